"""Decode attention (and cache write) throughput of paged_ops against the machine's bandwidth.

Each row: time per call, effective GB/s (K and V bytes read once), that as a fraction of the
read bandwidth measured in the same run (a large ``torch.sum``; on CUDA the GPU's peak), and the
speed-up over gather + SDPA (K/V gathered from the cache with the block table, then
``scaled_dot_product_attention``). Ratios measured in one run survive a noisy, shared machine.

    python benchmarks/bench_attention.py                    # CPU rows
    python benchmarks/bench_attention.py --device cuda      # GPU rows
    python benchmarks/bench_attention.py --csv out.csv --plot out.png
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch

import paged_ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8": torch.float8_e4m3fn}  # fp8: e4m3 cache, bf16 queries, per-tensor scales
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Peak HBM bandwidth (GB/s) by device name, for the % of peak column on CUDA.
GPU_PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100": 3350.0, "A100": 2039.0,
                "L40S": 864.0, "A10": 600.0}


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


def read_bandwidth_gbs(device):
    """Read bandwidth by a large reduction (CPU), or the device's published peak (CUDA)."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, gbs in GPU_PEAK_GBS.items():
            if key in name:
                return gbs, f"peak of {name}"
        big = torch.empty(1 << 28, dtype=torch.float32, device=device)
        t = timeit(lambda: big.sum(), device)
        return big.numel() * 4 / t / 1e9, "measured torch.sum"
    big = torch.ones(1 << 27, dtype=torch.float32)  # 512 MiB, far beyond any cache
    t = timeit(lambda: big.sum(), device, min_time=1.0)
    return big.numel() * 4 / t / 1e9, "measured torch.sum"


def copy_bandwidth_gbs(device):
    src = torch.ones(1 << 26, dtype=torch.float32, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, min_time=1.0)
    return 2 * src.numel() * 4 / t / 1e9


def make_case(batch, ctx, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed=0):
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


def kv_scales(kc):
    """One-element fp32 scales for fp8 caches (None otherwise)."""
    if kc.dtype not in FP8:
        return None, None
    one = torch.ones(1, dtype=torch.float32, device=kc.device)
    return one, one.clone()


def gather_sdpa(q, kc, vc, bt, sl, ctx):
    # The baseline a user without a paged kernel would write: gather, then dense attention.
    B, H, D = q.shape
    Hkv, bs = vc.shape[1], vc.shape[3]
    k = kc[bt.long()].to(q.dtype)  # [B, nb, Hkv, D/x, bs, x]
    k = k.permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, -1, D)[:, :, :ctx]
    v = vc[bt.long()].to(q.dtype).permute(0, 2, 1, 4, 3).reshape(B, Hkv, -1, D)[:, :, :ctx]
    del bs
    return torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, enable_gqa=H != Hkv).squeeze(2)


def bench_attention_rows(device, dtypes, shapes, heads, head_size, block_size, bw, baseline):
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for (num_heads, num_kv_heads) in heads:
            for batch, ctx in shapes:
                q, kc, vc, bt, sl = make_case(batch, ctx, num_heads, num_kv_heads, head_size,
                                              block_size, dtype, device)
                out = torch.empty_like(q)
                ks, vs = kv_scales(kc)

                def run(q=q, kc=kc, vc=vc, bt=bt, sl=sl, out=out, ctx=ctx, ks=ks, vs=vs):
                    torch.ops.paged.attention_out(out, q, kc, vc, bt, sl, head_size**-0.5,
                                                  None, -1, 0.0, ks, vs, ctx)

                t = timeit(run, device)
                nbytes = 2 * batch * ctx * num_kv_heads * head_size * kc.element_size()
                gbs = nbytes / t / 1e9
                row = dict(device=device, dtype=dname, batch=batch, ctx=ctx, heads=num_heads,
                           kv_heads=num_kv_heads, us=t * 1e6, gbs=gbs, frac_bw=gbs / bw)
                if baseline:
                    tb = timeit(lambda: gather_sdpa(q, kc, vc, bt, sl, ctx), device,
                                min_time=0.2, min_reps=2)
                    ref = gather_sdpa(q, kc, vc, bt, sl, ctx)
                    err = (ref.float() - out.float()).abs().max().item()
                    row.update(sdpa_us=tb * 1e6, speedup=tb / t, max_err=err)
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
            row = dict(device=device, dtype=dname, op="reshape_and_cache", case=label,
                       us=t * 1e6, gbs=gbs, frac_copy_bw=gbs / bw_copy)
            rows.append(row)
            print(f"  reshape_and_cache {dname:5s} {label:13s} {t * 1e6:9.1f} us "
                  f"{gbs:7.2f} GB/s  {100 * gbs / bw_copy:5.1f}% of copy bandwidth", flush=True)
    return rows


def fmt_row(r):
    s = (f"  {r['dtype']:5s} B={r['batch']:<3d} L={r['ctx']:<6d} {r['heads']}q/{r['kv_heads']}kv "
         f"{r['us']:10.1f} us {r['gbs']:8.2f} GB/s {100 * r['frac_bw']:6.1f}% of bw")
    if "speedup" in r:
        s += f"   gather+SDPA {r['sdpa_us']:10.1f} us  x{r['speedup']:6.1f}  err {r['max_err']:.1e}"
    return s


def plot(rows, bw, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dname in sorted({r["dtype"] for r in rows}):
        pts = sorted((r["ctx"], r["gbs"], r["batch"]) for r in rows if r["dtype"] == dname)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=dname)
        for c, g, b in pts:
            ax.annotate(f"B={b}", (c, g), fontsize=7)
    ax.axhline(bw, color="k", ls="--", label=f"read bandwidth {bw:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("effective GB/s (K+V read once)")
    ax.set_title(f"paged decode attention ({rows[0]['device']})")
    ax.legend()
    fig.tight_layout()
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtypes", default=None, help="comma list of fp32,fp16,bf16,fp8")
    p.add_argument("--no-baseline", action="store_true", help="skip gather+SDPA")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--quick", action="store_true", help="a few rows only")
    p.add_argument("--multi-token", action="store_true",
                   help="CUDA only: the multi-token (chunked prefill) and fp8 rows, nothing else")
    a = p.parse_args(argv)
    device = a.device
    if device == "cuda" and not (torch.cuda.is_available() and paged_ops.built_with_cuda()):
        sys.exit("--device cuda needs a GPU and paged_ops built with CUDA")
    bw, how = read_bandwidth_gbs(device)
    print(f"paged_ops attention benchmark on {device}: torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, CPU kernel {paged_ops.cpu_kernel_variant()}")
    print(f"read bandwidth: {bw:.1f} GB/s ({how})")
    rows = []
    if a.multi_token:
        if device != "cuda":
            sys.exit("--multi-token rows are for --device cuda")
        rows += bench_cuda_multi_token_fp8_rows(bw)
    elif device == "cpu":
        dtypes = (a.dtypes or "fp32,fp16,bf16,fp8").split(",")
        shapes = [(8, 2048), (32, 512), (1, 16384)]
        if a.quick:
            shapes = shapes[:1]
        rows += bench_attention_rows(device, dtypes, shapes, [(32, 8)], 128, 16, bw,
                                     not a.no_baseline)
        print("small work (per-call overhead):")
        rows += bench_attention_rows(device, dtypes[:1], [(1, 128), (256, 64)], [(32, 8)], 128,
                                     16, bw, False)
        # Real decode lengths are rarely whole blocks: the last block is partly visible.
        print("odd lengths (a partly visible last block):")
        rows += bench_attention_rows(device, dtypes, [(256, 63), (8, 2047)], [(32, 8)], 128, 16,
                                     bw, False)
        bw_copy = copy_bandwidth_gbs(device)
        print(f"copy bandwidth (read + write): {bw_copy:.1f} GB/s")
        rows += bench_cache_write_rows(device, [d for d in dtypes if d != "fp8"], bw_copy)
    else:
        dtypes = (a.dtypes or "bf16").split(",")
        # One sequence at a long context (split-K), a middle batch, a large batch.
        shapes = [(1, 16384), (8, 4096), (64, 1024), (64, 4096)]
        rows += bench_attention_rows(device, dtypes, shapes, [(32, 8), (32, 32)], 128, 16, bw,
                                     not a.no_baseline)
    if a.csv:
        keys = sorted({k for r in rows for k in r})
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.csv}")
    if a.plot:
        plot([r for r in rows if "ctx" in r and r["ctx"] >= 512], bw, a.plot)


if __name__ == "__main__":
    main()
