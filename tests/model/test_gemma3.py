"""Gemma 3 (model/gemma.py): the config, the GGUF path, and the sliding window's blocks.

The token-for-token proofs against transformers on the HF fixture directories
(gemma3-window-f32: a sliding and a full layer, window 16 under a 290-token prompt,
query_pre_attn_scalar 24, final logits soft-capped at 30; gemma3-bf16: four layers,
every third full) run in test_conformance.py with the other families.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_files import read_checkpoint, write_gguf
from test_conformance import generate_greedy, reference

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig
from triollm.model.loader import load_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"


def gemma_config(**kw: object) -> dict:
    d = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 64,
        "vocab_size": 100,
        "sliding_window": 8,
    }
    return d | kw


def test_the_hub_spelling_and_the_transformers_5_spelling_read_alike() -> None:
    hub = ModelConfig.from_dict(
        gemma_config(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3)
    )
    v5 = ModelConfig.from_dict(
        gemma_config(
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    )
    assert hub == v5
    assert hub.gemma is not None
    assert hub.gemma.layer_sliding == (True, True, False, True, True, False)
    assert (hub.rope_theta, hub.gemma.local_rope_theta) == (1e6, 1e4)
    assert hub.gemma.query_pre_attn_scalar == 256  # transformers' default
    assert hub.qk_norm and hub.sliding_window is None  # the window is per layer


def test_the_default_pattern_is_every_sixth_layer_full() -> None:
    c = ModelConfig.from_dict(gemma_config(num_hidden_layers=12))
    assert c.gemma is not None
    assert [i for i, s in enumerate(c.gemma.layer_sliding) if not s] == [5, 11]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"final_logit_softcapping": -1}, "final_logit_softcapping"),
    ],
)
def test_a_bad_gemma_config_is_refused_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(gemma_config(**change))


def test_a_gemma3_gguf_gives_transformers_greedy_ids_and_logits(tmp_path: Path) -> None:
    # norms written as 1 + w (the converter's way) and taken back; window, per-layer
    # pattern and local RoPE base from the file's metadata
    name = "gemma3-bf16"
    config, tensors = read_checkpoint(FIXTURES / name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, config, tensors, FIXTURES / name, __import__("gguf").GGMLQuantizationType.F32)
    model = load_model(path)
    hf = ModelConfig.from_dir(FIXTURES / name)
    assert model.config.gemma == hf.gemma
    summary, arrays = reference(name)
    for i, prompt in enumerate(summary["prompts"]):
        tokens, logits = generate_greedy(model, prompt["prompt_ids"], 8)
        assert tokens == prompt["greedy_ids"][:8], f"prompt {i}"
        want = arrays[f"first_{i}"]
        assert np.abs(logits[0] - want).max() / np.abs(want).max() < 1e-4


def test_a_sliding_layer_never_reads_a_position_that_left_its_window() -> None:
    # The engine keeps the blocks (one block table serves every layer, and the full
    # layers read every position) and masks: a sliding layer's attention reads only
    # p - W + 1 .. p. Proof: garbage in layer 0's (sliding) K/V outside the window
    # changes no bit of the next step; the same garbage in layer 1's (full) does.
    from fixture_models import loaded

    from triollm.batch import Batch
    from triollm.plan import ChunkPlan

    model = loaded("gemma3-window-f32")
    g = model.config.gemma
    assert g is not None and g.layer_sliding == (True, False)
    prompt = reference("gemma3-window-f32")[0]["prompts"][2]["prompt_ids"]  # 290 tokens
    block = 16
    table = tuple(range(-(-(len(prompt) + 1) // block)))

    def next_logits(poison_layer: int | None) -> np.ndarray:
        batch = Batch(model, num_blocks=len(table), block_size=block)
        pre = ChunkPlan(0, tuple(prompt), 0, table, sample=True, prefill=True)
        token = int(np.argmax(model.model.forward([pre], batch.kv)[0]))
        p = len(prompt)  # the decode row's position; its window starts at p - W + 1
        if poison_layer is not None:
            for pos in range(p - g.sliding_window + 1):
                b, o = table[pos // block], pos % block
                k_at, v_at = batch.kv.position(poison_layer, b, o)  # views into the pool
                k_at[...] = 1e4
                v_at[...] = -1e4
        step = ChunkPlan(0, (token,), p, table, sample=True, prefill=False)
        return model.model.forward([step], batch.kv)[0]

    clean = next_logits(None)
    assert next_logits(0).tobytes() == clean.tobytes()
    assert not np.allclose(next_logits(1), clean)
