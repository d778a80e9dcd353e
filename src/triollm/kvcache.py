"""The KV-cache manager: which blocks each sequence holds, and what a later prompt can find.

The Scheduler decides *who* runs and *what* each step computes; this module keeps
the KV side of that: every running sequence's block table and how many of its
positions hold K/V, the prefix hashes of its token ids, which of its full blocks
are published (findable by content), the group member that writes the blocks a
group shares, and the stream of events a router needs to know what is cached.
``kv.BlockPool`` stays the allocator underneath (reference counts, the free heap,
the LRU of released content); nothing else calls it. Like the Scheduler it is
pure: integers and bytes, no trio, no clock, no I/O.

The rules it owns (the Scheduler's rules 9 and 10; docs/prefix-cache.md teaches them):

1. **A hit is a leading run of full blocks, never the last token's.**
   :meth:`KVCacheManager.computed_blocks` finds at most ``(n - 1) // block_size``
   blocks of ``n`` token ids, so at least one token is computed and has logits.
2. **Admission takes the hits and the rest together** (:meth:`~KVCacheManager.admit`,
   ``BlockPool.acquire``); the sequence's first uncached position is where its
   prefill starts.
3. **Publish only what a commit wrote** (:meth:`~KVCacheManager.commit`): a block is
   named by its chained hash once every position in it holds K/V, and is never
   written again. Cached blocks are evicted least recently released first.
4. **One writer per block.** A group's other members hold the writer's blocks and
   are not ready (:meth:`~KVCacheManager.ready`) until its committed positions
   cover them; a writer that leaves first hands the writing to the next member
   (:meth:`~KVCacheManager.free`).
5. **Salts never meet**: the salt is the root of the hash chain, so two salts
   never find each other's blocks.
6. **Events, in order** (:meth:`~KVCacheManager.drain_events`): a block's hash is
   announced (:class:`BlockStored`) only while its parent's is stored, every
   eviction is a :class:`BlockRemoved`, :meth:`~KVCacheManager.clear_cache` an
   :class:`AllBlocksCleared`. Replaying the events gives exactly the published
   set (``property_tests/kvcache_machine.py`` checks it after every rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from triollm.kv import BlockPool, prefix_hashes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheManager",
    "KVCacheStatistics",
    "KVEvent",
]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became findable, in chain order (vLLM's event of the same name).

    ``parent_hash`` is the hash of the block before the first one (None: the
    first is a prompt's opening block), stored when this event is recorded.
    ``token_ids`` are the ``len(block_hashes) * block_size`` ids they hold.
    """

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer findable (evicted for new content)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is findable any more (:meth:`KVCacheManager.clear_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVCacheStatistics:
    """The prefix cache's counters (vLLM's names)."""

    queries_total: int  # token ids looked up at admission, each readmission counted again
    hits_total: int  # of those, positions whose K/V somebody else computed


class _Entry:
    """One sequence the manager knows, from ``add`` to ``forget``."""

    __slots__ = (
        "blocks",
        "cached_tokens",
        "computed",
        "hashes",
        "prompt_len",
        "published",
        "salt",
        "writer",
    )

    def __init__(self, salt: str, prompt_len: int) -> None:
        self.salt = salt  # the hash chain's root: only equal salts share blocks
        self.prompt_len = prompt_len
        # Invariant: hashes[i] is prefix_hashes(token_ids, ...)[i] (extended as needed).
        self.hashes: tuple[bytes, ...] = ()
        self.cached_tokens: int | None = None  # set by the first admission
        # Invariant: blocks is empty while the sequence waits (not admitted).
        self.blocks: list[int] = []
        self.computed = 0  # positions whose K/V is written (committed)
        # Invariant: blocks[:published] are full and never written again (shared or
        # published); every write lands at or past published * block_size.
        self.published = 0
        # A group member admitted and not yet ready: the seq_id of the member writing
        # the shared blocks, a running sequence. Invariant: set only while this one's
        # computed > the writer's (ready() clears it once the writer has caught up).
        self.writer: int | None = None


class KVCacheManager:
    """Block tables, the prefix cache and its events (see the module docstring).

    Keyed by the Scheduler's seq_ids. ``add`` a sequence when it queues and
    ``forget`` it when it ends; in between it is admitted (``admit`` or
    ``admit_member``), grows, commits and is freed, any number of times
    (a preempted sequence is freed and admitted again).
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, prefix_cache: bool, record_events: bool = False
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        # Off unless a consumer drains them: nothing else bounds the buffer.
        self.record_events = record_events
        self._entries: dict[int, _Entry] = {}
        self._events: list[KVEvent] = []
        self._queries = 0
        self._hits = 0

    # -- sequences ------------------------------------------------------------------

    def add(self, seq_id: int, prompt_len: int, salt: str = "") -> None:
        """Know a new (waiting) sequence; ``salt`` is its prefix-cache domain."""
        if seq_id in self._entries:
            raise ValueError(f"seq {seq_id} is already known")
        self._entries[seq_id] = _Entry(salt, prompt_len)

    def forget(self, seq_id: int) -> None:
        """Drop an ended sequence (its blocks must already be freed)."""
        if self._entries[seq_id].blocks:
            raise ValueError(f"seq {seq_id} still holds blocks; free it first")
        del self._entries[seq_id]

    def shareable_blocks(self, n_tokens: int) -> int:
        """Leading full blocks a sequence of ``n_tokens`` can take from someone else
        (the cache, or its group's writer): all but the one its last token is in."""
        return (n_tokens - 1) // self.block_size

    # -- admission ------------------------------------------------------------------

    def computed_blocks(
        self, seq_id: int, token_ids: Sequence[int], *, scoring: bool = False
    ) -> tuple[int, ...]:
        """The cached blocks this sequence's admission would share (rule 1). Changes
        nothing but the sequence's memo of its hashes.

        A prompt of exactly ``k`` full blocks therefore recomputes its whole last
        block, not just its last token: that token's K/V belongs in block ``k - 1``,
        which is shared, and a shared block is never written (one writer per block,
        no copy-on-write). The price is at most ``block_size`` rows of prefill.
        ``scoring``: a scored prompt takes no hit (a cached position has no logits).
        """
        if not self.prefix_cache or scoring:
            return ()
        e = self._entries[seq_id]
        usable = self.shareable_blocks(len(token_ids))
        if len(e.hashes) < usable:
            e.hashes = prefix_hashes(token_ids, self.block_size, e.salt, known=e.hashes)
        return self.pool.lookup(e.hashes[:usable])

    def available(self, holding: Sequence[int] = ()) -> int:
        """Blocks an admission could take after holding ``holding`` (cached ones count)."""
        return self.pool.available(holding=holding)

    def admit(self, seq_id: int, n_tokens: int, take: int, hits: Sequence[int]) -> None:
        """Give a sequence of ``n_tokens`` its table: the ``hits`` (from
        ``computed_blocks``) and ``take - len(hits)`` fresh blocks, together (rule 2).
        Its prefill starts past the hits. Raises ``RuntimeError`` taking nothing when
        the pool cannot (the caller checks ``available`` first)."""
        self._enter(seq_id, n_tokens, hits, take)
        self._count_hits(self._entries[seq_id])

    def admit_member(self, seq_id: int, writer_id: int, n_tokens: int, take: int) -> None:
        """Admit a group member beside its writer (rule 4): it holds the writer's
        shareable blocks and takes ``take`` minus those fresh; it is not ready until
        the writer has committed them. The writer must be admitted first."""
        writer = self._entries[writer_id]
        e = self._enter(seq_id, n_tokens, writer.blocks[: self.shareable_blocks(n_tokens)], take)
        if writer.computed < e.computed:
            e.writer = writer_id  # its hits are counted once they are written (ready)
        else:
            self._count_hits(e)

    def _enter(self, seq_id: int, n_tokens: int, shared: Sequence[int], take: int) -> _Entry:
        e = self._entries[seq_id]
        if e.blocks:
            raise ValueError(f"seq {seq_id} is already admitted")
        fresh = self.pool.acquire(shared, take - len(shared))  # all together or nothing
        if fresh is None:
            raise RuntimeError(f"admission of seq {seq_id} found {take} blocks gone")
        self._record_evictions()
        e.blocks = [*shared, *fresh]
        e.published = len(shared)
        e.computed = len(shared) * self.block_size
        if self.prefix_cache:
            self._queries += n_tokens
        if e.cached_tokens is None:
            e.cached_tokens = min(e.computed, e.prompt_len)
        return e

    def _count_hits(self, e: _Entry) -> None:
        """Count the positions an admission did not compute as hits: when it enters,
        or, for a member that waited, when its writer has written them."""
        if self.prefix_cache:
            self._hits += e.computed

    # -- running --------------------------------------------------------------------

    def grow(self, seq_id: int, n: int) -> bool:
        """Append ``n`` fresh blocks to a running table; False (nothing taken) when
        the pool cannot."""
        got = self.pool.allocate(n)
        if got is None:
            return False
        self._record_evictions()
        self._entries[seq_id].blocks.extend(got)
        return True

    def ready(self, seq_id: int) -> bool:
        """May this sequence run? Not while its group's writer has yet to commit the
        shared blocks it will read (rule 4)."""
        e = self._entries[seq_id]
        if e.writer is None:
            return True
        if self._entries[e.writer].computed < e.computed:
            return False
        e.writer = None
        self._count_hits(e)
        return True

    def commit(self, seq_id: int, computed: int, token_ids: Sequence[int]) -> None:
        """A step wrote this sequence's K/V up to ``computed`` positions of
        ``token_ids``: publish every block that is now full (rule 3).

        Only after the step ran: a hash over positions never computed would hand
        a later prompt garbage.
        """
        e = self._entries[seq_id]
        e.computed = computed
        if not self.prefix_cache:
            return
        bs = self.block_size
        full = computed // bs
        if full <= e.published:
            return
        if len(e.hashes) < full:
            e.hashes = prefix_hashes(token_ids[: full * bs], bs, e.salt, known=e.hashes)
        # Rule 6: a block is announced only while its parent is stored. A parent this
        # sequence computed as a private twin (someone else published it first) may
        # have been evicted since; publishing our copy (full, written, held by us)
        # restores the chain. Walk back over every such missing ancestor: none of
        # them is findable, so each publish below succeeds.
        start = e.published
        while (
            start > 0
            and self.pool.content(e.blocks[start - 1]) is None
            and not self.pool.lookup([e.hashes[start - 1]])
        ):
            start -= 1
        run: list[int] = []  # indices of the blocks stored by this call, one run at a time
        for i in range(start, full):
            if self.pool.publish(e.blocks[i], e.hashes[i]):
                run.append(i)
            else:  # a twin: another block has this content; the run stops here
                self._stored(e, token_ids, run)
                run = []
        self._stored(e, token_ids, run)
        e.published = full

    def _stored(self, e: _Entry, token_ids: Sequence[int], run: list[int]) -> None:
        if not run or not self.record_events:
            return
        bs = self.block_size
        first, last = run[0], run[-1]
        self._events.append(
            BlockStored(
                block_hashes=tuple(e.hashes[first : last + 1]),
                parent_hash=e.hashes[first - 1] if first else None,
                token_ids=tuple(token_ids[first * bs : (last + 1) * bs]),
                block_size=bs,
            )
        )

    # -- giving back ----------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        """Give a running sequence's blocks back (released full blocks stay findable
        until the pool needs them). A group writer leaving before the shared blocks
        are written hands the writing over first (rule 4)."""
        e = self._entries[seq_id]
        self._hand_over(seq_id)
        e.writer = None
        self.pool.free(e.blocks)
        e.blocks = []  # the same call that frees drops the ids: no stale table
        e.computed = e.published = 0

    def _hand_over(self, writer_id: int) -> None:
        """The first member waiting for ``writer`` writes the shared blocks from here,
        continuing from the writer's last committed position (the blocks are the
        same; only the positions it committed are known to hold K/V); the others
        wait for that one. Members were admitted in ticket order, right after their
        writer, so the entries' order is the group's.

        Hazard: a step still in flight may be writing the same positions for the
        old writer; the heir is first planned after that step commits or is
        discarded (one plan in flight), and rewrites them with the same K/V.
        """
        waiting = [
            sid
            for sid, e in self._entries.items()
            if e.writer == writer_id and not self.ready(sid)  # ready: no heir needed
        ]
        if not waiting:
            return
        writer = self._entries[writer_id]
        heir_id, *rest = waiting
        heir = self._entries[heir_id]
        heir.writer = None
        heir.computed = writer.computed
        heir.published = writer.computed // self.block_size
        # It computes the rest of the shared positions itself: they are not its cached
        # tokens (it entered counting all of them), nor hits.
        heir.cached_tokens = min(heir.computed, heir.prompt_len)
        self._count_hits(heir)
        for other in rest:
            self._entries[other].writer = heir_id

    def clear_cache(self) -> bool:
        """Forget every cached block's content (vLLM's reset of the prefix cache).
        False, changing nothing, while a running sequence holds a published block:
        its content must stay findable for the twins and members that share it."""
        if any(self.pool.content(b) is not None for e in self._entries.values() for b in e.blocks):
            return False
        self.pool.forget_cached()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def _record_evictions(self) -> None:
        gone = self.pool.take_evicted()
        if gone and self.record_events:
            self._events.append(BlockRemoved(gone))

    # -- looking --------------------------------------------------------------------

    def blocks(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's block table, in position order (empty while it waits)."""
        return tuple(self._entries[seq_id].blocks)

    def n_blocks(self, seq_id: int) -> int:
        return len(self._entries[seq_id].blocks)

    def computed(self, seq_id: int) -> int:
        """Positions whose K/V is written (0 while it waits)."""
        return self._entries[seq_id].computed

    def cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens its first admission did not compute (found cached or shared)."""
        return self._entries[seq_id].cached_tokens or 0

    def waits_for(self, seq_id: int) -> int | None:
        """The group member whose committed positions it waits for, or None."""
        e = self._entries[seq_id]
        if e.writer is None or self._entries[e.writer].computed >= e.computed:
            return None
        return e.writer

    def drain_events(self) -> tuple[KVEvent, ...]:
        """The events recorded since the last call, in order (none unless
        ``record_events``)."""
        out, self._events = tuple(self._events), []
        return out

    def statistics(self) -> KVCacheStatistics:
        return KVCacheStatistics(queries_total=self._queries, hits_total=self._hits)
