"""The check both demos end with: generated tokens against transformers' greedy ``generate``.

A module of its own so that ``demo`` (which starts the tensor-parallel demo) and ``_demo_tp``
both import it without importing each other.
"""

from __future__ import annotations

import torch


def greedy_mismatches(model, prompts, outs, max_new: int, device) -> int:
    """How many branches of ``outs[i]`` differ from transformers' greedy ``generate`` on
    ``prompts[i]``."""
    bad = 0
    with torch.no_grad():
        for p, branches in zip(prompts, outs, strict=True):
            ids = torch.tensor([p], device=device)
            # all-ones mask: generate would otherwise mask prompt tokens == pad_token_id
            ref = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist()
            bad += sum(b != ref for b in branches)
    return bad
