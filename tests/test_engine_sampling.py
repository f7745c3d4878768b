"""Sampling in paged_ops.engine.PagedEngine (tiny random Llama, CPU, fp32).

The reference sampler is independent of the engine: transformers' full forward pass (SDPA, no
paged cache) over prompt + tokens so far, transformers' own logits warpers (temperature, top-k,
top-p) and one ``torch.multinomial`` draw per token from a generator seeded as the engine seeds
the branch's. The engine must produce the same tokens whatever shares its batches, and under
preemption by recompute or swap.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import PagedEngine, SamplingParams  # noqa: E402
from paged_ops.engine.sampling import branch_generator  # noqa: E402
from tests.test_engine import _check_pool_empty, _tiny_llama  # noqa: E402

PROMPT_LENS = (3, 9, 16, 23, 37)
MAX_NEW = 12


@pytest.fixture(scope="module")
def model_prompts():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(4321)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return model, prompts


def _reference_sample(model, prompt, params, branch, max_new):
    """One branch sampled token by token outside the engine."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    gen = branch_generator(params.seed, branch, "cpu")
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids = torch.tensor([toks])
            logits = model(ids).logits[:, -1].float()
            probs = warpers(ids, logits)[0].softmax(-1)
            toks.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return toks[len(prompt):]


SAMPLED = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=40, top_p=0.9, seed=7,
                         n=2)


def test_sampling_matches_reference_sampler(model_prompts):
    model, prompts = model_prompts
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    outs = engine.generate(prompts[:3], params=SAMPLED)
    for p, branches in zip(prompts[:3], outs, strict=True):
        for j, got in enumerate(branches):
            assert got == _reference_sample(model, p, SAMPLED, j, MAX_NEW)
    st = engine.stats
    assert st.forks == 3 and st.cow_copies > 0
    _check_pool_empty(engine)


@pytest.fixture(scope="module")
def sampled_together(model_prompts):
    model, prompts = model_prompts
    return PagedEngine(model, num_blocks=64, block_size=8).generate(prompts, params=SAMPLED)


@pytest.mark.parametrize("pool", ["alone", "recompute", "swap", "prefix-caching"])
def test_sampling_reproducible_across_batches_and_preemption(model_prompts, sampled_together,
                                                             pool):
    """Each prompt generated alone equals the same prompts generated together, in a pool
    small enough to preempt (by recompute or swap), or with prefix caching."""
    model, prompts = model_prompts
    together = sampled_together
    if pool == "alone":
        big = PagedEngine(model, num_blocks=64, block_size=8)
        got = [big.generate([p], params=SAMPLED)[0] for p in prompts]
    else:
        # 8 blocks of 8: the longest branch (37 + 12 - 1 = 48 positions) fits alone.
        engine = PagedEngine(model, num_blocks=8, block_size=8,
                             num_cpu_blocks=32 if pool == "swap" else 0,
                             enable_prefix_caching=pool == "prefix-caching")
        got = engine.generate(prompts, params=SAMPLED)
        assert engine.stats.preemptions > 0
        if pool == "swap":
            assert engine.stats.swap_preemptions > 0
        _check_pool_empty(engine)
    assert got == together


def test_branches_are_distinct_samples(model_prompts):
    model, prompts = model_prompts
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=3, n=4)
    outs = engine.generate(prompts, params=params)
    for branches in outs:
        assert len({tuple(b) for b in branches}) == 4, branches
    # Another seed gives other samples; the same seed the same ones.
    assert engine.generate(prompts[:2], params=SamplingParams(
        max_new_tokens=MAX_NEW, temperature=1.0, seed=4, n=4)) != outs[:2]
    assert engine.generate(prompts[:2], params=params) == outs[:2]
    # Forked branches share the prompt's blocks: at the first decode step 4 branches hold
    # fewer blocks than 4 independent sequences.
    first_decode = next(r for r in engine.stats.timeline if r.kind == "decode")
    assert first_decode.used_blocks < first_decode.unshared_blocks


def test_greedy_equivalents(model_prompts):
    """temperature 0 and top_k 1 are greedy (the default generate call)."""
    model, prompts = model_prompts
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    greedy = engine.generate(prompts, MAX_NEW, n=2)
    assert greedy[0][0] == greedy[0][1]
    for params in (SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=1),
                   SamplingParams(max_new_tokens=MAX_NEW, n=2, temperature=1.5, top_k=1)):
        assert engine.generate(prompts, params=params) == greedy


def test_stop_tokens_and_ignore_eos(model_prompts):
    model, prompts = model_prompts
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    full = engine.generate(prompts, MAX_NEW)
    stop = full[1][0][4]
    outs = engine.generate(prompts, params=SamplingParams(max_new_tokens=MAX_NEW,
                                                          stop_token_ids=[stop]))
    for got, ref in zip(outs, full, strict=True):
        r = ref[0]
        assert got[0] == (r[: r.index(stop) + 1] if stop in r else r)
    assert len(outs[1][0]) <= 5
    # EOS stops a branch unless ignore_eos; a stop token still does.
    eos_engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=stop)
    assert eos_engine.generate(prompts, MAX_NEW) == outs
    ignore = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    assert eos_engine.generate(prompts, params=ignore) == full
    ignore_stop = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                 stop_token_ids=(stop,))
    assert eos_engine.generate(prompts, params=ignore_stop) == outs


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", -1), ("temperature", -0.5), ("temperature", float("nan")),
    ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("seed", 1.5), ("n", 0),
    ("num_beams", 0), ("early_stopping", "sometimes"), ("stop_token_ids", ["a"]),
    ("stop_token_ids", [-1]), ("ignore_eos", 1), ("length_penalty", float("nan")),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_beam_params_are_checked():
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(num_beams=2, n=3)
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        SamplingParams(num_beams=2, temperature=0.5)
    assert SamplingParams(num_beams=4, n=4, early_stopping="never").use_beam_search


@pytest.mark.parametrize("budget,num_blocks", [(3, 64), (8, 64), (8, 8)],
                         ids=["budget3", "budget8", "budget8-preempting"])
def test_seeded_sampling_independent_of_chunking(model_prompts, sampled_together, budget,
                                                 num_blocks):
    """The same seeded samples whatever the step budget: prompts prefilled in chunks of 3 or
    8 tokens beside other sequences' decode rows (and preempted, in a pool of 8 blocks)."""
    model, prompts = model_prompts
    engine = PagedEngine(model, num_blocks=num_blocks, block_size=8,
                         max_num_batched_tokens=budget)
    assert engine.generate(prompts, params=SAMPLED) == sampled_together
    st = engine.stats
    assert st.mixed_steps > 0
    assert st.prefill_steps >= -(-sum(PROMPT_LENS) // budget)
    if num_blocks == 8:
        assert st.preemptions > 0
    _check_pool_empty(engine)


def _reference_logprobs(model, prompt, tokens):
    """fp32 log_softmax of transformers' logits before each of ``tokens`` (teacher forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.9, seed=7, n=2,
                   logprobs=3),
    SamplingParams(max_new_tokens=6, logprobs=0),
], ids=["sampled-top3", "greedy-chosen-only"])
def test_logprobs_match_transformers(model_prompts, params):
    """Each new token's logprobs: the chosen token and the top ``logprobs`` tokens, the fp32
    log_softmax of the raw logits (before temperature, top-k, top-p), checked against
    transformers' forward pass; with chunked prefill too."""
    model, prompts = model_prompts
    for budget in (4096, 8):
        engine = PagedEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=budget)
        done = [o for o in engine.stream(prompts[:3], params) if o.finished]
        assert len(done) == 3
        for out in done:
            assert len(out.logprobs) == params.n
            for toks, lps in zip(out.token_ids, out.logprobs, strict=True):
                assert len(lps) == len(toks) == params.max_new_tokens
                ref = _reference_logprobs(model, out.prompt_token_ids, toks)
                for t, (tok, d) in enumerate(zip(toks, lps, strict=True)):
                    top = ref[t].topk(params.logprobs).indices.tolist() if params.logprobs \
                        else []
                    assert set(d) == {tok, *top}
                    for k, v in d.items():
                        assert v == pytest.approx(ref[t, k].item(), abs=1e-4)
        # Without logprobs asked for, none are reported.
        plain = list(engine.stream(prompts[:1], SamplingParams(max_new_tokens=2)))
        assert all(o.logprobs is None for o in plain)


def test_logprobs_params_are_checked():
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        SamplingParams(num_beams=2, logprobs=1)


def test_rows_with_different_params_sample_together(model_prompts):
    """One step samples rows with different temperature, top-k and top-p (and greedy rows)
    at once; each request's tokens equal those it gets alone, and the reference sampler's."""
    model, prompts = model_prompts
    mix = [SamplingParams(max_new_tokens=MAX_NEW),
           SAMPLED,
           SamplingParams(max_new_tokens=MAX_NEW, temperature=1.3, top_p=0.8, seed=5),
           SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_k=5, seed=9, n=2),
           SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=2)]
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    together = {o.request_id: o.token_ids for o in engine.stream(prompts, mix) if o.finished}
    together = [together[i] for i in sorted(together)]
    alone = [engine.generate([p], params=sp)[0] for p, sp in zip(prompts, mix, strict=True)]
    assert together == alone
    for j, got in enumerate(together[2]):
        assert got == _reference_sample(model, prompts[2], mix[2], j, MAX_NEW)
