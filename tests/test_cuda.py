"""CUDA-only tests, against paged_ops.reference on identical inputs (never against the CPU
kernels: on a GPU host the CPU kernel may be a build checked nowhere else): what exists because
of the CUDA kernels (group-tile configurations, split-K partitions, the tensor-core and
CUDA-core multi-token kernels, the head and block sizes the CUDA backend is built for, device
data that cannot raise, pinned and device-to-device swaps, CUDA graphs, a second device). Tests
that run on every device take the device fixture in their feature's file (test_attention.py,
test_cache_ops.py, test_multi_token.py, test_fp8.py, test_compile.py). Skipped cleanly without
a GPU or without the CUDA kernels compiled in."""

from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    CUDA,
    CUDA_BLOCK_SIZES,
    CUDA_HEAD_SIZES,
    TOL,
    assert_same,
    assert_same_bytes,
    cache_x,
    check_attention,
    decode_step_inputs,
    make_paged,
    make_paged_fp8,
    nan_caches,
    nan_fp8_caches,
    one_thread,
    random_query,
)

pytestmark = CUDA

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

DEV = "cuda"


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


# ------------------------------------------------------------------------------------------
# attention (every device: test_attention.py)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_large_group_tiles_per_config(dtype):
    # fp32 / bs 32 / head 256 allows only one head per tile: 4 tiles per kv head.
    lens = [33, 95]
    pg = make_paged(lens, 2, 256, 32, dtype, device=DEV, seed=4)
    q = random_query(len(lens), 8, 256, dtype, device=DEV, scale=2.0)
    check_attention(pg, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_long_context_split_k(dtype):
    # Small batch, > 8192 positions: many partitions and the fp32 merge kernel.
    lens = [9000, 12345, 3]
    pg = make_paged(lens, 2, 128, 16, dtype, device=DEV, seed=5)
    q = random_query(len(lens), 8, 128, dtype, device=DEV, scale=3.0)
    check_attention(pg, q, dtype)
    check_attention(pg, q, dtype, max_seq_len=12345)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_split_k_with_window_and_empty_partitions(dtype):
    # Partitions wholly before the window, and partitions past short sequences, see nothing.
    lens = [10000, 40, 0]
    pg = make_paged(lens, 1, 64, 16, dtype, device=DEV, seed=6)
    q = random_query(len(lens), 4, 64, dtype, device=DEV, scale=2.0)
    check_attention(pg, q, dtype, sliding_window=700)
    check_attention(pg, q, dtype, sliding_window=700, max_seq_len=20000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_memory_safety_out_of_range_ids_and_lengths(dtype):
    # The CUDA path cannot raise on device data: bad ids are never dereferenced, lengths are
    # clamped. Nothing may crash or read out of bounds, and the results stay well defined.
    bs = 16
    lens = [40, 40, 48]
    pg = make_paged(lens, 2, 64, bs, dtype, device=DEV, seed=10, extra_blocks=2)
    q = random_query(3, 4, 64, dtype, device=DEV)
    nb = pg.key_cache.shape[0]
    bt = pg.block_tables.clone()
    bt[0, 2] = nb + 1000  # last block of seq 0 out of range: as if the sequence ended at 32
    bt[1, 1] = -5         # middle block of seq 1 out of range: skipped
    sl = pg.seq_lens.clone()
    sl[2] = 10**6         # beyond what the table addresses: clamped to its capacity (80)
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, bt, sl)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    scale = 64 ** -0.5
    kc, vc = pg.key_cache.cpu(), pg.value_cache.cpu()
    want0 = ref.attention(q[:1].cpu(), kc, vc, bt[:1].cpu(), torch.tensor([32], dtype=torch.int32),
                          scale)
    torch.testing.assert_close(out[:1].cpu().float(), want0.float(), **TOL[dtype])
    # seq 2: positions 48..79 lie in blocks with junk ids (2**30, -7): skipped, never read.
    assert bt.shape[1] * bs == 80
    want2 = ref.attention(q[2:].cpu(), kc, vc, bt[2:].cpu(), torch.tensor([48], dtype=torch.int32),
                          scale)
    torch.testing.assert_close(out[2:].cpu().float(), want2.float(), **TOL[dtype])
    # max_seq_len smaller than the real lengths clamps them too.
    out2 = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                     pg.seq_lens, max_seq_len=17)
    want3 = ref.attention(q.cpu(), kc, vc, pg.block_tables.cpu(),
                          torch.full((3,), 17, dtype=torch.int32), scale)
    torch.testing.assert_close(out2.cpu().float(), want3.float(), **TOL[dtype])
    # Negative lengths act as 0.
    out3 = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                     torch.full((3,), -3, dtype=torch.int32, device=DEV))
    assert (out3 == 0).all()
    torch.cuda.synchronize()  # the context is still healthy


def test_attention_rejects_unsupported_sizes_and_misaligned_caches():
    pg = make_paged([5], 1, 48, 16, torch.float16, device=DEV)
    q = random_query(1, 2, 48, torch.float16, device=DEV)
    with pytest.raises(RuntimeError, match="head_size 48"):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    pg = make_paged([5], 1, 64, 4, torch.float16, device=DEV)
    q = random_query(1, 2, 64, torch.float16, device=DEV)
    with pytest.raises(RuntimeError, match="block_size 4"):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    # A block stride that is not a multiple of 16 bytes.
    x = cache_x(torch.float16)
    kflat = torch.zeros(4 * 64 * 16 + 8 * 4, dtype=torch.float16, device=DEV)
    vflat = torch.zeros_like(kflat)
    kc = kflat.as_strided((4, 1, 64 // x, 16, x), (64 * 16 + 1, 64 * 16, 16 * x, x, 1))
    vc = vflat.as_strided((4, 1, 64, 16), (64 * 16 + 1, 64 * 16, 16, 1))
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        paged_ops.paged_attention(q, kc, vc, bt, torch.ones(1, dtype=torch.int32, device=DEV))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    dev = "cuda:1"
    with torch.cuda.device(0):
        pg = make_paged([7, 300], 2, 64, 16, torch.bfloat16, device=dev, seed=11)
        q = random_query(2, 8, 64, torch.bfloat16, device=dev, scale=2.0)
        got = check_attention(pg, q, torch.bfloat16)
        assert got.device == torch.device(dev)
        k = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=dev)
        slots = torch.tensor([0, 5, 17], device=dev)
        kc, vc = pg.key_cache.clone(), pg.value_cache.clone()
        want_k, want_v = ref.reshape_and_cache(k.cpu(), k.cpu(), kc.cpu(), vc.cpu(), slots.cpu())
        paged_ops.reshape_and_cache(k, k, kc, vc, slots)
        assert_same(kc.cpu(), want_k)
        assert_same(vc.cpu(), want_v)
        dst = torch.zeros_like(pg.key_cache, device="cuda:0")
        paged_ops.swap_blocks(pg.key_cache, dst, [(0, 1), (2, 3)])
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert_same(dst[1].cpu(), pg.key_cache[0].cpu())
        assert_same(dst[3].cpu(), pg.key_cache[2].cpu())


# ------------------------------------------------------------------------------------------
# reshape_and_cache (the grid, many heads, strided/misaligned/pool inputs: test_cache_ops.py)
# ------------------------------------------------------------------------------------------


def test_reshape_and_cache_out_of_range_slot_is_skipped():
    kc, vc = nan_caches(4, 2, 64, 16, torch.float16, DEV)
    before_k, before_v = kc.clone(), vc.clone()
    k = torch.randn(4, 2, 64, device=DEV).half()
    slots = torch.tensor([3, 64, 10**12, 20], device=DEV)  # 64 = num_blocks * block_size
    paged_ops.reshape_and_cache(k, k, kc, vc, slots)
    torch.cuda.synchronize()
    want_k, want_v = ref.reshape_and_cache(k.cpu(), k.cpu(), before_k.cpu(), before_v.cpu(),
                                           torch.tensor([3, -1, -1, 20]))
    assert_same(kc.cpu(), want_k)
    assert_same(vc.cpu(), want_v)


def test_reshape_and_cache_empty_and_bad_input_leaves_cache_unchanged():
    kc, vc = nan_caches(4, 2, 64, 16, torch.float32, DEV)
    k = torch.randn(3, 2, 64, device=DEV)
    paged_ops.reshape_and_cache(k, k, kc, vc, torch.empty(0, dtype=torch.int64, device=DEV))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        paged_ops.reshape_and_cache(k, k, kc, vc, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(RuntimeError, match="same device"):
        paged_ops.reshape_and_cache(k, k, kc, vc, torch.zeros(3, dtype=torch.int64))
    assert torch.isnan(kc).all() and torch.isnan(vc).all()


# ------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks
# ------------------------------------------------------------------------------------------


def random_layers(n, dtype=torch.float16, num_blocks=10, H=2, D=64, bs=16):
    caches = [paged_ops.allocate_kv_cache(num_blocks, H, D, bs, dtype, device=DEV)
              for _ in range(n)]
    return [k.normal_() for k, _ in caches], [v.normal_() for _, v in caches]


@pytest.mark.parametrize("where", ["cpu", "cuda", "cuda_strided"])
@pytest.mark.parametrize("num_layers", [1, 3, 70])  # 70: more layers than one launch carries
def test_copy_blocks(where, num_layers):
    kcs, vcs = random_layers(num_layers)
    mapping = torch.tensor([[0, 3], [1, 5], [9, 2], [4, 4]])
    want_k, want_v = ref.copy_blocks([k.cpu() for k in kcs], [v.cpu() for v in vcs], mapping)
    if where == "cuda":
        mapping = mapping.to(DEV)
    elif where == "cuda_strided":
        mapping = mapping.t().contiguous().to(DEV).t()
    paged_ops.copy_blocks(kcs, vcs, mapping)
    torch.cuda.synchronize()
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert_same(a.cpu(), b)


def test_copy_blocks_pool_views_and_device_ids_out_of_range():
    # [blocks, layers, ...] pools: each layer's cache has a strided block dim.
    kpool = torch.randn(8, 2, 2, 8, 16, 8, device=DEV).half()
    vpool = torch.randn(8, 2, 2, 64, 16, device=DEV).half()
    kcs, vcs = [kpool[:, 0], kpool[:, 1]], [vpool[:, 0], vpool[:, 1]]
    mapping = torch.tensor([[0, 1], [2, 99], [-1, 3], [6, 7]])
    want_k, want_v = ref.copy_blocks([k.cpu() for k in kcs], [v.cpu() for v in vcs],
                                     torch.tensor([[0, 1], [6, 7]]))
    paged_ops.copy_blocks(kcs, vcs, mapping.to(DEV))  # bad device ids: those pairs are skipped
    torch.cuda.synchronize()
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert_same(a.cpu(), b)
    before = [t.clone() for t in kcs + vcs]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_ops.copy_blocks(kcs, vcs, mapping)  # host ids are checked before any copy
    for a, b in zip(kcs + vcs, before):
        assert_same(a, b)


def test_copy_blocks_under_cuda_graph_capture():
    # A CPU mapping would be staged in a pinned buffer that is recycled after the capture: it is
    # refused while capturing, the capture going on unharmed. A device mapping is captured and
    # replayed with its pairs changed in place.
    kcs, vcs = random_layers(2)
    mapping = torch.tensor([[0, 3], [1, 5]], device=DEV)
    host_mapping = mapping.cpu()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_ops.copy_blocks(kcs, vcs, mapping)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
            paged_ops.copy_blocks(kcs, vcs, host_mapping)
        paged_ops.copy_blocks(kcs, vcs, mapping)
    for pairs in ([[2, 7], [4, 8]], [[9, 0], [6, 1]]):
        mapping.copy_(torch.tensor(pairs))
        want_k, want_v = ref.copy_blocks([k.cpu() for k in kcs], [v.cpu() for v in vcs],
                                         torch.tensor(pairs))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(kcs + vcs, want_k + want_v):
            assert_same(a.cpu(), b)
    paged_ops.copy_blocks(kcs, vcs, host_mapping)  # outside a capture a CPU mapping is fine
    torch.cuda.synchronize()
    assert_same(kcs[1][3], kcs[1][0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_round_trip_pinned(dtype):
    kcs, _ = random_layers(1, dtype)
    gpu = kcs[0]
    host = torch.zeros((6,) + gpu.shape[1:], dtype=dtype).pin_memory()
    out_map = torch.tensor([[1, 0], [2, 1], [3, 2], [7, 5]])  # a run of three merges into one copy
    want_host = ref.swap_blocks(gpu.cpu(), host, out_map)
    paged_ops.swap_blocks(gpu, host, out_map)
    torch.cuda.synchronize()
    assert_same(host, want_host)
    back = torch.zeros_like(gpu)
    in_map = torch.tensor([[0, 9], [1, 8], [5, 0]])
    want_back = ref.swap_blocks(host, back.cpu(), in_map)
    paged_ops.swap_blocks(host, back, in_map)
    torch.cuda.synchronize()
    assert_same(back.cpu(), want_back)
    assert_same(back[9].cpu(), gpu[1].cpu())


def test_swap_blocks_gpu_gpu_pageable_and_views():
    kcs, vcs = random_layers(2)
    src = kcs[0]
    pool = torch.zeros((10, 2) + src.shape[1:], dtype=src.dtype, device=DEV)
    dst = pool[:, 1]  # strided block dim: no run merging
    mapping = torch.tensor([[0, 0], [1, 1], [2, 2], [9, 4]])
    want = ref.swap_blocks(src.cpu(), dst.cpu(), mapping)
    paged_ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert_same(dst.cpu(), want)
    assert (pool[:, 0] == 0).all()
    pageable = vcs[1].cpu()
    paged_ops.swap_blocks(pageable, vcs[0], [(3, 3)])
    torch.cuda.synchronize()
    assert_same(vcs[0][3].cpu(), pageable[3])
    with pytest.raises(RuntimeError, match="out of range"):
        paged_ops.swap_blocks(src, dst, [(0, 10)])


# ------------------------------------------------------------------------------------------
# CUDA graphs (opcheck and torch.compile on CUDA: test_compile.py)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_replay_with_inputs_changed_in_place(dtype):
    # Long enough that the captured attention uses split-K; seq_lens and slot_mapping change
    # between replays, the graph's work split stays valid.
    lens = [3000, 700]
    q, k, v, kc, vc, slots, bt, sl = decode_step_inputs(2, 21, dtype, lens=lens, device=DEV)
    scale = 64 ** -0.5

    def body():
        torch.ops.paged.reshape_and_cache(k, v, kc, vc, slots)
        return torch.ops.paged.attention(q, kc, vc, bt, sl, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = body()
    bs = 16
    # Each step writes position L and attends to L + 1 positions, all of them written.
    for step, new_lens in enumerate(([3000, 700], [2500, 701], [17, 702], [0, 1])):
        sl.copy_(torch.tensor(new_lens, dtype=torch.int32) + 1)
        new_slots = [int(bt[s, L // bs]) * bs + L % bs for s, L in enumerate(new_lens)]
        slots.copy_(torch.tensor(new_slots))
        k.normal_()
        v.normal_()
        graph.replay()
        torch.cuda.synchronize()
        got = static_out.clone()
        eager = body()  # rewrites the same slots with the same values
        torch.cuda.synchronize()
        torch.testing.assert_close(got, eager, atol=0, rtol=0, msg=f"replay {step}")
        want = ref.attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), scale)
        torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])


# ------------------------------------------------------------------------------------------
# several query tokens per sequence (query_start_loc) and fp8 caches
# ------------------------------------------------------------------------------------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def qsl_of(q_lens, device=DEV):
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def check_general(pg, q, tol, *, qsl=None, k_scale=None, v_scale=None, out=None, **kw):
    """CUDA attention (decode, or multi-token with qsl; fp8 with scales) vs the reference on
    the same cache bytes, with the tolerance ``tol``."""
    return check_attention(pg, q, q.dtype, out=out, tol=tol, query_start_loc=qsl,
                           k_scale=k_scale, v_scale=v_scale, **kw)


def multi_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0,
                qscale=2.0):
    assert all(n <= L for n, L in zip(q_lens, seq_lens))
    pg = make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, device=DEV, seed=seed)
    q = random_query(sum(q_lens), num_heads, head_size, dtype, device=DEV, seed=seed + 1,
                     scale=qscale)
    return pg, q, qsl_of(q_lens)


@pytest.fixture(params=["tensor_cores", "cuda_cores"])
def multi_kernel(request, monkeypatch):
    """Run a multi-token test on both CUDA kernels: the tensor-core one (fp16 / bf16 queries,
    head sizes multiple of 16; the default) and the CUDA-core one (forced by the variable)."""
    if request.param == "cuda_cores":
        monkeypatch.setenv("PAGED_OPS_CUDA_MULTI_TOKEN_SIMT", "1")
    else:
        monkeypatch.delenv("PAGED_OPS_CUDA_MULTI_TOKEN_SIMT", raising=False)
    return request.param


def skip_same_kernel(multi_kernel, q_dtype, head_size=64):
    if multi_kernel == "tensor_cores" and (q_dtype == torch.float32 or head_size % 16):
        pytest.skip("fp32 queries and head size 120 always take the CUDA-core kernel")


# A decode token, empty sequences (q_len 0, with and without cached tokens), a short and a
# long chunk, and two whole prompts (q_len == seq_len), one spanning many query tiles.
MIXED_Q = [1, 0, 7, 64, 0, 45, 150]
MIXED_L = [37, 12, 50, 100, 0, 45, 150]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
def test_multi_token_mixed_batch(dtype, block_size, multi_kernel):
    skip_same_kernel(multi_kernel, dtype)
    pg, q, qsl = multi_batch(MIXED_Q, MIXED_L, 8, 2, 128, block_size, dtype, seed=block_size)
    check_general(pg, q, TOL[dtype], qsl=qsl)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES)
def test_multi_token_head_sizes(dtype, head_size, multi_kernel):
    skip_same_kernel(multi_kernel, dtype, head_size)
    pg, q, qsl = multi_batch([3, 40, 1], [20, 40, 9], 4, 2, head_size, 16, dtype, seed=head_size)
    check_general(pg, q, TOL[dtype], qsl=qsl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_size", [((64, 8), 128), ((32, 1), 128), ((8, 8), 64),
                                             ((12, 4), 96), ((40, 1), 256), ((96, 1), 64),
                                             ((6, 2), 192)])
def test_multi_token_gqa_mqa(dtype, heads, head_size, multi_kernel):
    # Group sizes 8, 32, 1, 3, 40 (two group tiles of 20 at head size 256 on CUDA cores), 96
    # (two group tiles of 48).
    skip_same_kernel(multi_kernel, dtype)
    num_heads, num_kv_heads = heads
    pg, q, qsl = multi_batch([5, 1, 33], [70, 16, 33], num_heads, num_kv_heads, head_size, 16,
                             dtype, seed=num_heads)
    check_general(pg, q, TOL[dtype], qsl=qsl)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
def test_multi_token_alibi_window_softcap(dtype, block_size, multi_kernel):
    skip_same_kernel(multi_kernel, dtype)
    pg, q, qsl = multi_batch([1, 9, 70, 33], [40, 200, 300, 33], 8, 2, 64, block_size, dtype,
                             seed=7)
    slopes = torch.rand(8, device=DEV) * 0.5
    check_general(pg, q, TOL[dtype], qsl=qsl, alibi_slopes=slopes)
    check_general(pg, q, TOL[dtype], qsl=qsl, sliding_window=37)
    check_general(pg, q, TOL[dtype], qsl=qsl, sliding_window=1)
    check_general(pg, q, TOL[dtype], qsl=qsl, logits_soft_cap=5.0)
    check_general(pg, q, TOL[dtype], qsl=qsl, alibi_slopes=slopes, sliding_window=50,
                  logits_soft_cap=8.0, scale=0.3)
    check_general(pg, q, TOL[dtype], qsl=qsl, alibi_slopes=torch.rand(16, device=DEV)[::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_long_context_split_k(dtype, multi_kernel):
    # Few query tiles over long contexts: the key range is split over partitions and merged.
    skip_same_kernel(multi_kernel, dtype)
    pg, q, qsl = multi_batch([3, 1, 0], [9000, 5000, 70], 8, 2, 128, 16, dtype, seed=5,
                             qscale=3.0)
    check_general(pg, q, TOL[dtype], qsl=qsl)
    check_general(pg, q, TOL[dtype], qsl=qsl, max_seq_len=9000)
    check_general(pg, q, TOL[dtype], qsl=qsl, sliding_window=700)


def test_multi_token_memory_safety_bad_device_indices():
    # The CUDA path cannot raise on device data: query_start_loc, seq_lens and block ids out of
    # range are clamped or skipped, never used to read or write outside the tensors.
    pg, q, qsl = multi_batch([4, 4, 4], [40, 40, 48], 4, 2, 64, 16, torch.float32, seed=10)
    T = q.shape[0]
    for bad in ([0, 9, 3, T], [0, 4, 2 * T, T], [-7, 4, 8, T], [0, 4, 8, 10**9],
                [5, 4, 8, 12], [0, 0, 0, 0]):
        out = torch.full_like(q, 7.0)
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                  pg.seq_lens, query_start_loc=torch.tensor(
                                      bad, dtype=torch.int32, device=DEV), out=out)
        torch.cuda.synchronize()
    sl = torch.tensor([2, -5, 10**6], dtype=torch.int32, device=DEV)  # q_len > seq_len, < 0, huge
    bt = pg.block_tables.clone()
    bt[0, 1] = 10**6
    bt[1, 0] = -3
    out = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, bt, sl,
                                    query_start_loc=qsl)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    # Rows at negative positions (q_len > seq_len) and a negative length see nothing: zero rows.
    assert (out[:2] == 0).all() and (out[4:8] == 0).all()
    # The valid rows of sequence 0 (positions 0 and 1) are unaffected by the bad block.
    want = ref.attention(q[2:4].cpu(), pg.key_cache.cpu(), pg.value_cache.cpu(),
                         pg.block_tables[:1].cpu(), torch.tensor([2], dtype=torch.int32),
                         64 ** -0.5, query_start_loc=torch.tensor([0, 2], dtype=torch.int32))
    torch.testing.assert_close(out[2:4].cpu(), want, **TOL[torch.float32])


# ---- fp8 caches ------------------------------------------------------------------------------


def fp8_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=0, **kw):
    pg = make_paged_fp8(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=seed, **kw)
    for name in ("key_cache", "value_cache", "block_tables", "seq_lens", "k_scale", "v_scale"):
        setattr(pg, name, getattr(pg, name).to(DEV))
    return pg


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_reshape_and_cache_out_of_range_slots_are_skipped(cache_dtype):
    # The CUDA path cannot raise on device data: slots past the cache are skipped (the CPU
    # raises). The strided, misaligned and pool-view writes: test_fp8.py.
    kc, vc = nan_fp8_caches(8, 2, 64, 16, cache_dtype, DEV)
    k = torch.randn(2, 2, 64, device=DEV).to(torch.bfloat16)
    v = torch.randn(2, 2, 64, device=DEV).to(torch.bfloat16)
    ks, vs = torch.tensor([0.02], device=DEV), torch.tensor([0.04], device=DEV)
    before_k, before_v = kc.clone(), vc.clone()
    paged_ops.reshape_and_cache(k, v, kc, vc, torch.tensor([128, 10**12], device=DEV),
                                k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert_same_bytes(kc, before_k)
    assert_same_bytes(vc, before_v)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("head_size", [h for h in CUDA_HEAD_SIZES if h % 16 == 0])
def test_fp8_attention_head_sizes_decode_and_multi_token(cache_dtype, head_size, multi_kernel):
    pg = fp8_paged([5, 40, 33], 2, head_size, 16, cache_dtype, seed=head_size)
    for q_dtype in (torch.float16, torch.bfloat16):
        q = random_query(3, 8, head_size, q_dtype, device=DEV, scale=2.0)
        check_general(pg, q, TOL[q_dtype], k_scale=pg.k_scale, v_scale=pg.v_scale)
        qm = random_query(12, 8, head_size, q_dtype, device=DEV, scale=2.0)
        check_general(pg, qm, TOL[q_dtype], qsl=qsl_of([2, 7, 3]), k_scale=pg.k_scale,
                      v_scale=pg.v_scale)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("q_dtype", DTYPES)
def test_fp8_attention_multi_token_options_and_split_k(cache_dtype, q_dtype, multi_kernel):
    skip_same_kernel(multi_kernel, q_dtype)
    pg = fp8_paged(MIXED_L + [6000], 2, 64, 16, cache_dtype, seed=4)
    q_lens = MIXED_Q + [2]
    q = random_query(sum(q_lens), 8, 64, q_dtype, device=DEV, scale=2.0)
    qsl = qsl_of(q_lens)
    kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    check_general(pg, q, TOL[q_dtype], qsl=qsl, **kw)
    check_general(pg, q, TOL[q_dtype], qsl=qsl, alibi_slopes=torch.rand(8, device=DEV),
                  sliding_window=45, logits_soft_cap=6.0, **kw)
    # Long context, few sequences: the decode kernel's split-K with fp8 scales.
    qd = random_query(2, 8, 64, q_dtype, device=DEV, scale=2.0)
    pg2 = fp8_paged([9000, 3], 2, 64, 16, cache_dtype, seed=5)
    check_general(pg2, qd, TOL[q_dtype], k_scale=pg2.k_scale, v_scale=pg2.v_scale)


def test_fp8_rejections_on_cuda():
    pg = fp8_paged([5], 1, 64, 16, torch.float8_e4m3fn)
    q = random_query(1, 2, 64, torch.float16, device=DEV)
    with pytest.raises(RuntimeError, match="k_scale is required"):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens)
    with pytest.raises(RuntimeError, match="same device"):
        paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                                  k_scale=pg.k_scale.cpu(), v_scale=pg.v_scale)
    pg4 = fp8_paged([5], 1, 64, 4, torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="block_size 4"):
        paged_ops.paged_attention(q, pg4.key_cache, pg4.value_cache, pg4.block_tables,
                                  pg4.seq_lens, k_scale=pg4.k_scale, v_scale=pg4.v_scale)
    pg48 = fp8_paged([5], 1, 48, 16, torch.float8_e5m2)
    q48 = random_query(1, 2, 48, torch.float16, device=DEV)
    with pytest.raises(RuntimeError, match="head_size 48"):
        paged_ops.paged_attention(q48, pg48.key_cache, pg48.value_cache, pg48.block_tables,
                                  pg48.seq_lens, k_scale=pg48.k_scale, v_scale=pg48.v_scale,
                                  query_start_loc=qsl_of([1]))


# ---- opcheck and CUDA graphs -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_chunked_prefill_replay_with_inputs_changed_in_place(dtype, fp8,
                                                                     multi_kernel):
    # One captured chunked-prefill step (cache write of the chunk, causal attention with
    # query_start_loc), replayed with seq_lens, query_start_loc and slot_mapping changed in place
    # (same number of sequences and query tokens): the graph's work split stays valid.
    skip_same_kernel(multi_kernel, dtype)
    bs, H, Hkv, D = 16, 8, 2, 64
    capacity = [400, 80, 700]
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    if fp8:
        pg = fp8_paged(capacity, Hkv, D, bs, cache_dtype, seed=31)
        scales = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    else:
        pg = make_paged(capacity, Hkv, D, bs, dtype, device=DEV, seed=31)
        scales = {}
    kc, vc, bt = pg.key_cache, pg.value_cache, pg.block_tables
    steps = [([40, 0, 300], [16, 30, 5]), ([56, 30, 305], [10, 20, 21]), ([0, 50, 0], [1, 30, 20]),
             ([300, 0, 600], [51, 0, 0])]
    T = 51
    assert all(sum(c) == T for _, c in steps)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    slots = torch.zeros(T, dtype=torch.int64, device=DEV)
    sl = torch.zeros(3, dtype=torch.int32, device=DEV)
    qsl = torch.zeros(4, dtype=torch.int32, device=DEV)
    scale = D ** -0.5

    def set_step(prefix, chunk):
        s_list = []
        for s, (p, c) in enumerate(zip(prefix, chunk)):
            s_list += [int(bt[s, pos // bs]) * bs + pos % bs for pos in range(p, p + c)]
        slots.copy_(torch.tensor(s_list))
        sl.copy_(torch.tensor([p + c for p, c in zip(prefix, chunk)], dtype=torch.int32))
        qsl.copy_(qsl_of(chunk, device="cpu"))

    def body():
        paged_ops.reshape_and_cache(k, v, kc, vc, slots, **scales)
        return paged_ops.paged_attention(q, kc, vc, bt, sl, scale, query_start_loc=qsl, **scales)

    set_step(*steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = body()
    for i, (prefix, chunk) in enumerate(steps):
        set_step(prefix, chunk)
        q.normal_()
        k.normal_()
        v.normal_()
        graph.replay()
        torch.cuda.synchronize()
        got = static_out.clone()
        eager = body()  # rewrites the same slots with the same values
        torch.cuda.synchronize()
        torch.testing.assert_close(got, eager, atol=0, rtol=0, msg=f"replay {i}")
        with one_thread():
            want = ref.attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), scale,
                                 k_scale=_cpu(scales.get("k_scale")),
                                 v_scale=_cpu(scales.get("v_scale")), query_start_loc=qsl.cpu())
        torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
