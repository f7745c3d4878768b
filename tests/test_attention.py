"""paged::attention and paged::attention_out against the reference implementation, on every CPU
kernel build; tests with a device parameter also on CUDA (against the reference only).
CUDA-only tests (group-tile configurations, split-K, unsupported sizes, memory safety):
test_cuda.py."""

import itertools

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    CUDA_BLOCK_SIZES,
    TOL,
    cache_x,
    check_attention,
    make_paged,
    per_device,
    random_query,
    set_cache_at,
    write_dense,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("cpu_variant")  # conftest.py: every CPU kernel build


def check(pg, q, dtype, **kw):
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, scale, **kw)
    want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, scale,
                         kw.get("alibi_slopes"), kw.get("sliding_window", -1),
                         kw.get("logits_soft_cap", 0.0))
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert not out.isnan().any(), "NaN from unwritten slots leaked into the output"
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    return out


@pytest.mark.parametrize("device,dtype,head_size,block_size", per_device(
    cpu=itertools.product(DTYPES, [64, 80, 96, 128, 256], [1, 8, 16, 32]),
    # Every head size and block size the CUDA kernels are built for.
    cuda=itertools.product(DTYPES, [32, 64, 80, 96, 112, 120, 128, 192, 256], [8, 16, 32])))
def test_grid(device, dtype, head_size, block_size):
    bs = block_size
    # Partial, exact and one-past blocks; the CPU runs this on every kernel build, so it keeps
    # one longer sequence, CUDA two.
    lens = [0, 1, max(bs - 1, 1), bs, bs + 1] + ([37] if device == "cpu" else [2 * bs + 5, 70])
    pg = make_paged(lens, 2, head_size, bs, dtype, device=device, seed=head_size + bs)
    q = random_query(len(lens), 8, head_size, dtype, device=device, scale=2.0)
    out = check_attention(pg, q, dtype)
    assert (out[0] == 0).all()  # seq_len 0 -> zero row


# The block sizes the checks accept and a server uses (the p.v fast path covers every multiple
# of the vector width; groups of blocks are sized in tokens), on every build.
BLOCK_SIZES = [8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,head_size", [((8, 2), 128), ((16, 2), 80)])
def test_every_block_size(dtype, block_size, heads, head_size):
    # Lengths ending before, after and on block edges over several groups of blocks; 8 q / 2 kv
    # is one tile of rows (V read in place), 16 q / 2 kv two (16-bit V converted once for both),
    # head size 80 leaves shorter steps at the end of each V block.
    bs = block_size
    num_heads, num_kv_heads = heads
    lens = [1, bs - 1, bs + 1, max(2 * bs, 160) + 3]  # 2-6 groups of blocks
    pg = make_paged(lens, num_kv_heads, head_size, bs, dtype, seed=bs)
    q = random_query(len(lens), num_heads, head_size, dtype, scale=2.0)
    check(pg, q, dtype)
    check(pg, q, dtype, sliding_window=bs + 5)  # a partly visible first block too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 12, 24, 40, 48, 56, 80, 96])
@pytest.mark.parametrize("head_size", [64, 68])
def test_small_and_uneven_block_sizes(dtype, block_size, head_size):
    # Block sizes that divide the vector width share vectors of a group's logits (dense rows,
    # the group's tail padded with -inf), and at a half or a quarter of it several V rows share
    # a p.v vector (head size 68: a last step of fewer rows); the others pad each block's row
    # to whole vectors. Below the vector width without a path of their own (1, 3, 5; 2 and 12
    # on 16 lanes), blocks are staged (csrc/cpu/attention/staging.h): with head size 68 their values
    # too, else p.v reads the cache's values (pv_tiny). Three vectors per V row (48 on 16
    # lanes, 24 on 8) take the tiled p.v path; other whole vector counts (80, 96 on 16 lanes;
    # 40, 56 on 8) and on 16 lanes rows half a vector short (24, 40, 56) pv_group_any.
    if head_size % cache_x(dtype):
        pytest.skip("head size not a multiple of x")
    bs = block_size
    lens = [1, bs + 1, 4 * bs + 3, 150]  # one block, part of a group, many groups
    pg = make_paged(lens, 2, head_size, bs, dtype, seed=40 + bs)
    q = random_query(len(lens), 8, head_size, dtype, scale=2.0)
    check(pg, q, dtype)
    check(pg, q, dtype, sliding_window=bs + 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 7])
def test_staged_block_sizes(dtype, block_size):
    # Staged blocks (several cache blocks copied into one of a size the fast paths read,
    # csrc/cpu/attention/staging.h) across groups, kv heads and items: a long sequence split
    # over the threads, windows that start inside a staged block and inside a cache block,
    # ALiBi and a soft cap; the unwritten slots of the last block hold NaN.
    bs = block_size
    lens = [1, bs, 17 * bs + 2, 700]
    pg = make_paged(lens, 2, 128, bs, dtype, seed=60 + bs)
    q = random_query(len(lens), 8, 128, dtype, scale=2.0)
    check(pg, q, dtype)
    check(pg, q, dtype, sliding_window=2 * bs + 3)
    check(pg, q, dtype, sliding_window=41, alibi_slopes=torch.rand(8), logits_soft_cap=5.0)
    # Long enough for 4 block-range splits on 2 threads (512 tokens each at head size 128).
    pg = make_paged([2100], 2, 128, bs, dtype, seed=70 + bs)
    q = random_query(1, 8, 128, dtype, scale=2.0)
    check(pg, q, dtype)
    check(pg, q, dtype, sliding_window=300)


@pytest.mark.parametrize("device,dtype,heads,head_size,lens", per_device(
    cpu=[(dt, h, 64, (3, 16, 50)) for dt in DTYPES
         for h in [(4, 4), (8, 2), (16, 2), (8, 1), (32, 1)]],
    # Group sizes 1, 2, 3, 5, 8, 32, 20, 12: one and several CUDA group tiles, padded tiles.
    cuda=[(dt, h, 128, (5, 16, 77, 300)) for dt in DTYPES
          for h in [(8, 8), (16, 8), (24, 8), (6, 2), (10, 2), (64, 8), (32, 1), (40, 2),
                    (12, 1)]]))
def test_gqa_mqa(device, dtype, heads, head_size, lens):
    num_heads, num_kv_heads = heads
    pg = make_paged(list(lens), num_kv_heads, head_size, 16, dtype, device=device, seed=3)
    q = random_query(len(lens), num_heads, head_size, dtype, device=device,
                     scale=2.0)  # peaked softmax
    check_attention(pg, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context(dtype):
    lens = [1500, 2049, 17]
    pg = make_paged(lens, 2, 128, 16, dtype, seed=5)
    q = random_query(len(lens), 8, 128, dtype, scale=3.0)
    check(pg, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 256])
@pytest.mark.parametrize("shape", ["rising", "falling", "sawtooth"])
def test_running_max_across_groups(dtype, block_size, shape):
    # Keys along the query's direction with logits rising (the running max grows on every
    # group: each group rescales the sums so far), falling (never: the first block holds the
    # max) or in a sawtooth (both, in turn), so the online-softmax rescale is checked on every
    # kind of step, not only where random logits happen to set a new max.
    lens = [301, 1000]
    H, Hkv, D = 8, 2, 128
    pg = make_paged(lens, Hkv, D, block_size, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = (u * D**0.5 + 0.05 * torch.randn(len(lens), H, D, generator=g)).to(dtype)
    for s, L in enumerate(lens):
        t = torch.arange(L, dtype=torch.float32)
        a = {"rising": 0.05 * t, "falling": 0.05 * (L - t), "sawtooth": 0.2 * (t % 150)}[shape]
        k = a[:, None, None] * u + 0.05 * torch.randn(L, Hkv, D, generator=g)
        slots = pg.block_tables[s].long()[t.long() // block_size] * block_size + (
            t.long() % block_size)
        write_dense(pg.key_cache, pg.value_cache, slots, k, pg.values[s])
    check(pg, q, dtype)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("case", ["one_short", "one_long", "few_mixed"])
def test_work_split_over_threads(threads, case):
    # How decode is cut into items depends on the thread count: whole sequences with every kv
    # head, block-range splits merged afterwards, and kv heads halved into uneven chunks (5 kv
    # heads: 3 + 2, then 2 + 1 + 2 ...). Every cut must give the same answer.
    # Splits cover at least 512 tokens at head size 128 (1024 at 64, kMinSplitElements in
    # csrc/cpu/attention/tuning.h): one_long splits in 4, few_mixed in 2 (empty splits for the
    # short ones).
    lens = {"one_short": [40], "one_long": [4500], "few_mixed": [2100, 1, 129]}[case]
    pg = make_paged(lens, 5, 64, 16, torch.float32, seed=11)
    q = random_query(len(lens), 10, 64, torch.float32, scale=2.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = check(pg, q, torch.float32, sliding_window=700)
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        one = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                        pg.seq_lens, 64**-0.5, sliding_window=700)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, one, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_length_rows_are_zero(dtype):
    lens = [0, 5, 0, 17]
    pg = make_paged(lens, 2, 64, 16, dtype)
    q = random_query(len(lens), 4, 64, dtype)
    out = check(pg, q, dtype)
    assert (out[0] == 0).all() and (out[2] == 0).all()


@pytest.mark.parametrize("device,dtype,n", per_device(cpu=[(torch.float32, 2)],
                                                     cuda=[(torch.float16, 3)]))
def test_all_zero_length_and_empty_batch(device, dtype, n):
    pg = make_paged([0] * n, 2, 64, 16, dtype, device=device)
    q = random_query(n, 4, 64, dtype, device=device)
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    assert (out == 0).all()
    empty = paged_ops.paged_attention(q[:0], pg.key_cache, pg.value_cache, pg.block_tables[:0],
                                      pg.seq_lens[:0])
    assert empty.shape == (0, 4, 64) and empty.device == q.device


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 33, 4000])
def test_sliding_window(dtype, window):
    lens = [1, 15, 40, 100]
    pg = make_paged(lens, 2, 64, 16, dtype, seed=7)
    q = random_query(len(lens), 4, 64, dtype, scale=2.0)
    check(pg, q, dtype, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (16, 2)])
@pytest.mark.parametrize("window", [-1, 5, 21])
def test_partial_blocks_every_offset(dtype, heads, window):
    # Every visible range of a block, at both ends: the last block ends at each offset (and
    # with a window the first one starts at each offset). Partly visible blocks are read
    # through a copy with their hidden (NaN) columns zeroed, full ones in place; 8 q / 2 kv
    # is one tile of rows (in place), 16 q / 2 kv two tiles (16-bit caches converted).
    num_heads, num_kv_heads = heads
    lens = list(range(1, 50))
    pg = make_paged(lens, num_kv_heads, 64, 16, dtype, seed=13)
    q = random_query(len(lens), num_heads, 64, dtype, scale=2.0)
    check(pg, q, dtype, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_softcap_window_together(dtype):
    lens = [9, 31, 64, 65]
    pg = make_paged(lens, 2, 80, 8, dtype, seed=11)
    q = random_query(len(lens), 8, 80, dtype, scale=4.0)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(8)])
    check(pg, q, dtype, alibi_slopes=slopes)
    check(pg, q, dtype, logits_soft_cap=5.0)
    check(pg, q, dtype, alibi_slopes=slopes, logits_soft_cap=5.0, sliding_window=20)
    check(pg, q, dtype, scale=0.3, max_seq_len=65)


@pytest.mark.parametrize("device,dtype,block_size", per_device(
    cpu=[(dt, 16) for dt in DTYPES],
    cuda=itertools.product(DTYPES, CUDA_BLOCK_SIZES)))
def test_alibi_window_softcap_each_and_strided_slopes(device, dtype, block_size):
    lens = [1, 17, 64, 333, 1000]
    pg = make_paged(lens, 2, 64, block_size, dtype, device=device, seed=7)
    q = random_query(len(lens), 8, 64, dtype, device=device, scale=2.0)
    slopes = torch.rand(8, device=device) * 0.5
    check_attention(pg, q, dtype, alibi_slopes=slopes)
    check_attention(pg, q, dtype, sliding_window=37)
    check_attention(pg, q, dtype, logits_soft_cap=5.0)
    check_attention(pg, q, dtype, alibi_slopes=slopes, sliding_window=100, logits_soft_cap=8.0,
                    scale=0.3)
    # A strided slopes tensor.
    check_attention(pg, q, dtype, alibi_slopes=torch.rand(16, device=device)[::2])


def test_soft_cap_actually_caps():
    # Huge logits: without the cap the softmax is one-hot, with it it is not.
    pg = make_paged([20], 1, 64, 16, torch.float32, seed=2, kv_scale=30.0)
    q = random_query(1, 1, 64, torch.float32, scale=30.0)
    a = check(pg, q, torch.float32)
    b = check(pg, q, torch.float32, logits_soft_cap=1.0)
    assert (a - b).abs().max() > 1e-2


def test_strided_query_and_out():
    # query as a slice of a fused qkv projection; out as a strided view (attention_out).
    dtype = torch.float32
    lens = [5, 33, 16]
    pg = make_paged(lens, 2, 64, 16, dtype)
    qkv = torch.randn(len(lens), 8 + 2 + 2, 64)
    q = qkv[:, :8]
    assert not q.is_contiguous()
    want = check(pg, q, dtype)
    big = torch.full((len(lens), 16, 64), 7.0)
    out = big[:, ::2]
    res = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, out=out)
    assert res is out
    torch.testing.assert_close(out, want)
    assert (big[:, 1::2] == 7.0).all(), "attention_out wrote outside its out view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query_pool_views_strided_tables(dtype, device):
    # query: slice of a fused qkv tensor and a head-strided view; caches: layer 1 of a
    # [blocks, layers, ...] pool; block_tables and seq_lens: strided views.
    lens = [3, 50, 129]
    H, Hkv, D = 8, 2, 96
    pg = make_paged(lens, Hkv, D, 16, dtype, device=device, seed=8, pool_layers=3, layer=1)
    assert pg.key_cache.stride(0) != pg.key_cache[0].numel()
    qkv = random_query(len(lens), H + 2 * Hkv, D, dtype, device=device, scale=2.0)
    check_attention(pg, qkv[:, :H], dtype)
    q2 = random_query(len(lens), H * 2, D, dtype, device=device).view(len(lens), H, 2, D)[:, :, 1]
    check_attention(pg, q2, dtype)
    wide = torch.full((len(lens), pg.block_tables.shape[1] * 2), 7, dtype=torch.int32,
                      device=device)
    wide[:, ::2] = pg.block_tables
    sl = torch.zeros(2 * len(lens), dtype=torch.int32, device=device)
    sl[::2] = pg.seq_lens
    pg.block_tables, pg.seq_lens = wide[:, ::2], sl[::2]
    check_attention(pg, qkv[:, :H], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_strided(dtype, device):
    lens = [0, 9, 100, 2000]
    pg = make_paged(lens, 2, 128, 16, dtype, device=device, seed=9)
    q = random_query(len(lens), 8, 128, dtype, device=device, scale=2.0)
    buf = torch.full((len(lens), 8, 2, 128), 123.0, dtype=dtype, device=device)
    out = buf[:, :, 1]
    assert not out.is_contiguous()
    got = check_attention(pg, q, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (buf[:, :, 0] == 123.0).all(), "attention_out wrote outside out"
    assert (out[0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_layer_view_of_a_pool(dtype):
    lens = [7, 40, 16]
    pg = make_paged(lens, 2, 64, 16, dtype, pool_layers=3, layer=1)
    assert not pg.key_cache.is_contiguous()
    q = random_query(len(lens), 4, 64, dtype)
    check(pg, q, dtype)


def test_kv_half_of_a_joint_pool():
    # [2, num_blocks, ...] K/V pool split in halves, each half a cache.
    lens = [10, 20]
    pg = make_paged(lens, 2, 64, 16, torch.float32)
    nb = pg.key_cache.shape[0]
    pool = torch.full((2, nb, 2, 64 * 16), float("nan"))
    kc = pool[0].view(nb, 2, 16, 16, 4)
    vc = pool[1].view(nb, 2, 64, 16)
    kc.copy_(pg.key_cache)
    vc.copy_(pg.value_cache)
    q = random_query(2, 4, 64, torch.float32)
    out = paged_ops.paged_attention(q, kc, vc, pg.block_tables, pg.seq_lens)
    want = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                     pg.seq_lens)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_matches_dense_sdpa_of_the_written_tokens():
    # Independent of the reference: dense SDPA over the K/V exactly as written.
    lens = [1, 17, 64, 129]
    pg = make_paged(lens, 2, 128, 16, torch.float32, seed=9)
    q = random_query(len(lens), 8, 128, torch.float32, scale=2.0)
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens)
    for s in range(len(lens)):
        k = pg.keys[s].repeat_interleave(4, dim=1).transpose(0, 1)
        v = pg.values[s].repeat_interleave(4, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[s].unsqueeze(1), k, v)
        torch.testing.assert_close(out[s], want.squeeze(1), atol=2e-5, rtol=1e-4)


def test_deterministic_and_input_unchanged():
    pg = make_paged([50, 3], 2, 64, 16, torch.bfloat16)
    q = random_query(2, 4, 64, torch.bfloat16)
    kc, vc = pg.key_cache.clone(), pg.value_cache.clone()
    a = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    b = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    assert torch.equal(a, b)
    torch.testing.assert_close(pg.key_cache, kc, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(pg.value_cache, vc, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_every_finite_code_decodes_exactly(fp8):
    # One visible position: the output is exactly v * v_scale, so every finite fp8 code placed
    # in V must come back as its exact value (the vectorised decoders vs torch's conversion).
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = codes[codes.float().isfinite()]
    D = 256
    v_vals = torch.cat([finite, finite[: D - finite.numel()]])
    kc, vc = paged_ops.allocate_kv_cache(2, 1, D, 16, fp8)
    kc.view(torch.uint8).fill_(0x7F)  # NaN / junk in every other slot
    vc.view(torch.uint8).fill_(0x7F)
    kc.view(torch.uint8)[1, 0, :, 0, :] = 0x30  # a finite key at position 0 of block 1
    vc[1, 0, :, 0] = v_vals
    q = torch.randn(1, 1, D)
    one = torch.ones(1)
    out = paged_ops.paged_attention(q, kc, vc, torch.tensor([[1]], dtype=torch.int32),
                                    torch.tensor([1], dtype=torch.int32), k_scale=one,
                                    v_scale=torch.tensor([2.0]))
    assert torch.equal(out[0, 0], v_vals.float() * 2.0)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_every_finite_key_code_decodes_exactly(fp8, block_size, q_dtype):
    # The key path's decoders (widening, byte tables) against torch's conversion. Sequence s
    # has two tokens: the first with finite code c_s at dimension d_s and zero elsewhere, the
    # second all zero; V is 1 for the first token and 0 for the second. With q = 2^-e at d_s
    # (e the exponent of c_s, so the product is exact; for zero that of the smallest
    # subnormal) the output is sigmoid(significand of c_s). Read as any other value, code c_s
    # would give an output at least 0.012 away, against an fp32 error near 1e-7.
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = codes[codes.float().isfinite()]
    n, D, bs = finite.numel(), 64, block_size
    vals = finite.float()
    tiny = vals[vals > 0].min()
    exp = torch.frexp(torch.where(vals == 0, tiny, vals)).exponent - 1.0
    dims = (torch.arange(n) * 7) % D  # every dimension, so every lane of the decode
    blocks = torch.randperm(n + 3, generator=torch.Generator().manual_seed(5))[:n]
    kc, vc = paged_ops.allocate_kv_cache(n + 3, 1, D, bs, fp8)
    kc.view(torch.uint8).fill_(0x7F)  # NaN in every slot the sequences do not hold
    vc.view(torch.uint8).fill_(0x7F)
    kc.view(torch.uint8)[blocks, 0, :, :2, :] = 0
    x = cache_x(fp8)
    kc[blocks, 0, dims // x, 0, dims % x] = finite
    vc[blocks, 0, :, 0] = torch.ones((), dtype=fp8)
    vc.view(torch.uint8)[blocks, 0, :, 1] = 0
    q = torch.zeros(n, 1, D)
    q[torch.arange(n), 0, dims] = torch.exp2(-exp)
    one = torch.ones(1)
    out = paged_ops.paged_attention(q.to(q_dtype), kc, vc, blocks[:, None].to(torch.int32),
                                    torch.full((n,), 2, dtype=torch.int32), 1.0, k_scale=one,
                                    v_scale=one)
    want = torch.sigmoid(vals * torch.exp2(-exp))[:, None, None].expand(n, 1, D)
    # bf16 outputs round to 2^-9 below 1.
    tol = 2e-6 if q_dtype == torch.float32 else 2.0**-9
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=0)


def _outputs(pg, q):
    """(op output, reference output) in fp32, non-finite values allowed."""
    scale = q.shape[-1] ** -0.5
    got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, scale)
    want = ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, scale)
    return got.float(), want.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 40, 80, 128])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_stored_nan_reads_as_nan(dtype, block_size, kind):
    # A NaN stored at a visible position reaches the output as softmax(z) @ V over it does: a
    # key's NaN makes every row of its kv head NaN (also in the first group of blocks, where
    # the running max starts), a value's NaN those rows' element. Unwritten slots hold NaN
    # too and must not count (test_stored_nan_reads_as_nan in test_fp8.py: fp8 caches).
    bs = block_size
    lens = [bs + 3, 9 * bs + 7]
    pg = make_paged(lens, 2, 64, bs, dtype, seed=bs)
    for s, pos in ((0, bs + 1), (1, 5 * bs + 2)):
        set_cache_at(pg, kind, s, pos, 1, 37, float("nan"))
    q = random_query(len(lens), 8, 64, dtype, scale=2.0)
    got, want = _outputs(pg, q)
    nan = torch.zeros_like(want, dtype=torch.bool)
    if kind == "key":
        nan[:, 4:8] = True
    else:
        nan[:, 4:8, 37] = True
    assert torch.equal(want.isnan(), nan)
    assert torch.equal(got.isnan(), nan)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [24, 40, 56])
def test_half_vector_rows_keep_rows_apart(dtype, block_size):
    # On 16 lanes, V rows of these block sizes end half a vector short: p.v reads rows d and
    # d + 1 with vectors that straddle them and leaves the other row's lanes out. A value NaN
    # in an even row's last tokens and one in an odd row's first tokens (where the straddling
    # vectors read them) reach their own output element only. 6 q / 2 kv: tiles of one row.
    bs = block_size
    lens = [3 * bs + 5, 2 * bs + 1]
    pg = make_paged(lens, 2, 64, bs, dtype, seed=bs)
    set_cache_at(pg, "value", 0, 2 * bs - 1, 1, 36, float("nan"))  # row 36, last token
    set_cache_at(pg, "value", 0, 2 * bs, 1, 41, float("nan"))  # row 41, first token
    set_cache_at(pg, "value", 1, bs + 2, 0, 9, float("inf"))  # row 9, third token
    q = random_query(len(lens), 6, 64, dtype, scale=2.0)
    got, want = _outputs(pg, q)
    bad = torch.zeros_like(want, dtype=torch.bool)
    bad[0, 3:6, 36] = bad[0, 3:6, 41] = bad[1, 0:3, 9] = True
    assert torch.equal(~want.isfinite(), bad)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0), **TOL[dtype])
