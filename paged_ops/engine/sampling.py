"""Per-request generation parameters and token sampling.

Sampling runs in fp32 on each branch's last logits: temperature, then top-k, then top-p, then
one draw from the branch's own ``torch.Generator``. A branch's generator is seeded from its
request's seed and its branch index only, and is drawn from exactly once per sampled token, so
its tokens do not depend on which other sequences share its batches, nor on preemption or
swapping.
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
    ``"stop"``), as EOS does unless ``ignore_eos``.

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
        if self.num_beams > 1:
            if self.n > self.num_beams:
                bad("n", f"<= num_beams ({self.num_beams}) for beam search")
            if self.temperature != 0.0:
                bad("temperature", "0 with num_beams > 1 (beam search is deterministic)")

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
    x = logits.float() / params.temperature
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        remove = cum <= 1.0 - params.top_p
        remove[-1] = False  # the most likely token always stays
        x = x.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return x


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> list[int]:
    """The next token of every row of ``logits`` ``[R, V]``: the argmax for greedy rows (one
    batched call), else one draw from the row's filtered distribution with its generator."""
    out: list[int | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = greedy if len(greedy) < len(params) else slice(None)
        for i, t in zip(greedy, logits[idx].argmax(-1).tolist(), strict=True):
            out[i] = t
    for i, p in enumerate(params):
        if out[i] is None:
            probs = filtered_logits(logits[i], p).softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
