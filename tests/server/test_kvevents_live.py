"""KV events from a live server: what a router subscribed to it would know.

A server started with ``kv_events`` publishes on a ZMQ PUB socket and serves replays
on a ROUTER socket (both bound to loopback ports the OS picks). Requests that share
openings fill, share and evict its cache; afterwards a subscriber that joins late
asks for a replay from sequence 0, decodes positionally, and must rebuild exactly
the pool's published set, with no block announced before its parent, no gap, and
an ``AllBlocksCleared`` first (a restarted server's old blocks are forgotten).
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio
from serverkit import live_server

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
msgpack = pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")

from triollm.server.kvevents import CacheIndex, KVEventsConfig, fetch_replay, hash63  # noqa: E402


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_a_late_subscriber_rebuilds_the_servers_cache_from_the_events(
    loaded: Any, encoding: str
) -> None:
    config = KVEventsConfig(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding=encoding, mode="bind"
    )
    # A small pool (16 blocks of 8) so the openings below evict each other.
    async with (
        live_server(loaded, kv_events=config, block_size=8, num_blocks=16, slots=2) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        publisher = live.stack.kv_publisher
        rng = random.Random(3)
        openings = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(5)]

        async def ask(i: int) -> None:
            prompt = openings[i % 5] + [rng.randrange(3, 200) for _ in range(i % 7)]
            body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200

        for wave in range(4):
            async with trio.open_nursery() as nursery:
                for i in range(wave * 6, wave * 6 + 6):
                    nursery.start_soon(ask, i)
        await live.service.wait_until(live.pool_is_idle)
        batches = await trio.to_thread.run_sync(fetch_replay, publisher.replay_address, 0)
        pool = live.service.scheduler.kv.pool
        published = {pool.content(b) for b in range(pool.num_blocks)} - {None}
    assert batches and batches[0][0] == 0
    index = CacheIndex()
    for seq, payload in batches:
        index.apply_message(seq, payload)
    assert index.gaps == 0 and index.violations == []
    first = msgpack.unpackb(batches[0][1])[1][0]
    assert (first["type"] if encoding == "map" else first[0]) == "AllBlocksCleared"
    assert set(index.blocks) == {hash63(h) for h in published}
    assert len(published) > 0
    removed = sum(
        1
        for _, payload in batches
        for e in msgpack.unpackb(payload)[1]
        if (e["type"] if encoding == "map" else e[0]) == "BlockRemoved"
    )
    assert removed > 0  # the small pool evicted: the test saw removals, not only stores
