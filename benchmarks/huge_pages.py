"""Decode on caches backed by huge pages against plain 4 KiB pages, on the CPU.

Two sets of layer copies (bench_attention.LayerCaches), each totalling >= ``--gib`` GiB: one
from ``paged_ops.allocate_kv_cache(..., huge_pages=True)`` (the default), one with
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ba.add_cell_args(p, "bf16,fp32,fp16,fp8_e4m3", "8,16,32,128,256")
    p.add_argument("--control", action="store_true", help="plain pages in both sets")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, L = map(int, args.shape.split("x"))
    H, Hkv = map(int, args.heads.split(","))
    D = 128
    control = "; CONTROL: plain pages in both" if args.control else ""
    print(f"{args.threads} threads, {H}q/{Hkv}kv, head size {D}, B={B} L={L}, caches cycled "
          f"over >= {args.gib} GiB per set{control}")
    bufs = [ba.probe_buffer(args.gib, huge) for huge in (False, not args.control)]
    (tp0, tp1), r = alternate([bufs[0].sum, bufs[1].sum], min(args.seconds, 2.0))
    gb = bufs[0].numel() * 4 / 1e9
    print(f"probe torch.sum: plain {gb / tp0:5.1f} GB/s, huge {gb / tp1:5.1f} GB/s, "
          f"plain/huge {r:.3f}x")
    del bufs
    for name in args.dtypes.split(","):
        dtype = ba.DTYPES[name]
        for bs in map(int, args.block_sizes.split(",")):
            nb = B * ((L + bs - 1) // bs) + 64
            # Two sets of the same values; the batch (queries, block table) serves both.
            sets = [ba.LayerCaches(nb, Hkv, D, bs, dtype, "cpu", args.gib * 2**30,
                                   huge_pages=huge) for huge in (False, not args.control)]
            q, bt, sl = sets[0].batch(B, L, H, D)
            kw = dict(k_scale=sets[0].ks, v_scale=sets[0].vs) if dtype in ba.FP8 else {}
            cursor = [0, 0]

            def caller(s):
                def call():
                    kc, vc = sets[s].layers[cursor[s] % len(sets[s].layers)]
                    cursor[s] += 1
                    paged_ops.paged_attention(q, kc, vc, bt, sl, D**-0.5, **kw)
                return call

            (t0, t1), r = alternate([caller(0), caller(1)], args.seconds)
            nbytes = 2 * B * L * Hkv * D * dtype.itemsize / 1e9
            print(f"{name:9s} bs {bs:3d}: plain {t0 * 1e3:6.2f} ms ({nbytes / t0:5.1f} GB/s), "
                  f"huge {t1 * 1e3:6.2f} ms ({nbytes / t1:5.1f} GB/s): plain/huge total "
                  f"{t0 / t1:.3f}x, median per call {r:.3f}x", flush=True)
            sets.clear()  # frees this row's caches before the next row allocates its own
            gc.collect()


if __name__ == "__main__":
    main()
