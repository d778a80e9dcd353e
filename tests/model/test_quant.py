"""The quantized kernels against the ``gguf`` package's own dequantize, every type.

Blocks come from ``gguf.quantize`` where it exists (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1) and are raw random bytes with sane scales for the K-quants, which it
cannot quantize. The reference is a plain numpy product (float64) with the
weights ``gguf.dequantize`` gives.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_files import random_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model import matmul
from triollm.model.quant import QuantizedTensor, QuantType, quantize, stack_rows

TYPES = list(QuantType)


def make_weight(
    qtype: QuantType, rows: int, blocks: int, rng: np.random.Generator, exact: bool = True
) -> QuantizedTensor:
    # exact: float32 activations (the widening kernels this file proves); False:
    # int8 activations (test_quant_int8.py proves those against their own scheme)
    cols = blocks * qtype.block_values
    g = gguf.GGMLQuantizationType(int(qtype))
    if qtype < QuantType.Q4_K:
        w = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        w = QuantizedTensor(qtype, (rows, cols), random_blocks(g, rows, cols, rng))
    return w.with_exact_activations(exact)


def gguf_values(w: QuantizedTensor) -> np.ndarray:
    g = gguf.GGMLQuantizationType(int(w.qtype))
    return gguf.dequantize(w.blocks, g).reshape(w.shape).astype(np.float64)


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    n=st.integers(1, 20),
    rows=st.integers(1, 40),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_kernel_equals_numpy_on_gguf_dequantized_weights(
    qtype: QuantType, n: int, rows: int, blocks: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    if qtype >= QuantType.Q4_K:
        blocks = min(blocks, 3)  # 256 values a block
    w = make_weight(qtype, rows, blocks, rng)
    x = rng.standard_normal((n, w.shape[1])).astype(np.float32)
    got = matmul.linear(x, matmul.prepare(w))
    ref_w = gguf_values(w)
    ref = x.astype(np.float64) @ ref_w.T
    scale = np.sqrt(w.shape[1]) * np.abs(x).max() * (np.abs(ref_w).max() + 1e-30)
    assert got.dtype == np.float32 and got.shape == (n, rows)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * scale)


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    n=st.integers(2, 80),
    rows=st.integers(1, 40),
    exact=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(
    qtype: QuantType, n: int, rows: int, exact: bool, seed: int
) -> None:
    # both activation paths: the int8 one quantizes each row on its own
    rng = np.random.default_rng(seed)
    w = make_weight(qtype, rows, 2 if qtype >= QuantType.Q4_K else 9, rng, exact)
    x = rng.standard_normal((n, w.shape[1])).astype(np.float32)
    batched = matmul.linear(x, w)
    for i in {0, int(rng.integers(n)), n - 1}:
        np.testing.assert_array_equal(matmul.linear(x[i : i + 1], w)[0], batched[i])


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_widen_to_exactly_the_values_gguf_dequantize_gives(qtype: QuantType) -> None:
    # the embedding lookup: only the rows asked for, bit for bit gguf's values
    rng = np.random.default_rng(int(qtype))
    w = make_weight(qtype, 50, 2, rng)
    ids = np.array([[3, 49], [0, 3]])
    got = w[ids]
    assert got.shape == (2, 2, w.shape[1]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, gguf_values(w)[ids].astype(np.float32))


@pytest.mark.parametrize("exact", [True, False])
def test_mixed_types_stacked_compute_each_part_into_its_columns(exact: bool) -> None:
    # int8: the parts share one quantization of x, and get the bits of their own
    rng = np.random.default_rng(5)
    kinds = ((QuantType.Q4_K, 7), (QuantType.Q6_K, 5))
    parts = [make_weight(t, r, 1, rng, exact) for t, r in kinds]
    stacked = stack_rows(parts)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = matmul.linear(x, stacked)
    want = np.concatenate([matmul.linear(x, p) for p in parts], axis=1)
    np.testing.assert_array_equal(got, want)
    assert stacked.nbytes == sum(p.nbytes for p in parts)


def test_quantize_refuses_k_quants_and_ragged_rows() -> None:
    with pytest.raises(ValueError, match="Q4_K"):
        quantize(np.zeros((2, 256), np.float32), QuantType.Q4_K)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize(np.zeros((2, 40), np.float32), QuantType.Q8_0)


def test_a_quantized_weight_stays_its_blocks_in_memory() -> None:
    w = quantize(np.ones((64, 64), np.float32), QuantType.Q8_0)
    assert matmul.prepare(w) is w
    assert w.nbytes == 64 * 2 * 34  # 34 bytes per 32 weights, not 4 per weight


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_quantize_at_load_runs_the_model_its_dequantized_weights_make(name: str) -> None:
    # `triollm serve MODEL_DIR --quantize q8_0`: the matrices are quantized as they
    # are read (gguf.quantize); the model then generates what a float model holding
    # exactly those quantized values generates.
    from pathlib import Path

    from test_conformance import generate_greedy, reference

    from triollm.model.llama import LlamaModel
    from triollm.model.loader import load_model
    from triollm.model.quant import QuantizingSource
    from triollm.model.weights import Checkpoint, expected_shapes

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "models" / "llama-gqa-f32"
    model = load_model(fixture, quantize=name, exact_activations=True)
    assert all(isinstance(layer.down_proj, QuantizedTensor) for layer in model.model.layers)
    with Checkpoint(fixture) as ck:
        source = QuantizingSource(ck, name)
        values = {}
        for key in expected_shapes(model.config):
            t = source.get_tensor(key)
            values[key] = t.dequantize() if isinstance(t, QuantizedTensor) else t
    ref_model = LlamaModel(model.config, values)
    ref = type(model)(model.config, ref_model, model.tokenizer, ref_model.weight_bytes, fixture)
    prompt = reference("llama-gqa-f32")[0]["prompts"][1]["prompt_ids"]
    want_ids, want = generate_greedy(ref, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert np.abs(got[0] - want[0]).max() / np.abs(want[0]).max() < 1e-4
    assert model.weight_bytes < ref.weight_bytes / 3  # 8.5 or 4.5 bits a weight, not 32


def test_quantize_names_the_choices_when_given_another() -> None:
    from triollm.model.quant import QuantizingSource

    with pytest.raises(ValueError, match="q8_0, q4_0"):
        QuantizingSource(None, "q5_k")
