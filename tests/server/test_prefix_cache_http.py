"""The prefix cache at the HTTP edge: cached_tokens in the usage, cache_salt, the
hit/query counters, and ``--prefix-cache off``."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import pytest
import trio
from serverkit import MODEL_ID, live_server

from triollm.server.command import configs_from_args, configure
from triollm.server.openai import ApiError, parse_completion

PROMPT = list(range(5, 45))  # 40 token ids: one full block of 32, then 8 more


async def complete(url: str, **fields: object) -> dict:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    body["temperature"] = 0
    body |= fields
    r = await trio.to_thread.run_sync(
        lambda: httpx.post(url + "/v1/completions", json=body, timeout=60)
    )
    assert r.status_code == 200, r.text
    return r.json()


async def counter(url: str, name: str) -> float:
    text = (await trio.to_thread.run_sync(lambda: httpx.get(url + "/metrics", timeout=30))).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def test_a_repeated_prompt_reports_its_cached_tokens_and_the_counters_move(loaded):
    async with live_server(loaded, block_size=32) as live:
        hits0 = await counter(live.url, "triollm:prefix_cache_hits_total")
        queries0 = await counter(live.url, "triollm:prefix_cache_queries_total")
        first = await complete(live.url)
        again = await complete(live.url)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert await counter(live.url, "triollm:prefix_cache_hits_total") - hits0 == 32
        assert await counter(live.url, "triollm:prefix_cache_queries_total") - queries0 == 80


async def test_another_cache_salt_shares_nothing(loaded):
    async with live_server(loaded, block_size=32) as live:
        await complete(live.url, cache_salt="tenant-a")
        other = await complete(live.url, cache_salt="tenant-b")
        same = await complete(live.url, cache_salt="tenant-a")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_with_the_cache_off_nothing_is_cached_and_the_answer_is_the_same(loaded):
    async with live_server(loaded, block_size=32) as on:
        await complete(on.url)
        cached = await complete(on.url)
    async with live_server(loaded, block_size=32, prefix_cache=False) as off:
        await complete(off.url)
        plain = await complete(off.url)
        assert await counter(off.url, "triollm:prefix_cache_queries_total") == 0
        assert off.service.scheduler.statistics().blocks_cached == 0
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert plain["choices"][0]["text"] == cached["choices"][0]["text"]


def test_the_flag_turns_it_on_by_default_and_off_when_asked():
    parser = argparse.ArgumentParser()
    configure(parser)
    on, _ = configs_from_args(parser.parse_args(["model"]))
    off, _ = configs_from_args(parser.parse_args(["model", "--prefix-cache", "off"]))
    assert (on.prefix_cache, off.prefix_cache) == (True, False)


@pytest.mark.parametrize(("salt", "why"), [(7, "must be a string"), ("", "non-empty")])
def test_a_bad_cache_salt_is_refused_by_name(salt, why):
    with pytest.raises(ApiError) as info:
        parse_completion(json.dumps({"prompt": "hi", "cache_salt": salt}).encode())
    assert info.value.status == 400 and info.value.param == "cache_salt"
    assert why in info.value.message
