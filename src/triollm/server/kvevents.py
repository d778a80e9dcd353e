"""KV events: what this server has cached, told to a router, in vLLM's wire format.

A prefix-aware router in *precise* mode (llm-d's KV-cache indexer, vllm-router's
``kv_aware``, AIBrix) keeps, per server, the set of KV blocks it could reuse. It
learns the set from events, not by guessing: a block published (``BlockStored``), a
block evicted (``BlockRemoved``), everything forgotten (``AllBlocksCleared``). The
KV-cache manager records them in order (``KVCacheManager.drain_events``); this
module only carries them: the manager stays pure, the publisher does the I/O.

The wire (vLLM's ``vllm/distributed/kv_events.py``; decoded positionally by llm-d's
vLLM adapter):

- a ZMQ **PUB** socket; each message is three frames: the topic
  (``kv@<host>:<port>@<model>`` by default, llm-d's convention; vLLM's own default
  is empty, and a reader that matches the topic exactly, vllm-router's static
  sources among them, drops every message under any other: ``--kv-events-topic``),
  the sequence number as 8 bytes big-endian, and the msgpack payload
  ``[timestamp, [event, ...], dp_rank]``;
- an event is a positional array (``encoding="array"``)::

      ["BlockStored", [hash, ...], parent_hash | None, [token_id, ...], block_size,
       None, "GPU", None]
      ["BlockRemoved", [hash, ...], "GPU"]
      ["AllBlocksCleared"]

  (the two ``None`` are vLLM's ``lora_id`` and ``lora_name``, ``"GPU"`` its ``medium``;
  current vLLM requires all eight positions), or a map with a
  ``type`` key and the same field names (``encoding="map"``: what vLLM itself sends
  since 2026, and the only shape vllm-router decodes);
- hashes are integers below 2^63: the manager's chained SHA-256 digests cut to their
  last 8 bytes and then to 63 bits, so readers that store them as signed 64-bit
  integers (Go's ``int64``) and unsigned ones agree;
- an optional **ROUTER** replay socket: a late or lossy subscriber sends an empty
  frame and a start sequence number (8 bytes big-endian) and gets every buffered
  batch from there on, ``[b"", topic, seq, payload]`` each, then
  ``[b"", b"", -1, b""]`` (current vLLM's reply; older vLLM and SGLang leave the
  topic frame out, and readers take the sequence number second from last). The
  buffer is bounded (``buffer_batches``): older batches are gone, and a subscriber
  that sees its first replayed sequence above what it asked for knows it lost state.

**Order is part of the contract**: the indexer drops a ``BlockStored`` whose parent it
never saw, so batches leave in the order the manager recorded them, one sequence
number each, and the first batch a publisher sends is an ``AllBlocksCleared`` (a
restarted server tells the indexer to forget what the old process had cached).

Hazard: PUB drops messages for a subscriber that is not connected yet (ZMQ's "slow
joiner"), and past the high-water mark; the sequence numbers make every loss
visible to the subscriber and the replay socket lets it catch up.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

ENCODINGS = ("array", "map")
# The tier the blocks sit in, in vLLM's words: "GPU" is the engine's own KV cache
# (vLLM's block pool says "GPU" on every platform, its CPU backend included), "CPU"
# an offload tier a block must be copied back from before it is used. Readers score
# by it: llm-d weighs a "CPU" hit 0.8 of a "GPU" one, and vllm-router credited 102
# of a 128-token "CPU" prefix (its host-tier discount) where a "GPU" one got 128.
# Our pool is the engine's own cache, wherever the engine runs: "GPU".
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HASH_BITS = 63
_HASH_MASK = (1 << HASH_BITS) - 1
_SEQ = struct.Struct(">q")


def hash63(digest: bytes | int) -> int:
    """A block hash as readers take it: the last 8 bytes, big-endian, cut to 63 bits
    (so a signed and an unsigned 64-bit reader see the same non-negative number)."""
    if isinstance(digest, int):
        return digest & _HASH_MASK
    return int.from_bytes(digest[-8:], "big") & _HASH_MASK


def encode_event(event: Any, encoding: str = "array") -> list[Any] | dict[str, Any]:
    """One manager event (``kvcache.BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared``, read by class name and fields) in the wire's shape."""
    kind = type(event).__name__
    fields: dict[str, Any]
    if kind == "BlockStored":
        parent = event.parent_hash
        fields = {
            "block_hashes": [hash63(h) for h in event.block_hashes],
            "parent_block_hash": None if parent is None else hash63(parent),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }
    elif kind == "BlockRemoved":
        fields = {"block_hashes": [hash63(h) for h in event.block_hashes], "medium": MEDIUM}
    elif kind == "AllBlocksCleared":
        fields = {}
    else:
        raise TypeError(f"not a KV event: {event!r}")
    if encoding == "array":
        return [kind, *fields.values()]
    if encoding == "map":
        return {"type": kind, **fields}
    raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")


def encode_batch(
    events: Iterable[Any], *, encoding: str = "array", ts: float | None = None, dp_rank: int = 0
) -> bytes:
    """The msgpack payload ``[timestamp, [events], dp_rank]`` (vLLM's KVEventBatch)."""
    import msgpack

    ts = time.time() if ts is None else ts
    return msgpack.packb([ts, [encode_event(e, encoding) for e in events], dp_rank])


def binds(endpoint: str, mode: str = "auto") -> bool:
    """Whether ``endpoint`` is bound (else connected to). ``auto`` is vLLM's rule: a
    wildcard host or an ipc/inproc address binds, a named host is dialled (the router
    binds and every server connects to it)."""
    if mode in ("bind", "connect"):
        return mode == "bind"
    if mode != "auto":
        raise ValueError(f"mode must be auto, bind or connect, got {mode!r}")
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class KVEventsConfig:
    """``triollm serve --kv-events-*``: where the events go and in which shape.

    ``topic_prefix``: ``kv@<host>:<port>`` (the server's own address, llm-d's
    convention); the served model's id is appended as ``@<model>``. ``topic``, when
    given, is the whole topic instead (``""``: vLLM's default, which vllm-router's
    static ``--kv-event-source`` requires: it matches the topic exactly)."""

    endpoint: str
    replay_endpoint: str | None = None
    encoding: str = "array"
    mode: str = "auto"
    topic_prefix: str = "kv"
    topic: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("endpoint", self.endpoint), ("replay-endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"--kv-events-{name} must be a ZMQ address (tcp://HOST:PORT, ipc://PATH), "
                    f"got {value!r}"
                )
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-encoding must be one of {ENCODINGS}")
        binds(self.endpoint, self.mode)  # refuses an unknown mode

    def publisher(self, model_id: str) -> KVEventPublisher:
        return KVEventPublisher(
            self.endpoint,
            topic=f"{self.topic_prefix}@{model_id}" if self.topic is None else self.topic,
            replay_endpoint=self.replay_endpoint,
            encoding=self.encoding,
            mode=self.mode,
        )


@dataclass
class KVEventPublisher:
    """The server's PUB socket, its sequence numbers and its replay buffer.

    ``publish`` runs in the service's trio thread (it never blocks: ZMQ's own I/O
    thread writes the socket); ``serve_replay`` is a task that answers the ROUTER
    socket. ``close`` ends both sockets."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    encoding: str = "array"
    mode: str = "auto"
    buffer_batches: int = 10_000
    high_water_mark: int = 100_000
    next_seq: int = 0
    published_events: int = 0
    dropped_batches: int = 0  # PUB refused (high-water mark); still in the replay buffer
    _buffer: deque[tuple[int, bytes]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        import zmq

        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {self.buffer_batches}")
        self._buffer = deque(maxlen=self.buffer_batches)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.high_water_mark)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._attach(self._pub, self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)  # a subscriber always dials the server
        self._topic = self.topic.encode()

    def _attach(self, socket: Any, endpoint: str) -> None:
        if binds(endpoint, self.mode):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)

    @property
    def pub_address(self) -> str:
        """The PUB socket's address (the real port when bound to port 0 or ``*``)."""
        return str(self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT))

    @property
    def replay_address(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT))

    def publish(self, events: Sequence[Any]) -> int | None:
        """Send ``events`` as one batch with the next sequence number; return it
        (None for an empty batch, which is not sent)."""
        if not events:
            return None
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(events, encoding=self.encoding)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart(
                (self._topic, _SEQ.pack(seq), payload), flags=self._zmq.NOBLOCK
            )
        except self._zmq.ZMQError:
            # Past the high-water mark (Again) or a socket gone: this runs inside the
            # batch loop, where raising would fail every request. The batch stays in
            # the replay buffer and the gap in the sequence tells the subscriber.
            self.dropped_batches += 1
        self.published_events += len(events)
        return seq

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches with a sequence number >= ``start``, in order."""
        return [(seq, payload) for seq, payload in self._buffer if seq >= start]

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled. The ZMQ file descriptor signals
        edge-triggered: every message waiting is read before waiting again."""
        if self._replay is None:
            await trio.sleep_forever()
            return
        zmq = self._zmq
        sock = self._replay
        fd = int(sock.getsockopt(zmq.FD))
        while True:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: [identity, b"", start]
                identity, start = frames[0], _SEQ.unpack(frames[2])[0]
                # Current vLLM's reply: the topic rides in each frame set (vllm-router
                # reads the sequence number second from last and stops at fewer than
                # four frames after the delimiter is gone, i.e. at the older shape).
                for seq, payload in self.replay_from(start):
                    sock.send_multipart((identity, b"", self._topic, _SEQ.pack(seq), payload))
                sock.send_multipart((identity, b"", b"", END_SEQ, b""))
            await trio.lowlevel.wait_readable(fd)

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


class KVEventsFeed:
    """The service's observer with the KV events added: after every step the
    manager's recorded events are drained and published as one batch.

    The service calls its observer's ``step`` in the batch loop right after the
    step's commit, so the events leave in the manager's order, from the task that
    changed the cache, and the manager never sees the socket. Events recorded by an
    admission (an eviction to make room) go out with the next step, which always
    follows an admission, still in order. Every other hook goes to ``inner`` (the
    metrics) unchanged."""

    def __init__(
        self, inner: Any, drain: Callable[[], Sequence[Any]], publisher: KVEventPublisher
    ) -> None:
        self.inner = inner
        self.drain = drain
        self.publisher = publisher

    def flush(self) -> int | None:
        return self.publisher.publish(self.drain())

    def admitted(self, prompt_tokens: int, queue_seconds: float, choices: int = 1) -> None:
        self.inner.admitted(prompt_tokens, queue_seconds, choices)

    def token(self, first: bool, seconds_since_previous: float) -> None:
        self.inner.token(first, seconds_since_previous)

    def finished(self, reason: Any, e2e_seconds: float) -> None:
        self.inner.finished(reason, e2e_seconds)

    def ended_early(self, reason: Any) -> None:
        self.inner.ended_early(reason)

    def step(self, rows: int, width: int, kind: Any, seconds: float) -> None:
        self.inner.step(rows, width, kind, seconds)
        self.flush()


# ------------------------------------------------------------------- the reading side


STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


def decode_event(raw: Any) -> tuple[str, dict[str, Any]]:
    """(kind, fields) of one event, as llm-d's vLLM adapter reads it: a positional
    array by index (trailing optional fields may be missing), or a map by key."""
    if isinstance(raw, dict):
        return raw["type"], {k: v for k, v in raw.items() if k != "type"}
    kind = raw[0]
    if kind == "BlockStored":
        return kind, dict(zip(STORED_FIELDS, raw[1:6], strict=False))
    if kind == "BlockRemoved":
        return kind, {"block_hashes": raw[1]}
    if kind == "AllBlocksCleared":
        return kind, {}
    raise ValueError(f"unknown KV event {kind!r}")


def fetch_replay(address: str, start: int, *, timeout_s: float = 30.0) -> list[tuple[int, bytes]]:
    """Ask a replay socket for every buffered batch from sequence ``start`` on, as a
    late subscriber does: ``[(seq, payload), ...]`` in order, up to the end marker.

    Blocking (run it in a thread). ``timeout_s`` bounds the wait for each reply frame
    (a server that never answers raises ``zmq.Again`` instead of hanging). A reply is
    ``[b"", topic, seq, payload]`` (current vLLM, and this server) or
    ``[b"", seq, payload]`` (older vLLM, SGLang); anything else raises ValueError: a
    reader must not guess."""
    import zmq

    ctx: Any = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        dealer.send_multipart([b"", _SEQ.pack(start)])
        out: list[tuple[int, bytes]] = []
        while True:
            frames = dealer.recv_multipart()
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                raise ValueError(f"not a replay reply: {frames!r}")
            seq, payload = frames[-2:]
            if seq == END_SEQ:
                if payload:
                    raise ValueError("the replay's end marker carries a payload")
                return out
            out.append((_SEQ.unpack(seq)[0], payload))
    finally:
        dealer.close()


@dataclass
class CacheIndex:
    """A router's view of one server's cache, rebuilt from its events alone.

    ``violations`` counts what an indexer would have dropped: a ``BlockStored``
    whose parent was never announced (or was removed since), a removal of a block
    it never saw. ``gaps`` counts missing sequence numbers."""

    blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # hash -> token ids
    violations: list[str] = field(default_factory=list)
    last_seq: int = -1
    gaps: int = 0
    batches: int = 0
    removed: int = 0  # blocks BlockRemoved took out (evictions, as the reader saw them)

    def apply_message(self, seq: int, payload: bytes) -> None:
        import msgpack

        if seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        ts, events, _rank = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        self.batches += 1
        for raw in events:
            self.apply(*decode_event(raw))

    def apply(self, kind: str, f: dict[str, Any]) -> None:
        if kind == "AllBlocksCleared":
            self.blocks.clear()
        elif kind == "BlockRemoved":
            for h in f["block_hashes"]:
                if self.blocks.pop(h, None) is None:
                    self.violations.append(f"removed {h}, never stored")
                else:
                    self.removed += 1
        elif kind == "BlockStored":
            parent = f["parent_block_hash"]
            if parent is not None and parent not in self.blocks:
                self.violations.append(f"stored under parent {parent}, never announced")
            size = f["block_size"]
            tokens = f["token_ids"]
            if len(tokens) != size * len(f["block_hashes"]):
                self.violations.append(
                    f"{len(tokens)} token ids for {len(f['block_hashes'])} blocks"
                )
            for i, h in enumerate(f["block_hashes"]):
                self.blocks[h] = tuple(tokens[i * size : (i + 1) * size])
