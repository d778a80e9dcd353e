"""A soak: mixed, careless and hostile clients against a live server, then a health check.

``python bench/soak.py`` (``just soak``) serves the small fixture model (or
``--model DIR``) on 127.0.0.1 in this process and runs ``--clients`` workers for
``--seconds`` or ``--requests``, whichever ends first. Each request is one of:

- ``stream`` / ``whole``: a completion or a chat, streamed or not (greedy or sampled);
- ``cut``: a client that hangs up in some phase: after the headers, half-way
  through the body, while queued, or after a few events of its stream;
- ``stall``: a stream whose client stops reading (small receive buffer), then leaves;
- ``burst``: more simultaneous requests than the queue holds (some get 429);
- ``malformed``: a hostile body (bad JSON, wrong types, NaN, a 5,000-digit integer,
  invalid UTF-8, deep nesting, a non-JSON content type) that must get a 4xx;
- ``big``: a prompt body just under the body limit, which cannot fit the context.

Before the mix, bench/hostile.py's probes run at the issue's sizes (grammars, schemas,
tools and prompts that crashed or froze the server), each beside a neighbour stream
whose largest gap is printed (``--no-hostile`` skips them).

It prints the outcomes, throughput, TTFT and inter-token latency (p50/p99) and the
peak RSS, then checks, once the server is idle: every KV block back, no request
and no task left, RSS growth within ``--rss-bound-mib``, the same greedy text as
at the start, and no 5xx. Exit status 1 if a check fails.

tests/server/test_soak.py runs a short one in CI; the figures of a full run are in
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile
from loadkit import (
    FIXTURE_MODEL,
    Reply,
    connect,
    count_tasks,
    exchange,
    http_request,
    live_tasks,
    percentile,
    reply_text,
    rss_bytes,
    running_server,
    server_is_idle,
)

KEEP_ALIVE_S = 5.0  # hypercorn's keep_alive_timeout default
GREEDY = {"prompt": "The soak begins", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
KINDS = {  # weight of each kind of request in the mix
    "stream": 30,
    "whole": 20,
    "cut": 15,
    "stall": 3,
    "burst": 2,
    "malformed": 25,
    "big": 5,
}


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    server_errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # answers that broke a promise

    def record(self, kind: str, reply: Reply | None, note: str = "") -> None:
        self.requests += 1
        if reply is None or reply.status is None:
            self.outcomes[f"{kind}: {note or 'no reply'}"] += 1
            return
        err = reply.error
        label = f"{reply.status}" + (f" {err.get('code')}" if err else "")
        self.outcomes[f"{kind}: {label}{' ' + note if note else ''}"] += 1
        if reply.status >= 500 or (err is not None and err.get("code") == "internal"):
            self.server_errors.append(f"{kind}: {label}: {(err or {}).get('message')}")
        if reply.status == 429 and "retry-after" not in reply.headers:
            self.wrong.append(f"{kind}: 429 without Retry-After")


def hostile_bodies(rng: random.Random, model: str) -> tuple[bytes, dict[str, str]]:
    """A body that must be refused with a 4xx, and its headers."""
    base = {"model": model, "prompt": "x", "max_tokens": 2}
    json_headers = {"Content-Type": "application/json"}
    choice = rng.randrange(12)
    if choice == 0:
        return b"{not json", json_headers
    if choice == 1:
        return json.dumps(base | {"max_tokens": "many"}).encode(), json_headers
    if choice == 2:
        return b'{"prompt": "x", "temperature": NaN}', json_headers
    if choice == 3:
        return b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", json_headers
    if choice == 4:
        return b'{"prompt": "\xff\xfe"}', json_headers
    if choice == 5:
        return b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", json_headers
    if choice == 6:
        return json.dumps(base | {"prompt": [1, 2.5]}).encode(), json_headers
    if choice == 7:
        return json.dumps(base | {"stop": ["a"] * 100}).encode(), json_headers
    if choice == 8:
        return json.dumps(base | {"prompt": "\ud800"}).encode(), json_headers
    if choice == 9:
        return json.dumps(base | {"prompt": [10**9]}).encode(), json_headers
    if choice == 10:
        return json.dumps(base | {"top_p": -1}).encode(), json_headers
    return json.dumps(base | {"n": 1000}).encode(), json_headers


class Soak:
    def __init__(self, stack: Any, rng: random.Random, tally: Tally) -> None:
        self.stack = stack
        self.port: int = stack.port
        self.model: str = stack.served.id
        self.rng = rng
        self.tally = tally

    def body(self, *, stream: bool, tokens: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        n = tokens or rng.randint(1, 24)
        common: dict[str, Any] = {"model": self.model, "max_tokens": n, "stream": stream}
        common["temperature"] = rng.choice([0, 0.7, 1.0])
        if rng.random() < 0.5:
            common["ignore_eos"] = True
        if rng.random() < 0.5:
            return "/v1/completions", common | {"prompt": f"soak {rng.randrange(10**6)}"}
        msgs = [{"role": "user", "content": f"say something {rng.randrange(10**6)}"}]
        return "/v1/chat/completions", common | {"messages": msgs}

    async def one(self, kind: str) -> None:
        rng, tally = self.rng, self.tally
        if kind in ("stream", "whole"):
            path, body = self.body(stream=kind == "stream")
            reply = await exchange(self.port, http_request(path, body))
            if reply.status == 200:
                if not reply.complete:
                    tally.wrong.append(f"{kind}: 200 with a truncated body")
                elif kind == "stream":
                    if reply.events[-1] != "[DONE]":
                        tally.wrong.append("stream: no [DONE]")
                    if reply.t_first is not None:
                        tally.ttft.append(reply.t_first)
                    tally.itl.extend(reply.gaps)
                    tally.tokens += len(reply.gaps) + (reply.t_first is not None)
                else:
                    tally.tokens += json.loads(reply.body)["usage"]["completion_tokens"]
            tally.record(kind, reply)
        elif kind == "cut":
            await self.cut(rng.choice(["headers", "half body", "queued", "mid-stream"]))
        elif kind == "stall":
            path, body = self.body(stream=True, tokens=64)
            if path == "/v1/completions":
                body["logprobs"] = 5  # ~1 KB per event: the buffers fill within a few tokens
            s = await connect(self.port, rcvbuf=2048)
            await s.send_all(http_request(path, body))
            await trio.sleep(rng.uniform(0.05, 0.5))  # the client is busy, not reading
            await s.aclose()
            tally.record(kind, None, "left without reading")
        elif kind == "burst":
            depth = self.stack.service.queue.max_waiters + self.stack.service.scheduler.config.slots

            async def whole() -> None:
                path, body = self.body(stream=False, tokens=4)
                tally.record("burst", await exchange(self.port, http_request(path, body)))

            async with trio.open_nursery() as nursery:
                for _ in range(depth + 4):
                    nursery.start_soon(whole)
        elif kind == "malformed":
            data, headers = hostile_bodies(rng, self.model)
            raw = http_request("/v1/completions", data, headers=headers)
            reply = await exchange(self.port, raw)
            if reply.status is None or not 400 <= reply.status < 500:
                tally.wrong.append(f"malformed: got {reply.status} for {data[:60]!r}")
            tally.record(kind, reply)
        elif kind == "big":
            limit = self.stack.served_body_limit
            text = "word " * ((limit - 200) // 5)
            body = {"model": self.model, "prompt": text, "max_tokens": 1}
            reply = await exchange(self.port, http_request("/v1/completions", body))
            if reply.status is None or not 400 <= reply.status < 500:
                tally.wrong.append(f"big: got {reply.status}")
            tally.record(kind, reply)

    async def cut(self, phase: str) -> None:
        path, body = self.body(stream=phase == "mid-stream", tokens=20)
        raw = http_request(path, body)
        if phase == "mid-stream":
            reply = await exchange(self.port, raw, stop_after_events=self.rng.randint(1, 4))
            self.tally.record("cut", None, f"left {phase}")
            del reply
            return
        s = await connect(self.port)
        head, _, data = raw.partition(b"\r\n\r\n")
        if phase == "headers":
            await s.send_all(head + b"\r\n\r\n")
        elif phase == "half body":
            await s.send_all(head + b"\r\n\r\n" + data[: len(data) // 2])
        else:  # queued or just admitted: the whole request, then gone
            await s.send_all(raw)
        await trio.sleep(self.rng.uniform(0, 0.05))
        await s.aclose()
        self.tally.record("cut", None, f"left after {phase}")


async def greedy_text(port: int, model: str) -> str:
    reply = await exchange(port, http_request("/v1/completions", GREEDY | {"model": model}))
    assert reply.status == 200, reply.body[:300]
    return reply_text(reply)


async def soak(
    *,
    model_dir: Path | str = FIXTURE_MODEL,
    seconds: float = 60.0,
    requests: int = 10_000,
    clients: int = 8,
    seed: int = 0,
    rss_bound_mib: float = 200.0,
    stack_kwargs: dict[str, Any] | None = None,
    hostile_probes: bool = False,
    out: Any = sys.stdout,
) -> dict[str, Any]:
    """Run the soak; returns the figures and the list of failed checks (``failures``).

    ``hostile_probes``: first run bench/hostile.py's probes at the issue's sizes, each
    beside a neighbour stream (``just soak`` does; the CI soak leaves them to
    tests/server/test_hostile_grammars.py, at small sizes)."""
    rng = random.Random(seed)
    tally = Tally()
    kwargs = {"slots": 4, "context_tokens": 256, "queue_depth_per_slot": 2} | (stack_kwargs or {})
    async with running_server(model_dir, **kwargs) as stack:
        stack.served_body_limit = stack.max_body_bytes
        model = stack.served.id
        first = await greedy_text(stack.port, model)
        probe_wrong: list[str] = []
        if hostile_probes:
            await trio.to_thread.run_sync(stack.served.grammars.start)  # as `serve` does
            print("hostile probes (issue 28's sizes), each beside a neighbour stream:", file=out)
            results = await hostile.run_all(stack.port, model, full=True)
            probe_wrong = hostile.report(results, out)
            gaps = [r.neighbour_gap_s * 1000 for r in results]
            print(f"  neighbour's largest gap over all probes: {max(gaps):.0f} ms", file=out)
        # A first round of every kind settles the allocator and the caches; RSS is
        # measured from there, so growth means a leak, not warm-up.
        runner = Soak(stack, rng, tally)
        for kind in KINDS:
            await runner.one(kind)
        await stack.service.wait_until(lambda: server_is_idle(stack))
        gc.collect()
        tasks_before = count_tasks()
        rss_start, _ = rss_bytes()
        kinds, weights = list(KINDS), list(KINDS.values())
        started = time.monotonic()
        deadline = trio.current_time() + seconds
        budget = [requests]

        async def worker(n: int) -> None:
            while trio.current_time() < deadline and budget[0] > 0:
                budget[0] -= 1
                await runner.one(rng.choices(kinds, weights)[0])

        async with trio.open_nursery() as nursery:
            for n in range(clients):
                nursery.start_soon(worker, n)
        elapsed = time.monotonic() - started
        with trio.fail_after(120):  # a hang guard: the server must come back to rest
            await stack.service.wait_until(lambda: server_is_idle(stack))
        # A connection whose client hung up after a complete answer keeps its task
        # until hypercorn's keep-alive timer (5 s) ends it: a bounded wait, by design.
        with trio.move_on_after(KEEP_ALIVE_S + 2):
            while count_tasks() > tasks_before:
                await trio.sleep(0.1)
        gc.collect()
        names_after = live_tasks()
        tasks_after = len(names_after)
        rss_end, rss_peak = rss_bytes()
        last = await greedy_text(stack.port, model)
        stats = stack.service.scheduler.statistics()

    failures = list(tally.wrong) + probe_wrong
    if tally.server_errors:
        failures.append(f"{len(tally.server_errors)} server errors: {tally.server_errors[:3]}")
    if stats.blocks_free != stats.blocks_total:
        failures.append(f"blocks not back: {stats.blocks_free}/{stats.blocks_total} free")
    if tasks_after > tasks_before:
        failures.append(
            f"tasks left: {tasks_after} now, {tasks_before} at the start: "
            f"{sorted(Counter(names_after).items(), key=lambda kv: -kv[1])[:5]}"
        )
    growth_mib = (rss_end - rss_start) / 2**20
    if growth_mib > rss_bound_mib:
        failures.append(f"RSS grew {growth_mib:.0f} MiB, past the bound of {rss_bound_mib:g} MiB")
    if last != first:
        failures.append(f"greedy text changed: {first!r} -> {last!r}")
    figures = {
        "requests": tally.requests,
        "seconds": round(elapsed, 1),
        "requests_per_s": round(tally.requests / elapsed, 1),
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "ttft_p50_ms": round(percentile(tally.ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(tally.ttft, 99) * 1000, 1),
        "itl_p50_ms": round(percentile(tally.itl, 50) * 1000, 1),
        "itl_p99_ms": round(percentile(tally.itl, 99) * 1000, 1),
        "rss_start_mib": round(rss_start / 2**20),
        "rss_end_mib": round(rss_end / 2**20),
        "rss_peak_mib": round(rss_peak / 2**20),
        "server_errors": len(tally.server_errors),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "failures": failures,
    }
    print_figures(figures, out)
    return figures


def print_figures(f: dict[str, Any], out: Any) -> None:
    print(
        f"soak: {f['requests']} requests in {f['seconds']} s "
        f"({f['requests_per_s']} req/s, {f['tokens_per_s']} streamed tokens/s)",
        file=out,
    )
    print(
        f"  TTFT p50 {f['ttft_p50_ms']} ms, p99 {f['ttft_p99_ms']} ms; "
        f"ITL p50 {f['itl_p50_ms']} ms, p99 {f['itl_p99_ms']} ms",
        file=out,
    )
    print(
        f"  RSS {f['rss_start_mib']} MiB at the start, {f['rss_end_mib']} MiB at the end, "
        f"peak {f['rss_peak_mib']} MiB; 5xx: {f['server_errors']}",
        file=out,
    )
    print("  outcomes:", file=out)
    for label, n in f["outcomes"].items():
        print(f"    {n:6d}  {label}", file=out)
    if f["failures"]:
        print("FAILED:", file=out)
        for line in f["failures"]:
            print(f"  - {line}", file=out)
    else:
        print("  at rest: every block back, no request or task left, same greedy text", file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(FIXTURE_MODEL), help="model directory")
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mib", type=float, default=200.0)
    p.add_argument(
        "--no-hostile", action="store_true", help="skip bench/hostile.py's probes at the start"
    )
    args = p.parse_args(argv)
    figures = trio.run(
        lambda: soak(
            model_dir=args.model,
            seconds=args.seconds,
            requests=args.requests,
            clients=args.clients,
            seed=args.seed,
            rss_bound_mib=args.rss_bound_mib,
            hostile_probes=not args.no_hostile,
        )
    )
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
