"""The Responses API (``POST /v1/responses``) with the official ``openai`` client, unmodified.

Each answer is held to what /v1/chat/completions answers for the same conversation at
temperature 0 (apikit.py says why), the typed stream to the whole body, and a tool call
to its schema and back through ``function_call_output``.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

import jsonschema
import openai
import pytest
import trio
from apikit import ASK, CHAT_TOOLS, WEATHER, chat, hermes_model, prompt_tokens
from pydantic import BaseModel
from serverkit import MODEL_ID, live_server

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}
]


class Place(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    coastal: bool


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hermes_loaded(tmp_path_factory: pytest.TempPathFactory):
    return hermes_model(tmp_path_factory.mktemp("hermes-responses"))


async def test_a_response_is_the_chat_answer_to_the_same_conversation(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.responses.create(
                model=MODEL_ID,
                instructions="Be brief.",
                input="Hello there",
                max_output_tokens=12,
                temperature=0,
            )
        )
        want = await chat(
            live.url,
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ],
            max_tokens=12,
        )
        assert live.pool_is_idle()
    choice = want["choices"][0]
    assert got.output_text == choice["message"]["content"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == want["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert got.status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens"
    else:
        assert got.status == "completed"
    assert got.instructions == "Be brief." and got.model == MODEL_ID


async def test_the_typed_stream_adds_up_to_the_whole_response(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        ask = dict(model=MODEL_ID, input="Hello there", max_output_tokens=10, temperature=0)
        whole = await trio.to_thread.run_sync(lambda: c.responses.create(**ask))
        events = await trio.to_thread.run_sync(lambda: list(c.responses.create(stream=True, **ask)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


async def test_text_format_parses_into_the_model_both_whole_and_streamed(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        ask = dict(model=MODEL_ID, input="Where?", max_output_tokens=60, temperature=0)
        parsed = await trio.to_thread.run_sync(lambda: c.responses.parse(text_format=Place, **ask))

        def streamed() -> Place | None:
            with c.responses.stream(text_format=Place, **ask) as s:
                for _ in s:
                    pass
                return s.get_final_response().output_parsed

        from_stream = await trio.to_thread.run_sync(streamed)
    assert isinstance(parsed.output_parsed, Place)
    assert from_stream == parsed.output_parsed


async def test_a_forced_call_round_trip_through_function_call_output(hermes_loaded):
    server = live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512)
    async with server as live:
        c = client(live.url)
        # one call (a forced call's grammar bounds it), greedy: the stream must repeat it
        ask = dict(
            model=MODEL_ID,
            input=ASK,
            tools=TOOLS,
            parallel_tool_calls=False,
            max_output_tokens=200,
            temperature=0,
        )
        first = await trio.to_thread.run_sync(
            lambda: c.responses.create(tool_choice="required", **ask)
        )
        calls = [item for item in first.output if item.type == "function_call"]
        assert first.status == "completed" and calls
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments), WEATHER)

        def streamed() -> tuple[list, object]:
            with c.responses.stream(tool_choice="required", **ask) as s:
                events = list(s)
                return events, s.get_final_response()

        events, final = await trio.to_thread.run_sync(streamed)
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        streamed_calls = [i for i in final.output if i.type == "function_call"]
        assert "".join(pieces) == "".join(i.arguments for i in streamed_calls)
        assert [i.arguments for i in streamed_calls] == [i.arguments for i in calls]

        # The result goes back as a function_call_output item; the model's own call
        # items are sent back as they came.
        results = [
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
            for call in calls
        ]
        second = await trio.to_thread.run_sync(
            lambda: c.responses.create(
                model=MODEL_ID,
                input=[{"role": "user", "content": ASK}, *first.output, *results],
                tools=TOOLS,
                tool_choice="none",
                max_output_tokens=8,
            )
        )
        # The same conversation in chat's spelling renders to as many tokens.
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ],
        }
        tool_turns = [
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}
            for call in calls
        ]
        messages = [{"role": "user", "content": ASK}, assistant, *tool_turns]
        expected = await prompt_tokens(live.url, messages, tools=CHAT_TOOLS)
        assert live.pool_is_idle()
    assert second.usage.input_tokens == expected
    assert not [i for i in second.output if i.type == "function_call"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
async def test_what_this_server_cannot_do_is_refused_by_name(loaded, extra, param):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(openai.BadRequestError) as refused:
            await trio.to_thread.run_sync(
                lambda: c.responses.create(model=MODEL_ID, input="Hi", extra_body=extra)
            )
    assert refused.value.body["param"] == param


async def test_an_unknown_field_is_ignored_and_logged_once(loaded, caplog):
    caplog.set_level(logging.WARNING, logger="triollm.server")
    async with live_server(loaded) as live:
        c = client(live.url)
        for _ in range(2):
            got = await trio.to_thread.run_sync(
                lambda: c.responses.create(
                    model=MODEL_ID,
                    input="Hi",
                    max_output_tokens=2,
                    extra_body={"frobnicate": True},
                )
            )
            assert got.usage.output_tokens >= 1
    lines = [r for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(lines) == 1


async def test_another_model_is_a_404_in_openai_s_shape(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(openai.NotFoundError) as missing:
            await trio.to_thread.run_sync(lambda: c.responses.create(model="gpt-9", input="Hi"))
    assert missing.value.body["param"] == "model"
