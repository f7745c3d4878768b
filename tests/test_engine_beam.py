"""Beam search in paged_ops.engine.PagedEngine against transformers' ``model.generate(...,
num_beams=4, num_return_sequences=2, do_sample=False)`` (tiny random Llama, CPU, fp32), token
for token, with and without EOS, and in a pool small enough to preempt."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import PagedEngine, SamplingParams  # noqa: E402
from tests.test_engine import _check_pool_empty, _tiny_llama  # noqa: E402

PROMPT_LENS = (3, 9, 16, 23, 37)
MAX_NEW = 12
K, N = 4, 2


def _hf_beam(model, prompt, eos=None, **kw):
    """transformers' beam search of one prompt: the N best hypotheses' new tokens (cut
    after the first EOS: the rest is padding)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                         do_sample=False, num_beams=K, num_return_sequences=N,
                         pad_token_id=0, eos_token_id=eos, **kw)
    eos = set() if eos is None else set(eos)
    res = []
    for row in out.tolist():
        r = row[len(prompt):]
        cut = next((i for i, t in enumerate(r) if t in eos), None)
        res.append(r if cut is None else r[: cut + 1])
    return res


@pytest.fixture(scope="module")
def beam_setup():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        refs = [_hf_beam(model, p) for p in prompts]
    return model, prompts, refs


def _params(**kw):
    return SamplingParams(max_new_tokens=MAX_NEW, num_beams=K, n=N, **kw)


def test_beam_search_matches_transformers(beam_setup):
    model, prompts, refs = beam_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    assert engine.generate(prompts, params=_params()) == refs
    st = engine.stats
    # Beams share blocks: the beam groups held far fewer blocks than 4 independent sequences
    # each; every step forks beams and copies shared tail blocks on write.
    assert 0 < st.peak_beam_blocks < st.peak_beam_unshared_blocks
    assert st.forks > 0 and st.cow_copies > 0
    assert st.tokens_generated == len(prompts) * K * MAX_NEW
    _check_pool_empty(engine)
    # n=1 is the best beam; n=K returns all K hypotheses, best first.
    one = engine.generate(prompts[:1], params=SamplingParams(max_new_tokens=MAX_NEW,
                                                             num_beams=K))
    assert one == [refs[0][:1]]


@pytest.mark.parametrize("early_stopping,length_penalty",
                         [(False, 1.0), (True, 1.0), ("never", -0.5)])
def test_beam_search_with_eos_matches_transformers(beam_setup, early_stopping, length_penalty):
    """16 EOS tokens (many hypotheses end early; keep = 17 k candidates per step). With
    these prompts early_stopping=True ends some searches before False does."""
    model, prompts, _ = beam_setup
    eos = list(range(3, 256, 16))
    with torch.no_grad():
        want = [_hf_beam(model, p, eos=eos, length_penalty=length_penalty,
                         early_stopping=early_stopping) for p in prompts]
    assert sum(len(h) < MAX_NEW for w in want for h in w) >= 2  # EOS ended hypotheses
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=eos)
    outs = engine.generate(prompts, params=_params(length_penalty=length_penalty,
                                                   early_stopping=early_stopping))
    assert outs == want
    _check_pool_empty(engine)
    # The same through stop_token_ids, with EOS off.
    plain = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    assert plain.generate(prompts[:2], params=_params(
        length_penalty=length_penalty, early_stopping=early_stopping,
        stop_token_ids=eos)) == want[:2]


@pytest.mark.parametrize("mode,cpu_blocks", [("recompute", 0), ("swap", 64), ("swap", 6)],
                         ids=["recompute", "swap", "swap-small-cpu-pool"])
def test_beam_search_under_preemption(beam_setup, mode, cpu_blocks):
    """24 blocks of 8: one beam group fits even unshared (4 x 6 blocks for the longest
    prompt), all five do not: groups are preempted whole and resume exactly. With a CPU pool
    of 6 blocks some groups do not fit it (their beams already moved are freed) and are
    recomputed instead."""
    model, prompts, refs = beam_setup
    engine = PagedEngine(model, num_blocks=24, block_size=8, eos_token_id=None,
                         num_cpu_blocks=cpu_blocks)
    assert engine.preemption_mode == mode
    assert engine.generate(prompts, params=_params()) == refs
    st = engine.stats
    assert st.preemptions > 0 and st.peak_used_blocks <= 24
    if mode == "swap":
        assert st.swap_preemptions > 0 and st.swap_ins == st.swap_preemptions
    if cpu_blocks != 64:
        assert st.recompute_preemptions > 0
    _check_pool_empty(engine)


def test_beam_request_that_cannot_fit_raises(beam_setup):
    model, prompts, _ = beam_setup
    engine = PagedEngine(model, num_blocks=20, block_size=8)
    with pytest.raises(ValueError, match="x 4 beams = 24 blocks"):
        engine.add_request(prompts[4], _params())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("num_blocks", [64, 24], ids=["roomy", "preempting"])
def test_beam_search_with_chunked_prefill(beam_setup, num_blocks):
    """A step budget of 16 tokens: prompts prefilled in chunks beside running beams' decode
    rows; in 24 blocks, a group preempted by recompute comes back with all its beams
    prefilled in one step, beyond the budget (its beams need their logits together)."""
    model, prompts, refs = beam_setup
    engine = PagedEngine(model, num_blocks=num_blocks, block_size=8, eos_token_id=None,
                         max_num_batched_tokens=16)
    assert engine.generate(prompts, params=_params()) == refs
    st = engine.stats
    assert st.mixed_steps > 0
    if num_blocks == 24:
        assert st.recompute_preemptions > 0
        assert max(r.prefill_tokens for r in st.timeline) > 16
    _check_pool_empty(engine)
