"""A client that leaves frees what it held at once: while queued, in prefill, in decode.

The book's rule (20.3.4): when the client's connection closes, stop generating and
give the KV cache back *at once*; a loop that ignores the request's context holds its
slot and blocks until ``max_tokens``. Forma hands the context even to the wait for a
free session, so a client that leaves while queued stops holding its place in line.
Such an ending is logged as 499 (nginx's "client closed request"), not as a failure.

This starts a real server on the demo model with one slot, holds the batch loop still
between steps, and hangs up three clients at three moments. Each time the pool is
printed right after the socket closed, before any further step has run: what changed
was done by the cancellation path alone (hypercorn notices the EOF, quart-trio cancels
the handler, the request's cleanup frees its blocks synchronously;
``docs/cancellation.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio

from triollm.mechanisms.live import Client, Hold, Server, demo_server
from triollm.outcomes import EndCode

BODY = {"prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True}


async def main(say: Callable[[str], None] = print) -> list[str]:
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        say(line)

    # A hang guard: a broken cancellation path fails loudly instead of waiting forever.
    with trio.fail_after(120):
        async with demo_server(slots=1, context_tokens=256) as server:
            await _story(server, emit)
    return lines


async def _story(server: Server, emit: Callable[[str], None]) -> None:
    hold = Hold(server)
    emit(f"one slot, the batch loop held between steps; {server.pool()}")

    a = await Client.post(server.port, "/v1/completions", BODY)
    await server.wait_for(lambda s: s.running == 1)
    await hold.parked()
    b = await Client.post(server.port, "/v1/completions", BODY)
    await server.wait_for(lambda s: s.waiting == 1)
    emit(f"A admitted (its prompt not computed yet), B queued: {server.pool()}")

    await b.hang_up()
    await server.wait_for(lambda s: s.waiting == 0)
    emit(f"B hung up while queued:    {server.pool()}")

    await a.hang_up()
    await server.wait_for(lambda s: s.running == 0)
    emit(f"A hung up in prefill:      {server.pool()}")

    c = await Client.post(server.port, "/v1/completions", BODY)
    await server.wait_for(lambda s: s.running == 1)
    await hold.parked()
    await hold.step(3)
    await c.read_events(2)
    emit(f"C decoding, 2 events read: {server.pool()}")
    await c.hang_up()
    await server.wait_for(lambda s: s.running == 0)
    emit(f"C hung up in decode:       {server.pool()}")

    closed = int(server.stack.metrics.rejection_count(EndCode.CLIENT_CLOSED))
    emit(f"ended as client_closed (logged 499, not counted as errors): {closed}")
    hold.release()


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


def run(args: argparse.Namespace) -> int:
    trio.run(main)
    return 0
