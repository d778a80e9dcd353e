"""Ollama's API with the official ``ollama`` client library, unmodified.

Each answer is held to what /v1/chat/completions (or /v1/completions, for a raw
prompt) answers at temperature 0 (apikit.py says why); the NDJSON stream to the whole
answer; ``format`` to its schema; a tool round trip to the prompt chat would render;
errors to Ollama's shape, naming the field.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import trio
from apikit import ASK, CHAT_TOOLS, chat, hermes_model, prompt_tokens
from serverkit import MODEL_ID, live_server

ollama = pytest.importorskip("ollama", reason="the ollama client (dev extra) is not installed")

NAME = MODEL_ID + ":latest"
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 10}
PLACE = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "coastal": {"type": "boolean"}},
    "required": ["city", "coastal"],
    "additionalProperties": False,
}


def client(url: str):
    return ollama.Client(host=url, timeout=60)


@pytest.fixture(scope="module")
def hermes_loaded(tmp_path_factory: pytest.TempPathFactory):
    return hermes_model(tmp_path_factory.mktemp("hermes-ollama"))


async def test_the_listings_name_the_served_model(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        tags = await trio.to_thread.run_sync(c.list)
        running = await trio.to_thread.run_sync(c.ps)
        shown = await trio.to_thread.run_sync(lambda: c.show(NAME))
        async with httpx.AsyncClient(base_url=live.url) as http:
            version = (await http.get("/api/version")).json()
    assert [m.model for m in tags.models] == [NAME]
    assert [m.model for m in running.models] == [NAME]
    assert shown.template == loaded.tokenizer.chat_templates["default"]
    assert "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 256  # serverkit's context
    assert version["version"]


async def test_chat_is_the_chat_completion_of_the_same_conversation(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat(model=NAME, messages=HELLO, options=GREEDY, stream=False)
        )
        pieces = await trio.to_thread.run_sync(
            lambda: list(c.chat(model=MODEL_ID, messages=HELLO, options=GREEDY, stream=True))
        )
        want = await chat(live.url, HELLO, max_tokens=10)
        assert live.pool_is_idle()
    choice = want["choices"][0]
    assert got.message.content == choice["message"]["content"]
    assert got.done and got.done_reason == choice["finish_reason"]
    assert got.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert got.eval_count == want["usage"]["completion_tokens"]
    assert "".join(p.message.content for p in pieces) == got.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].eval_count == got.eval_count


async def test_generate_through_the_template_and_raw(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        templated = await trio.to_thread.run_sync(
            lambda: c.generate(model=NAME, prompt="Hello there", options=GREEDY)
        )
        raw = await trio.to_thread.run_sync(
            lambda: c.generate(model=NAME, prompt="Hello there", raw=True, options=GREEDY)
        )
        streamed = await trio.to_thread.run_sync(
            lambda: list(
                c.generate(model=NAME, prompt="Hello there", raw=True, options=GREEDY, stream=True)
            )
        )
        want = await chat(live.url, HELLO, max_tokens=10)
        async with httpx.AsyncClient(base_url=live.url) as http:
            r = await http.post(
                "/v1/completions",
                json={"prompt": "Hello there", "max_tokens": 10, "temperature": 0},
            )
    assert templated.response == want["choices"][0]["message"]["content"]
    assert raw.response == r.json()["choices"][0]["text"]
    assert "".join(p.response for p in streamed) == raw.response


async def test_format_constrains_the_answer_to_the_schema(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat(
                model=NAME,
                messages=HELLO,
                format=PLACE,
                options={"temperature": 0, "num_predict": 60},
            )
        )
    jsonschema.validate(json.loads(got.message.content), PLACE)


async def test_a_tool_round_trip_renders_as_chat_would(hermes_loaded):
    server = live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    conversation = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 21}', "tool_name": "get_weather"},
    ]
    async with server as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat(
                model=NAME,
                messages=conversation,
                tools=CHAT_TOOLS,
                options={"temperature": 0, "num_predict": 6},
            )
        )
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps(call["function"]["arguments"]),
                    },
                }
            ],
        }
        tool_turn = {"role": "tool", "tool_call_id": "call_1_0", "content": '{"temp": 21}'}
        expected = await prompt_tokens(
            live.url, [conversation[0], assistant, tool_turn], tools=CHAT_TOOLS
        )
    assert got.prompt_eval_count == expected
    assert got.done


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"typical_p": 0.5}}, "options.typical_p"),
        ({"options": {"num_ctx": 3}}, "options.num_ctx"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"think": True}, "think"),
        ({"format": "yaml"}, "format"),
        (
            {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            "messages[0].images",
        ),
    ],
)
async def test_what_this_server_cannot_do_is_refused_by_name_in_ollama_s_shape(
    loaded, extra, field
):
    body = {"model": NAME, "messages": HELLO, "stream": False, **extra}
    async with live_server(loaded) as live, httpx.AsyncClient(base_url=live.url) as http:
        r = await http.post("/api/chat", json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and f"'{field}'" in r.json()["error"]


async def test_the_client_raises_ollama_s_error_for_another_model(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(ollama.ResponseError) as missing:
            await trio.to_thread.run_sync(lambda: c.chat(model="llama9:7b", messages=HELLO))
    assert missing.value.status_code == 404 and "llama9:7b" in missing.value.error


async def test_num_ctx_stops_the_answer_at_the_bound(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        bound = await prompt_tokens(live.url, HELLO) + 5
        got = await trio.to_thread.run_sync(
            lambda: c.chat(model=NAME, messages=HELLO, options={"temperature": 0, "num_ctx": bound})
        )
    assert got.eval_count <= 5 and got.prompt_eval_count + got.eval_count <= bound


async def test_a_final_assistant_message_is_continued(loaded):
    prefill = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat(model=NAME, messages=prefill, options=GREEDY)
        )
        want = await chat(
            live.url,
            prefill,
            max_tokens=10,
            continue_final_message=True,
            add_generation_prompt=False,
        )
    assert got.message.content == want["choices"][0]["message"]["content"]
    assert got.prompt_eval_count == want["usage"]["prompt_tokens"]
