"""Cascade decode: the blocks that several sequences of a decode step share (the prompt of
``n`` branches or beams, or a prefix-cache hit common to several requests) are attended once
for all of them.

For a group of sequences whose block tables start with the same ``d`` full blocks, every
layer runs

1. the group's query rows over the ``d`` shared blocks in one multi-token call
   (``query_start_loc`` = the group's rows, ``causal=False``: each row sees all ``d * bs``
   positions), each shared block read once for the whole group, with its log-sum-exp;
2. every sequence's decode row over its own blocks after the shared ones (its block table
   shifted by ``d``, its length less ``d * bs``), with its log-sum-exp;
3. ``merge_attention_states`` of the two, which is exactly the attention over all blocks.

Sharing is read from the block tables alone: two sequences share a block iff they hold the
same block id in the same column, and the same id in column ``c`` means the same tokens in
columns ``0..c`` (forks share a prefix of the table; prefix caching keys a block by its whole
prefix). A shared block is full and never written by the step (the block a decode row writes
is its own after copy-on-write). Positions in step 2 start at 0 instead of ``d * bs``, which
changes nothing without ALiBi or a sliding window; layers with a window take the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: A step is cascaded only when its groups save at least this many token reads per kv head
#: and layer in all (``sum of (members - 1) * shared tokens``). The shared call does the same
#: arithmetic as the decode rows it replaces, only at a somewhat better rate per row, and the
#: suffix calls and the merge come on top: below this the step is no faster than plain decode
#: (bench_cascade.py; benchmarks/RESULTS.md, "Cascade decode").
MIN_SAVED_TOKENS = 32768


@dataclass
class CascadePlan:
    """One decode step's cascade, host-side tensors (the runner moves them to the device).

    ``rows``: int64 ``[R]``, the step rows of the grouped sequences, each group's rows
    contiguous; ``shared_qsl``: int32 ``[G + 1]``, each group's slice of ``rows``;
    ``shared_tables``: int32 ``[G, d_max]``, each group's shared blocks; ``shared_lens``:
    int32 ``[G]`` (``d * block_size``); ``suffix_tables``: int32 ``[S, width]``, every
    sequence's blocks after its group's shared ones (unchanged for an ungrouped sequence);
    ``suffix_lens``: int32 ``[S]``. ``saved_tokens``: token reads saved per kv head and layer.
    """

    rows: torch.Tensor
    shared_qsl: torch.Tensor
    shared_tables: torch.Tensor
    shared_lens: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    saved_tokens: int


def plan_cascade(tables: torch.Tensor, seq_lens: list[int], block_size: int,
                 min_saved_tokens: int) -> CascadePlan | None:
    """The cascade of a decode step over ``tables`` (int32 ``[S, width]``, host) and
    ``seq_lens`` (each sequence's length including its decode row), or ``None`` when no group
    of two or more sequences shares a full block, or the groups save fewer than
    ``min_saved_tokens`` token reads in all.

    A sequence's shareable blocks are its full blocks before the one its decode row writes:
    columns ``0 .. (L - 1) // block_size - 1``. Each sequence joins the group of the deepest
    column it shares with another sequence: the sequences holding that column's block
    (which then share every column before it too).
    """
    S = tables.shape[0]
    if S < 2 or tables.shape[1] < 2:
        return None
    first = tables[:, 0].tolist()
    seen: dict[int, list[int]] = {}
    for i, b in enumerate(first):
        if (seq_lens[i] - 1) // block_size >= 1:
            seen.setdefault(b, []).append(i)
    candidates = [idx for idx in seen.values() if len(idx) > 1]
    if not candidates:
        return None
    # depth[i]: the deepest number of leading blocks row i shares with another row.
    depth = [0] * S
    for idx in candidates:
        sub = tables[idx]
        limit = torch.tensor([(seq_lens[i] - 1) // block_size for i in idx])
        width = int(limit.max())
        sub = sub[:, :width]
        eq = (sub[:, None, :] == sub[None, :, :]).to(torch.int32).cumprod(dim=2)
        lcp = eq.sum(dim=2)  # common leading blocks of each pair
        lcp = torch.minimum(lcp, torch.minimum(limit[:, None], limit[None, :]))
        lcp.fill_diagonal_(0)
        for k, i in enumerate(idx):
            depth[i] = int(lcp[k].max())
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(S):
        if depth[i] >= 1:
            groups.setdefault((depth[i], int(tables[i, depth[i] - 1])), []).append(i)
    chosen = [(d, idx) for (d, _), idx in groups.items() if len(idx) > 1]
    if not chosen or sum((len(idx) - 1) * d * block_size
                         for d, idx in chosen) < min_saved_tokens:
        return None
    rows: list[int] = []
    qsl = [0]
    shift = [0] * S
    d_max = max(d for d, _ in chosen)
    shared_tables = torch.zeros(len(chosen), d_max, dtype=torch.int32)
    shared_lens = []
    saved = 0
    for g, (d, idx) in enumerate(chosen):
        rows.extend(idx)
        qsl.append(len(rows))
        shared_tables[g, :d] = tables[idx[0], :d]
        shared_lens.append(d * block_size)
        saved += (len(idx) - 1) * d * block_size
        for i in idx:
            shift[i] = d
    width = tables.shape[1]
    shift_t = torch.tensor(shift, dtype=torch.long)
    cols = (torch.arange(width)[None, :] + shift_t[:, None]).clamp_(max=width - 1)
    suffix_tables = tables.gather(1, cols)
    suffix_lens = torch.tensor(seq_lens, dtype=torch.int32) - (shift_t * block_size).int()
    return CascadePlan(
        rows=torch.tensor(rows, dtype=torch.long),
        shared_qsl=torch.tensor(qsl, dtype=torch.int32),
        shared_tables=shared_tables,
        shared_lens=torch.tensor(shared_lens, dtype=torch.int32),
        suffix_tables=suffix_tables,
        suffix_lens=suffix_lens,
        saved_tokens=saved)


def cascade_attention(q_tok, key_cache, value_cache, plan, scale, softcap, k_scale, v_scale):
    """Decode attention of ``q_tok [S, H, D]`` by ``plan`` (a :class:`CascadePlan` on the
    device): the shared blocks once per group, each sequence's own blocks, merged."""
    ops = torch.ops.paged
    out, lse = ops.attention_with_lse(q_tok, key_cache, value_cache, plan.suffix_tables,
                                      plan.suffix_lens, scale, None, -1, softcap, k_scale,
                                      v_scale, None, None, True)
    q_shared = q_tok.index_select(0, plan.rows)
    out_s, lse_s = ops.attention_with_lse(q_shared, key_cache, value_cache, plan.shared_tables,
                                          plan.shared_lens, scale, None, -1, softcap, k_scale,
                                          v_scale, None, plan.shared_qsl, False)
    merged, _ = ops.merge_attention_states(out.index_select(0, plan.rows),
                                           lse.index_select(0, plan.rows), out_s, lse_s)
    return out.index_copy_(0, plan.rows, merged)
