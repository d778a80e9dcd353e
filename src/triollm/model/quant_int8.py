"""Quantized weights times int8 activations: integer dot products (VNNI).

:mod:`triollm.model.quant` widens every quantized weight to float32 and
multiplies it into float32 activations: sixteen multiply-adds per AVX-512
instruction. This module does what llama.cpp does instead: it quantizes the
*activations* to int8, block by block, and multiplies the weights' small
integers into them with ``vpdpbusd``: sixty-four 8-bit multiply-adds, summed
four by four into sixteen int32 lanes, per 512-bit instruction. The weights
are read from a layout repacked once at load (:mod:`triollm.model.quant_pack`):
sixteen weight rows interleaved, so that the sixteen lanes are sixteen
weight rows and a block's scales are applied to sixteen rows at once.

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
   normalised ``x`` is quantized once per layer and product kind. A fused
   product is a stack of up to :data:`PARTS` parts of any types (a Q4_K_M
   file's Q6_K v beside Q4_K q and k), multiplied in one kernel call
   (:func:`product_parts`): one parallel region per product.
2. **Unsigned weights, signed activations.** ``vpdpbusd`` multiplies
   *unsigned* bytes by *signed* ones. Every weight type's integer is stored
   unsigned with a fixed offset: ``w = d * (u - off)`` with ``u`` a nibble
   (Q4_0, off 8), five bits (Q5_0, off 16), six bits (Q6_K, off 32) or the
   int8 with its top bit flipped (Q8_0, off 128); the types with a min
   (Q4_1, Q5_1, Q4_K, Q5_K) have ``u >= 0`` already and off 0. Then
   ``sum (u - off) * q = sum u * q - off * sum q``, and ``sum q`` is the
   activation block sum of step 1: one integer per row of ``x``, shared by
   every weight row.
3. **The tile** (:func:`_tile_function`, LLVM IR): one *group* of sixteen
   weight rows meets ``R`` rows of ``x``: 1 for a batch-1 decode; for many
   rows 16 (two halves of eight per record), 8, 4, 1 for the K-quants and 8,
   4, 1 for the others, so that an unpacked vector feeds up to eight
   ``vpdpbusd``; tiles of eight rows and more prefetch the next group's
   records (memory and compute overlap, see ``_PREFETCH_X``).
   Per block, each 64-byte vector of the group's record holds four values
   of each of the sixteen rows; its nibbles are unpacked once, in
   registers, and each ``x`` row's four matching bytes, broadcast to every
   lane, are multiplied in with one ``vpdpbusd``: lane ``t`` accumulates
   weight row ``t``'s dot product, so no lane is ever summed across. The
   32-value types then take, per block and 16 rows: the offset correction
   (an integer), one convert and ``acc += float(isum) * (dw * dx)`` (+ the
   min term). The K-quants multiply each sub-block's integer sum by its
   integer scale (``vpmulld``) and touch floats once per 256 values:
   ``acc += float(I) * (d * dx) - float(M) * (dmin * dx)``, with ``M`` the
   mins times the activation's sub-block sums. A prefill's rows are walked
   in chunks of 64 (``_X_CHUNK``) so each chunk of ``x`` stays in L2.
4. **Same bits everywhere.** Integer sums are exact (their bounds are
   checked in the comments where they are formed), floats are multiplied
   then added, unfused, in one fixed order per lane: the VNNI instruction
   and the portable IR (plain integer multiplies and adds, which LLVM lowers
   to what the CPU has) give the same bits, a row gives the same bits
   whatever tile and position it lands in and whatever the thread count,
   and ``tests/model/test_quant_int8.py`` recomputes every output in plain
   numpy from the GGUF blocks and gets the same bits too.

Hazards
-------
- Results differ from the float32-activation path (``exact_activations``)
  by the activation rounding: 0.5-0.8% relative per product, 1-3% of a
  model's logits, measured in ``docs/engine.md``; the conformance suite
  runs the exact path.
- The int8 product reads the packed copy, not the GGUF bytes: a weight
  repacked at load (``QuantizedTensor.packed``) costs its size once more in
  memory beside the file's mapping (page cache, which the kernel can drop;
  the exact path and the embedding lookup read the mapping).
- ``float(I)`` of a K-quant's integer sum rounds when ``|I| > 2^24``: a
  fixed rounding, the same in the numpy reference.
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
_MANY_TYPES = (_Q4_K, _Q5_K, _Q6_K)  # the types with tiles of sixteen x rows
_EIGHT_TYPES = INT8_TYPES  # the types with tiles of eight x rows: all
SUM_VALUES = 16  # activation values per stored sum
SUM_DTYPE = np.int16  # the sums' type: the tile reads two of them as one 32-bit word


# --- the packed weight layout (quant_pack.py writes it; kept here, see there) -----

ROWS = 16  # weight rows per group: the int32 lanes of one 512-bit vpdpbusd
VECTOR = 64  # bytes per vector: 16 rows x 4 values


@dataclass(frozen=True)
class Layout:
    """Where each field of one group's record sits, for one weight type (offsets in bytes).

    After the scales, the record's *body* is a run of chunks, each the high bits
    (if the type has any) of ``chunk_vectors`` vectors followed by their nibbles
    (or Q8_0's bytes), in the order the tile reads them: one record is read front
    to back as one stream. Hazard: with the high bits in one field and the nibbles
    in another (Q6_K's first layout), the tile read two interleaved streams a
    record apart and the hardware prefetcher followed neither: one thread read
    Q6_K records at 9-10 GB/s from memory against 24 chunked (docs/engine.md).
    """

    values: int  # the activation block: values per record
    sub: int  # values per sub-block scale (= values for the 32-value types)
    offset: int  # w = d * (u - offset): 8, 16, 32, 128, or 0 (the types with a min)
    d: int
    m: int | None  # mins (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
    sc: int | None  # K-quants' sub-block scales
    mn: int | None  # Q4_K/Q5_K's sub-block mins
    body: int  # the first chunk
    chunk_vectors: int  # vectors per chunk (Q5_*: 8, one sub-block of 32; Q6_K: 4, of 16)
    hi_bytes: int  # high-bit bytes opening each chunk: Q5_* 8 a vector, Q6_K 64; else 0
    vector_bytes: int  # low-bit bytes per vector: 32 (two vectors' nibbles share 64), Q8_0 64
    size: int

    @property
    def vectors(self) -> int:
        """64-byte vectors of u per record (four values of sixteen rows each)."""
        return self.values // 4

    @property
    def subs(self) -> int:
        """Sub-blocks per record."""
        return self.values // self.sub

    @property
    def chunk(self) -> int:
        """Bytes per chunk: its high bits, then its nibbles (Q8_0: its bytes)."""
        return self.hi_bytes + self.vector_bytes * self.chunk_vectors

    def _chunk_at(self, c: int) -> int:
        return self.body + (c // self.chunk_vectors) * self.chunk

    def q_at(self, c: int) -> int:
        """The 64 bytes holding vector ``c``'s low bits: its nibbles (low nibbles of
        vector 2p, high of 2p + 1 share 64 bytes), or Q8_0's vector itself."""
        k = c % self.chunk_vectors
        k -= k % (64 // self.vector_bytes)  # the even vector of a nibble pair
        return self._chunk_at(c) + self.hi_bytes + self.vector_bytes * k

    def hi_at(self, c: int) -> int:
        """Vector ``c``'s high bits: the Q5 types' 8 bytes (bit 4r + i: lane byte 4r + i's
        fifth bit), Q6_K's 64 bytes that the chunk's four vectors share."""
        if not self.hi_bytes:  # a tile asking for a field of another type: a bug here
            raise ValueError("this type's record has no high bits")
        per = self.hi_bytes // self.chunk_vectors  # 8 (Q5_*) or 16 (Q6_K: shared)
        return self._chunk_at(c) + (8 * (c % self.chunk_vectors) if per == 8 else 0)


def _layout(kind: int) -> Layout:
    k_quant = kind >= _Q4_K
    values = 256 if k_quant else 32
    sub = {_Q4_K: 32, _Q5_K: 32, _Q6_K: 16}.get(kind, 32)
    subs = values // sub
    at = 0
    d, at = at, at + 2 * ROWS
    m = None
    if kind in (_Q4_1, _Q5_1, _Q4_K, _Q5_K):
        m, at = at, at + 2 * ROWS
    sc = mn = None
    if k_quant:
        sc, at = at, at + ROWS * subs
    if kind in (_Q4_K, _Q5_K):
        mn, at = at, at + ROWS * subs
    vectors = values // 4
    if kind in (_Q5_0, _Q5_1, _Q5_K):  # a chunk per sub-block of 32: 64 + 256 bytes
        cv, hib = 8, 64
    elif kind == _Q6_K:  # a chunk per sub-block of 16: 64 + 128 bytes
        cv, hib = 4, 64
    else:  # Q4_0, Q4_1, Q4_K, Q8_0: no high bits, one chunk
        cv, hib = vectors, 0
    vb = 64 if kind == _Q8_0 else 32
    size = at + (vectors // cv) * (hib + vb * cv)
    offset = {_Q4_0: 8, _Q5_0: 16, _Q8_0: 128, _Q6_K: 32}.get(kind, 0)
    return Layout(values, sub, offset, d, m, sc, mn, at, cv, hib, vb, size)


LAYOUTS = {k: _layout(k) for k in INT8_TYPES}


# --- activations, quantized per row and block -------------------------------------


@dataclass(frozen=True)
class Int8Rows:
    """Rows of ``x`` quantized per block: ``x ~ q * d``, block by block.

    ``q`` int8 ``(n, k)`` in -127..127; ``d`` float32 ``(n, k / block)``;
    ``sums`` int16 ``(n, k / 16)``: the sum of each 16 consecutive ``q``
    (at most 16 * 127 in magnitude). int16 so that two neighbours are one
    32-bit word the tile broadcasts into ``vpdpwssd`` (int16 pairs).
    """

    q: np.ndarray
    d: np.ndarray
    sums: np.ndarray
    block: int


@njit(cache=True, nogil=True)
def _quantize_row(
    x: Any, r: int, block: int, q: Any, d: Any, sums: Any
) -> None:  # pragma: no cover
    # Row r. Both drivers call this one compiled function, so a row's bits do not
    # depend on which one ran it (or on the rows beside it).
    # float32 throughout (np.float32 constants: a Python float would promote to float64)
    k = x.shape[1]
    top = np.float32(127.0)
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
            s += int(q[r, i])  # at most 16 * 127: fits the int16
        sums[r, g] = np.int16(s)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_rows(x: Any, block: int, q: Any, d: Any, sums: Any) -> None:  # pragma: no cover
    for r in prange(x.shape[0]):
        _quantize_row(x, np.int64(r), block, q, d, sums)  # type: ignore[arg-type]  # numba: int64


@njit(cache=True, nogil=True)
def _quantize_rows_serial(
    x: Any, block: int, q: Any, d: Any, sums: Any
) -> None:  # pragma: no cover
    # _quantize_rows on the calling thread: one row (a batch-1 decode step) cannot
    # be split, and a parallel region would wake the other (passive) worker for
    # nothing, once per product (~120 times a SmolLM2 step; docs/engine.md).
    for r in range(x.shape[0]):
        _quantize_row(x, np.int64(r), block, q, d, sums)  # type: ignore[arg-type]  # numba: int64


def row_buffers(n: int, k: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty ``(q, d, sums)`` for ``n`` rows of ``k`` values quantized per ``block``.

    The arrays :func:`quantize_rows` fills and the tiles read: int8 ``(n, k)``,
    float32 ``(n, k / block)``, :data:`SUM_DTYPE` ``(n, k / 16)``. Every maker of
    row buffers calls this one (:func:`quantize_rows`, ``quant._row_buffers``).
    Hazard: buffers made by hand drift from the layout; int32 sums once compiled
    and gave wrong one-row products.
    """
    if k % block:
        raise ValueError(f"rows of {k} values are not whole blocks of {block}")
    return (
        np.empty((n, k), np.int8),
        np.empty((n, k // block), np.float32),
        np.empty((n, k // SUM_VALUES), SUM_DTYPE),
    )


def quantize_rows(x: np.ndarray, block: int) -> Int8Rows:
    """``x`` float32 ``(n, k)`` quantized per block of ``block`` (32 or 256) values."""
    n, k = x.shape
    q, d, sums = row_buffers(n, k, block)
    if n:
        driver = _quantize_rows if n > 1 else _quantize_rows_serial
        driver(np.ascontiguousarray(x, np.float32), block, q, d, sums)
    return Int8Rows(q, d, sums, block)


def activation_block(kind: int) -> int:
    """The activation block a weight type pairs with: 32, or 256 for the K-quants."""
    return LAYOUTS[kind].values


# --- LLVM IR ----------------------------------------------------------------------

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(w) for w in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()
_LANES = ROWS  # int32 / float32 lanes of one vector: one per weight row of a group


def _vec(t: Any, n: int) -> Any:
    return ir.VectorType(t, n)


def _const(t: Any, n: int, values: Any) -> Any:
    vals = list(values) if hasattr(values, "__iter__") else [values] * n
    return ir.Constant(_vec(t, n), vals)


def _splat(b: Any, value: Any, n: int = _LANES) -> Any:
    undef = ir.Constant(_vec(value.type, n), ir.Undefined)
    one = b.insert_element(undef, value, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, undef, _const(_I32, n, 0))


def _ptr(b: Any, base: Any, offset: Any, ty: Any) -> Any:
    """A ``ty*`` at byte ``offset`` (an i64) of ``base``."""
    p = b.gep(b.bitcast(base, _I8.as_pointer()), [offset])
    return b.bitcast(p, ty.as_pointer())


def _intrinsic(b: Any, name: str, ret: Any, args: list[Any]) -> Any:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return b.call(cgutils.get_or_insert_function(b.module, fnty, name), args)


def _busd(b: Any, vnni: bool, acc: Any, u: Any, x: Any) -> Any:
    """``acc[l] + sum_k u[4l + k] * x[4l + k]``: acc <16 x i32>; u, x <64 x i8>.

    ``u`` is read unsigned, ``x`` signed (``vpdpbusd``; it does not saturate).
    The portable IR (plain widening multiplies and adds, which LLVM lowers to
    what the CPU has) gives the same bits: integer sums are exact.
    """
    if vnni:
        return _intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, u, x])
    n = u.type.count
    p = b.mul(b.zext(u, _vec(_I32, n)), b.sext(x, _vec(_I32, n)))
    part = [b.shuffle_vector(p, p, _const(_I32, n // 4, range(k, n, 4))) for k in range(4)]
    return b.add(acc, b.add(b.add(part[0], part[1]), b.add(part[2], part[3])))


def _wssd(b: Any, vnni: bool, acc: Any, a: Any, x: Any) -> Any:
    """``acc[l] + a[2l] * x[2l] + a[2l + 1] * x[2l + 1]``: acc <16 x i32>; a, x <32 x i16>.

    Signed int16 pairs (``vpdpwssd``, part of AVX512-VNNI; it does not
    saturate). The portable IR gives the same bits: integer sums are exact.
    """
    if vnni:
        return _intrinsic(b, "llvm.x86.avx512.vpdpwssd.512", acc.type, [acc, a, x])
    p = b.mul(b.sext(a, _vec(_I32, 32)), b.sext(x, _vec(_I32, 32)))
    part = [b.shuffle_vector(p, p, _const(_I32, 16, range(k, 32, 2))) for k in range(2)]
    return b.add(acc, b.add(part[0], part[1]))


def _can_vnni(context: Any) -> bool:
    """Whether numba's target has AVX512-VNNI with BW (else the portable IR).

    Hazard: the target features are a private attribute; without it the
    portable IR runs (the same bits, slower).
    """
    feats = getattr(context.codegen(), "_tm_features", "")
    return all(f"+{f}" in feats for f in ("avx512vnni", "avx512bw"))


def _shift16(b: Any, op: Any, v: Any, n: int) -> Any:
    """``v`` (<64 x i8>) shifted by ``n`` bits as 16-bit words, for a caller that masks.

    The bits that cross from one byte into its neighbour must fall outside the
    caller's mask (every caller here masks right after: nibbles with 15, Q6_K's
    high bits with 0x30). Why words: x86 has no byte shift, and LLVM lowers a
    byte shift plus mask to ``vgf2p8affineqb``, which runs on the multiply pipes
    beside ``vpdpbusd`` (a Zen 4 fact, docs/engine.md); a word shift and an AND
    do not. The same bytes after the mask, so the same bits.
    """
    w = b.bitcast(v, _vec(_I16, 32))
    return b.bitcast(op(w, _const(_I16, 32, n)), _vec(_I8, 64))


class _Record:
    """One group's record of one block (quant_pack's layout), read as IR values."""

    def __init__(self, b: Any, kind: int, base: Any, word_shifts: bool = False) -> None:
        # word_shifts: unpack with 16-bit shifts (_shift16), for the K-quants' tiles
        # of eight rows and more; the tiles of one and four keep the byte shifts
        # (with one vpdpbusd per unpacked vector, the extra AND of the word form
        # measured no better), and so do the 32-value types (one shift per sixteen
        # vpdpbusd there: Q4_0 and Q5_1 at eight rows came out mixed, bench_quant.py
        # --tile, docs/engine.md)
        self.b, self.kind, self.base, self.word_shifts = b, kind, base, word_shifts
        self.lay = LAYOUTS[kind]
        self._memo: dict[tuple[str, int], Any] = {}

    def load(self, at: int | None, ty: Any) -> Any:
        """The ``ty`` at byte ``at`` of the record (``None``: a field this type lacks)."""
        if at is None:  # a tile asking for a field of another type: a bug here, not input
            raise ValueError(f"type {self.kind}'s record has no such field")
        return self.b.load(_ptr(self.b, self.base, ir.Constant(_I64, at), ty), align=1)

    def _once(self, what: str, k: int, make: Any) -> Any:
        if (what, k) not in self._memo:
            self._memo[what, k] = make()
        return self._memo[what, k]

    def halves(self, at: int | None) -> Any:
        """The sixteen rows' f16 at byte ``at``, as float32 lanes (exact: vcvtph2ps)."""

        def make() -> Any:
            h = self.b.bitcast(self.load(at, _vec(_I16, _LANES)), _vec(ir.HalfType(), _LANES))
            return self.b.fpext(h, _vec(_F32, _LANES))

        return self._once("half", -1 if at is None else at, make)

    def scales(self, field: int | None, j: int, signed: bool) -> Any:
        """Sub-block ``j``'s sixteen byte scales (or mins) at ``field``, as int32 lanes."""
        v = self.load(None if field is None else field + _LANES * j, _vec(_I8, _LANES))
        ext = self.b.sext if signed else self.b.zext
        return ext(v, _vec(_I32, _LANES))

    def pairs(self, field: int | None, j: int, signed: bool, same: bool = False) -> Any:
        """Sub-blocks ``j`` and ``j + 1``'s byte scales as int16 pairs: lane l's word is
        (sc_j[l], sc_j+1[l]) as <32 x i16> (``same``: sub-block ``j``'s twice), for
        ``vpdpwssd``. Loaded afresh, not kept from :meth:`scales`: sixteen scale vectors
        held live across a Q6_K record spilled at eight x rows."""
        n = _LANES if same else 2 * _LANES
        v = self.load(None if field is None else field + _LANES * j, _vec(_I8, n))
        w = (self.b.sext if signed else self.b.zext)(v, _vec(_I16, n))
        if same:
            order = [lane // 2 for lane in range(2 * _LANES)]
        else:
            order = [lane // 2 + (lane % 2) * _LANES for lane in range(2 * _LANES)]
        return self.b.shuffle_vector(w, w, _const(_I32, 2 * _LANES, order))

    def _shift(self, op: Any, v: Any, n: int) -> Any:
        if self.word_shifts:
            return _shift16(self.b, op, v, n)
        return op(v, _const(_I8, 64, n))

    def u(self, c: int) -> Any:
        """Vector ``c``: lane r's four bytes are row r's values 4c .. 4c + 3, unsigned."""
        b, lay, kind = self.b, self.lay, self.kind
        v64 = _vec(_I8, 64)
        if kind == _Q8_0:
            return self.load(lay.q_at(c), v64)
        nib = self._once("nib", c // 2, lambda: self.load(lay.q_at(c), v64))
        if c % 2:
            nib = self._shift(b.lshr, nib, 4)
        u = b.and_(nib, _const(_I8, 64, 15))
        if kind in (_Q5_0, _Q5_1, _Q5_K):  # one bit per byte: a 64-bit mask
            bits = b.bitcast(self.load(lay.hi_at(c), _I64), _vec(_I1, 64))
            u = b.or_(u, b.select(bits, _const(_I8, 64, 16), _const(_I8, 64, 0)))
        elif kind == _Q6_K:  # bits 2j, 2j + 1 of the shared byte, moved to bits 4-5
            h = self._once("hi", c // 4, lambda: self.load(lay.hi_at(c), v64))
            j = c % 4
            if j < 2:
                h = self._shift(b.shl, h, 4 - 2 * j)
            elif j == 3:
                h = self._shift(b.lshr, h, 2)
            u = b.or_(u, b.and_(h, _const(_I8, 64, 0x30)))
        return u


def _tile_function(module: Any, K: int, R: int, vnni: bool) -> Any:
    """The LLVM function of one tile: type K, one group of 16 weight rows, R rows of x.

    Lane r of the result row is weight row ``16 g + r``; every lane takes the
    same operations, so a row's bits do not depend on R or on its position.
    """
    i8p, i64 = _I8.as_pointer(), _I64
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i64, i64, i8p, i64, i8p, i64, i8p, i64,
                                           i8p, i64, i64, i64, i64, i64, i64])  # fmt: skip
    name = f"triollm_int8_tile16_{K}_{R}_{'vnni' if vnni else 'portable'}"
    fn = cgutils.get_or_insert_function(module, fnty, name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # inlined beside the other types' tiles, LLVM spilled
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    xq, xq_s, k_in, xd, xd_s, xs, xs_s, w, w_s, out, out_s, colbase, cols, g, r0, last = fn.args
    lay = LAYOUTS[K]
    vf, vi = _vec(_F32, _LANES), _vec(_I32, _LANES)

    def c64(v: int) -> Any:
        return ir.Constant(i64, v)

    def row(base: Any, stride: Any, i: int) -> Any:  # row r0 + i (clamped: never past the end)
        idx = b.add(r0, c64(i))
        idx = b.select(b.icmp_signed("<", idx, last), idx, last)
        return _ptr(b, base, b.mul(idx, stride), _I8)

    xqr = [row(xq, xq_s, r) for r in range(R)]
    xdr = [row(xd, xd_s, r) for r in range(R)]
    xsr = [row(xs, xs_s, r) for r in range(R)]
    wg = _ptr(b, w, b.mul(g, w_s), _I8)
    accs = [cgutils.alloca_once(b, vf) for _ in range(R)]
    for a in accs:
        b.store(ir.Constant(vf, None), a)
    zero = ir.Constant(vi, None)
    neg_off = _const(_I16, 2 * _LANES, -lay.offset)  # int16 pairs for vpdpwssd
    ones16 = _const(_I16, 2 * _LANES, 1)

    # Rows of x in halves of at most eight: a tile of sixteen rows takes each record
    # twice in a row, eight rows at a time, so that a half's accumulators fit the 32
    # zmm registers (sixteen rows at once spilled), while the record is read from
    # memory once: the second half finds it in L1. The second half reloads and
    # unpacks the record through an opaque copy of its address (an empty inline
    # asm), so LLVM cannot keep the first half's unpacked vectors live across it.
    halves = [list(range(h, min(h + 8, R))) for h in range(0, R, 8)]
    with cgutils.for_range(b, b.udiv(k_in, c64(lay.values))) as loop:
        bi = loop.index
        recbase = _ptr(b, wg, b.mul(bi, c64(lay.size)), _I8)
        if R >= _PREFETCH_X:
            # the next group's record of this block, line by line: see _PREFETCH_X
            # (a hint: no fault past the array's end, after a task's last group)
            pf_ty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
            pf = cgutils.get_or_insert_function(module, pf_ty, "llvm.prefetch.p0")
            ahead = _ptr(b, recbase, w_s, _I8)  # w_s: one group's records
            read, data = ir.Constant(_I32, 0), ir.Constant(_I32, 1)
            locality = ir.Constant(_I32, _PREFETCH_LOCALITY)
            for line in range(0, lay.size, 64):
                b.call(pf, [_ptr(b, ahead, c64(line), _I8), read, locality, data])
        for rows in halves:
            if rows[0]:  # an opaque copy of the record's address: see `halves`
                asm_ty = ir.FunctionType(i8p, [i8p])
                recbase = b.asm(asm_ty, "", "=r,0", [recbase], side_effect=False)
            rec = _Record(b, K, recbase, word_shifts=R >= _HALF_X and lay.subs > 1)
            dx = {r: b.load(_ptr(b, xdr[r], b.mul(bi, c64(4)), _F32)) for r in rows}
            xoff = b.mul(bi, c64(lay.values))  # the block's first byte in a row of q
            soff = b.mul(bi, c64(lay.values // SUM_VALUES * 2))  # ... and of its int16 sums

            def xsum16(
                r: int, i: int, soff: Any = soff
            ) -> Any:  # x row r's i-th sum of 16 in this block
                return b.sext(b.load(_ptr(b, xsr[r], b.add(soff, c64(2 * i)), _I16), align=2), _I32)

            def xpair(
                r: int, p: int, soff: Any = soff
            ) -> Any:  # sums 2p and 2p + 1 (int16) in every lane
                two = b.load(_ptr(b, xsr[r], b.add(soff, c64(4 * p)), _I32), align=2)
                return b.bitcast(_splat(b, two), _vec(_I16, 2 * _LANES))

            def xb(
                r: int, c: int, xoff: Any = xoff
            ) -> Any:  # x row r's values 4c .. 4c + 3 in every lane
                four = b.load(_ptr(b, xqr[r], b.add(xoff, c64(4 * c)), _I32), align=1)
                return b.bitcast(_splat(b, four), _vec(_I8, 64))

            def sub_sums(j: int, rows: list[int] = rows, rec: _Record = rec) -> dict[int, Any]:
                # sub-block j, every x row: two partial sums (alternate vectors) so that
                # the vpdpbusd chains are half as long; integer adds are exact in any order
                per = lay.sub // 4
                parts = {r: [zero, zero] for r in rows}
                for c in range(j * per, (j + 1) * per):
                    u = rec.u(c)
                    for r in rows:
                        parts[r][c % 2] = _busd(b, vnni, parts[r][c % 2], u, xb(r, c))
                return {r: b.add(p[0], p[1]) for r, p in parts.items()}

            def add(r: int, value: Any) -> None:
                b.store(b.fadd(b.load(accs[r]), value), accs[r])

            if lay.subs == 1 and len(rows) < _FEW_X:  # the 32-value types, one x row
                # Two vpdpbusd chains, half as long (a decode step waits on them); the
                # offset by a scalar chain on the x row's sums. The vpdpwssd start of
                # the many-row tiles (below) made SmolLM2's batch-1 step ~25 % longer
                # in CPU (busy A/B, bench_gguf --workload decode): one more op on the
                # multiply pipes per block. The same integers, so the same bits.
                s = sub_sums(0)
                dw = rec.halves(lay.d)
                for r in rows:
                    xsum = b.add(xsum16(r, 0), xsum16(r, 1))  # |xsum| <= 32 * 127
                    isum = s[r]  # |isum| <= 32 * 255 * 127, exact
                    if lay.offset:  # sum (u - off) q = sum u q - off * sum q
                        isum = b.sub(isum, _splat(b, b.mul(xsum, ir.Constant(_I32, lay.offset))))
                    scale = b.fmul(dw, _splat(b, dx[r]))
                    add(r, b.fmul(b.sitofp(isum, vf), scale))
                    if lay.m is not None:  # + m * (dx * sum q)
                        mx = b.fmul(dx[r], b.sitofp(xsum, _F32))
                        add(r, b.fmul(rec.halves(lay.m), _splat(b, mx)))
            elif lay.subs == 1:  # the 32-value types, four or eight x rows
                # sum (u - off) q = sum u q - off * sum q: the chain starts at
                # -off * (s_0 + s_1), one vpdpwssd of the constant pair (-off, -off)
                # against the row's two int16 sums of 16 broadcast from memory (no
                # scalar chain, no broadcast from a general register).
                # |off * sum q| <= 128 * 32 * 127, |isum| <= 32 * 255 * 127 + that: exact
                if lay.offset:
                    s = {r: _wssd(b, vnni, zero, neg_off, xpair(r, 0)) for r in rows}
                else:
                    s = dict.fromkeys(rows, zero)
                # one vpdpbusd chain per row: the rows' chains are independent and hide
                # the latency; two per row held 16 accumulators at eight rows, which
                # with the float ones spilled the 32 zmm registers
                for c in range(lay.vectors):
                    u = rec.u(c)
                    for r in rows:
                        s[r] = _busd(b, vnni, s[r], u, xb(r, c))
                dw = rec.halves(lay.d)
                for r in rows:
                    dxs = _splat(b, dx[r])
                    add(r, b.fmul(b.sitofp(s[r], vf), b.fmul(dw, dxs)))
                    if lay.m is not None:  # + m * (dx * sum q), sum q by vpdpwssd as above
                        xsum = b.sitofp(_wssd(b, vnni, zero, ones16, xpair(r, 0)), vf)
                        add(r, b.fmul(rec.halves(lay.m), b.fmul(dxs, xsum)))
            else:
                # the K-quants: sub-block scales applied in integers, floats once per 256
                total = dict.fromkeys(rows, zero)
                for j in range(lay.subs):
                    s = sub_sums(j)
                    sc = rec.scales(lay.sc, j, signed=K == _Q6_K)
                    for r in rows:
                        # |t * sc| summed over the sub-blocks (t = sum u q, u unsigned):
                        # Q4_K/Q5_K <= 8 * 32 * 31 * 127 * 63, Q6_K <= 16 * 16 * 63 * 127 * 128:
                        # both below 2^31, exact
                        total[r] = b.add(total[r], b.mul(s[r], sc))
                if lay.offset:
                    # Q6_K: sum_j sc_j (t_j - 32 s_j) = sum_j sc_j t_j - 32 sum_j sc_j s_j; the
                    # second sum by vpdpwssd, two sub-blocks a word (the sc pair of a lane
                    # against the x row's two int16 sums, broadcast from memory), instead of
                    # a scalar offset broadcast into every sub-block of every row.
                    # |32 sum_j sc_j s_j| <= 32 * 16 * 128 * 16 * 127, exact
                    scp = [rec.pairs(lay.sc, 2 * p, True) for p in range(lay.subs // 2)]
                    for r in rows:
                        off = zero
                        for p in range(lay.subs // 2):
                            off = _wssd(b, vnni, off, scp[p], xpair(r, p))
                        total[r] = b.sub(total[r], b.shl(off, _const(_I32, _LANES, 5)))
                d = rec.halves(lay.d)
                for r in rows:
                    dxs = _splat(b, dx[r])
                    add(r, b.fmul(b.sitofp(total[r], vf), b.fmul(d, dxs)))
                if lay.mn is not None:  # - dmin * dx * sum_j mn_j * (sum q over sub-block j)
                    dmin = rec.halves(lay.m)
                    # mn_j * (s_2j + s_2j+1) by vpdpwssd: the lane's (mn_j, mn_j) against the
                    # x row's two int16 sums of sub-block j, broadcast from memory
                    mnp = [rec.pairs(lay.mn, j, False, same=True) for j in range(lay.subs)]
                    for r in rows:
                        mins = zero
                        for j in range(lay.subs):  # |.| <= 8 * 63 * 32 * 127, exact
                            mins = _wssd(b, vnni, mins, mnp[j], xpair(r, j))
                        corr = b.fmul(b.sitofp(mins, vf), b.fmul(dmin, _splat(b, dx[r])))
                        b.store(b.fsub(b.load(accs[r]), corr), accs[r])

    # the results: lane t of row r is out[r0 + r, colbase + 16 g + t], where the part
    # that holds the group starts; lanes past its `cols` rows masked
    first = b.mul(g, c64(_LANES))
    col0 = b.add(colbase, first)
    left = b.trunc(b.sub(cols, first), _I32)
    mask = b.icmp_signed("<", _const(_I32, _LANES, range(_LANES)), _splat(b, left))
    mstore = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [vf, i8p, _I32, _vec(_I1, _LANES)]),
        "llvm.masked.store.v16f32.p0",
    )  # fmt: skip
    for r in range(R):
        at = row(out, out_s, r)  # (the drivers' tiles never need the clamp)
        at = _ptr(b, at, b.mul(col0, c64(4)), _I8)
        b.call(mstore, [b.load(accs[r]), at, ir.Constant(_I32, 4), mask])
    b.ret_void()
    return fn


def _literal(t: Any) -> int | None:
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


@intrinsic(prefer_literal=True)
def _int8_tile(  # type: ignore[no-untyped-def]
    typingctx, kind, n_x, portable, xq, xd, xs, packed, out, g, r0, last, colbase, cols
):
    """``out[r0 + r, colbase + 16 g + t] = x[r0 + r] . W[16 g + t]`` from int8 rows: one tile.

    ``W`` is one part of a product (``packed``, ``cols`` weight rows) whose outputs
    start at column ``colbase``."""
    R, P = _literal(n_x), _literal(portable)
    if R is None or P is None:
        return None
    if xs.dtype != types.int16:
        # Hazard: the tile reads the sums as int16 pairs; int32 sums would compile and
        # give wrong numbers. numba's cache does not see a caller in another file
        # change with this one, so the check is here, where the layout lives.
        raise TypeError(f"int8 tile: the x sums must be int16 (SUM_DTYPE), not {xs.dtype}")
    intp = types.intp
    sig = types.void(intp, n_x, portable, xq, xd, xs, packed, out, intp, intp, intp, intp, intp)

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

        call = [
            *base_stride(3),
            cgutils.unpack_tuple(builder, arr(3).shape)[1],
            *base_stride(4),
            *base_stride(5),
            *base_stride(6),
            *base_stride(7),
            args[11],
            args[12],
            *args[8:11],
        ]
        vnni = _can_vnni(context) and not P
        end = builder.append_basic_block("type.end")
        switch = builder.switch(args[0], end)
        for K in _EIGHT_TYPES if R <= _HALF_X else _MANY_TYPES:
            case = builder.append_basic_block(f"type.{K}")
            switch.add_case(ir.Constant(_I64, K), case)
            builder.position_at_end(case)
            builder.call(_tile_function(builder.module, K, R, vnni), call)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return sig, codegen


# x rows per tile: for the K-quants sixteen (two halves of eight per record:
# the record read from memory once), then eight; then four, then one for what
# is left of a chunk (one row alone for a batch-1 decode). Each unpacked weight
# vector feeds up to eight vpdpbusd. Any R gives a row the same bits. Sixteen
# rows at once spilled (the accumulators no longer fit the 32 zmm registers)
# and ran slower than eight. The 32-value types stop at eight: their block is
# short, and a sixteen-row tile keeps sixteen float accumulators live across
# it (59 stack moves per Q8_0 block); eight rows with one vpdpbusd chain per
# row fit (one spill). Hazard: the tile of sixteen rows is compiled for the
# K-quants only (_MANY_TYPES); another type there would compute nothing, so
# the drivers ask `k >= _Q4_K` first.
_MANY_X = 16
# Tiles of at least this many x rows prefetch the next group's record of each
# block, every line, into L2 (locality 1: prefetcht2; into L1, locality 3, the
# next group evicted this one's records and gained nothing at eight rows). A
# group's records come from memory in the first tile over it; the tiles after
# that hit L1/L2, so the hardware prefetcher, which follows misses, idles, and
# the next group's first tile waits on memory: memory and compute took turns.
# bench_quant.py --prefetch: Q8_0 at 8 rows 0.9 -> 1.6 G vpdpbusd/s, at 16
# 1.0 -> 1.35, Q4_1 at 16 1.25 -> 1.6, Q4_K 1.5 -> 1.8 (busy machine). At four
# rows and one, one tile per group meets the records first and the hardware
# prefetcher streams them: prefetching there gave no clear gain.
_PREFETCH_X = 8
_PREFETCH_LOCALITY = 1
_HALF_X = 8
_FEW_X = 4
# x rows per pass over a thread's groups: a prefill's x (512 rows of 8960
# int8 = 4.6 MB) does not stay in L2 while every group passes over it; 64
# rows of x (<= 574 KB) do. Any chunking gives the same bits.
_X_CHUNK = 64
# Weight parts one product call takes: a fused q/k/v is three (a Q4_K_M file
# stores v in Q6_K beside Q4_K q and k), gate/up two. The kernels take exactly
# this many (unused ones empty), so numba compiles one signature; a stack of
# more parts runs one call per part (quant.linear).
PARTS = 3


@njit(cache=True, nogil=True, parallel=True)
def _int8_matmul(q, d, s, p0, p1, p2, kinds, first, cols, out, per_task):  # type: ignore[no-untyped-def]  # pragma: no cover
    # q (n, k) int8, d (n, k / block) float32, s (n, k / 16) int32; p0, p1, p2
    # (groups, records) uint8 (quant_pack), the parts of a stacked weight: part i
    # of type kinds[i] holds groups first[i] .. first[i + 1] of the product and
    # writes columns cols[i] .. cols[i + 1] of out (n, cols[3]) float32 (both
    # tables made by the caller: an array made here would be a parallel region
    # of its own). Threads split the groups of all parts (contiguous runs of
    # per_task); each group meets every tile of a chunk of x rows while its
    # records sit in L1/L2. Hazard: the part's array is chosen once per run of
    # its groups; chosen per group (two reference-count updates each, on an
    # array both threads share), a one-row gate/up ran 4 % slower than the
    # concatenated tensor it replaces (bench_quant.py --stacks, busy machine).
    n = q.shape[0]
    groups = first[PARTS]
    for task in prange((groups + per_task - 1) // per_task):
        g0 = task * per_task
        g1 = min(g0 + per_task, groups)
        for c0 in range(0, n, _X_CHUNK):
            for p in range(PARTS):  # the part once per run of its groups, not per group
                w = p0 if p == 0 else (p1 if p == 1 else p2)
                k, at, m = kinds[p], cols[p], cols[p + 1] - cols[p]
                for gg in range(max(g0, first[p]), min(g1, first[p + 1])):
                    g = gg - first[p]
                    # tiles of _MANY_X rows, then _HALF_X, _FEW_X, single rows: no tile
                    # computes a row twice (a clamped row did), and any row gets the
                    # same bits in any of them
                    end = min(c0 + _X_CHUNK, n)
                    r0 = c0
                    while k >= _Q4_K and r0 + _MANY_X <= end:
                        _int8_tile(k, _MANY_X, 0, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += _MANY_X
                    while r0 + _HALF_X <= end:
                        _int8_tile(k, _HALF_X, 0, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += _HALF_X
                    while r0 + _FEW_X <= end:
                        _int8_tile(k, _FEW_X, 0, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += _FEW_X
                    while r0 < end:
                        _int8_tile(k, 1, 0, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += 1


@njit(cache=True, nogil=True, parallel=True)
def _portable_matmul(q, d, s, p0, p1, p2, kinds, first, cols, out, per_task):  # type: ignore[no-untyped-def]  # pragma: no cover
    # _int8_matmul with the portable tiles: a function of its own so that the
    # model's product does not compile (and load) both variants. No tile of
    # sixteen rows here: with it, compiling the tests' products took more than
    # four CPU minutes (its portable IR widens sixteen rows' products), and any
    # R gives a row the same bits.
    n = q.shape[0]
    groups = first[PARTS]
    for task in prange((groups + per_task - 1) // per_task):
        g0 = task * per_task
        g1 = min(g0 + per_task, groups)
        for c0 in range(0, n, _X_CHUNK):
            for p in range(PARTS):  # the part once per run of its groups, not per group
                w = p0 if p == 0 else (p1 if p == 1 else p2)
                k, at, m = kinds[p], cols[p], cols[p + 1] - cols[p]
                for gg in range(max(g0, first[p]), min(g1, first[p + 1])):
                    g = gg - first[p]
                    end = min(c0 + _X_CHUNK, n)
                    r0 = c0
                    while r0 + _HALF_X <= end:
                        _int8_tile(k, _HALF_X, 1, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += _HALF_X
                    while r0 + _FEW_X <= end:
                        _int8_tile(k, _FEW_X, 1, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += _FEW_X
                    while r0 < end:
                        _int8_tile(k, 1, 1, q, d, s, w, out, g, r0, n - 1, at, m)
                        r0 += 1


_NO_PART = np.zeros((0, 1), np.uint8)  # an unused part: no groups


def product(
    x: Int8Rows,
    packed: np.ndarray,
    kind: int,
    out: np.ndarray,
    block_rows: int,
    *,
    portable: bool = False,
) -> np.ndarray:
    """``out[:] = x @ W.T`` for int8 rows ``x`` and ``W`` packed by :func:`quant_pack.pack`.

    ``out`` is float32 C-contiguous ``(n, rows of W)``; ``block_rows`` (a
    multiple of 16) weight rows go to one parallel task. ``portable=True``
    takes the plain-IR integer products instead of the VNNI instructions (the
    same bits; tests compare the two).
    """
    return product_parts(x, [(packed, kind, out.shape[1])], out, block_rows, portable=portable)


@dataclass(frozen=True, eq=False)
class PartsTable:
    """What :func:`product_table` needs of a weight besides ``x``: made once per weight.

    The three part arrays (unused ones empty), their types, where each part's
    groups start and where its outputs start. Built on every call, these small
    arrays cost about 8 us of the calling thread's time per product (``np.array``,
    two ``np.cumsum``, the checks): ~1 ms of a 1.5B batch-1 step's 113 products,
    so ``quant.linear`` keeps one per weight.
    """

    parts: tuple[np.ndarray, np.ndarray, np.ndarray]
    kinds: np.ndarray  # (PARTS,) int64
    first: np.ndarray  # (PARTS + 1,) int64: part i holds groups first[i] .. first[i + 1]
    cols: np.ndarray  # (PARTS + 1,) int64: part i writes columns cols[i] .. cols[i + 1]
    block: int  # the activation block every part pairs with

    @property
    def rows(self) -> int:
        """Output columns of the product: the parts' weight rows."""
        return int(self.cols[PARTS])


def parts_table(parts: list[tuple[np.ndarray, int, int]]) -> PartsTable:
    """The table of up to :data:`PARTS` ``(packed, kind, rows)`` of one activation block."""
    if not 1 <= len(parts) <= PARTS:
        raise ValueError(f"a product takes 1 to {PARTS} parts, got {len(parts)}")
    block = activation_block(parts[0][1])
    for _, kind, _ in parts:
        if activation_block(kind) != block:
            raise ValueError("the parts of one product must pair with one activation block")
    full = [*parts, *[(_NO_PART, parts[0][1], 0)] * (PARTS - len(parts))]
    return PartsTable(
        (full[0][0], full[1][0], full[2][0]),
        np.array([k for _, k, _ in full], np.int64),
        np.cumsum([0] + [p.shape[0] for p, _, _ in full], dtype=np.int64),
        np.cumsum([0] + [r for _, _, r in full], dtype=np.int64),
        block,
    )


def product_parts(
    x: Int8Rows,
    parts: list[tuple[np.ndarray, int, int]],
    out: np.ndarray,
    block_rows: int,
    *,
    portable: bool = False,
) -> np.ndarray:
    """:func:`product` of weights stacked along the output axis, in one call.

    ``parts`` lists up to :data:`PARTS` ``(packed, kind, rows)``, every kind
    pairing with ``x``'s activation block; their outputs go side by side into
    ``out`` ``(n, sum of rows)``. One call (one parallel region) serves a
    fused q/k/v whose v has another type, with no temporary per part.
    """
    return product_table(x, parts_table(parts), out, block_rows, portable=portable)


def product_table(
    x: Int8Rows, table: PartsTable, out: np.ndarray, block_rows: int, *, portable: bool = False
) -> np.ndarray:
    """:func:`product_parts` with the parts' :class:`PartsTable` made beforehand."""
    if x.block != table.block:
        raise ValueError(f"these weights pair with activation blocks of {table.block}")
    if table.rows != out.shape[1]:
        raise ValueError(f"the parts' rows do not add up to the {out.shape[1]} output columns")
    if x.q.shape[0]:
        fn = _portable_matmul if portable else _int8_matmul
        w0, w1, w2 = table.parts
        fn(x.q, x.d, x.sums, w0, w1, w2, table.kinds, table.first, table.cols, out,
           max(1, block_rows // ROWS))  # fmt: skip
    return out
