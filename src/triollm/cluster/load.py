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

A body without ``"stream": true`` is sent whole (:func:`whole_one`): one JSON document
per answer instead of one event per token. That is the light client of the scaling
measure, where the client shares the cores with the replicas it measures: parsing
every chunk in Python costs the client (and Envoy, which forwards each one) CPU the
replicas would otherwise have. The CPU accounting at the end of this module says
how much each process took.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def _result(
    outcome: str,
    detail: str,
    *,
    sent: float,
    t0: float,
    status: int | None,
    ttft: float | None,
    usage: dict[str, Any] | None,
) -> Result:
    """One request's end, streamed or whole: its times from ``t0`` and what ``usage``
    counted (the answer's tokens and the prompt tokens the prefix cache served)."""
    usage = usage or {}
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
        return _result(outcome, detail, sent=sent, t0=t0, status=status, ttft=ttft, usage=usage)

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


async def whole_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    t0: float,
    idle_timeout_s: float = 60.0,
) -> Result:
    """POST ``body`` (a completion or chat *not* streamed) and classify the end: ``ok``
    when the answer is a 200 whose every choice has a ``finish_reason``. No TTFT: the
    first token arrives with the last."""
    sent = time.perf_counter() - t0
    status: int | None = None

    def result(outcome: str, detail: str = "", usage: dict[str, Any] | None = None) -> Result:
        return _result(outcome, detail, sent=sent, t0=t0, status=status, ttft=None, usage=usage)

    timeout = httpx.Timeout(idle_timeout_s, connect=5.0)
    try:
        response = await client.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as exc:
        return result("hung", f"{type(exc).__name__}: nothing for {idle_timeout_s:g} s")
    except httpx.HTTPError as exc:
        return result("failed", f"{type(exc).__name__}: {exc}")
    status = response.status_code
    if status != 200:
        return result("refused", response.text[:200])
    try:
        answer = response.json()
    except ValueError:
        return result("cut", f"not JSON: {response.text[:120]!r}")
    choices = answer.get("choices") or []
    if not choices or not all(c.get("finish_reason") for c in choices):
        return result("cut", "an answer without finish_reason")
    return result("ok", usage=answer.get("usage"))


WORDS = ("river", "stone", "lantern", "meadow", "quiet", "harbor", "copper", "violet", "maple",
         "orbit", "candle", "forest", "ember", "glacier", "canyon", "beacon", "falcon")  # fmt: skip


def story_body(
    rng: random.Random, max_tokens: int, words: int = 12, *, stream: bool = True
) -> dict[str, Any]:
    """A completion of a short random prompt that runs to ``max_tokens`` (streamed,
    or whole with ``stream=False``)."""
    prompt = "Once upon a time " + " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


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
                body = make_body(rng)
                send = stream_one if body.get("stream") else whole_one
                r = await send(client, url, body, t0=t0, idle_timeout_s=idle_timeout_s)
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


# ------------------------------------------------------------------ CPU accounting

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) process ``pid`` has used so far.

    From ``/proc/PID/stat``: utime and stime are its fields 14 and 15, in clock
    ticks. Field 2, the command name in parentheses, may itself hold spaces and
    parentheses, so the fields are counted from after its last ``)``."""
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def stat_cpu_seconds(text: str) -> float:
    """utime + stime of one ``/proc/PID/stat`` line, in seconds."""
    after = text[text.rindex(")") + 2 :].split()  # from field 3 (the state) on
    return (int(after[14 - 3]) + int(after[15 - 3])) / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy (every core, every process) since
    boot: ``/proc/stat``'s first line less its idle and iowait columns."""
    columns = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(columns) - columns[3] - columns[4]) / CLOCK_TICKS


class CpuMeter:
    """The CPU each named process used between :meth:`start` and :meth:`stop`, and
    the machine's busy time the named ones do not account for (``other``: whatever
    else ran on the host meanwhile). A process that ended between the two counts
    what it had used when last read (0 when it never was)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}
        self.busy_before = 0.0
        self.t0 = 0.0

    def _read(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                out[name] = self.before.get(name, 0.0)
        return out

    def start(self) -> None:
        self.before = self._read()
        self.busy_before = machine_busy_seconds()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """{name: CPU seconds} plus ``other`` and ``wall`` (seconds)."""
        after = self._read()
        busy = machine_busy_seconds() - self.busy_before
        used = {name: after[name] - self.before.get(name, 0.0) for name in self.pids}
        used["other"] = max(0.0, busy - sum(used.values()))
        used["wall"] = time.perf_counter() - self.t0
        return used
