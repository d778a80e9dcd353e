"""One decoder layer in one parallel region: the forward pass's fast path.

A decode step of a small model is ~120 weight products and ~60 small parallel
kernels, each its own OpenMP parallel region. With the workers waiting
passively (the protection a shared machine needs, ``matmul.py``), every region
pays for waking a sleeping worker and for the main thread sleeping at the end
until the worker is done: 55-130 us per region measured here, 10-20 ms of a
20-40 ms batch-1 step. :func:`decoder_layer` runs a whole layer (norms, the
four weight products, RoPE, the K/V write, attention, SwiGLU, both residual
adds) in ONE region: 31 regions per step instead of ~181.

Theory of operation
-------------------
The layer is a fixed sequence of *stages*; each stage is a list of
independent *items* (a row to normalise, a block of weight rows to multiply,
a (row, KV head) pair to attend)::

    0 norm1 rows -> xn          4 o_proj blocks, x += att . Wo (+ bias)
    1 qkv blocks -> qkv (+ b)   5 norm2 rows -> xn
    2 rows: qk-norm, RoPE, K/V  6 gate/up blocks -> h = silu(g) * u
    3 (row, KV head) attention  7 down blocks, x += h . Wd

Every thread of the region runs the same loop: claim the stage's next item
with an atomic counter, compute it, count it done; when no item is left, wait
until every item of the stage is done, then go on to the next stage. There is
no fixed split between threads, so:

- the main thread starts working at once; a worker that wakes late (or is
  descheduled by another process on a shared machine) just takes fewer items,
  and the region never waits for a thread that has not started;
- a thread that runs alone (one core free, or ``numba`` set to one thread)
  claims every item itself: nothing can deadlock on a participant that never
  comes;
- waiting is a short spin (``pause``), then a futex sleep that the stage's
  last item ends: a waiting thread gives its core to whoever wants it, which
  is what passive OpenMP waiting bought, and a stage whose items all finish
  within the spin costs no system call at all.

Batch invariance holds for the same reason it holds in the separate kernels:
an item's arithmetic never depends on which thread runs it, on when it runs,
or on the other rows (the block products and the attention pairs are the very
functions ``matmul.py`` and ``kernels.py`` run, ``product_block`` and
``attend_pair``).

Who uses it: ``LlamaModel`` runs :func:`decoder_layer` when asked (opt-in
until a known defect is mended: ``llama.FUSED_BY_DEFAULT`` says which) and
every weight of the layer is a :class:`~triollm.model.matmul.PreparedWeight` of a format
``product_block`` knows (float32, bfloat16, float16), and the per-product path
(``matmul.linear`` plus the kernels of ``kernels.py``) otherwise; both compute
the same sums in the same order. ``matmul.py``'s docstring says how another
weight format joins either path.

Hazards
-------
- numba caches this module's machine code keyed by THIS file only, but it
  contains code from ``matmul.py`` and ``kernels.py``. :func:`_drop_stale_cache`
  deletes this module's cache entries on import when either file is newer, so
  editing a block product is never silently ignored.
- The atomics are LLVM ``atomicrmw``/``load atomic`` on int64 counters; a
  counter array is zeroed by the caller for every call (``COUNTERS`` each).
- Waiting is a short spin, then a futex sleep on the stage's done counter
  that the stage's last item wakes (Linux; elsewhere ``sched_yield``). Not
  ``sched_yield`` on Linux: on a loaded machine a yielding thread goes to the
  back of the run queue behind every other process's slice, and a first
  version that yielded ran a batch-1 step 3x slower (wall) than one region per
  product at the same CPU time; a woken sleeper is scheduled promptly.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see matmul.py: before OpenMP starts


def _drop_stale_cache(module: Path, deps: tuple[str, ...]) -> bool:
    """Delete ``module``'s numba cache entries if one of ``deps`` (siblings) is newer.

    Returns whether it deleted anything. numba stamps a cache entry with the
    defining file only; this module compiles in code from ``deps``.
    """
    cache = module.parent / "__pycache__"
    try:
        entries = list(cache.glob(f"{module.stem}.*.nbi"))
        if not entries:
            return False
        newest_dep = max((module.parent / dep).stat().st_mtime for dep in deps)
        if min(e.stat().st_mtime for e in entries) >= newest_dep:
            return False
        for f in [*entries, *cache.glob(f"{module.stem}.*.nbc")]:
            f.unlink(missing_ok=True)
    except OSError:  # a read-only tree: numba keeps its cache elsewhere, stamped by install
        return False
    return True


_drop_stale_cache(Path(__file__).resolve(), ("matmul.py", "kernels.py"))

import numpy as np  # noqa: E402  (after the cache check and the OpenMP policy)
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from triollm.model.kernels import attend_pair, fast_exp  # noqa: E402
from triollm.model.matmul import product_block  # noqa: E402

# Spins (x86 `pause`, ~30-60 cycles each) before a waiting thread goes to
# sleep: about 10 us, the length of a short item.
_SPINS = 200
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
# futex(2)'s syscall number; elsewhere a waiting thread yields instead
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine().lower(), -1)
_HAVE_FUTEX = sys.platform == "linux" and _SYS_FUTEX > 0

# Stage s has three counters: items claimed at 3 s, items done at 3 s + 1,
# threads asleep waiting for the stage at 3 s + 2.
N_STAGES = 8
COUNTERS = 3 * N_STAGES


# --- synchronisation primitives ----------------------------------------------


@intrinsic
def _atomic_add(typingctx: Any, arr: Any, idx: Any, delta: Any) -> Any:
    """``arr[idx] += delta`` atomically (sequentially consistent); returns the old value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        return builder.atomic_rmw("add", ptr, builder.sext(args[2], ir.IntType(64)), "seq_cst")

    return types.int64(arr, types.intp, types.int32), codegen


@intrinsic
def _atomic_load(typingctx: Any, arr: Any, idx: Any) -> Any:
    """``arr[idx]``, read atomically with acquire order (never hoisted out of a loop)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, types.intp), codegen


@intrinsic
def _cpu_relax(typingctx: Any) -> Any:
    """The spin-loop hint (x86 ``pause``); nothing elsewhere."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            pause = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _futex(typingctx: Any, arr: Any, idx: Any, op: Any, val: Any) -> Any:
    """Linux ``futex(&arr[idx], op, val)`` on the counter's low 32 bits (little-endian).

    ``op`` 128 (FUTEX_WAIT_PRIVATE): sleep while the word still equals ``val``,
    at most 1 ms (so a lost wake-up costs a millisecond, never a hang);
    ``op`` 129 (FUTEX_WAKE_PRIVATE): wake up to ``val`` sleepers.
    """
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, i64 = ir.IntType(32), ir.IntType(64)
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        timespec = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))
        builder.store(ir.Constant(ir.ArrayType(i64, 2), [0, 1_000_000]), timespec)
        fnty = ir.FunctionType(i64, [i64], var_arg=True)
        syscall = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
        builder.call(
            syscall,
            [
                ir.Constant(i64, _SYS_FUTEX),
                builder.bitcast(ptr, i32.as_pointer()),
                builder.trunc(args[2], i32),
                builder.trunc(args[3], i32),
                builder.bitcast(timespec, i64.as_pointer()),
                ir.Constant(i64, 0),
                ir.Constant(i32, 0),
            ],
        )
        return context.get_dummy_value()

    return types.none(arr, types.intp, types.int64, types.int64), codegen


@intrinsic
def _yield_core(typingctx: Any) -> Any:
    """POSIX ``sched_yield()``: the wait of last resort where there is no futex."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.IntType(32), [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_yield"), [])
        return context.get_dummy_value()

    return types.none(), codegen


@njit(inline="always")
def _claim(ctr: Any, stage: int) -> int:  # pragma: no cover - numba
    return _atomic_add(ctr, 3 * stage, 1)


@njit(inline="always")
def _done(ctr: Any, stage: int, n_items: int) -> None:  # pragma: no cover - numba
    # the stage's last item wakes whoever sleeps on it (seq_cst: either this
    # load sees a sleeper's registration, or the sleeper's re-check sees n_items)
    last = _atomic_add(ctr, 3 * stage + 1, 1) == n_items - 1
    if last and _HAVE_FUTEX and _atomic_load(ctr, 3 * stage + 2) > 0:
        _futex(ctr, 3 * stage + 1, 129, 1 << 30)


@njit(inline="always")
def _wait_all(ctr: Any, stage: int, n_items: int) -> None:  # pragma: no cover - numba
    # every item of the stage is done (its writes visible: acquire); spin a
    # little, then sleep on the futex until the last item's _done wakes us
    spins = 0
    while True:
        seen = _atomic_load(ctr, 3 * stage + 1)
        if seen >= n_items:
            return
        if spins < _SPINS:
            _cpu_relax()
            spins += 1
        elif _HAVE_FUTEX:
            _atomic_add(ctr, 3 * stage + 2, 1)  # register as a sleeper, then re-check
            seen = _atomic_load(ctr, 3 * stage + 1)
            if seen < n_items:
                _futex(ctr, 3 * stage + 1, 128, seen)
            _atomic_add(ctr, 3 * stage + 2, -1)
        else:
            _yield_core()


# --- per-row pieces ------------------------------------------------------------


@njit(inline="always", fastmath=True)
def _norm_row(src: Any, r: int, weight: Any, eps: Any, dst: Any) -> None:  # pragma: no cover
    # kernels.rms_norm for one row
    d = src.shape[1]
    ss = np.float32(0.0)
    for j in range(d):
        ss += src[r, j] * src[r, j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for j in range(d):
        dst[r, j] = weight[j] * (src[r, j] * inv)


@njit(inline="always", fastmath=True)
def _norm_head(a: Any, r: int, c: int, hd: int, weight: Any, eps: Any) -> None:  # pragma: no cover
    # qwen3's RMSNorm over one head's vector a[r, c:c+hd], in place
    ss = np.float32(0.0)
    for j in range(hd):
        ss += a[r, c + j] * a[r, c + j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(hd) + np.float32(eps))
    for j in range(hd):
        a[r, c + j] = weight[j] * (a[r, c + j] * inv)


@njit(inline="always", fastmath=True)
def _rope_head(
    a: Any, r: int, c: int, half: int, cos: Any, sin: Any, p: int
) -> None:  # pragma: no cover - numba
    # kernels.rope for one head's vector a[r, c:c+2*half], rotate-half layout
    for j in range(half):
        cj = cos[p, j]
        sj = sin[p, j]
        x1 = a[r, c + j]
        x2 = a[r, c + j + half]
        a[r, c + j] = x1 * cj - x2 * sj
        a[r, c + j + half] = x2 * cj + x1 * sj


# --- the layer ---------------------------------------------------------------


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def decoder_layer(
    x: Any,
    xn: Any,
    qkv: Any,
    att: Any,
    gu: Any,
    h: Any,
    w_qkv: Any,
    b_qkv: Any,
    w_o: Any,
    b_o: Any,
    w_gu: Any,
    w_down: Any,
    ln1: Any,
    ln2: Any,
    q_norm: Any,
    k_norm: Any,
    eps: Any,
    k_cache: Any,
    v_cache: Any,
    positions: Any,
    row_chunk: Any,
    row_block: Any,
    row_offset: Any,
    tables: Any,
    window: int,
    cos: Any,
    sin: Any,
    scale: Any,
    n_heads: int,
    blocks: Any,
    ctr: Any,
    n_workers: int,
) -> None:  # pragma: no cover - numba
    """One decoder layer over ``n`` rows, in place on the residual stream ``x``.

    x, xn: (n, hidden); qkv: (n, (n_heads + 2 n_kv) * hd); att: (n, n_heads *
    hd); gu: (n, 2 f); h: (n, f), all float32 scratch. w_*: ``kernel_data`` of
    the prepared weights (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
    ``down_proj``); b_qkv, b_o: (N,) or empty; q_norm, k_norm: (hd,) or empty;
    k_cache, v_cache: this layer's pool; the row arrays as in
    ``kernels.paged_attention`` and ``kernels.write_kv``; blocks: (4,) int64
    weight rows per item for the four products; ctr: (COUNTERS,)
    int64 zeros. ``n_workers`` threads enter; any number may really run.
    """
    for t in prange(n_workers):
        _layer_worker(
            t, x, xn, qkv, att, gu, h, w_qkv, b_qkv, w_o, b_o, w_gu, w_down,
            ln1, ln2, q_norm, k_norm, eps, k_cache, v_cache, positions, row_chunk,
            row_block, row_offset, tables, window, cos, sin, scale, n_heads, blocks, ctr,
        )  # fmt: skip


@njit(nogil=True, fastmath=True)
def _layer_worker(
    t: int,
    x: Any,
    xn: Any,
    qkv: Any,
    att: Any,
    gu: Any,
    h: Any,
    w_qkv: Any,
    b_qkv: Any,
    w_o: Any,
    b_o: Any,
    w_gu: Any,
    w_down: Any,
    ln1: Any,
    ln2: Any,
    q_norm: Any,
    k_norm: Any,
    eps: Any,
    k_cache: Any,
    v_cache: Any,
    positions: Any,
    row_chunk: Any,
    row_block: Any,
    row_offset: Any,
    tables: Any,
    window: int,
    cos: Any,
    sin: Any,
    scale: Any,
    n_heads: int,
    blocks: Any,
    ctr: Any,
) -> None:  # pragma: no cover - numba
    n = x.shape[0]
    n_kv = k_cache.shape[1]
    hd = k_cache.shape[3]
    q_dim = n_heads * hd
    kv_dim = n_kv * hd
    f = h.shape[1]
    n_qkv = qkv.shape[1]
    hidden = x.shape[1]
    no_bias = np.zeros(0, np.float32)

    # 0: attention RMSNorm, a row per item
    while True:
        r = _claim(ctr, 0)
        if r >= n:
            break
        _norm_row(x, r, ln1, eps, xn)
        _done(ctr, 0, n)
    _wait_all(ctr, 0, n)

    # 1: the fused q/k/v product (+ qwen2 biases)
    bq = blocks[0]
    items = (n_qkv + bq - 1) // bq
    while True:
        it = _claim(ctr, 1)
        if it >= items:
            break
        product_block(xn, w_qkv, qkv, it * bq, min(it * bq + bq, n_qkv), b_qkv, False)
        _done(ctr, 1, items)
    _wait_all(ctr, 1, items)

    # 2: per row: qwen3's q/k head norms, RoPE, this step's K/V into the pool
    half = hd // 2
    while True:
        r = _claim(ctr, 2)
        if r >= n:
            break
        p = positions[r]
        for hh in range(n_heads):
            if q_norm.shape[0] > 0:
                _norm_head(qkv, r, hh * hd, hd, q_norm, eps)
            _rope_head(qkv, r, hh * hd, half, cos, sin, p)
        b = row_block[r]
        o = row_offset[r]
        for kh in range(n_kv):
            c = q_dim + kh * hd
            if k_norm.shape[0] > 0:
                _norm_head(qkv, r, c, hd, k_norm, eps)
            _rope_head(qkv, r, c, half, cos, sin, p)
            for j in range(hd):
                k_cache[b, kh, o, j] = qkv[r, c + j]
                v_cache[b, kh, o, j] = qkv[r, c + kv_dim + j]
        _done(ctr, 2, n)
    _wait_all(ctr, 2, n)

    # 3: attention, a (row, KV head) pair per item
    items = n * n_kv
    while True:
        it = _claim(ctr, 3)
        if it >= items:
            break
        attend_pair(
            qkv, 0, n_heads, k_cache, v_cache, it // n_kv, it % n_kv,
            positions, row_chunk, tables, window, scale, att,
        )  # fmt: skip
        _done(ctr, 3, items)
    _wait_all(ctr, 3, items)

    # 4: output projection, added into the residual stream
    bo = blocks[1]
    items = (hidden + bo - 1) // bo
    while True:
        it = _claim(ctr, 4)
        if it >= items:
            break
        product_block(att, w_o, x, it * bo, min(it * bo + bo, hidden), b_o, True)
        _done(ctr, 4, items)
    _wait_all(ctr, 4, items)

    # 5: MLP RMSNorm
    while True:
        r = _claim(ctr, 5)
        if r >= n:
            break
        _norm_row(x, r, ln2, eps, xn)
        _done(ctr, 5, n)
    _wait_all(ctr, 5, n)

    # 6: gate and up rows of one block, then h = silu(gate) * up for its columns
    bg = blocks[2]
    items = (f + bg - 1) // bg
    while True:
        it = _claim(ctr, 6)
        if it >= items:
            break
        j0 = it * bg
        j1 = min(j0 + bg, f)
        product_block(xn, w_gu, gu, j0, j1, no_bias, False)
        product_block(xn, w_gu, gu, f + j0, f + j1, no_bias, False)
        for r in range(n):
            for j in range(j0, j1):
                g = gu[r, j]
                h[r, j] = g / (np.float32(1.0) + fast_exp(-g)) * gu[r, f + j]
        _done(ctr, 6, items)
    _wait_all(ctr, 6, items)

    # 7: down projection, added into the residual stream
    bd = blocks[3]
    items = (hidden + bd - 1) // bd
    while True:
        it = _claim(ctr, 7)
        if it >= items:
            break
        product_block(h, w_down, x, it * bd, min(it * bd + bd, hidden), no_bias, True)
        _done(ctr, 7, items)
    # The caller returns only when every item is in: thread 0 (the caller's
    # thread) waits; the others leave, so the caller arrives last at OpenMP's
    # closing barrier and does not sleep there.
    if t == 0:
        _wait_all(ctr, 7, items)
