"""The engine benchmark's pieces work on a tiny model (the full run is `just bench-engine`).

The benchmark's figures are only as good as its plans and its byte counts, so
these check that its ragged decode plans and its prefill plan run through the
real forward pass, that it counts the bytes a decode step reads correctly, and
that its profiler leaves the engine as it found it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from triollm.model import attention, kernels, llama, matmul
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_engine.py"

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(TINY, source="tiny test config")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_decode_plans_are_ragged_and_run_through_the_paged_forward(
    bench: ModuleType, config: ModelConfig, dtype: str
) -> None:
    model = LlamaModel(config, bench.random_weights(config, dtype))
    chunks, n_blocks = bench.decode_plan(5, 40)
    starts = [ch.start for ch in chunks]
    assert len(set(starts)) == 5  # every sequence at its own position
    blocks = [b for ch in chunks for b in ch.block_table]
    assert len(blocks) == len(set(blocks)) == n_blocks  # no block shared
    logits = model.forward(chunks, PagedKVCache(config, n_blocks, bench.BLOCK_SIZE))
    assert logits.shape == (5, 300) and logits.dtype == np.float32
    assert np.isfinite(logits).all()


def test_prefill_plan_samples_one_row(bench: ModuleType, config: ModelConfig) -> None:
    model = LlamaModel(config, bench.random_weights(config, "f32"))
    chunks, n_blocks = bench.prefill_plan(70)
    assert chunks[0].n_rows == 70 and n_blocks == 3
    logits = model.forward(chunks, PagedKVCache(config, n_blocks, bench.BLOCK_SIZE))
    assert logits.shape == (1, 300)


def test_decode_weight_bytes_counts_projections_and_head(
    bench: ModuleType, config: ModelConfig
) -> None:
    per_layer = 64 * 64 * 2 + 32 * 64 * 2 + 96 * 64 * 3  # q, o; k, v; gate, up, down
    # two layers + the (tied) head, its 300 columns padded to 10 panels of 32
    weights = 2 * per_layer + 320 * 64
    f32 = LlamaModel(config, bench.random_weights(config, "f32"))
    bf16 = LlamaModel(config, bench.random_weights(config, "bf16"))
    assert bench.decode_weight_bytes(f32) == 4 * weights
    assert bench.decode_weight_bytes(bf16) == 2 * weights
    assert bf16.lm_head.storage == "bfloat16"


def test_profile_splits_the_step_and_restores_the_engine(
    bench: ModuleType, config: ModelConfig
) -> None:
    model = LlamaModel(config, bench.random_weights(config, "f32"))
    chunks, n_blocks = bench.decode_plan(3, 40)
    kv = PagedKVCache(config, n_blocks, bench.BLOCK_SIZE)
    stages = bench.profile_case(model, chunks, kv, reps=2)
    assert stages["weight products (matmul.linear)"] > 0
    assert stages["attention (kernels.paged_attention)"] > 0
    timed = [v for k, v in stages.items() if k != "step" and not k.startswith("rest")]
    assert all(v >= 0 for v in timed) and sum(timed) <= stages["step"]
    # the timing wrappers are gone: the engine calls the real functions again
    assert llama.linear is matmul.linear
    assert kernels.paged_attention is attention.paged_attention  # a Python driver of numba kernels


def test_the_stage_profile_books_each_product_under_its_kind_with_its_bytes(
    bench: ModuleType, config: ModelConfig
) -> None:
    model = LlamaModel(config, bench.random_weights(config, "f32"))
    chunks, n_blocks = bench.decode_plan(1, 40)
    kv = PagedKVCache(config, n_blocks, bench.BLOCK_SIZE)
    stages = bench.profile_stages(model, chunks, kv, reps=3)
    layers = config.num_hidden_layers
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        wall, cpu, calls, nbytes = stages["product " + kind]
        assert calls == layers  # one product of each kind per layer per step
        assert nbytes == sum(getattr(layer, kind).nbytes for layer in model.layers)
        assert wall > 0 and cpu >= 0
    assert stages["product lm_head"][2:] == (1, model.lm_head.nbytes)  # one sampled row
    assert "product other" not in stages  # every product the forward runs is classified
    assert stages["SwiGLU (kernels.silu_mul)"][2] == layers  # the model's bound activation
    assert model._activation is kernels.silu_mul  # given back
    timed = [v[0] for k, v in stages.items() if k != "step" and not k.startswith("rest")]
    assert sum(timed) <= stages["step"][0]
    assert llama.linear is matmul.linear  # unwrapped again


def test_time_steps_reports_wall_and_cpu_per_step(bench: ModuleType, config: ModelConfig) -> None:
    model = LlamaModel(config, bench.random_weights(config, "f32"))
    chunks, n_blocks = bench.decode_plan(2, 40)
    wall, cpu, sleeps = bench.time_steps(
        model, chunks, PagedKVCache(config, n_blocks, bench.BLOCK_SIZE), reps=3
    )
    assert len(wall) == len(cpu) == 3
    assert all(t > 0 for t in wall)
    assert sleeps >= 0  # a count per step (Linux); the worker's sleeps, if any


def test_a_serial_threshold_sweep_alternates_the_values_and_restores_the_setting(
    bench: ModuleType, config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --serial-max-bytes 0,rule,N: each round times every value, every other round
    # in reverse (a load that drifts favours none); the process's setting comes back
    from triollm.model import threads

    model = LlamaModel(config, bench.random_weights(config, "f32"))
    chunks, n_blocks = bench.decode_plan(1, 40)
    kv = PagedKVCache(config, n_blocks, bench.BLOCK_SIZE)
    seen: list[int | None] = []
    real = bench.time_steps

    def spy(*args: object) -> object:
        seen.append(threads.SERIAL_MAX_BYTES)
        return real(*args, warmup=0)

    monkeypatch.setattr(bench, "time_steps", spy)
    before = threads.SERIAL_MAX_BYTES
    swept = bench.sweep_serial(model, chunks, kv, 2, [0, None, 1 << 30], 3)
    assert seen == [0, None, 1 << 30, 1 << 30, None, 0, 0, None, 1 << 30]
    assert before == threads.SERIAL_MAX_BYTES  # restored
    assert [len(runs) for runs in swept.values()] == [3, 3, 3]
