"""A hypothesis state machine for the KV-cache manager alone (kvcache.py).

Sequences arrive from a few shared openings under two salts, are admitted alone
(with their cache hits) or as a group (a writer and members holding its blocks),
commit positions, sample a token, grow, are freed (a preemption: they may come
back) or end, and the cache is sometimes cleared. Beside the manager a model
records what each commit wrote into each block; after every rule the claims:

- ``refcounts_are_the_live_holders``: a block's references = the tables naming it;
- ``a_block_is_written_by_one_writer`` (checked before every commit): what a commit
  writes is unpublished and held only by its writer and the members waiting for it;
- ``published_hashes_name_what_was_written`` and ``a_sequence_reads_its_own_prefix``:
  a block's hash is the chain of the tokens written into it, under the writer's
  salt, and every full block a sequence reads holds its own prefix;
- ``salts_never_share_a_block``;
- ``the_events_replay_to_the_published_set``: every ``BlockStored``'s parent is
  stored when it is announced, every ``BlockRemoved`` names stored hashes, and the
  set rebuilt from the events alone equals the manager's published hashes.
"""

from __future__ import annotations

from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from triollm.kv import blocks_for, prefix_hashes
from triollm.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager

from .pool_machine import OPENINGS, SALTS  # the pool's: collisions often, some by salt only


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager
        self.bs = 1
        self.ids: dict[int, list[int]] = {}  # every live sequence's token ids
        self.salt: dict[int, str] = {}
        self.running: list[int] = []  # admitted, in admission order
        self.next_id = 0
        # model: block -> (salt, token ids up to its end) of the commit that filled it
        self.written: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.stored: set[bytes] = set()  # rebuilt from the events alone
        self.evicted: set[bytes] = set()

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 3))
    def configure(self, num_blocks: int, block_size: int) -> None:
        note(f"a manager of {num_blocks} blocks x {block_size}")
        self.kv = KVCacheManager(num_blocks, block_size, prefix_cache=True, record_events=True)
        self.bs = block_size

    # -- helpers ----------------------------------------------------------------------

    def _new(self, opening: tuple[int, ...], length: int, salt: str) -> int:
        seq = self.next_id
        self.next_id += 1
        self.ids[seq] = list(opening[:length])
        self.salt[seq] = salt
        self.kv.add(seq, length, salt)
        return seq

    def _leave(self, seqs: list[int]) -> None:
        """Sequences that arrived together and did not fit leave again."""
        for q in seqs:
            self.kv.forget(q)
            del self.ids[q], self.salt[q]

    def _waiting(self) -> list[int]:
        return [q for q in self.ids if q not in self.running]

    def _runnable(self) -> list[int]:
        """Running sequences with a position to compute, room for it, and no writer
        to wait for."""
        return [
            q
            for q in self.running
            if self.kv.waits_for(q) is None
            and self.kv.computed(q) < min(len(self.ids[q]), self.kv.n_blocks(q) * self.bs)
        ]

    def _holders(self, block: int) -> list[int]:
        return [q for q in self.running for b in self.kv.blocks(q) if b == block]

    # -- rules ------------------------------------------------------------------------

    @rule(
        opening=st.sampled_from(OPENINGS),
        length=st.integers(1, 6),
        salt=st.sampled_from(SALTS),
    )
    def arrive(self, opening: tuple[int, ...], length: int, salt: str) -> None:
        seq = self._new(opening, length, salt)
        note(f"seq {seq} arrives: {self.ids[seq]} salt {salt!r}")

    @precondition(lambda self: bool(self._waiting()))
    @rule(data=st.data(), spare=st.integers(0, 1))
    def admit(self, data: st.DataObject, spare: int) -> None:
        waiting = self._waiting()
        if not waiting:
            return
        seq = data.draw(st.sampled_from(waiting))
        ids = self.ids[seq]
        hits = self.kv.computed_blocks(seq, ids)
        take = blocks_for(len(ids), self.bs) + spare
        if take - len(hits) > self.kv.available(holding=hits):
            note(f"seq {seq} does not fit ({take} blocks, {len(hits)} hits)")
            return
        self.kv.admit(seq, len(ids), take, hits)
        self.running.append(seq)
        if hits:
            event("a cache hit")
        assert self.kv.blocks(seq)[: len(hits)] == hits
        assert self.kv.computed(seq) == len(hits) * self.bs
        note(f"seq {seq} admitted: table {self.kv.blocks(seq)}, {len(hits)} hit(s)")

    @rule(opening=st.sampled_from(OPENINGS), salt=st.sampled_from(SALTS))
    def admit_twins(self, opening: tuple[int, ...], salt: str) -> None:
        """Two sequences of one prompt admitted alone at once: both compute the same
        blocks, the first commit publishes them, the other keeps private twins."""
        take = blocks_for(len(opening), self.bs)
        pair = [self._new(opening, len(opening), salt) for _ in range(2)]
        hits = self.kv.computed_blocks(pair[0], opening)
        if 2 * (take - len(hits)) > self.kv.available(holding=hits):
            self._leave(pair)
            return
        for q in pair:
            self.kv.admit(q, len(opening), take, hits)
            self.running.append(q)
        note(f"twins {pair} admitted: {[self.kv.blocks(q) for q in pair]}")

    @rule(
        opening=st.sampled_from(OPENINGS),
        length=st.integers(1, 6),
        salt=st.sampled_from(SALTS),
        n=st.integers(2, 3),
    )
    def admit_group(self, opening: tuple[int, ...], length: int, salt: str, n: int) -> None:
        take = blocks_for(length, self.bs)
        shared = self.kv.shareable_blocks(length)
        seqs = [self._new(opening, length, salt) for _ in range(n)]
        writer, *others = seqs
        hits = self.kv.computed_blocks(writer, self.ids[writer])
        need = take - len(hits) + (n - 1) * (take - shared)
        if need > self.kv.available(holding=hits):
            self._leave(seqs)
            return
        self.kv.admit(writer, length, take, hits)
        self.running.append(writer)
        for q in others:
            self.kv.admit_member(q, writer, length, take)
            self.running.append(q)
        note(f"group {seqs} admitted: writer table {self.kv.blocks(writer)}")

    @precondition(lambda self: bool(self._runnable()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self._runnable()))
        assert self.kv.ready(seq)
        ids, table, start = self.ids[seq], self.kv.blocks(seq), self.kv.computed(seq)
        end = data.draw(st.integers(start + 1, min(len(ids), len(table) * self.bs)))
        for p in range(start, end):
            self._check_one_writer(seq, table[p // self.bs])
            if p % self.bs == self.bs - 1:
                self.written[table[p // self.bs]] = (self.salt[seq], tuple(ids[: p + 1]))
        self.kv.commit(seq, end, ids)
        note(f"seq {seq} commits positions {start}..{end - 1}")

    def _check_one_writer(self, seq: int, block: int) -> None:
        assert self.kv.pool.content(block) is None, f"seq {seq} writes published block {block}"
        for q in self._holders(block):
            assert q == seq or self.kv.waits_for(q) == seq, (
                f"seq {seq} writes block {block}, which seq {q} reads"
            )

    @precondition(lambda self: any(self.kv.computed(q) == len(self.ids[q]) for q in self.running))
    @rule(data=st.data(), token=st.integers(1, 9))
    def sample(self, data: st.DataObject, token: int) -> None:
        done = [q for q in self.running if self.kv.computed(q) == len(self.ids[q])]
        if done:
            seq = data.draw(st.sampled_from(done))
            self.ids[seq].append(token)
            note(f"seq {seq} samples {token}")

    @precondition(
        lambda self: any(self.kv.n_blocks(q) * self.bs < len(self.ids[q]) for q in self.running)
    )
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        short = [q for q in self.running if self.kv.n_blocks(q) * self.bs < len(self.ids[q])]
        if short:
            seq = data.draw(st.sampled_from(short))
            grew = self.kv.grow(seq, 1)
            note(f"seq {seq} grows: {grew}")

    @precondition(lambda self: bool(self.ids))
    @rule(data=st.data(), ends=st.booleans())
    def free(self, data: st.DataObject, ends: bool) -> None:
        if not self.ids:
            return
        seq = data.draw(st.sampled_from(sorted(self.ids)))
        if seq in self.running:
            if any(self.kv.waits_for(q) == seq for q in self.running):
                event("a writer left before writing the shared blocks: a hand-over")
            self.kv.free(seq)
            self.running.remove(seq)
        if ends:
            self.kv.forget(seq)
            del self.ids[seq], self.salt[seq]
        note(f"seq {seq} {'ends' if ends else 'is freed (preempted)'}")

    @rule(now=st.integers(0, 9))
    def clear(self, now: int) -> None:
        if now:  # rarely: a cleared cache has nothing to hit
            return
        cleared = self.kv.clear_cache()
        note(f"clear the cache: {cleared}")
        if cleared:
            event("the cache was cleared")
            assert self.kv.pool.statistics().cached == 0

    # -- claims -----------------------------------------------------------------------

    @invariant()
    def refcounts_are_the_live_holders(self) -> None:
        refs: dict[int, int] = {}
        for q in self.running:
            for b in self.kv.blocks(q):
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.kv.pool.num_blocks):
            assert self.kv.pool.refcount(b) == refs.get(b, 0), f"block {b}"

    @invariant()
    def published_hashes_name_what_was_written(self) -> None:
        for b in range(self.kv.pool.num_blocks):
            h = self.kv.pool.content(b)
            if h is not None:
                salt, ids = self.written[b]
                assert h == prefix_hashes(ids, self.bs, salt)[-1], f"block {b}"

    @invariant()
    def a_sequence_reads_its_own_prefix(self) -> None:
        for q in self.running:
            if self.kv.waits_for(q) is not None:
                continue  # it reads nothing until its writer has written
            table, ids = self.kv.blocks(q), self.ids[q]
            for i in range(self.kv.computed(q) // self.bs):
                want = (self.salt[q], tuple(ids[: (i + 1) * self.bs]))
                assert self.written.get(table[i]) == want, f"seq {q} block {i}"

    @invariant()
    def salts_never_share_a_block(self) -> None:
        salt_of: dict[int, str] = {}
        for q in self.running:
            for b in self.kv.blocks(q):
                assert salt_of.setdefault(b, self.salt[q]) == self.salt[q], f"block {b}"

    @invariant()
    def the_events_replay_to_the_published_set(self) -> None:
        for ev in self.kv.drain_events():
            if isinstance(ev, BlockStored):
                event("blocks stored")
                if ev.block_hashes[0] in self.evicted:
                    event("a hash stored again after its eviction")
                parent = ev.parent_hash
                assert parent is None or parent in self.stored, f"{ev}: parent not stored"
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                for h in ev.block_hashes:
                    assert h not in self.stored, f"{h.hex()[:8]} announced twice"
                    self.stored.add(h)
            elif isinstance(ev, BlockRemoved):
                event("an eviction")
                for h in ev.block_hashes:
                    assert h in self.stored, f"{h.hex()[:8]} removed but never stored"
                    self.stored.remove(h)
                    self.evicted.add(h)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.stored.clear()
        published = {self.kv.pool.content(b) for b in range(self.kv.pool.num_blocks)}
        assert self.stored == published - {None}
