"""Decode attention (and cache write) throughput of paged_ops against the machine's bandwidth.

Each grid row is one (shape, KV dtype, block size, CPU kernel build): time per call, effective
GB/s (the K and V bytes of the visible tokens, read once, plus q and out) and that as a
percentage of the read bandwidth measured in the same run (``torch.sum`` over as many bytes as
the caches; on CUDA the GPU's peak). Ratios measured in one run survive a noisy, shared machine.
On the CPU each row also gives its share of the roofline: min(read bandwidth, FMA rate x cache
bytes per flop of the call), the FMA rate measured in the same run by a GEMM
(paged_ops.tune.gemm_gflops): fp32 for q.k and p.v on fp32 paths, bf16 for the paths that
multiply bf16 pairs (the row's ``paths``, paged_ops.cpu_plan), so that a CPU where the call is
compute-bound shows as one.

Every call reads a different layer's caches: the run cycles through copies of the caches that
total ``--cache-gib`` (default 1 GiB), so no call finds its K/V in a last-level cache that
holds hundreds of MiB. One row per CPU kernel build (``--variants``), timed one after the other
on the same caches, so the builds are compared side by side under the same load.

    python benchmarks/bench_attention.py                    # CPU grid + extra rows
    python benchmarks/bench_attention.py --block-sizes 8,16,32,64,128,256 \\
        --dtypes fp32,fp16,bf16,fp8_e4m3,fp8_e5m2 --variants all --csv g.csv --plot g.png
    python benchmarks/bench_attention.py --device cuda      # GPU rows
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import paged_ops
from paged_ops.tune import gemm_gflops, roofline_gbs

# fp8 caches are read with bf16 queries and per-tensor scales; "fp8" is fp8_e4m3.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
          "fp8": torch.float8_e4m3fn}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Peak HBM bandwidth (GB/s) by device name, for the % of peak column on CUDA.
GPU_PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100": 3350.0, "A100": 2039.0,
                "L40S": 864.0, "A10": 600.0}
DEFAULT_SHAPES = "8x2048,32x512,1x16384"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, min_time=0.3, min_reps=5):
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        start = time.perf_counter()
        while len(times) < min_reps or time.perf_counter() - start < min_time:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
            if len(times) > 1000:
                break
        return statistics.median(times)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 2000:
            break
    return statistics.median(times)


def time_rotating(fn, n, device, min_time=0.3, min_reps=3):
    """Median time of one call, calls ``fn(i)`` cycling i over 0..n-1 (one pass = n calls).

    A pass reads every layer copy once, so each call's K/V comes from memory, not a cache."""
    fn(n - 1)  # warm-up (the layer timed last, so the first timed call reads from memory)
    sync(device)
    per_call = []
    start = time.perf_counter()
    while len(per_call) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        sync(device)
        per_call.append((time.perf_counter() - t0) / n)
        if len(per_call) > 1000:
            break
    return statistics.median(per_call)


def probe_buffer(gib, huge_pages=True):
    """``gib`` GiB of fp32 ones for the read-bandwidth probe, on huge pages as the caches are
    (paged_ops.allocate_kv_cache): with 4 KiB pages the probe reads slower than memory allows,
    and the roofline with it."""
    big = torch.empty(max(1 << 10, int(gib * (1 << 30)) // 4), dtype=torch.float32)
    if huge_pages:
        paged_ops.advise_huge_pages(big)
    return big.fill_(1.0)


def copy_caches(kc, vc, huge_pages=True):
    """A copy of a layer's caches allocated as allocate_kv_cache allocates them."""
    k, v = torch.empty_like(kc), torch.empty_like(vc)
    for t in (k, v):
        if huge_pages:
            paged_ops.advise_huge_pages(t)
    return k.copy_(kc), v.copy_(vc)


def read_bandwidth_gbs(device, gib=1.0):
    """Read bandwidth by a reduction over ``gib`` GiB (CPU), or the device's published peak
    (CUDA). On a CPU the buffer must dwarf the last-level cache (hundreds of MiB on server
    parts): a buffer that partly stays cached reads faster than memory."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, gbs in GPU_PEAK_GBS.items():
            if key in name:
                return gbs, f"peak of {name}"
        big = torch.empty(1 << 28, dtype=torch.float32, device=device)
        t = timeit(lambda: big.sum(), device)
        return big.numel() * 4 / t / 1e9, "measured torch.sum"
    big = probe_buffer(gib)
    n = big.numel()
    t = timeit(lambda: big.sum(), device, min_time=1.0 if gib >= 0.5 else 0.05)
    return n * 4 / t / 1e9, f"measured torch.sum over {n * 4 / (1 << 30):.2f} GiB"


def copy_bandwidth_gbs(device):
    src = torch.ones(1 << 26, dtype=torch.float32, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, min_time=1.0)
    return 2 * src.numel() * 4 / t / 1e9


def machine_info():
    """CPU model, date and commit, for figures that name where and when they were taken."""
    cpu = platform.processor() or "unknown CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    # A VM's model name can be as vague as "Intel(R) Xeon(R) Processor": name the vector
    # extensions and the last-level cache too.
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
           if f in flags]
    llc = ""
    for index in (3, 2):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as fh:
                size = fh.read().strip()
            if size.endswith("K") and size[:-1].isdigit():
                size = f"{int(size[:-1]) / 1024:g} MiB"
            llc = f"L{index} {size}"
            break
        except OSError:
            continue
    cpu += f" [{' '.join(isa) or 'no AVX2'}{'; ' + llc if llc else ''}]"
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "csrc"],
                               capture_output=True, text=True).stdout.strip()
        commit += " (csrc modified)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return dict(cpu=cpu, cores=os.cpu_count(), date=date, commit=commit)


def make_case(batch, ctx, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed=0):
    """One layer's caches and a decode batch over them (used by kernel_phases.py)."""
    # Random data drawn on the target device, straight into the cache dtype (fp8 by way of
    # bf16): no host-side fp32 copy of a many-GB cache.
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq + 64
    kc, vc = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size, block_size, dtype,
                                         device)
    for c in (kc, vc):
        if dtype in FP8:
            c.copy_(torch.empty(c.shape, dtype=torch.bfloat16, device=device).normal_(
                generator=g))
        else:
            c.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g, device=device)[: batch * blocks_per_seq]
    bt = perm.view(batch, blocks_per_seq).to(torch.int32)  # scattered blocks
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qdtype = torch.bfloat16 if dtype in FP8 else dtype
    q = torch.randn(batch, num_heads, head_size, generator=g, device=device).to(qdtype)
    return q, kc, vc, bt, sl


class LayerCaches:
    """Copies of one layer's K/V caches, ``num_blocks`` blocks each, as many as it takes to
    total at least ``cache_bytes`` (at least one). All copies hold the same random values; the
    first is filled from a seeded generator, the others copied from it. ``huge_pages``: as
    paged_ops.allocate_kv_cache's."""

    def __init__(self, num_blocks, num_kv_heads, head_size, block_size, dtype, device,
                 cache_bytes, seed=0, huge_pages=True):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        g = torch.Generator().manual_seed(seed)
        kc, vc = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size, block_size,
                                             dtype, device, huge_pages=huge_pages)
        # randn in fp32 then cast: the same values (up to rounding) in every dtype.
        kc.copy_(torch.randn(kc.shape, generator=g).to(dtype))
        vc.copy_(torch.randn(vc.shape, generator=g).to(dtype))
        self.layer_bytes = (kc.numel() + vc.numel()) * kc.element_size()
        n = max(1, math.ceil(cache_bytes / self.layer_bytes))
        self.layers = [(kc, vc)]
        for _ in range(n - 1):
            self.layers.append(copy_caches(kc, vc, huge_pages))
        self.ks, self.vs = kv_scales(kc)

    @property
    def total_bytes(self):
        return self.layer_bytes * len(self.layers)

    def batch(self, batch, ctx, num_heads, head_size, seed=0):
        """Block table (scattered blocks), seq lens and queries for ``batch`` sequences of
        ``ctx`` tokens; the same block table serves every layer copy."""
        g = torch.Generator().manual_seed(seed + 1)
        device = self.layers[0][0].device
        per = (ctx + self.block_size - 1) // self.block_size
        if batch * per > self.num_blocks:
            raise ValueError(f"{batch}x{ctx} needs {batch * per} blocks, the caches hold "
                             f"{self.num_blocks}")
        perm = torch.randperm(self.num_blocks, generator=g)[: batch * per]
        bt = perm.view(batch, per).to(torch.int32).to(device)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        qdtype = torch.bfloat16 if self.dtype in FP8 else self.dtype
        q = torch.randn(batch, num_heads, head_size, generator=g).to(qdtype).to(device)
        return q, bt, sl


def kv_scales(kc):
    """One-element fp32 scales for fp8 caches (None otherwise)."""
    if kc.dtype not in FP8:
        return None, None
    one = torch.ones(1, dtype=torch.float32, device=kc.device)
    return one, one.clone()


def gather_sdpa(q, kc, vc, bt, sl, ctx):
    # The baseline a user without a paged kernel would write: gather, then dense attention.
    B, H, D = q.shape
    Hkv = vc.shape[1]
    k = kc[bt.long()].to(q.dtype)  # [B, nb, Hkv, D/x, bs, x]
    k = k.permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, -1, D)[:, :, :ctx]
    v = vc[bt.long()].to(q.dtype).permute(0, 2, 1, 4, 3).reshape(B, Hkv, -1, D)[:, :, :ctx]
    return torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, enable_gqa=H != Hkv).squeeze(2)


def add_cell_args(p, dtypes, block_sizes):
    """The arguments of the scripts that time one decode cell after another, each against a
    variant of itself (huge_pages.py, block_order.py)."""
    p.add_argument("--dtypes", default=dtypes)
    p.add_argument("--block-sizes", default=block_sizes)
    p.add_argument("--shape", default="8x2048", help="BATCHxCONTEXT")
    p.add_argument("--heads", default="32,8", help="query heads,kv heads")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gib", type=float, default=1.0, help="GiB of caches cycled over (per set)")
    p.add_argument("--seconds", type=float, default=4.0, help="per row")


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        try:
            b, c = item.lower().split("x")
            shapes.append((int(b), int(c)))
        except ValueError:
            raise SystemExit(f"--shapes: expected BxL items like 8x2048, got {item!r}") from None
    return shapes


# The builds paged_ops selected at import (on an AVX-512 CPU two, by block size).
# (peer_vllm_cpu.py loads this file without paged_ops: nothing then.)
SELECTION = getattr(paged_ops, "_selection", None)


def selection_name():
    return paged_ops._describe_selection(SELECTION)


def use_variant(variant):
    """Switch to a build by name, or back to the import-time selection ("selected")."""
    if variant == "selected":
        paged_ops._set_selection(SELECTION)
    elif variant is not None:
        paged_ops.set_cpu_kernel_variant(variant)


def parse_variants(text, device):
    if device != "cpu":
        return [None]
    supported = paged_ops.supported_cpu_kernel_variants()
    if text == "all":
        return supported
    if text == "selected":
        return ["selected"]
    names = text.split(",")
    bad = [n for n in names if n not in supported]
    if bad:
        raise SystemExit(f"--variants: {bad} not available here; supported: {supported}")
    return names


def bench_grid(device, dtypes, block_sizes, shapes, heads, head_size, variants, bw_ref,
               cache_bytes, baseline, min_time, min_reps, label="", rotate=True,
               gflops_ref=None):
    """Rows for every (dtype, block size, shape, variant); one set of layer copies per
    (dtype, block size), freed before the next. ``bw_ref()`` gives the reference read
    bandwidth and ``gflops_ref()`` (CPU) the FMA rate, re-measured by the caller's closures
    before each set."""
    rows = []
    for dname in dtypes:
        for bs in block_sizes:
            num_blocks = max(b * ((c + bs - 1) // bs) for b, c in shapes)
            caches = LayerCaches(num_blocks, heads[1], head_size, bs, DTYPES[dname], device,
                                 cache_bytes if rotate else 0)
            rows += _grid_rows(caches, dname, shapes, heads, head_size, variants, bw_ref(),
                               baseline, min_time, min_reps, label,
                               gflops_ref() if gflops_ref else None)
            del caches  # nothing else holds the layer copies: they are freed here
            gc.collect()
    return rows


def _grid_rows(caches, dname, shapes, heads, head_size, variants, bw, baseline, min_time,
               min_reps, label, gflops=None):
    num_heads, num_kv_heads = heads
    layers, ks, vs = caches.layers, caches.ks, caches.vs
    device = layers[0][0].device.type
    rows = []
    for si, (batch, ctx) in enumerate(shapes):
        q, bt, sl = caches.batch(batch, ctx, num_heads, head_size, seed=si)
        out = torch.empty_like(q)
        ref = None
        base = {}
        if baseline:
            kc0, vc0 = layers[0]
            tb = timeit(lambda: gather_sdpa(q, kc0, vc0, bt, sl, ctx), device,
                        min_time=min(min_time, 0.2), min_reps=2)
            ref = gather_sdpa(q, kc0, vc0, bt, sl, ctx).float()
            base = dict(sdpa_us=tb * 1e6)
        # K and V of the visible tokens, read once, plus q read and out written.
        nbytes = (2 * batch * ctx * num_kv_heads * head_size * layers[0][0].element_size()
                  + 2 * q.numel() * q.element_size())

        def run(i, q=q, bt=bt, sl=sl, out=out, ctx=ctx):
            kc, vc = layers[i]
            torch.ops.paged.attention_out(out, q, kc, vc, bt, sl, head_size**-0.5, None, -1,
                                          0.0, ks, vs, ctx)

        # Every other shape times the builds in reverse order: the one timed first in a round
        # can measure a few % apart from the others whatever it is.
        for variant in variants if si % 2 == 0 else variants[::-1]:
            use_variant(variant)
            t = time_rotating(run, len(layers), device, min_time, min_reps)
            gbs = nbytes / t / 1e9
            row = dict(device=device, section=label, variant=variant or device, dtype=dname,
                       block_size=caches.block_size, batch=batch, ctx=ctx, heads=num_heads,
                       kv_heads=num_kv_heads, head_size=head_size, layers=len(layers),
                       cache_gib=caches.total_bytes / (1 << 30), us=t * 1e6, gbs=gbs,
                       bw_gbs=bw, pct_bw=100 * gbs / bw)
            if gflops:
                group = num_heads // num_kv_heads
                plan = paged_ops.cpu_plan(q.dtype, DTYPES[dname], caches.block_size, head_size,
                                          group)
                paths = (plan["qk_path"], plan["pv_path"])
                roof = roofline_gbs(bw, gflops[0], DTYPES[dname], group, gflops[1], paths)
                row.update(gflops=gflops[0], bf16_gflops=gflops[1], paths="/".join(paths),
                           roof_gbs=roof, pct_roof=100 * gbs / roof)
            if baseline:
                run(0)
                err = (ref - out.float()).abs().max().item()
                row.update(base, speedup=base["sdpa_us"] / row["us"], max_err=err)
            rows.append(row)
            print(fmt_row(row), flush=True)
    return rows


def bench_cache_write_rows(device, dtypes, bw_copy):
    """reshape_and_cache: decode (one token per sequence) and prefill (a long prompt)."""
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for label, ntok in (("decode B=256", 256), ("prefill 8192", 8192)):
            H, D, bs = 8, 128, 16
            nb = ntok + 64  # room for one block per decode token
            kc, vc = paged_ops.allocate_kv_cache(nb, H, D, bs, dtype, device)
            k = torch.randn(ntok, H, D, device=device).to(dtype)
            v = torch.randn(ntok, H, D, device=device).to(dtype)
            if ntok == 8192:  # a prompt fills whole blocks in order of its block table
                blocks = torch.randperm(nb)[: ntok // bs]
                slots = (blocks.repeat_interleave(bs) * bs + torch.arange(ntok) % bs)
            else:  # one token per sequence, each in its own scattered block
                slots = torch.randperm(nb)[:ntok] * bs + torch.randint(0, bs, (ntok,))
            slots = slots.to(device)
            t = timeit(lambda: torch.ops.paged.reshape_and_cache(k, v, kc, vc, slots), device)
            nbytes = 2 * 2 * ntok * H * D * kc.element_size()  # read + write, K and V
            gbs = nbytes / t / 1e9
            row = dict(device=device, section="cache write", dtype=dname,
                       op="reshape_and_cache", case=label, us=t * 1e6, gbs=gbs,
                       frac_copy_bw=gbs / bw_copy)
            rows.append(row)
            print(f"  reshape_and_cache {dname:8s} {label:13s} {t * 1e6:9.1f} us "
                  f"{gbs:7.2f} GB/s  {100 * gbs / bw_copy:5.1f}% of copy bandwidth", flush=True)
    return rows


def fmt_row(r):
    s = (f"  {r['variant']:11s} {r['dtype']:8s} bs={r['block_size']:<3d} B={r['batch']:<3d} "
         f"L={r['ctx']:<6d} {r['us']:10.1f} us {r['gbs']:7.2f} GB/s {r['pct_bw']:6.1f}% of bw")
    if r.get("pct_roof") not in (None, ""):
        s += f" {r['pct_roof']:6.1f}% of roofline"
    if "speedup" in r:
        s += f"  gather+SDPA x{r['speedup']:6.1f}  err {r['max_err']:.1e}"
    return s


def summary_tables(rows, shapes):
    """Per shape: % of read bandwidth, one line per (dtype, variant), one column per block
    size."""
    lines = []
    grid = [r for r in rows if r.get("section") == "grid"]
    bss = sorted({r["block_size"] for r in grid})
    for batch, ctx in shapes:
        sel = [r for r in grid if (r["batch"], r["ctx"]) == (batch, ctx)]
        if not sel:
            continue
        lines.append(f"B={batch} L={ctx}: GB/s (% of read bandwidth / of the roofline) by "
                     "block size")
        lines.append(f"  {'dtype':8s} {'variant':11s} " + "".join(f"{'bs ' + str(b):>20s}"
                                                             for b in bss))
        keys = dict.fromkeys((r["dtype"], r["variant"]) for r in grid)  # the same order per shape
        keys = [k for k in keys if any((r["dtype"], r["variant"]) == k for r in sel)]
        for dname, variant in keys:
            cells = []
            for b in bss:
                hit = [r for r in sel if (r["dtype"], r["variant"], r["block_size"]) ==
                       (dname, variant, b)]
                roof = hit[0].get("pct_roof") if hit else None
                roof = f"/{roof:3.0f}%" if roof not in (None, "") else ""
                cells.append(f"{hit[0]['gbs']:6.1f} ({hit[0]['pct_bw']:3.0f}%{roof})"
                             if hit else "-")
            lines.append(f"  {dname:8s} {variant:11s} " + "".join(f"{c:>20s}" for c in cells))
    return "\n".join(lines)


def plot_grid(rows, path, title):
    """% of read bandwidth over block size: one panel per shape, one line per dtype x
    variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r.get("section") == "grid"]
    shapes = list(dict.fromkeys((r["batch"], r["ctx"]) for r in grid))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False,
                             sharey=True)
    for ax, (batch, ctx) in zip(axes[0], shapes):
        sel = [r for r in grid if (r["batch"], r["ctx"]) == (batch, ctx)]
        dnames = list(dict.fromkeys(r["dtype"] for r in sel))
        vnames = list(dict.fromkeys(r["variant"] for r in sel))
        for dname, variant in dict.fromkeys((r["dtype"], r["variant"]) for r in sel):
            pts = sorted((r["block_size"], r["pct_bw"]) for r in sel
                         if (r["dtype"], r["variant"]) == (dname, variant))
            # Colour by dtype, line style and marker by kernel build.
            vi = vnames.index(variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{dnames.index(dname)}",
                    ls=("-", "--", ":", "-.")[vi % 4], marker="os^Dv"[vi % 5], ms=3,
                    label=f"{dname} {variant}")
        ax.axhline(100, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
        ax.set_title(f"B={batch} L={ctx}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("% of read bandwidth (K+V of visible tokens, q, out)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    ncol = min(len(labels), 5)
    rows_legend = -(-len(labels) // ncol)
    fig.set_figheight(4.5 + 0.22 * rows_legend)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, (0.3 + 0.22 * rows_legend) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- CUDA: multi-token (chunked prefill) and fp8 rows (--multi-token) -------------------------


def bench_cuda_multi_token_fp8_rows(bw):
    """CUDA rows for query_start_loc and fp8 caches: a chunked-prefill step (8 sequences x 512
    new tokens over 4096 cached ones, causal), decode tokens through the multi-token kernel
    (against the decode kernel), and fp8 decode (against a bf16 cache of the same shape).
    32 query / 8 kv heads, head size 128, block size 16, bf16 queries."""
    dev = "cuda"
    H, Hkv, D, bs = 32, 8, 128, 16
    scale = D**-0.5
    rows = []

    def caches(num_seqs, L, dtype, seed=0):
        torch.manual_seed(seed)
        per = (L + bs - 1) // bs
        nb = num_seqs * per + 64
        kc, vc = paged_ops.allocate_kv_cache(nb, Hkv, D, bs, dtype, dev)
        kc.copy_(torch.randn(kc.shape, device=dev).to(dtype))
        vc.copy_(torch.randn(vc.shape, device=dev).to(dtype))
        bt = torch.randperm(nb, device=dev)[: num_seqs * per].view(num_seqs, per).int()
        sl = torch.full((num_seqs,), L, dtype=torch.int32, device=dev)
        ks, vs = kv_scales(kc)
        return kc, vc, bt, sl, ks, vs

    def attn(q, kc, vc, bt, sl, ks, vs, L, qsl=None, out=None):
        out = torch.empty_like(q) if out is None else out
        torch.ops.paged.attention_out(out, q, kc, vc, bt, sl, scale, None, -1, 0.0, ks, vs, L,
                                      qsl)
        return out

    # Chunked prefill: causal FLOPs 4 * D * sum of visible positions, per (row, head).
    for dname, cdtype in (("bf16", torch.bfloat16), ("fp8e4m3", torch.float8_e4m3fn)):
        B, chunk, cached = 8, 512, 4096
        L = cached + chunk
        kc, vc, bt, sl, ks, vs = caches(B, L, cdtype)
        q = torch.randn(B * chunk, H, D, device=dev).to(torch.bfloat16)
        qsl = torch.arange(0, B * chunk + 1, chunk, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        t = timeit(lambda: attn(q, kc, vc, bt, sl, ks, vs, L, qsl, out), dev)
        visible = B * sum(cached + j + 1 for j in range(chunk))
        tflops = 4 * D * H * visible / t / 1e12
        row = dict(device=dev, dtype=dname, case=f"prefill {B}x{chunk} over {cached}",
                   us=t * 1e6, tflops=tflops)
        if cdtype == torch.bfloat16:
            try:  # dense baseline: gathered K/V, SDPA with a bottom-right causal mask
                from torch.nn.attention.bias import causal_lower_right

                def dense():
                    k = kc[bt.long()].permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, -1, D)[:, :, :L]
                    v = vc[bt.long()].permute(0, 2, 1, 4, 3).reshape(B, Hkv, -1, D)[:, :, :L]
                    k = k.repeat_interleave(H // Hkv, dim=1)
                    v = v.repeat_interleave(H // Hkv, dim=1)
                    qq = q.view(B, chunk, H, D).transpose(1, 2)
                    return torch.nn.functional.scaled_dot_product_attention(
                        qq, k, v, attn_mask=causal_lower_right(chunk, L))

                tb = timeit(dense, dev, min_time=0.2, min_reps=2)
                err = (dense().transpose(1, 2).reshape_as(out).float() - out.float()).abs().max()
                row.update(sdpa_us=tb * 1e6, speedup=tb / t, max_err=err.item())
            except Exception as e:  # noqa: BLE001 - the baseline is optional
                print(f"  (dense SDPA baseline unavailable: {e})")
        rows.append(row)
        extra = f"  gather+SDPA {row['sdpa_us']:9.1f} us  x{row['speedup']:5.2f}  err " \
                f"{row['max_err']:.1e}" if "sdpa_us" in row else ""
        print(f"  {dname:8s} {row['case']:26s} {t * 1e6:10.1f} us {tflops:7.1f} TFLOP/s{extra}",
              flush=True)

    # Decode tokens (q_len 1) through the multi-token kernel vs the decode kernel.
    B, L = 64, 4096
    kc, vc, bt, sl, ks, vs = caches(B, L, torch.bfloat16, seed=1)
    q = torch.randn(B, H, D, device=dev).to(torch.bfloat16)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    t_multi = timeit(lambda: attn(q, kc, vc, bt, sl, ks, vs, L, qsl), dev)
    t_dec = timeit(lambda: attn(q, kc, vc, bt, sl, ks, vs, L), dev)
    gbs = 2 * B * L * Hkv * D * 2 / t_multi / 1e9
    rows.append(dict(device=dev, dtype="bf16", case=f"q_len 1 x {B} over {L} (multi)",
                     us=t_multi * 1e6, gbs=gbs, frac_bw=gbs / bw, decode_us=t_dec * 1e6))
    print(f"  bf16     q_len 1 x {B} over {L}: multi-token {t_multi * 1e6:9.1f} us "
          f"({gbs:7.1f} GB/s), decode kernel {t_dec * 1e6:9.1f} us", flush=True)

    # fp8 decode: bytes moved are halved against bf16.
    for B in (8, 64):
        times = {}
        for dname, cdtype in (("bf16", torch.bfloat16), ("fp8e4m3", torch.float8_e4m3fn),
                              ("fp8e5m2", torch.float8_e5m2)):
            kc, vc, bt, sl, ks, vs = caches(B, L, cdtype, seed=2)
            q = torch.randn(B, H, D, device=dev).to(torch.bfloat16)
            t = timeit(lambda: attn(q, kc, vc, bt, sl, ks, vs, L), dev)
            times[dname] = t
            gbs = 2 * B * L * Hkv * D * kc.element_size() / t / 1e9
            rows.append(dict(device=dev, dtype=dname, case=f"decode B={B} L={L}", us=t * 1e6,
                             gbs=gbs, frac_bw=gbs / bw, vs_bf16=times["bf16"] / t))
            print(f"  {dname:8s} decode B={B:<3d} L={L} {t * 1e6:9.1f} us {gbs:8.1f} GB/s "
                  f"{100 * gbs / bw:5.1f}% of bw  x{times['bf16'] / t:4.2f} vs bf16", flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtypes", default=None,
                   help="comma list of fp32,fp16,bf16,fp8_e4m3,fp8_e5m2 (fp8 = fp8_e4m3; fp8 "
                        "caches are read with bf16 queries); default fp32,fp16,bf16,fp8_e4m3 "
                        "(CPU), bf16 (CUDA)")
    p.add_argument("--block-sizes", default="16", help="comma list, e.g. 8,16,32,64,128,256")
    p.add_argument("--variants", default="all",
                   help="CPU kernel builds: 'all' (every supported one, side by side), "
                        "'selected' (the one chosen at import) or a comma list of "
                        "paged_ops.supported_cpu_kernel_variants()")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of BxL (batch x context), default {DEFAULT_SHAPES} (CPU)")
    p.add_argument("--heads", default="32/8", help="query/kv heads, default 32/8")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--cache-gib", type=float, default=1.0,
                   help="the layer copies the calls cycle through total at least this many GiB "
                        "(per dtype and block size; also the size of the torch.sum bandwidth "
                        "read); keep it well above the last-level cache")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--min-time", type=float, default=0.3,
                   help="seconds of timed passes per row (at least --min-reps passes)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip gather+SDPA")
    p.add_argument("--no-extras", action="store_true",
                   help="CPU: the grid only (no per-call overhead, odd-length and cache-write "
                        "rows)")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="PNG: %% of read bandwidth over block size")
    p.add_argument("--quick", action="store_true", help="a few rows only")
    p.add_argument("--from-csv", default=None, metavar="CSV[,CSV...]",
                   help="run nothing: the tables (and --plot) of earlier runs' CSV files")
    p.add_argument("--multi-token", action="store_true",
                   help="CUDA only: the multi-token (chunked prefill) and fp8 rows, nothing else")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cuda" and not (torch.cuda.is_available() and paged_ops.built_with_cuda()):
        sys.exit("--device cuda needs a GPU and paged_ops built with CUDA")
    threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        return run_benchmark(a)
    finally:  # main() may be called in a process that goes on (the tests)
        torch.set_num_threads(threads)


def read_csv_rows(paths):
    rows = []
    for path in paths:
        with open(path) as fh:
            for r in csv.DictReader(fh):
                if r.get("section") != "grid":
                    continue
                for k in ("block_size", "batch", "ctx", "heads", "kv_heads", "head_size"):
                    r[k] = int(r[k])
                for k in ("us", "gbs", "bw_gbs", "pct_bw"):
                    r[k] = float(r[k])
                for k in ("gflops", "bf16_gflops", "roof_gbs", "pct_roof"):  # CPU rows with them
                    r[k] = float(r[k]) if r.get(k) else None
                rows.append(r)
    return rows


def run_benchmark(a):
    if a.from_csv:
        rows = read_csv_rows(a.from_csv.split(","))
        if not rows:
            sys.exit(f"no grid rows in {a.from_csv}")
        print(summary_tables(rows, list(dict.fromkeys((r["batch"], r["ctx"]) for r in rows))))
        if a.plot:
            r0 = rows[0]
            plot_grid(rows, a.plot, f"paged decode attention, {r0['heads']}q/{r0['kv_heads']}kv "
                      f"heads, head size {r0['head_size']}; {r0.get('cpu')}, "
                      f"{r0.get('threads')} threads; {r0.get('date')}; commit {r0.get('commit')}")
        return rows
    device = a.device
    info = machine_info()
    selected = "selected"
    variants = parse_variants(a.variants, device)
    bws = []

    def bw_ref():
        # Re-measured before each set of caches; the run's reference is the median so far.
        bw, how = read_bandwidth_gbs(device, a.cache_gib)
        bws.append(bw)
        if len(bws) == 1:
            print(f"read bandwidth: {bw:.1f} GB/s ({how})", flush=True)
        return statistics.median(bws)

    gfs, gfs16 = [], []

    def gflops_ref():
        # The compute side of the roofline, re-measured with the bandwidth; the medians so far
        # (fp32, and bf16 for the paths that multiply bf16 pairs).
        gfs.append(gemm_gflops())
        gfs16.append(gemm_gflops(dtype=torch.bfloat16))
        if len(gfs) == 1:
            print(f"GEMM (torch.mm): fp32 {gfs[0]:.1f}, bf16 {gfs16[0]:.1f} GFLOP/s", flush=True)
        return statistics.median(gfs), statistics.median(gfs16)

    print(f"paged_ops attention benchmark on {device}: {info['cpu']} ({info['cores']} CPUs), "
          f"{info['date']}, commit {info['commit']}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU kernel builds "
          f"{variants} (selected at import: {selection_name()}), caches cycled over >= "
          f"{a.cache_gib:g} GiB")
    try:
        num_heads, num_kv_heads = (int(x) for x in a.heads.split("/"))
        block_sizes = [int(b) for b in a.block_sizes.split(",")]
    except ValueError:
        sys.exit("--heads is Q/KV (e.g. 32/8), --block-sizes a comma list of ints")
    dtypes = (a.dtypes or ("fp32,fp16,bf16,fp8_e4m3" if device == "cpu" else "bf16")).split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        sys.exit(f"--dtypes: unknown {unknown}; known: {list(DTYPES)}")
    cache_bytes = a.cache_gib * (1 << 30)
    rows = []
    common = dict(heads=(num_heads, num_kv_heads), head_size=a.head_size, bw_ref=bw_ref,
                  cache_bytes=cache_bytes, min_time=a.min_time, min_reps=a.min_reps,
                  gflops_ref=gflops_ref if device == "cpu" else None)
    if a.multi_token:
        if device != "cuda":
            sys.exit("--multi-token rows are for --device cuda")
        rows += bench_cuda_multi_token_fp8_rows(bw_ref())
    elif device == "cpu":
        shapes = parse_shapes(a.shapes or DEFAULT_SHAPES)
        if a.quick:
            shapes = shapes[:1]
        rows += bench_grid(device, dtypes, block_sizes, shapes, variants=variants,
                           baseline=not a.no_baseline, label="grid", **common)
        if not a.no_extras:
            use_variant(selected)
            print(f"small work (per-call overhead; one layer, cached), {selection_name()}:")
            rows += bench_grid(device, dtypes[:1], [16], [(1, 128), (256, 64)],
                               variants=[selected], baseline=False, label="small work",
                               rotate=False, **common)
            # Real decode lengths are rarely whole blocks: the last block is partly visible.
            print(f"odd lengths (a partly visible last block), {selection_name()}:")
            rows += bench_grid(device, dtypes, [16], [(256, 63), (8, 2047)],
                               variants=[selected], baseline=False, label="odd lengths",
                               **common)
            bw_copy = copy_bandwidth_gbs(device)
            print(f"copy bandwidth (read + write): {bw_copy:.1f} GB/s")
            rows += bench_cache_write_rows(device, [d for d in dtypes if DTYPES[d] not in FP8],
                                           bw_copy)
        use_variant(selected)
        print(f"read bandwidth over the run: {min(bws):.1f}-{max(bws):.1f} GB/s "
              f"(median {statistics.median(bws):.1f}, {len(bws)} measurements); fp32 GEMM "
              f"{min(gfs):.1f}-{max(gfs):.1f} GFLOP/s (median {statistics.median(gfs):.1f})")
        print(summary_tables(rows, shapes))
    else:
        # One sequence at a long context (split-K), a middle batch, a large batch.
        shapes = parse_shapes(a.shapes) if a.shapes else [
            (1, 16384), (8, 4096), (64, 1024), (64, 4096)]
        rows += bench_grid(device, dtypes, block_sizes, shapes, variants=[None],
                           baseline=not a.no_baseline, label="grid", **common)
        print(summary_tables(rows, shapes))
    if a.csv:
        run_info = dict(cpu=info["cpu"], date=info["date"], commit=info["commit"],
                        torch=torch.__version__, threads=torch.get_num_threads())
        rows = [{**r, **run_info} for r in rows]
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.csv}")
    if a.plot and any(r.get("section") == "grid" for r in rows):
        plot_grid(rows, a.plot, f"paged decode attention, {num_heads}q/{num_kv_heads}kv heads, "
                  f"head size {a.head_size}; {info['cpu']}, {torch.get_num_threads()} threads; "
                  f"{info['date']}; commit {info['commit']}")
    return rows


if __name__ == "__main__":
    main()
