"""Cascade decode in paged_ops.engine (``PagedEngine(cascade=True)``): the planner that finds
the blocks a step's sequences share, the attention it runs against one plain call, and the
engine's tokens against transformers and against ``cascade=False``."""

from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops.engine import cascade as cascade_mod
from paged_ops.engine.cascade import cascade_attention, plan_cascade

BS = 4


def _plan(rows, lens, min_saved=0):
    width = max(len(r) for r in rows)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return tables, plan_cascade(tables, lens, BS, min_saved)


def test_no_sharing_no_plan():
    assert _plan([[0, 1, 2], [3, 4, 5]], [12, 12])[1] is None
    assert _plan([[0, 1, 2]], [12])[1] is None  # one sequence


def test_forked_branches_share_their_full_prompt_blocks():
    # Three branches of a 10-token prompt (blocks 0, 1 full; block 2 copied on write), each
    # now 11 long: columns 0 and 1 are shared, column 2 is each branch's own.
    tables, plan = _plan([[0, 1, 5], [0, 1, 6], [0, 1, 7]], [11, 11, 11])
    assert plan.rows.tolist() == [0, 1, 2]
    assert plan.shared_qsl.tolist() == [0, 3]
    assert plan.shared_tables.tolist() == [[0, 1]]
    assert plan.shared_lens.tolist() == [8]
    assert plan.suffix_tables[:, 0].tolist() == [5, 6, 7]
    assert plan.suffix_lens.tolist() == [3, 3, 3]
    assert plan.saved_tokens == 2 * 8


def test_block_being_written_is_not_shared():
    # Length 9: position 8 (the decode row) is in column 2; columns 0-1 are full. Length 8:
    # the row writes column 1, so only column 0 can be shared.
    _, plan = _plan([[0, 1, 5], [0, 1, 6]], [9, 9])
    assert plan.shared_lens.tolist() == [8]
    _, plan = _plan([[0, 1], [0, 1]], [8, 8])
    assert plan.shared_lens.tolist() == [4]
    _, plan = _plan([[0, 1], [0, 2]], [4, 8])  # a one-block sequence has no full block
    assert plan is None


def test_groups_by_deepest_shared_block():
    # Rows 0-1 share 3 blocks, rows 2-3 share 3 others; all four share block 0 (a common
    # system prompt): each pair is a group of depth 3, row 4 shares only block 0 with them
    # and joins nobody deeper (a group of one at depth 1 is dropped).
    rows = [[0, 1, 2, 9], [0, 1, 2, 10], [0, 3, 4, 11], [0, 3, 4, 12], [0, 13, 14, 15]]
    tables, plan = _plan(rows, [13] * 5)
    assert plan.shared_qsl.tolist() == [0, 2, 4]
    assert sorted(plan.rows.tolist()[:2]) == [0, 1] and sorted(plan.rows.tolist()[2:]) == [2, 3]
    assert plan.shared_tables.tolist() == [[0, 1, 2], [0, 3, 4]]
    assert plan.suffix_tables[:, 0].tolist() == [9, 10, 11, 12, 0]
    assert plan.suffix_lens.tolist() == [1, 1, 1, 1, 13]


def test_small_savings_are_not_cascaded():
    rows = [[0, 1, 5], [0, 1, 6]]
    assert _plan(rows, [11, 11], min_saved=9)[1] is None
    assert _plan(rows, [11, 11], min_saved=8)[1] is not None
    # The threshold is on the step's total: two groups saving 8 each pass 16, not 17.
    rows = [[0, 1, 5], [0, 1, 6], [2, 3, 7], [2, 3, 8]]
    assert _plan(rows, [11] * 4, min_saved=16)[1].shared_qsl.tolist() == [0, 2, 4]
    assert _plan(rows, [11] * 4, min_saved=17)[1] is None


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_cascade_attention_equals_one_call(cache_dtype, softcap):
    """Random groups of forked sequences over scattered blocks: the cascade's three calls
    equal one decode call over every block."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    hkv, group, d, bs = 2, 4, 32, 8
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    num_blocks = 200
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, lens = [], []
    for members, shared_blocks in ((3, 5), (1, 2), (4, 1), (2, 9)):
        shared = [perm.pop() for _ in range(shared_blocks)]
        for _ in range(members):
            tail = int(torch.randint(1, 2 * bs + 1, (1,), generator=g))
            own = [perm.pop() for _ in range(-(-tail // bs))]
            rows.append(shared + own)
            lens.append(shared_blocks * bs + tail)
    width = max(len(r) for r in rows)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    kc, vc = paged_ops.allocate_kv_cache(num_blocks, hkv, d, bs, cache_dtype)
    ks = vs = None
    src = torch.randn(num_blocks * bs, hkv, d, dtype=dtype)
    if cache_dtype == torch.float8_e4m3fn:
        ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
    paged_ops.reshape_and_cache(src, src * 0.5, kc, vc, torch.arange(num_blocks * bs),
                                k_scale=ks, v_scale=vs)
    q = torch.randn(len(rows), hkv * group, d, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_cascade(tables, lens, bs, 0)
    assert plan is not None and plan.shared_qsl.numel() == 4  # the single member is alone
    want = torch.ops.paged.attention(q, kc, vc, tables, seq_lens, d ** -0.5, None, -1, softcap,
                                     ks, vs)
    got = cascade_attention(q, kc, vc, plan, d ** -0.5, softcap, ks, vs)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# ---------------------------------------------------------------------- the engine
transformers = pytest.importorskip("transformers")

from paged_ops.engine import PagedEngine, SamplingParams  # noqa: E402
from tests.test_engine import _check_pool_empty, _tiny_llama  # noqa: E402
from tests.test_engine_beam import MAX_NEW, K, N, _hf_beam  # noqa: E402

PROMPT_LENS = (17, 33, 40)


@pytest.fixture
def always_cascade(monkeypatch):
    """Cascade every shared block, however few (the tiny model's prompts are short)."""
    monkeypatch.setattr(cascade_mod, "MIN_SAVED_TOKENS", 0)


@pytest.fixture(scope="module")
def setup():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return model, prompts


def test_beam_search_with_cascade_matches_transformers(setup, always_cascade):
    model, prompts = setup
    with torch.no_grad():
        refs = [_hf_beam(model, p) for p in prompts]
    engine = PagedEngine(model, num_blocks=96, block_size=8, eos_token_id=None)
    got = engine.generate(prompts, params=SamplingParams(max_new_tokens=MAX_NEW, num_beams=K,
                                                         n=N))
    assert got == refs
    assert engine.stats.cascade_steps > 0 and engine.stats.cascade_saved_tokens > 0
    _check_pool_empty(engine)


@pytest.mark.parametrize("kv", [None, torch.float8_e5m2])
def test_sampling_with_cascade_equals_without(setup, always_cascade, kv):
    """n = 4 seeded branches per prompt: the same tokens with and without cascade (and the
    same with prefix caching, where two requests share a prompt's blocks too)."""
    model, prompts = setup
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=50, seed=11, n=4)
    runs = {}
    for cascade, caching in ((False, False), (True, False), (True, True)):
        engine = PagedEngine(model, num_blocks=96, block_size=8, cascade=cascade,
                             kv_cache_dtype=kv, kv_scale=0.05 if kv else "auto",
                             enable_prefix_caching=caching)
        runs[cascade, caching] = engine.generate(prompts + prompts[:1], params=params)
        assert (engine.stats.cascade_steps > 0) == cascade
        _check_pool_empty(engine)
    assert runs[True, False] == runs[False, False]
    assert runs[True, True] == runs[False, False]


def test_greedy_branches_with_cascade(setup, always_cascade):
    model, prompts = setup
    engine = PagedEngine(model, num_blocks=96, block_size=8)
    plain = PagedEngine(model, num_blocks=96, block_size=8, cascade=False)
    got = engine.generate(prompts, MAX_NEW, n=3)
    assert got == plain.generate(prompts, MAX_NEW, n=3)
    assert all(b == branches[0] for branches in got for b in branches)
    assert engine.stats.cascade_steps > 0


def test_more_branches_than_shared_positions(setup, always_cascade):
    """12 branches of a 9-token prompt share one block of 8 positions: the group's 12 rows
    attend it at once (non-causal rows may outnumber the positions)."""
    model, _ = setup
    prompt = list(range(10, 19))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=12)
    got = PagedEngine(model, num_blocks=96, block_size=8).generate([prompt], params=params)
    plain = PagedEngine(model, num_blocks=96, block_size=8, cascade=False)
    assert got == plain.generate([prompt], params=params)
    assert len({tuple(b) for b in got[0]}) > 1


def test_default_threshold_skips_tiny_groups(setup):
    """With the default MIN_SAVED_TOKENS the tiny prompts save too little to cascade."""
    model, prompts = setup
    engine = PagedEngine(model, num_blocks=96, block_size=8)
    engine.generate(prompts[:1], MAX_NEW, n=2)
    assert engine.stats.cascade_steps == 0
