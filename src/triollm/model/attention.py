"""Paged causal attention, tiled: the flash-attention recurrence on a CPU.

The old kernel took one (row, KV head) pair at a time and computed one 64- or
128-long dot product per position and head, a horizontal sum each: ~10 GFLOP/s,
half of a SmolLM2 prefill (docs/performance.md). This one works on tiles:

- **a tile of K/V** is :data:`TILE` (32) consecutive positions of one KV head,
  aligned to multiples of 32 and gathered through the block table, widened
  once to float32 from the cache's storage (f32, f16, bf16 or q8_0,
  ``kvstore.py``) and shared by every query vector of the work item: the rows
  of a query block times the ``group`` query heads of the KV head (GQA). The
  pool stores K *transposed within a block* (``(head_dim, block_size)`` per
  block and head) and V as it comes (``(block_size, head_dim)``), so both
  halves of a tile load are contiguous runs that LLVM vectorises: K straight
  into the keys-along-lanes panel the score product wants, V into its panels
  of 32 columns. (With K stored position-major the load was a transpose, one
  scalar widening per element: ~75 ms of a Qwen2.5-1.5B decode step at depth
  4096, ~15x the step's K/V bytes at the machine's bandwidth.) With blocks of
  32 positions (the server's default) an f16 or f32 block of K *is* such a
  panel, and the score product reads it in place, no copy; the next tile's
  K/V are prefetched into L2 while this one is multiplied, by the products
  themselves, a line per step of their loop (a burst of all its lines before
  them stalled the arithmetic until memory had answered);
- **a work item** is (query block, KV head, segment): up to :data:`Q_BLOCK`
  consecutive rows of one chunk against the positions of one segment of
  :data:`SEGMENT_POSITIONS`. A segment's partial result (max, sum, weighted
  sum of V) goes to a buffer; :func:`_merge` combines a row's segments. So a
  single decode row at depth 16384 is 16 segments x the KV heads, spread over
  both cores, while a prefill chunk is many query blocks. Every item reads its
  K/V tiles once for all the query heads of its GQA group;
- **scores** for a tile are one small product ``(vectors, head_dim) @
  (head_dim, 32)`` on the weight products' register tiles (``matmul.py``), keys
  along the vector lanes, no horizontal sum per score; so is the tile's
  weighted sum of V. **The softmax is online**: each tile raises the running
  max if it must, rescales what was summed so far by ``exp(old max - new
  max)``, and adds its own terms (docs/engine.md draws it step by step). Tiles
  wholly past a query block's last row are never visited (the causal half).

One step's items are planned once (:func:`plan_attention`) and the plan serves
every layer with the same window; a plan with little work runs its items on
the calling thread (:data:`PARALLEL_MIN_WORK`, in query vectors x head_dim x
tiles), since waking a sleeping OpenMP worker costs more than a few tiles.

Batch invariance, the rule that a row's bits do not depend on what else is in
the step: a row's arithmetic is a function of its own position only. Tiles are
aligned to absolute positions, and so are segments; the exp and the sums run
over the row's own valid positions ``a..z`` of a tile (a loop's trip count
decides how LLVM splits it into vector body and remainder, so it must not
depend on other rows); its other weights are exactly 0; the product tiles give
an element the same chain of roundings whichever tile size computes it; the
segments merge in position order. Which rows share a query block, and which
thread (or whether a second one) runs an item, change only *when* a row's sums
happen, never their order: the serial and the parallel driver call the one
compiled :func:`_item`. The same holds across chunkings of one prompt (the
prefix cache), and between a decode row and a prefill row at the same
position: there is one kernel. ``tests/model/test_kernels.py`` checks it.

Hazard: numba here has no SVML, so ``np.exp`` is a scalar libm call per
element that no loop vectorises, one per score; :func:`_exp` is a vectorisable
Cody-Waite + polynomial exp, exact at 0 (``_exp(0) == 1``, so a single segment
merges without changing a bit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from triollm.model.kvstore import Q8_BLOCK, V_PANEL
from triollm.model.matmul import PANEL as TILE
from triollm.model.matmul import _make_tile, _tile1, _tile8
from triollm.model.quant import claim_next
from triollm.model.threads import start_parallel_runtime, thread_count

start_parallel_runtime()  # passive OpenMP workers, before the first prange (threads.py)

# Rows per query block: 16 rows x a GQA group of query vectors share each K/V
# tile widened into L1 (a 32 x 128 float32 tile is 16 KiB).
Q_BLOCK = 16
# Positions per segment (rounded down to whole blocks): the unit a long decode
# context is split into across cores. 1024 gives a depth-4096 decode row 4 x
# n_kv items for 2 cores, and keeps a 2048-row prefill's partials (rows x heads
# x segments x (head_dim + 2) floats) at tens of MB.
SEGMENT_POSITIONS = 1024  # a multiple of TILE (32)
# Below this much work the items run on the calling thread. The unit is one
# query vector times head_dim over one tile of 32 positions (a tile visit of
# Qwen2.5-1.5B's 6 x 128 is 768 units, of SmolLM2's 3 x 64 is 192): a tile visit's
# two products cost in proportion to it, and counting visits alone had SmolLM2's
# cheap visits open a region per layer from position ~128 on, ~100 us each for a
# few us of work. The parallel driver's cost is the wake-up of the other (passive)
# worker, W, which it now overlaps with work (_attend: the items are claimed, so
# this thread starts at once); it loses only while the serial time S < W.
# `python bench/bench_attention.py --crossover` measures both; 12 288 units is
# S ~ 40-60 us, about W on this machine.
PARALLEL_MIN_WORK = 12288

# The products' register tiles for every row count up to 8, without the
# next-panel prefetch (here the "next panel" of a K block read in place is the
# next block in the pool, not the next tile of the block table, which the _pf
# tiles below and _prefetch_tile ask for). A
# decode row is one vector per query head of the GQA group (6 for
# Qwen2.5-1.5B, 7 for the 0.5B, 3 for SmolLM2): one tile of exactly that many
# rows passes over a K or V panel once, where 4 + 2 (+ 1) passed two or three
# times. Every tile computes an element with the same chain: the same bits.
_tile2 = _make_tile(2)
_tile3 = _make_tile(3)
_tile4 = _make_tile(4)
_tile5 = _make_tile(5)
_tile6 = _make_tile(6)
_tile7 = _make_tile(7)
# The same tiles asking, one line per k, for the next tile's K or V panel
# (prefetch_from: wherever the block table put it) while they multiply this
# one. The first tile over a panel of a product carries the prefetch; the
# others find the panel in L2. See _item, "the next tile's K/V".
_tile1_pf = _make_tile(1, prefetch_from=True)
_tile2_pf = _make_tile(2, prefetch_from=True)
_tile3_pf = _make_tile(3, prefetch_from=True)
_tile4_pf = _make_tile(4, prefetch_from=True)
_tile5_pf = _make_tile(5, prefetch_from=True)
_tile6_pf = _make_tile(6, prefetch_from=True)
_tile7_pf = _make_tile(7, prefetch_from=True)
_tile8_pf = _make_tile(8, prefetch_from=True)

if not TILE == Q8_BLOCK == V_PANEL:  # one q8_0 scale per V panel row; V's panels are the tiles'
    raise ImportError(
        f"attention needs TILE ({TILE}) == kvstore.Q8_BLOCK ({Q8_BLOCK}) == V_PANEL ({V_PANEL})"
    )

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


@intrinsic
def _f32_from_half(typingctx: Any, bits: Any) -> Any:
    """IEEE half bits (an int16) as float32: LLVM's ``fpext half``, exact for
    every half; in a vectorised loop one ``vcvtph2ps`` per 16 values (F16C, which
    the products' f16 panels already need). Hazard: an inf/NaN half stays one;
    the write side (kvstore.py) saturates, so the cache holds none."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:  # type: ignore[attr-defined]
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

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


# --- loading a tile: widening runs of the cache to float32, by storage dtype --


def _to_f32(x):  # type: ignore[no-untyped-def]  # numba: the overload is the body
    """One stored K/V element as float32 (q8_0's int8 before its scale)."""
    raise NotImplementedError


@overload(_to_f32, inline="always")
def _to_f32_impl(x):  # type: ignore[no-untyped-def]
    if x == types.float32:
        return lambda x: x
    if x == types.int16:  # IEEE f16 bits (the matmul's convention for f16)
        return lambda x: _f32_from_half(x)
    if x == types.uint16:  # bfloat16 bits: the top half of a float32
        return lambda x: _f32_from_bits(np.int32(x) << np.int32(16))
    if x == types.int8:  # q8_0's value; the caller multiplies by the block's scale
        return lambda x: np.float32(x)
    return None


_LANES = 16  # float32 lanes of one AVX-512 vector; a run of TILE is two


@intrinsic
def _widen_run(typingctx: Any, src: Any, s_at: Any, dst: Any, d_at: Any, n: Any) -> Any:
    """``dst.flat[d_at : d_at + n] = float32(src.flat[s_at : s_at + n])``, ``n <= 32``.

    src: a C-contiguous float32 | int16 (f16 bits) | uint16 (bf16 bits) array;
    dst: a C-contiguous float32 array; the offsets count elements. Two masked
    16-lane loads, widened in registers (f16: ``fpext half``, one vcvtph2ps;
    bf16: a shift; f32: as is), two masked stores: no element past ``n`` is
    read or written. Written in IR because numba's loops over the same run
    came out scalar (one conversion per element, the cost this replaces).
    """
    ok = (
        isinstance(src, types.Array)
        and src.layout == "C"
        and src.dtype in (types.float32, types.int16, types.uint16)
        and isinstance(dst, types.Array)
        and dst.layout == "C"
        and dst.dtype == types.float32
        and all(isinstance(x, types.Integer) for x in (s_at, d_at, n))
    )
    if not ok:
        return None
    kind = str(src.dtype)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        i1, i8, i16, i32, i64 = (ir.IntType(w) for w in (1, 8, 16, 32, 64))
        vf = ir.VectorType(ir.FloatType(), _LANES)
        vh = ir.VectorType(i16, _LANES)
        vi32 = ir.VectorType(i32, _LANES)
        vmask = ir.VectorType(i1, _LANES)
        i8p = i8.as_pointer()
        mod = builder.module
        load_t = vf if kind == "float32" else vh
        suffix = "v16f32" if kind == "float32" else "v16i16"
        mload = cgutils.get_or_insert_function(
            mod, ir.FunctionType(load_t, [i8p, i32, vmask, load_t]), f"llvm.masked.load.{suffix}.p0"
        )
        mstore = cgutils.get_or_insert_function(
            mod,
            ir.FunctionType(ir.VoidType(), [vf, i8p, i32, vmask]),
            "llvm.masked.store.v16f32.p0",
        )
        sa = context.make_array(a[0])(context, builder, args[0])
        da = context.make_array(a[2])(context, builder, args[2])
        s_at_v = context.cast(builder, args[1], a[1], types.int64)
        d_at_v = context.cast(builder, args[3], a[3], types.int64)
        count = builder.trunc(context.cast(builder, args[4], a[4], types.int64), i32)
        width = 4 if kind == "float32" else 2
        s_ptr = builder.gep(
            builder.bitcast(sa.data, i8p), [builder.mul(s_at_v, ir.Constant(i64, width))]
        )
        d_ptr = builder.gep(
            builder.bitcast(da.data, i8p), [builder.mul(d_at_v, ir.Constant(i64, 4))]
        )
        undef = ir.Constant(vi32, ir.Undefined)
        limit = builder.shuffle_vector(
            builder.insert_element(undef, count, ir.Constant(i32, 0)),
            undef,
            ir.Constant(vi32, [0] * _LANES),
        )

        def widen(raw: Any) -> Any:
            if kind == "float32":
                return raw
            if kind == "int16":  # IEEE half bits
                return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), _LANES)), vf)
            # bfloat16 bits: the top half of a float32
            wide = builder.shl(builder.zext(raw, vi32), ir.Constant(vi32, [16] * _LANES))
            return builder.bitcast(wide, vf)

        # a whole run (the common case: every tile but a row's last) takes plain
        # loads and stores; only a partial run needs the masked ones
        whole = builder.icmp_signed(">=", count, ir.Constant(i32, TILE))
        with builder.if_else(whole) as (then, otherwise):
            with then:
                for v in range(TILE // _LANES):
                    at = builder.gep(s_ptr, [ir.Constant(i64, v * _LANES * width)])
                    raw = builder.load(builder.bitcast(at, load_t.as_pointer()), align=width)
                    out = builder.gep(d_ptr, [ir.Constant(i64, v * _LANES * 4)])
                    builder.store(widen(raw), builder.bitcast(out, vf.as_pointer()), align=4)
            with otherwise:
                for v in range(TILE // _LANES):
                    lanes = ir.Constant(vi32, [v * _LANES + i for i in range(_LANES)])
                    mask = builder.icmp_signed("<", lanes, limit)
                    at = builder.gep(s_ptr, [ir.Constant(i64, v * _LANES * width)])
                    raw = builder.call(
                        mload, [at, ir.Constant(i32, width), mask, ir.Constant(load_t, None)]
                    )
                    out = builder.gep(d_ptr, [ir.Constant(i64, v * _LANES * 4)])
                    builder.call(mstore, [widen(raw), out, ir.Constant(i32, 4), mask])
        return context.get_dummy_value()

    return types.void(src, s_at, dst, d_at, n), codegen


@intrinsic
def _prefetch(typingctx: Any, arr: Any, at: Any, n: Any) -> Any:
    """Ask for the cache lines of ``arr.flat[at : at + n]`` (``prefetcht1``: into L2), no wait.

    arr: a C-contiguous array of any dtype; the offsets count elements. A hint:
    it reads nothing the program sees and never faults, so an address past the
    array is harmless. One ``llvm.prefetch`` per 64 bytes, and one for the last
    element (the run need not start on a line).
    """
    if not (
        isinstance(arr, types.Array)
        and arr.layout == "C"
        and isinstance(at, types.Integer)
        and isinstance(n, types.Integer)
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        i8p = i8.as_pointer()
        pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        item = context.get_abi_sizeof(context.get_data_type(a[0].dtype))
        arr_v = context.make_array(a[0])(context, builder, args[0])
        at_v = context.cast(builder, args[1], a[1], types.int64)
        n_v = context.cast(builder, args[2], a[2], types.int64)
        start = builder.mul(at_v, ir.Constant(i64, item))
        nbytes = builder.mul(n_v, ir.Constant(i64, item))
        base = builder.gep(builder.bitcast(arr_v.data, i8p), [start])
        hint = [
            ir.Constant(i32, 0),
            ir.Constant(i32, 2),
            ir.Constant(i32, 1),
        ]  # read, L2 (locality 2), data
        with cgutils.for_range_slice(
            builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, 64)
        ) as (
            off,
            _,
        ):
            builder.call(pf, [builder.gep(base, [off]), *hint])
        last = builder.sub(nbytes, ir.Constant(i64, 1))
        with builder.if_then(builder.icmp_signed(">", nbytes, ir.Constant(i64, 0))):
            builder.call(pf, [builder.gep(base, [last]), *hint])
        return context.get_dummy_value()

    return types.void(arr, at, n), codegen


def _prefetch_tile(k_cache, v_cache, k_scale, v_scale, b, h, o, n):  # type: ignore[no-untyped-def]
    """Prefetch positions ``o .. o+n-1`` of block ``b``, head ``h``: K, V (and scales)."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_prefetch_tile, inline="always")
def _prefetch_tile_impl(k_cache, v_cache, k_scale, v_scale, b, h, o, n):  # type: ignore[no-untyped-def]
    scaled = k_cache.dtype == types.int8

    def impl(k_cache, v_cache, k_scale, v_scale, b, h, o, n):  # type: ignore[no-untyped-def]
        head_dim, bs = k_cache.shape[2], k_cache.shape[3]
        at = (b * k_cache.shape[1] + h) * head_dim * bs + o  # K[b, h, 0, o], flat
        n_vp = v_cache.shape[2]  # V: (num_blocks, n_kv, head_dim / 32, bs, 32)
        v_at = ((b * v_cache.shape[1] + h) * n_vp * bs + o) * V_PANEL  # V[b, h, 0, o, 0]
        if n == bs:  # the whole block: one run of head_dim x bs, and one of V's panels
            _prefetch(k_cache, at, head_dim * bs)
            _prefetch(v_cache, v_at, n_vp * bs * V_PANEL)
        else:
            for j in range(head_dim):
                _prefetch(k_cache, at + j * bs, n)
            for p in range(n_vp):
                _prefetch(v_cache, v_at + p * bs * V_PANEL, n * V_PANEL)
        if scaled:  # both (num_blocks, n_kv, head_dim / 32, bs)
            ns = k_scale.shape[2]
            s_at = (b * k_scale.shape[1] + h) * ns * bs + o
            for j in range(ns):
                _prefetch(k_scale, s_at + j * bs, n)
                _prefetch(v_scale, s_at + j * bs, n)

    return impl


def _keys_in_place(cache):  # type: ignore[no-untyped-def]
    """True when the score product can read K's blocks where they are stored."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_keys_in_place, inline="always")
def _keys_in_place_impl(cache):  # type: ignore[no-untyped-def]
    # A block of K, (head_dim, block_size) per head, is exactly the products'
    # panel layout (K rows of 32 columns) when block_size == TILE, in float32
    # and in f16 bits (which the tiles widen per loaded vector, exactly as
    # _widen_run does: the same float32 values, so the same bits). bf16 panels
    # interleave their columns and q8_0 needs its scales: those load a tile.
    if cache.dtype in (types.float32, types.int16):
        return lambda cache: cache.shape[3] == TILE
    return lambda cache: False


def _scores(qb, cache, kp, sc, b, h, b_next):  # type: ignore[no-untyped-def]
    """``sc = qb @ K tile``: from block ``b``, head ``h`` in place (asking for block
    ``b_next``'s K meanwhile), or from ``kp``."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_scores, inline="always")
def _scores_impl(qb, cache, kp, sc, b, h, b_next):  # type: ignore[no-untyped-def]
    if cache.dtype in (types.float32, types.int16):

        def in_place(qb, cache, kp, sc, b, h, b_next):  # type: ignore[no-untyped-def]
            head_dim = qb.shape[1]
            if cache.shape[3] == TILE:
                # block b, head h as a one-panel (1, head_dim, 32) view. Hazard: the
                # tiles take the panel index as the output's column panel too, so
                # the panel must be index 0 of the view, not b * n_kv + h of the pool.
                # K[b_next, h] (flat offset) streams into L2 meanwhile, a line per k.
                pf_at = (b_next * cache.shape[1] + h) * head_dim * TILE
                _rows_times_panel_pf(qb, cache[b : b + 1, h], sc, 0, head_dim, TILE, cache, pf_at)
            else:
                _rows_times_panel(qb, kp, sc, 0, head_dim, TILE)

        return in_place

    def loaded(qb, cache, kp, sc, b, h, b_next):  # type: ignore[no-untyped-def]
        _rows_times_panel(qb, kp, sc, 0, qb.shape[1], TILE)

    return loaded


def _load_keys(cache, scales, b, h, o, kp, t, n):  # type: ignore[no-untyped-def]
    """``kp[0, j, t:t+n] = K[j]`` of positions ``o .. o+n-1`` of block ``b``, head ``h``."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_load_keys, inline="always")
def _load_keys_impl(cache, scales, b, h, o, kp, t, n):  # type: ignore[no-untyped-def]
    # cache: (num_blocks, n_kv, head_dim, block_size), K transposed within a block:
    # for each j the tile's positions are one contiguous run on both sides.
    if cache.dtype == types.int8:  # q8_0: scales (num_blocks, n_kv, head_dim // 32, bs)

        def q8(cache, scales, b, h, o, kp, t, n):  # type: ignore[no-untyped-def]
            # plain loops (q8_0 is not the default; its scale per lane has no IR run)
            for j in range(kp.shape[1]):
                jb = j // Q8_BLOCK
                for u in range(n):
                    d = _f32_from_half(scales[b, h, jb, o + u])
                    kp[0, j, t + u] = np.float32(cache[b, h, j, o + u]) * d

        return q8

    def plain(cache, scales, b, h, o, kp, t, n):  # type: ignore[no-untyped-def]
        head_dim, bs = cache.shape[2], cache.shape[3]
        at = (b * cache.shape[1] + h) * head_dim * bs + o  # K[b, h, 0, o], flat
        for j in range(head_dim):
            _widen_run(cache, at + j * bs, kp, j * TILE + t, n)  # kp: (1, head_dim, TILE)

    return plain


def _values_in_place(cache):  # type: ignore[no-untyped-def]
    """True when the V product can read V's blocks where they are stored."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_values_in_place, inline="always")
def _values_in_place_impl(cache):  # type: ignore[no-untyped-def]
    # A block of V, (head_dim / 32, block_size, 32) per head, is the products'
    # panel layout (panels of 32 columns, positions as their rows) for any
    # block size; it is one tile's panel when block_size == TILE. f32 and f16
    # bits only, as for K: bf16 panels interleave their columns, q8_0 needs
    # its scales.
    if cache.dtype in (types.float32, types.int16):
        return lambda cache: cache.shape[3] == TILE
    return lambda cache: False


def _weighted_values(sc, cache, vp, pv, b, h, here, b_next):  # type: ignore[no-untyped-def]
    """``pv = sc @ V tile``: from block ``b``, head ``h`` in place when ``here`` (asking
    for block ``b_next``'s V meanwhile), else ``vp``."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_weighted_values, inline="always")
def _weighted_values_impl(sc, cache, vp, pv, b, h, here, b_next):  # type: ignore[no-untyped-def]
    def loaded(sc, cache, vp, pv, b, h, here, b_next):  # type: ignore[no-untyped-def]
        head_dim = pv.shape[1]
        for panel in range(vp.shape[0]):
            _rows_times_panel(sc, vp, pv, panel, TILE, min(TILE, head_dim - panel * TILE))

    if cache.dtype not in (types.float32, types.int16):
        return loaded

    def in_place(sc, cache, vp, pv, b, h, here, b_next):  # type: ignore[no-untyped-def]
        # block b, head h: (head_dim / 32, TILE, 32), the tile's own panels; panel
        # p is the output's columns 32 p .. 32 p + 31 (the tiles take one index
        # for both), the last panel's padding columns masked off by ncols. Panel p
        # of V[b_next, h] streams into L2 meanwhile, a line per k.
        head_dim = pv.shape[1]
        block = cache[b, h]
        n_vp, bs = cache.shape[2], cache.shape[3]
        for panel in range(vp.shape[0]):
            ncols = min(TILE, head_dim - panel * TILE)
            if here:
                pf_at = ((b_next * cache.shape[1] + h) * n_vp + panel) * bs * TILE
                _rows_times_panel_pf(sc, block, pv, panel, TILE, ncols, cache, pf_at)
            else:
                _rows_times_panel(sc, vp, pv, panel, TILE, ncols)

    return in_place


def _load_values(cache, scales, b, h, o, vp, t, n):  # type: ignore[no-untyped-def]
    """``vp[:, t:t+n, :] = V`` of positions ``o .. o+n-1`` of block ``b``, head ``h``."""
    raise NotImplementedError  # only called from numba; the overload is the body


@overload(_load_values, inline="always")
def _load_values_impl(cache, scales, b, h, o, vp, t, n):  # type: ignore[no-untyped-def]
    # cache: (num_blocks, n_kv, head_dim / 32, block_size, 32): V's panels, the
    # vp tile's own layout (vp: (head_dim / 32, TILE, 32)); a panel's positions
    # o .. o+n-1 are n contiguous rows of 32 on both sides.
    if cache.dtype == types.int8:  # q8_0: scales (num_blocks, n_kv, head_dim / 32, bs)

        def q8(cache, scales, b, h, o, vp, t, n):  # type: ignore[no-untyped-def]
            # every column, the padding's too (zeros; the products mask those columns off)
            for p in range(vp.shape[0]):
                for u in range(n):
                    d = _f32_from_half(scales[b, h, p, o + u])  # a panel row is one q8_0 block
                    for c in range(TILE):
                        vp[p, t + u, c] = np.float32(cache[b, h, p, o + u, c]) * d

        return q8

    def plain(cache, scales, b, h, o, vp, t, n):  # type: ignore[no-untyped-def]
        n_vp, bs = cache.shape[2], cache.shape[3]
        at = ((b * cache.shape[1] + h) * n_vp * bs + o) * TILE  # V[b, h, 0, o, 0], flat
        for p in range(n_vp):
            for u in range(n):
                _widen_run(cache, at + (p * bs + u) * TILE, vp, (p * TILE + t + u) * TILE, TILE)

    return plain


# --- planning: query blocks, segments, and where each partial goes ------------


@njit(cache=True, nogil=True)
def _plan(
    positions: Any, row_chunk: Any, window: int, seg_len: int, n_kv: int
) -> tuple[Any, Any, Any, int]:  # pragma: no cover - numba
    # items: (n_items, 4) int64 rows [r0, r1) of one query block, KV head, segment.
    # first_seg[r]: the row's first segment; base[r]: its first partial's index.
    # visits: tiles the items will load, times their rows (the work's size).
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
    visits = 0
    for r0, r1 in blocks:
        p_last = positions[r1 - 1]
        lo_first = max(0, positions[r0] - window + 1) if window > 0 else 0
        for kvh in range(n_kv):
            for seg in range(first_seg[r0], p_last // seg_len + 1):
                items[i, 0] = r0
                items[i, 1] = r1
                items[i, 2] = kvh
                items[i, 3] = seg
                i += 1
                t_begin = max(seg * seg_len, lo_first) // TILE
                t_end = min(seg * seg_len + seg_len - 1, p_last) // TILE
                visits += (t_end - t_begin + 1) * (r1 - r0)
    return items, first_seg, base, visits


# --- one work item: a query block against one segment of one KV head ---------


@njit(inline="always")
def _tree_max(x: Any) -> Any:  # pragma: no cover - numba
    # max of x[0:32] (consumed) by halves: 16, 8, 4, 2, 1 lanes, each an
    # elementwise loop LLVM vectorises (a max is exact in any order)
    for i in range(16):
        x[i] = max(x[i], x[i + 16])
    for i in range(8):
        x[i] = max(x[i], x[i + 8])
    for i in range(4):
        x[i] = max(x[i], x[i + 4])
    return max(max(x[0], x[2]), max(x[1], x[3]))


@njit(inline="always")
def _tree_sum(w: Any, x: Any) -> Any:  # pragma: no cover - numba
    # sum of w[0:32] into scratch x by halves, in one fixed order for every row:
    # a sequential sum is a chain of 32 dependent adds, this is 5 vector steps
    for i in range(16):
        x[i] = w[i] + w[i + 16]
    for i in range(8):
        x[i] = x[i] + x[i + 8]
    for i in range(4):
        x[i] = x[i] + x[i + 4]
    return (x[0] + x[2]) + (x[1] + x[3])


@njit(inline="always")
def _rows_times_panel(x: Any, w: Any, out: Any, panel: int, k_in: int, ncols: int) -> None:
    # out[:, panel's columns] = x @ w[panel], 8 rows at a time, then the last 0-7
    # in one tile: the products' register tiles (matmul.py), which give every
    # element the same chain of roundings whichever tile computes it (so rows
    # stay independent).
    n = x.shape[0]
    r = 0
    while r + 8 <= n:
        _tile8(x, w, out, r, panel, k_in, ncols)
        r += 8
    _rows_times_panel_rest(x, w, out, panel, k_in, ncols, r)


@njit(inline="always")
def _rows_times_panel_rest(
    x: Any, w: Any, out: Any, panel: int, k_in: int, ncols: int, r: int
) -> None:  # pragma: no cover - numba
    # rows r .. n-1 (fewer than 8) of _rows_times_panel, in one tile
    rest = x.shape[0] - r
    if rest == 7:
        _tile7(x, w, out, r, panel, k_in, ncols)
    elif rest == 6:
        _tile6(x, w, out, r, panel, k_in, ncols)
    elif rest == 5:
        _tile5(x, w, out, r, panel, k_in, ncols)
    elif rest == 4:
        _tile4(x, w, out, r, panel, k_in, ncols)
    elif rest == 3:
        _tile3(x, w, out, r, panel, k_in, ncols)
    elif rest == 2:
        _tile2(x, w, out, r, panel, k_in, ncols)
    elif rest == 1:
        _tile1(x, w, out, r, panel, k_in, ncols)


@njit(inline="always")
def _rows_times_panel_pf(
    x: Any, w: Any, out: Any, panel: int, k_in: int, ncols: int, pf: Any, pf_at: int
) -> None:  # pragma: no cover - numba
    # _rows_times_panel, its first tile asking for pf.flat[pf_at:] one line per k
    # (the next tile's panel); the tiles after it find w's panel in L1/L2. The same
    # tiles' arithmetic, so the same bits.
    n = x.shape[0]
    r = 0
    if n >= 8:
        _tile8_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
        r = 8
        while r + 8 <= n:
            _tile8(x, w, out, r, panel, k_in, ncols)
            r += 8
        _rows_times_panel_rest(x, w, out, panel, k_in, ncols, r)
        return
    if n == 7:
        _tile7_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 6:
        _tile6_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 5:
        _tile5_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 4:
        _tile4_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 3:
        _tile3_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 2:
        _tile2_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)
    elif n == 1:
        _tile1_pf(x, w, out, 0, panel, k_in, ncols, pf, pf_at)


@njit(cache=True, nogil=True, fastmath={"contract"})
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
    # One compiled function that both drivers call (not inlined into them): its
    # arithmetic is then the same on either, and it compiles once per cache type.
    # Only "contract" (fused multiply-add) of the fast-math flags: no reassociation,
    # so each sum runs in the order written, the same in vector body and remainder.
    n_heads, head_dim = q.shape[1], q.shape[2]
    bs = k_cache.shape[3]  # K: (num_blocks, n_kv, head_dim, block_size)
    group = n_heads // k_cache.shape[1]
    nq = (r1 - r0) * group
    n_vp = (head_dim + TILE - 1) // TILE  # V panels of 32 columns
    # the item's query vectors, contiguous: row r's head kvh * group + g is qi
    qb = np.empty((nq, head_dim), np.float32)
    for r in range(r0, r1):
        for g in range(group):
            for j in range(head_dim):
                qb[(r - r0) * group + g, j] = q[r, kvh * group + g, j]
    # f32 and f16 pools with blocks of TILE positions are read in place by the
    # products (a tile is one block); the others widen each tile into kp and vp.
    # V in place only for a whole tile: a tile past the item's last row holds
    # positions nobody wrote (a reservation's stale bits, NaN in a test), and
    # weight 0 times NaN is NaN; those tiles are loaded, their tail zeroed.
    in_place = _keys_in_place(k_cache)
    v_in_place = _values_in_place(v_cache)
    kp_dim = 0 if in_place else head_dim
    kp = np.zeros((1, kp_dim, TILE), np.float32)  # K tile as one panel: keys along lanes
    vp = np.zeros((n_vp, TILE, TILE), np.float32)  # V tile as panels of 32 columns
    sc = np.empty((nq, TILE), np.float32)  # scores, then the tile's softmax weights
    pv = np.empty((nq, head_dim), np.float32)  # the tile's weighted sum of V
    m = np.zeros(nq, np.float32)  # running max per query vector
    lsum = np.zeros(nq, np.float32)  # running sum of exp(score - m)
    acc = np.zeros((nq, head_dim), np.float32)  # running sum of exp(score - m) * v
    started = np.zeros(nq, np.bool_)
    red = np.empty(TILE, np.float32)  # a reduction's scratch
    seg_lo = seg * seg_len
    seg_hi = seg_lo + seg_len - 1
    p_last = positions[r1 - 1]
    lo_first = max(0, positions[r0] - window + 1) if window > 0 else 0
    t_begin = max(seg_lo, lo_first) // TILE * TILE
    t_end = min(seg_hi, p_last)
    for t0 in range(t_begin, t_end + 1, TILE):
        # load the tile once for every query vector of the item, a block's run of
        # positions at a time; positions past the item's last row are zeros
        # (never weighted: finite is what matters). K read in place holds there
        # whatever the block holds: those scores only reach the softmax's
        # selects below, which drop them (a NaN included).
        n_valid = min(TILE, p_last - t0 + 1)
        v_here = v_in_place and n_valid == TILE  # V read from the pool, not from vp
        t = 0
        while t < n_valid:
            pos = t0 + t
            b = table[pos // bs]
            o = pos % bs
            n = min(bs - o, n_valid - t)  # this block's positions in the tile
            if not in_place:
                _load_keys(k_cache, k_scale, b, kvh, o, kp, t, n)
            if not v_here:
                _load_values(v_cache, v_scale, b, kvh, o, vp, t, n)
            t += n
        if n_valid < TILE:
            kp[0, :, n_valid:] = np.float32(0.0)  # (no rows when K is read in place)
            vp[:, n_valid:, :] = np.float32(0.0)
        # the next tile's K/V must stream in from memory while this one is
        # multiplied: at depth the tiles come from DRAM, and without a prefetch
        # the products waited for them (docs/engine.md, "Decode at depth"). Read
        # in place (f16/f32, blocks of TILE), the two products ask for it
        # themselves, one line per k (b_next); a burst of all its 256 lines here
        # filled the core's miss buffers and stalled the arithmetic behind it,
        # so memory and FMAs took turns (docs/engine.md, "the next tile's K/V").
        # The other layouts still ask in one burst, before their loads.
        t_next = t0 + TILE
        b_next = table[t_next // bs] if t_next <= t_end else table[t0 // bs]
        if t_next <= t_end and not (in_place and v_in_place):
            n_next = min(TILE, p_last - t_next + 1)
            t = 0
            while t < n_next:
                pos = t_next + t
                b = table[pos // bs]
                o = pos % bs
                n = min(bs - o, n_next - t)
                _prefetch_tile(k_cache, v_cache, k_scale, v_scale, b, kvh, o, n)
                t += n
        _scores(qb, k_cache, kp, sc, table[t0 // bs], kvh, b_next)  # sc = q . k, all vectors
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
                # the online softmax: raise the max, rescale the past, add the tile.
                # Every loop runs over all 32 lanes (a constant trip count: the
                # same vector code for every lane of every row, no remainder);
                # lanes outside a..z are masked by value, never by trip count.
                first = sc[qi, a] * scale
                for t in range(TILE):  # outside a..z: a valid score (the max is unchanged)
                    red[t] = sc[qi, t] * scale if a <= t <= z else first
                mt = _tree_max(red)
                m_new = max(m[qi], mt) if started[qi] else mt
                for t in range(TILE):
                    e = _exp(sc[qi, t] * scale - m_new)
                    sc[qi, t] = e if a <= t <= z else np.float32(0.0)
                total = _tree_sum(sc[qi], red)  # exact zeros outside a..z add nothing
                if started[qi] and m_new != m[qi]:  # the max rose: shrink the past
                    alpha = _exp(m[qi] - m_new)
                    total = lsum[qi] * alpha + total
                    for j in range(head_dim):
                        acc[qi, j] *= alpha
                elif started[qi]:
                    # the max stayed (most tiles, deep in a context): alpha would be
                    # _exp(0), exactly 1, and x * 1 is x, so skipping the exp and the
                    # head_dim multiplies changes no bit
                    total = lsum[qi] + total
                lsum[qi] = total
                m[qi] = m_new
                started[qi] = True
        # pv = weights @ V tile, all vectors
        _weighted_values(sc, v_cache, vp, pv, table[t0 // bs], kvh, v_here, b_next)
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


# --- the drivers: every item, on both cores or on this thread -----------------


@njit(cache=True, nogil=True, parallel=True)
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
    next_item: Any,
    lanes: int,
) -> None:  # pragma: no cover - numba
    # One lane per thread (lanes: the team's size, passed in: numba's
    # get_num_threads inside a kernel reads a ctypes pointer, which makes the
    # kernel uncachable), each claiming the next unclaimed item until none is left
    # (not prange over the items: numba splits those statically, half to each
    # thread, and this thread then waits for the other to wake up and do its half;
    # with claims it starts at once and does whatever the late one has not taken).
    # Which thread ran an item never changes its bits: each item is computed whole
    # by the one compiled _item, into its own partials.
    next_item[0] = 0
    for _lane in prange(lanes):
        while True:
            i = claim_next(next_item)  # type: ignore[call-arg,var-annotated]  # numba typing
            if i >= items.shape[0]:
                break
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


@njit(cache=True, nogil=True)
def _attend_serial(
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
    next_item: Any,
    lanes: int,
) -> None:  # pragma: no cover - numba
    # _attend's loop on the calling thread: no parallel region to open (and no
    # worker to wake) for a few tiles' work.
    for i in range(items.shape[0]):
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


@njit(cache=True, nogil=True, fastmath={"contract"})
def _merge(parts: Any, base: Any, out: Any) -> None:  # pragma: no cover - numba
    # out[r, h] = sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M), segments in order.
    # On this thread: a few vectors per row and head, less than a parallel region's
    # wake-up for a decode step, and a few ms for a 2048-row prefill.
    n, n_heads, head_dim = out.shape
    for item in range(n * n_heads):
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


# --- the public driver ----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One step's work items, and where each row's partial results go.

    Depends only on the rows' positions and chunks, the window and the head
    shape, so one plan serves every layer with the same window: the forward
    builds it once per step (``llama.py``), not once per layer.

    Trap: a plan is valid only for the arrays it was built from; passing it
    with other positions reads partials that belong to other rows.
    """

    items: np.ndarray  # (n_items, 4) int64: rows [r0, r1), KV head, segment
    first_seg: np.ndarray  # (n,) int64: each row's first segment
    base: np.ndarray  # (n + 1,) int64: each row's first partial's index in parts
    seg_len: int  # positions per segment (SEGMENT_POSITIONS when planned)
    window: int  # 0, or the sliding window the plan masks to
    parts: np.ndarray  # (n_partials, n_heads, head_dim + 2) float32 scratch, reused
    parallel: bool  # False: less than PARALLEL_MIN_WORK, one thread
    work: int  # query vectors x head_dim x tiles visited (PARALLEL_MIN_WORK's unit)
    next_item: np.ndarray  # (1,) int64: the parallel driver's next unclaimed item


def plan_attention(
    positions: np.ndarray,
    row_chunk: np.ndarray,
    window: int,
    n_kv_heads: int,
    n_heads: int,
    head_dim: int,
) -> AttentionPlan:
    """Plan :func:`paged_attention` for these rows (see :class:`AttentionPlan`)."""
    seg_len = SEGMENT_POSITIONS  # a multiple of TILE: a tile never straddles two segments
    items, first_seg, base, visits = _plan(positions, row_chunk, int(window), seg_len, n_kv_heads)
    parts = np.empty((int(base[-1]), n_heads, head_dim + 2), np.float32)
    work = visits * (n_heads // n_kv_heads) * head_dim
    parallel = len(items) > 1 and work >= PARALLEL_MIN_WORK
    return AttentionPlan(
        items, first_seg, base, seg_len, int(window), parts, parallel, work, np.zeros(1, np.int64)
    )


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
    plan: AttentionPlan | None = None,
) -> None:
    """Causal attention of every row over its own sequence's cached positions.

    q: (n, n_heads, head_dim) float32, RoPE applied; one layer's pool, already
    holding this step's K/V, in the cache's storage (float32, int16 f16 bits,
    uint16 bf16 bits, or int8 with f16 scales as int16: q8_0):
    k_cache (num_blocks, n_kv_heads, head_dim, block_size), K transposed
    within a block, and v_cache (num_blocks, n_kv_heads, block_size,
    head_dim); q8_0's k_scale (num_blocks, n_kv_heads, head_dim // 32,
    block_size) and v_scale (num_blocks, n_kv_heads, block_size, head_dim //
    32). positions: (n,) int64; row_chunk: (n,) int64, the row's index into
    block_tables: (n_chunks, max_blocks) int64; window: 0, or attend only to
    the last ``window`` positions (a sliding-window layer passes its own);
    out: (n, n_heads, head_dim) float32; plan: :func:`plan_attention` of these
    rows, built here when not given.

    Row i sees positions ``lo .. positions[i]`` of its sequence and nothing
    else: the block table is the only way in, so another sequence's blocks are
    unreachable, and positions past the row's own are never used (they may hold
    a reservation's stale data: they are in a tile, but outside the row's
    ``a..z`` range, so they are neither exponentiated nor summed).
    """
    if plan is None:
        plan = plan_attention(
            positions, row_chunk, window, k_cache.shape[1], q.shape[1], q.shape[2]
        )
    elif plan.window != int(window):
        raise ValueError(f"the plan masks to window {plan.window}, the layer asks {window}")
    ks = _NO_SCALES if k_scale is None else k_scale
    vs = _NO_SCALES if v_scale is None else v_scale
    driver = _attend if plan.parallel else _attend_serial
    driver(
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        positions,
        row_chunk,
        block_tables,
        plan.window,
        np.float32(scale),
        plan.items,
        plan.first_seg,
        plan.base,
        plan.seg_len,
        plan.parts,
        plan.next_item,
        thread_count() if plan.parallel else 1,
    )
    _merge(plan.parts, plan.base, out)


def warm_up(storage: type) -> None:
    """Compile (or load from numba's disk cache) attention for one storage dtype.

    Both drivers and the merge, with the argument types the forward passes
    (C-contiguous 4-D pools, int64 indices, a float32 scale). Only the pool's
    own type: each compiles ``_item`` anew (the bulk of a cold start), so
    compiling all four would make a cold start pay for three types nobody uses.
    """
    n, n_kv, hd, bs = 2, 2, 4, 4
    q = np.ones((n, n_kv, hd), np.float32)
    k_cache: np.ndarray = np.zeros((1, n_kv, hd, bs), storage)
    v_cache: np.ndarray = np.zeros((1, n_kv, 1, bs, V_PANEL), storage)  # V's panels
    k_scale = np.zeros((1, n_kv, 1, bs), np.int16)
    v_scale = np.zeros((1, n_kv, 1, bs), np.int16)
    positions = np.arange(n, dtype=np.int64)
    row_chunk = np.zeros(n, np.int64)
    tables = np.zeros((1, 1), np.int64)
    out = np.empty_like(q)
    plan = plan_attention(positions, row_chunk, 0, n_kv, n_kv, hd)
    for parallel in (True, False):
        paged_attention(
            q,
            k_cache,
            v_cache,
            positions,
            row_chunk,
            tables,
            0,
            np.float32(0.5),
            out,
            k_scale,
            v_scale,
            dataclasses.replace(plan, parallel=parallel),
        )
