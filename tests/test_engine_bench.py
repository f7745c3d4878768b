"""benchmarks/bench_engine.py and bench_cascade.py stay runnable: bench_engine's --quick offline
comparison (engine and transformers' generate, fp32) and --quick online mode run in-process,
and the engine's tokens equal generate's; bench_cascade's --quick table and rates."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    path = os.path.join(ROOT, "benchmarks", "bench_engine.py")
    spec = importlib.util.spec_from_file_location("bench_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv", [["--quick", "--dtypes", "fp32", "--systems", "engine,generate"],
                                  ["--quick", "--online", "--dtypes", "fp32"]],
                         ids=["offline", "online"])
def test_bench_engine_quick_runs(argv, monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", *argv])
    bench.main()
    out = capsys.readouterr().out
    if "--online" in argv:
        assert "inter-token latency, all" in out and "TTFT, long prompts" in out
    else:
        rows = [line for line in out.splitlines() if line.startswith("| engine")
                or line.startswith("| generate")]
        assert len(rows) == 2 and all(r.rstrip(" |").endswith("4/4") for r in rows), out


def test_bench_cascade_quick_runs(monkeypatch, capsys):
    """benchmarks/bench_cascade.py --quick: its table, with cascade=True and False giving the
    same tokens in fp32, and the arithmetic rates after it."""
    path = os.path.join(ROOT, "benchmarks", "bench_cascade.py")
    spec = importlib.util.spec_from_file_location("bench_cascade", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["bench_cascade.py", "--quick", "--dtypes", "fp32"])
    mod.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp32 |")]
    cases = [r for r in rows if r.count("|") == 12]
    assert len(cases) == 4 and all("| True |" in r for r in cases), out
    assert "fp32 GEMM" in out and len(rows) - len(cases) == 3, out
