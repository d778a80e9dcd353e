"""Structured output through the server, with the official ``openai`` client, unmodified.

The fixture model is random: its text is nonsense, so only the grammar makes the
answer parse. Each claim is one a user of ``response_format`` relies on.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import trio
from pydantic import BaseModel, Field
from serverkit import MODEL_ID, live_server


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    kind: Literal["city", "town"]


SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 50},
        "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Name a city and its country."}]


async def test_parse_with_a_pydantic_model_returns_a_parsed_object(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat.completions.parse(
                model=MODEL_ID, messages=MESSAGES, response_format=City, max_tokens=120, seed=1
            )
        )
        assert live.pool_is_idle()
    city = got.choices[0].message.parsed
    assert isinstance(city, City) and got.choices[0].finish_reason == "stop"
    assert city.kind in ("city", "town")


async def test_a_streamed_json_schema_answer_joins_into_valid_json(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)

        def run() -> list:
            fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
            return list(
                c.chat.completions.create(
                    model=MODEL_ID,
                    messages=MESSAGES,
                    response_format=fmt,
                    max_tokens=120,
                    temperature=1.0,
                    seed=4,
                    stream=True,
                )
            )

        chunks = await trio.to_thread.run_sync(run)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_json_object_and_the_vllm_extras_constrain_both_endpoints(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)

        def run() -> tuple:
            obj = c.chat.completions.create(
                model=MODEL_ID,
                messages=MESSAGES,
                response_format={"type": "json_object"},
                max_tokens=60,
                seed=2,
            )
            choice = c.completions.create(
                model=MODEL_ID,
                prompt="Pick one:",
                max_tokens=20,
                extra_body={"guided_choice": ["alpha", "beta gamma"]},
            )
            regex = c.completions.create(
                model=MODEL_ID,
                prompt="A date:",
                max_tokens=30,
                extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}},
            )
            return obj, choice, regex

        obj, choice, regex = await trio.to_thread.run_sync(run)
    if obj.choices[0].finish_reason == "stop":  # an object may outgrow 60 random tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert choice.choices[0].text in ("alpha", "beta gamma")
    assert choice.choices[0].finish_reason == "stop"
    assert len(regex.choices[0].text) == 7 and regex.choices[0].text.startswith("20")


async def test_max_tokens_cutting_the_json_is_length_and_parse_says_so(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(openai.LengthFinishReasonError):
            await trio.to_thread.run_sync(
                lambda: c.chat.completions.parse(
                    model=MODEL_ID, messages=MESSAGES, response_format=City, max_tokens=3
                )
            )
        assert live.pool_is_idle()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
async def test_a_grammar_the_library_refuses_is_a_400_naming_the_field(loaded, extra, param):
    async with live_server(loaded) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
            body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 5, **extra}
            r = await http.post("/v1/chat/completions", json=body)
        assert live.pool_is_idle()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
