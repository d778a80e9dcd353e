"""Helpers for the integration tests: a live server on 127.0.0.1 (a free port).

The server runs in the test's own trio run (same process), so a test can look at
the service's state directly -- the scheduler's block counts, the step recorder,
the metrics -- and can wait on it with ``service.wait_until`` (event-driven, no
sleeps). Clients that block (the official ``openai`` client, httpx) run in worker
threads; clients that must misbehave (stop reading, hang up) are raw trio sockets.

The model is the smallest fixture checkpoint (2 layers, hidden 64), loaded once per
session: every test builds its own Batch and Service around it.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import trio

from triollm.plan import StepPlan, StepResult
from triollm.server.command import Stack, build_stack, serve_stack
from triollm.server.frontend import HttpConfig
from triollm.service import ServiceConfig
from triollm.sizing import Capacity

MODEL_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "llama-gqa-f32"
MODEL_ID = MODEL_DIR.name
INF = math.inf
HANG_GUARD_S = 120


@dataclass
class Live:
    stack: Stack
    url: str
    port: int
    shutdown: trio.Event

    @property
    def service(self) -> Any:
        return self.stack.service

    def pool_is_idle(self) -> bool:
        s = self.service.scheduler.statistics()
        return s.blocks_free == s.blocks_total and s.running == 0 and s.waiting == 0


CAPACITY_FIELDS = {f.name for f in fields(Capacity)}
SERVICE_FIELDS = {f.name for f in fields(ServiceConfig)}


def stack_for(loaded: Any, **kwargs: Any) -> Stack:
    """``build_stack`` with each keyword routed to the config that owns it
    (Capacity, ServiceConfig, or build_stack's own)."""
    capacity = {k: kwargs.pop(k) for k in list(kwargs) if k in CAPACITY_FIELDS}
    service = {k: kwargs.pop(k) for k in list(kwargs) if k in SERVICE_FIELDS}
    return build_stack(loaded, Capacity(**capacity), ServiceConfig(**service), **kwargs)


@asynccontextmanager
async def live_server(
    loaded: Any,
    *,
    http: dict[str, Any] | None = None,
    hang_guard_s: float = HANG_GUARD_S,
    **stack_kwargs: Any,
) -> AsyncIterator[Live]:
    """Start a server; on exit shut it down gracefully and check nothing leaked.
    ``hang_guard_s``: longer for a real model (its warm-up compiles, its answers are slow)."""
    stack_kwargs.setdefault("slots", 2)
    stack_kwargs.setdefault("context_tokens", 256)
    stack = stack_for(loaded, **stack_kwargs)
    config = HttpConfig(host="127.0.0.1", port=0, **({"grace_s": 2.0} | (http or {})))
    shutdown = trio.Event()
    # A hang guard, not a timing assertion: a broken engine or a lost wake-up must
    # fail the test (TooSlowError) instead of hanging the suite.
    with trio.fail_after(hang_guard_s):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_stack, stack, config, shutdown)
            url = binds[0]
            live = Live(stack, url, int(url.rsplit(":", 1)[1]), shutdown)
            try:
                yield live
            finally:
                shutdown.set()
    # The nursery only exits once hypercorn has drained and the service has stopped.


class StepGate:
    """Wraps the service's step runner so a test decides how many steps may run.

    Starts with no credit: the first step parks until ``allow(n)`` or ``open()``.
    Lets a test hold generation still (a request stays "running") without a clock.
    """

    def __init__(self, service: Any) -> None:
        self.service = service
        self.inner: Callable[[StepPlan], Awaitable[StepResult]] = service.step_runner
        self.credits: float = 0
        self._more = trio.Event()
        self.parked = False
        self.steps = 0
        service.step_runner = self.run

    def allow(self, n: int) -> None:
        self.credits += n
        self._more.set()

    def open(self) -> None:
        self.allow(INF)  # type: ignore[arg-type]

    async def run(self, plan: StepPlan) -> StepResult:
        while self.credits < 1:
            self._more = trio.Event()
            self.parked = True
            self.service.notify()
            await self._more.wait()
        self.parked = False
        self.credits -= 1
        self.steps += 1
        return await self.inner(plan)


# ----------------------------------------------------------------------------- raw HTTP


async def raw_post(
    port: int, path: str, body: dict[str, Any], *, rcvbuf: int | None = None
) -> trio.SocketStream:
    """Open a socket, send one POST; the caller reads (or doesn't)."""
    sock = trio.socket.socket()
    if rcvbuf is not None:
        import socket as pysocket

        sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + data)
    return stream


async def read_until(stream: trio.SocketStream, marker: bytes, buf: bytearray) -> bool:
    """Read into ``buf`` until ``marker`` appears; False at EOF / reset."""
    while marker not in buf:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return False
        if not chunk:
            return False
        buf += chunk
    return True


def unchunk(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked response (headers included in ``raw``)."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    out = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        if not size_line.strip():
            break  # a truncated body: what arrived so far
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


def sse_payloads(body: bytes) -> list[Any]:
    out: list[Any] = []
    for block in body.decode(errors="replace").split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
