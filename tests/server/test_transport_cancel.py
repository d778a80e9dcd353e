"""A write the HTTP protocol has committed to is written, even by a cancelled task.

h11 changes its state when an event is *built* (a response start moves it to
SEND_BODY); the bytes go out afterwards through the connection's ``protocol_send``.
A cancellation landing between the two left h11 and hypercorn's stream disagreeing:
hypercorn's clean-up then answered 500 on a connection h11 said was mid-body, h11
raised, and the exception took the whole server down (a replica SIGTERMed under load
crashed so, cutting every stream it carried: tests/cluster/test_cluster.py). The
guard (src/triollm/server/transport.py, hazard 6) takes the send lock inside its
shield, so a committed event's bytes always leave.
"""

from __future__ import annotations

import trio
import trio.testing
from hypercorn.config import Config as HyperConfig
from hypercorn.events import RawData

from triollm.server import transport


def connection(stream: trio.abc.Stream) -> transport.GuardedTCPServer:
    config = HyperConfig()
    transport.configure(config, write_timeout_s=30.0, send_buffer_bytes=None)
    return transport.GuardedTCPServer(None, config, None, {}, stream)  # type: ignore[arg-type]


async def test_a_cancelled_task_still_writes_the_bytes_h11_has_committed() -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = connection(server)
    start = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
    with trio.CancelScope() as scope:
        scope.cancel()  # the task was cancelled before it reached the connection's lock
        await conn.protocol_send(RawData(data=start))
    await server.aclose()
    received = b""
    while chunk := await client.receive_some():
        received += chunk
    assert received == start


async def test_it_waits_for_a_write_in_progress_then_writes_whole() -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = connection(server)
    async with trio.open_nursery() as nursery:
        await conn.send_lock.acquire()  # another write of this connection is under way

        async def cancelled_writer() -> None:
            with trio.CancelScope() as scope:
                scope.cancel()
                await conn.protocol_send(RawData(data=b"second"))

        nursery.start_soon(cancelled_writer)
        await trio.testing.wait_all_tasks_blocked()
        await server.send_all(b"first;")
        conn.send_lock.release()
    await server.aclose()
    received = b""
    while chunk := await client.receive_some():
        received += chunk
    assert received == b"first;second"
