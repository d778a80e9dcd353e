"""Quantized weights times int8 activations, against a plain numpy copy of the scheme.

``reference_product`` below recomputes what ``quant_int8.py`` computes from the
GGUF blocks themselves (not from the packed layout the kernel reads, so the
repacking is proved too): the activations quantized per block, the weights
read as unsigned integers with their offset, exact integer sums per block (per
sub-block for the K-quants, times the integer sub-block scale), then the
float32 scale arithmetic multiply-then-add in the kernel's order. The kernel
(VNNI and portable) must equal it bit for bit. Blocks are raw random bytes (so
Q8_0 holds -128, scales run wild) with float16 scales drawn from a range, plus
whole zero blocks.
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model import matmul, quant, quant_int8, quant_pack
from triollm.model.quant import QuantizedStack, QuantizedTensor, QuantType, stack_rows

TYPES = list(QuantType)
F32 = np.float32


# --- the plain numpy scheme -------------------------------------------------------


def reference_rows(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q int8, d float32 per block, int16 sums of 16: quant_int8.quantize_rows in numpy."""
    n, k = x.shape
    xb = x.reshape(n, k // block, block)
    amax = np.abs(xb).max(axis=2)
    d = amax / F32(127)
    inv = np.divide(F32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int8).reshape(n, k)
    sums = q.astype(np.int32).reshape(n, k // 16, 16).sum(axis=2).astype(np.int16)
    return q, d.astype(F32), sums


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at : at + 2].copy().view(np.float16)[..., 0].astype(F32)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit scales and mins of each super-block (int64)."""
    s = b[..., 4:16].astype(np.int64)
    sc = np.empty((*b.shape[:-1], 8), np.int64)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def unsigned(w: QuantizedTensor) -> dict[str, np.ndarray]:
    """The weights as unsigned integers ``u`` (rows, k) and their block scalars."""
    kind = w.qtype
    rows = w.shape[0]
    b = w.blocks.reshape(rows, -1, kind.block_bytes)
    nb = b.shape[1]
    out: dict[str, np.ndarray] = {}
    if kind == QuantType.Q8_0:
        out["u"] = b[..., 2:34].view(np.int8).astype(np.int64) + 128
        out["d"] = _f16(b, 0)
    elif kind < QuantType.Q4_K:
        with_min = kind in (QuantType.Q4_1, QuantType.Q5_1)
        five = kind in (QuantType.Q5_0, QuantType.Q5_1)
        qh_at = 4 if with_min else 2
        qs_at = qh_at + 4 if five else qh_at
        qs = b[..., qs_at : qs_at + 16].astype(np.int64)
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if five:
            qh = b[..., qh_at : qh_at + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
            u |= ((qh[..., None] >> np.arange(32)) & 1) << 4
        out["u"], out["d"] = u, _f16(b, 0)
        if with_min:
            out["m"] = _f16(b, 2)
    elif kind in (QuantType.Q4_K, QuantType.Q5_K):
        qs_at = 16 if kind == QuantType.Q4_K else 48
        u = np.empty((rows, nb, 256), np.int64)
        for j in range(8):
            byte = b[..., qs_at + 32 * (j // 2) : qs_at + 32 * (j // 2) + 32].astype(np.int64)
            u[..., 32 * j : 32 * j + 32] = (byte >> (4 * (j % 2))) & 15
            if kind == QuantType.Q5_K:
                u[..., 32 * j : 32 * j + 32] |= ((b[..., 16:48].astype(np.int64) >> j) & 1) << 4
        out["u"], out["d"], out["dmin"] = u, _f16(b, 0), _f16(b, 2)
        out["sc"], out["mn"] = _k_scales(b)
    else:  # Q6_K
        u = np.empty((rows, nb, 256), np.int64)
        for h in range(2):
            for t in range(4):
                lo = b[..., 64 * h + 32 * (t % 2) : 64 * h + 32 * (t % 2) + 32].astype(np.int64)
                hi = b[..., 128 + 32 * h : 160 + 32 * h].astype(np.int64)
                u[..., 128 * h + 32 * t : 128 * h + 32 * t + 32] = ((lo >> (4 * (t // 2))) & 15) | (
                    ((hi >> (2 * t)) & 3) << 4
                )
        out["u"], out["d"] = u, _f16(b, 208)
        out["sc"] = b[..., 192:208].view(np.int8).astype(np.int64)
    out["u"] = out["u"].reshape(rows, -1)
    return out


OFFSET = {QuantType.Q4_0: 8, QuantType.Q5_0: 16, QuantType.Q8_0: 128}


def _i32_to_f32(v: np.ndarray) -> np.ndarray:
    assert np.abs(v).max(initial=0) < 2**31  # the kernel's int32 lanes hold it exactly
    return v.astype(np.int32).astype(F32)


def reference_product(x: np.ndarray, w: QuantizedTensor) -> np.ndarray:
    """``x @ W.T`` the way quant_int8 computes it: exact integer sums per block (or
    per sub-block, times its integer scale), then the float32 roundings in its order."""
    kind = w.qtype
    block = 256 if kind >= QuantType.Q4_K else 32
    q, dx, sums = reference_rows(x, block)
    W = unsigned(w)
    n, k = q.shape
    rows = W["u"].shape[0]
    qb = q.astype(np.int64).reshape(n, k // block, block)
    ub = W["u"].reshape(rows, k // block, block)
    acc = np.zeros((n, rows), F32)
    for bi in range(k // block):
        scale = W["d"][None, :, bi] * dx[:, bi, None]  # float32 (rows' d times x's d)
        if kind < QuantType.Q4_K:
            xsum = sums[:, 2 * bi].astype(np.int64) + sums[:, 2 * bi + 1]  # (n,)
            isum = qb[:, bi] @ ub[:, bi].T - OFFSET.get(kind, 0) * xsum[:, None]
            acc = acc + _i32_to_f32(isum) * scale
            if "m" in W:
                acc = acc + W["m"][None, :, bi] * (dx[:, bi] * xsum.astype(F32))[:, None]
            continue
        sub = 16 if kind == QuantType.Q6_K else 32
        xs = qb[:, bi].reshape(n, block // sub, sub)
        us = ub[:, bi].reshape(rows, block // sub, sub)
        per_sub = np.einsum("nsv,rsv->nrs", xs, us)  # (n, rows, sub-blocks), exact
        if kind == QuantType.Q6_K:  # offset 32, per sub-block of 16: its sum of q
            per_sub = per_sub - 32 * sums[:, None, 16 * bi : 16 * bi + 16].astype(np.int64)
        total = (per_sub * W["sc"][None, :, bi, :]).sum(axis=2)
        acc = acc + _i32_to_f32(total) * scale
        if kind != QuantType.Q6_K:  # - dmin * dx * sum_j mn_j * (sum of q over sub-block j)
            bs = sums[:, 16 * bi : 16 * bi + 16].astype(np.int64).reshape(n, 8, 2).sum(axis=2)
            mins = bs @ W["mn"][:, bi, :].T  # (n, rows)
            acc = acc - _i32_to_f32(mins) * (W["dmin"][None, :, bi] * dx[:, bi, None])
    return acc


# --- blocks ------------------------------------------------------------------------


def raw_blocks(
    kind: QuantType, rows: int, nb: int, rng: np.random.Generator, exp: int
) -> np.ndarray:
    """Random bytes for every field, float16 scales of magnitude 2**exp, some blocks zero."""
    b = rng.integers(0, 256, (rows, nb, kind.block_bytes), dtype=np.uint8)
    scales = {QuantType.Q6_K: (208,), QuantType.Q4_K: (0, 2), QuantType.Q5_K: (0, 2)}.get(
        kind, (0, 2) if kind in (QuantType.Q4_1, QuantType.Q5_1) else (0,)
    )
    for at in scales:
        v = (rng.uniform(0.5, 1.0, (rows, nb)) * 2.0**exp).astype(np.float16)
        b[..., at : at + 2] = v.view(np.uint8).reshape(rows, nb, 2)
    b[rng.random((rows, nb)) < 0.15] = 0  # whole zero blocks
    return b.reshape(rows, -1)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(TYPES),
    n=st.integers(1, 40),  # tiles of 16, 8, 4 and 1 x rows (the K-quants), 8, 4 and 1 (others)
    rows=st.integers(1, 37),
    nb=st.integers(1, 4),
    w_exp=st.integers(-14, 10),
    x_exp=st.integers(-30, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_int8_product_equals_the_numpy_scheme_bit_for_bit(
    kind: QuantType, n: int, rows: int, nb: int, w_exp: int, x_exp: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    blocks = raw_blocks(kind, rows, nb, rng, w_exp)
    w = QuantizedTensor(kind, (rows, nb * kind.block_values), blocks)
    x = (rng.standard_normal((n, w.shape[1])) * 2.0**x_exp).astype(F32)
    x[:, : kind.block_values][rng.random(n) < 0.3] = 0  # a zero activation block
    x[rng.random(x.shape) < 0.02] *= 1000  # an outlier dominating its block
    want = reference_product(x, w)
    acts = quant_int8.quantize_rows(x, quant_int8.activation_block(int(kind)))
    for portable in (False, True):
        got = np.empty((n, rows), F32)
        quant_int8.product(acts, w.packed(), int(kind), got, 16, portable=portable)
        np.testing.assert_array_equal(got, want, err_msg=f"portable={portable}")
    np.testing.assert_array_equal(matmul.linear(x, w), want)  # the default path


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_the_thread_count_and_the_split_of_the_rows_change_no_bit(kind: QuantType) -> None:
    # every output lane is one weight row's own chain: how many threads take how
    # many groups of 16 rows must not show in the bits (a 1-row and a 9-row x)
    rng = np.random.default_rng(int(kind))
    rows, nb = 83, 2 if kind >= QuantType.Q4_K else 9
    w = QuantizedTensor(kind, (rows, nb * kind.block_values), raw_blocks(kind, rows, nb, rng, -3))
    before = numba.get_num_threads()
    try:
        for n in (1, 9):
            x = rng.standard_normal((n, w.shape[1])).astype(F32)
            acts = quant_int8.quantize_rows(x, quant_int8.activation_block(int(kind)))
            results = []
            for threads, block_rows in ((1, 16), (2, 16), (2, 48), (2, 256)):
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                got = np.empty((n, rows), F32)
                results.append(quant_int8.product(acts, w.packed(), int(kind), got, block_rows))
            for got in results[1:]:
                np.testing.assert_array_equal(got, results[0])
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_the_packed_layout_holds_each_row_once_in_its_lane(kind: QuantType) -> None:
    # one nonzero weight row among zero rows: its product lands in its own column only
    rng = np.random.default_rng(3)
    rows, nb = 35, 1
    blocks = raw_blocks(kind, rows, nb, rng, 0)
    blocks[np.arange(rows) != 21] = 0
    w = QuantizedTensor(kind, (rows, kind.block_values), blocks)
    x = rng.standard_normal((2, w.shape[1])).astype(F32)
    got = matmul.linear(x, w)
    np.testing.assert_array_equal(got, reference_product(x, w))
    assert (got[:, np.arange(rows) != 21] == 0).all()


@settings(max_examples=30, deadline=None)
@given(
    block=st.sampled_from([32, 256]),
    n=st.integers(1, 12),
    nb=st.integers(1, 3),
    x_exp=st.integers(-40, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_activations_quantize_as_the_numpy_scheme_row_by_row(
    block: int, n: int, nb: int, x_exp: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, nb * block)) * 2.0**x_exp).astype(F32)
    x[0, :block] = 0
    got = quant_int8.quantize_rows(x, block)
    q, d, sums = reference_rows(x, block)
    np.testing.assert_array_equal(got.q, q)
    np.testing.assert_array_equal(got.d, d)
    np.testing.assert_array_equal(got.sums, sums)
    assert got.q.min(initial=0) >= -127  # never -128: its negation would not fit
    # a row's blocks depend on that row alone, and not on the driver: one row runs on
    # the calling thread (_quantize_rows_serial), several in a parallel region
    alone = quant_int8.quantize_rows(x[-1:], block)
    np.testing.assert_array_equal(alone.q[0], got.q[-1])
    np.testing.assert_array_equal(alone.d[0], got.d[-1])
    np.testing.assert_array_equal(alone.sums[0], got.sums[-1])


def test_every_int8_row_buffer_has_the_layout_the_tile_reads() -> None:
    # quantize_rows and the one-row product's per-thread buffers (quant._row_buffers)
    # must hand the tile the same dtypes and shapes: int32 sums once gave wrong products
    x = np.ones((3, 512), F32)
    for block in (32, 256):
        made = quant_int8.row_buffers(3, 512, block)
        acts = quant_int8.quantize_rows(x, block)
        one = quant._row_buffers(512, block)
        for a, b, c in zip(made, (acts.q, acts.d, acts.sums), one, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            assert (c.dtype, c.shape[1:]) == (a.dtype, a.shape[1:]) and c.shape[0] == 1
    assert made[2].dtype == quant_int8.SUM_DTYPE
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quant_int8.row_buffers(1, 48, 32)


def test_an_activation_width_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quant_int8.quantize_rows(np.zeros((1, 288), F32), 256)


@pytest.mark.parametrize("kind", TYPES)
def test_int8_rows_stay_within_the_activation_rounding_of_the_exact_path(kind: QuantType) -> None:
    # sane weights (gguf's dequantize as the truth) and Gaussian x: the int8 result
    # sits within the error the activation rounding explains (a stated bound)
    from test_quant import make_weight

    rng = np.random.default_rng(int(kind))
    w = make_weight(kind, 64, 2 if kind >= QuantType.Q4_K else 16, rng, exact=False)
    cols = w.shape[1]
    x = rng.standard_normal((8, cols)).astype(F32)
    wf = w.dequantize().astype(np.float64)
    exact = x.astype(np.float64) @ wf.T
    got = matmul.linear(x, w).astype(np.float64)
    # each x moved by at most d/2 = max|x_block| / 254: the error of a dot is at
    # most sum |w| * max|x| / 254 (worst case); typical is ~1/sqrt(k) of that
    bound = np.abs(wf).sum(axis=1)[None, :] * np.abs(x).max(axis=1)[:, None] / 254
    assert (np.abs(got - exact) <= bound).all()
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 0.02, rel


@pytest.mark.parametrize("n", [1, 6, 29])  # 29 = tiles of 16, 8, 4 and 1 x rows
def test_a_stack_of_parts_is_one_call_giving_each_part_its_own_bits(n: int) -> None:
    # a Q4_K_M file's fused q/k/v: Q4_K, Q4_K and a Q6_K v, in rows that leave
    # groups part-empty, so each part's outputs must start at its own column
    rng = np.random.default_rng(n)
    kinds = ((QuantType.Q4_K, 37), (QuantType.Q4_K, 5), (QuantType.Q6_K, 20))
    parts = [QuantizedTensor(t, (r, 512), raw_blocks(t, r, 2, rng, -3)) for t, r in kinds]
    x = rng.standard_normal((n, 512)).astype(F32)
    want = np.concatenate([reference_product(x, p) for p in parts], axis=1)
    acts = quant_int8.quantize_rows(x, 256)
    packed = [(p.packed(), int(p.qtype), p.shape[0]) for p in parts]
    for portable in (False, True):
        got = np.full((n, 62), np.nan, F32)  # every column must be written
        quant_int8.product_parts(acts, packed, got, 16, portable=portable)
        np.testing.assert_array_equal(got, want, err_msg=f"portable={portable}")
    stacked = stack_rows(parts)
    assert isinstance(stacked, QuantizedStack)  # the parts as they are: no concatenated copy
    np.testing.assert_array_equal(matmul.linear(x, stacked), want)


def test_a_weights_table_is_made_once_and_refuses_what_it_does_not_fit() -> None:
    # quant.linear keeps one PartsTable per weight (its arrays cost more than a small
    # product's kernel); a table must still refuse x of another activation block and
    # an out whose columns are not its rows
    rng = np.random.default_rng(5)
    w = QuantizedTensor(QuantType.Q4_K, (20, 256), raw_blocks(QuantType.Q4_K, 20, 1, rng, -3))
    table = w.table()
    assert w.table() is table and table.rows == 20 and table.block == 256
    x = rng.standard_normal((2, 256)).astype(F32)
    got = quant_int8.product_table(
        quant_int8.quantize_rows(x, 256), table, np.empty((2, 20), F32), 16
    )
    np.testing.assert_array_equal(got, reference_product(x, w))
    with pytest.raises(ValueError, match="activation blocks of 256"):
        quant_int8.product_table(quant_int8.quantize_rows(x, 32), table, np.empty((2, 20), F32), 16)
    with pytest.raises(ValueError, match="the 19 output columns"):
        quant_int8.product_table(
            quant_int8.quantize_rows(x, 256), table, np.empty((2, 19), F32), 16
        )
    with pytest.raises(ValueError, match="one activation block"):
        quant_int8.parts_table(
            [(w.packed(), int(QuantType.Q4_K), 20), (w.packed(), int(QuantType.Q8_0), 20)]
        )


def _resident_kb(path: Path) -> int:
    """This process's resident kB of the mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's line
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_packing_a_file_mapped_weight_releases_its_pages_and_keeps_its_values(
    tmp_path: Path,
) -> None:
    # the packed copy is what the int8 product reads: the file's pages of the
    # blocks leave resident memory (else the model is held twice), and reading
    # the blocks again (the embedding lookup) still gives the file's bytes
    rng = np.random.default_rng(9)
    kind = QuantType.Q4_K
    blocks = raw_blocks(kind, 64, 8, rng, -3)  # 64 x 1152 bytes: many whole pages
    path = tmp_path / "w.bin"
    blocks.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="c", shape=blocks.shape).view(np.ndarray)
    w = QuantizedTensor(kind, (64, 8 * 256), mapped)
    x = rng.standard_normal((2, w.shape[1])).astype(F32)
    assert int(mapped.sum(dtype=np.int64)) == int(blocks.sum(dtype=np.int64))  # all resident
    before = _resident_kb(path)
    w.packed()
    assert before >= 64 and _resident_kb(path) <= 8, (before, _resident_kb(path))
    np.testing.assert_array_equal(matmul.linear(x, w), reference_product(x, w))
    np.testing.assert_array_equal(mapped, blocks)
    # an array that is not a file mapping is never released: there the pages
    # would come back as zeros
    plain = blocks.copy()
    assert quant_pack.release_pages(plain) == 0
    np.testing.assert_array_equal(plain, blocks)
