"""PagedEngine against transformers on one workload, in one process.

Offline (default): a seeded random-weight ``LlamaForCausalLM`` (hidden 512, 8 layers, 8 query
/ 2 KV heads of 64, intermediate 1408, vocab 8192), 16 prompts of 256 random tokens, 64 new
tokens each, greedy, EOS off. Systems, each timed over the whole run after a short warm-up:

- ``engine``: ``PagedEngine(model, num_blocks, block_size=16)`` (``--budget``:
  ``max_num_batched_tokens``, default the engine's offline and ``ONLINE_BUDGET`` online);
- ``generate``: ``model.generate`` with SDPA and the dynamic cache, all prompts in one batch;
- ``engine_compile`` (not in the default list): the same engine with ``compile=True`` (the
  warm-up compiles it);
- ``static``: the same with ``cache_implementation="static"``;
- ``generate_batch``: transformers' continuous batching (``sdpa_paged``), where this
  transformers version has it.

It prints output tokens/s, the first forward pass (the engine's first step; generate's
prefill of every prompt) and the median decode step, for every dtype asked for, and whether
each system's tokens equal the engine's. ``--online``: Poisson arrivals (``--rate``
requests/s) of 256- and 4096-token prompts (``--long-every``: one long prompt in that many),
run through ``add_request`` / ``step``; prints time to first token (short and long prompts)
and inter-token latency p50/p99 of every request, and the same for the decode gaps of the
requests that were running while a long prompt was being prefilled.

``--quick`` shrinks everything (a 2-layer model, short prompts, few tokens) to check that the
script runs in well under a minute; its numbers mean nothing.

    python benchmarks/bench_engine.py --dtypes fp32,bf16
    python benchmarks/bench_engine.py --online --rate 0.5 --num-requests 32 --budget 512
    python benchmarks/bench_engine.py --quick && python benchmarks/bench_engine.py --quick --online
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SYSTEMS = ("engine", "generate", "static", "generate_batch")
EXTRA_SYSTEMS = ("engine_compile",)
# Online default step budget: a mixed step then costs a small multiple of a decode step on a
# 2-core CPU with the default model, so decode rows beside long prompts stay regular.
ONLINE_BUDGET = 128


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_model(args, dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, max_position_embeddings=max_positions,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


class ForwardTimer:
    """Wall time of every forward pass of ``model`` (a pre- and a post-hook)."""

    def __init__(self, model):
        self.times: list[float] = []
        self._t = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.times.append(time.perf_counter() - self._t)

    def close(self):
        for h in self._handles:
            h.remove()


def _summary(name, wall, ntok, times, tokens):
    first = times[0] if times else float("nan")
    rest = times[1:]
    step = statistics.median(rest) if rest else float("nan")
    return dict(system=name, tok_s=ntok / wall, wall_s=wall, first_s=first, step_s=step,
                tokens=tokens)


# --------------------------------------------------------------------------- offline systems
def run_engine(model, prompts, args, warm, compile=False):
    from paged_ops.engine import PagedEngine, SamplingParams

    per_seq = -(-(args.prompt_len + args.max_new) // 16)
    engine_kw = dict(num_blocks=len(prompts) * per_seq + 16, block_size=16, eos_token_id=None,
                     compile=compile)
    if args.budget:
        engine_kw["max_num_batched_tokens"] = args.budget
    engine = PagedEngine(model, **engine_kw)
    sp = SamplingParams(max_new_tokens=args.max_new, ignore_eos=True)
    # A compiled engine warms up on the workload's own shapes (its graphs are built then).
    engine.generate(prompts if compile else warm,
                    params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = engine.generate(prompts, params=sp)
    wall = time.perf_counter() - t
    model.set_attn_implementation("sdpa")
    # Step times from the engine's timeline (forward hooks would be traced into the graphs).
    ends = [r.time_s for r in engine.stats.timeline]
    times = [b - a for a, b in zip([0.0] + ends, ends, strict=False)]
    return _summary("engine_compile" if compile else "engine", wall,
                    len(prompts) * args.max_new, times, [o[0] for o in outs])


def run_generate(model, prompts, args, warm, static: bool):
    model.set_attn_implementation("sdpa")
    kw = dict(do_sample=False, max_new_tokens=args.max_new, min_new_tokens=args.max_new,
              pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"

    def gen(batch, **extra):
        ids = torch.tensor(batch)
        return model.generate(ids, attention_mask=torch.ones_like(ids), **{**kw, **extra})

    with torch.no_grad():
        gen(warm, max_new_tokens=4, min_new_tokens=4)
        timer = ForwardTimer(model)
        t = time.perf_counter()
        out = gen(prompts)
        wall = time.perf_counter() - t
        timer.close()
    toks = [row[len(p):] for row, p in zip(out.tolist(), prompts, strict=True)]
    return _summary("static" if static else "generate", wall, len(prompts) * args.max_new,
                    timer.times, toks)


def _cpu_memory_for_generate_batch() -> None:
    """transformers' continuous batching sizes its cache from the accelerator's free memory
    and has no figure for the CPU (it subtracts from ``None``); give it the host's available
    memory instead."""
    try:
        from transformers.generation.continuous_batching import cache as cb_cache
        from transformers.generation.continuous_batching.requests import (
            get_device_and_memory_breakdown,
        )
    except ImportError:
        return
    if get_device_and_memory_breakdown()[1] is not None:
        return
    avail = 8 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    cb_cache.PagedAttentionMemoryHandler.get_available_memory = staticmethod(
        lambda max_memory_percent=1.0: int(avail * max_memory_percent))


def run_generate_batch(model, prompts, args, warm):
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        return None
    _cpu_memory_for_generate_batch()
    per_seq = -(-(args.prompt_len + args.max_new) // 16)
    cfg = GenerationConfig(max_new_tokens=args.max_new, do_sample=False, eos_token_id=-1,
                           pad_token_id=0, num_blocks=len(prompts) * per_seq + 16,
                           block_size=16, max_batch_tokens=len(prompts) * args.prompt_len)
    model.set_attn_implementation("sdpa_paged")
    try:
        model.generate_batch(warm, generation_config=cfg, progress_bar=False)
        timer = ForwardTimer(model)
        t = time.perf_counter()
        res = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)
        wall = time.perf_counter() - t
        timer.close()
    finally:
        model.set_attn_implementation("sdpa")
    if len(res) != len(prompts):
        return None
    # Request ids are "req_<i>" in the order the prompts were added.
    ordered = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    toks = [list(r.generated_tokens)[: args.max_new] for r in ordered]
    return _summary("generate_batch", wall, len(prompts) * args.max_new, timer.times, toks)


def offline(args) -> None:
    print(f"# offline: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_new} new "
          f"tokens, greedy, EOS off; Llama hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}; "
          f"{torch.get_num_threads()} threads; {cpu_name()}; torch {torch.__version__}")
    systems = [s for s in args.systems.split(",") if s]
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        model = make_model(args, dtype, args.prompt_len + args.max_new + 8)
        prompts = random_prompts(args.num_prompts, args.prompt_len, args.vocab, args.seed + 1)
        warm = random_prompts(2, min(16, args.prompt_len), args.vocab, args.seed + 2)
        rows = []
        for s in systems:
            if s in ("engine", "engine_compile"):
                rows.append(run_engine(model, prompts, args, warm, s == "engine_compile"))
            elif s in ("generate", "static"):
                rows.append(run_generate(model, prompts, args, warm, static=s == "static"))
            elif s == "generate_batch":
                r = run_generate_batch(model, prompts, args, warm)
                if r is None:
                    print(f"  ({name}) generate_batch: not available or failed here")
                else:
                    rows.append(r)
            else:
                raise SystemExit(f"unknown system {s!r} (one of "
                                 f"{', '.join(SYSTEMS + EXTRA_SYSTEMS)})")
        ref = next((r["tokens"] for r in rows if r["system"] == "engine"), rows[0]["tokens"])
        print(f"\n| {name} | output tok/s | wall s | first forward s | decode step ms "
              f"| tokens equal to the engine's |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            same = sum(a == b for a, b in zip(r["tokens"], ref, strict=True))
            print(f"| {r['system']} | {r['tok_s']:.1f} | {r['wall_s']:.2f} | {r['first_s']:.2f} "
                  f"| {1e3 * r['step_s']:.0f} | {same}/{len(ref)} |")
        eng = next((r for r in rows if r["system"] == "engine"), None)
        if eng:
            for r in rows:
                if r is not eng:
                    print(f"  engine / {r['system']}: {eng['tok_s'] / r['tok_s']:.2f}x")


# --------------------------------------------------------------------------- online
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def online(args) -> None:
    from paged_ops.engine import PagedEngine, SamplingParams

    name = args.dtypes.split(",")[0]
    dtype = DTYPES[name]
    model = make_model(args, dtype, args.long_len + args.max_new + 8)
    g = torch.Generator().manual_seed(args.seed + 3)
    n = args.num_requests
    gaps = torch.empty(n).exponential_(1.0, generator=g) / args.rate
    arrivals = torch.cumsum(gaps, 0).tolist()
    lengths = [args.long_len if i % args.long_every == args.long_every - 1 else args.short_len
               for i in range(n)]
    prompts = [torch.randint(0, args.vocab, (L,), generator=g).tolist() for L in lengths]
    per_block = 16
    num_blocks = sum(-(-(L + args.max_new) // per_block) for L in lengths) + 16
    kw = dict(num_blocks=num_blocks, block_size=per_block, eos_token_id=None)
    if args.budget:
        kw["max_num_batched_tokens"] = args.budget
    if args.prefill_cap:
        kw["max_prefill_tokens_with_decodes"] = args.prefill_cap
    engine = PagedEngine(model, **kw)
    sp = SamplingParams(max_new_tokens=args.max_new, ignore_eos=True)
    engine.generate(random_prompts(2, 16, args.vocab, 0), params=SamplingParams(max_new_tokens=4))
    # The scheduler's decision of each step: does it prefill a chunk of a long prompt?
    schedule, decided = engine.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        decided.append(out)
        return out

    engine.scheduler.schedule = recording_schedule
    print(f"# online: {n} requests, Poisson {args.rate}/s, prompts of {args.short_len} tokens, "
          f"1 in {args.long_every} of {args.long_len}, {args.max_new} new tokens; {name}; "
          f"budget {engine.max_num_batched_tokens}, prefill tokens beside decodes "
          f"{args.prefill_cap or 'unlimited'}; Llama hidden {args.hidden}, "
          f"{args.layers} layers; {torch.get_num_threads()} threads; {cpu_name()}")
    rid_of: dict[int, int] = {}
    token_times: dict[int, list[float]] = {i: [] for i in range(n)}
    long_busy: list[tuple[float, float]] = []  # wall intervals of steps with long chunks
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            rid_of[engine.add_request(prompts[nxt], sp)] = nxt
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        start = time.perf_counter() - t0
        outs = engine.step()
        end = time.perf_counter() - t0
        if decided and any(s.prefill and len(s.branch.prompt) >= args.long_len
                           for s in decided[-1].seqs):
            long_busy.append((start, end))
        decided.clear()
        for o in outs:
            i = rid_of[o.request_id]
            token_times[i].extend([end] * len(o.new_token_ids[0]))
    ttft = {"short": [], "long": []}
    itl, itl_long = [], []
    for i in range(n):
        ts = token_times[i]
        if not ts:
            continue
        ttft["long" if lengths[i] == args.long_len else "short"].append(ts[0] - arrivals[i])
        for a, b in zip(ts, ts[1:], strict=False):
            itl.append(b - a)
            if any(s < b and a < e for s, e in long_busy):
                itl_long.append(b - a)
    print("\n| metric | p50 ms | p99 ms | p99 / p50 | count |")
    print("|---|---|---|---|---|")
    for label, xs in (("TTFT, short prompts", ttft["short"]),
                      ("TTFT, long prompts", ttft["long"]),
                      ("inter-token latency, all", itl),
                      ("inter-token latency, while a long prompt prefills", itl_long)):
        p50, p99 = _pct(xs, 50), _pct(xs, 99)
        print(f"| {label} | {1e3 * p50:.0f} | {1e3 * p99:.0f} | {p99 / p50:.2f} | {len(xs)} |")
    st = engine.stats
    print(f"\nsteps {st.steps} (mixed {st.mixed_steps}, decode {st.decode_steps}), "
          f"preemptions {st.preemptions}, {st.tokens_generated} tokens in "
          f"{time.perf_counter() - t0:.1f} s")


def add_model_args(ap) -> None:
    """The model's sizes (shared with bench_cascade.py)."""
    for name, default in (("hidden", 512), ("layers", 8), ("heads", 8), ("kv-heads", 2),
                          ("intermediate", 1408), ("vocab", 8192)):
        ap.add_argument(f"--{name}", type=int, default=default)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--online", action="store_true", help="the online mode")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16,fp16")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--budget", type=int, default=None,
                    help="the engine's max_num_batched_tokens (default: the engine's offline, "
                         f"{ONLINE_BUDGET} online)")
    ap.add_argument("--prefill-cap", type=int, default=None,
                    help="online: max_prefill_tokens_with_decodes (default: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=64)
    add_model_args(ap)
    ap.add_argument("--rate", type=float, default=0.5, help="online: requests per second")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--long-every", type=int, default=8)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_new = 4, 32, 8
        args.hidden, args.layers, args.heads, args.kv_heads = 128, 2, 4, 2
        args.intermediate, args.vocab = 256, 512
        args.num_requests, args.short_len, args.long_len, args.long_every = 6, 32, 256, 3
        args.rate = 20.0
        if args.budget is None:
            args.budget = 64
    if args.online and args.budget is None:
        args.budget = ONLINE_BUDGET
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import paged_ops  # noqa: F401  (loads the ops)

    online(args) if args.online else offline(args)


if __name__ == "__main__":
    main()
