"""Fake (meta) implementations of the paged ops, so torch.compile can trace them.

Each returns outputs of the right shape/dtype/device without computing anything; ops that only
mutate their arguments return nothing.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("paged::attention")
def _attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                    alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0, k_scale=None,
                    v_scale=None, max_seq_len=None, query_start_loc=None):
    torch._check(query.dim() == 3, lambda: "query must have 3 dims")
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                        alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0,
                        k_scale=None, v_scale=None, max_seq_len=None, query_start_loc=None):
    return None


@torch.library.register_fake("paged::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                            v_scale=None):
    return None


@torch.library.register_fake("paged::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping):
    return None


@torch.library.register_fake("paged::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    return None
