"""Routing traces, the replacement simulators and the synthetic routing (experts/trace.py, experts/synthetic.py).

The Belady simulator is checked against an exhaustive search over every eviction choice (written here, sharing
nothing with it); the LRU/LFU simulators against the real CachePolicy driven by the same requests and against a
real run's store counts; the generator's calibration against the published hit rates it was fitted to.
"""

from __future__ import annotations

import functools
import itertools
import json
import random

import numpy as np
import pytest
import torch

from helpers import cli
from moestream import bench
from moestream.engine import Engine
from moestream.experts.policy import LFUPolicy, LRUPolicy, SlotMap
from moestream.experts.synthetic import FITS, SyntheticRouting, decode_requests, lru_curve
from moestream.experts.trace import RoutingTrace, retile, simulate
from moestream.models.base import LoadOptions, load_model


# ------------------------------------------------------------------------------------------------ brute force
def brute_force_hits(requests, cap: int, window: tuple[int, int] | None = None) -> int:
    """Most hits any demand-paging schedule can get on one layer's ``requests`` [(experts, pinned)] through ``cap``
    slots: every subset of the evictable residents is tried at every request (also evicting more than needed)."""
    start, stop = window or (0, len(requests))
    reqs = requests[:stop]

    @functools.cache
    def best(i: int, state: frozenset) -> int:
        if i == len(reqs):
            return 0
        experts, pinned = reqs[i]
        need = frozenset(experts)
        hits = len(need & state) if i >= start else 0
        must_stay = need | (frozenset(pinned) & state)
        others = sorted(state - must_stay)
        n_after = len(state | need)
        out = -1
        for k in range(len(others) + 1):
            if n_after - k > cap:
                continue
            for gone in itertools.combinations(others, k):
                out = max(out, best(i + 1, (state | need) - frozenset(gone)))
        assert out >= 0, "no schedule fits (the trace is bad)"
        return hits + out

    return best(0, frozenset())


def random_trace(rng: random.Random, n_layers: int, n_experts: int, cap: int, n: int,
                 pins: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Random requests of 1..min(cap, 3) distinct experts. pins: "none"; "tiles" (sometimes the previous request of
    the layer, as MoE pins the previous prefill tile); "any" (a random subset of the experts)."""
    out, prev = [], {}
    for _ in range(n):
        layer = rng.randrange(n_layers)
        k = rng.randint(1, min(cap, 3))
        experts = tuple(sorted(rng.sample(range(n_experts), k)))
        room = cap - k
        pinned: tuple[int, ...] = ()
        if pins == "tiles" and layer in prev and rng.random() < 0.5:
            p = tuple(e for e in prev[layer] if e not in experts)
            pinned = p if len(p) <= room else ()
        elif pins == "any" and room:
            pinned = tuple(rng.sample([e for e in range(n_experts) if e not in experts],
                                      rng.randint(0, min(room, n_experts - k))))
        out.append((layer, experts, pinned))
        prev[layer] = experts
    return out


def per_layer(trace, layer):
    return [(e, p) for lay, e, p in trace if lay == layer]


@pytest.mark.parametrize("pins", ["none", "tiles"])
def test_belady_equals_the_brute_force_optimum(pins):
    rng = random.Random({"none": 1, "tiles": 2}[pins])
    checked = 0
    for _ in range(120):
        cap = rng.randint(2, 4)
        trace = random_trace(rng, 1, rng.randint(cap + 1, 6), cap, rng.randint(6, 13), pins)
        optimum = brute_force_hits(per_layer(trace, 0), cap)
        got = simulate(trace, "belady", cap)
        assert got.hits == optimum, (trace, cap)
        assert got.hits + got.misses == sum(len(e) for _, e, _ in trace)
        checked += optimum > simulate(trace, "lru", cap).hits  # the search finds better schedules than LRU's
    assert checked > 10  # the traces are hard enough for the optimum to differ from LRU


def test_belady_with_arbitrary_pins_is_not_always_optimal():
    """Where a pinned expert need not be the previous request's (MoE never does this), evicting it early can pay:
    3 slots; [1, 2]; [3]; [0] with 3 and 1 pinned forces 2 out; [0, 2] misses 2. Evicting 1 at the second
    request (no miss needs it) keeps 2: one more hit. So the Belady bound is stated for MoE's pins only, and here
    it can only be below the optimum."""
    trace = [(0, (1, 2), ()), (0, (3,), ()), (0, (0,), (3, 1)), (0, (0, 2), ())]
    assert simulate(trace, "belady", 3).hits == 1 and brute_force_hits(per_layer(trace, 0), 3) == 2
    rng = random.Random(3)
    for _ in range(100):
        cap = rng.randint(2, 4)
        trace = random_trace(rng, 1, rng.randint(cap + 1, 6), cap, rng.randint(6, 12), "any")
        assert simulate(trace, "belady", cap).hits <= brute_force_hits(per_layer(trace, 0), cap)


def test_belady_is_optimal_on_a_window_and_over_layers():
    """Counting only a window (earlier requests replayed, later ones not), over two independent layers."""
    rng = random.Random(4)
    for _ in range(60):
        cap = rng.randint(2, 4)
        trace = random_trace(rng, 2, 6, cap, 16, "tiles")
        start, stop = rng.randint(0, 8), rng.randint(9, 16)
        idx = {0: [], 1: []}
        for i, (layer, _, _) in enumerate(trace):
            idx[layer].append(i)
        optimum = 0
        for layer in (0, 1):
            reqs = per_layer(trace, layer)
            lo = sum(1 for i in idx[layer] if i < start)
            hi = sum(1 for i in idx[layer] if i < stop)
            optimum += brute_force_hits(reqs, cap, (lo, hi))
        assert simulate(trace, "belady", {0: cap, 1: cap}, (start, stop)).hits == optimum


def test_belady_bounds_lru_and_lfu():
    rng = random.Random(5)
    for _ in range(40):
        cap = rng.randint(3, 12)
        trace = random_trace(rng, 3, 24, cap, 300, "tiles")
        b = simulate(trace, "belady", cap).hits
        assert b >= simulate(trace, "lru", cap).hits and b >= simulate(trace, "lfu", cap).hits
    reqs = decode_requests(SyntheticRouting.fitted(128, 8), 4, 200)
    for slots in (8, 16, 32, 64):
        b = simulate(reqs, "belady", slots).hit_rate
        assert b >= simulate(reqs, "lru", slots).hit_rate and b >= simulate(reqs, "lfu", slots).hit_rate


@pytest.mark.parametrize("policy", [LRUPolicy, LFUPolicy])
def test_simulators_reproduce_the_cache_policy(policy):
    """The real CachePolicy on a SlotMap per layer, hits counted as StreamingStore counts them."""
    rng = random.Random(6)
    for trial in range(30):
        n_exp, cap = rng.randint(6, 40), rng.randint(2, 10)
        trace = random_trace(rng, 3, n_exp, cap, 400, "tiles" if trial % 2 else "any")
        slots = {layer: SlotMap(n_exp, cap) for layer in range(3)}
        pols = {layer: policy(n_exp) for layer in range(3)}
        hits = misses = 0
        window_hits = 0
        for i, (layer, experts, pinned) in enumerate(trace):
            plan = pols[layer].plan(slots[layer], list(experts), list(pinned))
            misses += len(plan.loads)
            hits += len(experts) - len(plan.loads)
            window_hits += (len(experts) - len(plan.loads)) * (i >= 100)
        got = simulate(trace, policy.name, cap)
        assert (got.hits, got.misses) == (hits, misses)
        assert simulate(trace, policy.name, cap, (100, None)).hits == window_hits


def test_simulate_refuses_a_request_larger_than_the_pool_and_retile_fits_it():
    trace = [(0, (1, 2, 3, 4, 5), ()), (0, (6, 7), (1, 2, 3)), (0, (1, 2), ())]
    with pytest.raises(ValueError, match="request 0 .*5 experts and 0 pinned need more than the 4 slots"):
        simulate(trace, "lru", 4)
    fitted, changed = retile(trace, 4)
    assert changed == 2
    assert fitted == [(0, (1, 2), ()), (0, (3, 4), (1, 2)), (0, (5,), (3, 4)), (0, (6, 7), (1, 2)),
                      (0, (1, 2), ())]
    assert simulate(fitted, "lru", 4).hits + simulate(fitted, "lru", 4).misses == 9


# ------------------------------------------------------------------------------------------------ real runs
def _run(model, n_prompt: int, n_decode: int, seed: int = 0) -> RoutingTrace:
    trace = RoutingTrace.attach(model)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.n_vocab, (n_prompt + n_decode,), generator=g).tolist()
    eng = Engine(model, ubatch=16)
    cache = model.new_cache(n_prompt + n_decode)
    eng.prefill(toks[:n_prompt], cache)
    trace.mark_decode()
    for i, t in enumerate(toks[n_prompt:]):
        eng.decode_step(t, n_prompt + i, cache)
    trace.finish()
    return trace


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_simulated_policy_equals_the_stores_own_counts_on_a_real_model(qwen3moe_tiny, policy):
    """qwen3moe-tiny (16 experts, top-4): a 40-token prefill in chunks of 16 through 6 slots is walked in tiles
    with the previous tile pinned, then 24 decode steps; the simulator replays the recorded trace."""
    model = load_model(str(qwen3moe_tiny["q8_0"]), LoadOptions(slots=6, io_threads=2, policy=policy))
    try:
        trace = _run(model, 40, 24)
    finally:
        model.store.close()
    reqs = trace.requests
    assert any(p for _, _, p in reqs) and len(reqs) > 4 * 24  # tiles with pins were recorded
    caps = trace.slots
    assert caps == {layer: 6 for layer in model.layout.moe_layers}
    st = model.store.stats
    got = simulate(reqs, policy, caps)
    assert (got.hits, got.misses) == (st.hits, st.misses)
    dec = simulate(reqs, policy, caps, (trace.decode_start, None))
    assert (dec.hits, dec.misses) == (trace.meta["decode_hits"], trace.meta["decode_misses"])
    assert simulate(reqs, "belady", caps).hits >= got.hits


def test_routing_override_uses_exactly_the_generators_ids(default_gguf):
    """With model.set_routing, the store sees the generator's experts: a fresh generator of the same seed predicts
    every recorded request (each decode step's top-k; each prefill chunk's distinct experts, over its tiles)."""
    model = load_model(str(default_gguf), LoadOptions(slots=8, io_threads=2))
    own = _run(model, 20, 6, seed=1).requests  # the router's own choices
    model.store.close()
    model = load_model(str(default_gguf), LoadOptions(slots=8, io_threads=2))
    model.set_routing(SyntheticRouting(model.n_experts, model.top_k, 0.5, 0.3, 0.2, seed=7))
    try:
        trace = _run(model, 20, 6, seed=1)
    finally:
        model.store.close()
    expect = SyntheticRouting(model.n_experts, model.top_k, 0.5, 0.3, 0.2, seed=7)
    layers = model.layout.moe_layers
    reqs = list(trace.requests)
    for chunk in (16, 4):  # ubatch 16: the 20-token prefill is two chunks
        for layer in layers:
            want = set(expect.tokens(layer, chunk).ravel().tolist())
            got: set[int] = set()
            while reqs and reqs[0][0] == layer and len(got) < len(want):
                got |= set(reqs.pop(0)[1])
            assert got == want
    for _ in range(6):
        for layer in layers:
            assert reqs.pop(0) == (layer, tuple(sorted(expect.tokens(layer, 1)[0].tolist())), ())
    assert not reqs
    assert own != trace.requests  # the router's own choices were replaced


# ------------------------------------------------------------------------------------------------ the generator
def test_generator_is_deterministic_distinct_and_in_range():
    a = SyntheticRouting.fitted(128, 8, seed=3)
    b = SyntheticRouting.fitted(128, 8, seed=3)
    x = np.concatenate([a.tokens(5, 7), a.tokens(5, 1), a.tokens(5, 92)])  # chunking does not matter
    assert (x == b.tokens(5, 100)).all()
    assert x.dtype == np.int64 and x.shape == (100, 8)
    assert x.min() >= 0 and x.max() < 128
    assert all(len(set(row)) == 8 for row in x.tolist())
    assert not (SyntheticRouting.fitted(128, 8, seed=4).tokens(5, 100) == x).all()
    assert not (SyntheticRouting.fitted(128, 8, seed=3).tokens(6, 100) == x).all()  # each layer its own
    ids = torch.zeros((3, 8), dtype=torch.int64)
    out = SyntheticRouting.fitted(128, 8, seed=3)(5, ids)
    assert out.dtype == torch.int64 and out.shape == (3, 8) and (out.numpy() == x[:3]).all()
    # top-k = n_experts: every expert every token; reuse 1: the same experts token after token
    assert sorted(SyntheticRouting(8, 8, 1.0, 0.2, 0.5).tokens(0, 1)[0].tolist()) == list(range(8))
    same = SyntheticRouting(64, 4, 1.0, 0.2, 1.0).tokens(0, 10)
    assert all(set(r) == set(same[0]) for r in same.tolist())


@pytest.mark.parametrize("name", sorted(FITS))
def test_calibrated_lru_hit_rates_match_the_published_ones(name):
    """The claim bench --routing calibrated makes: the generator's LRU hit rates under the published protocol are
    within 3 points of the published ones (benchmarks/calibrate_routing.py prints the table)."""
    f = FITS[name]
    got = lru_curve(f.zipf, f.cutoff, f.reuse, f.n_experts, f.top_k, [r for r, _ in f.targets], n_layers=f.n_layers)
    for (resident, want), g in zip(f.targets, got, strict=True):
        assert abs(g - want) <= 3.0, (resident, g, want)
    for what, resident, lo, hi in f.checks:  # published figures the fit did not use
        reqs = decode_requests(SyntheticRouting.fitted(f.n_experts, f.top_k, name), f.n_layers)
        lru, lfu, opt = (100 * simulate(reqs, p, resident).hit_rate for p in ("lru", "lfu", "belady"))
        assert lo <= (lru if what == "lru" else opt - lfu) <= hi, (what, resident, lru, lfu, opt)


# ------------------------------------------------------------------------------------------------ command line
def test_run_writes_a_trace_that_moestream_trace_replays(tmp_path, default_gguf):
    out = tmp_path / "run.trace"
    p = cli("run", "-n", "6", "--temp", "0", "--slots", "8", "--routing-trace", str(out))
    assert p.returncode == 0, p.stderr
    trace = RoutingTrace.read(str(out))
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["format"] == "moestream-routing-trace" and len(lines) == 1 + len(trace.requests)
    layers = len(trace.n_experts)
    assert len(trace.requests) - trace.decode_start == 5 * layers  # 5 decode steps after the first token
    own = simulate(trace.requests, "lfu", trace.slots, (trace.decode_start, None))
    assert (own.hits, own.misses) == (trace.meta["decode_hits"], trace.meta["decode_misses"])
    t = cli("trace", str(out), "--slots", "4,8,64")
    assert t.returncode == 0, t.stderr
    rows = [ln for ln in t.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| slots")]
    assert [r.split(" | ")[0] for r in rows] == ["| 4", "| 8 (recorded)", "| 64"]
    assert f"{100 * own.hit_rate:.1f}%" in rows[1].split(" | ")[1]
    # resident: recorded too, simulated at the default quarter of the experts
    res = tmp_path / "res.trace"
    assert cli("run", "-n", "3", "--temp", "0", "--moe-stream", "off", "--routing-trace", str(res)).returncode == 0
    assert RoutingTrace.read(str(res)).slots is None
    t = cli("trace", str(res))
    assert t.returncode == 0 and "| 16 |" in t.stdout, t.stdout + t.stderr


def one_error_line(p, *needles):
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moestream: error: ") and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_trace_bad_input(tmp_path):
    one_error_line(cli("trace", str(tmp_path / "nope")), "nope: no such file")
    (tmp_path / "x.txt").write_text("hello\n")
    one_error_line(cli("trace", str(tmp_path / "x.txt")), "x.txt: not a moestream routing trace")
    t = RoutingTrace(requests=[(0, (1, 2), ()), (0, (2, 3), ())],
                     meta={"format": "moestream-routing-trace", "version": 1, "top_k": 2, "n_experts": {"0": 4},
                           "slots": {"0": 2}, "requests": 2, "decode_start": 0, "model": "m"})
    good = tmp_path / "good.trace"
    good.write_text(t.text())
    assert cli("trace", str(good)).returncode == 0
    cut = tmp_path / "cut.trace"
    cut.write_text("\n".join(t.text().splitlines()[:2]) + "\n")
    one_error_line(cli("trace", str(cut)), "cut.trace: the header says 2 requests but the file holds 1")
    bad = tmp_path / "bad.trace"
    bad.write_text(t.text().replace("[0, [2, 3], []]", "[0, [2, 9], []]"))
    one_error_line(cli("trace", str(bad)), "bad.trace: line 3: expert 9 is outside 0..3")
    bad.write_text(t.text().replace("[0, [2, 3], []]", "{oops"))
    one_error_line(cli("trace", str(bad)), "bad.trace: line 3: expected [layer, [experts...], [pinned...]]")
    one_error_line(cli("trace", str(good), "--slots", "1"), "--slots 1 is below the experts used per token (2)")
    one_error_line(cli("trace", str(good), "--slots", "2,x"), "--slots: expected a comma-separated list")


def test_run_routing_trace_bad_path_fails_before_the_model_runs(tmp_path):
    p = cli("run", "-n", "2", "--routing-trace", str(tmp_path / "missing" / "t.trace"))
    one_error_line(p, "--routing-trace", "missing is missing or not writable")
    assert p.stdout == ""
    one_error_line(cli("run", "-n", "2", "--routing-trace", str(tmp_path)), "--routing-trace", "is a directory")
    one_error_line(cli("run", "-cnv", "--routing-trace", str(tmp_path / "t")), "does not apply to -cnv")
    one_error_line(cli("bench", "--routing", "bogus", "-p", "4", "-n", "2"),
                   "--routing: expected model or calibrated, got 'bogus'")


def test_bench_row_gets_simulated_hit_rates_under_calibrated_routing(default_gguf):
    """One streaming row in this process: the tg test's simulated LFU (the row's policy, its slot count, its tg
    requests warmed by the earlier ones) is the measured hit rate; Belady bounds LRU and LFU."""
    cfg = {"model": str(default_gguf), "n_prompt": 8, "n_gen": 6, "repetitions": 2, "ubatch": 128,
           "moe_stream": True, "slots": 8, "io_threads": 2, "overlap": True, "policy": "lfu", "routing": "calibrated"}
    row = bench.run_row(cfg)
    pp, tg = row["tests"]
    assert "belady_hit_rate" not in pp
    assert tg["lfu_hit_rate"] == pytest.approx(tg["hit_rate"], abs=1e-12)
    assert tg["belady_hit_rate"] >= max(tg["lru_hit_rate"], tg["lfu_hit_rate"])
    row2 = bench.run_row(cfg)  # the same routing sequence in every row
    assert row2["tests"][1]["hit_rate"] == tg["hit_rate"]
    table = bench.format_table([row])
    assert "| Belady hit rate |" in table and f"{100 * tg['belady_hit_rate']:.1f}%" in table


def test_bench_calibrated_says_so_in_the_table_stderr_and_json(tmp_path):
    out = tmp_path / "b.json"
    p = cli("bench", "-p", "4", "-n", "3", "-r", "1", "--slots", "8", "--moe-stream", "on", "--routing", "calibrated",
            "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "Routing: calibrated." in p.stdout and "| Belady hit rate |" in p.stdout
    summary = [ln for ln in p.stderr.splitlines() if ln.startswith("routing: synthetic, calibrated to Qwen3-30B-A3B")]
    assert len(summary) == 1 and "(published 74.1% at 24 of 128)" in summary[0]  # the default model: 64 experts
    d = json.loads(out.read_text())
    assert d["meta"]["routing"] == "calibrated" and d["meta"]["routing_calibration"]["summary"] == summary[0]
    (row,) = d["rows"]
    assert row["routing"] == "calibrated" and 0 <= row["tests"][1]["belady_hit_rate"] <= 1
    assert "cannot be replaced" in bench.routing_note("calibrated", d["meta"]["routing_calibration"], True)
    assert "cannot be replaced" not in bench.routing_note("model", None, False)


def test_trace_refuses_an_empty_name_and_files_that_are_not_regular(capsys):
    """``moestream trace /dev/zero`` would read forever: refused like any non-regular file; an empty name is
    said to be empty (newcomer review)."""
    from moestream import cli
    for arg, needle in (("/dev/zero", "/dev/zero: not a regular file"), ("", "the trace file name is empty")):
        assert cli.main(["trace", arg]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("moestream: error: ") and needle in err[0], err
