"""The ops of cascade attention on the CPU: attention_with_lse (each row's log-sum-exp with its
output), non-causal multi-token rows (causal=False) and merge_attention_states.

Checked against the reference (paged_ops/reference.py) for decode and multi-token calls of
every cache dtype, and for exactness: a sequence's blocks split into two disjoint sets, each
attended with its lse and the two merged, equal one call over all of them; the cascade shape (a
shared prefix attended once by every branch's query, non-causal, merged with each branch's own
tail) equals each branch's full decode. The tests marked with cpu_variant run on every CPU
kernel build (conftest.py). CUDA tests of these ops: test_cuda.py.
"""

import random

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    FP8_DTYPES,
    TOL,
    make_paged,
    make_paged_fp8,
    one_thread,
    query_start_loc,
    random_query,
    set_cache_at,
)

NEG_INF = float("-inf")
# Cache dtypes, with the query dtype each is tested with (fp8: one of each).
CACHES = {
    "f32": (torch.float32, torch.float32),
    "f16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "e4m3": (torch.float8_e4m3fn, torch.bfloat16),
    "e5m2": (torch.float8_e5m2, torch.float32),
}
# lse is fp32 from fp32 logits on both sides: only the summation order differs.
LSE_TOL = dict(atol=1e-4, rtol=1e-5)


def paged(kind, lens, num_kv_heads, head_size, block_size, seed=0, kv_scale=1.0):
    """Caches of `kind` (CACHES) holding `lens`, NaN in every unwritten slot; the query dtype
    and the op's fp8 scale arguments."""
    cache_dtype, q_dtype = CACHES[kind]
    if cache_dtype in FP8_DTYPES:
        pg = make_paged_fp8(list(lens), num_kv_heads, head_size, block_size, cache_dtype,
                            seed=seed, kv_scale=kv_scale)
        return pg, q_dtype, dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    pg = make_paged(list(lens), num_kv_heads, head_size, block_size, cache_dtype, seed=seed,
                    kv_scale=kv_scale)
    return pg, q_dtype, {}


def with_lse(q, kc, vc, bt, sl, **kw):
    return paged_ops.paged_attention_with_lse(q, kc, vc, bt, sl, kw.pop("scale", None), **kw)


def check_lse(pg, q, **kw):
    """attention_with_lse vs the reference (out and lse), and its out vs attention's, bit for
    bit. Returns (out, lse)."""
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    out, lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                        scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not out.isnan().any(), "NaN from unwritten slots leaked into the output"
    assert not lse.isnan().any() and not (lse == float("inf")).any()
    plain = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                      pg.seq_lens, scale, **kw)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    with one_thread():
        want, want_lse = ref.attention_with_lse(
            q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, scale,
            kw.get("alibi_slopes"), kw.get("sliding_window", -1), kw.get("logits_soft_cap", 0.0),
            kw.get("k_scale"), kw.get("v_scale"), kw.get("query_start_loc"),
            kw.get("causal", True))
    torch.testing.assert_close(out.float(), want.float(), **TOL[q.dtype])
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)
    return out, lse


def rows_without_keys(lse, out):
    """Rows that see no position: lse -inf, out zeros."""
    none = lse == NEG_INF
    assert (out[none] == 0).all()
    return none


class threads:
    """Runs the body with n intra-op threads (decode splits long sequences over them)."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


# ---- lse against the reference, every build ------------------------------------------------


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("block_size", [3, 16, 32])
def test_lse_decode(kind, block_size):
    # Empty, one token, partial, exact and one-past blocks, GQA, peaked logits, NaN in unwritten
    # slots; then split-K (one long sequence, an empty one, on 2 threads: 2100 tokens at head
    # size 64 make two splits, csrc/cpu/attention/tuning.h).
    bs = block_size
    lens = [0, 1, max(bs - 1, 1), bs, bs + 1, 2 * bs + 3]
    pg, q_dtype, kw = paged(kind, lens, 2, 64, bs, seed=bs, kv_scale=1.5)
    q = random_query(len(lens), 8, 64, q_dtype, scale=2.0)
    out, lse = check_lse(pg, q, **kw)
    assert rows_without_keys(lse, out)[0].all() and not rows_without_keys(lse, out)[1:].any()
    pg, q_dtype, kw = paged(kind, [2100, 0, 5], 2, 64, bs, seed=bs + 1)
    q = random_query(3, 8, 64, q_dtype, scale=2.0)
    with threads(2):
        check_lse(pg, q, logits_soft_cap=8.0, **kw)


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("causal", [True, False])
def test_lse_multi_token(kind, causal):
    # A decode row, a chunk, a whole prompt, a sequence without rows, and the options together
    # (non-causal: window and ALiBi measured from L - 1 for every row).
    q_lens, lens = [1, 7, 20, 0, 16], [37, 50, 20, 9, 16]
    pg, q_dtype, kw = paged(kind, lens, 2, 64, 16, seed=5)
    q = random_query(sum(q_lens), 8, 64, q_dtype, seed=6, scale=2.0)
    qsl = query_start_loc(q_lens)
    check_lse(pg, q, query_start_loc=qsl, causal=causal, **kw)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(8)])
    check_lse(pg, q, query_start_loc=qsl, causal=causal, alibi_slopes=slopes,
              logits_soft_cap=5.0, sliding_window=21, **kw)


# ---- options, head layouts, block sizes (the build in use) -----------------------------------


OPTIONS = {
    "plain": {},
    "soft_cap": dict(logits_soft_cap=4.0),
    "alibi": dict(alibi_slopes=torch.rand(8, generator=torch.Generator().manual_seed(0))),
    "window_5": dict(sliding_window=5),
    "window_40": dict(sliding_window=40),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("mode", ["decode", "causal", "non_causal"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_lse_options(option, mode, dtype):
    lens = [0, 1, 15, 16, 17, 70]
    pg, q_dtype, kw = paged(dtype, lens, 2, 64, 16, seed=7)
    if mode == "decode":
        q = random_query(len(lens), 8, 64, q_dtype, scale=2.0)
    else:
        q_lens = [0, 1, 3, 16, 1, 30]
        kw.update(query_start_loc=query_start_loc(q_lens), causal=mode == "causal")
        q = random_query(sum(q_lens), 8, 64, q_dtype, scale=2.0)
    check_lse(pg, q, **kw, **OPTIONS[option])


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_lse_gqa_mqa(heads, causal):
    num_heads, num_kv_heads = heads
    lens, q_lens = [5, 33, 64], [2, 33, 9]
    pg, q_dtype, kw = paged("bf16", lens, num_kv_heads, 128, 16, seed=8)
    q = random_query(len(lens), num_heads, 128, q_dtype, scale=2.0)
    check_lse(pg, q, **kw)
    q = random_query(sum(q_lens), num_heads, 128, q_dtype, scale=2.0)
    check_lse(pg, q, query_start_loc=query_start_loc(q_lens), causal=causal, **kw)


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("block_size", [1, 5, 8, 24, 64, 256])
def test_lse_block_sizes(kind, block_size):
    bs = block_size
    lens = [1, bs, 2 * bs + 1, 45]
    pg, q_dtype, kw = paged(kind, lens, 2, 64, bs, seed=bs)
    check_lse(pg, random_query(len(lens), 8, 64, q_dtype, scale=2.0), **kw)
    q_lens = [1, bs, 2, 45]
    q = random_query(sum(q_lens), 8, 64, q_dtype, scale=2.0)
    for causal in (True, False):
        check_lse(pg, q, query_start_loc=query_start_loc(q_lens), causal=causal, **kw)


def test_non_causal_row_equals_decode_over_the_sequence():
    # Every non-causal row of a sequence is the decode of its query over all L positions, with
    # window and ALiBi measured from L - 1; more rows than one multi-token item holds (64 / G).
    L, n = 70, 20
    pg, _, _ = paged("f32", [L], 2, 64, 16, seed=9)
    q = random_query(n, 8, 64, torch.float32, scale=2.0)
    slopes = torch.rand(8)
    for kw in ({}, dict(sliding_window=30, alibi_slopes=slopes, logits_soft_cap=6.0)):
        out, lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                            query_start_loc=query_start_loc([n]), causal=False, **kw)
        bt, sl = pg.block_tables.repeat(n, 1), pg.seq_lens.repeat(n)
        d_out, d_lse = with_lse(q, pg.key_cache, pg.value_cache, bt, sl, **kw)
        torch.testing.assert_close(out, d_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, d_lse, atol=1e-6, rtol=1e-6)


def test_decode_ignores_causal():
    pg, _, _ = paged("f32", [0, 7, 40], 2, 64, 16, seed=10)
    q = random_query(3, 8, 64, torch.float32, scale=2.0)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    a = with_lse(*args, causal=True)
    b = with_lse(*args, causal=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_attention_out_non_causal():
    q_lens, lens = [3, 5], [10, 40]
    pg, _, _ = paged("f32", lens, 2, 64, 16, seed=11)
    q = random_query(sum(q_lens), 8, 64, torch.float32, scale=2.0)
    qsl = query_start_loc(q_lens)
    out = torch.full_like(q, float("nan"))
    paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                              query_start_loc=qsl, causal=False, out=out)
    want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                         64**-0.5, query_start_loc=qsl, causal=False)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_lse_of_nonfinite_visible_keys():
    # A NaN key a row sees: its out and lse are NaN, as the reference's; a key of +inf with a
    # positive q.k: lse +inf (torch.logsumexp) and out NaN (softmax). Rows that do not see
    # them stay finite.
    lens = [20, 20]
    pg, _, _ = paged("f32", lens, 1, 64, 16, seed=12)
    set_cache_at(pg, "key", 0, 5, 0, 3, float("nan"))
    set_cache_at(pg, "key", 1, 19, 0, 3, float("inf"))
    q = random_query(2, 2, 64, torch.float32).abs()  # q.k = +inf for the infinite key
    out, lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    with one_thread():
        want, want_lse = ref.attention_with_lse(q, pg.key_cache, pg.value_cache,
                                                pg.block_tables, pg.seq_lens, 64**-0.5)
    assert lse[0].isnan().all() and out[0].isnan().all()
    assert (lse[1] == float("inf")).all() and out[1].isnan().all()
    torch.testing.assert_close(lse, want_lse, equal_nan=True)
    # Causal rows before the NaN key do not see it.
    qm = random_query(20, 2, 64, torch.float32)
    out, lse = with_lse(qm, pg.key_cache, pg.value_cache, pg.block_tables[:1], pg.seq_lens[:1],
                        query_start_loc=query_start_loc([20]))
    assert lse[:5].isfinite().all() and lse[5:].isnan().all()
    assert out[:5].isfinite().all() and out[5:].isnan().all()


# ---- exactness: partial attentions merged equal one call, every build ------------------------


def split_tables(pg, rng, bs):
    """Two block tables and lengths per sequence from a random split of its blocks into two
    disjoint sets (each in any order, a partial last block last; junk past the end)."""
    tables, lengths = ([], []), ([], [])
    width = pg.block_tables.shape[1]
    for s, L in enumerate(pg.seq_lens.tolist()):
        n = (L + bs - 1) // bs
        ids = pg.block_tables[s, :n].tolist()
        side = [rng.random() < 0.5 for _ in range(n)]
        for part in (0, 1):
            mine = [b for b in range(n) if side[b] == bool(part)]
            rng.shuffle(mine)
            mine.sort(key=lambda b: b == n - 1 and L % bs != 0)  # a partial block goes last
            length = sum(min(bs, L - b * bs) for b in mine)
            row = [ids[b] for b in mine] + [-7] * (width - len(mine))
            tables[part].append(row)
            lengths[part].append(length)
    return ([torch.tensor(t, dtype=torch.int32) for t in tables],
            [torch.tensor(x, dtype=torch.int32) for x in lengths])


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("soft_cap", [0.0, 5.0])
def test_split_and_merge_equals_one_call(kind, soft_cap):
    bs = 16
    lens = [0, 1, 16, 17, 40, 95, 130]
    pg, q_dtype, kw = paged(kind, lens, 2, 64, bs, seed=13, kv_scale=1.5)
    q = random_query(len(lens), 8, 64, q_dtype, scale=2.0)
    kw["logits_soft_cap"] = soft_cap
    whole, whole_lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                                **kw)
    rng = random.Random(kind + str(soft_cap))
    for _ in range(3):
        (ta, tb), (la, lb) = split_tables(pg, rng, bs)
        oa, sa = with_lse(q, pg.key_cache, pg.value_cache, ta, la, **kw)
        ob, sb = with_lse(q, pg.key_cache, pg.value_cache, tb, lb, **kw)
        out, lse = paged_ops.merge_attention_states(oa, sa, ob, sb)
        assert out.dtype == q.dtype
        # The partial outputs are rounded to the query's dtype before the merge.
        torch.testing.assert_close(out.float(), whole.float(), **TOL[q_dtype])
        torch.testing.assert_close(lse, whole_lse, **LSE_TOL)
        assert (out[0] == 0).all() and (lse[0] == NEG_INF).all()


def cascade(pg, q, n_prefix, bs, **kw):
    """Each branch's decode as a cascade: the shared first n_prefix blocks attended once by all
    branch queries (one sequence, non-causal), each branch's own blocks by decode, merged."""
    n = q.shape[0]
    width = pg.block_tables.shape[1]
    shared = pg.block_tables[:1, :n_prefix]
    prefix_out, prefix_lse = with_lse(
        q, pg.key_cache, pg.value_cache, shared, torch.tensor([n_prefix * bs], dtype=torch.int32),
        query_start_loc=query_start_loc([n]), causal=False, **kw)
    tails = torch.full((n, width), -7, dtype=torch.int32)
    tails[:, :width - n_prefix] = pg.block_tables[:, n_prefix:]
    tail_out, tail_lse = with_lse(q, pg.key_cache, pg.value_cache, tails,
                                  pg.seq_lens - n_prefix * bs, **kw)
    return paged_ops.merge_attention_states(prefix_out, prefix_lse, tail_out, tail_lse)


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("soft_cap", [0.0, 5.0])
def test_cascade_equals_each_branch_decode(kind, soft_cap):
    # Branches whose first 3 blocks are the same cache blocks, with own tails of 1 token, a
    # block, a block and a bit (and one that ends with the prefix: an empty tail).
    bs, n_prefix = 16, 3
    tails = [1, 16, 19, 0, 5]
    pg, q_dtype, kw = paged(kind, [n_prefix * bs + t for t in tails], 2, 64, bs, seed=14)
    pg.block_tables[1:, :n_prefix] = pg.block_tables[0, :n_prefix]
    q = random_query(len(tails), 8, 64, q_dtype, scale=2.0)
    kw["logits_soft_cap"] = soft_cap
    out, lse = cascade(pg, q, n_prefix, bs, **kw)
    want, want_lse = check_lse(pg, q, **kw)  # each branch's decode, against the reference too
    torch.testing.assert_close(out.float(), want.float(), **TOL[q_dtype])
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)


def test_cascade_many_branches():
    # More branch rows than one multi-token item takes (64 / G tokens), MQA.
    bs, n_prefix, n = 16, 4, 40
    tails = [1 + i % 20 for i in range(n)]
    pg, _, _ = paged("bf16", [n_prefix * bs + t for t in tails], 1, 128, bs, seed=15)
    pg.block_tables[1:, :n_prefix] = pg.block_tables[0, :n_prefix]
    q = random_query(n, 8, 128, torch.bfloat16, scale=2.0)
    out, lse = cascade(pg, q, n_prefix, bs)
    want, want_lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)


# ---- merge_attention_states ----------------------------------------------------------------


def merge_inputs(dtype, n=5, h=4, d=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    oa = torch.randn(n, h, d, generator=g).to(dtype)
    ob = torch.randn(n, h, d, generator=g).to(dtype)
    la = torch.randn(n, h, generator=g) * 4
    lb = torch.randn(n, h, generator=g) * 4
    return oa, la, ob, lb


def check_merge(oa, la, ob, lb, **tol):
    out, lse = paged_ops.merge_attention_states(oa, la, ob, lb)
    want, want_lse = ref.merge_attention_states(oa, la, ob, lb)
    assert out.dtype == oa.dtype and out.shape == oa.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == la.shape and lse.is_contiguous()
    torch.testing.assert_close(out, want, equal_nan=True, **(tol or TOL[oa.dtype]))
    torch.testing.assert_close(lse, want_lse, equal_nan=True, atol=1e-6, rtol=1e-6)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 16, 64, 72, 128])
def test_merge_matches_reference(dtype, d):
    check_merge(*merge_inputs(dtype, d=d, seed=d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_neg_inf_sides(dtype):
    oa, la, ob, lb = merge_inputs(dtype)
    la[0] = NEG_INF          # row 0: only b
    lb[1] = NEG_INF          # row 1: only a
    la[2] = lb[2] = NEG_INF  # row 2: neither
    oa[0] = float("nan")     # an empty side's out is never read
    ob[1] = float("inf")
    oa[2] = ob[2] = float("nan")
    out, lse = check_merge(oa, la, ob, lb)
    torch.testing.assert_close(out[0], ob[0], atol=0, rtol=0)
    torch.testing.assert_close(lse[0], lb[0], atol=0, rtol=0)
    torch.testing.assert_close(out[1], oa[1], atol=0, rtol=0)
    assert (out[2] == 0).all() and (lse[2] == NEG_INF).all()
    assert out[3:].isfinite().all()


def test_merge_nan_and_inf_lse():
    # A NaN lse on either side: NaN out and lse. A +inf lse: lse +inf, out NaN. Never a crash.
    oa, la, ob, lb = merge_inputs(torch.float32, n=4)
    la[0, 0] = float("nan")
    lb[1, 0] = float("nan")
    la[2, 0] = float("inf")
    la[3, 0], lb[3, 0] = float("nan"), NEG_INF
    out, lse = check_merge(oa, la, ob, lb)
    assert lse[:2, 0].isnan().all() and out[:2, 0].isnan().all()
    assert lse[2, 0] == float("inf") and out[2, 0].isnan().all()
    assert lse[3, 0].isnan() and out[3, 0].isnan().all()
    assert out[:, 1:].isfinite().all()


def test_merge_equal_and_far_apart_lse():
    oa, la, ob, lb = merge_inputs(torch.float32)
    lb.copy_(la)
    out, lse = check_merge(oa, la, ob, lb)
    torch.testing.assert_close(lse, la + torch.log(torch.tensor(2.0)))
    la.fill_(100.0)
    lb.fill_(-100.0)
    out, lse = check_merge(oa, la, ob, lb)
    torch.testing.assert_close(out, oa, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_strided_inputs(dtype):
    oa, la, ob, lb = merge_inputs(dtype, n=6, h=4, d=64)
    big = torch.randn(6, 9, 80).to(dtype)
    big[:, 1:5, 8:72] = oa
    oa_s = big[:, 1:5, 8:72]  # strided tokens and heads, last dim contiguous
    ob_t = ob.transpose(0, 1).contiguous().transpose(0, 1)  # head-major
    la_t = la.t().contiguous().t()  # column-major
    lb_s = torch.randn(12, 8)[::2, ::2]
    lb_s.copy_(lb)
    assert not (oa_s.is_contiguous() or ob_t.is_contiguous() or la_t.is_contiguous()
                or lb_s.is_contiguous())
    out, lse = check_merge(oa_s, la_t, ob_t, lb_s)
    want, want_lse = paged_ops.merge_attention_states(oa, la, ob, lb)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    # A broadcast lse (stride 0) reads the same.
    one = torch.tensor(0.5).expand(6, 4)
    check_merge(oa, one, ob, lb)


def test_merge_empty_and_threads():
    for shape in ((0, 4, 8), (3, 0, 8), (3, 4, 0)):
        oa = torch.randn(*shape)
        la = torch.randn(shape[:2])
        out, lse = paged_ops.merge_attention_states(oa, la, oa.clone(), la.clone())
        assert out.shape == shape and lse.shape == shape[:2]
        if shape[2] == 0:
            torch.testing.assert_close(lse, la + torch.log(torch.tensor(2.0)))
    # Enough rows for several tasks, on each thread count: the same result.
    args = merge_inputs(torch.bfloat16, n=300, h=8, d=128)
    with threads(1):
        one = paged_ops.merge_attention_states(*args)
    with threads(3):
        three = paged_ops.merge_attention_states(*args)
    for x, y in zip(one, three):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    check_merge(*args)


def test_merge_inputs_unchanged():
    args = merge_inputs(torch.float16)
    before = [a.clone() for a in args]
    paged_ops.merge_attention_states(*args)
    for a, b in zip(args, before):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


_oa, _la, _ob, _lb = merge_inputs(torch.float32)
MERGE_BAD = {
    "out_a rank": ((_oa[0], _la, _ob, _lb), "out_a must have 3 dims"),
    "out_a dtype": ((_oa.double(), _la, _ob.double(), _lb), "out_a must be float32"),
    "out_a int": ((_oa.int(), _la, _ob.int(), _lb), "out_a must be float32"),
    "out_b dtype": ((_oa, _la, _ob.half(), _lb), "out_b dtype"),
    "out_b shape": ((_oa, _la, _ob[:, :, :8], _lb), "out_b must have the shape"),
    "out_a last dim strided": ((torch.randn(5, 4, 144)[..., ::2], _la, _ob, _lb), "out_a"),
    "out_b last dim strided": ((_oa, _la, torch.randn(5, 4, 144)[..., ::2], _lb), "out_b"),
    "lse_a dtype": ((_oa, _la.double(), _ob, _lb), "lse_a must be float32"),
    "lse_b dtype": ((_oa, _la, _ob, _lb.half()), "lse_b must be float32"),
    "lse_a shape": ((_oa, _la[:, :2], _ob, _lb), "lse_a must have shape"),
    "lse_b rank": ((_oa, _la, _ob, _lb[..., None]), "lse_b must have shape"),
}


@pytest.mark.parametrize("case", list(MERGE_BAD))
def test_merge_bad_input(case):
    args, match = MERGE_BAD[case]
    with pytest.raises(RuntimeError, match=match):
        paged_ops.merge_attention_states(*args)


def test_attention_with_lse_bad_input():
    pg, _, _ = paged("f32", [5, 9], 2, 64, 16)
    q = random_query(3, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="query_start_loc"):  # 3 rows, 2 sequences
        with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                 query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    # More rows than positions: causal rows are the last positions, so that is an error;
    # non-causal rows all sit at the end and any number of them is valid.
    q7 = random_query(7, 8, 64, torch.float32)
    qsl = torch.tensor([0, 6, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query tokens"):
        with_lse(q7, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                 query_start_loc=qsl)
    out, lse = with_lse(q7, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                        query_start_loc=qsl, causal=False)
    want, want_lse = ref.attention_with_lse(
        q7, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 64 ** -0.5,
        query_start_loc=qsl, causal=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


# ---- opcheck and torch.compile -------------------------------------------------------------


def test_opcheck_attention_with_lse():
    pg, _, _ = paged("f32", [1, 17, 40], 2, 64, 16)
    q = random_query(3, 8, 64, torch.float32)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args,
                          dict(alibi_slopes=torch.rand(8), sliding_window=20,
                               logits_soft_cap=4.0))
    qm = random_query(9, 8, 64, torch.float32)
    kw = dict(query_start_loc=query_start_loc([1, 3, 5]), causal=False)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, (qm,) + args[1:], kw)
    torch.library.opcheck(torch.ops.paged.attention.default, (qm,) + args[1:], kw)
    out = torch.empty_like(qm)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, qm) + args[1:], kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_merge_attention_states(dtype):
    oa, la, ob, lb = merge_inputs(dtype)
    la[0, 0] = NEG_INF
    torch.library.opcheck(torch.ops.paged.merge_attention_states.default, (oa, la, ob, lb))


def test_compile_cascade_fullgraph():
    torch._dynamo.reset()
    bs, n_prefix = 16, 2
    tails = [3, 16, 20]
    pg, _, _ = paged("f32", [n_prefix * bs + t for t in tails], 2, 64, bs, seed=16)
    pg.block_tables[1:, :n_prefix] = pg.block_tables[0, :n_prefix]
    q = random_query(len(tails), 8, 64, torch.float32, scale=2.0)
    n = len(tails)
    width = pg.block_tables.shape[1]
    tables = torch.full((n, width), -7, dtype=torch.int32)
    tables[:, :width - n_prefix] = pg.block_tables[:, n_prefix:]
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables[:1, :n_prefix],
            torch.tensor([n_prefix * bs], dtype=torch.int32), query_start_loc([n]), tables,
            pg.seq_lens - n_prefix * bs)

    def f(q, kc, vc, shared_bt, shared_len, qsl, tail_bt, tail_lens):
        po, pl = torch.ops.paged.attention_with_lse(q, kc, vc, shared_bt, shared_len, 0.125,
                                                    query_start_loc=qsl, causal=False)
        to, tl = torch.ops.paged.attention_with_lse(q, kc, vc, tail_bt, tail_lens, 0.125)
        out, lse = torch.ops.paged.merge_attention_states(po, pl, to, tl)
        return out * 2.0, lse + 1.0

    explain = torch._dynamo.explain(f)(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    got = torch.compile(f, fullgraph=True)(*args)
    want = f(*args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)
    whole, whole_lse = with_lse(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                                scale=0.125)
    torch.testing.assert_close(got[0], whole * 2.0, **TOL[torch.float32])
    torch.testing.assert_close(got[1], whole_lse + 1.0, **LSE_TOL)
