"""The paged_ops demo: ``python -m paged_ops.demo [--plot PATH]`` (``make demo``).

Part 1, the ops: a short decode loop over a paged KV cache. Several sequences of different
lengths share one block pool. Each step writes the new token's key/value with
``reshape_and_cache`` and attends with ``torch.ops.paged.attention``; the demo prints the block
tables and tail waste and checks the paged output against dense attention over each sequence's
own keys/values.

Part 2, the engine (needs ``transformers``, the ``[hf]`` extra): :class:`paged_ops.engine.
PagedEngine` serves a batch of requests on a small random-weight Llama (GQA) with continuous
batching, two branches per prompt (fork + copy-on-write) and a pool too small for all of them
(requests wait and get preempted), with prefix caching on (a sequence readmitted after a
recompute preemption reuses its blocks still in the cache; a second batch of requests sharing a
system prompt prefills only their own suffixes). A progress line per step shows blocks in use
and tail waste; the summary gives tokens/s and the memory saved against a contiguous
max-length allocation; the generated tokens are checked against transformers' own
``model.generate``; a PNG plot of blocks in use over time goes to ``--plot`` (matplotlib).
Then sampled branches (``SamplingParams``: temperature, top-p, a seed; four branches per
prompt forked from its blocks) and a beam search (four beams forked from their parents each
step, checked against transformers' beam search), each with its block sharing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import paged_ops

from ._demo_check import greedy_mismatches


def run_decode_demo(device: str = "cpu", steps: int = 8, block_size: int = 16) -> float:
    torch.manual_seed(0)
    dtype = torch.float32
    num_heads, num_kv_heads, head_size = 8, 2, 64
    prompt_lens = [5, 16, 33, 70]
    num_blocks = 64
    key_cache, value_cache = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size,
                                                         block_size, dtype, device)
    key_cache.fill_(float("nan"))  # unwritten slots must never be read
    value_cache.fill_(float("nan"))
    free = torch.randperm(num_blocks).tolist()  # scattered physical blocks
    tables = [[] for _ in prompt_lens]
    dense_k = [torch.empty(0, num_kv_heads, head_size, device=device) for _ in prompt_lens]
    dense_v = [torch.empty(0, num_kv_heads, head_size, device=device) for _ in prompt_lens]
    lens = [0] * len(prompt_lens)

    def write(seq: int, n: int) -> None:
        slots = []
        for _ in range(n):
            pos = lens[seq]
            if pos % block_size == 0:
                tables[seq].append(free.pop())
            slots.append(tables[seq][pos // block_size] * block_size + pos % block_size)
            lens[seq] += 1
        k = torch.randn(n, num_kv_heads, head_size, device=device)
        v = torch.randn(n, num_kv_heads, head_size, device=device)
        paged_ops.reshape_and_cache(k, v, key_cache, value_cache,
                                    torch.tensor(slots, dtype=torch.int64, device=device))
        dense_k[seq] = torch.cat([dense_k[seq], k])
        dense_v[seq] = torch.cat([dense_v[seq], v])

    for s, n in enumerate(prompt_lens):
        write(s, n)
    worst = 0.0
    for step in range(steps):
        for s in range(len(prompt_lens)):
            write(s, 1)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                    dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        query = torch.randn(len(lens), num_heads, head_size, device=device)
        out = torch.ops.paged.attention(query, key_cache, value_cache, block_tables, seq_lens,
                                        head_size**-0.5)
        group = num_heads // num_kv_heads
        for s in range(len(lens)):
            k = dense_k[s].repeat_interleave(group, dim=1).transpose(0, 1)
            v = dense_v[s].repeat_interleave(group, dim=1).transpose(0, 1)
            ref = torch.nn.functional.scaled_dot_product_attention(
                query[s].unsqueeze(1), k, v).squeeze(1)
            worst = max(worst, (out[s] - ref).abs().max().item())
        if step in (0, steps - 1):
            print(f"step {step}: seq_lens {lens}")
            for s, t in enumerate(tables):
                waste = len(t) * block_size - lens[s]
                print(f"  seq {s}: block_table {t}  tail waste {waste} slots")
    used = sum(len(t) for t in tables)
    waste = sum(len(t) * block_size - n for t, n in zip(tables, lens, strict=True))
    contiguous = len(lens) * math.ceil(max(lens) / block_size) * block_size
    print(f"blocks in use {used}/{num_blocks}, tail waste {waste} slots "
          f"({100 * waste / (used * block_size):.1f}% of allocated); a contiguous max-length "
          f"layout would reserve {contiguous} slots vs {used * block_size} paged")
    print(f"paged attention vs dense attention: max abs difference {worst:.2e} "
          f"-> {'MATCH' if worst < 1e-4 else 'MISMATCH'}")
    return worst


# --------------------------------------------------------------------------- part 2: engine
DEFAULT_PLOT = "paged_ops_demo_blocks.png"


def _tiny_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=2048, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device).eval()


class _Progress:
    """A plain-text progress line per engine step (\r-updated on a terminal)."""

    def __init__(self, total_tokens: int, stream=sys.stdout):
        self.total = total_tokens
        self.stream = stream
        self.tty = stream.isatty()
        self.width = 0

    def __call__(self, engine, rec) -> None:
        st = engine.stats
        frac = rec.used_blocks / engine.num_blocks
        bar = "#" * round(10 * frac) + "-" * (10 - round(10 * frac))
        line = (f"step {rec.step:4d} {rec.kind:7s} | run {rec.running:2d} wait {rec.waiting:2d} "
                f"swap {rec.swapped:2d} | blocks {rec.used_blocks:3d}/{engine.num_blocks} "
                f"[{bar}] | tail waste {rec.tail_waste_slots:3d} slots | tokens "
                f"{st.tokens_generated:4d}/{self.total} | {st.tokens_per_s:6.0f} tok/s")
        if rec.preempted:
            line += f" | preempted {rec.preempted}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        elif rec.step % 25 == 1 or rec.preempted or st.tokens_generated == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _plot(stats, engine, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plot)")
        return None
    tl = stats.timeline
    steps = [r.step for r in tl]
    bs = engine.block_size
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(steps, [r.used_blocks for r in tl], label="paged: blocks in use", color="C0")
    ax.plot(steps, [math.ceil(r.contiguous_slots / bs) for r in tl], "--", color="C3",
            label="contiguous max-length reservation (in blocks)")
    ax.axhline(engine.num_blocks, color="k", lw=0.8, ls=":", label="pool size")
    pre = [r.step for r in tl if r.preempted]
    if pre:
        ax.plot(pre, [engine.num_blocks] * len(pre), "v", color="C1", label="preemption")
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"blocks of {bs} slots")
    ax2 = ax.twinx()
    ax2.step(steps, [r.running for r in tl], where="post", color="C2", alpha=0.5,
             label="running sequences")
    ax2.set_ylabel("running sequences")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_title("PagedEngine: KV blocks in use per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_engine_demo(device: str = "cpu", plot: str | None = DEFAULT_PLOT,
                    check: bool = True) -> bool:
    """Part 2: serve 12 prompts x 2 branches on a tiny Llama; returns whether tokens match."""
    try:
        import transformers
    except ImportError:
        print("part 2 skipped: transformers is not installed (pip install -e '.[hf]')")
        return True
    from .engine import PagedEngine

    model = _tiny_llama(device)
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(6, 90, (12,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    max_new, n, num_blocks, block_size = 48, 2, 40, 16
    cfg = model.config
    print(f"\n== part 2: PagedEngine on a random-weight Llama (transformers "
          f"{transformers.__version__}): {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, head_dim "
          f"{cfg.head_dim}, fp32, {device}")
    print(f"{len(prompts)} prompts of {min(lens)}-{max(lens)} tokens, n={n} branches each, "
          f"max_new_tokens={max_new}; pool of {num_blocks} blocks x {block_size} slots "
          f"= {num_blocks * block_size} positions (all requests at once would need up to "
          f"{n * sum(x + max_new for x in lens)})")
    total = n * len(prompts) * max_new
    progress = _Progress(total)
    engine = PagedEngine(model, num_blocks=num_blocks, block_size=block_size,
                         step_callback=progress, enable_prefix_caching=True)
    outs = engine.generate(prompts, max_new, n=n)
    progress.close()
    st = engine.stats
    bpb = engine.kv_bytes_per_block
    slot_bytes = bpb // block_size
    kib = 1024
    print(f"generated {st.tokens_generated} tokens in {st.elapsed_s:.2f} s = "
          f"{st.tokens_per_s:.0f} tokens/s ({st.steps} steps: {st.prefill_steps} prefill, "
          f"{st.decode_steps} decode; peak batch {st.peak_running} sequences)")
    print(f"scheduling: {st.forks} forks, {st.cow_copies} copy-on-write block copies, "
          f"{st.preemptions} preemptions by recompute, {st.deferred_admissions} steps with "
          f"requests waiting for blocks")
    readmitted = st.prefill_tokens + st.cached_prompt_tokens - st.prompt_tokens
    print(f"prefix cache: {st.cached_prompt_tokens} positions served from the cache, "
          f"{st.prefill_tokens} computed ({100 * st.prefix_cache_hit_rate:.0f}% hit rate); the "
          f"preempted sequences' readmissions covered {readmitted} positions, "
          f"{readmitted - st.cached_prompt_tokens} of them recomputed")
    busiest = max(st.timeline, key=lambda r: r.contiguous_slots)
    paged_slots = busiest.used_blocks * block_size
    print(f"blocks in use: peak {st.peak_used_blocks}/{num_blocks}; at the busiest step "
          f"({busiest.step}, {busiest.running} sequences) {busiest.used_blocks} blocks, tail "
          f"waste {busiest.tail_waste_slots} slots "
          f"({100 * busiest.tail_waste_slots / max(paged_slots, 1):.1f}% of allocated)")
    contig = busiest.contiguous_slots
    print(f"memory at that step: paged {paged_slots} slots = {paged_slots * slot_bytes / kib:.0f}"
          f" KiB vs contiguous max-length reservation (prompt + max_new_tokens per sequence) "
          f"{contig} slots = {contig * slot_bytes / kib:.0f} KiB -> "
          f"{100 * (1 - paged_slots / contig):.0f}% saved")
    smax = cfg.max_position_embeddings
    print(f"  (reserving S_max = {smax} positions per sequence would take "
          f"{busiest.running * smax * slot_bytes / kib:.0f} KiB; the whole paged pool is "
          f"{num_blocks * bpb / kib:.0f} KiB)")
    ok = True
    if check:
        t0 = time.perf_counter()
        bad = greedy_mismatches(model, prompts, outs, max_new, device)
        ok = bad == 0
        print(f"tokens vs transformers model.generate (greedy, per prompt): "
              f"{'IDENTICAL' if ok else f'{bad} MISMATCHING branches'} "
              f"({len(prompts)} prompts x {n} branches, checked in "
              f"{time.perf_counter() - t0:.1f} s)")
    ok = _shared_prefix_demo(model, engine, g, max_new=8) and ok
    ok = _sampling_and_beam_demo(model, g, device, check) and ok
    if plot:
        path = _plot(st, engine, plot)
        if path:
            print(f"plot of blocks in use per step: {path}")
    return ok


def _shared_prefix_demo(model, engine, g, max_new: int) -> bool:
    """Requests sharing a system prompt on the same engine: only their suffixes are
    prefilled. Checked against an engine without prefix caching (SDPA prefill)."""
    from .engine import PagedEngine

    system = torch.randint(0, 512, (100,), generator=g).tolist()
    lens = torch.randint(4, 30, (8,), generator=g).tolist()
    prompts = [system + torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    engine.step_callback = None  # no progress lines for this short run
    outs = engine.generate(prompts, max_new)
    st = engine.stats
    print(f"shared prefix: {len(prompts)} requests = a {len(system)}-token system prompt + "
          f"{min(lens)}-{max(lens)} own tokens ({st.prompt_tokens} prompt tokens): "
          f"{st.cached_prompt_tokens} served from the prefix cache, {st.prefill_tokens} "
          f"prefilled ({100 * st.prefix_cache_hit_rate:.0f}% hit rate)")
    plain = PagedEngine(model, num_blocks=engine.num_blocks, block_size=engine.block_size)
    ok = plain.generate(prompts, max_new) == outs
    print(f"  tokens vs the same engine without prefix caching: "
          f"{'IDENTICAL' if ok else 'MISMATCH'}")
    return ok


def _sharing(st) -> str:
    return (f"peak {st.peak_used_blocks} blocks in use vs {st.peak_unshared_blocks} without "
            f"sharing; {st.forks} forks, {st.cow_copies} copy-on-write block copies")


def _sampling_and_beam_demo(model, g, device: str, check: bool) -> bool:
    """Sampled branches and beam search on shared blocks; the beams are checked against
    transformers' beam search."""
    from .engine import PagedEngine, SamplingParams

    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 45, 70)]
    engine = PagedEngine(model, num_blocks=64, block_size=16)
    sp = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, n=4, seed=0)
    outs = engine.generate(prompts, params=sp)
    st = engine.stats
    print(f"\n== sampling: {len(prompts)} prompts x n={sp.n} branches (temperature "
          f"{sp.temperature}, top_p {sp.top_p}, seed {sp.seed}), {sp.max_new_tokens} tokens each")
    for j, b in enumerate(outs[0]):
        print(f"  prompt 0 branch {j}: {b[:12]} ...")
    distinct = sum(len({tuple(b) for b in br}) for br in outs)
    print(f"  {distinct}/{sp.n * len(prompts)} distinct branches; {_sharing(st)}")
    again = engine.generate(prompts[:1], params=sp)
    print(f"  prompt 0 alone, same seed: {'IDENTICAL' if again[0] == outs[0] else 'DIFFERENT'}"
          f" branches (a branch's tokens do not depend on its batch)")
    ok = again[0] == outs[0]

    k, n, max_new = 4, 2, 24
    bp = SamplingParams(max_new_tokens=max_new, num_beams=k, n=n)
    beams = engine.generate(prompts, params=bp)
    st = engine.stats
    print(f"== beam search: num_beams={k}, n={n}, {max_new} tokens")
    for i, hyps in enumerate(beams):
        print(f"  prompt {i} best beam: {hyps[0][:12]} ...")
    print(f"  beams on shared blocks: at most {st.peak_beam_blocks} blocks held by the beam "
          f"groups vs {st.peak_beam_unshared_blocks} for their beams as independent "
          f"sequences; {st.forks} forks, {st.cow_copies} copy-on-write block copies")
    if check:
        ref = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new, do_sample=False, num_beams=k,
                                     num_return_sequences=n, pad_token_id=0)
                ref.append([r[len(p):] for r in out.tolist()])
        same = ref == beams
        print(f"  beams vs transformers model.generate(num_beams={k}, num_return_sequences={n})"
              f": {'IDENTICAL' if same else 'MISMATCH'}")
        ok = ok and same
    return ok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paged_ops.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", default=DEFAULT_PLOT,
                    help=f"PNG of blocks in use per engine step (default: {DEFAULT_PLOT}; "
                         f"'' for none)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the comparison with transformers' model.generate")
    ap.add_argument("--tp", type=int, default=0, metavar="N",
                    help="tensor parallel over N ranks instead (launch with torchrun "
                         "--nproc-per-node N)")
    args = ap.parse_args(argv)
    if args.tp:
        from ._demo_tp import run_tp_demo
        if not run_tp_demo(args.tp):
            raise SystemExit("tensor-parallel PagedEngine tokens differ from one process's")
        return
    device = "cuda" if torch.cuda.is_available() and paged_ops.built_with_cuda() else "cpu"
    print(f"paged_ops demo on {device} (CPU kernel: {paged_ops.cpu_kernel_variant()}, "
          f"CUDA kernels built: {paged_ops.built_with_cuda()})")
    print("== part 1: decode loop over a paged cache vs dense attention")
    worst = run_decode_demo(device)
    if worst >= 1e-4:
        raise SystemExit("paged attention does not match dense attention")
    if not run_engine_demo(device, plot=args.plot or None, check=not args.no_check):
        raise SystemExit("PagedEngine tokens differ from transformers' generate")


if __name__ == "__main__":
    main()
