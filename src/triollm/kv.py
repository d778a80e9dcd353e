"""The paged KV block pool: the one owner of block ownership, the allocator under the cache.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` positions each.
A sequence holds a *block table* (block ids in position order); position ``p`` of
that sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``. This module decides which block ids are free, who holds how
many references to each, and which blocks are known by their content; it knows
nothing about sequences or arrays. The Batch owns the arrays those ids index;
the KV-cache manager (``kvcache.py``) owns the tables, decides what is published,
and is the pool's only caller.

Every block is in exactly one of three states:

- **free**: reference count 0, no content anyone can find;
- **cached**: reference count 0, but its content hash is still indexed, so a
  later prompt with the same opening finds it; it sits in an LRU;
- **held**: reference count >= 1 (one per block table that names it).

Rules:

1. ``allocate(n)`` is all-or-nothing: it returns ``n`` distinct blocks, or
   ``None`` having taken nothing. Admission relies on this: a request's prompt and
   its reserved answer are taken *together*, so a half-admitted request can never
   sit on blocks while it waits for the rest (the hold-and-wait half of a deadlock).
   Free blocks go first (lowest id first, which makes simulations and test
   failures reproducible); then cached blocks, **least recently released first**,
   each losing its hash as it is taken (an *eviction*). A cached block is therefore
   as good as a free one for admission: ``available = free + cached``.
2. Every block has a reference count. ``allocate`` sets it to 1, ``retain`` adds
   one (a cached block retained becomes held again: a prefix-cache hit), ``free``
   drops one. At 0 a block with a content hash becomes cached, one without
   becomes free.
3. ``publish(block, hash)`` names a held block by its content, once its K/V is
   fully written. From then on the block is never written again: only full
   blocks are published, and a writer only ever writes positions past the full
   blocks it shares. A hash already naming another block is not published twice
   (two sequences computed the same block at once); the second copy stays private
   and is simply free when released.
4. ``acquire(shared, n)`` is admission's one call: hold every block of ``shared``
   (found by ``lookup``) and allocate ``n`` more, all together or none.
5. Freeing a block whose count is already 0 is a bug in the caller (a double
   free would hand one block to two sequences later) and raises ``ValueError``;
   every call is checked whole before anything changes.

Invariant: ``free + cached + held == total`` at every moment. The property tests
check it after every rule (``property_tests/pool_machine.py`` for the pool alone,
``src/triollm/check/machine.py`` with the Scheduler on top).

The hash chain: block ``i``'s hash digests block ``i - 1``'s hash and block ``i``'s
token ids, and the chain starts from a digest of the salt. So a hash names a block
*and everything before it*: two prompts that differ anywhere before block ``i``
never share block ``i``, and two salts never share anything
(:func:`prefix_hashes`; SHA-256 from the standard library, so the scheduler stays
pure).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Versioned, so a change to the encoding can never match hashes made by the old one.
_HASH_LABEL = b"triollm/prefix/v1\x00"


def blocks_for(positions: int, block_size: int) -> int:
    """How many blocks hold ``positions`` positions: ``ceil(positions / block_size)``."""
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    return -(-positions // block_size)


def prefix_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    *,
    known: Sequence[bytes] = (),
) -> tuple[bytes, ...]:
    """The chained content hash of every *full* block of ``token_ids``.

    ``hashes[i]`` digests ``hashes[i - 1]`` (or, for block 0, a digest of
    ``salt``) and the ``block_size`` token ids of block ``i`` as fixed-width
    integers, so it names the block together with everything before it. A
    partial last block has no hash: only full blocks are ever shared.

    ``known`` is a leading run already computed for these same ids (a sequence
    extends its chain as it grows); only the rest is hashed. Trap: ``known`` is
    trusted, not re-checked; pass only what this function returned for a prefix
    of the same ``token_ids``, ``block_size`` and ``salt``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(token_ids) // block_size
    out = list(known[:full])
    if len(out) < full:
        pack = struct.Struct(f"<{block_size}I").pack  # token ids are < 2**32
        parent = out[-1] if out else _root(salt)
        for i in range(len(out), full):
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            parent = hashlib.sha256(parent + pack(*tokens)).digest()
            out.append(parent)
    return tuple(out)


def _root(salt: str) -> bytes:
    """The chain's starting point: the salt, length-prefixed so no salt is another's prefix."""
    raw = salt.encode("utf-8")
    return hashlib.sha256(_HASH_LABEL + struct.pack("<Q", len(raw)) + raw).digest()


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of the pool. ``free + cached + held == total`` always."""

    total: int  # blocks in the pool
    free: int  # reference count 0, no findable content: ready to allocate
    cached: int  # reference count 0, content still findable; allocated after the free ones
    held: int  # reference count >= 1
    block_size: int  # positions per block
    evictions: int = 0  # cached blocks taken for new content since the pool was made

    @property
    def available(self) -> int:
        """Blocks ``allocate`` can hand out now: the free and the cached ones."""
        return self.free + self.cached

    @property
    def utilisation(self) -> float:
        """Fraction of blocks held, 0.0 .. 1.0."""
        return self.held / self.total


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` positions, with reference counts
    and a content-addressed cache of released full blocks.

    Trap: the pool hands out ids, not memory. A caller that keeps using a block id
    after freeing its reference is reading a block someone else may now own; the
    KV-cache manager avoids this by dropping its block table in the same call that frees.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        # Invariant: b is in _free_heap exactly when _refs[b] == 0 and b has no hash.
        self._free_heap = list(range(num_blocks))  # already a valid min-heap
        # Invariant: b is in _cached exactly when _refs[b] == 0 and b has a hash.
        # Insertion order is release order: the first entry is the least recently used.
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Invariant: _hash_of and _block_of are inverse maps (published blocks only).
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictions = 0
        # The hashes evicted since the last take_evicted(), oldest first: the KV-cache
        # manager turns them into BlockRemoved events. Trap: a caller that never drains
        # it keeps one hash per eviction; the manager drains it after every allocation.
        self._evicted: list[bytes] = []
        self._held = 0  # blocks with a reference count above 0, counted as they change

    # -- taking ---------------------------------------------------------------------

    def allocate(self, n: int) -> tuple[int, ...] | None:
        """Take ``n`` blocks, all together, or none (``None``).

        Free blocks first, lowest id first; then cached blocks, least recently
        released first, each forgetting its content (rule 1). ``allocate(0)``
        succeeds with ``()``. Trap: ``None`` is not an error; the caller must leave
        its state exactly as it was (nothing was taken).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_heap) + len(self._cached):
            return None
        taken = []
        for _ in range(n):
            if self._free_heap:
                taken.append(heapq.heappop(self._free_heap))
            else:
                block, _ = self._cached.popitem(last=False)  # the least recently used
                gone = self._hash_of.pop(block)
                del self._block_of[gone]
                self._evicted.append(gone)
                self._evictions += 1
                taken.append(block)
        for b in taken:
            self._refs[b] = 1
        self._held += n
        return tuple(taken)

    def retain(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block; a cached block becomes held again (a hit).

        A free block (no content) cannot be retained: nobody could know what it holds.
        """
        blocks = tuple(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refs[b] == 0 and b not in self._cached:
                raise ValueError(f"cannot retain block {b}: it is free")
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached[b]
                self._held += 1
            self._refs[b] += 1

    def acquire(self, shared: Sequence[int], n: int) -> tuple[int, ...] | None:
        """Hold every block of ``shared`` and allocate ``n`` more, together or none.

        Returns the ``n`` new blocks (the caller's table is ``shared`` + them), or
        ``None`` having changed nothing. ``shared`` comes from :meth:`lookup`: held
        or cached blocks; the cached ones among them stop being available, which
        :meth:`available` accounts for.
        """
        if n > self.available(holding=shared):
            return None
        self.retain(shared)
        got = self.allocate(n)
        if got is None:  # cannot happen: available() counted exactly this
            raise RuntimeError(f"acquire({len(shared)} shared, {n}) found blocks gone")
        return got

    def available(self, holding: Sequence[int] = ()) -> int:
        """Blocks ``allocate`` could hand out after ``holding`` were retained.

        Free + cached, minus the cached blocks in ``holding`` (a hit on a cached
        block takes it out of the LRU, so it can no longer be evicted for someone else).
        """
        hit_cached = sum(1 for b in set(holding) if b in self._cached)
        return len(self._free_heap) + len(self._cached) - hit_cached

    # -- giving back ----------------------------------------------------------------

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; at zero it becomes cached or free (rule 2).

        Pass a block table in position order: its blocks are released last-first,
        so a table's opening block is the most recently used and the LRU takes its
        tail before its head (a chain is useless without its head). The whole call
        is checked before anything changes, so a bad id leaves the pool untouched.
        """
        blocks = tuple(blocks)
        drops: dict[int, int] = {}
        for b in blocks:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
        for b, k in drops.items():
            if self._refs[b] < k:
                raise ValueError(
                    f"block {b} freed {k} time(s) but holds {self._refs[b]} reference(s)"
                )
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._held -= 1
                if b in self._hash_of:
                    self._cached[b] = None  # the most recently used end
                else:
                    heapq.heappush(self._free_heap, b)

    # -- content --------------------------------------------------------------------

    def publish(self, block: int, content: bytes) -> bool:
        """Name a held, fully written block by its chained hash (rule 3).

        Returns False, changing nothing, when another block already has this
        content (this copy stays private). Publishing a block twice is a bug.
        """
        self._check_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"cannot publish block {block}: nobody holds it")
        if block in self._hash_of:
            raise ValueError(f"block {block} is already published; a cached block is never written")
        if content in self._block_of:
            return False
        self._hash_of[block] = content
        self._block_of[content] = block
        return True

    def take_evicted(self) -> tuple[bytes, ...]:
        """The hashes that ``allocate`` evicted since the last call, oldest first."""
        out, self._evicted = tuple(self._evicted), []
        return out

    def forget_cached(self) -> tuple[bytes, ...]:
        """Make every cached block free (its content no longer findable); returns the
        hashes dropped, least recently used first. Held blocks keep their content."""
        gone = tuple(self._hash_of[b] for b in self._cached)
        for b in self._cached:
            del self._block_of[self._hash_of.pop(b)]
            heapq.heappush(self._free_heap, b)
        self._cached.clear()
        return gone

    def lookup(self, hashes: Iterable[bytes]) -> tuple[int, ...]:
        """The blocks holding the longest leading run of ``hashes``. Changes nothing."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return tuple(found)

    def content(self, block: int) -> bytes | None:
        """The hash ``block`` was published under, or None (free, or private)."""
        self._check_id(block)
        return self._hash_of.get(block)

    # -- looking --------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        """How many references ``block`` holds (0 = free or cached)."""
        self._check_id(block)
        return self._refs[block]

    def cached_blocks(self) -> tuple[int, ...]:
        """Cached blocks, least recently used first (the order eviction takes them)."""
        return tuple(self._cached)

    def statistics(self) -> PoolStatistics:
        free, cached = len(self._free_heap), len(self._cached)
        return PoolStatistics(
            total=self.num_blocks,
            free=free,
            cached=cached,
            held=self._held,
            block_size=self.block_size,
            evictions=self._evictions,
        )

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the pool (0 .. {self.num_blocks - 1})")
