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


def _greedy_refs(model, prompts, max_new_tokens):
    """(references, margins): each prompt's new tokens by _hf_generate, and the smallest gap
    between the top two logits along them (a near tie would make any comparison luck)."""
    refs, margins = [], []
    with torch.no_grad():
        for p in prompts:
            out = _hf_generate(model, p, max_new_tokens)
            refs.append(out[len(p):].tolist())
            top2 = model(out[None]).logits[0, len(p) - 1:-1].topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).min().item())
    return refs, margins


@pytest.fixture(scope="module")
def setup():
    """(model, prompts, references, margins) computed once, before any engine touches the
    model."""
    torch.manual_seed(0)
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[1][4] = 0  # a token equal to pad_token_id inside a prompt
    refs, margins = _greedy_refs(model, prompts, MAX_NEW)
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
    # Everything fits the step budget: one prefill step of all prompts, then decode steps.
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


# --------------------------------------------------------------------------- prefix caching
PREFIX_LEN = 40  # with block_size 16: two full blocks (32 tokens) shared by every prompt
SUFFIX_LENS = (5, 13, 24, 0)
PREFIX_MAX_NEW = 16


@pytest.fixture(scope="module")
def shared_prefix(setup):
    """Prompts sharing a 40-token prefix, with transformers' greedy references and margins."""
    model = setup[0]
    g = torch.Generator().manual_seed(99)
    prefix = torch.randint(0, 256, (PREFIX_LEN,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in SUFFIX_LENS]
    refs, margins = [], []
    with torch.no_grad():
        for p in prompts:
            out = _hf_generate(model, p, PREFIX_MAX_NEW)
            refs.append(out[len(p):].tolist())
            top2 = model(out[None]).logits[0, len(p) - 1:-1].topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).min().item())
    return prompts, refs, margins


def test_prefix_caching_matches_transformers(setup, shared_prefix):
    model = setup[0]
    prompts, refs, margins = shared_prefix
    assert min(margins) > MIN_MARGIN, margins
    engine = PagedEngine(model, num_blocks=64, block_size=16, enable_prefix_caching=True)
    assert engine.block_manager.enable_prefix_caching
    outs = engine.generate(prompts, PREFIX_MAX_NEW, n=2)
    _check(outs, refs, 2)
    st = engine.stats
    # One prefill step: the first prompt registers the prefix's two full blocks, every later
    # prompt of the same batch reuses them and computes only its own suffix (from position 32).
    assert st.prefill_steps == 1 and st.preemptions == 0 and st.forks == len(prompts)
    assert st.cached_prompt_tokens == 32 * (len(prompts) - 1)
    assert st.prefill_tokens == st.prompt_tokens - st.cached_prompt_tokens
    assert st.timeline[0].num_tokens == st.prefill_tokens
    _check_pool_empty(engine)
    # Finished sequences leave their registered blocks cached (ref count 0, evictable).
    assert engine.block_manager.num_cached_blocks > 0
    # A second call on the same engine hits the blocks cached by the first: every prompt
    # reuses all its full blocks but the one holding its last token.
    outs = engine.generate(prompts, PREFIX_MAX_NEW)
    _check(outs, refs, 1)
    st = engine.stats
    assert st.cached_prompt_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert st.prefill_tokens == st.prompt_tokens - st.cached_prompt_tokens
    assert 0 < st.prefix_cache_hit_rate < 1
    _check_pool_empty(engine)
    # With prefix caching off nothing is served from the cache.
    plain = PagedEngine(model, num_blocks=64, block_size=16)
    assert plain.generate(prompts[:2], 4) == [[r[:4]] for r in refs[:2]]
    assert plain.stats.cached_prompt_tokens == 0
    assert plain.stats.prefill_tokens == plain.stats.prompt_tokens


def test_prefix_caching_gathered_sdpa_fallback(setup, shared_prefix):
    """The fallback for devices whose kernel lacks the multi-token op (gather + plain torch),
    forced on the CPU."""
    model = setup[0]
    prompts, refs, _ = shared_prefix
    engine = PagedEngine(model, num_blocks=64, block_size=16, enable_prefix_caching=True)
    assert engine.runner.native_multi_token  # the CPU kernel takes query_start_loc
    engine.runner.native_multi_token = False
    outs = engine.generate(prompts[::-1], 8)
    _check(outs, [r[:8] for r in refs[::-1]], 1)
    assert engine.stats.cached_prompt_tokens == 32 * (len(prompts) - 1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefix_caching_with_preemption(setup, mode):
    """A small pool with n=2 (fork + CoW) and preemption: a sequence preempted by recompute
    is readmitted with prompt + generated tokens and hits its own (or its sibling's) blocks
    still in the cache; swapped-in sequences revive cached blocks instead of copying."""
    model, prompts, refs, _ = setup
    engine = PagedEngine(model, num_blocks=9, block_size=8, enable_prefix_caching=True,
                         num_cpu_blocks=32 if mode == "swap" else 0)
    outs = engine.generate(prompts, MAX_NEW, n=2)
    _check(outs, refs, 2)
    st = engine.stats
    assert st.peak_used_blocks <= 9 and st.cow_copies > 0
    if mode == "swap":
        assert st.swap_preemptions > 0 and st.swap_ins == st.swap_preemptions
    else:
        assert st.recompute_preemptions > 0
        assert st.cached_prompt_tokens > 0  # readmissions served partly from the cache
        assert st.prefill_tokens + st.cached_prompt_tokens > st.prompt_tokens
    _check_pool_empty(engine)


# --------------------------------------------------------------------------- fp8 KV cache
FP8_STEPS = 6
# Bound on max |logit(fp8 cache) - logit(fp32 cache)| / (max logit - min logit) per step, over
# the steps where both engines have fed the same tokens. e4m3 keeps 3 mantissa bits: every
# cached key/value is off by up to 2^-4 of itself; through 3 layers of this deliberately
# peaked random model (logit range ~8-10) that measured 0.03 on average and 0.10 at worst.
# A scale that is not applied (on write or read) or a missing dequantisation is off by the
# whole range (~0.7-1.0 of it once the inputs diverge), so 0.15 separates the two.
FP8_REL_BOUND = 0.15


def _run_logged(model, prompts, max_new, **kw):
    """Generate with a step callback that keeps every step's logits per (request, branch)."""
    steps = []

    def cb(engine, rec):
        seqs, logits = engine.last_step_logits
        steps.append(dict(zip(seqs, logits.float().clone(), strict=True)))

    engine = PagedEngine(model, step_callback=cb, **kw)
    outs = engine.generate(prompts, max_new)
    per_seq = [torch.stack([s[(i, 0)] for s in steps if (i, 0) in s])
               for i in range(len(prompts))]
    return engine, [o[0] for o in outs], per_seq


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_fp8_cache_logits_close_to_fp32(setup, caching):
    """fp8 (e4m3, calibrated scales) vs fp32 cache: prefill + decode logits within
    FP8_REL_BOUND of the logit range; greedy tokens agree wherever the fp32 top-1 margin
    exceeds twice the fp8 logit error. Prefill and decode both attend over the fp8 cache,
    with and without prefix caching."""
    model, prompts, _, _ = setup
    kw = dict(num_blocks=64, block_size=16, enable_prefix_caching=caching)
    _, base, ref_logits = _run_logged(model, prompts, FP8_STEPS, **kw)
    engine, outs, logits = _run_logged(model, prompts, FP8_STEPS,
                                       kv_cache_dtype=torch.float8_e4m3fn, **kw)
    assert engine.key_caches[0].dtype == torch.float8_e4m3fn
    assert engine.kv_bytes_per_block * 4 == PagedEngine(model, num_blocks=1).kv_bytes_per_block
    # Calibrated on the first prefill, per layer: amax maps to 448 / 4.
    for s in engine.k_scales + engine.v_scales:
        assert s.dtype == torch.float32 and s.numel() == 1 and 0 < s.item() < 1
    compared = agreed = 0
    for i in range(len(prompts)):
        assert torch.isfinite(logits[i]).all() and len(outs[i]) == FP8_STEPS
        for t in range(FP8_STEPS):
            if outs[i][:t] != base[i][:t]:
                break  # different inputs from here on: nothing to compare
            a, b = ref_logits[i][t], logits[i][t]
            err = (a - b).abs().max().item()
            rng = (a.max() - a.min()).item()
            assert err <= FP8_REL_BOUND * rng, (i, t, err, rng)
            top2 = a.topk(2).values
            if (top2[0] - top2[1]).item() > 2 * err:
                assert outs[i][t] == base[i][t], (i, t)
            compared += 1
            agreed += outs[i][t] == base[i][t]
    # Every first token is compared, and most steps agree before a near-tie flips one.
    assert compared >= 2 * len(prompts) and agreed >= len(prompts) + 1


def test_fp8_cache_matches_fake_quantized_reference(setup):
    """The fp8 engine (prefix caching: prefill and decode both read the fp8 cache) against
    transformers' SDPA with keys/values quantised and dequantised with the engine's
    calibrated scales, teacher-forced over prompt + generated tokens: the same math, so the
    logits agree to fp32 noise (plus a rare value rounded to the other fp8 neighbour)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, prompts, _, _ = setup
    engine, outs, logits = _run_logged(model, prompts, FP8_STEPS, num_blocks=64,
                                       block_size=16, enable_prefix_caching=True,
                                       kv_cache_dtype=torch.float8_e4m3fn)
    scales = [(k.item(), v.item()) for k, v in zip(engine.k_scales, engine.v_scales,
                                                   strict=True)]

    def fq(x, s):
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    def fake_fp8_sdpa(module, q, k, v, mask, **kw):
        ks, vs = scales[module.layer_idx]
        return sdpa_attention_forward(module, q, fq(k, ks), fq(v, vs), mask, **kw)

    AttentionInterface.register("fp8_fake_quant_test", fake_fp8_sdpa)
    model.set_attn_implementation("fp8_fake_quant_test")
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                want = model(torch.tensor([p + outs[i][:-1]])).logits[0, len(p) - 1:]
                rng = (want.max(-1).values - want.min(-1).values).min().item()
                err = (want - logits[i]).abs().max().item()
                assert err <= 1e-2 * rng, (i, err, rng)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


@pytest.mark.parametrize("dtype,kv_scale,mode", [
    (torch.float8_e4m3fn, 1.0, "swap"),
    (torch.float8_e5m2, "auto", "recompute"),
])
def test_fp8_cache_generates_under_preemption(setup, dtype, kv_scale, mode):
    """fp8 caches through fork + CoW, preemption (swap: fp8 CPU pool) and prefix caching:
    every step's logits are finite and every branch runs to max_new_tokens."""
    model, prompts, _, _ = setup
    finite = []

    def cb(engine, rec):
        finite.append(bool(torch.isfinite(engine.last_step_logits[1]).all()))

    engine = PagedEngine(model, num_blocks=9, block_size=8, kv_cache_dtype=dtype,
                         kv_scale=kv_scale, enable_prefix_caching=mode == "recompute",
                         num_cpu_blocks=32 if mode == "swap" else 0, step_callback=cb)
    outs = engine.generate(prompts, 12, n=2)
    assert all(finite) and len(finite) == engine.stats.steps
    assert all(len(b) == 12 for branches in outs for b in branches)
    st = engine.stats
    assert st.preemptions > 0 and st.cow_copies > 0
    if mode == "swap":
        assert st.swap_preemptions > 0 and engine.cpu_key_caches[0].dtype == dtype
        assert engine.k_scales[0].item() == 1.0  # a fixed scale is never recalibrated
    _check_pool_empty(engine)


def test_kv_cache_dtype_and_scale_are_checked(setup):
    model = setup[0]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedEngine(model, num_blocks=4, kv_cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_scale"):
        PagedEngine(model, num_blocks=4, kv_cache_dtype=torch.float8_e4m3fn, kv_scale=0.0)
    with pytest.raises(ValueError, match="kv_scale"):
        PagedEngine(model, num_blocks=4, kv_cache_dtype=torch.float8_e4m3fn, kv_scale="max")
    engine = PagedEngine(model, num_blocks=4, kv_cache_dtype=torch.float8_e4m3fn,
                         kv_scale=(0.5, 0.25))
    assert engine.k_scales[2].item() == 0.5 and engine.v_scales[2].item() == 0.25
