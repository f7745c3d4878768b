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


def test_avx512_cpus_run_avx512_bf16_with_measured_overrides(monkeypatch):
    # Measured on an AVX-512 CPU (a Sapphire Rapids Xeon, every cache dtype and block size
    # 1-256; docs/cpu_kernel_selection.md): avx512_bf16 leads but for the (cache dtype, block
    # size) cells of _OVERRIDES; the AMX build is no faster from memory and runs only when
    # asked for.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability",
                        lambda: {"avx512_bf16": True, "avx512_vbmi": True, "amx_tile": True,
                                 "amx_bf16": True})
    built = [v for v in ("avx512_bf16", "avx512", "avx2", "avx512_amx")
             if paged_ops._variant_library(v)]
    assert paged_ops.supported_cpu_kernel_variants() == built + ["default"]
    assert set(paged_ops._OVERRIDES) <= {"avx512_bf16", "avx512"}
    for main, others in paged_ops._OVERRIDES.items():
        assert paged_ops._normalized_overrides(others) == others  # sorted, checked
        assert main not in others


def test_the_build_follows_the_block_size_and_cache_dtype():
    dtypes = list(paged_ops._CACHE_DTYPE_CODES)
    code = ("import paged_ops as p; print(p.cpu_kernel_variant(), *(p.cpu_kernel_variant(b, d) "
            "for d in p._CACHE_DTYPE_CODES for b in range(1, 300)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    main, *by_cell = res.stdout.split()
    expect = {}
    for other, cells in paged_ops._OVERRIDES.get(main, {}).items():
        if other in paged_ops.supported_cpu_kernel_variants():
            for d, sizes in cells.items():
                expect.update({(d, b): other for b in sizes})
    assert by_cell == [expect.get((d, b), main) for d in dtypes for b in range(1, 300)]
    # A build asked for by name (tests, benchmarks) runs every block size; the selection
    # comes back as it was.
    before = paged_ops._selection
    try:
        paged_ops.set_cpu_kernel_variant("default")
        assert {paged_ops.cpu_kernel_variant(b, d) for b in (0, 1, 8, 16, 256, 257)
                for d in dtypes} == {"default"}
        paged_ops.set_cpu_kernel_variant("default", overrides={
            main: {torch.float16: range(1, 17), torch.bfloat16: [40, 24, 24]}})
        assert paged_ops._selection == ("default", {main: {torch.float16: tuple(range(1, 17)),
                                                           torch.bfloat16: (24, 40)}})
        assert [paged_ops.cpu_kernel_variant(b, d) for b, d in
                ((1, torch.float16), (16, torch.float16), (17, torch.float16),
                 (24, torch.bfloat16), (40, torch.bfloat16), (32, torch.bfloat16),
                 (8, torch.float8_e4m3fn), (8, torch.float32))] == \
            [main, main, "default", main, main, "default", "default", "default"]
        assert paged_ops._describe_selection(paged_ops._selection) == \
            f"default ({main}: float16 bs 1-16, bfloat16 bs 24,40)"
        with pytest.raises(ValueError, match="cache_dtype"):
            paged_ops.cpu_kernel_variant(8, torch.int8)
        # Bad overrides are refused before anything switches.
        for bad, match in (({main: {torch.int8: [8]}}, "cache dtype"),
                           ({main: {torch.float16: [0]}}, "block sizes"),
                           ({main: {torch.float16: [257]}}, "block sizes"),
                           ({main: [8]}, "must map"),
                           ({"avx9000": {torch.float16: [8]}}, "not available")):
            with pytest.raises(ValueError, match=match):
                paged_ops.set_cpu_kernel_variant(main, overrides=bad)
            assert paged_ops.cpu_kernel_variant(16, torch.float16) == main
            assert paged_ops.cpu_kernel_variant(17, torch.float16) == "default"
    finally:
        paged_ops._set_selection(before)
    assert paged_ops._selection == before


def test_a_capability_cap_runs_one_build_everywhere():
    code = "import paged_ops as p; print(*{p.cpu_kernel_variant(b) for b in (8, 16, 32, 256)})"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PAGED_OPS_CPU_CAPABILITY": "avx512_amx"})
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.split()) == 1


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
@pytest.mark.parametrize("vbmi", [False, True])
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_and_amx_builds_only_where_the_cpu_has_them(monkeypatch, bf16, vbmi, amx):
    # What an AVX-512 CPU would be offered, with and without AVX512-BF16, AVX512-VBMI and
    # AMX-BF16 (ATen's cpuinfo flags): avx512_bf16 needs the first two (Cooper Lake has
    # AVX512-BF16 without VBMI), the AMX build all three.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability",
                        lambda: {"avx512_bf16": bf16, "avx512_vbmi": vbmi, "amx_tile": amx,
                                 "amx_bf16": amx})
    built = [v for v in ("avx512_bf16", "avx512", "avx2", "avx512_amx")
             if paged_ops._variant_library(v)]
    expect = [v for v in built if (bf16 and vbmi or v not in ("avx512_bf16", "avx512_amx"))
              and (amx or v != "avx512_amx")]
    assert paged_ops.supported_cpu_kernel_variants() == expect + ["default"]


def test_variant_libraries_are_told_apart():
    # "_cpu_avx512" must not find "_cpu_avx512_bf16" (a prefix of its name).
    for name in ISA_ORDER[1:]:
        path = paged_ops._variant_library(name)
        if path is not None:
            assert os.path.basename(path).split(".")[0] == f"_cpu_{name}"
