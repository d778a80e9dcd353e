"""The forward pass: chunked prefill, logits only where sampled, float32 throughout,
block-table checks, and a random model built without any directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig
from triollm.model.kvstore import STORAGE, KVDtype
from triollm.model.llama import LlamaModel, PagedKVCache, inverse_frequencies
from triollm.model.matmul import PreparedWeight
from triollm.model.weights import Checkpoint, expected_shapes, f32_to_bf16_bits
from triollm.plan import ChunkPlan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_NAMES = sorted(p.name for p in (FIXTURES / "models").iterdir())
PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 400, 60)]


def fixture_model(name: str) -> LlamaModel:
    d = FIXTURES / "models" / name
    with Checkpoint(d) as ck:
        return LlamaModel(ModelConfig.from_dir(d), ck)


def random_config(**over: object) -> ModelConfig:
    d: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 50,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    d.update(over)
    return ModelConfig.from_dict(d, source="<test>")


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        key: (rng.standard_normal(shape) * (0.3 if len(shape) == 2 else 1.0)).astype(np.float32)
        for key, shape in expected_shapes(config).items()
    }


def prefill_in_chunks(model: LlamaModel, ids: list[int], size: int) -> np.ndarray:
    """Feed ids in chunks of `size`; only the last chunk samples. Returns its logits row."""
    kv = PagedKVCache(model.config, num_blocks=8, block_size=16)
    table = (5, 2, 7, 0, 1, 3, 4, 6)  # not in order: positions must follow the table
    out = None
    for start in range(0, len(ids), size):
        part = tuple(ids[start : start + size])
        last = start + size >= len(ids)
        logits = model.forward([ChunkPlan(0, part, start, table, last, True)], kv)
        assert logits.shape == (int(last), model.config.vocab_size)
        out = logits
    assert out is not None
    return out[0]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_chunked_prefill_gives_the_logits_of_one_pass(name: str) -> None:
    model = fixture_model(name)
    whole = prefill_in_chunks(model, PROMPT, len(PROMPT))
    for size in (1, 7):
        got = prefill_in_chunks(model, PROMPT, size)
        # Not bit-equal: BLAS rounds a 1-row product differently from a 60-row one.
        np.testing.assert_allclose(got, whole, rtol=0, atol=2e-5 * np.abs(whole).max())
        assert int(np.argmax(got)) == int(np.argmax(whole))


def test_logits_are_returned_only_for_sampled_rows_in_chunk_order() -> None:
    model = fixture_model("qwen2-bias-f32")
    kv = PagedKVCache(model.config, num_blocks=6, block_size=16)
    chunks = [
        ChunkPlan(1, tuple(PROMPT[:20]), 0, (0, 1), sample=False, prefill=True),
        ChunkPlan(2, tuple(PROMPT[:9]), 0, (2,), sample=True, prefill=True),
        ChunkPlan(3, tuple(PROMPT[:30]), 0, (3, 4), sample=True, prefill=True),
    ]
    logits = model.forward(chunks, kv)
    assert logits.shape == (2, 400) and logits.dtype == np.float32
    alone = PagedKVCache(model.config, num_blocks=6, block_size=16)
    want = model.forward([chunks[2]], alone)
    np.testing.assert_allclose(logits[1], want[0], rtol=0, atol=2e-5 * np.abs(want).max())


def test_every_parameter_buffer_and_output_is_float32() -> None:
    """numpy 2 promotes float32 * np.float64 to float64; one such constant once cost 14x."""
    for name in MODEL_NAMES:
        model = fixture_model(name)
        assert model.eps.dtype == np.float32 and model.scale.dtype == np.float32
        assert model.rope_cos.dtype == np.float32 and model.rope_sin.dtype == np.float32
        assert model.norm.dtype == np.float32
        for layer in model.layers:
            for key, value in vars(layer).items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == np.float32, (name, key)
                elif isinstance(value, PreparedWeight):
                    assert value.in_features > 0
        kv = PagedKVCache(model.config, num_blocks=4, block_size=32)
        logits = model.forward([ChunkPlan(0, tuple(PROMPT[:5]), 0, (0,), True, True)], kv)
        assert logits.dtype == np.float32
        for key, buf in vars(model._scratch).items():
            if isinstance(buf, np.ndarray):
                assert buf.dtype == np.float32, key
        # the cache stores its own element type (16-bit f16 bits by default)
        assert kv.k.dtype == STORAGE[kv.dtype] and kv.v.dtype == STORAGE[kv.dtype]
        f32_kv = PagedKVCache(model.config, num_blocks=4, block_size=32, dtype=KVDtype.F32)
        assert f32_kv.k.dtype == np.float32 and f32_kv.v.dtype == np.float32


def test_inverse_frequencies_are_float32_and_llama3_scales_only_low_frequencies() -> None:
    plain = inverse_frequencies(random_config(rope_theta=500000.0, head_dim=16))
    scaled = inverse_frequencies(
        random_config(
            rope_theta=500000.0,
            head_dim=16,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    )
    assert plain.dtype == scaled.dtype == np.float32
    wavelen = 2 * np.pi / plain
    assert np.array_equal(scaled[wavelen < 16], plain[wavelen < 16])  # high: untouched
    np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)
    middle = (wavelen >= 16) & (wavelen <= 64)
    assert middle.any()
    assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


def test_a_random_model_runs_without_a_directory_in_f32_and_bf16() -> None:
    config = random_config()
    weights = random_weights(config)
    kv = PagedKVCache(config, num_blocks=2, block_size=8)
    chunk = ChunkPlan(0, (1, 2, 3), 0, (1,), True, True)
    f32_logits = LlamaModel(config, weights).forward([chunk], kv)
    bf16 = {k: f32_to_bf16_bits(w) for k, w in weights.items()}
    bf16_logits = LlamaModel(config, bf16).forward([chunk], kv)
    assert bf16_logits.dtype == np.float32
    # bf16 keeps 8 bits of mantissa: close to, not equal to, the f32 model
    assert 0 < np.abs(bf16_logits - f32_logits).max() < 0.05 * np.abs(f32_logits).max()


def test_a_missing_tensor_names_the_key() -> None:
    config = random_config()
    weights = random_weights(config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        LlamaModel(config, weights)


def test_a_mis_shaped_tensor_names_key_and_both_shapes() -> None:
    config = random_config()
    weights = random_weights(config)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(32, 32\).*expected \(16, 32\)"):
        LlamaModel(config, weights)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (ChunkPlan(0, tuple(range(9)), 0, (0,), True, True), "block table has 1"),
        (ChunkPlan(0, (1,), 0, (2,), True, False), "outside the pool"),
        (ChunkPlan(0, (50,), 0, (0,), True, False), "outside the vocabulary"),
        (ChunkPlan(0, (1,), 128, tuple(range(2)) * 9, True, False), "block table|max_position"),
    ],
)
def test_bad_plans_are_refused_before_any_kernel_runs(chunk: ChunkPlan, message: str) -> None:
    config = random_config()
    model = LlamaModel(config, random_weights(config))
    kv = PagedKVCache(config, num_blocks=2, block_size=8)
    with pytest.raises(ValueError, match=message):
        model.forward([chunk], kv)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_weight_bytes_counts_every_buffer_held_once(name: str) -> None:
    model = fixture_model(name)
    embed = model.embed_tokens  # a tied head's panels double as the embedding table
    buffers = [embed.data if isinstance(embed, PreparedWeight) else embed, model.norm]
    buffers.append(model.lm_head.data)
    for layer in model.layers:
        for value in vars(layer).values():
            if isinstance(value, PreparedWeight):
                buffers.append(value.data)
            elif value is not None:
                buffers.append(value)
    unique: list[np.ndarray] = []
    for b in buffers:
        if not any(np.shares_memory(b, u) for u in unique):
            unique.append(b)
    assert model.weight_bytes == sum(b.nbytes for b in unique)


def test_a_tied_head_is_also_the_embedding_table_held_once() -> None:
    # prepare() repacks the head into column panels; a second, checkpoint-layout
    # copy of the same (vocab, hidden) matrix for the embedding lookup would
    # double the largest tensor of a small model. The lookup reads the panels.
    config = random_config()
    weights = random_weights(config)
    model = LlamaModel(config, weights)
    assert model.embed_tokens is model.lm_head
    table = weights["model.embed_tokens.weight"]
    ids = np.array([0, 7, 31, 32, 49])
    np.testing.assert_array_equal(model.lm_head.rows(ids), table[ids])
    untied_config = random_config(tie_word_embeddings=False)
    untied = LlamaModel(untied_config, random_weights(untied_config))
    assert untied.embed_tokens is not untied.lm_head
