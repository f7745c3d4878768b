"""BlockPool (one pool's ref counts, free list, prefix cache, twins), the prefix-cache keys and
the tensor builders, on their own; BlockManager's tests cover them as the manager uses them."""

from array import array

import pytest
import torch

from paged_ops import block_tensors as bt
from paged_ops.block_pool import BlockPool
from paged_ops.prefix_hash import ROOT_HASH, chain_keys


def test_take_hands_out_the_lowest_free_id_and_release_returns_it():
    pool = BlockPool(4)
    assert [pool.take() for _ in range(3)] == [0, 1, 2]
    assert pool.ref == [1, 1, 1, 0] and pool.num_free == 1
    pool.release_all([1])
    assert pool.free_ids() == [1, 3] and pool.ref[1] == 0
    assert pool.take() == 1


def test_share_and_release_count_references():
    pool = BlockPool(3)
    a, b = pool.take(), pool.take()
    pool.share_held([a, b])
    pool.share([a])
    assert pool.ref_count(a) == 3 and pool.ref_count(b) == 2 and pool.num_shared() == 2
    pool.release_all([a, b])
    assert (pool.ref[a], pool.ref[b], pool.num_free) == (2, 1, 1)
    pool.release_all([a, a, b])
    assert pool.num_free == 3 and pool.free_ids() == [0, 1, 2]


def test_ref_count_names_the_pool_and_the_range():
    pool = BlockPool(2, "CPU")
    with pytest.raises(ValueError, match=r"CPU block id 2 out of range \[0, 2\)"):
        pool.ref_count(2)
    with pytest.raises(ValueError, match="CPU block id -1"):
        pool.ref_count(-1)


def test_registered_block_is_kept_in_lru_order_and_evicted_last():
    pool = BlockPool(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    pool.register(a, ("ka",))
    pool.register(b, ("kb",))
    pool.release_all([b, a, c])  # b released before a: b is the least recently used
    assert pool.cached_ids() == [b, a] and pool.free_ids() == [c]
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.take() == c  # truly free blocks first
    assert pool.take() == b  # then the LRU cached one, unregistered on eviction
    assert not pool.is_cached(b) and pool.cache == {("ka",): a}
    pool.share([a])  # a cache hit revives a ref-0 cached block
    assert pool.ref[a] == 1 and pool.cached_ids() == [] and pool.is_cached(a)


def test_register_first_block_per_key_wins():
    pool = BlockPool(2)
    a, b = pool.take(), pool.take()
    pool.register(a, ("k",))
    pool.register(b, ("k",))
    pool.register(a, ("other",))
    assert pool.cache == {("k",): a} and not pool.is_cached(b)
    pool.release_all([b])
    assert pool.free_ids() == [b]  # the duplicate is freed, not cached


def test_reset_cache_frees_ref0_blocks_and_keeps_held_ones():
    pool = BlockPool(3)
    a, b = pool.take(), pool.take()
    pool.register(a, ("ka",))
    pool.register(b, ("kb",))
    pool.release_all([a])
    assert pool.reset_cache() == 1
    assert pool.free_ids() == [a, 2] and pool.cache == {("kb",): b} and pool.num_cached == 0


def test_twins_are_linked_both_ways_and_dropped_on_release_or_write():
    gpu, cpu = BlockPool(2, "GPU"), BlockPool(2, "CPU")
    gpu.pair(cpu)
    g, c = gpu.take(), cpu.take()
    gpu.link_twin(g, c)
    assert gpu.twins == {g: c} and cpu.twins == {c: g}
    cpu.release_all([c])  # releasing either side drops the pair
    assert gpu.twins == {} and cpu.twins == {}
    c = cpu.take()
    cpu.link_twin(c, g)
    gpu.drop_twin(g)  # written in place: the CPU copy is stale
    assert gpu.twins == {} and cpu.twins == {}
    gpu.drop_twin(g)  # no twin: nothing happens


def test_snapshot_is_a_deep_copy():
    pool = BlockPool(2)
    b = pool.take()
    snap = pool.snapshot()
    pool.release_all([b])
    assert snap["ref"] == [1, 0] and pool.snapshot() != snap


def test_chain_keys_depend_on_the_whole_prefix():
    toks = [1, 2, 3, 4, 5, 6]
    keys = chain_keys(toks, 0, 3, 2, None)
    assert keys[0] == (ROOT_HASH, (1, 2)) and keys[1] == (hash(keys[0]), (3, 4))
    # Continuing a chain from a parent key gives the same keys as hashing it all at once.
    assert chain_keys(toks, 1, 2, 2, keys[0]) == keys[1:]
    # The same block after a different prefix gets a different key.
    assert chain_keys([9, 9, 3, 4], 0, 2, 2, None)[1] != keys[1]
    assert chain_keys(toks, 0, 0, 2, None) == []


def test_slots_follow_the_block_table():
    table = array("i", [5, 2, 7])
    bs = 4
    expect = [table[p // bs] * bs + p % bs for p in range(1, 11)]
    assert bt.slots(table, 1, 11, bs) == expect
    assert bt.slots(table, 3, 3, bs) == []


def test_tensor_builders():
    tables = [array("i", [3, 1]), array("i", []), array("i", [4])]
    t = bt.block_tables_tensor(tables, 3)
    assert t.dtype == torch.int32 and t.tolist() == [[3, 1, 0], [0, 0, 0], [4, 0, 0]]
    assert bt.block_tables_tensor([], 0).shape == (0, 0)
    s = bt.slots_tensor([7, 8], 4)
    assert s.dtype == torch.int64 and s.tolist() == [7, 8, -1, -1]
    with pytest.raises(ValueError, match="pad_to=1 < 2 slots"):
        bt.slots_tensor([7, 8], 1)
    assert bt.slots_tensor([], None).shape == (0,)
    m = bt.block_mapping_tensor([(1, 2), (3, 4)])
    assert m.dtype == torch.int64 and m.tolist() == [[1, 2], [3, 4]]
    assert bt.block_mapping_tensor([]).shape == (0, 2)
    lens = bt.int32_tensor(array("i", [5, 6]))
    assert lens.dtype == torch.int32 and lens.tolist() == [5, 6]
