"""Decode with the blocks of each sequence scattered against in address order, on the CPU.

What the scatter of a block table costs, and what the kernel's software prefetches give: the
same caches (bench_attention.LayerCaches, cycled over >= ``--gib`` GiB) read through two block
tables, the scattered one of the benchmarks (a random permutation) and one where every
sequence's blocks follow each other in memory (0, 1, 2, ...), each with the kernel's rules and
with the prefetches of the next blocks turned off (the plan knob ``prefetch``, docs/design.md
§6). Every round times one torch.sum over 1 GiB (the read-bandwidth probe) and then the four
calls, every other round in reverse order. Each cell is the median over the rounds of the
call's read rate as a share of that round's probe, so the host's bandwidth state cancels; the
last column is the median per-round time ratio of scattered to address order (rules).

    python benchmarks/block_order.py                         # fp32, bf16, fp8 e4m3; bs 8, 32, 128
    python benchmarks/block_order.py --dtypes fp16 --block-sizes 16 --seconds 8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

import paged_ops
from paged_ops import _plans

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

KERNELS = ("scattered", "scattered nopf", "in order", "in order nopf")


def cell(dtype, bs, B, L, H, Hkv, D, probe, args):
    """One row: the shares of the probe of the four kernels, and scattered / in order."""
    per = (L + bs - 1) // bs
    caches = ba.LayerCaches(B * per + 64, Hkv, D, bs, dtype, "cpu", args.gib * 2**30)
    q, scattered, sl = caches.batch(B, L, H, D)
    in_order = torch.arange(B * per, dtype=torch.int32).view(B, per)
    kw = dict(k_scale=caches.ks, v_scale=caches.vs) if dtype in ba.FP8 else {}
    qdtype = torch.bfloat16 if dtype in ba.FP8 else dtype
    key = (qdtype, dtype, bs, D, H // Hkv)
    lib = paged_ops._C_LIB
    cursor = [0]

    def timed(table, prefetch):
        # The rules, or the rules without the next blocks' prefetches.
        _plans.install(lib, [] if prefetch else [(key, None, {"prefetch": False})])
        kc, vc = caches.layers[cursor[0] % len(caches.layers)]
        cursor[0] += 1
        t0 = time.perf_counter()
        paged_ops.paged_attention(q, kc, vc, table, sl, D**-0.5, **kw)
        return time.perf_counter() - t0

    runs = [(scattered, True), (scattered, False), (in_order, True), (in_order, False)]
    for run in runs:  # warm: the threads' scratch grows on a first call
        timed(*run)
    probe_gb = probe.numel() * 4 / 1e9
    times, probes = [[] for _ in runs], []
    end, n = time.perf_counter() + args.seconds, 0
    while time.perf_counter() < end or n < 3:
        t0 = time.perf_counter()
        probe.sum()
        probes.append(probe_gb / (time.perf_counter() - t0))
        for i in range(len(runs)) if n % 2 == 0 else reversed(range(len(runs))):
            times[i].append(timed(*runs[i]))
        n += 1
    nbytes = 2 * B * L * Hkv * D * dtype.itemsize / 1e9
    shares = [statistics.median(nbytes / t / pr for t, pr in zip(ts, probes)) for ts in times]
    ratio = statistics.median(a / b for a, b in zip(times[0], times[2]))
    return statistics.median(probes), shares, ratio


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ba.add_cell_args(p, "fp32,bf16,fp8_e4m3", "8,32,128")  # --gib: the probe's size too
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, L = map(int, args.shape.split("x"))
    H, Hkv = map(int, args.heads.split(","))
    D = 128
    probe = ba.probe_buffer(args.gib)
    print(f"{args.threads} threads, {H}q/{Hkv}kv, head size {D}, B={B} L={L}, caches cycled "
          f"over >= {args.gib} GiB; % of the probe (torch.sum over "
          f"{probe.numel() * 4 / 1e9:.2f} GB) in the same round, median over rounds; nopf: no "
          f"prefetch of the next blocks")
    rows = []
    try:
        for name in args.dtypes.split(","):
            for bs in map(int, args.block_sizes.split(",")):
                bw, shares, ratio = cell(ba.DTYPES[name], bs, B, L, H, Hkv, D, probe, args)
                cells = " | ".join(f"{k} {100 * s:3.0f}%" for k, s in zip(KERNELS, shares))
                print(f"{name:9s} bs {bs:3d}: probe {bw:5.1f} GB/s | {cells} | scattered/in "
                      f"order {ratio:.3f}x", flush=True)
                rows.append((name, bs, shares, ratio))
                gc.collect()  # this cell's caches, before the next cell allocates its own
    finally:
        paged_ops._install_plans()  # the process's own plans again
    return rows


if __name__ == "__main__":
    main()
