"""Bad input: a RuntimeError naming the argument, raised before any write (caches unchanged)."""

import re

import pytest
import torch

import paged_ops
from tests.helpers import make_paged, random_query

F32, BF16 = torch.float32, torch.bfloat16


def base():
    pg = make_paged([5, 20], 2, 64, 16, F32)
    return dict(query=random_query(2, 4, 64, F32), key_cache=pg.key_cache,
                value_cache=pg.value_cache, block_tables=pg.block_tables,
                seq_lens=pg.seq_lens)


def attn(**over):
    a = base()
    a.update(over.pop("args", {}))
    return lambda: paged_ops.paged_attention(a["query"], a["key_cache"], a["value_cache"],
                                             a["block_tables"], a["seq_lens"], **over)


B = base()
KC, VC = B["key_cache"], B["value_cache"]

ATTENTION_CASES = {
    "query rank": (dict(args=dict(query=torch.randn(2, 256))), "query"),
    "query dtype int": (dict(args=dict(query=torch.ones(2, 4, 64, dtype=torch.int32))), "query"),
    "query head_size": (dict(args=dict(query=torch.randn(2, 4, 32))), "head_size"),
    "query last dim strided": (dict(args=dict(query=torch.randn(2, 4, 128)[..., ::2])),
                               "query"),
    "query/cache dtype": (dict(args=dict(query=torch.randn(2, 4, 64, dtype=BF16))), "dtype"),
    "gqa ratio": (dict(args=dict(query=torch.randn(2, 3, 64))), "num_kv_heads"),
    "key_cache rank": (dict(args=dict(key_cache=KC.reshape(KC.shape[0], 2, 16, 64))),
                       "key_cache"),
    "value_cache rank": (dict(args=dict(value_cache=VC.reshape(VC.shape[0], -1))),
                         "value_cache"),
    "x mismatch": (dict(args=dict(key_cache=KC.reshape(KC.shape[0], 2, 8, 16, 8))),
                   "key_cache.size(4)"),
    "value head_size": (dict(args=dict(value_cache=VC[:, :, :32])), "value_cache"),
    "value block_size": (dict(args=dict(value_cache=VC.reshape(VC.shape[0], 2, 128, 8))),
                         "value_cache"),
    "kv heads mismatch": (dict(args=dict(value_cache=VC[:, :1])), "value_cache"),
    "cache inner strided": (dict(args=dict(key_cache=KC.transpose(3, 4).contiguous()
                                           .transpose(3, 4))), "key_cache"),
    "cache dtypes differ": (dict(args=dict(value_cache=VC.to(BF16))), "value_cache"),
    "block_tables int64": (dict(args=dict(block_tables=B["block_tables"].long())),
                           "block_tables"),
    "block_tables rank": (dict(args=dict(block_tables=B["block_tables"].flatten())),
                          "block_tables"),
    "block_tables rows": (dict(args=dict(block_tables=B["block_tables"][:1])), "block_tables"),
    "seq_lens int64": (dict(args=dict(seq_lens=B["seq_lens"].long())), "seq_lens"),
    "seq_lens shape": (dict(args=dict(seq_lens=torch.tensor([5], dtype=torch.int32))),
                       "seq_lens"),
    "seq_lens negative": (dict(args=dict(seq_lens=torch.tensor([5, -1], dtype=torch.int32))),
                          "seq_lens"),
    "seq_lens beyond table": (dict(args=dict(seq_lens=torch.tensor([5, 10**6],
                                                                   dtype=torch.int32))),
                              "seq_lens"),
    "block id out of range": (dict(args=dict(block_tables=torch.tensor(
        [[10**6, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32))), "block_tables"),
    "negative block id": (dict(args=dict(block_tables=torch.tensor(
        [[1, 0, 0, 0], [2, -3, 0, 0]], dtype=torch.int32))), "block_tables"),
    "max_seq_len exceeded": (dict(max_seq_len=10), "max_seq_len"),
    "max_seq_len negative": (dict(max_seq_len=-1), "max_seq_len"),
    "alibi dtype": (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes"),
    "alibi shape": (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    "scale nan": (dict(scale=float("nan")), "scale"),
    "soft cap inf": (dict(logits_soft_cap=float("inf")), "logits_soft_cap"),
    "k_scale shape": (dict(k_scale=torch.ones(2)), "k_scale"),
    "out dtype": (dict(out=torch.empty(2, 4, 64, dtype=BF16)), "out"),
    "out shape": (dict(out=torch.empty(2, 4, 32)), "out"),
    "fp8 cache": (dict(args=dict(key_cache=KC.to(torch.float8_e4m3fn).reshape(
        KC.shape[0], 2, 4, 16, 16), value_cache=VC.to(torch.float8_e4m3fn))), "fp8"),
    "query without heads": (dict(args=dict(query=torch.randn(2, 0, 64))), "head"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_bad_input(case):
    over, needle = ATTENTION_CASES[case]
    over = dict(over)
    fn = attn(**over)
    out = over.get("out")
    before = out.clone() if out is not None else None
    with pytest.raises(RuntimeError, match=re.escape(needle)):
        fn()
    if out is not None:
        assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


def cache_args():
    kc, vc = paged_ops.allocate_kv_cache(4, 2, 64, 16, F32)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    return dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64), key_cache=kc,
                value_cache=vc, slot_mapping=torch.tensor([0, 5, 63]))


RESHAPE_CASES = {
    "slot out of range": (dict(slot_mapping=torch.tensor([0, 64, 1])), "slot_mapping"),
    "slot out of range last": (dict(slot_mapping=torch.tensor([0, 1, 10**9])), "slot_mapping"),
    "slot_mapping int32": (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)),
                           "slot_mapping"),
    "slot_mapping 2d": (dict(slot_mapping=torch.tensor([[0, 1, 2]])), "slot_mapping"),
    "slot_mapping longer than key": (dict(slot_mapping=torch.arange(4)), "slot_mapping"),
    "key rank": (dict(key=torch.randn(3, 128)), "key"),
    "key heads": (dict(key=torch.randn(3, 1, 64)), "key"),
    "value head_size": (dict(value=torch.randn(3, 2, 32)), "value"),
    "key dtype": (dict(key=torch.randn(3, 2, 64, dtype=BF16),
                       value=torch.randn(3, 2, 64, dtype=BF16)), "dtype"),
    "key/value dtypes differ": (dict(value=torch.randn(3, 2, 64, dtype=torch.float64)),
                                "value"),
    "key last dim strided": (dict(key=torch.randn(3, 2, 128)[..., ::2]), "key"),
    "value_cache shape": (dict(value_cache=torch.zeros(4, 2, 64, 8)), "value_cache"),
    "v_scale dtype": (dict(v_scale=torch.ones(1, dtype=torch.float64)), "v_scale"),
}


@pytest.mark.parametrize("case", list(RESHAPE_CASES))
def test_reshape_and_cache_bad_input_leaves_caches_unchanged(case):
    a = cache_args()
    a.update(RESHAPE_CASES[case][0])
    kc0, vc0 = a["key_cache"].clone(), a["value_cache"].clone()
    with pytest.raises(RuntimeError, match=re.escape(RESHAPE_CASES[case][1])):
        torch.ops.paged.reshape_and_cache(a["key"], a["value"], a["key_cache"],
                                          a["value_cache"], a["slot_mapping"],
                                          a.get("k_scale"), a.get("v_scale"))
    torch.testing.assert_close(a["key_cache"], kc0, equal_nan=True, atol=0, rtol=0)
    if a["value_cache"].shape == vc0.shape:
        torch.testing.assert_close(a["value_cache"], vc0, equal_nan=True, atol=0, rtol=0)


def layers(n=2):
    out = [paged_ops.allocate_kv_cache(4, 2, 32, 8, F32) for _ in range(n)]
    for kc, vc in out:
        kc.copy_(torch.randn(kc.shape))
        vc.copy_(torch.randn(vc.shape))
    return [kc for kc, _ in out], [vc for _, vc in out]


COPY_CASES = {
    "mapping dst out of range": (lambda k, v: (k, v, torch.tensor([[0, 1], [2, 4]])),
                                 "block_mapping"),
    "mapping negative src": (lambda k, v: (k, v, torch.tensor([[0, 1], [-1, 2]])),
                             "block_mapping"),
    "mapping shape": (lambda k, v: (k, v, torch.tensor([0, 1])), "block_mapping"),
    "mapping int32": (lambda k, v: (k, v, torch.tensor([[0, 1]], dtype=torch.int32)),
                      "block_mapping"),
    "mapping chained (dst read later)": (lambda k, v: (k, v, torch.tensor([[0, 1], [1, 2]])),
                                         "block_mapping[1] reads"),
    "mapping chained (dst read earlier)": (lambda k, v: (k, v, torch.tensor([[1, 2], [0, 1]])),
                                           "block_mapping[0] reads"),
    "mapping dst twice": (lambda k, v: (k, v, torch.tensor([[0, 3], [1, 2], [1, 3]])),
                          "both write block 3"),
    "layer count": (lambda k, v: (k, v[:1], torch.tensor([[0, 1]])), "value_caches"),
    "layer shape": (lambda k, v: (k[:1] + [k[1][:2]], v[:1] + [v[1][:2]],
                                  torch.tensor([[0, 1]])), "key_caches"),
}


@pytest.mark.parametrize("case", list(COPY_CASES))
def test_copy_blocks_bad_input_changes_nothing(case):
    kcs, vcs = layers()
    before = [t.clone() for t in kcs + vcs]
    k, v, m = COPY_CASES[case][0](kcs, vcs)
    with pytest.raises(RuntimeError, match=re.escape(COPY_CASES[case][1])):
        torch.ops.paged.copy_blocks(k, v, m)
    for a, b in zip(kcs + vcs, before):
        assert torch.equal(a, b)


SWAP_CASES = {
    "dst id out of range": (lambda s, d: (s, d, torch.tensor([[0, 0], [1, 3]])),
                            "block_mapping"),
    "src id out of range": (lambda s, d: (s, d, torch.tensor([[8, 0]])), "block_mapping"),
    "block shape": (lambda s, d: (s, d[:, :1], torch.tensor([[0, 0]])), "block shape"),
    "dtype": (lambda s, d: (s, d.double(), torch.tensor([[0, 0]])), "dtype"),
    "mapping dtype": (lambda s, d: (s, d, torch.tensor([[0.0, 0.0]])), "block_mapping"),
    "dst inner strided": (lambda s, d: (s, d.transpose(1, 2), torch.tensor([[0, 0]])), "dst"),
}


@pytest.mark.parametrize("case", list(SWAP_CASES))
def test_swap_blocks_bad_input_changes_nothing(case):
    src = torch.randn(8, 4, 4)
    dst = torch.zeros(3, 4, 4)
    s, d, m = SWAP_CASES[case][0](src, dst)
    before = d.clone()
    with pytest.raises(RuntimeError, match=re.escape(SWAP_CASES[case][1])):
        torch.ops.paged.swap_blocks(s, d, m)
    assert torch.equal(d, before) and (dst == 0).all()


def test_catalogue_size():
    assert len(ATTENTION_CASES) + len(RESHAPE_CASES) + len(COPY_CASES) + len(SWAP_CASES) >= 25
