"""A real triollm server in-process, and clients that misbehave on purpose.

The serving demonstrations (``disconnect``, ``overload``) need the whole path: the
HTTP frontend, the admission queue, the batch loop and the block pool. They start it
here, on the built-in demo model and a free loopback port, exactly as ``triollm
serve`` builds it (``build_stack`` + ``serve_stack``), and talk to it over raw trio
sockets: a well-behaved client library would not hang up mid-stream on cue.

A :class:`Hold` can stop the batch loop before its next step, so a demonstration can
say "this request is now in prefill" and act at that moment, without racing a clock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from triollm.plan import StepPlan, StepResult


@dataclass
class Server:
    stack: Any  # triollm.server.command.Stack
    port: int

    @property
    def service(self) -> Any:
        return self.stack.service

    def pool(self) -> str:
        """The pool and the queue, as one line: what the demonstrations print."""
        s = self.service.scheduler.statistics()
        return (
            f"blocks free {s.blocks_free}/{s.blocks_total}, "
            f"running {s.running}, waiting {s.waiting}"
        )

    async def wait_for(self, predicate: Any) -> None:
        """Wait (on the service's change events, not a timer) until
        ``predicate(statistics)`` holds for the scheduler's statistics."""
        scheduler = self.service.scheduler
        await self.service.wait_until(lambda: predicate(scheduler.statistics()))


@asynccontextmanager
async def demo_server(**knobs: Any) -> AsyncIterator[Server]:
    """The demo model served on 127.0.0.1 (a free port) with the given capacity and
    service knobs (``Capacity`` and ``ServiceConfig`` field names); shut down on exit."""
    from dataclasses import fields

    from triollm.demo import resolve_model_dir
    from triollm.model.loader import load_model
    from triollm.server.command import build_stack, serve_stack
    from triollm.server.frontend import HttpConfig
    from triollm.service import ServiceConfig
    from triollm.sizing import Capacity

    logging.getLogger("triollm").setLevel(logging.ERROR)  # the demo prints its own story
    loaded = load_model(resolve_model_dir(None))
    capacity = {f.name: knobs.pop(f.name) for f in fields(Capacity) if f.name in knobs}
    service = {f.name: knobs.pop(f.name) for f in fields(ServiceConfig) if f.name in knobs}
    if knobs:
        raise TypeError(f"unknown knobs {sorted(knobs)}")
    stack = build_stack(loaded, Capacity(**capacity), ServiceConfig(**service))
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            serve_stack, stack, HttpConfig(host="127.0.0.1", port=0, grace_s=2.0), shutdown
        )
        try:
            yield Server(stack, int(binds[0].rsplit(":", 1)[1]))
        finally:
            shutdown.set()


class Hold:
    """Stops the batch loop before each step until :meth:`step` lets some through.

    Installed on the service's step runner (the one seam the service offers for
    this; the tests use the same one). While the loop is held, nothing computes:
    whatever the demonstration sees changing then was done by the event loop alone.
    """

    def __init__(self, server: Server) -> None:
        self._inner = server.service.step_runner
        self._credit = 0
        self._is_parked = False
        self._more = trio.Event()  # set: credit was given
        self._changed = trio.Event()  # set and replaced at every park and unpark
        server.service.step_runner = self._run

    async def _run(self, plan: StepPlan) -> StepResult:
        while self._credit == 0:
            self._set_parked(True)
            await self._more.wait()
            self._more = trio.Event()
        self._set_parked(False)
        self._credit -= 1
        return await self._inner(plan)

    def _set_parked(self, parked: bool) -> None:
        self._is_parked = parked
        self._changed.set()
        self._changed = trio.Event()

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    async def parked(self) -> None:
        """Wait until the loop has work and is held before its next step."""
        await self._until(lambda: self._is_parked)

    async def step(self, n: int = 1) -> None:
        """Let ``n`` steps run; return once the loop is held before the next one."""
        self._credit += n
        self._more.set()
        await self._until(lambda: self._credit == 0 and self._is_parked)

    def release(self) -> None:
        """Stop holding: every later step runs at once."""
        self._credit = 10**9
        self._more.set()


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    events: list[Any]  # the SSE payloads (dicts, or "[DONE]")
    body: Any  # a JSON body, decoded (None for a stream)


class Client:
    """One HTTP/1.1 POST over a raw socket, read as far as the caller wants."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def post(cls, port: int, path: str, body: dict[str, Any]) -> Client:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        await stream.send_all(head + data)
        return cls(stream)

    async def _more(self) -> bool:
        try:
            chunk = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return False
        self.buf += chunk
        return bool(chunk)

    async def receive(self) -> bool:
        """Read what the socket has now (waiting for some); False once it is closed."""
        return await self._more()

    def events_so_far(self) -> list[Any]:
        """The SSE payloads that have arrived whole so far, while the stream is open
        (a chunk cut short by the read gives a block without its blank line: left out)."""
        _, sep, body = bytes(self.buf).partition(b"\r\n\r\n")
        if not sep:
            return []
        blocks = _unchunk(body).decode(errors="replace").split("\n\n")[:-1]
        return [
            b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
            for b in blocks
            if b.startswith("data: ")
        ]

    async def read_events(self, n: int) -> None:
        """Read until ``n`` SSE events have arrived (or the stream ended)."""
        while self.buf.count(b"\n\n") < n and await self._more():  # headers end in \r\n\r\n
            pass

    async def read_all(self) -> Response:
        """Read one whole response: by its Content-Length, to the last chunk of a chunked
        body, or to EOF. (Not to EOF alone: a keep-alive connection stays open.)"""
        while not self._complete() and await self._more():
            pass
        return self.response()

    def _complete(self) -> bool:
        head, sep, body = bytes(self.buf).partition(b"\r\n\r\n")
        if not sep:
            return False
        headers = head.decode("latin-1").lower()
        if "transfer-encoding: chunked" in headers:
            return body.endswith(b"0\r\n\r\n")
        for line in headers.split("\r\n"):
            if line.startswith("content-length:"):
                return len(body) >= int(line.split(":", 1)[1])
        return False

    def response(self) -> Response:
        head, _, body = bytes(self.buf).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if lines and lines[0] else 0
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])
        }
        text = _unchunk(body) if headers.get("transfer-encoding") == "chunked" else body
        decoded = None
        if headers.get("content-type", "").startswith("application/json"):
            decoded = json.loads(text)
        events: list[Any] = []
        for block in text.decode(errors="replace").split("\n\n"):
            if block.startswith("data: "):
                payload = block[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return Response(status, headers, events, decoded)

    async def hang_up(self) -> None:
        await self.stream.aclose()


def _unchunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, body = body.partition(b"\r\n")
        if not size_line.strip():
            break
        size = int(size_line, 16)
        if size == 0:
            break
        out += body[:size]
        body = body[size + 2 :]
    return bytes(out)
