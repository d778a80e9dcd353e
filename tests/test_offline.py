"""The offline Engine drives the real Scheduler and Batch: it reproduces transformers'
greedy continuations, and a prompt gets the same tokens alone or batched with others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triollm.model.kvstore import KVDtype
from triollm.model.loader import LoadedModel, load_model
from triollm.model.sampling import SamplingParams
from triollm.offline import Engine, engine_config
from triollm.plan import FinishReason
from triollm.scheduler import Infeasible, SchedulerConfig
from triollm.spec import GenerationSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = sorted(p.stem for p in (FIXTURES / "reference").glob("*.json"))
GREEDY = SamplingParams(temperature=0.0)


def reference(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "reference" / f"{name}.json").read_text()))


@pytest.fixture(scope="module")
def llama() -> LoadedModel:
    return load_model(FIXTURES / "models" / "llama-gqa-f32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [p["prompt_ids"] for p in reference("llama-gqa-f32")["prompts"]]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_equals_transformers(name: str) -> None:
    loaded = load_model(FIXTURES / "models" / name)
    # the f32 KV cache: token-exact against transformers is a claim about the arithmetic
    engine = Engine(loaded, engine_config(loaded, kv_dtype=KVDtype.F32), KVDtype.F32)
    for p in reference(name)["prompts"]:
        gen = engine.generate(p["prompt_ids"], GREEDY, max_tokens=len(p["greedy_ids"]))
        assert [t.token_id for t in gen] == p["greedy_ids"]
        assert gen.finish_reason is FinishReason.LENGTH


def test_batched_greedy_equals_each_prompt_alone(llama: LoadedModel, prompts: Any) -> None:
    engine = Engine(llama, engine_config(llama, slots=4))
    alone = [[t.token_id for t in engine.generate(p, GREEDY, max_tokens=20)] for p in prompts]
    together = engine.generate_many([GenerationSpec(tuple(p), GREEDY, 20) for p in prompts])
    assert [c.token_ids for c in together] == alone


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(
    llama: LoadedModel, prompts: Any
) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    engine = Engine(llama, engine_config(llama, slots=3))
    alone = [t.token_id for t in engine.generate(prompts[0], params, max_tokens=24)]
    neighbours = [
        GenerationSpec(tuple(prompts[1]), SamplingParams(seed=7), 30),
        GenerationSpec(tuple(prompts[0]), params, 24),
        GenerationSpec(tuple(prompts[2]), SamplingParams(temperature=0.5, seed=9), 10),
    ]
    batched = engine.generate_many(neighbours)[1].token_ids
    assert batched == alone
    other_seed = engine.generate(prompts[0], SamplingParams(top_p=0.9, seed=43), max_tokens=24)
    assert [t.token_id for t in other_seed] != alone


@pytest.mark.parametrize("name", ["llama-gqa-f32", "qwen3-headdim-f16"])
def test_small_chunks_and_a_tight_row_budget_still_give_the_reference(name: str) -> None:
    # The long prompt is prefilled 7 tokens at a time while the short ones decode beside
    # it, within 12 rows per step: every step is a ragged mix of chunks and decode rows.
    loaded = load_model(FIXTURES / "models" / name)
    config = SchedulerConfig(
        num_blocks=3 * 16, block_size=32, slots=3, chunk_tokens=7, step_rows=12,
        context_tokens=512,
    )  # fmt: skip
    engine = Engine(loaded, config)
    ref = reference(name)["prompts"]
    out = engine.generate_many(
        [GenerationSpec(tuple(p["prompt_ids"]), GREEDY, len(p["greedy_ids"])) for p in ref]
    )
    assert [c.token_ids for c in out] == [p["greedy_ids"] for p in ref]
    assert max(len(p["prompt_ids"]) for p in ref) > 150


def test_more_prompts_than_slots_all_complete_in_order(llama: LoadedModel, prompts: Any) -> None:
    engine = Engine(llama, engine_config(llama, slots=2))
    reqs = [GenerationSpec(tuple(p), GREEDY, 12) for p in prompts + prompts[:1]]
    out = engine.generate_many(reqs)
    assert [len(c.token_ids) for c in out] == [12] * 4
    assert out[0].token_ids == out[3].token_ids
    stats = engine.scheduler.statistics()
    assert stats.running == 0 and stats.blocks_free == stats.blocks_total


def test_a_stop_token_ends_the_sequence_with_stop(llama: LoadedModel, prompts: Any) -> None:
    ref = reference("llama-gqa-f32")["prompts"][1]["greedy_ids"]
    stop = ref[5]
    first = ref.index(stop)
    engine = Engine(llama, engine_config(llama))
    gen = engine.generate(prompts[1], GREEDY, max_tokens=32, stop_token_ids={stop})
    assert [t.token_id for t in gen] == ref[: first + 1]
    assert gen.finish_reason is FinishReason.STOP


def test_closing_a_generation_early_gives_its_blocks_back(llama: LoadedModel, prompts: Any) -> None:
    engine = Engine(llama, engine_config(llama))
    with engine.generate(prompts[0], GREEDY, max_tokens=32) as gen:
        for i, _ in enumerate(gen):
            if i == 2:
                break
        assert engine.scheduler.statistics().blocks_held > 0
    assert gen.finish_reason is FinishReason.STOP
    stats = engine.scheduler.statistics()
    assert stats.blocks_held == 0 and stats.running == 0
    assert len(engine.batch) == 0
    # The engine is still usable afterwards.
    assert len(list(engine.generate(prompts[0], GREEDY, max_tokens=3))) == 3


def test_logprobs_come_through_the_batch(llama: LoadedModel, prompts: Any) -> None:
    engine = Engine(llama, engine_config(llama))
    tokens = list(engine.generate(prompts[0], SamplingParams(temperature=0, logprobs=3), 4))
    for t in tokens:
        assert t.logprob is not None and len(t.top_logprobs) == 3
        assert t.top_logprobs[0][0] == t.token_id  # greedy picks the most likely


def test_a_request_that_can_never_fit_is_refused_before_it_queues(
    llama: LoadedModel, prompts: Any
) -> None:
    engine = Engine(llama, engine_config(llama, context_tokens=64))
    with pytest.raises(Infeasible) as exc:
        engine.generate(prompts[0], GREEDY, max_tokens=100)
    assert exc.value.field == "max_tokens"
    assert engine.scheduler.statistics().waiting == 0


def test_engine_config_holds_every_slot_at_full_context(llama: LoadedModel) -> None:
    config = engine_config(llama, slots=3, context_tokens=100, block_size=16)
    assert config.num_blocks == 3 * 7 and config.context_tokens == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine_config(llama, context_tokens=llama.config.max_position_embeddings + 1)
