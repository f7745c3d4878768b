"""Fixtures shared by the test files."""

import os
import time

import pytest
from cpu_variants import VARIANTS, use


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
