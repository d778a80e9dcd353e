"""Anthropic's Messages API (``POST /v1/messages``) with the official ``anthropic`` client.

Each answer is held to what /v1/chat/completions answers for the same conversation at
temperature 0 (apikit.py says why); the stream to the whole message; a forced tool
call to its schema and back through a ``tool_result``; errors to Anthropic's shape.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import trio
from apikit import ASK, CHAT_TOOLS, WEATHER, chat, hermes_model, prompt_tokens
from serverkit import MODEL_ID, live_server

anthropic = pytest.importorskip(
    "anthropic", reason="the anthropic client (dev extra) is not installed"
)

TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]
SYSTEM = "Be brief."
HELLO = [{"role": "user", "content": "Hello there"}]
# anthropic 2.x no longer sends temperature (the API still reads it, as vLLM and
# llama-server do): greedy decoding through the body
GREEDY = {"temperature": 0}


def client(url: str):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hermes_loaded(tmp_path_factory: pytest.TempPathFactory):
    return hermes_model(tmp_path_factory.mktemp("hermes-messages"))


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def test_a_message_is_the_chat_answer_to_the_same_conversation(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.messages.create(
                model=MODEL_ID, system=SYSTEM, messages=HELLO, max_tokens=12, extra_body=GREEDY
            )
        )
        want = await chat(live.url, [{"role": "system", "content": SYSTEM}, *HELLO], max_tokens=12)
    choice = want["choices"][0]
    assert text_of(got) == choice["message"]["content"]
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert got.stop_reason == reasons[choice["finish_reason"]]
    assert got.usage.output_tokens == want["usage"]["completion_tokens"]
    assert (
        got.usage.input_tokens + got.usage.cache_read_input_tokens == want["usage"]["prompt_tokens"]
    )


async def test_the_stream_adds_up_to_the_whole_message(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        ask = dict(model=MODEL_ID, system=SYSTEM, messages=HELLO, max_tokens=10, extra_body=GREEDY)
        whole = await trio.to_thread.run_sync(lambda: c.messages.create(**ask))

        def streamed():
            with c.messages.stream(**ask) as s:
                pieces = list(s.text_stream)
                return pieces, s.get_final_message()

        pieces, final = await trio.to_thread.run_sync(streamed)
        raw = await trio.to_thread.run_sync(
            lambda: [e.type for e in c.messages.create(stream=True, **ask)]
        )
    assert "".join(pieces) == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in raw and "content_block_stop" in raw


async def test_a_stop_sequence_ends_the_answer_and_is_named(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        free = await chat(live.url, [{"role": "system", "content": SYSTEM}, *HELLO], max_tokens=24)
        text = free["choices"][0]["message"]["content"]
        stop = text[6:8]
        assert len(stop) == 2, text
        ask = dict(
            model=MODEL_ID,
            system=SYSTEM,
            messages=HELLO,
            max_tokens=24,
            extra_body=GREEDY,
            stop_sequences=[stop],
        )
        got = await trio.to_thread.run_sync(lambda: c.messages.create(**ask))

        def streamed():
            with c.messages.stream(**ask) as s:
                return "".join(s.text_stream), s.get_final_message()

        pieces, final = await trio.to_thread.run_sync(streamed)
    expected = text[: text.find(stop)]
    for message in (got, final):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert text_of(message) == expected
    assert pieces == expected  # nothing of the stop string was streamed


async def test_a_forced_tool_use_round_trip(hermes_loaded):
    server = live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512)
    async with server as live:
        c = client(live.url)
        ask = [{"role": "user", "content": ASK}]
        first = await trio.to_thread.run_sync(
            lambda: c.messages.create(
                model=MODEL_ID,
                messages=ask,
                tools=TOOLS,
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                max_tokens=200,
                extra_body=GREEDY,
            )
        )
        uses = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and uses
        for use in uses:
            assert use.name == "get_weather"
            jsonschema.validate(use.input, WEATHER)

        def streamed():
            with c.messages.stream(
                model=MODEL_ID,
                messages=ask,
                tools=TOOLS,
                tool_choice={
                    "type": "tool",
                    "name": "get_weather",
                    "disable_parallel_tool_use": True,
                },
                max_tokens=200,
                extra_body=GREEDY,
            ) as s:
                return s.get_final_message()

        final = await trio.to_thread.run_sync(streamed)
        assert final.stop_reason == "tool_use"
        assert next(b.input for b in final.content if b.type == "tool_use") == uses[0].input

        results = [
            {"type": "tool_result", "tool_use_id": u.id, "content": '{"temp": 21}'} for u in uses
        ]
        conversation = [
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": results},
        ]
        second = await trio.to_thread.run_sync(
            lambda: c.messages.create(
                model=MODEL_ID, messages=conversation, tools=TOOLS, max_tokens=8, extra_body=GREEDY
            )
        )
        counted = await trio.to_thread.run_sync(
            lambda: c.messages.count_tokens(model=MODEL_ID, messages=conversation, tools=TOOLS)
        )
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": u.id,
                    "type": "function",
                    "function": {"name": u.name, "arguments": json.dumps(u.input)},
                }
                for u in uses
            ],
        }
        tool_turns = [
            {"role": "tool", "tool_call_id": u.id, "content": '{"temp": 21}'} for u in uses
        ]
        expected = await prompt_tokens(live.url, [*ask, assistant, *tool_turns], tools=CHAT_TOOLS)
        assert live.pool_is_idle()
    assert counted.input_tokens == expected
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == expected


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    *HELLO,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f"}],
                    },
                ]
            },
            "messages[1]",  # a tool_use needs its tool_result before anything else
        ),
        ({"temperature": 1.5}, "temperature"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ],
)
async def test_what_this_server_cannot_do_is_refused_by_name_in_anthropic_s_shape(
    loaded, extra, field
):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(anthropic.BadRequestError) as refused:
            await trio.to_thread.run_sync(
                lambda: c.messages.create(
                    model=MODEL_ID, messages=HELLO, max_tokens=4, extra_body=extra
                )
            )
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert f"'{field}'" in body["error"]["message"]


async def test_max_tokens_is_required_and_another_model_is_not_found(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(anthropic.BadRequestError) as missing:
            await trio.to_thread.run_sync(
                lambda: c.messages.create(
                    model=MODEL_ID, messages=HELLO, max_tokens=4, extra_body={"max_tokens": None}
                )
            )
        with pytest.raises(anthropic.NotFoundError) as other:
            await trio.to_thread.run_sync(
                lambda: c.messages.create(model="claude-9", messages=HELLO, max_tokens=4)
            )
    assert "'max_tokens'" in missing.value.body["error"]["message"]
    assert other.value.body["error"]["type"] == "not_found_error"


async def test_output_config_format_constrains_the_answer_to_the_schema(loaded):
    place = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "coastal": {"type": "boolean"}},
        "required": ["city", "coastal"],
        "additionalProperties": False,
    }
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.messages.create(
                model=MODEL_ID,
                messages=HELLO,
                max_tokens=60,
                extra_body={
                    **GREEDY,
                    "output_config": {"format": {"type": "json_schema", "schema": place}},
                },
            )
        )
    assert got.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(got)), place)


def test_tools_translate_to_chat_s_tools_key_for_key_in_order():
    # Qwen's template dumps each tool as JSON: a different key order is a different
    # prompt (it cost one token against chat's on the real Qwen2.5 GGUF).
    from triollm.server.anthropic import parse_messages
    from triollm.server.openai import parse_chat

    ask = [{"role": "user", "content": ASK}]
    ours = parse_messages(json.dumps({"max_tokens": 4, "messages": ask, "tools": TOOLS}).encode())
    chat = parse_chat(json.dumps({"messages": ask, "tools": CHAT_TOOLS}).encode())
    assert ours.request.tools is not None and chat.tools is not None
    assert json.dumps(ours.request.tools.definitions) == json.dumps(chat.tools.definitions)


async def test_a_final_assistant_turn_is_continued_as_chat_continues_it(loaded):
    prefill = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.messages.create(
                model=MODEL_ID, messages=prefill, max_tokens=8, extra_body=GREEDY
            )
        )
        want = await chat(
            live.url,
            prefill,
            max_tokens=8,
            continue_final_message=True,
            add_generation_prompt=False,
        )
        fresh = await chat(live.url, HELLO, max_tokens=8)
    assert text_of(got) == want["choices"][0]["message"]["content"]
    assert got.usage.output_tokens == want["usage"]["completion_tokens"]
    # the prefill is in the prompt: more of it than without
    assert (
        got.usage.input_tokens + got.usage.cache_read_input_tokens > fresh["usage"]["prompt_tokens"]
    )
