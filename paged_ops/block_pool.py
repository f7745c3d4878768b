"""One pool of physical KV-cache blocks: reference counts, a free list and a prefix cache.

:class:`~paged_ops.block_manager.BlockManager` owns two of them, the GPU pool and the CPU (swap)
pool, and keeps the per-sequence block tables; a pool knows nothing of sequences.

* Block ids are ``0 .. num_blocks-1``. The free list is a min-heap: the lowest free id is
  handed out first, so ids are a deterministic function of the call sequence.
* ``ref[b]`` is the number of block tables holding block ``b``.
* Prefix cache: a block can be registered under a key (:mod:`paged_ops.prefix_hash`). A
  registered block whose ref count drops to 0 is kept, evictable, in LRU order instead of
  freed; :meth:`BlockPool.take` takes truly free blocks first and evicts the least recently
  released cached block only when none is left. The CPU pool never registers blocks.
* Twins: a live block of this pool and a live block of the paired pool holding the same data
  (a swapped-out copy). Swapping a block that has a twin moves a reference instead of copying
  data again. A pair is dropped when either block is released or written.

Not thread-safe. Methods do not check their arguments: the manager checks a whole request
first, then commits through them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["BlockPool"]


class BlockPool:
    """Reference counts, free list, prefix cache and twins of ``num_blocks`` blocks.

    ``name`` (``"GPU"``, ``"CPU"``) appears in error messages. Two pools are paired for twins
    with :meth:`pair`. ``ref`` (the ref counts), ``cache`` (key -> block) and ``twins``
    (block -> twin in the paired pool) are read directly by the manager's per-step loops;
    they are changed only through the methods.
    """

    __slots__ = ("name", "num_blocks", "ref", "free", "cache", "block_key", "evictable",
                 "twins", "_other_twins")

    def __init__(self, num_blocks: int, name: str = "GPU"):
        self.name = name
        self.num_blocks = int(num_blocks)
        self.ref = [0] * self.num_blocks
        self.free = list(range(self.num_blocks))  # a sorted list is a valid min-heap
        # key -> block, the key of each registered block, and the ref-0 registered blocks in
        # release order (first = least recently used = next to evict).
        self.cache: dict[tuple, int] = {}
        self.block_key: list[tuple | None] = [None] * self.num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.twins: dict[int, int] = {}
        self._other_twins: dict[int, int] = {}  # the paired pool's twins

    def pair(self, other: BlockPool) -> None:
        """Make ``other`` the pool whose blocks can be twins of this pool's (both ways)."""
        # Each pool holds the other's twin map, not the other pool: no reference cycle, so a
        # dropped manager's pools are freed at once, not by the cyclic garbage collector.
        self._other_twins = other.twins
        other._other_twins = self.twins

    def __repr__(self) -> str:
        return (f"BlockPool({self.name}, num_blocks={self.num_blocks}, free={len(self.free)}, "
                f"cached={len(self.evictable)})")

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks :meth:`take` can hand out now: free plus evictable cached blocks."""
        return len(self.free) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        """Ref-0 blocks kept by the prefix cache (evictable)."""
        return len(self.evictable)

    def ref_count(self, b: int) -> int:
        """Ref count of block ``b``; ``ValueError`` if ``b`` is not a block id of this pool."""
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"{self.name} block id {b} out of range [0, {self.num_blocks})")
        return self.ref[b]

    def is_cached(self, b: int) -> bool:
        """Whether block ``b`` is registered in the prefix cache (any ref count)."""
        return self.block_key[b] is not None

    def free_ids(self) -> list[int]:
        """Sorted ids of the blocks on the free list (not counting cached blocks)."""
        return sorted(self.free)

    def cached_ids(self) -> list[int]:
        """Ref-0 cached blocks, least recently used (next to be evicted) first."""
        return list(self.evictable)

    def num_shared(self) -> int:
        """Blocks held by more than one block table."""
        return sum(1 for r in self.ref if r > 1)

    # ------------------------------------------------------------------ references
    def take(self) -> int:
        """Hand out a block with ref count 1: the lowest free id, else the LRU cached block.

        The caller has checked :attr:`num_free` (an empty pool raises ``KeyError``).
        """
        if self.free:
            b = heapq.heappop(self.free)
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.cache[self.block_key[b]]
            self.block_key[b] = None
        self.ref[b] = 1
        return b

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each of ``blocks``; ref-0 cached ones leave the LRU."""
        ref = self.ref
        evictable = self.evictable
        for b in blocks:
            if not ref[b]:
                del evictable[b]
            ref[b] += 1

    def share_held(self, blocks: Iterable[int]) -> None:
        """:meth:`share` for blocks known to be held (ref count > 0), e.g. a forked table."""
        ref = self.ref
        for b in blocks:
            ref[b] += 1

    def release_all(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each of ``blocks``, in order; see :meth:`_release`."""
        ref = self.ref
        release = self._release
        for b in blocks:
            ref[b] -= 1
            if not ref[b]:
                release(b)

    def _release(self, b: int) -> None:
        """Return a block whose ref count just dropped to 0: its twin pair is dropped, a
        registered block becomes the most recently used evictable one, any other is freed."""
        if self.twins:
            self.drop_twin(b)
        if self.block_key[b] is not None:
            self.evictable[b] = None
        else:
            heapq.heappush(self.free, b)

    # ------------------------------------------------------------------ prefix cache
    def register(self, b: int, key: tuple) -> None:
        """Register block ``b`` under ``key``. The first block with a key wins; a later
        duplicate stays unregistered and is freed normally (one cache entry per content)."""
        if key not in self.cache and self.block_key[b] is None:
            self.cache[key] = b
            self.block_key[b] = key

    def reset_cache(self) -> int:
        """Free every ref-0 cached block; returns how many. Blocks in use stay registered."""
        n = len(self.evictable)
        for b in self.evictable:
            del self.cache[self.block_key[b]]
            self.block_key[b] = None
            heapq.heappush(self.free, b)
        self.evictable.clear()
        return n

    # ------------------------------------------------------------------ twins
    def link_twin(self, b: int, other_b: int) -> None:
        """Record that block ``other_b`` of the paired pool holds the same data as ``b``."""
        self.twins[b] = other_b
        self._other_twins[other_b] = b

    def drop_twin(self, b: int) -> None:
        """Forget the twin of block ``b``, if any (its data is about to change or go)."""
        t = self.twins.pop(b, None)
        if t is not None:
            del self._other_twins[t]

    def snapshot(self) -> dict:
        """A deep, comparable copy of the pool's state."""
        return {
            "ref": list(self.ref),
            "free": list(self.free),
            "cache": dict(self.cache),
            "block_key": list(self.block_key),
            "evictable": list(self.evictable),
            "twins": dict(self.twins),
        }
