"""The forward pass's hot loops that are not weight products, as numba kernels.

Each kernel is a plain loop nest over float32 arrays, compiled once
(``cache=True`` keeps the machine code in ``__pycache__`` so the next process
loads it instead of recompiling) and run without the GIL (``nogil=True``).

Why ``nogil`` is not optional: the server runs ``Batch.run`` in a worker thread
(``trio.to_thread.run_sync``). A kernel that holds the GIL for the length of an
attention pass freezes the event loop for that long: no token is streamed, no
request accepted, no cancellation noticed. numpy's BLAS releases the GIL on its
own; these kernels must too.

The kernels write into ``out`` arrays the caller preallocated; they never return
new arrays, so the forward pass does not allocate per layer. Every array is
float32 (the caller's job; see ``llama.py``). ``fastmath`` is on where
reassociating a float32 sum is harmless; none of these loops compares against
infinities or NaN (attention starts its max from a real score, never ``-inf``).

Read with ``llama.py`` (the caller) and ``tests/model/test_kernels.py`` (each
kernel against a plain-numpy reference on random shapes).
"""

from __future__ import annotations

import os

# Hazard: two kernels here are parallel, and numba's OpenMP workers must wait
# passively between parallel regions on a shared machine, or every region pays
# for it (matmul.py explains; it sets the same default). It must be set before
# the OpenMP runtime starts, so here too: a program that imports this module
# without matmul measured 8.0 ms per parallel call instead of 0.4.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _f32_from_bits(typingctx: Any, bits: Any) -> Any:
    """The low 32 bits of an integer, reinterpreted as a float32 (vectorises: a no-op)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _fma32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` in one rounding (``llvm.fma``): exact whatever fastmath allows."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
        return builder.call(fn, list(args))

    return types.float32(a, b, c), codegen


@njit(inline="always", fastmath=True)
def fast_exp(x: Any) -> Any:  # pragma: no cover - numba
    """``exp(x)`` for float32 ``x``, in a form the compiler vectorises.

    numba has no vector ``exp`` without Intel's SVML (not installed here), so
    ``np.exp`` in a loop is one libm call per value: it was most of softmax's
    and SwiGLU's time. This is the textbook reduction: ``x = n ln2 + r`` with
    ``|r| <= ln2 / 2``, ``e^r`` by its Taylor polynomial to degree 6
    (truncation error ``r^7 / 7! < 1.3e-7``), times ``2^n`` built in the
    exponent bits. Relative error ~2e-7 (a few float32 ulps) over the clamped
    range [-87, 88]; below -87 it returns ~1.6e-38 instead of a subnormal or 0,
    which no softmax or sigmoid here can tell apart. Deterministic: the same
    input gives the same bits wherever it is called (batch invariance).
    """
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    # r = x - n ln2 in two fused steps (Cody-Waite): ln2 as a float32 plus the
    # remainder, so r stays accurate at |n| ~ 126; a plain x - n * ln2 rounds
    # n * ln2 to ulp(87) and costs 4e-6 of relative error there.
    r = _fma32(-n, np.float32(0.693147182464599609375), x)
    r = _fma32(-n, np.float32(-1.904654323148236e-09), r)
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)


@njit(cache=True, nogil=True, fastmath=True)
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """``out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight`` for each row i.

    x, out: (n, d) float32 (may be the same array); weight: (d,) float32.
    """
    n, d = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
        for j in range(d):
            # HF rounds the normalised row before scaling by the weight; in float32
            # both orders agree to the last bit or two, well inside tolerance.
            out[i, j] = weight[j] * (x[i, j] * inv)


@njit(cache=True, nogil=True, fastmath=True)
def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate ``x`` in place by each row's position, the Hugging Face way.

    x: (n, n_heads, head_dim) float32; positions: (n,) int64;
    cos, sin: (max_positions, head_dim // 2) float32 tables.
    "Rotate half": dimension j pairs with j + head_dim/2 (not with j+1 as in the
    original RoPE paper's interleaved layout; HF checkpoints have their q/k
    weights permuted for this convention, so the other one gives garbage).
    """
    n, n_heads, head_dim = x.shape
    half = head_dim // 2
    for i in range(n):
        p = positions[i]
        for h in range(n_heads):
            for j in range(half):
                c = cos[p, j]
                s = sin[p, j]
                x1 = x[i, h, j]
                x2 = x[i, h, j + half]
                x[i, h, j] = x1 * c - x2 * s
                x[i, h, j + half] = x2 * c + x1 * s


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU's middle: ``out = gate * sigmoid(gate) * up``. All (n, f) float32.

    ``gate`` and ``up`` may be column ranges of one array (the fused gate/up
    product's output): numba compiles a strided version for them, which
    ``warm_up`` compiles too. Rows run in parallel; each element is computed
    alone, so the split cannot change a result.
    """
    n, f = gate.shape
    for i in prange(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + fast_exp(-g)) * up[i, j]


@njit(cache=True, nogil=True)
def write_kv(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    row_block: np.ndarray,
    row_offset: np.ndarray,
) -> None:
    """Store each row's K and V at its block and offset in one layer's pool.

    k, v: (n, n_kv_heads, head_dim) float32; k_cache, v_cache:
    (num_blocks, n_kv_heads, block_size, head_dim) float32; row_block,
    row_offset: (n,) int64, already resolved through the block table.
    Trap: no bounds checks here; the caller validates block ids first.
    """
    n, n_kv, head_dim = k.shape
    for i in range(n):
        b = row_block[i]
        o = row_offset[i]
        for h in range(n_kv):
            for j in range(head_dim):
                k_cache[b, h, o, j] = k[i, h, j]
                v_cache[b, h, o, j] = v[i, h, j]


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    row_chunk: np.ndarray,
    block_tables: np.ndarray,
    window: int,
    scale: np.float32,
    out: np.ndarray,
) -> None:
    """Causal attention of every row over its own sequence's cached positions.

    q: (n, n_heads, head_dim) float32, RoPE applied; k_cache, v_cache:
    (num_blocks, n_kv_heads, block_size, head_dim) float32, already holding
    this step's K/V; positions: (n,) int64; row_chunk: (n,) int64, the row's
    index into block_tables: (n_chunks, max_blocks) int64; window: 0, or
    attend only to the last ``window`` positions (mistral); out: (n, n_heads,
    head_dim) float32.

    Row i sees positions ``lo .. positions[i]`` of its sequence and nothing
    else: the block table is the only way in, so another sequence's blocks are
    unreachable, and positions past the row's own are never read (they may hold
    a reservation's stale data). Work is split over (row, KV head) pairs; the
    query heads of one GQA group share each K/V vector they load (the hot spot:
    the K and V reads). Softmax is two-pass over a per-pair score buffer.

    The pairs run in parallel (``prange``). Batch invariance holds because a
    pair's arithmetic never depends on which thread runs it or what else is in
    the batch: each (row, KV head) pair sums its own positions in the same
    order, into its own buffer; threads only decide *when* a pair runs.
    Hazard: this kernel was serial once because a ``prange`` version measured
    15x slower when numba's OpenMP workers spin-waited on the shared 2-core
    machine; ``matmul.py`` sets ``OMP_WAIT_POLICY=PASSIVE`` before the runtime
    starts, and docs/performance.md has the re-measurement.
    """
    n, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    q2 = q.reshape(n, n_heads * head_dim)
    out2 = out.reshape(n, n_heads * head_dim)
    for item in prange(n * n_kv):
        attend_pair(
            q2, 0, n_heads, k_cache, v_cache, item // n_kv, item % n_kv,
            positions, row_chunk, block_tables, window, scale, out2,
        )  # fmt: skip


@njit(nogil=True, fastmath=True)
def attend_pair(
    q2: np.ndarray,
    q_col: int,
    n_heads: int,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    i: int,
    kvh: int,
    positions: np.ndarray,
    row_chunk: np.ndarray,
    block_tables: np.ndarray,
    window: int,
    scale: np.float32,
    out2: np.ndarray,
) -> None:  # pragma: no cover - numba
    """Row ``i``'s attention for the query heads of KV head ``kvh``: one work item.

    q2: (n, >= q_col + n_heads * head_dim) float32, query head h of row i at
    columns ``q_col + h * head_dim``; out2: (n, n_heads * head_dim). The
    unit of work of :func:`paged_attention` and of the fused layer kernel
    (``layer.py``); its sums run in one fixed order whoever calls it.
    """
    head_dim = k_cache.shape[3]
    block_size = k_cache.shape[2]
    group = n_heads // k_cache.shape[1]
    p = positions[i]
    lo = 0
    if window > 0 and p - window + 1 > 0:
        lo = p - window + 1
    n_ctx = p + 1 - lo
    table = block_tables[row_chunk[i]]
    scores = np.empty((group, n_ctx), dtype=np.float32)
    # Positions lo..p, walked block by block: no division per position.
    first, last = lo // block_size, p // block_size
    # pass 1: scores = q . k * scale
    t = 0
    for bi in range(first, last + 1):
        b = table[bi]
        o0 = max(lo - bi * block_size, 0)
        o1 = min(p - bi * block_size + 1, block_size)
        for o in range(o0, o1):
            for g in range(group):
                c = q_col + (kvh * group + g) * head_dim
                s = np.float32(0.0)
                for j in range(head_dim):
                    s += q2[i, c + j] * k_cache[b, kvh, o, j]
                scores[g, t] = s * np.float32(scale)
            t += 1
    # softmax of each head's scores, in place
    for g in range(group):
        m = scores[g, 0]
        for t in range(1, n_ctx):
            m = max(m, scores[g, t])
        total = np.float32(0.0)
        for t in range(n_ctx):
            e = fast_exp(scores[g, t] - m)
            scores[g, t] = e
            total += e
        inv = np.float32(1.0) / total
        for t in range(n_ctx):
            scores[g, t] *= inv
        c = (kvh * group + g) * head_dim
        for j in range(head_dim):
            out2[i, c + j] = np.float32(0.0)
    # pass 2: out = sum_t p_t * v_t
    t = 0
    for bi in range(first, last + 1):
        b = table[bi]
        o0 = max(lo - bi * block_size, 0)
        o1 = min(p - bi * block_size + 1, block_size)
        for o in range(o0, o1):
            for g in range(group):
                c = (kvh * group + g) * head_dim
                w = scores[g, t]
                for j in range(head_dim):
                    out2[i, c + j] += w * v_cache[b, kvh, o, j]
            t += 1


def warm_up() -> float:
    """Compile (or load from the on-disk cache) every kernel; return seconds taken.

    Called at model load so the first request does not pay the compile. The
    argument types match the forward pass's exactly (float32 ``eps``/``scale``,
    int64 indices): numba compiles one version per signature, and a mismatch
    here would leave the real one to compile during the first request.
    """
    import time

    t0 = time.perf_counter()
    x = np.ones((2, 2, 4), dtype=np.float32)
    pos = np.zeros(2, dtype=np.int64)
    tab = np.ones((4, 2), dtype=np.float32)
    rope(x, pos, tab, tab)
    x2 = x.reshape(2, 8)
    rms_norm(x2, np.ones(8, dtype=np.float32), np.float32(1e-6), x2)
    silu_mul(x2, x2, x2)
    fused = np.ones((2, 16), dtype=np.float32)  # the forward's call: column ranges of gate_up
    silu_mul(fused[:, :8], fused[:, 8:], x2)
    cache = np.zeros((1, 2, 4, 4), dtype=np.float32)
    write_kv(x, x, cache, cache, pos, pos)
    tables = np.zeros((1, 1), dtype=np.int64)
    paged_attention(x, cache, cache, pos, pos, tables, 0, np.float32(0.5), np.empty_like(x))
    return time.perf_counter() - t0


__all__ = [
    "paged_attention",
    "rms_norm",
    "rope",
    "silu_mul",
    "warm_up",
    "write_kv",
]
