"""PagedEngine on a tensor-parallel model: 2 ranks on loopback with gloo (CPU).

The test saves a tiny random Llama (GQA: 4 query heads, 2 KV heads), launches
``torchrun --nproc-per-node 2`` on ``tests/tp_worker.py`` (each rank loads the model with
transformers' ``tp_plan="auto"``) and checks every rank's tokens, with a pool small enough to
preempt and prefix caching on, against one process: transformers' ``generate`` for greedy
(two branches per prompt), one process's engine for seeded sampling and beam search. Each rank
caches one KV head (half the bytes of one process), every step is scheduled identically with
bitwise identical logits on both ranks, and a model whose KV heads do not divide by the world
size is refused with a ValueError.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tp_plan needs it

WORLD = 2
TIMEOUT_S = 180
ROOT = Path(__file__).resolve().parent.parent


def _distributed_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


pytestmark = pytest.mark.skipif(not _distributed_available(),
                                reason="torch.distributed with gloo is not available")


def _save_llama(path: Path, num_kv_heads: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=num_kv_heads, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 2-rank worker once; returns (per-rank results, rank 0's references)."""
    tmp = tmp_path_factory.mktemp("tp")
    _save_llama(tmp / "model", num_kv_heads=2)
    _save_llama(tmp / "mqa", num_kv_heads=1)  # 1 KV head cannot be split over 2 ranks
    out = tmp / "out"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname is
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
           str(ROOT / "tests" / "tp_worker.py"), str(tmp / "model"), str(tmp / "mqa"), str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        log, _ = proc.communicate()
        pytest.fail(f"2-rank run exceeded {TIMEOUT_S} s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{log[-6000:]}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return results, results[0]["reference"]


def test_each_rank_caches_its_own_kv_heads(ranks):
    results, ref = ranks
    assert ref["num_kv_heads"] == 2
    for r, res in enumerate(results):
        assert res["rank"] == r and res["tp_world_size"] == WORLD and res["tp_rank"] == r
        assert res["num_heads"] == 2 and res["num_kv_heads"] == 1
        assert res["cache_shape"][1] == 1  # [num_blocks, kv heads, head_dim / x, block, x]
        assert res["kv_bytes_per_block"] * WORLD == ref["kv_bytes_per_block"]


def test_greedy_tokens_equal_one_process(ranks):
    results, ref = ranks
    for res in results:
        stats = res["greedy_stats"]
        assert stats["preemptions"] > 0, stats  # the pool is small enough to preempt
        assert stats["forks"] > 0 and stats["cached_prompt_tokens"] > 0, stats
        for i, (branches, want) in enumerate(zip(res["greedy"], ref["greedy"], strict=True)):
            assert branches == [want] * len(branches), f"rank {res['rank']} prompt {i}"


def test_prefix_cache_hits_equal_one_process(ranks):
    results, ref = ranks
    for res in results:
        assert res["shared_cached_prompt_tokens"] > 0
        assert res["shared"] == ref["shared"], f"rank {res['rank']}"


def test_seeded_sampling_equals_one_process(ranks):
    results, ref = ranks
    for res in results:
        assert res["sampled_preemptions"] > 0
        assert res["sampled"] == ref["sampled"], f"rank {res['rank']}"
    assert any(b[0] != b[1] for b in ref["sampled"])  # the branches really sample


def test_unseeded_sampling_and_beam_search_agree(ranks):
    results, ref = ranks
    assert results[1]["unseeded"] == results[0]["unseeded"]
    for res in results:
        assert res["beam"] == ref["beam"], f"rank {res['rank']}"


def test_ranks_schedule_identically_with_identical_logits(ranks):
    results, _ = ranks
    for res in results:
        assert res["steps_checked"] > 0
        assert res["schedule_mismatches"] == 0
        assert res["logit_mismatches"] == 0


def test_indivisible_kv_heads_are_refused(ranks):
    results, _ = ranks
    for res in results:
        msg = res["indivisible_error"]
        assert msg is not None and "num_key_value_heads=1" in msg and "world size 2" in msg
