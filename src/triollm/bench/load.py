"""The two shapes of load, in trio: a closed loop and an open (Poisson) loop.

- **Closed loop at concurrency C**: C workers, each sends a request, waits for its
  stream to end, sends the next. The server always has C streams; throughput is what
  it does with them. This is what llama.cpp's and vLLM's batch benchmarks measure.
- **Open loop at rate R**: arrivals are a Poisson process (exponential gaps, mean
  1/R, from the level's seed) whatever the server is doing, as users arrive; a slow
  server builds a queue (and, if it has a bound, answers 429). This is the one that
  shows queueing delay in TTFT.

Both stop issuing when the level's request count is reached or its time is up,
whichever comes first, and then wait for what is in flight. In multi-turn mode a
worker (closed) or an arrival (open) holds a whole conversation, one turn after
another; the count is of turns, and a conversation starts only if all its turns fit
in what is left.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import trio

from triollm.bench.client import send
from triollm.bench.stats import Outcome, RequestRecord
from triollm.bench.workload import Source, Workload


@dataclass(frozen=True)
class Level:
    """One level of load: a concurrency (closed loop) or a rate (open loop)."""

    requests: int
    concurrency: int | None = None
    rate: float | None = None  # requests (or conversations) per second
    duration_s: float | None = None  # stop issuing after this long

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}"

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "poisson"


class _Budget:
    """How many requests may still be issued, and until when (shared by one level's
    tasks, all in one trio thread, so plain counters are safe)."""

    def __init__(self, level: Level, now: float) -> None:
        self.left = level.requests
        self.deadline = now + level.duration_s if level.duration_s else float("inf")

    def take(self, n: int, now: float) -> bool:
        if self.left < n or now >= self.deadline:
            return False
        self.left -= n
        return True


async def run_level(
    client: httpx.AsyncClient,
    base_url: str,
    workload: Workload,
    level: Level,
    *,
    level_seed: int,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[RequestRecord]:
    """Run one level to the end; the records in completion order."""
    source = Source(workload, level_seed)
    records: list[RequestRecord] = []
    t0 = clock()
    budget = _Budget(level, t0)
    per_unit = max(workload.turns, 1)

    async def one() -> None:
        """One request, or one whole conversation."""
        if not workload.turns:
            rec = await send(client, base_url, workload.api, source.single(), t0=t0, clock=clock)
            records.append(rec)
            on_done(rec)
            return
        conv = source.conversation()
        while not conv.finished:
            rec = await send(
                client, base_url, workload.api, conv.next_request(), t0=t0, clock=clock
            )
            records.append(rec)
            on_done(rec)
            if rec.outcome is not Outcome.OK:
                break  # a conversation cannot go on without its answer
            conv.answered(rec.text)

    async with trio.open_nursery() as nursery:
        if level.concurrency is not None:

            async def worker() -> None:
                while budget.take(per_unit, clock()):
                    await one()

            for _ in range(level.concurrency):
                nursery.start_soon(worker)
        elif level.rate is not None:
            # Arrivals have their own RNG, so the gaps do not depend on the prompts drawn.
            arrivals = random.Random(f"arrivals/{workload.seed}/{level_seed}")
            while budget.take(per_unit, clock()):
                nursery.start_soon(one)
                await trio.sleep(arrivals.expovariate(level.rate))
    return records
