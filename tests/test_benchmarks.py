"""The benchmark scripts stay in step with the sources they measure."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_phases_switches_exist_in_the_kernel():
    # kernel_phases.py builds the kernel with -DPAGED_OPS_PHASE_<NAME>=0/1: each switch must have
    # a default in the kernel and be used by it, or a phase build would silently measure the
    # whole kernel.
    kp = load("kernel_phases")
    text = ""
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc", "cpu")):
        for f in files:
            with open(os.path.join(dirpath, f)) as fh:
                text += fh.read()
    for flag in ("ARITH", "QK", "SM", "PV"):
        macro = f"PAGED_OPS_PHASE_{flag}"
        assert f"#ifndef {macro}" in text, f"{macro} has no default in csrc/cpu"
        assert text.count(macro) >= 3, f"{macro} is defined but never used in csrc/cpu"
    assert all(len(v) == 4 and set(v) <= {0, 1} for v in kp.VARIANTS.values())


def test_ab_kernels_extracts_a_revision_and_the_working_tree(tmp_path):
    # ab_kernels.py builds the kernel of each revision from its csrc/ (git archive, or a copy
    # of the working tree); the build itself is left to the script's own runs.
    ab = load("ab_kernels")
    kernel = os.path.join("csrc", "cpu", "attention", "kernel.h")
    key_head = ab.extract("HEAD", str(tmp_path / "head"))
    assert os.path.exists(tmp_path / "head" / kernel) and key_head.startswith("git-")
    key_wt = ab.extract(".", str(tmp_path / "wt"))
    assert os.path.exists(tmp_path / "wt" / kernel) and key_wt.startswith("wt-")
    assert ab.extract(".", str(tmp_path / "wt2")) == key_wt  # same content, same key


def test_bench_attention_grid_smoke(tmp_path):
    # The grid of bench_attention.py on tiny caches: a row per (dtype, block size, shape, CPU
    # kernel build), each build's output checked against gather + SDPA, the CSV and the plot.
    import torch

    import paged_ops
    from paged_ops import tune

    ba = load("bench_attention")
    selected = paged_ops._selection
    csv_path, png_path = tmp_path / "g.csv", tmp_path / "g.png"
    rows = ba.main(["--cache-gib", "0.002", "--block-sizes", "8,32", "--dtypes",
                    "fp32,bf16,fp8_e5m2", "--variants", "all", "--shapes", "2x40,1x70",
                    "--heads", "4/2", "--threads", "1", "--min-time", "0", "--min-reps", "1",
                    "--no-extras", "--csv", str(csv_path), "--plot", str(png_path)])
    variants = paged_ops.supported_cpu_kernel_variants()
    grid = [r for r in rows if r["section"] == "grid"]
    assert len(grid) == 3 * 2 * 2 * len(variants)
    assert {r["variant"] for r in grid} == set(variants)
    for r in grid:
        assert r["layers"] >= 2 and r["gbs"] > 0 and r["pct_bw"] > 0
        assert r["max_err"] < 2e-2, r
        # The roof by the row's own paths: each phase at its path's GEMM rate.
        qk, pv = r["paths"].split("/")
        assert r["roof_gbs"] == pytest.approx(tune.roofline_gbs(
            r["bw_gbs"], r["gflops"], ba.DTYPES[r["dtype"]], 2, r["bf16_gflops"], (qk, pv)))
    assert paged_ops._selection == selected  # the selection is restored
    name, cells = selected
    for bs, dtype in ((1, torch.float32), (8, torch.float32), (24, torch.bfloat16)):
        expect = next((o for o, c in cells.items() if bs in c.get(dtype, ())), name)
        assert paged_ops.cpu_kernel_variant(bs, dtype) == expect
    with open(csv_path) as fh:
        assert len(fh.read().splitlines()) == len(grid) + 1
    assert png_path.stat().st_size > 0
    again = ba.main(["--from-csv", str(csv_path), "--plot", str(tmp_path / "again.png")])
    assert [(r["variant"], r["dtype"], r["block_size"], r["batch"]) for r in again] == \
        [(r["variant"], r["dtype"], r["block_size"], r["batch"]) for r in grid]


def test_peer_vllm_cpu_table_and_fp8_reference():
    # The peer script's table from rows of both sides (vLLM itself lives in .venv-peer and is
    # not run here), and its model of vLLM's fp8 cache write (round toward zero).
    import torch

    pv = load("peer_vllm_cpu")
    ours = [dict(variant=v, dtype="bf16", block_size=bs, batch=8, ctx=2048, gbs=g, pct_bw=p)
            for v, bs, g, p in (("avx2", 16, 20.0, 80.0), ("avx512", 16, 22.0, 88.0),
                                ("avx2", 32, 21.0, 84.0), ("avx512", 32, 23.0, 92.0))]
    peer = dict(rows=[dict(dtype="bf16", block_size=16, batch=8, ctx=2048, isa="vec16",
                           error="block size"),
                      dict(dtype="bf16", block_size=32, batch=8, ctx=2048, isa="amx",
                           gbs=11.5, pct_bw=46.0)])
    lines = pv.table(ours, peer, [(8, 2048)]).splitlines()
    assert "ours avx2" in lines[0] and "ours avx512" in lines[0]
    assert "unsupported (vec16)" in lines[1]
    assert "amx" in lines[2] and lines[2].endswith("x2.00")  # best build 92% / vLLM 46%
    assert "-" in pv.table(ours, None, [(8, 2048)]).splitlines()[1]
    x = torch.tensor([1.1, -1.1, 0.3, 448.0, 0.0, 1e-3])
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = pv.fp8_toward_zero(torch, x, f8)
        assert (t.abs() <= x.abs()).all() and (t * x >= 0).all()
        assert (t == x.to(f8).float()).logical_or(t.abs() < x.to(f8).float().abs()).all()
    # 1.1 lies between e4m3's 1.0 and 1.125; round-to-nearest gives 1.125.
    assert pv.fp8_toward_zero(torch, x, torch.float8_e4m3fn)[:2].tolist() == [1.0, -1.0]


def test_benchmark_scripts_print_their_help():
    # argparse formats help strings with %: a stray one fails --help (and every run) at once.
    for name in ("bench_attention", "bench_cache_write", "bench_block_manager", "kernel_phases",
                 "ab_kernels", "cpu_grid", "bench_prefill", "huge_pages", "block_order"):
        run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"),
                              "--help"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "usage" in run.stdout, (name, run.stderr[-2000:])


@pytest.mark.parametrize("name", ["scattered_read", "cache_write_lines", "overlap_model"])
def test_cpp_benchmarks_compile(name):
    # The C++ probes build as their headers say (compiled, not run: each reads 1 GiB).
    import platform
    import shutil
    if shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs g++ on x86-64")
    src = os.path.join(ROOT, "benchmarks", f"{name}.cpp")
    run = subprocess.run(["g++", "-fsyntax-only", "-Wall", "-Werror", "-mavx2", "-mfma",
                          "-fopenmp", src], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_block_order_runs_and_restores_the_plans(monkeypatch):
    # benchmarks/block_order.py installs plans of its own per call: a row per cell with four
    # shares, and at the end the process's plans are installed again.
    import torch

    import paged_ops
    restored = []
    install = paged_ops._install_plans
    monkeypatch.setattr(paged_ops, "_install_plans", lambda: restored.append(install()))
    threads = torch.get_num_threads()
    try:
        rows = load("block_order").main(["--gib", "0.01", "--seconds", "0.05", "--dtypes", "bf16",
                                         "--block-sizes", "16", "--shape", "2x100"])
    finally:
        torch.set_num_threads(threads)
    assert [(r[0], r[1], len(r[2])) for r in rows] == [("bf16", 16, 4)]
    assert all(s > 0 for s in rows[0][2]) and rows[0][3] > 0
    assert len(restored) == 1


def test_bench_prefill_quick_runs(capsys):
    # benchmarks/bench_prefill.py --quick: a row per case and thread count, ours equal to SDPA.
    import torch
    threads = torch.get_num_threads()
    try:
        load("bench_prefill").main(["--quick", "--dtypes", "fp32", "--threads", "2"])
    finally:
        torch.set_num_threads(threads)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 1 x 40 |")
            or r.startswith("| 2 mixed")]
    assert len(rows) == 4, rows
    assert all(float(r.rstrip(" |").rsplit("|", 1)[1]) < 1e-4 for r in rows), rows
