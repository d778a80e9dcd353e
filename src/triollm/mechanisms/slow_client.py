"""The book's fast/slow client program (20.3.4), with trio memory channels.

The Go program gives each stream a channel of capacity 2 and, after every forward
step, offers each stream its token with ``select { case s.out <- tok: default: }``.
The slow client never reads, so its buffer is full after step 2 and the offer at
step 3 falls into ``default``: the request is dropped from the batch, the fast one
carries on. In trio the same offer is ``send_nowait``, and ``default`` is
``except trio.WouldBlock``: the batch loop never waits for a client.

The real server makes the same decision in ``OutputProcessor._deliver`` (a buffer of
``--stream-buffer`` steps of undelivered deltas cuts the client with a ``too_slow``
error event and frees its blocks), but by counting: its channel keeps one more place
per choice for the end event, so it compares ``current_buffer_used`` with its room
instead of waiting for ``WouldBlock`` (docs/streaming.md, section 4). This program is
the mechanism alone, small enough to read at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import trio

BUFFER_TOKENS = 2  # the book's capacity: each request may be two tokens behind
STEPS = 4


@dataclass
class _Stream:
    name: str
    send: trio.MemorySendChannel[int]
    receive: trio.MemoryReceiveChannel[int]
    reads: bool  # does this client read its tokens in time?


def _stream(name: str, *, reads: bool) -> _Stream:
    send, receive = trio.open_memory_channel[int](BUFFER_TOKENS)
    return _Stream(name, send, receive, reads)


async def batch_loop(streams: list[_Stream]) -> list[str]:
    """Run the book's four steps; print the lines the book shows and return them."""
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line)

    for step in range(1, STEPS + 1):
        # one forward step later: hand this step's token to every request in the batch
        live = []
        for s in streams:
            try:
                s.send.send_nowait(step)  # never blocks: one slow request cannot stall the batch
            except trio.WouldBlock:  # buffer full: the client fell behind; drop it
                backlog = s.receive.statistics().current_buffer_used
                emit(
                    f"step {step}: the {s.name} client is {backlog} tokens behind; "
                    "its request is cancelled"
                )
                s.send.close()
                continue
            live.append(s)
        streams = live
        for s in streams:
            if s.reads:
                s.receive.receive_nowait()
        emit(f"step {step}: {len(streams)} requests left in the batch")
    return lines


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


async def main() -> list[str]:
    return await batch_loop([_stream("fast", reads=True), _stream("slow", reads=False)])


def run(args: argparse.Namespace) -> int:
    trio.run(main)
    return 0
