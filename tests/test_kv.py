"""The block pool: all-or-nothing allocation, reference counts, conservation."""

from __future__ import annotations

import pytest

from triollm.kv import BlockPool, blocks_for, prefix_hashes


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.allocate(3) == (0, 1, 2)
    assert pool.allocate(2) is None
    assert pool.statistics().free == 1  # the refused request took nothing


def test_freed_blocks_come_back_and_are_reused_lowest_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a is not None and b is not None
    pool.free(a)
    assert pool.statistics().free == 2
    assert pool.allocate(1) == (0,)


def test_a_shared_block_stays_held_until_its_last_reference_is_dropped() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    assert blocks == (0,)
    pool.retain(blocks)
    pool.free(blocks)
    assert pool.refcount(0) == 1 and pool.statistics().held == 1
    pool.free(blocks)
    assert pool.refcount(0) == 0 and pool.statistics().free == 2


def test_a_double_free_is_refused_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    blocks = pool.allocate(2)
    assert blocks is not None
    with pytest.raises(ValueError, match="block 0 freed 2 time"):
        pool.free((0, 0))
    assert pool.statistics().held == 2
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free((7,))
    with pytest.raises(ValueError, match="it is free"):
        pool.retain((2,))


def test_free_plus_held_is_the_total() -> None:
    pool = BlockPool(num_blocks=5, block_size=1)
    pool.allocate(3)
    st = pool.statistics()
    assert (st.free, st.cached, st.held, st.total) == (2, 0, 3, 5)
    assert st.utilisation == pytest.approx(0.6)


def test_allocating_zero_blocks_gives_an_empty_table() -> None:
    pool = BlockPool(num_blocks=1, block_size=1)
    assert pool.allocate(0) == ()
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_the_pool_refuses_a_nonsense_shape() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# -- the prefix cache -----------------------------------------------------------------


def test_only_full_blocks_have_a_hash() -> None:
    assert len(prefix_hashes([1, 2, 3, 4, 5], block_size=2)) == 2
    assert prefix_hashes([1], block_size=2) == ()


def test_a_hash_names_its_block_and_everything_before_it() -> None:
    a = prefix_hashes([1, 2, 3, 4], block_size=2)
    b = prefix_hashes([9, 9, 3, 4], block_size=2)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different history: not the same block
    assert prefix_hashes([1, 2, 7, 7], block_size=2)[0] == a[0]


def test_two_salts_share_no_hash() -> None:
    ids = list(range(12))
    a, b = prefix_hashes(ids, 4, salt="tenant-a"), prefix_hashes(ids, 4, salt="tenant-b")
    assert not set(a) & set(b)
    assert prefix_hashes(ids, 4, salt="tenant-a") == a


def test_a_chain_extends_from_what_is_already_known() -> None:
    ids = list(range(10))
    first = prefix_hashes(ids[:5], 2, salt="s")
    assert prefix_hashes(ids, 2, salt="s", known=first) == prefix_hashes(ids, 2, salt="s")


def publish_table(pool: BlockPool, ids: list[int], salt: str = "") -> tuple[int, ...]:
    """Allocate a table for ``ids``, publish its full blocks, release it to the cache."""
    table = pool.allocate(blocks_for(len(ids), pool.block_size))
    assert table is not None
    for block, h in zip(table, prefix_hashes(ids, pool.block_size, salt), strict=False):
        assert pool.publish(block, h)
    pool.free(table)
    return table


def test_a_released_full_block_stays_findable_until_it_is_taken() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    table = publish_table(pool, [1, 2, 3, 4, 5])  # two full blocks and a partial one
    st = pool.statistics()
    assert (st.free, st.cached, st.held) == (2, 2, 0)
    assert pool.lookup(prefix_hashes([1, 2, 3, 4, 8], 2)) == table[:2]
    assert pool.lookup(prefix_hashes([1, 2, 9, 9], 2)) == table[:1]


def test_allocation_takes_free_blocks_before_cached_ones_then_the_least_recent() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    old = publish_table(pool, [1])  # block 0, cached first
    new = publish_table(pool, [2])  # block 0 is cached, so a free block is taken
    assert (old, new) == ((0,), (1,))
    assert pool.allocate(2) == (2, 3)  # the free ones first
    assert pool.allocate(1) == (0,)  # then the least recently released
    assert pool.lookup(prefix_hashes([1], 1)) == ()  # evicted: a miss, never a stale block
    assert pool.lookup(prefix_hashes([2], 1)) == (1,)
    assert pool.statistics().evictions == 1


def test_a_table_is_released_tail_first_so_the_lru_takes_its_tail_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    table = publish_table(pool, [1, 2, 3])
    assert pool.cached_blocks() == tuple(reversed(table))


def test_a_hit_on_a_cached_block_holds_it_again() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    table = publish_table(pool, [1, 2])
    hit = pool.lookup(prefix_hashes([1, 2, 3], 2))
    assert hit == table[:1]
    assert pool.acquire(hit, 1) == (1,)
    assert pool.refcount(hit[0]) == 1 and pool.statistics().cached == 0
    pool.retain(hit)  # a second holder shares it
    pool.free(hit)
    assert pool.refcount(hit[0]) == 1  # one holder finishing leaves it to the other


def test_acquire_is_all_or_nothing_and_a_hit_is_not_also_counted_as_available() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    hit = publish_table(pool, [7])
    assert pool.available() == 3
    assert pool.available(holding=hit) == 2
    assert pool.acquire(hit, 3) is None  # the hit itself cannot be allocated as well
    st = pool.statistics()
    assert (st.free, st.cached, st.held) == (2, 1, 0)  # and the refusal took nothing
    assert pool.acquire(hit, 2) == (1, 2)


def test_one_content_is_published_once_and_a_block_once() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    a, b = pool.allocate(1), pool.allocate(1)
    assert a is not None and b is not None
    (h,) = prefix_hashes([5], 1)
    assert pool.publish(a[0], h)
    assert not pool.publish(b[0], h)  # a second copy of the same content stays private
    with pytest.raises(ValueError, match="already published"):
        pool.publish(a[0], h)
    with pytest.raises(ValueError, match="nobody holds it"):
        pool.publish(2, h)
    pool.free(b)
    assert pool.statistics().free == 2  # the private copy is plain free, not cached
    with pytest.raises(ValueError, match="it is free"):
        pool.retain(b)


def test_each_eviction_leaves_its_hash_for_the_manager_to_take_once() -> None:
    pool = BlockPool(num_blocks=2, block_size=1)
    publish_table(pool, [1, 2])  # both cached, block 1 the least recent
    assert pool.take_evicted() == ()
    pool.allocate(1)
    assert pool.take_evicted() == prefix_hashes([1, 2], 1)[1:]
    assert pool.take_evicted() == ()  # taken


def test_forgetting_the_cache_frees_every_cached_block_and_keeps_held_content() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    publish_table(pool, [1, 2])
    held = pool.allocate(1)
    assert held is not None
    (h,) = prefix_hashes([9], 1)
    assert pool.publish(held[0], h)
    assert pool.forget_cached() == tuple(reversed(prefix_hashes([1, 2], 1)))
    st = pool.statistics()
    assert (st.free, st.cached, st.held) == (2, 0, 1)
    assert pool.lookup(prefix_hashes([1], 1)) == () and pool.lookup([h]) == held
    assert pool.allocate(2) == (0, 1)  # the free heap is whole again
