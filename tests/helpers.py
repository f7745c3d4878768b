"""Shared test fixtures-by-hand: paged caches with scattered blocks, NaN in every unwritten slot
and junk in unused block-table entries, plus the dense K/V each sequence was written with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import paged_ops

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
