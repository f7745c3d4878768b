"""The transformers attention hook: the function every attention layer calls inside a
:class:`~paged_ops.engine.PagedEngine` step, and the per-step context it reads."""

from __future__ import annotations

import torch

from .cascade import cascade_attention
from .fp8 import FP8_DTYPES, calibrate_scales

#: Name under which the paged attention function is registered with transformers.
ATTN_IMPLEMENTATION = "paged_ops"


class StepContext:
    """What the attention function of every layer needs for one forward pass.

    ``key_caches``/``value_caches``: one paged cache per layer. ``slot_mapping``: int64 slot of
    every token of the step (in input order; ``-1``: a padding token, not written).
    ``block_tables`` (int32 ``[num_seqs, width]``) and ``seq_lens`` (int32, each sequence's
    length including this step's tokens) of the step's sequences. ``query_start_loc``: int32
    ``[num_seqs + 1]``, each sequence's rows of the packed tokens (its last ``q_len``
    positions); ``None`` when every sequence has exactly one row (the op's decode form).
    ``gather`` is ``None`` when the multi-token op runs on this device, else the host-side
    ``(block ids, seq_len, q_len)`` of each sequence for the gathered fallback.
    ``k_scales``/``v_scales``: one fp32 one-element scale tensor per layer for fp8 caches
    (``None`` otherwise); ``calibrate``: set each layer's scales from this step's keys/values
    before writing them (fp8 with ``kv_scale="auto"``, first forward pass only).
    ``cascade``: a :class:`~paged_ops.engine.cascade.CascadePlan` with device tensors (decode
    steps whose sequences share blocks, ``PagedEngine(cascade=True)``), else ``None``.
    ``is_prefill`` says whether the step computes prompt positions (informational);
    ``positions`` and ``segments`` are accepted and not read (every step attends over the
    paged cache, so no packed-sequence mask is built).
    """

    __slots__ = ("is_prefill", "key_caches", "value_caches", "slot_mapping", "block_tables",
                 "seq_lens", "positions", "segments", "query_start_loc", "gather", "k_scales",
                 "v_scales", "calibrate", "scale_target", "cascade")

    def __init__(self, is_prefill, key_caches, value_caches, slot_mapping, block_tables=None,
                 seq_lens=None, positions=None, segments=None, query_start_loc=None,
                 gather=None, k_scales=None, v_scales=None, calibrate=False, scale_target=1.0,
                 cascade=None):
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
        self.cascade = cascade


def _gathered_attention(query, key_cache, value_cache, seqs, scale, window, softcap, k_scale,
                        v_scale):
    """Multi-token paged attention in plain torch (fallback where the op rejects a multi-token
    call on the model's device): per sequence, gather its positions ``0..L-1`` from the paged
    cache (dequantised for fp8) and attend from its last ``q_len`` positions, causally, with
    the op's window and soft cap.

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
        if q_len == 0:
            continue
        idx = torch.tensor(blocks, dtype=torch.long, device=query.device)
        k = key_cache[idx].permute(0, 3, 1, 2, 4).reshape(-1, hkv, d)[:L]
        v = value_cache[idx].permute(0, 3, 1, 2).reshape(-1, hkv, d)[:L]
        if fp8:
            k, v = k.float() * k_scale, v.float() * v_scale
        k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        q = query[start:start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        z = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap > 0:
            z = softcap * torch.tanh(z / softcap)
        pq = torch.arange(L - q_len, L, device=query.device)[:, None]
        pk = torch.arange(L, device=query.device)[None, :]
        visible = pk <= pq
        if window > 0:
            visible = visible & (pq - pk < window)
        z = z.masked_fill(~visible, float("-inf"))
        out = torch.matmul(z.softmax(-1), v)
        outs.append(out.transpose(0, 1).to(query.dtype))
        start += q_len
    return torch.cat(outs)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged_ctx: StepContext | None = None, sliding_window=None,
                            softcap=None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers as ``"paged_ops"``.

    Called by each attention layer with ``query [B, H, q_len, D]``, ``key``/``value``
    ``[B, Hkv, q_len, D]`` (after RoPE) and ``module.layer_idx``; returns
    ``(attn_output [B, q_len, H, D], None)``. With a ``paged_ctx`` (set by
    :class:`PagedEngine`: one packed row, ``B == 1``) it writes every token's key/value into
    layer ``module.layer_idx``'s paged cache, then attends over the cache with
    ``torch.ops.paged.attention``: one query row per sequence (decode form) or, with
    ``paged_ctx.query_start_loc``, several causal rows per sequence (prompt chunks, mixed
    with decode rows). Decode steps with a ``paged_ctx.cascade`` attend the blocks their
    sequences share once per group (:mod:`paged_ops.engine.cascade`). The layer's
    ``sliding_window`` and ``softcap`` (Gemma 2 style logit soft capping) go to the op; fp8
    caches get ``paged_ctx``'s per-layer scales. Without ``paged_ctx`` (the model called
    outside the engine, e.g. by ``model.generate``) it falls back to transformers' SDPA
    attention. Attention sinks (``s_aux``) are not supported.
    """
    if paged_ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        if softcap is not None:
            kwargs["softcap"] = softcap
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("paged_ops attention: attention sinks (s_aux) not supported")
    ctx = paged_ctx
    layer = module.layer_idx
    key_cache, value_cache = ctx.key_caches[layer], ctx.value_caches[layer]
    b, h, q_len, d = query.shape
    scale = float(scaling) if scaling is not None else d ** -0.5
    window = int(sliding_window) if sliding_window else -1
    cap = float(softcap) if softcap else 0.0
    k_scale = v_scale = None
    if ctx.k_scales is not None:
        k_scale, v_scale = ctx.k_scales[layer], ctx.v_scales[layer]
        if ctx.calibrate:
            calibrate_scales(key, value, k_scale, v_scale, ctx.scale_target)
    # Token-major views: [B * q_len, heads, D] (the op reads any row stride of keys/values).
    k_tok = key.transpose(1, 2).reshape(b * q_len, key.shape[1], d)
    v_tok = value.transpose(1, 2).reshape(b * q_len, value.shape[1], d)
    torch.ops.paged.reshape_and_cache(k_tok, v_tok, key_cache, value_cache, ctx.slot_mapping,
                                      k_scale, v_scale)
    q_tok = query.transpose(1, 2).reshape(b * q_len, h, d).contiguous()
    if ctx.cascade is not None and window <= 0:
        # A window would be measured from the shifted positions of the cascade's parts.
        out = cascade_attention(q_tok, key_cache, value_cache, ctx.cascade, scale, cap,
                                k_scale, v_scale)
    elif ctx.gather is not None:
        out = _gathered_attention(q_tok, key_cache, value_cache, ctx.gather, scale, window,
                                  cap, k_scale, v_scale)
    else:
        out = torch.ops.paged.attention(q_tok, key_cache, value_cache, ctx.block_tables,
                                        ctx.seq_lens, scale, None, window, cap, k_scale,
                                        v_scale, None, ctx.query_start_loc)
    return out.view(b, q_len, h, d), None


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
