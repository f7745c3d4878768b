"""A short decode loop over a paged KV cache: ``python -m paged_ops.demo``.

Several sequences of different lengths share one block pool. Each step writes the new token's
key/value with ``reshape_and_cache`` and attends with ``torch.ops.paged.attention``; the demo
prints the block tables and tail waste and checks the paged output against dense attention over
each sequence's own keys/values.
"""

from __future__ import annotations

import math

import torch

import paged_ops


def run_decode_demo(device: str = "cpu", steps: int = 8, block_size: int = 16) -> float:
    torch.manual_seed(0)
    dtype = torch.float32
    num_heads, num_kv_heads, head_size = 8, 2, 64
    prompt_lens = [5, 16, 33, 70]
    num_blocks = 64
    key_cache, value_cache = paged_ops.allocate_kv_cache(num_blocks, num_kv_heads, head_size,
                                                         block_size, dtype, device)
    key_cache.fill_(float("nan"))  # unwritten slots must never be read
    value_cache.fill_(float("nan"))
    free = torch.randperm(num_blocks).tolist()  # scattered physical blocks
    tables = [[] for _ in prompt_lens]
    dense_k = [torch.empty(0, num_kv_heads, head_size, device=device) for _ in prompt_lens]
    dense_v = [torch.empty(0, num_kv_heads, head_size, device=device) for _ in prompt_lens]
    lens = [0] * len(prompt_lens)

    def write(seq: int, n: int) -> None:
        slots = []
        for _ in range(n):
            pos = lens[seq]
            if pos % block_size == 0:
                tables[seq].append(free.pop())
            slots.append(tables[seq][pos // block_size] * block_size + pos % block_size)
            lens[seq] += 1
        k = torch.randn(n, num_kv_heads, head_size, device=device)
        v = torch.randn(n, num_kv_heads, head_size, device=device)
        paged_ops.reshape_and_cache(k, v, key_cache, value_cache,
                                    torch.tensor(slots, dtype=torch.int64, device=device))
        dense_k[seq] = torch.cat([dense_k[seq], k])
        dense_v[seq] = torch.cat([dense_v[seq], v])

    for s, n in enumerate(prompt_lens):
        write(s, n)
    worst = 0.0
    for step in range(steps):
        for s in range(len(prompt_lens)):
            write(s, 1)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                    dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        query = torch.randn(len(lens), num_heads, head_size, device=device)
        out = torch.ops.paged.attention(query, key_cache, value_cache, block_tables, seq_lens,
                                        head_size**-0.5)
        group = num_heads // num_kv_heads
        for s in range(len(lens)):
            k = dense_k[s].repeat_interleave(group, dim=1).transpose(0, 1)
            v = dense_v[s].repeat_interleave(group, dim=1).transpose(0, 1)
            ref = torch.nn.functional.scaled_dot_product_attention(
                query[s].unsqueeze(1), k, v).squeeze(1)
            worst = max(worst, (out[s] - ref).abs().max().item())
        if step in (0, steps - 1):
            print(f"step {step}: seq_lens {lens}")
            for s, t in enumerate(tables):
                waste = len(t) * block_size - lens[s]
                print(f"  seq {s}: block_table {t}  tail waste {waste} slots")
    used = sum(len(t) for t in tables)
    waste = sum(len(t) * block_size - n for t, n in zip(tables, lens))
    contiguous = len(lens) * math.ceil(max(lens) / block_size) * block_size
    print(f"blocks in use {used}/{num_blocks}, tail waste {waste} slots "
          f"({100 * waste / (used * block_size):.1f}% of allocated); a contiguous max-length "
          f"layout would reserve {contiguous} slots vs {used * block_size} paged")
    print(f"paged attention vs dense attention: max abs difference {worst:.2e} "
          f"-> {'MATCH' if worst < 1e-4 else 'MISMATCH'}")
    return worst


def main() -> None:
    device = "cuda" if torch.cuda.is_available() and paged_ops.built_with_cuda() else "cpu"
    print(f"paged_ops demo on {device} (CPU kernel: {paged_ops.cpu_kernel_variant()}, "
          f"CUDA kernels built: {paged_ops.built_with_cuda()})")
    worst = run_decode_demo(device)
    if worst >= 1e-4:
        raise SystemExit("paged attention does not match dense attention")


if __name__ == "__main__":
    main()
