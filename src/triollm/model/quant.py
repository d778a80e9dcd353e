"""Quantized weights: GGUF's block formats kept as blocks, multiplied as they are.

A quantized weight ``[out, in]`` is stored the way a GGUF file stores it: each
row cut into blocks of 32 values (256 for the K-quants), each block a few
bytes of scales and packed small integers. :class:`QuantizedTensor` holds
those bytes untouched (a memory map of the file, when it comes from one) and
:func:`linear` computes ``x @ W.T`` from them, so a decode step streams the
quantized bytes, not a float copy: 34 bytes per 32 weights for Q8_0 against
128 for float32.

Block layouts (``docs/engine.md`` draws a Q4_K super-block)::

    type   values  bytes  one block
    Q8_0     32     34    d f16 | 32 x int8               w = d * q
    Q4_0     32     18    d f16 | 16 bytes of nibbles     w = d * (q - 8)
    Q4_1     32     20    d, m f16 | 16 bytes of nibbles  w = d * q + m
    Q5_0     32     22    d f16 | qh 4 bytes | nibbles    w = d * (q - 16), q = nibble | bit << 4
    Q5_1     32     24    d, m f16 | qh | nibbles         w = d * q + m
    Q4_K    256    144    d, dmin f16 | 12 bytes: eight 6-bit scales and mins | 128 bytes of nibbles
                          w = (d * sc_j) * q - dmin * m_j for sub-block j of 32
    Q5_K    256    176    as Q4_K plus 32 bytes holding each value's fifth bit
    Q6_K    256    210    128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d f16
                          w = (d * sc_i) * (q - 32) for sub-block i of 16

The ``gguf`` package (the format's own Python code) defines these exactly;
the tests compare every kernel with its ``dequantize``.

Theory of operation
-------------------
Threads split the output rows into blocks. Inside a block, sixteen weight
rows at a time are *widened* chunk by chunk (256 input columns, 16 KiB of
float32 that stays in L1) and every row of ``x`` is multiplied into those
sixteen rows with sixteen float32 accumulators, carried from chunk to chunk.
The quantized bytes are read from memory once per product whatever the row
count, as in ``matmul.py``: one row (batch-1 decode) pays the widening once
per weight, sixteen rows share it.

Every row of ``x`` runs the same instructions in the same order whatever else
is in the product (there is one inner loop, per row), so a row's result is
the same bits alone and in a batch (batch invariance, tested). Arithmetic is
float32 throughout; the widened weights are the values ``gguf.dequantize``
computes, up to the last bit where the compiler fuses a multiply and an add.

Hazards
-------
- ``nogil=True``: the forward runs in a worker thread beside the event loop.
- ``in_features`` must be a whole number of blocks (GGUF guarantees it; a
  K-quant needs a multiple of 256, which is why SmolLM2's 576 columns come
  as Q4_1). :func:`quantize` refuses anything else by name.
- The embedding lookup (:meth:`QuantizedTensor.__getitem__`) widens only the
  rows asked for; nothing widens a whole quantized matrix except
  :meth:`QuantizedTensor.dequantize` (tests, tools).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see matmul.py: before OpenMP starts

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic


class QuantType(IntEnum):
    """The block formats the kernels compute on; values are GGML's type ids."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14

    @property
    def block_values(self) -> int:
        """Weights per block: 32, or 256 for the K-quants."""
        return 256 if self >= QuantType.Q4_K else 32

    @property
    def block_bytes(self) -> int:
        """Bytes per block."""
        return _BLOCK_BYTES[self]


_BLOCK_BYTES = {
    QuantType.Q4_0: 18,
    QuantType.Q4_1: 20,
    QuantType.Q5_0: 22,
    QuantType.Q5_1: 24,
    QuantType.Q8_0: 34,
    QuantType.Q4_K: 144,
    QuantType.Q5_K: 176,
    QuantType.Q6_K: 210,
}

# numba sees these as compile-time constants
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q4_K, _Q5_K, _Q6_K = 12, 13, 14

_GROUP = 16  # weight rows widened together (sixteen accumulators per x row)
_CHUNK = 256  # input columns widened at a time: 16 x 256 float32 = 16 KiB, in L1
_ROW_CHUNK = 64  # rows of x per pass over a block (their accumulators stay in L1)
_BLOCK_ROWS_MAX = 256  # weight rows per parallel block at most


# --- reading a block's bytes ---------------------------------------------------


@intrinsic
def _f16_to_f32(typingctx: Any, bits: Any) -> Any:
    """The low 16 bits of an integer, read as float16, widened to float32 (vcvtph2ps)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        low = builder.trunc(args[0], ir.IntType(16))
        return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always")
def _half(row: Any, o: int) -> Any:  # pragma: no cover - numba
    # the little-endian float16 at byte o of a block row, as float32
    bits = np.uint32(row[o]) | (np.uint32(row[o + 1]) << np.uint32(8))
    return _f16_to_f32(bits)  # type: ignore[call-arg]  # typingctx is numba's


@njit(inline="always")
def _k_scale_min(row: Any, o: int, j: int) -> Any:  # pragma: no cover - numba
    # Q4_K/Q5_K: sub-block j's 6-bit scale and min from the 12 bytes at o.
    # Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7;
    # bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of scales and
    # mins 4-7 (scale in the low nibble, min in the high one).
    if j < 4:
        sc = row[o + j] & 63
        m = row[o + j + 4] & 63
    else:
        sc = (row[o + j + 4] & 15) | ((row[o + j - 4] >> 6) << 4)
        m = (row[o + j + 4] >> 4) | ((row[o + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


def _make_widen(lanes: int, *, signed: bool = False, word: bool = False, add: bool = True) -> Any:
    """An intrinsic widening ``lanes`` packed values of a block row into float32.

    For lane ``i`` it computes, in LLVM vector IR (one vector op per step)::

        lo = (row[o_lo + i] >> ls) & lm          (sign-extended first if ``signed``)
        hi = (row[o_hi + i] >> hs) & hm          (``word``: (o_hi >> (hs + i)) & hm,
                                                  o_hi being a 32-bit word of high bits)
        dst[p + i] = float32((lo | hi << hp) - off) * d + m     (no "+ m" unless ``add``)

    Written as IR because numba's loops over bytes do not vectorise here: the
    compiler cannot prove the block row and ``dst`` apart, so it will not move
    a load above a store. Multiply then add, unfused, as ``gguf.dequantize``
    computes them: the widened values are its values bit for bit.
    """

    @intrinsic
    def widen(typingctx, row, o_lo, ls, lm, o_hi, hs, hm, hp, off, d, m, dst, p):  # type: ignore[no-untyped-def]
        ints = (o_lo, ls, lm, o_hi, hs, hm, hp, off, p)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.void(
            row, o_lo, ls, lm, o_hi, hs, hm, hp, off, types.float32, types.float32, dst, p
        )

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
            vi8, vi32, vf = (ir.VectorType(t, lanes) for t in (i8, i32, f32))
            a = signature.args
            r = context.make_array(a[0])(context, builder, args[0])
            out = context.make_array(a[11])(context, builder, args[11])

            def scalar(k: int, ty: Any) -> Any:
                return context.cast(builder, args[k], a[k], ty)

            def int32(k: int) -> Any:
                return builder.trunc(scalar(k, types.int64), i32)

            def splat(value: Any, vt: Any) -> Any:
                undef = ir.Constant(vt, ir.Undefined)
                one = builder.insert_element(undef, value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, undef, ir.Constant(vi32, [0] * lanes))

            def load(k: int) -> Any:
                ptr = builder.gep(builder.bitcast(r.data, i8.as_pointer()), [scalar(k, types.intp)])
                return builder.load(builder.bitcast(ptr, vi8.as_pointer()), align=1)

            lo = builder.sext(load(1), vi32) if signed else builder.zext(load(1), vi32)
            lo = builder.and_(builder.lshr(lo, splat(int32(2), vi32)), splat(int32(3), vi32))
            if word:
                lane = ir.Constant(vi32, list(range(lanes)))
                shift = builder.add(lane, splat(int32(5), vi32))
                hi = builder.lshr(splat(int32(4), vi32), shift)
            else:
                hi = builder.lshr(builder.zext(load(4), vi32), splat(int32(5), vi32))
            hi = builder.shl(builder.and_(hi, splat(int32(6), vi32)), splat(int32(7), vi32))
            q = builder.sub(builder.or_(lo, hi), splat(int32(8), vi32))
            v = builder.fmul(builder.sitofp(q, vf), splat(scalar(9, types.float32), vf))
            if add:
                v = builder.fadd(v, splat(scalar(10, types.float32), vf))
            base = builder.bitcast(out.data, f32.as_pointer())
            ptr = builder.gep(base, [scalar(12, types.intp)])
            builder.store(v, builder.bitcast(ptr, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return widen


_widen_i8x32 = _make_widen(32, signed=True, add=False)  # Q8_0
_widen_u8x32 = _make_widen(32)  # Q4_K, Q5_K
_widen_u8x16 = _make_widen(16)  # Q4_1
_widen_u8x16_nomin = _make_widen(16, add=False)  # Q4_0, Q6_K
_widen_q5x16 = _make_widen(16, word=True)  # Q5_1
_widen_q5x16_nomin = _make_widen(16, word=True, add=False)  # Q5_0


@njit(inline="always")
def _widen_block(kind: int, row: Any, b: int, dst: Any, p: int) -> None:  # pragma: no cover
    # Block b of a quantized row, as float32, into dst[p : p + block values].
    zero = np.float32(0.0)
    if kind == _Q8_0:
        o = b * 34
        _widen_i8x32(row, o + 2, 0, -1, o + 2, 0, 0, 0, 0, _half(row, o), zero, dst, p)
    elif kind == _Q4_0 or kind == _Q4_1:  # noqa: SIM109 (plain compares for numba)
        o = b * 18 if kind == _Q4_0 else b * 20
        d = _half(row, o)
        m = zero
        qs = o + 2
        off = 8
        if kind == _Q4_1:
            m = _half(row, o + 2)
            qs = o + 4
            off = 0
        if kind == _Q4_1:  # low nibbles: values 0-15, high nibbles: 16-31
            _widen_u8x16(row, qs, 0, 15, qs, 0, 0, 0, off, d, m, dst, p)
            _widen_u8x16(row, qs, 4, 15, qs, 0, 0, 0, off, d, m, dst, p + 16)
        else:
            _widen_u8x16_nomin(row, qs, 0, 15, qs, 0, 0, 0, off, d, m, dst, p)
            _widen_u8x16_nomin(row, qs, 4, 15, qs, 0, 0, 0, off, d, m, dst, p + 16)
    elif kind == _Q5_0 or kind == _Q5_1:  # noqa: SIM109 (plain compares for numba)
        o = b * 22 if kind == _Q5_0 else b * 24
        d = _half(row, o)
        m = zero
        h = o + 2
        off = 16
        if kind == _Q5_1:
            m = _half(row, o + 2)
            h = o + 4
            off = 0
        qh = (
            np.int64(row[h])
            | (np.int64(row[h + 1]) << 8)
            | (np.int64(row[h + 2]) << 16)
            | (np.int64(row[h + 3]) << 24)
        )
        # value i takes bit i of the 32-bit qh as its fifth bit
        if kind == _Q5_1:
            _widen_q5x16(row, h + 4, 0, 15, qh, 0, 1, 4, off, d, m, dst, p)
            _widen_q5x16(row, h + 4, 4, 15, qh, 16, 1, 4, off, d, m, dst, p + 16)
        else:
            _widen_q5x16_nomin(row, h + 4, 0, 15, qh, 0, 1, 4, off, d, m, dst, p)
            _widen_q5x16_nomin(row, h + 4, 4, 15, qh, 16, 1, 4, off, d, m, dst, p + 16)
    elif kind == _Q4_K or kind == _Q5_K:  # noqa: SIM109 (plain compares for numba)
        o = b * 144 if kind == _Q4_K else b * 176
        d = _half(row, o)
        dmin = _half(row, o + 2)
        qs = o + 16 if kind == _Q4_K else o + 48  # Q5_K: 32 bytes of fifth bits first
        hm = 0 if kind == _Q4_K else 1
        for g in range(4):  # 32 bytes: low nibbles = sub-block 2g, high = 2g + 1
            sc0, m0 = _k_scale_min(row, o + 4, 2 * g)
            sc1, m1 = _k_scale_min(row, o + 4, 2 * g + 1)
            q = qs + 32 * g
            _widen_u8x32(
                row, q, 0, 15, o + 16, 2 * g, hm, 4, 0, d * sc0, -(dmin * m0), dst, p + 64 * g
            )
            _widen_u8x32(
                row,
                q,
                4,
                15,
                o + 16,
                2 * g + 1,
                hm,
                4,
                0,
                d * sc1,
                -(dmin * m1),
                dst,
                p + 64 * g + 32,
            )
    else:  # _Q6_K: two halves of 128 values, each four groups of 32, scales per 16
        o = b * 210
        d = _half(row, o + 208)
        for h in range(2):
            for t in range(4):  # group t: nibble t // 2 of ql[(t % 2) * 32 + i], bits 2t of qh[i]
                ql = o + 64 * h + (t % 2) * 32
                hb = o + 128 + 32 * h  # the high 2-bit pairs
                sc = o + 192 + 8 * h + 2 * t
                at = p + 128 * h + 32 * t
                for s in range(2):
                    scale = d * np.float32(np.int8(row[sc + s]))
                    _widen_u8x16_nomin(
                        row,
                        ql + 16 * s,
                        4 * (t // 2),
                        15,
                        hb + 16 * s,
                        2 * t,
                        3,
                        4,
                        32,
                        scale,
                        zero,
                        dst,
                        at + 16 * s,
                    )


@njit(nogil=True, cache=True)
def _widen_span(kind: int, row: Any, c: int, kc: int, dst: Any) -> None:  # pragma: no cover
    # Values c .. c + kc of a quantized row into dst[0:kc] (c, kc whole blocks).
    # one loop per type, so the type test is not repeated per block
    if kind == _Q8_0:
        for b in range(kc // 32):
            _widen_block(_Q8_0, row, c // 32 + b, dst, b * 32)
    elif kind == _Q4_0:
        for b in range(kc // 32):
            _widen_block(_Q4_0, row, c // 32 + b, dst, b * 32)
    elif kind == _Q4_1:
        for b in range(kc // 32):
            _widen_block(_Q4_1, row, c // 32 + b, dst, b * 32)
    elif kind == _Q5_0:
        for b in range(kc // 32):
            _widen_block(_Q5_0, row, c // 32 + b, dst, b * 32)
    elif kind == _Q5_1:
        for b in range(kc // 32):
            _widen_block(_Q5_1, row, c // 32 + b, dst, b * 32)
    else:  # the K-quants: one super-block of 256 per chunk
        _widen_block(kind, row, c // 256, dst, 0)


# --- the product ---------------------------------------------------------------


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _quant_matmul(
    x: Any, blocks: Any, kind: int, k_in: int, out: Any, block: int
) -> None:  # pragma: no cover - numba
    # x (n, k_in) float32; blocks (n_out, bytes per row) uint8; out (n, n_out).
    n = x.shape[0]
    n_out = blocks.shape[0]
    for blk in prange((n_out + block - 1) // block):
        j0 = blk * block
        j1 = min(j0 + block, n_out)
        buf = np.empty((_GROUP, _CHUNK), np.float32)
        acc = np.empty((_ROW_CHUNK, _GROUP), np.float32)
        for g in range(j0, j1, _GROUP):
            e = min(g + _GROUP, j1) - 1  # a short last group repeats its last row
            for r0 in range(0, n, _ROW_CHUNK):
                r1 = min(r0 + _ROW_CHUNK, n)
                acc[:, :] = 0.0
                for c in range(0, k_in, _CHUNK):
                    kc = min(_CHUNK, k_in - c)
                    for t in range(_GROUP):
                        _widen_span(kind, blocks[min(g + t, e)], c, kc, buf[t])
                    for r in range(r0, r1):
                        # a slice, so the loop index is known >= 0: an index that might
                        # be negative (c + k) made LLVM gather x instead of loading it
                        _dot16(x[r, c : c + kc], kc, buf, acc, r - r0)
                for r in range(r0, r1):
                    for t in range(min(_GROUP, j1 - g)):
                        out[r, g + t] = acc[r - r0, t]


@njit(inline="always", fastmath=True)
def _dot16(xr: Any, kc: int, buf: Any, acc: Any, a: int) -> None:  # pragma: no cover
    # acc[a, t] += xr[:kc] . buf[t, :kc] for the sixteen widened rows t:
    # sixteen independent sums, each one vector accumulator (the hot loop).
    w0, w1, w2, w3 = buf[0], buf[1], buf[2], buf[3]
    w4, w5, w6, w7 = buf[4], buf[5], buf[6], buf[7]
    w8, w9, w10, w11 = buf[8], buf[9], buf[10], buf[11]
    w12, w13, w14, w15 = buf[12], buf[13], buf[14], buf[15]
    s0, s1, s2, s3 = acc[a, 0], acc[a, 1], acc[a, 2], acc[a, 3]
    s4, s5, s6, s7 = acc[a, 4], acc[a, 5], acc[a, 6], acc[a, 7]
    s8, s9, s10, s11 = acc[a, 8], acc[a, 9], acc[a, 10], acc[a, 11]
    s12, s13, s14, s15 = acc[a, 12], acc[a, 13], acc[a, 14], acc[a, 15]
    for k in range(kc):
        v = xr[k]
        s0 += v * w0[k]
        s1 += v * w1[k]
        s2 += v * w2[k]
        s3 += v * w3[k]
        s4 += v * w4[k]
        s5 += v * w5[k]
        s6 += v * w6[k]
        s7 += v * w7[k]
        s8 += v * w8[k]
        s9 += v * w9[k]
        s10 += v * w10[k]
        s11 += v * w11[k]
        s12 += v * w12[k]
        s13 += v * w13[k]
        s14 += v * w14[k]
        s15 += v * w15[k]
    acc[a, 0], acc[a, 1], acc[a, 2], acc[a, 3] = s0, s1, s2, s3
    acc[a, 4], acc[a, 5], acc[a, 6], acc[a, 7] = s4, s5, s6, s7
    acc[a, 8], acc[a, 9], acc[a, 10], acc[a, 11] = s8, s9, s10, s11
    acc[a, 12], acc[a, 13], acc[a, 14], acc[a, 15] = s12, s13, s14, s15


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _widen_rows(blocks: Any, ids: Any, kind: int, k_in: int, out: Any) -> None:  # pragma: no cover
    # out[i] = row ids[i] of the quantized matrix, as float32 (embedding lookup)
    for i in prange(ids.shape[0]):
        row = blocks[ids[i]]
        for c in range(0, k_in, _CHUNK):
            kc = min(_CHUNK, k_in - c)
            _widen_span(kind, row, c, kc, out[i, c : c + kc])


# --- public API ----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A 2-D weight ``[rows, cols]`` kept as its GGUF blocks.

    ``blocks`` is ``uint8 (rows, cols / block values * block bytes)``, often a
    read-only memory map of the file. ``shape`` is the logical shape, so the
    model checks it like any checkpoint tensor.
    """

    qtype: QuantType
    shape: tuple[int, int]
    blocks: np.ndarray

    def __post_init__(self) -> None:
        rows, cols = self.shape
        bv, bb = self.qtype.block_values, self.qtype.block_bytes
        if cols % bv:
            raise ValueError(f"{self.qtype.name}: {cols} columns are not whole blocks of {bv}")
        want = (rows, cols // bv * bb)
        if self.blocks.dtype != np.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(
                f"{self.qtype.name} blocks of a {rows}x{cols} weight must be uint8 {want}, "
                f"got {self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def ndim(self) -> int:
        return 2

    @property
    def data(self) -> np.ndarray:
        """The bytes a product streams (as ``PreparedWeight.data``)."""
        return self.blocks

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def __getitem__(self, ids: Any) -> np.ndarray:
        """Rows ``ids`` (an integer array) widened to float32: only those rows are read."""
        idx = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"row index outside 0..{self.shape[0] - 1}")
        out = np.empty((idx.size, self.shape[1]), np.float32)
        if idx.size:
            _widen_rows(self.blocks, idx, int(self.qtype), self.shape[1], out)
        return out.reshape((*np.shape(ids), self.shape[1]))

    def dequantize(self) -> np.ndarray:
        """The whole weight as float32 (tests and tools; the forward never calls it)."""
        return self[np.arange(self.shape[0])]

    def take_rows(self, order: np.ndarray) -> QuantizedTensor:
        """The same weight with its rows reordered (a row is a run of whole blocks)."""
        return QuantizedTensor(self.qtype, self.shape, np.ascontiguousarray(self.blocks[order]))


@dataclass(frozen=True, eq=False)
class QuantizedStack:
    """Quantized weights of different types stacked along the output axis.

    A Q4_K_M file stores ``attn_v`` in Q6_K beside a Q4_K ``attn_q``: the fused
    q/k/v product then runs one kernel call per part, each into its columns.
    """

    parts: tuple[QuantizedTensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def data(self) -> np.ndarray:
        return self.parts[0].blocks

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts], axis=0)


Quantized = QuantizedTensor | QuantizedStack


def stack_rows(parts: list[Any]) -> QuantizedTensor | QuantizedStack:
    """Quantized weights stacked along the output axis (fused q/k/v, gate/up).

    Parts of one type become one tensor (one kernel call); mixed types a
    :class:`QuantizedStack`. Every part must be quantized and of one width.
    """
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        kinds = ", ".join(
            p.qtype.name if isinstance(p, QuantizedTensor) else str(p.dtype) for p in parts
        )
        raise ValueError(f"weights multiplied as one must all be quantized, got {kinds}")
    cols = parts[0].shape[1]
    if any(p.shape[1] != cols for p in parts):
        raise ValueError("weights multiplied as one must have one width")
    if any(p.qtype != parts[0].qtype for p in parts):
        return QuantizedStack(tuple(parts))
    blocks = np.concatenate([p.blocks for p in parts], axis=0)
    return QuantizedTensor(parts[0].qtype, (blocks.shape[0], cols), blocks)


def quantize(w: np.ndarray, qtype: QuantType) -> QuantizedTensor:
    """Quantize a float ``[out, in]`` weight with the ``gguf`` package's own code.

    ``gguf`` quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (bit for bit as
    llama.cpp does); it has no K-quant quantizer, so those are refused.
    """
    from gguf import GGMLQuantizationType
    from gguf import quantize as gguf_quantize

    if qtype >= QuantType.Q4_K:
        raise ValueError(f"quantizing to {qtype.name} is not supported (only to Q8_0, Q4_0 ...)")
    if w.ndim != 2 or w.shape[1] % qtype.block_values:
        raise ValueError(
            f"{qtype.name} needs a 2-D weight whose rows are whole blocks of "
            f"{qtype.block_values}, got shape {w.shape}"
        )
    blocks = gguf_quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType(int(qtype)))
    return QuantizedTensor(qtype, (int(w.shape[0]), int(w.shape[1])), blocks)


def block_rows(n_out: int, n_threads: int) -> int:
    """Weight rows per parallel block: a multiple of 16, about 8 blocks per thread."""
    target = max(_GROUP, -(-n_out // (8 * n_threads)))
    return -(-min(target, _BLOCK_ROWS_MAX) // _GROUP) * _GROUP


def linear(x: np.ndarray, w: QuantizedTensor | QuantizedStack, out: np.ndarray) -> np.ndarray:
    """``out[:] = x @ W.T`` in float32, computed from the blocks. ``out`` is ``(n, out)``.

    The caller (``matmul.linear``) has checked the shapes and dtypes.
    """
    if isinstance(w, QuantizedStack):
        j = 0
        for part in w.parts:
            # through a contiguous temporary: a column range of `out` would be a
            # strided array, and numba compiles the kernel once more for that layout
            out[:, j : j + part.shape[0]] = linear(
                x, part, np.empty((x.shape[0], part.shape[0]), np.float32)
            )
            j += part.shape[0]
        return out
    if x.shape[0]:
        _quant_matmul(
            np.ascontiguousarray(x),
            w.blocks,
            int(w.qtype),
            w.shape[1],
            out,
            block_rows(w.shape[0], numba.get_num_threads()),
        )
    return out


class QuantizingSource:
    """A TensorSource quantizing a checkpoint's matrices as they are read (``--quantize``).

    Every 2-D tensor whose rows are whole blocks (the projections, the
    embedding, an untied head) comes back quantized; norms and biases, and a
    matrix whose width is not a multiple of 32, come back as they are.
    """

    def __init__(self, inner: Any, qtype: str | QuantType) -> None:
        if isinstance(qtype, str):
            names = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0}
            if qtype.lower() not in names:
                raise ValueError(f"--quantize must be one of {', '.join(names)}, got {qtype!r}")
            qtype = names[qtype.lower()]
        self.inner = inner
        self.qtype = qtype

    def where(self, key: str) -> str:
        return str(self.inner.where(key))

    def get_tensor(self, key: str) -> Any:
        arr = self.inner.get_tensor(key)
        if arr.ndim != 2 or arr.shape[1] % self.qtype.block_values:
            return arr
        if arr.dtype == np.uint16:  # bfloat16 bits
            arr = (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return quantize(arr, self.qtype)


def warm_up() -> None:
    """Compile (or load from numba's cache) the product and the row lookup once."""
    w = quantize(np.zeros((4, 32), np.float32), QuantType.Q8_0)
    linear(np.zeros((1, 32), np.float32), w, np.empty((1, 4), np.float32))
    w[np.zeros(1, np.int64)]
