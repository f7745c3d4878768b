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
