"""Where the CPU decode kernel's time goes: arithmetic alone, and each phase of it.

Builds instrumented copies of a kernel build (AVX2 unless ``--variant``; the kernel's
``PAGED_OPS_PHASE_*`` compile-time switches, in a temporary directory; the installed package is
not touched) and times them interleaved in one process, switching kernels through the same table
the package uses for CPU dispatch:

- ``kernel``: the kernel as built (memory and arithmetic);
- ``arith``: every sequence reads only its first two blocks, alternately, so K and V come from
  the core's caches and the call costs its arithmetic alone (same instructions, same prefetches);
- ``arith-no-qk`` / ``arith-no-softmax`` / ``arith-no-pv``: ``arith`` without that phase; the
  phase's time is the difference (the others run on stale but finite data);
- ``arith-none``: all three skipped: the loops, logits masking and reductions that remain.

Times are per (block, kv head) on one thread; q.k and p.v each do G * head_size * block_size
multiply-adds there, compared with the fp32 multiply-add rate (FMAs of the build's vector
width) measured by a probe on as many threads as the benchmark uses (``--threads``). Builds with
AVX512-BF16 also probe ``vdpbf16ps`` (two multiply-adds per fp32 lane), the instruction of their
bf16 paths: the ideal time printed beside the FMA one. The kernel's share is of the read
bandwidth of one torch.sum over 1 GiB at the start of every round, the median over the rounds.

    python benchmarks/kernel_phases.py                    # fp32, fp16, bf16, fp8; B=8 L=2048
    python benchmarks/kernel_phases.py --dtypes bf16 --shape 32x512 --reps 15 --block-size 128
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import paged_ops
from paged_ops import _cpu_build

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (PHASE_ARITH, PHASE_QK, PHASE_SM, PHASE_PV)
VARIANTS = {
    "kernel": (0, 1, 1, 1),
    "arith": (1, 1, 1, 1),
    "arith-no-qk": (1, 0, 1, 1),
    "arith-no-softmax": (1, 1, 0, 1),
    "arith-no-pv": (1, 1, 1, 0),
    "arith-none": (1, 0, 0, 0),
}

FMA_PROBE = r"""
#include <immintrin.h>
#include <chrono>
// Instructions per second on this thread: 12 independent chains of STEP (more than latency x
// throughput) from INIT, in named variables so that they stay in registers (asm constraint C).
#define CHAINS(V, INIT, STEP, N, C)                                                            \
  V a0 = INIT, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,        \
    a9 = a0, a10 = a0, a11 = a0;                                                               \
  const long n = N;                                                                            \
  auto t0 = std::chrono::steady_clock::now();                                                  \
  for (long k = 0; k < n; ++k) {                                                               \
    STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5) STEP(a6) STEP(a7) STEP(a8) STEP(a9)  \
    STEP(a10) STEP(a11)                                                                        \
    asm volatile("" : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4), "+" C(a5),        \
                 "+" C(a6), "+" C(a7), "+" C(a8), "+" C(a9), "+" C(a10), "+" C(a11));          \
  }                                                                                            \
  return 12.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

// 8-lane FMAs.
extern "C" double fma_rate() {
  const __m256 x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(1e-4f);
#define F(v) v = _mm256_fmadd_ps(v, x, y);
  CHAINS(__m256, _mm256_set1_ps(0.1f), F, 100000000, "x")
}
#ifdef __AVX512F__
// 16-lane FMAs: a core may run fewer of them per cycle than 8-lane ones.
extern "C" double fma512_rate() {
  const __m512 x = _mm512_set1_ps(0.9999f), y = _mm512_set1_ps(1e-4f);
#define F5(v) v = _mm512_fmadd_ps(v, x, y);
  CHAINS(__m512, _mm512_set1_ps(0.1f), F5, 50000000, "v")
}
#endif
#ifdef __AVX512BF16__
// vdpbf16ps.
extern "C" double dot_rate() {
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3800);
#define D(v) v = _mm512_dpbf16_ps(v, x, y);
  CHAINS(__m512, _mm512_set1_ps(0.1f), D, 50000000, "v")
}
#endif
"""


def compile_flags(variant="avx2"):
    from torch.utils import cpp_extension as ce

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    inc = [f"-I{p}" for p in ce.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([*_cpu_build.COMMON_CFLAGS, "-O3", *_cpu_build.variant_cflags(variant),
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + inc,
            [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"])


def tree_digest(path, h=None):
    """A sha256 of every file below `path` (names in sorted order, contents)."""
    h = h or hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            with open(os.path.join(dirpath, f), "rb") as fh:
                h.update(fh.read())
    return h


def script_digest(variant="avx2"):
    """A sha256 of the build command: this script, and the flags it takes from the torch
    install and paged_ops/_cpu_build.py."""
    cflags, ldflags = compile_flags(variant)
    with open(__file__, "rb") as fh:
        return hashlib.sha256(fh.read() + " ".join(cflags + ldflags).encode())


def compile_variant(tree, so, defines=(), variant="avx2", jobs=None):
    """Builds the kernel library `variant` (avx2, avx512, ...) of the csrc tree `tree` into
    `so`: a tree with csrc/cpu/builds/ by its units, `jobs` at a time; an older tree by its
    one file per build (csrc/cpu/variant_<name>.cpp), which defines the build's switches
    itself."""
    cflags, ldflags = compile_flags(variant)
    if os.path.exists(os.path.join(tree, "cpu", "builds")):
        _cpu_build.compile_library(tree, so, [*cflags, *defines], ldflags, jobs)
        return
    isa = _cpu_build.isa_flags(variant)
    cap = _cpu_build.VARIANTS[variant][1]
    old = [f for f in cflags if not f.startswith("-D") or f.startswith("-D_GLIBCXX")]
    old = [f for f in old if f not in _cpu_build.VARIANTS[variant][0]]
    subprocess.run(["g++", *old, *isa, f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}",
                    *defines, "-shared", f"-I{tree}",
                    os.path.join(tree, "cpu", f"variant_{variant}.cpp"), "-o", so, *ldflags],
                   check=True)


def load_kernel_table(so):
    """(library, its kernel table pointer); keep the library alive while the table is used."""
    lib = ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
    return lib, lib.paged_ops_cpu_kernel_table()


def require_avx2(script):
    if not torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX2", "AVX512")):
        sys.exit(f"{script} needs an x86 CPU with AVX2")


def build(build_dir, jobs, variant="avx2"):
    """The instrumented builds (rebuilt only when csrc or this script changed)."""
    src = os.path.join(ROOT, "csrc")
    out = os.path.join(build_dir, tree_digest(src, script_digest(variant)).hexdigest()[:16])
    sos = {name: os.path.join(out, f"{name}.so") for name in VARIANTS}
    probe = os.path.join(out, "fma_probe.so")
    if all(os.path.exists(p) for p in [*sos.values(), probe]):
        return sos, probe
    os.makedirs(out, exist_ok=True)
    tree = os.path.join(out, "csrc")
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(src, tree)

    def compile_one(item):
        name, (a, qk, sm, pv) = item
        compile_variant(tree, sos[name], [f"-DPAGED_OPS_PHASE_ARITH={a}",
                                          f"-DPAGED_OPS_PHASE_QK={qk}",
                                          f"-DPAGED_OPS_PHASE_SM={sm}",
                                          f"-DPAGED_OPS_PHASE_PV={pv}"], variant)

    print(f"building {len(VARIANTS)} variants in {out} ...", flush=True)
    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(compile_one, VARIANTS.items()))
    probe_src = os.path.join(out, "fma_probe.cpp")
    with open(probe_src, "w") as fh:
        fh.write(FMA_PROBE)
    dot = ["-mavx512f"] if variant.startswith("avx512") else []
    dot += ["-mavx512bf16"] if has_dot_bf16(variant) else []
    subprocess.run(["g++", "-O2", "-mavx2", "-mfma", *dot, "-fPIC", "-shared", probe_src, "-o",
                    probe], check=True)
    return sos, probe


def has_dot_bf16(variant):
    """Whether the build computes bf16 with vdpbf16ps (PAGED_OPS_DOT_BF16)."""
    return variant in ("avx512_bf16", "avx512_amx")


def fma_rate_per_thread(probe, threads, name="fma_rate"):
    """Vector instructions per second of one thread while `threads` threads run the probe
    `name`: fma_rate (8-lane FMAs), fma512_rate (16-lane) or dot_rate (vdpbf16ps)."""
    lib = ctypes.CDLL(probe)
    fn = getattr(lib, name)
    fn.restype = ctypes.c_double
    rates = [0.0] * threads

    def run(i):
        rates[i] = fn()  # ctypes releases the GIL: the threads run together

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return min(rates)


def decode_call(B, L, H, Hkv, D, bs, dname):
    """A decode call of bench_attention.py's case: (run, cache element size)."""
    q, kc, vc, bt, sl = ba.make_case(B, L, H, Hkv, D, bs, ba.DTYPES[dname], "cpu")
    out = torch.empty_like(q)
    ks, vs = ba.kv_scales(kc)

    def run():
        torch.ops.paged.attention_out(out, q, kc, vc, bt, sl, D**-0.5, None, -1, 0.0, ks, vs, L)

    return run, kc.element_size()


def time_interleaved(tables, cases, reps, probe=None):
    """Times every case with every kernel, round after round, switching kernels through the
    package's CPU kernel table. tables: [(name, table pointer)]; cases: [(run, calls per
    timing, {name: [seconds per call]})], appended to. Every other round runs the kernels in
    reverse order: the kernel timed first in a round measured 2-5% apart from the others,
    whichever it was. probe: (buffer, [GB/s]): one torch.sum over the buffer at the start of
    every round, its read bandwidth appended, so that a run shows which bandwidth state the
    shared host was in while it ran (round_probe)."""
    setk = paged_ops._C_LIB.paged_ops_set_cpu_kernel_table
    before = paged_ops._selection
    try:
        for r in range(reps):
            if probe is not None:
                probe[1].append(round_probe(probe[0]))
            for run, n_calls, times in cases:
                for name, tab in tables if r % 2 == 0 else tables[::-1]:
                    setk(ctypes.c_void_p(tab))
                    run()
                    t0 = time.perf_counter()
                    for _ in range(n_calls):
                        run()
                    times[name].append((time.perf_counter() - t0) / n_calls)
    finally:
        paged_ops._set_selection(before)


def round_probe(buf):
    """GB/s of one torch.sum over buf (sized beyond the last-level cache). On the shared hosts
    of benchmarks/RESULTS.md the read bandwidth flips between states about 1.6x apart for
    seconds to minutes at a time, whatever runs here; one read per round shows the state."""
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def probe_summary(gbs):
    """'median (min-max) GB/s' of round_probe's readings."""
    return (f"{statistics.median(gbs):.1f} ({min(gbs):.1f}-{max(gbs):.1f}) GB/s"
            if gbs else "none")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,fp16,bf16,fp8")
    p.add_argument("--shape", default="8x2048", help="BATCHxCONTEXT (context >= 2 blocks)")
    p.add_argument("--heads", default="32,8", help="query heads,kv heads")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--variant", default="avx2", choices=sorted(_cpu_build.VARIANTS))
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds (medians reported)")
    p.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "paged_ops_phases"))
    args = p.parse_args(argv)
    require_avx2("kernel_phases.py")
    torch.set_num_threads(args.threads)
    B, L = map(int, args.shape.split("x"))
    H, Hkv = map(int, args.heads.split(","))
    D, bs = 128, args.block_size
    if L < 2 * bs:
        sys.exit("--shape: the context must span at least two blocks")

    sos, probe = build(args.build_dir, min(args.threads, len(VARIANTS)), args.variant)
    libs = {name: load_kernel_table(so) for name, so in sos.items()}  # kept loaded
    tables = {name: tab for name, (_, tab) in libs.items()}
    # fp32 multiply-adds per second, with the vectors of the build
    lanes = 16 if args.variant.startswith("avx512") else 8
    fma = lanes * fma_rate_per_thread(probe, args.threads,
                                      "fma512_rate" if lanes == 16 else "fma_rate")
    dot = fma_rate_per_thread(probe, args.threads, "dot_rate") if has_dot_bf16(args.variant) \
        else None
    print(f"{args.threads} threads; {fma / 1e9:.1f} G fp32 multiply-adds/s per thread "
          f"({lanes}-lane FMAs)" + (f", {dot / 1e9:.2f} G vdpbf16ps/s" if dot else ""))

    block_heads = B * ((L + bs - 1) // bs) * Hkv
    n_calls = max(1, 20000 // block_heads)
    cases = []
    for dn in args.dtypes.split(","):
        run, es = decode_call(B, L, H, Hkv, D, bs, dn)
        cases.append((dn, es, run, {n: [] for n in tables}))
    probe = (ba.probe_buffer(1.0), [])
    time_interleaved(list(tables.items()), [(run, n_calls, t) for _, _, run, t in cases],
                     args.reps, probe)
    # The kernel's share: of the bandwidth read in the same rounds.
    bw = statistics.median(probe[1])
    print(f"read bandwidth, one torch.sum per round: {probe_summary(probe[1])}")

    G = H // Hkv
    macs = G * D * bs  # multiply-adds of q.k (and of p.v) per (block, kv head)
    ideal_ns = macs / fma * 1e9
    dot_ns = f" ({macs / (32 * dot) * 1e9:.0f} ns by vdpbf16ps)" if dot else ""
    print(f"B={B} L={L} {H}q/{Hkv}kv head_size {D} block_size {bs}: per (block, kv head) on one "
          f"thread; q.k and p.v each {macs} multiply-adds = {ideal_ns:.0f} ns at the FMA "
          f"rate{dot_ns}")
    print(f"{'cache':6s} {'kernel':>16s} {'arith alone':>18s} {'q.k':>13s} {'p.v':>13s} "
          f"{'softmax':>8s} {'rest':>6s}")
    for dn, es, _, times in cases:
        med = {n: statistics.median(v) for n, v in times.items()}
        ns = {n: t * args.threads / block_heads * 1e9 for n, t in med.items()}
        nbytes = 2 * B * L * Hkv * D * es
        gbs = nbytes / med["kernel"] / 1e9
        arith = nbytes / med["arith"] / 1e9
        qk = ns["arith"] - ns["arith-no-qk"]
        pv = ns["arith"] - ns["arith-no-pv"]
        sm = ns["arith"] - ns["arith-no-softmax"]
        print(f"{dn:6s} {gbs:6.2f} GB/s {100 * gbs / bw:4.0f}% {arith:7.2f} GB/s-eq "
              f"{ns['arith']:4.0f} ns {qk:5.0f} ns {100 * ideal_ns / qk:3.0f}% "
              f"{pv:5.0f} ns {100 * ideal_ns / pv:3.0f}% {sm:5.0f} ns {ns['arith-none']:4.0f} ns")
    print("q.k / p.v: the phase's time, and the FMA ideal's share of it; rest: arith-none")


if __name__ == "__main__":
    main()
