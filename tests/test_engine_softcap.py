"""A Gemma-2-style model in paged_ops.engine.PagedEngine: attention logit soft capping and
sliding-window layers go to ``torch.ops.paged.attention`` (``logits_soft_cap``,
``sliding_window``). Tiny random ``Gemma2ForCausalLM`` (CPU, fp32), against transformers' eager
attention (which applies both): greedy tokens equal ``model.generate``, every step's logits
equal the eager forward pass's, and the same model without the soft cap or without the window
is far off (so neither can be dropped unnoticed)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import ATTN_IMPLEMENTATION, PagedEngine  # noqa: E402
from tests.test_engine import MIN_MARGIN, _check_pool_empty, _greedy_refs  # noqa: E402

PROMPT_LENS = (5, 13, 30)
MAX_NEW = 10
SOFTCAP = 1.0  # small: it changes the attention of every layer a lot
WINDOW = 8  # the sliding layers (every other one) see 8 positions


def _gemma2(seed: int = 2, **overrides):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.2, query_pre_attn_scalar=16,
              sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP,
              final_logit_softcapping=30.0, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(**kw)).eval()


@pytest.fixture(scope="module")
def gemma_setup():
    model = _gemma2()
    assert "sliding_attention" in model.config.layer_types
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs, margins = _greedy_refs(model, prompts, MAX_NEW)
    assert min(margins) > MIN_MARGIN, margins
    return model, prompts, refs


def test_softcap_and_sliding_window_match_transformers(gemma_setup):
    model, prompts, refs = gemma_setup
    steps = []

    def cb(engine, rec):
        seqs, logits = engine.last_step_logits
        steps.append(dict(zip(seqs, logits.clone(), strict=True)))

    # A budget of 8 tokens: the 30-token prompt is prefilled in chunks beside decode rows.
    engine = PagedEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=8,
                         step_callback=cb)
    outs = engine.generate(prompts, MAX_NEW)
    assert [o[0] for o in outs] == refs
    assert engine.stats.mixed_steps > 0
    _check_pool_empty(engine)

    plain = {}
    for name, kw in (("no softcap", dict(attn_logit_softcapping=None)),
                     ("no window", dict(sliding_window=256))):
        other = _gemma2(**kw)
        other.load_state_dict(model.state_dict())
        plain[name] = other
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                got = torch.stack([s[(i, 0)] for s in steps if (i, 0) in s])
                ids = torch.tensor([p + outs[i][0][:-1]])
                want = model(ids, use_cache=False).logits[0, len(p) - 1:]
                assert got.shape == want.shape
                err = (got - want).abs().max().item()
                assert err < 1e-4, (i, err)
                for name, other in plain.items():
                    off = (other(ids, use_cache=False).logits[0, len(p) - 1:] - want)
                    if name == "no window" and len(ids[0]) <= WINDOW:
                        continue  # the window hides nothing yet
                    assert off.abs().max().item() > 1000 * max(err, 1e-6), (i, name)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
