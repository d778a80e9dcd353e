"""Hand-written HTTP/1.1 clients for the soak and the overload runs (loopback only).

The clients speak HTTP over raw trio sockets so they can misbehave on purpose (cut
the connection in any phase, stop reading) and time what a user sees (time to the
response headers, to the first token, between tokens). A real server runs in the
same ``trio.run`` (``running_server``), so a run can also read the server's state:
its KV blocks, its queue, its live requests and the tasks left in the tree.

Used by bench/soak.py, bench/overload.py and tests/server/test_soak.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket as pysocket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_MODEL = ROOT / "tests" / "fixtures" / "models" / "llama-gqa-f32"


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process, in bytes (Linux /proc)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank rule; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def live_tasks() -> list[str]:
    """The names of the tasks alive in this trio run (the whole tree, from the root)."""
    todo = [trio.lowlevel.current_root_task()]
    names = []
    while todo:
        task = todo.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return names


def count_tasks() -> int:
    return len(live_tasks())


# ----------------------------------------------------------------------------- HTTP


def http_request(
    path: str,
    body: bytes | dict[str, Any] | None,
    *,
    method: str = "POST",
    version: str = "1.1",
    headers: dict[str, str] | None = None,
) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body else b""
    head = {"Host": "127.0.0.1"}
    if body is not None:
        head |= {"Content-Type": "application/json", "Content-Length": str(len(data))}
    head |= headers or {}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/{version}\r\n{lines}\r\n".encode() + data


@dataclass
class Reply:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: list[Any] = field(default_factory=list)  # SSE payloads, "[DONE]" as a string
    t_headers: float | None = None  # seconds from send to the response headers
    t_first: float | None = None  # ... to the first event carrying text
    gaps: list[float] = field(default_factory=list)  # between text events
    complete: bool = False  # the body ended where HTTP says it ends

    @property
    def error(self) -> dict[str, Any] | None:
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        if errors:
            return errors[-1]["error"]  # type: ignore[no-any-return]
        if self.status is not None and self.status >= 400 and self.body:
            try:
                return json.loads(self.body)["error"]
            except (ValueError, KeyError, TypeError):
                return None
        return None


class _Reader:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.eof = False

    async def more(self) -> bool:
        try:
            chunk = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    async def line(self) -> bytes | None:
        while b"\r\n" not in self.buf:
            if not await self.more():
                return None
        out, _, rest = bytes(self.buf).partition(b"\r\n")
        self.buf = bytearray(rest)
        return out

    async def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self.more():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def connect(port: int, *, rcvbuf: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def exchange(
    port: int, raw: bytes, *, stop_after_events: int | None = None, rcvbuf: int | None = None
) -> Reply:
    """Send one request, read its reply (chunked or not); with ``stop_after_events``,
    hang up after that many SSE events instead (a client that leaves mid-stream)."""
    reply = Reply()
    stream = await connect(port, rcvbuf=rcvbuf)
    start = trio.current_time()
    try:
        # Refused before the body was read (413): the answer may still be there.
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(raw)
        reader = _Reader(stream)
        status_line = await reader.line()
        if status_line is None:
            return reply
        reply.status = int(status_line.split(b" ", 2)[1])
        while (line := await reader.line()) not in (None, b""):
            k, _, v = line.decode("latin-1").partition(":")
            reply.headers[k.strip().lower()] = v.strip()
        reply.t_headers = trio.current_time() - start
        body = bytearray()
        last_text: float | None = None
        pending = b""
        if reply.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.line()
                if size_line is None:
                    break
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await reader.line()
                    reply.complete = True
                    break
                data = await reader.exactly(size + 2)
                if data is None:
                    break
                body += data[:-2]
                pending += data[:-2]
                while b"\n\n" in pending:
                    block, _, pending = pending.partition(b"\n\n")
                    if not block.startswith(b"data: "):
                        continue
                    payload = block[6:].decode()
                    event = payload if payload == "[DONE]" else json.loads(payload)
                    reply.events.append(event)
                    now = trio.current_time()
                    if _has_text(event):
                        if last_text is None:
                            reply.t_first = now - start
                        else:
                            reply.gaps.append(now - last_text)
                        last_text = now
                    if stop_after_events is not None and len(reply.events) >= stop_after_events:
                        return reply
        else:
            length = reply.headers.get("content-length")
            if length is not None:
                data = await reader.exactly(int(length))
                if data is not None:
                    body += data
                    reply.complete = True
            else:
                while await reader.more():
                    pass
                body += reader.buf
                reply.complete = True
        reply.body = bytes(body)
        return reply
    finally:
        await stream.aclose()


def _has_text(event: Any) -> bool:
    if not isinstance(event, dict) or not event.get("choices"):
        return False
    choice = event["choices"][0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def reply_text(reply: Reply) -> str:
    if reply.events:
        out = []
        for e in reply.events:
            if isinstance(e, dict) and e.get("choices"):
                c = e["choices"][0]
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(out)
    obj = json.loads(reply.body)
    c = obj["choices"][0]
    return c.get("text") if "text" in c else c["message"]["content"]


# ----------------------------------------------------------------------------- a server


@asynccontextmanager
async def running_server(
    model_dir: Path | str = FIXTURE_MODEL, *, http: dict[str, Any] | None = None, **stack: Any
) -> AsyncIterator[Any]:
    """Load ``model_dir`` and serve it on 127.0.0.1 (a free port) in this trio run;
    yields the Stack (``.port`` set); on exit shuts it down gracefully."""
    from dataclasses import fields

    from triollm.model.loader import load_model
    from triollm.server.command import build_stack, serve_stack
    from triollm.server.frontend import HttpConfig
    from triollm.service import ServiceConfig
    from triollm.sizing import Capacity

    loaded = await trio.to_thread.run_sync(load_model, Path(model_dir))
    # Each keyword goes to the config that owns it (Capacity, ServiceConfig, build_stack).
    capacity = {k: stack.pop(k) for k in list(stack) if k in {f.name for f in fields(Capacity)}}
    service = {k: stack.pop(k) for k in list(stack) if k in {f.name for f in fields(ServiceConfig)}}
    built = build_stack(loaded, Capacity(**capacity), ServiceConfig(**service), **stack)
    config = HttpConfig(host="127.0.0.1", port=0, **({"grace_s": 5.0} | (http or {})))
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve_stack, built, config, shutdown)
        built.port = int(binds[0].rsplit(":", 1)[1])  # type: ignore[attr-defined]
        try:
            yield built
        finally:
            shutdown.set()


def server_is_idle(stack: Any) -> bool:
    s = stack.service.scheduler.statistics()
    return (
        s.blocks_free == s.blocks_total
        and s.running == 0
        and s.waiting == 0
        and stack.service.live_requests == 0
        and stack.app.in_flight == 0
    )
