"""/metrics against the Gateway API Inference Extension's Model Server Protocol.

The endpoint picker scrapes three gauges whose names are free and whose meaning is
fixed (queued requests, running requests, KV-cache usage as a 0-1 fraction), reads
the pool's shape from ``cache_config_info`` (value 1, labels ``block_size`` and
``num_gpu_blocks``) and, for prefix-aware scoring, the prefix cache's query and hit
counters. These tests scrape the page of a live server while its generation is held
still (a StepGate: the load is exactly what the test made it) and after it ran, and
check the types, the ranges and that each value moves as the protocol says. The
``vllm`` naming (``--metrics-names vllm``) must carry the same series under vLLM's
names, since routers that hard-code them read nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from serverkit import StepGate, live_server

from triollm.policies import policy_name
from triollm.server.metrics import Metrics

GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], name: str) -> float:
    fam = fams[name]
    samples = [s for s in fam.samples if s.name in (name, name + "_total")]
    assert len(samples) == 1, samples
    return samples[0].value


def check_types(fams: dict[str, Any], prefix: str) -> None:
    for gauge in GAUGES:
        assert fams[f"{prefix}:{gauge}"].type == "gauge", gauge
    for counter in COUNTERS:
        assert fams[f"{prefix}:{counter}"].type == "counter", counter
    info = fams[f"{prefix}:cache_config_info"]
    assert info.type == "gauge"


async def scrape(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return families(response.text)


def body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


async def test_the_gauges_and_counters_move_as_the_protocol_says(loaded: Any) -> None:
    slots, block_size = 2, 16
    async with (
        # a stall budget unlike the chunk's, so the info gauge must carry the real one
        live_server(loaded, slots=slots, block_size=block_size, stall_rows=5) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        service = live.service
        config = service.scheduler.config
        idle = await scrape(http)
        check_types(idle, "triollm")
        # At rest: nothing queued or running, no block held.
        assert value(idle, "triollm:num_requests_waiting") == 0
        assert value(idle, "triollm:num_requests_running") == 0
        assert value(idle, "triollm:kv_cache_usage_perc") == 0
        (info,) = idle["triollm:cache_config_info"].samples  # one pool, one sample
        assert info.value == 1
        assert info.labels["block_size"] == str(block_size)
        assert info.labels["num_gpu_blocks"] == str(config.num_blocks)
        # the step budget the scheduler really runs with (stall_rows is resolved from
        # the model's size when not given, so only the running config can say it)
        (budget,) = idle["triollm:scheduler_config_info"].samples
        assert budget.value == 1
        assert {k: budget.labels[k] for k in ("slots", "chunk_tokens", "step_rows")} == {
            "slots": str(config.slots),
            "chunk_tokens": str(config.chunk_tokens),
            "step_rows": str(config.step_rows),
        }
        assert budget.labels["stall_rows"] == str(config.stall_rows) == "5"
        assert budget.labels["policy"] == policy_name(config.policy)
        queries0 = value(idle, "triollm:prefix_cache_queries")

        gate = StepGate(service)
        prompt = "Once upon a time there was a lighthouse keeper who loved the sea. " * 3
        answers: list[int] = []

        async def ask() -> None:
            response = await http.post("/v1/completions", json=body(prompt, 8))
            answers.append(response.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(slots + 2):
                nursery.start_soon(ask)
            stats = service.scheduler.statistics
            await service.wait_until(lambda: stats().running == slots and stats().waiting == 2)
            held = await scrape(http)
            # Under load, held still: both slots run, two wait, blocks are held.
            assert value(held, "triollm:num_requests_running") == slots
            assert value(held, "triollm:num_requests_waiting") == 2
            usage = value(held, "triollm:kv_cache_usage_perc")
            assert 0 < usage <= 1
            assert usage == stats().blocks_held / config.num_blocks
            gate.open()
        assert answers == [200] * (slots + 2)
        await service.wait_until(live.pool_is_idle)
        after = await scrape(http)
        assert value(after, "triollm:num_requests_waiting") == 0
        assert value(after, "triollm:num_requests_running") == 0
        assert value(after, "triollm:kv_cache_usage_perc") == 0
        # Every admitted prompt was looked up; the same prompt again found its blocks.
        queries = value(after, "triollm:prefix_cache_queries") - queries0
        hits = value(after, "triollm:prefix_cache_hits")
        assert queries >= (slots + 2) * 10
        assert 0 < hits <= value(after, "triollm:prefix_cache_queries")


async def test_vllm_names_carry_the_same_series_for_routers_that_hard_code_them(
    loaded: Any,
) -> None:
    async with (
        live_server(loaded, metrics_names="vllm") as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        response = await http.post("/v1/completions", json=body("Hello there", 4))
        assert response.status_code == 200
        text = (await http.get("/metrics")).text
    fams = families(text)
    check_types(fams, "vllm")
    assert not any(name.startswith("triollm:") for name in fams)
    # vLLM before 0.10 (and the production-stack router) read the usage under this name.
    assert fams["vllm:gpu_cache_usage_perc"].type == "gauge"
    assert value(fams, "vllm:gpu_cache_usage_perc") == value(fams, "vllm:kv_cache_usage_perc")
    assert fams["vllm:generation_tokens"].type == "counter"
    assert value(fams, "vllm:generation_tokens") >= 4


def test_an_unknown_naming_is_refused() -> None:
    try:
        Metrics("m", names="sglang")
    except ValueError as exc:
        assert "sglang" in str(exc)
    else:
        raise AssertionError("Metrics accepted names='sglang'")


async def test_every_response_reports_its_cached_tokens(loaded: Any) -> None:
    # The endpoint picker records usage.prompt_tokens_details.cached_tokens from
    # responses: on completions and chat, whole and streamed (with include_usage).
    prompt = "The lighthouse keeper counted the ships that passed the rocks at night. " * 2
    chat = [{"role": "user", "content": prompt}]
    async with (
        live_server(loaded) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        seen: list[int] = []
        for path, extra in (
            ("/v1/completions", {"prompt": prompt}),
            ("/v1/chat/completions", {"messages": chat}),
        ):
            for stream in (False, True, False):
                body = {"max_tokens": 2, "temperature": 0, **extra}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                response = await http.post(path, json=body)
                assert response.status_code == 200
                if stream:
                    events = [
                        line[6:]
                        for line in response.text.splitlines()
                        if line.startswith("data: {")
                    ]
                    usage = [json.loads(e)["usage"] for e in events if json.loads(e).get("usage")]
                    (usage_of,) = usage
                else:
                    usage_of = response.json()["usage"]
                cached = usage_of["prompt_tokens_details"]["cached_tokens"]
                assert 0 <= cached < usage_of["prompt_tokens"]
                seen.append(cached)
    # The same prompt again finds its blocks: the second and third asks of each path.
    assert seen[1] > 0 and seen[2] > 0 and seen[4] > 0 and seen[5] > 0
