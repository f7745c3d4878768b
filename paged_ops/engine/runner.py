"""The model runner of :class:`~paged_ops.engine.PagedEngine`: owns the paged caches, applies a
step's block moves, builds the step's model inputs and paged metadata from a
:class:`~paged_ops.engine.scheduler.SchedulerOutput`, runs the model once and returns the
logits rows the step asked for.

Every step is one forward pass over one packed row of ``T`` tokens (``input_ids [1, T]``):
decode rows (one token per sequence) and prompt chunks alike. Each attention layer writes the
step's keys/values into the paged cache and attends over it with ``torch.ops.paged.attention``:
in the op's decode form when every sequence has one row, else with ``query_start_loc`` (several
rows per sequence, causal). There is no ``[T, T]`` mask anywhere.
"""

from __future__ import annotations

import torch

from .._api import allocate_kv_cache, copy_blocks, swap_blocks
from ..block_manager import BlockManager
from . import cascade as _cascade
from .attention import StepContext
from .cascade import CascadePlan, plan_cascade
from .scheduler import SchedulerOutput


def _own(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` as a tensor that is not a view: torch.compile guards on the base
    of view inputs, so mixing views and non-views would recompile the model."""
    t = t.to(device)
    return t.clone() if t._base is not None else t


def _pad(t: torch.Tensor, count: int, value, dim: int = 0) -> torch.Tensor:
    """``t`` with ``count`` entries of ``value`` appended along ``dim``.

    torch.compile padding: a dimension of size 1 would be specialised (another graph), so
    compiled steps pad their token, sequence and block-table dimensions to at least 2 with
    entries that change nothing (slot -1: not written; length 0: an empty row)."""
    if count <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = count
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


class ModelRunner:
    """Forward passes of one engine over its paged caches.

    ``key_caches``/``value_caches``: one pair per layer on the model's device; with a swap pool
    ``cpu_key_caches``/``cpu_value_caches`` too. ``k_scales``/``v_scales``: fp8 scales per
    layer (``None`` otherwise); ``calibrate``: the next forward pass sets them from its
    keys/values (once). ``compile``, ``cascade``: as :class:`PagedEngine`'s arguments.
    ``native_multi_token``: whether the op takes ``query_start_loc`` on the model's device
    (else steps with several rows per sequence attend through a gathered plain-torch
    fallback, eagerly).
    """

    def __init__(self, model, block_manager: BlockManager, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 num_cpu_blocks: int, kv_cache_dtype: torch.dtype, device, dtype,
                 num_heads: int, compile, k_scales, v_scales, calibrate: bool,
                 scale_target: float, cascade: bool = True):
        self.model = model
        self.block_manager = block_manager
        self.device = device
        self.k_scales, self.v_scales = k_scales, v_scales
        self.calibrate = calibrate
        self.scale_target = scale_target
        self.cascade = cascade
        self.block_size = block_size
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        for _ in range(num_layers):
            k, v = allocate_kv_cache(num_blocks, num_kv_heads, head_dim, block_size,
                                     kv_cache_dtype, device)
            if compile:
                # Fixed shapes: no symbolic sizes (nor duck-sizing guards) for the caches.
                torch._dynamo.mark_static(k)
                torch._dynamo.mark_static(v)
            self.key_caches.append(k)
            self.value_caches.append(v)
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        if num_cpu_blocks:
            pin = device.type == "cuda"
            for _ in range(num_layers):
                k, v = allocate_kv_cache(num_cpu_blocks, num_kv_heads, head_dim, block_size,
                                         kv_cache_dtype, "cpu")
                if pin:
                    k, v = k.pin_memory(), v.pin_memory()
                self.cpu_key_caches.append(k)
                self.cpu_value_caches.append(v)

        self.native_multi_token = self._probe_multi_token(num_heads, num_kv_heads, head_dim,
                                                          block_size, kv_cache_dtype, dtype)
        self.compile = compile
        self._decode_fn = self._mixed_fn = self._forward
        self._compile_mixed = False
        if compile:
            opts = dict(compile) if isinstance(compile, dict) else {}
            opts.setdefault("dynamic", True)
            compiled = torch.compile(self._forward, **opts)
            self._decode_fn = compiled
            if compile != "decode" and self.native_multi_token:
                self._mixed_fn = compiled
                self._compile_mixed = True

    def _probe_multi_token(self, num_heads, num_kv_heads, head_dim, block_size,
                           kv_cache_dtype, dtype) -> bool:
        """Whether ``torch.ops.paged.attention`` takes ``query_start_loc`` on the model's
        device: always on the CPU; elsewhere tried once on a one-block cache."""
        if self.device.type == "cpu":
            return True
        dev = self.device
        k, v = allocate_kv_cache(1, num_kv_heads, head_dim, block_size, kv_cache_dtype, dev)
        k.view(torch.uint8).zero_()
        v.view(torch.uint8).zero_()
        q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=dev)
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

    # ------------------------------------------------------------------ block moves
    def apply_block_ops(self, ops: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """Apply a step's swaps and copy-on-write copies, in the scheduler's order."""
        bm = self.block_manager
        for kind, pairs in ops:
            if kind == "copy":
                copy_blocks(self.key_caches, self.value_caches,
                            bm.block_mapping_tensor(pairs, self.device))
                continue
            m = bm.block_mapping_tensor(pairs)
            if kind == "swap_out":
                src_k, src_v = self.key_caches, self.value_caches
                dst_k, dst_v = self.cpu_key_caches, self.cpu_value_caches
            else:
                src_k, src_v = self.cpu_key_caches, self.cpu_value_caches
                dst_k, dst_v = self.key_caches, self.value_caches
            for s, d in zip(src_k, dst_k, strict=True):
                swap_blocks(s, d, m)
            for s, d in zip(src_v, dst_v, strict=True):
                swap_blocks(s, d, m)

    # ------------------------------------------------------------------ the forward pass
    def _forward(self, input_ids, position_ids, logits_to_keep, ctx):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logits_to_keep, paged_ctx=ctx)
        return out.logits

    def _scale_kwargs(self) -> dict:
        if self.k_scales is None:
            return {}
        return dict(k_scales=self.k_scales, v_scales=self.v_scales, calibrate=self.calibrate,
                    scale_target=self.scale_target)

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Apply ``sched``'s block moves, run its one forward pass; returns the logits rows of
        its sequences with ``logits`` set, in order (``[rows, vocab]``)."""
        self.apply_block_ops(sched.block_ops)
        seqs = sched.seqs
        bm = self.block_manager
        dev = self.device
        ids = [s.branch.seq_id for s in seqs]
        qlens = [s.end - s.start for s in seqs]
        decode = sched.is_decode_only
        tokens: list[int] = []
        positions: list[int] = []
        for s in seqs:
            b = s.branch
            if s.end - s.start == 1:
                tokens.append(b.last_token() if s.end == b.num_tokens
                              else b.token_slice(s.start, s.end)[0])
                positions.append(s.start)
            else:
                tokens.extend(b.token_slice(s.start, s.end))
                positions.extend(range(s.start, s.end))
        # Every sequence's reserved positions end with this step's rows.
        slots = bm.slot_mapping_tensor(ids, 1 if decode else qlens)
        tables = bm.block_tables_tensor(ids)
        seq_lens = [s.end for s in seqs]
        rows = [i for i, s in enumerate(seqs) if s.logits]
        compiled = self._compile_mixed or (decode and self.compile)
        gather = None
        if decode:
            last = torch.tensor(rows, dtype=torch.long)
            qsl = None
            if compiled:
                # Padding sequences: token 0 at position 0, slot -1 (not written), length 0.
                pad = 2 - len(seqs)
                tokens += [0] * max(pad, 0)
                positions += [0] * max(pad, 0)
                slots = _pad(slots, pad, -1)
                tables = _pad(tables, pad, 0)
                seq_lens += [0] * max(pad, 0)
            fn = self._decode_fn
        else:
            if compiled:
                # A padding sequence of one token at position 0 (slot -1: not written) that
                # attends to position 0 of the first sequence (written by now: every
                # scheduled sequence starts at 0 or continues cached positions).
                tokens.append(0)
                positions.append(0)
                slots = _pad(slots, 1, -1)
                tables = torch.cat([tables, tables[:1]])
                seq_lens.append(1)
                qlens = qlens + [1]
            qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            last = qsl[1:].long()[rows] - 1
            if not self.native_multi_token:
                gather = [(tables[i, : bm.num_blocks_for(n)].tolist(), n, q)
                          for i, (n, q) in enumerate(zip(seq_lens, qlens, strict=True))]
            fn = self._mixed_fn
        if compiled:
            tables = _pad(tables, 2 - tables.shape[1], 0, dim=1)
            if len(last):
                last = _pad(last, 2 - len(last), int(last[-1]))
        if not len(rows):
            # No sequence completes: the model still runs (it writes the cache); one row of
            # logits is computed and dropped.
            last = torch.zeros(2 if compiled else 1, dtype=torch.long)
        cascade = None
        if decode and self.cascade and not compiled:
            plan = plan_cascade(tables, seq_lens, self.block_size, _cascade.MIN_SAVED_TOKENS)
            if plan is not None:
                cascade = CascadePlan(
                    *(_own(getattr(plan, f), dev) for f in (
                        "rows", "shared_qsl", "shared_tables", "shared_lens", "suffix_tables",
                        "suffix_lens")), saved_tokens=plan.saved_tokens)
                sched.cascade_saved_tokens = plan.saved_tokens
        input_ids = _own(torch.tensor(tokens, dtype=torch.long).view(1, -1), dev)
        position_ids = _own(torch.tensor(positions, dtype=torch.long).view(1, -1), dev)
        ctx = StepContext(sched.kind != "decode", self.key_caches, self.value_caches,
                          _own(slots, dev),
                          block_tables=_own(tables, dev),
                          seq_lens=_own(torch.tensor(seq_lens, dtype=torch.int32), dev),
                          query_start_loc=None if qsl is None else _own(qsl, dev),
                          gather=gather, cascade=cascade, **self._scale_kwargs())
        if self.calibrate:
            # Calibrating writes the scales in place: run that one step eagerly.
            logits = self._forward(input_ids, position_ids, _own(last, dev), ctx)
            self.calibrate = False
        else:
            logits = fn(input_ids, position_ids, _own(last, dev), ctx)
        return logits[0, : len(rows)]
