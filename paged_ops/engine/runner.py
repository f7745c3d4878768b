"""The step runner: builds one step's model inputs and paged metadata, runs the model, and
returns one row of last-position logits per sequence. A mixin of
:class:`~paged_ops.engine.PagedEngine` (it shares the engine's caches, block manager and
compiled functions)."""

from __future__ import annotations

import torch

from .attention import StepContext
from .request import Branch


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


class StepRunnerMixin:
    """Prefill and decode forward passes of :class:`~paged_ops.engine.PagedEngine`."""

    def _forward(self, input_ids, position_ids, logits_to_keep, ctx):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logits_to_keep, paged_ctx=ctx)
        return out.logits

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

    def _prefill(self, batch: list[Branch]) -> torch.Tensor:
        """Prefill whole sequences (their blocks allocated), packed into one row; attention
        over the step's own keys/values (SDPA). Returns ``[len(batch), V]`` logits."""
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
            # One graph for every prefill: always packed (segments given); a lone token gets a
            # padding token of its own segment, and a lone row's logits are kept twice.
            pad = 2 - len(tokens)
            tokens = tokens + [0] * max(pad, 0)
            positions = _pad(positions, pad, 0)
            segments = _pad(segments, pad, len(batch))
            slots = _pad(slots, pad, -1)
            last = _pad(last, 2 - len(last), int(last[-1]))
        input_ids = _own(torch.tensor(tokens, dtype=torch.long).view(1, -1), dev)
        position_ids = _own(positions.view(1, -1), dev)
        ctx = StepContext(True, self.key_caches, self.value_caches, _own(slots, dev),
                          positions=None if segments is None else _own(positions, dev),
                          segments=None if segments is None else _own(segments, dev),
                          **self._scale_kwargs())
        logits = self._run_prefill(input_ids, position_ids, _own(last, dev), ctx)
        ntok = sum(lens)
        self.stats.prefill_tokens += ntok
        self._step_tokens = ntok
        return logits[0, : len(batch)]

    def _prefill_paged(self, batch: list[Branch], cached: list[int]) -> torch.Tensor:
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
            # One graph for every prefill: a padding sequence of one token at position 0
            # (slot -1: not written) that attends to position 0 of the first sequence's
            # first block (written by now), and a table at least 2 wide.
            tokens.append(0)
            positions.append(0)
            slots = _pad(slots, 1, -1)
            tables = torch.cat([tables, tables[:1]])
            tables = _pad(tables, 2 - tables.shape[1], 0, dim=1)
            seq_lens.append(1)
            qlens = qlens + [1]
        qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        last = qsl[1:].long() - 1
        input_ids = _own(torch.tensor(tokens, dtype=torch.long).view(1, -1), dev)
        position_ids = _own(torch.tensor(positions, dtype=torch.long).view(1, -1), dev)
        ctx = StepContext(True, self.key_caches, self.value_caches, _own(slots, dev),
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
        return logits[0, : len(batch)]

    def _decode_forward(self, running: list[Branch]) -> torch.Tensor:
        """One decode step (every sequence's slot already appended): feeds each sequence's
        last token; returns ``[len(running), V]`` logits."""
        bm = self.block_manager
        dev = self.device
        ids = [s.seq_id for s in running]
        toks = [s.output[-1] for s in running]
        pos = [s.num_tokens - 1 for s in running]
        slots = bm.slot_mapping_tensor(ids, 1)
        tables = bm.block_tables_tensor(ids)
        lens = bm.seq_lens_tensor(ids)
        # Compiled decode: table entries past a sequence's last block are ignored by the op;
        # padding rows are token 0 at position 0, slot -1 (not written), length 0.
        tables = _pad(tables, self._min_decode_batch - tables.shape[1], 0, dim=1)
        pad = self._min_decode_batch - len(running)
        if pad > 0:
            toks += [0] * pad
            pos += [0] * pad
            slots = _pad(slots, pad, -1)
            tables = _pad(tables, pad, 0)
            lens = _pad(lens, pad, 0)
        input_ids = torch.tensor(toks, dtype=torch.long).view(-1, 1)
        position_ids = torch.tensor(pos, dtype=torch.long).view(-1, 1)
        ctx = StepContext(False, self.key_caches, self.value_caches, _own(slots, dev),
                          block_tables=_own(tables, dev), seq_lens=_own(lens, dev),
                          **self._scale_kwargs())
        input_ids, position_ids = _own(input_ids, dev), _own(position_ids, dev)
        logits = self._decode_fn(input_ids, position_ids, 0, ctx)
        self._step_tokens = len(running)
        return logits[: len(running), -1]
