"""torch.library.opcheck for every op, and torch.compile(fullgraph=True, dynamic=True) of a
model step that writes the cache and attends, with no graph break and eager-equal results; on
each device (the device fixture)."""

import pytest
import torch

import paged_ops
from tests.helpers import CUDA, decode_step_inputs, make_paged, random_query


def attention_sample(dtype=torch.float32, device="cpu"):
    pg = make_paged([1, 17, 40], 2, 64, 16, dtype, device=device)
    q = random_query(3, 8, 64, dtype, device=device)
    return pg, (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention(dtype, device):
    pg, args = attention_sample(dtype, device)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention.default, args,
                          dict(alibi_slopes=torch.rand(8, device=device), sliding_window=20,
                               logits_soft_cap=4.0, max_seq_len=40))


def test_opcheck_attention_out(device):
    pg, args = attention_sample(device=device)
    out = torch.empty_like(args[0])
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out,) + args)


def test_opcheck_reshape_and_cache(device):
    kc, vc = paged_ops.allocate_kv_cache(4, 2, 64, 16, torch.float32, device=device)
    kc.zero_()
    vc.zero_()
    args = (torch.randn(5, 2, 64, device=device), torch.randn(5, 2, 64, device=device), kc, vc,
            torch.tensor([3, 17, -1, 40, 63], device=device))
    torch.library.opcheck(torch.ops.paged.reshape_and_cache.default, args)


def test_opcheck_copy_blocks(device):
    caches = [paged_ops.allocate_kv_cache(6, 2, 32, 8, torch.float32, device=device)
              for _ in range(2)]
    kcs = [k.normal_() for k, _ in caches]
    vcs = [v.normal_() for _, v in caches]
    for mapping_device in dict.fromkeys(["cpu", device]):  # host ids, and ids on the GPU
        torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                              (kcs, vcs, torch.tensor([[0, 3], [1, 5]], device=mapping_device)))


@pytest.mark.parametrize("src_device,dst_device", [
    ("cpu", "cpu"),
    pytest.param("cuda", "cuda", marks=CUDA),
    pytest.param("cuda", "cpu", marks=CUDA),
    pytest.param("cpu", "cuda", marks=CUDA),
])
def test_opcheck_swap_blocks(src_device, dst_device):
    src = torch.randn(6, 2, 8, 16, device=src_device)
    dst = torch.zeros(3, 2, 8, 16, device=dst_device)
    torch.library.opcheck(torch.ops.paged.swap_blocks.default,
                          (src, dst, torch.tensor([[5, 0], [2, 2]])))


def step(q, k, v, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
    # A decode step of one attention layer: project (here: identity), cache, attend.
    torch.ops.paged.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    out = torch.ops.paged.attention(q * 1.0, key_cache, value_cache, block_tables, seq_lens,
                                    q.shape[-1] ** -0.5)
    return out.sum(dim=1) + 1.0


def test_compile_fullgraph_dynamic_no_graph_break_matches_eager(device):
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*decode_step_inputs(3, 0, device=device))
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n, seed in ((3, 1), (5, 2), (2, 3)):  # several batch sizes: one dynamic graph
        eager_in = decode_step_inputs(n, seed, device=device)
        comp_in = decode_step_inputs(n, seed, device=device)
        want = step(*eager_in)
        got = compiled(*comp_in)
        torch.testing.assert_close(got, want)
        for a, b in zip(comp_in[3:5], eager_in[3:5]):  # the cache mutations happened
            torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


def test_compile_wrapper_api(device):
    torch._dynamo.reset()

    def f(q, kc, vc, bt, sl):
        return paged_ops.paged_attention(q, kc, vc, bt, sl)

    pg, args = attention_sample(device=device)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(*args[:5]), f(*args[:5]))
