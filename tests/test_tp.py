"""PagedEngine on a tensor-parallel model: 2 ranks on loopback with gloo (CPU).

The test saves a tiny random Llama (GQA: 4 query heads, 2 KV heads), launches
``torchrun --nproc-per-node 2`` on ``tests/tp_worker.py`` (each rank loads the model with
transformers' ``tp_plan="auto"``) and checks every rank's tokens, with a pool small enough to
preempt (by recompute; by swapping in one run), prefix caching on, chunked prefill in one run
and cascade decode of the branches' shared blocks, against one process:
transformers' ``generate`` for greedy (two branches per prompt), one process's engine for
seeded sampling and beam search. Each rank caches one KV head (half the bytes of one process),
every step is scheduled identically with bitwise identical logits on both ranks, and a model
whose KV heads do not divide by the world size is refused with a ValueError. The 2-rank tests
skip without transformers, accelerate or gloo; the tests of ``tp_layout`` alone (on stand-in
modules) always run.
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

from paged_ops.engine.tp import tp_layout

WORLD = 2
TIMEOUT_S = 180
ROOT = Path(__file__).resolve().parent.parent


def _distributed_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()




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
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tp_plan needs it
    if not _distributed_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("tp")
    _save_llama(tmp / "model", num_kv_heads=2)
    _save_llama(tmp / "mqa", num_kv_heads=1)  # 1 KV head cannot be split over 2 ranks
    out = tmp / "out"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    # CPU and gloo even where a GPU is visible (transformers' tp_plan would take CUDA + NCCL
    # and need a GPU per rank).
    env["CUDA_VISIBLE_DEVICES"] = ""
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
        assert res["layout_from_weights"] == [WORLD, r, 2, 1]


def test_greedy_tokens_equal_one_process(ranks):
    results, ref = ranks
    for res in results:
        stats = res["greedy_stats"]
        assert stats["preemptions"] > 0, stats  # the pool is small enough to preempt
        assert stats["forks"] > 0 and stats["cached_prompt_tokens"] > 0, stats
        assert stats["cascade_steps"] > 0, stats  # the branches' shared prompt blocks
        for i, (branches, want) in enumerate(zip(res["greedy"], ref["greedy"], strict=True)):
            assert branches == [want] * len(branches), f"rank {res['rank']} prompt {i}"


def test_chunked_prefill_equals_one_process(ranks):
    """A step budget of 8 tokens: every prompt is prefilled in chunks, mixed with decodes."""
    results, ref = ranks
    for res in results:
        assert res["chunked_mixed_steps"] > 0
        assert res["chunked"] == [[want] for want in ref["greedy"]], f"rank {res['rank']}"


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
        assert res["swap_preemptions"] > 0
        assert res["swapped"] == ref["sampled"], f"rank {res['rank']}"
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


# --------------------------------------------------------------------------- tp_layout alone
class _Mesh:
    def __init__(self, rank):
        self.rank = rank

    def get_local_rank(self):
        return self.rank

    def get_group(self):
        return None


class _Attention(torch.nn.Module):
    """An attention layer as a rank of a 2-way sharded model holds it: local q/k rows."""

    def __init__(self, q_rows, k_rows, head_dim=16):
        super().__init__()
        self.layer_idx = 0
        self.head_dim = head_dim
        self.q_proj = torch.nn.Linear(64, q_rows, bias=False)
        self.k_proj = torch.nn.Linear(64, k_rows, bias=False)


def _sharded(attn, rank=1):
    model = torch.nn.Sequential(attn)
    model._tp_size, model._device_mesh = WORLD, _Mesh(rank)
    return model


def test_tp_layout_unsharded_keeps_the_config_counts():
    lay = tp_layout(torch.nn.Sequential(_Attention(64, 32)), 4, 2, 16)
    assert (lay.world_size, lay.rank, lay.num_heads, lay.num_kv_heads) == (1, 0, 4, 2)


def test_tp_layout_reads_the_local_projections():
    lay = tp_layout(_sharded(_Attention(32, 16)), 4, 2, 16)
    assert (lay.world_size, lay.rank, lay.num_heads, lay.num_kv_heads) == (2, 1, 2, 1)


@pytest.mark.parametrize("heads,kv_heads,name", [(3, 1, "num_attention_heads=3"),
                                                 (4, 1, "num_key_value_heads=1")])
def test_tp_layout_refuses_counts_not_divisible_by_the_world(heads, kv_heads, name):
    with pytest.raises(ValueError, match=f"{name} is not divisible by the tensor-parallel "
                                         f"world size 2"):
        tp_layout(_sharded(_Attention(32, 8)), heads, kv_heads, 16)


def test_tp_layout_refuses_partial_heads_and_foreign_plans():
    with pytest.raises(ValueError, match="not whole heads of head_dim 16"):
        tp_layout(_sharded(_Attention(32, 8)), 4, 2, 16)
    with pytest.raises(ValueError, match="unsupported sharding plan"):
        tp_layout(_sharded(_Attention(32, 32)), 4, 2, 16)  # KV heads replicated, not split
