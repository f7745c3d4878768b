"""reshape_and_cache (CPU) throughput against the copy bandwidth measured in the same run.

The cases of ``bench_attention.py``'s ``bench_cache_write_rows`` (decode: one token for each of
256 sequences, each in its own scattered block; prefill: an 8192-token prompt filling whole
blocks in block-table order), plus fp8 caches (bf16 key/value in, e4m3fn / e5m2 stored).

Bytes counted per call: key and value read once (input dtype) and written once (cache dtype).
Two clocks, both for the op and for the reference copy (``dst.copy_(src)`` of 256 MiB): wall time
and the CPU time of the calling thread (``time.thread_time``); medians. On a shared, noisy
machine use ``--threads 1``: then the thread-time ratio is exact (another process's load
stretches wall time, not our thread's CPU time), whereas with several threads a descheduled
worker makes the others wait (or spin) and both clocks suffer.

    python benchmarks/bench_cache_write.py                  # all rows, torch's thread count
    python benchmarks/bench_cache_write.py --threads 1      # per-core ratios on a noisy machine
    python benchmarks/bench_cache_write.py --cases fp32,bf16
    python benchmarks/bench_cache_write.py --block-sizes 8,16,32,64,128,256
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import paged_ops

CACHE_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    # (input dtype, cache dtype)
    "fp8e4m3": (torch.bfloat16, torch.float8_e4m3fn),
    "fp8e5m2": (torch.bfloat16, torch.float8_e5m2),
}


def timeit(fn, min_time=0.3, min_reps=5):
    """(median wall seconds, median CPU seconds of this thread) per call."""
    fn()  # warm-up
    walls, cpus = [], []
    start = time.perf_counter()
    while len(walls) < min_reps or time.perf_counter() - start < min_time:
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        if len(walls) > 2000:
            break
    return statistics.median(walls), statistics.median(cpus)


def copy_bandwidth(min_time=1.0):
    """(GB/s by wall time, GB/s by CPU time) of a 256 MiB fp32 copy, read + write."""
    src = torch.ones(1 << 26, dtype=torch.float32)
    dst = torch.empty_like(src)
    wall, cpu = timeit(lambda: dst.copy_(src), min_time=min_time)
    nbytes = 2 * src.numel() * 4
    return nbytes / wall / 1e9, nbytes / max(cpu, 1e-9) / 1e9


def case(name, ntok, bs=16, seed=0):
    in_dtype, cache_dtype = CACHE_DTYPES[name]
    H, D = 8, 128
    g = torch.Generator().manual_seed(seed)
    # Room for one block per decode token, or for the prompt's blocks.
    nb = (ntok if ntok != 8192 else -(-ntok // bs)) + 64
    kc, vc = paged_ops.allocate_kv_cache(nb, H, D, bs, cache_dtype)
    kc.view(torch.uint8).zero_()
    vc.view(torch.uint8).zero_()
    k = torch.randn(ntok, H, D, generator=g).to(in_dtype)
    v = torch.randn(ntok, H, D, generator=g).to(in_dtype)
    if ntok == 8192:  # a prompt fills whole blocks in order of its block table
        blocks = torch.randperm(nb, generator=g)[: -(-ntok // bs)]
        slots = blocks.repeat_interleave(bs) * bs + torch.arange(ntok) % bs
    else:  # one token per sequence, each in its own scattered block
        slots = torch.randperm(nb, generator=g)[:ntok] * bs + torch.randint(
            0, bs, (ntok,), generator=g)
    scales = {}
    if cache_dtype.is_floating_point and kc.element_size() == 1:
        scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.04]))
    nbytes = 2 * ntok * H * D * (k.element_size() + kc.element_size())
    return (k, v, kc, vc, slots, scales), nbytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CACHE_DTYPES), help="comma list of "
                   + ",".join(CACHE_DTYPES))
    p.add_argument("--block-sizes", default="16", help="comma list, e.g. 8,16,32,64,128,256")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--min-time", type=float, default=0.3)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    bw_wall, bw_cpu = copy_bandwidth()
    print(f"reshape_and_cache CPU: torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"copy bandwidth (read + write): {bw_wall:.1f} GB/s wall, {bw_cpu:.1f} GB/s per "
          "second of thread time")
    for name, bs, (label, ntok) in itertools.product(
            a.cases.split(","), map(int, a.block_sizes.split(",")),
            (("decode B=256", 256), ("prefill 8192", 8192))):
        (k, v, kc, vc, slots, scales), nbytes = case(name, ntok, bs)

        def fn():
            torch.ops.paged.reshape_and_cache(k, v, kc, vc, slots, scales.get("k_scale"),
                                              scales.get("v_scale"))

        wall, cpu = timeit(fn, min_time=a.min_time)
        gw, gc = nbytes / wall / 1e9, nbytes / max(cpu, 1e-9) / 1e9
        print(f"  {name:8s} bs {bs:3d} {label:13s} {wall * 1e6:9.1f} us wall {gw:7.2f} GB/s "
              f"{100 * gw / bw_wall:6.1f}% of copy | thread {cpu * 1e6:9.1f} us "
              f"{100 * gc / bw_cpu:6.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
