"""CUDA tests of attention_with_lse, causal=False and merge_attention_states: every CUDA
attention kernel (decode with and without split-K, the tensor-core and CUDA-core multi-token
kernels and their split-K) and the merge kernel, against paged_ops.reference on identical
inputs (never against the CPU kernels); splits of a sequence's blocks attended separately and
merged against one call over all of them; a shared prefix attended once for a group of
branches (causal=False) merged with each branch's own blocks; CUDA-graph capture. Skipped
cleanly without a GPU or without the CUDA kernels compiled in."""

from __future__ import annotations

import random

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    CUDA,
    CUDA_HEAD_SIZES,
    TOL,
    assert_same,
    make_paged,
    one_thread,
    random_query,
)
from tests.test_cuda import FP8, MIXED_L, MIXED_Q, fp8_paged, qsl_of, skip_same_kernel

pytestmark = CUDA

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# lse is fp32 from fp32 logits in every kernel: only the order of the sums and __expf differ.
LSE_TOL = dict(atol=1e-4, rtol=1e-4)
JUNK = (2**30, -7)  # unused block-table entries, never read


@pytest.fixture(params=["tensor_cores", "cuda_cores"])
def multi_kernel(request, monkeypatch):
    """Both CUDA multi-token kernels: tensor cores (fp16 / bf16 queries, head sizes multiple of
    16; the default) and CUDA cores (forced by the variable)."""
    if request.param == "cuda_cores":
        monkeypatch.setenv("PAGED_OPS_CUDA_MULTI_TOKEN_SIMT", "1")
    else:
        monkeypatch.delenv("PAGED_OPS_CUDA_MULTI_TOKEN_SIMT", raising=False)
    return request.param


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def ref_with_lse(q, key_cache, value_cache, block_tables, seq_lens, scale, **kw):
    with one_thread():
        return ref.attention_with_lse(
            q.cpu(), key_cache.cpu(), value_cache.cpu(), block_tables.cpu(), seq_lens.cpu(),
            scale, _cpu(kw.get("alibi_slopes")), kw.get("sliding_window", -1),
            kw.get("logits_soft_cap", 0.0), k_scale=_cpu(kw.get("k_scale")),
            v_scale=_cpu(kw.get("v_scale")), query_start_loc=_cpu(kw.get("query_start_loc")),
            causal=kw.get("causal", True))


def with_lse(q, kc, vc, bt, sl, scale, **kw):
    out, lse = paged_ops.paged_attention_with_lse(q, kc, vc, bt, sl, scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and out.device == q.device
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2] and lse.is_contiguous()
    assert lse.device == q.device
    return out, lse


def check_lse(pg, q, tol=None, **kw):
    """attention_with_lse on CUDA vs the reference (out within the dtype's tolerance, lse within
    LSE_TOL, -inf exactly where the reference has it), and its out bitwise equal to that of
    attention with the same arguments (writing lse changes nothing else)."""
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, scale)
    out, lse = with_lse(*args, **kw)
    plain = paged_ops.paged_attention(*args, **kw)
    torch.cuda.synchronize()
    assert_same(out, plain)
    want_out, want_lse = ref_with_lse(*args, **kw)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), **(tol or TOL[q.dtype]))
    torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOL)
    return out, lse


def paged(lens, num_kv_heads, head_size, block_size, cache_dtype, seed=0):
    """Caches holding `lens` (fp8: quantised, with their scales in the returned kwargs)."""
    if cache_dtype in FP8:
        pg = fp8_paged(lens, num_kv_heads, head_size, block_size, cache_dtype, seed=seed)
        return pg, dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    return make_paged(lens, num_kv_heads, head_size, block_size, cache_dtype, device=DEV,
                      seed=seed), {}


# ------------------------------------------------------------------------------------------
# lse of the decode kernel (and causal, which decode ignores)
# ------------------------------------------------------------------------------------------

# No split-K (a table of 8 blocks of 16: one partition) and split-K (many partitions, some of
# them past the short sequences' ends or before the window). Length 0: lse -inf, out zeros.
DECODE_LENS = {"one_partition": [5, 0, 40, 90], "split_k": [9000, 3, 0, 700]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", list(DECODE_LENS), ids=list(DECODE_LENS))
def test_decode_lse(dtype, lens):
    lens = DECODE_LENS[lens]
    pg = make_paged(lens, 2, 128, 16, dtype, device=DEV, seed=len(lens))
    q = random_query(len(lens), 8, 128, dtype, device=DEV, scale=2.0)
    _, lse = check_lse(pg, q)
    assert (lse[lens.index(0)] == float("-inf")).all()
    check_lse(pg, q, logits_soft_cap=5.0, alibi_slopes=torch.rand(8, device=DEV), scale=0.3)
    check_lse(pg, q, sliding_window=300)
    check_lse(pg, q, sliding_window=1, logits_soft_cap=3.0)
    out, lse = check_lse(pg, q, causal=False)  # decode: nothing changes
    out_c, lse_c = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                            128 ** -0.5)
    assert_same(out, out_c)
    assert_same(lse, lse_c)


@pytest.mark.parametrize("heads,head_size,block_size", [((4, 4), 64, 16), ((8, 1), 128, 8),
                                                        ((16, 2), 256, 32), ((12, 4), 96, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_lse_gqa_group_tiles(dtype, heads, head_size, block_size):
    # fp32 / head 256 / block 32: one head per group tile, several tiles per kv head.
    num_heads, num_kv_heads = heads
    lens = [33, 1, 300]
    pg = make_paged(lens, num_kv_heads, head_size, block_size, dtype, device=DEV, seed=num_heads)
    q = random_query(len(lens), num_heads, head_size, dtype, device=DEV, scale=2.0)
    check_lse(pg, q)
    check_lse(pg, q, logits_soft_cap=4.0, alibi_slopes=torch.rand(num_heads, device=DEV))


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("q_dtype", DTYPES)
def test_decode_lse_fp8(cache_dtype, q_dtype):
    # k_scale is folded into the logit scale: lse is still that of the real logits.
    for lens in DECODE_LENS.values():
        pg = fp8_paged(lens, 2, 64, 16, cache_dtype, seed=len(lens))
        q = random_query(len(lens), 8, 64, q_dtype, device=DEV, scale=2.0)
        kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
        check_lse(pg, q, **kw)
        check_lse(pg, q, alibi_slopes=torch.rand(8, device=DEV), sliding_window=45,
                  logits_soft_cap=6.0, **kw)


# ------------------------------------------------------------------------------------------
# lse and causal=False in the multi-token kernels
# ------------------------------------------------------------------------------------------


def multi_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    pg = make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, device=DEV, seed=seed)
    q = random_query(sum(q_lens), num_heads, head_size, dtype, device=DEV, seed=seed + 1,
                     scale=2.0)
    return pg, q, qsl_of(q_lens)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_lse_mixed_batch(dtype, causal, multi_kernel):
    skip_same_kernel(multi_kernel, dtype)
    pg, q, qsl = multi_batch(MIXED_Q, MIXED_L, 8, 2, 128, 16, dtype, seed=3)
    kw = dict(query_start_loc=qsl, causal=causal)
    _, lse = check_lse(pg, q, **kw)
    assert torch.isfinite(lse).all()  # every row sees at least one position
    slopes = torch.rand(8, device=DEV) * 0.5
    check_lse(pg, q, alibi_slopes=slopes, **kw)
    check_lse(pg, q, sliding_window=37, **kw)
    check_lse(pg, q, sliding_window=1, **kw)
    check_lse(pg, q, alibi_slopes=slopes, sliding_window=50, logits_soft_cap=8.0, scale=0.3,
              **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_non_causal_rows_past_the_length(dtype, multi_kernel):
    # causal=False: every row sits at L - 1, however many rows there are (more than L here), and
    # a sequence of length 0 gives rows that see nothing (zeros, lse -inf).
    skip_same_kernel(multi_kernel, dtype)
    q_lens, seq_lens = [20, 3, 5, 70], [9, 0, 64, 1]
    pg, q, qsl = multi_batch(q_lens, seq_lens, 8, 2, 64, 16, dtype, seed=8)
    out, lse = check_lse(pg, q, query_start_loc=qsl, causal=False)
    assert (out[20:23] == 0).all() and (lse[20:23] == float("-inf")).all()
    check_lse(pg, q, query_start_loc=qsl, causal=False, sliding_window=5,
              alibi_slopes=torch.rand(8, device=DEV))
    # attention_out takes causal too.
    buf = torch.full_like(q, float("nan"))
    got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, query_start_loc=qsl, causal=False, out=buf)
    torch.cuda.synchronize()
    assert got is buf
    assert_same(buf, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES)
def test_multi_token_lse_head_sizes(dtype, head_size, multi_kernel):
    skip_same_kernel(multi_kernel, dtype, head_size)
    pg, q, qsl = multi_batch([3, 40, 1], [20, 40, 9], 4, 2, head_size, 16, dtype, seed=head_size)
    check_lse(pg, q, query_start_loc=qsl)
    check_lse(pg, q, query_start_loc=qsl, causal=False, logits_soft_cap=5.0)


@pytest.mark.parametrize("heads,head_size", [((64, 8), 128), ((32, 1), 128), ((40, 1), 256),
                                             ((96, 1), 64), ((6, 2), 192)])
def test_multi_token_lse_gqa(heads, head_size, multi_kernel):
    # Group sizes 8, 32, 40 (two group tiles on CUDA cores at head size 256), 96 (two tiles), 3.
    num_heads, num_kv_heads = heads
    pg, q, qsl = multi_batch([5, 1, 33], [70, 16, 33], num_heads, num_kv_heads, head_size, 16,
                             torch.bfloat16, seed=num_heads)
    for causal in (True, False):
        check_lse(pg, q, query_start_loc=qsl, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_lse_split_k(dtype, multi_kernel):
    # Few query tiles over long contexts: partitions merged by the reduce kernel, which writes
    # lse; some partitions lie wholly before the window.
    skip_same_kernel(multi_kernel, dtype)
    pg, q, qsl = multi_batch([3, 1, 0, 2], [9000, 5000, 70, 0], 8, 2, 128, 16, dtype, seed=5)
    for causal in (True, False):
        _, lse = check_lse(pg, q, query_start_loc=qsl, causal=causal)
        if not causal:
            assert (lse[4:] == float("-inf")).all()  # length 0
        check_lse(pg, q, query_start_loc=qsl, causal=causal, sliding_window=700,
                  logits_soft_cap=5.0)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("q_dtype", DTYPES)
def test_multi_token_lse_fp8(cache_dtype, q_dtype, multi_kernel):
    skip_same_kernel(multi_kernel, q_dtype)
    pg = fp8_paged(MIXED_L + [6000], 2, 64, 16, cache_dtype, seed=4)
    q_lens = MIXED_Q + [2]
    q = random_query(sum(q_lens), 8, 64, q_dtype, device=DEV, scale=2.0)
    kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale, query_start_loc=qsl_of(q_lens))
    for causal in (True, False):
        check_lse(pg, q, causal=causal, **kw)
        check_lse(pg, q, causal=causal, alibi_slopes=torch.rand(8, device=DEV),
                  sliding_window=45, logits_soft_cap=6.0, **kw)


# ------------------------------------------------------------------------------------------
# Exactness: a sequence's blocks split in two, attended separately with lse and merged
# ------------------------------------------------------------------------------------------


def split_blocks(bt, lens, bs, rng):
    """Each sequence's blocks split at random in two sets (the partial last block, which must
    end its table, always in the second): (block_tables, seq_lens) of both parts, on DEV."""
    tables, part_lens = ([], []), ([], [])
    width = bt.shape[1]
    for s, L in enumerate(lens):
        n_full, rem = divmod(L, bs)
        ids = bt[s, :(L + bs - 1) // bs].tolist()
        parts = ([], [])
        for b in range(n_full):
            parts[rng.random() < 0.5].append(ids[b])
        if rem:
            parts[1].append(ids[n_full])
        part_lens[0].append(len(parts[0]) * bs)
        part_lens[1].append(L - len(parts[0]) * bs)
        for i in (0, 1):
            tables[i].append(parts[i] + [JUNK[j % 2] for j in range(width - len(parts[i]))])
    return [(torch.tensor(tables[i], dtype=torch.int32, device=DEV),
             torch.tensor(part_lens[i], dtype=torch.int32, device=DEV)) for i in (0, 1)]


def check_split_merge(pg, q, tol, splits=3, seed=0, **kw):
    """For a few random block splits: attention_with_lse over each part, merged, equals the
    reference over all of them (out within tol, lse within LSE_TOL). Without ALiBi or window:
    those depend on positions, which a part's own table renumbers."""
    scale = q.shape[-1] ** -0.5
    want_out, want_lse = ref_with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                      pg.seq_lens, scale, **kw)
    lens = pg.seq_lens.tolist()
    bs = pg.value_cache.shape[-1]
    rng = random.Random(seed)
    for _ in range(splits):
        (bt_a, sl_a), (bt_b, sl_b) = split_blocks(pg.block_tables.cpu(), lens, bs, rng)
        out_a, lse_a = with_lse(q, pg.key_cache, pg.value_cache, bt_a, sl_a, scale, **kw)
        out_b, lse_b = with_lse(q, pg.key_cache, pg.value_cache, bt_b, sl_b, scale, **kw)
        out, lse = paged_ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
        torch.cuda.synchronize()
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.cpu().float(), want_out.float(), **tol)
        torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOL)


# Every part is rounded to the query's dtype before the merge: one more rounding than a single
# call, within the dtype's tolerance.
@pytest.mark.parametrize("cache_dtype", DTYPES + FP8)
def test_split_merge_decode_exact(cache_dtype):
    q_dtype = torch.bfloat16 if cache_dtype in FP8 else cache_dtype
    lens = [0, 1, 16, 100, 2000, 9000]  # split-K in both parts for the long ones
    pg, scales = paged(lens, 2, 128, 16, cache_dtype, seed=21)
    q = random_query(len(lens), 8, 128, q_dtype, device=DEV, scale=2.0)
    check_split_merge(pg, q, TOL[q_dtype], **scales)
    check_split_merge(pg, q, TOL[q_dtype], seed=1, logits_soft_cap=5.0, **scales)


@pytest.mark.parametrize("cache_dtype", DTYPES + FP8)
def test_split_merge_multi_token_non_causal_exact(cache_dtype, multi_kernel):
    # causal=False rows see every position of both parts: the merge is exact for them.
    q_dtype = torch.bfloat16 if cache_dtype in FP8 else cache_dtype
    skip_same_kernel(multi_kernel, q_dtype)
    lens, q_lens = [40, 0, 333, 5000], [8, 3, 70, 2]
    pg, scales = paged(lens, 2, 64, 16, cache_dtype, seed=22)
    q = random_query(sum(q_lens), 16, 64, q_dtype, device=DEV, scale=2.0)
    kw = dict(query_start_loc=qsl_of(q_lens), causal=False, **scales)
    check_split_merge(pg, q, TOL[q_dtype], **kw)
    check_split_merge(pg, q, TOL[q_dtype], seed=2, logits_soft_cap=4.0, **kw)


# ------------------------------------------------------------------------------------------
# Cascade: a shared prefix attended once for a group of branches, then each branch's own blocks
# ------------------------------------------------------------------------------------------


def cascade_inputs(prefix_blocks, suffix_lens, num_heads, num_kv_heads, head_size, bs,
                   cache_dtype, q_dtype, seed=0):
    """One cache holding a prefix of `prefix_blocks` full blocks and one suffix per branch.
    Returns (pg, scales, q [n, H, D], prefix (bt [1, w], sl [1]), suffixes (bt [n, w], sl [n]),
    full (bt [n, w'], sl [n])): the full tables are the prefix's blocks then the branch's."""
    n = len(suffix_lens)
    pg, scales = paged([prefix_blocks * bs] + list(suffix_lens), num_kv_heads, head_size, bs,
                       cache_dtype, seed=seed)
    bt = pg.block_tables.cpu()
    prefix_ids = bt[0, :prefix_blocks].tolist()
    full_bt = torch.tensor([prefix_ids + bt[1 + i].tolist() for i in range(n)],
                           dtype=torch.int32, device=DEV)
    sl = pg.seq_lens.cpu()
    q = random_query(n, num_heads, head_size, q_dtype, device=DEV, seed=seed + 1, scale=2.0)
    return (pg, scales, q, (pg.block_tables[:1], pg.seq_lens[:1]),
            (pg.block_tables[1:], pg.seq_lens[1:]),
            (full_bt, (sl[1:] + prefix_blocks * bs).to(torch.int32).to(DEV)))


def cascade(q, pg, prefix, suffix, scale, qsl, **kw):
    """The prefix for all rows of q at once (one sequence, causal=False), each row's own blocks
    (decode), merged."""
    out_p, lse_p = paged_ops.paged_attention_with_lse(
        q, pg.key_cache, pg.value_cache, *prefix, scale, query_start_loc=qsl, causal=False, **kw)
    out_s, lse_s = paged_ops.paged_attention_with_lse(
        q, pg.key_cache, pg.value_cache, *suffix, scale, **kw)
    return paged_ops.merge_attention_states(out_p, lse_p, out_s, lse_s)


@pytest.mark.parametrize("cache_dtype", DTYPES + FP8)
def test_cascade_shared_prefix_equals_decode(cache_dtype, multi_kernel):
    # Six branches over a 5-block prefix, own blocks from none to several (one partial).
    q_dtype = torch.bfloat16 if cache_dtype in FP8 else cache_dtype
    skip_same_kernel(multi_kernel, q_dtype)
    pg, scales, q, prefix, suffix, full = cascade_inputs(
        5, [0, 1, 16, 17, 40, 100], 8, 2, 128, 16, cache_dtype, q_dtype, seed=23)
    scale = 128 ** -0.5
    qsl = qsl_of([q.shape[0]])
    for kw in ({}, {"logits_soft_cap": 5.0}):
        out, lse = cascade(q, pg, prefix, suffix, scale, qsl, **scales, **kw)
        torch.cuda.synchronize()
        want_out, want_lse = ref_with_lse(q, pg.key_cache, pg.value_cache, *full, scale,
                                          **scales, **kw)
        torch.testing.assert_close(out.cpu().float(), want_out.float(), **TOL[q_dtype])
        torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOL)


# ------------------------------------------------------------------------------------------
# merge_attention_states
# ------------------------------------------------------------------------------------------

NEG_INF = float("-inf")


def merge_inputs(N, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    oa = torch.randn(N, H, D, generator=g).to(dtype)
    ob = torch.randn(N, H, D, generator=g).to(dtype)
    la = torch.randn(N, H, generator=g) * 4
    lb = torch.randn(N, H, generator=g) * 4
    if N >= 5:
        la[0], oa[0] = NEG_INF, float("nan")  # side a empty: its NaN must not leak
        lb[1], ob[1] = NEG_INF, float("nan")
        la[2], lb[2] = NEG_INF, NEG_INF       # both empty: zeros and -inf
        oa[2], ob[2] = float("nan"), float("inf")
        la[3], lb[3] = 90.0, -90.0            # a weight that underflows to 0
        la[4], lb[4] = 1.5, 1.5
    return oa, la, ob, lb


def check_merge(oa, la, ob, lb):
    out, lse = paged_ops.merge_attention_states(oa, la, ob, lb)
    torch.cuda.synchronize()
    want_out, want_lse = ref.merge_attention_states(oa.cpu(), la.cpu(), ob.cpu(), lb.cpu())
    assert out.dtype == oa.dtype and out.shape == oa.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == la.shape and lse.is_contiguous()
    assert out.device == oa.device and lse.device == oa.device
    torch.testing.assert_close(out.cpu().float(), want_out.float(), equal_nan=True,
                               **TOL[oa.dtype])
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-6, rtol=1e-6, equal_nan=True)
    return out, lse


# 128: 16-byte chunks; 20: chunks for fp32 only; 3: element by element; 0: lse only.
@pytest.mark.parametrize("head_size", [128, 20, 3, 0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_matches_reference(dtype, head_size):
    oa, la, ob, lb = (t.to(DEV) for t in merge_inputs(37, 5, head_size, dtype, seed=head_size))
    out, lse = check_merge(oa, la, ob, lb)
    if head_size:
        assert torch.isfinite(out).all()
        # A side with lse -inf is dropped, the other taken with weight exactly 1.
        assert_same(out[0], ob[0])
        assert_same(out[1], oa[1])
        assert (out[2] == 0).all()
    assert (lse[2] == NEG_INF).all()
    assert_same(lse[0], lb[0])
    assert_same(lse[1], la[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_strided_and_misaligned_inputs(dtype):
    N, H, D = 19, 4, 64
    oa, la, ob, lb = merge_inputs(N, H, D, dtype, seed=7)
    # out_a: every other head of a wider tensor, tokens further apart; out_b: one element off
    # 16-byte alignment; lse_a transposed; lse_b a column of a wider tensor.
    wide = torch.zeros(N, 2 * H + 1, D, dtype=dtype, device=DEV)
    wide[:, 1::2] = oa.to(DEV)
    oa_v = wide[:, 1::2]
    flat = torch.zeros(N * H * D + 1, dtype=dtype, device=DEV)
    ob_v = flat[1:].view(N, H, D)
    ob_v.copy_(ob)
    la_v = la.t().contiguous().to(DEV).t()
    lb_wide = torch.zeros(N, H, 3, device=DEV)
    lb_wide[:, :, 2] = lb.to(DEV)
    lb_v = lb_wide[:, :, 2]
    assert not oa_v.is_contiguous() and not la_v.is_contiguous() and not lb_v.is_contiguous()
    out, lse = check_merge(oa_v, la_v, ob_v, lb_v)
    out_c, lse_c = check_merge(*(t.contiguous() for t in (oa_v, la_v, ob_v, lb_v)))
    assert_same(out, out_c)
    assert_same(lse, lse_c)


def test_merge_states_nan_lse_and_empty():
    oa, la, ob, lb = (t.to(DEV) for t in merge_inputs(6, 2, 16, torch.float32))
    la[5, 0] = float("nan")
    out, lse = check_merge(oa, la, ob, lb)  # NaN where the reference has NaN
    assert lse[5, 0].isnan() and out[5, 0].isnan().all()
    e = torch.empty(0, 3, 8, dtype=torch.bfloat16, device=DEV)
    el = torch.empty(0, 3, device=DEV)
    out, lse = paged_ops.merge_attention_states(e, el, e, el)
    assert out.shape == (0, 3, 8) and out.dtype == torch.bfloat16 and lse.shape == (0, 3)


def test_merge_states_rejections():
    oa, la, ob, lb = (t.to(DEV) for t in merge_inputs(6, 2, 16, torch.float16))
    with pytest.raises(RuntimeError, match="out_b must have the shape"):
        paged_ops.merge_attention_states(oa, la, ob[:, :1], lb)
    with pytest.raises(RuntimeError, match="out_b dtype"):
        paged_ops.merge_attention_states(oa, la, ob.float(), lb)
    with pytest.raises(RuntimeError, match="lse_b must be float32"):
        paged_ops.merge_attention_states(oa, la, ob, lb.half())
    with pytest.raises(RuntimeError, match="lse_a must have shape"):
        paged_ops.merge_attention_states(oa, la[:, :1], ob, lb)
    with pytest.raises(RuntimeError, match="same device"):
        paged_ops.merge_attention_states(oa, la.cpu(), ob, lb)
    with pytest.raises(RuntimeError, match="last dim"):
        paged_ops.merge_attention_states(oa.transpose(1, 2).contiguous().transpose(1, 2), la,
                                         ob, lb)


# ------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_cascade_replay_with_lengths_changed_in_place(dtype, multi_kernel):
    # One captured cascade step (prefix: multi-token causal=False with lse, split-K for the long
    # prefix; suffixes: decode with lse; merge), replayed with the prefix and suffix lengths
    # changed in place: the graph's work split stays valid and the results equal eager calls.
    skip_same_kernel(multi_kernel, dtype)
    bs, prefix_blocks = 16, 150
    suffix_cap = [40, 0, 200, 17]
    pg, _, q, prefix, suffix, full = cascade_inputs(prefix_blocks, suffix_cap, 8, 2, 64, bs,
                                                    dtype, dtype, seed=24)
    scale = 64 ** -0.5
    sl_p, sl_s = prefix[1].clone(), suffix[1].clone()
    bt_p, bt_s = prefix[0], suffix[0]
    qsl = qsl_of([q.shape[0]])  # made before the capture: a host-to-device copy is not captured

    def body():
        return cascade(q, pg, (bt_p, sl_p), (bt_s, sl_s), scale, qsl)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = body()
    full_bt = full[0].cpu()
    for step, (p_blocks, s_lens) in enumerate(((150, [40, 0, 200, 17]), (2, [1, 0, 3, 16]),
                                               (0, [0, 0, 5, 0]), (77, [17, 0, 0, 1]))):
        sl_p.fill_(p_blocks * bs)
        sl_s.copy_(torch.tensor(s_lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        got_out, got_lse = static_out.clone(), static_lse.clone()
        eager_out, eager_lse = body()
        torch.cuda.synchronize()
        assert_same(got_out, eager_out)
        assert_same(got_lse, eager_lse)
        # The whole sequence of branch i: the first p_blocks prefix blocks, then its own.
        bt = torch.cat([full_bt[:, :p_blocks], full_bt[:, prefix_blocks:]], dim=1)
        sl = torch.tensor(s_lens, dtype=torch.int32) + p_blocks * bs
        want_out, want_lse = ref_with_lse(q, pg.key_cache, pg.value_cache, bt, sl, scale)
        torch.testing.assert_close(got_out.cpu().float(), want_out.float(), **TOL[dtype],
                                   msg=f"replay {step}")
        torch.testing.assert_close(got_lse.cpu(), want_lse, **LSE_TOL, msg=f"replay {step}")


# ------------------------------------------------------------------------------------------
# opcheck and torch.compile on CUDA
# ------------------------------------------------------------------------------------------


def test_opcheck_with_lse_non_causal_and_merge():
    pg = make_paged([1, 17, 40], 2, 64, 16, torch.bfloat16, device=DEV)
    q = random_query(3, 8, 64, torch.bfloat16, device=DEV)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)
    op = torch.ops.paged.attention_with_lse.default
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, args, dict(alibi_slopes=torch.rand(8, device=DEV),
                                         sliding_window=20, logits_soft_cap=4.0))
    qm = random_query(10, 8, 64, torch.bfloat16, device=DEV)
    margs = (qm,) + args[1:]
    mkw = dict(query_start_loc=qsl_of([2, 3, 5]), causal=False)
    torch.library.opcheck(op, margs, mkw)
    torch.library.opcheck(torch.ops.paged.attention.default, margs, mkw)
    oa, la, ob, lb = (t.to(DEV) for t in merge_inputs(4, 3, 16, torch.bfloat16))
    torch.library.opcheck(torch.ops.paged.merge_attention_states.default, (oa, la, ob, lb))


def test_compile_cascade_step_equals_eager(multi_kernel):
    pg, _, q, prefix, suffix, _ = cascade_inputs(5, [0, 3, 20], 8, 2, 64, 16, torch.bfloat16,
                                                 torch.bfloat16, seed=25)
    qsl = qsl_of([q.shape[0]])

    def step(q, kc, vc, bt_p, sl_p, bt_s, sl_s, qsl):
        out_p, lse_p = paged_ops.paged_attention_with_lse(q, kc, vc, bt_p, sl_p, 0.125,
                                                          query_start_loc=qsl, causal=False)
        out_s, lse_s = paged_ops.paged_attention_with_lse(q, kc, vc, bt_s, sl_s, 0.125)
        return paged_ops.merge_attention_states(out_p, lse_p, out_s, lse_s)

    args = (q, pg.key_cache, pg.value_cache, *prefix, *suffix, qsl)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    got_out, got_lse = compiled(*args)
    want_out, want_lse = step(*args)
    torch.cuda.synchronize()
    assert_same(got_out, want_out)
    assert_same(got_lse, want_lse)
