"""Requests, their branches, the groups the scheduler moves, and what a step reports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .beam import BeamSearch
from .sampling import SamplingParams


class Branch:
    """One generation branch of a request: one sequence of the block manager.

    ``tokens()`` = prompt + output. ``num_computed``: leading positions whose K/V the cache
    holds (or the step being run writes); a decoding branch has ``num_tokens - 1`` (its last
    token is the next step's input), a branch being prefilled fewer. ``prefill_len``: the
    positions its current prefill covers (the prompt, or prompt + output recomputed after a
    preemption); rows below it are prefill rows, later ones decode rows. ``index``: the
    branch's place in the request's results (for beams: its rank among the running beams).
    ``logprobs``: one ``{token_id: logprob}`` per output token when the request asks for them.
    """

    __slots__ = ("seq_id", "request", "index", "prompt", "output", "generator",
                 "finish_reason", "num_computed", "prefill_len", "logprobs")

    def __init__(self, seq_id: int, request: Request, index: int, prompt: list[int],
                 output: list[int], generator: torch.Generator | None = None,
                 num_computed: int = 0, logprobs: list[dict[int, float]] | None = None):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.prompt = prompt
        self.output = output
        self.generator = generator
        self.finish_reason: str | None = None
        self.num_computed = num_computed
        self.prefill_len = 0
        self.logprobs = logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens of positions ``start .. end - 1`` (without copying the whole sequence)."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p:end - p]
        return self.prompt[start:] + self.output[:end - p]


class SeqGroup:
    """Branches that are admitted, preempted and swapped together: all beams of a beam search
    (one step needs all of them), or a single sampling branch (branches of a sample are
    independent). A request not yet prefilled is one group holding its prompt branch."""

    __slots__ = ("request", "branches")

    def __init__(self, request: Request, branches: list[Branch]):
        self.request = request
        self.branches = branches

    @property
    def seats(self) -> int:
        """Running sequences the group takes once prefilled."""
        req = self.request
        if not req.started:
            return req.params.num_beams if req.beam is not None else req.params.n
        return len(self.branches)


class Request:
    """One request: its prompt, parameters and branches (sampling) or beam search."""

    __slots__ = ("request_id", "prompt", "params", "seed", "branches", "beam", "started",
                 "finished", "reported", "aborted")

    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                 stop_ids: frozenset[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seed = seed
        #: Sampling: the branches by index (one until the prompt's prefill forks the rest).
        self.branches: list[Branch] = []
        self.beam: BeamSearch | None = None
        if params.use_beam_search:
            self.beam = BeamSearch(params.num_beams, params.n, params.max_new_tokens, stop_ids,
                                   params.length_penalty, params.early_stopping)
        self.started = False
        self.finished = False
        self.aborted = False
        #: Tokens of each branch already reported by a RequestOutput.
        self.reported = [0] * params.n

    def logprobs(self) -> list[list[dict[int, float]]] | None:
        """Per result branch, one ``{token_id: logprob}`` per new token (``None`` unless
        ``params.logprobs`` is set)."""
        if self.params.logprobs is None:
            return None
        out: list[list[dict[int, float]]] = [[] for _ in range(self.params.n)]
        for b in self.branches:
            out[b.index] = list(b.logprobs)
        return out

    def token_ids(self) -> tuple[list[list[int]], list[str | None]]:
        """Per result branch: the new tokens so far and the finish reason (None: running)."""
        n = self.params.n
        if self.beam is not None:
            if self.beam.done and not self.aborted:
                return self.beam.results()
            return [[] for _ in range(n)], ["abort" if self.aborted else None] * n
        toks: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [("abort" if self.aborted else None)] * n
        for b in self.branches:
            toks[b.index] = list(b.output)
            reasons[b.index] = b.finish_reason
        return toks, reasons


@dataclass
class RequestOutput:
    """What :meth:`PagedEngine.step` reports for a request that progressed or finished.

    ``token_ids[j]``: all new tokens of branch ``j`` so far; ``new_token_ids[j]``: those added
    since the previous output of the request; ``finish_reasons[j]``: ``"length"``, ``"stop"``,
    ``"abort"`` or ``None`` (running); ``finished``: every branch is done. A beam search reports
    once, when it ends: its ``n`` best beams, best first. ``logprobs[j]`` (requests with
    ``SamplingParams.logprobs`` set, else ``None``): one dict per new token of branch ``j`` so
    far, ``{token_id: logprob}`` for the chosen token and the ``logprobs`` most likely ones,
    the fp32 ``log_softmax`` of the model's logits (before temperature, top-k and top-p).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[list[int]]
    new_token_ids: list[list[int]]
    finished: bool
    finish_reasons: list[str | None]
    logprobs: list[list[dict[int, float]]] | None = None
