"""The CPU attention kernel's work plan (csrc/cpu/attention/work_plan.h), checked without torch.

make_plan cuts a call into items and item_info says what each covers; a mistake there (a row or
block covered twice or not at all, a split leaving a gap, a range past the sequence) gives wrong
attention only for the shapes it mis-cuts, which the numeric tests may never draw. The header is
plain C++, so tests/work_plan_check.cpp includes it, enumerates every item of a case and checks
the coverage, the bounds and the documented heuristic (splits, heads per item, grain, sized
in key elements). Each case below pins a shape class; `sweep` runs a grid of ~37000 more.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# key=value arguments of work_plan_check (see its header); splits/hpi/items pin the plan.
CASES = {
    # Decode: one query row per sequence, every kv head in one item while there are enough.
    "decode_batch": "lens=1,5,16,17,100,0,3000 heads=32/8 bs=16 threads=2 splits=1 hpi=8",
    "decode_seq_len_0": "lens=0,0,0 heads=32/8 bs=16 threads=16",
    "decode_one_thread_no_split": "lens=16384 heads=32/8 bs=16 threads=1 splits=1 items=1",
    # A long lone sequence with idle threads: its blocks split into 2 items per thread.
    "decode_long_split_2_threads": "lens=16384 heads=32/8 bs=16 threads=2 splits=4 hpi=8",
    "decode_long_split_16_threads_mqa": "lens=16384 heads=8/1 bs=16 threads=16 splits=32",
    # Too few blocks to split (2 splits need 64 here): the kv heads are spread over items.
    "decode_short_heads_spread": "lens=20 heads=32/8 bs=16 threads=16 splits=1 hpi=1 items=8",
    # 16 tokens at block size 1 are 2 Ki key elements per kv head, less than a split's 64 Ki.
    "decode_heads_halve_unevenly": "lens=16 heads=24/3 bs=1 threads=2 splits=1 hpi=1 items=3",
    # A split covers 64 Ki key elements (512 tokens at head size 128), whatever the block size
    # and the cache dtype: 2 blocks of 256, 512 blocks of 1, 64 blocks of 16 at head size 64.
    "decode_bs256_two_blocks_per_split": "lens=2048 heads=32/8 bs=256 threads=2 splits=4 hpi=8",
    "decode_bs256_short": "lens=1024 heads=32/8 bs=256 threads=2 splits=2 hpi=4",
    "decode_bs1_fp8_512_blocks_per_split":
        "lens=1100 heads=32/8 bs=1 threads=2 dtype=fp8_e4m3 splits=2 hpi=4",
    "decode_fp32_d64": "lens=4096 heads=32/8 bs=16 threads=2 d=64 dtype=fp32 splits=4 hpi=8",
    # 65 blocks in 32 splits of 3: the last splits are empty, which the merge allows.
    "decode_empty_splits": "lens=16640 heads=8/1 bs=256 threads=16 splits=32",
    "decode_window_bs7": "lens=1000,3,70 heads=4/4 bs=7 threads=16 window=100",
    "decode_bs1_window1": "lens=300 heads=8/1 bs=1 threads=2 window=1",
    "decode_bs128_strided_seq_lens": "lens=129,128,1 heads=32/8 bs=128 threads=2 stride=3",
    # Multi-token: chunks of about 64 query rows, one kv head per item; q_len 0 and 1, and a
    # prompt of several chunks (16 tokens per chunk at G = 4).
    "multi_mixed": "lens=10,100,300,5,7 q=0,1,300,5,0 heads=32/8 bs=16 threads=2",
    "multi_mqa": "lens=500,64,1 q=130,64,1 heads=8/1 bs=8 threads=16",
    "multi_mha_one_chunk_64": "lens=200,65 q=200,65 heads=4/4 bs=16 threads=2 items=24",
    "multi_g128_one_token_per_chunk": "lens=9 q=9 heads=256/2 bs=16 threads=2 items=18",
    "multi_window_bs7": "lens=1000,40 q=150,40 heads=32/8 bs=7 threads=2 window=5",
    "multi_bs1_window1": "lens=100 q=100 heads=8/1 bs=1 threads=1 window=1",
    "multi_bs128": "lens=1000,129 q=200,1 heads=32/8 bs=128 threads=16",
    "multi_no_seqs": "lens= q= heads=32/8 bs=16 threads=2 items=0",
    "decode_no_seqs": "lens= heads=32/8 bs=16 threads=2 items=0",
    "sweep": "sweep",
}


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build tests/work_plan_check.cpp")
    exe = str(tmp_path_factory.mktemp("work_plan") / "work_plan_check")
    # -DCPU_CAPABILITY: the header sits in the per-capability inline namespace.
    cmd = ["g++", "-std=c++20", "-O1", "-Wall", "-Wextra", "-DCPU_CAPABILITY=DEFAULT",
           "-I" + os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests", "work_plan_check.cpp"),
           "-o", exe]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
    return exe


@pytest.mark.parametrize("case", list(CASES))
def test_work_plan(checker, case):
    res = subprocess.run([checker, *CASES[case].split()], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("ok"), res.stdout


def test_checker_catches_a_wrong_pin(checker):
    # The checker fails (exit 1, naming the check) when the plan is not what a case pins, so a
    # pin above is a real assertion.
    res = subprocess.run([checker, "lens=5", "splits=3"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "FAIL" in res.stdout and "want_splits" in res.stdout
