"""Constrained decoding: compiling grammars, filling and applying masks, advancing matchers.

The logits here are random (a seeded generator stands in for the model), which is the
hard case: nothing but the mask keeps the answer inside the grammar. Every sampler
setting is exercised, because the mask must hold whatever the sampler does after it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from triollm.model.constrained import (
    ConstraintTokenizer,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    MaskFiller,
    MatcherFailed,
    compile_grammar,
)
from triollm.model.sampling import SamplingParams, SequenceSampler
from triollm.model.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "src" / "triollm" / "demo" / "model"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen2-bias-f32"

_tok: dict[Path, tuple[Tokenizer, ConstraintTokenizer]] = {}


def tokenizers(path: Path = DEMO) -> tuple[Tokenizer, ConstraintTokenizer]:
    if path not in _tok:
        tok = Tokenizer.from_dir(path)
        _tok[path] = (tok, ConstraintTokenizer.from_tokenizer(tok))
    return _tok[path]


def generate(
    spec: GrammarSpec,
    params: SamplingParams,
    *,
    seed: int = 0,
    max_tokens: int = 300,
    path: Path = DEMO,
) -> tuple[str, bool]:
    """Decode under ``spec`` from random logits; (text, whether the grammar completed)."""
    tok, ctok = tokenizers(path)
    grammar = compile_grammar(spec, ctok)
    matcher = grammar.start()
    sampler = SequenceSampler(params)
    filler = MaskFiller(ctok.vocab_size)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = rng.normal(0, 3, ctok.vocab_size).astype(np.float32)
        filler.fill([matcher])
        matcher.check()
        filler.apply(0, logits)
        token = sampler.sample(logits).token_id
        out.append(token)
        if matcher.advance(token):
            return tok.decode(out), True
    return tok.decode(out), False


SAMPLERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=1.5, top_k=5, seed=2),
    SamplingParams(temperature=0.8, top_p=0.5, seed=3),
    SamplingParams(temperature=1.0, min_p=0.2, seed=4),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=1.0, seed=5),
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("params", SAMPLERS, ids=lambda p: repr(p)[14:60])
def test_every_sampler_gives_json_that_validates_against_the_schema(
    params: SamplingParams,
) -> None:
    text, done = generate(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON, "response_format"), params)
    assert done, text
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_gives_an_object_on_the_fixture_vocabulary_too() -> None:
    spec = GrammarSpec(
        GrammarKind.JSON_SCHEMA,
        {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "response_format",
    )
    text, done = generate(spec, SamplingParams(seed=7), path=FIXTURE)
    assert done and isinstance(json.loads(text), dict), text


def test_json_is_spelled_with_pythons_separators_and_no_free_whitespace() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1]}, "b": {"enum": [2]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    text, done = generate(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, "f"), SamplingParams())
    assert done and text == '{"a": 1, "b": 2}'


def test_a_regex_constrains_the_whole_answer() -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    text, done = generate(GrammarSpec(GrammarKind.REGEX, pattern, "guided_regex"), SamplingParams())
    assert done and re.fullmatch(pattern, text), text


def test_a_choice_answers_with_exactly_one_of_the_choices() -> None:
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        text, done = generate(
            GrammarSpec(GrammarKind.CHOICE, choices, "guided_choice"), SamplingParams(seed=seed)
        )
        assert done and text in choices


def test_a_lark_grammar_constrains_the_answer() -> None:
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    text, done = generate(
        GrammarSpec(GrammarKind.LARK, lark, "guided_grammar"), SamplingParams(seed=3)
    )
    assert done and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_a_llama_cpp_gbnf_grammar_is_accepted_too() -> None:
    gbnf = 'root ::= "on" | "off"'
    text, done = generate(GrammarSpec(GrammarKind.LARK, gbnf, "guided_grammar"), SamplingParams())
    assert done and text in ("on", "off")


@pytest.mark.parametrize(
    ("kind", "source", "needle"),
    [
        (GrammarKind.JSON_SCHEMA, {"type": "object", "if": {"type": "object"}}, "if"),
        (GrammarKind.REGEX, "a(", "unclosed group"),
        (GrammarKind.LARK, "start: nowhere", "unknown name"),
        (GrammarKind.JSON_SCHEMA, "not a schema", "valid"),
    ],
)
def test_a_grammar_the_library_refuses_is_a_grammar_error_naming_the_field(
    kind: GrammarKind, source: object, needle: str
) -> None:
    _, ctok = tokenizers()
    with pytest.raises(GrammarError) as info:
        compile_grammar(GrammarSpec(kind, source, "response_format.json_schema"), ctok)
    assert info.value.field == "response_format.json_schema"
    assert needle in str(info.value) and "response_format.json_schema" in str(info.value)


def test_the_mask_forbids_exactly_what_the_grammar_forbids() -> None:
    tok, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.CHOICE, ["yes", "no"], "c"), ctok)
    filler = MaskFiller(ctok.vocab_size)
    filler.fill([grammar.start()])
    allowed = set(np.flatnonzero(filler.allowed(0)).tolist())
    # Every allowed token starts one of the choices; every token that does is allowed.
    starts = {
        t
        for t in range(tok.vocab_size)
        if (s := tok.decode([t])) and any(c.startswith(s) for c in ("yes", "no"))
    }
    assert allowed == starts
    logits = np.zeros(ctok.vocab_size, np.float32)
    filler.apply(0, logits)
    assert set(np.flatnonzero(np.isfinite(logits)).tolist()) == allowed


def test_a_parallel_fill_writes_the_same_masks_as_one_at_a_time() -> None:
    tok, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON, "f"), ctok)
    prefixes = ['{"name": "a', '{"name": "', '{"name": "b", "age": 1', "", '{"name": "", "age']
    matchers = []
    for p in prefixes:
        m = grammar.start()
        m.replay(tok.encode(p, add_special_tokens=False))
        matchers.append(m)
    together = MaskFiller(ctok.vocab_size, parallel_min_rows=2)  # the executor's path
    together.fill(matchers)
    for i, m in enumerate(matchers):
        alone = MaskFiller(ctok.vocab_size)
        alone.fill([m])
        assert np.array_equal(together.allowed(i), alone.allowed(0)), prefixes[i]


def test_a_replayed_matcher_is_where_the_stepwise_one_is() -> None:
    tok, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON, "f"), ctok)
    ids = tok.encode('{"name": "ab", "age": 4', add_special_tokens=False)
    stepwise, replayed = grammar.start(), grammar.start()
    for t in ids:
        assert not stepwise.advance(t)
    replayed.replay(ids[:3])
    replayed.replay(ids)  # a second replay starts over, it does not consume twice
    a, b = MaskFiller(ctok.vocab_size), MaskFiller(ctok.vocab_size)
    a.fill([stepwise])
    b.fill([replayed])
    assert np.array_equal(a.allowed(0), b.allowed(0))
    assert replayed.n_consumed == stepwise.n_consumed == len(ids)


def test_a_token_the_grammar_forbids_fails_that_matcher_only() -> None:
    tok, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.CHOICE, ["yes"], "c"), ctok)
    bad, good = grammar.start(), grammar.start()
    with pytest.raises(MatcherFailed):
        bad.advance(tok.encode("no", add_special_tokens=False)[0])
    with pytest.raises(MatcherFailed):
        bad.check()  # the error state is permanent
    assert good.replay(tok.encode("yes", add_special_tokens=False)) is None
    assert good.complete


def test_an_empty_mask_is_refused_rather_than_sampled() -> None:
    _, ctok = tokenizers()
    filler = MaskFiller(ctok.vocab_size)
    filler._mask[0, :] = 0  # what a matcher in its error state leaves
    with pytest.raises(MatcherFailed):
        filler.apply(0, np.zeros(ctok.vocab_size, np.float32))


def test_eos_ends_a_grammar_that_could_go_on() -> None:
    tok, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.REGEX, "a+", "guided_regex"), ctok)
    m = grammar.start()
    m.replay(tok.encode("aa", add_special_tokens=False))
    assert not m.complete
    filler = MaskFiller(ctok.vocab_size)
    filler.fill([m])
    eos = min(tok.eos_token_ids)
    assert filler.allowed(0)[eos]
    assert m.advance(eos)


def test_a_wider_model_vocabulary_never_allows_the_padding_ids() -> None:
    tok, _ = tokenizers()
    wide = ConstraintTokenizer.from_tokenizer(tok, vocab_size=tok.vocab_size + 50)
    grammar = compile_grammar(GrammarSpec(GrammarKind.JSON_OBJECT, None, "response_format"), wide)
    filler = MaskFiller(wide.vocab_size)
    filler.fill([grammar.start()])
    assert not filler.allowed(0)[tok.vocab_size :].any()


def test_logprobs_under_a_mask_are_the_masked_distribution_without_forbidden_alternatives() -> None:
    _, ctok = tokenizers()
    grammar = compile_grammar(GrammarSpec(GrammarKind.CHOICE, ["yes", "no"], "c"), ctok)
    filler = MaskFiller(ctok.vocab_size)
    filler.fill([grammar.start()])
    logits = np.random.default_rng(0).normal(0, 1, ctok.vocab_size).astype(np.float32)
    filler.apply(0, logits)
    out = SequenceSampler(SamplingParams(logprobs=20, seed=0)).sample(logits)
    allowed = np.flatnonzero(filler.allowed(0))
    assert {t for t, _ in out.top_logprobs} == set(allowed.tolist())  # fewer than 20
    total = sum(np.exp(lp) for _, lp in out.top_logprobs)
    assert total == pytest.approx(1.0)  # they are all the mass there is


def test_a_tokenizer_with_ids_past_the_models_logits_is_cut_to_them() -> None:
    tok, _ = tokenizers()
    narrow = ConstraintTokenizer.from_tokenizer(tok, vocab_size=tok.vocab_size - 5)
    assert narrow.mask_vocab == tok.vocab_size
    grammar = compile_grammar(GrammarSpec(GrammarKind.CHOICE, ["yes", "no"], "c"), narrow)
    matcher = grammar.start()
    filler = MaskFiller(matcher.mask_vocab)
    filler.fill([matcher])
    logits = np.zeros(narrow.vocab_size, np.float32)  # the model's width
    filler.apply(0, logits)
    assert np.isfinite(logits).sum() == filler.allowed(0)[: narrow.vocab_size].sum() > 0


def test_the_same_constraint_compiles_once_and_a_refused_one_is_never_kept() -> None:
    from triollm.model.constrained import GrammarCache

    _, ctok = tokenizers()
    cache = GrammarCache(ctok, size=2)
    a = cache.get(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON, "response_format"))
    again = cache.get(GrammarSpec(GrammarKind.JSON_SCHEMA, dict(PERSON), "guided_json"))
    assert again is a and (cache.hits, cache.misses) == (1, 1)
    cache.get(GrammarSpec(GrammarKind.REGEX, "a+", "guided_regex"))
    cache.get(GrammarSpec(GrammarKind.REGEX, "b+", "guided_regex"))  # evicts PERSON
    assert cache.get(GrammarSpec(GrammarKind.JSON_SCHEMA, PERSON, "f")) is not a
    for _ in range(2):  # a refusal is raised each time, naming each request's field
        with pytest.raises(GrammarError) as info:
            cache.get(GrammarSpec(GrammarKind.REGEX, "a(", "guided_regex"))
        assert info.value.field == "guided_regex"


# --------------------------------------------------------------------------- bounded JSON

NUMBER_IN = {
    "type": "object",
    "properties": {"x": {"type": "number"}},
    "required": ["x"],
    "additionalProperties": False,
}


def _bounded_cases() -> list[tuple[str, GrammarSpec, str]]:
    from triollm.model.constrained import JSON_OPTIONS, bounded_numbers
    from triollm.toolcalls import ToolCallFormat, tool_grammar

    lark = tool_grammar(
        ToolCallFormat.HERMES,
        [{"name": "f", "parameters": bounded_numbers(NUMBER_IN)}],
        parallel=False,
        marker_token_id=lambda s: None,
        json_options=JSON_OPTIONS,
    )
    return [
        ("schema", GrammarSpec(GrammarKind.JSON_SCHEMA, NUMBER_IN, "f"), '{"x": '),
        ("json_object", GrammarSpec(GrammarKind.JSON_OBJECT, None, "f"), '{"x": '),
        (
            "tools",
            GrammarSpec(GrammarKind.LARK, lark, "tools"),
            '<tool_call>\n{"name": "f", "arguments": {"x": ',
        ),
    ]


@pytest.mark.parametrize(
    ("name", "spec", "prefix"), _bounded_cases(), ids=lambda c: c if isinstance(c, str) else ""
)
def test_no_json_number_grows_past_sixteen_integral_digits_nor_takes_free_whitespace(
    name: str, spec: GrammarSpec, prefix: str
) -> None:
    # SmolLM2 wrote "population_millions": 1111111... until max_tokens (issue 26): in
    # every JSON grammar a number's integral part ends at 16 digits, as llama.cpp's.
    from triollm.model.constrained import MAX_INTEGRAL_DIGITS

    tok, ctok = tokenizers()
    grammar = compile_grammar(spec, ctok)
    filler = MaskFiller(ctok.vocab_size)
    one = tok.encode("1", add_special_tokens=False)
    space = tok.encode(" ", add_special_tokens=False)
    assert len(one) == 1 and len(space) == 1

    def allowed_after(text: str) -> np.ndarray:
        matcher = grammar.start()
        matcher.replay(tok.encode(text, add_special_tokens=False))
        filler.fill([matcher])
        return filler.allowed(0)

    assert allowed_after(prefix + "1" * (MAX_INTEGRAL_DIGITS - 1))[one[0]]
    assert not allowed_after(prefix + "1" * MAX_INTEGRAL_DIGITS)[one[0]], name
    assert not allowed_after(prefix + "1")[space[0]], name  # no whitespace between tokens


def test_a_model_that_always_wants_another_digit_still_ends_its_json() -> None:
    from triollm.model.constrained import MAX_INTEGRAL_DIGITS

    tok, ctok = tokenizers()
    matcher = compile_grammar(GrammarSpec(GrammarKind.JSON_SCHEMA, NUMBER_IN, "f"), ctok).start()
    filler = MaskFiller(ctok.vocab_size)
    [one], [close] = (tok.encode(t, add_special_tokens=False) for t in ("1", "}"))
    ids: list[int] = []
    for _ in range(100):
        filler.fill([matcher])
        allowed = filler.allowed(0)
        # '1' whenever the grammar lets it, then '}', else the first token allowed.
        pick = next((t for t in (one, close) if allowed[t]), int(np.argmax(allowed)))
        ids.append(pick)
        if matcher.advance(pick):
            break
    assert matcher.complete
    assert json.loads(tok.decode(ids)) == {"x": float("1" * MAX_INTEGRAL_DIGITS)}
