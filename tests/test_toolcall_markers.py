"""Tool-call markers that are added tokens reach the parser, and a forcing grammar names them by id.

The detokenizer drops special tokens, as ``decode(skip_special_tokens=True)`` does; a
request with tools keeps its family's markers (Mistral's ``[TOOL_CALLS]``), so a call
written after one is parsed. A forcing grammar names every marker that is one added
token by its id, special or not: Qwen's ``<tool_call>`` is an added token that is not
special, and written as text it failed every forced call (issue 26).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from triollm.model.constrained import (
    JSON_OPTIONS,
    ConstraintTokenizer,
    GrammarKind,
    GrammarSpec,
    MaskFiller,
    compile_grammar,
)
from triollm.model.sampling import SamplingParams, SequenceSampler
from triollm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from triollm.textstream import TextStream
from triollm.toolcalls import ToolCallFormat, ToolCallParser, merge, tool_grammar

DEMO = Path(__file__).resolve().parents[1] / "src" / "triollm" / "demo" / "model"
MARKER = "[TOOL_CALLS]"


@pytest.fixture(scope="module")
def mistral_like(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("mistral-like")
    hf = HFTokenizer.from_file(str(DEMO / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(MARKER, special=True)])
    hf.save(str(d / "tokenizer.json"))
    shutil.copy(DEMO / "tokenizer_config.json", d / "tokenizer_config.json")
    return Tokenizer.from_dir(d)


CALL = '[{"name": "f", "arguments": {"x": 1}}]'


def stream(tok: Tokenizer, ids: list[int], tools: ToolCallParser | None) -> tuple[str, tuple]:
    text = TextStream(IncrementalDetokenizer(tok), tools=tools)
    pieces = [text.push(t) for t in ids]
    pieces.append(text.finish(text.finish_reason or _stop()))
    content = "".join(p.text for p in pieces)
    calls = [t for p in pieces for t in p.tool_calls]
    return content, tuple(calls)


def _stop():
    from triollm.plan import FinishReason

    return FinishReason.STOP


def test_a_special_marker_reaches_the_parser_only_when_tools_are_asked(mistral_like) -> None:
    marker = mistral_like.special_token_id(MARKER)
    assert marker is not None
    ids = [marker, *mistral_like.encode(CALL, add_special_tokens=False)]
    content, calls = stream(mistral_like, ids, ToolCallParser(ToolCallFormat.MISTRAL))
    assert content == ""
    from triollm.toolcalls import ParsedDelta

    _, whole = merge([ParsedDelta("", calls)])
    assert whole[0].name == "f" and json.loads(whole[0].arguments) == {"x": 1}
    plain, none = stream(mistral_like, ids, None)  # no tools: the marker is not text
    assert plain == CALL and none == ()


def force(tok: Tokenizer, lark: str, seed: int = 0, steps: int = 400) -> list[int]:
    """Token ids under ``lark`` from random logits (the hard case: only the mask holds)."""
    ctok = ConstraintTokenizer.from_tokenizer(tok)
    matcher = compile_grammar(GrammarSpec(GrammarKind.LARK, lark, "tools"), ctok).start()
    filler, sampler = MaskFiller(matcher.mask_vocab), SequenceSampler(SamplingParams(seed=seed))
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while not (ids and matcher.complete) and len(ids) < steps:
        logits = rng.normal(0, 3, ctok.vocab_size).astype(np.float32)
        filler.fill([matcher])
        filler.apply(0, logits)
        ids.append(sampler.sample(logits).token_id)
        matcher.advance(ids[-1])
    assert matcher.complete
    return ids


@pytest.fixture(scope="module")
def hermes_like(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("hermes-like")
    hf = HFTokenizer.from_file(str(DEMO / "tokenizer.json"))
    # Qwen's markers as its GGUF has them: added tokens, matched whole, *not* special.
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in HERMES])
    hf.save(str(d / "tokenizer.json"))
    shutil.copy(DEMO / "tokenizer_config.json", d / "tokenizer_config.json")
    return Tokenizer.from_dir(d)


HERMES = ("<tool_call>", "</tool_call>")
F = {
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
        "additionalProperties": False,
    },
}


def test_a_forced_call_names_a_marker_that_is_added_but_not_special_by_its_id(hermes_like) -> None:
    opening, closing = (hermes_like.added_token_id(t) for t in HERMES)
    assert opening is not None and closing is not None
    assert hermes_like.special_token_id(HERMES[0]) is None  # the trap of issue 26
    lark = tool_grammar(
        ToolCallFormat.HERMES,
        [F],
        parallel=False,
        marker_token_id=hermes_like.added_token_id,
        json_options=JSON_OPTIONS,
    )
    assert f"<[{opening}]>" in lark and f"<[{closing}]>" in lark
    for seed in range(3):
        ids = force(hermes_like, lark, seed)
        assert ids[0] == opening and closing in ids
        content, calls = stream(hermes_like, ids, ToolCallParser(ToolCallFormat.HERMES))
        assert content == "" and [c.name for c in calls if c.name] == ["f"]


def test_a_forced_mistral_call_starts_with_the_special_marker_token(mistral_like) -> None:
    tools = [
        {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
        }
    ]
    lark = tool_grammar(
        ToolCallFormat.MISTRAL,
        tools,
        parallel=False,
        marker_token_id=mistral_like.special_token_id,
        json_options=JSON_OPTIONS,
    )
    ctok = ConstraintTokenizer.from_tokenizer(mistral_like)
    matcher = compile_grammar(GrammarSpec(GrammarKind.LARK, lark, "tools"), ctok).start()
    filler, sampler = MaskFiller(matcher.mask_vocab), SequenceSampler(SamplingParams(seed=0))
    rng = np.random.default_rng(0)
    ids: list[int] = []
    while not (ids and matcher.complete):
        logits = rng.normal(0, 3, ctok.vocab_size).astype(np.float32)
        filler.fill([matcher])
        filler.apply(0, logits)
        ids.append(sampler.sample(logits).token_id)
        matcher.advance(ids[-1])
    assert ids[0] == mistral_like.special_token_id(MARKER)
    content, calls = stream(mistral_like, ids, ToolCallParser(ToolCallFormat.MISTRAL))
    assert content == "" and calls and calls[0].name == "f"
