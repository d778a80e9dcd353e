"""The load generator is the server's client: protocol faults are reported, not hidden.

Each test is a fake server (an ``httpx.MockTransport`` answering with the SSE body
given) that gets one thing wrong, and checks what the record says.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from triollm.bench.client import send, word_ids
from triollm.bench.stats import Outcome, Problem
from triollm.bench.workload import Api, Request
from triollm.errors import UserError

IDS = (11, 12, 13, 14)


def request(max_tokens: int = 3) -> Request:
    body = {"model": "m", "prompt": list(IDS), "max_tokens": max_tokens, "stream": True}
    return Request(body, IDS, max_tokens)


def chunk(text: str = "", finish: str | None = None, usage: dict | None = None) -> str:
    payload: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        payload["usage"] = usage
    return f"data: {json.dumps(payload)}\n\n"


def usage(prompt: int = 4, completion: int = 3) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


GOOD = [chunk("a"), chunk("b"), chunk("c", "length"), chunk(usage=usage()), "data: [DONE]\n\n"]


async def fetch(events: list[str], status: int = 200, headers: dict | None = None, **kw):
    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status,
            headers={"content-type": "text/event-stream", **(headers or {})},
            content="".join(events).encode(),
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await send(
            client, "http://127.0.0.1:1", Api.COMPLETIONS, kw.get("req") or request(), t0=0.0
        )


def kinds(record) -> list[Problem]:
    return [k for k, _ in record.problems]


async def test_a_correct_stream_is_ok_with_no_problems_and_its_usage_counts() -> None:
    r = await fetch(GOOD)
    assert r.outcome is Outcome.OK and r.problems == ()
    assert r.output_tokens == 3 and len(r.chunk_s) == 3 and r.text == "abc"
    assert r.prompt_tokens == 4 and r.finish_reason == "length"


async def test_a_stream_without_done_is_reported() -> None:
    r = await fetch(GOOD[:-1])
    assert kinds(r) == [Problem.NO_DONE]


async def test_usage_that_counts_fewer_tokens_than_arrived_is_reported() -> None:
    r = await fetch([*GOOD[:3], chunk(usage=usage(completion=2)), "data: [DONE]\n\n"])
    assert Problem.USAGE_MISMATCH in kinds(r)
    assert any("3 chunks carried text" in d for _, d in r.problems)


async def test_usage_that_miscounts_the_prompt_is_reported() -> None:
    r = await fetch([*GOOD[:3], chunk(usage=usage(prompt=5)), "data: [DONE]\n\n"])
    assert kinds(r) == [Problem.USAGE_MISMATCH]
    assert "usage.prompt_tokens=5 but 4 token ids were sent" in r.problems[0][1]


async def test_a_length_finish_short_of_max_tokens_is_reported() -> None:
    r = await fetch(GOOD, req=request(max_tokens=8))
    assert kinds(r) == [Problem.USAGE_MISMATCH]
    assert "max_tokens=8" in r.problems[0][1]


async def test_missing_usage_is_reported() -> None:
    r = await fetch([*GOOD[:3], "data: [DONE]\n\n"])
    assert kinds(r) == [Problem.USAGE_MISSING]
    assert r.output_tokens == 3  # counted from the chunks instead


async def test_an_error_event_cuts_the_stream_and_is_reported() -> None:
    error = 'data: {"error": {"message": "engine failed", "type": "server_error"}}\n\n'
    r = await fetch([chunk("a"), error, "data: [DONE]\n\n"])
    assert r.outcome is Outcome.CUT
    assert Problem.ERROR_EVENT in kinds(r)
    assert "engine failed" in dict(r.problems)[Problem.ERROR_EVENT]


async def test_garbage_and_data_after_done_are_reported() -> None:
    r = await fetch([*GOOD[:2], "data: {not json\n\n", *GOOD[2:], chunk("late")])
    assert kinds(r) == [Problem.BAD_EVENT, Problem.DATA_AFTER_DONE]
    assert r.outcome is Outcome.OK


async def test_a_429_is_counted_with_its_retry_after() -> None:
    r = await fetch(['{"error": "busy"}'], status=429, headers={"retry-after": "3"})
    assert r.outcome is Outcome.RATE_LIMITED and r.retry_after == "3" and r.status == 429


async def test_4xx_and_5xx_are_told_apart() -> None:
    assert (await fetch(["{}"], status=400)).outcome is Outcome.CLIENT_ERROR
    assert (await fetch(["{}"], status=503)).outcome is Outcome.SERVER_ERROR


async def test_a_connection_that_breaks_mid_stream_is_a_cut_stream() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield chunk("a").encode()
        raise httpx.ReadError("connection reset by peer")

    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send(client, "http://127.0.0.1:1", Api.COMPLETIONS, request(), t0=0.0)
    assert r.outcome is Outcome.CUT
    assert kinds(r) == [Problem.NO_DONE]
    assert "ReadError" in r.problems[0][1]
    assert len(r.chunk_s) == 1


async def test_a_refused_connection_is_no_connection() -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send(client, "http://127.0.0.1:1", Api.COMPLETIONS, request(), t0=0.0)
    assert r.outcome is Outcome.NO_CONNECTION and r.status is None


async def test_a_200_that_is_not_an_event_stream_is_reported() -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "whole"}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send(client, "http://127.0.0.1:1", Api.COMPLETIONS, request(), t0=0.0)
    assert r.outcome is Outcome.CUT and kinds(r) == [Problem.BAD_EVENT]


async def served_after(failures: list[Exception]) -> httpx.AsyncClient:
    """A fake server whose first requests fail as ``failures`` say, then answer GOOD."""

    async def handler(req: httpx.Request) -> httpx.Response:
        if failures:
            raise failures.pop(0)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content="".join(GOOD).encode()
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_a_connection_closed_while_idle_is_tried_once_more_and_the_stream_counts() -> None:
    stale = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    async with await served_after([stale]) as client:
        r = await send(client, "http://127.0.0.1:1", Api.COMPLETIONS, request(), t0=0.0)
    assert r.outcome is Outcome.OK and r.problems == ()


async def test_a_second_failure_before_any_response_is_no_connection() -> None:
    failures: list[Exception] = [httpx.ReadError("reset"), httpx.ReadError("reset again")]
    async with await served_after(failures) as client:
        r = await send(client, "http://127.0.0.1:1", Api.COMPLETIONS, request(), t0=0.0)
    assert r.outcome is Outcome.NO_CONNECTION and r.status is None


def timed(text: str, predicted: int, finish: str | None = None, **extra) -> str:
    """A llama-server chunk with timings_per_token: the tokens generated so far."""
    payload: dict = {
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        "timings": {"predicted_n": predicted},
        **extra,
    }
    return f"data: {json.dumps(payload)}\n\n"


async def test_the_servers_running_token_count_says_a_chunk_carried_three_tokens() -> None:
    # "a" (1 token), then a CJK character held back until its 3rd byte-token arrived;
    # the final chunk repeats the total (no new token) with the usage
    events = [
        timed("a", 1),
        timed("\u5b57", 4),
        timed("", 4, "length", usage=usage(completion=4)),
        "data: [DONE]\n\n",
    ]
    r = await fetch(events, req=request(max_tokens=4))
    assert r.problems == () and r.outcome is Outcome.OK
    assert r.chunk_tokens == (1, 3) and len(r.chunk_s) == 2 and r.output_tokens == 4


async def test_a_final_chunk_without_text_that_counts_tokens_is_a_chunk_of_output() -> None:
    # the last two byte-tokens never made a character: no partial chunk, the final one
    # counts them
    events = [timed("a", 1), timed("", 3, "length", usage=usage()), "data: [DONE]\n\n"]
    r = await fetch(events)
    assert r.problems == () and r.chunk_tokens == (1, 2) and len(r.chunk_s) == 2


async def test_running_counts_that_disagree_with_usage_are_reported() -> None:
    events = [timed("a", 1), timed("b", 2, "length", usage=usage()), "data: [DONE]\n\n"]
    r = await fetch(events)
    assert kinds(r) == [Problem.USAGE_MISMATCH]
    assert "add up to 2 but usage.completion_tokens=3" in r.problems[0][1]


async def test_a_stream_without_counts_leaves_them_to_be_inferred() -> None:
    r = await fetch(GOOD)
    assert r.chunk_tokens == () and r.tokens_by_chunk == (1, 1, 1)


def ignoring_eos(max_tokens: int = 3) -> Request:
    req = request(max_tokens)
    return Request(req.body | {"ignore_eos": True}, req.prompt_ids, max_tokens)


async def test_ignore_eos_holds_every_answer_to_max_tokens() -> None:
    assert (await fetch(GOOD, req=ignoring_eos())).problems == ()
    # the server stopped at a stop token although ignore_eos was sent
    stopped = [chunk("a"), chunk("b", "stop"), chunk(usage=usage(completion=2)), "data: [DONE]\n\n"]
    r = await fetch(stopped, req=ignoring_eos())
    assert kinds(r) == [Problem.NOT_MAX_TOKENS]
    assert "max_tokens=3 but usage.completion_tokens=2, finish_reason 'stop'" in r.problems[0][1]
    # without ignore_eos an early stop is the model's right
    assert (await fetch(stopped, req=request())).problems == ()


async def test_words_are_tokenized_by_the_server_with_their_leading_space() -> None:
    vocab = {" the": [5], " world": [6, 7]}
    seen: list[dict] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append(body)
        if req.url.path != "/tokenize":
            return httpx.Response(404, json={"error": "no such route"})
        return httpx.Response(200, json={"tokens": vocab[body["content"]]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        assert await word_ids(client, "http://127.0.0.1:1", ["the", "world"]) == ((5,), (6, 7))
        assert all(b["add_special"] is False for b in seen)  # no BOS inside a prompt
        with pytest.raises(UserError, match="--prompt-kind ids"):
            await word_ids(client, "http://127.0.0.1:1/v1", ["the"])  # 404: no /tokenize
