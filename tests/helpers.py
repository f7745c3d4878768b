"""Shared test fixtures-by-hand: paged caches with scattered blocks, NaN in every unwritten slot
and junk in unused block-table entries, plus the dense K/V each sequence was written with."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import pytest
import torch

import paged_ops
from paged_ops import reference as ref

HAVE_CUDA = torch.cuda.is_available() and paged_ops.built_with_cuda()
# Marks of a test (or parameter) that needs CUDA: selected by `-m cuda`, skipped without a GPU.
CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU and a build with CUDA kernels")]
# The devices of the `device` fixture (conftest.py): for parametrizing by hand.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _cuda_sizes(which):
    """The head sizes (0) or block sizes (1) the CUDA kernels are built for (csrc/cuda_sizes.h:
    the list the op checks and the kernels' dispatch use)."""
    fn = paged_ops._C_LIB.paged_ops_cuda_sizes
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.POINTER(ctypes.c_int))]
    fn.restype = ctypes.c_int
    values = ctypes.POINTER(ctypes.c_int)()
    n = fn(which, ctypes.byref(values))
    return [values[i] for i in range(n)]


CUDA_HEAD_SIZES = _cuda_sizes(0)
CUDA_BLOCK_SIZES = _cuda_sizes(1)


def synchronize(device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def cache_x(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


@dataclass
class Paged:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: list  # per sequence: [L, Hkv, D] as written
    values: list


def write_dense(key_cache, value_cache, slots, k, v):
    """Write tokens straight by index arithmetic (independent of the ops under test)."""
    bs = value_cache.shape[3]
    x = key_cache.shape[4]
    blk, off = slots // bs, slots % bs
    key_cache[blk, :, :, off, :] = k.reshape(k.shape[0], k.shape[1], -1, x).to(key_cache.dtype)
    value_cache[blk, :, :, off] = v.to(value_cache.dtype)


def make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, *, device="cpu",
               extra_blocks=5, seed=0, pool_layers=None, layer=0, kv_scale=1.0,
               junk=(2**30, -7)):
    """Caches holding the given sequences in scattered blocks.

    pool_layers: when set, the caches are views of layer `layer` of a
    [pool_layers, num_blocks, ...] pool (arbitrary stride on the block dim).
    """
    g = torch.Generator().manual_seed(seed)
    need = [(L + block_size - 1) // block_size for L in seq_lens]
    num_blocks = sum(need) + extra_blocks
    x = cache_x(dtype)
    kshape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    vshape = (num_blocks, num_kv_heads, head_size, block_size)
    if pool_layers:
        kpool = torch.full((num_blocks, pool_layers) + kshape[1:], float("nan"), dtype=dtype,
                           device=device)
        vpool = torch.full((num_blocks, pool_layers) + vshape[1:], float("nan"), dtype=dtype,
                           device=device)
        key_cache, value_cache = kpool[:, layer], vpool[:, layer]
    else:
        key_cache = torch.full(kshape, float("nan"), dtype=dtype, device=device)
        value_cache = torch.full(vshape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need + [1]) + 2
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    keys, values = [], []
    for s, L in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(need[s])]
        row = ids + [junk[i % len(junk)] for i in range(width - need[s])]
        tables[s] = torch.tensor(row, dtype=torch.int32)
        k = (torch.randn(L, num_kv_heads, head_size, generator=g) * kv_scale).to(dtype)
        v = torch.randn(L, num_kv_heads, head_size, generator=g).to(dtype)
        if L:
            pos = torch.arange(L)
            slots = torch.tensor(ids, dtype=torch.int64)[pos // block_size] * block_size + (
                pos % block_size)
            write_dense(key_cache, value_cache, slots.to(device), k.to(device), v.to(device))
        keys.append(k)
        values.append(v)
    return Paged(key_cache, value_cache, tables.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values)


def random_query(num_seqs, num_heads, head_size, dtype, *, seed=1, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_seqs, num_heads, head_size, generator=g) * scale).to(dtype).to(device)


# ---- fp8 caches and multi-token queries (test_fp8.py, test_multi_token.py) -------------------

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_quantize(t, scale, dtype):
    """round(t / scale) in fp8 `dtype`, saturated to its largest finite value (the contract of
    docs/design.md, section 3, written here independently of the ops and of the reference)."""
    fmax = torch.finfo(dtype).max
    return (t.float() / scale).clamp(-fmax, fmax).to(dtype)


def key_cache_as_dense(key_cache):
    """[nb, H, D // x, bs, x] -> [nb, H, D, bs] (element d of a key at d // x, d % x)."""
    nb, h, c, bs, x = key_cache.shape
    return key_cache.permute(0, 1, 2, 4, 3).reshape(nb, h, c * x, bs)


def dense_as_key_cache(dense, x):
    """[nb, H, D, bs] -> a contiguous [nb, H, D // x, bs, x] key cache."""
    nb, h, d, bs = dense.shape
    return dense.reshape(nb, h, d // x, x, bs).permute(0, 1, 2, 4, 3).contiguous()


@dataclass
class PagedFp8(Paged):
    k_scale: torch.Tensor = None  # fp32 [1]
    v_scale: torch.Tensor = None


def make_paged_fp8(seq_lens, num_kv_heads, head_size, block_size, dtype, *, k_scale=0.02,
                   v_scale=0.015, seed=0, extra_blocks=5, kv_scale=1.0, device="cpu"):
    """Like make_paged, with fp8 caches holding the sequences quantised with the given scales
    (unwritten slots NaN, unused block-table entries junk). keys/values are the values the
    stored bytes stand for (stored * scale, fp32, on the CPU); the tensors of the op are on
    ``device``."""
    pg = make_paged(seq_lens, num_kv_heads, head_size, block_size, torch.float32, seed=seed,
                    extra_blocks=extra_blocks, kv_scale=kv_scale)
    ks = torch.tensor([k_scale], dtype=torch.float32)
    vs = torch.tensor([v_scale], dtype=torch.float32)
    kc = dense_as_key_cache(fp8_quantize(key_cache_as_dense(pg.key_cache), ks, dtype),
                            cache_x(dtype))
    vc = fp8_quantize(pg.value_cache, vs, dtype)
    keys = [fp8_quantize(k, ks, dtype).float() * ks for k in pg.keys]
    values = [fp8_quantize(v, vs, dtype).float() * vs for v in pg.values]
    return PagedFp8(kc.to(device), vc.to(device), pg.block_tables.to(device),
                    pg.seq_lens.to(device), keys, values, ks.to(device), vs.to(device))


def set_cache_at(pg, kind, s, pos, h, i, value):
    """Stores value in the key (element i) or the value (row i) of sequence s at position pos,
    kv head h, through the block table."""
    bs = pg.value_cache.shape[-1]
    blk = int(pg.block_tables[s, pos // bs])
    if kind == "key":
        x = pg.key_cache.shape[-1]
        pg.key_cache[blk, h, i // x, pos % bs, i % x] = value
    else:
        pg.value_cache[blk, h, i, pos % bs] = value


def query_start_loc(q_lens, device="cpu"):
    """int32 [len(q_lens) + 1] cumulative offsets of the sequences' query rows."""
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@contextlib.contextmanager
def one_thread():
    """Run the (loop-based, many tiny ops) reference on one intra-op thread: on a loaded
    machine every tiny parallel op may otherwise wait for a descheduled worker thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fp8_write_inputs(in_dtype, D):
    """Inputs [n, 1, D] for bitwise fp8 cache-write tests: every 16-bit pattern of a 16-bit
    dtype; for fp32, magnitudes over the whole range, random bit patterns and the specials."""
    if in_dtype == torch.float32:
        g = torch.Generator().manual_seed(3)
        x = torch.cat([
            torch.randn(8192, generator=g) * 10 ** torch.empty(8192).uniform_(-9, 7,
                                                                               generator=g),
            torch.randint(-2**31, 2**31 - 1, (8192,), dtype=torch.int32, generator=g)
            .view(torch.float32),
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3e38]),
        ])
    else:
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(in_dtype)
    return torch.cat([x, torch.zeros((-x.numel()) % D, dtype=x.dtype)]).reshape(-1, 1, D)


def decode_step_inputs(num_seqs, seed, dtype=torch.float32, lens=None, device="cpu"):
    """Inputs of a decode step (q, k, v, key_cache, value_cache, slot_mapping, block_tables,
    seq_lens) appending one token at position L of each sequence (L + 1 visible), within the
    allocated blocks or in a fresh spare block."""
    bs = 16
    lens = lens or [3 + 9 * i for i in range(num_seqs)]
    pg = make_paged(lens, 2, 64, bs, dtype, device=device, seed=seed, extra_blocks=num_seqs)
    bt = pg.block_tables.clone()
    used = set(bt[bt >= 0].tolist()) & set(range(pg.key_cache.shape[0]))
    free = [b for b in range(pg.key_cache.shape[0]) if b not in used]
    slots = []
    for s, L in enumerate(lens):
        if L % bs == 0:
            bt[s, L // bs] = free.pop()
        slots.append(int(bt[s, L // bs]) * bs + L % bs)
    q = random_query(num_seqs, 8, 64, dtype, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_seqs, 2, 64, generator=g).to(dtype).to(device)
    v = torch.randn(num_seqs, 2, 64, generator=g).to(dtype).to(device)
    return (q, k, v, pg.key_cache, pg.value_cache, torch.tensor(slots, device=device), bt,
            pg.seq_lens + 1)


def assert_same(a, b):
    """Bitwise equal (NaN where NaN), on any devices: compared on the CPU."""
    torch.testing.assert_close(a.cpu(), b.cpu(), equal_nan=True, atol=0, rtol=0)


def nan_caches(num_blocks, num_kv_heads, head_size, block_size, dtype, device="cpu"):
    """A key/value cache pair holding NaN in every slot."""
    kc, vc = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size, block_size, dtype,
                                         device=device)
    return kc.fill_(float("nan")), vc.fill_(float("nan"))


def check_cache_write(k, v, kc, vc, slots, *, ref_slots=None):
    """reshape_and_cache on the caches' device vs the reference, bit for bit (never vs the CPU
    kernel: on a GPU host a mismatch must point at the CUDA code). ``ref_slots``: the slots the
    reference writes (the default: ``slots``)."""
    ref_slots = slots if ref_slots is None else ref_slots
    want_k, want_v = ref.reshape_and_cache(k.cpu(), v.cpu(), kc.cpu(), vc.cpu(), ref_slots.cpu())
    paged_ops.reshape_and_cache(k, v, kc, vc, slots)
    synchronize(kc.device)
    assert_same(kc, want_k)
    assert_same(vc, want_v)


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def check_attention(pg, q, dtype, *, out=None, tol=None, **kw):
    """Attention on the query's device (decode, or several query tokens per sequence with
    ``query_start_loc``; fp8 caches with ``k_scale``/``v_scale``) vs the reference on the same
    cache contents (never vs the CPU kernel: on a GPU host a mismatch must point at the CUDA
    code). ``kw``: the op's options (``scale`` defaults to head_size ** -0.5); ``tol``: the
    tolerance (default: that of ``dtype``). Returns the output."""
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens, scale, out=out, **kw)
    synchronize(q.device)
    assert got.device == q.device and got.dtype == q.dtype and got.shape == q.shape
    if out is None:
        assert got.is_contiguous()
    assert not got.isnan().any(), "NaN from unwritten slots leaked into the output"
    kc, vc = pg.key_cache.cpu(), pg.value_cache.cpu()
    bt, sl = pg.block_tables.cpu(), pg.seq_lens.cpu()
    with one_thread():
        want = ref.attention(q.cpu(), kc, vc, bt, sl, scale, _cpu(kw.get("alibi_slopes")),
                             kw.get("sliding_window", -1), kw.get("logits_soft_cap", 0.0),
                             k_scale=_cpu(kw.get("k_scale")), v_scale=_cpu(kw.get("v_scale")),
                             query_start_loc=_cpu(kw.get("query_start_loc")))
    torch.testing.assert_close(got.cpu().float(), want.float(), **(tol or TOL[dtype]))
    return got


def per_device(cpu, cuda):
    """Parameter sets for a test whose grid differs per device: ``("cpu", *p)`` for each tuple
    ``p`` of ``cpu`` and ``("cuda", *p)`` (marked as CUDA) for each of ``cuda``."""
    return ([pytest.param("cpu", *p) for p in cpu]
            + [pytest.param("cuda", *p, marks=CUDA) for p in cuda])


def assert_same_bytes(a, b):
    """Byte-for-byte equal (compared on the CPU)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = a.view(torch.uint8) != b.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"


def nan_fp8_caches(num_blocks, num_kv_heads, head_size, block_size, dtype, device="cpu"):
    """An fp8 key/value cache pair holding NaN (0x7F in both formats) in every slot."""
    kc, vc = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size, block_size, dtype,
                                         device=device)
    kc.view(torch.uint8).fill_(0x7F)
    vc.view(torch.uint8).fill_(0x7F)
    return kc, vc


def check_fp8_write(k, v, kc, vc, slots, ks, vs):
    """An fp8 reshape_and_cache on the caches' device vs the reference: every byte equal, except
    that a NaN the reference writes may be any NaN; every other written value is finite
    (saturated). Never vs the CPU kernel: on a GPU host a mismatch must point at the CUDA code."""
    before_k, before_v = kc.cpu().clone(), vc.cpu().clone()
    want_k, want_v = ref.reshape_and_cache(k.cpu(), v.cpu(), before_k, before_v, slots.cpu(),
                                           ks.cpu(), vs.cpu())
    paged_ops.reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    synchronize(kc.device)
    for got, want, before in ((kc, want_k, before_k), (vc, want_v, before_v)):
        got = got.cpu()
        written = got.view(torch.uint8) != before.view(torch.uint8)
        written |= want.view(torch.uint8) != before.view(torch.uint8)
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        diff = (got.view(torch.uint8) != want.view(torch.uint8)) & ~(nan & written)
        assert not diff.any(), f"{int(diff.sum())} bytes differ from the reference"
        assert got.float()[written & ~nan].isfinite().all()
