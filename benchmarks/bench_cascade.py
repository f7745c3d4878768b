"""Cascade decode against plain decode in PagedEngine, in one run.

``B`` requests of a 2048-token prompt each, every one sampled into ``n`` branches
(``SamplingParams(n=n, temperature=1, seed)``), 64 new tokens, on a seeded random-weight
``LlamaForCausalLM`` (bench_engine.py's model: hidden 512, 8 layers, 8 query / 2 KV heads of
64). Per (dtype, B, n) the same generate call runs with ``cascade=True`` and ``cascade=False``
(the same engine, its ``runner.cascade`` switched; rounds interleaved, every other one
reversed). The prompts come from the prefix cache (filled by a warm-up call), so the timed
calls are decode. Printed per case:

- attention time per decode step: the wall time of every attention layer call of decode
  steps (cache write + attention, summed over the layers), per step, median over rounds;
- output tokens/s of the whole generate call, median over rounds;
- the ratios plain / cascade, and whether both produced the same tokens.

Then, per dtype, the arithmetic rates that bound the cascade where the calls are
compute-bound (caches in the last-level cache): one sequence of --prompt-len keys attended by
1 decode row and by 8 and 32 non-causal rows (the shared call of a group), in GFLOP/s (q.k and
p.v, 4 flops per query head, key and head dimension), beside an fp32 GEMM's rate.

    python benchmarks/bench_cascade.py --dtypes fp32,bf16 --batches 1,4 --branches 1,2,4,8,16
    python benchmarks/bench_cascade.py --quick   # checks that it runs; numbers mean nothing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402
from bench_engine import DTYPES, add_model_args, cpu_name, make_model, random_prompts  # noqa: E402

from paged_ops.tune import gemm_gflops  # noqa: E402


class AttentionTimer:
    """Wall time of the engine's attention function in decode steps (the function is looked
    up by transformers at each call, so wrapping the registered one covers every layer)."""

    def __init__(self):
        from paged_ops.engine import attention as attn
        self.attn = attn
        self.inner = attn.paged_attention_forward
        self.total = 0.0

    def __enter__(self):
        from transformers import AttentionInterface

        def timed(*args, **kw):
            ctx = kw.get("paged_ctx")
            if ctx is None or ctx.is_prefill:
                return self.inner(*args, **kw)
            t = time.perf_counter()
            out = self.inner(*args, **kw)
            self.total += time.perf_counter() - t
            return out
        AttentionInterface.register(self.attn.ATTN_IMPLEMENTATION, timed)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface
        AttentionInterface.register(self.attn.ATTN_IMPLEMENTATION, self.inner)


def run_case(engine, prompts, n, args, cascade: bool):
    from paged_ops.engine import SamplingParams
    engine.runner.cascade = cascade
    params = SamplingParams(max_new_tokens=args.max_new, n=n, temperature=1.0, top_k=0,
                            seed=args.seed + 1, ignore_eos=True)
    with AttentionTimer() as timer:
        t = time.perf_counter()
        outs = engine.generate(prompts, params=params)
        wall = time.perf_counter() - t
    st = engine.stats
    ntok = sum(len(b) for o in outs for b in o)
    return dict(attn_per_step=timer.total / max(st.decode_steps, 1), tok_s=ntok / wall,
                tokens=outs, cascade_steps=st.cascade_steps, decode_steps=st.decode_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batches", default="1,4", help="requests per call")
    ap.add_argument("--branches", default="1,2,4,8,16", help="n of each request")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    add_model_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.max_new, args.rounds = 256, 8, 1
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 128, 256, 512
        args.batches, args.branches = "1,2", "1,4"
    if args.threads:
        torch.set_num_threads(args.threads)

    from paged_ops.engine import PagedEngine, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    branches = [int(n) for n in args.branches.split(",")]
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"prompt {args.prompt_len}, {args.max_new} new tokens, block size "
          f"{args.block_size}, {args.rounds} rounds")
    print("| dtype | B | n | attention ms/step plain | cascade | plain/cascade | "
          "tok/s plain | cascade | cascade/plain | same tokens | cascade steps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        model = make_model(args, dtype, args.prompt_len + args.max_new + 8)
        bs = args.block_size
        per_seq = -(-(args.prompt_len + args.max_new) // bs)
        need = max(batches) * (per_seq + max(branches) * (-(-args.max_new // bs) + 1))
        engine = PagedEngine(model, num_blocks=need + 64, block_size=bs,
                             max_num_seqs=max(batches) * max(branches),
                             enable_prefix_caching=True, eos_token_id=None)
        prompts_all = random_prompts(max(batches), args.prompt_len, args.vocab, args.seed)
        # Warm-up: fills the prefix cache with every prompt (and runs both paths once).
        engine.generate(prompts_all, params=SamplingParams(max_new_tokens=2, n=2))
        for b in batches:
            prompts = prompts_all[:b]
            for n in branches:
                res = {True: [], False: []}
                for r in range(args.rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    for c in order:
                        res[c].append(run_case(engine, prompts, n, args, c))
                on, off = res[True], res[False]
                a_on = statistics.median(x["attn_per_step"] for x in on) * 1e3
                a_off = statistics.median(x["attn_per_step"] for x in off) * 1e3
                t_on = statistics.median(x["tok_s"] for x in on)
                t_off = statistics.median(x["tok_s"] for x in off)
                same = all(x["tokens"] == off[0]["tokens"] for x in on + off)
                steps = f"{on[0]['cascade_steps']}/{on[0]['decode_steps']}"
                print(f"| {name} | {b} | {n} | {a_off:.2f} | {a_on:.2f} | {a_off / a_on:.2f} | "
                      f"{t_off:.0f} | {t_on:.0f} | {t_on / t_off:.2f} | {same} | {steps} |",
                      flush=True)
        del engine, model
    print("\n| dtype | query rows | GFLOP/s |\n|---|---|---|")
    for name in args.dtypes.split(","):
        for rows in (1, 8, 32):
            print(f"| {name} | {rows} | {shared_call_gflops(DTYPES[name], rows, args):.0f} |",
                  flush=True)
    print(f"| fp32 GEMM 512x512 | | {gemm_gflops():.0f} |")


def shared_call_gflops(dtype, rows: int, args, min_time: float = 0.2) -> float:
    """GFLOP/s of paged attention of ``rows`` query rows (non-causal) over one sequence of
    --prompt-len keys, the model's heads."""
    D, L = args.hidden // args.heads, args.prompt_len
    _, kc, vc, bt, sl = ba.make_case(1, L, args.heads, args.kv_heads, D, args.block_size, dtype,
                                     "cpu")
    q = torch.randn(rows, args.heads, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    qsl = torch.tensor([0, rows], dtype=torch.int32)

    def call():
        torch.ops.paged.attention(q, kc, vc, bt, sl, D**-0.5, None, -1, 0.0, None, None, L,
                                  qsl, False)

    call()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time:
        call()
        n += 1
    return 4 * rows * args.heads * L * D * n / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()
