"""torch.library.opcheck for every op, and torch.compile(fullgraph=True, dynamic=True) of a
model step that writes the cache and attends, with no graph break and eager-equal results."""

import pytest
import torch

import paged_ops
from tests.helpers import make_paged, random_query


def attention_sample(dtype=torch.float32, **kw):
    pg = make_paged([1, 17, 40], 2, 64, 16, dtype)
    q = random_query(3, 8, 64, dtype)
    return pg, (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention(dtype):
    pg, args = attention_sample(dtype)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention.default, args,
                          dict(alibi_slopes=torch.rand(8), sliding_window=20,
                               logits_soft_cap=4.0, max_seq_len=40))


def test_opcheck_attention_out():
    pg, args = attention_sample()
    out = torch.empty_like(args[0])
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out,) + args)


def test_opcheck_reshape_and_cache():
    kc, vc = paged_ops.allocate_kv_cache(4, 2, 64, 16, torch.float32)
    kc.zero_()
    vc.zero_()
    args = (torch.randn(5, 2, 64), torch.randn(5, 2, 64), kc, vc,
            torch.tensor([3, 17, -1, 40, 63]))
    torch.library.opcheck(torch.ops.paged.reshape_and_cache.default, args)


def test_opcheck_copy_blocks():
    caches = [paged_ops.allocate_kv_cache(6, 2, 32, 8, torch.float32) for _ in range(2)]
    kcs = [k.normal_() for k, _ in caches]
    vcs = [v.normal_() for _, v in caches]
    torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                          (kcs, vcs, torch.tensor([[0, 3], [1, 5]])))


def test_opcheck_swap_blocks():
    src = torch.randn(6, 2, 8, 16)
    dst = torch.zeros(3, 2, 8, 16)
    torch.library.opcheck(torch.ops.paged.swap_blocks.default,
                          (src, dst, torch.tensor([[5, 0], [2, 2]])))


def step(q, k, v, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
    # A decode step of one attention layer: project (here: identity), cache, attend.
    torch.ops.paged.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    out = torch.ops.paged.attention(q * 1.0, key_cache, value_cache, block_tables, seq_lens,
                                    q.shape[-1] ** -0.5)
    return out.sum(dim=1) + 1.0


def step_inputs(num_seqs, seed):
    lens = [3 + 9 * i for i in range(num_seqs)]
    pg = make_paged(lens, 2, 64, 16, torch.float32, seed=seed, extra_blocks=num_seqs)
    # The step appends one token at position L (lens + 1 visible), within the allocated blocks
    # or in a fresh spare block.
    bt = pg.block_tables.clone()
    slots = []
    used = set(bt[bt >= 0].tolist()) & set(range(pg.key_cache.shape[0]))
    free = [b for b in range(pg.key_cache.shape[0]) if b not in used]
    for s, L in enumerate(lens):
        if L % 16 == 0:
            bt[s, L // 16] = free.pop()
        slots.append(int(bt[s, L // 16]) * 16 + L % 16)
    q = random_query(num_seqs, 8, 64, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_seqs, 2, 64, generator=g)
    v = torch.randn(num_seqs, 2, 64, generator=g)
    return (q, k, v, pg.key_cache, pg.value_cache, torch.tensor(slots), bt,
            pg.seq_lens + 1)


def test_compile_fullgraph_dynamic_no_graph_break_matches_eager():
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*step_inputs(3, 0))
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n, seed in ((3, 1), (5, 2), (2, 3)):  # several batch sizes: one dynamic graph
        eager_in = step_inputs(n, seed)
        comp_in = step_inputs(n, seed)
        want = step(*eager_in)
        got = compiled(*comp_in)
        torch.testing.assert_close(got, want)
        for a, b in zip(comp_in[3:5], eager_in[3:5]):  # the cache mutations happened
            torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


def test_compile_wrapper_api():
    torch._dynamo.reset()

    def f(q, kc, vc, bt, sl):
        return paged_ops.paged_attention(q, kc, vc, bt, sl)

    pg, args = attention_sample()
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(*args[:5]), f(*args[:5]))
