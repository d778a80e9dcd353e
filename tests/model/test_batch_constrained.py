"""Constrained sequences in the real Batch and Scheduler (the offline Engine drives both).

The fixture models are random: left alone they write nonsense, so a valid document is
the mask's doing. The claims: every constrained answer parses and validates, a grammar
that completes ends its sequence with STOP, max_tokens cutting it is LENGTH, an
unconstrained neighbour is unaffected, and a matcher failure, a removal mid-step, a
preemption or a lost sampler state costs nothing but what it must.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triollm.batch import Batch
from triollm.model.constrained import (
    ConstraintTokenizer,
    Grammar,
    GrammarKind,
    GrammarSpec,
    compile_grammar,
)
from triollm.model.loader import LoadedModel, load_model
from triollm.model.sampling import SamplingParams
from triollm.model.tokenizer import Tokenizer
from triollm.offline import Engine, engine_config
from triollm.plan import ChunkPlan, FinishReason, StepPlan
from triollm.policies import Policy
from triollm.scheduler import SchedulerConfig
from triollm.spec import GenerationSpec, SequenceSpec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
DEMO = Path(__file__).resolve().parents[2] / "src" / "triollm" / "demo" / "model"
MODELS = [*sorted(p.name for p in FIXTURES.iterdir()), "demo"]

_cache: dict[str, tuple[LoadedModel, Tokenizer, ConstraintTokenizer]] = {}


def model(name: str) -> tuple[LoadedModel, Tokenizer, ConstraintTokenizer]:
    if name not in _cache:
        path = DEMO if name == "demo" else FIXTURES / name
        loaded = load_model(path)
        tok = Tokenizer.from_dir(path)
        _cache[name] = (
            loaded,
            tok,
            ConstraintTokenizer.from_tokenizer(tok, loaded.config.vocab_size),
        )
    return _cache[name]


def grammar(name: str, schema: object) -> Grammar:
    return compile_grammar(
        GrammarSpec(GrammarKind.JSON_SCHEMA, schema, "response_format"), model(name)[2]
    )


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def run(name: str, requests: list[GenerationSpec], **config: object) -> list:
    loaded, _, _ = model(name)
    cfg = engine_config(loaded, slots=len(requests), context_tokens=256)
    if config:
        cfg = SchedulerConfig(**{**cfg.__dict__, **config})
    return Engine(loaded, cfg).generate_many(requests)


def prompt(name: str, text: str = "Describe a person as JSON:") -> tuple[int, ...]:
    return tuple(model(name)[1].encode(text))


@pytest.mark.parametrize("name", MODELS)
def test_every_model_answers_json_that_validates_and_stops(name: str) -> None:
    g = grammar(name, PERSON)
    params = [SamplingParams(temperature=0.0, grammar=g), SamplingParams(seed=3, grammar=g)]
    eos = model(name)[1].eos_token_ids
    outs = run(name, [GenerationSpec(prompt(name), p, 200, eos) for p in params])
    for out in outs:
        assert out.finish_reason is FinishReason.STOP
        text = model(name)[1].decode(out.token_ids)
        jsonschema.validate(json.loads(text), PERSON)
        assert out.tokens[-1].completes


def test_an_unconstrained_neighbour_gets_the_same_tokens_as_alone() -> None:
    name = "llama-gqa-f32"
    plain = GenerationSpec(prompt(name, "The river"), SamplingParams(seed=5), 24)
    alone = run(name, [plain])[0].token_ids
    shaped = GenerationSpec(
        prompt(name), SamplingParams(seed=1, grammar=grammar(name, PERSON)), 200
    )
    together = run(name, [shaped, plain])[1].token_ids
    assert together == alone


def test_max_tokens_cutting_the_json_short_is_length() -> None:
    name = "qwen2-bias-f32"
    out = run(
        name, [GenerationSpec(prompt(name), SamplingParams(grammar=grammar(name, PERSON)), 5)]
    )[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.tokens) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(model(name)[1].decode(out.token_ids))


def test_a_preempted_constrained_sequence_recomputes_to_the_same_valid_answer() -> None:
    name = "llama-gqa-f32"
    g = grammar(name, PERSON)
    reqs = [
        GenerationSpec(prompt(name, f"Person {i}:"), SamplingParams(temperature=0.0, grammar=g), 40)
        for i in range(3)
    ]
    alone = [run(name, [r])[0].token_ids for r in reqs]
    loaded, _, _ = model(name)
    cfg = SchedulerConfig(
        num_blocks=8, block_size=8, slots=3, context_tokens=64, policy=Policy.PREEMPT
    )
    engine = Engine(loaded, cfg)
    outs = engine.generate_many(reqs)
    assert engine.scheduler.statistics().preemptions_total >= 1
    assert [o.token_ids for o in outs] == alone


def test_a_sequence_re_added_with_its_tokens_continues_where_it_was() -> None:
    name = "qwen3-headdim-f16"
    loaded, _, _ = model(name)
    g = grammar(name, PERSON)
    params = SamplingParams(temperature=0.0, grammar=g)
    whole = run(name, [GenerationSpec(prompt(name), params, 200)])[0].token_ids
    # Lose the Batch's state after 6 tokens: a fresh sequence fed prompt + those tokens
    # as its prompt, its matcher replayed over them, must go on to the same answer.
    head = whole[:6]
    engine = Engine(loaded, engine_config(loaded, slots=1, context_tokens=256))
    seq = engine.scheduler.add(SequenceSpec(prompt(name) + tuple(head), 200 - 6))
    engine.batch.add(seq, GenerationSpec(prompt(name), params), generated=head)
    rest = [t.token_id for t in engine._steps({seq}) if hasattr(t, "token_id")]
    assert head + rest == whole


def _plan(batch_ids: list[tuple[int, tuple[int, ...], tuple[int, ...]]], step: int = 0) -> StepPlan:
    chunks = tuple(
        ChunkPlan(seq, ids, 0, table, sample=True, prefill=True) for seq, ids, table in batch_ids
    )
    return StepPlan(step, chunks)


def test_a_failing_matcher_fails_its_sequence_alone() -> None:
    name = "llama-gqa-f32"
    loaded, tok, _ = model(name)
    batch = Batch(loaded, num_blocks=8, block_size=8)
    g = grammar(name, PERSON)
    batch.add(1, GenerationSpec([5, 6], SamplingParams(grammar=g, seed=0)))
    batch.add(2, GenerationSpec([5, 6], SamplingParams(seed=0)))
    batch.add(3, GenerationSpec([5, 6], SamplingParams(grammar=g, seed=0)))
    batch._matchers[1].ll.consume_token(tok.encode("zz", add_special_tokens=False)[0])  # breaks it
    result = batch.run(_plan([(1, (5, 6), (0,)), (2, (5, 6), (1,)), (3, (5, 6), (2,))]))
    assert [f.seq_id for f in result.failed] == [1]
    assert "grammar" in result.failed[0].message
    assert sorted(t.seq_id for t in result.sampled) == [2, 3]


def test_a_constrained_sequence_removed_during_the_step_does_not_break_it() -> None:
    name = "llama-gqa-f32"
    loaded, _, _ = model(name)
    batch = Batch(loaded, num_blocks=8, block_size=8)
    batch.add(1, GenerationSpec([5, 6], SamplingParams(grammar=grammar(name, PERSON), seed=0)))
    batch.add(2, GenerationSpec([5, 6], SamplingParams(seed=0)))
    forward = batch.model.forward

    def forward_then_cancel(*args: object) -> np.ndarray:
        out = forward(*args)
        batch.remove(1)  # the event loop cancels it while the step computes
        return out

    batch.model.forward = forward_then_cancel  # type: ignore[method-assign]
    try:
        result = batch.run(_plan([(1, (5, 6), (0,)), (2, (5, 6), (1,))]))
    finally:
        batch.model.forward = forward  # type: ignore[method-assign]
    assert sorted(t.seq_id for t in result.sampled) == [1, 2] and not result.failed
    assert 1 not in batch and 2 in batch


def test_unconstrained_steps_never_start_the_mask_machinery() -> None:
    loaded, _, _ = model("llama-gqa-f32")
    batch = Batch(loaded, num_blocks=8, block_size=8)
    batch.add(1, GenerationSpec([5, 6], SamplingParams(seed=0)))
    batch.run(_plan([(1, (5, 6), (0,))]))
    assert batch._masks is None and batch._mask_thread is None


# Hypothesis draws the schemas: objects of bounded strings, bounded numbers, enums,
# booleans, arrays and nested objects, each property required or optional.
def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
        ),
        st.tuples(st.integers(-5, 5), st.integers(1, 10)).map(
            lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}
        ),
        st.lists(
            st.sampled_from(["a", "b", 1, 2.5, True, None]), min_size=1, max_size=3, unique=True
        ).map(lambda e: {"enum": e}),
        st.just({"type": "boolean"}),
    )


def _schema(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.sampled_from(["a", "b", "cc", "d_d", "e"])
    obj = st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {
                "type": "object",
                "properties": props,
                "required": req,
                "additionalProperties": False,
            }
        )
    )
    arr = children.map(lambda c: {"type": "array", "items": c, "maxItems": 2})
    return st.one_of(obj, arr)


SCHEMAS = st.recursive(_leaf(), _schema, max_leaves=5).filter(
    lambda s: "properties" in s or "items" in s
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schema=SCHEMAS, seed=st.integers(0, 2**16), which=st.sampled_from(["qwen2-bias-f32", "demo"])
)
def test_any_generated_schema_gives_output_that_validates(
    schema: dict, seed: int, which: str
) -> None:
    g = grammar(which, schema)
    tok = model(which)[1]
    out = run(
        which,
        [
            GenerationSpec(
                prompt(which), SamplingParams(seed=seed, grammar=g), 200, tok.eos_token_ids
            )
        ],
    )[0]
    text = tok.decode(out.token_ids)
    assert out.finish_reason is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), schema)


def test_a_complete_grammar_ends_the_sequence_even_without_stop_ids() -> None:
    name = "mistral-window-f32"
    g = grammar(name, PERSON)
    out = run(name, [GenerationSpec(prompt(name), SamplingParams(seed=2, grammar=g), 200)])[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.tokens[-1].completes and not any(t.completes for t in out.tokens[:-1])
    assert not set(out.token_ids) & model(name)[1].eos_token_ids  # it ended on the JSON's end
    jsonschema.validate(json.loads(model(name)[1].decode(out.token_ids)), PERSON)
