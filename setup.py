"""Build of paged_ops: one extension ``paged_ops._C`` (schemas, CPU kernels, CUDA kernels when
enabled) plus CPU-capability builds of the attention kernel (``_cpu_avx2``, ``_cpu_avx512``,
``_cpu_avx512_bf16``, ``_cpu_avx512_amx``).

Switches (environment):
  PAGED_OPS_BUILD_CUDA=auto|0|1   auto: CUDA kernels when torch is a CUDA build, nvcc exists
                                  and a GPU is visible; 1: whenever torch and nvcc allow.
  TORCH_CUDA_ARCH_LIST            GPU architectures; without a visible GPU we default to 8.0;9.0.
  MAX_JOBS                        parallel compile jobs (ninja).
  PAGED_OPS_CPU_VARIANTS=all|native|none
                                  all (default): every capability build the compiler takes;
                                  native: those this CPU runs; none: the portable kernel of _C
                                  only (a quick build check).
"""

import glob
import importlib.util
import os
import platform

import torch
from setuptools import setup
from torch.utils import cpp_extension as ce

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_STD = "-std=c++20"  # torch >= 2.14 headers need C++20 (2.11 - 2.13 take it too)


def _want_cuda() -> bool:
    mode = os.environ.get("PAGED_OPS_BUILD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"PAGED_OPS_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False
    has_cuda_torch = torch.version.cuda is not None
    has_nvcc = ce.CUDA_HOME is not None and os.path.exists(
        os.path.join(ce.CUDA_HOME, "bin", "nvcc")
    )
    if mode == "1":
        if not (has_cuda_torch and has_nvcc):
            raise SystemExit(
                "PAGED_OPS_BUILD_CUDA=1 but "
                + ("torch is not a CUDA build" if not has_cuda_torch else "nvcc was not found")
                + " (set CUDA_HOME)"
            )
        return True
    # auto: only where the kernels can run here (a GPU is visible); CI asks with 1.
    return has_cuda_torch and has_nvcc and torch.cuda.is_available()


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _load_cpu_build():
    # The builds' flags are shared with the package, the tests and the benchmarks; loaded by
    # path: the package cannot be imported before it is built.
    spec = importlib.util.spec_from_file_location(
        "_cpu_build", os.path.join(ROOT, "paged_ops", "_cpu_build.py"))
    cpu_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_build)
    return cpu_build


def _wanted_variants(cpu_build) -> list[str]:
    mode = os.environ.get("PAGED_OPS_CPU_VARIANTS", "all").strip().lower()
    mode = {"1": "all", "0": "none"}.get(mode, mode)
    if mode not in ("all", "native", "none"):
        raise SystemExit(f"PAGED_OPS_CPU_VARIANTS must be all, native or none, got {mode!r}")
    if mode == "none" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    names = list(cpu_build.VARIANTS)
    if mode == "native":
        names = [n for n in names if cpu_build.runnable_here(n)]
    return names


class _BuildExtension(ce.BuildExtension.with_options(use_ninja=True)):
    """Each extension in its own object folder (the capability builds compile the same sources
    with other flags), with a line saying which one is being built."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        print(f"paged_ops: building {ext.name} ({len(ext.sources)} units)", flush=True)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


def extensions():
    cuda_dir = os.path.join(ROOT, "csrc", "cuda")
    has_cuda_sources = bool(glob.glob(os.path.join(cuda_dir, "*.cu")))
    # Until csrc/cuda/ holds kernels, every mode builds the CPU backend only.
    with_cuda = _want_cuda() and has_cuda_sources
    # -fopenmp: at::parallel_for is an inline OpenMP loop in torch's headers; without the flag
    # it silently runs on one thread.
    # -g0: Python's CFLAGS ask for -g, and debug info is a large part of the kernel units'
    # compile time.
    cxx = [CXX_STD, "-O3", "-g0", "-fvisibility=hidden", "-fopenmp"]
    link = ["-fopenmp"]
    cpu_build = _load_cpu_build()
    # The CPU kernels of _C are the portable (DEFAULT) build; see csrc/cpu/kernels.h.
    define = [("CPU_CAPABILITY", "DEFAULT"), ("CPU_CAPABILITY_DEFAULT", None),
              ("PAGED_OPS_BUILD_NAME", "default")]
    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    sources += ["csrc/" + s for s in cpu_build.SOURCES]
    exts = []
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        cu_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
        cu_sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        # No --use_fast_math: it turns tanhf (the logit soft cap) into tanh.approx.f32, whose
        # ~1e-5 relative error breaks fp32 agreement with the reference, and `/` into an
        # approximation. The hot loops call __expf where the approximation is meant; the divisions
        # and tanhf left are once per output row or per soft-capped logit.
        nvcc = [CXX_STD, "-O3", "-lineinfo", "--expt-relaxed-constexpr"]
        exts.append(
            ce.CUDAExtension(
                "paged_ops._C",
                sources + cu_sources,
                define_macros=define + [("PAGED_OPS_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                extra_link_args=link,
                include_dirs=[os.path.join(ROOT, "csrc")],
            )
        )
    else:
        exts.append(
            ce.CppExtension(
                "paged_ops._C",
                sources,
                define_macros=define,
                extra_compile_args={"cxx": cxx},
                extra_link_args=link,
                include_dirs=[os.path.join(ROOT, "csrc")],
            )
        )
    # Capability builds: separate shared objects, so that no AVX-512 code (including inline
    # functions from torch headers instantiated under those flags) can leak into code that runs
    # on a CPU without it. paged_ops/__init__.py picks one at import (docs/cpu_kernel_selection.md).
    for name in _wanted_variants(cpu_build):
        if not cpu_build.compiler_accepts(name):
            flags = " ".join(cpu_build.isa_flags(name))
            print(f"paged_ops: the compiler does not take {flags}; "
                  f"the {name} CPU kernel build is left out")
            continue
        exts.append(
            ce.CppExtension(
                f"paged_ops._cpu_{name}",
                ["csrc/" + s for s in cpu_build.SOURCES],
                define_macros=cpu_build.variant_defines(name),
                extra_compile_args={"cxx": cxx + cpu_build.VARIANTS[name][0]},
                extra_link_args=link,
                include_dirs=[os.path.join(ROOT, "csrc")],
            )
        )
    return exts


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": _BuildExtension},
)
