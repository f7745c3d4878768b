"""The online API of paged_ops.engine.PagedEngine: add_request / step / stream, abort of
waiting, running and swapped requests, and overload rejection (tiny random Llama, CPU, fp32).

Greedy references come from transformers' ``model.generate``; sampled ones from the same
engine running the request without the others (sampling is batch independent, see
test_engine_sampling.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_ops.engine import EngineOverloaded, PagedEngine, SamplingParams  # noqa: E402
from paged_ops.engine.request import RequestOutput  # noqa: E402
from tests.test_engine import _check_pool_empty, _hf_generate, _tiny_llama  # noqa: E402

PROMPT_LENS = (3, 9, 16, 23, 37, 12)
MAX_NEW = 16


@pytest.fixture(scope="module")
def online_setup():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(555)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        refs = [_hf_generate(model, p, MAX_NEW)[len(p):].tolist() for p in prompts]
    return model, prompts, refs


GREEDY = SamplingParams(max_new_tokens=MAX_NEW)
SAMPLED = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=11, n=2)


def _drain(engine, outs_by_id):
    """step() until idle; checks that new_token_ids add up to token_ids."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert isinstance(out, RequestOutput)
            acc = outs_by_id.setdefault(out.request_id, [[] for _ in out.token_ids])
            for a, new, full in zip(acc, out.new_token_ids, out.token_ids, strict=True):
                a.extend(new)
                assert a == full
            outs_by_id[out.request_id] = acc
            if out.finished:
                assert all(r is not None for r in out.finish_reasons)


def test_step_and_stream_match_generate(online_setup):
    model, prompts, refs = online_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    first = engine.step()  # one packed prefill: every request got its first token
    assert sorted(o.request_id for o in first) == ids
    assert all(len(o.new_token_ids[0]) == 1 and not o.finished for o in first)
    # A request added while others run joins at the next step.
    ids.append(engine.add_request(prompts[3], GREEDY))
    got: dict[int, list[list[int]]] = {o.request_id: o.token_ids for o in first}
    _drain(engine, got)
    assert [got[i][0] for i in ids] == refs[:4]
    _check_pool_empty(engine)
    # stream(): every output of its requests, in arrival order, ending with finished ones.
    outs = list(engine.stream(prompts[:2], GREEDY))
    done = [o for o in outs if o.finished]
    assert len(done) == 2 and all(o.finish_reasons == ["length"] for o in done)
    assert sorted((o.token_ids[0] for o in done), key=len) == sorted(refs[:2], key=len)
    assert engine.generate(prompts[:2], params=GREEDY) == [[r] for r in refs[:2]]


def test_abort_waiting_running_and_swapped(online_setup):
    """Abort one request of each state mid-flight: its blocks are freed at once (GPU and
    CPU), it is reported with finish reason "abort", and every other request's tokens are
    those it gets without the aborted ones."""
    model, prompts, refs = online_setup
    alone = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    sampled_ref = alone.generate(prompts[5:6], params=SAMPLED)[0]
    # 9 blocks of 8 (72 positions), a CPU pool for swapping, max 3 waiting.
    engine = PagedEngine(model, num_blocks=9, block_size=8, num_cpu_blocks=32,
                         eos_token_id=None, max_waiting_requests=8)
    bm = engine.block_manager
    ids = [engine.add_request(p, GREEDY) for p in prompts[:5]]
    ids.append(engine.add_request(prompts[5], SAMPLED))
    got: dict[int, list[list[int]]] = {}
    states = {}
    for _ in range(60):
        for out in engine.step():
            got[out.request_id] = out.token_ids
        waiting = {g.request.request_id for g in engine.scheduler.waiting}
        running = {g.request.request_id for g in engine.scheduler.running}
        swapped = {g.request.request_id for g in engine.scheduler.swapped}
        if waiting and running and swapped:
            states = dict(waiting=min(waiting), running=max(running), swapped=min(swapped))
            if len(set(states.values())) == 3 and ids[5] not in states.values():
                break
    assert len(set(states.values())) == 3, "no step had a waiting, running and swapped request"
    aborted = set(states.values())
    for rid in aborted:
        used, cpu_used, seqs = bm.stats().used_blocks, bm.stats().cpu_used_blocks, len(bm)
        engine.abort(rid)
        assert len(bm) <= seqs and (bm.stats().used_blocks < used
                                    or bm.stats().cpu_used_blocks < cpu_used
                                    or rid == states["waiting"])
    sch = engine.scheduler
    assert not any(g.request.request_id in aborted
                   for q in (sch.waiting, sch.running, sch.swapped) for g in q)
    held = {b.seq_id for q in (sch.running, sch.swapped) for g in q for b in g.branches}
    assert set(bm.seq_ids()) == held  # nothing of the aborted requests is left
    reported = {o.request_id: o for o in engine.step()}
    for rid in aborted:
        assert reported[rid].finished and reported[rid].finish_reasons == ["abort"]
    engine.abort(states["running"])  # finished already: nothing happens
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.token_ids
    for i, rid in enumerate(ids[:5]):
        if rid not in aborted:
            assert got[rid] == [refs[i]]
    assert got[ids[5]] == sampled_ref
    assert engine.stats.aborted_requests == 3 and engine.stats.swap_preemptions > 0
    _check_pool_empty(engine)
    with pytest.raises(KeyError):
        engine.abort(12345)


def test_closing_a_stream_aborts_its_requests(online_setup):
    model, prompts, _ = online_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8)
    it = engine.stream(prompts[:3], SAMPLED)
    next(it)
    assert engine.block_manager.stats().used_blocks > 0
    it.close()
    assert not engine.has_unfinished_requests()
    _check_pool_empty(engine)


def test_overload_rejects_and_changes_nothing(online_setup):
    model, prompts, refs = online_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None,
                         max_waiting_requests=2)
    a = engine.add_request(prompts[0], GREEDY)
    engine.add_request(prompts[1], GREEDY)
    with pytest.raises(EngineOverloaded, match="max_waiting_requests=2") as exc:
        engine.add_request(prompts[2], GREEDY)
    assert isinstance(exc.value, RuntimeError)
    assert engine._num_waiting_requests() == 2 and engine.stats.rejected_requests == 1
    assert engine.stats.prompt_tokens == len(prompts[0]) + len(prompts[1])
    got = {o.request_id: o.token_ids for o in engine.step()}  # admits both: room again
    c = engine.add_request(prompts[2], GREEDY)
    _drain(engine, got)
    assert got[a] == [refs[0]] and got[c] == [refs[2]]
    # A request that could never fit raises ValueError, whatever the load.
    small = PagedEngine(model, num_blocks=4, block_size=8, max_waiting_requests=0)
    with pytest.raises(ValueError, match="pool has only 4 blocks"):
        small.add_request(prompts[4], GREEDY)
    with pytest.raises(EngineOverloaded):
        small.add_request(prompts[0], GREEDY)
    # generate() and stream() feed their requests as the waiting queue drains.
    assert engine.generate(prompts, params=GREEDY) == [[r] for r in refs]
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        engine.add_request([0, 256], GREEDY)


def test_generate_needs_an_idle_engine(online_setup):
    model, prompts, refs = online_setup
    engine = PagedEngine(model, num_blocks=64, block_size=8, eos_token_id=None)
    rid = engine.add_request(prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        engine.generate(prompts[:1], 4)
    engine.abort(rid)
    assert engine.generate(prompts[:1], 4) == [[refs[0][:4]]]
    # max_new_tokens=0 finishes at once, with empty branches.
    assert engine.generate(prompts[:2], params=SamplingParams(max_new_tokens=0, n=2)) == \
        [[[], []], [[], []]]
