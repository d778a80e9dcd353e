"""Quantized weights times int8 activations: integer dot products (VNNI).

:mod:`triollm.model.quant` widens every quantized weight to float32 and
multiplies it into float32 activations: sixteen multiply-adds per AVX-512
instruction. This module does what llama.cpp does instead: it quantizes the
*activations* to int8, block by block, and multiplies the weights' small
integers into them with ``vpdpbusd`` (thirty-two 8-bit multiply-adds, summed
four by four into eight int32 lanes, per 256-bit instruction) or, for the
K-quants, ``vpmaddubsw`` + ``vpdpwssd`` (64 values and the sub-block scales
in two 512-bit instructions). Scales stay float32 and are applied once per
block of 32 (once per super-block of 256 for the K-quants).

Theory of operation
-------------------
1. **Activations, per row and block** (:func:`quantize_rows`). For the
   32-value types a row of ``x`` is cut into blocks of 32, for the K-quants
   into blocks of 256; each block gets ``d = max|x| / 127`` and
   ``q = rint(x * (127 / max|x|))`` in -127..127 (never -128, so a negated
   value always fits), plus the int32 sum of every 16 consecutive ``q``
   (what the weights' offsets and mins need). A row's quantization reads
   that row alone: the batch around it changes nothing (batch invariance).
   One quantization of ``x`` serves every weight row of a product, and the
   forward fuses q/k/v and gate/up into one product each, so each
   normalised ``x`` is quantized once per layer and product kind.
2. **Unsigned weights, signed activations.** ``vpdpbusd`` multiplies
   *unsigned* bytes by *signed* ones. Every weight type's integer is made
   unsigned with a fixed offset: ``w = d * (u - off)`` with ``u`` a nibble
   (Q4_0, off 8), five bits (Q5_0, off 16), six bits (Q6_K, off 32) or the
   int8 with its top bit flipped (Q8_0, ``u = q ^ 0x80``, off 128); the
   types with a min (Q4_1, Q5_1, Q4_K, Q5_K) have ``u >= 0`` already and
   off 0. Then ``sum (u - off) * x = sum u * x - off * sum x``, and
   ``sum x`` is the activation block sum computed once in step 1. Why the
   weights and not ``x + 128``: the correction would then need the sum of
   each *weight* block, recomputed inside the hot loop for every weight
   row, where ``sum x`` is computed once per row of ``x`` and reused by all
   of them.
3. **The tile** (:func:`_int8_tile_function`, LLVM IR like quant.py's): a
   tile of weight rows meets a tile of ``x`` rows; each weight block is
   unpacked to unsigned bytes once, in registers, and multiplied into every
   ``x`` row of the tile. 32-value types keep one 8-lane float32
   accumulator per (x row, weight row): per block,
   ``acc = acc + float(isum) * (dw * dx)`` (+ the min term), where ``isum``
   are the eight int32 lanes of one ``vpdpbusd`` started from the offset
   correction. K-quants keep 16 int32 lanes per super-block
   (``vpdpwssd`` multiplies each pair sum by its sub-block scale) and fold
   them into 16 float32 lanes once per 256 values. A prefill's rows are
   walked in chunks of 64 (``_X_CHUNK``) so each chunk of ``x`` stays in L2. The lanes are summed in
   one fixed pairwise order at the end.
4. **Same bits everywhere.** Integer sums are exact (their bounds are
   checked in the comments where they are formed), floats are multiplied
   then added, unfused, in a fixed order: the VNNI instructions and the
   portable IR (plain integer multiplies and adds, which LLVM lowers to what
   the CPU has) give the same bits, a row gives the same bits whatever tile
   it lands in, and ``tests/model/test_quant_int8.py`` recomputes every
   lane in plain numpy and gets the same bits too.

Hazards
-------
- ``vpmaddubsw`` saturates its int16 pair sums; the K-quants' unsigned
  values stay <= 63 and ``|q| <= 127``, so a pair is at most 16002 and never
  saturates. Q8_0's ``u`` reaches 255, so it goes through ``vpdpbusd``
  (int32 lanes) instead.
- Results differ from the float32-activation path (``exact_activations``)
  by the activation rounding: 0.5-0.8% relative per product, 1-3% of a
  model's logits, measured in ``docs/engine.md``; the conformance suite
  runs the exact path.
- A K-quant's offset (Q6_K) and mins are subtracted in float32, once per 16
  values (``c_t[i] * dx * sum``), not in integers: one multiply per (x row,
  weight row) instead of an int32 multiply, a convert and a scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)

# type ids (quant.QuantType), compile-time constants for numba
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q4_K, _Q5_K, _Q6_K = 12, 13, 14
INT8_TYPES = (_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K)
_BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)}
_BLOCK.update({12: (256, 144), 13: (256, 176), 14: (256, 210)})
SUM_VALUES = 16  # activation values per stored int32 sum


# --- activations, quantized per row and block -------------------------------------


@dataclass(frozen=True)
class Int8Rows:
    """Rows of ``x`` quantized per block: ``x ~ q * d``, block by block.

    ``q`` int8 ``(n, k)`` in -127..127; ``d`` float32 ``(n, k / block)``;
    ``sums`` int32 ``(n, k / 16)``: the sum of each 16 consecutive ``q``.
    """

    q: np.ndarray
    d: np.ndarray
    sums: np.ndarray
    block: int


@njit(cache=True, nogil=True, parallel=True)
def _quantize_rows(x: Any, block: int, q: Any, d: Any, sums: Any) -> None:  # pragma: no cover
    # float32 throughout (np.float32 constants: a Python float would promote to float64)
    n, k = x.shape
    top = np.float32(127.0)
    for r in prange(n):
        for b in range(k // block):
            amax = np.float32(0.0)
            for i in range(b * block, (b + 1) * block):
                a = abs(x[r, i])
                if a > amax:
                    amax = a
            d[r, b] = amax / top
            inv = top / amax if amax > 0 else np.float32(0.0)
            for i in range(b * block, (b + 1) * block):
                v = np.rint(x[r, i] * inv)  # |v| <= 127 (+ rounding), clamped below
                q[r, i] = np.int8(min(max(v, -top), top))
        for g in range(k // SUM_VALUES):
            s = 0
            for i in range(g * SUM_VALUES, (g + 1) * SUM_VALUES):
                s += int(q[r, i])  # at most 16 * 127
            sums[r, g] = s


def quantize_rows(x: np.ndarray, block: int) -> Int8Rows:
    """``x`` float32 ``(n, k)`` quantized per block of ``block`` (32 or 256) values."""
    n, k = x.shape
    if k % block:
        raise ValueError(f"rows of {k} values are not whole blocks of {block}")
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // block), np.float32)
    sums = np.empty((n, k // SUM_VALUES), np.int32)
    if n:
        _quantize_rows(np.ascontiguousarray(x, np.float32), block, q, d, sums)
    return Int8Rows(q, d, sums, block)


def activation_block(kind: int) -> int:
    """The activation block a weight type pairs with: 32, or 256 for the K-quants."""
    return _BLOCK[kind][0]


# --- LLVM IR ----------------------------------------------------------------------

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(w) for w in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()


def _vec(t: Any, n: int) -> Any:
    return ir.VectorType(t, n)


def _const(t: Any, n: int, values: Any) -> Any:
    vals = list(values) if hasattr(values, "__iter__") else [values] * n
    return ir.Constant(_vec(t, n), vals)


def _splat(b: Any, value: Any, n: int) -> Any:
    undef = ir.Constant(_vec(value.type, n), ir.Undefined)
    one = b.insert_element(undef, value, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, undef, _const(_I32, n, 0))


def _spread(b: Any, scalars: list[Any], each: int) -> Any:
    """A vector holding ``scalars[0]`` ``each`` times, then ``scalars[1]`` ... (in order)."""
    t = scalars[0].type
    v = ir.Constant(_vec(t, len(scalars)), ir.Undefined)
    for i, s in enumerate(scalars):
        v = b.insert_element(v, s, ir.Constant(_I32, i))
    mask = _const(_I32, len(scalars) * each, [i // each for i in range(len(scalars) * each)])
    return b.shuffle_vector(v, v, mask)


def _ptr(b: Any, base: Any, offset: Any, ty: Any) -> Any:
    """A ``ty*`` at byte ``offset`` (an i64) of ``base``."""
    p = b.gep(b.bitcast(base, _I8.as_pointer()), [offset])
    return b.bitcast(p, ty.as_pointer())


def _intrinsic(b: Any, name: str, ret: Any, args: list[Any]) -> Any:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return b.call(cgutils.get_or_insert_function(b.module, fnty, name), args)


def _join(b: Any, lo: Any, hi: Any) -> Any:
    """Two byte vectors of one width, one after the other (twice the width)."""
    n = lo.type.count
    return b.shuffle_vector(lo, hi, _const(_I32, 2 * n, range(2 * n)))


def _bits(b: Any, v: Any, shift: int, mask: int) -> Any:
    """``(v >> shift) & mask`` bytewise (one shift for the whole vector: cheap on x86)."""
    n = v.type.count
    if shift:
        v = b.lshr(v, _const(_I8, n, shift))
    return b.and_(v, _const(_I8, n, mask))


class _Ops:
    """The integer products: the x86 instructions, or portable IR with the same bits."""

    def __init__(self, b: Any, vnni: bool) -> None:
        self.b, self.vnni = b, vnni

    def busd(self, acc: Any, u: Any, x: Any) -> Any:
        """``acc[l] + sum_k u[4l + k] * x[4l + k]``: acc <8 x i32>; u, x <32 x i8>.

        ``u`` is read unsigned, ``x`` signed.

        Bound: 4 * 255 * 127 per call, exact in int32 (vpdpbusd does not saturate).
        """
        b = self.b
        if self.vnni:
            return _intrinsic(b, "llvm.x86.avx512.vpdpbusd.256", acc.type, [acc, u, x])
        p = b.mul(b.zext(u, _vec(_I32, 32)), b.sext(x, _vec(_I32, 32)))
        part = [b.shuffle_vector(p, p, _const(_I32, 8, range(k, 32, 4))) for k in range(4)]
        return b.add(acc, b.add(b.add(part[0], part[1]), b.add(part[2], part[3])))

    def pairs(self, u: Any, x: Any) -> Any:
        """``u[2p] * x[2p] + u[2p + 1] * x[2p + 1]`` as <32 x i16> (vpmaddubsw).

        Hazard: the instruction saturates; callers keep ``u <= 63`` (|pair| <= 16002).
        """
        b = self.b
        if self.vnni:
            return _intrinsic(b, "llvm.x86.avx512.pmaddubs.w.512", _vec(_I16, 32), [u, x])
        p = b.mul(b.zext(u, _vec(_I32, 64)), b.sext(x, _vec(_I32, 64)))
        even = b.shuffle_vector(p, p, _const(_I32, 32, range(0, 64, 2)))
        odd = b.shuffle_vector(p, p, _const(_I32, 32, range(1, 64, 2)))
        return b.trunc(b.add(even, odd), _vec(_I16, 32))

    def wssd(self, acc: Any, a: Any, s: Any) -> Any:
        """``acc[l] + a[2l] * s[2l] + a[2l + 1] * s[2l + 1]``: <32 x i16> pairs into <16 x i32>."""
        b = self.b
        if self.vnni:
            return _intrinsic(b, "llvm.x86.avx512.vpdpwssd.512", acc.type, [acc, a, s])
        p = b.mul(b.sext(a, _vec(_I32, 32)), b.sext(s, _vec(_I32, 32)))
        even = b.shuffle_vector(p, p, _const(_I32, 16, range(0, 32, 2)))
        odd = b.shuffle_vector(p, p, _const(_I32, 16, range(1, 32, 2)))
        return b.add(acc, b.add(even, odd))


def _can_vnni(context: Any) -> bool:
    """Whether numba's target has AVX512-VNNI with BW and VL (else the portable IR).

    Hazard: the target features are a private attribute; without it the
    portable IR runs (the same bits, slower).
    """
    feats = getattr(context.codegen(), "_tm_features", "")
    return all(f"+{f}" in feats for f in ("avx512vnni", "avx512bw", "avx512vl"))


class _WBlock:
    """The bytes of one weight block as IR values (scalars read once)."""

    def __init__(self, b: Any, row: Any, start: Any) -> None:
        self.b, self.row, self.start = b, row, start
        self._memo: dict[tuple[str, int], Any] = {}

    def at(self, k: int, ty: Any) -> Any:
        return _ptr(self.b, self.row, self.b.add(self.start, ir.Constant(_I64, k)), ty)

    def load(self, k: int, ty: Any) -> Any:
        return self.b.load(self.at(k, ty), align=1)

    def byte(self, k: int) -> Any:
        key = ("byte", k)
        if key not in self._memo:
            self._memo[key] = self.b.zext(self.load(k, _I8), _I32)
        return self._memo[key]

    def half(self, k: int) -> Any:
        """The little-endian float16 at byte k, as float32."""
        key = ("half", k)
        if key not in self._memo:
            bits = self.load(k, _I16)
            self._memo[key] = self.b.fpext(self.b.bitcast(bits, ir.HalfType()), _F32)
        return self._memo[key]

    def k_scale_min(self, j: int) -> tuple[Any, Any]:
        """Q4_K/Q5_K: sub-block j's 6-bit scale and min, as i32 (layout: quant.py)."""
        b, c = self.b, (lambda v: ir.Constant(_I32, v))
        if j < 4:
            return b.and_(self.byte(4 + j), c(63)), b.and_(self.byte(8 + j), c(63))
        top_sc = b.shl(b.lshr(self.byte(j), c(6)), c(4))
        top_m = b.shl(b.lshr(self.byte(4 + j), c(6)), c(4))
        sc = b.or_(b.and_(self.byte(8 + j), c(15)), top_sc)
        return sc, b.or_(b.lshr(self.byte(8 + j), c(4)), top_m)


def _small_unsigned(kind: int, w: _WBlock) -> Any:
    """A 32-value block's weights as unsigned bytes ``u`` (<32 x i8>).

    ``w = d * (u - off)`` (``+ m`` for the types with a min).
    """
    b = w.b
    if kind == _Q8_0:  # int8 q at byte 2: u = q + 128, the top bit flipped
        return b.xor(w.load(2, _vec(_I8, 32)), _const(_I8, 32, 0x80))
    with_min, five = kind in (_Q4_1, _Q5_1), kind in (_Q5_0, _Q5_1)
    qh = 4 if with_min else 2
    qs = qh + 4 if five else qh
    # 16 bytes: low nibbles are values 0-15, high nibbles 16-31
    v = w.load(qs, _vec(_I8, 16))
    u = _join(b, _bits(b, v, 0, 15), _bits(b, v, 4, 15))
    if five:  # bit i of the little-endian word qh is value i's fifth bit
        bits = b.bitcast(w.load(qh, _I32), _vec(_I1, 32))
        u = b.or_(u, b.shl(b.zext(bits, _vec(_I8, 32)), _const(_I8, 32, 4)))
    return u


_OFFSET = {_Q4_0: 8, _Q5_0: 16, _Q8_0: 128, _Q4_1: 0, _Q5_1: 0}


def _k_chunk(kind: int, w: _WBlock, g: int) -> tuple[Any, Any]:
    """Values 64 g .. 64 g + 63 of a K-quant super-block: (u <64 x i8>, scales <32 x i16>).

    Scale lane p belongs to values 2p and 2p + 1 of the chunk (the pair
    ``vpmaddubsw`` sums).
    """
    b = w.b
    if kind in (_Q4_K, _Q5_K):
        # 32 bytes per pair of sub-blocks: low nibbles sub-block 2g, high 2g + 1
        qs = 16 if kind == _Q4_K else 48
        v = w.load(qs + 32 * g, _vec(_I8, 32))
        u = _join(b, _bits(b, v, 0, 15), _bits(b, v, 4, 15))
        if kind == _Q5_K:  # bit j of byte i (of 32 at byte 16): sub-block j's value i, bit 4
            h = w.load(16, _vec(_I8, 32))
            h = _join(b, _bits(b, h, 2 * g, 1), _bits(b, h, 2 * g + 1, 1))
            u = b.or_(u, b.shl(h, _const(_I8, 64, 4)))
        scales = [b.trunc(w.k_scale_min(j)[0], _I16) for j in (2 * g, 2 * g + 1)]
        return u, _spread(b, scales, 16)
    # Q6_K: chunk g = half h = g // 2, groups t = 2 (g % 2) and + 1 (32 values each):
    # low nibbles of bytes 64 h .. 64 h + 63 (shift 4 for t >= 2), two high bits
    # (bits 2t) of bytes 128 + 32 h .., sub-blocks of 16 4g .. 4g + 3
    h, t0 = g // 2, 2 * (g % 2)
    low = _bits(b, w.load(64 * h, _vec(_I8, 64)), 4 * (g % 2), 15)
    hi = w.load(128 + 32 * h, _vec(_I8, 32))
    hi = _join(b, _bits(b, hi, 2 * t0, 3), _bits(b, hi, 2 * t0 + 2, 3))
    u = b.or_(low, b.shl(hi, _const(_I8, 64, 4)))
    sc = b.sext(w.load(192 + 4 * g, _vec(_I8, 4)), _vec(_I16, 4))
    return u, b.shuffle_vector(sc, sc, _const(_I32, 32, [p // 8 for p in range(32)]))


def _sum_lanes(b: Any, v: Any) -> Any:
    """The lanes of ``v`` added pairwise in one fixed order (half + half, ...)."""
    width = v.type.count
    while width > 1:
        width //= 2
        lo = b.shuffle_vector(v, v, _const(_I32, width, range(width)))
        hi = b.shuffle_vector(v, v, _const(_I32, width, range(width, 2 * width)))
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(_I32, 0))


def _int8_tile_function(module: Any, K: int, T: int, R: int, vnni: bool) -> Any:
    """The LLVM function of one (type K, T weight rows, R x rows) int8 tile."""
    i8p = _I8.as_pointer()
    i64 = _I64
    fnty = ir.FunctionType(
        ir.VoidType(),
        [i8p, i64, i64, i8p, i64, i8p, i64, i8p, i64, i64, i64, i64, i64, _F32.as_pointer()],
    )
    name = f"triollm_int8_tile_{K}_{T}x{R}_{'vnni' if vnni else 'portable'}"
    fn = cgutils.get_or_insert_function(module, fnty, name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # as quant.py's tiles: inlined, LLVM spilled accumulators
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    xq, xq_s, k_in, xd, xd_s, xs, xs_s, w, w_s, r0, last, j0, e, out = fn.args
    ops = _Ops(b, vnni)
    values, nbytes = _BLOCK[K]
    kq = K >= _Q4_K
    lanes = 16 if kq else 8

    def row(base: Any, stride: Any, first: Any, i: int, end: Any) -> Any:
        idx = b.add(first, ir.Constant(i64, i))
        idx = b.select(b.icmp_signed("<", idx, end), idx, end)
        return _ptr(b, base, b.mul(idx, stride), _I8)

    xqr = [row(xq, xq_s, r0, r, last) for r in range(R)]
    xdr = [row(xd, xd_s, r0, r, last) for r in range(R)]
    xsr = [row(xs, xs_s, r0, r, last) for r in range(R)]
    wr = [row(w, w_s, j0, t, e) for t in range(T)]
    accs = [[cgutils.alloca_once(b, _vec(_F32, lanes)) for _ in range(T)] for _ in range(R)]
    for a in (a for ra in accs for a in ra):
        b.store(ir.Constant(_vec(_F32, lanes), None), a)
    zero_i = ir.Constant(_vec(_I32, lanes), None)
    zero_f = ir.Constant(_vec(_F32, lanes), None)

    def c64(v: int) -> Any:
        return ir.Constant(i64, v)

    with cgutils.for_range(b, b.udiv(k_in, c64(values))) as loop:
        bi = loop.index
        wstart = b.mul(bi, c64(nbytes))
        blocks = [_WBlock(b, wr[t], wstart) for t in range(T)]
        dx = [b.load(_ptr(b, xdr[r], b.mul(bi, c64(4)), _F32)) for r in range(R)]
        xoff = b.mul(bi, c64(values))  # byte offset of the block in a q row
        soff = b.mul(bi, c64(values // SUM_VALUES * 4))  # ... and of its sums

        def xvec(r: int, g: int, n: int) -> Any:
            return b.load(_ptr(b, xqr[r], b.add(xoff, c64(n * g)), _vec(_I8, n)), align=1)

        if not kq:
            off = _OFFSET[K]
            # the block's sum of x (two stored sums of 16): |sum| <= 32 * 127
            xsum = []
            for r in range(R):
                two = b.load(_ptr(b, xsr[r], soff, _vec(_I32, 2)), align=4)
                xsum.append(
                    b.add(
                        b.extract_element(two, ir.Constant(_I32, 0)),
                        b.extract_element(two, ir.Constant(_I32, 1)),
                    )
                )
            # the offset correction rides in lane 0 of vpdpbusd's start value
            start = [
                b.insert_element(
                    zero_i, b.mul(xsum[r], ir.Constant(_I32, -off)), ir.Constant(_I32, 0)
                )
                for r in range(R)
            ]
            mx = [b.fmul(dx[r], b.sitofp(xsum[r], _F32)) for r in range(R)]  # dx * sum q
            xv = [xvec(r, 0, 32) for r in range(R)]
            for t in range(T):
                u = _small_unsigned(K, blocks[t])
                dw = blocks[t].half(0)
                for r in range(R):
                    isum = ops.busd(
                        start[r], u, xv[r]
                    )  # lanes: 4 * 255 * 127 + 32 * 127 * 128 at most
                    scale = _splat(b, b.fmul(dw, dx[r]), lanes)
                    acc = b.fadd(
                        b.load(accs[r][t]), b.fmul(b.sitofp(isum, _vec(_F32, lanes)), scale)
                    )
                    if off == 0:  # + m * dx * sum q, in lane 0
                        m = b.fmul(blocks[t].half(2), mx[r])
                        acc = b.fadd(acc, b.insert_element(zero_f, m, ir.Constant(_I32, 0)))
                    b.store(acc, accs[r][t])
        else:
            # the offset/min correction in float32 lanes, one per 16 values:
            # c_t[i] * (dx * sum of x over those 16), c_t per weight row (shared by
            # every x row), the sums' lanes per x row (shared by every weight row)
            xcorr = []
            for r in range(R):
                sums = b.load(_ptr(b, xsr[r], soff, _vec(_I32, 16)), align=4)
                xcorr.append(b.fmul(b.sitofp(sums, _vec(_F32, 16)), _splat(b, dx[r], 16)))
            for t in range(T):
                blk = blocks[t]
                chunks = [_k_chunk(K, blk, g) for g in range(4)]
                if K == _Q6_K:  # offset 32: c[i] = sc_i * (32 d), 32 d exact (a power of two)
                    d = blk.half(208)
                    sc16 = b.sitofp(blk.load(192, _vec(_I8, 16)), _vec(_F32, 16))
                    wcorr = b.fmul(sc16, _splat(b, b.fmul(d, ir.Constant(_F32, 32.0)), 16))
                else:  # the mins: c[i] = m_j * dmin for both sums of 16 of sub-block j
                    d = blk.half(0)
                    mins = _spread(b, [blk.k_scale_min(j)[1] for j in range(8)], 2)
                    wcorr = b.fmul(b.sitofp(mins, _vec(_F32, 16)), _splat(b, blk.half(2), 16))
                for r in range(R):
                    iacc = zero_i
                    for g, (u, sc) in enumerate(chunks):
                        iacc = ops.wssd(iacc, ops.pairs(u, xvec(r, g, 64)), sc)
                    scale = _splat(b, b.fmul(d, dx[r]), lanes)
                    main = b.fmul(b.sitofp(iacc, _vec(_F32, lanes)), scale)
                    acc = b.fsub(b.fadd(b.load(accs[r][t]), main), b.fmul(wcorr, xcorr[r]))
                    b.store(acc, accs[r][t])
    for r in range(R):
        for t in range(T):
            total = _sum_lanes(b, b.load(accs[r][t]))
            b.store(total, b.gep(out, [ir.Constant(i64, r * T + t)]))
    b.ret_void()
    return fn


def _literal(t: Any) -> int | None:
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


@intrinsic(prefer_literal=True)
def _int8_tile(typingctx, kind, n_w, n_x, portable, xq, xd, xs, blocks, r0, last, j0, e, res):  # type: ignore[no-untyped-def]
    """``res[r * n_w + t] = x[r0 + r] . W[j0 + t]`` from int8 rows: one tile (quant.py's _tile)."""
    T, R, P = _literal(n_w), _literal(n_x), _literal(portable)
    if T is None or R is None or P is None:
        return None
    intp = types.intp
    sig = types.void(intp, n_w, n_x, portable, xq, xd, xs, blocks, intp, intp, intp, intp, res)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args

        def arr(i: int) -> Any:
            return context.make_array(a[i])(context, builder, args[i])

        def base_stride(i: int) -> list[Any]:
            ary = arr(i)
            return [
                builder.bitcast(ary.data, _I8.as_pointer()),
                cgutils.unpack_tuple(builder, ary.strides)[0],
            ]

        q = arr(4)
        call = [
            *base_stride(4),
            cgutils.unpack_tuple(builder, q.shape)[1],
            *base_stride(5),
            *base_stride(6),
            *base_stride(7),
            *args[8:12],
            builder.bitcast(arr(12).data, _F32.as_pointer()),
        ]
        vnni = _can_vnni(context) and not P
        end = builder.append_basic_block("type.end")
        switch = builder.switch(args[0], end)
        for K in INT8_TYPES:
            case = builder.append_basic_block(f"type.{K}")
            switch.add_case(ir.Constant(_I64, K), case)
            builder.position_at_end(case)
            builder.call(_int8_tile_function(builder.module, K, T, R, vnni), call)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return sig, codegen


# Tile shapes (weight rows, x rows) by row count, as quant.py's: one row takes
# sixteen weight rows, up to four rows 4 x 4, more 2 x 8.
_ONE_W, _ONE_X = 16, 1
_FEW_W, _FEW_X = 4, 4
_MANY_W, _MANY_X = 2, 8
# x rows per pass over a thread's weight rows: a prefill's x (512 rows of 8960
# int8 = 4.6 MB) does not stay in L2 while every pair of weight rows passes over
# it; 64 rows of x (<= 574 KB) and the thread's weight block (<= 256 rows) do.
# Any chunking gives the same bits: each row's tile computes the same.
_X_CHUNK = 64


@njit(inline="always")
def _tile_shape(n: int) -> tuple[int, int]:  # pragma: no cover - numba
    if n == 1:
        return _ONE_W, _ONE_X
    if n <= _FEW_X:
        return _FEW_W, _FEW_X
    return _MANY_W, _MANY_X


@njit(inline="always")
def _tile_of(kind, n, q, d, s, blocks, r0, g, e, res):  # type: ignore[no-untyped-def]  # pragma: no cover
    # the VNNI tile of _tile_shape(n) (its shape must be compile-time constants)
    if n == 1:
        _int8_tile(kind, _ONE_W, _ONE_X, 0, q, d, s, blocks, r0, n - 1, g, e, res)
    elif n <= _FEW_X:
        _int8_tile(kind, _FEW_W, _FEW_X, 0, q, d, s, blocks, r0, n - 1, g, e, res)
    else:
        _int8_tile(kind, _MANY_W, _MANY_X, 0, q, d, s, blocks, r0, n - 1, g, e, res)


@njit(inline="always")
def _portable_tile_of(kind, n, q, d, s, blocks, r0, g, e, res):  # type: ignore[no-untyped-def]  # pragma: no cover
    # the same with the portable integer IR (tests: the same bits)
    if n == 1:
        _int8_tile(kind, _ONE_W, _ONE_X, 1, q, d, s, blocks, r0, n - 1, g, e, res)
    elif n <= _FEW_X:
        _int8_tile(kind, _FEW_W, _FEW_X, 1, q, d, s, blocks, r0, n - 1, g, e, res)
    else:
        _int8_tile(kind, _MANY_W, _MANY_X, 1, q, d, s, blocks, r0, n - 1, g, e, res)


@njit(cache=True, nogil=True, parallel=True)
def _int8_matmul(q, d, s, blocks, kind, out, block):  # type: ignore[no-untyped-def]  # pragma: no cover
    # q (n, k) int8, d (n, k / block values) float32, s (n, k / 16) int32;
    # blocks (n_out, bytes per row) uint8; out (n, n_out) float32. As
    # quant._quant_matmul: threads split the weight rows, each group of weight
    # rows meets every tile of a chunk of x rows while its bytes sit in L1.
    n = q.shape[0]
    n_out = blocks.shape[0]
    nw, nx = _tile_shape(n)
    for blk in prange((n_out + block - 1) // block):
        j0 = blk * block
        j1 = min(j0 + block, n_out)
        res = np.empty(nw * nx, np.float32)
        for c0 in range(0, n, _X_CHUNK):
            for g in range(j0, j1, nw):
                for r0 in range(c0, min(c0 + _X_CHUNK, n), nx):
                    _tile_of(kind, n, q, d, s, blocks, r0, g, j1 - 1, res)
                    for r in range(min(nx, n - r0)):
                        for t in range(min(nw, j1 - g)):
                            out[r0 + r, g + t] = res[r * nw + t]


@njit(cache=True, nogil=True, parallel=True)
def _portable_matmul(q, d, s, blocks, kind, out, block):  # type: ignore[no-untyped-def]  # pragma: no cover
    # _int8_matmul with the portable tiles: a function of its own so that the
    # model's product does not compile (and load) both variants
    n = q.shape[0]
    n_out = blocks.shape[0]
    nw, nx = _tile_shape(n)
    for blk in prange((n_out + block - 1) // block):
        j0 = blk * block
        j1 = min(j0 + block, n_out)
        res = np.empty(nw * nx, np.float32)
        for c0 in range(0, n, _X_CHUNK):
            for g in range(j0, j1, nw):
                for r0 in range(c0, min(c0 + _X_CHUNK, n), nx):
                    _portable_tile_of(kind, n, q, d, s, blocks, r0, g, j1 - 1, res)
                    for r in range(min(nx, n - r0)):
                        for t in range(min(nw, j1 - g)):
                            out[r0 + r, g + t] = res[r * nw + t]


def product(
    x: Int8Rows,
    blocks: np.ndarray,
    kind: int,
    out: np.ndarray,
    block_rows: int,
    *,
    portable: bool = False,
) -> np.ndarray:
    """``out[:] = x @ W.T`` for int8 rows ``x`` and the GGUF blocks of a ``kind`` weight.

    ``portable=True`` takes the plain-IR integer products instead of the VNNI
    instructions (the same bits; tests compare the two).
    """
    if x.block != activation_block(kind):
        raise ValueError(f"type {kind} pairs with activation blocks of {activation_block(kind)}")
    if x.q.shape[0]:
        fn = _portable_matmul if portable else _int8_matmul
        fn(x.q, x.d, x.sums, blocks, kind, out, block_rows)
    return out
