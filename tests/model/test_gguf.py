"""GGUF files load into the same model as the checkpoints they came from.

The files are written by the tests (``gguf_files.py``) the way llama.cpp's
converter writes them, q/k permutation included, from the committed HF
fixtures (tests/fixtures/models) and from random weights for the K-quants.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import read_checkpoint, write_gguf
from test_conformance import generate_greedy, reference

from triollm.errors import ModelLoadError
from triollm.model.gguf import GGUFFile, unpermute_order
from triollm.model.loader import load_model
from triollm.model.quant import QuantizedTensor

G = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"


def make(tmp_path: Path, name: str, weight_type: G = G.F32, **kw: object) -> tuple[Path, dict]:
    config, tensors = read_checkpoint(FIXTURES / name)
    path = tmp_path / f"{name}-{weight_type.name}.gguf"
    held = write_gguf(path, config, tensors, FIXTURES / name, weight_type, **kw)
    return path, held


@pytest.mark.parametrize(
    "name", ["llama-gqa-f32", "qwen2-bias-f32", "qwen3-headdim-f16", "llama-tied-llama3-bf16"]
)
def test_a_gguf_written_from_a_checkpoint_gives_its_logits_and_greedy_ids(
    tmp_path: Path, name: str
) -> None:
    # llama: q/k permuted by the converter and un-permuted on load; qwen2: biases;
    # qwen3: q/k norms and an explicit head_dim; llama3: RoPE scaled by the file's
    # rope_freqs.weight factors, tied output. The reference is transformers' output
    # on the HF checkpoint (tools/make_fixtures.py), as for the directory.
    path, _ = make(tmp_path, name)
    model = load_model(path)
    summary, arrays = reference(name)
    for i, prompt in enumerate(summary["prompts"][:2]):
        tokens, logits = generate_greedy(model, prompt["prompt_ids"], 8)
        assert tokens == prompt["greedy_ids"][:8], f"prompt {i}"
        want = arrays[f"first_{i}"]
        assert np.abs(logits[0] - want).max() / np.abs(want).max() < 1e-4


def test_without_undoing_the_permutation_the_logits_are_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the proof above can fail: skip the un-permutation and the llama file disagrees
    from triollm.model import gguf as gguf_module

    path, _ = make(tmp_path, "llama-gqa-f32")
    monkeypatch.setattr(gguf_module, "_PERMUTED_ARCHITECTURES", ())
    summary, arrays = reference("llama-gqa-f32")
    _, logits = generate_greedy(load_model(path), summary["prompts"][1]["prompt_ids"], 1)
    want = arrays["first_1"]
    assert np.abs(logits[0] - want).max() / np.abs(want).max() > 1e-2


def test_unpermute_order_inverts_the_converters_permutation() -> None:
    from gguf_files import permute

    w = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 2, 3):
        np.testing.assert_array_equal(permute(w, heads)[unpermute_order(48, heads)], w)


QUANT_TYPES = [G.Q8_0, G.Q4_0, G.Q4_1, G.Q5_0, G.Q5_1]


@pytest.mark.parametrize("qtype", [G.F16, G.BF16, *QUANT_TYPES])
def test_a_quantized_fixture_gguf_generates_what_its_dequantized_weights_do(
    tmp_path: Path, qtype: G
) -> None:
    # Reference: the same model with the weights gguf.dequantize gives, in float32,
    # through the safetensors-free in-memory path.
    from triollm.model.config import ModelConfig
    from triollm.model.llama import LlamaModel

    path, held = make(tmp_path, "llama-gqa-f32", qtype)
    model = load_model(path, exact_activations=True)  # transformers computes float32 x
    assert any(isinstance(layer.o_proj, QuantizedTensor) for layer in model.model.layers) == (
        qtype in QUANT_TYPES
    )
    config = ModelConfig.from_dir(FIXTURES / "llama-gqa-f32")
    ref = LlamaModel(config, held)
    prompt = reference("llama-gqa-f32")[0]["prompts"][1]["prompt_ids"]
    ref_loaded = type(model)(config, ref, model.tokenizer, ref.weight_bytes, path)
    want_ids, want = generate_greedy(ref_loaded, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert np.abs(got[0] - want[0]).max() / np.abs(want[0]).max() < 1e-4


def kquant_config() -> dict:
    # the smallest llama whose widths are whole K-quant super-blocks (256)
    return {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 400,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@pytest.mark.parametrize("mix", ["Q4_K", "Q5_K", "Q6_K", "Q4_K_M"])
def test_a_k_quant_gguf_generates_what_its_dequantized_weights_do(tmp_path: Path, mix: str) -> None:
    from triollm.model.config import ModelConfig
    from triollm.model.llama import LlamaModel
    from triollm.model.weights import expected_shapes

    cfg = kquant_config()
    config = ModelConfig.from_dict(cfg)
    rng = np.random.default_rng(3)
    tensors = {
        k: (
            rng.standard_normal(s) * (0.3 if len(s) == 1 else 0.05) + (1.0 if len(s) == 1 else 0.0)
        ).astype(np.float32)
        for k, s in expected_shapes(config).items()
    }

    def weight_type(key: str, w: np.ndarray) -> G:
        if mix == "Q4_K_M":  # llama.cpp's mix: v and down in Q6_K, the embedding in Q8_0
            if "v_proj" in key or "down_proj" in key:
                return G.Q6_K
            return G.Q8_0 if "embed" in key else G.Q4_K
        return G[mix]

    path = tmp_path / f"k-{mix}.gguf"
    held = write_gguf(path, cfg, tensors, FIXTURES / "llama-gqa-f32", weight_type)
    model = load_model(path, exact_activations=True)  # transformers computes float32 x
    ref = LlamaModel(config, held)
    ref_loaded = type(model)(config, ref, model.tokenizer, ref.weight_bytes, path)
    prompt = [1, 5, 77, 300, 12, 9, 250]
    want_ids, want = generate_greedy(ref_loaded, prompt, 6)
    got_ids, got = generate_greedy(model, prompt, 6)
    assert got_ids == want_ids
    assert np.abs(got[0] - want[0]).max() / np.abs(want[0]).max() < 1e-4


# --- bad input: one error naming the key or tensor ---------------------------------


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path, _ = make(tmp_path, "llama-gqa-f32", G.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"tensor '[^']+' ends at byte \d+, past the end of"):
        load_model(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:100])  # cut inside the metadata
    with pytest.raises(ModelLoadError, match=r"head\.gguf"):
        load_model(head)


def test_an_unknown_tensor_type_is_refused_naming_it(tmp_path: Path) -> None:
    path, _ = make(tmp_path, "llama-gqa-f32", G.Q4_0)
    t = GGUFFile(path).tensors["blk.0.ffn_up.weight"]
    # Rewrite that tensor's type to IQ4_NL: the same block size and bytes as Q4_0,
    # so the file stays well formed, but a type we do not compute on.
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == int(t.tensor_type)
    data[type_at : type_at + 4] = int(G.IQ4_NL).to_bytes(4, "little")
    bad = tmp_path / "iq4nl.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_up\.weight' has type IQ4_NL"):
        load_model(bad)


def test_a_missing_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    config, tensors = read_checkpoint(FIXTURES / "llama-gqa-f32")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf(path, config, tensors, FIXTURES / "llama-gqa-f32", G.F32)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down\.weight.*missing"):
        load_model(path)


def test_rope_factors_of_the_wrong_length_are_refused_naming_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf_files

    name = "llama-tied-llama3-bf16"
    config, tensors = read_checkpoint(FIXTURES / name)
    real = gguf_files.llama3_rope_factors
    monkeypatch.setattr(gguf_files, "llama3_rope_factors", lambda c: real(c)[:-1])
    path = tmp_path / "short-factors.gguf"
    gguf_files.write_gguf(path, config, tensors, FIXTURES / name, G.F32)
    with pytest.raises(ModelLoadError, match=r"'rope_freqs\.weight' must hold 8 positive"):
        load_model(path)


def test_a_metadata_key_of_the_wrong_type_is_refused_naming_it(tmp_path: Path) -> None:
    path, _ = make(tmp_path, "llama-gqa-f32")
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at : at + 4], "little") == int(gguf.GGUFValueType.UINT32)
    data[at : at + 4] = int(gguf.GGUFValueType.FLOAT32).to_bytes(4, "little")
    bad = tmp_path / "badkey.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'llama\.block_count' must be int, got float"):
        load_model(bad)


def test_the_cli_prints_one_line_and_exits_non_zero_on_a_bad_file(tmp_path: Path) -> None:
    path, _ = make(tmp_path, "llama-gqa-f32", G.Q8_0)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])
    proc = subprocess.run(
        [sys.executable, "-m", "triollm.cli", "generate", str(cut), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "cut.gguf" in proc.stderr and "truncated" in proc.stderr
