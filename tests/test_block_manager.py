"""Unit tests of paged_ops.BlockManager: worked examples (docs/concepts.md) and the API contract."""

import math

import pytest
import torch

from paged_ops.block_manager import BlockManager, BlockManagerStats, OutOfBlocks


def blocks_for(n, bs):
    return math.ceil(n / bs)


def tail_waste(n, bs):
    return blocks_for(n, bs) * bs - n


def refs(bm):
    return [bm.ref_count(b) for b in range(bm.num_blocks)]


def check_consistent(bm):
    """Cheap structural checks shared by many tests (the stateful test does the full set)."""
    tables = {s: bm.block_table(s) for s in bm.seq_ids() if not bm.is_swapped(s)}
    count = [0] * bm.num_blocks
    for s, t in tables.items():
        assert len(t) == blocks_for(bm.seq_len(s), bm.block_size)
        for b in t:
            count[b] += 1
    assert count == refs(bm)
    st = bm.stats()
    assert st.used_blocks + st.free_blocks + st.cached_blocks == bm.num_blocks
    assert st.used_blocks == sum(1 for c in count if c)
    assert not set(bm.free_block_ids()) & {b for b, c in enumerate(count) if c}


# ------------------------------------------------------------ capacity and tail waste
@pytest.mark.parametrize(
    "bs, fits, blocks, waste",
    [
        (8, True, [3, 4, 4, 5], 15),
        (16, False, [2, 2, 2, 3], 31),
        (32, False, [1, 1, 1, 2], 47),
    ],
)
def test_capacity_and_tail_waste_128_slot_pool(bs, fits, blocks, waste):
    lengths = [17, 31, 32, 33]
    # The formulas first: ceil(n / bs) blocks, ceil(n / bs) * bs - n wasted slots.
    assert [blocks_for(n, bs) for n in lengths] == blocks
    assert sum(tail_waste(n, bs) for n in lengths) == waste
    assert (sum(blocks) * bs <= 128) == fits

    bm = BlockManager(128 // bs, bs)
    admitted = []
    for i, n in enumerate(lengths):
        if bm.can_allocate(n):
            bm.allocate(f"req{i}", n)
            admitted.append(n)
            assert len(bm.block_table(f"req{i}")) == blocks[i]
        else:
            before = bm.snapshot()
            with pytest.raises(OutOfBlocks) as e:
                bm.allocate(f"req{i}", n)
            assert e.value.needed == blocks[i] and e.value.available == bm.num_free_blocks
            assert bm.snapshot() == before
    st = bm.stats()
    assert (len(admitted) == 4) == fits
    assert st.used_blocks == sum(blocks_for(n, bs) for n in admitted)
    assert st.tail_waste_slots == sum(tail_waste(n, bs) for n in admitted)
    assert st.num_tokens == st.stored_tokens == sum(admitted)
    if fits:  # B = 8: 128 slots exactly, 15 wasted (11.72 %)
        assert st.allocated_slots == 128 and bm.num_free_blocks == 0
        assert st.tail_waste_fraction == pytest.approx(15 / 128)
    check_consistent(bm)


# --------------------------------------------------------------------------- exercise 1
@pytest.mark.parametrize(
    "bs, blocks, slots, waste, fits",
    [(4, [2, 3, 3], 32, 4, True), (8, [1, 2, 2], 40, 12, False)],
)
def test_exercise_1_32_slot_pool(bs, blocks, slots, waste, fits):
    lengths = [7, 11, 10]
    assert [blocks_for(n, bs) for n in lengths] == blocks
    assert sum(blocks) * bs == slots
    assert sum(tail_waste(n, bs) for n in lengths) == waste

    bm = BlockManager(32 // bs, bs)
    ok = [bm.can_allocate(n) and (bm.allocate(i, n) or True) for i, n in enumerate(lengths)]
    assert all(ok) == fits
    if fits:
        st = bm.stats()
        assert st.allocated_slots == 32 and st.tail_waste_slots == 4
        assert st.tail_waste_fraction == pytest.approx(0.125)
        assert bm.num_free_blocks == 0
    else:
        assert ok == [True, True, False]  # 1 + 2 blocks used, the third needs 2 of 1 left
        with pytest.raises(OutOfBlocks):
            bm.allocate(2, lengths[2])


# --------------------------------------------------------------------------- exercise 2
def test_exercise_2_cow_trace():
    bm = BlockManager(16, 8)
    assert bm.allocate("A", 22) == 0
    assert bm.block_table("A") == [0, 1, 2]
    bm.fork("A", "B")
    assert bm.block_table("B") == [0, 1, 2]
    assert refs(bm)[:3] == [2, 2, 2]

    # Token 22: tail block 2 is shared -> CoW into block 3, written at offset 6.
    assert bm.append_slots("A") == [(2, 3)]
    assert bm.block_table("A") == [0, 1, 3] and bm.block_table("B") == [0, 1, 2]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    assert bm.slot_mapping("A", 22, 23) == [3 * 8 + 6]
    # Token 23: block 3 is private with one free slot -> in place.
    assert bm.append_slots("A") == []
    assert bm.block_table("A") == [0, 1, 3] and bm.slot_mapping("A", 23, 24) == [3 * 8 + 7]
    # Token 24: block 3 full -> new block 4, offset 0.
    assert bm.append_slots("A") == []
    assert bm.block_table("A") == [0, 1, 3, 4] and bm.slot_mapping("A", 24, 25) == [32]
    # Tokens 25..31: in place in block 4.
    for _ in range(7):
        assert bm.append_slots("A") == []
    assert bm.seq_len("A") == 32 and bm.seq_len("B") == 22
    assert bm.block_table("A") == [0, 1, 3, 4]
    assert bm.block_table("B") == [0, 1, 2]
    assert refs(bm)[:5] == [2, 2, 1, 1, 1] and sum(refs(bm)[5:]) == 0
    st = bm.stats()
    assert st.used_blocks == 5 and st.allocated_slots == 40
    assert st.stored_tokens == 38 and st.tail_waste_slots == 2
    assert st.shared_blocks == 2 and st.num_tokens == 54
    check_consistent(bm)


def test_exercise_2_append_ten_at_once_matches_token_by_token():
    bm = BlockManager(16, 8)
    bm.allocate("A", 22)
    bm.fork("A", "B")
    assert bm.append_slots("A", 10) == [(2, 3)]
    assert bm.block_table("A") == [0, 1, 3, 4]
    assert bm.slot_mapping("A", 22, 32) == [30, 31] + list(range(32, 40))


# ------------------------------------------------------------- the 35-token fork trace
def test_35_token_fork_trace_and_release():
    bm = BlockManager(16, 16)
    bm.allocate("dummy", 10 * 16)  # blocks 0..9: the trace uses blocks 10-13
    assert bm.allocate("A", 35) == 0
    assert bm.block_table("A") == [10, 11, 12]
    assert refs(bm)[10:13] == [1, 1, 1]
    bm.fork("A", "B")
    assert bm.block_table("B") == [10, 11, 12]
    assert refs(bm)[10:13] == [2, 2, 2]

    # A appends position 35: block 12 is shared -> CoW to 13, 3 valid positions copied.
    assert bm.append_slots("A") == [(12, 13)]
    assert bm.block_table("A") == [10, 11, 13]
    assert bm.slot_mapping("A", 35, 36) == [13 * 16 + 3]
    assert refs(bm)[10:14] == [2, 2, 1, 1]
    # B appends its own position 35: block 12 is now private to B -> in place.
    assert bm.append_slots("B") == []
    assert bm.block_table("B") == [10, 11, 12]
    assert bm.slot_mapping("B", 35, 36) == [12 * 16 + 3]

    st = bm.stats()
    # Besides the 10 full dummy blocks: 4 blocks in use, 40 useful tokens, 24 slots of waste.
    assert st.used_blocks - 10 == 4
    assert st.stored_tokens - 160 == 40 and st.tail_waste_slots == 24
    assert st.shared_blocks == 2
    # Unshared, both sequences need 3 blocks each: sharing saves 2 full blocks (32 slots).
    assert 2 * blocks_for(36, 16) - 4 == 2

    free_before = set(bm.free_block_ids())
    bm.free("A")
    assert refs(bm)[10:14] == [1, 1, 1, 0]
    assert set(bm.free_block_ids()) == free_before | {13}
    check_consistent(bm)


# --------------------------------------------------------------------------- transactions
def test_allocate_exhaustion_is_transactional():
    bm = BlockManager(4, 4)
    bm.allocate("a", 9)
    before = bm.snapshot()
    assert not bm.can_allocate(5)
    with pytest.raises(OutOfBlocks) as e:
        bm.allocate("b", 5)
    assert isinstance(e.value, RuntimeError) and e.value.pool == "gpu"
    assert e.value.needed == 2 and e.value.available == 1
    assert bm.snapshot() == before
    assert "b" not in bm
    bm.allocate("b", 4)  # still usable


def test_append_exhaustion_is_transactional():
    bm = BlockManager(1, 4)
    bm.allocate("seq", 4)
    before = bm.snapshot()
    assert not bm.can_append_slots("seq")
    with pytest.raises(OutOfBlocks):
        bm.append_slots("seq")
    assert bm.snapshot() == before
    assert bm.seq_len("seq") == 4 and bm.block_table("seq") == [0]
    # Several tokens at once: fails as a whole even though the first ones would fit.
    bm2 = BlockManager(2, 4)
    bm2.allocate("s", 3)
    before = bm2.snapshot()
    with pytest.raises(OutOfBlocks):
        bm2.append_slots("s", 6)  # needs 3 blocks in total, 2 exist
    assert bm2.snapshot() == before


def test_cow_without_free_block_is_transactional():
    bm = BlockManager(3, 8)
    bm.allocate("A", 22)  # all 3 blocks
    bm.fork("A", "B")
    before = bm.snapshot()
    assert not bm.can_append_slots("A")
    with pytest.raises(OutOfBlocks) as e:
        bm.append_slots("A")  # the shared tail needs a copy and no block is free
    assert e.value.needed == 1 and e.value.available == 0
    assert bm.snapshot() == before
    assert refs(bm) == [2, 2, 2]
    # Freeing the sibling makes the tail private: then it is written in place.
    bm.free("B")
    assert bm.append_slots("A") == []


def test_append_batch_is_all_or_nothing():
    bm = BlockManager(6, 4)
    bm.allocate("a", 4)  # block 0, full: its next token needs a block
    bm.allocate("b", 4)  # block 1
    bm.allocate("c", 6)  # blocks 2, 3
    bm.fork("c", "d")  # shared partial tail 3
    # a: +1, b: +1, c: CoW +1, d: in place after c detached -> 3 needed, 2 free.
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks) as e:
        bm.append_slots_batch(["a", "b", "c", "d"])
    assert e.value.needed == 3 and e.value.available == 2
    assert bm.snapshot() == before
    # Without "a" it fits exactly: the exact count knows that d writes in place.
    assert bm.append_slots_batch(["b", "c", "d"]) == [(3, 5)]
    assert bm.num_free_blocks == 0
    assert bm.block_table("b") == [1, 4]
    assert bm.block_table("c") == [2, 5] and bm.block_table("d") == [2, 3]
    assert [bm.seq_len(s) for s in "abcd"] == [4, 5, 7, 7]
    check_consistent(bm)


def test_append_batch_matches_sequential_appends():
    def build():
        bm = BlockManager(64, 4)
        bm.allocate("p", 10)
        for c in "abc":
            bm.fork("p", c)
        bm.allocate("q", 8)
        return bm

    ids = ["p", "a", "b", "c", "q"]
    counts = [1, 3, 0, 5, 2]
    seq, bat = build(), build()
    cow_seq = [pair for s, n in zip(ids, counts, strict=True) for pair in seq.append_slots(s, n)]
    cow_bat = bat.append_slots_batch(ids, counts)
    assert cow_seq == cow_bat
    assert seq.snapshot() == bat.snapshot()
    with pytest.raises(ValueError):
        bat.append_slots_batch(["p", "p"])


def test_release_everything_reclaims_the_pool():
    bm = BlockManager(6, 4)
    bm.allocate("A", 6)
    bm.fork("A", "B")
    bm.append_slots("A", 3)
    bm.append_slots("B", 1)
    bm.allocate("C", 5)
    for s in ["A", "B", "C"]:
        bm.free(s)
    assert bm.free_block_ids() == list(range(6))
    assert refs(bm) == [0] * 6
    assert bm.num_free_blocks == 6 and len(bm) == 0
    st = bm.stats()
    assert st.used_blocks == 0 and st.tail_waste_slots == 0 and st.num_seqs == 0


# --------------------------------------------------------------------------- errors
def test_argument_errors():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(4, 4, num_cpu_blocks=-1)
    bm = BlockManager(8, 4)
    bm.allocate("a", 5)
    with pytest.raises(ValueError):
        bm.allocate("a", 1)
    with pytest.raises(ValueError):
        bm.allocate("b", 0)
    with pytest.raises(ValueError):
        bm.allocate("b", 3, token_ids=[1, 2])
    with pytest.raises(KeyError):
        bm.fork("nope", "c")
    with pytest.raises(ValueError):
        bm.fork("a", "a")
    for f in (bm.block_table, bm.seq_len, bm.free, bm.append_slots, bm.is_swapped):
        with pytest.raises(KeyError):
            f("nope")
    with pytest.raises(ValueError):
        bm.append_slots("a", -1)
    assert bm.append_slots("a", 0) == [] and bm.seq_len("a") == 5
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 3, 6)
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 4, 3)
    with pytest.raises(ValueError):
        bm.ref_count(8)
    assert bm.snapshot()["seqs"]["a"][1] == 5
    assert issubclass(OutOfBlocks, RuntimeError)


def test_swap_out_without_cpu_pool_raises_out_of_blocks():
    bm = BlockManager(8, 4)
    bm.allocate("a", 5)
    with pytest.raises(OutOfBlocks) as e:
        bm.swap_out("a")
    assert e.value.pool == "cpu"


# --------------------------------------------------------------------------- tensors
def test_tensor_builders():
    bm = BlockManager(32, 4)
    bm.allocate("dummy", 3)  # shift ids
    bm.allocate("a", 10)  # blocks 1,2,3
    bm.allocate("b", 3)  # block 4
    bm.fork("a", "c")
    bm.append_slots("c", 2)  # CoW 3 -> 5
    ids = ["a", "b", "c"]
    bt = bm.block_tables_tensor(ids)
    assert bt.dtype == torch.int32 and bt.is_contiguous()
    assert bt.tolist() == [[1, 2, 3], [4, 0, 0], [1, 2, 5]]
    assert bm.block_tables_tensor(ids, max_blocks=5).tolist()[1] == [4, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        bm.block_tables_tensor(ids, max_blocks=2)
    sl = bm.seq_lens_tensor(ids)
    assert sl.dtype == torch.int32 and sl.tolist() == [10, 3, 12]
    sm = bm.slot_mapping_tensor(ids)
    assert sm.dtype == torch.int64
    assert sm.tolist() == [3 * 4 + 1, 4 * 4 + 2, 5 * 4 + 3]
    sm = bm.slot_mapping_tensor(ids, [10, 0, 2])
    assert sm.tolist() == bm.slot_mapping("a", 0, 10) + bm.slot_mapping("c", 10, 12)
    assert bm.slot_mapping("a", 0, 10) == list(range(4, 14))
    padded = bm.slot_mapping_tensor(ids, pad_to=6)
    assert padded.tolist()[3:] == [-1, -1, -1]
    spans = bm.slot_mapping_spans_tensor([("a", 2, 5), ("c", 11, 12)])
    assert spans.tolist() == bm.slot_mapping("a", 2, 5) + [5 * 4 + 3]
    # Empty batches keep their dtype and rank.
    assert bm.block_tables_tensor([]).shape == (0, 0)
    assert bm.block_tables_tensor([], max_blocks=4).shape == (0, 4)
    assert bm.seq_lens_tensor([]).shape == (0,)
    assert bm.slot_mapping_tensor([]).dtype == torch.int64
    bmt = bm.block_mapping_tensor([(3, 5), (1, 2)])
    assert bmt.dtype == torch.int64 and bmt.tolist() == [[3, 5], [1, 2]]
    assert bm.block_mapping_tensor([]).shape == (0, 2)
    # Results own their memory: later changes do not show through.
    bt = bm.block_tables_tensor(["b"])
    bm.append_slots("b", 5)
    assert bt.tolist() == [[4]]


def test_slot_mapping_formula_on_scattered_tables():
    bm = BlockManager(64, 8)
    for i in range(10):
        bm.allocate(i, 3 + 7 * i)
    for i in range(0, 10, 2):
        bm.free(i)
    bm.allocate("x", 50)  # takes the holes left behind
    table = bm.block_table("x")
    expect = [table[p // 8] * 8 + p % 8 for p in range(50)]
    assert bm.slot_mapping("x", 0, 50) == expect
    assert bm.slot_mapping_spans_tensor([("x", 13, 41)]).tolist() == expect[13:41]


def test_stats_is_a_dataclass_with_the_required_fields():
    bm = BlockManager(8, 4, num_cpu_blocks=2)
    st = bm.stats()
    assert isinstance(st, BlockManagerStats)
    for field in (
        "num_blocks block_size used_blocks free_blocks cached_blocks num_seqs num_tokens "
        "shared_blocks tail_waste_slots"
    ).split():
        assert hasattr(st, field)
    assert (st.num_blocks, st.block_size, st.free_blocks, st.num_cpu_blocks) == (8, 4, 8, 2)


def test_lowest_free_id_first_after_frees():
    bm = BlockManager(8, 1)
    for i in range(8):
        bm.allocate(i, 1)
    for i in (6, 2, 4):
        bm.free(i)
    bm.allocate("x", 2)
    assert bm.block_table("x") == [2, 4]


# --------------------------------------------------------------------------- prefix caching
def toks(*chunks):
    """Token ids from (value, count) chunks, e.g. toks((1, 16), (2, 4))."""
    out = []
    for v, n in chunks:
        out += [v] * n
    return out


def test_prefix_cache_hit_after_release():
    bm = BlockManager(8, 16, enable_prefix_caching=True)
    prompt = list(range(40))
    assert bm.allocate("A", 40, prompt) == 0
    a_table = bm.block_table("A")
    bm.free("A")
    # The two full blocks stay cached (ref 0), the partial tail is freed.
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    assert bm.cached_block_ids() == [a_table[1], a_table[0]]  # tail of the chain first
    assert a_table[2] in bm.free_block_ids()
    assert bm.allocate("B", 40, prompt) == 32
    b_table = bm.block_table("B")
    assert b_table[:2] == a_table[:2]
    assert bm.ref_count(b_table[0]) == 1 and bm.num_cached_blocks == 0
    # A cached block handed out again is not on the free list.
    assert not set(b_table) & set(bm.free_block_ids())
    st = bm.stats()
    assert st.prefix_cache_hit_tokens == 32 and st.prefix_cache_queried_tokens == 80
    check_consistent(bm)


def test_prefix_cache_hit_while_in_use_shares_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    assert bm.allocate("A", 10, prompt) == 0
    assert bm.allocate("B", 10, prompt) == 8
    assert bm.block_table("B")[:2] == bm.block_table("A")[:2]
    assert bm.block_table("B")[2] != bm.block_table("A")[2]
    assert [bm.ref_count(b) for b in bm.block_table("A")] == [2, 2, 1]
    # A longer prompt with the same start shares the common full blocks only.
    assert bm.allocate("C", 7, prompt[:7]) == 4
    assert bm.ref_count(bm.block_table("A")[0]) == 3


def test_prefix_cache_same_text_after_different_prefix_misses():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    x = [7, 7, 7, 7]
    bm.allocate("A", 9, [1, 1, 1, 1] + x + [0])
    # Same second block text, different first block: no hit at all.
    assert bm.allocate("B", 9, [2, 2, 2, 2] + x + [0]) == 0
    assert bm.block_table("B")[1] != bm.block_table("A")[1]
    # Same first block, different second block: only the first matches.
    assert bm.allocate("C", 9, [1, 1, 1, 1] + [8, 8, 8, 8] + [0]) == 4
    # Same text at a different position (the parent differs too): no hit.
    assert bm.allocate("D", 5, x + [0]) == 0
    check_consistent(bm)


def test_prefix_cache_whole_prompt_cached_recomputes_last_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(8))
    assert bm.allocate("A", 8, prompt) == 0
    bm.free("A")
    # Both blocks are cached, but the block holding the last token is allocated fresh.
    assert bm.allocate("B", 8, prompt) == 4
    assert bm.allocate("C", 1, [0]) == 0  # nothing may be cached for a 1-token prompt
    assert bm.allocate("D", 5, prompt[:5]) == 4


def test_prefix_cache_lru_eviction_order():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    bm.allocate("A", 5, [1, 1, 1, 1, 9])  # A0 A1 + partial
    bm.allocate("B", 5, [2, 2, 2, 2, 9])  # B0 B1 + partial
    a, b = bm.block_table("A"), bm.block_table("B")
    bm.free("A")
    bm.free("B")
    # Release order: A's chain tail first, then A's head, then B likewise.
    assert bm.cached_block_ids() == [a[1], a[0], b[1], b[0]]
    assert bm.stats().cached_blocks == 4 and bm.stats().free_blocks == 2
    # 3 new blocks: the 2 truly free ones first, then the LRU cached block (A's second).
    assert bm.allocate("C", 6, [3] * 6) == 0
    c = bm.block_table("C")
    assert c == [a[2], b[2], a[1]]
    assert bm.cached_block_ids() == [a[0], b[1], b[0]]
    bm.free("C")
    assert bm.cached_block_ids() == [a[0], b[1], b[0], c[2], c[1], c[0]]
    # A's first block is still cached, its second was evicted: one block hits, and the two
    # fresh blocks evict the least recently released (B's) ones.
    assert bm.allocate("A2", 5, [1, 1, 1, 1, 9]) == 2
    assert bm.block_table("A2") == [a[0], b[1], b[0]]
    assert bm.cached_block_ids() == [c[2], c[1], c[0]]
    # C's chain is still cached: 2 blocks hit (the last is recomputed).
    assert bm.allocate("C2", 6, [3] * 6) == 4
    assert bm.block_table("C2") == [c[0], c[1], c[2]]
    assert bm.cached_block_ids() == [] and bm.num_free_blocks == 0
    bm.free("A2")
    assert bm.allocate("B2", 5, [2, 2, 2, 2, 9]) == 0  # B's blocks were evicted
    check_consistent(bm)


def test_prefix_cache_exhaustion_counts_revived_blocks():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    bm.allocate("A", 5, [1, 1, 2, 2, 3])
    bm.free("A")  # 2 cached, 1 free
    before = bm.snapshot()
    # 7 tokens: 4 blocks, 2 of them hits -> 2 fresh blocks needed. free + cached = 3, but the
    # 2 cached ones are the hits being revived, so only 1 block is really available.
    assert not bm.can_allocate(7, [1, 1, 2, 2, 3, 3, 4])
    with pytest.raises(OutOfBlocks):
        bm.allocate("B", 7, [1, 1, 2, 2, 3, 3, 4])
    assert bm.snapshot() == before
    assert bm.allocate("B", 6, [1, 1, 2, 2, 3, 3]) == 4
    assert bm.num_free_blocks == 0


def test_prefix_cache_registers_blocks_filled_by_append():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    text = list(range(100, 112))
    bm.allocate("A", 3, text[:3])
    bm.append_slots("A", 1, text[3])  # block 0 full -> registered
    bm.append_slots("A", 4, text[4:8])  # block 1 full -> registered
    assert bm.allocate("B", 9, text[:8] + [0]) == 8
    assert bm.block_table("B")[:2] == bm.block_table("A")
    # Appending without token ids stops registration for the rest of the sequence.
    bm.allocate("C", 2, [5, 5])
    bm.append_slots("C", 2)
    bm.append_slots("C", 4, [6, 6, 6, 6])
    assert bm.allocate("D", 9, [5, 5, 5, 5, 6, 6, 6, 6, 0]) == 0
    # A fork inherits the chain: its own appended blocks are registered.
    bm.allocate("E", 2, [8, 8])
    bm.fork("E", "F")
    bm.append_slots("F", 2, [9, 9])
    assert bm.allocate("G", 5, [8, 8, 9, 9, 1]) == 4
    assert bm.block_table("G")[0] == bm.block_table("F")[0]
    check_consistent(bm)


def test_prefix_caching_disabled_ignores_token_ids():
    bm = BlockManager(8, 4)
    assert bm.allocate("A", 8, list(range(8))) == 0
    bm.free("A")
    assert bm.allocate("B", 8, list(range(8))) == 0
    assert bm.num_cached_blocks == 0 and bm.free_block_ids() == list(range(2, 8))


def test_reset_prefix_cache():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate("A", 9, list(range(9)))
    bm.allocate("B", 4, [0] * 4)
    bm.free("A")
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.free_block_ids() == [0, 1, 2, 4, 5, 6, 7]
    assert bm.allocate("C", 9, list(range(9))) == 0
    # B's in-use block stays registered.
    assert bm.allocate("D", 5, [0] * 5) == 4


def test_token_ids_accept_tensors():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    t = torch.arange(9)
    bm.allocate("A", 9, t)
    assert bm.allocate("B", 9, t.tolist()) == 8


# --------------------------------------------------------------------------- swap
def test_swap_round_trip():
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    bm.allocate("X", 4)  # block 0
    bm.allocate("A", 10)  # blocks 1, 2, 3
    assert not bm.is_swapped("A")
    out = bm.swap_out("A")
    assert out == [(1, 0), (2, 1), (3, 2)]
    assert bm.is_swapped("A") and bm.seq_len("A") == 10
    assert bm.cpu_block_table("A") == [0, 1, 2]
    assert [bm.cpu_ref_count(c) for c in range(4)] == [1, 1, 1, 0]
    with pytest.raises(ValueError):
        bm.block_table("A")
    with pytest.raises(ValueError):
        bm.append_slots("A")
    with pytest.raises(ValueError):
        bm.fork("A", "B")
    with pytest.raises(ValueError):
        bm.swap_out("A")
    with pytest.raises(ValueError):
        bm.block_tables_tensor(["A"])
    assert bm.num_free_blocks == 7 and bm.num_free_cpu_blocks == 5
    assert bm.stats().num_swapped_seqs == 1 and bm.stats().cpu_used_blocks == 3
    bm.allocate("Y", 8)  # takes blocks 1, 2: A comes back elsewhere
    back = bm.swap_in("A")
    assert back == [(0, 3), (1, 4), (2, 5)]
    assert bm.block_table("A") == [3, 4, 5] and not bm.is_swapped("A")
    assert bm.num_free_cpu_blocks == 8
    with pytest.raises(ValueError):
        bm.swap_in("A")
    with pytest.raises(ValueError):
        bm.cpu_block_table("A")
    bm.append_slots("A", 3)
    assert bm.block_table("A") == [3, 4, 5, 6]
    check_consistent(bm)


def test_swap_shared_blocks_copied_once():
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    bm.allocate("A", 10)  # 0 1 2
    bm.fork("A", "B")
    bm.fork("A", "C")
    bm.append_slots("C")  # CoW: C = 0 1 3
    out_a = bm.swap_out("A")
    # B (and C) still use the blocks: they are copied, and stay on the GPU for B.
    assert out_a == [(0, 0), (1, 1), (2, 2)]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    out_b = bm.swap_out("B")
    assert out_b == []  # every block already has a CPU copy: nothing moves twice
    assert bm.cpu_block_table("B") == [0, 1, 2]
    assert [bm.cpu_ref_count(c) for c in range(3)] == [2, 2, 2]
    assert refs(bm)[:4] == [1, 1, 0, 1]
    out_c = bm.swap_out("C")
    assert out_c == [(3, 3)]  # only C's private tail moves
    assert bm.cpu_block_table("C") == [0, 1, 3]
    assert [bm.cpu_ref_count(c) for c in range(4)] == [3, 3, 2, 1]
    assert bm.num_free_blocks == 8

    # Back in: the first sequence copies, the others share what is already on the GPU.
    assert bm.swap_in("B") == [(0, 0), (1, 1), (2, 2)]
    assert bm.swap_in("A") == []
    assert bm.block_table("A") == bm.block_table("B") == [0, 1, 2]
    assert bm.swap_in("C") == [(3, 3)]
    assert bm.block_table("C") == [0, 1, 3]
    assert refs(bm)[:4] == [3, 3, 2, 1]
    assert bm.num_free_cpu_blocks == 8
    # Sharing is real again: the shared partial tail is copied on write.
    assert bm.append_slots("A") == [(2, 4)]
    check_consistent(bm)


def test_swap_in_reuses_resident_copy_and_respects_writes():
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    bm.allocate("A", 6)  # 0 1
    bm.fork("A", "B")
    bm.swap_out("A")  # A's data copied to CPU 0 1; B keeps GPU 0 1
    # B writes position 6 in place into block 1 (private now): A's copy of it must come back
    # from the CPU, block 0 is still identical on the GPU.
    assert bm.append_slots("B") == []
    assert bm.swap_in("A") == [(1, 2)]
    assert bm.block_table("A") == [0, 2]
    assert refs(bm)[:3] == [2, 1, 1]


def test_swap_exhaustion_is_transactional():
    bm = BlockManager(4, 4, num_cpu_blocks=2)
    bm.allocate("A", 9)  # 3 blocks
    before = bm.snapshot()
    assert not bm.can_swap_out("A")
    with pytest.raises(OutOfBlocks) as e:
        bm.swap_out("A")
    assert e.value.pool == "cpu" and e.value.needed == 3 and e.value.available == 2
    assert bm.snapshot() == before

    bm2 = BlockManager(4, 4, num_cpu_blocks=4)
    bm2.allocate("A", 9)
    bm2.swap_out("A")
    bm2.allocate("B", 8)  # 2 of 4 GPU blocks left
    before = bm2.snapshot()
    assert not bm2.can_swap_in("A")
    with pytest.raises(OutOfBlocks) as e:
        bm2.swap_in("A")
    assert e.value.pool == "gpu" and e.value.needed == 3
    assert bm2.snapshot() == before
    bm2.free("B")
    assert bm2.can_swap_in("A")
    bm2.swap_in("A")


def test_free_swapped_sequence_releases_cpu_blocks():
    bm = BlockManager(4, 4, num_cpu_blocks=4)
    bm.allocate("A", 9)
    bm.fork("A", "B")
    bm.swap_out("A")
    bm.swap_out("B")
    bm.free("A")
    assert bm.num_free_cpu_blocks == 1
    bm.free("B")
    assert bm.free_cpu_block_ids() == [0, 1, 2, 3]
    assert bm.free_block_ids() == [0, 1, 2, 3]


def test_swap_with_prefix_cache_reuses_cached_blocks():
    bm = BlockManager(8, 4, num_cpu_blocks=8, enable_prefix_caching=True)
    prompt = list(range(10))
    bm.allocate("A", 10, prompt)
    assert bm.swap_out("A") == [(0, 0), (1, 1), (2, 2)]
    # The two full blocks stay cached on the GPU (ref 0): the swap-in reuses them.
    assert bm.num_cached_blocks == 2
    assert bm.swap_in("A") == [(2, 2)]
    assert bm.block_table("A") == [0, 1, 2]
    assert bm.num_cached_blocks == 0
    # Evicted meanwhile: copied back, and re-registered for later hits.
    bm.swap_out("A")
    bm.allocate("big", 32)  # takes every GPU block, evicting the cached ones
    bm.free("big")
    bm.reset_prefix_cache()
    out = bm.swap_in("A")
    assert len(out) == 3
    assert bm.allocate("B", 10, prompt) == 8
    assert bm.block_table("B")[:2] == bm.block_table("A")[:2]
    check_consistent(bm)
