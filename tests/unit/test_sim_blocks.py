"""The KV block pool: ref counts, the LRU free queue and the prefix-cache index."""

from __future__ import annotations

import pytest

from seawall.sim.blocks import BlockPool, chain_hash


def test_freed_blocks_stay_cached_until_reused_tail_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    h0 = chain_hash(0, [1, 2])
    h1 = chain_hash(h0, [3, 4])
    pool.cache(a[0], h0)
    pool.cache(a[1], h1)
    pool.free(a)
    assert pool.num_free == 4 and pool.usage() == 0.0  # evictable blocks count as free
    assert pool.lookup([h0, h1]) == a
    # allocation takes never-used blocks first, then the tail block of the freed request
    pool.allocate(2)
    pool.allocate(1)
    assert pool.lookup([h0, h1]) == [a[0]]  # the prefix survives its own tail


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache(block, 42)
    pool.free([block])
    assert pool.num_evictable([block]) == 1
    pool.touch(pool.lookup([42]))
    assert pool.num_free == 2 and pool.total_refs() == 1
    pool.touch([block])  # a second holder
    pool.free([block])
    assert pool.num_free == 2  # still held once
    pool.free([block])
    assert pool.num_free == 3


def test_equal_prefixes_hash_equal_and_different_parents_do_not() -> None:
    assert chain_hash(0, [5, 6]) == chain_hash(0, [5, 6])
    assert chain_hash(1, [5, 6]) != chain_hash(0, [5, 6])


def test_over_allocation_is_refused() -> None:
    with pytest.raises(ValueError):
        BlockPool(2).allocate(3)
