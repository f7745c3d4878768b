"""reshape_and_cache, copy_blocks and swap_blocks against the reference (tests with a device
parameter also run on CUDA, there too against the reference only; CUDA-only ones:
test_cuda.py)."""

import os

import pytest
import torch

import paged_ops
from paged_ops import reference as ref
from tests.helpers import (
    assert_same,
    cache_x,
    check_cache_write,
    nan_caches,
    per_device,
    synchronize,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_reshape_and_cache_grid(dtype, head_size, block_size, device):
    g = torch.Generator().manual_seed(head_size + block_size)
    num_blocks, H = 12, 2
    n = 19
    kc, vc = nan_caches(num_blocks, H, head_size, block_size, dtype, device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[3] = -1  # padding token
    k = torch.randn(n, H, head_size, generator=g).to(dtype).to(device)
    v = torch.randn(n, H, head_size, generator=g).to(dtype).to(device)
    check_cache_write(k, v, kc, vc, slots.to(device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_many_heads(dtype, device):
    # num_kv_heads * head_size / x = 640 > 512 chunks per token: more than one CUDA block's
    # threads, the grid-stride loop covers all.
    x = cache_x(dtype)
    H, D = 640 * x // 128, 128
    assert H * D // x > 512
    kc, vc = nan_caches(6, H, D, 16, dtype, device)
    k = torch.randn(7, H, D, device=device).to(dtype)
    v = torch.randn(7, H, D, device=device).to(dtype)
    check_cache_write(k, v, kc, vc, torch.tensor([0, 17, 95, 40, -1, 64, 3], device=device))


def test_reshape_layout_by_hand():
    # Token 0 of head 1 into slot 5 of a block_size-4 cache: block 1, offset 1.
    kc, vc = nan_caches(3, 2, 8, 4, torch.float32)
    k = torch.arange(2 * 8, dtype=torch.float32).reshape(1, 2, 8)
    v = -k
    paged_ops.reshape_and_cache(k, v, kc, vc, torch.tensor([5]))
    x = cache_x(torch.float32)
    for d in range(8):
        assert kc[1, 1, d // x, 1, d % x] == k[0, 1, d]
        assert vc[1, 1, d, 1] == v[0, 1, d]
    assert torch.isnan(kc[0]).all() and torch.isnan(kc[2]).all()
    assert torch.isnan(kc[1, :, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_strided_fused_qkv_and_graph_padding(dtype):
    # key/value are slices of a fused qkv tensor, with extra padding rows beyond slot_mapping.
    H, D, bs = 2, 64, 16
    qkv = torch.randn(10, 8 + 2 * H, D).to(dtype)
    k, v = qkv[:, 8:8 + H], qkv[:, 8 + H:]
    assert not k.is_contiguous()
    slots = torch.tensor([17, 3, -1, 40, 0, 63])  # 6 of the 10 rows are written
    kc, vc = nan_caches(4, H, D, bs, dtype)
    want_k, want_v = ref.reshape_and_cache(k[:6], v[:6], kc, vc, slots)
    paged_ops.reshape_and_cache(k, v, kc, vc, slots)
    assert_same(kc, want_k)
    assert_same(vc, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_strided_padded_misaligned_pool(dtype, device):
    H, D, bs = 2, 64, 16
    # Slices of a fused qkv tensor, graph padding rows beyond slot_mapping, a strided slot
    # mapping, and caches that are layer 1 of a [layers, blocks, ...] pool.
    qkv = torch.randn(10, 8 + 2 * H, D, device=device).to(dtype)
    k, v = qkv[:, 8:8 + H], qkv[:, 8 + H:]
    x = cache_x(dtype)
    kpool = torch.full((3, 8, H, D // x, bs, x), float("nan"), dtype=dtype, device=device)
    vpool = torch.full((3, 8, H, D, bs), float("nan"), dtype=dtype, device=device)
    kc, vc = kpool[1], vpool[1]
    slots = torch.tensor([5, 99, 16, -1, 127, 0, 64], device=device)
    strided = torch.stack([slots, torch.full_like(slots, -9)], 1).reshape(-1)[::2]
    check_cache_write(k, v, kc, vc, strided)
    assert torch.isnan(kpool[0]).all() and torch.isnan(kpool[2]).all()
    # Key/value one element off 16-byte alignment: the scalar path.
    base = torch.randn(6, H, D + 1, device=device).to(dtype)
    k2, v2 = base[..., 1:], base.flip(0)[..., 1:]
    check_cache_write(k2, v2, kc, vc, torch.tensor([1, 2, 3, 30, 31, -1], device=device))


def test_reshape_into_layer_view_of_pool():
    H, D, bs, nb, layers = 2, 64, 8, 6, 3
    kpool = torch.full((layers, nb, H, D // 4, bs, 4), float("nan"))
    vpool = torch.full((nb, layers, H, D, bs), float("nan"))  # block-major: strided dim 0
    kc, vc = kpool[2], vpool[:, 1]
    k, v = torch.randn(5, H, D), torch.randn(5, H, D)
    slots = torch.tensor([0, 9, 47, 20, 33])
    want_k, want_v = ref.reshape_and_cache(k, v, kc, vc, slots)
    paged_ops.reshape_and_cache(k, v, kc, vc, slots)
    assert_same(kc, want_k)
    assert_same(vc, want_v)
    assert torch.isnan(kpool[:2]).all() and torch.isnan(vpool[:, [0, 2]]).all()


def test_reshape_zero_tokens_is_noop():
    kc, vc = nan_caches(2, 1, 8, 4, torch.float32)
    paged_ops.reshape_and_cache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), kc, vc,
                                torch.empty(0, dtype=torch.int64))
    assert torch.isnan(kc).all() and torch.isnan(vc).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_all_layers(dtype):
    layers, nb = 3, 10
    kcs, vcs = [], []
    for _ in range(layers):
        kc, vc = paged_ops.allocate_kv_cache(nb, 2, 32, 8, dtype)
        kcs.append(kc.copy_(torch.randn(kc.shape)))
        vcs.append(vc.copy_(torch.randn(vc.shape)))
    mapping = torch.tensor([[0, 5], [3, 7], [9, 1]])
    want_k, want_v = ref.copy_blocks(kcs, vcs, mapping)
    paged_ops.copy_blocks(kcs, vcs, mapping)
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert_same(a, b)
    paged_ops.copy_blocks(kcs, vcs, [(5, 2)])  # list-of-pairs form
    assert torch.equal(kcs[1][2], kcs[1][0])


@pytest.mark.parametrize("device,dtype", per_device(
    cpu=[(torch.uint8,), (torch.int32,), (torch.float8_e4m3fn,)],
    cuda=[(torch.uint8,), (torch.int32,), (torch.float8_e5m2,)]))
def test_copy_blocks_any_dtype(device, dtype):
    # A block copy moves bytes: caches of any dtype (x = 16 // element size) are accepted.
    x = 16 // torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(2)
    kcs = [torch.randint(0, 100, (6, 2, 32 // x, 8, x), generator=g).to(dtype).to(device)
           for _ in range(2)]
    vcs = [torch.randint(0, 100, (6, 2, 32, 8), generator=g).to(dtype).to(device)
           for _ in range(2)]
    mapping = torch.tensor([[0, 4], [5, 1], [2, 2]])  # (2, 2): a no-op pair is allowed
    want_k, want_v = ref.copy_blocks([k.cpu() for k in kcs], [v.cpu() for v in vcs], mapping)
    paged_ops.copy_blocks(kcs, vcs, mapping.to(device))
    synchronize(device)
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


# (2, 5) after (0, 2) or before it: block 2 is written and read; (1, 3) and (4, 3): written twice.
@pytest.mark.parametrize("pairs", [[[0, 2], [2, 5]], [[2, 5], [0, 2]], [[1, 3], [4, 3]]])
def test_copy_blocks_rejects_chained_pairs_of_a_host_mapping(pairs, device):
    caches = [paged_ops.allocate_kv_cache(10, 2, 64, 16, torch.float16, device=device)
              for _ in range(2)]
    kcs, vcs = [k.normal_() for k, _ in caches], [v.normal_() for _, v in caches]
    before = [t.clone() for t in kcs + vcs]
    with pytest.raises(RuntimeError, match="block_mapping"):
        paged_ops.copy_blocks(kcs, vcs, torch.tensor(pairs))
    synchronize(device)
    for a, b in zip(kcs + vcs, before):
        assert_same(a, b)


def test_copy_blocks_empty_mapping_and_no_layers():
    kc, vc = paged_ops.allocate_kv_cache(4, 1, 8, 4, torch.float32)
    kc.zero_()
    paged_ops.copy_blocks([kc], [vc], torch.empty(0, 2, dtype=torch.int64))
    paged_ops.copy_blocks([], [], torch.tensor([[0, 1]]))
    assert (kc == 0).all()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
def test_swap_blocks_round_trip(dtype):
    src_k, _ = paged_ops.allocate_kv_cache(8, 2, 32, 16, dtype)
    src_k.copy_(torch.randn(src_k.shape).to(dtype))
    dst_k = torch.zeros((4,) + src_k.shape[1:], dtype=dtype)
    out_map = torch.tensor([[6, 0], [2, 3], [5, 1]])
    want = ref.swap_blocks(src_k, dst_k, out_map)
    paged_ops.swap_blocks(src_k, dst_k, out_map)
    assert torch.equal(dst_k.view(torch.uint8), want.view(torch.uint8))
    back = torch.zeros_like(src_k)
    paged_ops.swap_blocks(dst_k, back, [(0, 6), (3, 2), (1, 5)])
    for b in (6, 2, 5):
        assert torch.equal(back[b].view(torch.uint8), src_k[b].view(torch.uint8))
    assert (back[[0, 1, 3, 4, 7]].float() == 0).all()


def test_swap_blocks_strided_layer_views():
    pool = torch.randn(6, 2, 4, 8)  # [blocks, layers, ...]
    dst_pool = torch.zeros(3, 2, 4, 8)
    paged_ops.swap_blocks(pool[:, 1], dst_pool[:, 0], torch.tensor([[4, 2]]))
    assert torch.equal(dst_pool[2, 0], pool[4, 1])
    assert (dst_pool[:, 1] == 0).all() and (dst_pool[:2] == 0).all()


def _vm_flags(addr):
    """The VmFlags of the mapping of this process that holds address ``addr``."""
    lo = hi = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
            elif line.startswith("VmFlags:") and lo <= addr < hi:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages (not Linux, or not built in)")
def test_allocate_kv_cache_asks_for_huge_pages():
    # 36 MiB per cache: above glibc's largest mmap threshold, so each is a mapping of its own.
    n = 36 << 20
    kc, vc = paged_ops.allocate_kv_cache(n // (8 * 128 * 16 * 4), 8, 128, 16, torch.float32)
    for c in (kc, vc):
        assert "hg" in _vm_flags(c.data_ptr() + n // 2)
    plain, _ = paged_ops.allocate_kv_cache(n // (8 * 128 * 16 * 4), 8, 128, 16, torch.float32,
                                           huge_pages=False)
    assert "hg" not in _vm_flags(plain.data_ptr() + n // 2)
    # Tensors without whole 2 MiB pages, or without memory, are left alone.
    assert not paged_ops.advise_huge_pages(torch.empty(100))
    assert not paged_ops.advise_huge_pages(torch.empty(n, device="meta"))
    # The caches work as ever.
    kc.zero_()
    paged_ops.copy_blocks([kc], [vc], [(0, 1)])
    assert (kc[1] == 0).all()
