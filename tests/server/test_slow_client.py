"""A real socket that stops reading: cut off, blocks back, neighbours unharmed.

The server's send buffer and the client's receive buffer are shrunk (SO_SNDBUF /
SO_RCVBUF) so the kernel absorbs kilobytes, not megabytes, before hypercorn's write
blocks; each chunk carries top-5 logprobs (~1 KB) so that happens within a few
dozen tokens of a tiny model. Then the per-request channel (4 steps) fills and the
batch loop cuts the request off without ever waiting for it.
"""

from __future__ import annotations

import importlib.metadata
import logging

import openai
import trio
from serverkit import MODEL_ID, live_server, raw_post, read_until, sse_payloads, unchunk

from triollm.outcomes import EndCode
from triollm.server import transport

SLOW = {
    "model": MODEL_ID,
    "prompt": "Hello there",
    "temperature": 0,
    "stream": True,
    "max_tokens": 200,
    "ignore_eos": True,
    "logprobs": 5,  # ~1 KB per chunk: the socket buffers fill within a few dozen tokens
}
SMALL_BUFFERS = {"send_buffer_bytes": 4096}


def finished(metrics) -> float:
    sample = "triollm:request_success_total"
    return metrics.registry.get_sample_value(sample, {"finished_reason": "length"}) or 0.0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_write_guard_is_installed_for_this_hypercorn():
    # Fails first when hypercorn is upgraded: re-read tcp_server.py, then re-pin.
    assert importlib.metadata.version("hypercorn") in transport.PINNED_VERSIONS
    assert transport.install()
    assert transport.installed()


async def test_a_client_that_stops_reading_is_cut_off_with_the_error_event(loaded, caplog):
    caplog.set_level(logging.INFO, logger="triollm.server")
    async with live_server(
        loaded, stream_buffer_steps=4, http=SMALL_BUFFERS | {"write_timeout_s": 120}
    ) as live:
        service, metrics = live.service, live.stack.metrics
        slow = await raw_post(live.port, "/v1/completions", SLOW, rcvbuf=2048)
        c = client(live.url)
        neighbour: list[str] = []

        async def fast() -> None:
            r = await trio.to_thread.run_sync(
                lambda: c.completions.create(model=MODEL_ID, prompt="neighbour", max_tokens=30)
            )
            neighbour.append(r.choices[0].finish_reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fast)
            # Not reading: hypercorn's write blocks, our channel fills, the loop cuts it.
            await service.wait_until(lambda: metrics.rejection_count(EndCode.TOO_SLOW) == 1)
            [seq] = [seq for seq, code in service.outcomes if code is EndCode.TOO_SLOW]
            assert service.scheduler.state(seq).value == "cancelled"  # its blocks are back
        assert neighbour and neighbour[0] in ("stop", "length")  # the neighbour completed
        # The client comes back and reads: what was generated, then the error, then [DONE].
        buf = bytearray()
        assert await read_until(slow, b"\r\n0\r\n\r\n", buf)
        events = sse_payloads(unchunk(bytes(buf)))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "too_slow"
        assert all("choices" in e for e in events[:-2])
        await slow.aclose()
        assert live.pool_is_idle()
        assert service.live_requests == 0
        await service.wait_until(lambda: live.stack.app.in_flight == 0)
    # The access log says why the stream ended, not just "200".
    assert any("ended early: too_slow" in r.getMessage() for r in caplog.records)


async def test_a_client_that_never_reads_again_is_aborted_by_the_write_deadline(loaded):
    # A stream buffer large enough never to fill: only the socket write can stall,
    # and only the write deadline can end this request.
    async with live_server(
        loaded, stream_buffer_steps=1000, http=SMALL_BUFFERS | {"write_timeout_s": 0.5}
    ) as live:
        service, metrics = live.service, live.stack.metrics
        slow = await raw_post(live.port, "/v1/completions", SLOW, rcvbuf=2048)
        # hypercorn's shielded send would block forever; the guard's deadline aborts it.
        with trio.fail_after(60):  # a hang guard (without the fix this never returns)
            await service.wait_until(lambda: metrics.aborted_connections() == 1)
        # The handler task that was stuck in the shielded write has ended.
        await service.wait_until(lambda: live.stack.app.in_flight == 0)
        assert service.live_requests == 0
        # The connection is gone: the client drains what reached it, then EOF or reset.
        buf = bytearray()
        assert not await read_until(slow, b"data: [DONE]", buf)
        await slow.aclose()
        assert live.pool_is_idle()
        # And the server is fine for the next client.
        c = client(live.url)
        r = await trio.to_thread.run_sync(
            lambda: c.completions.create(
                model=MODEL_ID, prompt="next", max_tokens=3, extra_body={"ignore_eos": True}
            )
        )
        assert r.usage.completion_tokens == 3


async def test_a_stuck_write_does_not_hold_up_graceful_shutdown(loaded):
    """Stock hypercorn behaviour (no write deadline): the shielded send is stuck, and
    only the abort after the grace period lets the server exit."""
    with trio.fail_after(60):  # a hang guard, not a timing assertion
        async with live_server(
            loaded,
            stream_buffer_steps=1000,
            http=SMALL_BUFFERS | {"write_timeout_s": None, "grace_s": 0.5},
        ) as live:
            service, metrics = live.service, live.stack.metrics
            slow = await raw_post(live.port, "/v1/completions", SLOW, rcvbuf=2048)
            # The whole answer (~100 KB) is generated; kilobytes fit in the socket
            # buffers, so the handler is now stuck in hypercorn's shielded write.
            await service.wait_until(lambda: finished(metrics) == 1)
        # live_server's exit waited for hypercorn to drain: the watchdog aborted the
        # connection whose write was stuck inside hypercorn's shield.
        assert metrics.aborted_connections() == 1
        await slow.aclose()
