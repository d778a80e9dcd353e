"""The client side of the cluster measurements: streamed requests, classified exactly.

A request through the cluster ends in one of these ways, and the failover
measurements count each:

- ``ok``: 200, a ``finish_reason``, then ``data: [DONE]``;
- ``cut``: 200 and some of the stream, then the connection broke (its replica died
  mid-stream; Envoy cannot retry once headers went out). The client sees a chunked
  body that ends without its terminating chunk: httpx raises ``RemoteProtocolError``,
  a clear error, not a hang;
- ``refused``: a status other than 200 (a 429 or 503 that every retry met too);
- ``failed``: no response at all (connection refused or reset before a status);
- ``hung``: nothing arrived for ``idle_timeout_s``: the one outcome that must never
  happen, since it means a client waits for a stream nobody will finish.

There is no retry here: every retry a measurement credits is Envoy's. (The bench
client of ``triollm bench serve`` sends a request once more after a stale pooled
connection fails, which would hide a reset the proxy should have retried.)
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

OUTCOMES = ("ok", "cut", "refused", "failed", "hung")


@dataclass
class Result:
    outcome: str
    sent_s: float
    done_s: float
    status: int | None = None
    ttft_s: float | None = None  # to the first chunk carrying text
    tokens: int = 0  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    detail: str = ""  # the error the client saw, for cut / refused / failed / hung


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0-100); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    t0: float,
    idle_timeout_s: float = 60.0,
) -> Result:
    """POST ``body`` (a streamed completion or chat) to ``url`` and classify the end."""
    sent = time.perf_counter() - t0
    status: int | None = None
    ttft: float | None = None
    usage: dict[str, Any] = {}
    finish = done = False

    def result(outcome: str, detail: str = "") -> Result:
        details = usage.get("prompt_tokens_details") or {}
        return Result(
            outcome,
            sent,
            time.perf_counter() - t0,
            status,
            ttft,
            int(usage.get("completion_tokens") or 0),
            details.get("cached_tokens"),
            detail,
        )

    timeout = httpx.Timeout(idle_timeout_s, connect=5.0)
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode(errors="replace")
                return result("refused", text[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    return result("cut", json.dumps(event["error"])[:200])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0 - sent
                    if choice.get("finish_reason"):
                        finish = True
    except httpx.TimeoutException as exc:
        return result("hung", f"{type(exc).__name__}: nothing for {idle_timeout_s:g} s")
    except httpx.HTTPError as exc:
        return result("failed" if status is None else "cut", f"{type(exc).__name__}: {exc}")
    if finish and done:
        return result("ok")
    return result("cut", "the stream ended without finish_reason and [DONE]")


WORDS = ("river", "stone", "lantern", "meadow", "quiet", "harbor", "copper", "violet", "maple",
         "orbit", "candle", "forest", "ember", "glacier", "canyon", "beacon", "falcon")  # fmt: skip


def story_body(rng: random.Random, max_tokens: int, words: int = 12) -> dict[str, Any]:
    """A streamed completion of a short random prompt that runs to ``max_tokens``."""
    prompt = "Once upon a time " + " ".join(rng.choice(WORDS) for _ in range(words))
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def closed_loop(
    url: str,
    concurrency: int,
    requests: int,
    make_body: Callable[[random.Random], dict[str, Any]],
    *,
    seed: int = 0,
    deadline_s: float = 600.0,
    idle_timeout_s: float = 60.0,
    on_result: Callable[[Result], None] | None = None,
) -> tuple[list[Result], float]:
    """``concurrency`` workers send ``requests`` requests in all, back to back; stop
    issuing at ``deadline_s``. Returns the results and the wall time."""
    results: list[Result] = []
    left = requests
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker(index: int) -> None:
            nonlocal left
            rng = random.Random(seed * 1000 + index)
            while left > 0 and time.perf_counter() - t0 < deadline_s:
                left -= 1
                r = await stream_one(
                    client, url, make_body(rng), t0=t0, idle_timeout_s=idle_timeout_s
                )
                results.append(r)
                if on_result is not None:
                    on_result(r)

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(worker, i)
    return results, time.perf_counter() - t0


def counts(results: list[Result]) -> dict[str, int]:
    return {o: sum(r.outcome == o for r in results) for o in OUTCOMES}


async def scrape(url: str) -> dict[str, float]:
    """``/metrics`` of one replica as {series (with labels): value}."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(url + "/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def series(page: dict[str, float], name: str) -> float:
    """The sum of every sample of ``name`` (whatever its labels) on a scraped page."""
    return sum(v for k, v in page.items() if k == name or k.startswith(name + "{"))
