"""A hypothesis state machine for the block pool alone, prefix cache included.

Holders (block tables) come and go: ``take`` allocates fresh blocks, ``take_shared``
looks a prompt's opening up and acquires the hits plus fresh blocks, ``write``
publishes a held block's content, ``release`` frees a table. Prompts are drawn
from a small alphabet of openings so hits are frequent. A model beside the pool
counts references and replays the LRU; the invariants compare the two.
"""

from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triollm.kv import BlockPool, prefix_hashes

# Three openings and two salts: prompts collide often, and sometimes only by salt.
OPENINGS = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9, 9), (7, 7, 7, 7, 7, 7))
SALTS = ("", "tenant-b")


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.tables: list[list[int]] = []  # the live holders' tables
        self.content: dict[int, bytes] = {}  # model: block -> the hash it was published with
        self.lru: list[int] = []  # model: cached blocks, least recently released first

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 3))
    def configure(self, num_blocks: int, block_size: int) -> None:
        note(f"pool of {num_blocks} blocks x {block_size}")
        self.pool = BlockPool(num_blocks, block_size)

    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for table in self.tables:
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def _expect_taken(self, got: tuple[int, ...], before: dict[int, int]) -> None:
        """Fresh blocks: never one somebody holds; free before cached, LRU order."""
        assert not any(b in before for b in got), f"allocated a held block: {got}"
        evicted = [b for b in got if b in self.lru]
        assert evicted == self.lru[: len(evicted)], "eviction is least recently used first"
        if evicted:
            assert len(got) - len(evicted) == got.index(evicted[0]), "free blocks go first"
        for b in evicted:
            self.lru.remove(b)
            del self.content[b]

    @rule(n=st.integers(0, 4))
    def take(self, n: int) -> None:
        before = self._refs()
        available = self.pool.statistics().available
        got = self.pool.allocate(n)
        note(f"allocate {n}: {got}")
        if got is None:
            assert n > available
            return
        self._expect_taken(got, before)
        self.tables.append(list(got))

    @rule(
        opening=st.sampled_from(OPENINGS),
        length=st.integers(1, 6),
        salt=st.sampled_from(SALTS),
        extra=st.integers(0, 2),
    )
    def take_shared(self, opening: tuple[int, ...], length: int, salt: str, extra: int) -> None:
        bs = self.pool.block_size
        hashes = prefix_hashes(opening[:length], bs, salt)
        hit = self.pool.lookup(hashes)
        for b, h in zip(hit, hashes, strict=False):
            assert self.content.get(b) == h, "a hit names the block published with that hash"
        before = self._refs()
        room = self.pool.available(holding=hit)
        got = self.pool.acquire(hit, extra)
        note(f"acquire {list(hit)} + {extra} for {opening[:length]} salt={salt!r}: {got}")
        if got is None:
            assert extra > room
            return
        for b in hit:
            if b in self.lru:
                self.lru.remove(b)
        self._expect_taken(got, before)
        self.tables.append([*hit, *got])

    @precondition(lambda self: bool(self.tables))
    @rule(data=st.data(), opening=st.sampled_from(OPENINGS), salt=st.sampled_from(SALTS))
    def write(self, data: st.DataObject, opening: tuple[int, ...], salt: str) -> None:
        """Publish the first unpublished block of a table as if its K/V were written."""
        table = data.draw(st.sampled_from(self.tables), label="table")
        i = next((i for i, b in enumerate(table) if b not in self.content), None)
        if i is None:
            return
        hashes = prefix_hashes(opening, self.pool.block_size, salt)
        if i >= len(hashes):
            return
        published = self.pool.publish(table[i], hashes[i])
        note(f"publish block {table[i]} as block {i} of {opening} salt={salt!r}: {published}")
        assert published == (hashes[i] not in self.content.values())
        if published:
            self.content[table[i]] = hashes[i]

    @precondition(lambda self: bool(self.tables))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables), label="table")
        self.tables.remove(table)
        note(f"free {table}")
        self.pool.free(table)
        refs = self._refs()
        for b in reversed(table):
            if b not in refs and b in self.content and b not in self.lru:
                self.lru.append(b)

    @invariant()
    def blocks_are_conserved(self) -> None:
        if not hasattr(self, "pool"):
            return
        s = self.pool.statistics()
        refs = self._refs()
        assert s.free + s.cached + s.held == s.total
        assert s.held == len(refs)
        assert s.cached == len(self.lru)

    @invariant()
    def refcounts_equal_the_live_holders(self) -> None:
        if not hasattr(self, "pool"):
            return
        refs = self._refs()
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == refs.get(b, 0), f"block {b}"

    @invariant()
    def the_cache_is_the_model_lru_and_every_content_is_findable(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert self.pool.cached_blocks() == tuple(self.lru)
        for b, h in self.content.items():
            assert self.pool.content(b) == h
            assert self.pool.lookup([h]) == (b,)
        assert len(set(self.content.values())) == len(self.content), "one block per content"
