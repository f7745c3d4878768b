"""A paged-KV-cache generation engine for Hugging Face ``transformers`` decoder-only models.

:class:`PagedEngine` runs greedy generation for many requests at once over one pool of KV-cache
blocks (seed 000 §5-§19):

* it owns a :class:`~paged_ops.block_manager.BlockManager` and one ``(key_cache, value_cache)``
  pair per layer from :func:`paged_ops.allocate_kv_cache`;
* the model is *not* re-implemented: the engine registers an attention function with
  transformers' public extension point (``AttentionInterface.register``) and switches the model
  to it (``model.set_attn_implementation``). Every forward pass gets the step's paged metadata
  (slot mapping, block tables, sequence lengths) through a ``paged_ctx`` keyword argument that
  transformers forwards to the attention function of every layer. The function writes the new
  keys/values into that layer's paged cache with ``torch.ops.paged.reshape_and_cache`` and
  computes attention: decode steps (one token per sequence) with ``torch.ops.paged.attention``
  over the paged cache; prefill steps (whole prompts, several packed into one row) with torch
  SDPA over the step's own keys/values and a block-diagonal causal mask, or, with prefix
  caching, with ``torch.ops.paged.attention`` and ``query_start_loc`` over the paged cache;
* scheduling is continuous batching: waiting requests are admitted first come first served
  whenever the pool can hold their prompt, and each step is either one packed prefill of the
  newly admitted requests or one decode step of every running sequence;
* ``n > 1`` branches per prompt share the prompt's blocks (``BlockManager.fork``); a branch that
  writes into a shared, partially filled tail block gets a private copy first (copy-on-write,
  applied with ``paged_ops.copy_blocks``);
* pool exhaustion during decode preempts the most recently admitted running sequence (seed 000
  §19): by recompute (its blocks are freed; it goes back to the front of the waiting queue with
  prompt + generated tokens as its new prompt) or, with ``num_cpu_blocks > 0`` and
  ``preemption_mode="swap"``, by swapping its blocks to a CPU pool (``paged_ops.swap_blocks``)
  and back. No generated token is ever lost;
* ``enable_prefix_caching=True`` shares the KV blocks of common prompt prefixes (seed 000
  §18): a request whose leading full blocks are already cached (by a running sequence, or a
  finished one whose blocks were not reused yet) prefills only its uncached suffix;
* ``kv_cache_dtype=torch.float8_e4m3fn`` stores the KV cache in fp8 with per-tensor scales
  (calibrated on the first prefill, or given).

Example::

    from transformers import AutoModelForCausalLM
    from paged_ops.engine import PagedEngine

    model = AutoModelForCausalLM.from_pretrained(...)
    engine = PagedEngine(model, num_blocks=512, block_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, n=2)
    outs[0][1]          # the new token ids of branch 1 of prompt 0
    engine.stats        # steps, preemptions, cow_copies, peak blocks, timeline, ...

Requires ``transformers`` (the optional ``[hf]`` extra); it is imported only when an engine is
created.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ._api import allocate_kv_cache, copy_blocks, swap_blocks
from .block_manager import BlockManager, OutOfBlocks

__all__ = ["ATTN_IMPLEMENTATION", "EngineStats", "PagedEngine", "StepRecord",
           "register_paged_attention"]

#: Name under which the paged attention function is registered with transformers.
ATTN_IMPLEMENTATION = "paged_ops"

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: ``kv_scale="auto"`` maps the amax of the first prefill's keys (values) of a layer to
#: ``finfo(fp8).max / KV_SCALE_HEADROOM``: later tokens up to this many times larger than
#: anything seen during calibration are still represented without saturating.
KV_SCALE_HEADROOM = 4.0


# --------------------------------------------------------------------------- attention hook
class _StepContext:
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
    """Multi-token paged attention in plain torch (fallback where the op lacks it, e.g. CUDA
    for now): per sequence, gather its positions ``0..L-1`` from the paged cache (dequantised
    for fp8) and run SDPA with the causal mask of its last ``q_len`` positions.

    ``query``: ``[T, H, D]``; ``seqs``: host-side ``(block ids, L, q_len)`` per sequence, in
    query order. Returns ``[T, H, D]``.
    """
    _, hkv, dx, bs, x = key_cache.shape
    d = dx * x
    group = query.shape[1] // hkv
    fp8 = key_cache.dtype in _FP8_DTYPES
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
                            paged_ctx: _StepContext | None = None, sliding_window=None,
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
            # Per-tensor scale from this step's keys/values: amax maps to fmax / headroom.
            for t, sc in ((key, k_scale), (value, v_scale)):
                amax = t.detach().abs().amax().float()
                sc.copy_(torch.where(amax > 0, amax / ctx.scale_target,
                                     torch.ones_like(amax)).reshape(sc.shape))
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


# --------------------------------------------------------------------------- stats
@dataclass
class StepRecord:
    """One engine step, for the blocks-in-use timeline.

    ``kind``: ``"prefill"`` or ``"decode"``; ``num_tokens``: tokens fed to the model;
    ``used_blocks``: GPU blocks in use after the step; ``tail_waste_slots``: unused slots of the
    partially filled tail blocks; ``stored_tokens``: KV positions held (shared blocks once);
    ``contiguous_slots``: what a contiguous max-length reservation (prompt + max_new_tokens
    per resident sequence, seed 000 §3) would hold for the same sequences; ``running``,
    ``waiting``, ``swapped``: queue sizes after the step; ``preempted``: sequences preempted
    during the step; ``time_s``: seconds since the start.
    """

    step: int
    kind: str
    num_tokens: int
    used_blocks: int
    tail_waste_slots: int
    stored_tokens: int
    contiguous_slots: int
    running: int
    waiting: int
    swapped: int
    preempted: int
    time_s: float


@dataclass
class EngineStats:
    """Counters of one :meth:`PagedEngine.generate` call (reset at its start).

    ``preemptions`` = ``recompute_preemptions + swap_preemptions``; ``cow_copies``: blocks
    copied on write; ``deferred_admissions``: steps that ended with requests still waiting
    (the pool, the watermark, ``max_num_seqs`` or the prefill token budget kept them out);
    ``peak_used_blocks``: most GPU blocks in use after any step; ``peak_contiguous_slots``:
    most slots a contiguous max-length reservation would have needed at any step;
    ``timeline``: one :class:`StepRecord` per step.

    ``prefill_tokens``: positions computed by prefill steps (prompts, and prompt + generated
    tokens of sequences readmitted after a recompute preemption); ``cached_prompt_tokens``:
    positions of admitted sequences whose K/V came from the prefix cache instead (not
    computed; 0 without ``enable_prefix_caching``). Every admission covers
    ``prefill_tokens + cached_prompt_tokens`` positions in all.
    """

    num_blocks: int = 0
    block_size: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    swap_ins: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    cow_copies: int = 0
    forks: int = 0
    deferred_admissions: int = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    peak_contiguous_slots: int = 0
    elapsed_s: float = 0.0
    timeline: list[StepRecord] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.tokens_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the admitted positions served from the prefix cache."""
        total = self.prefill_tokens + self.cached_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0

    @property
    def peak_used_slots(self) -> int:
        """Slots of the peak number of blocks in use."""
        return self.peak_used_blocks * self.block_size


# --------------------------------------------------------------------------- sequences
class _Seq:
    """One generation branch. ``tokens`` = prompt + output; the KV cache holds positions
    ``0 .. len(tokens) - 2`` between steps (the last token is the next step's input)."""

    __slots__ = ("seq_id", "request", "branch", "prompt", "output", "forks_left")

    def __init__(self, seq_id, request, branch, prompt, output, forks_left=0):
        self.seq_id = seq_id
        self.request = request
        self.branch = branch
        self.prompt = prompt
        self.output = output
        self.forks_left = forks_left

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _own(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` as a tensor that is not a view: torch.compile guards on the base
    of view inputs, so mixing views and non-views would recompile the model."""
    t = t.to(device)
    return t.clone() if t._base is not None else t


# --------------------------------------------------------------------------- engine
class PagedEngine:
    """Greedy continuous-batching generation for a transformers decoder-only model over paged KV.

    Args:
        model: a ``transformers`` causal LM whose attention layers dispatch through
            ``ALL_ATTENTION_FUNCTIONS`` and carry ``layer_idx`` (Llama, Mistral, Qwen2, ... ;
            GQA included). The engine switches it to the ``"paged_ops"`` attention
            implementation (calls outside the engine fall back to SDPA) and puts it in eval
            mode. Its device and dtype decide the caches' device and dtype.
        num_blocks: GPU (model-device) blocks in the pool.
        block_size: token slots per block.
        num_cpu_blocks: blocks of the CPU swap pool (0: no swapping).
        preemption_mode: ``"recompute"`` or ``"swap"`` (needs ``num_cpu_blocks > 0``; falls
            back to recompute when the CPU pool is full). Default: ``"swap"`` if
            ``num_cpu_blocks > 0`` else ``"recompute"``.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most prompt tokens packed into one prefill step (a longer
            prompt still runs, alone).
        watermark: fraction of the pool kept free when admitting a request while others run
            (headroom for their growth, fewer preemptions right after admission).
        compile: ``True`` wraps the model forward in ``torch.compile(dynamic=True)`` for both
            prefill and decode steps; ``"decode"`` compiles the decode steps only; a ``dict`` is
            passed to ``torch.compile`` as keyword arguments (both steps, ``dynamic=True``
            unless given).
        eos_token_id: token id(s) that end a branch; default: the model's
            ``generation_config.eos_token_id`` (``None``: stop only at ``max_new_tokens``).
        step_callback: called as ``step_callback(engine, record)`` after every step (progress
            bars). :attr:`last_step_logits` holds that step's logits.
        enable_prefix_caching: share the KV blocks of common prompt prefixes (seed 000 §18).
            The block manager registers every full block under a hash of its token ids (and
            its whole prefix); a new request (or a sequence readmitted after a recompute
            preemption) whose leading full blocks are registered, in a running sequence or
            in a finished one whose blocks are still cached (ref count 0, evicted LRU only
            when the pool needs them), reuses them and prefills only the rest: the prefill
            step then runs ``torch.ops.paged.attention`` with ``query_start_loc`` over the
            paged cache for every prefill, instead of SDPA over the step's own keys/values.
            Decode steps register the blocks they fill too. ``stats.cached_prompt_tokens``
            counts the positions served from the cache. Cached blocks outlive
            :meth:`generate`, so a later call hits blocks of an earlier one.
        kv_cache_dtype: element type of the KV caches: the model's dtype (default), or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (half or a quarter of the
            memory; stored = ``x / scale`` saturated, read = ``stored * scale``).
        kv_scale: fp8 only: the per-tensor scales. ``"auto"`` (default): one key scale and
            one value scale per layer, calibrated once, on the engine's first prefill step,
            from that step's keys/values: ``scale = amax / (finfo.max / KV_SCALE_HEADROOM)``
            (headroom 4: later values up to 4x the calibration amax still fit; fp8's
            relative precision does not depend on the scale, the headroom only moves the
            underflow threshold by two binades). The scales never change afterwards (cached
            blocks stay valid). A float, or a ``(k_scale, v_scale)`` pair, fixes the scales of
            every layer (``1.0``: store the values as they are). :attr:`k_scales` and
            :attr:`v_scales` hold the tensors.

    The pool is sized in blocks; :attr:`kv_bytes_per_block` gives the bytes one block takes
    over all layers (keys and values).
    """

    def __init__(self, model, *, num_blocks: int, block_size: int = 16,
                 num_cpu_blocks: int = 0, preemption_mode: str | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 watermark: float = 0.01,
                 compile: bool | str | dict = False, eos_token_id=...,
                 step_callback: Callable[[PagedEngine, StepRecord], None] | None = None,
                 enable_prefix_caching: bool = False,
                 kv_cache_dtype: torch.dtype | None = None,
                 kv_scale: float | tuple[float, float] | str = "auto"):
        if preemption_mode is None:
            preemption_mode = "swap" if num_cpu_blocks > 0 else "recompute"
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks <= 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.model = model
        self.config = config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.preemption_mode = preemption_mode
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = float(watermark)
        self.watermark_blocks = math.ceil(watermark * num_blocks)
        self.step_callback = step_callback

        if eos_token_id is ...:
            gen = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)

        if kv_cache_dtype is None:
            kv_cache_dtype = self.dtype
        if kv_cache_dtype != self.dtype and kv_cache_dtype not in _FP8_DTYPES:
            raise ValueError(f"kv_cache_dtype must be the model's dtype ({self.dtype}) or an "
                             f"fp8 type ({_FP8_DTYPES}), got {kv_cache_dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scale = kv_scale
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        self._calibrate = False
        self._scale_target = 1.0
        if kv_cache_dtype in _FP8_DTYPES:
            if isinstance(kv_scale, str):
                if kv_scale != "auto":
                    raise ValueError(f"kv_scale must be 'auto', a float or a pair, "
                                     f"got {kv_scale!r}")
                ks = vs = 1.0  # until the first prefill calibrates them
                self._calibrate = True
                self._scale_target = torch.finfo(kv_cache_dtype).max / KV_SCALE_HEADROOM
            elif isinstance(kv_scale, (int, float)):
                ks = vs = float(kv_scale)
            else:
                ks, vs = (float(v) for v in kv_scale)
            if not (ks > 0 and vs > 0 and math.isfinite(ks) and math.isfinite(vs)):
                raise ValueError(f"kv_scale must be positive and finite, got {kv_scale!r}")
            self.k_scales = [torch.tensor([ks], dtype=torch.float32, device=self.device)
                             for _ in range(self.num_layers)]
            self.v_scales = [torch.tensor([vs], dtype=torch.float32, device=self.device)
                             for _ in range(self.num_layers)]

        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                          enable_prefix_caching=self.enable_prefix_caching)
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        for _ in range(self.num_layers):
            k, v = allocate_kv_cache(self.num_blocks, self.num_kv_heads, self.head_dim,
                                     self.block_size, kv_cache_dtype, self.device)
            if compile:
                # Fixed shapes: no symbolic sizes (nor duck-sizing guards) for the caches.
                torch._dynamo.mark_static(k)
                torch._dynamo.mark_static(v)
            self.key_caches.append(k)
            self.value_caches.append(v)
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        if self.num_cpu_blocks:
            pin = self.device.type == "cuda"
            for _ in range(self.num_layers):
                k, v = allocate_kv_cache(self.num_cpu_blocks, self.num_kv_heads, self.head_dim,
                                         self.block_size, kv_cache_dtype, "cpu")
                if pin:
                    k, v = k.pin_memory(), v.pin_memory()
                self.cpu_key_caches.append(k)
                self.cpu_value_caches.append(v)

        register_paged_attention(ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.eval()

        # Prefix caching prefills over the paged cache with the multi-token op; where the
        # device's kernel lacks it (CUDA for now), a gathered-SDPA fallback runs (eagerly).
        self._native_multi_token = True
        if self.enable_prefix_caching:
            self._native_multi_token = self._probe_multi_token()

        self._prefill_fn = self._decode_fn = self._forward
        self._min_decode_batch = 2 if compile else 1
        self._compile_prefill = False
        if compile:
            opts = dict(compile) if isinstance(compile, dict) else {}
            opts.setdefault("dynamic", True)
            compiled = torch.compile(self._forward, **opts)
            self._decode_fn = compiled
            if compile != "decode" and self._native_multi_token:
                self._prefill_fn = compiled
                self._compile_prefill = True
        self.compile = compile
        #: ``(seqs, logits)`` of the latest step: ``seqs`` lists the ``(request, branch)`` of
        #: each logits row (prefill: one row per admitted sequence, before its forks).
        self.last_step_logits: tuple[list[tuple[int, int]], torch.Tensor] | None = None

        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        self._next_seq_id = 0

    def _probe_multi_token(self) -> bool:
        """Whether ``torch.ops.paged.attention`` takes ``query_start_loc`` on the model's
        device: always on the CPU; elsewhere tried once on a one-block cache."""
        if self.device.type == "cpu":
            return True
        dev = self.device
        k, v = allocate_kv_cache(1, self.num_kv_heads, self.head_dim, self.block_size,
                                 self.kv_cache_dtype, dev)
        k.view(torch.uint8).zero_()
        v.view(torch.uint8).zero_()
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.dtype, device=dev)
        one = torch.ones(1, dtype=torch.int32, device=dev)
        try:
            torch.ops.paged.attention(
                q, k, v, torch.zeros(1, 1, dtype=torch.int32, device=dev), one, 1.0, None, -1,
                0.0, None if self.k_scales is None else self.k_scales[0],
                None if self.v_scales is None else self.v_scales[0], None,
                torch.tensor([0, 1], dtype=torch.int32, device=dev))
        except RuntimeError:
            return False
        return True

    # ------------------------------------------------------------------ properties
    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * elem

    @property
    def capacity_tokens(self) -> int:
        """KV positions the GPU pool holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    # ------------------------------------------------------------------ model call
    def _forward(self, input_ids, position_ids, logits_to_keep, ctx):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logits_to_keep, paged_ctx=ctx)
        return out.logits

    # ------------------------------------------------------------------ public API
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int, *,
                 n: int = 1) -> list[list[list[int]]]:
        """Greedy generation for every prompt; returns ``result[i][j]``: new token ids of
        branch ``j < n`` of prompt ``i``.

        Each branch stops after ``max_new_tokens`` tokens or at an EOS token (included in its
        output). With greedy decoding every branch equals the single greedy continuation; the
        branches still run as separate sequences sharing the prompt's blocks (fork +
        copy-on-write). Requests are admitted in order as the pool allows (continuous
        batching); pool exhaustion preempts (see :class:`PagedEngine`). ``ValueError`` if a
        prompt is empty or if one branch of a request could need more positions
        (``len(prompt) + max_new_tokens - 1``) than the whole pool holds. Resets
        :attr:`stats`.
        """
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            need = len(p) + max_new_tokens - 1
            if max_new_tokens and -(-need // self.block_size) > self.num_blocks:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) with max_new_tokens={max_new_tokens} may need "
                    f"{need} KV positions = {-(-need // self.block_size)} blocks, but the pool "
                    f"has only {self.num_blocks} blocks of {self.block_size} "
                    f"({self.capacity_tokens} positions)")
        results: list[list[list[int]]] = [[[] for _ in range(n)] for _ in prompts]
        self.stats = st = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        st.prompt_tokens = sum(map(len, prompts))
        if max_new_tokens == 0 or not prompts:
            return results
        self._max_new_tokens = max_new_tokens
        self._results = results
        self._waiting: deque[_Seq] = deque()
        self._swapped: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        for i, p in enumerate(prompts):
            self._waiting.append(_Seq(self._new_id(), i, 0, p, [], forks_left=n - 1))
        self._t0 = time.perf_counter()
        self._preemptions_before = 0
        ok = False
        try:
            with torch.no_grad():
                while self._waiting or self._swapped or self._running:
                    self._step()
            ok = True
        finally:
            # Leave the pool empty whatever happened (an exception mid-run included).
            bm = self.block_manager
            for sid in bm.seq_ids():
                bm.free(sid)
            if not ok:
                # Blocks registered by the failed step may never have had their K/V written.
                bm.reset_prefix_cache()
            st.elapsed_s = time.perf_counter() - self._t0
        return results

    # ------------------------------------------------------------------ scheduler
    def _new_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _step(self) -> None:
        bm = self.block_manager
        st = self.stats
        running, waiting, swapped = self._running, self._waiting, self._swapped
        # 1. Swapped-out sequences come back first (FCFS), then waiting requests are admitted.
        while swapped and len(running) < self.max_num_seqs and bm.can_swap_in(swapped[0].seq_id):
            self._swap_in(swapped.popleft())
        batch: list[_Seq] = []
        cached: list[int] = []  # per batch member: leading positions served by the prefix cache
        caching = self.enable_prefix_caching
        if not swapped:
            budget = self.max_num_batched_tokens
            seats = self.max_num_seqs - len(running)
            while waiting:
                seq = waiting[0]
                ntok = seq.num_tokens
                toks = seq.tokens() if caching else None
                branches = 1 + seq.forks_left
                if batch and ntok > budget:  # a longer prompt is prefilled alone
                    break
                if branches > seats and (batch or running):
                    break
                if not bm.can_allocate(ntok, toks):
                    break
                # (Conservative with prefix caching: cache hits need no new block.)
                if (batch or running) and (bm.num_free_blocks - bm.num_blocks_for(ntok)
                                           < self.watermark_blocks):
                    break  # keep headroom for the running sequences' growth
                # With prefix caching this registers the new full blocks: the prefill of
                # this very step writes their K/V (a later member of the batch may hit them:
                # every layer writes the whole step's K/V before it attends).
                cached.append(bm.allocate(seq.seq_id, ntok, toks))
                waiting.popleft()
                batch.append(seq)
                budget -= ntok - cached[-1]
                seats -= branches
        if waiting:
            st.deferred_admissions += 1  # a request had to wait for blocks (or a seat)
        if batch:
            if caching:
                self._prefill_paged(batch, cached)
            else:
                self._prefill(batch)
        elif running:
            self._decode()
        else:
            raise RuntimeError(
                "PagedEngine: no request can be scheduled (waiting "
                f"{len(waiting)}, swapped {len(swapped)}, free blocks {bm.num_free_blocks})")
        self._record("prefill" if batch else "decode", self._step_tokens)

    def _record(self, kind: str, num_tokens: int) -> None:
        st = self.stats
        bst = self.block_manager.stats()
        st.steps += 1
        if kind == "prefill":
            st.prefill_steps += 1
        else:
            st.decode_steps += 1
        contiguous = sum(len(s.prompt) + self._max_new_tokens for s in self._running)
        rec = StepRecord(step=st.steps, kind=kind, num_tokens=num_tokens,
                         used_blocks=bst.used_blocks, tail_waste_slots=bst.tail_waste_slots,
                         stored_tokens=bst.stored_tokens, contiguous_slots=contiguous,
                         running=len(self._running), waiting=len(self._waiting),
                         swapped=len(self._swapped),
                         preempted=st.preemptions - self._preemptions_before,
                         time_s=time.perf_counter() - self._t0)
        self._preemptions_before = st.preemptions
        st.timeline.append(rec)
        st.peak_used_blocks = max(st.peak_used_blocks, bst.used_blocks)
        st.peak_running = max(st.peak_running, len(self._running))
        st.peak_contiguous_slots = max(st.peak_contiguous_slots, contiguous)
        st.elapsed_s = rec.time_s
        if self.step_callback is not None:
            self.step_callback(self, rec)

    def _preempt(self, seq: _Seq) -> None:
        """Evict a running sequence (already removed from ``running``) from the GPU pool."""
        bm = self.block_manager
        st = self.stats
        st.preemptions += 1
        if self.preemption_mode == "swap":
            try:
                mapping = bm.swap_out(seq.seq_id)
            except OutOfBlocks:
                pass  # CPU pool full: recompute instead
            else:
                if mapping:
                    m = bm.block_mapping_tensor(mapping)
                    for g, c in zip(self.key_caches, self.cpu_key_caches, strict=True):
                        swap_blocks(g, c, m)
                    for g, c in zip(self.value_caches, self.cpu_value_caches, strict=True):
                        swap_blocks(g, c, m)
                st.swap_preemptions += 1
                st.blocks_swapped_out += len(mapping)
                self._swapped.appendleft(seq)
                return
        bm.free(seq.seq_id)
        st.recompute_preemptions += 1
        self._waiting.appendleft(seq)  # its prompt + output is recomputed on readmission

    def _swap_in(self, seq: _Seq) -> None:
        mapping = self.block_manager.swap_in(seq.seq_id)
        if mapping:
            m = self.block_manager.block_mapping_tensor(mapping)
            for c, g in zip(self.cpu_key_caches, self.key_caches, strict=True):
                swap_blocks(c, g, m)
            for c, g in zip(self.cpu_value_caches, self.value_caches, strict=True):
                swap_blocks(c, g, m)
        self.stats.swap_ins += 1
        self.stats.blocks_swapped_in += len(mapping)
        self._running.append(seq)

    def _finish_or_keep(self, seq: _Seq) -> bool:
        """After a token was appended: free and report the branch if it is done."""
        tok = seq.output[-1]
        if len(seq.output) >= self._max_new_tokens or tok in self.eos_token_ids:
            self.block_manager.free(seq.seq_id)
            self._results[seq.request][seq.branch] = list(seq.output)
            return True
        return False

    # ------------------------------------------------------------------ forward steps
    def _prefill(self, batch: list[_Seq]) -> None:
        bm = self.block_manager
        dev = self.device
        ids = [s.seq_id for s in batch]
        lens = [s.num_tokens for s in batch]
        tokens: list[int] = []
        for s in batch:
            tokens.extend(s.tokens())
        slots = bm.slot_mapping_tensor(ids, lens)
        positions = torch.cat([torch.arange(n) for n in lens])
        last = torch.tensor(lens).cumsum(0) - 1
        segments = None
        if len(batch) > 1 or self.compile:
            segments = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lens))
        if self.compile:
            # One graph for every prefill: always packed (segments given), and never a size
            # of 1 (which torch.compile would specialise): pad with a token of its own segment
            # that is not written (slot -1), and keep the last row's logits twice.
            if len(tokens) < 2:
                tokens = tokens + [0]
                positions = torch.cat([positions, positions.new_zeros(1)])
                segments = torch.cat([segments, segments.new_full((1,), len(batch))])
                slots = torch.cat([slots, slots.new_full((1,), -1)])
            if len(last) < 2:
                last = torch.cat([last, last])
        input_ids = _own(torch.tensor(tokens, dtype=torch.long).view(1, -1), dev)
        position_ids = _own(positions.view(1, -1), dev)
        ctx = _StepContext(True, self.key_caches, self.value_caches, _own(slots, dev),
                           positions=None if segments is None else _own(positions, dev),
                           segments=None if segments is None else _own(segments, dev),
                           **self._scale_kwargs())
        logits = self._run_prefill(input_ids, position_ids, _own(last, dev), ctx)
        ntok = sum(lens)
        self.stats.prefill_tokens += ntok
        self._step_tokens = ntok
        self._after_prefill(batch, logits[0, : len(batch)])

    def _scale_kwargs(self) -> dict:
        """The fp8 scale fields of a step's context (calibration on the first prefill)."""
        if self.k_scales is None:
            return {}
        return dict(k_scales=self.k_scales, v_scales=self.v_scales, calibrate=self._calibrate,
                    scale_target=self._scale_target)

    def _run_prefill(self, input_ids, position_ids, last, ctx):
        if ctx.calibrate:
            # Calibrating writes the scales in place: run that one step eagerly.
            logits = self._forward(input_ids, position_ids, last, ctx)
            self._calibrate = False
            return logits
        return self._prefill_fn(input_ids, position_ids, last, ctx)

    def _prefill_paged(self, batch: list[_Seq], cached: list[int]) -> None:
        """Prefill with prefix caching: only the uncached suffix of each sequence (positions
        ``cached .. len-1``) is fed to the model; attention runs over the paged cache, which
        holds the cached prefix plus the K/V the step writes (multi-token paged op)."""
        bm = self.block_manager
        dev = self.device
        ids = [s.seq_id for s in batch]
        lens = [s.num_tokens for s in batch]
        qlens = [n - c for n, c in zip(lens, cached, strict=True)]
        tokens: list[int] = []
        positions: list[int] = []
        for s, c, n in zip(batch, cached, lens, strict=True):
            tokens.extend(s.tokens()[c:])
            positions.extend(range(c, n))
        slots = bm.slot_mapping_tensor(ids, qlens)
        tables = bm.block_tables_tensor(ids)
        gather = None
        if not self._native_multi_token:
            gather = [(tables[i, : bm.num_blocks_for(n)].tolist(), n, q)
                      for i, (n, q) in enumerate(zip(lens, qlens, strict=True))]
        seq_lens = list(lens)
        if self._compile_prefill:
            # One graph for every prefill, and no size of 1 for torch.compile to specialise:
            # a padding sequence of one token at position 0 (slot -1: not written) that
            # attends to position 0 of the first sequence's first block (written by now).
            tokens.append(0)
            positions.append(0)
            slots = torch.cat([slots, slots.new_full((1,), -1)])
            tables = torch.cat([tables, tables[:1]])
            if tables.shape[1] < 2:
                tables = torch.cat([tables, tables.new_zeros((tables.shape[0], 1))], dim=1)
            seq_lens.append(1)
            qlens = qlens + [1]
        qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        last = qsl[1:].long() - 1
        input_ids = _own(torch.tensor(tokens, dtype=torch.long).view(1, -1), dev)
        position_ids = _own(torch.tensor(positions, dtype=torch.long).view(1, -1), dev)
        ctx = _StepContext(True, self.key_caches, self.value_caches, _own(slots, dev),
                           block_tables=_own(tables, dev),
                           seq_lens=_own(torch.tensor(seq_lens, dtype=torch.int32), dev),
                           query_start_loc=_own(qsl, dev), gather=gather,
                           **self._scale_kwargs())
        logits = self._run_prefill(input_ids, position_ids, _own(last, dev), ctx)
        st = self.stats
        ntok = sum(lens) - sum(cached)
        st.prefill_tokens += ntok
        st.cached_prompt_tokens += sum(cached)
        self._step_tokens = ntok
        self._after_prefill(batch, logits[0, : len(batch)])

    def _after_prefill(self, batch: list[_Seq], logits: torch.Tensor) -> None:
        """Append each sequence's first token (``logits``: one row per sequence), fork its
        branches, and move them to ``running`` (or finish them)."""
        bm = self.block_manager
        self.last_step_logits = ([(s.request, s.branch) for s in batch], logits)
        next_tokens = logits.argmax(-1).tolist()
        st = self.stats
        for seq, tok in zip(batch, next_tokens, strict=True):
            seq.output.append(tok)
            st.tokens_generated += 1
            branches = [seq]
            for _ in range(seq.forks_left):
                child = _Seq(self._new_id(), seq.request, len(branches), seq.prompt,
                             list(seq.output))
                bm.fork(seq.seq_id, child.seq_id)
                st.forks += 1
                st.tokens_generated += 1
                branches.append(child)
            seq.forks_left = 0
            for b in branches:
                if not self._finish_or_keep(b):
                    self._running.append(b)

    def _decode(self) -> None:
        bm = self.block_manager
        dev = self.device
        running = self._running
        while True:
            try:
                if self.enable_prefix_caching:
                    # The token of each new position: blocks it fills get registered (its
                    # K/V is written by this step's forward).
                    cow = bm.append_slots_batch([s.seq_id for s in running],
                                                token_ids=[[s.output[-1]] for s in running])
                else:
                    cow = bm.append_slots_batch([s.seq_id for s in running])
                break
            except OutOfBlocks:
                if len(running) == 1:  # cannot happen: generate() checked that one branch fits
                    raise RuntimeError(
                        f"PagedEngine: sequence of {running[0].num_tokens} tokens does not fit "
                        f"the pool of {self.num_blocks} blocks") from None
                self._preempt(running.pop())  # the most recently admitted
        if cow:
            copy_blocks(self.key_caches, self.value_caches, bm.block_mapping_tensor(cow, dev))
            self.stats.cow_copies += len(cow)
        ids = [s.seq_id for s in running]
        toks = [s.output[-1] for s in running]
        pos = [s.num_tokens - 1 for s in running]
        slots = bm.slot_mapping_tensor(ids, 1)
        tables = bm.block_tables_tensor(ids)
        lens = bm.seq_lens_tensor(ids)
        if tables.shape[1] < self._min_decode_batch:
            # Compiled decode: a size of 1 would be specialised (another graph); table entries
            # past a sequence's last block are ignored by the op.
            tables = torch.cat([tables, tables.new_zeros((len(ids), 1))], dim=1)
        pad = self._min_decode_batch - len(running)
        if pad > 0:
            # Likewise for a batch of 1: pad with empty rows: token 0 at position 0, slot -1
            # (not written), length 0 (zero output row).
            toks += [0] * pad
            pos += [0] * pad
            slots = torch.cat([slots, slots.new_full((pad,), -1)])
            tables = torch.cat([tables, tables.new_zeros((pad, tables.shape[1]))])
            lens = torch.cat([lens, lens.new_zeros(pad)])
        input_ids = torch.tensor(toks, dtype=torch.long).view(-1, 1)
        position_ids = torch.tensor(pos, dtype=torch.long).view(-1, 1)
        ctx = _StepContext(False, self.key_caches, self.value_caches, _own(slots, dev),
                           block_tables=_own(tables, dev), seq_lens=_own(lens, dev),
                           **self._scale_kwargs())
        input_ids, position_ids = _own(input_ids, dev), _own(position_ids, dev)
        logits = self._decode_fn(input_ids, position_ids, 0, ctx)
        logits = logits[: len(running), -1]
        self.last_step_logits = ([(s.request, s.branch) for s in running], logits)
        next_tokens = logits.argmax(-1).tolist()
        self._step_tokens = len(running)
        keep = []
        for seq, tok in zip(running, next_tokens, strict=True):
            seq.output.append(tok)
            self.stats.tokens_generated += 1
            if not self._finish_or_keep(seq):
                keep.append(seq)
        self._running[:] = keep

