"""Per-request generation parameters and token sampling.

Sampling runs in fp32 on each branch's last logits: temperature, then top-k, then top-p, then
one draw from the branch's own ``torch.Generator``. A branch's generator is seeded from its
request's seed and its branch index only, and is drawn from exactly once per sampled token, so
its tokens do not depend on which other sequences share its batches, nor on chunking,
preemption or swapping.

:class:`Sampler` does this for all rows of a step at once: the filters run on the whole
``[rows, vocab]`` tensor with per-row parameters; only the noise of the draw comes from each
row's own generator. The draw is ``torch.multinomial(probs, 1, generator=g)``'s: ``argmax(probs
/ q)`` with ``q ~ Exp(1)`` drawn from ``g`` over the vocabulary, so a row's token is the one
``torch.multinomial`` gives for the same generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads branch indices over the seeds


@dataclass
class SamplingParams:
    """How to generate for one request.

    ``max_new_tokens``: most new tokens per branch. ``temperature``: ``0`` is greedy;
    ``top_k``: keep the ``k`` most likely tokens (``0``: off); ``top_p``: keep the smallest set
    of most likely tokens whose probability reaches ``top_p`` (``1.0``: off). ``seed``: seeds
    the request's generators (``None``: drawn from torch's default generator when the request
    is added). ``n``: branches returned: independent samples sharing the prompt's blocks, or,
    with ``num_beams > 1``, the ``n`` best beams, best first. ``num_beams``: beam width (beam
    search is deterministic: ``temperature`` must be 0); ``length_penalty`` and
    ``early_stopping`` (``True``, ``False`` or ``"never"``) as in transformers' beam search.
    ``stop_token_ids``: tokens that end a branch (kept in its output, finish reason
    ``"stop"``), as EOS does unless ``ignore_eos``. ``logprobs``: ``None`` (off) or ``k >= 0``:
    each new token's ``{token_id: logprob}`` for the chosen token and the ``k`` most likely ones
    (:attr:`RequestOutput.logprobs`), the fp32 ``log_softmax`` of the model's logits before
    temperature, top-k and top-p (not with beam search).

    Invalid values raise ``ValueError`` naming the field.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"SamplingParams.{name} must be {want}, "
                             f"got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "an int >= 0")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0 \
                or self.temperature == float("inf"):
            bad("temperature", "a finite float >= 0")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an int >= 0 (0: off)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "a float in (0, 1]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "an int or None")
        if not is_int(self.n) or self.n < 1:
            bad("n", "an int >= 1")
        if not is_int(self.num_beams) or self.num_beams < 1:
            bad("num_beams", "an int >= 1")
        if not isinstance(self.length_penalty, (int, float)) \
                or self.length_penalty != self.length_penalty:
            bad("length_penalty", "a float")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", "True, False or 'never'")
        try:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError):
            bad("stop_token_ids", "a sequence of ints")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "None or an int >= 0")
        if self.num_beams > 1:
            if self.n > self.num_beams:
                bad("n", f"<= num_beams ({self.num_beams}) for beam search")
            if self.temperature != 0.0:
                bad("temperature", "0 with num_beams > 1 (beam search is deterministic)")
            if self.logprobs is not None:
                bad("logprobs", "None with num_beams > 1 (beams report no logprobs)")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (``temperature == 0`` or ``top_k == 1``)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1


def branch_generator(seed: int, branch: int, device) -> torch.Generator:
    """The generator of branch ``branch`` of a request seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed((seed + branch * _SEED_MIX) % (1 << 63))
    return g


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits (fp32, ``[V]``) after temperature, top-k and top-p; removed tokens
    are ``-inf``. Top-p keeps the most likely tokens up to and including the one whose
    cumulative probability reaches ``top_p`` (at least one)."""
    return _filter(logits.float()[None], [params])[0]


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p of every row of ``x`` (fp32 ``[R, V]``), each row with its
    own parameters; element for element the operations of transformers' logits warpers."""
    dev = x.device
    v = x.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    x = x / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, device=dev)
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
        x = x.masked_fill((x < kth) & (k > 0)[:, None], float("-inf"))
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        sub = x[rows]
        sorted_x, order = torch.sort(sub, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        limit = torch.tensor([1.0 - params[i].top_p for i in rows], dtype=torch.float32,
                             device=dev)
        remove = cum <= limit[:, None]
        remove[:, -1] = False  # the most likely token always stays
        sub = sub.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        if len(rows) == len(params):
            x = sub
        else:
            x = x.clone()
            x[rows] = sub
    return x


class Sampler:
    """The next token of every logits row of a step, and the logprobs asked for.

    ``__call__(logits, params, generators)``: ``logits`` ``[R, V]`` (any float dtype),
    one :class:`SamplingParams` and one generator (``None`` for greedy rows) per row. Returns
    ``(tokens, logprobs)``: one token id per row and, per row, ``None`` or the row's
    ``{token_id: logprob}`` dict. Greedy rows take the argmax; the others are filtered
    together and draw with their own generator (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        x = logits.float()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            toks = x.argmax(-1)
        else:
            toks = x.argmax(-1) if len(sampled) < len(params) else None
            every = len(sampled) == len(params)
            probs = _filter(x if every else x[sampled], [params[i] for i in sampled]).softmax(-1)
            q = torch.empty_like(probs)
            for r, i in enumerate(sampled):
                q[r].exponential_(1.0, generator=generators[i])
            drawn = (probs / q).argmax(-1)
            if toks is None:
                toks = drawn
            else:
                toks[sampled] = drawn
        tokens = toks.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(x[want], dim=-1)
            kmax = min(max(params[i].logprobs for i in want), lp.shape[-1])
            chosen = lp.gather(1, toks[want][:, None])[:, 0].tolist()
            top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long()))
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for r, i in enumerate(want):
                k = params[i].logprobs
                d = {tokens[i]: chosen[r]}
                for t, v in zip(top_i[r][:k], top_v[r][:k], strict=True):
                    d.setdefault(t, v)
                logprobs[i] = d
        return tokens, logprobs


_SAMPLER = Sampler()


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> list[int]:
    """The next token of every row of ``logits`` ``[R, V]`` (:class:`Sampler` without the
    logprobs)."""
    return _SAMPLER(logits, params, generators)[0]
