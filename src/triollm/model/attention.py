"""Paged causal attention, tiled: the flash-attention recurrence on a CPU.

The old kernel took one (row, KV head) pair at a time and computed one 64- or
128-long dot product per position and head, a horizontal sum each: ~10 GFLOP/s,
half of a SmolLM2 prefill (docs/performance.md). This one works on tiles:

- **a tile of K/V** is :data:`TILE` (32) consecutive positions of one KV head,
  aligned to multiples of 32 and gathered through the block table, widened
  once to float32 from the cache's storage (f32, f16, bf16 or q8_0,
  ``kvcache.py``) and shared by every query vector of the work item: the rows
  of a query block times the ``group`` query heads of the KV head (GQA);
- **a work item** is (query block, KV head, segment): up to :data:`Q_BLOCK`
  consecutive rows of one chunk against the positions of one segment of
  :data:`SEGMENT_POSITIONS`. A segment's partial result (max, sum, weighted
  sum of V) goes to a buffer; :func:`_merge` combines a row's segments. So a
  single decode row at depth 16384 is 16 segments x the KV heads, spread over
  both cores, while a prefill chunk is many query blocks;
- **scores** for a tile are one small product ``(vectors, head_dim) @
  (head_dim, 32)`` on the weight products' register tiles (``matmul.py``), keys
  along the vector lanes, no horizontal sum per score; so is the tile's
  weighted sum of V. **The softmax is online**: each tile raises the running
  max if it must, rescales what was summed so far by ``exp(old max - new
  max)``, and adds its own terms (docs/engine.md draws it step by step). Tiles
  wholly past a query block's last row are never visited (the causal half).

Batch invariance, the rule that a row's bits do not depend on what else is in
the step: a row's arithmetic is a function of its own position only. Tiles are
aligned to absolute positions, and so are segments; the exp and the sums run
over the row's own valid positions ``a..z`` of a tile (a loop's trip count
decides how LLVM splits it into vector body and remainder, so it must not
depend on other rows); its other weights are exactly 0; the product tiles give
an element the same chain of roundings whichever tile size computes it; the
segments merge in position order. Which rows share a query block, and which
thread runs an item, change only *when* a row's sums happen, never their
order. The same holds across chunkings of one prompt (the prefix cache), and
between a decode row and a prefill row at the same position: there is one
kernel. ``tests/model/test_kernels.py`` checks it.

Hazard: numba here has no SVML, so ``np.exp`` is a scalar libm call per
element that no loop vectorises, one per score; :func:`_exp` is a vectorisable
Cody-Waite + polynomial exp, exact at 0 (``_exp(0) == 1``, so a single segment
merges without changing a bit).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from triollm.model.matmul import PANEL as TILE
from triollm.model.matmul import _tile1, _tile2, _tile4, _tile8
from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)

# Rows per query block: 16 rows x a GQA group of query vectors share each K/V
# tile widened into L1 (a 32 x 128 float32 tile is 16 KiB).
Q_BLOCK = 16
# Positions per segment (rounded down to whole blocks): the unit a long decode
# context is split into across cores. 1024 gives a depth-4096 decode row 4 x
# n_kv items for 2 cores, and keeps a 2048-row prefill's partials (rows x heads
# x segments x (head_dim + 2) floats) at tens of MB.
SEGMENT_POSITIONS = 1024  # a multiple of TILE (32)

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two (Cody-Waite): n * hi is exact
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)  # exp(-87) ~ 1.6e-38 is still a normal float32


@intrinsic
def _f32_from_bits(typingctx: Any, bits: Any) -> Any:
    """Reinterpret the low 32 bits of an integer as a float32 (a truncation and a
    bitcast, which LLVM vectorises; numba widens ``int32 << int`` to int64)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        low = args[0]
        if bits.bitwidth != 32:  # type: ignore[attr-defined]  # numba's Integer has it
            low = builder.trunc(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always")
def _exp(x: Any) -> Any:  # pragma: no cover - numba
    # exp(x) for x <= 0 (softmax terms): x = n ln2 + r, |r| <= ln2 / 2,
    # exp(r) by a degree-6 polynomial (Cephes' expf coefficients), 2^n built in
    # the exponent bits. Max relative error ~2 ulp; exactly 1 at x = 0.
    x = max(x, _EXP_FLOOR)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = (np.int32(n) + np.int32(127)) << np.int32(23)
    return p * _f32_from_bits(e)  # type: ignore[call-arg]  # typingctx is numba's


# --- widening a cache element to float32, by the cache's storage dtype --------


def _value(cache, scales, b, h, t, j):  # type: ignore[no-untyped-def]  # numba: names only
    """``cache[b, h, t, j]`` as float32 (numba picks the storage below)."""
    raise NotImplementedError  # only called from numba; the overload is the body


_TWO_112 = np.float32(2.0**112)  # rebiases an f16 exponent (15) to float32's (127)


@overload(_value, inline="always")
def _value_impl(cache, scales, b, h, t, j):  # type: ignore[no-untyped-def]
    dt = cache.dtype
    if dt == types.float32:
        return lambda cache, scales, b, h, t, j: cache[b, h, t, j]
    if dt == types.int16:  # IEEE f16 bits (the matmul's convention for f16)
        # sign to bit 31, exponent+mantissa to bits 13..30, times 2^112: exact for
        # every finite f16, subnormals included. Hazard: an f16 inf/NaN comes
        # back as a large finite number; the write side (kvcache.py) saturates.
        def f16(cache, scales, b, h, t, j):  # type: ignore[no-untyped-def]
            u = np.int32(cache[b, h, t, j]) & np.int32(0xFFFF)
            bits = ((u & np.int32(0x8000)) << np.int32(16)) | ((u & np.int32(0x7FFF)) << 13)
            return _f32_from_bits(bits) * _TWO_112

        return f16
    if dt == types.uint16:  # bfloat16 bits: the top half of a float32
        return lambda cache, scales, b, h, t, j: _f32_from_bits(
            np.int32(cache[b, h, t, j]) << np.int32(16)
        )
    if dt == types.int8:  # q8_0: int8 values, one f16 scale per 32 along head_dim

        def q8(cache, scales, b, h, t, j):  # type: ignore[no-untyped-def]
            u = np.int32(scales[b, h, t, j // 32]) & np.int32(0xFFFF)
            bits = ((u & np.int32(0x8000)) << np.int32(16)) | ((u & np.int32(0x7FFF)) << 13)
            return np.float32(cache[b, h, t, j]) * (_f32_from_bits(bits) * _TWO_112)

        return q8
    return None


# --- planning: query blocks, segments, and where each partial goes ------------


@njit(cache=True, nogil=True)
def _plan(
    positions: Any, row_chunk: Any, window: int, seg_len: int, n_kv: int
) -> tuple[Any, Any, Any]:  # pragma: no cover - numba
    # items: (n_items, 4) int64 rows [r0, r1) of one query block, KV head, segment.
    # first_seg[r]: the row's first segment; base[r]: its first partial's index.
    n = positions.shape[0]
    first_seg = np.empty(n, np.int64)
    base = np.empty(n + 1, np.int64)
    base[0] = 0
    for r in range(n):
        p = positions[r]
        lo = max(0, p - window + 1) if window > 0 else 0
        first_seg[r] = lo // seg_len
        base[r + 1] = base[r] + p // seg_len - first_seg[r] + 1
    blocks = []
    r0 = 0
    while r0 < n:
        r1 = r0 + 1
        while (
            r1 < n
            and r1 - r0 < Q_BLOCK
            and row_chunk[r1] == row_chunk[r0]
            and positions[r1] == positions[r1 - 1] + 1
        ):
            r1 += 1
        blocks.append((r0, r1))
        r0 = r1
    count = 0
    for r0, r1 in blocks:
        count += n_kv * (positions[r1 - 1] // seg_len - first_seg[r0] + 1)
    items = np.empty((count, 4), np.int64)
    i = 0
    for r0, r1 in blocks:
        for kvh in range(n_kv):
            for seg in range(first_seg[r0], positions[r1 - 1] // seg_len + 1):
                items[i, 0] = r0
                items[i, 1] = r1
                items[i, 2] = kvh
                items[i, 3] = seg
                i += 1
    return items, first_seg, base


# --- one work item: a query block against one segment of one KV head ---------


@njit(inline="always")
def _rows_times_panel(x: Any, w: Any, out: Any, panel: int, k_in: int, ncols: int) -> None:
    # out[:, panel's columns] = x @ w[panel], 8 rows at a time, then 4, 2, 1: the
    # products' register tiles (matmul.py), which give every element the same
    # chain of roundings whichever tile computes it (so rows stay independent).
    n = x.shape[0]
    r = 0
    while r + 8 <= n:
        _tile8(x, w, out, r, panel, k_in, ncols)
        r += 8
    if r + 4 <= n:
        _tile4(x, w, out, r, panel, k_in, ncols)
        r += 4
    if r + 2 <= n:
        _tile2(x, w, out, r, panel, k_in, ncols)
        r += 2
    if r < n:
        _tile1(x, w, out, r, panel, k_in, ncols)


@njit(inline="always")
def _item(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k_scale: Any,
    v_scale: Any,
    positions: Any,
    table: Any,
    r0: int,
    r1: int,
    kvh: int,
    seg: int,
    seg_len: int,
    window: int,
    scale: Any,
    parts: Any,
    first_seg: Any,
    base: Any,
) -> None:  # pragma: no cover - numba
    n_heads, head_dim = q.shape[1], q.shape[2]
    bs = k_cache.shape[2]
    group = n_heads // k_cache.shape[1]
    nq = (r1 - r0) * group
    n_vp = (head_dim + TILE - 1) // TILE  # V panels of 32 columns
    # the item's query vectors, contiguous: row r's head kvh * group + g is qi
    qb = np.empty((nq, head_dim), np.float32)
    for r in range(r0, r1):
        for g in range(group):
            for j in range(head_dim):
                qb[(r - r0) * group + g, j] = q[r, kvh * group + g, j]
    kp = np.zeros((1, head_dim, TILE), np.float32)  # K tile as one panel: keys along lanes
    vp = np.zeros((n_vp, TILE, TILE), np.float32)  # V tile as panels of 32 columns
    sc = np.empty((nq, TILE), np.float32)  # scores, then the tile's softmax weights
    pv = np.empty((nq, head_dim), np.float32)  # the tile's weighted sum of V
    m = np.zeros(nq, np.float32)  # running max per query vector
    lsum = np.zeros(nq, np.float32)  # running sum of exp(score - m)
    acc = np.zeros((nq, head_dim), np.float32)  # running sum of exp(score - m) * v
    started = np.zeros(nq, np.bool_)
    seg_lo = seg * seg_len
    seg_hi = seg_lo + seg_len - 1
    p_last = positions[r1 - 1]
    lo_first = max(0, positions[r0] - window + 1) if window > 0 else 0
    t_begin = max(seg_lo, lo_first) // TILE * TILE
    t_end = min(seg_hi, p_last)
    for t0 in range(t_begin, t_end + 1, TILE):
        # load the tile once for every query vector of the item; positions past
        # the item's last row are zeros (never weighted: finite is what matters)
        for t in range(TILE):
            pos = t0 + t
            if pos <= p_last:
                b = table[pos // bs]
                o = pos % bs
                for j in range(head_dim):
                    kp[0, j, t] = _value(k_cache, k_scale, b, kvh, o, j)
                    vp[j // TILE, t, j % TILE] = _value(v_cache, v_scale, b, kvh, o, j)
            else:
                for j in range(head_dim):
                    kp[0, j, t] = np.float32(0.0)
                    vp[j // TILE, t, j % TILE] = np.float32(0.0)
        _rows_times_panel(qb, kp, sc, 0, head_dim, TILE)  # sc = q . k, all vectors
        for r in range(r0, r1):
            p = positions[r]
            lo = max(0, p - window + 1) if window > 0 else 0
            a = max(t0, lo) - t0  # the row's valid positions in this tile: a..z
            z = min(t0 + TILE - 1, p) - t0
            for g in range(group):
                qi = (r - r0) * group + g
                if a > z:  # causal (or window) part of the tile: weight 0
                    for t in range(TILE):
                        sc[qi, t] = np.float32(0.0)
                    continue
                # the online softmax: raise the max, rescale the past, add the tile
                mt = sc[qi, a] * scale
                for t in range(a + 1, z + 1):
                    mt = max(mt, sc[qi, t] * scale)
                m_new = max(m[qi], mt) if started[qi] else mt
                for t in range(a, z + 1):
                    sc[qi, t] = _exp(sc[qi, t] * scale - m_new)
                for t in range(0, a):
                    sc[qi, t] = np.float32(0.0)
                for t in range(z + 1, TILE):
                    sc[qi, t] = np.float32(0.0)
                if started[qi]:
                    alpha = _exp(m[qi] - m_new)
                    total = lsum[qi] * alpha
                else:
                    alpha = np.float32(0.0)
                    total = np.float32(0.0)
                for t in range(a, z + 1):
                    total += sc[qi, t]
                lsum[qi] = total
                m[qi] = m_new
                if started[qi]:
                    for j in range(head_dim):
                        acc[qi, j] *= alpha
                started[qi] = True
        for panel in range(n_vp):  # pv = weights @ V tile, all vectors
            _rows_times_panel(sc, vp, pv, panel, TILE, head_dim - panel * TILE)
        for r in range(r0, r1):
            p = positions[r]
            lo = max(0, p - window + 1) if window > 0 else 0
            if max(t0, lo) > min(t0 + TILE - 1, p):
                continue
            for g in range(group):
                qi = (r - r0) * group + g
                for j in range(head_dim):
                    acc[qi, j] += pv[qi, j]
    # each row's partial for this segment: parts[index, head] = [m, l, acc...]
    for r in range(r0, r1):
        p = positions[r]
        if seg > p // seg_len or seg < first_seg[r]:
            continue  # the row ends before (or starts after) this segment
        index = base[r] + seg - first_seg[r]
        for g in range(group):
            qi = (r - r0) * group + g
            h = kvh * group + g
            parts[index, h, 0] = m[qi]
            parts[index, h, 1] = lsum[qi]
            for j in range(head_dim):
                parts[index, h, 2 + j] = acc[qi, j]


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _attend(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k_scale: Any,
    v_scale: Any,
    positions: Any,
    row_chunk: Any,
    block_tables: Any,
    window: int,
    scale: Any,
    items: Any,
    first_seg: Any,
    base: Any,
    seg_len: int,
    parts: Any,
) -> None:  # pragma: no cover - numba
    # Only "contract" (fused multiply-add) of the fast-math flags: no reassociation,
    # so each sum runs in the order written, the same in vector body and remainder.
    for i in prange(items.shape[0]):
        r0 = items[i, 0]
        _item(
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            positions,
            block_tables[row_chunk[r0]],
            r0,
            items[i, 1],
            items[i, 2],
            items[i, 3],
            seg_len,
            window,
            scale,
            parts,
            first_seg,
            base,
        )


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _merge(parts: Any, base: Any, out: Any) -> None:  # pragma: no cover - numba
    # out[r, h] = sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M), segments in order
    n, n_heads, head_dim = out.shape
    for item in prange(n * n_heads):
        r = item // n_heads
        h = item % n_heads
        big = parts[base[r], h, 0]
        for index in range(base[r] + 1, base[r + 1]):
            big = max(big, parts[index, h, 0])
        total = np.float32(0.0)
        for j in range(head_dim):
            out[r, h, j] = np.float32(0.0)
        for index in range(base[r], base[r + 1]):
            w = _exp(parts[index, h, 0] - big)
            total += w * parts[index, h, 1]
            for j in range(head_dim):
                out[r, h, j] += w * parts[index, h, 2 + j]
        inv = np.float32(1.0) / total
        for j in range(head_dim):
            out[r, h, j] *= inv


_NO_SCALES = np.zeros((1, 1, 1, 1), np.int16)  # the scale argument of an unscaled cache


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
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> None:
    """Causal attention of every row over its own sequence's cached positions.

    q: (n, n_heads, head_dim) float32, RoPE applied; k_cache, v_cache: one
    layer's pool, (num_blocks, n_kv_heads, block_size, head_dim) in the cache's
    storage (float32, int16 f16 bits, uint16 bf16 bits, or int8 with
    ``k_scale``/``v_scale`` (num_blocks, n_kv_heads, block_size, head_dim // 32)
    int16 f16 scales: q8_0), already holding this step's K/V; positions: (n,)
    int64; row_chunk: (n,) int64, the row's index into block_tables:
    (n_chunks, max_blocks) int64; window: 0, or attend only to the last
    ``window`` positions (a sliding-window layer passes its own); out: (n,
    n_heads, head_dim) float32.

    Row i sees positions ``lo .. positions[i]`` of its sequence and nothing
    else: the block table is the only way in, so another sequence's blocks are
    unreachable, and positions past the row's own are never used (they may hold
    a reservation's stale data: they are in a tile, but outside the row's
    ``a..z`` range, so they are neither exponentiated nor summed).
    """
    n_kv = k_cache.shape[1]
    seg_len = SEGMENT_POSITIONS  # a multiple of TILE: a tile never straddles two segments
    items, first_seg, base = _plan(positions, row_chunk, int(window), seg_len, n_kv)
    parts = np.empty((int(base[-1]), q.shape[1], q.shape[2] + 2), np.float32)
    ks = _NO_SCALES if k_scale is None else k_scale
    vs = _NO_SCALES if v_scale is None else v_scale
    _attend(
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        positions,
        row_chunk,
        block_tables,
        int(window),
        np.float32(scale),
        items,
        first_seg,
        base,
        seg_len,
        parts,
    )
    _merge(parts, base, out)
