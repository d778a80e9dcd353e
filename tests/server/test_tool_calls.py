"""Tool calls through the server with the official ``openai`` client, unmodified.

The fixture model gets a Hermes-style chat template (written here, and kept short for
the fixture's 512 positions: it renders the tool names, the assistant's calls and the
tool results), so the server reads the format from the template as it does for Qwen.
The model is random, so it only calls a tool when ``tool_choice`` forces it; the forced
calls must still parse and fit the schema.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import trio
from apikit import HERMES_TEMPLATE, WEATHER
from serverkit import MODEL_DIR, MODEL_ID, live_server

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes_loaded(tmp_path_factory: pytest.TempPathFactory):
    from triollm.model.loader import load_model

    d = tmp_path_factory.mktemp("hermes-model")
    for f in MODEL_DIR.iterdir():
        if f.name != "tokenizer_config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HERMES_TEMPLATE}))
    yield load_model(d)
    shutil.rmtree(d, ignore_errors=True)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_a_streamed_tool_call_round_trip(hermes_loaded):
    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        c = client(live.url)

        def ask() -> list:
            stream = c.chat.completions.create(
                model=MODEL_ID,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=150,
                seed=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await trio.to_thread.run_sync(ask)
        deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or ()]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        assert finish == "tool_calls"
        # The first delta of each call names it; the rest stream its arguments.
        calls: dict[int, dict] = {}
        for d in deltas:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                assert d.type == "function"
            calls[d.index]["args"] += d.function.arguments or ""
        assert calls and len(deltas) > len(calls)  # arguments came in several pieces
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls.values():
            jsonschema.validate(json.loads(call["args"]), schemas[call["name"]])
        first_prompt = chunks[-1].usage.prompt_tokens

        # Send the results back; the answer is text this time.
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["args"]},
                }
                for call in calls.values()
            ],
        }
        results = [
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}
            for call in calls.values()
        ]
        answer = await trio.to_thread.run_sync(
            lambda: c.chat.completions.create(
                model=MODEL_ID,
                messages=[*ASK, assistant, *results],
                tools=TOOLS,
                tool_choice="none",
                max_tokens=8,
                seed=3,
            )
        )
        assert live.pool_is_idle()
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None
    # The template rendered the calls and the results into the second prompt.
    assert answer.usage.prompt_tokens > first_prompt + 10


async def test_a_named_tool_choice_calls_exactly_that_function(hermes_loaded):
    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat.completions.create(
                model=MODEL_ID,
                messages=ASK,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                max_tokens=80,
                seed=5,
            )
        )
    msg = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [t.function.name for t in msg.tool_calls] == ["get_time"]
    assert msg.tool_calls[0].id.startswith("call_")
    zone = json.loads(msg.tool_calls[0].function.arguments)["zone"]
    assert -12 <= zone <= 14


async def test_auto_tool_choice_leaves_a_plain_answer_as_content(hermes_loaded):
    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.chat.completions.create(
                model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=10, temperature=0
            )
        )
    # The random model does not write <tool_call>: its nonsense is content.
    assert got.choices[0].message.content and got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_forced_call_on_a_model_without_tool_syntax_is_the_calls_json(loaded, streamed):
    # The demo model's template renders no tools and names no syntax: a forced call is
    # constrained to the call's JSON, as vLLM does on any model (issue 26).
    async with live_server(loaded) as live:
        c = client(live.url)

        def ask() -> tuple[list, str]:
            kw = {"model": MODEL_ID, "messages": ASK, "tools": TOOLS, "max_tokens": 150}
            if not streamed:
                got = c.chat.completions.create(**kw, tool_choice="required", seed=4)
                msg = got.choices[0].message
                calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls or ()]
                return calls, got.choices[0].finish_reason
            named = {"type": "function", "function": {"name": "get_time"}}
            chunks = list(c.chat.completions.create(**kw, tool_choice=named, seed=4, stream=True))
            deltas = [
                d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or ()
            ]
            args = "".join(d.function.arguments or "" for d in deltas)
            names = [d.function.name for d in deltas if d.id]
            return [(names[0], args)], [ch.choices[0].finish_reason for ch in chunks][-1]

        calls, finish = await trio.to_thread.run_sync(ask)
    assert finish == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(json.loads(args), schemas[name])
    assert not streamed or calls[0][0] == "get_time"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS}, "tools"),  # auto: this template shows no tool-call format
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"functions": [{"name": "f"}]}, "functions"),  # the deprecated spelling
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ],
)
async def test_tool_fields_a_plain_model_cannot_honour_are_refused_by_name(loaded, extra, param):
    async with live_server(loaded) as live, httpx.AsyncClient(base_url=live.url) as http:
        body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 5, **extra}
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_a_forced_call_and_a_response_format_together_are_refused(hermes_loaded):
    body = {
        "model": MODEL_ID,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    server = live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512)
    async with server as live, httpx.AsyncClient(base_url=live.url) as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_the_hermes_template_is_read_as_the_hermes_format(hermes_loaded) -> None:
    from triollm.toolcalls import ToolCallFormat, detect_format

    template = hermes_loaded.tokenizer.chat_templates["default"]
    assert detect_format(template) is ToolCallFormat.HERMES
    assert Path(MODEL_DIR).is_dir()
