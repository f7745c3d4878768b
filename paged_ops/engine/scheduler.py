"""The scheduler of :class:`~paged_ops.engine.PagedEngine`: which positions of which
sequences the next forward pass computes, and the block moves that must happen first.

One step is one forward pass over a per-step token budget (``max_num_batched_tokens``), filled
in this order:

1. swapped-out groups come back first come first served, while seats and blocks allow;
2. every running sequence that is decoding gets one row (its last token); the rows always
   run and count against the budget first. When the pool cannot hold their new positions, the
   most recently admitted group is preempted (its blocks swapped to the CPU pool, or freed and
   the group requeued at the front of the waiting queue to be recomputed) until they fit;
3. running sequences part way through their prefill get their next chunk, as long as the
   budget lasts (in a step with decode rows, at most ``max_prefill_tokens_with_decodes``
   prompt tokens in all, when set: a mixed step then costs a bounded multiple of a decode
   step, so the running sequences' inter-token latency stays even while long prompts
   prefill);
4. waiting groups are admitted first come first served (not while a group is swapped out)
   while the seats (``max_num_seqs``), the pool (whole prompts, minus a watermark of headroom
   when others run) and the budget allow; each gets a first chunk of its prompt.

A prompt longer than what is left of the budget is prefilled over several steps: a sequence's
blocks are reserved chunk by chunk (``allocate`` for the first, ``append_slots`` for the
next ones), so the prefix cache registers a block only in the step that writes it. A group of
several sequences (the beams of a beam search recomputed after a preemption) is prefilled in
one step, without other prompt chunks when it exceeds the budget: its beams need their
logits together.

A group moves as a whole. A group preempted before its prefill ends is recomputed, whatever
the preemption mode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..block_manager import BlockManager, OutOfBlocks
from .request import Branch, SeqGroup


@dataclass
class ScheduledSeq:
    """Positions ``start .. end - 1`` of one sequence, computed by this step. ``logits``: the
    chunk reaches the sequence's last token, so the step returns a logits row for it;
    ``prefill``: the rows belong to the sequence's prefill (prompt, or prompt + output
    recomputed), not to decoding."""

    branch: Branch
    start: int
    end: int
    logits: bool
    prefill: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    """One step, as the runner executes it.

    ``seqs``: the scheduled sequences in row order, decode rows first, then prompt chunks.
    ``groups``: the groups whose every sequence gets a logits row this step, in the order of
    those rows (each group's rows are contiguous). ``block_ops``: ``(kind, pairs)`` to apply
    in order before the forward pass: ``"swap_in"`` (CPU -> model device), ``"swap_out"``
    (model device -> CPU) and ``"copy"`` (copy-on-write within the pool), each a list of
    ``(src, dst)`` block pairs. ``cached_tokens``: positions of the sequences admitted this
    step that the prefix cache already held.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    groups: list[SeqGroup] = field(default_factory=list)
    block_ops: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    cached_tokens: int = 0
    cascade_saved_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs if s.prefill)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for s in self.seqs if not s.prefill)

    @property
    def kind(self) -> str:
        """``"decode"`` (decode rows only), ``"prefill"`` (prefill rows only) or ``"mixed"``."""
        prefill = any(s.prefill for s in self.seqs)
        decode = any(not s.prefill for s in self.seqs)
        return "mixed" if prefill and decode else ("prefill" if prefill else "decode")

    @property
    def is_decode_only(self) -> bool:
        """Every sequence runs exactly one row (the op's decode form)."""
        return all(s.end - s.start == 1 for s in self.seqs)


class Scheduler:
    """Queues of :class:`SeqGroup` s and the decisions of each step (see the module
    docstring). It owns the block manager's bookkeeping; the data moves it decides are
    returned in :attr:`SchedulerOutput.block_ops` for the runner to apply.

    ``waiting``: groups to prefill (new requests, recompute preemptions at the front);
    ``running``: groups holding blocks, in admission order; ``swapped``: groups in the CPU
    pool. ``stats`` is the engine's :class:`~paged_ops.engine.stats.EngineStats` (counters of
    preemptions, swaps, copy-on-write copies, deferred admissions)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, watermark_blocks: int, preemption_mode: str,
                 enable_prefix_caching: bool, num_blocks: int,
                 max_prefill_tokens_with_decodes: int | None = None):
        self.block_manager = block_manager
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.preemption_mode = preemption_mode
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.waiting: deque[SeqGroup] = deque()
        self.running: list[SeqGroup] = []
        self.swapped: deque[SeqGroup] = deque()
        self.stats = None

    # ------------------------------------------------------------------ queries
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_waiting_requests(self) -> int:
        return len({id(g.request) for g in self.waiting})

    def seats_used(self) -> int:
        return sum(g.seats for g in self.running)

    def remove_request(self, req) -> list[SeqGroup]:
        """Take every group of ``req`` out of the queues; returns them."""
        groups = [g for g in (*self.waiting, *self.swapped, *self.running) if g.request is req]
        for queue in (self.waiting, self.swapped):
            keep = [g for g in queue if g.request is not req]
            queue.clear()
            queue.extend(keep)
        self.running[:] = [g for g in self.running if g.request is not req]
        return groups

    def clear(self) -> None:
        self.waiting.clear()
        self.swapped.clear()
        self.running.clear()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _decoding(group: SeqGroup) -> bool:
        """Every sequence of the group has one position left to compute (its last token)."""
        return all(b.num_computed == b.num_tokens - 1 for b in group.branches)

    def _prefix_hits(self, tokens: list[int]) -> int:
        """Leading positions of ``tokens`` whose blocks the prefix cache holds now (what
        ``allocate`` would report for the whole sequence)."""
        if not self.enable_prefix_caching:
            return 0
        bm = self.block_manager
        return len(bm._match_prefix(tokens, len(tokens))[1]) * bm.block_size

    def _group_blocks(self, group: SeqGroup) -> int:
        bm = self.block_manager
        return sum(bm.num_blocks_for(b.num_tokens) for b in group.branches)

    def _can_allocate(self, group: SeqGroup) -> bool:
        bm = self.block_manager
        if len(group.branches) == 1:
            b = group.branches[0]
            toks = b.tokens() if self.enable_prefix_caching else None
            return bm.can_allocate(b.num_tokens, toks)
        # Several sequences: without counting cache hits (fewer blocks, never more).
        return self._group_blocks(group) <= bm.num_free_blocks

    def _can_swap_in(self, group: SeqGroup) -> bool:
        bm = self.block_manager
        if len(group.branches) == 1:
            return bm.can_swap_in(group.branches[0].seq_id)
        # Every distinct CPU block needs at most one GPU block (twins and cache hits none).
        cpu = set()
        for b in group.branches:
            cpu.update(bm.cpu_block_table(b.seq_id))
        return len(cpu) <= bm.num_free_blocks

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring). Mutates the queues, the block
        manager and the sequences' ``num_computed``; the returned block ops must be applied
        before the step's forward pass writes the cache."""
        out = SchedulerOutput()
        bm = self.block_manager
        running, waiting, swapped = self.running, self.waiting, self.swapped
        caching = self.enable_prefix_caching
        while swapped and (not running or self.seats_used() + swapped[0].seats
                           <= self.max_num_seqs) and self._can_swap_in(swapped[0]):
            self._swap_in(swapped.popleft(), out)

        # Decode rows: one position each, preempting the most recently admitted groups until
        # the pool holds them all.
        while True:
            decoding = [g for g in running if self._decoding(g)]
            branches = [b for g in decoding for b in g.branches]
            try:
                if caching:
                    # The token of each new position: blocks it fills get registered (its
                    # K/V is written by this step's forward).
                    cow = bm.append_slots_batch([b.seq_id for b in branches],
                                                token_ids=[[b.last_token()] for b in branches])
                else:
                    cow = bm.append_slots_batch([b.seq_id for b in branches])
                break
            except OutOfBlocks:
                if len(running) == 1:  # cannot happen: add_request checked that a group fits
                    raise RuntimeError(
                        f"PagedEngine: {len(branches)} sequence(s) of up to "
                        f"{max(b.num_tokens for b in branches)} tokens do not fit the pool of "
                        f"{self.num_blocks} blocks") from None
                self._preempt(running.pop(), out)
        if cow:
            out.block_ops.append(("copy", cow))
            self.stats.cow_copies += len(cow)
        chunks: list[ScheduledSeq] = []
        for b in branches:
            n = b.num_tokens
            b.num_computed = n
            out.seqs.append(ScheduledSeq(b, n - 1, n, True, n <= b.prefill_len))
        out.groups.extend(decoding)
        budget = self.max_num_batched_tokens - len(branches)
        if branches and self.max_prefill_tokens_with_decodes is not None:
            budget = min(budget, self.max_prefill_tokens_with_decodes)

        # Prompt chunks of the running sequences part way through their prefill.
        scheduled = {id(g) for g in decoding}
        for group in list(running):
            if budget <= 0:
                break
            if id(group) in scheduled or group not in running:
                continue
            b = group.branches[0]  # a group being chunked has one sequence
            n = min(b.num_tokens - b.num_computed, budget)
            if not self._append_chunk(group, b, n, scheduled, out):
                continue
            scheduled.add(id(group))
            chunks.append(self._chunk(group, b, n, out))
            budget -= n

        # Admissions.
        admitted = False
        if not swapped:
            seats = self.max_num_seqs - self.seats_used()
            while waiting and budget > 0:
                group = waiting[0]
                if group.seats > seats and (running or admitted):
                    break
                if not self._can_allocate(group):
                    break
                # (Conservative with prefix caching: cache hits need no new block.)
                if (running or admitted) and (bm.num_free_blocks - self._group_blocks(group)
                                              < self.watermark_blocks):
                    break  # keep headroom for the running sequences' growth
                if len(group.branches) > 1:
                    need = sum(b.num_tokens - self._prefix_hits(b.tokens())
                               for b in group.branches)
                    if need > budget and chunks:
                        break  # a group larger than the budget is prefilled alone
                    for b in group.branches:
                        self._admit(b, b.num_tokens, out)
                        chunks.append(self._chunk(group, b, b.num_tokens - b.num_computed,
                                                   out))
                    out.groups.append(group)
                    budget -= need
                else:
                    b = group.branches[0]
                    toks = b.tokens()
                    hits = self._prefix_hits(toks)
                    n = min(b.num_tokens - hits, budget)
                    self._admit(b, hits + n, out, toks)
                    chunks.append(self._chunk(group, b, n, out))
                    budget -= n
                waiting.popleft()
                running.append(group)
                seats -= group.seats
                admitted = True
        if waiting:
            self.stats.deferred_admissions += 1  # a request had to wait (blocks, seat, budget)
        out.seqs.extend(chunks)
        return out

    @staticmethod
    def _chunk(group: SeqGroup, b: Branch, n: int, out: SchedulerOutput) -> ScheduledSeq:
        """Schedule positions ``num_computed .. num_computed + n - 1`` of ``b`` (their blocks
        reserved); a chunk that completes a one-sequence group gives the group its logits."""
        start = b.num_computed
        b.num_computed = start + n
        logits = b.num_computed == b.num_tokens
        if logits and len(group.branches) == 1:
            out.groups.append(group)
        return ScheduledSeq(b, start, start + n, logits, True)

    def _admit(self, b: Branch, num_tokens: int, out: SchedulerOutput,
               toks: list[int] | None = None) -> None:
        """Allocate the first ``num_tokens`` positions of ``b`` (a new sequence); the cached
        ones count as computed."""
        if self.enable_prefix_caching:
            toks = b.tokens() if toks is None else toks
            hits = self.block_manager.allocate(b.seq_id, num_tokens, toks[:num_tokens])
        else:
            hits = self.block_manager.allocate(b.seq_id, num_tokens)
        b.num_computed = hits
        b.prefill_len = b.num_tokens
        out.cached_tokens += hits

    def _append_chunk(self, group: SeqGroup, b: Branch, n: int, scheduled: set[int],
                      out: SchedulerOutput) -> bool:
        """Reserve ``n`` more positions of ``b``, preempting groups that are not scheduled
        yet, most recently admitted first; ``False`` when ``group`` itself was preempted."""
        bm = self.block_manager
        toks = b.token_slice(b.num_computed, b.num_computed + n) \
            if self.enable_prefix_caching else None
        while True:
            try:
                cow = bm.append_slots(b.seq_id, n, toks)
                break
            except OutOfBlocks:
                victim = next((g for g in reversed(self.running) if id(g) not in scheduled),
                              None)
                self.running.remove(victim)
                self._preempt(victim, out)
                if victim is group:
                    return False
        if cow:
            out.block_ops.append(("copy", cow))
            self.stats.cow_copies += len(cow)
        return True

    def _preempt(self, group: SeqGroup, out: SchedulerOutput) -> None:
        """Evict a running group (already removed from ``running``) from the pool."""
        bm = self.block_manager
        st = self.stats
        st.preemptions += 1
        if self.preemption_mode == "swap" and self._decoding(group):
            moved = 0
            try:
                for b in group.branches:
                    mapping = bm.swap_out(b.seq_id)
                    if mapping:  # before the released blocks are written again
                        out.block_ops.append(("swap_out", mapping))
                    moved += len(mapping)
            except OutOfBlocks:
                pass  # CPU pool full: recompute instead (the blocks moved so far are freed)
            else:
                st.swap_preemptions += 1
                st.blocks_swapped_out += moved
                self.swapped.appendleft(group)
                return
        for b in group.branches:
            bm.free(b.seq_id)
            b.num_computed = 0
        st.recompute_preemptions += 1
        self.waiting.appendleft(group)  # prompt + output are recomputed on readmission

    def _swap_in(self, group: SeqGroup, out: SchedulerOutput) -> None:
        bm = self.block_manager
        moved = 0
        for b in group.branches:
            mapping = bm.swap_in(b.seq_id)
            if mapping:
                out.block_ops.append(("swap_in", mapping))
            moved += len(mapping)
        self.stats.swap_ins += 1
        self.stats.blocks_swapped_in += moved
        self.running.append(group)
