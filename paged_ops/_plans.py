"""Tuned plans of the CPU attention kernel: the plan file (what ``python -m paged_ops.tune``
measured on this machine) and the table of plans the kernel reads (csrc/cpu/ops_cpu.cpp).

A plan is for one key: (query dtype, cache dtype, block size, head size, GQA group). It names
the build that runs such calls and the kernel's knobs (KernelPlan, csrc/cpu/kernels.h): the
q.k and p.v paths, the blocks per softmax step and whether the next blocks are prefetched.
Keys without a plan run by the rules. A plan file that cannot be used (missing fields,
unreadable, another CPU or version) is ignored with one warning: plans never change results,
only speed, so the rules are always a safe answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import tempfile
import warnings

import torch

# The kernels' codes of the dtypes (DType, csrc/dtype.h) and the names the plan file uses.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2,
               torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# In the order of the kernel's enums (QkPath, PvPath in csrc/cpu/attention/layout.h).
QK_PATHS = ("tile", "dot_bf16", "fp8_tables", "amx")
PV_PATHS = ("group", "group_any", "half_tile", "dot", "tiny", "row_any", "amx")
MAX_GROUP = 8  # kGroup (csrc/cpu/attention/tuning.h): most blocks per softmax step
MAX_BLOCK_SIZE = 256  # kMaxCellBlockSize (ops_cpu.cpp): larger block sizes run by the rules

FILE_FORMAT = "paged_ops-plans"
FILE_VERSION = 1


class KernelPlan(ctypes.Structure):
    _fields_ = [("qk_path", ctypes.c_int32), ("pv_path", ctypes.c_int32),
                ("group", ctypes.c_int32), ("prefetch", ctypes.c_int32),
                ("split_keys", ctypes.c_int32)]


class PlanInfo(ctypes.Structure):
    _fields_ = [("qk_path", ctypes.c_int32), ("pv_path", ctypes.c_int32),
                ("group", ctypes.c_int32), ("staged_block_size", ctypes.c_int32),
                ("qk_valid", ctypes.c_uint32), ("pv_valid", ctypes.c_uint32),
                ("split_keys", ctypes.c_int32)]


class PlanEntry(ctypes.Structure):
    _fields_ = [("cache_dtype", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("head_size", ctypes.c_int32), ("group", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("table", ctypes.c_void_p), ("knobs", KernelPlan)]


AUTOTUNE_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


def setup_library(lib) -> None:
    """Declares the plan entry points of the extension ``lib`` (ctypes)."""
    lib.paged_ops_set_cpu_plans.argtypes = [ctypes.POINTER(PlanEntry), ctypes.c_int64]
    lib.paged_ops_describe_cpu_plan.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(KernelPlan),
        ctypes.POINTER(PlanInfo)]
    lib.paged_ops_cpu_default_kernel_table.restype = ctypes.c_void_p
    lib.paged_ops_cpu_kernel_abi.restype = ctypes.c_int32
    lib.paged_ops_set_cpu_autotune_hook.argtypes = [AUTOTUNE_HOOK]


# --- Knobs ----------------------------------------------------------------------------------

def knobs_struct(knobs: dict | None) -> KernelPlan:
    """The kernel's KernelPlan of knobs {qk_path, pv_path, blocks_per_group, prefetch,
    split_key_prefetch} (None or absent: the rules)."""
    knobs = knobs or {}
    kp = KernelPlan()
    if knobs.get("qk_path") is not None:
        kp.qk_path = 1 + QK_PATHS.index(knobs["qk_path"])
    if knobs.get("pv_path") is not None:
        kp.pv_path = 1 + PV_PATHS.index(knobs["pv_path"])
    if knobs.get("blocks_per_group") is not None:
        kp.group = int(knobs["blocks_per_group"])
    if knobs.get("prefetch") is not None:
        kp.prefetch = 2 if knobs["prefetch"] else 1
    if knobs.get("split_key_prefetch") is not None:
        kp.split_keys = 2 if knobs["split_key_prefetch"] else 1
    return kp


KNOB_NAMES = ("qk_path", "pv_path", "blocks_per_group", "prefetch", "split_key_prefetch")


def forced_knobs(knobs: dict | None) -> dict:
    """The knobs a plan sets (the others are None: the rules decide)."""
    return {k: v for k, v in (knobs or {}).items() if v is not None}


def check_knobs(knobs: dict) -> dict:
    """knobs checked (ValueError naming the knob), with every knob present (None: rules)."""
    if not isinstance(knobs, dict):
        raise ValueError(f"knobs must be a dict, got {knobs!r}")
    unknown = set(knobs) - set(KNOB_NAMES)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; known: {list(KNOB_NAMES)}")
    out = {k: knobs.get(k) for k in KNOB_NAMES}
    if out["qk_path"] is not None and out["qk_path"] not in QK_PATHS:
        raise ValueError(f"qk_path must be one of {QK_PATHS} or None, got {out['qk_path']!r}")
    if out["pv_path"] is not None and out["pv_path"] not in PV_PATHS:
        raise ValueError(f"pv_path must be one of {PV_PATHS} or None, got {out['pv_path']!r}")
    g = out["blocks_per_group"]
    if g is not None and (isinstance(g, bool) or not isinstance(g, int)
                          or not 1 <= g <= MAX_GROUP):
        raise ValueError(f"blocks_per_group must be an int in [1, {MAX_GROUP}] or None, got {g!r}")
    if out["prefetch"] is not None and not isinstance(out["prefetch"], bool):
        raise ValueError(f"prefetch must be a bool or None, got {out['prefetch']!r}")
    if out["split_key_prefetch"] is not None and not isinstance(out["split_key_prefetch"], bool):
        raise ValueError(f"split_key_prefetch must be a bool or None, got "
                         f"{out['split_key_prefetch']!r}")
    return out


def check_key(dtype, cache_dtype, block_size, head_size, group) -> tuple:
    """The key (dtype, cache_dtype, block_size, head_size, group) checked: ValueError naming the
    argument."""
    if dtype not in QUERY_DTYPES:
        raise ValueError(f"dtype must be one of {list(QUERY_DTYPES)}, got {dtype!r}")
    if cache_dtype not in DTYPE_CODES:
        raise ValueError(f"cache_dtype must be one of {list(DTYPE_CODES)}, got {cache_dtype!r}")
    if cache_dtype != dtype and cache_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"cache_dtype must be dtype ({dtype}) or an fp8 dtype, got "
                         f"{cache_dtype}")
    for name, v in (("block_size", block_size), ("head_size", head_size), ("group", group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    if head_size % x:
        raise ValueError(f"head_size must be a multiple of {x} for a {cache_dtype} cache, "
                         f"got {head_size}")
    return (dtype, cache_dtype, block_size, head_size, group)


def describe(lib, table, key, knobs=None, multi_token=False) -> dict:
    """What a call of ``key`` takes on kernel ``table`` (None: the built-in default) with
    ``knobs``: {qk_path, pv_path, blocks_per_group, staged_block_size, split_key_prefetch,
    qk_valid, pv_valid} (the valid ones: the paths a plan may force for this key)."""
    dtype, cache_dtype, bs, D, group = key
    info = PlanInfo()
    kp = knobs_struct(knobs)
    rc = lib.paged_ops_describe_cpu_plan(table, DTYPE_CODES[dtype], DTYPE_CODES[cache_dtype],
                                         bs, D, group, 1, int(multi_token), ctypes.byref(kp),
                                         ctypes.byref(info))
    if rc != 0:
        raise RuntimeError(f"describing the CPU kernel's plan for {key} failed ({rc})")
    return {"qk_path": QK_PATHS[info.qk_path], "pv_path": PV_PATHS[info.pv_path],
            "blocks_per_group": info.group,
            "staged_block_size": info.staged_block_size or None,
            "split_key_prefetch": bool(info.split_keys),
            "qk_valid": [p for i, p in enumerate(QK_PATHS) if info.qk_valid >> i & 1],
            "pv_valid": [p for i, p in enumerate(PV_PATHS) if info.pv_valid >> i & 1]}


# --- The plan file --------------------------------------------------------------------------

def cache_path() -> str:
    """The plan file: ``PAGED_OPS_PLAN_CACHE`` when set, else ``~/.cache/paged_ops/plans.json``."""
    env = os.environ.get("PAGED_OPS_PLAN_CACHE", "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "paged_ops", "plans.json")


def _cpu_identity() -> tuple[str, str]:
    """(model name, flags) of this CPU: /proc/cpuinfo on Linux, else what platform says."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("paged_ops")
    except Exception:  # noqa: BLE001  (not installed: a build in place)
        return "unknown"


_machine = None


def machine(lib) -> dict:
    """What plans are valid for: this CPU (model and flags), the paged_ops and torch versions
    and the kernel's ABI version (plans of another kernel are stale)."""
    global _machine
    if _machine is None:
        model, flags = _cpu_identity()
        _machine = {"cpu": model,
                    "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
                    "paged_ops": _package_version(), "torch": torch.__version__,
                    "kernel_abi": int(lib.paged_ops_cpu_kernel_abi())}
    return dict(_machine)


def machine_key(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]


class PlanFileError(Exception):
    pass


def _check_plan(p) -> dict:
    """A plan record of the file checked (PlanFileError)."""
    if not isinstance(p, dict):
        raise PlanFileError(f"a plan is not an object: {p!r:.80}")
    try:
        dtype = DTYPES_BY_NAME[p["dtype"]]
        cache_dtype = DTYPES_BY_NAME[p["cache_dtype"]]
        key = check_key(dtype, cache_dtype, p["block_size"], p["head_size"], p["group"])
        knobs = check_knobs({k: p.get(k) for k in KNOB_NAMES})
        build = p["build"]
        us = p["us"]
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"a plan is malformed ({type(e).__name__}: {e}): {p!r:.120}") from None
    if not isinstance(build, str) or not isinstance(us, (int, float)) or not us > 0:
        raise PlanFileError(f"a plan is malformed: {p!r:.120}")
    return {"key": key, "build": build, "knobs": knobs, "us": float(us),
            "rules_us": p.get("rules_us")}


def read_file(path: str) -> dict | None:
    """The whole plan file (None where there is none); PlanFileError where it is unreadable or
    not a plan file."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanFileError(f"cannot read it ({e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PlanFileError(f"not valid JSON, corrupt or truncated ({e})") from None
    if (not isinstance(data, dict) or data.get("format") != FILE_FORMAT
            or not isinstance(data.get("machines"), dict)):
        raise PlanFileError("not a paged_ops plan file")
    if data.get("version") != FILE_VERSION:
        raise PlanFileError(f"plan file version {data.get('version')!r}, this paged_ops "
                            f"reads {FILE_VERSION}")
    return data


def plans_for(data: dict | None, m: dict) -> list[dict]:
    """The checked plans of machine ``m`` in the file's ``data`` (PlanFileError when the file
    holds plans of other machines or versions only, or malformed ones)."""
    if not data or not data["machines"]:
        return []
    entry = data["machines"].get(machine_key(m))
    if entry is None:
        raise PlanFileError("its plans are for another CPU or another paged_ops, torch or "
                            "kernel version; run python -m paged_ops.tune to tune this one")
    if not isinstance(entry, dict) or not isinstance(entry.get("plans"), list):
        raise PlanFileError("its entry for this machine is malformed")
    return [_check_plan(p) for p in entry["plans"]]


_warned = False


def warn_once(message: str) -> None:
    """One warning per process about plans (the rules apply meanwhile)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"paged_ops: {message}; the CPU kernel's rules apply", RuntimeWarning,
                      stacklevel=3)


def load(lib, path: str | None = None) -> list[dict]:
    """This machine's plans from the plan file ([] without one; [] and one warning when it
    cannot be used)."""
    path = path or cache_path()
    try:
        return plans_for(read_file(path), machine(lib))
    except PlanFileError as e:
        warn_once(f"ignoring the plan file {path}: {e}")
        return []


def _record(plan: dict) -> dict:
    dtype, cache_dtype, bs, D, group = plan["key"]
    rec = {"build": plan["build"], "dtype": DTYPE_NAMES[dtype],
           "cache_dtype": DTYPE_NAMES[cache_dtype], "block_size": bs, "head_size": D,
           "group": group}
    rec.update(plan["knobs"])
    rec["us"] = round(plan["us"], 3)
    if plan.get("rules_us") is not None:
        rec["rules_us"] = round(plan["rules_us"], 3)
    return rec


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock beside ``path`` (several tuners merge their plans one at a time); no
    lock where the file system has none."""
    try:
        import fcntl
        fh = open(path + ".lock", "a")
    except (ImportError, OSError):
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def save(lib, plans: list[dict], path: str | None = None, drop=()) -> str:
    """Merges ``plans`` (one per build and key; they replace this machine's plans of the same
    build and key, as do the (build, key) pairs of ``drop``: those a tuner raced) into the plan
    file, atomically: a temporary file renamed over it, under a lock, so that concurrent tuners
    leave a valid file holding both their plans. An unusable file is replaced. Returns the
    path; OSError when it cannot be written."""
    path = path or cache_path()
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    m = machine(lib)
    mkey = machine_key(m)
    with _locked(path):
        try:
            data = read_file(path) or {}
        except PlanFileError:
            data = {}
        machines = data.get("machines", {}) if isinstance(data.get("machines"), dict) else {}
        try:
            old = plans_for({"machines": {mkey: machines[mkey]}}, m) if mkey in machines else []
        except PlanFileError:
            old = []
        new_ids = {(p["build"], p["key"]) for p in plans} | set(drop)
        merged = [p for p in old if (p["build"], p["key"]) not in new_ids] + list(plans)
        merged.sort(key=lambda p: (DTYPE_NAMES[p["key"][1]], p["key"][2], p["key"][3],
                                   p["key"][4], DTYPE_NAMES[p["key"][0]], p["build"]))
        machines[mkey] = {"machine": m, "plans": [_record(p) for p in merged]}
        out = {"format": FILE_FORMAT, "version": FILE_VERSION, "machines": machines}
        fd, tmp = tempfile.mkstemp(prefix=".plans.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(out, fh, indent=1)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    return path


# --- Installed plans ------------------------------------------------------------------------

def install(lib, entries: list[tuple]) -> None:
    """Replaces the kernel's plans by ``entries``: (key, table pointer or None for the cell's
    build, knobs)."""
    arr = (PlanEntry * max(len(entries), 1))()
    for i, (key, table, knobs) in enumerate(entries):
        dtype, cache_dtype, bs, D, group = key
        arr[i] = PlanEntry(DTYPE_CODES[cache_dtype], bs, D, group, DTYPE_CODES[dtype], 0,
                           table, knobs_struct(knobs))
    rc = lib.paged_ops_set_cpu_plans(arr, len(entries))
    if rc != 0:
        raise RuntimeError(f"installing CPU kernel plans failed ({rc}): a kernel build from "
                           "an incompatible build, or a key out of range")


def best_per_key(plans: list[dict], builds: list[str] | None) -> dict:
    """{key: plan}: per key the fastest plan among those of ``builds`` (None: any build)."""
    best = {}
    for p in plans:
        if builds is not None and p["build"] not in builds:
            continue
        if p["key"][2] > MAX_BLOCK_SIZE:
            continue
        cur = best.get(p["key"])
        if cur is None or p["us"] < cur["us"]:
            best[p["key"]] = p
    return best
