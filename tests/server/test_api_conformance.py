"""What users of the peers expect: /v1/models/{id}, the developer role, text parts
joined as vLLM joins them, more stop strings, /health while warming, metrics that
reach long CPU requests and carry the process's CPU and memory."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio
from serverkit import MODEL_ID, live_server

from triollm.server.openai import MAX_STOP_SEQUENCES, parse_chat, parse_completion
from triollm.service import Lifecycle


async def get(url: str) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.get(url, timeout=30))


async def test_a_model_can_be_retrieved_by_id(loaded):
    async with live_server(loaded) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        card = await trio.to_thread.run_sync(lambda: c.models.retrieve(MODEL_ID))
        assert card.id == MODEL_ID
        with pytest.raises(openai.NotFoundError):
            await trio.to_thread.run_sync(lambda: c.models.retrieve("other/model"))


async def test_the_developer_role_is_the_system_role_for_a_template_without_it(loaded):
    async with live_server(loaded) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)

        def answer(role: str) -> str:
            r = c.chat.completions.create(
                model=MODEL_ID,
                messages=[
                    {"role": role, "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ],
                max_tokens=6,
                temperature=0,
            )
            return r.choices[0].message.content or ""

        assert "developer" not in loaded.tokenizer.chat_templates["default"]
        assert await trio.to_thread.run_sync(answer, "developer") == await trio.to_thread.run_sync(
            answer, "system"
        )


def test_text_parts_are_joined_with_a_newline_as_vllm_does():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    req = parse_chat(
        b'{"messages": [{"role": "user", "content": %s}]}' % repr(parts).replace("'", '"').encode()
    )
    assert req.messages is not None and req.messages[0].content == "Hello\nworld"


def test_up_to_the_stated_number_of_stop_strings_is_accepted():
    stops = [f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    body = json.dumps({"prompt": "x", "stop": stops}).encode()
    assert parse_completion(body).stop == tuple(stops)
    assert MAX_STOP_SEQUENCES >= 9  # code-completion clients send about nine


async def test_health_is_503_while_warming_up_and_200_while_draining(loaded):
    async with live_server(loaded) as live:
        assert (await get(live.url + "/health")).status_code == 200
        live.service.state = Lifecycle.STARTING  # as before warm_up completes
        r = await get(live.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        live.service.state = Lifecycle.READY


async def test_metrics_reach_long_requests_and_carry_process_figures(loaded):
    async with live_server(loaded) as live:
        text = (await get(live.url + "/metrics")).text
        bucket = (
            f'triollm:e2e_request_latency_seconds_bucket{{le="7680.0",model_name="{MODEL_ID}"}}'
        )
        assert bucket in text
        assert "process_resident_memory_bytes" in text
        assert "process_cpu_seconds_total" in text


async def test_completions_without_max_tokens_get_openais_16_and_chat_the_rest(loaded):
    async with live_server(loaded) as live:
        body = {"model": MODEL_ID, "prompt": "Hi", "ignore_eos": True}
        r = await trio.to_thread.run_sync(
            lambda: httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        )
        assert r.json()["usage"]["completion_tokens"] == 16


async def test_tokenize_and_detokenize_as_vllm_and_llama_server_offer_them(loaded):
    tok = loaded.tokenizer
    async with live_server(loaded) as live:

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(live.url + path, json=body, timeout=30)

        r = await trio.to_thread.run_sync(post, "/tokenize", {"prompt": "Hello world"})
        assert r.json()["tokens"] == tok.encode("Hello world")
        assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 256
        r = await trio.to_thread.run_sync(post, "/tokenize", {"content": "Hello world"})
        assert r.json()["tokens"] == tok.encode("Hello world")  # llama-server's key
        msgs = [{"role": "user", "content": "Hi"}]
        r = await trio.to_thread.run_sync(post, "/tokenize", {"messages": msgs})
        assert r.json()["tokens"] == tok.encode_chat(msgs)
        ids = tok.encode("Hello world", add_special_tokens=False)
        r = await trio.to_thread.run_sync(post, "/detokenize", {"tokens": ids})
        assert r.json()["prompt"] == r.json()["content"] == tok.decode(ids)
        r = await trio.to_thread.run_sync(post, "/detokenize", {"tokens": [10**9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        # More ids than the context holds: refused, naming the limit. A 3.2 MB request
        # came back as 137 MB (issue 28, N9).
        r = await trio.to_thread.run_sync(post, "/detokenize", {"tokens": ids * 200})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert "256" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bad_words", ["x"]),
        ("allowed_token_ids", [2]),
    ],
)
def test_vllm_fields_that_change_the_output_are_refused_by_name_not_ignored(field, value):
    from triollm.server.openai import ApiError

    with pytest.raises(ApiError) as info:
        parse_completion(json.dumps({"prompt": "x", field: value}).encode())
    assert info.value.param == field and "not supported" in info.value.message
    # Their neutral values change nothing and pass.
    assert parse_completion(json.dumps({"prompt": "x", field: type(value)()}).encode())


async def test_echo_returns_the_prompt_before_the_answer_whole_and_streamed(loaded):
    async with live_server(loaded) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        args = {"model": MODEL_ID, "max_tokens": 5, "temperature": 0}

        def text(**extra) -> str:
            return c.completions.create(**args, **extra).choices[0].text

        def streamed(**extra) -> list[str]:
            return [e.choices[0].text for e in c.completions.create(**args, stream=True, **extra)]

        plain = await trio.to_thread.run_sync(lambda: text(prompt="Hello"))
        echoed = await trio.to_thread.run_sync(lambda: text(prompt="Hello", echo=True))
        assert echoed == "Hello" + plain
        events = await trio.to_thread.run_sync(lambda: streamed(prompt="Hello", echo=True))
        assert events[0] == "Hello" and "".join(events) == echoed  # the prompt comes first
        ids = loaded.tokenizer.encode("Hello")
        by_ids = await trio.to_thread.run_sync(lambda: text(prompt=ids, echo=True))
        assert by_ids.startswith(loaded.tokenizer.decode(ids))


def test_chat_has_no_echo():
    from triollm.server.openai import ApiError

    with pytest.raises(ApiError) as info:
        parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "echo": true}')
    assert info.value.param == "echo"
    # echo with logprobs on /v1/completions: tests/server/test_echo_logprobs.py
