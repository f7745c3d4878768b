"""The scheduler of :class:`~paged_ops.engine.PagedEngine` (a mixin sharing the engine's
state): admission, preemption and swapping of :class:`~paged_ops.engine.request.SeqGroup`s.

Continuous batching: each step is either one packed prefill of newly admitted groups or one
decode step of every running sequence. Swapped-out groups come back first (FCFS); waiting
groups are admitted first come first served while the pool (minus a watermark of headroom
when others run), the seats (``max_num_seqs``) and the prefill token budget allow. When a
decode step cannot get a slot for every sequence, the most recently admitted group is
preempted: swapped to the CPU pool (``preemption_mode="swap"``; recompute when the CPU pool is
full) or freed and requeued at the front with prompt + generated tokens to recompute. A group
moves as a whole: the beams of a beam search step together.
"""

from __future__ import annotations

from .._api import copy_blocks, swap_blocks
from ..block_manager import OutOfBlocks
from .request import Branch, SeqGroup


class SchedulerMixin:
    """Admission, preemption and swap."""

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

    def _schedule(self) -> tuple[list[SeqGroup], list[int]]:
        """Swap in and admit for this step; returns the groups to prefill (their blocks
        allocated) and, per branch of them, the positions served by the prefix cache."""
        bm = self.block_manager
        st = self.stats
        running, waiting, swapped = self._running, self._waiting, self._swapped
        while swapped and (not running or self._seats_used() + swapped[0].seats
                           <= self.max_num_seqs) and self._can_swap_in(swapped[0]):
            self._swap_in(swapped.popleft())
        batch: list[SeqGroup] = []
        cached: list[int] = []
        caching = self.enable_prefix_caching
        if not swapped:
            budget = self.max_num_batched_tokens
            seats = self.max_num_seqs - self._seats_used()
            while waiting:
                group = waiting[0]
                ntok = sum(b.num_tokens for b in group.branches)
                if batch and ntok > budget:  # a longer prompt is prefilled alone
                    break
                if group.seats > seats and (batch or running):
                    break
                if not self._can_allocate(group):
                    break
                # (Conservative with prefix caching: cache hits need no new block.)
                if (batch or running) and (bm.num_free_blocks - self._group_blocks(group)
                                           < self.watermark_blocks):
                    break  # keep headroom for the running sequences' growth
                # With prefix caching this registers the new full blocks: the prefill of
                # this very step writes their K/V (a later member of the batch may hit them:
                # every layer writes the whole step's K/V before it attends).
                hits = 0
                for b in group.branches:
                    toks = b.tokens() if caching else None
                    cached.append(bm.allocate(b.seq_id, b.num_tokens, toks))
                    hits += cached[-1]
                waiting.popleft()
                batch.append(group)
                budget -= ntok - hits
                seats -= group.seats
        if waiting:
            st.deferred_admissions += 1  # a request had to wait for blocks (or a seat)
        return batch, cached

    def _seats_used(self) -> int:
        return sum(len(g.branches) for g in self._running)

    def _reserve_decode_slots(self) -> list[Branch]:
        """A slot for the next token of every running sequence, preempting the most recently
        admitted groups until they fit; applies the copy-on-write copies. Returns the
        running sequences in order."""
        bm = self.block_manager
        running = self._running
        while True:
            branches = [b for g in running for b in g.branches]
            try:
                if self.enable_prefix_caching:
                    # The token of each new position: blocks it fills get registered (its
                    # K/V is written by this step's forward).
                    cow = bm.append_slots_batch([b.seq_id for b in branches],
                                                token_ids=[[b.output[-1]] for b in branches])
                else:
                    cow = bm.append_slots_batch([b.seq_id for b in branches])
                break
            except OutOfBlocks:
                if len(running) == 1:  # cannot happen: add_request checked that a group fits
                    raise RuntimeError(
                        f"PagedEngine: {len(branches)} sequence(s) of up to "
                        f"{max(b.num_tokens for b in branches)} tokens do not fit the pool of "
                        f"{self.num_blocks} blocks") from None
                self._preempt(running.pop())  # the most recently admitted
        if cow:
            copy_blocks(self.key_caches, self.value_caches,
                        bm.block_mapping_tensor(cow, self.device))
            self.stats.cow_copies += len(cow)
        return branches

    def _swap_blocks_out(self, mapping) -> None:
        m = self.block_manager.block_mapping_tensor(mapping)
        for g, c in zip(self.key_caches, self.cpu_key_caches, strict=True):
            swap_blocks(g, c, m)
        for g, c in zip(self.value_caches, self.cpu_value_caches, strict=True):
            swap_blocks(g, c, m)

    def _preempt(self, group: SeqGroup) -> None:
        """Evict a running group (already removed from ``running``) from the GPU pool."""
        bm = self.block_manager
        st = self.stats
        st.preemptions += 1
        if self.preemption_mode == "swap":
            moved = 0
            try:
                for b in group.branches:
                    mapping = bm.swap_out(b.seq_id)
                    if mapping:  # copied now: the released GPU blocks may be reused next
                        self._swap_blocks_out(mapping)
                    moved += len(mapping)
            except OutOfBlocks:
                pass  # CPU pool full: recompute instead (the blocks moved so far are freed)
            else:
                st.swap_preemptions += 1
                st.blocks_swapped_out += moved
                self._swapped.appendleft(group)
                return
        for b in group.branches:
            bm.free(b.seq_id)
        st.recompute_preemptions += 1
        self._waiting.appendleft(group)  # prompt + output are recomputed on readmission

    def _swap_in(self, group: SeqGroup) -> None:
        bm = self.block_manager
        moved = 0
        for b in group.branches:
            mapping = bm.swap_in(b.seq_id)
            if mapping:
                m = bm.block_mapping_tensor(mapping)
                for c, g in zip(self.cpu_key_caches, self.key_caches, strict=True):
                    swap_blocks(c, g, m)
                for c, g in zip(self.cpu_value_caches, self.value_caches, strict=True):
                    swap_blocks(c, g, m)
            moved += len(mapping)
        self.stats.swap_ins += 1
        self.stats.blocks_swapped_in += moved
        self._running.append(group)
