"""Tool-call parsing: each family's syntax back into OpenAI's tool_calls, piece by piece.

The parser sees text as the detokenizer releases it, in pieces of any size, so every
claim is checked for every way of cutting the text (hypothesis draws the cuts).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.toolcalls import (
    ParsedDelta,
    ToolCallFormat,
    ToolCallParser,
    detect_format,
    merge,
    new_call_id,
    tool_grammar,
)

_ids = itertools.count()


def fixed_ids(fmt: ToolCallFormat) -> str:
    return f"call_{next(_ids)}"


def parse(fmt: ToolCallFormat, pieces: list[str]) -> list[ParsedDelta]:
    p = ToolCallParser(fmt, new_id=fixed_ids)
    out = [p.feed(x) for x in pieces]
    out.append(p.finish())
    return [d for d in out if d]


def cut(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(min(p, len(text)) for p in points)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "deep": {"a": "}{\\"}}
CASES = {
    ToolCallFormat.HERMES: (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
    ),
    ToolCallFormat.LLAMA3_JSON: (
        '{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "get_time", "parameters": {}}',
        "",
    ),
    ToolCallFormat.MISTRAL: (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": {}}]',
        "",
    ),
    ToolCallFormat.JSON: (
        '[{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": {}}]',
        "",
    ),
}


@pytest.mark.parametrize("fmt", list(CASES), ids=lambda f: f.value)
@settings(max_examples=60, deadline=None)
@given(points=st.lists(st.integers(0, 400), max_size=12))
def test_calls_come_out_whole_however_the_text_is_cut(
    fmt: ToolCallFormat, points: list[int]
) -> None:
    text, want_content = CASES[fmt]
    content, calls = merge(parse(fmt, cut(text, points)))
    assert content == want_content
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == WEATHER
    assert json.loads(calls[1].arguments) == {}
    assert len({c.id for c in calls}) == 2


def test_arguments_stream_as_they_are_generated_after_the_name() -> None:
    text = CASES[ToolCallFormat.HERMES][0]
    deltas = parse(ToolCallFormat.HERMES, list(text))  # one character at a time
    pieces = [t for d in deltas for t in d.tool_calls]
    first = pieces[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert first.id is not None
    args = [t.arguments for t in pieces if t.index == 0 and t.id is None]
    assert len(args) > 10  # many small pieces, not one at the end
    assert "".join(args) == json.dumps(WEATHER)


def test_arguments_before_the_name_are_sent_once_the_name_is_known() -> None:
    text = '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>'
    content, calls = merge(parse(ToolCallFormat.HERMES, list(text)))
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}


def test_arguments_written_as_a_json_string_are_unwrapped() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    _, calls = merge(parse(ToolCallFormat.HERMES, [text]))
    assert json.loads(calls[0].arguments) == {"x": 1}


def test_a_call_without_arguments_gets_an_empty_object() -> None:
    _, calls = merge(parse(ToolCallFormat.HERMES, ['<tool_call>{"name": "now"}</tool_call>']))
    assert calls[0].arguments == "{}"


@pytest.mark.parametrize("fmt", list(CASES), ids=lambda f: f.value)
def test_plain_text_is_content_and_nothing_is_held_back_at_the_end(fmt: ToolCallFormat) -> None:
    text = "The weather in Paris is mild < 20 degrees [today]."
    parser = ToolCallParser(fmt)
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    content, calls = merge(deltas)
    assert content == text and calls == () and not parser.called


def test_a_partial_marker_is_held_back_until_it_is_clearly_text() -> None:
    parser = ToolCallParser(ToolCallFormat.HERMES)
    assert parser.feed("a <tool").content == "a "
    assert parser.feed("box>").content == "<toolbox>"


def test_broken_json_in_a_call_block_is_given_back_as_content() -> None:
    text = "<tool_call>{not json}</tool_call>"
    content, calls = merge(parse(ToolCallFormat.HERMES, [text]))
    assert calls == () and "{not json}" in content


def test_a_llama3_answer_that_is_json_but_not_a_call_is_content() -> None:
    text = '{"answer": 42}'
    content, calls = merge(parse(ToolCallFormat.LLAMA3_JSON, list(text)))
    assert calls == () and content == text


def test_a_llama3_call_may_follow_the_python_tag() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}'
    _, calls = merge(parse(ToolCallFormat.LLAMA3_JSON, [text]))
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": "x"}


def test_a_call_cut_short_by_max_tokens_keeps_what_was_sent() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"city": "Par'
    parser = ToolCallParser(ToolCallFormat.HERMES)
    deltas = [parser.feed(text), parser.finish()]
    _, calls = merge(deltas)
    assert parser.called and calls[0].arguments == '{"city": "Par'


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_a_closing_tag_cut_by_max_tokens_is_neither_content_nor_a_second_call(whole) -> None:
    # SmolLM2 under a forced grammar, max_tokens 60: the content was '</tool_call'
    # (issue 26), which LangChain sent back into the next turn.
    text = CALL[:-1]
    content, calls = merge(parse(ToolCallFormat.HERMES, [text] if whole else list(text)))
    assert content == "" and [c.name for c in calls] == ["f"]


@pytest.mark.parametrize("tail", ["\n<tool_ca", '\n<tool_call>\n{"name": "f", "argu', "\n<"])
def test_a_next_call_cut_by_max_tokens_leaves_no_fragment(tail: str) -> None:
    content, calls = merge(parse(ToolCallFormat.HERMES, list(CALL + tail)))
    assert content == "" and len(calls) == 1, tail


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_a_call_repeated_word_for_word_is_one_call(whole: bool) -> None:
    other = CALL.replace('"x": 1', '"x": 2')
    text = "\n".join([CALL, CALL, other, CALL.replace('{"x": 1}', '{ "x" : 1 }')])
    content, calls = merge(parse(ToolCallFormat.HERMES, [text] if whole else list(text)))
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"x": 1}, {"x": 2}]


def test_a_json_answer_that_is_not_a_list_of_calls_stays_content() -> None:
    for text in ("[1, 2]", "Paris is mild."):
        content, calls = merge(parse(ToolCallFormat.JSON, list(text)))
        assert calls == () and content == text


def test_the_json_format_forces_a_list_of_calls_without_markers() -> None:
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    for parallel, more in ((False, ""), (True, ' (", " obj)*')):
        lark = tool_grammar(
            ToolCallFormat.JSON,
            tools,
            parallel=parallel,
            marker_token_id=lambda s: 1,
            json_options={},
        )
        assert lark.splitlines()[0] == f'start: "[" obj{more} "]"'


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}", "hermes"),
        ("{{ '[TOOL_CALLS]' }}{{ messages }}", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3_json"),
        ('<|start_header_id|>user {"name": x, "parameters": y}', "llama3_json"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_the_format_is_read_from_the_chat_template(template: str, fmt: str | None) -> None:
    got = detect_format(template)
    assert (got.value if got else None) == fmt


def test_mistral_ids_are_nine_letters_and_digits_and_others_are_call_ids() -> None:
    mistral = new_call_id(ToolCallFormat.MISTRAL)
    assert len(mistral) == 9 and mistral.isalnum()
    assert new_call_id(ToolCallFormat.HERMES).startswith("call_")


def test_the_forcing_grammar_names_special_markers_by_token_id() -> None:
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    lark = tool_grammar(
        ToolCallFormat.MISTRAL,
        tools,
        parallel=False,
        marker_token_id=lambda s: 5 if s == "[TOOL_CALLS]" else None,
        json_options={},
    )
    assert "<[5]>" in lark and '"[TOOL_CALLS]"' not in lark


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]


DEMO = Path(__file__).resolve().parents[1] / "src" / "triollm" / "demo" / "model"


@pytest.mark.parametrize("fmt", list(ToolCallFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_always_parses_and_fits_its_tools_schema(
    fmt: ToolCallFormat, parallel: bool
) -> None:
    import jsonschema
    import numpy as np

    from triollm.model.constrained import (
        JSON_OPTIONS,
        ConstraintTokenizer,
        GrammarKind,
        GrammarSpec,
        MaskFiller,
        compile_grammar,
    )
    from triollm.model.sampling import SamplingParams, SequenceSampler
    from triollm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO)
    ctok = ConstraintTokenizer.from_tokenizer(tok)
    lark = tool_grammar(
        fmt, TOOLS, parallel=parallel, marker_token_id=lambda s: None, json_options=JSON_OPTIONS
    )
    grammar = compile_grammar(GrammarSpec(GrammarKind.LARK, lark, "tools"), ctok)
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    for seed in range(3):
        matcher, filler = grammar.start(), MaskFiller(ctok.vocab_size)
        sampler = SequenceSampler(SamplingParams(seed=seed))
        rng = np.random.default_rng(seed)
        ids: list[int] = []
        for _ in range(400):
            logits = rng.normal(0, 3, ctok.vocab_size).astype(np.float32)
            filler.fill([matcher])
            filler.apply(0, logits)
            ids.append(sampler.sample(logits).token_id)
            if matcher.advance(ids[-1]):
                break
        assert matcher.complete
        text = tok.decode(ids)
        content, calls = merge(parse(fmt, [text]))
        assert content == "" and calls, text
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
