"""The KV-cache manager (kvcache.py) alone: tables, publishing, hand-over, events."""

from __future__ import annotations

from triollm.kv import prefix_hashes
from triollm.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager

BS = 2
PROMPT = [5, 6, 7, 8, 9]  # two full blocks of 2 and one token


def manager(num_blocks: int = 8, *, events: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix_cache=True, record_events=events)


def run(kv: KVCacheManager, seq: int, ids: list[int], salt: str = "", take: int = 3) -> None:
    """Add, admit with its hits and compute every position of ``ids``."""
    kv.add(seq, len(ids), salt)
    kv.admit(seq, len(ids), take, kv.computed_blocks(seq, ids))
    kv.commit(seq, len(ids), ids)


def end(kv: KVCacheManager, seq: int) -> None:
    kv.free(seq)
    kv.forget(seq)


def test_a_commit_announces_its_full_blocks_as_one_chain_with_their_tokens() -> None:
    kv = manager()
    run(kv, 0, PROMPT)
    h = prefix_hashes(PROMPT, BS)
    assert kv.drain_events() == (BlockStored(h, None, (5, 6, 7, 8), BS),)
    assert kv.drain_events() == ()  # drained


def test_a_later_block_names_its_parent_announced_before_it() -> None:
    kv = manager()
    kv.add(0, 5)
    kv.admit(0, 5, 3, ())
    kv.commit(0, 3, PROMPT)  # block 0 full
    kv.commit(0, 5, PROMPT)  # block 1 full
    h = prefix_hashes(PROMPT, BS)
    assert kv.drain_events() == (
        BlockStored(h[:1], None, (5, 6), BS),
        BlockStored(h[1:2], h[0], (7, 8), BS),
    )


def test_a_hit_is_announced_by_nobody_and_skips_the_cached_positions() -> None:
    kv = manager()
    run(kv, 0, PROMPT)
    end(kv, 0)
    kv.drain_events()
    kv.add(1, 5)
    hits = kv.computed_blocks(1, PROMPT)
    assert len(hits) == 2  # (5 - 1) // 2: the last token is always computed
    kv.admit(1, 5, 3, hits)
    assert kv.computed(1) == 4 and kv.cached_tokens(1) == 4
    kv.commit(1, 5, PROMPT)
    assert kv.drain_events() == ()
    assert kv.statistics().hits_total == 4


def test_an_eviction_is_announced_as_removed() -> None:
    kv = manager(num_blocks=3)
    run(kv, 0, PROMPT)
    end(kv, 0)
    kv.add(1, 5)
    kv.admit(1, 5, 3, ())  # a different opening needs every block: both cached are evicted
    stored, removed = kv.drain_events()
    assert isinstance(stored, BlockStored)
    # Released last-first, so the tail is the least recently used and goes first.
    assert removed == BlockRemoved(tuple(reversed(stored.block_hashes)))


def test_salts_never_share_a_block() -> None:
    kv = manager()
    run(kv, 0, PROMPT, salt="a")
    kv.add(1, 5, "b")
    assert kv.computed_blocks(1, PROMPT) == ()


def test_a_twin_republishes_its_copy_when_the_parent_was_evicted() -> None:
    # Two sequences compute the same opening at once; the first publishes it, the
    # second keeps a private twin. The first's copy is evicted; when the second's next
    # block is announced, its parent must be stored: the twin is published first.
    kv = manager(num_blocks=6)
    ids = [5, 6, 7, 8, 9, 9]
    kv.add(0, 3)
    kv.add(1, 6)
    kv.admit(0, 3, 2, ())
    kv.admit(1, 6, 3, ())
    kv.commit(0, 2, ids[:3])
    kv.commit(1, 2, ids)  # block 0: a twin, not announced again
    end(kv, 0)
    kv.add(2, 9)
    kv.admit(2, 9, 3, ())  # takes the free blocks and evicts seq 0's block 0
    kv.commit(1, 4, ids)  # block 1 full: its parent is gone
    h = prefix_hashes(ids, BS)
    events = kv.drain_events()
    assert events == (
        BlockStored(h[:1], None, (5, 6), BS),
        BlockRemoved(h[:1]),
        BlockStored(h[:2], None, (5, 6, 7, 8), BS),
    )
    assert kv.pool.lookup(h[:2]) == kv.blocks(1)[:2]


def test_clearing_forgets_every_cached_block_and_is_refused_while_one_is_held() -> None:
    kv = manager()
    run(kv, 0, PROMPT)
    assert not kv.clear_cache()  # seq 0 holds published blocks
    end(kv, 0)
    kv.drain_events()
    assert kv.clear_cache()
    assert kv.drain_events() == (AllBlocksCleared(),)
    assert kv.pool.statistics().cached == 0
    kv.add(1, 5)
    assert kv.computed_blocks(1, PROMPT) == ()


def test_a_member_waits_until_its_writer_has_committed_the_shared_blocks() -> None:
    kv = manager()
    kv.add(0, 5)
    kv.add(1, 5)
    kv.admit(0, 5, 3, ())
    kv.admit_member(1, 0, 5, 3)
    assert kv.blocks(1)[:2] == kv.blocks(0)[:2] and kv.computed(1) == 4
    assert not kv.ready(1) and kv.waits_for(1) == 0
    kv.commit(0, 4, PROMPT)
    assert kv.ready(1) and kv.waits_for(1) is None


def test_a_writer_that_leaves_hands_the_writing_to_the_first_waiting_member() -> None:
    kv = manager()
    for q in range(3):
        kv.add(q, 5)
    kv.admit(0, 5, 3, ())
    kv.admit_member(1, 0, 5, 3)
    kv.admit_member(2, 0, 5, 3)
    kv.commit(0, 2, PROMPT)
    end(kv, 0)
    assert kv.computed(1) == 2 and kv.ready(1)  # it continues from the writer's commit
    assert kv.waits_for(2) == 1
    assert kv.pool.refcount(kv.blocks(1)[0]) == 2  # the writer's reference is gone


def test_no_event_is_kept_unless_asked_for() -> None:
    kv = manager(events=False)
    run(kv, 0, PROMPT)
    end(kv, 0)
    assert kv.clear_cache()
    assert kv.drain_events() == ()
