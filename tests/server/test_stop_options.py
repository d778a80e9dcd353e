"""vLLM's stop options on the live path: ``stop_token_ids``, ``min_tokens``,
``include_stop_str_in_output`` (the text rules are tests/test_textstream.py's; here
the sampler's part and the HTTP fields, against the fixture model, greedy)."""

from __future__ import annotations

from typing import Any

import httpx
import trio
from serverkit import MODEL_ID, live_server

from triollm.model.sampling import SamplingParams
from triollm.service import Completed
from triollm.spec import GenerationSpec

PROMPT = "Hello there"


async def greedy_ids(live: Any, n: int) -> list[int]:
    """The first ``n`` greedy token ids of PROMPT, EOS ignored (read from the service)."""
    prompt = live.stack.served.tokenizer.encode(PROMPT)
    # logprobs=0: the deltas carry each token (with its own log-probability only)
    stream = await live.service.submit(
        GenerationSpec(prompt, SamplingParams(temperature=0.0, logprobs=0), n)
    )
    ids: list[int] = []
    try:
        async for delta in stream:
            ids += [t.token_id for t in delta.tokens]
    finally:
        stream.close()
    assert isinstance(stream.outcome, Completed)
    ids += [t.token_id for t in stream.outcome.final.tokens]
    return ids


async def complete(live: Any, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_ID, "prompt": PROMPT, "temperature": 0, "max_tokens": 8} | fields
    return await trio.to_thread.run_sync(
        lambda: httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    )


async def test_a_stop_token_id_ends_the_answer_as_eos_does(loaded):
    async with live_server(loaded) as live:
        ids = await greedy_ids(live, 8)
        stop = ids[3]
        r = await complete(live, ignore_eos=True, stop_token_ids=[stop])
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == ids.index(stop) + 1


async def test_min_tokens_keeps_the_stop_ids_from_being_sampled_that_early(loaded):
    async with live_server(loaded) as live:
        ids = await greedy_ids(live, 8)
        first = ids[0]
        r = await complete(live, ignore_eos=True, stop_token_ids=[first])
        assert r.json()["usage"]["completion_tokens"] == 1  # greedy picks it at once
        r = await complete(live, ignore_eos=True, stop_token_ids=[first], min_tokens=3)
        assert r.json()["usage"]["completion_tokens"] >= 3
        assert live.pool_is_idle()


async def test_include_stop_str_in_output_keeps_the_stop_string(loaded):
    async with live_server(loaded) as live:
        text = (await complete(live, ignore_eos=True)).json()["choices"][0]["text"]
        assert len(text) >= 5, text
        stop = text[2:5]
        at = text.find(stop)
        cut = (await complete(live, ignore_eos=True, stop=[stop])).json()["choices"][0]
        kept = await complete(live, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
        assert cut["text"] == text[:at] and cut["finish_reason"] == "stop"
        assert kept.json()["choices"][0]["text"] == text[: at + len(stop)]


async def test_the_stop_fields_are_checked_and_named(loaded):
    async with live_server(loaded) as live:
        for fields, param in (
            ({"stop_token_ids": [10**6]}, "stop_token_ids"),
            ({"stop_token_ids": "2"}, "stop_token_ids"),
            ({"stop_token_ids": [-1]}, "stop_token_ids"),
            ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens (8)
            ({"min_tokens": -1}, "min_tokens"),
            ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ):
            r = await complete(live, **fields)
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param


async def test_min_tokens_raises_the_completions_default_of_16(loaded):
    async with live_server(loaded) as live:
        r = await complete(live, ignore_eos=True, max_tokens=None, min_tokens=20)
        assert r.json()["usage"]["completion_tokens"] == 20
