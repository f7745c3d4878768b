"""fp8 KV caches (torch.float8_e4m3fn / torch.float8_e5m2); tests with a device parameter
also on CUDA (against the reference only), CUDA-only ones in test_cuda.py.

reshape_and_cache stores round(x / scale) saturated to the format's largest finite value
(round-to-nearest-even); attention reads stored * scale. Checked against the reference bit for
bit (cache writes) or on the same stored bytes (attention), plus the format's error bounds,
saturation, the scale checks and the block copies.
"""

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    CUDA_BLOCK_SIZES,
    FP8_DTYPES,
    TOL,
    PagedFp8,
    assert_same_bytes,
    cache_x,
    check_fp8_write,
    fp8_quantize,
    fp8_write_inputs,
    make_paged_fp8,
    nan_fp8_caches,
    per_device,
    query_start_loc,
    random_query,
    set_cache_at,
)
from tests.helpers import check_attention as check_on_device

IN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Half the spacing of the format's significands, relative: 2^-(mantissa bits + 1).
HALF_ULP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
# Spacing of the subnormals (the absolute error floor, times the scale).
SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}


def scales(k=0.05, v=0.03, device="cpu"):
    return torch.tensor([k], device=device), torch.tensor([v], device=device)


# ---- reshape_and_cache ----------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("head_size,block_size", [(64, 1), (128, 16), (80, 32), (256, 8),
                                                  (32, 16)])
def test_reshape_and_cache_matches_reference_bitwise(cache_dtype, in_dtype, head_size,
                                                     block_size, device):
    g = torch.Generator().manual_seed(head_size * 7 + block_size)
    num_blocks, H = 10, 2
    # A prefill run that fills blocks in order (several consecutive slots), then scattered
    # decode-like tokens and a padding token.
    b0, b1 = 7, 2
    run = [b0 * block_size + i for i in range(block_size)] + [b1 * block_size]
    rest = torch.randperm(num_blocks * block_size, generator=g).tolist()
    rest = [s for s in rest if s not in run][:20]
    slots = torch.tensor(run + [-1] + rest)
    n = slots.numel()
    k = torch.randn(n, H, head_size, generator=g) * 3
    v = torch.randn(n, H, head_size, generator=g) * 2
    # Saturation (beyond +-max after the division), +-Inf, NaN, tiny values, exact zeros.
    k[0, 0, :8] = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), float("nan"), 1e-30,
                                -0.0, 0.0])
    v[1, 1, :4] = torch.tensor([-1e9, 7e4, float("nan"), -float("nan")])
    kc, vc = nan_fp8_caches(num_blocks, H, head_size, block_size, cache_dtype, device)
    ks, vs = scales(device=device)
    check_fp8_write(k.to(in_dtype).to(device), v.to(in_dtype).to(device), kc, vc,
                    slots.to(device), ks, vs)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_every_16_bit_input_and_specials_bitwise(cache_dtype, in_dtype, device):
    # Every bf16 / fp16 bit pattern (and, for fp32, random magnitudes over the whole range,
    # random bit patterns and the specials) through the op and the reference: subnormals of
    # the format, exact ties, saturation and NaN.
    D = 128
    x = fp8_write_inputs(in_dtype, D).to(device)
    n = x.shape[0]
    for scale in (1.0, 0.0371, 2.5e-3, 700.0):
        s = torch.tensor([scale], device=device)
        kc, vc = nan_fp8_caches(n, 1, D, 1, cache_dtype, device)
        check_fp8_write(x, x.flip(0), kc, vc, torch.randperm(n).to(device), s, s)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_round_trip_error_bound(cache_dtype, in_dtype):
    g = torch.Generator().manual_seed(5)
    H, D, bs, n = 2, 64, 16, 40
    scale = 0.01
    fmax = torch.finfo(cache_dtype).max
    # Magnitudes spread over the format's whole range (subnormals to near max), times scale.
    mag = 2.0 ** torch.empty(n, H, D).uniform_(-12, 8.7, generator=g)
    sign = torch.randint(0, 2, (n, H, D), generator=g) * 2 - 1
    x = (mag * sign * scale).clamp(-fmax * scale, fmax * scale).to(in_dtype)
    kc, vc = nan_fp8_caches(n // bs + 1, H, D, bs, cache_dtype)
    s = torch.tensor([scale])
    paged_ops.reshape_and_cache(x, x, kc, vc, torch.arange(n), k_scale=s, v_scale=s)
    stored = vc[: (n + bs - 1) // bs].permute(0, 3, 1, 2).reshape(-1, H, D)[:n]
    back = stored.float() * scale
    xf = x.float()
    err = (back - xf).abs()
    bound = HALF_ULP[cache_dtype] * xf.abs() * (1 + 1e-6) + SUBNORMAL[cache_dtype] / 2 * scale
    assert (err <= bound).all(), float((err - bound).max())
    # The key cache holds the same bytes in its layout.
    kstored = kc[: (n + bs - 1) // bs].permute(0, 3, 1, 2, 4).reshape(-1, H, D)[:n]
    assert_same_bytes(kstored, stored)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_saturation_never_nan_or_inf(cache_dtype, in_dtype):
    H, D, bs = 1, 32, 4
    fmax = torch.finfo(cache_dtype).max
    scale = 0.5
    big = min(fmax * scale * 1000, torch.finfo(in_dtype).max)
    vals = torch.tensor([big, -big, fmax * scale * 1.06, -fmax * scale * 1.06,
                         float("inf"), -float("inf"), fmax * scale, 1.0])
    x = vals.repeat(D // vals.numel()).reshape(1, 1, D).to(in_dtype)
    kc, vc = nan_fp8_caches(2, H, D, bs, cache_dtype)
    s = torch.tensor([scale])
    paged_ops.reshape_and_cache(x, x, kc, vc, torch.tensor([5]), k_scale=s, v_scale=s)
    got = vc[1, 0, :, 1].float()
    assert got.isfinite().all()
    want = vals.repeat(D // vals.numel())
    want[want.abs() > fmax * scale] = want[want.abs() > fmax * scale].sign() * fmax * scale
    want = (want.to(in_dtype).float() / scale).clamp(-fmax, fmax)
    torch.testing.assert_close(got[[0, 1, 2, 3, 4, 5, 6]], want[[0, 1, 2, 3, 4, 5, 6]],
                               atol=0, rtol=0)
    assert (kc[1, 0, :, 1, :].float().abs() == fmax).sum() == 7 * (D // 8)


def test_nan_input_stays_nan_and_touches_nothing_else():
    kc, vc = nan_fp8_caches(2, 1, 16, 4, torch.float8_e4m3fn)
    kc.view(torch.uint8).zero_()
    vc.view(torch.uint8).zero_()
    x = torch.ones(1, 1, 16)
    x[0, 0, 3] = float("nan")
    s = torch.tensor([1.0])
    paged_ops.reshape_and_cache(x, x, kc, vc, torch.tensor([6]), k_scale=s, v_scale=s)
    assert vc[1, 0, 3, 2].float().isnan()
    assert (vc[1, 0, :, 2].float().isnan().sum()) == 1
    assert (vc.float().nan_to_num(0) != 0).sum() == 15


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_reshape_strided_inputs_padding_rows_and_pool_view(cache_dtype):
    H, D, bs, nb, layers = 2, 64, 16, 6, 3
    qkv = torch.randn(12, 8 + 2 * H, D, dtype=torch.bfloat16)
    k, v = qkv[:, 8:8 + H], qkv[:, 8 + H:]  # strided along tokens, 12 rows for 9 slots
    assert not k.is_contiguous()
    x = cache_x(cache_dtype)
    kpool = torch.zeros((nb, layers, H, D // x, bs, x), dtype=torch.uint8)
    vpool = torch.zeros((nb, layers, H, D, bs), dtype=torch.uint8)
    kc, vc = kpool[:, 1].view(cache_dtype), vpool[:, 1].view(cache_dtype)
    assert not kc.is_contiguous()
    slots = torch.tensor([32, 33, 34, 35, -1, 3, 95, 64, 65])
    ks, vs = scales(0.04, 0.02)
    want_k, want_v = ref.reshape_and_cache(k[:9], v[:9], kc, vc, slots, ks, vs)
    paged_ops.reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    assert_same_bytes(kc, want_k)
    assert_same_bytes(vc, want_v)
    assert (kpool[:, [0, 2]] == 0).all() and (vpool[:, [0, 2]] == 0).all()


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_reshape_strided_misaligned_and_scale_view(cache_dtype, device):
    H, D, bs = 2, 64, 16
    qkv = torch.randn(10, 8 + 2 * H, D, device=device).to(torch.bfloat16)
    k, v = qkv[:, 8:8 + H], qkv[:, 8 + H:]
    kpool = torch.zeros((3, 8, H, D // 16, bs, 16), dtype=torch.uint8, device=device).fill_(0x7F)
    vpool = torch.zeros((3, 8, H, D, bs), dtype=torch.uint8, device=device).fill_(0x7F)
    kc, vc = kpool[1].view(cache_dtype), vpool[1].view(cache_dtype)
    ks = torch.tensor([0.5, 0.02], device=device)[1:]  # a one-element view
    vs = torch.tensor([0.04], device=device)
    slots = torch.tensor([5, 99, 16, -1, 127, 0, 64], device=device)
    check_fp8_write(k, v, kc, vc, slots, ks, vs)
    assert (kpool[0] == 0x7F).all() and (kpool[2] == 0x7F).all()
    assert (vpool[0] == 0x7F).all() and (vpool[2] == 0x7F).all()
    # One element off 16-byte alignment: the scalar path.
    base = torch.randn(6, H, D + 1, device=device)
    check_fp8_write(base[..., 1:], base.flip(0)[..., 1:], kc, vc,
                    torch.tensor([1, 2, 3, 30, 31, -1], device=device), ks, vs)


def test_scale_tensor_may_be_a_view():
    # A one-element view of a larger scale table (storage offset, any stride).
    table = torch.tensor([9.0, 0.05, 9.0, 0.03])
    kc, vc = nan_fp8_caches(2, 1, 16, 4, torch.float8_e5m2)
    x = torch.randn(3, 1, 16)
    slots = torch.tensor([0, 5, 6])
    want_k, want_v = ref.reshape_and_cache(x, x, kc, vc, slots, table[1:2], table[3:])
    paged_ops.reshape_and_cache(x, x, kc, vc, slots, k_scale=table[1:2], v_scale=table[3:])
    assert_same_bytes(kc, want_k)
    assert_same_bytes(vc, want_v)


def test_non_fp8_caches_ignore_scales():
    kc, vc = paged_ops.allocate_kv_cache(2, 1, 16, 4, torch.float32)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    x = torch.randn(2, 1, 16)
    slots = torch.tensor([1, 6])
    want_k, want_v = ref.reshape_and_cache(x, x, kc, vc, slots)
    paged_ops.reshape_and_cache(x, x, kc, vc, slots, k_scale=torch.tensor([0.5]),
                                v_scale=torch.tensor([0.5]))
    assert_same_bytes(kc, want_k)
    assert_same_bytes(vc, want_v)


# ---- scale checks -----------------------------------------------------------------------------

BAD_SCALES = {
    "k_scale missing": (dict(k_scale=None), "k_scale"),
    "v_scale missing": (dict(v_scale=None), "v_scale"),
    "k_scale float64": (dict(k_scale=torch.tensor([0.5], dtype=torch.float64)), "k_scale"),
    "v_scale float16": (dict(v_scale=torch.tensor([0.5], dtype=torch.float16)), "v_scale"),
    "k_scale two elements": (dict(k_scale=torch.tensor([0.5, 0.5])), "k_scale"),
    "v_scale empty": (dict(v_scale=torch.empty(0)), "v_scale"),
}


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_reshape_and_cache_bad_scales(case):
    over, name = BAD_SCALES[case]
    kc, vc = nan_fp8_caches(2, 1, 16, 4, torch.float8_e4m3fn)
    kc0, vc0 = kc.clone(), vc.clone()
    kw = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.5]))
    kw.update(over)
    with pytest.raises(RuntimeError, match=name):
        paged_ops.reshape_and_cache(torch.randn(2, 1, 16), torch.randn(2, 1, 16), kc, vc,
                                    torch.tensor([0, 5]), **kw)
    assert_same_bytes(kc, kc0)
    assert_same_bytes(vc, vc0)


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_attention_bad_scales(case):
    over, name = BAD_SCALES[case]
    pg = make_paged_fp8([5, 20], 2, 64, 16, torch.float8_e5m2)
    kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    kw.update(over)
    q = random_query(2, 4, 64, torch.float32)
    with pytest.raises(RuntimeError, match=name):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                                  **kw)


# ---- attention over fp8 caches ----------------------------------------------------------------



FP8_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: TOL[torch.float16],
    torch.bfloat16: TOL[torch.bfloat16],
}


def check_attention(pg, q, *, tol=None, **kw):
    """Attention over the fp8 caches of ``pg`` on their device vs the reference."""
    return check_on_device(pg, q, q.dtype, tol=tol or FP8_TOL[q.dtype], k_scale=pg.k_scale,
                           v_scale=pg.v_scale, **kw)


@pytest.mark.parametrize("device,cache_dtype,q_dtype,heads,head_size,block_size,lens", per_device(
    cpu=[(c, q, h, 64, bs, (1, 15, 16, 17, 70)) for c in FP8_DTYPES for q in IN_DTYPES
         for h, bs in [((8, 2), 16), ((4, 4), 1), ((8, 1), 32)]],
    # Every block size the CUDA kernels are built for, with an empty sequence.
    cuda=[(c, q, (8, 2), 128, bs, (0, 1, bs + 3, 70, 301)) for c in FP8_DTYPES
          for q in IN_DTYPES for bs in CUDA_BLOCK_SIZES]))
@pytest.mark.usefixtures("cpu_variant")
def test_attention_matches_reference(device, cache_dtype, q_dtype, heads, head_size, block_size,
                                     lens):
    num_heads, num_kv_heads = heads
    pg = make_paged_fp8(list(lens), num_kv_heads, head_size, block_size, cache_dtype,
                        seed=block_size, device=device)
    q = random_query(len(lens), num_heads, head_size, q_dtype, device=device, scale=2.0)
    # The CUDA kernels sum fp32 queries in another order: the general fp32 tolerance there.
    out = check_attention(pg, q, tol=TOL[q_dtype] if device == "cuda" else None)
    if lens[0] == 0:
        assert (out[0] == 0).all()


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96,
                                        128, 256])
@pytest.mark.usefixtures("cpu_variant")
def test_attention_every_block_size(cache_dtype, block_size):
    # Several groups of blocks and partial ones at both ends (a window), bf16 queries.
    bs = block_size
    lens = [1, bs + 1, max(2 * bs, 160) + 3]
    pg = make_paged_fp8(lens, 2, 128, bs, cache_dtype, seed=bs)
    q = random_query(len(lens), 8, 128, torch.bfloat16, scale=2.0)
    check_attention(pg, q)
    check_attention(pg, q, sliding_window=bs + 5)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.usefixtures("cpu_variant")
def test_attention_options_and_zero_length(cache_dtype):
    lens = [0, 9, 40, 100]
    pg = make_paged_fp8(lens, 2, 128, 16, cache_dtype, k_scale=0.05, v_scale=0.01, seed=4)
    q = random_query(len(lens), 8, 128, torch.float32, scale=2.0)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(8)])
    out = check_attention(pg, q, sliding_window=20)
    assert (out[0] == 0).all()
    check_attention(pg, q, alibi_slopes=slopes, logits_soft_cap=5.0, sliding_window=33)
    check_attention(pg, q, scale=0.3, max_seq_len=100)


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_with_query_start_loc(cache_dtype, q_dtype):
    # Several query tokens per sequence over fp8 caches: a decode token, a chunk, a whole
    # prompt and a sequence with nothing to do.
    lens, q_lens = [40, 23, 17, 9], [1, 8, 17, 0]
    pg = make_paged_fp8(lens, 2, 64, 16, cache_dtype, seed=6)
    q = random_query(sum(q_lens), 8, 64, q_dtype, scale=2.0)
    check_attention(pg, q, query_start_loc=query_start_loc(q_lens), sliding_window=12)
    check_attention(pg, q, query_start_loc=query_start_loc(q_lens),
                    alibi_slopes=torch.rand(8), logits_soft_cap=4.0)


def _attend_both(pg, q, **kw):
    """(op output, reference output) in fp32 on the CPU, NaN allowed."""
    scale = q.shape[-1] ** -0.5
    got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, scale, k_scale=pg.k_scale, v_scale=pg.v_scale,
                                    **kw)
    kc, vc = pg.key_cache.cpu(), pg.value_cache.cpu()
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    want = ref.attention(q.cpu(), kc, vc, pg.block_tables.cpu(), pg.seq_lens.cpu(), scale,
                         k_scale=pg.k_scale.cpu(), v_scale=pg.v_scale.cpu(), **cpu)
    return got.cpu().float(), want.float()


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 8, 16, 24, 32, 128])
@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.usefixtures("cpu_variant")
def test_stored_nan_reads_as_nan(cache_dtype, block_size, kind):
    # A stored NaN reads as NaN (stored * scale), wherever a row sees it: a key's NaN makes
    # the rows of its kv head NaN, a value's NaN their output element. Decode, a long sequence
    # (split over threads), a sliding window that hides it, and several query tokens (only the
    # rows at or after the position). The unwritten slots hold NaN too and must not count.
    bs = block_size
    lens = [5, bs + 3, max(20 * bs, 1100) + 7]  # two splits of >= 512 tokens on 2 threads
    pg = make_paged_fp8(lens, 2, 128, bs, cache_dtype, seed=bs)
    for s, pos in ((1, bs + 1), (2, 11 * bs + 2)):
        set_cache_at(pg, kind, s, pos, 1, 37, float("nan"))
    q = random_query(len(lens), 8, 128, torch.bfloat16, scale=2.0)
    got, want = _attend_both(pg, q)
    nan = torch.zeros_like(want, dtype=torch.bool)
    if kind == "key":  # the GQA group of kv head 1, every element
        nan[1:, 4:8] = True
    else:  # the same rows, element 37
        nan[1:, 4:8, 37] = True
    assert torch.equal(want.isnan(), nan)
    assert torch.equal(got.isnan(), nan)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **TOL[torch.bfloat16])
    # A window that ends before the NaN of sequence 2: only sequence 1's remains.
    got, want = _attend_both(pg, q, sliding_window=8 * bs)
    assert torch.equal(got.isnan(), want.isnan()) and not want[2].isnan().any()
    assert want[1].isnan().any()
    # Five query tokens of one sequence, at the positions around a stored NaN: only the rows
    # at or after it see it.
    pos = 11 * bs + 2
    pg = make_paged_fp8([pos + 3], 2, 128, bs, cache_dtype, seed=bs)
    set_cache_at(pg, kind, 0, pos, 1, 37, float("nan"))
    q = random_query(5, 8, 128, torch.bfloat16, scale=2.0)
    got, want = _attend_both(pg, q, query_start_loc=query_start_loc([5]))
    rows = want.isnan().any(-1).any(-1)
    assert rows.tolist() == [False, False, True, True, True]  # positions pos - 2 .. pos + 2
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **TOL[torch.bfloat16])


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_attention_equals_dense_sdpa_of_the_dequantised_tokens(cache_dtype):
    # Independent of the reference: SDPA over stored * scale.
    lens = [3, 33, 64]
    pg = make_paged_fp8(lens, 2, 64, 16, cache_dtype, seed=8)
    q = random_query(len(lens), 8, 64, torch.float32)
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, k_scale=pg.k_scale, v_scale=pg.v_scale)
    for s in range(len(lens)):
        k = pg.keys[s].repeat_interleave(4, dim=1).transpose(0, 1)
        v = pg.values[s].repeat_interleave(4, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[s].unsqueeze(1), k, v)
        torch.testing.assert_close(out[s], want.squeeze(1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device,cache_dtype,in_dtype", per_device(
    cpu=[(c, torch.float32) for c in FP8_DTYPES], cuda=[(c, torch.float16) for c in FP8_DTYPES]))
@pytest.mark.usefixtures("cpu_variant")
def test_write_then_attend_end_to_end(device, cache_dtype, in_dtype):
    # reshape_and_cache into fp8 caches, then decode and multi-token attention (on CUDA: both
    # kernels) over the written bytes vs the reference, and decode vs attention over the
    # original keys/values: the gap is the quantisation error only.
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, bs = 8, 2, 128, 16
    lens = [20, 77]
    kc, vc = nan_fp8_caches(16, Hkv, D, bs, cache_dtype, device)
    bt = torch.tensor([[3, 9, 0, 0, 0, 0], [1, 4, 7, 12, 2, 15]], dtype=torch.int32)
    slots = torch.cat([bt[s, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs
                       for s, L in enumerate(lens)])
    k = torch.randn(sum(lens), Hkv, D, generator=g).to(in_dtype)
    v = torch.randn(sum(lens), Hkv, D, generator=g).to(in_dtype)
    ks, vs = scales(5.0 / 448, 5.0 / 448, device=device)
    paged_ops.reshape_and_cache(k.to(device), v.to(device), kc, vc, slots.to(device),
                                k_scale=ks, v_scale=vs)
    pg = PagedFp8(kc, vc, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                  None, None, ks, vs)
    q = random_query(2, H, D, in_dtype, device=device, seed=12)
    out = check_attention(pg, q).cpu().float()
    qm = random_query(30, H, D, in_dtype, device=device, seed=13)
    check_attention(pg, qm, query_start_loc=query_start_loc([10, 20], device=device))
    tol = 0.1 if cache_dtype == torch.float8_e4m3fn else 0.2
    first = 0
    for s, L in enumerate(lens):
        ks_, vs_ = (t[first:first + L].float().repeat_interleave(4, 1).transpose(0, 1)
                    for t in (k, v))
        first += L
        exact = torch.nn.functional.scaled_dot_product_attention(
            q[s].cpu().float().unsqueeze(1), ks_, vs_).squeeze(1)
        assert (out[s] - exact).abs().max() < tol


@pytest.mark.usefixtures("cpu_variant")
def test_attention_out_and_fp8_cache_is_not_modified():
    pg = make_paged_fp8([7, 30], 2, 64, 16, torch.float8_e4m3fn)
    kc0, vc0 = pg.key_cache.clone(), pg.value_cache.clone()
    q = random_query(2, 4, 64, torch.bfloat16)
    out = torch.empty_like(q)
    res = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, k_scale=pg.k_scale, v_scale=pg.v_scale,
                                    out=out)
    assert res is out
    want = check_attention(pg, q)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert_same_bytes(pg.key_cache, kc0)
    assert_same_bytes(pg.value_cache, vc0)


# ---- copy_blocks / swap_blocks on fp8 caches --------------------------------------------------


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_copy_blocks_fp8(cache_dtype):
    g = torch.Generator().manual_seed(2)
    kcs, vcs = [], []
    for _ in range(2):
        kc, vc = paged_ops.allocate_kv_cache(8, 2, 32, 8, cache_dtype)
        kc.view(torch.uint8).copy_(torch.randint(0, 256, kc.shape, dtype=torch.uint8,
                                                 generator=g))
        vc.view(torch.uint8).copy_(torch.randint(0, 256, vc.shape, dtype=torch.uint8,
                                                 generator=g))
        kcs.append(kc)
        vcs.append(vc)
    mapping = torch.tensor([[0, 5], [3, 7], [6, 1]])
    want_k, want_v = ref.copy_blocks(kcs, vcs, mapping)
    paged_ops.copy_blocks(kcs, vcs, mapping)
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert_same_bytes(a, b)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_swap_blocks_fp8_round_trip(cache_dtype):
    pg = make_paged_fp8([20, 9], 2, 64, 16, cache_dtype)
    host = torch.zeros((4,) + pg.key_cache.shape[1:], dtype=cache_dtype)
    used = pg.block_tables[0, :2].tolist()
    out_map = torch.tensor([[used[0], 2], [used[1], 0]])
    want = ref.swap_blocks(pg.key_cache, host, out_map)
    paged_ops.swap_blocks(pg.key_cache, host, out_map)
    assert_same_bytes(host, want)
    back = torch.zeros_like(pg.key_cache)
    paged_ops.swap_blocks(host, back, [(2, used[0]), (0, used[1])])
    for b in used:
        assert_same_bytes(back[b], pg.key_cache[b])


# ---- opcheck ------------------------------------------------------------------------------------

# test_schema is left out: its mutation check (SchemaCheckMode's bitwise_equal, run on every
# tensor argument) has no fp8 kernel in torch ("mul_cpu_reduced_float" not implemented for
# Float8); the schemas themselves are checked by test_compile.py on float caches.
OPCHECK_UTILS_FP8 = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_utils(device):
    # On CUDA every check runs (test_schema's comparison has CUDA kernels for fp8).
    return {} if device == "cuda" else dict(test_utils=OPCHECK_UTILS_FP8)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_opcheck_reshape_and_cache_fp8(cache_dtype, device):
    kc, vc = nan_fp8_caches(4, 2, 64, 16, cache_dtype, device)
    kc.view(torch.uint8).zero_()
    vc.view(torch.uint8).zero_()
    ks, vs = scales(device=device)
    args = (torch.randn(5, 2, 64, device=device), torch.randn(5, 2, 64, device=device), kc, vc,
            torch.tensor([3, 17, -1, 40, 63], device=device), ks, vs)
    torch.library.opcheck(torch.ops.paged.reshape_and_cache.default, args,
                          **opcheck_utils(device))


@pytest.mark.parametrize("device,cache_dtype", per_device(
    cpu=[(torch.float8_e4m3fn,)], cuda=[(c,) for c in FP8_DTYPES]))
def test_opcheck_attention_fp8(device, cache_dtype):
    pg = make_paged_fp8([1, 17, 40], 2, 64, 16, cache_dtype, seed=15, device=device)
    q = random_query(3, 8, 64, torch.bfloat16, device=device)
    args = (q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens, 0.125)
    scales_kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    torch.library.opcheck(torch.ops.paged.attention.default, args, scales_kw,
                          **opcheck_utils(device))
    # Several query tokens per sequence.
    qm = random_query(9, 8, 64, torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.paged.attention.default, (qm,) + args[1:],
                          dict(query_start_loc=query_start_loc([1, 4, 4], device=device),
                               **scales_kw), **opcheck_utils(device))


def test_quantize_helpers_agree_with_reference():
    # The test helpers and the reference state the same contract independently.
    x = torch.randn(1000) * 300
    for dt in FP8_DTYPES:
        s = torch.tensor([0.7])
        assert_same_bytes(fp8_quantize(x, s, dt), ref.quantize(x, s.reshape(()), dt))
