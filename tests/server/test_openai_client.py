"""The official ``openai`` client, unmodified, against a live server."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from functools import partial

import openai
import pytest
import trio
from serverkit import MODEL_DIR, MODEL_ID, live_server

from triollm import cli

PROMPT = "Hello there"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate_cli(prompt: str, max_tokens: int) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli.main(
            [
                "generate",
                str(MODEL_DIR),
                "--prompt",
                prompt,
                "--max-tokens",
                str(max_tokens),
                "--temperature",
                "0",
                "--json",
            ]
        )
    assert status == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


async def test_completions_greedy_equals_triollm_generate(loaded):
    expected = generate_cli(PROMPT, 12)
    async with live_server(loaded) as live:
        c = client(live.url)
        got = await trio.to_thread.run_sync(
            lambda: c.completions.create(
                model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0
            )
        )
    assert got.choices[0].text == expected["text"]
    assert got.choices[0].finish_reason == expected["finish_reason"]
    assert got.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert got.usage.completion_tokens == len(expected["token_ids"])


async def test_completions_stream_with_usage(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)

        def run() -> list:
            stream = c.completions.create(
                model=MODEL_ID,
                prompt=PROMPT,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await trio.to_thread.run_sync(run)
        whole = await trio.to_thread.run_sync(
            lambda: c.completions.create(
                model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0
            )
        )
        assert live.pool_is_idle()
    *text_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 10
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text


async def test_chat_completions_stream_and_not(loaded):
    messages = [{"role": "user", "content": "hi"}]
    async with live_server(loaded) as live:
        c = client(live.url)
        whole = await trio.to_thread.run_sync(
            lambda: c.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=8, temperature=0
            )
        )

        def streamed() -> list:
            return list(
                c.chat.completions.create(
                    model=MODEL_ID,
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await trio.to_thread.run_sync(streamed)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
    assert text == whole.choices[0].message.content


async def test_seeded_sampling_reproduces_and_logprobs_come_back(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        make = partial(
            c.completions.create,
            model=MODEL_ID,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0.9,
            top_p=0.95,
            seed=1234,
            logprobs=2,
        )
        a = await trio.to_thread.run_sync(make)
        b = await trio.to_thread.run_sync(make)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)


async def test_client_errors_reach_the_openai_client_with_the_field_named(loaded):
    async with live_server(loaded) as live:
        c = client(live.url)
        with pytest.raises(openai.BadRequestError) as bad:
            await trio.to_thread.run_sync(
                lambda: c.completions.create(model=MODEL_ID, prompt="x", n=3)
            )
        assert bad.value.body["param"] == "n"  # three choices, two slots
        with pytest.raises(openai.NotFoundError):
            await trio.to_thread.run_sync(
                lambda: c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
            )
        with pytest.raises(openai.BadRequestError) as long:
            await trio.to_thread.run_sync(
                lambda: c.completions.create(model=MODEL_ID, prompt="x", max_tokens=100_000)
            )
        assert long.value.body["param"] == "max_tokens"
        assert "256" in long.value.body["message"]  # the context, in numbers
        models = await trio.to_thread.run_sync(lambda: c.models.list())
        assert [m.id for m in models.data] == [MODEL_ID]
