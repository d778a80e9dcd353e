"""The int8 product's weight layout: sixteen weight rows interleaved, block by block.

A GGUF file stores a quantized matrix row after row, each row a run of
blocks. :mod:`triollm.model.quant_int8` multiplies with ``vpdpbusd``, whose
sixteen 32-bit lanes each sum four byte products. Read row by row, those
lanes are sixteen slices of *one* weight row, and every block ends in a
horizontal sum, a float conversion and the block's scales for that one row.
Repacked here, once, at load, the sixteen lanes are sixteen *weight rows*:

    one 64-byte vector c of a group (sixteen rows r0 .. r15):
      | u[r0, 4c..4c+3] | u[r1, 4c..4c+3] | ... | u[r15, 4c..4c+3] |
    times x[4c..4c+3] (one activation row's four bytes, the same in every lane)
      -> lane r accumulates row r's dot product: no horizontal sum, ever

so one broadcast of four activation bytes feeds sixteen rows, each block's
scales are sixteen-lane vectors loaded as they are, and the float work of a
block is done once per sixteen rows.

Layout
------
Rows go sixteen to a *group* (the last group padded with zero rows, whose
outputs are never stored). For each activation block of ``V`` values (32,
or 256 for the K-quants) a group holds one *record* of ``Layout.size`` bytes,
fields in this order (absent fields take no bytes):

    d    32 bytes: the sixteen rows' f16 scale (K-quants: super-block d)
    m    32 bytes: the sixteen f16 mins (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
    sc   16 bytes per sub-block: byte r is row r's sub-block scale
         (Q4_K, Q5_K: eight unsigned 6-bit scales of 32 values;
          Q6_K: sixteen int8 scales of 16 values)
    mn   16 bytes per sub-block: Q4_K/Q5_K's 6-bit mins
    then chunks, each the high bits of a few vectors followed by their low bits,
    in the order the tile reads them (one record is one forward stream):
    hi   Q5_0, Q5_1, Q5_K: 8 bytes per vector, bit 4r + i = bit 4 of lane r's byte i
         (a chunk per 8 vectors: 64 bytes, then their 256 bytes of nibbles);
         Q6_K: 64 bytes per four vectors, bits 2j, 2j + 1 of byte b = bits 4-5
         of byte b of vector 4p + j (a chunk per 4 vectors: 64, then 128 of nibbles)
    q    Q8_0: the vectors themselves (``u = q ^ 0x80``); the others 64 bytes per
         two vectors: low nibbles vector 2p, high nibbles vector 2p + 1
         (Q4_0, Q4_1, Q4_K, Q8_0 have no high bits: one chunk of these)

``u`` is each weight as an unsigned integer (``vpdpbusd`` multiplies unsigned
bytes by signed ones): ``w = d * (u - offset)`` (``+ m`` for the types with a
min; K-quants ``(d * sc) * u - dmin * mn``, Q6_K ``(d * sc) * (u - 32)``).
Every record field is a fixed number of bytes, so the record of block ``b``
of group ``g`` is at byte ``b * size`` of row ``g`` of the packed array.

The packed array replaces the file's bytes for the int8 product only: the
``--exact-activations`` path and the embedding lookup read the GGUF blocks.
A record is as large as the sixteen blocks it holds (Q4_K: 2368 bytes for
16 x 144 = 2304, the 6-bit scales stored as bytes), so the bytes a decode
step streams stay those of the file.

The table of offsets (``quant_int8.LAYOUTS``) lives beside the tile that
reads it. Hazard: numba's disk cache of a kernel is invalidated by changes
to the kernel's own module only; a layout defined here would let a changed
layout meet a stale cached tile.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
from numba import njit, prange

from triollm.model.quant_int8 import LAYOUTS, ROWS
from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)

# type ids (quant.QuantType)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q4_K, _Q5_K, _Q6_K = 12, 13, 14
_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}


# --- GGUF blocks into records, one output byte at a time ---------------------------
#
# Each record byte is written once, from the bytes of the one GGUF block it comes
# from, and the pass is specialised per type (``_pack_rows`` is inlined with the
# type as a constant, so LLVM drops the other types' branches from the inner
# loops). The first version asked a per-value function every type's question for
# each of 1.3 G values and or'ed nibbles into zeroed bytes: 7 s of CPU for the
# 1.5B file.


@njit(inline="always")
def _low(b: Any, row: int, s: int, kind: int, v: int) -> int:  # pragma: no cover - numba
    # value v of the block at byte s of row `row`: its low four bits
    if kind == _Q6_K:  # half h, group t of 32: the low nibble, shifted 4 (t // 2)
        h, t, k = v // 128, (v % 128) // 32, v % 32
        return (int(b[row, s + 64 * h + 32 * (t % 2) + k]) >> (4 * (t // 2))) & 15
    if kind in (_Q4_K, _Q5_K):  # 32 bytes per pair of sub-blocks: low 2j, high 2j + 1
        j, k = v // 32, v % 32
        at = s + (16 if kind == _Q4_K else 48) + 32 * (j // 2) + k
        return (int(b[row, at]) >> (4 * (j % 2))) & 15
    # the 32-value types: d (m) | (qh: bit v is value v's fifth) | 16 bytes of nibbles
    qh = 4 if kind in (_Q4_1, _Q5_1) else 2
    qs = qh + 4 if kind in (_Q5_0, _Q5_1) else qh
    return (int(b[row, s + qs + v % 16]) >> (4 * (v // 16))) & 15


@njit(inline="always")
def _high(b: Any, row: int, s: int, kind: int, v: int) -> int:  # pragma: no cover - numba
    # value v's bits above the nibble: Q6_K two, the Q5 types one
    if kind == _Q6_K:
        h, t, k = v // 128, (v % 128) // 32, v % 32
        return (int(b[row, s + 128 + 32 * h + k]) >> (2 * t)) & 3
    if kind == _Q5_K:  # bit j of byte k (of 32 at byte 16)
        return (int(b[row, s + 16 + v % 32]) >> (v // 32)) & 1
    qh = 4 if kind == _Q5_1 else 2
    return (int(b[row, s + qh + v // 8]) >> (v % 8)) & 1


@njit(inline="always")
def _pack_rows(b, kind, bb, values, size, fields, out, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    # group g's records, row by row; `kind` a constant where this is inlined
    at_d, at_m, at_sc, at_mn, body, cv, hib = fields
    chunk = hib + (64 if kind == _Q8_0 else 32) * cv  # quant_int8.Layout.chunk
    for r in range(min(ROWS, b.shape[0] - g * ROWS)):  # rows past the end stay zero
        row = g * ROWS + r
        for bi in range(b.shape[1] // bb):
            s, o = bi * bb, bi * size
            dat = 208 if kind == _Q6_K else 0  # the f16s' bits, copied
            out[g, o + at_d + 2 * r] = b[row, s + dat]
            out[g, o + at_d + 2 * r + 1] = b[row, s + dat + 1]
            if at_m >= 0:
                out[g, o + at_m + 2 * r] = b[row, s + 2]
                out[g, o + at_m + 2 * r + 1] = b[row, s + 3]
            if kind == _Q6_K:  # sixteen int8 scales, as bytes
                for j in range(16):
                    out[g, o + at_sc + 16 * j + r] = b[row, s + 192 + j]
            elif kind in (_Q4_K, _Q5_K):  # eight 6-bit scales and mins in 12 bytes
                for j in range(8):
                    if j < 4:
                        sc = int(b[row, s + 4 + j]) & 63
                        mn = int(b[row, s + 8 + j]) & 63
                    else:
                        sc = (int(b[row, s + 8 + j]) & 15) | ((int(b[row, s + j]) >> 6) << 4)
                        mn = (int(b[row, s + 8 + j]) >> 4) | ((int(b[row, s + 4 + j]) >> 6) << 4)
                    out[g, o + at_sc + 16 * j + r] = sc
                    out[g, o + at_mn + 16 * j + r] = mn
            if kind == _Q8_0:  # vector c, byte 4r + i: the int8 with its top bit flipped
                for c in range(8):
                    for i in range(4):
                        out[g, o + body + 64 * c + 4 * r + i] = b[row, s + 2 + 4 * c + i] ^ 0x80
                continue
            # 64 bytes per two vectors: value 8p + i low, 8p + 4 + i high, in byte 4r + i
            for p in range(values // 8):
                c = 2 * p  # its chunk's high bits first, then its nibbles (Layout.q_at)
                at = o + body + (c // cv) * chunk + hib + 32 * (c % cv)
                for i in range(4):
                    v = 8 * p + i
                    lo, hi = _low(b, row, s, kind, v), _low(b, row, s, kind, v + 4)
                    out[g, at + 4 * r + i] = lo | (hi << 4)
            if kind == _Q6_K:  # bits 4-5 of vector 4p + j at bits 2j of byte 4r + i
                for p in range(values // 16):
                    for i in range(4):
                        two = 0
                        for j in range(4):
                            two |= _high(b, row, s, kind, 16 * p + 4 * j + i) << (2 * j)
                        out[g, o + body + p * chunk + 4 * r + i] = two  # chunk p opens
            elif hib:  # bit 4 of lane byte 4r + i: bit 4r + i of a 64-bit word
                for c in range(values // 4):
                    four = 0
                    for i in range(4):
                        four |= _high(b, row, s, kind, 4 * c + i) << i
                    # rows 2m and 2m + 1 share the byte (this thread packs both)
                    at = o + body + (c // cv) * chunk + 8 * (c % cv)  # Layout.hi_at
                    out[g, at + r // 2] |= four << (4 * (r % 2))


@njit(cache=True, nogil=True, parallel=True)
def _pack(b, kind, bb, values, size, fields, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    # b (rows, nb * bb) GGUF blocks; out (groups, nb * size) zeros; fields: the
    # layout's offsets d, m, sc, mn (-1: absent, a value numba can hold), then
    # where the chunks start, the vectors per chunk and the high-bit bytes opening each.
    # One branch per group, each calling the pass with its type as a constant.
    for g in prange(out.shape[0]):
        if kind == _Q4_0:
            _pack_rows(b, _Q4_0, bb, values, size, fields, out, g)
        elif kind == _Q4_1:
            _pack_rows(b, _Q4_1, bb, values, size, fields, out, g)
        elif kind == _Q5_0:
            _pack_rows(b, _Q5_0, bb, values, size, fields, out, g)
        elif kind == _Q5_1:
            _pack_rows(b, _Q5_1, bb, values, size, fields, out, g)
        elif kind == _Q8_0:
            _pack_rows(b, _Q8_0, bb, values, size, fields, out, g)
        elif kind == _Q4_K:
            _pack_rows(b, _Q4_K, bb, values, size, fields, out, g)
        elif kind == _Q5_K:
            _pack_rows(b, _Q5_K, bb, values, size, fields, out, g)
        else:
            _pack_rows(b, _Q6_K, bb, values, size, fields, out, g)


def pack(blocks: np.ndarray, kind: int) -> np.ndarray:
    """GGUF blocks ``(rows, bytes per row)`` as records ``(ceil(rows / 16), blocks * size)``.

    Row ``16 g + r`` of the weight is lane ``r`` of row ``g`` of the result.
    The rows past the last are zero (scale 0: their products are 0, and never stored).
    """
    lay = LAYOUTS[kind]
    rows = blocks.shape[0]
    nb = blocks.shape[1] // _BLOCK_BYTES[kind]
    out = np.zeros((-(-rows // ROWS), nb * lay.size), np.uint8)
    fields = tuple(
        -1 if f is None else f
        for f in (lay.d, lay.m, lay.sc, lay.mn, lay.body, lay.chunk_vectors, lay.hi_bytes)
    )
    if rows:
        _pack(blocks, kind, _BLOCK_BYTES[kind], lay.values, lay.size, fields, out)
    return out


def _mapping(a: np.ndarray) -> mmap.mmap | None:
    """The file mapping ``a`` is a view of, if any (numpy keeps it at the end of ``.base``)."""
    obj: Any = a
    while obj is not None:
        if isinstance(obj, mmap.mmap):
            return obj
        obj = getattr(obj, "base", None)
    return None


def release_pages(blocks: np.ndarray) -> int:
    """Drop the pages of ``blocks`` from this process when they are a view of a file mapping.

    Once a matrix is packed, the int8 product never reads its GGUF bytes again;
    left mapped, those pages count in the process's resident memory beside the
    packed copy (the model twice). ``MADV_DONTNEED`` unmaps them; a later read
    (the embedding lookup, ``--exact-activations``) faults them back from the
    file. Returns the bytes released (whole pages inside ``blocks`` only).

    Hazard: on a private (copy-on-write) mapping, a page this process had
    written would lose the write; nothing writes a GGUF mapping (the loader
    copies what it rearranges). An array that is not a file mapping (a copy,
    ``np.concatenate``'s stack) is left alone: there DONTNEED would zero it.
    """
    mm = _mapping(blocks)
    if mm is None or mm.closed or not blocks.flags.c_contiguous or not blocks.nbytes:
        return 0
    base = np.frombuffer(mm, np.uint8).ctypes.data  # where the mapping starts
    lo = blocks.ctypes.data - base
    hi = lo + blocks.nbytes
    lo, hi = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return hi - lo
