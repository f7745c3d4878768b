"""Beam search state of one request, step for step the algorithm of transformers'
``GenerationMixin._beam_search`` (4.57) for one prompt, so that the engine's beams equal
``model.generate(ids, num_beams=k, num_return_sequences=n, do_sample=False, length_penalty=...,
early_stopping=...)`` token for token.

Per step, from the ``k`` running beams' logits: scores are sums of fp32 ``log_softmax``; the
best ``keep = max(2, 1 + number of stop tokens) * k`` continuations over all beams are
candidates; the best ``k`` candidates that did not just finish run on (a finished one gets
``-1e9``, so with too few live candidates a dead beam runs on, as in transformers); candidates
among the best ``k`` that finish (a stop token, or ``max_new_tokens`` reached) compete for the
``k`` finished hypotheses with score ``sum / generated_length ** length_penalty``. The search
ends when no running beam can beat the worst finished hypothesis (the ``early_stopping``
heuristic), when every hypothesis slot is filled and ``early_stopping is True``, or when every
candidate finished. The result is the ``n`` best hypotheses, best first.

The tensors keep transformers' ``[batch=1, ...]`` shapes and operation order, so ties and
rounding resolve the same way.
"""

from __future__ import annotations

import torch

_NEG = -1.0e9


class BeamSearch:
    """The beam search of one request. :meth:`step` takes the running beams' logits and
    returns, for each of the next ``k`` running beams, its parent beam and its new token."""

    def __init__(self, num_beams: int, num_return: int, max_new_tokens: int,
                 stop_token_ids: frozenset[int], length_penalty: float,
                 early_stopping: bool | str):
        k = num_beams
        self.num_beams = k
        self.num_return = num_return
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + len(stop_token_ids)) * k
        self.top_mask = torch.cat([torch.ones(k, dtype=torch.bool),
                                   torch.zeros(self.keep - k, dtype=torch.bool)])
        # Only beam 0 is live at first: the k copies of the prompt would propose equal tokens.
        self.running_scores = torch.zeros((1, k), dtype=torch.float32)
        self.running_scores[:, 1:] = _NEG
        self.finished_scores = torch.full((1, k), _NEG, dtype=torch.float32)
        self.finished_tokens: list[list[int]] = [[] for _ in range(k)]
        self.is_finished = torch.zeros((1, k), dtype=torch.bool)
        self.improvable = torch.ones((1, 1), dtype=torch.bool)
        self.generated = 0
        self.done = False

    def step(self, logits: torch.Tensor, outputs: list[list[int]]
             ) -> tuple[list[int], list[int]]:
        """One step. ``logits``: ``[k, V]``, the last logits of the running beams (before the
        first step: the prompt's row, repeated); ``outputs``: their generated tokens so far.
        Returns ``(parents, tokens)`` of the next running beams (meaningless once
        :attr:`done`)."""
        k = self.num_beams
        vocab = logits.shape[-1]
        log_probs = torch.nn.functional.log_softmax(logits.detach().to("cpu", torch.float32),
                                                    dim=-1)
        log_probs = log_probs.view(1, k, vocab) + self.running_scores[:, :, None]
        log_probs = log_probs.reshape(1, k * vocab)
        top_lp, top_idx = torch.topk(log_probs, k=self.keep)
        parents = (top_idx // vocab)[0].tolist()
        tokens = (top_idx % vocab)[0].tolist()
        gen_len = self.generated + 1
        at_max = gen_len >= self.max_new_tokens
        hits = torch.tensor([[at_max or t in self.stop_token_ids for t in tokens]])

        # Running beams for the next step: the best candidates that did not just finish.
        running_lp = top_lp + hits.to(torch.float32) * _NEG
        next_idx = torch.topk(running_lp, k=k)[1]
        self.running_scores = torch.take_along_dim(running_lp, next_idx, dim=1)

        # Finished hypotheses: the best k of the old ones and the candidates just finished.
        just_finished = hits & self.top_mask[None, :]
        scores = top_lp / (gen_len ** self.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * _NEG
        scores += (~self.improvable).to(torch.float32) * _NEG
        scores += (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, scores), dim=1)
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        pick = torch.topk(merged_scores, k=k)[1]
        old = self.finished_tokens
        self.finished_tokens = [old[i] if i < k else outputs[parents[i - k]] + [tokens[i - k]]
                                for i in pick[0].tolist()]
        self.finished_scores = torch.take_along_dim(merged_scores, pick, dim=1)
        self.is_finished = torch.take_along_dim(merged_finished, pick, dim=1)
        self.generated = gen_len

        # Can a running beam still beat the worst finished hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = gen_len
        best_running = self.running_scores[:, :1] / (best_len ** self.length_penalty)
        worst_finished = torch.where(self.is_finished,
                                     torch.min(self.finished_scores, dim=1, keepdim=True)[0],
                                     _NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1,
                                                      keepdim=True)
        open_slot = not (bool(torch.all(self.is_finished)) and self.early_stopping is True)
        self.done = not (bool(torch.any(self.improvable)) and open_slot
                         and not bool(torch.all(hits)))
        nxt = next_idx[0].tolist()
        return [parents[i] for i in nxt], [tokens[i] for i in nxt]

    def results(self) -> tuple[list[list[int]], list[str]]:
        """The ``n`` best hypotheses (new tokens), best first, and their finish reasons."""
        hyps = [list(t) for t in self.finished_tokens[: self.num_return]]
        reasons = ["stop" if h and h[-1] in self.stop_token_ids else "length" for h in hyps]
        return hyps, reasons
