"""The CPU attention kernel builds the tests run on: those this CPU supports (paged_ops), plus
``lanes16``, the kernel compiled here with ATen's portable vectors widened to 16 fp32 lanes.

The AVX-512 build runs the kernel's code paths for 16-lane vectors (W = 16: block tiles,
q repeats, lane sums), and a machine without AVX-512 cannot run it. ``lanes16`` runs the same
kernel source with W = 16 on any CPU: ATen's portable ``Vectorized`` (what the default build
uses, 8 lanes) with its width set to 64 bytes, through a copy of ``ATen/cpu/vec/vec_base.h``
edited in a shim include directory. Only the lane operations differ from the AVX-512 build
(ATen's portable loops instead of its AVX-512 intrinsics), so what the kernel itself does with
16 lanes is tested everywhere. Built once per kernel source and torch install (about 15 s) into
the temporary directory; where it cannot be built (no C++ compiler, or a torch whose header no
longer matches the edit), its tests skip and say why.
"""

from __future__ import annotations

import contextlib
import ctypes
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

_SOURCE = """#define CPU_CAPABILITY_NAME "{name}"
#include "cpu/attention_kernel.h"
static_assert(paged::cpu::W == 16, "the edited vec_base.h did not widen Vectorized<float>");
extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_kernel_table() {{ return paged::cpu::kernel_table(); }}
"""

_libs = []  # loaded libraries stay alive while their table may be in use


def _command(shim, src, so, name):
    includes = [f"-I{p}" for p in [shim, CSRC, *cpp_extension.include_paths()]]
    libdirs = [f"-L{p}" for p in cpp_extension.library_paths()]
    # CPU_CAPABILITY names ATen's inline vector namespace: LANES16 keeps these instantiations
    # apart from the 8-lane DEFAULT ones in _C and libtorch. No CPU_CAPABILITY_<X> macro: the
    # portable paths, as in the default build.
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)  # as torch was built (c10 symbols are used)
    return ["g++", *_cpu_build.COMMON_CFLAGS, "-O1", *LANES16[name],
            "-DCPU_CAPABILITY=LANES16", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, src,
            "-o", so, *libdirs, "-lc10",
            "-ltorch_cpu", *[f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]]


@functools.cache
def _lanes16_library(name):
    """(path of the lanes16 kernel library `name`, None), (None, why it cannot be built here) or
    (None, RuntimeError) when the kernel does not compile with 16 lanes: a bug, not a skip.
    Cached, failure included, so a failed build is not retried by every test."""
    if shutil.which("g++") is None:
        return None, "no g++ to build the lanes16 kernel"
    vec_base = os.path.join(cpp_extension.include_paths()[0], "ATen", "cpu", "vec", "vec_base.h")
    with open(vec_base) as fh:
        text = fh.read()
    if text.count(_WIDTH_32) != 1:
        return None, f"{vec_base} no longer has the 32-byte width block the lanes16 build edits"
    digest = hashlib.sha256(text.encode() + name.encode())
    digest.update(torch.__version__.encode() + sysconfig.get_paths()["include"].encode())
    # The build command and source (this file and the flags): a change to them must not reuse
    # a stale build.
    for path in (__file__, _cpu_build.__file__):
        with open(path, "rb") as fh:
            digest.update(fh.read())
    for folder in (CSRC, os.path.join(CSRC, "cpu")):
        for header in sorted(os.listdir(folder)):
            if header.endswith(".h"):
                with open(os.path.join(folder, header), "rb") as fh:
                    digest.update(header.encode() + fh.read())
    out = os.path.join(tempfile.gettempdir(), f"paged_ops_lanes16_{os.getuid()}",
                       digest.hexdigest()[:16])
    so = os.path.join(out, f"kernel_{name}.so")
    if os.path.exists(so):
        return so, None
    shim = os.path.join(out, "shim")
    os.makedirs(os.path.join(shim, "ATen", "cpu", "vec"), exist_ok=True)
    with open(os.path.join(shim, "ATen", "cpu", "vec", "vec_base.h"), "w") as fh:
        fh.write(text.replace(_WIDTH_32, _WIDTH_32.replace("32", "64")))
    src = os.path.join(out, f"{name}.cpp")
    with open(src, "w") as fh:
        fh.write(_SOURCE.format(name=name))
    tmp = so + f".{os.getpid()}.tmp"
    res = subprocess.run(_command(shim, src, tmp, name), capture_output=True, text=True)
    if res.returncode != 0:
        return None, RuntimeError(f"building the {name} kernel failed:\n{res.stderr[-4000:]}")
    os.replace(tmp, so)
    return so, None


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
