"""linear() equals the plain numpy product x @ W.T for every storage format and row count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model import matmul
from triollm.model.matmul import linear, prepare
from triollm.model.weights import bf16_bits_to_f32


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, as a checkpoint stores them."""
    u = a.astype(np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def stored(w: np.ndarray, kind: str) -> tuple[matmul.PreparedWeight, np.ndarray]:
    """The prepared weight and the float64 values it really holds (after rounding)."""
    if kind == "f32":
        return prepare(w), w.astype(np.float64)
    if kind == "f16":
        h = w.astype(np.float16)
        return prepare(h), h.astype(np.float64)
    bits = bf16_bits(w)
    return prepare(bits, bf16=True), bf16_bits_to_f32(bits).astype(np.float64)


def assert_matches_reference(got: np.ndarray, x: np.ndarray, ref_w: np.ndarray) -> None:
    ref = x.astype(np.float64) @ ref_w.T
    # float32 accumulation over k terms: error grows like sqrt(k) * |x| * |w|
    scale = np.sqrt(x.shape[1]) * (np.abs(x).max() + 1e-30) * (np.abs(ref_w).max() + 1e-30)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * scale)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    k_in=st.integers(1, 97),
    n_out=st.integers(1, 200),
    kind=st.sampled_from(["f32", "f16", "bf16"]),
    path=st.sampled_from(["kernel", "blas"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_equals_numpy_reference(
    n: int, k_in: int, n_out: int, kind: str, path: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, k_in)).astype(np.float32)
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    pw, ref_w = stored(w, kind)
    got = linear(x, pw, blas_min_rows=1 if path == "blas" else 1000)
    assert got.dtype == np.float32
    assert got.shape == (n, n_out)
    assert_matches_reference(got, x, ref_w)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 40),
    k_in=st.integers(1, 97),
    n_out=st.integers(1, 200),
    kind=st.sampled_from(["f32", "f16", "bf16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(
    n: int, k_in: int, n_out: int, kind: str, seed: int
) -> None:
    # Batch invariance: the kernel computes every row with the same instructions,
    # so a sequence's logits do not depend on which rows share its step.
    rng = np.random.default_rng(seed)
    pw, _ = stored(rng.standard_normal((n_out, k_in)).astype(np.float32), kind)
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    batched = linear(x, pw)
    i = int(rng.integers(n))
    np.testing.assert_array_equal(linear(x[i : i + 1], pw)[0], batched[i])


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_long_prefill_crosses_row_chunks_and_stays_invariant(kind: str) -> None:
    # 150 rows = two full chunks of 64 and a ragged 22 (a short last 4-row tile)
    rng = np.random.default_rng(1)
    pw, ref_w = stored(rng.standard_normal((53, 40)).astype(np.float32), kind)
    x = rng.standard_normal((150, 40)).astype(np.float32)
    got = linear(x, pw)
    assert_matches_reference(got, x, ref_w)
    for i in (0, 63, 64, 149):
        np.testing.assert_array_equal(linear(x[i : i + 1], pw)[0], got[i])


def test_smollm2_shapes_match_reference() -> None:
    rng = np.random.default_rng(2)
    for n_out, k_in in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        w = rng.standard_normal((n_out, k_in)).astype(np.float32) * np.float32(0.02)
        x = rng.standard_normal((5, k_in)).astype(np.float32)
        for kind in ("f32", "bf16"):
            pw, ref_w = stored(w, kind)
            assert_matches_reference(linear(x, pw), x, ref_w)


def test_linear_writes_into_out() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    out = np.empty((4, 8), np.float32)
    assert linear(x, prepare(w), out=out) is out
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_non_contiguous_rows_are_accepted() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((9, 6)).astype(np.float32)
    x = rng.standard_normal((6, 12)).astype(np.float32)[:, ::2]  # strided view
    assert_matches_reference(linear(x, prepare(w)), x, w.astype(np.float64))


def test_zero_rows_give_an_empty_result() -> None:
    got = linear(np.empty((0, 3), np.float32), prepare(np.ones((4, 3), np.float32)))
    assert got.shape == (0, 4) and got.dtype == np.float32


def test_prepared_weight_reports_shape_storage_and_bytes() -> None:
    w = np.ones((6, 10), np.float32)
    p32, p16, pbf = prepare(w), prepare(w.astype(np.float16)), prepare(bf16_bits(w), bf16=True)
    assert (p32.out_features, p32.in_features) == (6, 10)
    assert (p32.storage, p16.storage, pbf.storage) == ("float32", "float16", "bfloat16")
    # 16-bit formats stay 16-bit in memory: half the bytes read per product
    # (6 output columns fill one zero-padded panel of 32: 32 x 10 values)
    assert matmul.PANEL == 32
    assert (p32.nbytes, p16.nbytes, pbf.nbytes) == (1280, 640, 640)
    assert pbf.to_float32().dtype == np.float32


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_out", [1, 31, 32, 33, 70])
def test_the_panels_give_back_the_checkpoint_rows_and_matrix(kind: str, n_out: int) -> None:
    # A tied head is also the embedding table: the model looks its rows up in
    # the panels (the only copy), so rows() and to_float32() must undo the
    # packing exactly, bf16's interleaved columns and the padded last panel too.
    rng = np.random.default_rng(n_out)
    pw, ref_w = stored(rng.standard_normal((n_out, 9)).astype(np.float32), kind)
    np.testing.assert_array_equal(pw.to_float32(), ref_w.astype(np.float32))
    index = rng.integers(0, n_out, size=12)
    got = pw.rows(index)
    assert got.dtype == np.float32 and got.shape == (12, 9)
    np.testing.assert_array_equal(got, ref_w[index].astype(np.float32))
    with pytest.raises(IndexError, match="row index"):
        pw.rows(np.array([n_out]))


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_every_tile_shape_gives_a_row_the_same_bits(kind: str) -> None:
    # Rows go through 8-, 4-, 2- and 1-row tiles, and a row alone through the
    # one-row tile that takes four panels at once (200 columns: one group of
    # four panels, two whole panels and one of 8 columns); a row's bits must
    # not depend on which (n = 15 is 8 + 4 + 2 + 1: row 14 is the 1-row tile's).
    rng = np.random.default_rng(4)
    pw, _ = stored(rng.standard_normal((200, 300)).astype(np.float32), kind)
    x = rng.standard_normal((15, 300)).astype(np.float32)
    batched = linear(x, pw)
    for n in (1, 2, 3, 4, 7, 8, 9, 15):
        np.testing.assert_array_equal(linear(x[15 - n :], pw), batched[15 - n :])


def test_linear_rejects_float64_rows() -> None:
    w = prepare(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        linear(np.ones((2, 3)), w)


def test_linear_rejects_wrong_width_and_wrong_out() -> None:
    w = prepare(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(n, 3\)"):
        linear(np.ones((2, 5), np.float32), w)
    with pytest.raises(ValueError, match="out must be float32"):
        linear(np.ones((2, 3), np.float32), w, out=np.empty((2, 5), np.float32))


def test_prepare_rejects_integers_without_the_bf16_flag() -> None:
    with pytest.raises(TypeError, match="bf16=True"):
        prepare(np.ones((2, 2), np.uint16))
    with pytest.raises(TypeError, match="uint16 bits"):
        prepare(np.ones((2, 2), np.float32), bf16=True)
    with pytest.raises(ValueError, match="2-D"):
        prepare(np.ones(3, np.float32))


def test_kernel_releases_the_gil() -> None:
    # The server runs the forward in a worker thread; a kernel holding the GIL
    # would freeze the event loop for a whole step.
    assert matmul._panel_matmul.targetoptions["nogil"] is True
