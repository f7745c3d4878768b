"""Fixtures shared by the test files."""

import atexit
import os
import shutil
import tempfile
import time

# Before torch loads OpenMP: threads that finish a parallel region sleep instead of spinning.
# make test runs a test process per core (pytest-xdist), each with torch's threads, and
# spinning threads would take the cores the other processes need (a tenth of the speed).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before paged_ops loads: no plan file of the user's (tuned plans, paged_ops/_plans.py) and no
# autotuning reach the tests; each test process reads its own empty plan file location.
os.environ["PAGED_OPS_PLAN_CACHE"] = os.path.join(
    tempfile.mkdtemp(prefix="paged_ops_test_plans_"), "plans.json")
os.environ.pop("PAGED_OPS_AUTOTUNE", None)

import pytest

from tests.cpu_variants import VARIANTS, use
from tests.helpers import DEVICES

# The plan file's directory goes when the test process ends.
atexit.register(shutil.rmtree, os.path.dirname(os.environ["PAGED_OPS_PLAN_CACHE"]), True)


@pytest.fixture(params=VARIANTS)
def cpu_variant(request):
    """Run the test on each CPU attention kernel build: those this CPU supports (e.g. avx2,
    default) and lanes16, the kernel's 16-lane paths (what AVX-512 runs), see cpu_variants.py."""
    with use(request.param) as name:
        yield name


# benchmarks/gpu_check.sh runs the CUDA tests under a time budget: tests not started by this
# time (epoch seconds) are reported as skipped instead of the run being killed midway.
_DEADLINE = float(os.environ.get("PAGED_OPS_TEST_DEADLINE", "inf"))


def pytest_runtest_setup(item):
    if time.time() > _DEADLINE:
        pytest.skip("not started: out of the time budget (PAGED_OPS_TEST_DEADLINE)")


@pytest.fixture(params=DEVICES)
def device(request):
    """Run the test on each device: "cpu" always, "cuda" (marked ``cuda``) where a GPU and the
    CUDA kernels are present, skipped otherwise."""
    return request.param


def pytest_collection_modifyitems(config, items):
    # A CUDA run of a test that also takes cpu_variant needs one CPU kernel build (the others
    # are what the CPU runs of the test cover).
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("device") == "cuda" and params.get("cpu_variant", VARIANTS[0]) != VARIANTS[0]:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
