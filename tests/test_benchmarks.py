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
