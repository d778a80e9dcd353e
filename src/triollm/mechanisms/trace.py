"""``triollm trace``: one request traced through the real server, beside a neighbour.

It starts the demo model's server in-process, exactly as ``triollm serve`` builds it
(``mechanisms/live.py``), makes a :class:`~triollm.trace.Tracer` the service's step
recorder, and sends two streaming completions over real sockets: A, then B once A has
run ``--join-after`` steps. The batch loop is held (``live.Hold``) until each request
is admitted, so the steps are the same on every run; only the times differ. Then it
prints, in time order, one line per step (its rows; what A and B computed, the token
each got, the blocks each took, shares and freed) and one line per SSE event at the
moment it arrived at the client's socket: each event leaves as its step ends, which is
the per-event flush of docs/streaming.md seen from outside.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio

from triollm.mechanisms.live import Client, Hold, Server, demo_server
from triollm.policies import policy_name
from triollm.trace import TraceLine, Tracer

PROMPT_A = "Once upon a time"
PROMPT_B = "Once upon a time there was"  # A's opening: B finds its full blocks cached


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=PROMPT_A, help="request A's prompt")
    parser.add_argument("--neighbour", default=PROMPT_B, help="request B's prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each generates")
    parser.add_argument(
        "--join-after", type=int, default=2, metavar="N", help="B arrives after A's N-th step"
    )
    parser.add_argument(
        "--block-size", type=int, default=4, help="positions per KV block (small: visible)"
    )


async def main(args: argparse.Namespace, say: Callable[[str], None] = print) -> list[str]:
    """Run the story; print and return its lines (times in seconds from A's request)."""
    if not 0 < args.join_after < args.max_tokens:
        raise SystemExit("triollm trace: --join-after must be at least 1 and below --max-tokens")
    async with demo_server(slots=2, context_tokens=64, block_size=args.block_size) as server:
        # A hang guard: a broken path fails loudly instead of waiting forever. Not
        # around the start: a cold numba cache compiles there for minutes.
        with trio.fail_after(60):
            lines = await _story(server, args)
    for line in lines:
        say(line)
    return lines


async def _story(server: Server, args: argparse.Namespace) -> list[str]:
    from triollm.output import token_text

    tokenizer = server.stack.served.tokenizer
    tracer = Tracer(
        server.service.scheduler,
        clock=trio.current_time,
        token_text=lambda i: token_text(tokenizer, i)[0],
    )
    server.service.recorder = tracer  # the loop records every committed step here
    hold = Hold(server)
    head = _header(server, args, tokenizer)

    def body(prompt: str) -> dict[str, object]:
        return {
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

    async with trio.open_nursery() as nursery:
        a = await Client.post(server.port, "/v1/completions", body(args.prompt))
        tracer.note("A  sent POST /v1/completions (stream)")
        await server.wait_for(lambda s: s.running == 1)
        await hold.parked()
        nursery.start_soon(_read, a, "A", tracer)
        await hold.step(args.join_after)
        b = await Client.post(server.port, "/v1/completions", body(args.neighbour))
        tracer.note("B  sent POST /v1/completions (stream)")
        await server.wait_for(lambda s: s.running == 2)
        nursery.start_soon(_read, b, "B", tracer)
        hold.release()
    ordered = sorted(tracer.lines, key=lambda line: line.at)  # stable: a step before its events
    return head + [_format(line) for line in ordered]


def _header(server: Server, args: argparse.Namespace, tokenizer: object) -> list[str]:
    cfg = server.service.scheduler.config
    n_a = len(tokenizer.encode(args.prompt))  # type: ignore[attr-defined]
    n_b = len(tokenizer.encode(args.neighbour))  # type: ignore[attr-defined]
    return [
        f"the demo model: {cfg.slots} slots, {cfg.num_blocks} blocks of {cfg.block_size} "
        f"positions, policy {policy_name(cfg.policy)}, "
        f"prefix cache {'on' if cfg.prefix_cache else 'off'}",
        f"A: {args.prompt!r} ({n_a} prompt tokens), B: {args.neighbour!r} ({n_b}), "
        f"max_tokens {args.max_tokens} each, B sent after A's step {args.join_after}",
        "    time s  what",
    ]


def _format(line: TraceLine) -> str:
    return f"{line.at:10.4f}  {line.text}"


async def _read(client: Client, name: str, tracer: Tracer) -> None:
    """Note each SSE event of ``client`` the moment its last byte arrives."""
    seen = 0
    while True:
        events = client.events_so_far()
        for k, payload in enumerate(events[seen:], seen + 1):
            tracer.note(f"{name}  SSE event {k}: {_describe(payload)}")
        seen = len(events)
        if (events and events[-1] == "[DONE]") or not await client.receive():
            return


def _describe(payload: object) -> str:
    if payload == "[DONE]":
        return "[DONE]"
    assert isinstance(payload, dict)
    choice = payload["choices"][0]
    end = choice.get("finish_reason")
    return repr(choice["text"]) + (f", finish_reason {end}" if end else "")


def run(args: argparse.Namespace) -> int:
    trio.run(main, args)
    return 0
