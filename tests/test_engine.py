"""End-to-end tests of paged_ops.engine.PagedEngine on a tiny random Llama (CPU, fp32).

Every test compares the engine's greedy tokens with transformers' own ``model.generate(...,
do_sample=False)`` run per prompt (no padding), token for token. The model is a Llama with GQA
(4 query heads, 2 KV heads) and seeded random weights; ``initializer_range=0.2`` makes its
logits peaked enough that every greedy choice of the references wins by a margin far above
fp32 rounding (checked by ``test_reference_is_not_a_near_tie``), so exact comparison is fair.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import ATTN_IMPLEMENTATION, PagedEngine  # noqa: E402

PROMPT_LENS = (3, 9, 16, 23, 37)
MAX_NEW = 28
MIN_MARGIN = 1e-4  # top-1 minus top-2 logit of every reference step; fp32 noise is ~1e-6


def _tiny_llama(seed: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _hf_generate(model, prompt, max_new_tokens):
    """transformers' greedy generate of one unpadded prompt: prompt + new tokens (1D). The
    explicit all-ones mask matters: generate would otherwise mask prompt tokens equal to
    pad_token_id."""
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)[0]


@pytest.fixture(scope="module")
def setup():
    """(model, prompts, references, margins) computed once, before any engine touches the
    model."""
    torch.manual_seed(0)
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[1][4] = 0  # a token equal to pad_token_id inside a prompt
    refs, margins = [], []
    with torch.no_grad():
        for p in prompts:
            out = _hf_generate(model, p, MAX_NEW)
            refs.append(out[len(p):].tolist())
            top2 = model(out[None]).logits[0, len(p) - 1:-1].topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).min().item())
    return model, prompts, refs, margins


def _check(outs, refs, n):
    assert len(outs) == len(refs)
    for i, (branches, ref) in enumerate(zip(outs, refs, strict=True)):
        assert len(branches) == n
        for j, got in enumerate(branches):
            assert got == ref, f"prompt {i} branch {j}: {got} != {ref}"


def _check_pool_empty(engine):
    bm = engine.block_manager
    assert len(bm) == 0
    assert bm.num_free_blocks == engine.num_blocks
    assert bm.stats().cpu_used_blocks == 0


def test_reference_is_not_a_near_tie(setup):
    _, _, refs, margins = setup
    assert all(len(r) == MAX_NEW for r in refs)
    assert min(margins) > MIN_MARGIN, margins


def test_greedy_matches_transformers(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=64, block_size=16)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    outs = engine.generate(prompts, MAX_NEW)
    _check(outs, refs, 1)
    st = engine.stats
    # Everything fits: one packed prefill of all prompts, then decode steps only.
    assert st.prefill_steps == 1 and st.preemptions == 0 and st.deferred_admissions == 0
    assert st.tokens_generated == len(prompts) * MAX_NEW
    assert st.decode_steps == MAX_NEW - 1
    assert st.peak_used_blocks == sum(-(-(n + MAX_NEW - 1) // 16) for n in PROMPT_LENS)
    assert len(st.timeline) == st.steps and st.timeline[-1].used_blocks == 0
    _check_pool_empty(engine)
    # The same engine again (pool reused), one prompt at a time.
    assert engine.generate(prompts[3:4], MAX_NEW) == [[refs[3]]]
    _check_pool_empty(engine)


def test_fork_copy_on_write(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    outs = engine.generate(prompts, MAX_NEW, n=2)
    _check(outs, refs, 2)
    st = engine.stats
    assert st.forks == len(prompts)
    # Prompts whose length is not a multiple of 8 leave a shared partial tail: the first
    # decode step of one branch copies it.
    assert st.cow_copies == sum(1 for n in PROMPT_LENS if n % 8)
    assert st.tokens_generated == 2 * len(prompts) * MAX_NEW
    _check_pool_empty(engine)


def test_three_branches_without_preemption(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=128, block_size=16)
    outs = engine.generate(prompts[:2], 12, n=3)
    _check(outs, [r[:12] for r in refs[:2]], 3)
    # ref count 3 on a partial tail: two branches copy it, the last one writes in place.
    assert engine.stats.cow_copies == 2 * 2
    _check_pool_empty(engine)


@pytest.mark.parametrize("n", [1, 2])
def test_small_pool_waits_and_preempts_by_recompute(setup, n):
    model, prompts, refs, _ = setup
    # 9 blocks of 8 = 72 positions: the longest request (37 + 28 - 1 = 64) fits alone, but the
    # pool cannot hold all requests at once.
    engine = PagedEngine(model, num_blocks=9, block_size=8)
    outs = engine.generate(prompts, MAX_NEW, n=n)
    _check(outs, refs, n)
    st = engine.stats
    assert st.deferred_admissions > 0  # requests waited for blocks
    assert st.preemptions > 0 and st.preemptions == st.recompute_preemptions
    assert st.peak_used_blocks <= 9
    assert sum(r.preempted for r in st.timeline) == st.preemptions
    # recompute re-prefills prompt + generated tokens: more prefill tokens than prompt tokens
    assert st.prefill_tokens > st.prompt_tokens
    assert st.tokens_generated == n * len(prompts) * MAX_NEW
    _check_pool_empty(engine)


def test_preemption_by_swap(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=9, block_size=8, num_cpu_blocks=32)
    assert engine.preemption_mode == "swap"
    outs = engine.generate(prompts, MAX_NEW, n=2)
    _check(outs, refs, 2)
    st = engine.stats
    assert st.swap_preemptions > 0 and st.swap_ins == st.swap_preemptions
    assert st.blocks_swapped_out > 0 and st.blocks_swapped_in > 0
    assert st.peak_used_blocks <= 9
    _check_pool_empty(engine)


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=9, block_size=8, num_cpu_blocks=2)
    outs = engine.generate(prompts, MAX_NEW)
    _check(outs, refs, 1)
    st = engine.stats
    assert st.recompute_preemptions > 0
    _check_pool_empty(engine)


def test_max_num_seqs_limits_the_batch(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=64, block_size=16, max_num_seqs=2)
    outs = engine.generate(prompts, 10)
    _check(outs, [r[:10] for r in refs], 1)
    st = engine.stats
    assert st.peak_running <= 2 and st.deferred_admissions > 0 and st.preemptions == 0


def test_eos_stops_a_branch(setup):
    model, prompts, refs, _ = setup
    # The 6th token of prompt 2's continuation as EOS: that request stops right after it
    # (EOS included), the others at its first occurrence, if any.
    eos = refs[2][5]
    engine = PagedEngine(model, num_blocks=64, block_size=16, eos_token_id=eos)
    outs = engine.generate(prompts, MAX_NEW, n=2)
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    _check(outs, expected, 2)
    assert len(outs[2][0]) <= 6
    _check_pool_empty(engine)
    # By default the engine takes EOS from model.generation_config.
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        assert PagedEngine(model, num_blocks=8).eos_token_ids == {eos}
    finally:
        model.generation_config.eos_token_id = old


def test_request_that_cannot_fit_raises(setup):
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=4, block_size=8)  # 32 positions
    with pytest.raises(ValueError, match="pool has only 4 blocks"):
        engine.generate([prompts[0], prompts[4]], MAX_NEW)
    _check_pool_empty(engine)
    # Nothing was started; requests that fit still run.
    assert engine.generate([prompts[0]], 8) == [[refs[0][:8]]]
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 4)


def test_model_outside_the_engine_falls_back_to_sdpa(setup):
    model, prompts, refs, _ = setup
    PagedEngine(model, num_blocks=8)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    out = _hf_generate(model, prompts[1], 8)
    assert out[len(prompts[1]):].tolist() == refs[1][:8]


def test_compiled_decode(setup):
    """The decode step through torch.compile(dynamic=True) (inductor), with preemption."""
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=9, block_size=8, compile="decode")
    outs = engine.generate(prompts, MAX_NEW, n=2)
    _check(outs, refs, 2)
    assert engine.stats.preemptions > 0 and engine.stats.cow_copies > 0
    _check_pool_empty(engine)
