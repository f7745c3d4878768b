"""Prefill attention on the CPU: ``torch.ops.paged.attention`` with ``query_start_loc`` (causal)
against torch's own ``scaled_dot_product_attention`` on the same keys and values laid out
densely (``is_causal=True``, ``enable_gqa=True``: ATen's flash attention for the CPU), in one
run, on one thread and on all of them.

Cases: one prompt of each ``--lengths`` entry, and a batch of prompts of mixed lengths (the
same lengths, one sequence each: SDPA then runs once per prompt). The paged caches are
scattered blocks (a random block table); the keys and values are the same numbers in both.
Printed per case, dtype and thread count: time per call (median of ``--reps``), GFLOP/s (4
flops per query head, visible key and head dimension, causal), SDPA time over ours, and the
largest difference between the two outputs. Then ours on all threads against ours on one.

    python benchmarks/bench_prefill.py                            # 8 q / 2 kv heads of 64
    python benchmarks/bench_prefill.py --heads 32/8 --head-size 128 --lengths 2048
    python benchmarks/bench_prefill.py --quick   # checks that it runs; numbers mean nothing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import paged_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import timeit  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(lengths, H, Hkv, D, bs, dtype, seed=0):
    """Paged caches holding every prompt's keys and values (scattered blocks), the queries,
    and the same keys and values as dense [1, Hkv, L, D] tensors per prompt."""
    g = torch.Generator().manual_seed(seed)
    per = [(n + bs - 1) // bs for n in lengths]
    nb = sum(per) + 4
    kc, vc = paged_ops.allocate_kv_cache(nb, Hkv, D, bs, dtype, "cpu")
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lengths), max(per), dtype=torch.int32)
    q_all, dense = [], []
    used = 0
    for s, n in enumerate(lengths):
        blocks = perm[used:used + per[s]]
        used += per[s]
        tables[s, :per[s]] = blocks.int()
        k = torch.randn(n, Hkv, D, generator=g).to(dtype)
        v = torch.randn(n, Hkv, D, generator=g).to(dtype)
        slots = (blocks.long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        paged_ops.reshape_and_cache(k, v, kc, vc, slots)
        q_all.append(torch.randn(n, H, D, generator=g).to(dtype))
        dense.append((k.permute(1, 0, 2).unsqueeze(0).contiguous(),
                      v.permute(1, 0, 2).unsqueeze(0).contiguous()))
    q = torch.cat(q_all)
    qsl = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    sl = torch.tensor(lengths, dtype=torch.int32)
    return q, kc, vc, tables, sl, qsl, dense


def run_case(name, lengths, dname, args, threads_list):
    dtype = DTYPES[dname]
    H, Hkv = (int(x) for x in args.heads.split("/"))
    D, bs = args.head_size, args.block_size
    scale = D ** -0.5
    q, kc, vc, bt, sl, qsl, dense = make_inputs(lengths, H, Hkv, D, bs, dtype)

    def ours():
        return torch.ops.paged.attention(q, kc, vc, bt, sl, scale, query_start_loc=qsl)

    def sdpa():
        outs, start = [], 0
        for n, (k, v) in zip(lengths, dense, strict=True):
            qq = q[start:start + n].permute(1, 0, 2).unsqueeze(0)
            start += n
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
            outs.append(o[0].permute(1, 0, 2))
        return torch.cat(outs)

    flops = sum(4 * D * H * n * (n + 1) / 2 for n in lengths)
    err = (ours().float() - sdpa().float()).abs().max().item()
    mine = {}
    for nt in threads_list:
        torch.set_num_threads(nt)
        # Interleaved rounds: the two share whatever the machine does meanwhile.
        t_ours, t_sdpa = [], []
        for _ in range(args.rounds):
            t_ours.append(timeit(ours, "cpu", min_time=0.0, min_reps=args.reps))
            t_sdpa.append(timeit(sdpa, "cpu", min_time=0.0, min_reps=args.reps))
        to, ts = statistics.median(t_ours), statistics.median(t_sdpa)
        mine[nt] = to
        print(f"| {name} | {dname} | {nt} | {to * 1e3:.2f} | "
              f"{flops / to / 1e9:.0f} | {ts * 1e3:.2f} | {flops / ts / 1e9:.0f} | "
              f"{ts / to:.2f} | {err:.1e} |", flush=True)
    return mine


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of " + ",".join(DTYPES))
    p.add_argument("--heads", default="8/2", help="query/kv heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths, comma list")
    p.add_argument("--mixed", default="4096,256,256,1024,128,2048",
                   help="the mixed batch's prompt lengths ('' for none)")
    p.add_argument("--threads", type=int, default=None, help="all threads (default: torch's)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.mixed, args.reps, args.rounds = "40", "40,17", 1, 1
    nt_all = args.threads or torch.get_num_threads()
    threads_list = [1, nt_all] if nt_all > 1 else [1]
    print(f"# {paged_ops.cpu_kernel_variant()} build, heads {args.heads}, head size "
          f"{args.head_size}, block size {args.block_size}; causal prefill")
    print("| case | dtype | threads | ours ms | GFLOP/s | SDPA ms | GFLOP/s | SDPA / ours "
          "| max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    scaling = []
    for dname in args.dtypes.split(","):
        cases = [(f"1 x {n}", [n]) for n in (int(x) for x in args.lengths.split(","))]
        if args.mixed:
            mixed = [int(x) for x in args.mixed.split(",")]
            cases.append((f"{len(mixed)} mixed ({'+'.join(map(str, mixed))})", mixed))
        for name, lengths in cases:
            mine = run_case(name, lengths, dname, args, threads_list)
            if len(mine) > 1:
                scaling.append(f"{name} {dname}: {mine[1] / mine[nt_all]:.2f}x")
    torch.set_num_threads(nt_all)
    if scaling:
        print(f"\nours on {nt_all} threads over 1 thread: " + "; ".join(scaling))


if __name__ == "__main__":
    main()
