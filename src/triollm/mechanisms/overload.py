"""A bounded queue refuses early: 429 with Retry-After at once, and 429 again, not 499,
when the wait budget runs out.

The book's Forma bounds its admission queue (8 waiters per slot), refuses a request
that arrives to a full queue, and refuses one that has waited longer than its budget
(30 s), both with 429 and a ``Retry-After`` header: an unbounded queue only trades
refusals for unbounded latency. "Waited too long" and "the client left" are kept apart
(429 vs 499), which is why the wait budget is a deadline of its own and not one derived
from the request's context.

This starts a real server on the demo model with one slot, room for two waiters, and
a wait budget of two seconds, holds the batch loop still so the one running request
never frees its slot, and sends a burst of five more.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio

from triollm.mechanisms.live import Client, Hold, Response, Server, demo_server
from triollm.outcomes import Refused

BODY = {"prompt": "Once upon a time", "max_tokens": 16, "stream": True}
WAIT_BUDGET_S = 2.0


async def main(say: Callable[[str], None] = print) -> list[str]:
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        say(line)

    with trio.fail_after(120):  # a hang guard, not a timing
        async with demo_server(
            slots=1, context_tokens=256, queue_depth_per_slot=2, queue_wait_s=WAIT_BUDGET_S
        ) as server:
            await _story(server, emit)
    return lines


def _refusal(name: str, r: Response) -> str:
    code = r.body.get("error", {}).get("code") if isinstance(r.body, dict) else None
    return f"  {name}: {r.status} {code}, Retry-After: {r.headers.get('retry-after', 'none')}"


async def _story(server: Server, emit: Callable[[str], None]) -> None:
    hold = Hold(server)
    emit(
        f"one slot, two places in the queue, a {WAIT_BUDGET_S:g} s wait budget; the batch loop held"
    )
    a = await Client.post(server.port, "/v1/completions", BODY)
    await server.wait_for(lambda s: s.running == 1)
    await hold.parked()
    emit(f"A is running and keeps its slot: {server.pool()}")

    waiters = {}
    for name in "BC":
        waiters[name] = await Client.post(server.port, "/v1/completions", BODY)
        queued = len(waiters)
        await server.wait_for(lambda s, n=queued: s.waiting == n)
    emit(f"B and C queue:                   {server.pool()}")

    emit("D, E and F arrive to a full queue, and are refused at once:")
    started = trio.current_time()
    for name in "DEF":
        r = await (await Client.post(server.port, "/v1/completions", BODY)).read_all()
        emit(_refusal(name, r))
    waited = trio.current_time() - started
    when = "at once" if waited < WAIT_BUDGET_S / 2 else "late"
    emit(f"  (all three answered {when}: nobody waited)")

    emit(f"B and C wait past the {WAIT_BUDGET_S:g} s budget while A holds the slot:")
    for name, client in waiters.items():
        r = await client.read_all()
        emit(_refusal(name, r))
    emit(f"  the queue is empty again:       {server.pool()}")

    hold.release()
    r = await a.read_all()
    finish = r.events[-2]["choices"][0]["finish_reason"]  # the last chunk before [DONE]
    emit(f"A, released, completes: {r.status}, finish_reason {finish}")
    metrics = server.stack.metrics
    emit(
        f"counted: queue_full {int(metrics.rejection_count(Refused.QUEUE_FULL))}, "
        f"queue_timeout {int(metrics.rejection_count(Refused.QUEUE_TIMEOUT))}"
    )


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


def run(args: argparse.Namespace) -> int:
    trio.run(main)
    return 0
