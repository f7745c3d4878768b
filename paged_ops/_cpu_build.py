"""How each CPU kernel build is compiled: one table for setup.py, the lanes16 test builds
(tests/cpu_variants.py) and the benchmarks that build kernels of other revisions
(benchmarks/ab_kernels.py, benchmarks/kernel_phases.py). Standard library only: setup.py
loads this file by path, before the package can be imported."""

from __future__ import annotations

import os
import subprocess

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]

# name: (compiler flags, ATen's capability: which of its vector implementations the build uses)
VARIANTS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], "AVX2"),
    "avx512": (_AVX512, "AVX512"),
    "avx512_bf16": (_AVX512 + ["-mavx512bf16", "-mavx512vbmi"], "AVX512"),
    "avx512_amx": (_AVX512 + ["-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16"],
                   "AVX512"),
}


# Flags every kernel build outside setup.py shares (setup.py adds its own on top of torch's).
COMMON_CFLAGS = ["-std=c++20", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden"]

# The emulated 16-lane builds of the tests (tests/cpu_variants.py): ATen's portable vectors
# widened to 16 lanes, no ISA flags; lanes16_dot adds the avx512_bf16 build's bf16 dot products
# through the kernel's portable emulation of vdpbf16ps, lanes16_amx the avx512_amx build's tile
# operations through their portable emulation (csrc/cpu/amx_tiles.h).
EMULATED = {"lanes16": [],
            "lanes16_dot": ["-DPAGED_OPS_DOT_BF16=1", "-DPAGED_OPS_FP8_TABLES=1"],
            "lanes16_amx": ["-DPAGED_OPS_DOT_BF16=1", "-DPAGED_OPS_FP8_TABLES=1",
                            "-DPAGED_OPS_AMX=1"]}


def variant_source(name: str) -> str:
    """The build's source file, relative to csrc/."""
    return f"cpu/variant_{name}.cpp"


def variant_defines(name: str) -> list[tuple[str, str | None]]:
    """The macros of the build (ATen's CPU_CAPABILITY and its CPU_CAPABILITY_<X> flag)."""
    cap = VARIANTS[name][1]
    return [("CPU_CAPABILITY", cap), (f"CPU_CAPABILITY_{cap}", None)]


def variant_cflags(name: str) -> list[str]:
    """Compiler flags of the build: the ISA flags and its macros as -D options."""
    return VARIANTS[name][0] + [f"-D{k}" if v is None else f"-D{k}={v}"
                                for k, v in variant_defines(name)]


def compiler_accepts(name: str, cxx: str | None = None) -> bool:
    """Whether the C++ compiler takes the build's ISA flags (older compilers lack -mamx-tile):
    setup.py leaves a build out rather than failing the install."""
    cxx = cxx or os.environ.get("CXX", "c++")
    try:
        res = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", *VARIANTS[name][0], "-"],
                             input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0
