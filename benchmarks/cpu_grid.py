"""CPU decode attention over a grid of builds x cache dtypes x block sizes, from DRAM.

Every kernel build is timed on the same calls, interleaved round after round (every other
round in reverse order), with the caches cycled over layer copies totalling at least --gib GiB,
so each call reads its K and V from DRAM and not from the last-level cache; the DRAM read
bandwidth (torch.sum over the same amount) is timed in the same rounds.

    python benchmarks/cpu_grid.py                                  # the builds of this CPU
    python benchmarks/cpu_grid.py --kernels avx2,avx512_bf16,old=/tmp/base/_cpu_avx2.so \
        --dtypes bf16,fp8_e4m3 --block-sizes 16,128 --shapes 8x2048

--kernels: names of the package's builds (paged_ops.supported_cpu_kernel_variants()), "selected"
(the builds chosen at import, by block size, with the plan file's tuned plans), "rules" (the
same builds without any plan: the kernel's own rules) or
name=path of another kernel library (a build of another revision, e.g. by ab_kernels.py).
All block sizes of a shape and cache dtype are timed in the same rounds (their caches, --gib
GiB each, are held at once). Prints GB/s (K and V read once per call), its share of the read
bandwidth and of the roofline, each kernel's time relative to the first kernel's, and its
time relative to its best block size of the dtype ("of best bs"); the shares and ratios are
medians of per-round ones (the probes and times of the same round). The roofline is min(read
bandwidth, what the call's arithmetic allows): q.k and p.v each at the FMA rate of the path the
selected builds and plans take (paged_ops.cpu_plan), an fp32 GEMM timed in the same rounds
(paged_ops.tune.gemm_gflops), or a bf16 GEMM for the paths that multiply bf16 pairs; the
paths are printed beside the roof. A cell where the CPU is compute-bound shows as one.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import time

import torch

import paged_ops
from paged_ops.tune import bf16_phases, gemm_gflops, roofline_gbs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

CACHE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
         "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kernel_tables(spec):
    """[(name, table pointer)] for the --kernels list; the libraries stay loaded."""
    out = []
    for item in spec.split(","):
        if "=" in item:
            name, path = item.split("=", 1)
            lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
            lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
            kernel_tables.libs.append(lib)
            out.append((name, lib.paged_ops_cpu_kernel_table()))
        else:
            out.append((item, item))  # a package build: switched by name
    return out


kernel_tables.libs = []
SELECTION = paged_ops._selection


def use(kernel):
    if kernel in ("selected", "rules"):  # the builds chosen at import (by block size)
        paged_ops._set_selection(SELECTION)
        paged_ops._install_plans()  # the plan file's plans
        if kernel == "rules":
            paged_ops._plans.install(paged_ops._C_LIB, [])
    elif isinstance(kernel, str):
        paged_ops.set_cpu_kernel_variant(kernel)
    else:
        assert paged_ops._C_LIB.paged_ops_set_cpu_kernel_table(ctypes.c_void_p(kernel)) == 0


def layers(B, L, H, Hkv, D, bs, dtype, gib):
    """(q, [(kc, vc)] layer copies totalling >= gib GiB, bt, sl, bytes read per call)."""
    q, kc, vc, bt, sl = ba.make_case(B, L, H, Hkv, D, bs, dtype, "cpu")
    per = 2 * kc.numel() * kc.element_size()
    n = max(2, math.ceil(gib * 2**30 / per))
    caches = [(kc, vc)] + [ba.copy_caches(kc, vc) for _ in range(n - 1)]
    return q, caches, bt, sl, 2 * B * L * Hkv * D * kc.element_size()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(
        v for v in paged_ops.supported_cpu_kernel_variants() if v != "default"))
    p.add_argument("--dtypes", default="fp32,fp16,bf16,fp8_e4m3,fp8_e5m2")
    p.add_argument("--block-sizes", default="8,16,32,64,128,256")
    p.add_argument("--shapes", default="8x2048")
    p.add_argument("--heads", default="32,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--min-time", type=float, default=0.15, help="seconds per timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    H, Hkv = map(int, args.heads.split(","))
    D = 128
    kernels = kernel_tables(args.kernels)
    before = "selected"
    big = ba.probe_buffer(args.gib)
    print(f"{args.threads} threads, {H}q/{Hkv}kv, head size {D}, caches cycled over >= "
          f"{args.gib} GiB; median of {args.reps} interleaved rounds; x: time of the first "
          f"kernel / this kernel's", flush=True)
    for shape in args.shapes.split(","):
        B, L = map(int, shape.split("x"))
        for dn in args.dtypes.split(","):
            # Every block size of the dtype is timed in the same rounds: a shared host's memory
            # bandwidth drifts over seconds, so only cells timed side by side compare.
            cells = []
            for bs in map(int, args.block_sizes.split(",")):
                q, caches, bt, sl, nbytes = layers(B, L, H, Hkv, D, bs, CACHE[dn], args.gib)
                out = torch.empty_like(q)
                ks, vs = ba.kv_scales(caches[0][0])

                def call(i, caches=caches, q=q, out=out, bt=bt, sl=sl, ks=ks, vs=vs):
                    kc, vc = caches[i % len(caches)]
                    torch.ops.paged.attention_out(out, q, kc, vc, bt, sl, D**-0.5, None, -1,
                                                  0.0, ks, vs, L)

                # The roofline by the paths of the selected builds and plans, what a user runs.
                use("selected")
                plan = paged_ops.cpu_plan(q.dtype, CACHE[dn], bs, D, H // Hkv)
                paths = (plan["qk_path"], plan["pv_path"])
                use(kernels[0][1])
                t0 = time.perf_counter()
                for i in range(len(caches)):
                    call(i)
                per_call = (time.perf_counter() - t0) / len(caches)
                n_calls = max(len(caches), round(args.min_time / per_call))
                cells.append((bs, call, n_calls, nbytes, {name: [] for name, _ in kernels},
                              paths))
            # The bf16 GEMM rate only where a cell's paths multiply bf16 pairs.
            bf16 = any(any(bf16_phases(p)) for *_, p in cells)
            bw, gf, gf16 = [], [], []
            for r in range(args.reps):
                t0 = time.perf_counter()
                big.sum()
                bw.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
                gf.append(gemm_gflops(min_time=0.02))
                if bf16:
                    gf16.append(gemm_gflops(min_time=0.02, dtype=torch.bfloat16))
                for _bs, call, n_calls, _nbytes, times, _ in cells if r % 2 == 0 else cells[::-1]:
                    for name, k in kernels if r % 2 == 0 else kernels[::-1]:
                        use(k)
                        t0 = time.perf_counter()
                        for i in range(n_calls):
                            call(i)
                        times[name].append((time.perf_counter() - t0) / n_calls)
            gbw, gemm = statistics.median(bw), statistics.median(gf)
            gemm16 = statistics.median(gf16) if gf16 else None
            # Ratios are taken round by round (times and probes of the same round) and their
            # median printed: the host's bandwidth can change state between rounds.
            best = {name: min(cells, key=lambda c: statistics.median(c[4][name]))[4][name]
                    for name, _ in kernels}
            for bs, _call, _n_calls, nbytes, times, paths in cells:
                roof = roofline_gbs(gbw, gemm, CACHE[dn], H // Hkv, gemm16, paths)
                roofs = [roofline_gbs(bw[r], gf[r], CACHE[dn], H // Hkv,
                                      gf16[r] if gf16 else None, paths) for r in range(args.reps)]
                base = times[kernels[0][0]]
                line = (f"B={B:<3d} L={L:<5d} {dn:8s} bs {bs:3d} bw {gbw:5.1f} "
                        f"gemm {gemm:5.1f}" + (f"/{gemm16:5.1f}" if gemm16 else "")
                        + f" roof {roof:5.1f} ({'/'.join(paths)}) |")
                for name, _ in kernels:
                    ts = times[name]
                    t = statistics.median(ts)

                    def per_round(f, ts=ts):
                        return statistics.median(f(r, ts[r]) for r in range(args.reps))

                    line += (f" {name} {t * 1e3:6.2f} ms {nbytes / t / 1e9:5.1f} GB/s "
                             f"{100 * per_round(lambda r, x: nbytes / x / 1e9 / bw[r]):3.0f}% bw "
                             f"{100 * per_round(lambda r, x: nbytes / x / 1e9 / roofs[r]):3.0f}%"
                             f" roof {per_round(lambda r, x: base[r] / x):4.2f}x "
                             f"{per_round(lambda r, x: x / best[name][r]):4.2f} of best bs |")
                print(line, flush=True)
            del cells
    use(before)


if __name__ == "__main__":
    main()
