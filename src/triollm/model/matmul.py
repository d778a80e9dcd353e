"""Weight products: every ``x @ W.T`` of the forward pass goes through here.

A checkpoint stores a linear layer as ``W`` of shape ``[out, in]``. :func:`prepare`
turns it once, at load time, into a :class:`PreparedWeight`; :func:`linear` then
computes ``x @ W.T`` in float32 for a batch of rows.

Theory of operation
-------------------
A decode step multiplies a handful of rows by every weight of the model, so it
is bound by memory bandwidth, not arithmetic: the floor of one step is the
weight bytes divided by the bandwidth (docs/performance.md does the sums).
Two things follow.

1. **Read each weight once per step, whatever the row count.** BLAS handles a
   skinny product (4-32 rows) badly: on this machine OpenBLAS runs a 16-row
   product at 80-100 GFLOP/s, so 16 rows cost several times one row. The numba
   kernel below reads each weight row once and multiplies it into every row of
   x, four rows (a tile in registers) at a time: 16 rows then cost 2-3x one
   row, bound by arithmetic rather than memory. A single row (batch-1 decode)
   takes sixteen weight rows per pass instead, to keep more memory streams in
   flight; both paths prefetch the weight rows that come next.
2. **Read fewer bytes.** bfloat16 and float16 weights stay 16-bit in memory
   and are widened to float32 in registers, inside the kernel: half the bytes
   of float32, the same float32 arithmetic. (numpy has no bfloat16, and numba
   cannot load float16, so both travel as 16-bit integers: ``uint16`` holds
   bfloat16 bits, ``int16`` holds float16 bits; the integer type is the tag.)

Large row counts (a long prefill chunk) are compute bound. The same kernel
handles them, in chunks of 64 rows that stay in L2 beside a block of weights.
:func:`linear` can hand products of ``blas_min_rows`` rows or more to BLAS
instead (a 16-bit weight is then widened into a temporary float32 copy for
that call); by default it does not: see ``BLAS_MIN_ROWS``.

Hazards
-------
- The kernel is compiled ``nogil=True`` because the server runs the forward in
  a worker thread; holding the GIL there would freeze the trio event loop.
- Rows are computed in tiles of four; a short last tile repeats its last row
  (the extra results are dropped), so every row of every batch runs the same
  instructions: a sequence's logits do not depend on which other rows share
  its step (batch invariance, bit for bit). With a BLAS threshold set, BLAS
  results differ from the kernel's in the last bits, so a step that crosses
  it breaks bit-equality (not the tolerance the conformance tests use).
- ``x`` must be float32: a float64 row would silently promote the residual
  stream and make the step many times slower, so it is rejected.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field
from typing import Any

# Hazard: numba's OpenMP workers (and so every parallel kernel of the engine)
# spin-wait between parallel regions by default. A forward pass launches ~200
# regions per step; when more threads want the CPU than there are cores (other
# processes, the event loop, BLAS's own threads), spinning workers steal the
# cores the working ones need and a step ran 10x slower on the 2-core target
# (docs/performance.md). Passive waiting costs a futex wake-up per region
# instead. It must be set before the OpenMP runtime starts (the first parallel
# kernel call); a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from triollm.model import quant
from triollm.model.quant import Quantized, QuantizedStack, QuantizedTensor

# Row count from which linear() hands a product to BLAS; None: never.
# Measured on the 2-core target machine (docs/performance.md): the kernel beats
# OpenBLAS at every row count there, up to a 512-row prefill, because OpenBLAS's
# spinning threads collapse when the cores are shared; and one code path keeps
# every step bit-for-bit batch invariant. A quiet machine with a fast BLAS may
# prefer BLAS for long prefill chunks: `bench_engine.py --blas-min-rows` tells.
BLAS_MIN_ROWS: int | None = None

# Rows of x processed against one block of weights while both sit in L2
# (64 rows x 1536 inputs x 4 bytes = 384 KiB); a decode step fits in one chunk.
_ROW_CHUNK = 64
# Bytes of one thread's block of weight rows: kept in L2 (1 MiB per core here)
# beside the chunk of x, so a prefill's row chunks re-read it from L2, not DRAM.
_BLOCK_BYTES = 256 * 1024
# Weight rows up to this many bytes are software-prefetched by the one-row path.
_PREFETCH_MAX_ROW_BYTES = 2048
_ALWAYS = 1 << 62  # a row-byte limit no row reaches

_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}


# --- widening 16-bit weights inside the kernel -------------------------------


@intrinsic
def _bf16_bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """bfloat16 is the top half of a float32: shift the bits up by 16."""
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = builder.zext(args[0], ir.IntType(32))
        shifted = builder.shl(wide, ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(shifted, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f16_bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """float16 bits to float32 (one vcvtph2ps per 16 values with F16C)."""
    if bits != types.int16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


def _widen(v):  # type: ignore[no-untyped-def]  # numba matches the overload by parameter names
    """One stored weight element as float32 (numba-only; typed by overload)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_widen, inline="always")
def _widen_impl(v):  # type: ignore[no-untyped-def]  # names must match _widen exactly
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: _bf16_bits_to_f32(v)
    if v == types.int16:
        return lambda v: _f16_bits_to_f32(v)
    return None


@intrinsic
def _bf16_pair_lo(typingctx: Any, pair: Any) -> Any:
    """The first bfloat16 of a little-endian pair read as one uint32: low half up."""
    if pair != types.uint32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        shifted = builder.shl(args[0], ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(shifted, ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bf16_pair_hi(typingctx: Any, pair: Any) -> Any:
    """The second bfloat16 of the pair: the high half is already in place."""
    if pair != types.uint32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        masked = builder.and_(args[0], ir.Constant(ir.IntType(32), 0xFFFF0000))
        return builder.bitcast(masked, ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _prefetch_l2(typingctx: Any, w: Any, row: Any, offset: Any) -> Any:
    """Ask for the cache line at byte ``offset`` of ``w[row]`` to be brought into L2."""
    if not isinstance(w, types.Array):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        row_stride = cgutils.unpack_tuple(builder, ary.strides)[0]
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        byte = builder.add(builder.mul(args[1], row_stride), args[2])
        ptr = builder.gep(builder.bitcast(ary.data, i8p), [byte])
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, locality 2 (prefetcht1: L2 and out), data cache
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(w, types.intp, types.intp), codegen


@njit(inline="always")
def _prefetch_rows(w: Any, j: int, j1: int, max_row_bytes: int) -> None:  # pragma: no cover - numba
    # Bring weight rows j..j1-1 (contiguous in memory) towards L2 while the
    # current rows are multiplied. The hardware prefetcher follows long streams
    # but ramps up again on every short one (a bf16 row of 576 is 18 cache
    # lines), and one core alone then read bf16 rows 15 % slower. In the
    # one-row path, rows over _PREFETCH_MAX_ROW_BYTES stream well alone
    # (prefetching them measured a few percent slower); the 4-row tiles, slower
    # consumers, gained 5-13 % (f32) and 20-75 % (bf16) from it at any length.
    row_bytes = w.shape[1] * w.itemsize
    if row_bytes > max_row_bytes:
        return
    for r in range(j, j1):
        for off in range(0, row_bytes, 64):
            _prefetch_l2(w, r, off)  # type: ignore[call-arg]  # typingctx is numba's


def _fma(acc, x, w, k):  # type: ignore[no-untyped-def]  # numba matches the overload by names
    """``acc`` plus the product of x and w at stored column ``k`` (numba-only)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_fma, inline="always")
def _fma_impl(acc, x, w, k):  # type: ignore[no-untyped-def]  # names must match _fma exactly
    if w.dtype == types.uint32:
        # bfloat16 read two at a time: a shift and a mask widen both, where
        # one at a time needs a zero-extending shuffle per value (the shuffle
        # port, not memory, limited the one-at-a-time bf16 kernel)
        return lambda acc, x, w, k: (
            acc + x[2 * k] * _bf16_pair_lo(w[k]) + x[2 * k + 1] * _bf16_pair_hi(w[k])
        )
    return lambda acc, x, w, k: acc + x[k] * _widen(w[k])


# --- the streaming kernel ----------------------------------------------------


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _stream_matmul(x: Any, w: Any, out: Any, block: int) -> None:  # pragma: no cover - numba
    # x (n, K) float32; w (N, K) float32 | uint16 bf16 bits | int16 f16 bits;
    # out (n, N) float32. Threads split the weight rows (output columns) into
    # blocks (sized to stay in L2). Four weight rows at a time stay in L1 while
    # every 4-row tile of a chunk of x (sized to stay in L2) passes over them.
    # With n <= _ROW_CHUNK (every decode step) each weight byte comes from
    # memory exactly once; a long prefill re-reads the block from L2 per chunk.
    n = x.shape[0]
    n_out, k_in = w.shape  # k_in counts stored columns: in_features / 2 for bf16 pairs
    last = n - 1
    for blk in prange((n_out + block - 1) // block):
        j0 = blk * block
        j1 = min(j0 + block, n_out)
        if n == 1:
            _block_product_one_row(x[0], w, out[0], j0, j1, k_in)
            continue
        for r0 in range(0, n, _ROW_CHUNK):
            r1 = min(r0 + _ROW_CHUNK, n)
            _block_product(x, w, out, j0, j1, r0, r1, last, k_in)


@njit(inline="always", fastmath=True)
def _block_product_one_row(
    x0: Any, w: Any, out0: Any, j0: int, j1: int, k_in: int
) -> None:  # pragma: no cover - numba
    # out0[j0:j1] for a single row (batch-1 decode). Sixteen weight rows per
    # pass: 16 memory streams in flight, and 16 independent accumulators, as
    # in the 4x4 tile, so the compiler vectorises both loops alike and a row
    # alone gets the same bits as inside a batch (the invariance test checks).
    j = j0
    while j < j1:
        _prefetch_rows(w, j + 16, min(j + 32, j1), _PREFETCH_MAX_ROW_BYTES)
        e = j1 - 1  # a short last group repeats its last row
        w0 = w[j]
        w1 = w[min(j + 1, e)]
        w2 = w[min(j + 2, e)]
        w3 = w[min(j + 3, e)]
        w4 = w[min(j + 4, e)]
        w5 = w[min(j + 5, e)]
        w6 = w[min(j + 6, e)]
        w7 = w[min(j + 7, e)]
        w8 = w[min(j + 8, e)]
        w9 = w[min(j + 9, e)]
        w10 = w[min(j + 10, e)]
        w11 = w[min(j + 11, e)]
        w12 = w[min(j + 12, e)]
        w13 = w[min(j + 13, e)]
        w14 = w[min(j + 14, e)]
        w15 = w[min(j + 15, e)]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        s8 = s9 = s10 = s11 = s12 = s13 = s14 = s15 = np.float32(0.0)
        for k in range(k_in):
            s0 = _fma(s0, x0, w0, k)
            s1 = _fma(s1, x0, w1, k)
            s2 = _fma(s2, x0, w2, k)
            s3 = _fma(s3, x0, w3, k)
            s4 = _fma(s4, x0, w4, k)
            s5 = _fma(s5, x0, w5, k)
            s6 = _fma(s6, x0, w6, k)
            s7 = _fma(s7, x0, w7, k)
            s8 = _fma(s8, x0, w8, k)
            s9 = _fma(s9, x0, w9, k)
            s10 = _fma(s10, x0, w10, k)
            s11 = _fma(s11, x0, w11, k)
            s12 = _fma(s12, x0, w12, k)
            s13 = _fma(s13, x0, w13, k)
            s14 = _fma(s14, x0, w14, k)
            s15 = _fma(s15, x0, w15, k)
        sums = (s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15)
        for t in range(min(16, j1 - j)):
            out0[j + t] = sums[t]
        j += 16


@njit(inline="always", fastmath=True)
def _block_product(
    x: Any, w: Any, out: Any, j0: int, j1: int, r0: int, r1: int, last: int, k_in: int
) -> None:  # pragma: no cover - numba
    # out[r0:r1, j0:j1] for one block of weight rows and one chunk of x rows
    j = j0
    while j < j1:
        # the next four weight rows come in while these four are multiplied:
        # the first row tile would otherwise wait on memory, compute idle
        _prefetch_rows(w, j + 4, min(j + 8, j1), _ALWAYS)
        wa = w[j]
        wb = w[min(j + 1, j1 - 1)]  # a short last group repeats its last row
        wc = w[min(j + 2, j1 - 1)]
        wd = w[min(j + 3, j1 - 1)]
        for r in range(r0, r1, 4):
            # a short last tile repeats row n-1: every row runs the same code
            x0 = x[r]
            x1 = x[min(r + 1, last)]
            x2 = x[min(r + 2, last)]
            x3 = x[min(r + 3, last)]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            b0 = b1 = b2 = b3 = np.float32(0.0)
            c0 = c1 = c2 = c3 = np.float32(0.0)
            d0 = d1 = d2 = d3 = np.float32(0.0)
            # hot spot: 4 rows x 4 weight rows = 16 vectorised dot products
            for k in range(k_in):
                a0 = _fma(a0, x0, wa, k)
                a1 = _fma(a1, x1, wa, k)
                a2 = _fma(a2, x2, wa, k)
                a3 = _fma(a3, x3, wa, k)
                b0 = _fma(b0, x0, wb, k)
                b1 = _fma(b1, x1, wb, k)
                b2 = _fma(b2, x2, wb, k)
                b3 = _fma(b3, x3, wb, k)
                c0 = _fma(c0, x0, wc, k)
                c1 = _fma(c1, x1, wc, k)
                c2 = _fma(c2, x2, wc, k)
                c3 = _fma(c3, x3, wc, k)
                d0 = _fma(d0, x0, wd, k)
                d1 = _fma(d1, x1, wd, k)
                d2 = _fma(d2, x2, wd, k)
                d3 = _fma(d3, x3, wd, k)
            _store4(out, r, last, j, a0, a1, a2, a3)
            if j + 1 < j1:
                _store4(out, r, last, j + 1, b0, b1, b2, b3)
            if j + 2 < j1:
                _store4(out, r, last, j + 2, c0, c1, c2, c3)
            if j + 3 < j1:
                _store4(out, r, last, j + 3, d0, d1, d2, d3)
        j += 4


@njit(inline="always")
def _store4(
    out: Any, r: int, last: int, j: int, v0: Any, v1: Any, v2: Any, v3: Any
) -> None:  # pragma: no cover - numba
    # column j of rows r..r+3, dropping the repeated rows past the last one
    out[r, j] = v0
    if r + 1 <= last:
        out[r + 1, j] = v1
    if r + 2 <= last:
        out[r + 2, j] = v2
    if r + 3 <= last:
        out[r + 3, j] = v3


def _block_rows(w: np.ndarray, n_threads: int) -> int:
    """Weight rows per parallel block: a multiple of 16, about 8 blocks per thread.

    Several blocks per thread even out the threads' shares; blocks of at least
    16 rows keep the per-block overhead small; at most ``_BLOCK_BYTES`` so a
    block stays in L2 (the output head has 49152 rows: 12 MB per thread else).
    """
    n_out, k_in = w.shape
    target = max(16, -(-n_out // (8 * n_threads)))
    cap = max(4, _BLOCK_BYTES // (k_in * w.itemsize))
    # a multiple of 16: the one-row path takes weight rows 16 at a time
    return -(-min(target, cap) // 16) * 16


# --- public API -------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight laid out for :func:`linear`: checkpoint layout ``[out, in]``, C-contiguous.

    ``data`` holds float32 values, or 16-bit patterns tagged by integer type
    (``uint16`` = bfloat16 bits, ``int16`` = float16 bits); ``storage`` names
    the format. ``nbytes`` is what one product reads from memory, whatever
    its row count: the quantity the bandwidth floor counts.
    """

    data: np.ndarray  # (out_features, in_features) float32 | uint16 | int16
    storage: str  # "float32" | "bfloat16" | "float16"
    # What the kernel streams: `data`, or for bfloat16 with an even in_features
    # the same memory as (out_features, in_features // 2) uint32 pairs.
    kernel_data: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        kd = self.data
        if self.storage == "bfloat16" and kd.shape[1] % 2 == 0:
            kd = kd.view(np.uint32)
        object.__setattr__(self, "kernel_data", kd)

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype in memory (uint16/int16 for the 16-bit float formats)."""
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def to_float32(self) -> np.ndarray:
        """The weight widened to float32, ``[out, in]`` (a new array unless float32)."""
        if self.storage == "float32":
            return self.data
        if self.storage == "bfloat16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        return self.data.view(np.float16).astype(np.float32)


@typing.overload
def prepare(w: np.ndarray, *, bf16: bool = False) -> PreparedWeight: ...
@typing.overload
def prepare(w: Quantized, *, bf16: bool = False) -> Quantized: ...
def prepare(w: np.ndarray | Quantized, *, bf16: bool = False) -> PreparedWeight | Quantized:
    """Keep a checkpoint weight ``w`` (``[out, in]``) in the layout :func:`linear` streams.

    ``w`` is float32 or float16, or with ``bf16=True`` the raw uint16 bits of
    a bfloat16 tensor. 16-bit weights stay 16-bit (half the bytes per step).
    Trap: a bf16 tensor must come as its bits with ``bf16=True``; an integer
    array without the flag is rejected, never read as numbers.
    """
    if isinstance(w, QuantizedTensor | QuantizedStack):  # GGUF blocks: kept (quant.py)
        return w
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    if bf16:
        if w.dtype != np.uint16:
            raise TypeError(f"bf16=True needs the raw uint16 bits, got dtype {w.dtype}")
        return PreparedWeight(np.ascontiguousarray(w), "bfloat16")
    if w.dtype == np.float32:
        return PreparedWeight(np.ascontiguousarray(w), "float32")
    if w.dtype == np.float16:
        return PreparedWeight(np.ascontiguousarray(w).view(np.int16), "float16")
    raise TypeError(
        f"weight dtype must be float32 or float16 (or uint16 bits with bf16=True), got {w.dtype}"
    )


def linear(
    x: np.ndarray,
    w: PreparedWeight | Quantized,
    out: np.ndarray | None = None,
    *,
    blas_min_rows: int | None = None,
) -> np.ndarray:
    """Return ``x @ W.T`` as float32 ``(n, out_features)`` for ``x`` float32 ``(n, in)``.

    With ``out`` given (float32, C-contiguous, shape ``(n, out_features)``) the
    result is written there and ``out`` is returned. Products of fewer than
    ``blas_min_rows`` rows (``None``: the module's ``BLAS_MIN_ROWS``) run the
    streaming numba kernel, which releases the GIL; larger ones run BLAS.
    Trap: ``x`` must be float32; a float64 ``x`` is rejected rather than
    silently promoting the residual stream.
    """
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be (n, {w.in_features}), got shape {x.shape}")
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    n = x.shape[0]
    if out is None:
        out = np.empty((n, w.out_features), dtype=np.float32)
    elif out.shape != (n, w.out_features) or out.dtype != np.float32:
        raise ValueError(
            f"out must be float32 ({n}, {w.out_features}), got {out.dtype} {out.shape}"
        )
    if n == 0:
        return out
    if isinstance(w, QuantizedTensor | QuantizedStack):  # the quantized kernels (quant.py)
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        return quant.linear(x, w, out)
    threshold = BLAS_MIN_ROWS if blas_min_rows is None else blas_min_rows
    if threshold is not None and n >= threshold:
        # compute bound: BLAS's blocked GEMM; the transposed view costs nothing here
        np.matmul(x, w.to_float32().T, out=out)
        return out
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    _stream_matmul(
        np.ascontiguousarray(x),
        w.kernel_data,
        out,
        _block_rows(w.data, numba.get_num_threads()),
    )
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for every storage format.

    Call at model load so the first request does not pay for compilation.
    """
    x = np.zeros((1, 8), np.float32)
    for bits in (np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float16)):
        linear(x, prepare(bits))
    for width in (8, 7):  # bfloat16: pairs (even width) and one at a time (odd)
        linear(x[:, :width], prepare(np.zeros((4, width), np.uint16), bf16=True))
