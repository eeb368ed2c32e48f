"""--mem SIZE: the memory plan that sizes the slot pools, its errors, and the budget held under a real cgroup cap."""

from __future__ import annotations

import re
import sys

import pytest

from moestream import cli
from moestream.budget import GiB, MiB, parse_mem, plan_pools
from moestream.errors import ConfigError
from moestream.memcap import MemCap
from moestream.models.base import LoadOptions, load_model, open_model


def _plan(budget: int, slot_bytes: dict[int, int], n_exp: int = 16, top_k: int = 4, fixed: int = 100):
    return plan_pools(budget, f"--mem {budget}B", process=fixed, dense=0, kv=0, n_ctx=1, scratch=0,
                      slot_bytes=slot_bytes, n_experts=dict.fromkeys(slot_bytes, n_exp), top_k=top_k, what="m.gguf")


def test_plan_fills_the_budget_and_never_exceeds_it():
    """Every plan over a sweep of budgets stays within the budget, gives each layer at least top-k slots, and
    keeps layers within one slot of each other, and leaves no room for one more slot in any layer that has the
    fewest (its next slot would not fit, or it is full)."""
    sb = {0: 300, 1: 200, 2: 300, 5: 250}
    for budget in range(100 + 4 * 1050, 100 + 16 * 1050 + 400, 37):
        p = _plan(budget, sb)
        assert p.fixed + p.pools <= budget
        assert p.pools == sum(sb[la] * n for la, n in p.slots.items())
        assert all(4 <= n <= 16 for n in p.slots.values())
        assert max(p.slots.values()) - min(p.slots.values()) <= 1 or p.all_fit
        low = min(p.slots.values())
        assert all(n == 16 or n > low or sb[la] > budget - p.fixed - p.pools for la, n in p.slots.items())


def test_plan_all_experts_and_minimum():
    sb = {0: 1000, 1: 1000}
    p = _plan(100 + 2 * 16 * 1000 + 5000, sb)
    assert p.all_fit and p.slots == {0: 16, 1: 16} and p.left == 5000
    p = _plan(100 + 2 * 4 * 1000, sb)  # exactly the minimum
    assert p.slots == {0: 4, 1: 4} and p.minimum == 100 + 8000
    with pytest.raises(ConfigError) as e:
        _plan(100 + 2 * 4 * 1000 - 1, sb)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("m.gguf: --mem ")
    assert "; --mem 50MiB works (that sum and 40 MiB of room" in msg


def test_extra_slots_go_to_the_cheapest_layers():
    """What a uniform count leaves goes one slot each to the layers whose slots cost least."""
    p = _plan(100 + 5 * (300 + 200) + 200, {0: 300, 1: 200})
    assert p.slots == {0: 5, 1: 6}


def test_parse_mem():
    assert parse_mem("1.5GiB") == int(1.5 * GiB) and parse_mem("800M") == 800 * MiB
    for bad, what in (("", "empty"), ("abc", "cannot read"), ("1MiB", "below the 64 MiB minimum")):
        with pytest.raises(ConfigError, match=what):
            parse_mem(bad)


def test_mem_and_slots_refused_together(default_gguf, capsys):
    assert cli.main(["run", "-m", str(default_gguf), "--mem", "1GiB", "--slots", "8", "-n", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moestream: error: --mem 1GiB and --slots 8 both size the slot pools: give one of them"]


def _smallest(err: str) -> str:
    m = re.search(r"; --mem ([0-9.]+[MG]iB) works \(that sum and \d+ MiB of room", err)
    assert m, err
    return m.group(1)


def test_too_small_names_the_smallest_that_works(default_gguf):
    """A budget below what dense + KV + top-k slots need: one line with the smallest --mem, nothing on stdout; that
    size runs in a fresh process (this one holds pytest too), with top-k slots or a few more (it is rounded up to
    10 MiB) and the plan printed."""
    from helpers import moestream

    p = moestream("run", "-m", str(default_gguf), "--mem", "100MiB", "-n", "4", "--temp", "0")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and p.stdout == ""
    assert len(lines) == 1 and lines[0].startswith(f"moestream: error: {default_gguf}: --mem 100MiB is too small")
    size = _smallest(lines[0])
    p = moestream("run", "-m", str(default_gguf), "--mem", size, "-n", "4", "--temp", "0")
    assert p.returncode == 0, p.stderr
    err = p.stderr
    m = re.search(r"memory plan: --mem \S+ = .* pools [0-9.]+ GiB \((\d+)(?:-(\d+))? slots/layer of 64", err)
    assert m, err
    assert 4 <= int(m.group(1)) <= 64


def test_budget_too_small_is_refused_before_any_weight_is_read(default_gguf, monkeypatch):
    """The memory plan comes first (issue 23): a --mem that cannot hold top-k slots per layer is refused from the
    tensor table, before the loader reads a weight; a budget that fits gets the store in the same call, its pools
    fitted to the process measured after the load (no deferred store for the caller to finish)."""
    from moestream.models.base import MoEModel

    opts = LoadOptions(mem=parse_mem("100MiB"), mem_source="--mem 100MiB")
    reads = []
    real = MoEModel.load_declared
    monkeypatch.setattr(MoEModel, "load_declared", lambda self, *a: reads.append(1) or real(self, *a))
    with pytest.raises(ConfigError, match=r"--mem 100MiB is too small"):
        load_model(str(default_gguf), opts, n_ctx=64)
    assert reads == []
    model = load_model(str(default_gguf), LoadOptions(mem=parse_mem("20GiB"), mem_source="--mem 20GiB"), n_ctx=64)
    assert reads == [1]
    assert model.store.streaming and model.memory_plan.n_ctx == 64
    assert set(model.memory_plan.slots.values()) == {64}  # every expert fits in 20 GiB
    model.store.close()


def test_every_expert_fits_says_resident_mode_reads_them_in_place(default_gguf):
    """A plan that holds every expert of the file (its expert count read with the gguf package) says so and that
    --moe-stream off reads them in place (no pools, no reads), in run's line and inspect's report; one that
    holds fewer says neither."""
    import dataclasses

    from gguf import GGUFReader

    field = GGUFReader(default_gguf).fields["qwen3moe.expert_count"]
    n = int(field.parts[field.data[0]][0])
    plan = open_model(str(default_gguf)).plan_memory(LoadOptions(mem=parse_mem("20GiB"), mem_source="--mem 20GiB"),
                                                     64, loaded=False)
    assert plan.all_fit and set(plan.slots.values()) == {n}
    assert f"of {n}, every expert fits: nothing is evicted; --moe-stream off reads them in place)" in plan.line()
    assert "every expert fits, nothing is evicted; --moe-stream off reads them in place)" in "\n".join(plan.lines())
    fewer = dataclasses.replace(plan, slots={la: n // 2 for la in plan.slots}, all_fit=False)
    assert "every expert fits" not in fewer.line() and "--moe-stream off" not in fewer.line()


def test_inspect_mem_prints_the_plan_run_uses(default_gguf):
    """inspect --mem prints the plan run makes: the same dense, KV and scratch figures, the process measured within
    64 MiB of run's own (fresh processes both), and pools = budget less the rest."""
    from helpers import moestream

    p = moestream("inspect", "-m", str(default_gguf), "--mem", "2GiB", "-c", "14")
    assert p.returncode == 0, p.stderr
    got = dict(re.findall(r"^  (process|dense weights|KV cache|scratch|slot pools|left) +([0-9.]+) GiB", p.stdout,
                          re.M))
    assert set(got) == {"process", "dense weights", "KV cache", "scratch", "slot pools", "left"}, p.stdout
    assert "every expert fits" in p.stdout and "minimum" in p.stdout
    r = moestream("run", "-m", str(default_gguf), "--mem", "2GiB", "-n", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    m = re.search(r"memory plan: --mem 2GiB = process ([0-9.]+) \+ dense ([0-9.]+) \+ KV ([0-9.]+) \(14 tokens\) "
                  r"\+ scratch ([0-9.]+) \+ pools ([0-9.]+) GiB", r.stderr)
    assert m, r.stderr
    assert abs(float(m.group(1)) - float(got["process"])) <= 64 / 1024
    assert abs(float(m.group(2)) - float(got["dense weights"])) < 0.01
    assert float(m.group(4)) == pytest.approx(float(got["scratch"]), abs=0.006)
    assert abs(float(m.group(5)) - float(got["slot pools"])) < 0.01


def test_inspect_minimum_is_about_and_names_a_mem_run_takes(default_gguf):
    """inspect's minimum has this process's size in it, run's its own (often tens of MiB more: inspect said 0.426
    GiB, run refused 440 MiB naming 0.44): the line says "about" and names a --mem with run's room for that, which
    covers run's own sum and runs."""
    from helpers import moestream

    p = moestream("inspect", "-m", str(default_gguf), "--mem", "2GiB")
    assert p.returncode == 0, p.stderr
    m = re.search(r"^  minimum +about ([0-9.]+) GiB \(4 slots per layer, the top-k; the process part is this "
                  r"process's, run measures its own, often tens of MiB more: give run --mem (\d+MiB) or more\)$",
                  p.stdout, re.M)
    assert m, p.stdout
    suggested = parse_mem(m.group(2))
    assert suggested >= float(m.group(1)) * GiB + 40 * MiB
    r = moestream("run", "-m", str(default_gguf), "--mem", "100MiB", "-n", "2")
    run_sum = re.search(r"= ([0-9.]+) GiB; --mem", r.stderr)
    assert r.returncode == 1 and run_sum, r.stderr
    assert suggested >= float(run_sum.group(1)) * GiB
    r = moestream("run", "-m", str(default_gguf), "--mem", m.group(2), "-n", "2", "--temp", "0")
    assert r.returncode == 0 and "memory plan: --mem" in r.stderr, r.stderr


def test_budget_store_is_identical_to_resident(default_gguf, monkeypatch):
    """Pools sized by a budget (a few slots per layer: misses and evictions) give the resident logits bitwise. (This
    process's memory, which the plan measures, is held fixed: pytest's own moves by more than the model's slots.)"""
    import torch

    from moestream import budget
    from moestream.engine import Engine
    monkeypatch.setattr(budget, "process_rss", lambda exclude=(): 400 * MiB)
    resident = load_model(str(default_gguf), LoadOptions(moe_stream=False))
    ids = list(range(1, 40))
    ref = Engine(resident).prefill(ids, resident.new_cache(48), logits_all=True)
    probe = open_model(str(default_gguf))  # the loader's plan: from the tensor table, before the load
    need = probe.plan_memory(LoadOptions(mem=2**40), n_ctx=48, loaded=False).minimum  # bytes for top-k slots
    m = load_model(str(default_gguf), LoadOptions(mem=need + 6 * 4 * probe.layout.bytes_per_expert(0), n_ctx=48))
    try:
        per = m.store.slots_per_layer()
        assert all(m.top_k <= n < m.n_experts for n in per.values()), per
        got = Engine(m).prefill(ids, m.new_cache(48), logits_all=True)
        assert torch.equal(ref.view(torch.int32), got.view(torch.int32))
        assert m.store.stats.misses > 0
    finally:
        m.store.close()


def _no_cap() -> str | None:
    try:
        MemCap.check()
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_no_cap() is not None, reason=f"no usable memory cgroup: {_no_cap()}")
def test_budget_holds_under_a_real_cap(default_gguf):
    """Under a memory cgroup equal to --mem (page cache included, swap off), from the smallest size that works up
    to far more than the model: the run finishes and is never OOM-killed. (The cgroup's peak cannot pass the cap
    -- the kernel enforces it -- so what shows the budget held is that the run was not killed; the control run
    shows the cap at the smallest size does kill a process that holds more than it.)"""
    from helpers import moestream

    smallest = parse_mem(_smallest(moestream("run", "-m", str(default_gguf), "--mem", "100MiB").stderr))
    hog = f"x = bytearray({smallest + 64 * MiB}); x[::4096] = b'1' * len(x[::4096]); print(len(x))"
    control = MemCap(smallest).run([sys.executable, "-c", hog])
    assert control.oom_killed or control.returncode != 0, "the cap did not bite: this test would prove nothing"
    for cap in (smallest, smallest + 16 * MiB, smallest + 64 * MiB, 2 * GiB):
        cmd = [sys.executable, "-m", "moestream", "run", "-m", str(default_gguf), "--mem", f"{cap}B", "-n", "32",
               "-p", "A long prompt about the printing press " * 8, "--temp", "0"]
        res = MemCap(cap).run(cmd)
        assert res.returncode == 0 and not res.oom_killed, (cap, res.stderr[-2000:])
        assert 0 < res.peak_bytes <= cap, (cap, res.peak_bytes)
        assert "memory plan: --mem" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["inspect", "-c", "5"], "-c: inspect prices a context only with --mem"),
    (["inspect", "--mem", "1GiB", "-c", "3000000000"], "-c must be from 1 to 2^31, got 3000000000"),
    (["inspect", "--mem", "1GiB", "-c", "5000"], "past the 4096 tokens default.gguf was trained for"),
    (["run", "--mem", "0.5", "-n", "1"], "--mem 0.5: below the 64 MiB minimum"),
])
def test_inspect_and_mem_refusals_are_one_line(args, needle, capsys):
    """inspect -c gets run's context checks; a --mem below the minimum names the value as given (newcomer review)."""
    assert cli.main(args) == 1
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: ") and needle in lines[0], out.err
    assert out.out == ""


def test_process_rss_reads_the_rollup_as_the_smaps_sum(tmp_path):
    """process_rss reads the kernel's rollup where no excluded file is mapped (issue 27's start: a process with torch
    has hundreds of mappings to walk) and walks /proc/self/smaps where one is: the same figure either way, and a
    mapped file's touched pages are left out only where it is excluded."""
    import mmap
    import os

    from moestream import budget

    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(16 * MiB))

    def smaps(skip: str = "") -> int:  # the sum process_rss took from smaps alone before the rollup
        total, counting = 0, True
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(":"):
                    parts = line.split(None, 5)
                    counting = not (skip and len(parts) > 5 and parts[5].strip() == skip)
                elif head == "Rss:" and counting:
                    total += int(line.split()[1]) * 1024
        return total

    def near(fn, skip: str = "") -> bool:  # noqa: ANN001 - fn() within 2 MiB of smaps read just before and after it
        # (another thread of the test process, e.g. an earlier test's reader or server, may allocate in between;
        # three tries)
        for _ in range(3):
            a, got, b = smaps(skip), fn(), smaps(skip)
            if min(a, b) - 2 * MiB < got < max(a, b) + 2 * MiB:
                return True
        return False

    assert near(budget.process_rss)
    assert near(lambda: budget.process_rss([str(path)]))  # not mapped: the rollup
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) >= 0  # every page touched
        assert near(budget.process_rss) and near(lambda: budget.process_rss([str(path)]), os.path.realpath(path))
        whole, less = budget.process_rss(), budget.process_rss([str(path)])
        assert 15 * MiB < whole - less < 17 * MiB


def test_inspect_device_pools_price_the_host_side_without_host_pools(default_gguf, monkeypatch):
    """``inspect --device cuda --gpu-mem G --host-cache H --mem M`` (pools in GPU memory, the default --pool
    device): the host side is the process and the tier only, not a second set of pools in host memory (a
    newcomer's report of 2026-12-05: the q32 file priced 10.9 GiB of host pools beside its 10.9 GiB tier). The
    tier is at most every expert: the `gguf` package's byte counts of the expert tensors (read buffered)."""
    import gguf
    import torch

    from moestream.report import inspect_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA LoadOptions on this CPU torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    every = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(default_gguf)).tensors if "_exps." in t.name)
    opts = LoadOptions(device="cuda", gpu_mem=GiB, host_cache=64 * GiB, mem=64 * GiB, direct_io=False)
    text = inspect_model(str(default_gguf), opts, 160)
    pools = [ln for ln in text.splitlines() if ln.strip().startswith("slot pools")]
    assert len(pools) == 1, text  # the GPU plan's, none on the host
    assert "GPU memory plan" in text and "host memory" in text
    tier = re.search(r"host tier\s+([0-9.]+) GiB", text)
    assert tier and abs(float(tier.group(1)) - every / GiB) < 0.0005, (tier, every)
    assert re.search(r"^  left\s+[0-9.]+ GiB$", text, re.M)
    # a --mem below process + tier: said, with a size that holds both
    small = inspect_model(str(default_gguf), LoadOptions(device="cuda", gpu_mem=GiB, host_cache=64 * GiB,
                                                         mem=16 * MiB, direct_io=False), 160)
    assert re.search(r"^  over\s+[0-9.]+ GiB: process \+ host tier need", small, re.M), small
