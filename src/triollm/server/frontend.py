"""The HTTP frontend: hypercorn serving the app, a shutdown watchdog, abort after the grace.

``Service.run(frontend=...)`` runs :func:`serve_http` in the service's nursery
(``server/command.py`` wires it). On shutdown the queue closes (waiters get 503)
and in-flight streams get ``grace_s`` seconds. hypercorn keeps listening through
that drain, so a newcomer gets a 503 with ``Retry-After`` (``lifetime.py``) rather
than a refused connection; once the last request has ended and its response is
written (or the grace ran out) hypercorn stops accepting and closes what is idle.
The connections still open after the grace (a write stuck on a client that does
not read) are aborted.
Read with ``transport.py`` (the per-write deadline it installs) and ``lifetime.py``
(the middleware whose drainers run in this nursery, and which answers the drain's 503s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import hypercorn.trio
import trio
from hypercorn.config import Config as HyperConfig

from triollm.server import transport
from triollm.server.lifetime import Lifetime
from triollm.server.metrics import Metrics
from triollm.service import Service

log = logging.getLogger("triollm.server")


# After the grace: how long the cut streams have to write their last event (a bound).
FINAL_EVENT_S = 2.0


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grace_s: float = 30.0  # shutdown: how long in-flight streams may run on (= the queue wait)
    # A socket write that makes no progress this long aborts the connection (transport.py).
    write_timeout_s: float | None = 30.0
    send_buffer_bytes: int | None = None  # SO_SNDBUF; None = the kernel's autotuned default


def _aborted(metrics: Metrics, service: Service) -> None:
    metrics.connections_aborted.inc()
    service.notify()


@dataclass(frozen=True)
class Serving:
    """What :func:`serve_http` reports once it listens: the addresses and the app."""

    binds: list[str]
    app: Lifetime


async def serve_http(
    service: Service,
    make_app: Callable[[trio.Nursery], Lifetime],
    config: HttpConfig,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run hypercorn until ``shutdown`` is set, then drain gracefully.

    ``make_app(nursery)`` builds the ASGI app around this function's nursery, the one
    that outlives every request (``lifetime.py``'s drainers need it)."""
    if not transport.install():
        log.warning("the slow-client write guard is off (unsupported hypercorn version)")
    hconfig = HyperConfig()
    hconfig.bind = [f"{config.host}:{config.port}"]
    # hypercorn cancels the handlers when its own timeout runs out; it must run out
    # after ours, or a stream cut by the end of the grace gets no closing event.
    hconfig.graceful_timeout = config.grace_s + FINAL_EVENT_S
    hconfig.accesslog = None  # Lifetime logs each request, with 499s
    hconfig.errorlog = log
    async with trio.open_nursery() as nursery:
        app = make_app(nursery)
        connections = transport.configure(
            hconfig,
            write_timeout_s=config.write_timeout_s,
            send_buffer_bytes=config.send_buffer_bytes,
            on_abort=partial(_aborted, app.metrics, service),
        )

        # hypercorn's own shutdown: not at the signal but once the drain is over, so
        # that it answers new connections (with a 503) while the streams finish.
        drained = trio.Event()

        async def watchdog() -> None:
            await shutdown.wait()
            service.begin_shutdown(config.grace_s)
            # Requests not yet queued (a body still arriving: half a body and then
            # nothing held the drain for the whole grace) get the drain's 503 now.
            cut = app.cut_readers()
            if cut:
                log.info("shutdown: %d request(s) not yet queued answered 503", cut)
            deadline = trio.current_time() + config.grace_s
            with trio.move_on_at(deadline):
                # Drained: no request left in the service, and no response still being
                # written (a slow reader's stream may end in the service long before
                # its last bytes leave).
                await service.wait_until(lambda: service.live_requests == 0 and app.in_flight == 0)
            drained.set()
            await trio.sleep_until(deadline)  # hypercorn is done by then, unless stuck
            # The grace ran out: end what still runs, so each stream writes its
            # shutdown error event and [DONE] (a whole-body request gets a 503).
            service.end_running()
            await trio.sleep(FINAL_EVENT_S + 0.5)
            n = await transport.abort_all(connections)
            if n:
                log.warning("aborted %d connection(s) still open after the grace period", n)

        async def run_server(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(
                app,  # type: ignore[arg-type]
                hconfig,
                shutdown_trigger=drained.wait,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # served and drained: stop the watchdog

        nursery.start_soon(watchdog)
        binds = await nursery.start(run_server)
        task_status.started(Serving(binds, app))
