"""Chunked prefill in mixed batches in paged_ops.engine.PagedEngine (tiny random Llama, CPU,
fp32): prompts longer than the step's token budget are prefilled over several steps, in the
same forward pass as the running sequences' decode rows, and the tokens still equal
transformers' ``model.generate`` (greedy) and the engine's unchunked run (seeded sampling).
Every step is one forward pass through the paged op: no SDPA call, no dense mask."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import PagedEngine, SamplingParams  # noqa: E402
from tests.test_engine import (  # noqa: E402
    MIN_MARGIN,
    _check,
    _check_pool_empty,
    _greedy_refs,
    _tiny_llama,
)

PROMPT_LENS = (3, 9, 16, 23, 37)
MAX_NEW = 12
BUDGET = 8  # tokens per step: the 37-token prompt takes at least 5 steps


@pytest.fixture(scope="module")
def chunk_setup():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(777)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs, margins = _greedy_refs(model, prompts, MAX_NEW)
    assert min(margins) > MIN_MARGIN, margins
    return model, prompts, refs


def _count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def _check_steps(engine, budget):
    st = engine.stats
    assert st.steps == st.prefill_steps + st.decode_steps == len(st.timeline)
    for rec in st.timeline:
        assert rec.num_tokens == rec.prefill_tokens + rec.decode_rows
        # Decode rows always run; prompt chunks only fill what the budget leaves.
        assert rec.num_tokens <= max(budget, rec.decode_rows)
    assert sum(r.prefill_tokens for r in st.timeline) == st.prefill_tokens


@pytest.mark.parametrize("case", ["plain", "fork", "recompute-prefix-caching", "swap"])
def test_chunked_prefill_matches_transformers(chunk_setup, case):
    """Prompts of up to 37 tokens with a budget of 8 tokens per step; with two branches per
    prompt, prefix caching and preemption by recompute (a preempted sequence is recomputed in
    chunks too) or by swap."""
    model, prompts, refs = chunk_setup
    n = 1 if case == "plain" else 2
    kw = dict(num_blocks=64, block_size=8)
    if case == "recompute-prefix-caching":
        kw.update(num_blocks=9, enable_prefix_caching=True)
    elif case == "swap":
        kw.update(num_blocks=9, num_cpu_blocks=32)
    engine = PagedEngine(model, max_num_batched_tokens=BUDGET, **kw)
    calls, handle = _count_forwards(model)
    try:
        outs = engine.generate(prompts, MAX_NEW, n=n)
    finally:
        handle.remove()
    _check(outs, refs, n)
    st = engine.stats
    assert len(calls) == st.steps  # one forward pass per step
    _check_steps(engine, BUDGET)
    assert st.mixed_steps > 0  # decode rows and prompt chunks in one forward pass
    # Every prompt position was computed once at least, in chunks of at most the budget.
    assert st.prefill_tokens + st.cached_prompt_tokens >= st.prompt_tokens
    assert st.prefill_steps >= -(-sum(PROMPT_LENS) // BUDGET)
    if case in ("recompute-prefix-caching", "swap"):
        assert st.preemptions > 0
    if case == "swap":
        assert st.swap_preemptions > 0
    if case == "recompute-prefix-caching":
        assert st.recompute_preemptions > 0
    _check_pool_empty(engine)


def test_decodes_run_while_a_long_prompt_is_chunked(chunk_setup):
    """A running request gets one token every step while a prompt longer than the budget is
    prefilled in chunks beside it; the long prompt's first token comes after its last
    chunk."""
    model, prompts, refs = chunk_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=BUDGET,
                         eos_token_id=None)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    short = engine.add_request(prompts[0], params)  # 3 tokens: prefilled in one step
    got = {o.request_id: o.token_ids[0] for o in engine.step()}
    assert len(got[short]) == 1
    long = engine.add_request(prompts[4], params)  # 37 tokens: chunks of 7, 7, 7, 7, 7, 2
    chunk_steps = 0
    while long not in got:
        outs = {o.request_id: o for o in engine.step()}
        rec = engine.stats.timeline[-1]
        assert rec.kind == "mixed" and rec.decode_rows == 1
        assert rec.num_tokens <= BUDGET
        assert len(outs[short].new_token_ids[0]) == 1  # the short request never waits
        got[short] = outs[short].token_ids[0]
        if long in outs:
            got[long] = outs[long].token_ids[0]
        chunk_steps += 1
    assert chunk_steps == -(-len(prompts[4]) // (BUDGET - 1))
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o.token_ids[0]
    assert got[short] == refs[0] and got[long] == refs[4]
    _check_pool_empty(engine)


def test_prefill_tokens_beside_decodes_are_capped(chunk_setup):
    """max_prefill_tokens_with_decodes=3: while a request decodes, the long prompt is
    prefilled 3 tokens per step (the budget alone would allow 7); alone, a step takes the
    whole budget. Tokens are unchanged."""
    model, prompts, refs = chunk_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=BUDGET,
                         max_prefill_tokens_with_decodes=3, eos_token_id=None)
    outs = engine.generate([prompts[0], prompts[4]], MAX_NEW)
    assert outs == [[refs[0]], [refs[4]]]
    st = engine.stats
    assert st.mixed_steps > 0
    for rec in st.timeline:
        if rec.decode_rows:
            assert rec.prefill_tokens <= 3
        else:
            assert rec.num_tokens <= BUDGET
    # Both prompts fit the first step's budget of 8 only in part: 8 prompt tokens, no decode.
    assert st.timeline[0].prefill_tokens == BUDGET
    for bad in (0, -1, 2.5, "4"):
        with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
            PagedEngine(model, num_blocks=8, block_size=8, max_prefill_tokens_with_decodes=bad)


def test_no_sdpa_and_no_dense_mask(chunk_setup, monkeypatch):
    """Prefill of several prompts at once, chunked and not: attention never goes through
    SDPA (nor any other dense-mask attention) inside the engine."""
    model, prompts, refs = chunk_setup

    def refuse(*args, **kwargs):
        raise AssertionError("scaled_dot_product_attention called inside the engine")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    for budget in (4096, BUDGET):
        engine = PagedEngine(model, num_blocks=64, block_size=16,
                             max_num_batched_tokens=budget)
        _check(engine.generate(prompts, 4), [r[:4] for r in refs], 1)


def test_fp8_scales_calibrated_on_the_first_chunk(chunk_setup):
    """kv_scale="auto" with a prompt longer than the budget: each layer's scales come from
    the keys/values of the first step alone (positions 0..BUDGET-1 of the first prompt).
    Reference: transformers' own forward pass over the whole prompt, each layer taking the
    amax of its first BUDGET positions and attending over fp8-rounded keys/values with the
    scales so found (as the engine's cache holds them), so later layers see what the
    engine's layers saw."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from paged_ops.engine import KV_SCALE_HEADROOM

    model, prompts, _ = chunk_setup
    target = torch.finfo(torch.float8_e4m3fn).max / KV_SCALE_HEADROOM
    scales: dict[int, tuple[float, float]] = {}

    def fq(x, s):
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    def capture(module, q, k, v, mask, **kw):
        ks = k[:, :, :BUDGET].abs().max().item() / target
        vs = v[:, :, :BUDGET].abs().max().item() / target
        scales[module.layer_idx] = (ks, vs)
        return sdpa_attention_forward(module, q, fq(k, ks), fq(v, vs), mask, **kw)

    engine = PagedEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=BUDGET,
                         kv_cache_dtype=torch.float8_e4m3fn)
    engine.generate(prompts[4:], 2)
    assert engine.stats.timeline[0].num_tokens == BUDGET < len(prompts[4])
    AttentionInterface.register("amax_capture_test", capture)
    model.set_attn_implementation("amax_capture_test")
    try:
        with torch.no_grad():
            model(torch.tensor([prompts[4]]))
    finally:
        model.set_attn_implementation("paged_ops")
    assert len(scales) == model.config.num_hidden_layers
    for layer, (ks, vs) in scales.items():
        assert engine.k_scales[layer].item() == pytest.approx(ks, rel=1e-4)
        assert engine.v_scales[layer].item() == pytest.approx(vs, rel=1e-4)
    # The whole prompt's amax is larger: calibrating on more than the first chunk would show.
    whole = PagedEngine(model, num_blocks=64, block_size=8, kv_cache_dtype=torch.float8_e4m3fn)
    whole.generate(prompts[4:], 1)
    assert any(w.item() > c.item() * 1.001 for w, c in zip(whole.k_scales + whole.v_scales,
                                                            engine.k_scales + engine.v_scales))


def test_compiled_mixed_steps(chunk_setup):
    """compile=True: decode steps and mixed steps (prompt chunks beside decode rows, a
    partial chunk without logits) run through torch.compile(dynamic=True), with preemption
    and copy-on-write; the tokens equal transformers'."""
    model, prompts, refs = chunk_setup
    engine = PagedEngine(model, num_blocks=9, block_size=8, compile=True,
                         max_num_batched_tokens=BUDGET)
    assert engine.runner._compile_mixed
    outs = engine.generate(prompts, MAX_NEW, n=2)
    _check(outs, refs, 2)
    st = engine.stats
    assert st.mixed_steps > 0 and st.decode_steps > 0
    assert st.preemptions > 0 and st.cow_copies > 0
    _check_pool_empty(engine)
