"""Documented Python wrappers of the ``torch.ops.paged`` ops (docs/design.md, section 3)."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch

__all__ = [
    "advise_huge_pages",
    "allocate_kv_cache",
    "copy_blocks",
    "merge_attention_states",
    "paged_attention",
    "paged_attention_with_lse",
    "reshape_and_cache",
    "swap_blocks",
]


def cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector of ``dtype``: the ``x`` of the 5D key-cache layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside a CPU tensor's memory with transparent
    huge pages (``madvise(MADV_HUGEPAGE)``); returns whether the advice was taken. Pages
    touched before the call keep their 4 KiB pages, so call it on fresh memory
    (``torch.empty``). Attention reads cache blocks scattered over the whole cache: with 4 KiB
    pages nearly every block starts with a TLB miss (a two-level page walk in a VM), and the
    hardware prefetchers stop at each page's end."""
    global _madvise
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    try:
        start = t.data_ptr()
        nbytes = t.untyped_storage().nbytes()
    except RuntimeError:  # fake or meta tensors: no memory
        return False
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            fn = False
        else:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        _madvise = fn
    return bool(_madvise) and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def allocate_kv_cache(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                      dtype: torch.dtype = torch.float16,
                      device: torch.device | str = "cpu", *,
                      huge_pages: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate one layer's paged KV cache in the layouts of docs/design.md, section 2.

    Returns ``(key_cache, value_cache)`` of shapes
    ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` and
    ``[num_blocks, num_kv_heads, head_size, block_size]`` with ``x = 16 // element_size``.
    The memory is uninitialised: slots that were never written are never read by the ops.
    On the CPU (Linux), ``huge_pages`` backs the caches with transparent huge pages where the
    system allows them (:func:`advise_huge_pages`).
    """
    x = cache_x(dtype)
    for name, v in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size), ("block_size", block_size)):
        if not isinstance(v, int) or v < (0 if name == "num_blocks" else 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if head_size % x:
        raise ValueError(f"head_size ({head_size}) must be a multiple of x = {x} for {dtype}")
    key_cache = torch.empty((num_blocks, num_kv_heads, head_size // x, block_size, x),
                            dtype=dtype, device=device)
    value_cache = torch.empty((num_blocks, num_kv_heads, head_size, block_size),
                              dtype=dtype, device=device)
    if huge_pages:
        advise_huge_pages(key_cache)
        advise_huge_pages(value_cache)
    return key_cache, value_cache


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float | None = None, *, alibi_slopes: torch.Tensor | None = None,
                    sliding_window: int = -1, logits_soft_cap: float = 0.0,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    max_seq_len: int | None = None,
                    query_start_loc: torch.Tensor | None = None, causal: bool = True,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of new query tokens over a paged KV cache (decode: one token per sequence).

    Args:
        query: ``[num_seqs, num_heads, head_size]`` (decode) or, with ``query_start_loc``,
            ``[total_query_tokens, num_heads, head_size]``; last dim contiguous.
        key_cache, value_cache: the caches (layouts: docs/design.md, section 2).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entry ``b`` of row ``s`` is the
            physical block holding positions ``b * block_size ...`` of sequence ``s``.
        seq_lens: int32 ``[num_seqs]``: how many cached positions each sequence attends to.
        scale: logit scale; defaults to ``head_size ** -0.5``.
        alibi_slopes: optional fp32 ``[num_heads]``: adds ``slope * (p - (L - 1))``.
        sliding_window: ``> 0`` restricts attention to the last ``sliding_window`` positions.
        logits_soft_cap: ``> 0`` maps logits through ``cap * tanh(z / cap)``.
        k_scale, v_scale: fp32 one-element scales of fp8 caches.
        max_seq_len: optional host-side upper bound on ``seq_lens``.
        query_start_loc: optional int32 ``[num_seqs + 1]`` cumulative offsets: sequence ``s``
            owns query rows ``[qsl[s], qsl[s+1])``, its last ``q_len`` positions; row ``j`` at
            position ``P = seq_lens[s] - q_len + j`` attends causally to positions ``p <= P``
            (chunked prefill, prefix-cache hits, speculative verification).
        causal: with ``query_start_loc``, ``False`` lets every row of sequence ``s`` see all
            ``seq_lens[s]`` positions (window and ALiBi measured from ``seq_lens[s] - 1``): a
            group of queries attending a shared prefix in one pass.
        out: optional output tensor (``attention_out``); otherwise a new one is returned.

    Returns:
        A tensor of the query's shape and dtype (``out`` when given).
    """
    if scale is None:
        scale = query.shape[-1] ** -0.5
    args = (query, key_cache, value_cache, block_tables, seq_lens, float(scale), alibi_slopes,
            int(sliding_window), float(logits_soft_cap), k_scale, v_scale, max_seq_len,
            query_start_loc, bool(causal))
    if out is None:
        return torch.ops.paged.attention(*args)
    torch.ops.paged.attention_out(out, *args)
    return out


def paged_attention_with_lse(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float | None = None, *,
                             alibi_slopes: torch.Tensor | None = None, sliding_window: int = -1,
                             logits_soft_cap: float = 0.0, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None, max_seq_len: int | None = None,
                             query_start_loc: torch.Tensor | None = None,
                             causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` and each row's log-sum-exp: ``(out, lse)``.

    ``lse`` is fp32 ``[num_query_tokens, num_heads]``: the natural-log log-sum-exp of the row's
    final logits (after scale, soft cap and ALiBi) over its visible positions, ``-inf`` for a
    row that sees none (its output is zeros). Partial attentions over disjoint parts of a
    sequence combine exactly with :func:`merge_attention_states`.
    """
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return torch.ops.paged.attention_with_lse(
        query, key_cache, value_cache, block_tables, seq_lens, float(scale), alibi_slopes,
        int(sliding_window), float(logits_soft_cap), k_scale, v_scale, max_seq_len,
        query_start_loc, bool(causal))


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets into the attention over their union.

    ``out_a``, ``out_b``: ``[num_tokens, num_heads, head_size]`` of one float dtype;
    ``lse_a``, ``lse_b``: their fp32 ``[num_tokens, num_heads]`` log-sum-exps (from
    :func:`paged_attention_with_lse`). Returns ``(out, lse)`` with
    ``lse = log(e^lse_a + e^lse_b)`` and ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``
    (fp32 math, ``out`` in the inputs' dtype). A side whose lse is ``-inf`` contributes
    nothing; both ``-inf`` give zeros and ``-inf``.
    """
    return torch.ops.paged.merge_attention_states(out_a, lse_a, out_b, lse_b)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write new keys/values ``[num_tokens, num_kv_heads, head_size]`` into their cache slots.

    Token ``i < slot_mapping.size(0)`` goes to slot ``slot_mapping[i]`` (``block * block_size +
    offset``); a negative slot marks padding and is skipped. Rows of ``key``/``value`` beyond
    ``slot_mapping.size(0)`` are ignored.
    """
    torch.ops.paged.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                      k_scale, v_scale)


def _mapping(block_mapping, device) -> torch.Tensor:
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping
    rows = [tuple(r) for r in block_mapping]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), 2)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor | Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks ``(src, dst)`` inside every layer's caches (copy-on-write).

    ``block_mapping`` is an int64 ``[n, 2]`` tensor or a list of ``(src, dst)`` pairs. A block
    should appear at most once as a destination and never as both source and destination.
    """
    key_caches, value_caches = list(key_caches), list(value_caches)
    device = key_caches[0].device if key_caches else "cpu"
    torch.ops.paged.copy_blocks(key_caches, value_caches, _mapping(block_mapping, device))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor,
                block_mapping: torch.Tensor | Sequence[tuple[int, int]]) -> None:
    """Copy blocks ``(src_block, dst_block)`` from ``src`` to ``dst``, on any devices.

    ``src`` and ``dst`` share one block shape (dims after dim 0); ``block_mapping`` is a CPU
    int64 ``[n, 2]`` tensor or a list of pairs.
    """
    torch.ops.paged.swap_blocks(src, dst, _mapping(block_mapping, "cpu"))
