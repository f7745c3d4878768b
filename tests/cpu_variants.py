"""The CPU attention kernel builds the tests run on: those this CPU supports (paged_ops), plus
``lanes16``, the kernel compiled here with ATen's portable vectors widened to 16 fp32 lanes.

The AVX-512 build runs the kernel's code paths for 16-lane vectors (W = 16: block tiles,
q repeats, lane sums), and a machine without AVX-512 cannot run it. ``lanes16`` runs the same
kernel source with W = 16 on any CPU: ATen's portable ``Vectorized`` (what the default build
uses, 8 lanes) with its width set to 64 bytes, through a copy of ``ATen/cpu/vec/vec_base.h``
edited in a shim include directory. Only the lane operations differ from the AVX-512 build
(ATen's portable loops instead of its AVX-512 intrinsics), so what the kernel itself does with
16 lanes is tested everywhere. Built once per kernel source and torch install into the
temporary directory (reused across runs); where it cannot be built (no C++ compiler, or a
torch whose header no longer matches the edit), its tests skip and say why.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile

import pytest
import torch
from torch.utils import cpp_extension

import paged_ops
from paged_ops import _cpu_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# lanes16_dot: lanes16 with the bf16 pair dot products of the avx512_bf16 build (kDotBF16), done
# by the kernel's portable emulation of vdpbf16ps. Their flags: paged_ops/_cpu_build.py.
LANES16 = _cpu_build.EMULATED
VARIANTS = paged_ops.supported_cpu_kernel_variants() + list(LANES16)

_WIDTH_32 = """#define __at_align__ __attribute__((aligned(32)))
#elif defined(_WIN32)
#define __at_align__ __declspec(align(32))
#else
#define __at_align__
#endif
#define VECTOR_WIDTH 32"""

# Each emulated build's f32 unit, with a check that the shim widened the vectors.
_CHECKED_UNIT = """#include "cpu/builds/cache_f32.cpp"
static_assert(paged::cpu::W == 16, "the edited vec_base.h did not widen Vectorized<float>");
"""

_libs = []  # loaded libraries stay alive while their table may be in use


def _flags(shim, name):
    includes = [f"-I{p}" for p in [shim, *cpp_extension.include_paths()]]
    libdirs = [f"-L{p}" for p in cpp_extension.library_paths()]
    # CPU_CAPABILITY names ATen's inline vector namespace: LANES16 keeps these instantiations
    # apart from the 8-lane DEFAULT ones in _C and libtorch. No CPU_CAPABILITY_<X> macro: the
    # portable paths, as in the default build.
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)  # as torch was built (c10 symbols are used)
    cflags = [*_cpu_build.COMMON_CFLAGS, "-O1", *LANES16[name], "-DCPU_CAPABILITY=LANES16",
              f"-DPAGED_OPS_BUILD_NAME={name}", "-DPAGED_OPS_VARIANT_LIBRARY=1",
              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
    ldflags = [*libdirs, "-lc10", "-ltorch_cpu",
               *[f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]]
    return cflags, ldflags


def _source_digest():
    """A sha256 of what the emulated builds compile: the kernel's sources, the build command
    (this file and the flags) and the torch install."""
    digest = hashlib.sha256(torch.__version__.encode() + sysconfig.get_paths()["include"].encode())
    for path in (__file__, _cpu_build.__file__):
        with open(path, "rb") as fh:
            digest.update(fh.read())
    for dirpath, dirs, files in os.walk(CSRC):
        dirs[:] = sorted(d for d in dirs if d != "cuda")
        for f in sorted(files):
            if f.endswith((".h", ".cpp")):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    digest.update(os.path.relpath(os.path.join(dirpath, f), CSRC).encode()
                                  + fh.read())
    return digest.hexdigest()[:16]


@functools.cache
def _build_all():
    """{name: (path, None) | (None, why it cannot be built here) | (None, RuntimeError) when
    the kernel does not compile with 16 lanes: a bug, not a skip}. The emulated builds are
    built together, each unit in parallel, once per source digest (reused across runs)."""
    if shutil.which("g++") is None:
        return {n: (None, "no g++ to build the lanes16 kernel") for n in LANES16}
    vec_base = os.path.join(cpp_extension.include_paths()[0], "ATen", "cpu", "vec", "vec_base.h")
    with open(vec_base) as fh:
        text = fh.read()
    if text.count(_WIDTH_32) != 1:
        why = f"{vec_base} no longer has the 32-byte width block the lanes16 build edits"
        return {n: (None, why) for n in LANES16}
    out = os.path.join(tempfile.gettempdir(), f"paged_ops_lanes16_{os.getuid()}",
                       _source_digest())

    def build(name):
        so = os.path.join(out, f"kernel_{name}.so")
        if os.path.exists(so):
            return so, None
        tmp = so + f".{os.getpid()}.tmp"
        try:
            _cpu_build.compile_library(CSRC, tmp, *_flags(shim, name), sources=sources)
        except subprocess.CalledProcessError as e:
            return None, RuntimeError(f"building the {name} kernel failed:\n{e.stderr[-4000:]}")
        os.replace(tmp, so)
        return so, None

    # One build at a time, its units in parallel: the three together would oversubscribe. The
    # test processes of one run (pytest-xdist) wait for the first one's builds.
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shim = os.path.join(out, "shim")
        os.makedirs(os.path.join(shim, "ATen", "cpu", "vec"), exist_ok=True)
        with open(os.path.join(shim, "ATen", "cpu", "vec", "vec_base.h"), "w") as fh:
            fh.write(text.replace(_WIDTH_32, _WIDTH_32.replace("32", "64")))
        checked = os.path.join(out, "cache_f32_checked.cpp")
        with open(checked, "w") as fh:
            fh.write(_CHECKED_UNIT)
        sources = [checked if s.endswith("cache_f32.cpp") else s for s in _cpu_build.SOURCES]
        return {name: build(name) for name in LANES16}


def _lanes16_library(name):
    return _build_all()[name]


def _set(name):
    if name not in LANES16:
        paged_ops.set_cpu_kernel_variant(name)
        return
    so, why = _lanes16_library(name)
    if isinstance(why, Exception):
        raise why
    if so is None:
        pytest.skip(why)
    lib = ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
    assert paged_ops._C_LIB.paged_ops_set_cpu_kernel_table(lib.paged_ops_cpu_kernel_table()) == 0
    _libs.append(lib)
    assert paged_ops.cpu_kernel_variant() == name


def table(name):
    """The kernel table (a pointer) of build ``name`` (one of VARIANTS), for tuned plans that
    name it or ask what it takes (paged_ops/_plans.py)."""
    if name not in LANES16:
        return paged_ops._table_pointer(name)
    so, why = _lanes16_library(name)
    if so is None:
        pytest.skip(str(why))
    lib = ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
    _libs.append(lib)
    return lib.paged_ops_cpu_kernel_table()


@contextlib.contextmanager
def use(name):
    """Runs the body with the CPU attention kernel `name` (one of VARIANTS), then restores the
    kernel that was in use."""
    before = paged_ops._selection  # the builds in use (by block size)
    _set(name)
    try:
        yield name
    finally:
        paged_ops._set_selection(before)
