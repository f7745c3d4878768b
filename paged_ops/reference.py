"""Reference implementations of the paged ops in plain PyTorch: the executable spec.

Written from the contract (docs/design.md, sections 2-3) as simply as possible (Python loops
over sequences and tokens, fp32 math), and sharing no code with the kernels. Every function is
pure: it returns new tensors and leaves its inputs unchanged.
"""

from __future__ import annotations

import torch


def _x(cache: torch.Tensor) -> int:
    return 16 // cache.element_size()


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype) -> bool:
    return dtype in FP8_DTYPES


def _scale_value(scale, name):
    if scale is None:
        raise ValueError(f"{name} is required for an fp8 cache")
    return scale.detach().cpu().float().reshape(())


def quantize(x, scale, dtype):
    """``round(x / scale)`` in fp8 ``dtype``: fp32 division, then saturation to the format's
    largest finite value (+-Inf too; NaN stays NaN), then round-to-nearest-even."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize(stored, scale):
    """The value an fp8 cache entry stands for: ``stored * scale`` in fp32."""
    return stored.float() * scale


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                      v_scale=None):
    """Return copies of the caches with token ``i`` written to slot ``slot_mapping[i]``.

    fp8 caches store ``quantize(key, k_scale)`` / ``quantize(value, v_scale)``.
    """
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = value_cache.shape[3]
    x = _x(key_cache)
    fp8 = is_fp8(key_cache.dtype)
    if fp8:
        ks, vs = _scale_value(k_scale, "k_scale"), _scale_value(v_scale, "v_scale")
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, block_size)
        for h in range(key.shape[1]):
            k, v = key[i, h], value[i, h]
            if fp8:
                k, v = quantize(k, ks, key_cache.dtype), quantize(v, vs, value_cache.dtype)
            # key_cache[b, h, d // x, off, d % x] = key[i, h, d]
            key_cache[b, h, :, off, :] = k.reshape(-1, x)
            value_cache[b, h, :, off] = v
    return key_cache, value_cache


def gather_kv(key_cache, value_cache, block_table, seq_len):
    """Positions ``0..seq_len-1`` of one sequence as dense ``[seq_len, num_kv_heads, D]`` K, V."""
    block_size = value_cache.shape[3]
    ks, vs = [], []
    for p in range(seq_len):
        b = int(block_table[p // block_size])
        off = p % block_size
        ks.append(key_cache[b, :, :, off, :].reshape(key_cache.shape[1], -1))
        vs.append(value_cache[b, :, :, off])
    if not ks:
        shape = (0, value_cache.shape[1], value_cache.shape[2])
        return value_cache.new_empty(shape), value_cache.new_empty(shape)
    return torch.stack(ks), torch.stack(vs)


def dense_attention(q, k, v, scale, *, alibi_slopes=None, sliding_window=-1,
                    logits_soft_cap=0.0, return_lse=False):
    """One query token ``q [H, D]`` over dense ``k, v [L, Hkv, D]`` (the last L positions).

    With ``return_lse``: ``(out, lse)``, ``lse [H]`` the natural-log log-sum-exp of each head's
    final logits over the visible positions (``-inf`` when none is visible).
    """
    H, D = q.shape
    L, Hkv, _ = k.shape
    out = torch.zeros(H, D, dtype=torch.float32)
    lse = torch.full((H,), float("-inf"), dtype=torch.float32)
    if L == 0:
        return (out, lse) if return_lse else out
    group = H // Hkv
    pos = torch.arange(L, dtype=torch.float32)
    for h in range(H):
        kh = k[:, h // group].float()
        vh = v[:, h // group].float()
        z = scale * (kh @ q[h].float())
        if logits_soft_cap > 0:
            z = logits_soft_cap * torch.tanh(z / logits_soft_cap)
        if alibi_slopes is not None:
            z = z + float(alibi_slopes[h]) * (pos - (L - 1))
        visible = torch.ones(L, dtype=torch.bool)
        if sliding_window > 0:
            visible = pos >= L - sliding_window
        z = z[visible]
        if z.numel() == 0:
            continue
        out[h] = torch.softmax(z, dim=0) @ vh[visible]
        lse[h] = torch.logsumexp(z, dim=0)
    return (out, lse) if return_lse else out


def attention(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes=None,
              sliding_window=-1, logits_soft_cap=0.0, k_scale=None, v_scale=None,
              query_start_loc=None, causal=True):
    """Attention over the paged cache; result in the query's dtype.

    Decode (``query_start_loc`` None): row ``s`` of ``query`` is sequence ``s``'s query at its
    last position. With ``query_start_loc`` (int32 ``[num_seqs + 1]``), sequence ``s`` owns the
    rows ``[qsl[s], qsl[s+1])``, its last ``q_len`` positions: row ``j`` sits at position
    ``P = seq_lens[s] - q_len + j`` and sees positions ``p <= P`` (window and ALiBi measured
    from ``P``, exactly as decode measures them from ``L - 1``). With ``causal=False`` every
    row of sequence ``s`` sits at ``P = L - 1``: it sees all ``L`` positions. fp8 caches are
    read as ``stored * scale``.
    """
    return attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens, scale,
                              alibi_slopes, sliding_window, logits_soft_cap, k_scale, v_scale,
                              query_start_loc, causal)[0]


def attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens, scale,
                       alibi_slopes=None, sliding_window=-1, logits_soft_cap=0.0, k_scale=None,
                       v_scale=None, query_start_loc=None, causal=True):
    """:func:`attention` and the fp32 ``[num_query_tokens, num_heads]`` log-sum-exp of each
    row's final logits (after scale, soft cap and ALiBi, over its visible positions; natural
    log; ``-inf`` for a row that sees no position, whose output is zeros)."""
    kc, vc = key_cache.cpu(), value_cache.cpu()
    fp8 = is_fp8(kc.dtype)
    if fp8:
        ks, vs = _scale_value(k_scale, "k_scale"), _scale_value(v_scale, "v_scale")
    out = torch.empty(query.shape, dtype=torch.float32)
    lse = torch.empty(query.shape[:2], dtype=torch.float32)
    num_seqs = query.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    for s in range(num_seqs):
        L = int(seq_lens[s])
        k, v = gather_kv(kc, vc, block_tables[s].cpu(), L)
        if fp8:
            k, v = dequantize(k, ks), dequantize(v, vs)
        kw = dict(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                  logits_soft_cap=logits_soft_cap)
        if query_start_loc is None:
            out[s], lse[s] = dense_attention(query[s].cpu(), k, v, scale, return_lse=True, **kw)
            continue
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len = end - start
        for j in range(q_len):
            P = L - q_len + j if causal else L - 1  # this row's position: it sees 0..P
            out[start + j], lse[start + j] = dense_attention(
                query[start + j].cpu(), k[:P + 1], v[:P + 1], scale, return_lse=True, **kw)
    return out.to(dtype=query.dtype, device=query.device), lse.to(query.device)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """The attention over the union of two disjoint key sets from the attentions over each:
    ``lse = log(e^lse_a + e^lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``
    in fp32, ``out`` in the inputs' dtype. A side with ``lse = -inf`` contributes nothing;
    both ``-inf`` gives zeros and ``-inf``."""
    a, b = lse_a.float().cpu(), lse_b.float().cpu()
    lse = torch.logaddexp(a, b)
    none = torch.isneginf(lse)
    safe = torch.where(none, torch.zeros_like(lse), lse)
    wa = torch.where(torch.isneginf(a), torch.zeros_like(a), torch.exp(a - safe))
    wb = torch.where(torch.isneginf(b), torch.zeros_like(b), torch.exp(b - safe))
    oa = torch.where(torch.isneginf(a)[..., None], 0.0, wa[..., None] * out_a.float().cpu())
    ob = torch.where(torch.isneginf(b)[..., None], 0.0, wb[..., None] * out_b.float().cpu())
    out = oa + ob
    return out.to(dtype=out_a.dtype, device=out_a.device), lse.to(out_a.device)


def copy_blocks(key_caches, value_caches, block_mapping):
    """Return copies of every layer's caches with block ``dst`` := block ``src``."""
    key_caches = [k.clone() for k in key_caches]
    value_caches = [v.clone() for v in value_caches]
    for src, dst in block_mapping.tolist():
        for kc, vc in zip(key_caches, value_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]
    return key_caches, value_caches


def swap_blocks(src, dst, block_mapping):
    """Return a copy of ``dst`` with block ``d`` := ``src`` block ``s`` for each row (s, d)."""
    dst = dst.clone()
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)
    return dst
