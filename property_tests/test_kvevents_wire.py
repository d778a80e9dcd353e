"""The KV-cache manager's events through the wire, as a router reads them, by hypothesis.

The manager's own machine (kvcache_machine.py) checks that its events replay to its
published set. Here the same machine's events go through what a router receives:
encoded as vLLM's msgpack batch (positional arrays or the map encoding, drawn),
decoded by position as llm-d's vLLM adapter does, hashes cut to 63 bits. After every
rule the router's view, rebuilt from those messages alone, must equal the pool's
published set, and no ``BlockStored`` may arrive before its parent (the indexer
would drop it and everything chained under it).
"""

from __future__ import annotations

import pytest
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")

from triollm.server.kvevents import CacheIndex, encode_batch, hash63

from .kvcache_machine import KVCacheMachine


class KVEventsWireMachine(KVCacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = CacheIndex()
        self.encoding = "array"
        self.seq = 0

    @initialize(encoding=st.sampled_from(["array", "map"]))
    def choose_encoding(self, encoding: str) -> None:
        note(f"encoding {encoding}")
        self.encoding = encoding

    @invariant()
    def the_events_replay_to_the_published_set(self) -> None:
        # Replaces the machine's own check: the events are read from the wire instead.
        if not hasattr(self, "kv"):
            return
        events = self.kv.drain_events()
        if events:
            self.index.apply_message(self.seq, encode_batch(events, encoding=self.encoding))
            self.seq += 1
        assert self.index.violations == [], self.index.violations
        assert self.index.gaps == 0
        published = {self.kv.pool.content(b) for b in range(self.kv.pool.num_blocks)}
        assert set(self.index.blocks) == {hash63(h) for h in published if h is not None}
        for h in self.index.blocks:
            assert 0 <= h < 2**63


TestKVEventsWire = KVEventsWireMachine.TestCase
