"""benchmarks/bench_engine.py stays runnable: its --quick offline comparison (engine and
transformers' generate, fp32) and --quick online mode run in-process, and the engine's tokens
equal generate's."""

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
