"""A bounded write for hypercorn's trio worker: a client that stops reading cannot pin us.

The hazard (hypercorn 0.18, ``hypercorn/trio/tcp_server.py``, ``TCPServer.protocol_send``):
every write to the socket runs inside ``trio.CancelScope(shield=True)`` with no
deadline. The shield is there for a good reason -- a ``send_all`` interrupted
half-way leaves half an HTTP chunk on the wire -- but it means a client that keeps
its connection open and stops reading blocks that write until the kernel's
buffers drain, i.e. forever. The request's task is stuck inside the shield: the
disconnect machinery cannot reach it (the client never disconnects), our
cancellation cannot reach it (shielded), and hypercorn's graceful shutdown
cannot reach it either (it cancels the handler nursery, which the shield ignores).

The fix keeps the shield and gives it a deadline of its own: a shielded cancel
scope is immune to *outer* cancellation but still fires at *its own* deadline.
A write that makes no progress for ``write_timeout_s`` seconds is abandoned, and
because an abandoned ``send_all`` leaves the stream in an unknown state, the
connection is aborted at once (``SO_LINGER`` 0, so the kernel drops the queued
bytes with a RST instead of retrying them for minutes). Closing the socket wakes
hypercorn's reader task, which reports ``http.disconnect`` to the app, and
quart-trio cancels the handler: the ordinary client-left path takes over.

A second hazard, found while testing shutdown: with quart-trio, the keep-alive
idle timer of a connection is started from inside the app's final ``send``, which
quart-trio cancels moments later; the timer never starts, so an idle keep-alive
connection is never closed -- and at shutdown it holds the server for the whole
grace period. The guard shields that (brief) timer restart.

A third, the same cancellation again: the ``Closed`` event that ends a connection
which must not be kept (``Connection: close``, HTTP/1.0, a request answered during
the drain) can be cut between "response written" and "socket closed"; the socket
then stays open, an HTTP/1.0 client (whose body ends with the connection) waits
forever, and the drain waits for the whole grace period. The guard shields it too.

A fourth: a client that sends a complete request and then closes its write half
still waits for its answer; stock hypercorn reports that EOF as a disconnect and
the request is cancelled unanswered. The guard holds such an EOF back until the
response has ended. Tests: tests/server/test_raw_sockets.py.

A fifth: HTTP/2 in cleartext (h2c: an ``Upgrade: h2c`` header, or the HTTP/2 preface
sent at once) is accepted by stock hypercorn, and none of the guards above reach it:
an HTTP/2 stream waits for the client's flow-control window, not for a socket write,
so a client that stops granting window held its connection 82 s and the drain for
the whole grace (issue 28, N6). The guard keeps every connection on HTTP/1.1: an
``Upgrade: h2c`` is ignored (the answer comes in HTTP/1.1, as RFC 9110 allows) and a
prior-knowledge preface closes the connection. A deployment that wants HTTP/2 puts a
proxy in front (Envoy speaks HTTP/1.1 to its upstreams by default).

A sixth, the same cancellation once more: upstream takes the connection's send lock
outside its shield, so a task cancelled while waiting for it leaves h11 believing a
response start was sent that never was; hypercorn then answers 500 on top of it, h11
raises, and the exception ends the whole server (a replica SIGTERMed under load
crashed so, cutting every stream it carried). The guard takes the lock inside the
shield. Test: tests/server/test_transport_cancel.py.

It also lets a deployment shrink the kernel's send buffer (``SO_SNDBUF``) so a
stalled reader backs up into our bounded per-request channel after kilobytes
rather than megabytes, and keeps a set of live connections so shutdown can
abort the ones still open after the grace period.

How it is installed: ``hypercorn.trio.run.worker_serve`` builds connections by
calling the module-global name ``TCPServer``. :func:`install` replaces that name
with :class:`GuardedTCPServer`, a subclass that changes ``run`` (register, buffer
size), ``_read_data`` (the half-close) and ``protocol_send`` (the deadline, the
shields). It does so only for
the hypercorn versions in :data:`PINNED_VERSIONS`, whose ``protocol_send`` it was
written against and tested on; the options live on the hypercorn ``Config``, so a
config without them behaves exactly as stock hypercorn.
Test: tests/server/test_slow_client.py.

Trap: upgrading hypercorn silently turns this off (install() returns False and
the service logs a warning);
tests/server/test_slow_client.py::test_the_write_guard_is_installed_for_this_hypercorn
fails first, and tests/server/test_pins.py keeps pyproject pinned to what it accepts.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import socket
import struct
from collections.abc import Callable
from typing import Any

import h11
import hypercorn.trio.run as hypercorn_run
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

log = logging.getLogger("triollm.server")

PINNED_VERSIONS = frozenset({"0.18.0"})
# The attributes this module reads from a hypercorn Config (absent = stock behaviour).
WRITE_TIMEOUT_ATTR = "triollm_write_timeout_s"
SEND_BUFFER_ATTR = "triollm_send_buffer_bytes"
CONNECTIONS_ATTR = "triollm_connections"
ON_ABORT_ATTR = "triollm_on_abort"
# Closing a connection (socket close + telling the app) is brief; a bound, not a timing.
CLOSE_BOUND_S = 5.0
# A half-closed connection waiting for its answer: how often the kernel is asked
# whether the client has in fact gone (its RST). Cost: one getsockopt per period.
HALF_CLOSE_POLL_S = 0.05
TCP_CLOSE = 7  # tcp_info.tcpi_state of a connection the peer reset (linux/tcp_states.h)


class _Http2Refused(Exception):
    """A client opened with the HTTP/2 preface (prior knowledge)."""


class GuardedTCPServer(TCPServer):
    """hypercorn's TCPServer with a deadline on every shielded write."""

    aborted = False

    async def run(self) -> None:
        connections: set[GuardedTCPServer] | None = getattr(self.config, CONNECTIONS_ATTR, None)
        size = getattr(self.config, SEND_BUFFER_ATTR, None)
        sock = getattr(self.stream, "socket", None)
        if size is not None and sock is not None:
            # Set before the first write; Linux doubles the value and disables autotuning.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        if connections is not None:
            connections.add(self)
        try:
            await super().run()
        finally:
            if connections is not None:
                connections.discard(self)

    # Set when the response in progress has ended (the connection went idle or closed).
    _answered: trio.Event | None = None

    def _h11(self) -> Any:
        return getattr(getattr(self.protocol, "protocol", None), "connection", None)

    def _awaiting_answer(self) -> bool:
        """A complete HTTP/1.1 request whose response has not started yet."""
        conn = self._h11()
        return (
            getattr(conn, "their_state", None) is h11.DONE
            and getattr(conn, "our_state", None) is h11.SEND_RESPONSE
            and getattr(conn, "their_http_version", None) == b"1.1"
        )

    def _peer_reset(self) -> bool:
        """The kernel has seen the peer's RST (TCP_INFO state CLOSE)."""
        sock = getattr(self.stream, "socket", None)
        if sock is None:
            return True
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE
        except OSError:
            return True

    def _http11_only(self) -> None:
        """Keep this connection on HTTP/1.1 (hazard 5, module docstring)."""
        inner = getattr(self.protocol, "protocol", None)
        if not isinstance(inner, H11Protocol) or getattr(inner, "_triollm_http11", False):
            return

        async def check_protocol(event: h11.Request) -> None:
            # An h2c Upgrade header is ignored (RFC 9110 lets a server answer in the
            # protocol asked in); a prior-knowledge HTTP/2 preface ends the connection.
            if event.method == b"PRI" and event.target == b"*":
                raise _Http2Refused

        inner._check_protocol = check_protocol  # type: ignore[method-assign]
        inner._triollm_http11 = True  # type: ignore[attr-defined]

    async def _read_data(self) -> None:
        self._http11_only()
        try:
            await self._read_data_http11()
        except _Http2Refused:
            log.info("refused an HTTP/2 connection (prior knowledge): this server speaks HTTP/1.1")
            await self.abort(count=False)

    async def _read_data_http11(self) -> None:
        # Hazard 4 (measured): a client that sends its whole request and then closes
        # its write half (``shutdown(SHUT_WR)``, ``nc -N``, scripted clients) still
        # waits for the answer. Stock hypercorn reports that EOF as a disconnect and
        # the request is cancelled unanswered. But an EOF reads the same whether the
        # client half-closed or left for good, and a client that left must be let go
        # at once (docs/cancellation.md). So: an EOF after a complete HTTP/1.1
        # request, before the response starts, is answered with an interim
        # "100 Continue" (which every HTTP/1.1 client must accept and skip). A client
        # that left answers it with a RST, seen by the kernel (TCP_INFO), and is let
        # go; one that half-closed keeps its request, and its EOF is held until the
        # response has ended. Any other EOF is a disconnect, as upstream.
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or math.inf):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            if data == b"" and self._awaiting_answer():
                await self._hold_half_close()
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self.protocol.handle(Closed())

    async def _hold_half_close(self) -> None:
        self._answered = answered = trio.Event()
        with contextlib.suppress(h11.LocalProtocolError):
            await self.protocol.protocol._send_h11_event(  # type: ignore[union-attr]
                h11.InformationalResponse(status_code=100, headers=[])
            )
        # Until the response ends: watch for the RST of a client that left (loopback
        # delivers it within the write above; a remote one within a round trip).
        while not answered.is_set() and not self._peer_reset() and not self.aborted:
            with trio.move_on_after(HALF_CLOSE_POLL_S):
                await answered.wait()

    def _response_ended(self) -> None:
        if self._answered is not None:
            self._answered.set()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated | Closed):
            self._response_ended()
        if isinstance(event, Updated):
            # Hazard 2 (measured): with quart-trio, the Updated(idle=True) that starts the
            # keep-alive timer is sent from inside the app's last send(); that same send
            # reports http.disconnect to quart-trio, which cancels the app task -- and
            # with it this restart, half done. The idle timer then never runs: the
            # connection is never closed for idleness, and at shutdown it holds the
            # server for the whole grace period. Restarting a timer is brief: shield it.
            with trio.CancelScope(shield=True):
                await super().protocol_send(event)
            return
        if isinstance(event, Closed):
            # Hazard 3 (measured): the same cancellation lands on the Closed event that
            # ends a connection which must not be kept (``Connection: close``, HTTP/1.0,
            # a request finished while shutting down). Cut between "response written"
            # and "socket closed", it leaves the socket open: an HTTP/1.0 client (whose
            # body ends with the connection) waits forever, and at shutdown the
            # connection holds the drain for the whole grace period. Closing a socket
            # does not block, so the shield gets a short deadline of its own for the
            # protocol's own bookkeeping (a disconnect handed to the app).
            with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_BOUND_S):
                await super().protocol_send(event)
            return
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        timeout: float | None = getattr(self.config, WRITE_TIMEOUT_ATTR, None)
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        stalled = broken = False
        # Hazard 6 (measured: a replica crashed at SIGTERM under load): by the time this
        # runs, h11 has already moved its state past the event these bytes carry (a
        # response start: SEND_BODY). Upstream takes the send lock *outside* its
        # shield, and acquiring a lock is a checkpoint: a task cancelled there (the
        # drain's cut_readers, quart-trio's disconnect) leaves h11 saying "response
        # sent" while hypercorn's stream still says "no response", so its clean-up
        # answers 500, h11 raises LocalProtocolError and the exception takes the whole
        # server down, every stream with it. So the lock is taken inside the shield
        # too: once h11 has committed to an event, its bytes are written (or the
        # deadline aborts the connection), and the cancel lands at the next checkpoint.
        with trio.CancelScope(shield=True, deadline=deadline) as sc:
            async with self.send_lock:
                try:
                    await self.stream.send_all(event.data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    broken = True
        stalled = sc.cancelled_caught
        if not stalled and broken:
            await self.protocol.handle(Closed())
            return
        if stalled:
            log.warning(
                "write stalled for %.1f s (client not reading); aborting the connection", timeout
            )
            await self.abort()

    async def abort(self, *, count: bool = True) -> None:
        """Drop the connection now: RST, queued bytes discarded, reader woken."""
        if self.aborted:
            return
        self.aborted = True
        self._response_ended()
        on_abort = getattr(self.config, ON_ABORT_ATTR, None)
        if count and on_abort is not None:
            on_abort()
        sock = getattr(self.stream, "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by the peer: nothing to drop
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with trio.CancelScope(shield=True):
            await self.stream.aclose()  # closes at once; wakes the reader task
        # The reader reports the disconnect too; doing it here as well makes it
        # prompt even if the reader is parked (h11 PAUSED on a pipelined request).
        await self.protocol.handle(Closed())


def installed() -> bool:
    return hypercorn_run.TCPServer is GuardedTCPServer


def install() -> bool:
    """Make hypercorn's trio worker build :class:`GuardedTCPServer` connections.

    Idempotent. Returns False (and changes nothing) on a hypercorn version this
    adaptation was not written against.
    """
    if installed():
        return True
    version = importlib.metadata.version("hypercorn")
    if version not in PINNED_VERSIONS or hypercorn_run.TCPServer is not TCPServer:
        log.warning(
            "hypercorn %s is not one of %s: writes to a client that stops reading are unbounded",
            version,
            sorted(PINNED_VERSIONS),
        )
        return False
    hypercorn_run.TCPServer = GuardedTCPServer  # type: ignore[misc]
    return True


def configure(
    config: Config,
    *,
    write_timeout_s: float | None,
    send_buffer_bytes: int | None,
    on_abort: Callable[[], None] | None = None,
) -> set[Any]:
    """Put the guard's options on a hypercorn Config; returns its live-connection set.

    ``on_abort`` is called (sync) each time a connection is aborted."""
    connections: set[GuardedTCPServer] = set()
    setattr(config, ON_ABORT_ATTR, on_abort)
    setattr(config, WRITE_TIMEOUT_ATTR, write_timeout_s)
    setattr(config, SEND_BUFFER_ATTR, send_buffer_bytes)
    setattr(config, CONNECTIONS_ATTR, connections)
    return connections


async def abort_all(connections: set[Any]) -> int:
    """Abort every connection still open (shutdown after the grace period)."""
    live = list(connections)
    for conn in live:
        await conn.abort()
    return len(live)
