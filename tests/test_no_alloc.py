"""The CPU attention and reshape_and_cache kernels allocate nothing per call once warm (issue 5:
"no allocation per call in the hot path"): split-K states, plans, runs and scratch are reused
from call to call.

A subprocess runs paged::attention_out and paged::reshape_and_cache with LD_PRELOAD of a small
library that counts the calls of malloc / calloc / realloc / posix_memalign / aligned_alloc of
4 KiB or more (torch's Python binding makes two small ones per op call; every buffer of the
kernels that matters is larger) and checks that the count does not grow over repeated calls:
decode with and without split-K, fp32 / bf16 caches, several query tokens per sequence; cache
writes for decode and prefill, plain and fp8. glibc serves such blocks with mmap past its
threshold, so on many-core machines (split-K states of MiBs) every call would otherwise fault
in fresh pages.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import paged_ops

COUNTER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
long paged_big_allocs = 0;
static void count(size_t n) {
  if (n >= 4096) __atomic_add_fetch(&paged_big_allocs, 1, __ATOMIC_RELAXED);
}
#define REAL(name) \
  static __typeof__(&name) real; \
  if (!real) real = (__typeof__(&name))dlsym(RTLD_NEXT, #name)
void* malloc(size_t n) { REAL(malloc); count(n); return real(n); }
void* calloc(size_t a, size_t b) { REAL(calloc); count(a * b); return real(a, b); }
void* realloc(void* p, size_t n) { REAL(realloc); count(n); return real(p, n); }
int posix_memalign(void** p, size_t a, size_t n) {
  REAL(posix_memalign); count(n); return real(p, a, n);
}
void* aligned_alloc(size_t a, size_t n) { REAL(aligned_alloc); count(n); return real(a, n); }
"""

SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import torch
    import paged_ops
    sys.path.insert(0, {root!r})
    from tests.helpers import make_paged, query_start_loc, random_query

    counter = ctypes.c_long.in_dll(ctypes.CDLL(None), "paged_big_allocs")
    paged_ops.set_cpu_kernel_variant({variant!r})
    torch.set_num_threads(2)

    def check(call, *what):
        for _ in range(3):  # warm: buffers grow to the shapes
            call()
        before = counter.value
        for _ in range(10):
            call()
        print(*what, counter.value - before)
        assert counter.value == before, f"{{counter.value - before}} allocations in 10 calls"

    for dtype, lens, q_lens, bs in [
        (torch.float32, [2048, 5], None, 16),             # split-K (few sequences, long)
        (torch.bfloat16, [64] * 9 + [63], None, 16),       # many short sequences
        (torch.float32, [700, 33], [17, 1], 16),           # several query tokens per sequence
        (torch.bfloat16, [900, 7], None, 3),              # staged blocks
        (torch.float32, [300, 33], [9, 1], 1),             # staged, several query tokens
        (torch.float16, [500, 41], None, 40),             # V rows half a vector short
    ]:
        pg = make_paged(lens, 2, 64, bs, dtype)
        n = sum(q_lens) if q_lens else len(lens)
        q = random_query(n, 8, 64, dtype)
        out = torch.empty_like(q)
        qsl = query_start_loc(q_lens) if q_lens else None
        def call():
            torch.ops.paged.attention_out(out, q, pg.key_cache, pg.value_cache, pg.block_tables,
                                          pg.seq_lens, 0.125, None, -1, 0.0, None, None, None,
                                          qsl)
        check(call, dtype, lens, q_lens)
    # reshape_and_cache: decode (one token per scattered block) and a prefill chunk, plain and
    # fp8 (quantised through a per-thread tile).
    for in_dtype, cache_dtype, ntok, prefill in [
        (torch.float32, torch.float32, 256, False),
        (torch.bfloat16, torch.bfloat16, 512, True),
        (torch.bfloat16, torch.float8_e4m3fn, 256, False),
        (torch.float16, torch.float8_e5m2, 512, True),
    ]:
        nb = ntok + 8
        kc, vc = paged_ops.allocate_kv_cache(nb, 2, 64, 16, cache_dtype)
        k = torch.randn(ntok, 2, 64).to(in_dtype)
        v = torch.randn(ntok, 2, 64).to(in_dtype)
        blocks = torch.randperm(nb)
        slots = (blocks[: ntok // 16].repeat_interleave(16) * 16 + torch.arange(ntok) % 16
                 if prefill else blocks[:ntok] * 16 + torch.arange(ntok) % 16)
        scales = (torch.tensor([0.05]), torch.tensor([0.04])) if kc.element_size() == 1 else (
            None, None)
        def write():
            torch.ops.paged.reshape_and_cache(k, v, kc, vc, slots, *scales)
        check(write, cache_dtype, ntok, prefill)
    print("ok")
""")


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("gcc") is None,
                    reason="needs Linux and gcc for the LD_PRELOAD counter")
@pytest.mark.parametrize("variant", paged_ops.supported_cpu_kernel_variants())
def test_cpu_kernels_allocate_nothing_per_call(variant, tmp_path):
    src = tmp_path / "count_allocs.c"
    src.write_text(COUNTER)
    lib = tmp_path / "count_allocs.so"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", str(src), "-o", str(lib),
                    "-ldl"], check=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LD_PRELOAD=str(lib))
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(root=root, variant=variant)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout + res.stderr
