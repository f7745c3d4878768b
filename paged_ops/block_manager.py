"""Host-side metadata of a paged KV cache: block tables, ref counts, CoW, prefix caching, swap.

The cache itself is a pool of ``num_blocks`` physical blocks of ``block_size`` token slots each
(``paged_ops.allocate_kv_cache``). Sequences see it through a *block table*: logical block
``i`` of a sequence (positions ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``table[i]``, so position ``p`` lives in slot ``table[p // block_size] * block_size +
p % block_size``. :class:`BlockManager` owns that metadata and turns it into
the int32/int64 tensors the ops take; it never touches the cache tensors: every method that
needs data moved returns ``(src, dst)`` block pairs for the caller to apply with
``paged_ops.copy_blocks`` (copy-on-write) or ``paged_ops.swap_blocks`` (swap).

Typical engine loop::

    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=..., enable_prefix_caching=True)
    cached = bm.allocate("r0", len(prompt), prompt)        # prefill positions cached..len-1
    slots = bm.slot_mapping_tensor(["r0"], [len(prompt) - cached])
    ...                                                     # forward, reshape_and_cache(slots)
    cow = bm.append_slots_batch(running, token_ids=[[t] for t in next_tokens])
    if cow:
        paged_ops.copy_blocks(key_caches, value_caches, bm.block_mapping_tensor(cow, dev))
    tables = bm.block_tables_tensor(running, dev)
    lens = bm.seq_lens_tensor(running, dev)
    slots = bm.slot_mapping_tensor(running)                 # the slot of each new token
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from . import block_tensors as bt
from .block_pool import BlockPool
from .prefix_hash import chain_keys

__all__ = ["BlockManager", "BlockManagerStats", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """A pool (GPU or CPU) cannot satisfy a request. The manager's state is unchanged.

    Attributes: ``needed`` and ``available`` block counts, ``pool`` (``"gpu"`` or ``"cpu"``).
    """

    def __init__(self, message: str, *, needed: int = 0, available: int = 0, pool: str = "gpu"):
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.pool = pool


@dataclass(frozen=True)
class BlockManagerStats:
    """A snapshot of pool usage (see :meth:`BlockManager.stats`).

    The GPU fields partition the pool: ``used_blocks + free_blocks + cached_blocks ==
    num_blocks``. ``used_blocks`` have ref count > 0; ``cached_blocks`` have ref count 0 but
    keep a prefix-cache entry (evictable, LRU); ``free_blocks`` hold nothing.
    ``num_seqs``/``num_tokens``/``tail_waste_slots``/``stored_tokens`` count sequences resident
    on the GPU (not swapped out); ``num_tokens`` is logical (a shared block counts once per
    sequence), ``stored_tokens`` physical (a shared block counts once), and
    ``stored_tokens + tail_waste_slots == used_blocks * block_size``.
    """

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    num_seqs: int
    num_tokens: int
    shared_blocks: int
    tail_waste_slots: int
    stored_tokens: int
    num_swapped_seqs: int
    num_cpu_blocks: int
    cpu_used_blocks: int
    cpu_free_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int

    @property
    def allocated_slots(self) -> int:
        """Slots of the blocks in use (``used_blocks * block_size``)."""
        return self.used_blocks * self.block_size

    @property
    def tail_waste_fraction(self) -> float:
        """Internal fragmentation: ``tail_waste_slots / allocated_slots`` (0 when empty)."""
        slots = self.allocated_slots
        return self.tail_waste_slots / slots if slots else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the prompt tokens offered to the prefix cache that were found there."""
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


class _SeqBlocks:
    """The blocks of one sequence: ``table`` holds GPU block ids, or CPU ids while swapped."""

    __slots__ = ("table", "length", "swapped", "keys", "pending")

    def __init__(self, table: array, length: int, keys: list | None, pending: list | None):
        self.table = table  # array('i'): cheap to copy and to turn into a tensor (tobytes)
        self.length = length
        self.swapped = False
        # Prefix caching only: keys[i] is the cache key of full block i, pending holds the
        # token ids of the positions after the last full block; pending None = token ids
        # unknown from there on, so no later block of this sequence can be registered.
        self.keys = keys
        self.pending = pending


def _as_token_list(token_ids, num_tokens: int) -> list[int] | None:
    if token_ids is None:
        return None
    if isinstance(token_ids, int):
        token_ids = [token_ids]
    elif hasattr(token_ids, "tolist"):  # torch tensors, numpy arrays
        token_ids = token_ids.tolist()
    else:
        token_ids = list(token_ids)
    if len(token_ids) != num_tokens:
        raise ValueError(f"token_ids has {len(token_ids)} entries, expected {num_tokens}")
    return token_ids


class BlockManager:
    """Block tables of the sequences in a paged KV cache, over a GPU and a CPU block pool.

    * GPU block ids are ``0 .. num_blocks-1``, CPU block ids ``0 .. num_cpu_blocks-1``; each
      pool is a :class:`~paged_ops.block_pool.BlockPool` (ref counts, a min-heap free list:
      the lowest free id is handed out first, so block ids are a deterministic function of
      the call sequence).
    * A sequence of length ``L`` owns exactly ``ceil(L / block_size)`` blocks. Blocks are shared
      by :meth:`fork` and by prefix caching; the ref count of a block is the number of block
      tables holding it. A shared block is never written: :meth:`append_slots` copies a shared,
      partially filled tail on write and returns the ``(src, dst)`` pair to apply with
      ``paged_ops.copy_blocks`` *before* the new tokens are written.
    * Every method that can fail checks first and mutates after: an :class:`OutOfBlocks`,
      ``KeyError`` or ``ValueError`` leaves the manager exactly as it was.
    * Prefix caching (``enable_prefix_caching=True``): a full block whose token ids are known
      gets the key ``(hash of parent block key, its token ids)``, so equal text after a
      different prefix never matches. Only full blocks are shared this way. Blocks are
      registered as soon as they are full (:meth:`allocate`, :meth:`append_slots` with
      ``token_ids``), so the caller must write the KV of the slots it reserved in the very next
      forward pass (a hit in the same batch is fine: ``reshape_and_cache`` runs before
      attention). When a registered block's ref count drops to 0 it is kept (evictable, LRU)
      instead of freed, and a later sequence with the same prefix chain takes it back
      (ref 0 -> 1). Allocation takes truly free blocks first and evicts the least recently
      released cached block only when none is left. :meth:`allocate` returns how many leading
      tokens are cached: a multiple of ``block_size``, at most ``num_tokens - 1`` (the block
      holding the last prompt token is always private and recomputed, so its logits exist).
    * Swap: :meth:`swap_out` / :meth:`swap_in` move a sequence between the GPU pool and a CPU
      pool of ``num_cpu_blocks`` blocks and return the ``(src, dst)`` pairs for
      ``paged_ops.swap_blocks``. A block shared by several sequences is copied once (see
      :meth:`swap_out`).

    Not thread-safe: one scheduler thread owns it.
    """

    # ------------------------------------------------------------------ construction
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ):
        """Create a manager for ``num_blocks`` GPU blocks of ``block_size`` slots.

        ``num_cpu_blocks`` sizes the CPU pool used by :meth:`swap_out` (0: no swapping).
        ``enable_prefix_caching`` turns on automatic prefix caching.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.enable_prefix_caching = bool(enable_prefix_caching)

        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._gpu = BlockPool(self.num_blocks, "GPU")
        # The swap pool. A GPU block and a CPU block holding the same data are twins: swapping
        # a block that has a twin moves a reference instead of copying data again.
        self._cpu = BlockPool(self.num_cpu_blocks, "CPU")
        self._gpu.pair(self._cpu)
        self._queried_tokens = 0
        self._hit_tokens = 0

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_cpu_blocks={self.num_cpu_blocks}, "
            f"enable_prefix_caching={self.enable_prefix_caching}, seqs={len(self._seqs)}, "
            f"free={self.num_free_blocks})"
        )

    # ------------------------------------------------------------------ small queries
    @property
    def num_free_blocks(self) -> int:
        """GPU blocks an allocation can take now: free blocks plus evictable cached blocks."""
        return self._gpu.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Ref-0 GPU blocks kept by the prefix cache (evictable)."""
        return self._gpu.num_cached

    @property
    def num_free_cpu_blocks(self) -> int:
        """Free blocks of the CPU (swap) pool."""
        return self._cpu.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_ids(self) -> list:
        """Ids of all live sequences (resident and swapped out), in creation order."""
        return list(self._seqs)

    def _get(self, seq_id: Hashable) -> _SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _resident(self, seq_id: Hashable) -> _SeqBlocks:
        seq = self._get(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap_in() it first")
        return seq

    def _resident_many(self, seq_ids: Iterable[Hashable]) -> list[_SeqBlocks]:
        # Batch lookup for the per-step paths: one comprehension instead of a call per id.
        seqs = self._seqs
        try:
            out = [seqs[s] for s in seq_ids]
        except KeyError as e:
            raise KeyError(f"unknown sequence {e.args[0]!r}") from None
        if any(s.swapped for s in out):
            sid = next(i for i, s in zip(seq_ids, out, strict=True) if s.swapped)
            raise ValueError(f"sequence {sid!r} is swapped out; swap_in() it first")
        return out

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the GPU block table of ``seq_id``.

        ``KeyError`` if unknown; ``ValueError`` while it is swapped out (see
        :meth:`cpu_block_table`).
        """
        return self._resident(seq_id).table.tolist()

    def cpu_block_table(self, seq_id: Hashable) -> list[int]:
        """The CPU block table of a swapped-out sequence (``ValueError`` if it is resident)."""
        seq = self._get(seq_id)
        if not seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return seq.table.tolist()

    def seq_len(self, seq_id: Hashable) -> int:
        """Number of positions reserved for ``seq_id`` (also while swapped out)."""
        return self._get(seq_id).length

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is swapped out to the CPU pool (``KeyError`` if unknown)."""
        return self._get(seq_id).swapped

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding GPU block ``block_id``."""
        return self._gpu.ref_count(block_id)

    def cpu_ref_count(self, block_id: int) -> int:
        """Number of (swapped-out) block tables holding CPU block ``block_id``."""
        return self._cpu.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        """Whether GPU block ``block_id`` is registered in the prefix cache (any ref count)."""
        return self._gpu.is_cached(block_id)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Physical slots of positions ``start .. end-1`` of a resident sequence.

        ``0 <= start <= end <= seq_len(seq_id)``, else ``ValueError``.
        """
        seq = self._resident(seq_id)
        if not 0 <= start <= end <= seq.length:
            raise ValueError(f"bad position range [{start}, {end}) for length {seq.length}")
        return bt.slots(seq.table, start, end, self.block_size)

    # ------------------------------------------------------------------ prefix matching

    def _match_prefix(self, tokens: list[int] | None, num_tokens: int):
        """Keys of the prompt's full blocks and the cached blocks matching its prefix.

        At most ``(num_tokens - 1) // block_size`` blocks match, so the block holding the last
        prompt token is always private and the engine always computes at least that token
        (it needs its logits); a fully cached prompt still recomputes its last block.
        """
        if tokens is None or not self.enable_prefix_caching:
            return None, []
        keys = chain_keys(tokens, 0, num_tokens // self.block_size, self.block_size, None)
        hits = []
        cache = self._gpu.cache
        for key in keys[: (num_tokens - 1) // self.block_size]:
            b = cache.get(key)
            if b is None:
                break
            hits.append(b)
        return keys, hits

    # ------------------------------------------------------------------ allocate
    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """Whether :meth:`allocate` of a new sequence of ``num_tokens`` would succeed now."""
        if num_tokens < 1:
            return False
        _, hits = self._match_prefix(_as_token_list(token_ids, num_tokens), num_tokens)
        return self._alloc_need(num_tokens, hits) <= self._alloc_avail(hits)

    def _alloc_need(self, num_tokens: int, hits: list[int]) -> int:
        return self.num_blocks_for(num_tokens) - len(hits)

    def _alloc_avail(self, hits: list[int]) -> int:
        # Cached ref-0 blocks we are about to revive cannot also be evicted for fresh blocks.
        ref = self._gpu.ref
        reviving = sum(1 for b in hits if ref[b] == 0)
        return self._gpu.num_free - reviving

    def allocate(
        self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> int:
        """Reserve blocks for a new sequence of ``num_tokens`` positions (its prompt).

        Returns the number of leading positions whose KV is already in the cache (prefix
        caching with ``token_ids`` given; otherwise 0). It is a multiple of ``block_size`` and
        at most ``num_tokens - 1``: the engine prefills positions ``returned .. num_tokens-1``
        only (``slot_mapping_tensor([seq_id], [num_tokens - returned])``).

        ``ValueError`` if ``seq_id`` exists, ``num_tokens < 1`` or ``token_ids`` has the wrong
        length; :class:`OutOfBlocks` if the pool cannot hold it. Either way nothing changes.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        tokens = _as_token_list(token_ids, num_tokens)
        keys, hits = self._match_prefix(tokens, num_tokens)
        need = self._alloc_need(num_tokens, hits)
        avail = self._alloc_avail(hits)
        if need > avail:
            raise OutOfBlocks(
                f"allocate({seq_id!r}, {num_tokens}) needs {need} free blocks, {avail} available",
                needed=need,
                available=avail,
            )
        # Commit. Revive hits before taking fresh blocks so eviction cannot pick them.
        gpu = self._gpu
        gpu.share(hits)
        table = array("i", hits)
        take = gpu.take
        table.extend([take() for _ in range(need)])
        pending = None
        if keys is not None:
            for i in range(len(hits), len(keys)):
                gpu.register(table[i], keys[i])
            pending = tokens[len(keys) * self.block_size :]
            self._queried_tokens += num_tokens
            self._hit_tokens += len(hits) * self.block_size
        elif self.enable_prefix_caching:
            keys = []  # token ids unknown: nothing of this sequence is ever registered
        self._seqs[seq_id] = _SeqBlocks(table, num_tokens, keys, pending)
        return len(hits) * self.block_size

    # ------------------------------------------------------------------ fork / free
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (each ref count + 1).

        ``KeyError`` for an unknown parent, ``ValueError`` for an existing child or a
        swapped-out parent.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        if parent.swapped:
            raise ValueError(f"cannot fork swapped-out sequence {parent_id!r}")
        self._gpu.share_held(parent.table)
        self._seqs[child_id] = _SeqBlocks(
            array("i", parent.table),
            parent.length,
            None if parent.keys is None else list(parent.keys),
            None if parent.pending is None else list(parent.pending),
        )

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id`` (resident or swapped out); ``KeyError`` if unknown.

        Blocks whose ref count drops to 0 return to the free list, or, when they are
        registered in the prefix cache, to the evictable LRU. Blocks are released tail first,
        so a prefix chain's later blocks are evicted before its earlier ones.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        if seq.swapped:
            self._cpu.release_all(seq.table)
        else:
            self._gpu.release_all(reversed(seq.table))

    # ------------------------------------------------------------------ append
    def _append_need(self, seq: _SeqBlocks, n: int) -> tuple[int, bool]:
        """(blocks to take, whether the tail is copied on write) for appending n positions."""
        length = seq.length
        cow = n > 0 and length % self.block_size != 0 and self._gpu.ref[seq.table[-1]] > 1
        grow = -(-(length + n) // self.block_size) - len(seq.table)
        return grow + cow, cow

    def can_append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` of ``num_tokens`` positions would succeed now."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need, _ = self._append_need(self._resident(seq_id), num_tokens)
        return need <= self.num_free_blocks

    def append_slots(
        self, seq_id: Hashable, num_tokens: int = 1, token_ids: Sequence[int] | int | None = None
    ) -> list[tuple[int, int]]:
        """Reserve slots for ``num_tokens`` new positions at the end of ``seq_id``.

        If the tail block is partially filled and shared (ref count > 1) it is copied on
        write: a fresh block replaces it in this sequence's table only, and the returned list
        holds ``(src_block, dst_block)``: apply it with ``paged_ops.copy_blocks`` before
        writing the new tokens. A private tail with room is written in place (returns ``[]``).
        The new positions' slots are ``slot_mapping(seq_id, old_len, old_len + num_tokens)``.

        ``token_ids`` (prefix caching) lets blocks that become full be registered in the
        cache; appending without them stops registration for the rest of this sequence.
        ``KeyError``/``ValueError`` for unknown/swapped sequences, :class:`OutOfBlocks` when
        the pool is too small: nothing changes then.
        """
        seq = self._resident(seq_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        tokens = _as_token_list(token_ids, num_tokens)
        need, cow = self._append_need(seq, num_tokens)
        avail = self.num_free_blocks
        if need > avail:
            raise OutOfBlocks(
                f"append_slots({seq_id!r}, {num_tokens}) needs {need} free blocks, "
                f"{avail} available",
                needed=need,
                available=avail,
            )
        out: list[tuple[int, int]] = []
        self._append(seq, num_tokens, tokens, need, cow, out)
        return out

    def append_slots_batch(
        self,
        seq_ids: Sequence[Hashable],
        num_tokens: int | Sequence[int] = 1,
        token_ids: Sequence[Sequence[int] | int | None] | None = None,
    ) -> list[tuple[int, int]]:
        """:meth:`append_slots` for a batch, all or nothing; returns every CoW pair.

        ``num_tokens`` is one count for all or one per sequence; ``token_ids`` is ``None`` or
        one entry per sequence. The result is the same as calling :meth:`append_slots` on each
        sequence in order, but if the pool cannot hold the whole batch nothing is appended
        and :class:`OutOfBlocks` is raised (a scheduler then preempts and retries). Duplicate
        ids are a ``ValueError``.
        """
        seqs = self._resident_many(seq_ids)
        if len(set(seq_ids)) != len(seqs):
            raise ValueError("duplicate sequence ids in append_slots_batch")
        counts = [num_tokens] * len(seqs) if isinstance(num_tokens, int) else list(num_tokens)
        if len(counts) != len(seqs) or (counts and min(counts) < 0):
            raise ValueError("num_tokens must be one count >= 0, or one per sequence")
        if token_ids is None:
            toks = [None] * len(seqs)
        else:
            if len(token_ids) != len(seqs):
                raise ValueError("token_ids must have one entry per sequence")
            toks = [_as_token_list(t, n) for t, n in zip(token_ids, counts, strict=True)]
        # Exact need: k batch members sharing a partial tail of ref count r copy it
        # min(k, r - 1) times (the last holder, alone by then, writes in place).
        bs = self.block_size
        ref = self._gpu.ref
        need = 0
        shared_tails: dict[int, int] = {}
        for seq, n in zip(seqs, counts, strict=True):
            length = seq.length
            need += -(-(length + n) // bs) - len(seq.table)
            if n and length % bs:
                tail = seq.table[-1]
                if ref[tail] > 1:
                    shared_tails[tail] = shared_tails.get(tail, 0) + 1
        for tail, k in shared_tails.items():
            need += min(k, ref[tail] - 1)
        avail = self.num_free_blocks
        if need > avail:
            raise OutOfBlocks(
                f"append_slots_batch of {len(seqs)} sequences needs {need} free blocks, "
                f"{avail} available",
                needed=need,
                available=avail,
            )
        out: list[tuple[int, int]] = []
        append = self._append
        if not shared_tails and token_ids is None and all(c == 1 for c in counts):
            # Decode fast path: one token each, no copy-on-write anywhere in the batch.
            caching = self.enable_prefix_caching
            gpu = self._gpu
            twins = gpu.twins
            take = gpu.take
            for seq in seqs:
                length = seq.length
                if length % bs:
                    if twins:
                        gpu.drop_twin(seq.table[-1])
                else:
                    seq.table.append(take())
                seq.length = length + 1
                if caching:
                    seq.pending = None
            return out
        for seq, n, t in zip(seqs, counts, toks, strict=True):
            cow = n > 0 and seq.length % bs != 0 and ref[seq.table[-1]] > 1
            grow = -(-(seq.length + n) // bs) - len(seq.table)
            append(seq, n, t, grow + cow, cow, out)
        return out

    def _append(
        self, seq: _SeqBlocks, n: int, tokens: list[int] | None, need: int, cow: bool, out: list
    ) -> None:
        """Commit an append whose block need was checked by the caller."""
        table = seq.table
        gpu = self._gpu
        if cow:
            src = table[-1]
            dst = gpu.take()
            gpu.release_all((src,))  # stays >= 1: it was shared
            table[-1] = dst
            out.append((src, dst))
            need -= 1
        elif n and seq.length % self.block_size and gpu.twins:
            # The private tail is written in place: its CPU twin (if any) goes stale.
            gpu.drop_twin(table[-1])
        if need:
            take = gpu.take
            table.extend([take() for _ in range(need)])
        seq.length += n
        if seq.pending is not None and n:
            if tokens is None:
                seq.pending = None
            else:
                pending = seq.pending
                pending.extend(tokens)
                bs = self.block_size
                if len(pending) >= bs:
                    keys = seq.keys
                    full = len(pending) // bs
                    new = chain_keys(pending, 0, full, bs, keys[-1] if keys else None)
                    for key in new:
                        gpu.register(table[len(keys)], key)
                        keys.append(key)
                    del pending[: full * bs]

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Whether :meth:`swap_out` would succeed now."""
        seq = self._resident(seq_id)
        return self._swap_need(seq.table, self._gpu.twins) <= self._cpu.num_free

    @staticmethod
    def _swap_need(table: array, twins: dict[int, int]) -> int:
        return len({b for b in table if b not in twins})

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a resident sequence to the CPU pool; returns ``(gpu_block, cpu_block)`` pairs.

        Apply the pairs with ``paged_ops.swap_blocks(gpu_cache, cpu_cache, mapping)`` (each
        layer, keys and values) before the released GPU blocks are written again, i.e. before
        the next forward pass. Afterwards :meth:`block_table` raises ``ValueError`` (the
        sequence has no GPU blocks), :meth:`cpu_block_table` gives its CPU table,
        :meth:`seq_len` and :meth:`free` still work; :meth:`append_slots` and :meth:`fork`
        raise ``ValueError`` until :meth:`swap_in`.

        Sharing is kept: a GPU block that already has a CPU copy (a *twin*, made when another
        sequence sharing it was swapped out) is not copied again; the sequence takes a
        reference to that CPU block (CPU ref counts work like GPU ones). So sequences that
        share blocks copy each shared block once, and share the CPU copies.
        ``OutOfBlocks`` (``pool="cpu"``) with no state change if the CPU pool is too small.
        """
        seq = self._resident(seq_id)
        gpu, cpu = self._gpu, self._cpu
        g2c = gpu.twins
        need = self._swap_need(seq.table, g2c)
        avail = cpu.num_free
        if need > avail:
            raise OutOfBlocks(
                f"swap_out({seq_id!r}) needs {need} CPU blocks, {avail} free",
                needed=need,
                available=avail,
                pool="cpu",
            )
        mapping: list[tuple[int, int]] = []
        cpu_table = array("i")
        for g in seq.table:
            c = g2c.get(g)
            if c is None:
                c = cpu.take()
                gpu.link_twin(g, c)
                mapping.append((g, c))
            else:
                cpu.share((c,))
            cpu_table.append(c)
        gpu.release_all(reversed(seq.table))
        seq.table = cpu_table
        seq.swapped = True
        return mapping

    def _swap_in_plan(self, seq: _SeqBlocks) -> tuple[list, int, int]:
        """For each CPU block of ``seq``: the GPU block already holding its data, or None.

        Returns (plan, fresh blocks needed, cached ref-0 blocks revived). The data may be on
        the GPU as the block's twin or, with prefix caching, as a cached block of the same key.
        """
        c2g = self._cpu.twins
        keys = seq.keys or ()
        cache = self._gpu.cache
        ref = self._gpu.ref
        plan = []
        seen: dict[int, int | None] = {}
        need = reviving = 0
        for i, c in enumerate(seq.table):
            if c in seen:
                plan.append(seen[c])
                continue
            g = c2g.get(c)
            if g is None and i < len(keys):
                g = cache.get(keys[i])
                if g is not None and ref[g] == 0:
                    reviving += 1
            if g is None:
                need += 1
            seen[c] = g
            plan.append(g)
        return plan, need, reviving

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether :meth:`swap_in` would succeed now."""
        seq = self._get(seq_id)
        if not seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        _, need, reviving = self._swap_in_plan(seq)
        return need <= self.num_free_blocks - reviving

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a swapped-out sequence back to the GPU; returns ``(cpu_block, gpu_block)`` pairs.

        Apply them with ``paged_ops.swap_blocks(cpu_cache, gpu_cache, mapping)`` before the
        sequence's next forward pass. A block whose data is still on the GPU is not copied:
        the sequence shares that GPU block instead. That is the case for a CPU block's twin
        (e.g. a prefix shared with a sequence that stayed resident, or a block that another
        swapped-out sequence already brought back) and, with prefix caching, for a cached
        block with the same key (a cache hit). Full blocks with known token ids are
        (re-)registered in the prefix cache.
        ``KeyError`` if unknown, ``ValueError`` if resident, :class:`OutOfBlocks` with no state
        change if the GPU pool (free + evictable cached blocks) is too small.
        """
        seq = self._get(seq_id)
        if not seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        plan, need, reviving = self._swap_in_plan(seq)
        avail = self.num_free_blocks - reviving
        if need > avail:
            raise OutOfBlocks(
                f"swap_in({seq_id!r}) needs {need} GPU blocks, {avail} available",
                needed=need,
                available=avail,
            )
        gpu, cpu = self._gpu, self._cpu
        g2c, c2g = gpu.twins, cpu.twins
        # Commit. Take references to blocks already on the GPU first, so that reviving a
        # cached block happens before any eviction for the fresh ones.
        gpu.share([g for g in plan if g is not None])
        mapping: list[tuple[int, int]] = []
        gpu_table = array("i")
        fresh: dict[int, int] = {}
        for c, g in zip(seq.table, plan, strict=True):
            if g is None:
                g = fresh.get(c)
                if g is None:
                    g = fresh[c] = gpu.take()
                    mapping.append((c, g))
                else:
                    gpu.share((g,))
            if c not in c2g and g not in g2c:
                gpu.link_twin(g, c)
            gpu_table.append(g)
        cpu.release_all(seq.table)
        if seq.keys:
            for i, key in enumerate(seq.keys):
                gpu.register(gpu_table[i], key)
        seq.table = gpu_table
        seq.swapped = False
        return mapping

    # ------------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> int:
        """Evict every ref-0 cached block to the free list; returns how many were evicted.

        Blocks in use keep their registration (they stay matchable while referenced).
        """
        return self._gpu.reset_cache()

    # ------------------------------------------------------------------ tensors
    def block_tables_tensor(
        self, seq_ids: Sequence[Hashable], device=None, *, max_blocks: int | None = None
    ) -> torch.Tensor:
        """int32 ``[len(seq_ids), width]`` block tables of resident sequences, padded with 0.

        ``width`` is the longest table, or ``max_blocks`` (fixed shapes, e.g. CUDA graphs;
        ``ValueError`` if a table is longer). Padding entries lie beyond
        ``ceil(seq_len / block_size)``, which the attention op ignores.
        """
        tables = [s.table for s in self._resident_many(seq_ids)]
        longest = max(map(len, tables), default=0)
        width = longest if max_blocks is None else max_blocks
        if longest > width:
            raise ValueError(f"a block table has {longest} entries > max_blocks={max_blocks}")
        return bt.block_tables_tensor(tables, width, device)

    def seq_lens_tensor(self, seq_ids: Sequence[Hashable], device=None) -> torch.Tensor:
        """int32 ``[len(seq_ids)]`` sequence lengths (swapped-out sequences included)."""
        seqs = self._seqs
        try:
            lens = array("i", [seqs[s].length for s in seq_ids])
        except KeyError as e:
            raise KeyError(f"unknown sequence {e.args[0]!r}") from None
        return bt.int32_tensor(lens, device)

    def slot_mapping_tensor(
        self,
        seq_ids: Sequence[Hashable],
        num_new_tokens: int | Sequence[int] = 1,
        device=None,
        *,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """int64 slots of the last ``num_new_tokens`` positions of each sequence, concatenated.

        This is the ``slot_mapping`` of ``reshape_and_cache`` for the tokens a forward pass
        writes: after :meth:`append_slots_batch` (decode) use the default 1; after
        :meth:`allocate` pass ``seq_len - cached`` per sequence (prefill of the uncached
        part). ``num_new_tokens`` is one count for all or one per sequence. ``pad_to`` pads
        the result with ``-1`` (the op skips negative slots) to a fixed length.
        """
        seqs = self._resident_many(seq_ids)
        bs = self.block_size
        if isinstance(num_new_tokens, int) and num_new_tokens == 1:
            slots = []
            for seq in seqs:
                p = seq.length - 1
                slots.append(seq.table[p // bs] * bs + p % bs)
        else:
            counts = (
                [num_new_tokens] * len(seqs)
                if isinstance(num_new_tokens, int)
                else list(num_new_tokens)
            )
            if len(counts) != len(seqs):
                raise ValueError("num_new_tokens must be one count or one per sequence")
            slots = []
            for seq, n in zip(seqs, counts, strict=True):
                if not 0 <= n <= seq.length:
                    raise ValueError(f"num_new_tokens {n} out of range for length {seq.length}")
                slots.extend(bt.slots(seq.table, seq.length - n, seq.length, bs))
        return bt.slots_tensor(slots, pad_to, device)

    def slot_mapping_spans_tensor(
        self,
        spans: Iterable[tuple[Hashable, int, int]],
        device=None,
        *,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """int64 slots of explicit ``(seq_id, start, end)`` position ranges, concatenated.

        For chunked prefill and other layouts :meth:`slot_mapping_tensor` does not cover.
        """
        bs = self.block_size
        slots: list[int] = []
        for seq_id, start, end in spans:
            seq = self._resident(seq_id)
            if not 0 <= start <= end <= seq.length:
                raise ValueError(f"bad position range [{start}, {end}) for length {seq.length}")
            slots.extend(bt.slots(seq.table, start, end, bs))
        return bt.slots_tensor(slots, pad_to, device)

    @staticmethod
    def block_mapping_tensor(pairs: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
        """int64 ``[n, 2]`` tensor of ``(src, dst)`` pairs for ``copy_blocks``/``swap_blocks``."""
        return bt.block_mapping_tensor(pairs, device)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> BlockManagerStats:
        """Pool usage now (O(num_blocks + num_seqs); meant for logging, not the hot path)."""
        bs = self.block_size
        partial_tails: dict[int, int] = {}
        num_seqs = num_tokens = swapped = 0
        for seq in self._seqs.values():
            if seq.swapped:
                swapped += 1
                continue
            num_seqs += 1
            num_tokens += seq.length
            r = seq.length % bs
            if r:
                # A shared partial tail is held at the same fill by all its holders.
                tail = seq.table[-1]
                partial_tails[tail] = max(partial_tails.get(tail, 0), r)
        gpu = self._gpu
        used = self.num_blocks - gpu.num_free
        waste = sum(bs - r for r in partial_tails.values())
        cpu_free = self._cpu.num_free
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            block_size=bs,
            used_blocks=used,
            free_blocks=len(gpu.free),
            cached_blocks=gpu.num_cached,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            shared_blocks=gpu.num_shared(),
            tail_waste_slots=waste,
            stored_tokens=used * bs - waste,
            num_swapped_seqs=swapped,
            num_cpu_blocks=self.num_cpu_blocks,
            cpu_used_blocks=self.num_cpu_blocks - cpu_free,
            cpu_free_blocks=cpu_free,
            prefix_cache_queried_tokens=self._queried_tokens,
            prefix_cache_hit_tokens=self._hit_tokens,
        )

    def snapshot(self) -> dict:
        """A deep, comparable copy of the whole internal state (for tests and debugging).

        Two snapshots are equal iff the managers would behave identically from then on.
        """
        gpu, cpu = self._gpu.snapshot(), self._cpu.snapshot()
        return {
            "seqs": {
                sid: (
                    s.table.tolist(),
                    s.length,
                    s.swapped,
                    None if s.keys is None else list(s.keys),
                    None if s.pending is None else list(s.pending),
                )
                for sid, s in self._seqs.items()
            },
            "seq_order": list(self._seqs),
            "ref": gpu["ref"],
            "free": gpu["free"],
            "cache": gpu["cache"],
            "block_key": gpu["block_key"],
            "evictable": gpu["evictable"],
            "cpu_ref": cpu["ref"],
            "cpu_free": cpu["free"],
            "g2c": gpu["twins"],
            "c2g": cpu["twins"],
            "counters": (self._queried_tokens, self._hit_tokens),
        }

    def free_block_ids(self) -> list[int]:
        """Sorted ids of the GPU blocks on the free list (not counting cached blocks)."""
        return self._gpu.free_ids()

    def cached_block_ids(self) -> list[int]:
        """Ref-0 cached GPU blocks, least recently used (next to be evicted) first."""
        return self._gpu.cached_ids()

    def free_cpu_block_ids(self) -> list[int]:
        """Sorted ids of the free CPU blocks."""
        return self._cpu.free_ids()
