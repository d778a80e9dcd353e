"""Overload: an open-loop arrival rate several times what the server can do, for a minute.

``python bench/overload.py`` (``just overload``) serves the small fixture model (or
``--model DIR``) on 127.0.0.1 in this process. It first measures capacity (closed
loop: ``slots`` clients back to back for ``--probe-seconds``), then sends Poisson
arrivals at ``--factor`` times that rate for ``--seconds``, each a streamed
completion, without waiting for answers (open loop: the load does not slow down
when the server does). It prints, and checks:

- the queue depth never passed its bound (slots x --queue-depth-per-slot);
- every refusal was a 429 with ``Retry-After``, nothing else failed;
- the queue wait of the admitted (time to the response headers, which go out at
  admission) stayed within the wait budget: p50 / p99 / max;
- memory stayed bounded (peak RSS, growth over the run).

Exit status 1 if a promise broke. Figures of a full run: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadkit import (
    FIXTURE_MODEL,
    exchange,
    http_request,
    percentile,
    rss_bytes,
    running_server,
    server_is_idle,
)

BODY = {"prompt": "Overload", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


async def measure_capacity(port: int, model: str, clients: int, seconds: float) -> float:
    done = 0
    deadline = trio.current_time() + seconds

    async def client() -> None:
        nonlocal done
        while trio.current_time() < deadline:
            body = BODY | {"model": model, "stream": True}  # the same request as the run
            reply = await exchange(port, http_request("/v1/completions", body))
            if reply.status == 200:
                done += 1

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return done / (trio.current_time() - started)


async def overload(
    *,
    model_dir: Path | str = FIXTURE_MODEL,
    seconds: float = 60.0,
    factor: float = 4.0,
    probe_seconds: float = 8.0,
    slots: int = 4,
    depth_per_slot: int = 2,
    queue_wait_s: float = 5.0,
    seed: int = 0,
    out: Any = sys.stdout,
) -> dict[str, Any]:
    rng = random.Random(seed)
    kwargs = {
        "slots": slots,
        "context_tokens": 256,
        "queue_depth_per_slot": depth_per_slot,
        "queue_wait_s": queue_wait_s,
    }
    statuses: Counter[str] = Counter()
    waits: list[float] = []
    problems: list[str] = []
    depth_max = 0
    async with running_server(model_dir, **kwargs) as stack:
        model = stack.served.id
        bound = stack.service.queue.max_waiters
        capacity = await measure_capacity(stack.port, model, slots, probe_seconds)
        rate = capacity * factor
        rss_start, _ = rss_bytes()
        rss_peak = rss_start

        async def one() -> None:
            body = BODY | {"model": model, "stream": True}
            reply = await exchange(stack.port, http_request("/v1/completions", body))
            err = reply.error
            statuses[f"{reply.status}" + (f" {err['code']}" if err else "")] += 1
            if reply.status == 200:
                if reply.t_headers is not None:
                    waits.append(reply.t_headers)
                if reply.events[-1:] != ["[DONE]"] or err is not None:
                    problems.append(f"a 200 stream ended badly: {reply.events[-2:]}")
            elif reply.status == 429:
                if "retry-after" not in reply.headers:
                    problems.append("a 429 without Retry-After")
            else:
                problems.append(f"status {reply.status}: {err}")

        async def sampler() -> None:
            nonlocal depth_max, rss_peak
            while True:
                depth_max = max(depth_max, stack.service.queue.waiting)
                rss_peak = max(rss_peak, rss_bytes()[0])
                await trio.sleep(0.05)

        started = time.monotonic()
        sent = 0
        async with trio.open_nursery() as outer:
            outer.start_soon(sampler)
            async with trio.open_nursery() as nursery:
                deadline = trio.current_time() + seconds
                while trio.current_time() < deadline:
                    nursery.start_soon(one)
                    sent += 1
                    await trio.sleep(rng.expovariate(rate))
            outer.cancel_scope.cancel()
        elapsed = time.monotonic() - started
        with trio.fail_after(120):
            await stack.service.wait_until(lambda: server_is_idle(stack))
        rss_end, _ = rss_bytes()

    if depth_max > bound:
        problems.append(f"the queue held {depth_max} waiters, past its bound of {bound}")
    p99 = percentile(waits, 99)
    # The budget bounds the wait in the queue; the headers follow admission within a step.
    if waits and max(waits) > queue_wait_s + 2.0:
        problems.append(f"a queue wait of {max(waits):.1f} s, past the budget of {queue_wait_s} s")
    figures = {
        "capacity_rps": round(capacity, 2),
        "offered_rps": round(rate, 2),
        "sent": sent,
        "seconds": round(elapsed, 1),
        "completed_rps": round(statuses.get("200", 0) / elapsed, 2),
        "statuses": dict(statuses),
        "queue_bound": bound,
        "queue_depth_max": depth_max,
        "wait_p50_s": round(percentile(waits, 50), 2),
        "wait_p99_s": round(p99, 2),
        "wait_max_s": round(max(waits), 2) if waits else None,
        "wait_budget_s": queue_wait_s,
        "rss_start_mib": round(rss_start / 2**20),
        "rss_peak_mib": round(rss_peak / 2**20),
        "rss_end_mib": round(rss_end / 2**20),
        "problems": problems[:10],
    }
    print(
        f"overload: capacity {figures['capacity_rps']} req/s; asked for {figures['offered_rps']} "
        f"req/s ({factor:g}x) for {figures['seconds']} s: {sent} requests sent "
        f"({sent / elapsed:.1f} req/s: the clients share this process with the server)",
        file=out,
    )
    print(f"  completed {figures['completed_rps']} req/s; statuses {figures['statuses']}", file=out)
    print(
        f"  queue depth max {depth_max} (bound {bound}); queue wait of the admitted "
        f"p50 {figures['wait_p50_s']} s, p99 {figures['wait_p99_s']} s, max "
        f"{figures['wait_max_s']} s (budget {queue_wait_s:g} s)",
        file=out,
    )
    print(
        f"  RSS {figures['rss_start_mib']} MiB at the start, peak {figures['rss_peak_mib']} MiB, "
        f"{figures['rss_end_mib']} MiB at the end",
        file=out,
    )
    print("FAILED: " + "; ".join(problems[:5]) if problems else "  every promise held", file=out)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(FIXTURE_MODEL))
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--queue-wait", type=float, default=5.0)
    args = p.parse_args(argv)
    figures = trio.run(
        lambda: overload(
            model_dir=args.model,
            seconds=args.seconds,
            factor=args.factor,
            queue_wait_s=args.queue_wait,
        )
    )
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
