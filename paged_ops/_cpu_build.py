"""How each CPU kernel build is compiled and which ones a CPU runs: one table for setup.py, the
package's selection at import (paged_ops/__init__.py), the emulated test builds
(tests/cpu_variants.py) and the benchmarks that build kernels of other revisions
(benchmarks/ab_kernels.py, benchmarks/kernel_phases.py). Standard library only: setup.py
loads this file by path, before the package can be imported.

A build is the attention kernel compiled with one instruction set: its table
(csrc/cpu/builds/table.cpp) and one translation unit per cache dtype
(csrc/cpu/builds/cache_<dtype>.cpp), which compile in parallel.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
# What the kernel takes from a build beyond its ISA flags (csrc/cpu/attention/tuning.h):
# bf16 pair dot products (vdpbf16ps), fp8 keys decoded by byte tables (vpermi2b), AMX tiles.
_DOT = ["-DPAGED_OPS_DOT_BF16=1", "-DPAGED_OPS_FP8_TABLES=1"]

# name: (compiler flags, ATen's capability: which of its vector implementations the build
# uses, the cpuinfo flags a CPU needs beyond that capability to run it)
VARIANTS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], "AVX2", ()),
    "avx512": (_AVX512, "AVX512", ()),
    # Every CPU with AVX512-BF16 has AVX512-VBMI but Cooper Lake, which runs avx512.
    "avx512_bf16": (_AVX512 + ["-mavx512bf16", "-mavx512vbmi"] + _DOT, "AVX512",
                    ("avx512_bf16", "avx512_vbmi")),
    "avx512_amx": (_AVX512 + ["-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16"] + _DOT
                   + ["-DPAGED_OPS_AMX=1"], "AVX512",
                   ("avx512_bf16", "avx512_vbmi", "amx_tile", "amx_bf16")),
}

# The cache dtypes, one translation unit each (csrc/cpu/builds/cache_<name>.cpp).
CACHE_DTYPES = ("f32", "f16", "bf16", "e4m3", "e5m2")
# A build's sources, relative to csrc/.
SOURCES = ["cpu/builds/table.cpp"] + [f"cpu/builds/cache_{d}.cpp" for d in CACHE_DTYPES]

# Flags every kernel build outside setup.py shares (setup.py adds its own on top of torch's).
COMMON_CFLAGS = ["-std=c++20", "-fPIC", "-fopenmp", "-fvisibility=hidden"]

# The emulated 16-lane builds of the tests (tests/cpu_variants.py): ATen's portable vectors
# widened to 16 lanes, no ISA flags; lanes16_dot adds the avx512_bf16 build's bf16 dot products
# through the kernel's portable emulation of vdpbf16ps, lanes16_amx the avx512_amx build's tile
# operations through their portable emulation (csrc/cpu/amx_tiles.h).
EMULATED = {"lanes16": [],
            "lanes16_dot": list(_DOT),
            "lanes16_amx": _DOT + ["-DPAGED_OPS_AMX=1"]}


def runnable(name: str, aten_capability: str, cpu_flags: dict) -> bool:
    """Whether a CPU runs build `name`: ATen's detected capability ("AVX512", "AVX2", ...) and
    its cpuinfo flags (torch._C._cpu._get_cpu_capability(); empty from an older torch, which
    then runs the builds of the capability alone)."""
    if name == "default":
        return True
    _, cap, needs = VARIANTS[name]
    order = ["DEFAULT", "AVX2", "AVX512"]
    have = aten_capability.upper()
    if have not in order or order.index(have) < order.index(cap):
        return False
    return all(cpu_flags.get(f, False) for f in needs) if cpu_flags else not needs


def runnable_here(name: str) -> bool:
    """runnable() for this CPU, as the installed torch detects it (imported here: setup.py
    loads this file before the package exists, but with torch installed)."""
    import torch

    get = getattr(torch._C._cpu, "_get_cpu_capability", None)  # absent from an older torch
    return runnable(name, torch.backends.cpu.get_cpu_capability(), get() if get else {})


def isa_flags(name: str) -> list[str]:
    """The build's instruction-set flags, without its -D switches."""
    return [f for f in VARIANTS[name][0] if not f.startswith("-D")]


def variant_defines(name: str) -> list[tuple[str, str | None]]:
    """The macros of the build: ATen's CPU_CAPABILITY and its CPU_CAPABILITY_<X> flag, and the
    name its kernel table reports."""
    cap = VARIANTS[name][1]
    return [("CPU_CAPABILITY", cap), (f"CPU_CAPABILITY_{cap}", None),
            ("PAGED_OPS_BUILD_NAME", name), ("PAGED_OPS_VARIANT_LIBRARY", "1")]


def variant_cflags(name: str) -> list[str]:
    """Compiler flags of the build: the ISA flags and its macros as -D options."""
    return VARIANTS[name][0] + [f"-D{k}" if v is None else f"-D{k}={v}"
                                for k, v in variant_defines(name)]


def compile_library(tree: str, so: str, cflags: list[str], ldflags: list[str],
                    jobs: int | None = None, cxx: str = "g++",
                    sources: list[str] | None = None) -> None:
    """Builds the kernel library of the csrc tree `tree` into `so`: each source (SOURCES, or
    `sources`: paths relative to `tree` or absolute) to an object, `jobs` at a time, then one
    link. Raises CalledProcessError, its stderr holding the compiler's output, on failure."""
    sources = [os.path.join(tree, s) for s in sources or SOURCES]
    objs = [f"{so}.{i}.o" for i in range(len(sources))]

    def compile_one(i):
        subprocess.run([cxx, *cflags, f"-I{tree}", "-c", sources[i], "-o", objs[i]],
                       check=True, capture_output=True, text=True)

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as ex:
        list(ex.map(compile_one, range(len(sources))))
    subprocess.run([cxx, "-shared", *cflags, *objs, "-o", so, *ldflags], check=True,
                   capture_output=True, text=True)
    for o in objs:
        os.remove(o)


def compiler_accepts(name: str, cxx: str | None = None) -> bool:
    """Whether the C++ compiler takes the build's ISA flags (older compilers lack -mamx-tile):
    setup.py leaves a build out rather than failing the install."""
    cxx = cxx or os.environ.get("CXX", "c++")
    try:
        res = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", *isa_flags(name), "-"],
                             input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0
