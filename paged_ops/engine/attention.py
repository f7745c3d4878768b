"""The transformers attention hook: the function every attention layer calls inside a
:class:`~paged_ops.engine.PagedEngine` step, and the per-step context it reads."""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPES, calibrate_scales

#: Name under which the paged attention function is registered with transformers.
ATTN_IMPLEMENTATION = "paged_ops"


class StepContext:
    """What the attention function of every layer needs for one forward pass.

    ``key_caches``/``value_caches``: one paged cache per layer. ``slot_mapping``: int64 slot of
    every token of the step (in input order). Decode: ``block_tables`` (int32
    ``[num_seqs, width]``) and ``seq_lens`` (int32, lengths including the new token). SDPA
    prefill: ``positions`` and ``segments`` (int64 ``[num_tokens]``, position in its sequence
    and index of its sequence) when several sequences are packed (and always under
    torch.compile), else ``None`` (plain causal). Paged prefill (prefix caching): also
    ``block_tables``, ``seq_lens`` and ``query_start_loc`` (int32 ``[num_seqs + 1]``): each
    sequence's query rows are its last ``q_len`` positions, attended over the paged cache;
    ``gather`` is ``None`` when the multi-token op runs on this device, else the host-side
    ``(block ids, seq_len, q_len)`` of each sequence for the gathered-SDPA fallback.
    ``k_scales``/``v_scales``: one fp32 one-element scale tensor per layer for fp8 caches
    (``None`` otherwise); ``calibrate``: set each layer's scales from this step's keys/values
    before writing them (fp8 with ``kv_scale="auto"``, first prefill only).
    """

    __slots__ = ("is_prefill", "key_caches", "value_caches", "slot_mapping", "block_tables",
                 "seq_lens", "positions", "segments", "query_start_loc", "gather", "k_scales",
                 "v_scales", "calibrate", "scale_target")

    def __init__(self, is_prefill, key_caches, value_caches, slot_mapping, block_tables=None,
                 seq_lens=None, positions=None, segments=None, query_start_loc=None,
                 gather=None, k_scales=None, v_scales=None, calibrate=False, scale_target=1.0):
        self.is_prefill = is_prefill
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.positions = positions
        self.segments = segments
        self.query_start_loc = query_start_loc
        self.gather = gather
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.calibrate = calibrate
        self.scale_target = scale_target


def _gathered_attention(query, key_cache, value_cache, seqs, scale, window, k_scale, v_scale):
    """Multi-token paged attention in plain torch (fallback where the op rejects a multi-token
    call on the model's device): per sequence, gather its positions ``0..L-1`` from the paged
    cache (dequantised for fp8) and run SDPA with the causal mask of its last ``q_len`` positions.

    ``query``: ``[T, H, D]``; ``seqs``: host-side ``(block ids, L, q_len)`` per sequence, in
    query order. Returns ``[T, H, D]``.
    """
    _, hkv, dx, bs, x = key_cache.shape
    d = dx * x
    group = query.shape[1] // hkv
    fp8 = key_cache.dtype in FP8_DTYPES
    outs = []
    start = 0
    for blocks, L, q_len in seqs:
        idx = torch.tensor(blocks, dtype=torch.long, device=query.device)
        k = key_cache[idx].permute(0, 3, 1, 2, 4).reshape(-1, hkv, d)[:L]
        v = value_cache[idx].permute(0, 3, 1, 2).reshape(-1, hkv, d)[:L]
        if fp8:
            k, v = k.float() * k_scale, v.float() * v_scale
        k = k.to(query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.to(query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        q = query[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
        pq = torch.arange(L - q_len, L, device=query.device)[:, None]
        pk = torch.arange(L, device=query.device)[None, :]
        mask = pk <= pq
        if window > 0:
            mask = mask & (pq - pk < window)
        out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                               attn_mask=mask[None, None],
                                                               scale=scale)
        outs.append(out[0].transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged_ctx: StepContext | None = None, sliding_window=None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers as ``"paged_ops"``.

    Called by each attention layer with ``query [B, H, q_len, D]``, ``key``/``value``
    ``[B, Hkv, q_len, D]`` (after RoPE) and ``module.layer_idx``; returns
    ``(attn_output [B, q_len, H, D], None)``. With a ``paged_ctx`` (set by
    :class:`PagedEngine`) it writes ``key``/``value`` into layer ``module.layer_idx``'s paged
    cache and attends: decode (``B`` sequences, ``q_len == 1``) with
    ``torch.ops.paged.attention``; prefill (``B == 1``, one or several packed prompts) with SDPA
    over the step's own keys/values, or (prefix caching: ``paged_ctx.query_start_loc`` set)
    with ``torch.ops.paged.attention`` over the paged cache, several query tokens per
    sequence. fp8 caches get ``paged_ctx``'s per-layer scales. Without ``paged_ctx`` (the
    model called outside the engine, e.g. by ``model.generate``) it falls back to
    transformers' SDPA attention.
    """
    if paged_ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("paged_ops attention: softcap / attention sinks not supported")
    ctx = paged_ctx
    layer = module.layer_idx
    key_cache, value_cache = ctx.key_caches[layer], ctx.value_caches[layer]
    head_dim = query.shape[-1]
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    window = int(sliding_window) if sliding_window else -1
    k_scale = v_scale = None
    if ctx.k_scales is not None:
        k_scale, v_scale = ctx.k_scales[layer], ctx.v_scales[layer]
        if ctx.calibrate:
            calibrate_scales(key, value, k_scale, v_scale, ctx.scale_target)
    if not ctx.is_prefill:
        # Decode: query [B, H, 1, D] -> [B, H, D]; the new token's K/V go to its slot first.
        torch.ops.paged.reshape_and_cache(key[:, :, 0, :], value[:, :, 0, :], key_cache,
                                          value_cache, ctx.slot_mapping, k_scale, v_scale)
        out = torch.ops.paged.attention(query[:, :, 0, :], key_cache, value_cache,
                                        ctx.block_tables, ctx.seq_lens, scale, None, window,
                                        0.0, k_scale, v_scale, None)
        return out.unsqueeze(1), None
    if ctx.query_start_loc is not None:
        # Paged prefill: one row of T packed tokens, each sequence's uncached suffix. Write
        # the suffix's K/V first, then attend over the paged cache, which also holds the
        # cached prefix (several query tokens per sequence: query_start_loc).
        k_tok = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
        v_tok = value[0].transpose(0, 1).contiguous()
        torch.ops.paged.reshape_and_cache(k_tok, v_tok, key_cache, value_cache,
                                          ctx.slot_mapping, k_scale, v_scale)
        q_tok = query[0].transpose(0, 1).contiguous()  # [T, H, D]
        if ctx.gather is None:
            out = torch.ops.paged.attention(q_tok, key_cache, value_cache, ctx.block_tables,
                                            ctx.seq_lens, scale, None, window, 0.0, k_scale,
                                            v_scale, None, ctx.query_start_loc)
        else:
            out = _gathered_attention(q_tok, key_cache, value_cache, ctx.gather, scale,
                                      window, k_scale, v_scale)
        return out.unsqueeze(0), None
    # Prefill: one row of T packed tokens. Cache the keys/values, attend over the step's own.
    k_tok = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v_tok = value[0].transpose(0, 1).contiguous()
    torch.ops.paged.reshape_and_cache(k_tok, v_tok, key_cache, value_cache, ctx.slot_mapping,
                                      k_scale, v_scale)
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if ctx.segments is None and window <= 0:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value,
                                                               is_causal=True, scale=scale)
    else:
        T = query.shape[2]
        if ctx.segments is None:
            pos = torch.arange(T, device=query.device)
            mask = pos[:, None] >= pos[None, :]
        else:
            pos = ctx.positions
            seg = ctx.segments
            mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
        if window > 0:
            mask = mask & (pos[:, None] - pos[None, :] < window)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value,
                                                               attn_mask=mask[None, None],
                                                               scale=scale)
    return out.transpose(1, 2), None


def register_paged_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`paged_attention_forward` with transformers under ``name``; returns it.

    ``model.set_attn_implementation(name)`` (or ``from_pretrained(..., attn_implementation=
    name)``) then routes every attention layer through it. No attention-mask function is
    registered for ``name``, so transformers passes ``attention_mask=None`` and the function
    builds the masks it needs itself.
    """
    from transformers import AttentionInterface
    AttentionInterface.register(name, paged_attention_forward)
    return name
