"""The fake (meta) implementations: under FakeTensorMode and torch.compile they accept what the
real ops accept, return outputs of the real ops' shape, dtype and device, and reject bad ranks,
shapes, dtypes and devices with the real ops' errors while tracing."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_ops

F32, F16, BF16, E4M3 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
OPS = torch.ops.paged


def caches(dtype=F32, num_blocks=6, heads=2, head_size=64, block_size=16, device="cpu"):
    return paged_ops.allocate_kv_cache(num_blocks, heads, head_size, block_size, dtype,
                                       device=device)


def attention_args(q_dtype=F32, cache_dtype=None, device="cpu", num_seqs=2):
    kc, vc = caches(cache_dtype or q_dtype, device=device)
    kc.view(torch.uint8).zero_()
    vc.view(torch.uint8).zero_()
    return dict(query=torch.randn(num_seqs, 4, 64, device=device).to(q_dtype), key_cache=kc,
                value_cache=vc, block_tables=torch.zeros(num_seqs, 3, dtype=torch.int32,
                                                         device=device),
                seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=device), scale=0.125)


def cache_write_args(dtype=F32, cache_dtype=None, device="cpu"):
    kc, vc = caches(cache_dtype or dtype, device=device)
    return dict(key=torch.randn(3, 2, 64, device=device).to(dtype),
                value=torch.randn(3, 2, 64, device=device).to(dtype), key_cache=kc,
                value_cache=vc, slot_mapping=torch.tensor([0, 5, -1], device=device))


def fake_call(op, args: dict, *, fake_device=None):
    """op(**args) on fake copies of the arguments (on `fake_device`, if given)."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        def conv(v):
            if isinstance(v, torch.Tensor):
                f = mode.from_tensor(v)
                return f.to(fake_device) if fake_device is not None else f
            if isinstance(v, list):
                return [conv(t) for t in v]
            return v
        return op(**{k: conv(v) for k, v in args.items()})


# ---- accepted calls: outputs as the real op's ---------------------------------------------


@pytest.mark.parametrize("fake_device", ["cpu", "cuda"])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(F32, F32), (BF16, BF16), (F16, E4M3),
                                                 (F32, torch.float8_e5m2)])
def test_attention_output_matches_the_real_op(q_dtype, cache_dtype, fake_device):
    a = attention_args(q_dtype, cache_dtype)
    if cache_dtype in (E4M3, torch.float8_e5m2):
        a.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
    a["query"] = a["query"].transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    real = OPS.attention(**a)
    fake = fake_call(OPS.attention, a, fake_device=fake_device)
    assert fake.shape == real.shape and fake.dtype == real.dtype
    assert fake.stride() == real.stride() and fake.device.type == fake_device


def test_multi_token_and_out_variants_accepted():
    a = attention_args(num_seqs=2)
    a["query"] = torch.randn(5, 4, 64)
    a["query_start_loc"] = torch.tensor([0, 1, 5], dtype=torch.int32)
    a["seq_lens"] = torch.tensor([1, 4], dtype=torch.int32)
    a["block_tables"] = torch.zeros(2, 1, dtype=torch.int32)
    a["alibi_slopes"] = torch.rand(4)
    assert fake_call(OPS.attention, a).shape == (5, 4, 64)
    assert fake_call(OPS.attention_out, dict(a, out=torch.empty(5, 4, 64))) is None
    assert fake_call(OPS.reshape_and_cache, cache_write_args(BF16, E4M3) |
                     dict(k_scale=torch.ones(1), v_scale=torch.ones(1))) is None
    kcs, vcs = zip(*[caches() for _ in range(2)])
    assert fake_call(OPS.copy_blocks, dict(key_caches=list(kcs), value_caches=list(vcs),
                                           block_mapping=torch.tensor([[0, 1]]))) is None
    assert fake_call(OPS.swap_blocks, dict(src=kcs[0], dst=kcs[1],
                                           block_mapping=torch.tensor([[0, 1]]))) is None


# ---- rejected calls: the real op's error, while tracing -----------------------------------

def _attn(**over):
    a = attention_args()
    a.update(over)
    return OPS.attention, a


def _write(**over):
    a = cache_write_args()
    a.update(over)
    return OPS.reshape_and_cache, a


def _copy(n_v=2, mapping=None, second=None):
    layers = [caches(num_blocks=4) for _ in range(2)]
    kcs = [k for k, _ in layers]
    vcs = [v for _, v in layers][:n_v]
    if second is not None:
        kcs[1], vcs[1] = second
    return OPS.copy_blocks, dict(key_caches=kcs, value_caches=vcs,
                                 block_mapping=torch.tensor([[0, 1]]) if mapping is None
                                 else mapping)


def _swap(src=None, dst=None, mapping=None):
    return OPS.swap_blocks, dict(src=torch.zeros(4, 2, 8) if src is None else src,
                                 dst=torch.zeros(3, 2, 8) if dst is None else dst,
                                 block_mapping=torch.tensor([[0, 0]]) if mapping is None
                                 else mapping)


KC, VC = caches()

# name: (op and arguments, needle of the error message). All metadata-only: no data is read.
BAD = {
    "query rank": (lambda: _attn(query=torch.randn(2, 256)), "query must have 3 dims"),
    "query dtype": (lambda: _attn(query=torch.ones(2, 4, 64, dtype=torch.int32)),
                    "query must be float32, float16 or bfloat16"),
    "query head_size": (lambda: _attn(query=torch.randn(2, 4, 32)), "query.size(2) (head_size)"),
    "query/cache dtype": (lambda: _attn(query=torch.randn(2, 4, 64, dtype=BF16)),
                          "must equal query dtype"),
    "gqa ratio": (lambda: _attn(query=torch.randn(2, 3, 64)), "must be a multiple of"),
    "no heads": (lambda: _attn(query=torch.randn(2, 0, 64)), "at least one head"),
    "key_cache rank": (lambda: _attn(key_cache=KC[0]), "key_cache must have 5 dims"),
    "value_cache rank": (lambda: _attn(value_cache=VC[0]), "value_cache must have 4 dims"),
    "key_cache x": (lambda: _attn(key_cache=KC.reshape(6, 2, 8, 16, 8)), "key_cache.size(4)"),
    "key_cache int": (lambda: _attn(key_cache=KC.int(), value_cache=VC.int()),
                      "key_cache must be float32"),
    "cache dtypes differ": (lambda: _attn(value_cache=VC.to(BF16)), "value_cache dtype"),
    "value head_size": (lambda: _attn(value_cache=VC[:, :, :32]), "value_cache.size(2)"),
    "value kv heads": (lambda: _attn(value_cache=VC[:, :1]), "value_cache.size(1)"),
    "value blocks": (lambda: _attn(value_cache=VC[:5]), "value_cache.size(0)"),
    "block_tables int64": (lambda: _attn(block_tables=torch.zeros(2, 3, dtype=torch.int64)),
                           "block_tables must be int32"),
    "block_tables rank": (lambda: _attn(block_tables=torch.zeros(6, dtype=torch.int32)),
                          "block_tables must have 2 dims"),
    "block_tables rows": (lambda: _attn(block_tables=torch.zeros(1, 3, dtype=torch.int32)),
                          "block_tables.size(0)"),
    "seq_lens int64": (lambda: _attn(seq_lens=torch.ones(2, dtype=torch.int64)),
                       "seq_lens must be int32"),
    "seq_lens shape": (lambda: _attn(seq_lens=torch.ones(3, dtype=torch.int32)),
                       "seq_lens must have shape"),
    "alibi dtype": (lambda: _attn(alibi_slopes=torch.ones(4, dtype=torch.float64)),
                    "alibi_slopes must be float32"),
    "alibi shape": (lambda: _attn(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape"),
    "max_seq_len negative": (lambda: _attn(max_seq_len=-1), "max_seq_len must be >= 0"),
    "fp8 without scales": (lambda: _attn(key_cache=caches(E4M3)[0], value_cache=caches(E4M3)[1]),
                           "k_scale is required"),
    "k_scale shape": (lambda: _attn(k_scale=torch.ones(2)), "k_scale must hold exactly one"),
    "v_scale dtype": (lambda: _attn(v_scale=torch.ones(1, dtype=torch.float64)),
                      "v_scale must be a float32 tensor"),
    "qsl dtype": (lambda: _attn(query_start_loc=torch.tensor([0, 1, 2])),
                  "query_start_loc must be int32"),
    "qsl shape": (lambda: _attn(query_start_loc=torch.zeros(0, dtype=torch.int32)),
                  "query_start_loc must have shape"),
    "qsl vs block_tables": (lambda: _attn(query_start_loc=torch.tensor([0, 2],
                                                                       dtype=torch.int32)),
                            "block_tables.size(0)"),
    "out shape": (lambda: (OPS.attention_out, dict(attention_args(), out=torch.empty(2, 4, 32))),
                  "out must have the shape of query"),
    "out dtype": (lambda: (OPS.attention_out,
                           dict(attention_args(), out=torch.empty(2, 4, 64, dtype=BF16))),
                  "out dtype"),
    "key rank": (lambda: _write(key=torch.randn(3, 128)), "key must have 3 dims"),
    "value rank": (lambda: _write(value=torch.randn(3, 128)), "value must have 3 dims"),
    "key dtype int": (lambda: _write(key=torch.ones(3, 2, 64, dtype=torch.int32)),
                      "key must be float32"),
    "key/value dtypes": (lambda: _write(value=torch.randn(3, 2, 64, dtype=torch.float64)),
                         "value dtype"),
    "key/cache dtype": (lambda: _write(key=torch.randn(3, 2, 64, dtype=BF16),
                                       value=torch.randn(3, 2, 64, dtype=BF16)),
                        "must equal key dtype"),
    "key heads": (lambda: _write(key=torch.randn(3, 1, 64)), "key must have shape"),
    "write value head_size": (lambda: _write(value=torch.randn(3, 2, 32)),
                              "value must have shape"),
    "slot_mapping int32": (lambda: _write(slot_mapping=torch.tensor([0, 1, 2],
                                                                    dtype=torch.int32)),
                           "slot_mapping must be int64"),
    "slot_mapping 2d": (lambda: _write(slot_mapping=torch.tensor([[0, 1, 2]])),
                        "slot_mapping must have 1 dim"),
    "slot_mapping too long": (lambda: _write(slot_mapping=torch.arange(4)), "slot_mapping has 4"),
    "write fp8 without scales": (lambda: _write(key_cache=caches(E4M3)[0],
                                                value_cache=caches(E4M3)[1]),
                                 "k_scale is required"),
    "copy layer count": (lambda: _copy(n_v=1), "value_caches has 1"),
    "copy mapping int32": (lambda: _copy(mapping=torch.tensor([[0, 1]], dtype=torch.int32)),
                           "block_mapping must be int64"),
    "copy mapping shape": (lambda: _copy(mapping=torch.tensor([0, 1])),
                           "block_mapping must have shape [n, 2]"),
    "copy layer shape": (lambda: _copy(second=caches(num_blocks=3)), "key_caches[1] shape"),
    "copy layer dtype": (lambda: _copy(second=caches(BF16, num_blocks=4, head_size=64)),
                         "key_caches[1] dtype"),
    "copy layer pair": (lambda: _copy(second=(KC[:4], VC[:3])), "value_caches[1].size(0)"),
    "swap rank": (lambda: _swap(dst=torch.zeros(3, 16)), "dst must have as many dims"),
    "swap dtype": (lambda: _swap(dst=torch.zeros(3, 2, 8, dtype=torch.float64)), "dst dtype"),
    "swap block shape": (lambda: _swap(dst=torch.zeros(3, 2, 4)), "same block shape"),
    "swap mapping dtype": (lambda: _swap(mapping=torch.tensor([[0.0, 0.0]])),
                           "block_mapping must be int64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_fake_rejects_what_the_real_op_rejects(case):
    make, needle = BAD[case]
    op, args = make()
    with pytest.raises(RuntimeError, match=re.escape(needle)):
        op(**args)  # the real op (CPU)
    op, args = make()
    with pytest.raises(RuntimeError, match=re.escape(needle)):
        fake_call(op, args)


@pytest.mark.parametrize("name", ["key_cache", "block_tables", "seq_lens", "alibi_slopes",
                                  "query_start_loc", "k_scale", "out"])
def test_fake_rejects_an_argument_on_another_device(name):
    a = attention_args(cache_dtype=E4M3)
    a.update(alibi_slopes=torch.rand(4), query_start_loc=torch.tensor([0, 1, 2],
                                                                      dtype=torch.int32),
             k_scale=torch.ones(1), v_scale=torch.ones(1), out=torch.empty(2, 4, 64))
    # Everything on "cuda" but `name` (the caches as a pair) on the CPU.
    on_cpu = {"key_cache": ("key_cache", "value_cache")}.get(name, (name,))
    ref = "the caches" if name == "k_scale" else "query"
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v).to("cuda") if isinstance(v, torch.Tensor) else v
             for k, v in a.items()}
        for k in on_cpu:
            f[k] = f[k].cpu()
        with pytest.raises(RuntimeError,
                           match=re.escape(f"{name} must be on the same device as {ref}")):
            OPS.attention_out(**f)


@pytest.mark.parametrize("name", ["value", "key_cache", "slot_mapping"])
def test_fake_cache_write_rejects_another_device(name):
    a = cache_write_args()
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in a.items()}
        f[name] = f[name].to("cuda")
        if name == "key_cache":
            f["value_cache"] = f["value_cache"].to("cuda")
        with pytest.raises(RuntimeError, match=re.escape(f"{name} must be on the same device")):
            OPS.reshape_and_cache(**f)


def test_fake_swap_rejects_a_device_mapping():
    with FakeTensorMode():
        src, dst = torch.zeros(4, 2, 8, device="cuda"), torch.zeros(3, 2, 8)
        with pytest.raises(RuntimeError, match="must be a CPU tensor"):
            OPS.swap_blocks(src, dst, torch.tensor([[0, 0]], device="cuda"))


def test_compile_reports_a_bad_argument_while_tracing():
    # fullgraph + dynamic: the fake runs on symbolic shapes and still names the bad argument.
    torch._dynamo.reset()
    a = attention_args()
    a["block_tables"] = a["block_tables"].long()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(query, key_cache, value_cache, block_tables, seq_lens):
        return OPS.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125) * 2

    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        f(a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"])
    a["block_tables"] = a["block_tables"].int()
    out = f(a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"])
    assert out.shape == a["query"].shape
