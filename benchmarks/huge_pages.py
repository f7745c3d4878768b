"""Decode on caches backed by huge pages against plain 4 KiB pages, on the CPU.

Two sets of layer copies, each totalling >= ``--gib`` GiB: one from
``paged_ops.allocate_kv_cache(..., huge_pages=True)`` (the default), one with
``huge_pages=False``. Calls alternate between the sets, the order swapped every call, so both
see the same moments of a noisy machine; each row gives both times per call and their ratio
(total, and the median of per-call ratios). ``--control`` gives both sets plain pages: the
ratio the method itself reads when nothing differs. A probe row times torch.sum over 1 GiB of
each kind the same way.

    python benchmarks/huge_pages.py                       # bf16, fp32, fp16, fp8 e4m3; bs 8-256
    python benchmarks/huge_pages.py --control --dtypes bf16 --block-sizes 16
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402


def alternate(calls, seconds):
    """Time the callables in turn (order swapped each round) for ``seconds``: per-callable mean
    time per call, and the median over rounds of calls[0]'s time over calls[1]'s."""
    tot = [0.0] * len(calls)
    ratios = []
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end or n < 2:
        t = [0.0] * len(calls)
        for i in (range(len(calls)) if n % 2 == 0 else reversed(range(len(calls)))):
            t0 = time.perf_counter()
            calls[i]()
            t[i] = time.perf_counter() - t0
            tot[i] += t[i]
        ratios.append(t[0] / t[1])
        n += 1
    return [x / n for x in tot], statistics.median(ratios)


def cache_sets(B, L, Hkv, D, bs, dtype, gib, control):
    nb = B * ((L + bs - 1) // bs) + 64
    per = 2 * nb * Hkv * D * bs * dtype.itemsize
    sets = []
    for huge in (False, not control):
        layers = []
        for _ in range(max(2, int(gib * 2**30) // per)):
            kc, vc = paged_ops.allocate_kv_cache(nb, Hkv, D, bs, dtype, huge_pages=huge)
            for c in (kc, vc):
                c.view(torch.uint8).fill_(0x3C)  # finite in every cache dtype
            layers.append((kc, vc))
        sets.append(layers)
    return nb, sets


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32,fp16,fp8_e4m3")
    p.add_argument("--block-sizes", default="8,16,32,128,256")
    p.add_argument("--shape", default="8x2048", help="BATCHxCONTEXT")
    p.add_argument("--heads", default="32,8", help="query heads,kv heads")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=4.0, help="per row")
    p.add_argument("--control", action="store_true", help="plain pages in both sets")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, L = map(int, args.shape.split("x"))
    H, Hkv = map(int, args.heads.split(","))
    D = 128
    print(f"{args.threads} threads, {H}q/{Hkv}kv, head size {D}, B={B} L={L}, caches cycled "
          f"over >= {args.gib} GiB per set{'; CONTROL: plain pages in both' if args.control else ''}")
    bufs = []
    for huge in (False, not args.control):
        b = torch.empty(max(1 << 10, int(args.gib * 2**30) // 4), dtype=torch.float32)
        if huge:
            paged_ops.advise_huge_pages(b)
        bufs.append(b.fill_(1.0))
    (tp0, tp1), r = alternate([bufs[0].sum, bufs[1].sum], min(args.seconds, 2.0))
    gb = bufs[0].numel() * 4 / 1e9
    print(f"probe torch.sum: plain {gb / tp0:5.1f} GB/s, huge {gb / tp1:5.1f} GB/s, "
          f"plain/huge {r:.3f}x")
    del bufs
    for name in args.dtypes.split(","):
        dtype = ba.DTYPES[name]
        for bs in map(int, args.block_sizes.split(",")):
            nb, sets = cache_sets(B, L, Hkv, D, bs, dtype, args.gib, args.control)
            g = torch.Generator().manual_seed(bs)
            per = (L + bs - 1) // bs
            bt = torch.randperm(nb, generator=g)[: B * per].view(B, per).to(torch.int32)
            sl = torch.full((B,), L, dtype=torch.int32)
            q = torch.randn(B, H, D, generator=g).to(
                torch.bfloat16 if dtype in ba.FP8 else dtype)
            ks, vs = ba.kv_scales(sets[0][0][0])
            kw = dict(k_scale=ks, v_scale=vs) if dtype in ba.FP8 else {}
            cursor = [0, 0]

            def caller(s):
                def call():
                    kc, vc = sets[s][cursor[s] % len(sets[s])]
                    cursor[s] += 1
                    paged_ops.paged_attention(q, kc, vc, bt, sl, D**-0.5, **kw)
                return call

            (t0, t1), r = alternate([caller(0), caller(1)], args.seconds)
            nbytes = 2 * B * L * Hkv * D * dtype.itemsize / 1e9
            print(f"{name:9s} bs {bs:3d}: plain {t0 * 1e3:6.2f} ms ({nbytes / t0:5.1f} GB/s), "
                  f"huge {t1 * 1e3:6.2f} ms ({nbytes / t1:5.1f} GB/s): plain/huge total "
                  f"{t0 / t1:.3f}x, median per call {r:.3f}x", flush=True)
            del sets
            gc.collect()


if __name__ == "__main__":
    main()
