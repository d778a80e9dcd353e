"""linear() equals the plain numpy product x @ W.T for every storage dtype."""

from __future__ import annotations

import numpy as np
import pytest

from triollm.model.matmul import bf16_bits_to_f32, linear, prepare


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, as a checkpoint stores them."""
    u = a.astype(np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 16, 33])
def test_linear_equals_numpy_reference(kind: str, n: int) -> None:
    rng = np.random.default_rng(n)
    w = rng.standard_normal((37, 29)).astype(np.float32)
    x = rng.standard_normal((n, 29)).astype(np.float32)
    if kind == "f32":
        pw, ref_w = prepare(w), w.astype(np.float64)
    elif kind == "f16":
        pw, ref_w = prepare(w.astype(np.float16)), w.astype(np.float16).astype(np.float64)
    else:
        bits = _bf16_bits(w)
        pw, ref_w = prepare(bits, bf16=True), bf16_bits_to_f32(bits).astype(np.float64)
    got = linear(x, pw)
    assert got.dtype == np.float32
    assert got.shape == (n, 37)
    np.testing.assert_allclose(got, x.astype(np.float64) @ ref_w.T, rtol=1e-4, atol=1e-4)
    assert (pw.in_features, pw.out_features) == (29, 37)


def test_linear_writes_into_out() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    out = np.empty((4, 8), np.float32)
    assert linear(x, prepare(w), out=out) is out
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_linear_rejects_float64_rows() -> None:
    w = prepare(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        linear(np.ones((2, 3)), w)
