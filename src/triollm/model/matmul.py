"""Weight products: every ``x @ W.T`` of the forward pass goes through here.

A checkpoint stores a linear layer as ``W`` of shape ``[out, in]``. :func:`prepare`
repacks it once, at load time, into a :class:`PreparedWeight`; :func:`linear`
then computes ``x @ W.T`` in float32 for a batch of rows.

Theory of operation
-------------------
The product is written as a small GEMM kernel, the way BLAS libraries write
theirs, with one rule they do not keep: every output element is one plain
float32 multiply-add chain over ``k`` in order, whatever the row count.

1. **Column panels.** ``prepare`` stores the weight as ``[panel][k][32]``: the
   32 output columns of one panel are adjacent for each input index ``k``, so
   one panel is one contiguous stream of memory, and the threads split the
   panels (each thread then streams one contiguous range: what the hardware
   prefetcher follows best).
2. **A register tile.** For a tile of up to 8 rows of ``x`` and one panel, the
   kernel keeps 8 x 2 vectors of 16 float32 accumulators in registers; for
   each ``k`` it loads the panel's 32 weights (two vectors), broadcasts each
   row's ``x[r, k]`` and issues 16 fused multiply-adds. No horizontal sums,
   no spills: the loop is FMA bound at 16 rows and beyond, memory bound at
   one row. It is written in LLVM vector IR (``_make_tile``), because the
   autovectoriser will not keep a 2-D accumulator tile in registers.
3. **Bits independent of the batch.** Element ``(r, c)`` is
   ``fma(x[r, k], w[c, k], acc)`` for ``k = 0, 1, ...`` starting from 0, the
   same sequence in the 8-row, 4-row, 2-row and 1-row tiles, whichever tile
   and position the row lands in. A row alone (batch-1 decode), in a 16-row
   decode step or in a 512-row prefill gets the same bits by construction.
   Nothing reassociates it: the chains are ``llvm.fma`` calls without
   fast-math flags, which LLVM may neither reorder nor split.
4. **16-bit weights stay 16-bit.** bfloat16 and float16 panels are widened to
   float32 in registers, per loaded vector: half the bytes of float32, the
   same float32 arithmetic. bfloat16 is the top half of a float32; its panels
   interleave columns ``c`` and ``c + 16`` so that one 32-bit lane holds both,
   and one shift and one mask widen 32 values (no shuffles). float16 goes
   through ``vcvtph2ps``. (numpy has no bfloat16: ``uint16`` holds bfloat16
   bits and ``int16`` float16 bits; the integer type is the tag.)

Hazards
-------
- The kernel is compiled ``nogil=True`` because the server runs the forward in
  a worker thread; holding the GIL there would freeze the trio event loop.
- The ``k`` chain must stay sequential in every tile: a tile that summed it
  in another order (two half-chains, reversed, or numba arithmetic under
  ``fastmath``, which may reassociate) would give a row other bits alone than
  in a batch (``test_a_row_gets_the_same_bits_alone_and_in_a_batch`` fails).
- The last panel of a weight whose ``out_features`` is not a multiple of 32
  is padded with zero columns, never stored: the kernel masks its stores.
- A tied output head is also the embedding table: the model reads embedding
  rows from the panels (:meth:`PreparedWeight.rows`), so the weight is held once.
- With a BLAS threshold set, BLAS results differ from the kernel's in the last
  bits, so a step that crosses it breaks bit-equality (not the tolerance the
  conformance tests use).
- ``x`` must be float32: a float64 row would silently promote the residual
  stream and make the step many times slower, so it is rejected.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from triollm.model import quant, threads
from triollm.model.quant import Quantized, QuantizedStack, QuantizedTensor, claim_next
from triollm.model.threads import start_parallel_runtime

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)

# Row count from which linear() hands a product to BLAS; None: never.
# The kernel is bit-for-bit batch invariant and BLAS is not; `bench_engine.py
# --blas-min-rows` and `bench/bench_gemm.py` measure the two side by side.
BLAS_MIN_ROWS: int | None = None

PANEL = 32  # output columns per panel: two vectors of 16 float32
_LANES = 16  # float32 lanes of one AVX-512 vector
_ALIGN = 64  # panels start on a cache line

_F32 = np.dtype(np.float32)  # linear()'s identity test of a dtype

_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}


def _column_positions(storage: str) -> np.ndarray:
    """Where column ``c`` of a panel sits in its stored row of ``PANEL`` values.

    bfloat16 panels interleave columns ``c`` and ``c + 16`` (positions ``2c``
    and ``2c + 1``): one little-endian 32-bit lane then holds column ``c`` in
    its low half and ``c + 16`` in its high half, and widening is a shift (low)
    and a mask (high). The other formats keep the columns in order.
    """
    c = np.arange(PANEL)
    if storage == "bfloat16":
        return 2 * (c % _LANES) + c // _LANES
    return c


# --- the register tile, in LLVM vector IR ------------------------------------


def _make_tile(
    rows: int,
    panels: int = 1,
    prefetch_next: bool = False,
    prefetch_bytes: int = 0,
    prefetch_from: bool = False,
) -> Any:
    """An intrinsic computing ``out[r0 : r0 + rows, panel]`` for one column panel.

    ``tile(x, w, out, r0, panel, k_in, ncols)``: ``x`` (n, K) float32, ``w``
    (n_panels, K, PANEL) float32 | uint16 bfloat16 bits | int16 float16 bits,
    ``out`` (n, N) float32; ``ncols`` of the panel's columns are stored (the
    last panel's padding is masked off). For each ``k`` in order it loads the
    panel's 32 weights, widens them to two float32 vectors, broadcasts
    ``x[r, k]`` for each row and issues ``llvm.fma`` into ``rows x 2``
    accumulators that live in registers (SSA phis across the loop). No
    fast-math flag is set, so LLVM may neither reassociate nor split the
    chains: every element is the same sequence of roundings in every tile.

    ``prefetch_from``: the tile takes two more arguments, ``pf`` (any
    C-contiguous array) and ``pf_at`` (an element offset into it), and at each
    ``k`` asks for the lines of ``pf.flat[pf_at:]`` that lie as far in as the
    panel's row ``k`` lies in the panel (``prefetcht1``, into L2): a caller
    whose next panel is somewhere else than the next one in ``w`` (attention's
    next K/V tile, wherever the block table put it) gets it streamed in one
    line per ``k``, spread through the arithmetic. A hint: it changes no bit.
    """
    vecs = PANEL // _LANES
    nv = panels * vecs  # accumulators per row

    def typed(typingctx, x, w, out, r0, panel, k_in, ncols, pf_args):  # type: ignore[no-untyped-def]
        pf_ok = (
            len(pf_args) == 2
            and isinstance(pf_args[0], types.Array)
            and pf_args[0].layout == "C"
            and isinstance(pf_args[1], types.Integer)
            if prefetch_from
            else not pf_args
        )
        ok = pf_ok and (
            isinstance(x, types.Array)
            and x.dtype == types.float32
            and x.ndim == 2
            and isinstance(out, types.Array)
            and out.dtype == types.float32
            and out.ndim == 2
            and isinstance(w, types.Array)
            and w.ndim == 3
            and w.dtype in (types.float32, types.uint16, types.int16)
            and all(isinstance(t, types.Integer) for t in (r0, panel, k_in, ncols))
        )
        if not ok:
            return None
        sig = types.void(x, w, out, r0, panel, k_in, ncols, *pf_args)
        kind = str(w.dtype)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            a = signature.args
            i1, i8, i16, i32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
            i64 = context.get_value_type(types.intp)
            f32 = ir.FloatType()
            vf = ir.VectorType(f32, _LANES)
            vi32 = ir.VectorType(i32, _LANES)
            i8p = i8.as_pointer()
            mod = builder.module
            fma = cgutils.get_or_insert_function(
                mod, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v16f32"
            )
            mstore = cgutils.get_or_insert_function(
                mod,
                ir.FunctionType(ir.VoidType(), [vf, i8p, i32, ir.VectorType(i1, _LANES)]),
                "llvm.masked.store.v16f32.p0",
            )

            def intp(k: int) -> Any:
                return context.cast(builder, args[k], a[k], types.intp)

            def const(v: int) -> Any:
                return ir.Constant(i64, v)

            def splat(value: Any, vt: Any) -> Any:
                undef = ir.Constant(vt, ir.Undefined)
                one = builder.insert_element(undef, value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, undef, ir.Constant(vi32, [0] * _LANES))

            xa = context.make_array(a[0])(context, builder, args[0])
            wa = context.make_array(a[1])(context, builder, args[1])
            oa = context.make_array(a[2])(context, builder, args[2])
            r0v, pv, kv, nc = intp(3), intp(4), intp(5), intp(6)
            x_stride = cgutils.unpack_tuple(builder, xa.strides)[0]
            w_stride = cgutils.unpack_tuple(builder, wa.strides)[0]
            o_stride = cgutils.unpack_tuple(builder, oa.strides)[0]
            xbase = builder.bitcast(xa.data, i8p)
            x_rows = [
                builder.gep(xbase, [builder.mul(builder.add(r0v, const(r)), x_stride)])
                for r in range(rows)
            ]
            w_panel = builder.gep(builder.bitcast(wa.data, i8p), [builder.mul(pv, w_stride)])
            w_step = PANEL * (4 if kind == "float32" else 2)  # bytes of one k of a panel
            obase = builder.gep(builder.bitcast(oa.data, i8p), [builder.mul(pv, const(PANEL * 4))])
            o_rows = [
                builder.gep(obase, [builder.mul(builder.add(r0v, const(r)), o_stride)])
                for r in range(rows)
            ]
            zero = ir.Constant(vf, [0.0] * _LANES)

            def widened(wk: Any) -> list[Any]:
                # the panel's 32 weights at this k as `vecs` float32 vectors, columns in order
                if kind == "float32":
                    return [
                        builder.load(
                            builder.bitcast(builder.gep(wk, [const(64 * v)]), vf.as_pointer()),
                            align=4,
                        )
                        for v in range(vecs)
                    ]
                if kind == "uint16":  # bfloat16 pairs: lane i = column i | column 16 + i << 16
                    pairs = builder.load(builder.bitcast(wk, vi32.as_pointer()), align=4)
                    lo = builder.shl(pairs, ir.Constant(vi32, [16] * _LANES))
                    hi = builder.and_(pairs, ir.Constant(vi32, [0xFFFF0000] * _LANES))
                    return [builder.bitcast(lo, vf), builder.bitcast(hi, vf)]
                vh = ir.VectorType(i16, _LANES)  # float16, columns in order
                out_v = []
                for v in range(vecs):
                    ptr = builder.bitcast(builder.gep(wk, [const(32 * v)]), vh.as_pointer())
                    half = builder.bitcast(
                        builder.load(ptr, align=2), ir.VectorType(ir.HalfType(), _LANES)
                    )
                    out_v.append(builder.fpext(half, vf))
                return out_v

            if prefetch_from:  # pf.flat[pf_at], in bytes
                pfa = context.make_array(a[7])(context, builder, args[7])
                pf_item = context.get_abi_sizeof(context.get_data_type(a[7].dtype))
                pf_base = builder.gep(
                    builder.bitcast(pfa.data, i8p), [builder.mul(intp(8), const(pf_item))]
                )
            entry = builder.block
            loop = builder.append_basic_block("tile.loop")
            done = builder.append_basic_block("tile.done")
            builder.cbranch(builder.icmp_signed(">", kv, const(0)), loop, done)

            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(const(0), entry)
            acc = [[builder.phi(vf) for _ in range(nv)] for _ in range(rows)]
            for row in acc:
                for phi in row:
                    phi.add_incoming(zero, entry)
            wk = builder.gep(w_panel, [builder.mul(k, const(w_step))])
            pf = cgutils.get_or_insert_function(
                mod, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
            )

            def prefetch(ptr: Any, locality: int) -> None:
                for line in range(0, w_step, 64):
                    at = builder.gep(ptr, [const(line)])
                    builder.call(
                        pf,
                        [at, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)],
                    )

            if prefetch_from:
                prefetch(builder.gep(pf_base, [builder.mul(k, const(w_step))]), 2)
            if prefetch_next:
                # the same k of the next panel, towards L2 (prefetcht1): the next
                # panel streams in from memory while this one is multiplied
                prefetch(builder.gep(wk, [builder.mul(const(panels), w_stride)]), 2)
            if prefetch_bytes:
                for j in range(panels):
                    at = builder.gep(
                        wk, [builder.add(builder.mul(const(j), w_stride), const(prefetch_bytes))]
                    )
                    prefetch(at, 3)
            wv = [
                v
                for j in range(panels)
                for v in widened(builder.gep(wk, [builder.mul(const(j), w_stride)]))
            ]
            koff = builder.mul(k, const(4))
            new = []
            for r in range(rows):
                xr = builder.load(
                    builder.bitcast(builder.gep(x_rows[r], [koff]), f32.as_pointer()), align=4
                )
                xs = splat(xr, vf)
                new.append([builder.call(fma, [xs, wv[u], acc[r][u]]) for u in range(nv)])
            k_next = builder.add(k, const(1))
            tail = builder.block
            k.add_incoming(k_next, tail)
            for r in range(rows):
                for v in range(nv):
                    acc[r][v].add_incoming(new[r][v], tail)
            builder.cbranch(builder.icmp_signed("<", k_next, kv), loop, done)

            builder.position_at_end(done)
            results = []  # phis first: they must open the block
            for r in range(rows):
                for v in range(nv):
                    phi = builder.phi(vf)
                    phi.add_incoming(zero, entry)
                    phi.add_incoming(new[r][v], tail)
                    results.append((r, v, phi))
            lane = ir.Constant(vi32, list(range(_LANES)))
            valid = splat(builder.trunc(nc, i32), vi32)
            masks = [
                builder.icmp_signed(
                    "<", builder.add(lane, ir.Constant(vi32, [_LANES * v] * _LANES)), valid
                )
                for v in range(nv)
            ]
            for r, v, result in results:
                ptr = builder.gep(o_rows[r], [const(64 * v)])
                builder.call(mstore, [result, ptr, ir.Constant(i32, 4), masks[v]])
            return context.get_dummy_value()

        return sig, codegen

    if prefetch_from:

        @intrinsic
        def tile_pf(typingctx, x, w, out, r0, panel, k_in, ncols, pf, pf_at):  # type: ignore[no-untyped-def]
            return typed(typingctx, x, w, out, r0, panel, k_in, ncols, (pf, pf_at))

        return tile_pf

    @intrinsic
    def tile(typingctx, x, w, out, r0, panel, k_in, ncols):  # type: ignore[no-untyped-def]
        return typed(typingctx, x, w, out, r0, panel, k_in, ncols, ())

    return tile


# The first tile over a panel also prefetches the next panel (into L2): at 16
# rows it halved the CPU time of a sweep over the model's products (the tile is
# compute bound, so without it the panel's reads from memory were not
# overlapped with arithmetic); later tiles find the panel in L2 and skip it.
_tile8_first = _make_tile(8, prefetch_next=True)
_tile8 = _make_tile(8)
_tile4 = _make_tile(4, prefetch_next=True)
_tile2 = _make_tile(2, prefetch_next=True)
_tile1 = _make_tile(1)
# One row alone (batch-1 decode) is bound by memory: it takes four panels at
# once (four streams in flight, 8 accumulators) and asks for the lines 1 KiB
# ahead of each; against one panel at a time, a sweep over the model's
# products took 10-30 % less time (docs/performance.md).
_ONE_ROW_PANELS = 4
_tile1_wide = _make_tile(1, panels=_ONE_ROW_PANELS, prefetch_bytes=1024)


# How fast one thread streams a one-row product's panels from memory, per storage
# (GB/s; threads.split_pays weighs it against what two threads reach). bfloat16:
# the quiet 16:32 sweep's single-thread steps (~13 GB/s; SmolLM2's q/k/v, o, down);
# widening is part of the cost per byte: by thread CPU time on the busy machine
# bfloat16 and float16 panels read 15-17 GB/s and float32 ones 24, so float32 is
# given 13 x 24 / 16.5 ~ 19 (engine.md, "Each path's break-even").
_ONE_THREAD_GBS = {"bfloat16": 13.0, "float16": 13.0, "float32": 19.0}


@njit(cache=True, nogil=True, parallel=True)
def _panel_matmul(x: Any, w: Any, out: Any, n_cols: int, lanes: int) -> None:  # pragma: no cover
    # x (n, K) float32; w (n_panels, K, PANEL) storage; out (n, n_cols) float32.
    # Threads split the panels (contiguous ranges: one memory stream each);
    # within a panel, rows go 8 at a time, then 4, 2, 1. Every tile computes
    # each of its elements with the same k chain, so the split does not show
    # in the bits. A panel (K x 32 weights, 72-192 KiB here) stays in L2 while
    # a long prefill's row tiles pass over it.
    n = x.shape[0]
    n_panels, k_in = w.shape[0], w.shape[1]
    if n == 1:
        # One row: runs of _ONE_ROW_PANELS panels, claimed one at a time by
        # `lanes` threads (the team's size, passed in: numba's get_num_threads in
        # a kernel makes it uncachable). Not prange over the runs: numba splits
        # those statically, and a weight of 30 or 18 panels (SmolLM2's q/k/v, o,
        # down: 7 or 4 runs of four and 2 single panels) gave one thread twice
        # the other's panels; and the calling thread waited for a sleeping
        # worker to wake and do its half. Which thread runs a panel never
        # changes its bits: every column is one k chain in either tile.
        runs = (n_panels + _ONE_ROW_PANELS - 1) // _ONE_ROW_PANELS
        next_run = np.empty(1, np.int64)  # not np.zeros: parallel=True makes that a region
        next_run[0] = 0
        for _lane in prange(lanes):
            while True:
                g = claim_next(next_run)  # type: ignore[call-arg,var-annotated]  # numba typing
                if g >= runs:
                    break
                p = g * _ONE_ROW_PANELS
                if p + _ONE_ROW_PANELS <= n_panels:
                    _tile1_wide(x, w, out, 0, p, k_in, n_cols - p * PANEL)
                else:  # the last run, short: one panel at a time
                    for pp in range(p, n_panels):
                        _tile1(x, w, out, 0, pp, k_in, n_cols - pp * PANEL)
        return
    for p in prange(n_panels):
        ncols = n_cols - p * PANEL  # columns left from this panel on (stores are masked)
        r = 0
        if n >= 8:
            _tile8_first(x, w, out, 0, p, k_in, ncols)
            r = 8
        while r + 8 <= n:
            _tile8(x, w, out, r, p, k_in, ncols)
            r += 8
        if r + 4 <= n:
            _tile4(x, w, out, r, p, k_in, ncols)
            r += 4
        if r + 2 <= n:
            _tile2(x, w, out, r, p, k_in, ncols)
            r += 2
        if r < n:
            _tile1(x, w, out, r, p, k_in, ncols)


# --- public API -------------------------------------------------------------


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a cache line."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    buf = np.empty(nbytes + _ALIGN, np.uint8)
    off = -buf.ctypes.data % _ALIGN
    return buf[off : off + nbytes].view(dt).reshape(shape)


def _pack(w: np.ndarray, storage: str) -> np.ndarray:
    """``w`` ``[out, in]`` as panels ``[ceil(out / PANEL), in, PANEL]`` (see the module doc)."""
    n_out, k_in = w.shape
    n_panels = -(-n_out // PANEL)
    packed = _aligned_empty((n_panels, k_in, PANEL), w.dtype)
    pos = _column_positions(storage)
    full = n_out // PANEL
    step = max(1, (1 << 22) // max(1, k_in * PANEL))  # a few MiB of panels per copy
    for b0 in range(0, full, step):
        b1 = min(full, b0 + step)
        block = w[b0 * PANEL : b1 * PANEL].reshape(b1 - b0, PANEL, k_in)
        packed[b0:b1, :, pos] = block.transpose(0, 2, 1)
    rest = n_out - full * PANEL
    if rest:
        packed[full] = 0
        packed[full][:, pos[:rest]] = w[full * PANEL :].T
    return packed


def _widen_bits(bits: np.ndarray, storage: str) -> np.ndarray:
    """Stored values (float32, bfloat16 bits, float16 bits) as a new float32 array."""
    if storage == "float32":
        return np.array(bits, dtype=np.float32)
    if storage == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight laid out for :func:`linear`: column panels ``[panel][in][PANEL]``.

    ``data`` holds float32 values, or 16-bit patterns tagged by integer type
    (``uint16`` = bfloat16 bits, ``int16`` = float16 bits); ``storage`` names
    the format. Output column ``c`` is column ``c % PANEL`` of panel
    ``c // PANEL`` (bfloat16 panels store their columns interleaved; see
    ``_column_positions``); the last panel is padded with zeros. ``nbytes`` is
    what one product reads from memory, whatever its row count: the quantity
    the bandwidth floor counts. :meth:`to_float32` and :meth:`rows` give the
    checkpoint layout back.
    """

    data: np.ndarray  # (n_panels, in_features, PANEL) float32 | uint16 | int16
    storage: str  # "float32" | "bfloat16" | "float16"
    out_features: int

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype in memory (uint16/int16 for the 16-bit float formats)."""
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` of the checkpoint's ``[out, in]`` matrix, widened to float32.

        The embedding lookup of a model whose output head is tied to its
        embedding table: the panels are the only copy of that table.
        """
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.out_features):
            raise IndexError(f"row index outside 0..{self.out_features - 1}")
        panel, col = np.divmod(index, PANEL)
        bits = self.data[panel, :, _column_positions(self.storage)[col]]  # (len, in)
        return _widen_bits(bits, self.storage)

    def to_float32(self) -> np.ndarray:
        """The weight widened to float32 in the checkpoint layout ``[out, in]`` (a new array)."""
        cols = self.data[:, :, _column_positions(self.storage)]  # columns back in order
        full = cols.transpose(0, 2, 1).reshape(-1, self.in_features)[: self.out_features]
        return np.ascontiguousarray(_widen_bits(full, self.storage))


@typing.overload
def prepare(w: np.ndarray, *, bf16: bool = False) -> PreparedWeight: ...
@typing.overload
def prepare(w: Quantized, *, bf16: bool = False) -> Quantized: ...
def prepare(w: np.ndarray | Quantized, *, bf16: bool = False) -> PreparedWeight | Quantized:
    """Repack a checkpoint weight ``w`` (``[out, in]``) into the panels :func:`linear` streams.

    ``w`` is float32 or float16, or with ``bf16=True`` the raw uint16 bits of
    a bfloat16 tensor. 16-bit weights stay 16-bit (half the bytes per step).
    The panels are a new array: drop ``w`` afterwards, or the model holds two
    copies. Trap: a bf16 tensor must come as its bits with ``bf16=True``; an
    integer array without the flag is rejected, never read as numbers.
    """
    if isinstance(w, QuantizedTensor | QuantizedStack):  # GGUF blocks: kept (quant.py)
        for part in w.parts if isinstance(w, QuantizedStack) else (w,):
            if not part.exact_activations:
                part.packed()  # the int8 product's interleaved copy, made now, not mid-request
        return w
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    if bf16:
        if w.dtype != np.uint16:
            raise TypeError(f"bf16=True needs the raw uint16 bits, got dtype {w.dtype}")
        storage = "bfloat16"
    elif w.dtype == np.float32:
        storage = "float32"
    elif w.dtype == np.float16:
        w = w.view(np.int16)
        storage = "float16"
    else:
        raise TypeError(
            "weight dtype must be float32 or float16 (or uint16 bits with bf16=True), "
            f"got {w.dtype}"
        )
    return PreparedWeight(_pack(w, storage), storage, int(w.shape[0]))


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
    panel kernel, which releases the GIL; larger ones run BLAS.
    Trap: ``x`` must be float32; a float64 ``x`` is rejected rather than
    silently promoting the residual stream.
    """
    # The checks read each attribute once and test a dtype by identity first (the
    # builtin float32 dtype is one object; `!=` against the type converts it): a
    # batch-1 step makes 121 calls, and these checks were ~0.8 us of each.
    k_in, n_out = w.in_features, w.out_features
    if x.ndim != 2 or x.shape[1] != k_in:
        raise ValueError(f"x must be (n, {k_in}), got shape {x.shape}")
    if x.dtype is not _F32 and x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    n = x.shape[0]
    if out is None:
        out = np.empty((n, n_out), dtype=np.float32)
    elif out.shape != (n, n_out) or (out.dtype is not _F32 and out.dtype != np.float32):
        raise ValueError(f"out must be float32 ({n}, {n_out}), got {out.dtype} {out.shape}")
    if n == 0:
        return out
    if isinstance(w, QuantizedTensor | QuantizedStack):  # the quantized kernels (quant.py)
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        return quant.linear(x, w, out)
    threshold = BLAS_MIN_ROWS if blas_min_rows is None else blas_min_rows
    if threshold is not None and n >= threshold:
        # compute bound: BLAS's blocked GEMM (on an unpacked float32 copy of the weight)
        np.matmul(x, w.to_float32().T, out=out)
        return out
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    xc = np.ascontiguousarray(x)
    if n == 1 and not threads.split_pays(w.nbytes, _ONE_THREAD_GBS[w.storage]):
        threads.on_calling_thread(_panel_matmul, xc, w.data, out, n_out, 1)
    else:
        _panel_matmul(xc, w.data, out, n_out, threads.thread_count())
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for every storage format.

    Call at model load so the first request does not pay for compilation.
    """
    x = np.zeros((1, 8), np.float32)
    for w in (
        np.zeros((4, 8), np.float32),
        np.zeros((4, 8), np.float16),
    ):
        linear(x, prepare(w))
    linear(x, prepare(np.zeros((4, 8), np.uint16), bf16=True))
