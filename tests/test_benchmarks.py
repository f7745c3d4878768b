"""The benchmark scripts stay in step with the sources they measure."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_phases_edits_match_the_kernel():
    # kernel_phases.py instruments a copy of the kernel by text edits: each must match once.
    kp = load("kernel_phases")
    with open(os.path.join(ROOT, "csrc", kp.KERNEL)) as fh:
        text = fh.read()
    for name, old, new in kp.EDITS:
        assert text.count(old) == 1, f"kernel_phases.py edit {name!r} no longer matches"
        text = text.replace(old, new)
    for flag in ("PHASE_ARITH", "PHASE_QK", "PHASE_SM", "PHASE_PV"):
        assert flag in text


def test_ab_kernels_extracts_a_revision_and_the_working_tree(tmp_path):
    # ab_kernels.py builds the kernel of each revision from its csrc/ (git archive, or a copy
    # of the working tree); the build itself is left to the script's own runs.
    ab = load("ab_kernels")
    kernel = os.path.join("csrc", "cpu", "attention_kernel.h")
    key_head = ab.extract("HEAD", str(tmp_path / "head"))
    assert os.path.exists(tmp_path / "head" / kernel) and key_head.startswith("git-")
    key_wt = ab.extract(".", str(tmp_path / "wt"))
    assert os.path.exists(tmp_path / "wt" / kernel) and key_wt.startswith("wt-")
    assert ab.extract(".", str(tmp_path / "wt2")) == key_wt  # same content, same key


def test_bench_attention_grid_smoke(tmp_path):
    # The grid of bench_attention.py on tiny caches: a row per (dtype, block size, shape, CPU
    # kernel build), each build's output checked against gather + SDPA, the CSV and the plot.
    import paged_ops

    ba = load("bench_attention")
    selected = paged_ops.cpu_kernel_variant()
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
    assert paged_ops.cpu_kernel_variant() == selected  # the selection is restored
    with open(csv_path) as fh:
        assert len(fh.read().splitlines()) == len(grid) + 1
    assert png_path.stat().st_size > 0
