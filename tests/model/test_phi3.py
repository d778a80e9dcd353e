"""Phi-3 (model/phi3.py): the config, partial rotary, LongRoPE's two lists, the GGUF path.

The token-for-token proofs against transformers on the HF fixture directories run
in test_conformance.py with the other families: phi3-longrope-f32 (qkv_proj and
gate_up_proj fused, half of each head rotated, LongRoPE whose training length, 36,
the engine's default context exceeds: the long factors and the attention factor)
and phi3-window-bf16 (3/4 rotated, tied head, a window of 48 under a 290-token
prompt). This module proves the short list, that each piece is needed (leave it out
and the logits leave transformers'), and the GGUF files written from both.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import read_checkpoint, write_gguf
from test_conformance import generate_greedy, reference

from triollm.errors import ModelLoadError
from triollm.model import kernels
from triollm.model.config import ModelConfig
from triollm.model.gguf import GGUFFile
from triollm.model.kvstore import KVDtype
from triollm.model.llama import LlamaModel
from triollm.model.loader import LoadedModel, load_model
from triollm.model.quant import QuantizedTensor
from triollm.model.sampling import SamplingParams
from triollm.model.tokenizer import Tokenizer
from triollm.model.weights import Checkpoint
from triollm.offline import Engine, engine_config

G = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
NAMES = ["phi3-longrope-f32", "phi3-window-bf16"]


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def phi3_config(**kw: object) -> dict:
    # Phi-3.5-mini-instruct's config.json as the hub spells it (a 128k LongRoPE model)
    d = {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + i / 64 for i in range(48)],
            "long_factor": [1.0 + i for i in range(48)],
        },
        "sliding_window": 262144,
        "vocab_size": 32064,
        "rms_norm_eps": 1e-5,
    }
    return d | kw


def test_a_hub_phi3_config_reads_its_longrope_partial_rotary_and_window() -> None:
    c = ModelConfig.from_dict(phi3_config())
    sc = c.rope_scaling
    assert sc is not None and sc.rope_type == "longrope"
    assert sc.original_max_position_embeddings == 4096 and sc.factor == 32.0
    # transformers' default attention factor: sqrt(1 + ln(131072 / 4096) / ln(4096))
    assert sc.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert sc.short_factor[1] == 1.0 + 1 / 64 and len(sc.long_factor) == 48
    assert c.rope_dim == c.head_dim == 96 and c.rotary_dim is None
    assert c.sliding_window == 262144 and not c.attention_bias and not c.qk_norm
    # Phi-4-mini: 3/4 of each head rotated (128 -> 96 dims, 48 factors per list);
    # the first 128k configs called LongRoPE "su"
    phi4 = ModelConfig.from_dict(
        phi3_config(
            hidden_size=3072,
            num_attention_heads=24,
            num_key_value_heads=8,
            partial_rotary_factor=0.75,
            rope_scaling=dict(phi3_config()["rope_scaling"], type="su"),
        )
    )
    assert phi4.head_dim == 128 and phi4.rotary_dim == 96 == phi4.rope_dim
    assert phi4.rope_scaling is not None and phi4.rope_scaling.rope_type == "longrope"


BAD_CONFIGS = [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47,
                       "long_factor": [1.0] * 48}}, "short_factor must list 48"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}},
     "long_factor must list 48"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                       "long_factor": [0.0] * 48}}, "long_factor must list 48 positive"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"partial_rotary_factor": 0}, "'partial_rotary_factor' must be a number in"),
    ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' must be a number in"),
    ({"partial_rotary_factor": 0.09375, "rope_scaling": None}, "an even number"),  # 9 dims
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings must be"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5, "rope_scaling": None},
     "supported for phi3 only"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "pattern"), BAD_CONFIGS)
def test_a_bad_phi3_config_is_refused_naming_the_field(change: dict, pattern: str) -> None:
    with pytest.raises(ModelLoadError, match=pattern):
        ModelConfig.from_dict(phi3_config(**change))


def test_the_fixtures_are_read_as_transformers_wrote_them() -> None:
    lr = ModelConfig.from_dir(FIXTURES / "phi3-longrope-f32")  # transformers 5 spelling
    assert lr.rotary_dim == 8 and lr.head_dim == 16
    sc = lr.rope_scaling
    assert sc is not None and sc.original_max_position_embeddings == 36
    assert sc.short_factor == (1.0, 1.3, 1.9, 2.6) and sc.long_factor == (1.1, 2.5, 5.0, 9.0)
    assert sc.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / 36) / math.log(36)))
    win = ModelConfig.from_dir(FIXTURES / "phi3-window-bf16")
    assert win.rotary_dim == 12 and win.sliding_window == 48 and win.tie_word_embeddings
    assert win.rope_scaling is None


def test_the_rope_kernel_turns_only_as_many_pairs_as_its_tables_hold() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    angles = rng.uniform(0, 6, (40, 4)).astype(np.float32)  # rotary_dim 8 of 16
    cos, sin = np.cos(angles), np.sin(angles)
    pos = np.array([0, 3, 17, 39, 5], np.int64)
    got = x.copy()
    kernels.rope(got, pos, cos, sin)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    x1, x2 = x[..., :4], x[..., 4:8]
    np.testing.assert_allclose(got[..., :4], x1 * c - x2 * s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[..., 4:8], x2 * c + x1 * s, rtol=1e-6, atol=1e-6)
    assert got[..., 8:].tobytes() == x[..., 8:].tobytes()  # passed through, untouched


def test_a_context_within_the_training_length_turns_with_the_short_factors() -> None:
    # transformers turns a sequence that stays within 36 positions with the short
    # list; a server whose context is 36 does too, and one of 37 takes the long list
    name = "phi3-longrope-f32"
    model = load_model(FIXTURES / name)  # its own copy: use_context changes the model
    summary, arrays = reference(name)
    prompt = summary["prompts"][0]
    assert "short_greedy_ids" in prompt and len(prompt["prompt_ids"]) + 31 <= 36
    model.model.use_context(36)
    tokens, logits = generate_greedy(model, prompt["prompt_ids"], 32)
    assert tokens == prompt["short_greedy_ids"]
    assert rel(logits[0], arrays["short_first_0"]) < 1e-4
    model.model.use_context(37)
    tokens, logits = generate_greedy(model, prompt["prompt_ids"], 32)
    assert tokens == prompt["greedy_ids"]
    assert rel(logits[0], arrays["first_0"]) < 1e-4
    # the two lists really differ here: the proof above could fail
    assert rel(arrays["short_first_0"], arrays["first_0"]) > 1e-2


def test_the_offline_engine_turns_with_the_list_its_context_selects() -> None:
    # Engine sizes its context (engine_config) and tells the model (use_context)
    name = "phi3-longrope-f32"
    loaded = load_model(FIXTURES / name)
    prompt = reference(name)[0]["prompts"][0]
    for context, want in ((36, prompt["short_greedy_ids"]), (512, prompt["greedy_ids"])):
        config = engine_config(loaded, context_tokens=context, kv_dtype=KVDtype.F32)
        engine = Engine(loaded, config, KVDtype.F32)  # f32 cache: transformers' arithmetic
        gen = engine.generate(prompt["prompt_ids"], SamplingParams(temperature=0.0), 32)
        assert [t.token_id for t in gen] == want, context


def _with_config(name: str, config: ModelConfig) -> LoadedModel:
    """The fixture's weights under another config (a piece of Phi-3 left out)."""
    with Checkpoint(FIXTURES / name) as ck:
        model = LlamaModel(config, ck)
    tokenizer = Tokenizer.from_dir(FIXTURES / name)
    return LoadedModel(config, model, tokenizer, model.weight_bytes, FIXTURES / name)


@pytest.mark.parametrize(
    ("name", "leave_out"),
    [
        ("phi3-longrope-f32", "attention_factor"),
        ("phi3-longrope-f32", "long_factor"),
        ("phi3-window-bf16", "partial_rotary"),
        ("phi3-window-bf16", "sliding_window"),
    ],
)
def test_leaving_out_a_phi3_piece_leaves_transformers_logits(name: str, leave_out: str) -> None:
    config = ModelConfig.from_dir(FIXTURES / name)
    sc = config.rope_scaling
    if leave_out == "attention_factor":
        assert sc is not None
        config = dataclasses.replace(
            config, rope_scaling=dataclasses.replace(sc, attention_factor=1.0)
        )
    elif leave_out == "long_factor":  # the short list where the long one applies
        assert sc is not None
        config = dataclasses.replace(
            config, rope_scaling=dataclasses.replace(sc, long_factor=sc.short_factor)
        )
    elif leave_out == "partial_rotary":
        config = dataclasses.replace(config, rotary_dim=None)
    else:
        config = dataclasses.replace(config, sliding_window=None)
    summary, arrays = reference(name)
    i = 2  # the 290-token prompt: past the window and the training length
    _, logits = generate_greedy(_with_config(name, config), summary["prompts"][i]["prompt_ids"], 1)
    assert rel(logits[0], arrays[f"first_{i}"]) > 1e-3


# --- GGUF: llama.cpp's phi3 layout ----------------------------------------------------


def make(tmp_path: Path, name: str, weight_type: G = G.F32) -> tuple[Path, dict]:
    config, tensors = read_checkpoint(FIXTURES / name)
    path = tmp_path / f"{name}-{weight_type.name}.gguf"
    held = write_gguf(path, config, tensors, FIXTURES / name, weight_type)
    return path, held


@pytest.mark.parametrize("name", NAMES)
def test_a_phi3_gguf_gives_transformers_greedy_ids_and_logits(tmp_path: Path, name: str) -> None:
    # attn_qkv and ffn_up (gate and up) fused, rope.dimension_count, the window, and
    # LongRoPE as rope_factors_short/long tensors plus the converter's attn_factor
    path, _ = make(tmp_path, name)
    assert "blk.0.attn_qkv.weight" in GGUFFile(path).tensors
    model = load_model(path)
    hf = ModelConfig.from_dir(FIXTURES / name)
    got = model.config
    assert (got.model_type, got.rotary_dim, got.sliding_window) == (
        hf.model_type,
        hf.rotary_dim,
        hf.sliding_window,
    )
    if hf.rope_scaling is not None:
        assert got.rope_scaling is not None
        for field in ("short_factor", "long_factor", "attention_factor"):
            a, b = getattr(got.rope_scaling, field), getattr(hf.rope_scaling, field)
            np.testing.assert_array_equal(np.float32(a), np.float32(b))  # float32 in the file
    summary, arrays = reference(name)
    for i, prompt in enumerate(summary["prompts"]):
        tokens, logits = generate_greedy(model, prompt["prompt_ids"], 8)
        assert tokens == prompt["greedy_ids"][:8], f"prompt {i}"
        assert rel(logits[0], arrays[f"first_{i}"]) < 1e-4


def test_a_quantized_phi3_gguf_generates_what_its_dequantized_weights_do(tmp_path: Path) -> None:
    name = "phi3-longrope-f32"
    path, held = make(tmp_path, name, G.Q8_0)
    model = load_model(path, exact_activations=True)  # the reference keeps x float32
    assert isinstance(model.model.layers[0].qkv_proj, QuantizedTensor)
    config = ModelConfig.from_dir(FIXTURES / name)
    ref = LlamaModel(config, held)
    ref_loaded = LoadedModel(config, ref, model.tokenizer, ref.weight_bytes, path)
    prompt = reference(name)[0]["prompts"][1]["prompt_ids"]
    want_ids, want = generate_greedy(ref_loaded, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert rel(got[0], want[0]) < 1e-4


def test_a_gguf_with_one_longrope_list_is_refused_naming_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf_files

    real = gguf_files.phi3_rope_factors
    monkeypatch.setattr(
        gguf_files,
        "phi3_rope_factors",
        lambda c: {k: v for k, v in real(c).items() if "short" not in k},
    )
    path, _ = make(tmp_path, "phi3-longrope-f32")
    with pytest.raises(ModelLoadError, match=r"rope_factors_short\.weight' is missing"):
        load_model(path)
