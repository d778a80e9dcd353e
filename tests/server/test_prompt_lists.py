"""A list of prompts in ``/v1/completions`` (OpenAI's and vLLM's batch; lm-eval sends
it): each prompt gets ``n`` choices, prompt ``i``'s choice ``j`` is index ``i * n + j``,
whole and streamed, the usage summed over the prompts. At temperature 0 each choice
equals its prompt sent alone. The refusals name ``prompt`` or ``prompt[i]``.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio
from serverkit import MODEL_ID, StepGate, live_server, raw_post, read_until, sse_payloads

from triollm.server.openai import MAX_PROMPTS

PROMPTS = ["The cat sat on", "Once upon a time", "1, 2, 3,"]
IDS = [list(range(5, 25)), list(range(30, 41)), list(range(50, 77))]
N = 2


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return await trio.to_thread.run_sync(
        lambda: httpx.post(url + "/v1/completions", json=body, timeout=120)
    )


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    return body | {"ignore_eos": True} | fields


def streamed(r: httpx.Response) -> tuple[dict[int, str], dict[int, str], list[dict[str, Any]]]:
    """(text by index, finish by index, usages) of an SSE body."""
    events = sse_payloads(r.content)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finish[c["index"]] = c["finish_reason"]
    return texts, finish, [e["usage"] for e in events[:-1] if not e["choices"]]


async def alone(url: str, prompt: Any, **fields: Any) -> tuple[str, dict[str, Any]]:
    r = await post(url, completion(prompt, **fields))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]


async def test_three_prompts_of_two_choices_each_equal_each_prompt_alone(loaded):
    async with live_server(loaded, slots=6, context_tokens=128) as live:
        singles = [await alone(live.url, p) for p in PROMPTS]
        r = await post(live.url, completion(PROMPTS, n=N))
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS) * N))
        for c in body["choices"]:
            assert c["text"] == singles[c["index"] // N][0], c["index"]
            assert c["finish_reason"] == "length"
        prompt_tokens = sum(u["prompt_tokens"] for _, u in singles)
        assert body["usage"]["prompt_tokens"] == prompt_tokens
        assert body["usage"]["completion_tokens"] == 6 * N * len(PROMPTS)
        assert body["usage"]["total_tokens"] == prompt_tokens + 6 * N * len(PROMPTS)

        fields = {"stream": True, "stream_options": {"include_usage": True}}
        r = await post(live.url, completion(PROMPTS, n=N, **fields))
        assert r.status_code == 200, r.text
        texts, finish, usages = streamed(r)
        assert sorted(texts) == list(range(len(PROMPTS) * N))
        assert {i: t for i, t in texts.items()} == {
            i: singles[i // N][0] for i in range(len(PROMPTS) * N)
        }
        assert set(finish.values()) == {"length"} and len(finish) == len(PROMPTS) * N
        assert [u["prompt_tokens"] for u in usages] == [prompt_tokens]
        assert usages[0]["completion_tokens"] == 6 * N * len(PROMPTS)
        assert live.pool_is_idle()


async def test_token_id_lists_with_echo_and_logprobs_per_choice(loaded):
    async with live_server(loaded, slots=6, context_tokens=128) as live:
        singles = []
        for p in IDS:
            r = await post(live.url, completion(p, echo=True, logprobs=1))
            assert r.status_code == 200, r.text
            singles.append(r.json()["choices"][0])
        r = await post(live.url, completion(IDS, n=N, echo=True, logprobs=1))
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(len(IDS) * N))
        for c in body["choices"]:
            one = singles[c["index"] // N]
            assert c["text"] == one["text"]
            assert c["logprobs"]["tokens"] == one["logprobs"]["tokens"]
            assert c["logprobs"]["text_offset"] == one["logprobs"]["text_offset"]
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in IDS)
        # a one-element list is one prompt, as before
        r = await post(live.url, completion([IDS[1]]))
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
        assert live.pool_is_idle()


async def test_the_refusals_name_the_field_and_the_element(loaded):
    async with live_server(loaded, slots=6, context_tokens=128) as live:
        cases = [
            ([], "prompt", "must not be empty"),
            (["a", ""], "prompt[1]", "must not be empty"),
            (["a", []], "prompt[1]", "must not be empty"),
            (["a", 5], "prompt[1]", "must be a string or a list of token ids"),
            ([[1, 2], [3, "x"]], "prompt[1]", "token ids"),
            ([[1, 2], [3, -1]], "prompt[1]", "non-negative"),
            ([[1, 2], [3, 2.5]], "prompt[1]", "prompt[1][1] is 2.5"),
            (["a"] * (MAX_PROMPTS + 1), "prompt", f"the limit of {MAX_PROMPTS}"),
        ]
        for prompt, param, words in cases:
            r = await post(live.url, completion(prompt))
            assert r.status_code == 400, (prompt, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (prompt, error)
            assert words in error["message"], (prompt, error)
        # more sequences than the slots: refused with the numbers, nothing queued
        r = await post(live.url, completion(PROMPTS, n=3))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt"
        assert "9 sequences" in error["message"] and "6 slots" in error["message"]
        assert live.pool_is_idle()


async def test_a_prompt_refused_a_queue_place_takes_the_others_out_of_the_queue(loaded):
    # slots 2, one waiter per slot: two running, one queued, then a list of two prompts
    # whose first group takes the last place and whose second is refused (429): the
    # first must leave the queue with it, and nothing of the request is left.
    async with live_server(loaded, slots=2, queue_depth_per_slot=1) as live:
        service = live.service
        gate = StepGate(service)
        running = await raw_post(live.port, "/v1/completions", completion(IDS[0], n=2, stream=True))
        await service.wait_until(lambda: service.scheduler.statistics().running == 2)
        queued = await raw_post(live.port, "/v1/completions", completion(IDS[1], stream=True))
        await service.wait_until(lambda: service.scheduler.statistics().waiting == 1)
        r = await post(live.url, completion(IDS[1:], max_tokens=2))
        assert r.status_code == 429, r.text
        assert service.scheduler.statistics().waiting == 1  # only the one queued before
        gate.open()
        for sock in (running, queued):
            assert await read_until(sock, b"data: [DONE]", bytearray())
            await sock.aclose()
        await service.wait_until(live.pool_is_idle)
