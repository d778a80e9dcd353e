"""The paged KV block pool: the one owner of block ownership.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` positions each.
A sequence holds a *block table* (block ids in position order); position ``p`` of
that sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``. This module decides which block ids are free and who holds
how many references to each; it knows nothing about sequences, tokens or arrays.
The Batch owns the float32 arrays those ids index; the Scheduler owns the tables.

Rules:

1. ``allocate(n)`` is all-or-nothing: it returns ``n`` distinct free block ids, or
   ``None`` having taken nothing. Admission relies on this: a request's prompt and
   its reserved answer are taken *together*, so a half-admitted request can never
   sit on blocks while it waits for the rest (the hold-and-wait half of a deadlock).
2. Every block has a reference count. ``allocate`` sets it to 1, ``retain`` adds
   one (a later prefix cache shares a block between sequences this way), ``free``
   drops one. A block returns to the free list exactly when its count reaches 0.
3. Freeing a block whose count is already 0 is a bug in the caller (a double
   free would hand one block to two sequences later) and raises ``ValueError``.
4. Free blocks are handed out lowest id first. Nothing depends on it for
   correctness; it makes simulations and test failures reproducible and easy to read.

Invariant: ``free + held == total`` at every moment, where ``held`` counts blocks
with a reference count above zero. The property tests check it after every rule.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


def blocks_for(positions: int, block_size: int) -> int:
    """How many blocks hold ``positions`` positions: ``ceil(positions / block_size)``."""
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    return -(-positions // block_size)


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of the pool. ``free + held == total`` always."""

    total: int  # blocks in the pool
    free: int  # blocks with reference count 0, ready to allocate
    held: int  # blocks with reference count >= 1
    block_size: int  # positions per block

    @property
    def utilisation(self) -> float:
        """Fraction of blocks held, 0.0 .. 1.0."""
        return self.held / self.total


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` positions, with reference counts.

    Trap: the pool hands out ids, not memory. A caller that keeps using a block id
    after freeing its reference is reading a block someone else may now own; the
    Scheduler avoids this by dropping its block table in the same call that frees.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Invariant: block b is in _free_heap exactly when _refs[b] == 0.
        self._refs = [0] * num_blocks
        self._free_heap = list(range(num_blocks))  # already a valid min-heap

    def allocate(self, n: int) -> tuple[int, ...] | None:
        """Take ``n`` free blocks, all together, or none (``None``).

        ``allocate(0)`` succeeds with ``()``. Trap: ``None`` is not an error; the
        caller must leave its state exactly as it was (nothing was taken).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_heap):
            return None
        taken = tuple(heapq.heappop(self._free_heap) for _ in range(n))
        for b in taken:
            self._refs[b] = 1
        return taken

    def retain(self, blocks: Iterable[int]) -> None:
        """Add one reference to each held block (sharing, e.g. a prefix cache)."""
        blocks = tuple(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refs[b] == 0:
                raise ValueError(f"cannot retain block {b}: it is free")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block at zero goes back to the free list.

        The whole call is checked before anything changes, so a bad id leaves the
        pool untouched.
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
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free_heap, b)

    def refcount(self, block: int) -> int:
        """How many references ``block`` holds (0 = free)."""
        self._check_id(block)
        return self._refs[block]

    def statistics(self) -> PoolStatistics:
        free = len(self._free_heap)
        return PoolStatistics(
            total=self.num_blocks,
            free=free,
            held=self.num_blocks - free,
            block_size=self.block_size,
        )

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the pool (0 .. {self.num_blocks - 1})")
