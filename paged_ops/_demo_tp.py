"""``torchrun --nproc-per-node N -m paged_ops.demo --tp N``: PagedEngine on a tensor-parallel model.

Every rank builds the same seeded tiny Llama (8 query heads and 2 KV heads; 4N and N on N > 2
ranks), saves it to a temporary directory of its own (no shared file system needed) and loads
it with transformers' ``tp_plan="auto"``, which shards each attention layer's heads over the
ranks. Every rank runs
the same :class:`~paged_ops.engine.PagedEngine` schedule on its own KV heads; rank 0 prints the
tokens against one process's transformers ``generate`` and each rank's KV bytes.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import paged_ops

from ._demo_check import greedy_mismatches


def _tiny_llama(tp: int):
    """A random-weight Llama whose heads divide by ``tp``: 2 KV heads (``tp`` <= 2) or ``tp``
    of them, and 4 query heads per KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kv_heads = 2 if tp <= 2 else tp
    cfg = LlamaConfig(vocab_size=512, hidden_size=64 * kv_heads, intermediate_size=128 * kv_heads,
                      num_hidden_layers=4, num_attention_heads=4 * kv_heads,
                      num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=2048,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def run_tp_demo(tp: int) -> bool:
    """Run on every rank of a ``torchrun`` launch of ``tp`` processes; True if tokens match."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise SystemExit(f"--tp {tp} needs {tp} processes (WORLD_SIZE is {world}): run "
                         f"torchrun --nproc-per-node {tp} -m paged_ops.demo --tp {tp}")
    from transformers import AutoModelForCausalLM

    from .engine import PagedEngine

    plain = _tiny_llama(tp)  # the same seeded weights on every rank
    with tempfile.TemporaryDirectory() as path:
        plain.save_pretrained(path)
        # transformers initialises the process group (gloo on CPU, NCCL on CUDA) from
        # torchrun's environment and puts each rank's shard on its local device.
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    rank = dist.get_rank()
    device = next(model.parameters()).device
    if device.type == "cuda" and not paged_ops.built_with_cuda():
        raise SystemExit("the model is on CUDA but paged_ops was built without CUDA kernels")
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(6, 60, (8,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    max_new, n, num_blocks, block_size = 24, 2, 24, 16
    engine = PagedEngine(model, num_blocks=num_blocks, block_size=block_size,
                         enable_prefix_caching=True)
    outs = engine.generate(prompts, max_new, n=n)
    st = engine.stats
    mine = (rank, str(device), engine.num_heads, engine.num_kv_heads, engine.kv_bytes_per_block)
    every = [None] * world
    dist.all_gather_object(every, mine)
    ok = True
    if rank == 0:
        cfg = plain.config
        print(f"\n== tensor parallel: {world} ranks ({dist.get_backend()}), a random-weight Llama "
              f"of {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, "
              f"{cfg.num_hidden_layers} layers, sharded by transformers' tp_plan='auto'")
        print(f"{len(prompts)} prompts of {min(lens)}-{max(lens)} tokens, n={n} branches, "
              f"max_new_tokens={max_new}; pool of {num_blocks} blocks x {block_size} slots per "
              f"rank: {st.steps} steps, {st.preemptions} preemptions, {st.cow_copies} "
              f"copy-on-write copies, {st.cached_prompt_tokens} positions from the prefix cache")
        plain = plain.to(device)
        single = PagedEngine(plain, num_blocks=num_blocks, block_size=block_size)
        for r, dev, heads, kv_heads, bpb in every:
            print(f"  rank {r} ({dev}): {heads} query / {kv_heads} KV heads, KV cache "
                  f"{bpb} bytes per block, {num_blocks * bpb / 1024:.0f} KiB pool")
        print(f"  one process: {single.num_kv_heads} KV heads, {single.kv_bytes_per_block} bytes "
              f"per block, {num_blocks * single.kv_bytes_per_block / 1024:.0f} KiB pool")
        bad = greedy_mismatches(plain, prompts, outs, max_new, device)
        ok = bad == 0
        print(f"tokens of rank 0 vs one process's transformers model.generate (greedy): "
              f"{'IDENTICAL' if ok else f'{bad} MISMATCHING branches'} "
              f"({len(prompts)} prompts x {n} branches)")
    # Every rank's tokens against rank 0's (the schedule and sampling are replicated).
    firsts = [None] * world
    dist.all_gather_object(firsts, outs)
    same = all(o == firsts[0] for o in firsts)
    verdict = [ok and same]
    dist.broadcast_object_list(verdict, src=0)
    if rank == 0:
        print(f"tokens on every rank: {'IDENTICAL' if same else 'DIFFERENT'}")
    dist.destroy_process_group()
    return bool(verdict[0])
