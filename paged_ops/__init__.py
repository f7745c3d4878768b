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
    _cpu_build,
    _fake,  # noqa: F401  (fake impls for torch.compile)
    _plans,
)
from ._api import (
    advise_huge_pages,
    allocate_kv_cache,
    copy_blocks,
    merge_attention_states,
    paged_attention,
    paged_attention_with_lse,
    reshape_and_cache,
    swap_blocks,
)
from .block_manager import BlockManager, BlockManagerStats, OutOfBlocks

__all__ = [
    "BlockManager",
    "BlockManagerStats",
    "OutOfBlocks",
    "advise_huge_pages",
    "allocate_kv_cache",
    "built_with_cuda",
    "copy_blocks",
    "cpu_kernel_variant",
    "cpu_plan",
    "merge_attention_states",
    "plan_cache_path",
    "set_cpu_kernel_variant",
    "supported_cpu_kernel_variants",
    "paged_attention",
    "paged_attention_with_lse",
    "reshape_and_cache",
    "swap_blocks",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_C_LIB = ctypes.CDLL(_C.__file__)  # the already-loaded extension, for its C entry points
_C_LIB.paged_ops_cpu_kernel_name.restype = ctypes.c_char_p
_C_LIB.paged_ops_cpu_kernel_name.argtypes = [ctypes.c_int64, ctypes.c_int32]
_C_LIB.paged_ops_set_cpu_kernel_table.argtypes = [ctypes.c_void_p]
_C_LIB.paged_ops_set_cpu_cell_kernel_table.argtypes = [ctypes.c_void_p, ctypes.c_int64,
                                                       ctypes.c_int32]
_plans.setup_library(_C_LIB)
# The kernels' codes of the cache dtypes (DType, csrc/dtype.h).
_CACHE_DTYPE_CODES = _plans.DTYPE_CODES
_MAX_CELL_BLOCK_SIZE = 256  # the largest block size a build is chosen for (kMaxCellBlockSize)
_variant_libs = {}  # name -> loaded variant library (kept alive, loaded once)


def built_with_cuda() -> bool:
    """Whether the CUDA kernels were compiled into this build (a CUDA impl is registered)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("paged::attention", "CUDA")


# In order of instruction sets.
_VARIANT_NAMES = ("default", "avx2", "avx512", "avx512_bf16", "avx512_amx")

# The builds, fastest first where a CPU runs several (docs/cpu_kernel_selection.md: every
# cache dtype and block size 1-256 on an AVX-512 Xeon, interleaved A/B); the AMX build is no
# faster than avx512_bf16 on caches read from memory, so it runs only when asked for.
_PREFERENCE = ["avx512_bf16", "avx512", "avx2", "avx512_amx"]
# Selected build -> {other build: {cache dtype: the block sizes it runs instead}}: the cells
# where the other build measured faster on all three shapes in two runs
# (docs/cpu_kernel_selection.md).
_OVERRIDES = {
    "avx512_bf16": {
        "avx2": {torch.float32: (1, 2, 4), torch.float16: (24,), torch.bfloat16: (24, 40)},
        "avx512": {torch.float16: (5,), torch.bfloat16: (3, 4, 5, 256),
                   torch.float8_e5m2: (1, 2, 4)},
    },
    "avx512": {
        "avx2": {torch.float32: (1, 4), torch.float16: (24,), torch.bfloat16: (24,),
                 torch.float8_e5m2: (24,)},
    },
}
_selection: tuple = ("default", {})  # set_cpu_kernel_variant's arguments, for restoring


def cpu_kernel_variant(block_size: int | None = None,
                       cache_dtype: torch.dtype = torch.bfloat16) -> str:
    """The CPU attention kernel build that runs calls of ``block_size`` (by default: of large
    block sizes) with a cache of ``cache_dtype``: ``"avx512_amx"``, ``"avx512_bf16"``,
    ``"avx512"``, ``"avx2"`` or ``"default"``. On an AVX-512 CPU two builds share the work, by
    block size and cache dtype."""
    if cache_dtype not in _CACHE_DTYPE_CODES:
        raise ValueError(f"cache_dtype must be one of {list(_CACHE_DTYPE_CODES)}, "
                         f"got {cache_dtype}")
    return _C_LIB.paged_ops_cpu_kernel_name(block_size or 0,
                                            _CACHE_DTYPE_CODES[cache_dtype]).decode()


def _variant_library(name: str) -> str | None:
    # "_cpu_avx512.<abi tag>.so", not "_cpu_avx512_bf16...": the name ends at the first dot.
    found = glob.glob(os.path.join(_HERE, f"_cpu_{name}.*so"))
    return found[0] if found else None


def supported_cpu_kernel_variants() -> list[str]:
    """CPU kernel variants this CPU can run (per ATen's capability detection, which honours
    ``ATEN_CPU_CAPABILITY``) and that were built, the fastest measured first (the one selected
    at import); ``"default"`` is always last."""
    built = [n for n in _PREFERENCE if _cpu_build.runnable_here(n) and _variant_library(n)]
    return built + ["default"]


def _kernel_table(name: str):
    """The kernel table of build ``name`` (None: the built-in default one)."""
    if name not in supported_cpu_kernel_variants():
        raise ValueError(f"CPU kernel variant {name!r} is not available here; "
                         f"supported: {supported_cpu_kernel_variants()}")
    if name == "default":
        return None
    lib = _variant_libs.get(name)
    if lib is None:
        lib = ctypes.CDLL(_variant_library(name), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        lib.paged_ops_cpu_kernel_table.restype = ctypes.c_void_p
        _variant_libs[name] = lib
    return lib.paged_ops_cpu_kernel_table()


def _normalized_overrides(overrides) -> dict:
    """overrides as {other build: {cache dtype: sorted block sizes}}, checked."""
    out = {}
    for other, cells in (overrides or {}).items():
        if not isinstance(cells, dict):
            raise ValueError(f"overrides[{other!r}] must map cache dtypes to block sizes, "
                             f"got {cells!r}")
        for dtype, sizes in cells.items():
            if dtype not in _CACHE_DTYPE_CODES:
                raise ValueError(f"overrides[{other!r}]: cache dtype must be one of "
                                 f"{list(_CACHE_DTYPE_CODES)}, got {dtype}")
            sizes = tuple(sorted(set(int(b) for b in sizes)))
            if any(b < 1 or b > _MAX_CELL_BLOCK_SIZE for b in sizes):
                raise ValueError(f"overrides[{other!r}][{dtype}]: block sizes must be in "
                                 f"[1, {_MAX_CELL_BLOCK_SIZE}], got {sizes}")
            if sizes:
                out.setdefault(other, {})[dtype] = sizes
    return out


def set_cpu_kernel_variant(name: str, *, overrides: dict | None = None) -> None:
    """Switch the CPU attention kernel to ``name`` (one of :func:`supported_cpu_kernel_variants`)
    for every block size and cache dtype; ``overrides={other: {cache_dtype: block_sizes}}``
    runs build ``other`` instead for calls of those block sizes (1-256) with a cache of that
    dtype.

    Meant for tests and benchmarks; at import the fastest supported builds are chosen, or the
    one the environment variable
    ``PAGED_OPS_CPU_CAPABILITY=default|avx2|avx512|avx512_bf16|avx512_amx`` names when set, for
    every block size (a cap: where the CPU or the build lacks it, the highest supported
    instruction set below it).
    """
    global _selection
    cells = _normalized_overrides(overrides)
    table = _kernel_table(name)
    others = {other: _kernel_table(other) for other in cells}  # ValueError before any switch
    if _C_LIB.paged_ops_set_cpu_kernel_table(table) != 0:
        raise RuntimeError(f"{_variant_library(name)} is from an incompatible build; "
                           "rebuild paged_ops")
    for other, by_dtype in cells.items():
        for dtype, sizes in by_dtype.items():
            for b in sizes:
                if _C_LIB.paged_ops_set_cpu_cell_kernel_table(
                        others[other], b, _CACHE_DTYPE_CODES[dtype]) != 0:
                    _C_LIB.paged_ops_set_cpu_kernel_table(table)  # not half switched
                    raise RuntimeError(f"{_variant_library(other)} is from an incompatible "
                                       "build; rebuild paged_ops")
    _selection = (name, cells)
    _install_plans()


def _set_selection(selection: tuple) -> None:
    """Back to a selection saved from ``_selection`` (tests and benchmarks)."""
    set_cpu_kernel_variant(selection[0], overrides=selection[1])


def _describe_selection(selection: tuple) -> str:
    """A selection in words: "avx512_bf16 (avx2: float32 bs 1-8, float16 bs 24,40)"."""
    name, cells = selection
    parts = []
    for other, by_dtype in cells.items():
        of_other = []
        for dtype, sizes in by_dtype.items():
            runs, start = [], 0
            for i in range(1, len(sizes) + 1):  # consecutive sizes as one range
                if i == len(sizes) or sizes[i] != sizes[i - 1] + 1:
                    lo, hi = sizes[start], sizes[i - 1]
                    runs.append(f"{lo}-{hi}" if hi > lo + 1 else
                                ",".join(str(b) for b in sizes[start:i]))
                    start = i
            of_other.append(f"{str(dtype).removeprefix('torch.')} bs {','.join(runs)}")
        parts.append(f"{other}: {', '.join(of_other)}")
    return f"{name} ({'; '.join(parts)})" if parts else name


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
        return
    overrides = {other: cells for other, cells in _OVERRIDES.get(variants[0], {}).items()
                 if other in variants}
    set_cpu_kernel_variant(variants[0], overrides=overrides)




# --- Tuned plans (paged_ops/_plans.py; python -m paged_ops.tune writes them) ---
# This machine's plans: those of the plan file, then those tuned in this process (each a dict
# of _plans: key, build, knobs, us, source).
_plan_list: list = []
_auto_selection = None  # the import's selection, where no PAGED_OPS_CPU_CAPABILITY caps it
_installed: dict = {}  # key -> the plan installed for it
_autotune_keys: set = set()  # keys PAGED_OPS_AUTOTUNE has reached (tuned or being tuned)


def _table_pointer(name: str):
    """The kernel table of build ``name``, "default" included (for plans)."""
    if name == "default":
        return _C_LIB.paged_ops_cpu_default_kernel_table()
    return _kernel_table(name)


def _install_plans() -> None:
    """Hands the kernel its plans: at the import's selection, per key the fastest plan of a
    build this CPU runs (with that build); after set_cpu_kernel_variant or under
    PAGED_OPS_CPU_CAPABILITY, the plan of the build the selection runs for the key, if tuned
    (that build stays). Keys PAGED_OPS_AUTOTUNE reached without a plan get the rules' own."""
    global _installed
    installed = {}
    if _auto_selection is not None and _selection == _auto_selection:
        for key, p in _plans.best_per_key(_plan_list, supported_cpu_kernel_variants()).items():
            installed[key] = (p, _table_pointer(p["build"]))
    else:
        for p in _plan_list:
            key = p["key"]
            if (key[2] <= _MAX_CELL_BLOCK_SIZE
                    and p["build"] == cpu_kernel_variant(key[2], key[1])
                    and (key not in installed or p["us"] < installed[key][0]["us"])):
                installed[key] = (p, None)
    entries = [(key, table, p["knobs"]) for key, (p, table) in installed.items()]
    entries += [(key, None, None) for key in _autotune_keys if key not in installed]
    _plans.install(_C_LIB, entries)
    _installed = {key: p for key, (p, _) in installed.items()}


def _add_plans(plans: list, drop=()) -> None:
    """Adds plans tuned in this process (they replace those of the same build and key, as do
    the (build, key) pairs of ``drop``) and installs them."""
    global _plan_list
    ids = {(p["build"], p["key"]) for p in plans} | set(drop)
    _plan_list = [p for p in _plan_list if (p["build"], p["key"]) not in ids] + [
        dict(p, source="tuned") for p in plans]
    _install_plans()


def _load_plans() -> None:
    """(Re)reads this machine's plans from the plan file and installs them."""
    global _plan_list
    _plan_list = [dict(p, source="plan file") for p in _plans.load(_C_LIB)]
    _install_plans()


def plan_cache_path() -> str:
    """The plan file the tuner writes and import reads: ``PAGED_OPS_PLAN_CACHE`` when set, else
    ``~/.cache/paged_ops/plans.json``."""
    return _plans.cache_path()


def cpu_plan(dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, head_size: int,
             group: int) -> dict:
    """The plan a CPU attention call would use: queries of ``dtype``, a cache of
    ``cache_dtype``, ``block_size``, ``head_size`` and ``group`` query heads per kv head.

    Returns a dict: ``source`` (``"plan file"``, ``"tuned"`` in this process, or ``"rules"``),
    ``build``, the paths the call takes (``qk_path``, ``pv_path``), ``blocks_per_group``,
    ``prefetch``, ``split_key_prefetch`` (half of the next blocks' key lines asked for over
    p.v, the rest over q.k), ``staged_block_size`` (None: blocks read in place), ``forced``
    (the knobs the plan sets; None for the rules) and ``us`` (the plan's time per call as
    tuned; None for the rules). ``ValueError`` names a bad argument."""
    key = _plans.check_key(dtype, cache_dtype, block_size, head_size, group)
    p = _installed.get(key)
    if p is None:
        build, knobs = cpu_kernel_variant(block_size, cache_dtype), None
    else:
        build, knobs = p["build"], p["knobs"]
    d = _plans.describe(_C_LIB, _table_pointer(build), key, knobs)
    return {"source": "rules" if p is None else p["source"], "build": build,
            "qk_path": d["qk_path"], "pv_path": d["pv_path"],
            "blocks_per_group": d["blocks_per_group"],
            "prefetch": not (knobs and knobs.get("prefetch") is False),
            "split_key_prefetch": d["split_key_prefetch"],
            "staged_block_size": d["staged_block_size"],
            "forced": None if p is None else _plans.forced_knobs(knobs),
            "us": None if p is None else p["us"]}


def _autotune(dtype_code, cache_code, block_size, head_size, num_heads, num_kv_heads) -> None:
    """PAGED_OPS_AUTOTUNE=1: a call of a key without a plan tunes it (the kernel calls this
    once per key, csrc/cpu/ops_cpu.cpp); a failure warns once and the rules stay."""
    codes = {c: d for d, c in _CACHE_DTYPE_CODES.items()}
    key = (codes[dtype_code], codes[cache_code], int(block_size), int(head_size),
           int(num_heads // num_kv_heads))
    if key in _autotune_keys:
        return
    _autotune_keys.add(key)
    try:
        _install_plans()  # the rules' plan for now: calls of this key no longer come here
        from . import tune
        tune.autotune_key(key, num_heads=int(num_heads), num_kv_heads=int(num_kv_heads))
    except Exception as e:  # noqa: BLE001  (never fail the user's call)
        _plans.warn_once(f"PAGED_OPS_AUTOTUNE could not tune {key} ({type(e).__name__}: {e})")


_autotune_hook = _plans.AUTOTUNE_HOOK(_autotune)  # alive while the kernel may call it

_select_cpu_kernels()
if not os.environ.get("PAGED_OPS_CPU_CAPABILITY", "").strip():
    _auto_selection = _selection
_load_plans()
if os.environ.get("PAGED_OPS_AUTOTUNE", "").strip() == "1":
    _C_LIB.paged_ops_set_cpu_autotune_hook(_autotune_hook)
