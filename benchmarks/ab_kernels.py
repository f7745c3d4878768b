"""Interleaved A/B of a CPU attention kernel build at two or more source revisions.

Builds the kernel library (AVX2, or ``--variant``: ``csrc/cpu/builds/`` with the
flags of ``paged_ops/_cpu_build.py``) from each revision's ``csrc/``, a git revision or ``.``
for the working tree, in a temporary directory, loads them all into one process and times
decode calls round after round, switching kernels through the table the package uses for CPU
dispatch. Every other round runs the kernels in reverse order: on a shared two-core machine
the kernel timed first in a round measured 2-5% apart from the others whatever it was, and
alternating cancels that.

    python benchmarks/ab_kernels.py 29c3a84 .               # a revision against the work tree
    python benchmarks/ab_kernels.py HEAD~1 . --dtypes fp16,bf16 --shapes 8x2048,1x128
    python benchmarks/ab_kernels.py HEAD~1 . --variant avx512_bf16 --block-size 128

Prints, per dtype and shape, each kernel's median time per (block, kv head) on one thread, its
GB/s (K and V read once) and its speed-up over the first revision; and the read bandwidth of one
torch.sum over 1 GiB at the start of every round (median and range), which shows the shared
host's bandwidth state while the kernels ran.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402
import kernel_phases as kp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extract(rev, dest):
    """Writes `rev`'s csrc/ under dest (dest/csrc); returns a key that names its content."""
    out = os.path.join(dest, "csrc")
    shutil.rmtree(out, ignore_errors=True)
    if rev == ".":
        shutil.copytree(os.path.join(ROOT, "csrc"), out)
        return "wt-" + kp.tree_digest(out).hexdigest()[:16]
    tree = subprocess.run(["git", "-C", ROOT, "rev-parse", f"{rev}:csrc"], check=True,
                          capture_output=True, text=True).stdout.strip()
    tar = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev, "csrc"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return "git-" + tree[:16]


def build(revs, build_dir, jobs, variant="avx2", arith=False):
    """{rev: path of its kernel library}, built once per distinct source tree."""
    # Keyed on the build command too (kernel_phases.py, the torch install's flags, --arith).
    defines = ["-DPAGED_OPS_PHASE_ARITH=1"] if arith else []
    flags_key = kp.script_digest(variant).hexdigest()
    todo = {}
    sos = {}
    for rev in revs:
        staging = tempfile.mkdtemp(dir=build_dir)
        key = extract(rev, staging)
        out = os.path.join(build_dir, f"{key}-{flags_key[:8]}{'-arith' if arith else ''}")
        so = os.path.join(out, f"kernel_{variant}.so")
        sos[rev] = so
        if os.path.exists(so) or out in todo:
            shutil.rmtree(staging)
            continue
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
        todo[out] = so

    if todo:
        print(f"building {len(todo)} kernel(s) in {build_dir} ...", flush=True)
        with ThreadPoolExecutor(jobs) as ex:
            list(ex.map(lambda item: kp.compile_variant(os.path.join(item[0], "csrc"), item[1],
                                                        defines, variant), todo.items()))
    return sos


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("revs", nargs="+", help="git revisions, or . for the working tree")
    p.add_argument("--dtypes", default="fp32,fp16,bf16")
    p.add_argument("--shapes", default="8x2048,32x512", help="BATCHxCONTEXT,...")
    p.add_argument("--heads", default="32,8", help="query heads,kv heads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--variant", default="avx2", choices=sorted(kp._cpu_build.VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=12, help="rounds (medians reported)")
    p.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "paged_ops_ab"))
    p.add_argument("--arith", action="store_true",
                   help="time the arithmetic alone (kernel_phases.py's arith: K and V from the "
                        "core's caches): changes to per-block work, without DRAM's noise")
    p.add_argument("--probe-gib", type=float, default=1.0,
                   help="GiB read by torch.sum at the start of every round, to show the host's "
                        "bandwidth state during the run (0: none)")
    args = p.parse_args(argv)
    if len(args.revs) < 2:
        sys.exit("ab_kernels.py: give at least two revisions")
    kp.require_avx2("ab_kernels.py")
    torch.set_num_threads(args.threads)
    os.makedirs(args.build_dir, exist_ok=True)
    sos = build(args.revs, args.build_dir, min(args.threads, len(args.revs)), args.variant,
                args.arith)

    libs = [kp.load_kernel_table(sos[rev]) for rev in args.revs]  # kept loaded for the run
    tables = [(rev, tab) for rev, (_, tab) in zip(args.revs, libs)]

    H, Hkv = map(int, args.heads.split(","))
    D, bs = 128, args.block_size
    cases = []
    for shape in args.shapes.split(","):
        B, L = map(int, shape.split("x"))
        for dn in args.dtypes.split(","):
            run, es = kp.decode_call(B, L, H, Hkv, D, bs, dn)
            block_heads = B * ((L + bs - 1) // bs) * Hkv
            cases.append((dn, B, L, block_heads, 2 * B * L * Hkv * D * es, run,
                          {rev: [] for rev in args.revs}))
    # ~20 ms of calls per timing, or more
    probe = (ba.probe_buffer(args.probe_gib), []) if args.probe_gib > 0 else None
    kp.time_interleaved(tables, [(c[5], max(3, 32768 // c[3]), c[6]) for c in cases], args.reps,
                        probe)

    print(f"{args.threads} threads, {H}q/{Hkv}kv, head size {D}, block size {bs}; per (block, "
          f"kv head) on one thread, median of {args.reps} rounds; speed-up over {args.revs[0]}"
          + ("; arithmetic alone (GB/s-eq)" if args.arith else ""))
    if probe is not None:
        print(f"read bandwidth, one torch.sum per round: {kp.probe_summary(probe[1])}")
    for dn, B, L, block_heads, nbytes, _, times in cases:
        base = statistics.median(times[args.revs[0]])
        line = f"{dn:5s} B={B:<4d} L={L:<6d}"
        for rev in args.revs:
            t = statistics.median(times[rev])
            line += (f" | {rev}: {t * args.threads / block_heads * 1e9:5.0f} ns "
                     f"{nbytes / t / 1e9:6.2f} GB/s {base / t:5.2f}x")
        print(line)


if __name__ == "__main__":
    main()
