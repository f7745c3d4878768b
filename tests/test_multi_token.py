"""paged::attention with several query tokens per sequence (query_start_loc), on the CPU and,
in the tests with a device parameter, on CUDA (both CUDA multi-token kernels: test_cuda.py).

Sequence s owns the query rows [qsl[s], qsl[s+1]): its last q_len positions. The row at
position P = seq_lens[s] - q_len + j sees positions p <= P (sliding window and ALiBi measured
from P). Checked against the reference, against decode, against dense causal SDPA (chunked
prefill end to end), under opcheck and torch.compile, and for bad query_start_loc.
"""

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    TOL,
    check_attention,
    make_paged,
    one_thread,
    per_device,
    query_start_loc,
    random_query,
    set_cache_at,
    synchronize,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("cpu_variant")  # conftest.py: every CPU kernel build


def run(pg, q, qsl, *, scale=None, out=None, **kw):
    """torch.ops.paged.attention (or attention_out) with the full positional schema."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, scale,
            kw.get("alibi_slopes"), kw.get("sliding_window", -1),
            kw.get("logits_soft_cap", 0.0), None, None, kw.get("max_seq_len"), qsl)
    if out is None:
        return torch.ops.paged.attention(*args)
    torch.ops.paged.attention_out(out, *args)
    return out


def check(pg, q, qsl, dtype=None, **kw):
    dtype = dtype or q.dtype
    out = run(pg, q, qsl, **kw)
    scale = kw.get("scale") or q.shape[-1] ** -0.5
    with one_thread():
        want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                             scale, kw.get("alibi_slopes"), kw.get("sliding_window", -1),
                             kw.get("logits_soft_cap", 0.0), query_start_loc=qsl)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert not out.isnan().any(), "NaN from unwritten slots (or future positions) leaked"
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    return out


def batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
          dtype=torch.float32, seed=0, qscale=2.0, device="cpu"):
    pg = make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=seed,
                    device=device)
    q = random_query(sum(q_lens), num_heads, head_size, dtype, seed=seed + 1, scale=qscale,
                     device=device)
    return pg, q, query_start_loc(q_lens, device=device)


# A batch mixing a decode token, a short and a long chunk, and a whole prompt (q_len == L).
MIXED_Q = [1, 7, 64, 45]
MIXED_L = [37, 50, 100, 45]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32, 64, 256])
def test_mixed_q_lens(dtype, block_size):
    pg, q, qsl = batch(MIXED_Q, MIXED_L, block_size=block_size, dtype=dtype, seed=block_size)
    check(pg, q, qsl)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
def test_gqa_mqa(heads):
    num_heads, num_kv_heads = heads
    pg, q, qsl = batch([3, 20], [17, 20], num_heads, num_kv_heads, seed=3)
    check(pg, q, qsl)


@pytest.mark.parametrize("head_size", [80, 128, 256])
def test_head_sizes(head_size):
    pg, q, qsl = batch([5, 17], [40, 17], head_size=head_size, dtype=torch.bfloat16, seed=4)
    check(pg, q, qsl)


def test_zero_query_tokens_for_a_sequence():
    # Sequences 0 and 2 have nothing to compute this step (q_len = 0), one with L = 0 too.
    pg, q, qsl = batch([0, 5, 0, 3, 0], [12, 20, 0, 3, 33], seed=5)
    out = check(pg, q, qsl)
    assert out.shape == (8, 8, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_query_rows_at_all(dtype, device):
    pg, q, qsl = batch([0, 0], [4, 9], dtype=dtype, seed=6, device=device)
    assert q.shape[0] == 0
    out = run(pg, q, qsl)
    assert out.shape == (0, 8, 64) and out.device == q.device
    # No sequences at all.
    pg.block_tables, pg.seq_lens = pg.block_tables[:0], pg.seq_lens[:0]
    out = run(pg, q, query_start_loc([], device=device))
    assert out.shape == (0, 8, 64) and out.device == q.device
    synchronize(device)  # nothing was launched that fails late


@pytest.mark.parametrize("device,dtype,lens,head_size", per_device(
    cpu=[(dt, (1, 16, 17, 40), 64) for dt in DTYPES],
    cuda=[(dt, (1, 17, 64, 333, 1000), 128) for dt in DTYPES]))
def test_q_len_one_equals_decode(device, dtype, lens, head_size):
    pg, q, qsl = batch([1] * len(lens), list(lens), head_size=head_size, dtype=dtype, seed=7,
                       device=device)
    # On the CPU both paths share the kernel's inner loops (fp32: all but equal); the CUDA
    # multi-token and decode kernels are different code.
    tight = (dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 and device == "cpu"
             else TOL[dtype])
    slopes = torch.rand(8, device=device)
    for kw in ({}, dict(sliding_window=5), dict(sliding_window=40), dict(alibi_slopes=slopes),
               dict(alibi_slopes=slopes, logits_soft_cap=3.0)):
        multi = check_attention(pg, q, dtype, query_start_loc=qsl, **kw)
        decode = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                           pg.seq_lens, **kw)
        synchronize(device)
        torch.testing.assert_close(multi.cpu().float(), decode.cpu().float(), **tight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 33])
def test_sliding_window(dtype, window):
    pg, q, qsl = batch([1, 7, 40], [9, 30, 70], dtype=dtype, seed=8)
    check(pg, q, qsl, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_softcap_window_together(dtype):
    pg, q, qsl = batch([4, 31, 1], [31, 31, 65], head_size=80, block_size=8, dtype=dtype,
                       seed=9, qscale=4.0)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(8)])
    check(pg, q, qsl, alibi_slopes=slopes)
    check(pg, q, qsl, logits_soft_cap=5.0)
    check(pg, q, qsl, alibi_slopes=slopes, logits_soft_cap=5.0, sliding_window=20)
    check(pg, q, qsl, scale=0.3, max_seq_len=65)


def test_causal_mask_by_hand():
    # One sequence, one head, a whole 3-token prompt with orthogonal one-hot values: row j must
    # average exactly values 0..j when all logits are equal (query zero).
    L, D = 3, 16
    pg = make_paged([L], 1, D, 16, torch.float32, seed=10)
    blk = int(pg.block_tables[0, 0])
    vals = torch.eye(D)[:L]  # value of position p: e_p
    pg.value_cache[blk, 0, :, :L] = vals.T
    pg.key_cache[blk].zero_()
    q = torch.zeros(L, 1, D)
    out = run(pg, q, query_start_loc([L]))
    for j in range(L):
        want = vals[: j + 1].mean(0)
        torch.testing.assert_close(out[j, 0], want)


def test_strided_query_and_attention_out():
    pg = make_paged([33, 16], 2, 64, 16, torch.float32, seed=11)
    qsl = query_start_loc([9, 16])
    qkv = torch.randn(25, 8 + 2 + 2, 64)
    q = qkv[:, :8]
    assert not q.is_contiguous()
    want = check(pg, q, qsl)
    big = torch.full((25, 16, 64), 7.0)
    out = big[:, ::2]
    res = run(pg, q, qsl, out=out)
    assert res is out
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert (big[:, 1::2] == 7.0).all(), "attention_out wrote outside its out view"
    via_api = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                        pg.seq_lens, query_start_loc=qsl)
    torch.testing.assert_close(via_api, want, atol=0, rtol=0)


def test_per_layer_view_of_a_pool():
    pg = make_paged([20, 47], 2, 64, 16, torch.bfloat16, pool_layers=3, layer=2, seed=12)
    assert not pg.key_cache.is_contiguous()
    q = random_query(30, 4, 64, torch.bfloat16)
    check(pg, q, query_start_loc([10, 20]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query_out_and_pool_view(dtype, device):
    q_lens, lens = [4, 19, 1], [10, 60, 129]
    H, Hkv, D = 8, 2, 96
    pg = make_paged(lens, Hkv, D, 16, dtype, device=device, seed=8, pool_layers=3, layer=1)
    n = sum(q_lens)
    qkv = random_query(n, H + 2 * Hkv, D, dtype, device=device, scale=2.0)
    qsl = query_start_loc(q_lens, device=device)
    buf = torch.full((n, H, 2, D), 123.0, dtype=dtype, device=device)
    out = buf[:, :, 1]
    got = check_attention(pg, qkv[:, :H], dtype, query_start_loc=qsl, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (buf[:, :, 0] == 123.0).all(), "attention_out wrote outside out"
    # A strided query_start_loc (a view) is read with its stride.
    wide = torch.zeros(2 * len(qsl), dtype=torch.int32, device=device)
    wide[::2] = qsl
    check_attention(pg, qkv[:, :H], dtype, query_start_loc=wide[::2])


def test_deterministic_and_inputs_unchanged():
    pg, q, qsl = batch([3, 12], [50, 12], dtype=torch.bfloat16, seed=13)
    kc, vc, q0, qsl0 = pg.key_cache.clone(), pg.value_cache.clone(), q.clone(), qsl.clone()
    a = run(pg, q, qsl)
    b = run(pg, q, qsl)
    assert torch.equal(a, b)
    torch.testing.assert_close(pg.key_cache, kc, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(pg.value_cache, vc, equal_nan=True, atol=0, rtol=0)
    assert torch.equal(q, q0) and torch.equal(qsl, qsl0)


# ---- end to end: chunked prefill over the paged cache == dense causal SDPA ------------------


@pytest.mark.parametrize("chunks", [(16, 7), (5, 5, 13), (23,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_equals_dense_causal_sdpa(chunks, dtype):
    g = torch.Generator().manual_seed(sum(chunks))
    H, Hkv, D, bs = 8, 2, 64, 8
    T = sum(chunks)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    nb = 10
    kc, vc = paged_ops.allocate_kv_cache(nb, Hkv, D, bs, dtype)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    blocks = torch.randperm(nb, generator=g)[: (T + bs - 1) // bs]
    bt = torch.full((1, nb), 2**30, dtype=torch.int32)
    bt[0, : blocks.numel()] = blocks.int()
    outs, start = [], 0
    for c in chunks:
        pos = torch.arange(start, start + c)
        slots = blocks[pos // bs] * bs + pos % bs
        paged_ops.reshape_and_cache(k[start:start + c], v[start:start + c], kc, vc, slots)
        sl = torch.tensor([start + c], dtype=torch.int32)
        outs.append(paged_ops.paged_attention(q[start:start + c], kc, vc, bt, sl,
                                              query_start_loc=query_start_loc([c])))
        start += c
    got = torch.cat(outs)
    G = H // Hkv
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(G, 1).transpose(0, 1),
        v.float().repeat_interleave(G, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_two_sequences_chunked_together_equal_separate_sdpa():
    # One batched call: sequence 0 decodes its 30th token while sequence 1 prefills 12 tokens
    # after a 9-token prefix (a prefix-cache hit); both against dense causal SDPA.
    g = torch.Generator().manual_seed(21)
    H, Hkv, D, bs = 4, 4, 32, 16
    lens, qlens = [30, 21], [1, 12]
    pg = make_paged(lens, Hkv, D, bs, torch.float32, seed=21)
    q = torch.randn(sum(qlens), H, D, generator=g)
    out = run(pg, q, query_start_loc(qlens))
    row = 0
    for s, (L, n) in enumerate(zip(lens, qlens)):
        k, v = pg.keys[s].transpose(0, 1), pg.values[s].transpose(0, 1)
        qs = q[row:row + n].transpose(0, 1)
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        torch.testing.assert_close(out[row:row + n], want.transpose(0, 1), atol=2e-5,
                                   rtol=1e-4)
        row += n


# ---- opcheck and torch.compile ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention_with_query_start_loc(dtype, device):
    pg, q, qsl = batch([1, 6, 17], [1, 20, 40], dtype=dtype, seed=14, device=device)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)
    torch.library.opcheck(torch.ops.paged.attention.default, args,
                          dict(query_start_loc=qsl))
    torch.library.opcheck(torch.ops.paged.attention.default, args,
                          dict(alibi_slopes=torch.rand(8, device=device), sliding_window=9,
                               logits_soft_cap=4.0, max_seq_len=40, query_start_loc=qsl))
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out,) + args,
                          dict(query_start_loc=qsl))


def prefill_step(q, k, v, key_cache, value_cache, slot_mapping, block_tables, seq_lens, qsl):
    # A chunked-prefill step of one attention layer: cache the chunk's K/V, attend causally.
    torch.ops.paged.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    out = torch.ops.paged.attention(q * 1.0, key_cache, value_cache, block_tables, seq_lens,
                                    q.shape[-1] ** -0.5, None, -1, 0.0, None, None, None, qsl)
    return out.sum(dim=1) + 1.0


def prefill_inputs(prefix_lens, chunk_lens, seed):
    """Sequences with `prefix_lens` cached tokens each get a chunk of `chunk_lens` new ones."""
    bs, Hkv, H, D = 16, 2, 8, 64
    totals = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    pg = make_paged(totals, Hkv, D, bs, torch.float32, seed=seed, extra_blocks=2)
    # make_paged wrote all positions; the step rewrites the chunk's positions (new values).
    g = torch.Generator().manual_seed(seed)
    slots = []
    for s, (p, c) in enumerate(zip(prefix_lens, chunk_lens)):
        for pos in range(p, p + c):
            slots.append(int(pg.block_tables[s, pos // bs]) * bs + pos % bs)
    n = sum(chunk_lens)
    k = torch.randn(n, Hkv, D, generator=g)
    v = torch.randn(n, Hkv, D, generator=g)
    q = torch.randn(n, H, D, generator=g)
    return (q, k, v, pg.key_cache, pg.value_cache, torch.tensor(slots, dtype=torch.int64),
            pg.block_tables, pg.seq_lens, query_start_loc(chunk_lens))


def test_compile_chunked_prefill_fullgraph_dynamic():
    torch._dynamo.reset()
    explain = torch._dynamo.explain(prefill_step)(*prefill_inputs([3, 0], [5, 16], 0))
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(prefill_step, fullgraph=True, dynamic=True)
    for prefix, chunk, seed in (([3, 0], [5, 16], 1), ([20, 7, 0], [1, 9, 30], 2),
                                ([0], [4], 3)):
        eager_in = prefill_inputs(prefix, chunk, seed)
        comp_in = prefill_inputs(prefix, chunk, seed)
        want = prefill_step(*eager_in)
        got = compiled(*comp_in)
        torch.testing.assert_close(got, want)
        for a, b in zip(comp_in[3:5], eager_in[3:5]):  # the cache writes happened
            torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


# ---- bad query_start_loc ------------------------------------------------------------------------


BAD_QSL = {
    # name: (query_start_loc, seq_lens) for 5 query rows over two sequences
    "int64": ([0, 2, 5], torch.int64, [10, 5]),
    "2-d": ([[0, 2, 5]], torch.int32, [10, 5]),
    "empty": ([], torch.int32, [10, 5]),
    "too long (3 sequences)": ([0, 2, 5, 5], torch.int32, [10, 5]),
    "too short (1 sequence)": ([0, 5], torch.int32, [10, 5]),
    "not starting at 0": ([1, 3, 5], torch.int32, [10, 5]),
    "decreasing": ([0, 4, 3], torch.int32, [10, 5]),
    "last != query rows": ([0, 2, 4], torch.int32, [10, 5]),
    "q_len > seq_len": ([0, 1, 5], torch.int32, [10, 3]),
    "no sequence but query rows": ([0], torch.int32, [10, 5]),
}


def test_rejects_query_rows_without_a_sequence(device):
    # Checked from the shapes alone (values of query_start_loc on a device are not read).
    pg = make_paged([5], 2, 64, 16, torch.float16, device=device)
    q = random_query(3, 4, 64, torch.float16, device=device)
    out = torch.full_like(q, 3.0)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables[:0],
                                  pg.seq_lens[:0], query_start_loc=query_start_loc(
                                      [], device=device), out=out)
    assert (out == 3.0).all()


@pytest.mark.parametrize("case", list(BAD_QSL))
def test_bad_query_start_loc(case):
    values, dtype, lens = BAD_QSL[case]
    pg, q, _ = batch([2, 3], [10, 5], seed=15)
    pg.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    qsl = torch.tensor(values, dtype=dtype)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        run(pg, q, qsl)
    out = torch.full_like(q, 3.0)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        run(pg, q, qsl, out=out)
    assert (out == 3.0).all(), "a failed attention_out wrote its output"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("window", [-1, 20])
def test_non_finite_value_reaches_only_the_rows_that_see_it(dtype, block_size, special, window):
    # A chunk of 9 query tokens over one sequence: a NaN or an infinity stored in the value at
    # the chunk's 4th position (element 11), and with the window one that only the first 5
    # rows' windows reach (element 12), reaches the rows that see it as softmax(z) @ V does
    # and no other row: the others give it probability 0, and 0 * NaN must not count.
    bs, q_len, L = block_size, 9, 3 * block_size + 5
    pg = make_paged([L], 2, 64, bs, dtype, seed=bs)
    spots = [(L - q_len + 3, 11)] + ([(L - 24, 12)] if window > 0 else [])
    for pos, d in spots:
        set_cache_at(pg, "value", 0, pos, 1, d, special)
    q = random_query(q_len, 8, 64, dtype, scale=2.0)
    qsl = query_start_loc([q_len])
    got = run(pg, q, qsl, sliding_window=window).float()
    with one_thread():
        want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                             64 ** -0.5, sliding_window=window, query_start_loc=qsl).float()
    for _pos, d in spots:  # per query token: whether its kv head 1 rows see the spot
        seen = want[:, 4:8, d].isfinite().logical_not().all(-1).tolist()
        assert seen == ([False] * 3 + [True] * 6 if d == 11 else [True] * 5 + [False] * 4)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_nan_key_reaches_only_the_rows_that_see_it(dtype, block_size):
    # A NaN key element at the chunk's 4th position makes every logit, probability and output
    # of the rows that see it NaN, as softmax over it does; the 3 rows before it must stay
    # finite, however the kernel lays the rows' probabilities side by side (dense rows at
    # block sizes that divide the vector width: a row's last block borders the next row).
    bs, q_len, L = block_size, 9, 3 * block_size + 40
    pg = make_paged([L], 2, 64, bs, dtype, seed=bs + 7)
    set_cache_at(pg, "key", 0, L - q_len + 3, 1, 5, float("nan"))
    q = random_query(q_len, 8, 64, dtype, scale=2.0)
    qsl = query_start_loc([q_len])
    got = run(pg, q, qsl).float()
    with one_thread():
        want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                             64 ** -0.5, query_start_loc=qsl).float()
    nan_rows = want[:, 4:8].isnan().all(-1).all(-1).tolist()  # kv head 1's query heads
    assert nan_rows == [False] * 3 + [True] * 6
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], **TOL[dtype])
