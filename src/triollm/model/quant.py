"""Quantized weights: GGUF's block formats kept as blocks, multiplied as they are.

A quantized weight ``[out, in]`` is stored the way a GGUF file stores it: each
row cut into blocks of 32 values (256 for the K-quants), each block a few
bytes of scales and packed small integers. :class:`QuantizedTensor` holds
those bytes untouched (a memory map of the file, when it comes from one) and
:func:`linear` computes ``x @ W.T`` from them, so a decode step streams the
quantized bytes, not a float copy: 34 bytes per 32 weights for Q8_0 against
128 for float32. The default int8 product (:mod:`triollm.model.quant_int8`)
reads the same bytes repacked once at load, sixteen rows interleaved
(:mod:`triollm.model.quant_pack`); the widening kernels below (the
``--exact-activations`` path) and the embedding lookup read the blocks.

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
Threads split the output rows into blocks. Inside a block, a *tile* of
weight rows meets a tile of ``x`` rows (:func:`_tile`): for each block of
the weight rows, the quantized values are *widened* to float32 sixteen at a
time, in AVX-512 registers, and multiplied into every ``x`` row of the tile
with fused multiply-adds, one 16-lane accumulator per (x row, weight row),
whose lanes are summed once at the end. Nothing widened goes back to
memory (a 4-bit type on AVX-512 looks each nibble up in a register holding
the 16 values it can stand for, computed once per block). One row (batch-1
decode) takes sixteen weight rows per tile: sixteen accumulators hide the
FMA latency and sixteen rows keep memory streams in flight. Two to four rows
take a 4 x 4 tile; more take two weight rows by eight ``x`` rows: the
widening is shared by eight rows and each ``x`` vector loaded serves two.
The quantized bytes are read from memory once per product whatever the row
count: a weight row's bytes stay in L1 while every ``x`` tile passes over
them.

The tile is LLVM IR written here (numba has no vector types, and its loops
over a block's bytes did not vectorise: the first kernel widened 1.3 weights
a cycle per core). Each type's block is described once, as the list of its
16-weight vectors (:func:`_block_vectors`); the product tile and the row
lookup (:func:`_widen_row`) both emit that list.

Every row of ``x`` takes the same operations in the same order whatever the
tile's shape and whatever else is in the product, so a row's result is the
same bits alone and in a batch (batch invariance, tested). Arithmetic is
float32 throughout: each weight is ``float32(q) * d (+ m)``, exactly the
value ``gguf.dequantize`` computes (multiply then add, unfused), and the
products accumulate with FMAs.

Hazards
-------
- ``nogil=True``: the forward runs in a worker thread beside the event loop.
- ``in_features`` must be a whole number of blocks (GGUF guarantees it; a
  K-quant needs a multiple of 256, which is why SmolLM2's 576 columns come
  as Q4_1). :func:`quantize` refuses anything else by name.
- The embedding lookup (:meth:`QuantizedTensor.__getitem__`) widens only the
  rows asked for; nothing widens a whole quantized matrix except
  :meth:`QuantizedTensor.dequantize` (tests, tools).
- The nibble lookup is an x86 AVX-512 intrinsic (``vpermps``), emitted only
  when numba's target has AVX-512F (:func:`_can_permute`); anywhere else
  every type takes the portable IR, which LLVM lowers to what the CPU has.
  The two give the same bits (the table holds the very products); each is
  proved equal to ``gguf.dequantize`` on the machine that runs the tests.
- A tile is its own LLVM function, ``noinline``: inlined, LLVM spilled its
  accumulators (see :func:`_tile_function`). Emitting the vector ops in
  another order never changes a result, only the register allocation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from triollm.model import quant_int8, quant_pack, threads
from triollm.model.quant_int8 import Int8Rows
from triollm.model.threads import start_parallel_runtime, thread_count

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)


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


# --- a block's values, as LLVM vector IR ----------------------------------------
#
# numba has no vector types, and its loops over a block's bytes neither
# vectorised nor kept the widened weights in registers (the first version
# widened into an L1 buffer and re-read it: one core then widened 1.3
# weights a cycle). So the kernels below are written as LLVM IR, sixteen
# float32 lanes (one AVX-512 register) at a time: each type's block is a list
# of "vectors" (16 lanes of widened weights each), and one product tile and
# the row lookup both consume that list. A block's scalars (f16 scales, the
# K-quants' 6-bit sub-block scales) are computed once per block and row.

_LANES = 16  # float32 lanes per vector: one AVX-512 register
_I8, _I16, _I32, _I64 = (ir.IntType(w) for w in (8, 16, 32, 64))
_F32 = ir.FloatType()
_VI8, _VI32, _VF32 = (ir.VectorType(t, _LANES) for t in (_I8, _I32, _F32))


def _ints(value: int) -> Any:
    return ir.Constant(_VI32, [value] * _LANES)


def _splat(builder: Any, value: Any) -> Any:
    undef = ir.Constant(ir.VectorType(value.type, _LANES), ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_VI32, [0] * _LANES))


def _byte_ptr(builder: Any, base: Any, offset: Any, ty: Any) -> Any:
    """A ``ty*`` at byte ``offset`` (an i64) of ``base``."""
    ptr = builder.gep(builder.bitcast(base, _I8.as_pointer()), [offset])
    return builder.bitcast(ptr, ty.as_pointer())


class _Block:
    """The bytes of block ``index`` of one quantized row, read as IR values.

    Scalars are read once (memoised by offset): every vector of the block
    that needs the scale uses the same value, emitted where it was first
    asked for, so the block's IR stays straight-line in one basic block.
    """

    def __init__(self, builder: Any, row: Any, start: Any, *, permute: bool) -> None:
        self.b, self.row, self.start = builder, row, start
        self.permute = permute  # AVX-512's vpermps may look nibbles up in a table
        self._memo: dict[tuple[str, int], Any] = {}

    def _ptr(self, k: int, ty: Any) -> Any:
        return _byte_ptr(self.b, self.row, self.b.add(self.start, ir.Constant(_I64, k)), ty)

    def _once(self, what: str, k: int, make: Any) -> Any:
        if (what, k) not in self._memo:
            self._memo[what, k] = make()
        return self._memo[what, k]

    def byte(self, k: int) -> Any:
        """Byte k, zero-extended to i32."""
        return self._once("byte", k, lambda: self.b.zext(self.b.load(self._ptr(k, _I8)), _I32))

    def half(self, k: int) -> Any:
        """The little-endian float16 at byte k, as float32 (vcvtph2ps)."""

        def make() -> Any:
            bits = self.b.load(self._ptr(k, _I16), align=1)
            return self.b.fpext(self.b.bitcast(bits, ir.HalfType()), _F32)

        return self._once("half", k, make)

    def word(self, k: int) -> Any:
        """The little-endian 32-bit word at byte k."""
        return self._once("word", k, lambda: self.b.load(self._ptr(k, _I32), align=1))

    def lanes(self, k: int, *, signed: bool = False) -> Any:
        """Bytes k .. k + 15, widened to sixteen i32 lanes."""
        v = self.b.load(self._ptr(k, _VI8), align=1)
        return self.b.sext(v, _VI32) if signed else self.b.zext(v, _VI32)

    def bits(self, k: int, shift: int, mask: int) -> Any:
        """``(byte >> shift) & mask`` for bytes k .. k + 15, moved up to bit 4 (a 5th/6th bit)."""
        v = self.b.and_(self.b.lshr(self.lanes(k), _ints(shift)), _ints(mask))
        return self.b.shl(v, _ints(4))

    def word_bits(self, k: int, first: int) -> Any:
        """Bit ``first + i`` of the word at byte k for lane i, moved up to bit 4."""
        lane = ir.Constant(_VI32, list(range(first, first + _LANES)))
        v = self.b.and_(self.b.lshr(_splat(self.b, self.word(k)), lane), _ints(1))
        return self.b.shl(v, _ints(4))

    def vector(
        self,
        k: int,
        d: Any,
        m: Any = None,
        *,
        signed: bool = False,
        shift: int = 0,
        high: Any = None,
        offset: int = 0,
    ) -> Any:
        """Sixteen weights ``float32(q - offset) * d (+ m)``, q from bytes k .. k + 15.

        ``q`` is the byte (``signed``: int8) or its nibble at ``shift``, or'ed
        with ``high`` (the 5th/6th bits, already in place). Multiply then
        add, unfused, as ``gguf.dequantize`` computes them: the widened values
        are its values bit for bit.
        """
        q = self.lanes(k, signed=signed)
        if not signed:
            q = self.b.and_(self.b.lshr(q, _ints(shift)), _ints(15))
        if self.permute and not signed and high is None:
            # a 4-bit q has 16 values: compute them once per block, then each
            # lane is one lookup (vpermps) instead of convert, multiply, add
            return self.b.call(_permute_fn(self.b.module), [self._table(d, m, offset), q])
        if high is not None:
            q = self.b.or_(q, high())
        if offset:
            q = self.b.sub(q, _ints(offset))
        v = self.b.fmul(self.b.sitofp(q, _VF32), _splat(self.b, d))
        return v if m is None else self.b.fadd(v, _splat(self.b, m))

    def _table(self, d: Any, m: Any, offset: int) -> Any:
        """The 16 weights a nibble can stand for, ``float32(i - offset) * d (+ m)``."""

        def make() -> Any:
            i = ir.Constant(_VF32, [float(i - offset) for i in range(_LANES)])
            v = self.b.fmul(i, _splat(self.b, d))
            return v if m is None else self.b.fadd(v, _splat(self.b, m))

        return self._once("table", hash((id(d), id(m), offset)), make)  # per scale and min

    def k_scale_min(self, j: int) -> tuple[Any, Any]:
        """Q4_K/Q5_K: sub-block j's 6-bit scale and min, as float32.

        Bytes 4-7 of the block hold scales 0-3 (low 6 bits) and the top 2
        bits of scales 4-7; bytes 8-11 the same for the mins; bytes 12-15
        the low 4 bits of scales and mins 4-7 (scale low nibble, min high).
        """
        b = self.b

        def c(v: int) -> Any:
            return ir.Constant(_I32, v)

        if j < 4:
            sc = b.and_(self.byte(4 + j), c(63))
            m = b.and_(self.byte(8 + j), c(63))
        else:
            top_sc = b.shl(b.lshr(self.byte(j), c(6)), c(4))
            top_m = b.shl(b.lshr(self.byte(4 + j), c(6)), c(4))
            sc = b.or_(b.and_(self.byte(8 + j), c(15)), top_sc)
            m = b.or_(b.lshr(self.byte(8 + j), c(4)), top_m)
        return b.uitofp(sc, _F32), b.uitofp(m, _F32)


def _permute_fn(module: Any) -> Any:
    """``llvm.x86.avx512.permvar.sf.512``: lane i of the result is ``table[idx[i]]``."""
    fnty = ir.FunctionType(_VF32, [_VF32, _VI32])
    return cgutils.get_or_insert_function(module, fnty, "llvm.x86.avx512.permvar.sf.512")


def _can_permute(context: Any) -> bool:
    """Whether the target has AVX-512F (else every type takes the portable widening).

    Hazard: numba's target features are a private attribute; without it the
    portable path runs (the same values: the table holds the very products).
    """
    return "+avx512f" in getattr(context.codegen(), "_tm_features", "")


def _block_vectors(kind: int, blk: _Block) -> list[Any]:
    """Block ``blk`` of a ``kind`` row as thunks, one per 16 weights, in order.

    Calling thunk v emits the IR of weights 16 v .. 16 v + 15 (a <16 x float>).
    """
    b = blk.b
    if kind == _Q8_0:  # d | 32 x int8
        return [lambda s=s: blk.vector(2 + 16 * s, blk.half(0), signed=True) for s in (0, 1)]
    if kind in (_Q4_0, _Q4_1, _Q5_0, _Q5_1):
        # d (m) | (Q5: qh, bit i weight i's 5th) | 16 bytes: low nibbles are
        # weights 0-15, high nibbles 16-31
        with_min, five = kind in (_Q4_1, _Q5_1), kind in (_Q5_0, _Q5_1)
        qh = 4 if with_min else 2
        qs = qh + 4 if five else qh
        off = 0 if with_min else (16 if five else 8)

        def q4_q5(s: int) -> Any:
            m = blk.half(2) if with_min else None
            high = (lambda: blk.word_bits(qh, 16 * s)) if five else None
            return blk.vector(qs, blk.half(0), m, shift=4 * s, high=high, offset=off)

        return [lambda s=s: q4_q5(s) for s in (0, 1)]
    if kind in (_Q4_K, _Q5_K):
        # d, dmin | 12 bytes of scales | (Q5_K: 32 bytes of 5th bits) | 128 bytes of
        # nibbles: 32 bytes per pair of sub-blocks, low nibbles 2g, high 2g + 1
        qs = 16 if kind == _Q4_K else 48

        def k_vector(j: int, s: int) -> Any:
            sc, mn = blk.k_scale_min(j)
            scale = b.fmul(blk.half(0), sc)
            neg_min = b.fneg(b.fmul(blk.half(2), mn))
            high = None if kind == _Q4_K else (lambda: blk.bits(16 + 16 * s, j, 1))
            at = qs + 32 * (j // 2) + 16 * s
            return blk.vector(at, scale, neg_min, shift=4 * (j % 2), high=high)

        return [lambda j=j, s=s: k_vector(j, s) for j in range(8) for s in (0, 1)]
    # _Q6_K: 128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d.
    # Two halves of 128 weights, each four groups t of 32, a scale per 16.

    def q6_vector(h: int, t: int, s: int) -> Any:
        sc = b.sitofp(b.trunc(blk.byte(192 + 8 * h + 2 * t + s), _I8), _F32)
        low = 64 * h + 32 * (t % 2) + 16 * s
        high = lambda: blk.bits(128 + 32 * h + 16 * s, 2 * t, 3)  # noqa: E731
        return blk.vector(low, b.fmul(blk.half(208), sc), shift=4 * (t // 2), high=high, offset=32)

    halves = [(h, t, s) for h in (0, 1) for t in range(4) for s in (0, 1)]
    return [lambda hts=hts: q6_vector(*hts) for hts in halves]


def _literal(t: Any) -> int | None:
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


def _row_ptr(context: Any, builder: Any, ary: Any, index: Any) -> Any:
    """The data pointer of row ``index`` of a 2-D array (its byte stride)."""
    stride = cgutils.unpack_tuple(builder, ary.strides)[0]
    return _byte_ptr(builder, ary.data, builder.mul(index, stride), _I8)


def _clamp(builder: Any, i: Any, last: Any) -> Any:
    return builder.select(builder.icmp_signed("<", i, last), i, last)


def _sum_lanes(builder: Any, v: Any) -> Any:
    """The 16 lanes of ``v`` added pairwise, in one fixed order (8 + 8, 4 + 4, ...)."""
    width = _LANES
    while width > 1:
        width //= 2
        lanes = ir.VectorType(_I32, width)
        lo = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width, 2 * width))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _tile_function(module: Any, K: int, T: int, R: int, permute: bool) -> Any:
    """The LLVM function computing one (type K, T weight rows, R x rows) tile.

    Its own function, never inlined: inlined into the product's loop (with
    the other types' tiles beside it) LLVM spilled half the accumulators to
    the stack, in a loop that left sixteen vector registers unused.
    """
    i8p = _I8.as_pointer()
    fnty = ir.FunctionType(
        ir.VoidType(), [i8p, _I64, _I64, i8p, _I64, _I64, _I64, _I64, _I64, _F32.as_pointer()]
    )
    fn = cgutils.get_or_insert_function(module, fnty, f"triollm_quant_tile_{K}_{T}x{R}")
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    x, x_stride, k_in, w, w_stride, r0, last, j0, e, out = fn.args
    values = QuantType(K).block_values
    nbytes = QuantType(K).block_bytes

    def row(base: Any, stride: Any, first: Any, i: int, end: Any) -> Any:
        index = _clamp(builder, builder.add(first, ir.Constant(_I64, i)), end)
        return _byte_ptr(builder, base, builder.mul(index, stride), _I8)

    xs = [row(x, x_stride, r0, r, last) for r in range(R)]
    ws = [row(w, w_stride, j0, t, e) for t in range(T)]
    accs = [[cgutils.alloca_once(builder, _VF32) for _ in range(T)] for _ in range(R)]
    for acc in (a for row_accs in accs for a in row_accs):
        builder.store(ir.Constant(_VF32, None), acc)
    fma = cgutils.get_or_insert_function(
        module, ir.FunctionType(_VF32, [_VF32] * 3), "llvm.fma.v16f32"
    )
    with cgutils.for_range(builder, builder.udiv(k_in, ir.Constant(_I64, values))) as loop:
        start = builder.mul(loop.index, ir.Constant(_I64, nbytes))
        first = builder.mul(loop.index, ir.Constant(_I64, values * 4))  # x's byte offset
        thunks = [_block_vectors(K, _Block(builder, wp, start, permute=permute)) for wp in ws]
        # the order of emission only steers LLVM's register allocation: each
        # accumulator takes the same FMAs in the same order either way.
        # One x row: weight row by weight row (a row's scale dies at once);
        # more: vector by vector (an x vector serves every weight row)
        steps = [(t, v) for t in range(T) for v in range(len(thunks[0]))]
        if R > 1:
            steps.sort(key=lambda tv: tv[1])
        for t, v in steps:  # the hot loop
            at = builder.add(first, ir.Constant(_I64, 64 * v))
            wv = thunks[t][v]()
            for r in range(R):
                xv = builder.load(_byte_ptr(builder, xs[r], at, _VF32), align=4)
                s = builder.load(accs[r][t])
                builder.store(builder.call(fma, [xv, wv, s]), accs[r][t])
    for r in range(R):
        for t in range(T):
            total = _sum_lanes(builder, builder.load(accs[r][t]))
            builder.store(total, builder.gep(out, [ir.Constant(_I64, r * T + t)]))
    builder.ret_void()
    return fn


def _each_type(builder: Any, kind: Any, emit: Any) -> None:
    """Branch on the run-time type id ``kind`` (an i64): ``emit(K)`` writes type K's code."""
    end = builder.append_basic_block("type.end")
    switch = builder.switch(kind, end)  # no default: QuantizedTensor checked the type
    for q in QuantType:
        case = builder.append_basic_block(f"type.{q.name}")
        switch.add_case(ir.Constant(_I64, int(q)), case)
        builder.position_at_end(case)
        emit(int(q))
        builder.branch(end)
    builder.position_at_end(end)


@intrinsic(prefer_literal=True)
def _tile(typingctx, kind, n_w, n_x, x, blocks, r0, last, j0, e, res):  # type: ignore[no-untyped-def]
    """``res[r * n_w + t] = x[r0 + r] . W[j0 + t]`` for a tile of n_x rows by n_w weight rows.

    Rows past ``last`` (of x) or ``e`` (of W) repeat it; ``kind`` is the
    type id, ``n_w`` and ``n_x`` compile-time constants. The hot loop: per
    block, each weight row's vectors are widened once, in registers, and
    multiplied into every x row of the tile (``n_x * n_w`` accumulators of 16
    lanes, fused multiply-add); the lanes are summed once at the end. A
    row's sums take the same operations in the same order whatever the
    tile's shape: a row's result has the same bits alone and in a batch.
    """
    T, R = _literal(n_w), _literal(n_x)
    if T is None or R is None:
        return None
    ints = (types.intp,) * 5
    sig = types.void(ints[0], n_w, n_x, x, blocks, *ints[1:], res)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        xa = context.make_array(a[3])(context, builder, args[3])
        wa = context.make_array(a[4])(context, builder, args[4])
        ra = context.make_array(a[9])(context, builder, args[9])
        call_args = [
            builder.bitcast(xa.data, _I8.as_pointer()),
            cgutils.unpack_tuple(builder, xa.strides)[0],
            cgutils.unpack_tuple(builder, xa.shape)[1],
            builder.bitcast(wa.data, _I8.as_pointer()),
            cgutils.unpack_tuple(builder, wa.strides)[0],
            *args[5:9],
            builder.bitcast(ra.data, _F32.as_pointer()),
        ]
        _each_type(
            builder,
            args[0],
            lambda K: builder.call(
                _tile_function(builder.module, K, T, R, _can_permute(context)), call_args
            ),
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _widen_row(typingctx, kind, blocks, j, out, i):  # type: ignore[no-untyped-def]
    """``out[i, :] = W[j]`` widened to float32: the values ``gguf.dequantize`` gives."""
    sig = types.void(types.intp, blocks, types.intp, out, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        wa = context.make_array(a[1])(context, builder, args[1])
        oa = context.make_array(a[3])(context, builder, args[3])
        row = _row_ptr(context, builder, wa, args[2])
        dst = _row_ptr(context, builder, oa, args[4])
        k_in = cgutils.unpack_tuple(builder, oa.shape)[1]

        def emit(K: int) -> None:
            values, nbytes = QuantType(K).block_values, QuantType(K).block_bytes
            with cgutils.for_range(builder, builder.udiv(k_in, ir.Constant(_I64, values))) as loop:
                start = builder.mul(loop.index, ir.Constant(_I64, nbytes))
                first = builder.mul(loop.index, ir.Constant(_I64, values * 4))
                blk = _Block(builder, row, start, permute=_can_permute(context))
                for v, thunk in enumerate(_block_vectors(K, blk)):
                    at = builder.add(first, ir.Constant(_I64, 64 * v))
                    builder.store(thunk(), _byte_ptr(builder, dst, at, _VF32), align=4)

        _each_type(builder, args[0], emit)
        return context.get_dummy_value()

    return sig, codegen


# --- the product ---------------------------------------------------------------

# Tile shapes: (weight rows, x rows), by the product's row count. Measured one
# core, SmolLM2's shapes (bench/bench_gguf.py --products): one row takes
# sixteen weight rows (sixteen accumulators hide the FMA latency, sixteen
# memory streams); up to four rows 4 x 4 (a 2 x 8 tile would repeat rows);
# more 2 x 8: 86 GFLOP/s a core at 16 rows against 74 for 4 x 4 and 37 for
# 1 x 16 (whose x loads, one per FMA, came from L2).
_ONE_W, _ONE_X = 16, 1
_FEW_W, _FEW_X = 4, 4
_MANY_W, _MANY_X = 2, 8
_GROUP = 16  # parallel blocks are whole multiples of every tile's weight rows
_BLOCK_ROWS_MAX = 256  # weight rows per parallel block at most


@njit(inline="always")
def _tile_shape(n: int) -> tuple[int, int]:  # pragma: no cover - numba
    if n == 1:
        return _ONE_W, _ONE_X
    if n <= _FEW_X:
        return _FEW_W, _FEW_X
    return _MANY_W, _MANY_X


@njit(inline="always")
def _tile_of(kind, n, x, blocks, r0, last, j0, e, res):  # type: ignore[no-untyped-def]  # pragma: no cover
    # the tile of _tile_shape(n): its shape must be compile-time constants
    if n == 1:
        _tile(kind, _ONE_W, _ONE_X, x, blocks, r0, last, j0, e, res)
    elif n <= _FEW_X:
        _tile(kind, _FEW_W, _FEW_X, x, blocks, r0, last, j0, e, res)
    else:
        _tile(kind, _MANY_W, _MANY_X, x, blocks, r0, last, j0, e, res)


@njit(cache=True, nogil=True, parallel=True)
def _quant_matmul(x: Any, blocks: Any, kind: int, out: Any, block: int) -> None:  # pragma: no cover
    # x (n, k_in) float32; blocks (n_out, bytes per row) uint8; out (n, n_out).
    # Threads split the weight rows into blocks; inside one, each group of
    # weight rows meets every tile of x rows while its bytes sit in L1, so the
    # quantized bytes come from memory once per product whatever n.
    n = x.shape[0]
    n_out = blocks.shape[0]
    nw, nx = _tile_shape(n)
    for blk in prange((n_out + block - 1) // block):
        j0 = blk * block
        j1 = min(j0 + block, n_out)
        res = np.empty(nw * nx, np.float32)
        for g in range(j0, j1, nw):
            for r0 in range(0, n, nx):
                _tile_of(kind, n, x, blocks, r0, n - 1, g, j1 - 1, res)
                for r in range(min(nx, n - r0)):
                    for t in range(min(nw, j1 - g)):
                        out[r0 + r, g + t] = res[r * nw + t]


@njit(cache=True, nogil=True, parallel=True)
def _widen_rows(blocks: Any, ids: Any, kind: int, out: Any) -> None:  # pragma: no cover - numba
    # out[i] = row ids[i] of the quantized matrix, as float32 (embedding lookup)
    for i in prange(ids.shape[0]):
        _widen_row(kind, blocks, ids[i], out, i)  # type: ignore[call-arg]  # typingctx is numba's


# --- public API ----------------------------------------------------------------


# Row lookups (the embedding) of fewer rows run on the calling thread: one 576-wide
# Q8_0 row widens in ~1-3 us, a parallel region costs ~10 us or more (busy machine:
# 16 -> 4 us of wall for one token, docs/engine.md "The step's fixed costs")
_PARALLEL_LOOKUP_ROWS = 16


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
    # False: products quantize x to int8 per block and multiply integers
    # (quant_int8.py, the default, as llama.cpp does); True: x stays float32
    # and the weights are widened (what transformers computes: the
    # conformance suite's path, `--exact-activations`)
    exact_activations: bool = False
    # the int8 product's copy of the blocks, sixteen rows interleaved
    # (quant_pack.py), made once by packed(): at load through matmul.prepare
    _packed: dict[str, np.ndarray] = field(default_factory=dict, repr=False, init=False)
    # the int8 product's table of this weight (quant_int8.PartsTable), made once
    _table: dict[str, quant_int8.PartsTable] = field(default_factory=dict, repr=False, init=False)
    # what linear() needs per call, made on the first (int8_call)
    _call: dict[str, tuple[int, quant_int8.PartsTable] | None] = field(
        default_factory=dict, repr=False, init=False
    )
    # a one-row product's kernel arguments, by threads.SERIAL_MAX_BYTES (_one_row_args)
    _one_row: dict[int | None, tuple[Any, ...] | None] = field(
        default_factory=dict, repr=False, init=False
    )

    def int8_call(self) -> tuple[int, quant_int8.PartsTable] | None:
        """``(activation block, table)`` of the int8 product, or None (exact path); made once."""
        if "int8" not in self._call:
            self._call["int8"] = (
                None
                if self.exact_activations
                else (quant_int8.activation_block(int(self.qtype)), self.table())
            )
        return self._call["int8"]

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

    def packed(self) -> np.ndarray:
        """The blocks repacked for the int8 product (:func:`quant_pack.pack`), made once.

        Trap: the first call repacks the whole matrix (a second copy of its
        bytes; the blocks' pages of a file mapping are dropped from memory after,
        faulted back when read); ``matmul.prepare`` calls it at load so no
        request pays for it.
        """
        if "int8" not in self._packed:
            self._packed["int8"] = quant_pack.pack(self.blocks, int(self.qtype))
            # the file's pages of these blocks: read again only by the embedding
            # lookup, so out of resident memory until then (quant_pack.release_pages)
            quant_pack.release_pages(self.blocks)
        return self._packed["int8"]

    def table(self) -> quant_int8.PartsTable:
        """The int8 product's :class:`quant_int8.PartsTable` of this weight, made once."""
        if "int8" not in self._table:
            self._table["int8"] = quant_int8.parts_table(
                [(self.packed(), int(self.qtype), self.shape[0])]
            )
        return self._table["int8"]

    def __getitem__(self, ids: Any) -> np.ndarray:
        """Rows ``ids`` (an integer array) widened to float32: only those rows are read."""
        idx = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"row index outside 0..{self.shape[0] - 1}")
        out = np.empty((idx.size, self.shape[1]), np.float32)
        if idx.size >= _PARALLEL_LOOKUP_ROWS:
            _widen_rows(self.blocks, idx, int(self.qtype), out)
        elif idx.size:  # a decode step's few tokens: a region would cost more than the rows
            threads.on_calling_thread(_widen_rows, self.blocks, idx, int(self.qtype), out)
        return out.reshape((*np.shape(ids), self.shape[1]))

    def dequantize(self) -> np.ndarray:
        """The whole weight as float32 (tests and tools; the forward never calls it)."""
        return self[np.arange(self.shape[0])]

    def take_rows(self, order: np.ndarray) -> QuantizedTensor:
        """The same weight with its rows reordered (a row is a run of whole blocks)."""
        blocks = np.ascontiguousarray(self.blocks[order])
        return QuantizedTensor(self.qtype, self.shape, blocks, self.exact_activations)

    def with_exact_activations(self, exact: bool = True) -> QuantizedTensor:
        """The same blocks, multiplied with float32 (``True``) or int8 activations."""
        return QuantizedTensor(self.qtype, self.shape, self.blocks, exact)


@dataclass(frozen=True, eq=False)
class QuantizedStack:
    """Quantized weights stacked along the output axis, each part kept as it is.

    A Q4_K_M file stores ``attn_v`` in Q6_K beside a Q4_K ``attn_q``. The int8
    product takes up to ``quant_int8.PARTS`` parts of one activation block in
    one kernel call, each part's outputs into its columns (every fused product
    of the int8 path is a stack: :func:`stack_rows`); otherwise, and on the
    ``exact_activations`` path, one call per part.
    """

    parts: tuple[QuantizedTensor, ...]
    # the int8 product's table of the parts (quant_int8.PartsTable), made once
    _table: dict[str, quant_int8.PartsTable] = field(default_factory=dict, repr=False, init=False)
    _call: dict[str, tuple[int, quant_int8.PartsTable] | None] = field(
        default_factory=dict, repr=False, init=False
    )
    _one_row: dict[int | None, tuple[Any, ...] | None] = field(
        default_factory=dict, repr=False, init=False
    )
    # shape and bytes, summed once: linear() reads them on every call (a sum over
    # the parts each time was ~1 us of a batch-1 product's Python path)
    _shape: tuple[int, int] = field(default=(0, 0), repr=False, init=False)
    _nbytes: int = field(default=0, repr=False, init=False)

    def __post_init__(self) -> None:
        shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        object.__setattr__(self, "_shape", shape)  # frozen: set once, here
        object.__setattr__(self, "_nbytes", sum(p.nbytes for p in self.parts))

    def int8_call(self) -> tuple[int, quant_int8.PartsTable] | None:
        """``(activation block, table)`` when the int8 product takes the parts in one
        call (``_in_one_call``), else None (a call per part); made once."""
        if "int8" not in self._call:
            self._call["int8"] = (
                (quant_int8.activation_block(int(self.parts[0].qtype)), self.table())
                if _in_one_call(self)
                else None
            )
        return self._call["int8"]

    def table(self) -> quant_int8.PartsTable:
        """The int8 product's :class:`quant_int8.PartsTable` of the parts, made once.

        Only for a stack :func:`linear` multiplies in one call (``_in_one_call``)."""
        if "int8" not in self._table:
            self._table["int8"] = quant_int8.parts_table(
                [(p.packed(), int(p.qtype), p.shape[0]) for p in self.parts]
            )
        return self._table["int8"]

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def data(self) -> np.ndarray:
        return self.parts[0].blocks

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts], axis=0)


Quantized = QuantizedTensor | QuantizedStack


def stack_rows(parts: list[Any]) -> QuantizedTensor | QuantizedStack:
    """Quantized weights stacked along the output axis (fused q/k/v, gate/up).

    On the int8 path (the default) the parts stay as they are, views of the
    file, in a :class:`QuantizedStack` whose product takes them in one kernel
    call (each part packed once, here; a concatenated copy of the blocks would
    be the weight once more in memory, read by nothing). With
    ``exact_activations`` parts of one type become one tensor (one call of the
    widening kernel), mixed types a stack. Every part must be quantized and of
    one width.
    """
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        kinds = ", ".join(
            p.qtype.name if isinstance(p, QuantizedTensor) else str(p.dtype) for p in parts
        )
        raise ValueError(f"weights multiplied as one must all be quantized, got {kinds}")
    cols = parts[0].shape[1]
    if any(p.shape[1] != cols for p in parts):
        raise ValueError("weights multiplied as one must have one width")
    exact = parts[0].exact_activations
    if not exact:
        for p in parts:
            p.packed()  # at load, as matmul.prepare does for a single weight
        return QuantizedStack(tuple(parts))
    if any(p.qtype != parts[0].qtype for p in parts):
        return QuantizedStack(tuple(parts))
    blocks = np.concatenate([p.blocks for p in parts], axis=0)
    return QuantizedTensor(parts[0].qtype, (blocks.shape[0], cols), blocks, exact)


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


# How fast one thread streams a one-row int8 product's weights from memory (GB/s;
# threads.split_pays weighs it against two threads): SmolLM2 Q8_0 and Q4_1,
# Qwen2.5-Coder-0.5B Q4_K_M products in step order, thread CPU time, 19-24 GB/s
# once the ~8-10 us a call costs besides is taken out (engine.md). The exact path
# (float32 activations) is slower per byte, so for it the threshold is on the
# safe side: it splits fewer products than it could.
INT8_ONE_THREAD_GBS = 19.0


def block_rows(n_out: int, n_threads: int) -> int:
    """Weight rows per parallel block: a multiple of 16, about 8 blocks per thread."""
    target = max(_GROUP, -(-n_out // (8 * n_threads)))
    return -(-min(target, _BLOCK_ROWS_MAX) // _GROUP) * _GROUP


def _in_one_call(w: QuantizedStack) -> bool:
    """Whether the int8 product can take a stack's parts in one call (one quantized x)."""
    block = quant_int8.activation_block
    first = block(int(w.parts[0].qtype))
    return (
        not w.parts[0].exact_activations
        and len(w.parts) <= quant_int8.PARTS
        and all(block(int(p.qtype)) == first for p in w.parts)
    )


def linear(
    x: np.ndarray,
    w: QuantizedTensor | QuantizedStack,
    out: np.ndarray,
    *,
    int8_rows: dict[int, Int8Rows] | None = None,
) -> np.ndarray:
    """``out[:] = x @ W.T`` in float32, computed from the blocks. ``out`` is ``(n, out)``.

    Unless the weight asks for ``exact_activations``, ``x`` is quantized to
    int8 per block once (``int8_rows`` keeps it by block size, so every part
    of a stack shares it) and multiplied with integer dot products
    (:mod:`triollm.model.quant_int8`). The caller (``matmul.linear``) has
    checked the shapes and dtypes. One row times a weight too small to repay a
    parallel region (``threads.split_pays``) runs on the calling thread; one row
    times a larger weight is one call opening one region.
    """
    n = x.shape[0]
    if n == 1 and int8_rows is None:
        args = w._one_row.get(threads.SERIAL_MAX_BYTES, _UNSET)
        if args is _UNSET:
            args = w._one_row[threads.SERIAL_MAX_BYTES] = _one_row_args(w)
        if args is not None:
            return _int8_one_row_product(x, args, out)
    if not n:
        return out
    serial = n == 1 and not threads.split_pays(w.nbytes, INT8_ONE_THREAD_GBS)
    if serial:
        return threads.on_calling_thread(_linear, x, w, out, int8_rows)  # type: ignore[no-any-return]
    return _linear(x, w, out, int8_rows)


_UNSET: Any = object()  # _one_row's "not made yet" (None is "no int8 one-row path")


def _one_row_args(w: QuantizedTensor | QuantizedStack) -> tuple[Any, ...] | None:
    """What a one-row int8 product of ``w`` passes besides ``x`` and ``out``, or None
    (the exact path, or a stack of more parts or blocks than one call takes).

    ``(split, block, width, rows, p0, p1, p2, kinds, first, cols)``: made once per
    weight and ``threads.SERIAL_MAX_BYTES`` value (a benchmark changes it between
    steps), so a batch-1 product's Python is a dictionary lookup, not the split
    rule, the table and the shape each call: ~1.3 us of the ~2 us a product spent
    outside its kernel, ~0.15 ms of a SmolLM2 step's 121 products (docs/engine.md,
    "The step's fixed costs"). Hazard: the split decision is frozen per value of
    SERIAL_MAX_BYTES; a change of threads.REGION_US or of INT8_ONE_THREAD_GBS at
    run time (nothing does it) would not be seen by a weight already used.
    """
    call = w.int8_call()
    if call is None:
        return None
    block, table = call
    split = threads.split_pays(w.nbytes, INT8_ONE_THREAD_GBS)
    return (split, block, w.in_features, table.rows, *table.parts,
            table.kinds, table.first, table.cols)  # fmt: skip


def _int8_one_row_product(x: np.ndarray, args: tuple[Any, ...], out: np.ndarray) -> np.ndarray:
    """One int8 row times a weight's parts in one numba call: on the calling thread
    (:func:`_int8_one_row`) or split over the team (:func:`_int8_one_row_split`)."""
    split, block, k, rows, p0, p1, p2, kinds, first, cols = args
    q, d, sums = _row_buffers(k, block)
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if split:
        lanes = thread_count()
        per_task = block_rows(rows, lanes) // quant_int8.ROWS
        _int8_one_row_split(x, block, q, d, sums, p0, p1, p2,
                            kinds, first, cols, out, per_task, lanes)  # fmt: skip
    else:
        _int8_one_row(x, block, q, d, sums, p0, p1, p2, kinds, first, cols, out)
    return out


@njit(cache=True, nogil=True)
def _int8_one_row(x, block, q, d, sums, p0, p1, p2, kinds, first, cols, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    # One activation row quantized and multiplied by every part, in one call on the
    # calling thread: quant_int8.quantize_rows and product_table's _int8_matmul do
    # this in two calls, two record allocations and a parfor launch even with a team
    # of one (~8-14 us of a SmolLM2 product, against 6-25 us of work; engine.md,
    # "The step's fixed costs"). The same compiled _quantize_row and the same
    # one-row tile per group of 16 weight rows as _int8_matmul's n == 1 path, so the
    # same bits (test_threads compares them). Hazard: it follows quant_int8's
    # private tile and row quantizer; a change of their arguments shows here first.
    quant_int8._quantize_row(x, np.int64(0), block, q, d, sums)
    for p in range(quant_int8.PARTS):
        w = p0 if p == 0 else (p1 if p == 1 else p2)
        kind, at, m = kinds[p], cols[p], cols[p + 1] - cols[p]
        for g in range(first[p + 1] - first[p]):
            quant_int8._int8_tile(kind, 1, 0, q, d, sums, w, out, g, 0, 0, at, m)


@intrinsic
def claim_next(typingctx: Any, counter: Any) -> Any:
    """``counter[0] += 1`` as one atomic step; returns the value before it.

    How a one-row product hands out its runs of weight rows: whichever thread asks next
    gets the next run, so a worker still waking up takes fewer. "monotonic" ordering
    is enough: the inputs were written before the region began and the outputs are
    read after it ended, both of which order memory already. matmul.py's one-row
    panels and attention's parallel driver (its items) use it too. Hazard: numba's
    cache does not see a change here from a cached caller in another file; check
    such a change on a fresh cache.
    """
    if not (
        isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.layout == "C"
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", arr.data, one, "monotonic")

    return types.int64(counter), codegen


@njit(cache=True, nogil=True, parallel=True)
def _int8_one_row_split(x, block, q, d, sums, p0, p1, p2, kinds, first, cols, out, per_task, lanes):  # type: ignore[no-untyped-def]  # pragma: no cover
    # _int8_one_row with the groups split over the team (a weight large enough to
    # repay a region: threads.split_pays), in one call: the row is quantized on the
    # calling thread into its buffers, then `lanes` threads (the team's size, passed
    # in: get_num_threads in a kernel makes it uncachable) claim runs of per_task
    # groups one at a time, each through the same one-row tile as _int8_matmul's
    # n == 1 path, so the same bits (test_threads). Claimed, not a prange over the
    # runs: numba splits those statically, and the calling thread then waited for
    # a sleeping worker to wake and do its half; now it starts at once and the
    # worker takes what is left when it arrives. Against quantize_rows +
    # product_table it saves a numba call, three fresh arrays and a record, the
    # table's checks and the Python between them (~5-9 us a product; engine.md,
    # "The step's fixed costs"). Hazard: the row buffers are the calling
    # thread's; the workers only read them, and only inside this call.
    quant_int8._quantize_row(x, np.int64(0), block, q, d, sums)
    groups = first[quant_int8.PARTS]
    runs = (groups + per_task - 1) // per_task
    next_run = np.empty(1, np.int64)  # not np.zeros: parallel=True makes that a region
    next_run[0] = 0
    for _lane in prange(lanes):
        while True:
            task = claim_next(next_run)
            if task >= runs:
                break
            g0 = task * per_task
            g1 = min(g0 + per_task, groups)
            for p in range(quant_int8.PARTS):  # the part once per run of its groups
                w = p0 if p == 0 else (p1 if p == 1 else p2)
                kind, at, m = kinds[p], cols[p], cols[p + 1] - cols[p]
                for gg in range(max(g0, first[p]), min(g1, first[p + 1])):
                    g = gg - first[p]
                    quant_int8._int8_tile(kind, 1, 0, q, d, sums, w, out, g, 0, 0, at, m)


_rows = threading.local()  # one thread's int8 row buffers, by (width, block)


def _row_buffers(k: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's buffers for one int8 activation row of ``k`` values (q, d, sums).

    Per thread: two forwards on two models in two threads must not share them. A
    row's buffers are filled and consumed inside one :func:`_int8_one_row` call."""
    cache = getattr(_rows, "cache", None)
    if cache is None:
        cache = _rows.cache = {}
    key = (k, block)
    if key not in cache:
        cache[key] = quant_int8.row_buffers(1, k, block)
    return cache[key]  # type: ignore[no-any-return]


def _linear(
    x: np.ndarray,
    w: QuantizedTensor | QuantizedStack,
    out: np.ndarray,
    int8_rows: dict[int, Int8Rows] | None,
) -> np.ndarray:
    call = w.int8_call()  # the int8 product in one kernel call: its block and table
    if call is not None:
        block, table = call
        if int8_rows is None:
            acts = quant_int8.quantize_rows(x, block)
        else:  # a stack's parts share one quantized x per block size
            if block not in int8_rows:
                int8_rows[block] = quant_int8.quantize_rows(x, block)
            acts = int8_rows[block]
        rows = block_rows(table.rows, thread_count())
        return quant_int8.product_table(acts, table, out, rows)
    if isinstance(w, QuantizedStack):  # parts the int8 product cannot take in one call
        shared: dict[int, Int8Rows] = {} if int8_rows is None else int8_rows
        j = 0
        for part in w.parts:
            # through a contiguous temporary: a column range of `out` would be a
            # strided array, and numba compiles the kernel once more for that layout
            out[:, j : j + part.shape[0]] = _linear(
                x, part, np.empty((x.shape[0], part.shape[0]), np.float32), shared
            )
            j += part.shape[0]
        return out
    # exact_activations: x stays float32, the weights are widened
    _quant_matmul(np.ascontiguousarray(x), w.blocks, int(w.qtype), out,
                  block_rows(w.shape[0], thread_count()))  # fmt: skip
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


class ExactActivationsSource:
    """A TensorSource whose quantized weights multiply float32 activations.

    ``--exact-activations`` on the command line, ``exact_activations=True`` to ``load_model``.

    The default multiplies int8-quantized activations (``quant_int8.py``):
    faster, and about 0.5% off per product. This wrapper keeps ``x`` in
    float32, which is what transformers computes on the dequantized weights;
    the conformance tests load through it.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def where(self, key: str) -> str:
        return str(self.inner.where(key))

    def get_tensor(self, key: str) -> Any:
        arr = self.inner.get_tensor(key)
        return arr.with_exact_activations() if isinstance(arr, QuantizedTensor) else arr


def warm_up() -> None:
    """Compile (or load from numba's cache) both products and the row lookup once."""
    w = quantize(np.zeros((4, 32), np.float32), QuantType.Q8_0)
    for weight in (w, w.with_exact_activations()):
        for n in (1, 2):  # one row quantizes on the calling thread, more in parallel
            linear(np.zeros((n, 32), np.float32), weight, np.empty((n, 4), np.float32))
    args = _one_row_args(w)  # a large weight's one-row driver (small weights take the other)
    if args is not None:
        x = np.zeros((1, 32), np.float32)
        _int8_one_row_product(x, (True, *args[1:]), np.empty((1, 4), np.float32))
    w[np.zeros(1, np.int64)]
