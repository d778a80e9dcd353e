"""Reading safetensors: f32/f16/bf16, sharded indexes, and the errors that name files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig
from triollm.model.weights import (
    Checkpoint,
    bf16_bits_to_f32,
    expected_shapes,
    f32_to_bf16_bits,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"


def test_bf16_widening_is_exact_on_known_bit_patterns() -> None:
    bits = np.array([0x3F80, 0xBF80, 0x4049, 0x0000, 0x8000, 0x7F80, 0x0001], np.uint16)
    got = bf16_bits_to_f32(bits)
    assert got.dtype == np.float32
    want = np.array([1.0, -1.0, 3.140625, 0.0, -0.0, np.inf, 2.0**-133], np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[4])
    with pytest.raises(TypeError, match="uint16"):
        bf16_bits_to_f32(got)


def test_bf16_rounding_is_nearest_even_and_round_trips() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-7, -2.5], np.float32)
    back = bf16_bits_to_f32(f32_to_bf16_bits(x))
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    np.testing.assert_array_equal(back, [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5])
    rng = np.random.default_rng(0)
    r = rng.standard_normal(1000).astype(np.float32)
    assert np.abs(bf16_bits_to_f32(f32_to_bf16_bits(r)) - r).max() <= np.abs(r).max() * 2**-8


def test_bf16_checkpoint_reads_raw_bits_that_widen_to_the_stored_values() -> None:
    d = FIXTURES / "llama-tied-llama3-bf16"
    with Checkpoint(d) as ck:
        assert ck.dtype("model.norm.weight") == "BF16"
        bits = ck.get_tensor("model.embed_tokens.weight")
        assert bits.dtype == np.uint16 and bits.shape == (400, 64)
        widened = bf16_bits_to_f32(bits)
        # every widened value is exactly representable in bf16: the low 16 bits are zero
        assert not (widened.view(np.uint32) & 0xFFFF).any()
        assert 0.5 < widened.std() < 2.0  # fixtures draw embeddings with std 1


def test_f16_and_f32_checkpoints_keep_their_dtype() -> None:
    with Checkpoint(FIXTURES / "qwen3-headdim-f16") as ck:
        assert ck.get_tensor("model.norm.weight").dtype == np.float16
    with Checkpoint(FIXTURES / "qwen2-bias-f32") as ck:
        assert ck.get_tensor("model.layers.0.self_attn.q_proj.bias").dtype == np.float32


def test_a_sharded_checkpoint_finds_each_tensor_in_its_shard() -> None:
    d = FIXTURES / "llama-gqa-f32"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    config = ModelConfig.from_dir(d)
    with Checkpoint(d) as ck:
        assert set(expected_shapes(config)) <= set(ck.keys())
        for key, shape in expected_shapes(config).items():
            assert ck.shape(key) == shape
            assert ck.where(key) == str(d / index[key])
        assert ck.nbytes() == sum(4 * int(np.prod(s)) for s in expected_shapes(config).values())


def test_no_weights_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no weights found \(expected model\.safetensors"):
        Checkpoint(tmp_path)


def test_a_broken_index_and_a_missing_shard_are_named(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama-gqa-f32", d)
    index = d / "model.safetensors.index.json"
    good = index.read_text()
    index.write_text("{")
    with pytest.raises(ModelLoadError, match=r"index\.json: not valid JSON"):
        Checkpoint(d)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelLoadError, match=r"index\.json: field 'weight_map'"):
        Checkpoint(d)
    index.write_text(good)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=rf"names .*{shard.name}: file not found"):
        Checkpoint(d)


def test_a_corrupt_safetensors_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors"):
        Checkpoint(tmp_path)


def test_a_missing_key_and_an_unsupported_dtype_are_named(tmp_path: Path) -> None:
    save_file(
        {"a": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.int32)},
        str(tmp_path / "model.safetensors"),
    )
    with Checkpoint(tmp_path) as ck:
        assert ck.get_tensor("a").shape == (2, 2)
        with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'c' is missing"):
            ck.get_tensor("c")
        with pytest.raises(ModelLoadError, match=r"tensor 'b' has dtype I32; supported"):
            ck.get_tensor("b")


def test_loading_holds_one_raw_tensor_at_a_time(tmp_path: Path) -> None:
    """Peak traced memory while building the model stays near the prepared model's
    size: each raw tensor is prepared and dropped before the next is read."""
    import tracemalloc

    from triollm.model.llama import LlamaModel

    config = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "vocab_size": 512,
            "max_position_embeddings": 64,
        }
    )
    rng = np.random.default_rng(0)
    shapes = expected_shapes(config)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    total = sum(t.nbytes for t in tensors.values())
    largest = max(t.nbytes for t in tensors.values())
    del tensors

    def peak_while_building(hold_everything: bool) -> tuple[int, int]:
        tracemalloc.start()
        try:
            with Checkpoint(tmp_path) as ck:
                if hold_everything:  # the mistake guarded against: read all, then prepare
                    raw = {k: ck.get_tensor(k) for k in shapes}
                    model = LlamaModel(config, lambda k: raw[k].copy())
                else:
                    model = LlamaModel(config, ck)
                _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak, model.weight_bytes

    peak, weight_bytes = peak_while_building(hold_everything=False)
    assert weight_bytes >= total
    # the model itself plus the raw copy of about one tensor, not of the model
    assert peak < weight_bytes + 2 * largest, (peak, weight_bytes, largest)
    # and the bound is tight enough to catch a loader that reads everything first
    wasteful_peak, _ = peak_while_building(hold_everything=True)
    assert wasteful_peak > weight_bytes + 2 * largest
