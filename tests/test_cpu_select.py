"""Which CPU attention kernel build runs: the fastest measured one that ATen's capability
detection allows and that was built, or the one PAGED_OPS_CPU_CAPABILITY names (a cap)
(docs/cpu_kernel_selection.md)."""

import os
import subprocess
import sys

import pytest
import torch

import paged_ops


def _variant_in_subprocess(**env):
    code = "import paged_ops; print(paged_ops.cpu_kernel_variant())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env})
    return res


def test_default_is_the_fastest_supported():
    res = _variant_in_subprocess()
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == paged_ops.supported_cpu_kernel_variants()[0]


def test_avx2_is_selected_on_avx512_cpus(monkeypatch):
    # Measured: neither AVX-512 build is faster than the AVX2 one on an AVX-512 CPU (a
    # Sapphire Rapids Xeon: slower at block size 8, 16 and for fp8, even elsewhere), so AVX2
    # comes first; the AVX-512 builds stay available by name and by the cap.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability",
                        lambda: {"avx512_bf16": True, "amx_tile": True, "amx_bf16": True})
    built = [v for v in ("avx2", "avx512_bf16", "avx512", "avx512_amx")
             if paged_ops._variant_library(v)]
    assert paged_ops.supported_cpu_kernel_variants() == built + ["default"]


ISA_ORDER = ["default", "avx2", "avx512", "avx512_bf16", "avx512_amx"]


@pytest.mark.parametrize("cap", ISA_ORDER)
def test_capability_caps_the_choice(cap):
    # The cap's build where supported, else the highest instruction set below it: asking for
    # more than the CPU has gives the most it has, not the portable build.
    order = ISA_ORDER
    expect = max((v for v in paged_ops.supported_cpu_kernel_variants()
                  if order.index(v) <= order.index(cap)), key=order.index)
    res = _variant_in_subprocess(PAGED_OPS_CPU_CAPABILITY=cap.upper())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expect


def test_bad_capability_names_the_variable():
    res = _variant_in_subprocess(PAGED_OPS_CPU_CAPABILITY="avx9000")
    assert res.returncode != 0
    assert "PAGED_OPS_CPU_CAPABILITY" in res.stderr and "avx512_bf16" in res.stderr


def test_aten_capability_limits_the_builds():
    res = _variant_in_subprocess(ATEN_CPU_CAPABILITY="default")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "default"


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_and_amx_builds_only_where_the_cpu_has_them(monkeypatch, bf16, amx):
    # What an AVX-512 CPU would be offered, with and without AVX512-BF16 and AMX-BF16 (ATen's
    # cpuinfo flags): the AMX build needs both.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability",
                        lambda: {"avx512_bf16": bf16, "amx_tile": amx, "amx_bf16": amx})
    built = [v for v in ("avx2", "avx512_bf16", "avx512", "avx512_amx")
             if paged_ops._variant_library(v)]
    expect = [v for v in built
              if (bf16 or v not in ("avx512_bf16", "avx512_amx")) and (amx or v != "avx512_amx")]
    assert paged_ops.supported_cpu_kernel_variants() == expect + ["default"]


def test_variant_libraries_are_told_apart():
    # "_cpu_avx512" must not find "_cpu_avx512_bf16" (a prefix of its name).
    for name in ISA_ORDER[1:]:
        path = paged_ops._variant_library(name)
        if path is not None:
            assert os.path.basename(path).split(".")[0] == f"_cpu_{name}"
