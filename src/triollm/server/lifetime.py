"""The request's lifetime at the ASGI level: who ends a request, and two hypercorn/quart traps.

:class:`Lifetime` is an ASGI middleware around the whole quart-trio app. Its
``finally`` runs however the request ends (normal, error, cancelled before or after
the response started) and calls the stream's synchronous
:meth:`~triollm.service.RequestStream.close`: an ``await`` there would raise at once,
because the scope is already cancelled. A request cut short by its client is logged
with status 499 and counted as ``client_closed``. It is also the access log: one line
per request, with the :class:`Stage` it reached and why a stream ended early.

Traps it designs around (read with ``transport.py``, the third one):

- An answer sent before the body was read (413, 404 on a POST) leaves the rest of
  the body on the wire: the connection cannot carry another request, so the answer
  says ``Connection: close``.
- hypercorn 0.18 deadlocks closing such a connection unless someone keeps reading
  the request (``_drain_until_disconnect``, in a nursery that outlives the request).
  That nursery is a required argument: a Lifetime cannot be built without it, so the
  guard cannot be silently off however the app is mounted (``frontend.py`` builds
  the app inside its own nursery; an in-process test passes its own).

During a shutdown's drain the server still accepts connections (``frontend.py``
keeps listening until the last stream has ended), and every new request but the
probes is answered here, before any route runs: 503 ``shutting_down`` with
``Retry-After`` and ``Connection: close``. A client retries later instead of
finding the port refusing it, and a keep-alive connection cannot hold the drain open.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import trio

from triollm.outcomes import EndCode
from triollm.server.door import DEFAULT_OPEN_PATHS, send_error
from triollm.server.metrics import Metrics
from triollm.service import Failed, RequestStream, Service

log = logging.getLogger("triollm.server")

LIFE_KEY = "triollm.life"
# What a draining server still answers: the probes (/health stays 200, /ready says
# "shutting down"), so an orchestrator sees the drain instead of a refusal.
DRAIN_OPEN_PATHS = DEFAULT_OPEN_PATHS
DRAIN_LIMIT_S = 30.0  # a drainer gives up after this (a resource bound, not a timing)


class Stage(enum.Enum):
    """How far a request got: READING -> QUEUED -> STREAMING | GENERATING | REFUSED."""

    READING = "reading"  # the body is being read and parsed
    QUEUED = "queued"  # waiting for admission
    STREAMING = "streaming"  # admitted, answering with SSE
    GENERATING = "generating"  # admitted, answering with one JSON body at the end
    REFUSED = "refused"  # turned away (400, 429, 503) after parsing


@dataclass
class RequestLife:
    """One request as the middleware sees it."""

    method: str
    path: str
    started: float
    stage: Stage = Stage.READING
    stream: RequestStream | None = None
    disconnected: bool = False
    status: int | None = None
    response_done: bool = False
    body_pending: bool = False  # the request has a body we have not read to its end
    closes_connection: bool = False  # we answered before the body ended: Connection: close


class Lifetime:
    """ASGI middleware: records disconnects and ends every request synchronously."""

    def __init__(
        self, app: Any, metrics: Metrics, service: Service, drain_nursery: trio.Nursery
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.service = service
        self.in_flight = 0  # HTTP requests whose handler task has not ended
        # The cancel scope of each request in flight, for cut_readers (keyed by id(life)).
        self._scopes: dict[int, tuple[RequestLife, trio.CancelScope]] = {}
        # Where drainers of refused bodies run: they must outlive the request's own task.
        self.drain_nursery = drain_nursery

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        life = RequestLife(scope["method"], scope["path"], time.monotonic())
        life.body_pending = _has_body(scope)
        scope[LIFE_KEY] = life  # quart's Request keeps this same dict as request.scope

        async def watched_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not life.response_done:
                life.disconnected = True
            elif message["type"] == "http.request" and not message.get("more_body"):
                life.body_pending = False
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                life.status = message["status"]
                if life.status >= 500 and not self._by_design(life):
                    self.metrics.server_error(life.status)
                if life.body_pending:
                    # An answer sent before the body was read (413, 404 on a POST...):
                    # the unread rest of the body is still coming down this connection,
                    # so it cannot carry another request. Without "Connection: close"
                    # the server waits for a body it will never read and a keep-alive
                    # client waits for the connection: both hang.
                    headers = [
                        h for h in message.get("headers", []) if h[0].lower() != b"connection"
                    ]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
                    life.closes_connection = True
                    # hypercorn 0.18 trap: closing that connection first hands the app
                    # an ``http.disconnect`` through a bounded queue that the unread
                    # body has filled, and the app has stopped reading: the close
                    # deadlocks. A drainer task keeps receiving until that disconnect.
                    self.drain_nursery.start_soon(_drain_until_disconnect, receive)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                life.response_done = True
                if life.closes_connection:
                    # This send also closes the socket (hypercorn does it inside the
                    # call), and it hands the app the disconnect that makes quart-trio
                    # cancel this very task: unshielded, that cancel can land between
                    # "response written" and "socket closed", leaving the client
                    # waiting on an open connection. The socket write has its own
                    # deadline (transport.py), so the shield cannot pin us.
                    with trio.CancelScope(shield=True):
                        await send(message)
                    return
            await send(message)

        self.in_flight += 1
        self.service.notify()  # wake whoever waits on in_flight (the drain; tests)
        try:
            if self.service.closing and scope["path"] not in DRAIN_OPEN_PATHS:
                life.stage = Stage.REFUSED
                await self._refuse_draining(watched_send)
                return
            with trio.CancelScope() as cut:
                self._scopes[id(life)] = (life, cut)
                try:
                    await self.app(scope, watched_receive, watched_send)
                finally:
                    del self._scopes[id(life)]
            if cut.cancelled_caught and life.status is None:
                # Cut by the drain before it was queued (cut_readers): the answer any
                # newcomer gets. Its body may be unread: Connection: close follows.
                life.stage = Stage.REFUSED
                await self._refuse_draining(watched_send)
        finally:
            self.in_flight -= 1
            self._end(life)  # sync: we may be inside a cancelled scope

    def cut_readers(self) -> int:
        """At the start of the drain, end every request not yet queued (still reading its
        body, parsing, tokenizing or compiling its grammar); each gets the drain's 503.

        Such a request would be refused by the closed queue anyway, and one whose client
        sent half a body and then nothing held the drain for the whole grace: the drain
        waits for every handler (issue 28, N5). Probes are left to finish. Returns how
        many were cut."""
        cut = 0
        for life, scope in list(self._scopes.values()):
            if life.stage is Stage.READING and life.path not in DRAIN_OPEN_PATHS:
                scope.cancel()
                cut += 1
        return cut

    async def _refuse_draining(self, send: Any) -> None:
        await send_error(
            send,
            503,
            "the server is shutting down; retry later",
            "shutting_down",
            type="service_unavailable",
            headers=[
                (b"retry-after", str(self.service.retry_after_s()).encode()),
                (b"connection", b"close"),
            ],
        )

    def _by_design(self, life: RequestLife) -> bool:
        """A 503 that is the server's lifecycle speaking, not a server error: a probe
        saying "warming up" or "shutting down", or a request refused by the drain. Counted
        as errors, every fresh server started at 1 (issue 28, N11). A failed batch loop's
        503 is an error, and counted."""
        if life.status != 503 or self.service.failed is not None:
            return False
        return life.path in DRAIN_OPEN_PATHS or self.service.closing or not self.service.ready

    def _end(self, life: RequestLife) -> None:
        # Cut without a disconnect while shutting down: the grace period ran out.
        by_shutdown = self.service.closing and not life.disconnected
        reason = EndCode.SHUTDOWN if by_shutdown else EndCode.CLIENT_CLOSED
        cut = life.stream.close(reason) if life.stream is not None else False
        left_queued = life.stage is Stage.QUEUED and life.disconnected
        if left_queued:
            # A stream counts itself in the service; a waiter that left is counted here.
            self.metrics.ended_early(EndCode.CLIENT_CLOSED)
        if cut and by_shutdown:
            log.info("%s %s cut short by the shutdown", life.method, life.path)
        elif cut or left_queued:
            where = "while queued" if left_queued else f"while {life.stage.value}"
            log.info("%s %s 499 client closed the connection %s", life.method, life.path, where)
        elif life.status is not None:
            outcome = life.stream.outcome if life.stream is not None else None
            # A stream the server ended (too_slow, internal) still has status 200:
            # say why it ended, or the log shows a cut-off stream as a success.
            why = f" ended early: {outcome.code.value}" if isinstance(outcome, Failed) else ""
            log.info(
                "%s %s %d %.3fs%s",
                life.method,
                life.path,
                life.status,
                time.monotonic() - life.started,
                why,
            )
        self.service.notify()  # wake anything waiting on this request's end


async def _drain_until_disconnect(receive: Any) -> None:
    """Discard the rest of a refused body until the connection closes (see Lifetime)."""
    with trio.move_on_after(DRAIN_LIMIT_S):
        while (await receive())["type"] != "http.disconnect":
            pass


def _has_body(scope: dict[str, Any]) -> bool:
    for name, value in scope.get("headers", []):
        name = name.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False
