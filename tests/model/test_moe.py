"""Mixtures of experts (model/moe.py): routing, the batched-by-expert product, GGUF.

The token-for-token proofs against transformers on the HF fixture directories
(qwen3-moe-f32/bf16, mixtral-f32/f16) run in test_conformance.py with the other
families, and batch invariance in test_batch.py; this module proves the pieces
and the GGUF path (experts stored as 3-D tensors, quantized or not).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import read_checkpoint, write_gguf
from test_conformance import generate_greedy, reference

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel
from triollm.model.loader import load_model
from triollm.model.matmul import prepare
from triollm.model.moe import Expert, MoeBlock, route
from triollm.model.quant import QuantizedTensor

G = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
# qwen3-moe-f32 has a dense layer (mlp_only_layers), which a qwen3moe GGUF cannot
# hold: llama.cpp's qwen3moe has experts in every layer, and no dense tensor names
GGUF_FIXTURES = ["qwen3-moe-bf16", "mixtral-f32", "mixtral-f16"]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_route_picks_the_most_probable_experts_and_their_probabilities() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 8)).astype(np.float32) * 3
    probs = softmax(logits.astype(np.float64))
    for normalize in (False, True):
        experts, weights = route(logits, 3, normalize)
        want = np.argsort(-probs, axis=1)[:, :3]
        np.testing.assert_array_equal(experts, want)
        w = np.take_along_axis(probs, want, axis=1)
        if normalize:
            w = w / w.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(weights, w, rtol=1e-5)
        assert weights.dtype == np.float32


def test_route_breaks_a_tie_towards_the_lower_expert() -> None:
    logits = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    experts, _ = route(logits, 2, True)
    assert experts.tolist() == [[1, 2]]


def random_block(rng: np.random.Generator, n_experts: int, top_k: int) -> MoeBlock:
    h, w = 32, 24

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    experts = [Expert(prepare(mat(2 * w, h)), prepare(mat(h, w))) for _ in range(n_experts)]
    return MoeBlock(prepare(mat(n_experts, h) * 4), experts, top_k, normalize=True)


def test_a_block_computes_each_row_s_weighted_sum_of_its_experts() -> None:
    rng = np.random.default_rng(1)
    block = random_block(rng, 6, 2)
    x = rng.standard_normal((40, 32)).astype(np.float32)
    out = np.empty_like(x)
    block.forward(x, out)
    router = block.router.to_float32()
    experts, weights = route(x @ router.T, 2, True)
    for i in range(len(x)):
        want = np.zeros(32, np.float64)
        for e, w in zip(experts[i], weights[i], strict=True):
            gate_up = block.experts[e].gate_up_proj.to_float32() @ x[i]
            g, u = np.split(gate_up.astype(np.float64), 2)
            act = g / (1 + np.exp(-g)) * u
            want += w * (block.experts[e].down_proj.to_float32() @ act)
        np.testing.assert_allclose(out[i], want, rtol=1e-4, atol=1e-5)


def test_a_row_s_bits_are_the_same_alone_and_among_other_rows() -> None:
    # batch invariance: which other rows share an expert changes the gathered
    # matrices, never a row's result
    rng = np.random.default_rng(2)
    block = random_block(rng, 8, 2)
    x = rng.standard_normal((33, 32)).astype(np.float32)
    together = np.empty_like(x)
    block.forward(x, together)
    for i in range(len(x)):
        alone = np.empty((1, 32), np.float32)
        block.forward(x[i : i + 1].copy(), alone)
        assert alone[0].tobytes() == together[i].tobytes(), i


def test_experts_no_row_chose_are_not_multiplied(monkeypatch: pytest.MonkeyPatch) -> None:
    from triollm.model import moe

    rng = np.random.default_rng(3)
    block = random_block(rng, 8, 2)
    x = rng.standard_normal((1, 32)).astype(np.float32)
    seen: list[int] = []
    real = moe.linear

    def counting(a: np.ndarray, w: object, out: np.ndarray | None = None) -> np.ndarray:
        seen.append(id(w))
        return real(a, w, out)  # type: ignore[arg-type]

    monkeypatch.setattr(moe, "linear", counting)
    block.forward(x, np.empty_like(x))
    # the router, then gate_up and down of exactly the two chosen experts
    assert len(seen) == 1 + 2 * 2


# --- config ----------------------------------------------------------------------


def moe_config(**kw: object) -> dict:
    d = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "vocab_size": 100,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    return d | kw


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_sparse_layers() -> None:
    c = ModelConfig.from_dict(moe_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert c.moe is not None
    assert c.moe.sparse_layers == {1, 5}  # (i + 1) % 2 == 0, minus layer 3
    assert not c.moe.norm_topk_prob  # transformers' default for qwen3_moe
    assert c.qk_norm
    mix = ModelConfig.from_dict(
        moe_config(model_type="mixtral", num_local_experts=8, num_experts=None)
    )
    assert mix.moe is not None and mix.moe.sparse_layers == set(range(6))
    assert mix.moe.norm_topk_prob and not mix.qk_norm
    assert mix.moe.intermediate_size == 128  # Mixtral's experts are intermediate_size wide


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [6]}, "mlp_only_layers"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"num_experts": 0}, "num_experts"),
    ],
)
def test_a_bad_moe_config_is_refused_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(moe_config(**change))


# --- GGUF: experts as 3-D tensors --------------------------------------------------


def make(tmp_path: Path, name: str, weight_type: G | object = G.F32) -> tuple[Path, dict]:
    config, tensors = read_checkpoint(FIXTURES / name)
    path = tmp_path / f"{name}.gguf"
    held = write_gguf(path, config, tensors, FIXTURES / name, weight_type)  # type: ignore[arg-type]
    return path, held


@pytest.mark.parametrize("name", GGUF_FIXTURES)
def test_a_moe_gguf_gives_transformers_greedy_ids_and_logits(tmp_path: Path, name: str) -> None:
    # qwen3moe files and Mixtral's (a "llama" file with experts, q/k permuted)
    path, _ = make(tmp_path, name)
    model = load_model(path)
    hf = ModelConfig.from_dir(FIXTURES / name)
    assert model.config.moe == hf.moe  # experts, top-k, norm, sparse layers from metadata
    assert model.config.model_type == hf.model_type
    summary, arrays = reference(name)
    for i, prompt in enumerate(summary["prompts"][:2]):
        tokens, logits = generate_greedy(model, prompt["prompt_ids"], 8)
        assert tokens == prompt["greedy_ids"][:8], f"prompt {i}"
        want = arrays[f"first_{i}"]
        assert np.abs(logits[0] - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize(("name", "qtype"), [("mixtral-f32", G.Q8_0), ("mixtral-f16", G.Q4_0)])
def test_quantized_experts_generate_what_their_dequantized_weights_do(
    tmp_path: Path, name: str, qtype: G
) -> None:
    path, held = make(tmp_path, name, qtype)
    model = load_model(path, exact_activations=True)  # the reference keeps x float32
    moe_layers = [layer.moe for layer in model.model.layers if layer.moe is not None]
    assert moe_layers and all(
        isinstance(e.down_proj, QuantizedTensor) for m in moe_layers for e in m.experts
    )
    config = ModelConfig.from_dir(FIXTURES / name)
    ref = LlamaModel(config, held)
    ref_loaded = type(model)(config, ref, model.tokenizer, ref.weight_bytes, path)
    prompt = reference(name)[0]["prompts"][1]["prompt_ids"]
    want_ids, want = generate_greedy(ref_loaded, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert np.abs(got[0] - want[0]).max() / np.abs(want[0]).max() < 1e-4


def test_k_quant_experts_generate_what_their_dequantized_weights_do(tmp_path: Path) -> None:
    # a Q4_K_M-style mix (experts' down in Q6_K, the rest Q4_K): widths of 256
    from triollm.model.weights import expected_shapes

    cfg = moe_config(
        hidden_size=256,
        moe_intermediate_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        head_dim=64,
        num_experts=4,
        norm_topk_prob=True,
        vocab_size=400,
        rms_norm_eps=1e-5,
        eos_token_id=4,
    )
    config = ModelConfig.from_dict(cfg)
    rng = np.random.default_rng(4)
    tensors = {
        k: (
            rng.standard_normal(s) * (0.3 if len(s) == 1 else 0.05) + (1.0 if len(s) == 1 else 0.0)
        ).astype(np.float32)
        for k, s in expected_shapes(config).items()
    }

    def weight_type(key: str, w: np.ndarray) -> G:
        if "down_proj" in key or "v_proj" in key:
            return G.Q6_K
        return G.Q8_0 if "embed" in key or "lm_head" in key else G.Q4_K

    path = tmp_path / "moe-k.gguf"
    held = write_gguf(path, cfg, tensors, FIXTURES / "qwen3-moe-f32", weight_type)
    model = load_model(path, exact_activations=True)  # the reference keeps x float32
    sparse = model.model.layers[1].moe
    assert sparse is not None
    assert isinstance(sparse.experts[0].down_proj, QuantizedTensor)
    assert sparse.experts[0].down_proj.qtype.name == "Q6_K"
    ref = LlamaModel(config, held)
    ref_loaded = type(model)(config, ref, model.tokenizer, ref.weight_bytes, path)
    prompt = [5, 77, 300, 12, 9, 250]
    want_ids, want = generate_greedy(ref_loaded, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert np.abs(got[0] - want[0]).max() / np.abs(want[0]).max() < 1e-4
