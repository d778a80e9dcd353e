"""The memory arithmetic (sizing.py), one rule per test, on plain integers."""

from __future__ import annotations

import pytest

from triollm.errors import FieldError
from triollm.policies import Policy
from triollm.scheduler import SchedulerConfig
from triollm.sizing import DEFAULT_KV_MEMORY_BYTES, Capacity, MemoryReport, resolve_context

PER_POSITION = 1024  # bytes of K/V per position


def test_the_default_context_is_the_models_own() -> None:
    # A 4096 cap refused every max_tokens-4096 request (Continue's) on a 32768 model.
    assert resolve_context(2048, None) == 2048
    assert resolve_context(131072, None) == 131072


def test_the_default_pool_of_a_long_context_is_held_to_the_default_budget() -> None:
    per_position = 28 * 1024  # Qwen2.5-1.5B's f16 K/V
    cfg = Capacity(slots=4, block_size=32).resolve(32768, per_position)
    assert cfg.context_tokens == 32768
    assert cfg.num_blocks == DEFAULT_KV_MEMORY_BYTES // (per_position * 32)
    assert cfg.largest_request == 32768  # one whole context still fits
    report = MemoryReport(0, per_position, cfg).describe()
    assert "whole contexts, not 4 (slots)" in report and "--kv-memory" in report
    asked = Capacity(slots=4, block_size=32, context_tokens=32768).resolve(32768, per_position)
    assert asked.num_blocks == 4 * 1024  # --context asked: every slot's whole context


@pytest.mark.parametrize("context", [0, 1, -5])
def test_a_context_below_two_positions_is_refused_by_name(context: int) -> None:
    with pytest.raises(FieldError, match="context_tokens must be >= 2") as info:
        resolve_context(2048, context)
    assert info.value.field == "context_tokens"


def test_a_context_past_the_models_limit_is_refused_by_name() -> None:
    with pytest.raises(FieldError, match="max_position_embeddings") as info:
        Capacity(context_tokens=4096).resolve(2048, PER_POSITION)
    assert info.value.field == "context_tokens"


def test_the_default_pool_holds_every_slots_whole_context() -> None:
    # 100 positions in blocks of 16 is 7 blocks a sequence, not ceil(300 / 16) = 19.
    cfg = Capacity(slots=3, block_size=16, context_tokens=100).resolve(2048, PER_POSITION)
    assert cfg.num_blocks == 3 * 7 and cfg.largest_request == 100


def test_a_memory_budget_sets_the_pool_and_can_make_it_smaller_than_a_context() -> None:
    cfg = Capacity(block_size=16, kv_memory_bytes=10 * 16 * PER_POSITION).resolve(
        2048, PER_POSITION
    )
    assert cfg.num_blocks == 10 and cfg.largest_request == 160  # < the context of 2048
    with pytest.raises(FieldError, match="holds no block") as info:
        Capacity(kv_memory_bytes=100).resolve(2048, PER_POSITION)
    assert info.value.field == "kv_memory_bytes"


def test_unset_knobs_take_the_scheduler_configs_defaults() -> None:
    cfg = Capacity(num_blocks=8).resolve(2048, PER_POSITION)
    # The one knob whose serving default differs from the bare SchedulerConfig's: the
    # server shares cached prompt blocks (docs/prefix-cache.md); the pure core does not.
    default = SchedulerConfig(num_blocks=8, context_tokens=2048, prefix_cache=True)
    assert cfg == default
    assert cfg.step_rows == cfg.chunk_tokens + cfg.slots  # a full chunk plus every decoder
    asked = Capacity(num_blocks=8, chunk_tokens=512, policy=Policy.PREEMPT).resolve(2048, 1)
    assert (asked.chunk_tokens, asked.step_rows, asked.policy) == (512, 516, Policy.PREEMPT)


def test_the_report_shows_the_arithmetic() -> None:
    cfg = Capacity(slots=2, block_size=16, context_tokens=128, num_blocks=4).resolve(2048, 1024)
    text = MemoryReport(weight_bytes=2**20, kv_bytes_per_position=1024, scheduler=cfg).describe()
    assert "pool: 4 blocks x 16 positions = 64 positions = 0.1 MiB" in text
    assert "prompt + max_tokens <= 64 positions" in text
