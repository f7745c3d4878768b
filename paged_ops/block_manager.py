"""Host-side metadata of a paged KV cache: block tables, ref counts, CoW, prefix caching, swap.

The cache itself is a pool of ``num_blocks`` physical blocks of ``block_size`` token slots each
(``paged_ops.allocate_kv_cache``). Sequences see it through a *block table*: logical block
``i`` of a sequence (positions ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``table[i]``, so position ``p`` lives in slot ``table[p // block_size] * block_size +
p % block_size`` (DESIGN.md §2). :class:`BlockManager` owns that metadata and turns it into
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

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["BlockManager", "BlockManagerStats", "OutOfBlocks"]

# Parent "hash" of a sequence's first block. Any fixed int works; hash(None) is not stable
# across processes before Python 3.12.
_ROOT_HASH = 0x9E3779B97F4A7C15 & ((1 << 61) - 1)


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


class _Seq:
    """Per-sequence state. ``table`` holds GPU block ids, or CPU block ids while swapped."""

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


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if device is None:
        return t
    device = torch.device(device)
    if device.type == "cpu":
        return t
    # Pinned staging lets the host->device copy overlap; fall back when pinning is unavailable.
    try:
        return t.pin_memory().to(device, non_blocking=True)
    except RuntimeError:
        return t.to(device)


class BlockManager:
    """Block tables, reference counts and free lists of a paged KV cache (seed 000 §7-19).

    * GPU block ids are ``0 .. num_blocks-1``, CPU block ids ``0 .. num_cpu_blocks-1``. The free
      lists are min-heaps: the lowest free id is always handed out first, so block ids are a
      deterministic function of the call sequence.
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
        ``enable_prefix_caching`` turns on automatic prefix caching (seed 000 §18).
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

        self._seqs: dict[Hashable, _Seq] = {}
        self._ref = [0] * self.num_blocks
        self._free = list(range(self.num_blocks))  # sorted list is a valid min-heap
        # Prefix cache: key -> GPU block, the key of each registered block, and the ref-0
        # registered blocks in release order (first = least recently used = next to evict).
        self._cache: dict[tuple, int] = {}
        self._block_key: list[tuple | None] = [None] * self.num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._queried_tokens = 0
        self._hit_tokens = 0

        self._cpu_ref = [0] * self.num_cpu_blocks
        self._cpu_free = list(range(self.num_cpu_blocks))
        # "Twins": a live GPU block and a live CPU block holding the same data. Swapping a
        # block that already has a twin moves a reference instead of copying data again; a
        # twin pair is dropped when either block is released or the GPU block is written.
        self._g2c: dict[int, int] = {}
        self._c2g: dict[int, int] = {}

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
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Ref-0 GPU blocks kept by the prefix cache (evictable)."""
        return len(self._evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        """Free blocks of the CPU (swap) pool."""
        return len(self._cpu_free)

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

    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _resident(self, seq_id: Hashable) -> _Seq:
        seq = self._get(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap_in() it first")
        return seq

    def _resident_many(self, seq_ids: Iterable[Hashable]) -> list[_Seq]:
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
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"GPU block id {block_id} out of range [0, {self.num_blocks})")
        return self._ref[block_id]

    def cpu_ref_count(self, block_id: int) -> int:
        """Number of (swapped-out) block tables holding CPU block ``block_id``."""
        if not 0 <= block_id < self.num_cpu_blocks:
            raise ValueError(f"CPU block id {block_id} out of range [0, {self.num_cpu_blocks})")
        return self._cpu_ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether GPU block ``block_id`` is registered in the prefix cache (any ref count)."""
        return self._block_key[block_id] is not None

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Physical slots of positions ``start .. end-1`` of a resident sequence.

        ``0 <= start <= end <= seq_len(seq_id)``, else ``ValueError``.
        """
        seq = self._resident(seq_id)
        if not 0 <= start <= end <= seq.length:
            raise ValueError(f"bad position range [{start}, {end}) for length {seq.length}")
        return self._slots(seq.table, start, end)

    def _slots(self, table: array, start: int, end: int) -> list[int]:
        # One range() per block, not one Python step per token.
        bs = self.block_size
        out: list[int] = []
        i = start // bs
        while start < end:
            hi = min(end, (i + 1) * bs)
            base = table[i] * bs - i * bs
            out.extend(range(base + start, base + hi))
            start = hi
            i += 1
        return out

    # ------------------------------------------------------------------ GPU pool internals
    def _take(self) -> int:
        """Pop a GPU block with ref count 1; evicts the LRU cached block when none is free."""
        if self._free:
            b = heapq.heappop(self._free)
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._cache[self._block_key[b]]
            self._block_key[b] = None
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        """Return a GPU block whose ref count just dropped to 0."""
        c = self._g2c.pop(b, None)
        if c is not None:
            del self._c2g[c]
        if self._block_key[b] is not None:
            self._evictable[b] = None  # most recently used end
        else:
            heapq.heappush(self._free, b)

    def _register(self, b: int, key: tuple) -> None:
        # First block with a key wins; a later duplicate stays unregistered and is freed
        # normally (one cache entry per content).
        if key not in self._cache and self._block_key[b] is None:
            self._cache[key] = b
            self._block_key[b] = key

    def _chain_keys(self, tokens: list[int], first: int, count: int, parent_key) -> list:
        bs = self.block_size
        parent = _ROOT_HASH if parent_key is None else hash(parent_key)
        keys = []
        for i in range(first, first + count):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(key)
            parent = hash(key)
        return keys

    def _match_prefix(self, tokens: list[int] | None, num_tokens: int):
        """Keys of the prompt's full blocks and the cached blocks matching its prefix.

        At most ``(num_tokens - 1) // block_size`` blocks match, so the block holding the last
        prompt token is always private and the engine always computes at least that token
        (it needs its logits); a fully cached prompt still recomputes its last block.
        """
        if tokens is None or not self.enable_prefix_caching:
            return None, []
        keys = self._chain_keys(tokens, 0, num_tokens // self.block_size, None)
        hits = []
        cache = self._cache
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
        ref = self._ref
        reviving = sum(1 for b in hits if ref[b] == 0)
        return len(self._free) + len(self._evictable) - reviving

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
        ref = self._ref
        evictable = self._evictable
        for b in hits:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
        table = array("i", hits)
        take = self._take
        table.extend([take() for _ in range(need)])
        pending = None
        if keys is not None:
            for i in range(len(hits), len(keys)):
                self._register(table[i], keys[i])
            pending = tokens[len(keys) * self.block_size :]
            self._queried_tokens += num_tokens
            self._hit_tokens += len(hits) * self.block_size
        elif self.enable_prefix_caching:
            keys = []  # token ids unknown: nothing of this sequence is ever registered
        self._seqs[seq_id] = _Seq(table, num_tokens, keys, pending)
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
        ref = self._ref
        for b in parent.table:
            ref[b] += 1
        self._seqs[child_id] = _Seq(
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
            self._release_cpu(seq.table)
            return
        ref = self._ref
        for b in reversed(seq.table):
            ref[b] -= 1
            if not ref[b]:
                self._release(b)

    def _release_cpu(self, table: array) -> None:
        cpu_ref = self._cpu_ref
        for c in table:
            cpu_ref[c] -= 1
            if not cpu_ref[c]:
                g = self._c2g.pop(c, None)
                if g is not None:
                    del self._g2c[g]
                heapq.heappush(self._cpu_free, c)

    # ------------------------------------------------------------------ append
    def _append_need(self, seq: _Seq, n: int) -> tuple[int, bool]:
        """(blocks to take, whether the tail is copied on write) for appending n positions."""
        length = seq.length
        cow = n > 0 and length % self.block_size != 0 and self._ref[seq.table[-1]] > 1
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
        ref = self._ref
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
            g2c = self._g2c
            take = self._take
            for seq in seqs:
                length = seq.length
                if length % bs:
                    if g2c:
                        self._drop_gpu_twin(seq.table[-1])
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

    def _drop_gpu_twin(self, b: int) -> None:
        c = self._g2c.pop(b, None)
        if c is not None:
            del self._c2g[c]

    def _append(
        self, seq: _Seq, n: int, tokens: list[int] | None, need: int, cow: bool, out: list
    ) -> None:
        """Commit an append whose block need was checked by the caller."""
        table = seq.table
        if cow:
            src = table[-1]
            dst = self._take()
            self._ref[src] -= 1  # stays >= 1: it was shared
            table[-1] = dst
            out.append((src, dst))
            need -= 1
        elif n and seq.length % self.block_size and self._g2c:
            # The private tail is written in place: its CPU twin (if any) goes stale.
            self._drop_gpu_twin(table[-1])
        if need:
            take = self._take
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
                    new = self._chain_keys(pending, 0, full, keys[-1] if keys else None)
                    for key in new:
                        self._register(table[len(keys)], key)
                        keys.append(key)
                    del pending[: full * bs]

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Whether :meth:`swap_out` would succeed now."""
        seq = self._resident(seq_id)
        return self._swap_need(seq.table, self._g2c) <= len(self._cpu_free)

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
        g2c, c2g = self._g2c, self._c2g
        need = self._swap_need(seq.table, g2c)
        if need > len(self._cpu_free):
            raise OutOfBlocks(
                f"swap_out({seq_id!r}) needs {need} CPU blocks, {len(self._cpu_free)} free",
                needed=need,
                available=len(self._cpu_free),
                pool="cpu",
            )
        mapping: list[tuple[int, int]] = []
        cpu_ref = self._cpu_ref
        cpu_table = array("i")
        for g in seq.table:
            c = g2c.get(g)
            if c is None:
                c = heapq.heappop(self._cpu_free)
                g2c[g] = c
                c2g[c] = g
                mapping.append((g, c))
            cpu_ref[c] += 1
            cpu_table.append(c)
        ref = self._ref
        for g in reversed(seq.table):
            ref[g] -= 1
            if not ref[g]:
                self._release(g)
        seq.table = cpu_table
        seq.swapped = True
        return mapping

    def _swap_in_plan(self, seq: _Seq) -> tuple[list, int, int]:
        """For each CPU block of ``seq``: the GPU block already holding its data, or None.

        Returns (plan, fresh blocks needed, cached ref-0 blocks revived). The data may be on
        the GPU as the block's twin or, with prefix caching, as a cached block of the same key.
        """
        c2g = self._c2g
        keys = seq.keys or ()
        cache = self._cache
        ref = self._ref
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
        g2c, c2g = self._g2c, self._c2g
        ref = self._ref
        evictable = self._evictable
        # Commit. Take references to blocks already on the GPU first, so that reviving a
        # cached block happens before any eviction for the fresh ones.
        for g in plan:
            if g is not None:
                if ref[g] == 0:
                    del evictable[g]
                ref[g] += 1
        mapping: list[tuple[int, int]] = []
        gpu_table = array("i")
        fresh: dict[int, int] = {}
        for c, g in zip(seq.table, plan, strict=True):
            if g is None:
                g = fresh.get(c)
                if g is None:
                    g = fresh[c] = self._take()
                    mapping.append((c, g))
                else:
                    ref[g] += 1
            if c not in c2g and g not in g2c:
                g2c[g] = c
                c2g[c] = g
            gpu_table.append(g)
        self._release_cpu(seq.table)
        if seq.keys:
            for i, key in enumerate(seq.keys):
                self._register(gpu_table[i], key)
        seq.table = gpu_table
        seq.swapped = False
        return mapping

    # ------------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> int:
        """Evict every ref-0 cached block to the free list; returns how many were evicted.

        Blocks in use keep their registration (they stay matchable while referenced).
        """
        n = len(self._evictable)
        for b in self._evictable:
            del self._cache[self._block_key[b]]
            self._block_key[b] = None
            heapq.heappush(self._free, b)
        self._evictable.clear()
        return n

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
        if not tables or width == 0:
            return _to_device(torch.zeros((len(tables), width), dtype=torch.int32), device)
        # Byte-level concatenation: no per-entry Python int -> C int conversion.
        zero = bytes(4 * width)
        parts = []
        for t in tables:
            parts.append(t.tobytes())
            if len(t) < width:
                parts.append(zero[: 4 * (width - len(t))])
        buf = bytearray(b"".join(parts))
        t = torch.frombuffer(buf, dtype=torch.int32).view(len(tables), width)
        return _to_device(t, device)

    def seq_lens_tensor(self, seq_ids: Sequence[Hashable], device=None) -> torch.Tensor:
        """int32 ``[len(seq_ids)]`` sequence lengths (swapped-out sequences included)."""
        seqs = self._seqs
        try:
            lens = array("i", [seqs[s].length for s in seq_ids])
        except KeyError as e:
            raise KeyError(f"unknown sequence {e.args[0]!r}") from None
        return _to_device(_tensor_from_array(lens, torch.int32), device)

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
                slots.extend(self._slots(seq.table, seq.length - n, seq.length))
        return self._slots_tensor(slots, pad_to, device)

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
        slots: list[int] = []
        for seq_id, start, end in spans:
            seq = self._resident(seq_id)
            if not 0 <= start <= end <= seq.length:
                raise ValueError(f"bad position range [{start}, {end}) for length {seq.length}")
            slots.extend(self._slots(seq.table, start, end))
        return self._slots_tensor(slots, pad_to, device)

    @staticmethod
    def _slots_tensor(slots: list[int], pad_to: int | None, device) -> torch.Tensor:
        if pad_to is not None:
            if pad_to < len(slots):
                raise ValueError(f"pad_to={pad_to} < {len(slots)} slots")
            slots.extend([-1] * (pad_to - len(slots)))
        return _to_device(_tensor_from_array(array("q", slots), torch.int64), device)

    @staticmethod
    def block_mapping_tensor(pairs: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
        """int64 ``[n, 2]`` tensor of ``(src, dst)`` pairs for ``copy_blocks``/``swap_blocks``."""
        flat = array("q")
        for s, d in pairs:
            flat.append(s)
            flat.append(d)
        return _to_device(_tensor_from_array(flat, torch.int64).view(-1, 2), device)

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
        used = self.num_blocks - len(self._free) - len(self._evictable)
        waste = sum(bs - r for r in partial_tails.values())
        cpu_free = len(self._cpu_free)
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            block_size=bs,
            used_blocks=used,
            free_blocks=len(self._free),
            cached_blocks=len(self._evictable),
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            shared_blocks=sum(1 for r in self._ref if r > 1),
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
            "ref": list(self._ref),
            "free": list(self._free),
            "cache": dict(self._cache),
            "block_key": list(self._block_key),
            "evictable": list(self._evictable),
            "cpu_ref": list(self._cpu_ref),
            "cpu_free": list(self._cpu_free),
            "g2c": dict(self._g2c),
            "c2g": dict(self._c2g),
            "counters": (self._queried_tokens, self._hit_tokens),
        }

    def free_block_ids(self) -> list[int]:
        """Sorted ids of the GPU blocks on the free list (not counting cached blocks)."""
        return sorted(self._free)

    def cached_block_ids(self) -> list[int]:
        """Ref-0 cached GPU blocks, least recently used (next to be evicted) first."""
        return list(self._evictable)

    def free_cpu_block_ids(self) -> list[int]:
        """Sorted ids of the free CPU blocks."""
        return sorted(self._cpu_free)


def _tensor_from_array(a: array, dtype: torch.dtype) -> torch.Tensor:
    # torch.frombuffer keeps the buffer alive and skips per-element conversion; it rejects
    # empty buffers, hence the special case.
    if not len(a):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(a, dtype=dtype)
