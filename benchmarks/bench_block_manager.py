"""Host-side cost of the BlockManager bookkeeping.

Measures, with 10^4 live sequences in the pool:
  * allocate / fork / append_slots / free: operations per second;
and the bookkeeping of one decode step for a batch of sequences (default 256): append one
slot to each (append_slots_batch) and build the three op inputs (block tables, seq lens,
slot mapping) as CPU tensors; the target is < 1 ms.

Usage: python benchmarks/bench_block_manager.py [--csv out.csv] [--repeat N] [--batch 256]
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
import time

from paged_ops.block_manager import BlockManager


def best_of(fn, repeat):
    """Median and best wall time of fn() over `repeat` runs (seconds)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def populated(num_seqs, block_size, mean_len, *, caching=False, seed=0):
    """A manager holding num_seqs live sequences of random lengths around mean_len."""
    rng = random.Random(seed)
    lens = [rng.randint(mean_len // 2, mean_len * 3 // 2) for _ in range(num_seqs)]
    blocks = sum(-(-n // block_size) for n in lens)
    bm = BlockManager(blocks * 2 + 1024, block_size, enable_prefix_caching=caching)
    for i, n in enumerate(lens):
        bm.allocate(i, n)
    return bm


def bench_ops(num_seqs, block_size, mean_len, repeat, n_ops):
    """Ops/s of allocate, fork, append_slots (1 token), free, with num_seqs already live."""
    rows = []

    def run(name, setup, op):
        per_op = []
        for _ in range(repeat):
            bm, ids = setup()
            t0 = time.perf_counter()
            op(bm, ids)
            per_op.append((time.perf_counter() - t0) / len(ids))
        med = statistics.median(per_op)
        rows.append((name, len(ids), 1.0 / med, med * 1e6))

    rng = random.Random(1)

    def setup_new():
        bm = populated(num_seqs, block_size, mean_len)
        return bm, [("new", i) for i in range(n_ops)]

    def setup_existing():
        bm = populated(num_seqs, block_size, mean_len)
        return bm, rng.sample(range(num_seqs), n_ops)

    lens = [rng.randint(mean_len // 2, mean_len * 3 // 2) for _ in range(n_ops)]

    def do_allocate(bm, ids):
        for sid, n in zip(ids, lens, strict=True):
            bm.allocate(sid, n)

    def do_fork(bm, ids):
        for sid in ids:
            bm.fork(sid, ("child", sid))

    def do_append(bm, ids):
        for sid in ids:
            bm.append_slots(sid)

    def do_free(bm, ids):
        for sid in ids:
            bm.free(sid)

    run("allocate", setup_new, do_allocate)
    run("fork", setup_existing, do_fork)
    run("append_slots (1 token)", setup_existing, do_append)
    run("free", setup_existing, do_free)

    def setup_cow():
        bm = populated(num_seqs, block_size, mean_len)
        ids = [i for i in rng.sample(range(num_seqs), n_ops) if bm.seq_len(i) % block_size]
        for i in ids:
            bm.fork(i, ("child", i))
        return bm, ids

    run("append_slots (CoW)", setup_cow, do_append)

    def setup_prefix():
        bm = populated(num_seqs, block_size, mean_len, caching=True)
        prompt = list(range(mean_len))
        bm.allocate("seed", mean_len, prompt)
        return bm, [("hit", i) for i in range(n_ops)]

    def do_prefix(bm, ids):
        prompt = list(range(mean_len))
        for sid in ids:
            bm.allocate(sid, mean_len, prompt)

    run(f"allocate (prefix hit, {mean_len} tok)", setup_prefix, do_prefix)
    return rows


def bench_decode_step(num_seqs, batch, block_size, mean_len, repeat):
    """One decode step's bookkeeping for `batch` running sequences out of num_seqs live."""
    bm = populated(num_seqs, block_size, mean_len)
    running = list(range(batch))
    steps = {}

    def append():
        bm.append_slots_batch(running)

    def tables():
        bm.block_tables_tensor(running)

    def lens():
        bm.seq_lens_tensor(running)

    def slots():
        bm.slot_mapping_tensor(running)

    def whole_step():
        cow = bm.append_slots_batch(running)
        if cow:
            bm.block_mapping_tensor(cow)
        bm.block_tables_tensor(running)
        bm.seq_lens_tensor(running)
        bm.slot_mapping_tensor(running)

    def per_seq_append():
        for s in running:
            bm.append_slots(s)

    for name, fn in [
        ("append_slots_batch", append),
        ("append_slots x batch (one call each)", per_seq_append),
        ("block_tables_tensor", tables),
        ("seq_lens_tensor", lens),
        ("slot_mapping_tensor", slots),
        ("whole decode step", whole_step),
    ]:
        fn()  # warm up
        steps[name] = best_of(fn, repeat)
    width = bm.block_tables_tensor(running).shape[1]
    return steps, width


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=10_000, help="live sequences (10^4)")
    ap.add_argument("--batch", type=int, default=256, help="decode batch size")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mean-len", type=int, default=512, help="mean sequence length")
    ap.add_argument("--ops", type=int, default=2000, help="operations timed per kind")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--csv", help="also write the results to this CSV file")
    args = ap.parse_args(argv)

    print(
        f"BlockManager bookkeeping: {args.num_seqs} live sequences, block_size "
        f"{args.block_size}, mean length {args.mean_len}, Python {sys.version.split()[0]}"
    )
    rows = bench_ops(args.num_seqs, args.block_size, args.mean_len, args.repeat, args.ops)
    print(f"\n{'operation':<36} {'ops/s':>12} {'us/op':>9}")
    for name, _, ops, us in rows:
        print(f"{name:<36} {ops:>12,.0f} {us:>9.2f}")

    results = [("ops", name, ops, us) for name, _, ops, us in rows]
    for mean_len in sorted({args.mean_len, 128, 2048}):
        steps, width = bench_decode_step(
            args.num_seqs, args.batch, args.block_size, mean_len, args.repeat * 20
        )
        print(
            f"\ndecode step, batch {args.batch}, mean length {mean_len} "
            f"(block table width {width}):"
        )
        print(f"{'part':<36} {'median us':>10} {'best us':>9}")
        for name, (med, best) in steps.items():
            print(f"{name:<36} {med * 1e6:>10.1f} {best * 1e6:>9.1f}")
            results.append((f"decode_len{mean_len}", name, med * 1e6, best * 1e6))
        total = steps["whole decode step"][0] * 1e3
        verdict = "OK" if total < 1.0 else "over"
        print(f"whole step: {total:.3f} ms (target < 1 ms: {verdict})")

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["group", "name", "value_a", "value_b"])
            w.writerows(results)
        print(f"\nwrote {args.csv} (ops: ops/s, us/op; decode: median us, best us)")


if __name__ == "__main__":
    main()
