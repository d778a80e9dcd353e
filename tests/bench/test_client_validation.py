"""The load generator is the server's client: protocol faults are reported, not hidden.

Each test is a fake server (an ``httpx.MockTransport`` answering with the SSE body
given) that gets one thing wrong, and checks what the record says.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from triollm.bench.client import send
from triollm.bench.stats import Outcome, Problem
from triollm.bench.workload import Api, Request

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
