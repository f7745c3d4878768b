"""Fake (meta) implementations of the paged ops, so torch.compile can trace them.

Each checks what the real op checks from metadata alone (ranks, shapes, dtypes, devices), with
the real op's error messages, and returns outputs of the right shape/dtype/device without
computing anything; ops that only mutate their arguments return nothing. A call the real op
would reject therefore fails while tracing, not later inside a compiled graph. What needs the
data (block ids, slots, query_start_loc values) or the backend (CUDA head sizes, alignment) is
checked by the real op only.
"""

from __future__ import annotations

import torch

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check(cond, message: str) -> None:
    torch._check(cond, lambda: message)


def _same_device(t, ref, name: str, ref_name: str) -> None:
    _check(t.device == ref.device,
           f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def _cache_pair(key_cache, value_cache, kname="key_cache", vname="value_cache"):
    """(num_blocks, num_kv_heads, head_size, block_size) of a checked key/value cache pair."""
    _check(key_cache.dim() == 5,
           f"{kname} must have 5 dims [num_blocks, num_kv_heads, head_size // x, block_size, x], "
           f"got {key_cache.dim()} dims with sizes {tuple(key_cache.shape)}")
    _check(value_cache.dim() == 4,
           f"{vname} must have 4 dims [num_blocks, num_kv_heads, head_size, block_size], got "
           f"{value_cache.dim()} dims with sizes {tuple(value_cache.shape)}")
    dt = key_cache.dtype
    _check(dt in _FLOAT or dt in _FP8,
           f"{kname} must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got {dt}")
    _check(value_cache.dtype == dt,
           f"{vname} dtype ({value_cache.dtype}) must equal {kname} dtype ({dt})")
    _same_device(value_cache, key_cache, vname, kname)
    x = 16 // key_cache.element_size()
    _check(key_cache.size(4) == x,
           f"{kname}.size(4) (x) must be 16 // element_size = {x} for {dt}, got "
           f"{key_cache.size(4)}")
    num_blocks, num_kv_heads, head_size, block_size = (
        key_cache.size(0), key_cache.size(1), key_cache.size(2) * x, key_cache.size(3))
    _check(num_kv_heads >= 1, f"{kname} must have at least one kv head")
    _check(head_size >= 1, f"{kname} must have head_size >= 1")
    _check(block_size >= 1, f"{kname} must have block_size >= 1")
    for d, what, want in ((0, "num_blocks", num_blocks), (1, "num_kv_heads", num_kv_heads),
                          (2, "head_size", head_size), (3, "block_size", block_size)):
        _check(value_cache.size(d) == want,
               f"{vname}.size({d}) ({what}) = {value_cache.size(d)} must equal {want}, as in "
               f"{kname}")
    return num_blocks, num_kv_heads, head_size, block_size


def _fp8_scales(cache_dtype, k_scale, v_scale) -> None:
    if cache_dtype in _FP8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check(s is not None, f"{name} is required for an fp8 ({cache_dtype}) cache: pass a "
                                  "float32 one-element tensor")


def _scale_tensor(s, key_cache, name: str) -> None:
    if s is None:
        return
    _check(s.dtype == torch.float32, f"{name} must be a float32 tensor, got {s.dtype}")
    _check(s.numel() == 1, f"{name} must hold exactly one element (a per-tensor scale), got "
                           f"{s.numel()} elements")
    _same_device(s, key_cache, name, "the caches")


def _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                     k_scale, v_scale, max_seq_len, query_start_loc) -> None:
    _check(query.dim() == 3, f"query must have 3 dims [num_seqs, num_heads, head_size], got "
                             f"{query.dim()} dims with sizes {tuple(query.shape)}")
    _check(query.dtype in _FLOAT, f"query must be float32, float16 or bfloat16, got "
                                  f"{query.dtype}")
    _, num_kv_heads, head_size, _ = _cache_pair(key_cache, value_cache)
    num_seqs, num_heads = query.size(0), query.size(1)
    if query_start_loc is not None:
        _check(query_start_loc.dtype == torch.int32,
               f"query_start_loc must be int32, got {query_start_loc.dtype}")
        _check(query_start_loc.dim() == 1 and query_start_loc.size(0) >= 1,
               f"query_start_loc must have shape [num_seqs + 1], got "
               f"{tuple(query_start_loc.shape)}")
        _same_device(query_start_loc, query, "query_start_loc", "query")
        num_seqs = query_start_loc.size(0) - 1
    _same_device(key_cache, query, "key_cache", "query")
    _fp8_scales(key_cache.dtype, k_scale, v_scale)
    _check(key_cache.dtype in _FP8 or key_cache.dtype == query.dtype,
           f"key_cache dtype ({key_cache.dtype}) must equal query dtype ({query.dtype}) unless "
           "the cache is fp8")
    _check(query.size(2) == head_size,
           f"query.size(2) (head_size) = {query.size(2)} must equal the caches' head_size = "
           f"{head_size} (key_cache.size(2) * key_cache.size(4))")
    _check(num_heads >= 1, "query must have at least one head")
    _check(num_heads % num_kv_heads == 0,
           f"query num_heads ({num_heads}) must be a multiple of the caches' num_kv_heads "
           f"({num_kv_heads})")
    _check(block_tables.dtype == torch.int32,
           f"block_tables must be int32, got {block_tables.dtype}")
    _check(block_tables.dim() == 2, f"block_tables must have 2 dims [num_seqs, "
                                    f"max_blocks_per_seq], got sizes {tuple(block_tables.shape)}")
    _check(block_tables.size(0) == num_seqs,
           f"block_tables.size(0) = {block_tables.size(0)} must equal num_seqs = {num_seqs}")
    _same_device(block_tables, query, "block_tables", "query")
    _check(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
    _check(seq_lens.dim() == 1 and seq_lens.size(0) == num_seqs,
           f"seq_lens must have shape [num_seqs] = [{num_seqs}], got {tuple(seq_lens.shape)}")
    _same_device(seq_lens, query, "seq_lens", "query")
    if alibi_slopes is not None:
        _check(alibi_slopes.dtype == torch.float32,
               f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        _check(alibi_slopes.dim() == 1 and alibi_slopes.size(0) == num_heads,
               f"alibi_slopes must have shape [num_heads] = [{num_heads}], got "
               f"{tuple(alibi_slopes.shape)}")
        _same_device(alibi_slopes, query, "alibi_slopes", "query")
    _scale_tensor(k_scale, key_cache, "k_scale")
    _scale_tensor(v_scale, key_cache, "v_scale")
    if max_seq_len is not None:
        _check(max_seq_len >= 0, f"max_seq_len must be >= 0, got {max_seq_len}")
    if out is not None:
        _check(out.shape == query.shape,
               f"out must have the shape of query {tuple(query.shape)}, got {tuple(out.shape)}")
        _check(out.dtype == query.dtype,
               f"out dtype ({out.dtype}) must equal query dtype ({query.dtype})")
        _same_device(out, query, "out", "query")


@torch.library.register_fake("paged::attention")
def _attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                    alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0, k_scale=None,
                    v_scale=None, max_seq_len=None, query_start_loc=None, causal=True):
    _check_attention(None, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                     k_scale, v_scale, max_seq_len, query_start_loc)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("paged::attention_with_lse")
def _attention_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                             alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0,
                             k_scale=None, v_scale=None, max_seq_len=None, query_start_loc=None,
                             causal=True):
    _check_attention(None, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                     k_scale, v_scale, max_seq_len, query_start_loc)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = query.new_empty((query.size(0), query.size(1)), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("paged::merge_attention_states")
def _merge_attention_states_fake(out_a, lse_a, out_b, lse_b):
    _check(out_a.dim() == 3, f"out_a must have 3 dims [num_tokens, num_heads, head_size], got "
                             f"{out_a.dim()} dims with sizes {tuple(out_a.shape)}")
    _check(out_a.dtype in _FLOAT, f"out_a must be float32, float16 or bfloat16, got "
                                  f"{out_a.dtype}")
    _check(out_b.shape == out_a.shape, f"out_b must have the shape of out_a "
                                       f"{tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    _check(out_b.dtype == out_a.dtype,
           f"out_b dtype ({out_b.dtype}) must equal out_a dtype ({out_a.dtype})")
    n, h = out_a.size(0), out_a.size(1)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check(lse.dtype == torch.float32, f"{name} must be float32, got {lse.dtype}")
        _check(lse.dim() == 2 and lse.size(0) == n and lse.size(1) == h,
               f"{name} must have shape [num_tokens, num_heads] = [{n}, {h}], got "
               f"{tuple(lse.shape)}")
        _same_device(lse, out_a, name, "out_a")
    _same_device(out_b, out_a, "out_b", "out_a")
    return (torch.empty_like(out_a, memory_format=torch.contiguous_format),
            lse_a.new_empty((n, h)))


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                        alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0,
                        k_scale=None, v_scale=None, max_seq_len=None, query_start_loc=None,
                        causal=True):
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                     k_scale, v_scale, max_seq_len, query_start_loc)
    return None


@torch.library.register_fake("paged::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                            v_scale=None):
    for name, t in (("key", key), ("value", value)):
        _check(t.dim() == 3, f"{name} must have 3 dims [num_tokens, num_kv_heads, head_size], "
                             f"got {t.dim()} dims with sizes {tuple(t.shape)}")
    _check(key.dtype in _FLOAT, f"key must be float32, float16 or bfloat16, got {key.dtype}")
    _check(value.dtype == key.dtype,
           f"value dtype ({value.dtype}) must equal key dtype ({key.dtype})")
    _, num_kv_heads, head_size, _ = _cache_pair(key_cache, value_cache)
    _fp8_scales(key_cache.dtype, k_scale, v_scale)
    _check(key_cache.dtype in _FP8 or key_cache.dtype == key.dtype,
           f"key_cache dtype ({key_cache.dtype}) must equal key dtype ({key.dtype}) unless the "
           "cache is fp8")
    _same_device(value, key, "value", "key")
    _same_device(key_cache, key, "key_cache", "key")
    _same_device(slot_mapping, key, "slot_mapping", "key")
    for name, t in (("key", key), ("value", value)):
        msg = (f"{name} must have shape [num_tokens, {num_kv_heads}, {head_size}] to match "
               f"the caches, got {tuple(t.shape)}")
        _check(t.size(1) == num_kv_heads, msg)
        _check(t.size(2) == head_size, msg)
    _check(slot_mapping.dtype == torch.int64,
           f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _check(slot_mapping.dim() == 1, f"slot_mapping must have 1 dim [num_tokens], got sizes "
                                    f"{tuple(slot_mapping.shape)}")
    n = slot_mapping.size(0)
    msg = (f"slot_mapping has {n} entries but key has {key.size(0)} rows and value has "
           f"{value.size(0)} (key and value need at least slot_mapping.size(0) rows)")
    _check(n <= key.size(0), msg)
    _check(n <= value.size(0), msg)
    _scale_tensor(k_scale, key_cache, "k_scale")
    _scale_tensor(v_scale, key_cache, "v_scale")
    return None


def _block_mapping(block_mapping) -> None:
    _check(block_mapping.dtype == torch.int64,
           f"block_mapping must be int64, got {block_mapping.dtype}")
    _check(block_mapping.dim() == 2 and block_mapping.size(1) == 2,
           f"block_mapping must have shape [n, 2] (rows of (src_block, dst_block)), got "
           f"{tuple(block_mapping.shape)}")


@torch.library.register_fake("paged::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping):
    _check(len(key_caches) == len(value_caches),
           f"key_caches has {len(key_caches)} tensors but value_caches has "
           f"{len(value_caches)} (one of each per layer)")
    _block_mapping(block_mapping)
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        kn, vn = f"key_caches[{i}]", f"value_caches[{i}]"
        _cache_pair(k, v, kn, vn)
        if i:
            k0 = key_caches[0]
            _check(k.dtype == k0.dtype,
                   f"{kn} dtype ({k.dtype}) must equal key_caches[0] dtype ({k0.dtype})")
            _same_device(k, k0, kn, "key_caches[0]")
            _check(k.shape == k0.shape, f"{kn} shape {tuple(k.shape)} must equal key_caches[0] "
                                        f"shape {tuple(k0.shape)}")
    return None


@torch.library.register_fake("paged::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    _check(src.dim() >= 1, "src must have a block dim (dim 0)")
    _check(dst.dim() == src.dim(),
           f"dst must have as many dims as src ({src.dim()}), got {dst.dim()}")
    _check(dst.dtype == src.dtype, f"dst dtype ({dst.dtype}) must equal src dtype ({src.dtype})")
    _check(src.shape[1:] == dst.shape[1:],
           f"src and dst must have the same block shape (every dim after dim 0); got src "
           f"{tuple(src.shape)} and dst {tuple(dst.shape)}")
    _block_mapping(block_mapping)
    _check(block_mapping.device.type == "cpu",
           f"block_mapping for swap_blocks must be a CPU tensor (the copies are issued from the "
           f"host), got {block_mapping.device}")
    return None
