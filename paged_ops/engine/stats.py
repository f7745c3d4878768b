"""Counters and the per-step timeline of a :class:`~paged_ops.engine.PagedEngine`, and the
code that keeps them (:class:`StatsCollector`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """One engine step, for the blocks-in-use timeline.

    ``kind``: ``"prefill"`` (prompt chunks only), ``"decode"`` (decode rows only) or
    ``"mixed"`` (both in one forward pass); ``num_tokens``: tokens fed to the model
    (``prefill_tokens`` of them computing prefill positions, ``decode_rows`` decode rows);
    ``used_blocks``: GPU blocks in use after the step; ``tail_waste_slots``: unused slots of the
    partially filled tail blocks; ``stored_tokens``: KV positions held (shared blocks once);
    ``contiguous_slots``: what a contiguous max-length reservation (prompt + max_new_tokens
    per resident sequence) would hold for the same sequences; ``running``,
    ``waiting``, ``swapped``: queue sizes after the step; ``preempted``: sequences preempted
    during the step; ``time_s``: seconds since the start. ``unshared_blocks``: blocks the
    running sequences would hold without sharing (the sum of their block-table lengths; fork
    and prefix caching make ``used_blocks`` smaller); ``beam_blocks`` /
    ``beam_unshared_blocks``: the same two figures for the beams of beam searches alone
    (distinct blocks of each beam group vs its beams as independent sequences).
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
    unshared_blocks: int = 0
    beam_blocks: int = 0
    beam_unshared_blocks: int = 0
    prefill_tokens: int = 0
    decode_rows: int = 0


@dataclass
class EngineStats:
    """Counters since the engine was created or :meth:`PagedEngine.reset_stats` (which
    :meth:`PagedEngine.generate` calls at its start).

    ``steps`` = ``prefill_steps + decode_steps``: a step that computes prompt positions counts
    as a prefill step (``mixed_steps`` of them also ran decode rows in the same forward pass).

    ``preemptions`` = ``recompute_preemptions + swap_preemptions``; ``cow_copies``: blocks
    copied on write; ``deferred_admissions``: steps that ended with requests still waiting
    (the pool, the watermark, ``max_num_seqs`` or the prefill token budget kept them out);
    ``peak_used_blocks``: most GPU blocks in use after any step; ``peak_contiguous_slots``:
    most slots a contiguous max-length reservation would have needed at any step;
    ``timeline``: one :class:`StepRecord` per step. ``peak_unshared_blocks``: most blocks
    the running sequences would have held without sharing; ``peak_beam_blocks``: most blocks
    held by beam groups at one step, and ``peak_beam_unshared_blocks`` what their beams would
    have held as independent sequences at that step. ``aborted_requests``: :meth:`abort` ed;
    ``rejected_requests``: refused by ``max_waiting_requests``. ``cascade_steps``: decode
    steps that attended shared blocks once per group of sequences (``cascade=True``);
    ``cascade_saved_tokens``: the token reads (per kv head and layer) they saved.

    ``prefill_tokens``: prefill positions computed (prompts, and prompt + generated tokens of
    sequences readmitted after a recompute preemption), in whichever steps their chunks ran;
    ``cached_prompt_tokens``: positions of admitted sequences whose K/V came from the prefix
    cache instead (not computed; 0 without ``enable_prefix_caching``). Every admission covers
    ``prefill_tokens + cached_prompt_tokens`` positions in all.
    """

    num_blocks: int = 0
    block_size: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
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
    peak_unshared_blocks: int = 0
    peak_beam_blocks: int = 0
    peak_beam_unshared_blocks: int = 0
    aborted_requests: int = 0
    rejected_requests: int = 0
    cascade_steps: int = 0
    cascade_saved_tokens: int = 0
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


class StatsCollector:
    """Keeps an engine's :class:`EngineStats`: :meth:`reset` starts afresh, :meth:`record`
    adds one step (its counters, the pool's state after it, a :class:`StepRecord`)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reset()

    def reset(self) -> EngineStats:
        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        self.t0 = time.perf_counter()
        self._preemptions_before = 0
        return self.stats

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def record(self, sched, scheduler, block_manager) -> StepRecord:
        """One step: ``sched`` its :class:`~paged_ops.engine.scheduler.SchedulerOutput`,
        ``scheduler`` (its queues after the step) and the block manager after it."""
        st = self.stats
        bm = block_manager
        bst = bm.stats()
        kind = sched.kind
        st.steps += 1
        if kind == "decode":
            st.decode_steps += 1
        else:
            st.prefill_steps += 1
            st.mixed_steps += kind == "mixed"
        prefill = sched.num_prefill_tokens
        st.prefill_tokens += prefill
        st.cached_prompt_tokens += sched.cached_tokens
        if sched.cascade_saved_tokens:
            st.cascade_steps += 1
            st.cascade_saved_tokens += sched.cascade_saved_tokens
        contiguous = unshared = beam_blocks = beam_unshared = 0
        for g in scheduler.running:
            p = g.request.params
            contiguous += len(g.branches) * (len(g.request.prompt) + p.max_new_tokens)
            # A sequence of L positions holds ceil(L / block_size) blocks.
            n = sum(bm.num_blocks_for(bm.seq_len(b.seq_id)) for b in g.branches)
            unshared += n
            if g.request.beam is not None:
                beam_unshared += n
                beam_blocks += len({x for b in g.branches for x in bm.block_table(b.seq_id)})
        running = sum(len(g.branches) for g in scheduler.running)
        rec = StepRecord(step=st.steps, kind=kind, num_tokens=sched.num_tokens,
                         used_blocks=bst.used_blocks, tail_waste_slots=bst.tail_waste_slots,
                         stored_tokens=bst.stored_tokens, contiguous_slots=contiguous,
                         running=running,
                         waiting=sum(len(g.branches) for g in scheduler.waiting),
                         swapped=sum(len(g.branches) for g in scheduler.swapped),
                         preempted=st.preemptions - self._preemptions_before,
                         time_s=self.elapsed(), unshared_blocks=unshared,
                         beam_blocks=beam_blocks, beam_unshared_blocks=beam_unshared,
                         prefill_tokens=prefill, decode_rows=sched.num_decode_rows)
        self._preemptions_before = st.preemptions
        st.timeline.append(rec)
        st.peak_used_blocks = max(st.peak_used_blocks, bst.used_blocks)
        st.peak_running = max(st.peak_running, running)
        st.peak_contiguous_slots = max(st.peak_contiguous_slots, contiguous)
        st.peak_unshared_blocks = max(st.peak_unshared_blocks, unshared)
        if beam_blocks > st.peak_beam_blocks:
            st.peak_beam_blocks, st.peak_beam_unshared_blocks = beam_blocks, beam_unshared
        st.elapsed_s = rec.time_s
        return rec
