"""KV events on the wire: vLLM's format, decoded as llm-d's adapter decodes it.

The events here are stand-ins with the manager's class names and fields (the
publisher reads events by name); tests/server/test_kvevents_live.py drives the real
KV-cache manager through a server.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass

import pytest
import trio

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
msgpack = pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")

from triollm.server.kvevents import (  # noqa: E402
    END_SEQ,
    CacheIndex,
    KVEventPublisher,
    KVEventsConfig,
    decode_event,
    encode_batch,
    encode_event,
    fetch_replay,
    hash63,
)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


def digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def test_hashes_are_the_last_8_bytes_cut_to_63_bits() -> None:
    high = b"\x00" * 24 + b"\xff" * 8  # the top bit set: an int64 reader would see -1
    assert hash63(high) == 2**63 - 1
    for n in range(50):
        h = hash63(digest(n))
        assert 0 <= h < 2**63
        assert h == int.from_bytes(digest(n)[-8:], "big") & (2**63 - 1)


def test_the_positional_encoding_is_vllms_and_the_map_carries_the_same_fields() -> None:
    stored = BlockStored((digest(1), digest(2)), digest(0), tuple(range(8)), 4)
    array = encode_event(stored, "array")
    assert array == [
        "BlockStored",
        [hash63(digest(1)), hash63(digest(2))],
        hash63(digest(0)),
        list(range(8)),
        4,
        None,  # lora_id
        "GPU",  # medium: the engine's own cache ("CPU" is an offload tier, discounted)
        None,  # lora_name (vLLM's own BlockStored requires the field)
    ]
    as_map = encode_event(stored, "map")
    assert as_map["type"] == "BlockStored"
    assert decode_event(array) == (
        "BlockStored",
        {k: v for k, v in as_map.items() if k not in ("type", "medium", "lora_name")},
    )
    assert encode_event(BlockRemoved((digest(1),)), "array") == [
        "BlockRemoved",
        [hash63(digest(1))],
        "GPU",
    ]
    assert encode_event(AllBlocksCleared(), "array") == ["AllBlocksCleared"]
    ts, events, rank = msgpack.unpackb(encode_batch([AllBlocksCleared()], ts=1.5))
    assert (ts, events, rank) == (1.5, [["AllBlocksCleared"]], 0)


def test_the_index_counts_a_block_stored_before_its_parent() -> None:
    index = CacheIndex()
    first = BlockStored((digest(1),), None, (1, 2), 2)
    child = BlockStored((digest(2),), digest(1), (3, 4), 2)
    orphan = BlockStored((digest(9),), digest(8), (5, 6), 2)
    for event in (first, child):
        index.apply(*decode_event(encode_event(event)))
    assert index.violations == []
    assert index.blocks == {hash63(digest(1)): (1, 2), hash63(digest(2)): (3, 4)}
    index.apply(*decode_event(encode_event(orphan)))
    assert len(index.violations) == 1
    index.apply(*decode_event(encode_event(BlockRemoved((digest(1),)))))
    index.apply(*decode_event(encode_event(AllBlocksCleared())))
    assert index.blocks == {}


async def test_a_late_subscriber_replays_what_it_missed_from_a_bounded_buffer() -> None:
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*",
        topic="kv@127.0.0.1:8000@m",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_batches=3,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.serve_replay)
            events = [
                [AllBlocksCleared()],
                [BlockStored((digest(1),), None, (1, 2), 2)],
                [BlockStored((digest(2),), digest(1), (3, 4), 2)],
                [BlockRemoved((digest(2),))],
            ]
            assert [publisher.publish(batch) for batch in events] == [0, 1, 2, 3]
            assert publisher.publish([]) is None  # nothing to say: no sequence number used
            address = publisher.replay_address
            assert address is not None
            got = await trio.to_thread.run_sync(fetch_replay, address, 2)
            assert [seq for seq, _ in got] == [2, 3]
            # The buffer holds 3 batches: asked from 0, the replay starts at 1, and the
            # subscriber sees the gap (it lost state, and must resynchronize).
            got = await trio.to_thread.run_sync(fetch_replay, address, 0)
            assert [seq for seq, _ in got] == [1, 2, 3]
            index = CacheIndex(last_seq=0)
            for seq, payload in got:
                index.apply_message(seq, payload)
            assert index.gaps == 0 and index.violations == []
            assert index.blocks == {hash63(digest(1)): (1, 2)}
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()


def test_a_reader_refuses_a_replay_reply_it_cannot_read() -> None:
    # A server answering replays in another shape (no empty delimiter, a 4-byte
    # sequence number) must not be read as batches: a guessed sequence number would
    # silently misplace a batch, and order is the contract.
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_badly() -> None:
        identity, _empty, _start = router.recv_multipart()
        router.send_multipart([identity, b"", (7).to_bytes(4, "big"), b"payload"])

    server = threading.Thread(target=answer_badly, daemon=True)
    server.start()
    try:
        with pytest.raises(ValueError, match="not a replay reply"):
            fetch_replay(f"tcp://127.0.0.1:{port}", 0, timeout_s=30)
    finally:
        server.join(timeout=30)
        router.close()


async def test_live_messages_are_three_frames_topic_sequence_payload() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv@127.0.0.1:8000@m")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.pub_address)
    try:
        # PUB drops what it sends before the subscription has arrived (the slow
        # joiner): publish until one message comes through, a bounded number of times.
        frames = None
        for _ in range(500):
            publisher.publish([AllBlocksCleared()])
            if sub.poll(10):
                frames = sub.recv_multipart()
                break
            await trio.sleep(0)
        assert frames is not None, "no message reached the subscriber"
        topic, seq, payload = frames
        assert topic == b"kv@127.0.0.1:8000@m"
        assert len(seq) == 8 and struct.unpack(">q", seq)[0] >= 0
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
    finally:
        sub.close()
        publisher.close()


def test_the_topic_is_llm_ds_convention_unless_given_whole() -> None:
    # vllm-router's static sources match the topic exactly against vLLM's default (an
    # empty one): under llm-d's kv@host:port@model it dropped every message (0 tokens
    # credited); with --kv-events-topic '' it credited each replica's cached prefix.
    default = KVEventsConfig("tcp://127.0.0.1:*", topic_prefix="kv@127.0.0.1:8000")
    given = KVEventsConfig("tcp://127.0.0.1:*", topic_prefix="kv@127.0.0.1:8000", topic="")
    for config, topic in ((default, "kv@127.0.0.1:8000@m"), (given, "")):
        publisher = config.publisher("m")
        try:
            assert publisher.topic == topic
        finally:
            publisher.close()


async def test_a_replay_carries_the_topic_as_current_vllm_and_old_replies_still_read() -> None:
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv@h:1@m", replay_endpoint="tcp://127.0.0.1:*"
    )
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.serve_replay)
            publisher.publish([AllBlocksCleared()])
            address = publisher.replay_address
            assert address is not None
            dealer.connect(address)
            dealer.send_multipart([b"", struct.pack(">q", 0)])
            # vllm-router reads [empty, topic, seq, payload]: the sequence number second
            # from last, and it stops at a reply of fewer frames (the older shape).
            first = await trio.to_thread.run_sync(dealer.recv_multipart)
            end = await trio.to_thread.run_sync(dealer.recv_multipart)
            assert first[:3] == [b"", b"kv@h:1@m", struct.pack(">q", 0)]
            assert msgpack.unpackb(first[3])[1] == [["AllBlocksCleared"]]
            assert end == [b"", b"", END_SEQ, b""]
            nursery.cancel_scope.cancel()
    finally:
        dealer.close()
        publisher.close()

    # Older vLLM and SGLang answer without the topic frame: read alike.
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch([AllBlocksCleared()])

    def answer_old_style() -> None:
        identity, _empty, _start = router.recv_multipart()
        router.send_multipart([identity, b"", struct.pack(">q", 5), payload])
        router.send_multipart([identity, b"", END_SEQ, b""])

    server = threading.Thread(target=answer_old_style, daemon=True)
    server.start()
    try:
        got = await trio.to_thread.run_sync(fetch_replay, f"tcp://127.0.0.1:{port}", 0)
        assert got == [(5, payload)]
    finally:
        server.join(timeout=30)
        router.close()
