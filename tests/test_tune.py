"""Tuned plans of the CPU attention kernel (paged_ops/_plans.py, paged_ops/tune.py): every plan
computes what the rules compute (each path a key may take, forced, on every build), plan files
that cannot be used are ignored with one warning, concurrent tuners leave a valid file, and the
tuner runs end to end. No timing is asserted."""

import contextlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import paged_ops
from paged_ops import _plans, tune
from paged_ops import reference as ref
from tests import cpu_variants
from tests.helpers import (
    TOL,
    make_paged,
    make_paged_fp8,
    one_thread,
    query_start_loc,
    random_query,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = paged_ops._C_LIB
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@contextlib.contextmanager
def forced(key, knobs, table=None):
    """Calls of ``key`` run with plan ``knobs`` (on ``table``; None: the selected build)."""
    _plans.install(LIB, [(key, table, knobs)])
    try:
        yield
    finally:
        paged_ops._install_plans()


# (query dtype, cache dtype, block size, head size, query heads / kv heads): staged block sizes
# (1, 3), dense logit rows (8 on 16 lanes), half and quarter tiles, whole and partial vectors
# per V row, several groups per sequence, GQA 4 and 1, fp8 keys by tables, bf16 pair dot
# products on one and on several operands per V row.
CASES = [
    (torch.float32, torch.float32, 1, 64, (8, 2)),
    (torch.float32, torch.float32, 8, 128, (8, 2)),
    (torch.float32, torch.float32, 48, 64, (4, 4)),
    (torch.float16, torch.float16, 4, 64, (8, 2)),
    (torch.float16, torch.float16, 24, 80, (8, 2)),
    (torch.bfloat16, torch.bfloat16, 3, 128, (8, 2)),
    (torch.bfloat16, torch.bfloat16, 8, 128, (8, 2)),
    (torch.bfloat16, torch.bfloat16, 16, 128, (8, 2)),
    (torch.bfloat16, torch.bfloat16, 32, 64, (8, 8)),
    (torch.bfloat16, torch.bfloat16, 128, 64, (8, 2)),
    (torch.bfloat16, torch.float8_e4m3fn, 16, 128, (8, 2)),
    (torch.bfloat16, torch.float8_e4m3fn, 64, 64, (8, 2)),
    (torch.bfloat16, torch.float8_e5m2, 32, 80, (8, 2)),
    (torch.float16, torch.float8_e5m2, 8, 128, (8, 2)),
]


def _case_id(c):
    dt, ct, bs, D, (h, kv) = c
    return f"{_plans.DTYPE_NAMES[dt]}-{_plans.DTYPE_NAMES[ct]}-bs{bs}-d{D}-{h}x{kv}"


def _inputs(case, multi):
    dt, ct, bs, D, (H, Hkv) = case
    lens = [1, max(bs - 1, 1), bs + 1, 9 * bs + 7, 141]  # odd lengths, several groups
    kw = {}
    if ct in FP8:
        pg = make_paged_fp8(lens, Hkv, D, bs, ct, seed=bs + D)
        kw = dict(k_scale=pg.k_scale, v_scale=pg.v_scale)
    else:
        pg = make_paged(lens, Hkv, D, bs, ct, seed=bs + D)
    if multi:
        q_lens = [1, 1, 2, 5, 3]
        q = random_query(sum(q_lens), H, D, dt, scale=2.0, seed=bs)
        kw["query_start_loc"] = query_start_loc(q_lens)
    else:
        q = random_query(len(lens), H, D, dt, scale=2.0, seed=bs)
    return pg, q, kw


def _reference(pg, q, kw, scale, window):
    ks, vs = kw.get("k_scale"), kw.get("v_scale")
    with one_thread():
        return ref.attention(q, pg.key_cache, pg.value_cache, pg.block_tables, pg.seq_lens,
                             scale, None, window, 0.0, k_scale=ks, v_scale=vs,
                             query_start_loc=kw.get("query_start_loc"))


def _knob_sets(d):
    """Every path the key may take forced alone and in pairs, every group size, no prefetch,
    the next key lines over q.k alone or split, and paths the key cannot take (the rules must
    decide then)."""
    sets = [{"qk_path": qk} for qk in _plans.QK_PATHS]
    sets += [{"pv_path": pv} for pv in _plans.PV_PATHS]
    sets += [{"qk_path": qk, "pv_path": pv} for qk in d["qk_valid"] for pv in d["pv_valid"]]
    sets += [{"blocks_per_group": g} for g in range(1, _plans.MAX_GROUP + 1)]
    sets += [{"prefetch": False}, {"prefetch": True},
             {"qk_path": "tile", "pv_path": "row_any", "blocks_per_group": 3,
              "prefetch": False}]
    sets += [{"split_key_prefetch": False}, {"split_key_prefetch": True},
             {"blocks_per_group": 2, "split_key_prefetch": False}]
    sets += [{"pv_path": pv, "split_key_prefetch": False} for pv in d["pv_valid"]]
    return sets


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_forced_plan_matches_the_reference(cpu_variant, case, multi):
    dt, ct, bs, D, (H, Hkv) = case
    key = (dt, ct, bs, D, H // Hkv)
    table = cpu_variants.table(cpu_variant)
    pg, q, kw = _inputs(case, multi)
    scale = D**-0.5
    tol = dict(atol=1e-5, rtol=1e-4) if dt == torch.float32 and ct in FP8 else TOL[dt]
    rules = _plans.describe(LIB, table, key, multi_token=multi)
    for window in (-1, 2 * bs + 3):
        want = _reference(pg, q, kw, scale, window).float()
        for knobs in _knob_sets(rules):
            knobs = _plans.check_knobs(knobs)
            d = _plans.describe(LIB, table, key, knobs, multi_token=multi)
            # A forced path is taken where the key may take it.
            if knobs["qk_path"] in rules["qk_valid"] and knobs["pv_path"] is None:
                assert d["qk_path"] == knobs["qk_path"], (knobs, d)
            if knobs["pv_path"] in rules["pv_valid"] and knobs["qk_path"] is None:
                assert d["pv_path"] == knobs["pv_path"], (knobs, d)
            if knobs["blocks_per_group"] is not None:
                assert d["blocks_per_group"] == knobs["blocks_per_group"]
            if knobs["split_key_prefetch"] is False or knobs["prefetch"] is False:
                assert not d["split_key_prefetch"], (knobs, d)
            with forced(key, knobs, table):
                got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache,
                                                pg.block_tables, pg.seq_lens, scale,
                                                sliding_window=window, **kw)
            assert not got.isnan().any(), f"NaN leaked under plan {knobs}"
            torch.testing.assert_close(got.float(), want, **tol,
                                       msg=lambda m, k=knobs: f"plan {k}: {m}")


def test_a_plan_naming_another_build_runs_that_build():
    # The plan's build runs its key's calls, whatever the selection; results do not change.
    dt = ct = torch.bfloat16
    key = (dt, ct, 16, 128, 4)
    pg = make_paged([40, 300], 2, 128, 16, ct, seed=3)
    q = random_query(2, 8, 128, dt, scale=2.0)
    want = _reference(pg, q, {}, 128**-0.5, -1).float()
    for build in paged_ops.supported_cpu_kernel_variants():
        table = paged_ops._table_pointer(build)
        for knobs in ({}, {"qk_path": "tile", "pv_path": "row_any", "blocks_per_group": 1}):
            with forced(key, _plans.check_knobs(knobs), table):
                got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache,
                                                pg.block_tables, pg.seq_lens)
            torch.testing.assert_close(got.float(), want, **TOL[dt])


# --- Plan file ---------------------------------------------------------------------------------

KEY = (torch.bfloat16, torch.bfloat16, 16, 128, 4)


def _plan(build=None, us=100.0, **knobs):
    build = build or paged_ops.cpu_kernel_variant(16, torch.bfloat16)
    return {"key": KEY, "build": build, "knobs": _plans.check_knobs(knobs), "us": us,
            "rules_us": 120.0}


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    """A plan file location of the test's own (PAGED_OPS_PLAN_CACHE); the plans installed
    before come back afterwards."""
    path = tmp_path / "plans" / "plans.json"
    monkeypatch.setenv("PAGED_OPS_PLAN_CACHE", str(path))
    monkeypatch.setattr(_plans, "_warned", False)
    yield path
    monkeypatch.undo()
    paged_ops._load_plans()


def _load_warnings(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _plans.load(LIB, str(path))
        _plans.load(LIB, str(path))  # a second read: no second warning
    return got, [str(w.message) for w in caught if "paged_ops" in str(w.message)]


def test_plan_file_round_trip_and_cpu_plan(plan_file):
    assert paged_ops.plan_cache_path() == str(plan_file)
    assert paged_ops.cpu_plan(*KEY)["source"] == "rules"
    _plans.save(LIB, [_plan(qk_path="tile", pv_path="row_any", blocks_per_group=2)])
    got, warned = _load_warnings(plan_file)
    assert not warned and len(got) == 1 and got[0]["key"] == KEY
    paged_ops._load_plans()
    p = paged_ops.cpu_plan(*KEY)
    assert p["source"] == "plan file" and p["qk_path"] == "tile" and p["pv_path"] == "row_any"
    assert p["blocks_per_group"] == 2 and p["forced"]["blocks_per_group"] == 2
    # The plan runs, and computes what the rules compute.
    pg = make_paged([33, 250], 2, 128, 16, torch.bfloat16, seed=5)
    q = random_query(2, 8, 128, torch.bfloat16, scale=2.0)
    want = _reference(pg, q, {}, 128**-0.5, -1).float()
    got = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                    pg.seq_lens)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    # An explicit build keeps its own plans only (none tuned for avx2 here unless it runs).
    paged_ops.set_cpu_kernel_variant("default")
    try:
        assert paged_ops.cpu_plan(*KEY)["source"] == "rules"
    finally:
        paged_ops._set_selection(paged_ops._auto_selection)
    assert paged_ops.cpu_plan(*KEY)["source"] == "plan file"


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def _valid_text(path):
    _plans.save(LIB, [_plan(qk_path="tile")], str(path))
    with open(path) as fh:
        return fh.read()


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "empty", "not_plans", "version",
                                  "foreign_machine", "foreign_version", "bad_plan",
                                  "unreadable"])
def test_unusable_plan_files_are_ignored_with_one_warning(plan_file, kind):
    text = _valid_text(plan_file)
    data = json.loads(text)
    if kind == "corrupt":
        _write(plan_file, text.replace('"plans"', '"plans" ]]', 1))
    elif kind == "truncated":
        _write(plan_file, text[:len(text) // 2])
    elif kind == "empty":
        _write(plan_file, "")
    elif kind == "not_plans":
        _write(plan_file, json.dumps([1, 2, 3]))
    elif kind == "version":
        data["version"] = 99
        _write(plan_file, json.dumps(data))
    elif kind in ("foreign_machine", "foreign_version"):
        (mkey, entry), = data["machines"].items()
        m = dict(entry["machine"])
        if kind == "foreign_machine":
            m["cpu"] = "Some Other CPU"
        else:
            m["torch"] = "0.0.1"
        data["machines"] = {_plans.machine_key(m): dict(entry, machine=m)}
        _write(plan_file, json.dumps(data))
    elif kind == "bad_plan":
        (entry,) = data["machines"].values()
        entry["plans"][0]["qk_path"] = "warp_drive"
        _write(plan_file, json.dumps(data))
    elif kind == "unreadable":
        os.remove(plan_file)
        os.makedirs(plan_file)  # a directory where the file should be: open() fails
    got, warned = _load_warnings(plan_file)
    assert got == [] and len(warned) == 1, warned
    # Import-time loading: the rules apply, and the results are the rules'.
    paged_ops._load_plans()
    assert paged_ops.cpu_plan(*KEY)["source"] == "rules"


def test_a_missing_plan_file_is_no_warning(plan_file):
    got, warned = _load_warnings(plan_file)
    assert got == [] and not warned


def test_saving_replaces_an_unusable_file_and_keeps_other_machines(plan_file):
    _write(plan_file, "{ truncated")
    _plans.save(LIB, [_plan(pv_path="row_any")])
    other = {"cpu": "Other", "flags_sha256": "0", "paged_ops": "0", "torch": "0",
             "kernel_abi": 0}
    with open(plan_file) as fh:
        data = json.load(fh)
    data["machines"][_plans.machine_key(other)] = {"machine": other, "plans": []}
    _write(plan_file, json.dumps(data))
    _plans.save(LIB, [_plan(build="default", us=50.0)])
    with open(plan_file) as fh:
        data = json.load(fh)
    assert _plans.machine_key(other) in data["machines"]
    got, warned = _load_warnings(plan_file)
    assert not warned and {p["build"] for p in got} >= {"default"} and len(got) == 2


def test_saving_where_the_file_cannot_be_written_raises_oserror(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(OSError):
        _plans.save(LIB, [_plan()], str(blocker / "plans.json"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        try:
            with pytest.raises(OSError):
                _plans.save(LIB, [_plan()], str(ro / "plans.json"))
        finally:
            os.chmod(ro, 0o700)


_WRITER = """
import sys
import paged_ops
from paged_ops import _plans
path, build, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
key = (paged_ops.torch.bfloat16, paged_ops.torch.bfloat16, 0, 128, 4)
for i in range(n):
    key = (key[0], key[1], 1 + i, 128, 4)
    _plans.save(paged_ops._C_LIB, [{"key": key, "build": build, "us": 10.0 + i,
                                   "knobs": _plans.check_knobs({})}], path)
"""


def test_two_processes_tuning_at_once_leave_a_valid_file(tmp_path):
    path = tmp_path / "plans.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), build, "25"],
                              cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for build in ("default", "other")]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    got, warned = _load_warnings(path)
    assert not warned
    assert sorted((p["build"], p["key"][2]) for p in got) == sorted(
        (b, bs) for b in ("default", "other") for bs in range(1, 26))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_import_with_a_corrupt_plan_file_warns_once_and_computes(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text('{"format": "paged_ops-plans", "version": 1, "machines": {"x": ')
    code = ("import torch, paged_ops\n"
            "kc, vc = paged_ops.allocate_kv_cache(4, 1, 64, 16, torch.float32)\n"
            "kc.normal_(); vc.normal_()\n"
            "q = torch.randn(1, 2, 64)\n"
            "out = paged_ops.paged_attention(q, kc, vc, torch.tensor([[0, 1]], dtype=torch.int32),"
            " torch.tensor([20], dtype=torch.int32))\n"
            "assert out.isfinite().all()\n"
            "print(paged_ops.cpu_plan(torch.float32, torch.float32, 16, 64, 2)['source'])\n")
    env = dict(os.environ, PAGED_OPS_PLAN_CACHE=str(path))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "rules"
    assert res.stderr.count("ignoring the plan file") == 1, res.stderr


# --- API ---------------------------------------------------------------------------------------

def test_plan_cache_path_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGED_OPS_PLAN_CACHE")
    assert paged_ops.plan_cache_path() == os.path.join(
        os.path.expanduser("~"), ".cache", "paged_ops", "plans.json")
    monkeypatch.setenv("PAGED_OPS_PLAN_CACHE", str(tmp_path / "p.json"))
    assert paged_ops.plan_cache_path() == str(tmp_path / "p.json")


@pytest.mark.parametrize("args,name", [
    ((torch.int32, torch.bfloat16, 16, 128, 4), "dtype"),
    ((torch.bfloat16, torch.int8, 16, 128, 4), "cache_dtype"),
    ((torch.bfloat16, torch.float16, 16, 128, 4), "cache_dtype"),
    ((torch.bfloat16, torch.bfloat16, 0, 128, 4), "block_size"),
    ((torch.bfloat16, torch.bfloat16, 16, 0, 4), "head_size"),
    ((torch.bfloat16, torch.bfloat16, 16, 100, 4), "head_size"),
    ((torch.bfloat16, torch.bfloat16, 16, 128, 0), "group"),
    ((torch.bfloat16, torch.bfloat16, 16.0, 128, 4), "block_size"),
])
def test_cpu_plan_rejects_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        paged_ops.cpu_plan(*args)


def test_cpu_plan_of_the_rules():
    for ct in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        dt = torch.bfloat16 if ct in FP8 else ct
        for bs in (1, 16, 300):
            p = paged_ops.cpu_plan(dt, ct, bs, 128, 4)
            assert p["source"] == "rules" and p["forced"] is None and p["us"] is None
            assert p["build"] == paged_ops.cpu_kernel_variant(bs, ct)
            assert p["qk_path"] in _plans.QK_PATHS and p["pv_path"] in _plans.PV_PATHS
            assert 1 <= p["blocks_per_group"] <= _plans.MAX_GROUP and p["prefetch"]
            assert isinstance(p["split_key_prefetch"], bool)


@pytest.mark.parametrize("variant", ["lanes16_dot"] + [
    v for v in ("avx512_bf16",) if v in paged_ops.supported_cpu_kernel_variants()])
def test_rules_take_the_dot_paths_for_bf16_queries(variant):
    # fp8 caches read with bf16 queries decode to bf16 pairs at every block size of the dot
    # paths; bf16 caches take p.v by dot products below 16 lanes' block size, pv_group from it
    # (Dot stays open to a plan there).
    table = cpu_variants.table(variant)
    for bs in (8, 16, 32, 64, 128, 256):
        for ct in FP8:
            d = _plans.describe(LIB, table, (torch.bfloat16, ct, bs, 128, 4))
            assert (d["qk_path"], d["pv_path"]) == ("dot_bf16", "dot"), (bs, ct, d)
            d = _plans.describe(LIB, table, (torch.float32, ct, bs, 128, 4))
            assert d["qk_path"] == "fp8_tables" and "dot" not in d["pv_valid"], (bs, ct, d)
        d = _plans.describe(LIB, table, (torch.bfloat16, torch.bfloat16, bs, 128, 4))
        assert d["qk_path"] == "dot_bf16" and "dot" in d["pv_valid"], (bs, d)
        assert d["pv_path"] == ("dot" if bs < 16 else "group"), (bs, d)


@pytest.mark.parametrize("variant", ["lanes16", "lanes16_dot"] + [
    v for v in ("avx512_bf16", "avx2") if v in paged_ops.supported_cpu_kernel_variants()])
def test_rules_split_the_next_key_lines_of_16_bit_caches_on_16_lanes(variant):
    # Half of the next blocks' key lines go out over p.v for 16-bit caches on the 16-lane
    # builds where the p.v path steps them (not row_any, not dot); a plan may send them all
    # over q.k.
    table = cpu_variants.table(variant)
    lanes16 = variant != "avx2"
    for ct in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        dt = torch.bfloat16 if ct in FP8 else ct
        for bs in (8, 16, 128):
            key = (dt, ct, bs, 128, 4)
            d = _plans.describe(LIB, table, key)
            want = lanes16 and ct in (torch.float16, torch.bfloat16) and d["pv_path"] in (
                "group", "group_any", "half_tile")
            assert d["split_key_prefetch"] == want, (key, d)
            for knobs in ({"split_key_prefetch": False}, {"prefetch": False},
                          {"pv_path": "row_any"}):
                d = _plans.describe(LIB, table, key, _plans.check_knobs(knobs))
                if d["pv_path"] == knobs.get("pv_path", d["pv_path"]):
                    assert not d["split_key_prefetch"], (key, knobs, d)
            d = _plans.describe(LIB, table, key, _plans.check_knobs({"split_key_prefetch": True}))
            assert d["split_key_prefetch"] == want, (key, d)


def test_bad_knobs_are_rejected():
    for knobs, name in (({"qk_path": "x"}, "qk_path"), ({"pv_path": 1}, "pv_path"),
                        ({"blocks_per_group": _plans.MAX_GROUP + 1}, "blocks_per_group"),
                        ({"prefetch": 1}, "prefetch"), ({"speed": 2}, "speed"),
                        ({"split_key_prefetch": "yes"}, "split_key_prefetch")):
        with pytest.raises(ValueError, match=name):
            _plans.check_knobs(knobs)


# --- Roofline ----------------------------------------------------------------------------------

def test_roofline_takes_q_k_and_p_v_each_at_the_rate_of_its_path():
    # bf16 cache, 4 query heads per kv head: 2 bytes per 8 flops. q.k reads K and p.v reads V,
    # half the bytes each, so a call's arithmetic allows 2 * 0.25 / (1 / qk + 1 / pv) GB/s.
    bw, fp32, bf16 = 1000.0, 100.0, 200.0
    assert tune.bytes_per_flop(torch.bfloat16, 4) == 0.25
    assert tune.roofline_gbs(bw, fp32, torch.bfloat16, 4) == pytest.approx(25.0)
    cases = {("tile", "group"): 25.0, ("dot_bf16", "dot"): 50.0, ("amx", "amx"): 50.0,
             ("dot_bf16", "group"): 0.5 / (1 / 200 + 1 / 100),
             ("fp8_tables", "dot"): 0.5 / (1 / 100 + 1 / 200)}
    for paths, want in cases.items():
        assert tune.roofline_gbs(bw, fp32, torch.bfloat16, 4, bf16, paths) == pytest.approx(want)
    # Without a bf16 rate every phase takes the fp32 one; the read bandwidth caps the roof.
    assert tune.roofline_gbs(bw, fp32, torch.bfloat16, 4, None, ("dot_bf16", "dot")) == 25.0
    assert tune.roofline_gbs(30.0, fp32, torch.bfloat16, 4, bf16, ("dot_bf16", "dot")) == 30.0
    assert tune.roofline_gbs(bw, fp32, torch.float8_e4m3fn, 4, bf16, ("dot_bf16", "dot")) == \
        pytest.approx(25.0)  # 1 byte per 8 flops at 200 GFLOP/s
    # Every path name the kernel reports is either a bf16-pair path or an fp32 one.
    assert tune.BF16_QK_PATHS <= set(_plans.QK_PATHS)
    assert tune.BF16_PV_PATHS <= set(_plans.PV_PATHS)


def test_gemm_rate_probes_fp32_and_bf16():
    assert tune.gemm_gflops(min_time=1e-6, n=64) > 0
    assert tune.gemm_gflops(min_time=1e-6, n=64, dtype=torch.bfloat16) > 0


# --- Tuner -------------------------------------------------------------------------------------

TINY = ["--quick", "--head-size", "64", "--q-heads", "4", "--kv-heads", "2", "--batch", "2",
        "--context", "80", "--gib", "0.004", "--threads", "1"]


def test_tuner_quick_writes_a_valid_plan_file(tmp_path, capsys):
    out = tmp_path / "plans.json"
    before = paged_ops._selection
    plans = tune.main(TINY + ["--dtypes", "fp32,fp8_e5m2", "--block-sizes", "8,16",
                              "--output", str(out)])
    assert paged_ops._selection == before
    text = capsys.readouterr().out
    assert "summary" in text and "roofline" in text and "winner" in text
    got, warned = _load_warnings(out)
    assert not warned
    keys = {p["key"] for p in got}
    assert keys == {(torch.float32, torch.float32, bs, 64, 2) for bs in (8, 16)} | {
        (torch.bfloat16, torch.float8_e5m2, bs, 64, 2) for bs in (8, 16)}
    assert len(got) == len(plans)
    # The file's plans compute what the rules compute.
    for p in got:
        dt, ct, bs, D, _ = p["key"]
        pg, q, kw = _inputs((dt, ct, bs, D, (4, 2)), False)
        want = _reference(pg, q, kw, D**-0.5, -1).float()
        with forced(p["key"], p["knobs"], paged_ops._table_pointer(p["build"])):
            res = paged_ops.paged_attention(q, pg.key_cache, pg.value_cache, pg.block_tables,
                                            pg.seq_lens, **kw)
        torch.testing.assert_close(res.float(), want, **TOL[dt])


def test_tuner_writes_one_plan_per_key_replacing_older_plans_of_the_builds_raced(tmp_path):
    """Times from different races are not comparable, so a re-tune leaves no older plan of
    another raced build that could outrank its winner by its recorded time."""
    out = tmp_path / "plans.json"
    key = (torch.float32, torch.float32, 16, 64, 2)
    builds = [b for b in paged_ops.supported_cpu_kernel_variants() if b != "default"] or [
        "default"]
    stale = [{"key": key, "build": b, "knobs": _plans.check_knobs({}), "us": 0.001}
             for b in builds]
    other = {"key": (torch.float32, torch.float32, 32, 64, 2), "build": builds[0],
             "knobs": _plans.check_knobs({}), "us": 5.0}
    _plans.save(LIB, stale + [other], str(out))
    plans = tune.main(TINY + ["--dtypes", "fp32", "--block-sizes", "16", "--output", str(out)])
    assert len(plans) == 1
    got, warned = _load_warnings(out)
    assert not warned
    assert [p for p in got if p["key"] == key] == [dict(plans[0], rules_us=pytest.approx(
        plans[0]["rules_us"], abs=1e-3), us=pytest.approx(plans[0]["us"], abs=1e-3))]
    assert [p["key"] for p in got if p["key"] != key] == [other["key"]]


def test_tuner_cli_runs(tmp_path):
    out = tmp_path / "plans.json"
    res = subprocess.run([sys.executable, "-m", "paged_ops.tune", *TINY, "--dtypes", "bf16",
                          "--block-sizes", "16", "--output", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"plans to {out}" in res.stdout
    got, warned = _load_warnings(out)
    assert not warned and len(got) >= 1
    bad = subprocess.run([sys.executable, "-m", "paged_ops.tune", "--dtypes", "int4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--dtypes" in bad.stderr
