"""On-host tuner of the CPU attention kernel: measures, per key (query dtype, cache dtype, block
size, head size, GQA group), the kernel's candidate plans on this machine and writes the
fastest to the plan file (paged_ops.plan_cache_path()), which import reads.

    python -m paged_ops.tune                                   # 32 q / 8 kv heads, head size 128
    python -m paged_ops.tune --q-heads 32 --kv-heads 8 --head-size 128 \\
        --dtypes bf16,fp8_e4m3 --block-sizes 16,128
    python -m paged_ops.tune --quick                           # fewer rounds, smaller caches

The candidates of a key are raced in stages, each against the best so far (the rules first):
the builds this CPU runs (with the rules' paths), the q.k x p.v paths open to the key on the
winning build, where the next blocks' key lines are split between q.k and p.v, all of them
over q.k, the blocks per softmax step, then no prefetching; last, the winner races the
rules once more, in twice the rounds, and is kept only if it wins again. Every race
interleaves its candidates in rounds (every other round in reverse order) and compares each
candidate with the best so far round by round: a candidate replaces it only when the median
of its per-round time ratios is 3% below and it is faster in most rounds. Memory bandwidth on
a shared host drifts over seconds, so only times taken in the same round are compared. The
calls are decode steps (--batch sequences of --context tokens) whose caches are cycled over
layer copies totalling --gib GiB, so K and V come from DRAM, as in a model. The table printed
per key gives each candidate's time, GB/s (K and V read once per call) and share of the
roofline: min(read bandwidth, fp32 GEMM rate x cache bytes per flop of the call), both
measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

import paged_ops
from paged_ops import _plans

CACHE_DTYPES = dict(_plans.DTYPES_BY_NAME)
MARGIN = 0.97  # a candidate replaces the best so far when its median per-round time ratio
#                to it is below this


# --- Roofline --------------------------------------------------------------------------------

def read_bandwidth_gbs(t: torch.Tensor, reps: int = 3) -> float:
    """Read bandwidth (GB/s): the best of ``reps`` torch.sum over ``t`` (sized beyond the
    last-level cache)."""
    f = t.view(torch.float32) if t.dtype == torch.uint8 else t
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        f.sum()
        best = min(best, time.perf_counter() - t0)
    return f.numel() * f.element_size() / best / 1e9


def gemm_gflops(min_time: float = 0.1, n: int = 512, dtype: torch.dtype = torch.float32) -> float:
    """The FMA rate (GFLOP/s) of this process's threads: torch.mm of n x n matrices (in the
    caches), the best of a few timings of ``min_time`` seconds in all. ``dtype`` fp32: the rate
    of the kernel's fp32 paths; bf16: of its bf16-pair paths (BF16_QK_PATHS, BF16_PV_PATHS),
    which oneDNN's bf16 GEMM runs on the same instructions (vdpbf16ps, AMX tiles)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=c)
    best, spent = math.inf, 0.0
    while spent < min_time:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=c)
        dt = (time.perf_counter() - t0) / 4
        spent += 4 * dt
        best = min(best, dt)
    return 2 * n**3 / best / 1e9


# The q.k and p.v paths (cpu_plan's names) that multiply bf16 pairs, two multiply-adds per fp32
# lane: their compute roof is the bf16 GEMM's rate, the other paths' the fp32 GEMM's.
BF16_QK_PATHS = frozenset({"dot_bf16", "amx"})
BF16_PV_PATHS = frozenset({"dot", "amx"})


def bf16_phases(paths: tuple) -> tuple:
    """(q.k, p.v): whether each phase of ``paths`` = (qk_path, pv_path) multiplies bf16 pairs,
    and so runs at the bf16 GEMM's rate."""
    return paths[0] in BF16_QK_PATHS, paths[1] in BF16_PV_PATHS


def bytes_per_flop(cache_dtype: torch.dtype, group: int) -> float:
    """Cache bytes a decode call reads per flop: each K and V element (esize bytes) takes a
    multiply-add (2 flops) per query head of its group, for q.k and for p.v alike."""
    return torch.empty((), dtype=cache_dtype).element_size() / (2 * group)


def roofline_gbs(bw_gbs: float, gflops: float, cache_dtype: torch.dtype, group: int,
                 bf16_gflops: float | None = None, paths: tuple | None = None) -> float:
    """The highest GB/s a decode call can reach: min(read bandwidth, what its arithmetic
    allows). q.k (on K, half the bytes) and p.v (on V) each do the multiply-adds of
    bytes_per_flop at the rate of their path, ``paths`` = (qk_path, pv_path) as cpu_plan names
    them: ``bf16_gflops`` for the bf16-pair paths, ``gflops`` (fp32) for the others and where
    no paths or bf16 rate are given."""
    qk_rate = pv_rate = gflops
    if paths is not None and bf16_gflops:
        qk_rate, pv_rate = (bf16_gflops if b else gflops for b in bf16_phases(paths))
    # Seconds per byte: half the bytes at each phase's rate.
    compute_gbs = 2 * bytes_per_flop(cache_dtype, group) / (1 / qk_rate + 1 / pv_rate)
    return min(bw_gbs, compute_gbs)


# --- Workload ---------------------------------------------------------------------------------

class Workload:
    """Decode calls over caches cycled through layer copies in one buffer of ``gib`` GiB, filled
    with bytes 0x30-0x3F: positive normal numbers in every cache dtype (no NaN, no
    subnormals)."""

    def __init__(self, gib: float, batch: int, context: int, seed: int = 0):
        self.batch, self.context = batch, context
        n = max(int(gib * 2**30) // 2**20, 1) * 2**20
        self.buf = torch.empty(n, dtype=torch.uint8)
        # Huge pages, as allocate_kv_cache's caches; the bandwidth probe reads this buffer too.
        paged_ops.advise_huge_pages(self.buf)
        g = torch.Generator().manual_seed(seed)
        chunk = torch.randint(0x30, 0x40, (2**20,), dtype=torch.uint8, generator=g)
        self.buf.view(-1, 2**20).copy_(chunk)
        self.i = 0
        self.key = None

    def set_key(self, key, num_heads: int, num_kv_heads: int) -> None:
        dtype, cache_dtype, bs, D, _ = key
        esize = torch.empty((), dtype=cache_dtype).element_size()
        x = 16 // esize
        B, L = self.batch, self.context
        per_seq = (L + bs - 1) // bs
        nblocks = B * per_seq
        half = nblocks * num_kv_heads * D * bs * esize
        layer = 2 * ((half + 4095) // 4096 * 4096)
        n_layers = max(1, self.buf.numel() // layer)
        if n_layers < 2:
            raise ValueError(f"--gib {self.buf.numel() / 2**30:.3f} holds {n_layers} layer(s) of "
                             f"{layer / 2**20:.1f} MiB; give it at least two")
        self.layers = []
        for i in range(n_layers):
            base = i * layer
            kc = self.buf[base:base + half].view(cache_dtype).view(
                nblocks, num_kv_heads, D // x, bs, x)
            vc = self.buf[base + layer // 2:base + layer // 2 + half].view(cache_dtype).view(
                nblocks, num_kv_heads, D, bs)
            self.layers.append((kc, vc))
        g = torch.Generator().manual_seed(bs)
        self.bt = torch.randperm(nblocks, generator=g).to(torch.int32).view(B, per_seq)
        self.sl = torch.full((B,), L, dtype=torch.int32)
        self.q = torch.randn(B, num_heads, D, generator=g).to(dtype)
        self.out = torch.empty_like(self.q)
        fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.ks = torch.ones(1) if fp8 else None
        self.vs = torch.ones(1) if fp8 else None
        self.scale = D**-0.5
        self.nbytes = 2 * B * L * num_kv_heads * D * esize  # K and V read per call
        self.key = key

    def call(self) -> None:
        kc, vc = self.layers[self.i % len(self.layers)]
        self.i += 1
        torch.ops.paged.attention_out(self.out, self.q, kc, vc, self.bt, self.sl, self.scale,
                                      None, -1, 0.0, self.ks, self.vs, self.context)


# --- Candidates -------------------------------------------------------------------------------

def _label(build, knobs, d) -> str:
    forced = _plans.forced_knobs(knobs)
    what = (f"{d['qk_path']}/{d['pv_path']} g{d['blocks_per_group']}"
            + ("" if (knobs or {}).get("prefetch") is not False else " nopf")
            + (" ksplit" if d["split_key_prefetch"] else ""))
    return f"{build:11s} {what:26s} {'rules' if not forced else 'plan'}"


class Candidate:
    def __init__(self, build, table, knobs, d):
        self.build, self.table, self.knobs, self.d = build, table, knobs, d
        self.times: list[float] = []
        self.label = _label(build, knobs, d)

    def effective(self):
        return (self.build, self.d["qk_path"], self.d["pv_path"], self.d["blocks_per_group"],
                self.d["staged_block_size"], (self.knobs or {}).get("prefetch") is not False,
                self.d["split_key_prefetch"])

    def median(self) -> float:
        return statistics.median(self.times)


def _candidate(build, key, knobs):
    table = paged_ops._table_pointer(build)
    knobs = _plans.check_knobs(knobs or {})
    return Candidate(build, table, knobs, _plans.describe(paged_ops._C_LIB, table, key, knobs))


def _dedupe(cands):
    seen, out = set(), []
    for c in cands:
        if c.effective() not in seen:
            seen.add(c.effective())
            out.append(c)
    return out


def _race(w: Workload, cands, rounds: int, calls: int, incumbent: Candidate):
    """Times the candidates (the incumbent among them) in interleaved rounds; returns the
    winner: the candidate with the lowest median per-round time ratio to the incumbent where
    that median is below MARGIN and the candidate is faster in most rounds, else the
    incumbent. Every candidate's times are this race's only."""
    key = w.key
    for c in cands:  # warm: the threads' scratch grows on a first call
        c.times = []
        _plans.install(paged_ops._C_LIB, [(key, c.table, c.knobs)])
        w.call()
    for r in range(rounds):
        for c in cands if r % 2 == 0 else cands[::-1]:
            _plans.install(paged_ops._C_LIB, [(key, c.table, c.knobs)])
            t0 = time.perf_counter()
            for _ in range(calls):
                w.call()
            c.times.append((time.perf_counter() - t0) / calls)
    best, best_ratio = incumbent, 1.0
    for c in cands:
        if c is incumbent:
            continue
        ratios = [a / b for a, b in zip(c.times, incumbent.times)]
        ratio = statistics.median(ratios)
        if ratio < MARGIN and 2 * sum(x < 1 for x in ratios) > len(ratios) and ratio < best_ratio:
            best, best_ratio = c, ratio
    return best


def tune_key(w: Workload, key, num_heads: int, num_kv_heads: int, builds, rounds: int,
             calls: int):
    """Races the candidates of ``key``; returns (plans: the winner's, one; every candidate
    timed, in the order raced; the rules' candidate; the winner). Only the winner is written:
    times from different races are not comparable, so a plan's time per call says nothing
    about another build's."""
    w.set_key(key, num_heads, num_kv_heads)
    rules_build = paged_ops.cpu_kernel_variant(key[2], key[1])
    rules = _candidate(rules_build, key, None)
    timed = []
    # Stage 1: the builds, each with its rules (the AMX build only where it takes AMX tiles:
    # elsewhere it runs the avx512_bf16 build's code).
    stage = [rules]
    for b in builds:
        if b == rules_build:
            continue
        c = _candidate(b, key, None)
        if b == "avx512_amx" and "amx" not in c.d["qk_valid"]:
            continue
        stage.append(c)
    winner = _race(w, stage, rounds, calls, rules)
    timed += stage
    # Stage 2: the q.k x p.v paths open to the key on the winning build.
    b = winner.build
    stage = [winner]
    for qk in winner.d["qk_valid"]:
        for pv in winner.d["pv_valid"]:
            c = _candidate(b, key, {"qk_path": qk, "pv_path": pv})
            if c.d["qk_path"] == qk and c.d["pv_path"] == pv:  # both honoured together
                stage.append(c)
    stage = _dedupe(stage)
    if len(stage) > 1:
        winner = _race(w, stage, rounds, calls, winner)
        timed += stage[1:]
    # Stage 3: where the next key lines are split between q.k and p.v, all of them over q.k;
    # before the groups, whose best size depends on how the prefetches go out.
    if winner.d["split_key_prefetch"]:
        c = _candidate(b, key, dict(_plans.forced_knobs(winner.knobs), split_key_prefetch=False))
        winner = _race(w, [winner, c], rounds, calls, winner)
        timed.append(c)
    # Stage 4: blocks per softmax step (a plan forces only the knobs that won).
    forced = _plans.forced_knobs(winner.knobs)
    stage = [winner] + [_candidate(b, key, dict(forced, blocks_per_group=g))
                        for g in range(1, _plans.MAX_GROUP + 1)]
    stage = _dedupe(stage)
    if len(stage) > 1:
        winner = _race(w, stage, rounds, calls, winner)
        timed += stage[1:]
    # Stage 5: no prefetches of the next step's blocks.
    c = _candidate(b, key, dict(_plans.forced_knobs(winner.knobs), prefetch=False))
    winner = _race(w, [winner, c], rounds, calls, winner)
    timed.append(c)
    # The winner races the rules once more; where it loses, the plan is the rules'.
    if winner is not rules:
        winner = _race(w, [rules, winner], 2 * rounds, calls, rules)
    plans = [{"key": key, "build": winner.build, "knobs": winner.knobs,
              "us": winner.median() * 1e6, "rules_us": rules.median() * 1e6}]
    return plans, timed, rules, winner


def key_name(key) -> str:
    dtype, cache_dtype, bs, D, group = key
    return (f"{_plans.DTYPE_NAMES[dtype]} q, {_plans.DTYPE_NAMES[cache_dtype]} cache, bs {bs}, "
            f"head {D}, group {group}")


def autotune_key(key, num_heads: int, num_kv_heads: int, gib: float = 0.5) -> None:
    """PAGED_OPS_AUTOTUNE: tunes one key (fewer rounds, smaller caches), saves and installs
    its plans (a plan file that cannot be written warns once; the plans still apply)."""
    builds = _default_builds()
    w = Workload(gib, 8, 2048)
    try:
        plans, *_ = tune_key(w, key, num_heads, num_kv_heads, builds, rounds=3, calls=2)
    finally:
        paged_ops._install_plans()
    drop = [(b, key) for b in builds]
    try:
        _plans.save(paged_ops._C_LIB, plans, drop=drop)
    except OSError as e:
        _plans.warn_once(f"cannot write the plan file {_plans.cache_path()} ({e})")
    paged_ops._add_plans(plans, drop)


def _default_builds():
    builds = [b for b in paged_ops.supported_cpu_kernel_variants() if b != "default"]
    return builds or ["default"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m paged_ops.tune",
                                description=__doc__.splitlines()[0])
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dtypes", default="fp32,fp16,bf16,fp8_e4m3,fp8_e5m2",
                   help="cache dtypes: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2")
    p.add_argument("--fp8-query", default="bf16", choices=["fp32", "fp16", "bf16"],
                   help="the query dtype of fp8 caches")
    p.add_argument("--block-sizes", default="8,16,32,64,128,256")
    p.add_argument("--builds", default=None,
                   help="comma list of CPU kernel builds (default: those this CPU runs)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--gib", type=float, default=None,
                   help="GiB of layer copies the caches cycle over (default 1, --quick 0.25)")
    p.add_argument("--rounds", type=int, default=None, help="default 5, --quick 2")
    p.add_argument("--calls", type=int, default=None,
                   help="calls per timing (default 3, --quick 2)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds and smaller caches: a rougher plan, sooner")
    p.add_argument("--output", default=None,
                   help="the plan file (default: paged_ops.plan_cache_path())")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    a = p.parse_args(argv)
    for name in ("head_size", "q_heads", "kv_heads", "batch", "context"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if a.q_heads % a.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    return a


def main(argv=None) -> list:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    gib = a.gib if a.gib is not None else (0.25 if a.quick else 1.0)
    rounds = a.rounds or (2 if a.quick else 5)
    calls = a.calls or (2 if a.quick else 3)
    supported = paged_ops.supported_cpu_kernel_variants()
    builds = a.builds.split(",") if a.builds else _default_builds()
    for b in builds:
        if b not in supported:
            sys.exit(f"--builds: {b!r} is not available here; supported: {supported}")
    group = a.q_heads // a.kv_heads
    keys = []
    for name in a.dtypes.split(","):
        if name not in CACHE_DTYPES:
            sys.exit(f"--dtypes: unknown cache dtype {name!r}; known: {list(CACHE_DTYPES)}")
        cache_dtype = CACHE_DTYPES[name]
        dtype = CACHE_DTYPES[a.fp8_query] if cache_dtype.itemsize == 1 else cache_dtype
        for bs in a.block_sizes.split(","):
            try:
                bs = int(bs)
                keys.append(_plans.check_key(dtype, cache_dtype, bs, a.head_size, group))
            except ValueError as e:
                sys.exit(f"--block-sizes / --head-size: {e}")
            if bs > _plans.MAX_BLOCK_SIZE:
                sys.exit(f"--block-sizes: plans cover block sizes up to {_plans.MAX_BLOCK_SIZE}")
    start = time.perf_counter()
    w = Workload(gib, a.batch, a.context)
    bw = read_bandwidth_gbs(w.buf)
    gflops = gemm_gflops()
    print(f"paged_ops.tune: {_plans.machine(paged_ops._C_LIB)['cpu']}, "
          f"{torch.get_num_threads()} threads; builds {','.join(builds)}; {a.q_heads} q / "
          f"{a.kv_heads} kv heads, head size {a.head_size}, B={a.batch} L={a.context}; caches "
          f"cycled over {gib:g} GiB; {rounds} rounds x {calls} calls per timing", flush=True)
    print(f"read bandwidth {bw:.1f} GB/s (torch.sum), fp32 GEMM {gflops:.1f} GFLOP/s",
          flush=True)
    bf16_gflops = []  # measured on first need: only the bf16-pair paths run at that rate

    def roof_of(c, key):
        """The roofline of candidate c's calls: q.k and p.v at the rates of its paths."""
        paths = (c.d["qk_path"], c.d["pv_path"])
        if not bf16_gflops and any(bf16_phases(paths)):
            bf16_gflops.append(gemm_gflops(dtype=torch.bfloat16))
            print(f"bf16 GEMM {bf16_gflops[0]:.1f} GFLOP/s (the bf16-pair paths' roof)",
                  flush=True)
        return roofline_gbs(bw, gflops, key[1], group, bf16_gflops[0] if bf16_gflops else None,
                            paths)

    all_plans, summary = [], []
    try:
        for key in keys:
            plans, timed, rules, winner = tune_key(w, key, a.q_heads, a.kv_heads, builds,
                                                   rounds, calls)
            roof = roof_of(winner, key)
            print(f"\n{key_name(key)}: {w.nbytes / 1e6:.1f} MB per call, roofline "
                  f"{roof:.1f} GB/s (the winner's paths)", flush=True)
            print(f"  {'candidate':45s} {'ms':>8s} {'GB/s':>7s} {'roofline':>8s}")
            for c in timed:
                t = c.median()
                mark = " <- winner" if c is winner else ""
                print(f"  {c.label:45s} {t * 1e3:8.3f} {w.nbytes / t / 1e9:7.2f} "
                      f"{100 * w.nbytes / t / 1e9 / roof_of(c, key):7.0f}%{mark}")
            summary.append((key, rules.median(), winner, winner is rules, roof, w.nbytes))
            all_plans += plans
    finally:
        paged_ops._install_plans()  # the plans of before, until the new ones are added
    elapsed = time.perf_counter() - start
    print(f"\nsummary ({elapsed:.0f} s): per key the rules' time, the winner's, GB/s and share "
          f"of the roofline; the winner, and whether the plan is the rules' (another build with "
          f"its own rules is a plan)")
    print(f"  {'key':52s} {'rules ms':>9s} {'tuned ms':>9s} {'x':>5s} {'GB/s':>6s} "
          f"{'roof':>5s}  winner")
    for key, rules_t, winner, is_rules, roof, nbytes in summary:
        t = winner.median()
        gbs = nbytes / t / 1e9
        what = winner.label.rsplit(maxsplit=1)[0]
        print(f"  {key_name(key):52s} {rules_t * 1e3:9.3f} {t * 1e3:9.3f} {rules_t / t:5.2f} "
              f"{gbs:6.2f} {100 * gbs / roof:4.0f}%  {what:37s} {'rules' if is_rules else 'plan'}")
    if a.dry_run:
        print("dry run: nothing written")
        return all_plans
    path = a.output or _plans.cache_path()
    drop = [(b, key) for b in builds for key in keys]  # the raced builds' older plans
    try:
        _plans.save(paged_ops._C_LIB, all_plans, path, drop)
    except OSError as e:
        sys.exit(f"cannot write the plan file {path}: {e}")
    if path == _plans.cache_path():
        paged_ops._add_plans(all_plans, drop)
    print(f"wrote {len(all_plans)} plans to {path}")
    return all_plans


if __name__ == "__main__":
    main()
