"""Prefix-cache keys of full KV-cache blocks.

The key of a full block is ``(hash of its parent block's key, its token ids)``, the parent
being the block before it in the same sequence. So a key identifies the block's tokens *and*
everything before them: equal text after a different prefix never matches. The first block
of a sequence has the fixed parent :data:`ROOT_HASH`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ROOT_HASH", "chain_keys"]

# Any fixed int works; hash(None) is not stable across processes before Python 3.12.
ROOT_HASH = 0x9E3779B97F4A7C15 & ((1 << 61) - 1)


def chain_keys(
    tokens: Sequence[int], first: int, count: int, block_size: int, parent_key: tuple | None
) -> list[tuple]:
    """Keys of the ``count`` full blocks ``first .. first+count-1`` of ``tokens``.

    Block ``i`` holds ``tokens[i*block_size : (i+1)*block_size]``; ``parent_key`` is the key
    of the block before block ``first`` (``None``: block ``first`` starts the sequence).
    """
    parent = ROOT_HASH if parent_key is None else hash(parent_key)
    keys = []
    for i in range(first, first + count):
        key = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        keys.append(key)
        parent = hash(key)
    return keys
