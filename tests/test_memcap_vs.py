"""bench --mem-cap (memory cgroup, page cache included) and bench --vs llama.cpp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moestream import memcap
from moestream.errors import ConfigError
from moestream.memcap import MemCap, parse_size


def _no_cap(version: int | None = None) -> str | None:
    """Why no cap (of that cgroup version; None: either) can be applied on this machine, or None."""
    try:
        MemCap.check(version)
    except ConfigError as e:
        return str(e)
    return None


needs_cgroup = pytest.mark.skipif(_no_cap() is not None, reason=f"no usable memory cgroup: {_no_cap()}")


def test_parse_size():
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size("800MiB") == 800 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("12345") == 12345
    for bad in ("", "abc", "-1G", "4XB", "0"):
        with pytest.raises(ConfigError, match="--mem-cap: cannot read"):
            parse_size(bad)


def test_cap_that_cannot_be_applied_says_so(monkeypatch, tmp_path):
    """Neither hierarchy usable (a v2 tree with no memory controller, no v1 memory mount): one line that names
    what was found, before anything runs."""
    _tree(monkeypatch, tmp_path, v2={"unified": "hugetlb"})
    with pytest.raises(ConfigError) as e:
        MemCap.check()
    msg = str(e.value)
    assert "\n" not in msg and "needs a memory cgroup and found none" in msg
    assert f"{tmp_path}/unified has no memory controller" in msg and "lists hugetlb" in msg
    assert "no cgroup v1 memory controller is mounted" in msg and "nothing was run" in msg


@pytest.mark.parametrize("version", [1, 2])
def test_cap_limits_and_reports_peak(version):
    """A real capped process, on each cgroup version this machine has (the other is skipped): under the cap it
    runs, and its peak is reported; over it, the OOM killer stops it inside the cap."""
    why = _no_cap(version)
    if why:
        pytest.skip(f"cgroup v{version} cannot be used here: {why}")
    code = "x = bytearray({} * 2**20); x[::4096] = b'1' * len(x[::4096]); print(len(x))"
    ok = MemCap(parse_size("256MiB"), version).run([sys.executable, "-c", code.format(64)])
    assert ok.version == version and ok.peak_exact
    assert ok.returncode == 0 and not ok.oom_killed
    assert 64 * 2**20 <= ok.peak_bytes <= 256 * 2**20
    killed = MemCap(parse_size("96MiB"), version).run([sys.executable, "-c", code.format(400)])
    assert killed.returncode != 0 and killed.oom_killed
    assert killed.peak_bytes <= 96 * 2**20 + 2**20


# Which hierarchy is chosen: small trees under tmp_path, named by a mount table written like the kernel's.

def _tree(monkeypatch, tmp_path, v2=None, v1=(), mounts_only=False, as_root=True):
    """Mount points under ``tmp_path``: ``v2`` maps a name to its cgroup.controllers text, ``v1`` names v1 memory
    mounts (each with a memory.limit_in_bytes); a cpu v1 mount is always there. The mount table goes to
    MOUNTINFO (or, ``mounts_only``, to MOUNTS with MOUNTINFO missing)."""
    def point(name: str) -> str:  # as the kernel writes a mount point: a space is \040
        return f"{tmp_path}/{name}".replace(" ", "\\040")

    (tmp_path / "cpu").mkdir()
    info = ["22 1 0:20 / / rw - ext4 /dev/sda1 rw", f"31 22 0:28 / {point('')} rw - tmpfs tmpfs rw",
            f"32 31 0:29 / {point('cpu')} rw,relatime - cgroup cgroup rw,cpu"]
    mounts = [f"cgroup {point('cpu')} cgroup rw,cpu 0 0"]
    for name in v1:
        (tmp_path / name).mkdir()
        (tmp_path / name / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        info.append(f"35 31 0:32 / {point(name)} rw - cgroup cgroup rw,memory")
        mounts.append(f"cgroup {point(name)} cgroup rw,memory 0 0")
    for name, ctrls in (v2 or {}).items():
        d = tmp_path / name
        d.mkdir()
        for f, text in (("cgroup.controllers", ctrls), ("cgroup.subtree_control", ""), ("cgroup.procs", "1")):
            (d / f).write_text(text + "\n")
        info.append(f"41 31 0:38 / {point(name)} rw,relatime - cgroup2 cgroup2 rw")
        mounts.append(f"cgroup2 {point(name)} cgroup2 rw 0 0")
    if mounts_only:
        monkeypatch.setattr(memcap, "MOUNTINFO", str(tmp_path / "no-mountinfo"))
    else:
        (tmp_path / "mountinfo").write_text("\n".join(info) + "\n")
        monkeypatch.setattr(memcap, "MOUNTINFO", str(tmp_path / "mountinfo"))
    (tmp_path / "mounts").write_text("\n".join(mounts) + "\n")
    monkeypatch.setattr(memcap, "MOUNTS", str(tmp_path / "mounts"))
    monkeypatch.setattr(memcap.os, "geteuid", lambda: 0 if as_root else 1000)


def test_memcap_hybrid_without_v2_memory_uses_v1(monkeypatch, tmp_path):
    """This machine's layout: v2 at .../unified with only hugetlb, the memory controller on v1."""
    _tree(monkeypatch, tmp_path, v2={"unified": "hugetlb"}, v1=["memory"])
    assert MemCap.check() == memcap.Hierarchy(1, str(tmp_path / "memory"))


def test_memcap_v2_with_memory_is_chosen(monkeypatch, tmp_path):
    """A v2 hierarchy with the memory controller wins, wherever it is mounted (a mount point with a space,
    written \\040 in the table); the cpu-only v1 mount and a v2 mount without memory are passed over."""
    _tree(monkeypatch, tmp_path, v2={"unified": "hugetlb", "my cgroup": "cpuset cpu io memory hugetlb pids"},
          v1=["memory"])
    assert MemCap.check() == memcap.Hierarchy(2, str(tmp_path / "my cgroup"))
    assert MemCap.check(1) == memcap.Hierarchy(1, str(tmp_path / "memory"))


def test_memcap_mounts_when_mountinfo_cannot_be_read(monkeypatch, tmp_path):
    _tree(monkeypatch, tmp_path, v2={"cg": "cpu memory"}, mounts_only=True)
    assert MemCap.check() == memcap.Hierarchy(2, str(tmp_path / "cg"))


def test_memcap_forced_version_says_what_is_missing(monkeypatch, tmp_path):
    _tree(monkeypatch, tmp_path, v2={"unified": "hugetlb"}, v1=["memory"])
    with pytest.raises(ConfigError, match=r"unified has no memory controller \(.*cgroup.controllers lists hugetlb\)"):
        MemCap.check(2)


def test_memcap_forced_v1_on_a_v2_only_machine(monkeypatch, tmp_path):
    _tree(monkeypatch, tmp_path, v2={"cg": "cpu memory"})
    with pytest.raises(ConfigError, match="no cgroup v1 memory controller is mounted"):
        MemCap.check(1)


def test_memcap_v2_group_with_processes_cannot_enable_memory(monkeypatch, tmp_path):
    """A v2 mount that is not the root cgroup (it has cgroup.type: a container's cgroup namespace), with processes
    in it and memory not in its subtree_control: the no-internal-processes rule, said before anything runs. The
    root cgroup is exempt from the rule, and where memory is already given to children there is nothing to do."""
    _tree(monkeypatch, tmp_path, v2={"cg": "cpu memory"})
    assert MemCap.check() == memcap.Hierarchy(2, str(tmp_path / "cg"))  # the root cgroup: no cgroup.type
    (tmp_path / "cg" / "cgroup.type").write_text("domain\n")
    with pytest.raises(ConfigError, match=r"cg/cgroup.subtree_control does not give the memory controller to child "
                                          r"groups .* has processes in it \(cgroup v2's no-internal-processes rule\)"):
        MemCap.check()
    (tmp_path / "cg" / "cgroup.subtree_control").write_text("cpu memory\n")
    assert MemCap.check().version == 2


def test_memcap_needs_root(monkeypatch, tmp_path):
    _tree(monkeypatch, tmp_path, v1=["memory"], as_root=False)
    with pytest.raises(ConfigError, match="--mem-cap needs root"):
        MemCap.check()


@needs_cgroup
def test_bench_row_that_fails_says_so_on_stderr(tmp_path):
    """A row OOM-killed under the cap: the table says "failed", the JSON keeps the row, and stderr ends with one
    error line naming the model; exit status 1."""
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "moestream", "bench", "-p", "4", "-n", "2", "-r", "1", "--slots", "4",
                        "--moe-stream", "on", "--mem-cap", "64MiB", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("moestream: error: ") and "default.gguf: 1 of 1 bench rows failed" in last, p.stderr
    assert "OOM-killed under the 64MiB memory cap" in last
    assert "Traceback" not in p.stderr
    assert "failed: OOM-killed" in p.stdout
    assert "error" in json.loads(out.read_text())["rows"][0]


@needs_cgroup
@pytest.mark.llamacpp
def test_bench_vs_llamacpp_under_a_cap(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/test.sh")
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "moestream", "bench", "-p", "8", "-n", "4", "-r", "1", "--slots", "8",
                        "--vs", "llama.cpp", "--mem-cap", "2GiB", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    head = p.stdout.splitlines()[0]
    assert "cgroup peak GiB" in head and "moestream / llama.cpp" in head
    rows = json.loads(out.read_text())["rows"]
    kinds = [(r.get("engine", "moestream"), r.get("repack")) for r in rows]
    assert ("llama.cpp", True) in kinds and ("llama.cpp", False) in kinds
    for r in rows:
        assert r["mem_cap"] == "2GiB"
        assert r["cgroup_peak_gib"] is not None and 0 < r["cgroup_peak_gib"] <= 2.0
    ratios = [line.rsplit("|", 2)[-2].strip() for line in p.stdout.splitlines()[2:] if "| streaming |" in line]
    assert ratios and all(float(x) > 0 for x in ratios)


@needs_cgroup
def test_available_memory_sees_the_cgroup_limit():
    """The KV-cache checks (-c, -n -1, -cnv) size against the memory cgroup's limit when it is tighter than the
    machine's available memory (a container), not against the host's MemAvailable."""
    code = "from moestream.budget import available_memory; print(available_memory())"
    r = MemCap(parse_size("512MiB")).run([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    assert 0 < int(r.stdout) <= 512 * 2**20


@needs_cgroup
def test_capped_rows_take_the_budget_run_takes_in_the_cap(tmp_path):
    """bench under --mem-cap without --mem or --slots plans each row for what ``run``'s auto budget takes in a
    cgroup of that size (measured here by a process in one: the cgroup's own accounting), not for the whole cap:
    a plan of the whole cap leaves the process's mapped file pages no room, and they fault back in every token."""
    from moestream.budget import capped_budget

    cap = 2**30
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "moestream", "bench", "-p", "4", "-n", "2", "-r", "1", "--moe-stream",
                        "on", "--mem-cap", "1GiB", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["mem"]["bytes"] == capped_budget(cap) < cap
    assert f"streaming, --mem {row['mem']['text']}" in p.stdout
    code = "from moestream.budget import auto_budget; print(auto_budget()[0])"
    r = MemCap(cap).run([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    assert abs(int(r.stdout) - capped_budget(cap)) <= 64 * 2**20, (int(r.stdout), capped_budget(cap))
