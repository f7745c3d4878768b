"""The int32/int64 tensors the ops take, built from block tables and slot lists.

Block tables are ``array('i')``: a table turns into tensor bytes without a per-entry Python
int -> C int conversion. Every builder returns a CPU tensor, or one on ``device`` (copied
through pinned memory where possible, so the host->device copy can overlap).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

__all__ = [
    "block_mapping_tensor",
    "block_tables_tensor",
    "int32_tensor",
    "slots",
    "slots_tensor",
    "tensor_from_array",
    "to_device",
]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` (``None``: left where it is)."""
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


def tensor_from_array(a: array, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing the buffer of ``a`` (whose item size must match ``dtype``)."""
    # torch.frombuffer keeps the buffer alive and skips per-element conversion; it rejects
    # empty buffers, hence the special case.
    if not len(a):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(a, dtype=dtype)


def int32_tensor(values: array, device=None) -> torch.Tensor:
    """int32 ``[len(values)]`` from an ``array('i')``."""
    return to_device(tensor_from_array(values, torch.int32), device)


def block_tables_tensor(tables: Sequence[array], width: int, device=None) -> torch.Tensor:
    """int32 ``[len(tables), width]``: each table padded with 0 (no table longer than width)."""
    if not tables or width == 0:
        return to_device(torch.zeros((len(tables), width), dtype=torch.int32), device)
    # Byte-level concatenation: no per-entry Python int -> C int conversion.
    zero = bytes(4 * width)
    parts = []
    for t in tables:
        parts.append(t.tobytes())
        if len(t) < width:
            parts.append(zero[: 4 * (width - len(t))])
    buf = bytearray(b"".join(parts))
    t = torch.frombuffer(buf, dtype=torch.int32).view(len(tables), width)
    return to_device(t, device)


def slots(table: array, start: int, end: int, block_size: int) -> list[int]:
    """Physical slots of positions ``start .. end-1`` of a sequence with block table ``table``:
    position ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``."""
    # One range() per block, not one Python step per token.
    out: list[int] = []
    i = start // block_size
    while start < end:
        hi = min(end, (i + 1) * block_size)
        base = table[i] * block_size - i * block_size
        out.extend(range(base + start, base + hi))
        start = hi
        i += 1
    return out


def slots_tensor(slot_list: list[int], pad_to: int | None, device=None) -> torch.Tensor:
    """int64 slots, padded with ``-1`` (skipped by the ops) to ``pad_to`` entries if given.

    ``ValueError`` if there are more than ``pad_to`` slots. Extends ``slot_list`` in place.
    """
    if pad_to is not None:
        if pad_to < len(slot_list):
            raise ValueError(f"pad_to={pad_to} < {len(slot_list)} slots")
        slot_list.extend([-1] * (pad_to - len(slot_list)))
    return to_device(tensor_from_array(array("q", slot_list), torch.int64), device)


def block_mapping_tensor(pairs: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    """int64 ``[n, 2]`` tensor of ``(src, dst)`` pairs for ``copy_blocks``/``swap_blocks``."""
    flat = array("q")
    for s, d in pairs:
        flat.append(s)
        flat.append(d)
    return to_device(tensor_from_array(flat, torch.int64).view(-1, 2), device)
