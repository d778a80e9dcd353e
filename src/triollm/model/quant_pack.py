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
    hi   Q5_0, Q5_1, Q5_K: 8 bytes per vector, bit 4r + i = bit 4 of lane r's byte i;
         Q6_K: 64 bytes per four vectors, bits 2j, 2j + 1 of byte b = bits 4-5
         of byte b of vector 4p + j
    q    Q8_0: the vectors themselves (``u = q ^ 0x80``); the others 64 bytes per
         two vectors: low nibbles vector 2p, high nibbles vector 2p + 1

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


# --- GGUF blocks into records, one value at a time --------------------------------


@njit(inline="always")
def _value(b: Any, row: int, s: int, kind: int, i: int) -> int:  # pragma: no cover - numba
    # value i of the block at byte s of row `row`, as the unsigned u (layouts: quant.py)
    if kind == _Q8_0:  # int8 q: u = q + 128, its top bit flipped
        return int(b[row, s + 2 + i]) ^ 0x80
    if kind == _Q6_K:  # half h, group t of 32: low nibble (shifted 4 (t // 2)), 2 high bits
        h, t, k = i // 128, (i % 128) // 32, i % 32
        low = (int(b[row, s + 64 * h + 32 * (t % 2) + k]) >> (4 * (t // 2))) & 15
        return low | (((int(b[row, s + 128 + 32 * h + k]) >> (2 * t)) & 3) << 4)
    if kind in (_Q4_K, _Q5_K):  # 32 bytes per pair of sub-blocks: low 2j, high 2j + 1
        j, k = i // 32, i % 32
        u = (
            int(b[row, s + (16 if kind == _Q4_K else 48) + 32 * (j // 2) + k]) >> (4 * (j % 2))
        ) & 15
        if kind == _Q5_K:  # bit j of byte k (of 32 at byte 16)
            u |= ((int(b[row, s + 16 + k]) >> j) & 1) << 4
        return u
    # the 32-value types: d (m) | (qh: bit i is value i's fifth) | 16 bytes of nibbles
    with_min = kind in (_Q4_1, _Q5_1)
    five = kind in (_Q5_0, _Q5_1)
    qh = 4 if with_min else 2
    u = (int(b[row, s + (qh + 4 if five else qh) + i % 16]) >> (4 * (i // 16))) & 15
    if five:
        u |= ((int(b[row, s + qh + i // 8]) >> (i % 8)) & 1) << 4
    return u


@njit(cache=True, nogil=True, parallel=True)
def _pack(b, kind, bb, values, size, fields, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    # b (rows, nb * bb) GGUF blocks; out (groups, nb * size) zeros; fields: the
    # layout's offsets d, m, sc, mn, hi, q (-1: absent, a value numba can hold)
    at_d, at_m, at_sc, at_mn, at_hi, at_q = fields
    rows = b.shape[0]
    nb = b.shape[1] // bb
    for g in prange(out.shape[0]):
        for r in range(min(ROWS, rows - g * ROWS)):  # rows past the end stay zero
            row = g * ROWS + r
            for bi in range(nb):
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
                elif at_mn >= 0:  # Q4_K/Q5_K: eight 6-bit scales and mins in 12 bytes
                    for j in range(8):
                        if j < 4:
                            sc = int(b[row, s + 4 + j]) & 63
                            mn = int(b[row, s + 8 + j]) & 63
                        else:
                            sc = (int(b[row, s + 8 + j]) & 15) | ((int(b[row, s + j]) >> 6) << 4)
                            mn = (int(b[row, s + 8 + j]) >> 4) | (
                                (int(b[row, s + 4 + j]) >> 6) << 4
                            )
                        out[g, o + at_sc + 16 * j + r] = sc
                        out[g, o + at_mn + 16 * j + r] = mn
                for i in range(values):
                    u = _value(b, row, s, kind, i)
                    c, lane = i // 4, 4 * r + i % 4  # vector c, byte `lane` of it
                    if kind == _Q8_0:
                        out[g, o + at_q + 64 * c + lane] = u
                        continue
                    out[g, o + at_q + 64 * (c // 2) + lane] |= (u & 15) << (4 * (c % 2))
                    if kind == _Q6_K:  # bits 4-5 of vector 4p + j at bits 2j of one byte
                        out[g, o + at_hi + 64 * (c // 4) + lane] |= ((u >> 4) & 3) << (2 * (c % 4))
                    elif at_hi >= 0:  # bit 4 of each byte, 64 to a little-endian word
                        out[g, o + at_hi + 8 * c + lane // 8] |= ((u >> 4) & 1) << (lane % 8)


def pack(blocks: np.ndarray, kind: int) -> np.ndarray:
    """GGUF blocks ``(rows, bytes per row)`` as records ``(ceil(rows / 16), blocks * size)``.

    Row ``16 g + r`` of the weight is lane ``r`` of row ``g`` of the result.
    The rows past the last are zero (scale 0: their products are 0, and never stored).
    """
    lay = LAYOUTS[kind]
    rows = blocks.shape[0]
    nb = blocks.shape[1] // _BLOCK_BYTES[kind]
    out = np.zeros((-(-rows // ROWS), nb * lay.size), np.uint8)
    fields = tuple(-1 if f is None else f for f in (lay.d, lay.m, lay.sc, lay.mn, lay.hi, lay.q))
    if rows:
        _pack(blocks, kind, _BLOCK_BYTES[kind], lay.values, lay.size, fields, out)
    return out
