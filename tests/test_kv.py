"""The block pool: all-or-nothing allocation, reference counts, conservation."""

from __future__ import annotations

import pytest

from triollm.kv import BlockPool, blocks_for


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
    assert (st.free, st.held, st.total) == (2, 3, 5)
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
