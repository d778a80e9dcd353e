"""Raw-socket abuse: what a careless or hostile HTTP client does, byte by byte.

Each test speaks HTTP by hand over a trio socket, so it can do what no client
library does on purpose: stop half-way through the headers, close its write half,
speak HTTP/1.0, send ``Connection: close`` and wait for the server to hang up.
The rule for all of them: the client gets a complete, correct answer or a clear
refusal, the connection ends when HTTP says it must, and nothing is left behind
(blocks, handler tasks).

Every wait on the server is a hang guard (``trio.fail_after``), never a timing
assertion: without the fix the guarded read would wait forever.
"""

from __future__ import annotations

import json

import trio
from serverkit import (
    MODEL_ID,
    StepGate,
    live_server,
    raw_post,
    read_until,
    sse_payloads,
    unchunk,
)

HANG_S = 30  # a hang guard: far longer than any of these exchanges takes


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


def request(
    path: str,
    body: dict | bytes | None = None,
    *,
    version: str = "1.1",
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body else b""
    head = {"Host": "127.0.0.1"}
    if body is not None:
        head |= {"Content-Type": "application/json", "Content-Length": str(len(data))}
    head |= headers or {}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/{version}\r\n{lines}\r\n".encode() + data


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    buf = bytearray()
    with trio.fail_after(HANG_S):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            buf += chunk
    return bytes(buf)


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def header(raw: bytes, name: str) -> str | None:
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    for line in head:
        k, _, v = line.partition(":")
        if k.strip().lower() == name.lower():
            return v.strip()
    return None


def body_of(raw: bytes) -> bytes:
    if (header(raw, "transfer-encoding") or "").lower() == "chunked":
        return unchunk(raw)
    return raw.partition(b"\r\n\r\n")[2]


COMPLETION = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
COMPLETION["ignore_eos"] = True


async def test_a_connection_close_request_gets_its_answer_and_then_the_server_hangs_up(loaded):
    async with live_server(loaded) as live:
        for path, body in (("/v1/completions", COMPLETION), ("/health", None)):
            s = await connect(live.port)
            await s.send_all(
                request(
                    path,
                    body,
                    headers={"Connection": "close"},
                    method="POST" if body else "GET",
                )
            )
            raw = await read_to_eof(s)  # hangs without the fix: the socket stays open
            assert status_of(raw) == 200
            assert header(raw, "connection") == "close"
            await s.aclose()
        assert live.pool_is_idle()


async def test_an_http_1_0_request_and_stream_end_with_the_connection(loaded):
    async with live_server(loaded) as live:
        s = await connect(live.port)
        await s.send_all(request("/v1/completions", COMPLETION, version="1.0"))
        raw = await read_to_eof(s)
        assert status_of(raw) == 200
        assert json.loads(body_of(raw))["usage"]["completion_tokens"] == 4
        await s.aclose()

        # HTTP/1.0 has no chunked encoding: the stream's end is the connection's end,
        # so a client that got [DONE] and no EOF would wait forever.
        s = await connect(live.port)
        await s.send_all(request("/v1/completions", COMPLETION | {"stream": True}, version="1.0"))
        raw = await read_to_eof(s)
        assert status_of(raw) == 200
        events = sse_payloads(body_of(raw))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await s.aclose()
        assert live.pool_is_idle()


async def test_a_refusal_during_the_drain_closes_its_keep_alive_connection(loaded):
    """Shutdown with a stream still running: a newcomer on a keep-alive connection
    gets its 503 and the connection closes, so it cannot hold the drain open."""
    async with live_server(loaded, http={"grace_s": HANG_S}) as live:
        service = live.service
        gate = StepGate(service)
        running = await connect(live.port)
        await running.send_all(request("/v1/completions", COMPLETION | {"stream": True}))
        await service.wait_until(lambda: gate.parked)

        keep = await connect(live.port)
        await keep.send_all(request("/v1/completions", COMPLETION))
        service.begin_shutdown()  # what the watchdog does on SIGTERM (queue closed)
        raw = await read_to_eof(keep)  # the 503, then EOF (no fix: no EOF, ever)
        assert status_of(raw) == 503
        assert json.loads(body_of(raw))["error"]["code"] == "shutting_down"
        await keep.aclose()

        live.shutdown.set()
        gate.open()
        raw = await read_to_eof(running)
        assert sse_payloads(unchunk(raw))[-1] == "[DONE]"
        await running.aclose()
    # The drain ended when the stream did: nothing was left for the abort after the grace.
    assert live.stack.metrics.aborted_connections() == 0


async def test_during_the_drain_a_new_connection_gets_503_with_retry_after(loaded):
    """SIGTERM with a stream running: the port keeps answering (no refused connection),
    a newcomer gets 503 ``shutting_down`` with ``Retry-After`` and the connection
    closes, the probes still answer, and the running stream finishes whole."""
    async with live_server(loaded, http={"grace_s": HANG_S}) as live:
        service = live.service
        gate = StepGate(service)
        running = await connect(live.port)
        await running.send_all(request("/v1/completions", COMPLETION | {"stream": True}))
        await service.wait_until(lambda: gate.parked)
        live.shutdown.set()  # what SIGTERM does
        await service.wait_until(lambda: service.closing)

        newcomer = await connect(live.port)  # no fix: no answer, ever (hypercorn stopped)
        await newcomer.send_all(request("/v1/completions", COMPLETION))
        raw = await read_to_eof(newcomer)
        assert status_of(raw) == 503
        assert json.loads(body_of(raw))["error"]["code"] == "shutting_down"
        assert 1 <= int(header(raw, "retry-after") or 0) <= HANG_S
        assert header(raw, "connection") == "close"
        await newcomer.aclose()
        probe = await connect(live.port)
        await probe.send_all(request("/health", method="GET", headers={"Connection": "close"}))
        assert status_of(await read_to_eof(probe)) == 200  # draining, not dead
        await probe.aclose()
        probe = await connect(live.port)
        await probe.send_all(request("/ready", method="GET", headers={"Connection": "close"}))
        assert status_of(await read_to_eof(probe)) == 503  # shutting down: not ready
        await probe.aclose()
        # Those 503s are the lifecycle speaking, not server errors (issue 28, N11).
        assert live.stack.metrics.server_error_count() == 0

        gate.open()
        raw = await read_to_eof(running)
        events = sse_payloads(unchunk(raw))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await running.aclose()
    assert live.stack.metrics.aborted_connections() == 0


async def test_the_drain_waits_for_a_slow_readers_last_bytes_and_still_answers_newcomers(loaded):
    """A stream the service has finished while its response is still being written (a
    client reading slowly): the drain is not over, so the port still answers with 503."""
    slow_body = COMPLETION | {"stream": True, "max_tokens": 200, "logprobs": 5}
    async with live_server(loaded, http={"grace_s": HANG_S, "send_buffer_bytes": 4096}) as live:
        service, app = live.service, live.stack.app
        slow = await raw_post(live.port, "/v1/completions", slow_body, rcvbuf=2048)
        registry = live.stack.metrics.registry

        def finished_but_still_writing() -> bool:
            tokens = registry.get_sample_value("triollm:generation_tokens_total") or 0
            return tokens >= 200 and service.live_requests == 0 and app.in_flight == 1

        await service.wait_until(finished_but_still_writing)
        live.shutdown.set()
        await service.wait_until(lambda: service.closing)

        newcomer = await connect(live.port)  # no fix: the drain looked over, port closed
        await newcomer.send_all(request("/v1/completions", COMPLETION))
        raw = await read_to_eof(newcomer)
        assert status_of(raw) == 503
        await newcomer.aclose()

        raw = await read_to_eof(slow)
        events = sse_payloads(unchunk(raw))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await slow.aclose()


async def test_a_stream_cut_by_the_end_of_the_grace_gets_the_shutdown_error_event(loaded):
    async with live_server(loaded, http={"grace_s": 0.5}) as live:
        service = live.service
        gate = StepGate(service)
        s = await connect(live.port)
        body = COMPLETION | {"stream": True, "max_tokens": 50}
        await s.send_all(request("/v1/completions", body))
        buf = bytearray()
        with trio.fail_after(HANG_S):
            await service.wait_until(lambda: gate.parked)
            gate.allow(3)
            assert await read_until(s, b'"text_completion"', buf)
        live.shutdown.set()  # the grace (0.5 s) runs out with the stream held still
        raw = bytes(buf) + await read_to_eof(s)
        events = sse_payloads(unchunk(raw))
        assert events[-1] == "[DONE]"  # no fix: a truncated chunked body, no error event
        assert events[-2]["error"]["code"] == "shutdown"
        assert raw.endswith(b"0\r\n\r\n")  # a complete chunked body
        await s.aclose()
        gate.open()


async def test_a_half_close_after_a_complete_request_still_gets_the_answer(loaded):
    async with live_server(loaded) as live:
        for body in (COMPLETION, COMPLETION | {"stream": True}):
            s = await connect(live.port)
            await s.send_all(request("/v1/completions", body))
            await s.send_eof()  # shutdown(SHUT_WR): "that was all; now answer"
            raw = await read_to_eof(s)  # no fix: EOF at once, the request cancelled
            # The server asked "still there?" with an interim 100 (RFC 9110 15.2: a
            # client must skip 1xx responses it did not expect), then answered.
            interim, _, raw = raw.partition(b"\r\n\r\n")
            assert interim == b"HTTP/1.1 100 "
            assert status_of(raw) == 200
            if body.get("stream"):
                assert sse_payloads(body_of(raw))[-1] == "[DONE]"
            else:
                assert json.loads(body_of(raw))["usage"]["completion_tokens"] == 4
            await s.aclose()
        # A half-close in the middle of the body is a client that left: nothing runs.
        s = await connect(live.port)
        raw_req = request("/v1/completions", COMPLETION)
        await s.send_all(raw_req[:-5])
        await s.send_eof()
        raw = await read_to_eof(s)
        assert raw == b"" or 400 <= status_of(raw) < 500
        await s.aclose()
        await live.service.wait_until(lambda: live.stack.app.in_flight == 0)
        assert live.pool_is_idle()


async def test_a_slowloris_that_never_finishes_its_headers_is_hung_up_on(loaded):
    async with live_server(loaded) as live:
        s = await connect(live.port)
        head = request("/v1/completions", COMPLETION)
        closed = False
        with trio.fail_after(HANG_S):
            for byte in head[:-4]:  # never the blank line that ends the headers
                try:
                    await s.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    closed = True
                    break
                with trio.move_on_after(0.2):  # a client trickling a byte every 0.2 s
                    if await s.receive_some(1024) == b"":
                        closed = True
                        break
        # hypercorn's keep-alive timer runs until a request's headers are complete.
        assert closed
        await s.aclose()
        assert live.stack.app.in_flight == 0


async def test_headers_with_no_body_are_answered_408_after_the_body_timeout(loaded):
    async with live_server(loaded, body_timeout_s=1.0) as live:
        s = await connect(live.port)
        head, _, _ = request("/v1/completions", COMPLETION).partition(b"\r\n\r\n")
        await s.send_all(head + b"\r\n\r\n")  # Content-Length promised, nothing sent
        raw = await read_to_eof(s)
        assert status_of(raw) == 408
        assert json.loads(body_of(raw))["error"]["code"] == "request_timeout"
        await s.aclose()
        assert live.pool_is_idle()


async def test_a_half_body_at_sigterm_gets_the_drains_503_instead_of_holding_it(loaded):
    # Headers and half a body, then nothing: the drain waited for its handler for the
    # whole grace (issue 28, N5). Now it is answered as a newcomer would be.
    async with live_server(loaded, http={"grace_s": 4 * HANG_S}) as live:
        s = await connect(live.port)
        data = request("/v1/completions", COMPLETION)
        await s.send_all(data[: len(data) - 10])
        await live.service.wait_until(lambda: live.stack.app.in_flight == 1)
        live.shutdown.set()
        raw = await read_to_eof(s)  # no fix: nothing until the grace (hang guard first)
        assert status_of(raw) == 503
        assert json.loads(body_of(raw))["error"]["code"] == "shutting_down"
        assert header(raw, "connection") == "close"
        await s.aclose()


async def test_http2_is_not_spoken_so_its_flow_control_cannot_hold_a_connection(loaded):
    # Over h2c a client that granted no flow-control window held its connection for 82 s
    # and the drain for the whole grace (issue 28, N6): the write guard covers HTTP/1.1.
    async with live_server(loaded) as live:
        s = await connect(live.port)  # prior knowledge: the HTTP/2 preface at once
        await s.send_all(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        )
        raw = await read_to_eof(s)
        assert raw == b""  # no fix: an HTTP/2 SETTINGS frame
        await s.aclose()
        s = await connect(live.port)  # an upgrade: answered in HTTP/1.1
        upgrade = {
            "Connection": "Upgrade, HTTP2-Settings, close",
            "Upgrade": "h2c",
            "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA",
        }
        await s.send_all(request("/health", method="GET", headers=upgrade))
        raw = await read_to_eof(s)
        assert raw.startswith(b"HTTP/1.1 200")  # no fix: HTTP/1.1 101 Switching Protocols
        await s.aclose()
