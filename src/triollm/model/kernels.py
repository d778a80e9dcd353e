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

import numpy as np
from numba import njit, prange

from triollm.model.attention import paged_attention
from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)


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
    cos, sin: (max_positions, rotary_dim // 2) float32 tables.
    "Rotate half": dimension j pairs with j + rotary_dim/2 (not with j+1 as in the
    original RoPE paper's interleaved layout; HF checkpoints have their q/k
    weights permuted for this convention, so the other one gives garbage).
    rotary_dim is head_dim except for partial rotary (Phi-4-mini: 3/4 of it): the
    tables' width says how many pairs turn; dimensions past rotary_dim pass through.
    """
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


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def silu_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU's middle: ``out = gate * sigmoid(gate) * up``.

    gate_up: (n, 2 f) float32, C-contiguous, the fused gate/up product's
    output, gate in its first f columns and up in the rest; out: (n, f).
    Rows run in parallel; each element is computed alone, so the split cannot
    change a result.

    Hazard: the kernel takes the whole fused array, not two column ranges of
    it. A column range is C-contiguous when it has one row and strided when it
    has more, numba compiles one machine-code version per layout, and the two
    vectorised ``exp`` differently: a row's bits changed with the batch size
    (``test_silu_mul_gives_a_row_the_same_bits_alone_and_in_a_batch``).
    """
    n, f = out.shape
    for i in prange(n):
        for j in range(f):
            g = gate_up[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[i, f + j]


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
    (``PagedKVCache.encode``); k_cache, v_cache: (num_blocks, n_kv_heads,
    block_size, width) of that dtype. The same kernel stores q8_0's scales
    (width head_dim // 32). row_block, row_offset: (n,) int64, already
    resolved through the block table.
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
    silu_mul(np.ones((2, 16), dtype=np.float32), x2)
    tables = np.zeros((1, 1), dtype=np.int64)
    for storage in (np.float32, np.int16, np.uint16, np.int8):  # the KV cache's types
        cache = np.zeros((1, 2, 4, 4), dtype=storage)
        write_kv(x.astype(storage), x.astype(storage), cache, cache, pos, pos)
        scales = np.zeros((1, 2, 4, 1), dtype=np.int16)
        paged_attention(
            x, cache, cache, pos, pos, tables, 0, np.float32(0.5), np.empty_like(x), scales, scales
        )
    write_kv(
        pos.astype(np.int16).reshape(2, 1, 1),
        pos.astype(np.int16).reshape(2, 1, 1),
        scales,
        scales,
        pos,
        pos,
    )
    return time.perf_counter() - t0


__all__ = [
    "paged_attention",
    "rms_norm",
    "rope",
    "silu_mul",
    "warm_up",
    "write_kv",
]
