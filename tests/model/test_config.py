"""ModelConfig from config.json, and the clear errors for broken model directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from triollm.errors import ModelLoadError, UserError
from triollm.model.config import ModelConfig, RopeScaling
from triollm.model.kvstore import KVDtype, kv_bytes_per_position
from triollm.model.loader import load_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 400,
        "max_position_embeddings": 512,
    }
    d.update(over)
    return d


def test_each_fixture_family_reads_its_switches() -> None:
    llama = ModelConfig.from_dir(FIXTURES / "llama-gqa-f32")
    assert (llama.num_key_value_heads, llama.kv_group_size, llama.head_dim) == (2, 2, 16)
    assert not llama.tie_word_embeddings and llama.eos_token_ids == frozenset({2})
    tied = ModelConfig.from_dir(FIXTURES / "llama-tied-llama3-bf16")  # pre-v5 spelling
    assert tied.tie_word_embeddings and tied.torch_dtype == "bfloat16"
    assert tied.rope_theta == 500000.0
    assert tied.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    qwen2 = ModelConfig.from_dir(FIXTURES / "qwen2-bias-f32")  # transformers 5 spelling
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.rope_theta == 1e6
    assert qwen2.bos_token_id is None
    qwen3 = ModelConfig.from_dir(FIXTURES / "qwen3-headdim-f16")
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // 4
    assert qwen3.eos_token_ids == frozenset({2, 4}) and qwen3.torch_dtype == "float16"
    mistral = ModelConfig.from_dir(FIXTURES / "mistral-window-f32")
    assert mistral.sliding_window == 48 and mistral.num_key_value_heads == 1


def test_defaults_and_derived_fields() -> None:
    c = ModelConfig.from_dict(base(num_key_value_heads=None, head_dim=None, eos_token_id=None))
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.eos_token_ids == frozenset()
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and c.rms_norm_eps == 1e-6
    # the pool's bytes per position follow the cache's element type (kvcache.py owns the
    # rule; the config no longer counts float32 behind the default f16 cache's back)
    assert not hasattr(c, "kv_bytes_per_position")
    # layers x KV heads x (K's 16 values + V's one panel of 32: head_dim 16, padded) x bytes
    assert kv_bytes_per_position(c, KVDtype.F32) == 2 * 4 * (16 + 32) * 4
    assert kv_bytes_per_position(c, KVDtype.F16) == 2 * 4 * (16 + 32) * 2
    wide = ModelConfig.from_dict(base(head_dim=64))  # a multiple of 32: no padding
    assert kv_bytes_per_position(wide, KVDtype.F16) == 2 * 2 * 2 * 64 * 2  # as before panels


def test_linear_rope_scaling_and_the_legacy_type_key() -> None:
    c = ModelConfig.from_dict(base(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize(
    ("over", "pattern"),
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported \(supported: llama"),
        ({"model_type": None}, r"required field 'model_type' is missing"),
        ({"hidden_size": None}, r"required field 'hidden_size' is missing"),
        ({"hidden_size": "64"}, r"field 'hidden_size' must be a positive integer, got '64'"),
        ({"num_hidden_layers": True}, r"'num_hidden_layers' must be a positive integer"),
        ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be a positive integer, got 0"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of"),
        ({"rms_norm_eps": -1}, r"'rms_norm_eps' must be a positive number"),
        ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings' must be true or false"),
        ({"eos_token_id": "</s>"}, r"eos_token_id must be an integer or a list"),
        ({"eos_token_id": [2, None]}, r"eos_token_id must be an integer or a list"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, r"rope_type 'yarn' is not supp"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8}}, r"'low_freq_factor' is missing"),
        ({"head_dim": 7}, r"head_dim must be even"),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
        ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ],
)
def test_bad_fields_name_the_file_and_the_field(over: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ModelLoadError, match=r"^my/config\.json[^:]*: .*" + pattern):
        ModelConfig.from_dict(base(**over), source="my/config.json")


def test_a_non_object_config_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="expected a JSON object, got list"):
        ModelConfig.from_dict([1, 2])


def copy_fixture(tmp_path: Path, name: str = "llama-gqa-f32") -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_load_model_loads_every_fixture_with_its_tokenizer() -> None:
    for d in sorted(FIXTURES.iterdir()):
        loaded = load_model(d)
        assert loaded.model_dir == d and loaded.config == ModelConfig.from_dir(d)
        assert loaded.weight_bytes == loaded.model.weight_bytes > 0
        assert loaded.tokenizer.encode("The river", add_special_tokens=False)


def test_missing_directory_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model(tmp_path)


def test_broken_json_names_the_file(tmp_path: Path) -> None:
    d = copy_fixture(tmp_path)
    (d / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(d)


def test_unsupported_model_type_is_a_user_error(tmp_path: Path) -> None:
    d = copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config\.json: model_type 'falcon' is not supported"):
        load_model(d)


def test_a_config_that_disagrees_with_the_weights_names_tensor_and_shapes(tmp_path: Path) -> None:
    d = copy_fixture(tmp_path, "qwen2-bias-f32")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has "
        r"shape \(128, 64\), expected \(96, 64\)",
    ):
        load_model(d)


def test_more_layers_than_the_checkpoint_holds_names_the_missing_tensor(tmp_path: Path) -> None:
    d = copy_fixture(tmp_path, "mistral-window-f32")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.2\..*' is missing"
    ):
        load_model(d)
