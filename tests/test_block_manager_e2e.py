"""BlockManager driving the real ops: writes, copy-on-write, prefix-cache hits and swaps must
leave every sequence's paged attention equal to dense attention over its own tokens.

Every cache starts filled with NaN, so a slot that a sequence reads but nobody wrote (a wrong
slot mapping, a CoW not applied, a swap mapping missing a block) poisons the output.
"""

import pytest
import torch

import paged_ops
from paged_ops.block_manager import BlockManager

TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and paged_ops.built_with_cuda()),
                reason="needs a CUDA GPU and a CUDA build",
            ),
        ],
    ),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(d):
    return str(d).removeprefix("torch.")


def dense_attention(q, k, v, scale):
    """softmax(q k^T * scale) v in fp32 for one sequence. q [H, D], k/v [L, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    p = (torch.einsum("hd,lhd->hl", q.float(), k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v)


class Harness:
    """A BlockManager, one layer of GPU (device) cache, an optional CPU cache, and the dense
    K/V each sequence has been written with."""

    def __init__(
        self,
        num_blocks,
        block_size,
        dtype,
        device,
        *,
        num_cpu_blocks=0,
        caching=False,
        heads=4,
        kv_heads=2,
        head_size=64,
        seed=0,
    ):
        self.bm = BlockManager(
            num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=caching
        )
        self.dtype, self.device = dtype, torch.device(device)
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.kc, self.vc = paged_ops.allocate_kv_cache(
            num_blocks, kv_heads, head_size, block_size, dtype, device
        )
        self.kc.fill_(float("nan"))
        self.vc.fill_(float("nan"))
        if num_cpu_blocks:
            self.ckc, self.cvc = paged_ops.allocate_kv_cache(
                num_cpu_blocks, kv_heads, head_size, block_size, dtype, "cpu"
            )
            self.ckc.fill_(float("nan"))
            self.cvc.fill_(float("nan"))
        self.keys: dict = {}
        self.values: dict = {}
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def write(self, seq, start, end, k=None, v=None):
        """Write positions start..end-1 of seq (new random K/V unless given)."""
        n = end - start
        if k is None:
            k = self.randn(n, self.kv_heads, self.head_size)
            v = self.randn(n, self.kv_heads, self.head_size)
        old_k = self.keys.get(seq, k[:0])
        old_v = self.values.get(seq, v[:0])
        assert old_k.shape[0] == start
        self.keys[seq] = torch.cat([old_k, k])
        self.values[seq] = torch.cat([old_v, v])
        slots = self.bm.slot_mapping_spans_tensor([(seq, start, end)], self.device)
        paged_ops.reshape_and_cache(k.to(self.device), v.to(self.device), self.kc, self.vc, slots)

    def fork(self, parent, child):
        self.bm.fork(parent, child)
        self.keys[child] = self.keys[parent].clone()
        self.values[child] = self.values[parent].clone()

    def cow(self, pairs):
        if pairs:
            mapping = self.bm.block_mapping_tensor(pairs, self.device)
            paged_ops.copy_blocks([self.kc], [self.vc], mapping)

    def swap_out(self, seq):
        mapping = self.bm.swap_out(seq)
        if mapping:
            m = self.bm.block_mapping_tensor(mapping)  # swap_blocks takes a CPU mapping
            paged_ops.swap_blocks(self.kc, self.ckc, m)
            paged_ops.swap_blocks(self.vc, self.cvc, m)
        return mapping

    def swap_in(self, seq):
        mapping = self.bm.swap_in(seq)
        if mapping:
            m = self.bm.block_mapping_tensor(mapping)
            paged_ops.swap_blocks(self.ckc, self.kc, m)
            paged_ops.swap_blocks(self.cvc, self.vc, m)
        return mapping

    def check(self, seqs):
        """Paged attention of a batch == dense attention of each sequence over its own K/V."""
        q = self.randn(len(seqs), self.heads, self.head_size)
        tables = self.bm.block_tables_tensor(seqs, self.device)
        lens = self.bm.seq_lens_tensor(seqs, self.device)
        out = paged_ops.paged_attention(q.to(self.device), self.kc, self.vc, tables, lens)
        scale = self.head_size**-0.5
        for i, s in enumerate(seqs):
            assert self.keys[s].shape[0] == self.bm.seq_len(s)
            ref = dense_attention(q[i], self.keys[s], self.values[s], scale)
            torch.testing.assert_close(out[i].float().cpu(), ref, **TOL[self.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fork_cow_branches_match_dense(device, dtype):
    h = Harness(num_blocks=12, block_size=16, dtype=dtype, device=device)
    h.bm.allocate("dummy", 16)  # so A's blocks are not simply 0, 1, 2
    assert h.bm.allocate("A", 35) == 0
    h.write("A", 0, 35)
    h.check(["A"])
    h.fork("A", "B")
    h.check(["A", "B"])

    # One new token per branch: A copies the shared tail on write, B then owns the original.
    cow_a = h.bm.append_slots("A")
    assert cow_a == [(h.bm.block_table("B")[2], h.bm.block_table("A")[2])]
    h.cow(cow_a)
    h.write("A", 35, 36)
    cow_b = h.bm.append_slots("B")
    assert cow_b == []
    h.write("B", 35, 36)
    assert not torch.equal(h.keys["A"][35], h.keys["B"][35])  # the branches really diverge
    h.check(["A", "B"])
    h.check(["B"])

    # A few decode steps for three branches with the batched helpers, as an engine does.
    h.fork("B", "C")
    for _ in range(20):
        seqs = ["A", "B", "C"]
        starts = {s: h.bm.seq_len(s) for s in seqs}
        h.cow(h.bm.append_slots_batch(seqs))
        k = h.randn(len(seqs), h.kv_heads, h.head_size)
        v = h.randn(len(seqs), h.kv_heads, h.head_size)
        slots = h.bm.slot_mapping_tensor(seqs, device=h.device, pad_to=len(seqs) + 2)
        kp = torch.cat([k, h.randn(2, h.kv_heads, h.head_size)])  # padding rows are skipped
        vp = torch.cat([v, h.randn(2, h.kv_heads, h.head_size)])
        paged_ops.reshape_and_cache(kp.to(h.device), vp.to(h.device), h.kc, h.vc, slots)
        for i, s in enumerate(seqs):
            assert h.keys[s].shape[0] == starts[s]
            h.keys[s] = torch.cat([h.keys[s], k[i : i + 1]])
            h.values[s] = torch.cat([h.values[s], v[i : i + 1]])
        h.check(seqs)
    st = h.bm.stats()
    assert st.shared_blocks == 2  # A, B, C still share the two full prompt blocks
    h.bm.free("A")
    h.check(["B", "C"])


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_hit_reads_cached_kv(device):
    dtype = torch.float32
    h = Harness(num_blocks=10, block_size=8, dtype=dtype, device=device, caching=True)
    prompt = list(range(1000, 1029))  # 29 tokens: 3 full blocks + 5
    assert h.bm.allocate("A", 29, prompt) == 0
    h.write("A", 0, 29)
    kA, vA = h.keys["A"], h.values["A"]

    # Same prompt while A is alive: 3 blocks shared, only the last 5 positions computed. A
    # deterministic model computes the same K/V for them, so we write A's values again.
    cached = h.bm.allocate("B", 29, prompt)
    assert cached == 24
    assert h.bm.block_table("B")[:3] == h.bm.block_table("A")[:3]
    h.keys["B"], h.values["B"] = kA[:cached].clone(), vA[:cached].clone()
    h.write("B", cached, 29, kA[cached:], vA[cached:])
    h.check(["A", "B"])

    # After both finish the blocks stay cached; a new request with a longer prompt that
    # starts the same way reuses them (ref 0 -> 1) and computes only its own tail.
    h.bm.free("A")
    h.bm.free("B")
    longer = prompt[:16] + [7] * 20
    cached = h.bm.allocate("C", 36, longer)
    assert cached == 16
    kC = torch.cat([kA[:16], h.randn(20, h.kv_heads, h.head_size)])
    vC = torch.cat([vA[:16], h.randn(20, h.kv_heads, h.head_size)])
    h.keys["C"], h.values["C"] = kC[:16].clone(), vC[:16].clone()
    h.write("C", 16, 36, kC[16:], vC[16:])
    h.check(["C"])
    # Decode steps with token ids register C's newly filled blocks too.
    for t in range(4):
        h.cow(h.bm.append_slots("C", 1, [500 + t]))
        n = h.bm.seq_len("C")
        h.write("C", n - 1, n)
    h.check(["C"])
    d_prompt = longer + [500, 501, 502, 503] + [9]
    assert h.bm.allocate("D", len(d_prompt), d_prompt) == 40
    h.keys["D"], h.values["D"] = h.keys["C"].clone(), h.values["C"].clone()
    h.write("D", 40, 41)
    h.check(["C", "D"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=dtype_id)
def test_swap_round_trip_preserves_attention(device, dtype):
    h = Harness(num_blocks=8, block_size=8, dtype=dtype, device=device, num_cpu_blocks=8)
    h.bm.allocate("A", 20)
    h.write("A", 0, 20)
    h.fork("A", "B")
    h.cow(h.bm.append_slots("B", 3))
    h.write("B", 20, 23)

    out_a = h.swap_out("A")
    assert len(out_a) == 3  # B still holds blocks 0, 1: they are copied for A
    out_b = h.swap_out("B")
    assert len(out_b) == 1  # only B's private tail: the shared blocks already have copies
    assert h.bm.num_free_blocks == 8

    # Someone else overwrites the whole GPU pool meanwhile.
    h.bm.allocate("junk", 64)
    h.write("junk", 0, 64)
    h.bm.free("junk")

    # B comes back first and copies its three blocks; A then shares B's copies of the two
    # common blocks and only its own tail moves.
    assert h.swap_in("B") == [(0, 0), (1, 1), (3, 2)]
    h.check(["B"])
    assert h.swap_in("A") == [(2, 3)]
    h.check(["A", "B"])
    assert h.bm.block_table("A")[:2] == h.bm.block_table("B")[:2]  # sharing restored

    # They keep decoding correctly: A's tail is private after the swap-in; B's too.
    for s in ("A", "B"):
        h.cow(h.bm.append_slots(s))
        n = h.bm.seq_len(s)
        h.write(s, n - 1, n)
    h.check(["A", "B"])
