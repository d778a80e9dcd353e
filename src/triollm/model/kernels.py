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

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from triollm.model import attention
from triollm.model.attention import AttentionPlan, paged_attention, plan_attention
from triollm.model.kvstore import DEFAULT_KV_DTYPE, STORAGE, V_PANEL, KVDtype
from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)


@njit(cache=True, nogil=True, fastmath=True)
def _rms_norm_row(
    x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray, i: int
) -> None:
    # Row i of rms_norm. A fused add_rms_norm calling this row norm was tried and
    # taken out: LLVM inlines the row into each caller and, with fastmath, orders
    # the sum per copy, and one of its rows came out with different last bits on
    # two calls with the same inputs.
    d = x.shape[1]
    ss = np.float32(0.0)
    for j in range(d):
        ss += x[i, j] * x[i, j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for j in range(d):
        # HF rounds the normalised row before scaling by the weight; in float32
        # both orders agree to the last bit or two, well inside tolerance.
        out[i, j] = weight[j] * (x[i, j] * inv)


@njit(cache=True, nogil=True, fastmath=True)
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """``out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight`` for each row i.

    x, out: (n, d) float32 (may be the same array); weight: (d,) float32.
    """
    for i in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, np.int64(i))  # type: ignore[arg-type]  # numba: int64


@njit(inline="always")
def _rotate(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    # "Rotate half" in place: dimension j pairs with j + rotary_dim / 2 (see rope).
    n, n_heads, _ = x.shape
    half = cos.shape[1]  # rotary_dim // 2; head_dim // 2 unless partial rotary
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


@njit(cache=True, nogil=True, fastmath=True)
def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate ``x`` in place by each row's position, the Hugging Face way.

    x: (n, n_heads, head_dim) float32; positions: (n,) int64;
    cos, sin: (max_positions, rotary_dim // 2) float32 tables.
    "Rotate half": dimension j pairs with j + rotary_dim/2 (not with j+1 as in the
    original RoPE paper's interleaved layout; HF checkpoints have their q/k
    weights permuted for this convention, so the other one gives garbage).
    rotary_dim is head_dim except for partial rotary (Phi-4-mini: 3/4 of it): the
    tables' width says how many pairs turn; dimensions past rotary_dim pass through.
    """
    _rotate(x, positions, cos, sin)


@njit(cache=True, nogil=True, fastmath=True)
def rope_qk(
    q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray
) -> None:
    """:func:`rope` on the queries and the keys of a layer in one call (the forward's).

    q: (n, n_heads, head_dim), k: (n, n_kv_heads, head_dim) float32, in place.
    One kernel call per layer instead of two: on a 135M model a call's fixed
    cost is a visible part of a batch-1 step (docs/engine.md, "Kernels").
    """
    _rotate(q, positions, cos, sin)
    _rotate(k, positions, cos, sin)


@njit(cache=True, nogil=True, fastmath=True)
def _silu_row(gate_up: np.ndarray, out: np.ndarray, i: int) -> None:
    # Row i of silu_mul. Both drivers call this one compiled function (not an
    # inlined copy each), so a row's bits cannot depend on which driver ran it.
    f = out.shape[1]
    for j in range(f):
        g = gate_up[i, j]
        out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[i, f + j]


@njit(cache=True, nogil=True, parallel=True)
def _silu_rows(gate_up: np.ndarray, out: np.ndarray) -> None:
    for i in prange(out.shape[0]):
        _silu_row(gate_up, out, np.int64(i))  # type: ignore[arg-type]  # one signature for both


@njit(cache=True, nogil=True)
def _silu_rows_serial(gate_up: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        _silu_row(gate_up, out, np.int64(i))  # type: ignore[arg-type]  # numba: an int64


def silu_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU's middle: ``out = gate * sigmoid(gate) * up``.

    gate_up: (n, 2 f) float32, C-contiguous, the fused gate/up product's
    output, gate in its first f columns and up in the rest; out: (n, f).
    Rows run in parallel; each element is computed alone, so the split cannot
    change a result. One row (a batch-1 decode step) runs on the calling
    thread: a parallel region cannot split a single row, and opening one wakes
    the other (passive) worker for nothing, once per layer.

    Hazard: the kernel takes the whole fused array, not two column ranges of
    it. A column range is C-contiguous when it has one row and strided when it
    has more, numba compiles one machine-code version per layout, and the two
    vectorised ``exp`` differently: a row's bits changed with the batch size
    (``test_silu_mul_gives_a_row_the_same_bits_alone_and_in_a_batch``).
    """
    if out.shape[0] > 1:
        _silu_rows(gate_up, out)
    else:
        _silu_rows_serial(gate_up, out)


def _put_v(v_cache, b, h, o, j, x):  # type: ignore[no-untyped-def]  # numba: overload
    """Store value ``j`` of position ``o`` of block ``b``, head ``h`` into ``v_cache``."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_put_v, inline="always")
def _put_v_impl(v_cache, b, h, o, j, x):  # type: ignore[no-untyped-def]
    if v_cache.ndim == 5:  # V's values: (num_blocks, n_kv, head_dim / 32, block_size, 32)

        def panels(v_cache, b, h, o, j, x):  # type: ignore[no-untyped-def]
            v_cache[b, h, j // V_PANEL, o, j % V_PANEL] = x

        return panels
    if v_cache.ndim == 4:  # q8_0's V scales: (num_blocks, n_kv, head_dim / 32, block_size)

        def transposed(v_cache, b, h, o, j, x):  # type: ignore[no-untyped-def]
            v_cache[b, h, j, o] = x

        return transposed
    return None


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

    k, v: (n, n_kv_heads, width), already in the pool's storage dtype
    (``PagedKVCache.encode``); k_cache: (num_blocks, n_kv_heads, width,
    block_size), K transposed within a block (attention loads a tile's keys as
    contiguous runs of positions); v_cache: (num_blocks, n_kv_heads, width /
    32, block_size, 32), V in panels of 32 columns (the V product reads them in
    place; ``kvstore.py``). The same kernel stores q8_0's scales (width
    head_dim / 32), both transposed as K is: a 4-D v_cache is that. row_block,
    row_offset: (n,) int64, already resolved through the block table.
    Trap: no bounds checks here; the caller validates block ids first.
    """
    n, n_kv, width = k.shape
    for i in range(n):
        b = row_block[i]
        o = row_offset[i]
        for h in range(n_kv):
            for j in range(width):
                k_cache[b, h, j, o] = k[i, h, j]
                _put_v(v_cache, b, h, o, j, v[i, h, j])


_F16_MAX = np.float32(65504.0)  # the largest finite half


@intrinsic
def _half_bits(typingctx: Any, x: Any) -> Any:
    """float32 -> IEEE half bits (int16), rounded to nearest even: LLVM's
    ``fptrunc`` (vcvtps2ph), the rounding numpy's ``astype(np.float16)`` does."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(x), codegen


@intrinsic
def _f32_bits(typingctx: Any, x: Any) -> Any:
    """The bits of a float32, as a uint32."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


def _encode(x, cache):  # type: ignore[no-untyped-def]  # numba: the overload is the body
    """One float32 value in ``cache``'s storage type, rounded as ``PagedKVCache.encode``."""
    raise NotImplementedError


@overload(_encode)  # not inline="always": that tripped a numba IR-scope warning
def _encode_impl(x, cache):  # type: ignore[no-untyped-def]
    dt = cache.dtype
    if dt == types.float32:
        return lambda x, cache: x
    if dt == types.int16:  # f16, saturated at +-65504 (an inf key would make NaN scores)

        def f16(x, cache):  # type: ignore[no-untyped-def]
            # two compares, not min/max: a NaN fails both and stays NaN, as in np.clip
            y = _F16_MAX if x > _F16_MAX else (-_F16_MAX if x < -_F16_MAX else x)
            return _half_bits(y)

        return f16
    if dt == types.uint16:  # bf16: the top half, rounded to nearest even

        def bf16(x, cache):  # type: ignore[no-untyped-def]
            u = np.uint64(_f32_bits(x))
            r = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(
                0xFFFFFFFF
            )  # uint32 arithmetic, wrapping as numpy's does
            return np.uint16(r >> np.uint64(16))

        return bf16
    return None


@njit(cache=True, nogil=True)
def store_kv(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    row_block: np.ndarray,
    row_offset: np.ndarray,
) -> None:
    """:func:`write_kv` from float32 K and V, each value rounded to the pool's type
    on its way in (``PagedKVCache.encode``'s rounding, to the bit).

    k, v: (n, n_kv_heads, head_dim) float32; the pools and rows as write_kv's,
    of type float32, int16 (f16 bits) or uint16 (bf16 bits). One call per layer
    instead of two numpy encodes (each a few passes and temporaries) and a
    write. Trap: q8_0 (a scale per 32 values) is not handled here; its pool
    goes through ``encode`` and :func:`write_kv`. No bounds checks.
    """
    n, n_kv, width = k.shape
    for i in range(n):
        b = row_block[i]
        o = row_offset[i]
        for h in range(n_kv):
            for j in range(width):
                k_cache[b, h, j, o] = _encode(k[i, h, j], k_cache)
                v_cache[b, h, j // V_PANEL, o, j % V_PANEL] = _encode(v[i, h, j], v_cache)


@njit(cache=True, nogil=True, fastmath=True)
def qkv_rope_store(
    qkv: np.ndarray,
    bias: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    row_block: np.ndarray,
    row_offset: np.ndarray,
) -> None:
    """A layer's attention inputs from its fused q/k/v product, in one call: split
    ``qkv`` into ``q``, ``k``, ``v`` (+ ``bias``), RoPE on q and k, then K and V
    rounded into the pool (:func:`store_kv`).

    qkv: (n, (n_heads + 2 n_kv) * head_dim) float32, the product's output; bias:
    its (n_heads + 2 n_kv) * head_dim biases (qwen2), or empty; q: (n, n_heads,
    head_dim), k, v: (n, n_kv, head_dim) float32, written; the pools and rows as
    :func:`store_kv`'s (f32, f16 or bf16; not q8_0). The forward's one call per
    layer for what were seven (three copies, three bias adds, rope_qk, store_kv
    counted as one): on a small model each call's fixed cost shows in a batch-1
    step (docs/engine.md, "The step's fixed costs"). Trap: no bounds checks.
    """
    n, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
    biased = bias.shape[0] > 0
    for i in range(n):
        for h in range(n_heads):
            for j in range(head_dim):
                c = h * head_dim + j
                q[i, h, j] = qkv[i, c] + bias[c] if biased else qkv[i, c]
        for h in range(n_kv):
            for j in range(head_dim):
                c = q_dim + h * head_dim + j
                k[i, h, j] = qkv[i, c] + bias[c] if biased else qkv[i, c]
                c += kv_dim
                v[i, h, j] = qkv[i, c] + bias[c] if biased else qkv[i, c]
    _rotate(q, positions, cos, sin)
    _rotate(k, positions, cos, sin)
    store_kv(k, v, k_cache, v_cache, row_block, row_offset)


def warm_up(kv_dtype: KVDtype = DEFAULT_KV_DTYPE) -> float:
    """Compile (or load from the on-disk cache) every kernel; return seconds taken.

    Called at model load so the first request does not pay the compile. The
    argument types match the forward pass's exactly (float32 ``eps``/``scale``,
    int64 indices): numba compiles one version per signature, and a mismatch
    here would leave the real one to compile during the first request.
    Attention and the KV write compile for ``kv_dtype`` only (the default
    cache's): each cache type is a compile of its own (~25 s cold for the
    attention), and a pool of another type compiles on its first step, which a
    server's warm-up request takes before it reports ready.
    """
    import time

    t0 = time.perf_counter()
    x = np.ones((2, 2, 4), dtype=np.float32)
    pos = np.zeros(2, dtype=np.int64)
    tab = np.ones((4, 2), dtype=np.float32)
    rope(x, pos, tab, tab)
    rope_qk(x, x.copy(), pos, tab, tab)
    x2 = x.reshape(2, 8)
    rms_norm(x2, np.ones(8, dtype=np.float32), np.float32(1e-6), x2)
    silu_mul(np.ones((2, 16), dtype=np.float32), x2)  # two rows: the parallel driver
    silu_mul(np.ones((1, 16), dtype=np.float32), x2[:1])  # one: the serial one
    storage = STORAGE[kv_dtype]
    cache: np.ndarray = np.zeros((1, 2, 4, 4), dtype=storage)  # K: (blocks, n_kv, hd, bs)
    v_cache: np.ndarray = np.zeros((1, 2, 1, 4, V_PANEL), dtype=storage)  # V's panels
    if kv_dtype is not KVDtype.Q8_0:
        store_kv(x, x, cache, v_cache, pos, pos)
        qkv = np.ones((2, 24), dtype=np.float32)  # 2 heads + 2 x 2 KV heads of 4
        for bias in (np.zeros(0, np.float32), np.ones(24, np.float32)):
            qkv_rope_store(
                qkv, bias, pos, tab, tab, x.copy(), x.copy(), x.copy(), cache, v_cache, pos, pos
            )
    else:  # encode + write_kv, and its per-32 scales (int16 f16 bits)
        write_kv(x.astype(storage), x.astype(storage), cache, v_cache, pos, pos)
        rows = np.zeros((2, 2, 1), dtype=np.int16)  # (n, n_kv, head_dim // 32)
        scales = np.zeros((1, 2, 1, 4), dtype=np.int16)
        write_kv(rows, rows, scales, scales, pos, pos)
    attention.warm_up(storage)
    return time.perf_counter() - t0


__all__ = [
    "AttentionPlan",
    "paged_attention",
    "plan_attention",
    "qkv_rope_store",
    "rms_norm",
    "rope",
    "rope_qk",
    "silu_mul",
    "store_kv",
    "warm_up",
    "write_kv",
]
