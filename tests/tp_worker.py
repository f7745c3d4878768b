"""One rank of tests/test_tp.py, launched by ``torchrun --nproc-per-node 2`` (gloo, CPU).

``python tp_worker.py MODEL_DIR INDIVISIBLE_MODEL_DIR OUT_DIR``: loads ``MODEL_DIR`` sharded
by transformers' tensor-parallel plan and runs :class:`PagedEngine` on it with a pool small
enough to preempt and prefix caching on: greedy with two branches per prompt, requests sharing
a system prompt, seeded sampling with two branches, unseeded sampling, beam search; then
seeded sampling again on an engine that preempts by swapping, and greedy again with a step
budget of 8 tokens (prompts prefilled in chunks beside running decodes). Cascade decode is
on for every shared block (``MIN_SAVED_TOKENS = 0``). After every step it checks that
all ranks scheduled the same step and got bitwise identical logits. Writes
``OUT_DIR/rank<r>.json``; rank 0 also writes the single-process references (transformers'
``generate`` of the unsharded model for greedy, one process's engine on it for sampling and
beam search). The test process compares them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

PROMPT_LENS = (5, 11, 19, 26, 33, 40)
MAX_NEW = 14
N_BRANCHES = 2
NUM_BLOCKS, BLOCK_SIZE = 20, 8
SYSTEM_LEN, SHARED_MAX_NEW = 24, 6
BEAM_PROMPTS, BEAM_MAX_NEW = 2, 6


def _params():
    """Seeded sampling (two branches), and a beam search."""
    from paged_ops.engine import SamplingParams

    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=40, top_p=0.95,
                             n=N_BRANCHES, seed=11)
    beam = SamplingParams(max_new_tokens=BEAM_MAX_NEW, num_beams=3, n=2)
    return sampled, beam


def _prompts():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    system = torch.randint(0, 256, (SYSTEM_LEN,), generator=g).tolist()
    shared = [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 14)]
    return prompts, shared


class _StepCheck:
    """Step callback: every rank must see the same step (scheduling) and the same logits."""

    def __init__(self):
        self.steps = 0
        self.schedule_mismatches = 0
        self.logit_mismatches = 0

    def __call__(self, engine, rec):
        self.steps += 1
        seqs, logits = engine.last_step_logits
        mine = (rec.kind, rec.num_tokens, rec.used_blocks, rec.running, rec.waiting,
                rec.preempted, seqs)
        world = dist.get_world_size()
        theirs = [None] * world
        dist.all_gather_object(theirs, mine)
        if any(t != mine for t in theirs):
            self.schedule_mismatches += 1
            return  # logits of different steps cannot be compared
        got = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(got, logits.contiguous())
        if any(not torch.equal(g, logits) for g in got):
            self.logit_mismatches += 1


def _reference(model_dir, prompts, shared):
    from transformers import AutoModelForCausalLM

    from paged_ops.engine import PagedEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def gen(p, max_new):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)
        return out[0, len(p):].tolist()

    with torch.no_grad():
        refs = [gen(p, MAX_NEW) for p in prompts]
        shared_refs = [gen(p, SHARED_MAX_NEW) for p in shared]
    single = PagedEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    # Sampling and beam search: one process's engine with a pool that never preempts.
    roomy = PagedEngine(model, num_blocks=8 * NUM_BLOCKS, block_size=BLOCK_SIZE)
    sampled, beam = _params()
    return {"greedy": refs, "shared": shared_refs,
            "sampled": roomy.generate(prompts, params=sampled),
            "beam": roomy.generate(prompts[:BEAM_PROMPTS], params=beam),
            "kv_bytes_per_block": single.kv_bytes_per_block,
            "num_kv_heads": single.num_kv_heads}


def main(model_dir: str, bad_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM

    from paged_ops.engine import PagedEngine
    from paged_ops.engine import cascade as cascade_mod

    cascade_mod.MIN_SAVED_TOKENS = 0  # the prompts are short: cascade every shared block
    prompts, shared = _prompts()
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    check = _StepCheck()
    engine = PagedEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         enable_prefix_caching=True, step_callback=check)
    out = {"rank": rank, "tp_world_size": engine.tp.world_size, "tp_rank": engine.tp.rank,
           "num_heads": engine.num_heads, "num_kv_heads": engine.num_kv_heads,
           "kv_bytes_per_block": engine.kv_bytes_per_block,
           "cache_shape": list(engine.key_caches[0].shape)}
    # Without transformers' _tp_size the layout comes from the DTensor weights' mesh.
    from paged_ops.engine.tp import tp_layout
    model._tp_size, saved = None, model._tp_size
    lay = tp_layout(model, 4, 2, 16)
    model._tp_size = saved
    out["layout_from_weights"] = [lay.world_size, lay.rank, lay.num_heads, lay.num_kv_heads]
    out["greedy"] = engine.generate(prompts, MAX_NEW, n=N_BRANCHES)
    st = engine.stats
    out["greedy_stats"] = {"preemptions": st.preemptions, "cow_copies": st.cow_copies,
                           "forks": st.forks, "cached_prompt_tokens": st.cached_prompt_tokens,
                           "steps": st.steps, "cascade_steps": st.cascade_steps}
    out["shared"] = [b[0] for b in engine.generate(shared, SHARED_MAX_NEW)]
    out["shared_cached_prompt_tokens"] = engine.stats.cached_prompt_tokens
    sampled, beam = _params()
    out["sampled"] = engine.generate(prompts, params=sampled)
    out["sampled_preemptions"] = engine.stats.preemptions
    # No seed: each rank's default generator differs, the engine shares rank 0's seed.
    torch.manual_seed(100 + rank)
    sampled.seed = None
    out["unseeded"] = engine.generate(prompts[:3], params=sampled)
    out["beam"] = engine.generate(prompts[:BEAM_PROMPTS], params=beam)
    swapping = PagedEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                           num_cpu_blocks=2 * NUM_BLOCKS, step_callback=check)
    sampled.seed = 11
    out["swapped"] = swapping.generate(prompts, params=sampled)
    out["swap_preemptions"] = swapping.stats.swap_preemptions
    chunked = PagedEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                          max_num_batched_tokens=8, step_callback=check)
    out["chunked"] = chunked.generate(prompts, MAX_NEW)
    out["chunked_mixed_steps"] = chunked.stats.mixed_steps
    out["steps_checked"] = check.steps
    out["schedule_mismatches"] = check.schedule_mismatches
    out["logit_mismatches"] = check.logit_mismatches

    bad = AutoModelForCausalLM.from_pretrained(bad_dir, tp_plan="auto", dtype=torch.float32)
    try:
        PagedEngine(bad, num_blocks=4, block_size=BLOCK_SIZE)
        out["indivisible_error"] = None
    except ValueError as e:
        out["indivisible_error"] = str(e)

    if rank == 0:
        out["reference"] = _reference(model_dir, prompts, shared)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
