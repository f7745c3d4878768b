"""paged_ops: paged KV-cache attention operators for PyTorch.

Importing this package loads the compiled extension, which registers the ``torch.ops.paged``
ops (docs/design.md, section 3) on CPU and, when built with CUDA, on CUDA; their fake
implementations (for torch.compile) come from :mod:`paged_ops._fake`. It also selects the
fastest CPU attention kernel build this CPU can run (docs/cpu_kernel.md).
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

from . import (
    _C,  # noqa: F401  (registers torch.ops.paged.*)
    _fake,  # noqa: F401  (fake impls for torch.compile)
)
from ._api import (
    allocate_kv_cache,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)
from .block_manager import BlockManager, BlockManagerStats, OutOfBlocks

__all__ = [
    "BlockManager",
    "BlockManagerStats",
    "OutOfBlocks",
    "allocate_kv_cache",
    "built_with_cuda",
    "copy_blocks",
    "cpu_kernel_variant",
    "set_cpu_kernel_variant",
    "supported_cpu_kernel_variants",
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


_VARIANT_NAMES = ("default", "avx2", "avx512", "avx512_bf16", "avx512_amx")  # in order of instruction sets

# The builds an AVX-512 CPU can run, fastest first as measured on one (docs/cpu_kernel_selection.md:
# a Sapphire Rapids Xeon, every cache dtype and block size 8-256, interleaved A/B): the AVX2 build
# is selected there until an AVX-512 build measures faster.
_AVX512_PREFERENCE = ["avx2", "avx512_bf16", "avx512", "avx512_amx"]


def cpu_kernel_variant() -> str:
    """The CPU attention kernel in use: ``"avx512_amx"``, ``"avx512_bf16"``, ``"avx512"``,
    ``"avx2"`` or ``"default"``."""
    return _C_LIB.paged_ops_cpu_kernel_name().decode()


def _variant_library(name: str) -> str | None:
    # "_cpu_avx512.<abi tag>.so", not "_cpu_avx512_bf16...": the name ends at the first dot.
    found = glob.glob(os.path.join(_HERE, f"_cpu_{name}.*so"))
    return found[0] if found else None


def _cpu_has(*features: str) -> bool:
    # ATen's cpuinfo flags; an older torch without them reports none (the avx512 build runs).
    get = getattr(torch._C._cpu, "_get_cpu_capability", None)
    flags = get() if get is not None else {}
    return all(flags.get(f, False) for f in features)


def supported_cpu_kernel_variants() -> list[str]:
    """CPU kernel variants this CPU can run (per ATen's capability detection, which honours
    ``ATEN_CPU_CAPABILITY``) and that were built, the fastest measured first (the one selected
    at import); ``"default"`` is always last."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    order = {"AVX512": list(_AVX512_PREFERENCE), "AVX2": ["avx2"]}.get(cap, [])
    if not _cpu_has("avx512_bf16"):
        order = [n for n in order if n not in ("avx512_bf16", "avx512_amx")]
    if not _cpu_has("amx_tile", "amx_bf16"):
        order = [n for n in order if n != "avx512_amx"]
    built = [n for n in order if _variant_library(n)]
    return built + ["default"]


def set_cpu_kernel_variant(name: str) -> None:
    """Switch the CPU attention kernel to ``name`` (one of :func:`supported_cpu_kernel_variants`).

    Meant for tests and benchmarks; at import the fastest supported variant is chosen, or the
    one the environment variable ``PAGED_OPS_CPU_CAPABILITY=default|avx2|avx512|avx512_bf16``
    names when set (a cap: where the CPU or the build lacks it, the highest supported instruction
    set below it).
    """
    if name not in supported_cpu_kernel_variants():
        raise ValueError(f"CPU kernel variant {name!r} is not available here; "
                         f"supported: {supported_cpu_kernel_variants()}")
    if name == "default":
        _C_LIB.paged_ops_set_cpu_kernel_table(None)
        return
    path = _variant_library(name)
    lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
    if _C_LIB.paged_ops_set_cpu_kernel_table(lib.paged_ops_cpu_kernel_table()) != 0:
        raise RuntimeError(f"{path} is from an incompatible build; rebuild paged_ops")
    _variant_libs.append(lib)


def _select_cpu_kernels() -> None:
    variants = supported_cpu_kernel_variants()
    cap_env = os.environ.get("PAGED_OPS_CPU_CAPABILITY", "").strip().lower()
    if cap_env:
        if cap_env not in _VARIANT_NAMES:
            raise ValueError("PAGED_OPS_CPU_CAPABILITY must be one of "
                             f"{', '.join(_VARIANT_NAMES)}, got {cap_env!r}")
        # A cap: the highest supported instruction set at or below it.
        cap = _VARIANT_NAMES.index(cap_env)
        variants = sorted((v for v in variants if _VARIANT_NAMES.index(v) <= cap),
                          key=_VARIANT_NAMES.index, reverse=True)
    set_cpu_kernel_variant(variants[0])


_select_cpu_kernels()
