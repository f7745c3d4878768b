"""paged_ops: paged KV-cache attention operators for PyTorch.

Importing this package loads the compiled extension, which registers the ``torch.ops.paged``
ops (see DESIGN.md §3) on CPU and, when built with CUDA, on CUDA; their fake implementations
(for torch.compile) come from :mod:`paged_ops._fake`.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

from . import _C  # noqa: F401  (registers torch.ops.paged.*)
from . import _fake  # noqa: F401  (fake impls for torch.compile)
from ._api import (
    allocate_kv_cache,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)

__all__ = [
    "allocate_kv_cache",
    "built_with_cuda",
    "copy_blocks",
    "cpu_kernel_variant",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_C_LIB = ctypes.CDLL(_C.__file__)  # the already-loaded extension, for its C entry points
_C_LIB.paged_ops_cpu_kernel_name.restype = ctypes.c_char_p
_C_LIB.paged_ops_set_cpu_kernel_table.argtypes = [ctypes.c_void_p]
_variant_libs = []  # keep loaded variant libraries alive


def built_with_cuda() -> bool:
    """Whether the CUDA kernels were compiled into this build (a CUDA impl is registered)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("paged::attention", "CUDA")


def cpu_kernel_variant() -> str:
    """The CPU attention kernel in use: ``"avx512"``, ``"avx2"`` or ``"default"``."""
    return _C_LIB.paged_ops_cpu_kernel_name().decode()


def _select_cpu_kernels() -> None:
    # ATen's own CPU capability detection (it honours ATEN_CPU_CAPABILITY), optionally capped
    # by PAGED_OPS_CPU_CAPABILITY=default|avx2|avx512.
    cap = torch.backends.cpu.get_cpu_capability().upper()
    order = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(cap, [])
    cap_env = os.environ.get("PAGED_OPS_CPU_CAPABILITY", "").strip().lower()
    if cap_env:
        if cap_env not in ("default", "avx2", "avx512"):
            raise ValueError(
                f"PAGED_OPS_CPU_CAPABILITY must be default, avx2 or avx512, got {cap_env!r}"
            )
        order = order[order.index(cap_env):] if cap_env in order else []
    for name in order:
        paths = glob.glob(os.path.join(_HERE, f"_cpu_{name}*.so"))
        if not paths:
            continue
        lib = ctypes.CDLL(paths[0], mode=os.RTLD_NOW | os.RTLD_LOCAL)
        lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
        if _C_LIB.paged_ops_set_cpu_kernel_table(lib.paged_ops_cpu_kernel_table()) == 0:
            _variant_libs.append(lib)
            return


_select_cpu_kernels()
