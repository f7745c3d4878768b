"""Fixtures shared by the test files."""

import pytest
from cpu_variants import VARIANTS, use


@pytest.fixture(params=VARIANTS)
def cpu_variant(request):
    """Run the test on each CPU attention kernel build: those this CPU supports (e.g. avx2,
    default) and lanes16, the kernel's 16-lane paths (what AVX-512 runs), see cpu_variants.py."""
    with use(request.param) as name:
        yield name
