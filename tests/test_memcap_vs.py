"""bench --mem-cap (memory cgroup, page cache included) and bench --vs llama.cpp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moestream import memcap
from moestream.errors import ConfigError
from moestream.memcap import MemCap, parse_size

needs_cgroup = pytest.mark.skipif(
    not __import__("os").path.isfile(f"{memcap.CGROUP_V1}/memory.limit_in_bytes"),
    reason="no cgroup v1 memory controller on this machine")


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
    monkeypatch.setattr(memcap, "CGROUP_V1", str(tmp_path / "no-such-controller"))
    with pytest.raises(ConfigError, match="needs the cgroup v1 memory controller"):
        MemCap.check()


@needs_cgroup
def test_cap_limits_and_reports_peak():
    code = "x = bytearray({} * 2**20); x[::4096] = b'1' * len(x[::4096]); print(len(x))"
    ok = MemCap(parse_size("256MiB")).run([sys.executable, "-c", code.format(64)])
    assert ok.returncode == 0 and not ok.oom_killed
    assert 64 * 2**20 <= ok.peak_bytes <= 256 * 2**20
    killed = MemCap(parse_size("96MiB")).run([sys.executable, "-c", code.format(400)])
    assert killed.returncode != 0 and killed.oom_killed
    assert killed.peak_bytes <= 96 * 2**20 + 2**20


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
    code = "from moestream.engine import available_memory; print(available_memory())"
    r = MemCap(parse_size("512MiB")).run([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    assert 0 < int(r.stdout) <= 512 * 2**20
