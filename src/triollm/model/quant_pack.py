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

import numpy as np

from triollm.model.quant_int8 import LAYOUTS, ROWS

# type ids (quant.QuantType)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q4_K, _Q5_K, _Q6_K = 12, 13, 14
_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}


# --- reading the GGUF blocks ------------------------------------------------------


def _half_bits(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block, as its 16 bits (kept exact)."""
    return b[..., at : at + 2].copy().view(np.uint16)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-value block: low nibbles are values 0-15, high 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _unsigned(kind: int, b: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``u`` uint8 ``(rows, blocks, V)`` and the per-block fields of GGUF blocks ``b``.

    ``b`` is ``(rows, blocks, block bytes)`` uint8. The fields: ``d``, ``m``
    (f16 bits), ``sc``, ``mn`` (bytes, ``(rows, blocks, sub-blocks)``).
    """
    f: dict[str, np.ndarray] = {"d": _half_bits(b, 208 if kind == _Q6_K else 0)}
    if kind == _Q8_0:
        return b[..., 2:34] ^ np.uint8(0x80), f
    if kind in (_Q4_0, _Q4_1, _Q5_0, _Q5_1):
        with_min, five = kind in (_Q4_1, _Q5_1), kind in (_Q5_0, _Q5_1)
        qh_at = 4 if with_min else 2
        qs_at = qh_at + 4 if five else qh_at
        u = _nibbles32(b[..., qs_at : qs_at + 16])
        if five:  # bit i of the little-endian word qh is value i's fifth bit
            qh = np.unpackbits(b[..., qh_at : qh_at + 4], axis=-1, bitorder="little")
            u |= qh << np.uint8(4)
        if with_min:
            f["m"] = _half_bits(b, 2)
        return u, f
    if kind in (_Q4_K, _Q5_K):
        s = b[..., 4:16]
        f["m"] = _half_bits(b, 2)
        lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
        hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        f["sc"] = np.concatenate([lo_sc, hi_sc], axis=-1)
        f["mn"] = np.concatenate([lo_mn, hi_mn], axis=-1)
        qs_at = 16 if kind == _Q4_K else 48
        # 32 bytes per pair of sub-blocks: low nibbles sub-block 2j, high 2j + 1
        qs = b[..., qs_at : qs_at + 128].reshape(*b.shape[:2], 4, 32)
        u = np.stack([qs & 15, qs >> 4], axis=3).reshape(*b.shape[:2], 256)
        if kind == _Q5_K:  # bit j of byte i (of 32 at byte 16): sub-block j's value i
            bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # (.., i, j)
            u |= np.swapaxes(bits, -1, -2).reshape(*b.shape[:2], 256) << np.uint8(4)
        return u, f
    # Q6_K: 128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d.
    # Half h (128 values), group t (32): low nibbles of bytes 64 h + 32 (t % 2) ..
    # (shifted 4 (t // 2)), high bits 2t of bytes 128 + 32 h ..
    lo = b[..., 0:128].reshape(*b.shape[:2], 2, 2, 32)  # (h, t % 2, i)
    hi = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)  # (h, -, i)
    u = np.empty((*b.shape[:2], 2, 4, 32), np.uint8)
    for t in range(4):
        low = (lo[..., t % 2, :] >> np.uint8(4 * (t // 2))) & 15
        u[..., t, :] = low | (((hi[..., 0, :] >> np.uint8(2 * t)) & 3) << 4)
    f["sc"] = b[..., 192:208]
    return u.reshape(*b.shape[:2], 256), f


# --- interleaving sixteen rows ----------------------------------------------------


def _group_fields(kind: int, u: np.ndarray, f: dict[str, np.ndarray]) -> np.ndarray:
    """Records ``(groups, blocks, size)`` from ``u`` and fields of 16k rows (the layout above)."""
    lay = LAYOUTS[kind]
    rows, nb, v = u.shape
    g = rows // ROWS
    # vector c of a record: lane r holds u[r, 4c .. 4c + 3]
    vec = u.reshape(g, ROWS, nb, v // 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, v // 4, 64)

    def per_row(a: np.ndarray) -> np.ndarray:  # (rows, nb, ...) -> (g, nb, ..., 16) as bytes
        a = a.reshape(g, ROWS, nb, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(a).view(np.uint8).reshape(g, nb, -1)

    parts = [per_row(f["d"])]
    if lay.m is not None:
        parts.append(per_row(f["m"]))
    if lay.sc is not None:
        parts.append(per_row(f["sc"]))
    if lay.mn is not None:
        parts.append(per_row(f["mn"]))
    if kind in (_Q5_0, _Q5_1, _Q5_K):  # bit 4 of each byte, 64 to a little-endian word
        parts.append(np.packbits((vec >> 4) & 1, axis=-1, bitorder="little").reshape(g, nb, -1))
    elif kind == _Q6_K:  # bits 4-5 of four vectors in one
        h = ((vec >> 4) & 3).reshape(g, nb, v // 16, 4, 64)
        parts.append(h[:, :, :, 0] | h[:, :, :, 1] << 2 | h[:, :, :, 2] << 4 | h[:, :, :, 3] << 6)
    if kind == _Q8_0:
        parts.append(vec)
    else:
        parts.append((vec[:, :, 0::2] & 15) | ((vec[:, :, 1::2] & 15) << 4))
    out = np.concatenate([p.reshape(g, nb, -1) for p in parts], axis=2)
    assert out.shape[2] == lay.size, (kind, out.shape, lay)  # the layout table and this agree
    return out


_CHUNK_ROWS = 512  # rows repacked at a time: the intermediates stay a few MB


def pack(blocks: np.ndarray, kind: int) -> np.ndarray:
    """GGUF blocks ``(rows, bytes per row)`` as records ``(ceil(rows / 16), blocks * size)``.

    Row ``16 g + r`` of the weight is lane ``r`` of row ``g`` of the result.
    The rows past the last are zero (scale 0: their products are 0, and never stored).
    """
    lay = LAYOUTS[kind]
    rows = blocks.shape[0]
    nb = blocks.shape[1] // _BLOCK_BYTES[kind]
    groups = -(-rows // ROWS)
    out = np.empty((groups, nb * lay.size), np.uint8)
    for r0 in range(0, rows, _CHUNK_ROWS):
        r1 = min(rows, r0 + _CHUNK_ROWS)
        b = np.asarray(blocks[r0:r1]).reshape(r1 - r0, nb, _BLOCK_BYTES[kind])
        if (r1 - r0) % ROWS:  # the last group: zero rows after the real ones
            pad = np.zeros((ROWS - (r1 - r0) % ROWS, nb, b.shape[2]), np.uint8)
            b = np.concatenate([b, pad])
        u, f = _unsigned(kind, b)
        out[r0 // ROWS : r0 // ROWS + b.shape[0] // ROWS] = _group_fields(kind, u, f).reshape(
            b.shape[0] // ROWS, -1
        )
    return out
