"""GPU telemetry (moestream/telemetry.py) with a fake sample source, and bench's llama-bench rows with a fake
llama-bench: no GPU and no llama.cpp build needed."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import moestream
from moestream import bench, telemetry
from moestream.telemetry import GpuSample, GpuSampler, GpuSummary, merge, summarize, summarize_windows

GiB = 2**30


def _samples() -> list[GpuSample]:
    # t, util %, memory bytes, power W
    return [GpuSample(0.0, 0, 1 * GiB, 100), GpuSample(1.0, 50, 3 * GiB, 300), GpuSample(2.0, 100, 2 * GiB, 500),
            GpuSample(3.0, 10, 8 * GiB, 120)]


def test_summarize_window_means_and_peak() -> None:
    s = summarize(_samples(), 0.5, 2.5)  # the samples at t = 1 and 2 only
    assert s == GpuSummary(samples=2, util_mean_pct=75.0, power_mean_w=400.0, mem_peak_gib=3.0)
    assert summarize(_samples()).mem_peak_gib == 8.0 and summarize(_samples()).samples == 4
    assert summarize(_samples(), 10, 20) is None and summarize([]) is None
    w = summarize_windows(_samples(), [(0, 0.5), (1.5, 2.5), (1.9, 2.1)])  # t = 0 and 2; 2 counted once
    assert w == GpuSummary(samples=2, util_mean_pct=50.0, power_mean_w=300.0, mem_peak_gib=2.0)


def test_merge_weights_by_sample_count() -> None:
    a = summarize(_samples()[:1])  # 1 sample: util 0, 100 W, 1 GiB
    b = summarize(_samples()[1:])  # 3 samples: util 160/3, 920/3 W, 8 GiB
    m = merge([a, None, b.as_dict()])
    assert m.samples == 4 and m.util_mean_pct == pytest.approx(40.0) and m.power_mean_w == pytest.approx(255.0)
    assert m.mem_peak_gib == 8.0 and m == summarize(_samples())
    assert merge([None, None]) is None and merge([]) is None


def test_sampler_samples_until_stopped_and_survives_a_failing_source() -> None:
    calls = []
    lock = threading.Lock()

    def source() -> GpuSample:
        with lock:
            calls.append(1)
            n = len(calls)
        if n > 6:
            raise RuntimeError("the GPU went away")
        return GpuSample(time.monotonic(), 10 * n, n * GiB, 50)

    with GpuSampler(source, interval=0.005) as s:
        deadline = time.monotonic() + 5
        while len(calls) < 7 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert len(s.samples) == 6  # the seventh raised: sampling ended, the six kept
    w = s.window()
    assert w.samples == 6 and w.util_mean_pct == pytest.approx(35.0) and w.mem_peak_gib == 6.0


def test_nvml_source_without_pynvml_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert telemetry.nvml_source() is None and telemetry.sampler() is None


LLAMA_JSON = [{"n_prompt": 8, "n_gen": 0, "avg_ts": 100.5, "stddev_ts": 1.5, "samples_ts": [99.0, 102.0],
               "n_gpu_layers": 99, "n_cpu_moe": 0, "backends": "CUDA", "gpu_info": "H200"},
              {"n_prompt": 0, "n_gen": 4, "avg_ts": 20.0, "stddev_ts": 0.0, "samples_ts": [20.0],
               "n_gpu_layers": 99, "n_cpu_moe": 0, "backends": "CUDA", "gpu_info": "H200"}]


def test_parse_llama_bench_json_and_windows() -> None:
    tests = bench.parse_llama_bench_json(json.dumps(LLAMA_JSON))
    assert [(t["test"], t["tok_s_mean"], t["tok_s_sd"]) for t in tests] == [("pp8", 100.5, 1.5), ("tg4", 20.0, 0.0)]
    stamps = [(1.0, "llama-bench: benchmark 1/2: starting"), (2.0, "llama-bench: benchmark 1/2: warmup prompt run"),
              (3.0, "llama-bench: benchmark 1/2: prompt run 1/2"), (4.0, "llama-bench: benchmark 1/2: prompt run 2/2"),
              (5.0, "llama-bench: benchmark 2/2: starting"), (6.0, "llama-bench: benchmark 2/2: warmup generation run"),
              (7.0, "llama-bench: benchmark 2/2: generation run 1/1")]
    assert bench.test_windows(stamps, 9.0) == {1: (3.0, 5.0), 2: (7.0, 9.0)}
    with pytest.raises(bench.OutputError, match="did not print JSON"):
        bench.parse_llama_bench_json("oops")


FAKE_LLAMA_BENCH = """#!{python}
import json, sys, time
args = sys.argv[1:]
open({log!r}, "a").write(json.dumps(args) + "\\n")
tests = {tests}
out = []
for k, t in enumerate(tests, 1):
    print(f"llama-bench: benchmark {{k}}/{{len(tests)}}: starting", file=sys.stderr, flush=True)
    kind = "prompt" if t["n_prompt"] else "generation"
    print(f"llama-bench: benchmark {{k}}/{{len(tests)}}: {{kind}} run 1/1", file=sys.stderr, flush=True)
    time.sleep(0.05)
    out.append(t)
print(json.dumps(out))
"""


def test_bench_llama_bench_rows(tmp_path: Path) -> None:
    """--vs llama.cpp --llama-bench PATH: the binary's rows (the CPU one with --device cpu: -ngl 0 -dev none),
    parsed from its JSON, with a device column and the ratio against it; the moestream row carries device cpu."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), tests=repr(LLAMA_JSON)))
    fake.chmod(0o755)
    out = tmp_path / "b.json"
    p = moestream("bench", "-p", "8", "-n", "4", "-r", "1", "--slots", "4", "--moe-stream", "on", "-t", "1",
                  "--vs", "llama.cpp", "--llama-bench", str(fake), "--device", "cpu", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("engine", "moestream") for r in rows] == ["moestream", "llama-bench"]
    assert rows[0]["device"] == "cpu" and rows[1]["device"] == "cpu" and rows[1]["label"] == "llama.cpp CPU"
    assert [(t["test"], t["tok_s_mean"]) for t in rows[1]["tests"]] == [("pp8", 100.5), ("tg4", 20.0)]
    args = json.loads(log.read_text().splitlines()[0])
    for flag in (["-p", "8"], ["-n", "4"], ["-r", "1"], ["-o", "json"], ["-fa", "0"], ["-ngl", "0"],
                 ["-dev", "none"], ["-t", "1"]):
        i = args.index(flag[0])
        assert args[i:i + 2] == flag, args
    assert args[args.index("-m") + 1] == rows[0]["model"] and "--progress" in args and "--repack" not in args
    lines = [x for x in p.stdout.splitlines() if x.startswith("| default.gguf |")]
    assert len(lines) == 4 and all(x.split("|")[2].strip() == "cpu" for x in lines)
    ratios = [x.rsplit("|", 2)[-2].strip() for x in lines if "llama.cpp CPU" not in x]
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios)
    assert "GPU util" not in p.stdout.splitlines()[0]  # no row has telemetry here


def test_bench_llama_bench_crash_with_repack_gets_a_repack_off_row(tmp_path: Path) -> None:
    """A llama-bench that dies of SIGSEGV with CPU repacking on (llama.cpp's Q4_0 repack on Gemma-4's expert rows,
    2026-12-05) is named in its failed row, followed by the same row with --repack 0, which becomes the ratio's
    baseline; the run still succeeds."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "llama-bench"
    crash = "import os, signal\nif '--repack' not in args: os.kill(os.getpid(), signal.SIGSEGV)\n"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), tests=repr(LLAMA_JSON))
                    .replace("tests = ", crash + "tests = ", 1))
    fake.chmod(0o755)
    out = tmp_path / "b.json"
    p = moestream("bench", "-p", "8", "-n", "4", "-r", "1", "--moe-stream", "off", "-t", "1", "--vs", "llama.cpp",
                  "--llama-bench", str(fake), "--device", "cpu", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r.get("engine", "moestream"), r.get("repack", True)) for r in rows] == [
        ("moestream", True), ("llama-bench", True), ("llama-bench", False)]
    assert "SIGSEGV" in rows[1]["error"] and rows[1]["retried"] and "error" not in rows[2]
    assert [json.loads(x).count("--repack") for x in log.read_text().splitlines()] == [0, 1]
    assert "again with --repack 0" in p.stderr
    assert bench.ratio_baseline(rows) is rows[2]


def test_crash_detection_is_for_repacking_llama_rows_only() -> None:
    row = {"engine": "llama-bench", "repack": True}
    assert bench._crashed_with_repack(row, 1, "llama-bench exited with status -11: killed by SIGSEGV")
    assert bench._crashed_with_repack({"engine": "llama.cpp"}, -11, "exit status -11")
    assert not bench._crashed_with_repack(row, 1, "llama-bench exited with status 1: error loading model")
    assert not bench._crashed_with_repack({**row, "repack": False}, 1, "llama-bench exited with status -11: x")
    assert not bench._crashed_with_repack({"engine": None}, -11, "exit status -11")
    assert not bench._crashed_with_repack(row, -9, "OOM-killed under the 2G memory cap")


def test_bench_llama_bench_needs_vs(tmp_path: Path) -> None:
    p = moestream("bench", "-p", "8", "-n", "0", "--llama-bench", str(tmp_path / "nope"))
    assert p.returncode != 0 and "--vs llama.cpp" in p.stderr
    p = moestream("bench", "-p", "8", "-n", "0", "--vs", "llama.cpp", "--llama-bench", str(tmp_path / "nope"))
    assert p.returncode != 0 and "not an executable file" in p.stderr
    p = moestream("bench", "-p", "8", "-n", "0", "--device", "tpu")
    assert p.returncode != 0 and "--device" in p.stderr


def test_table_shows_gpu_columns_only_with_telemetry() -> None:
    row = {"model": "m.gguf", "moe_stream": False, "device": "cuda", "peak_rss_gib": 1.0,
           "tests": [{"test": "tg4", "tok_s_mean": 5.0, "tok_s_sd": 0.0, "streamed_gib": 0.0, "disk_read_gib": 0.0,
                      "gpu": {"samples": 3, "util_mean_pct": 87.4, "power_mean_w": 412.3, "mem_peak_gib": 20.5}}]}
    table = bench.format_table([row])
    head, line = table.splitlines()[0], table.splitlines()[2]
    assert "GPU util | GPU W | GPU mem GiB" in head and "| 87% | 412 | 20.50 |" in line and "| cuda |" in line
    row["tests"][0].update(host_cpu_pct=153.2, host_ms_per_token=2.5)  # issue 24: the host's share beside the GPU's
    table = bench.format_table([row])
    head, line = table.splitlines()[0], table.splitlines()[2]
    assert "GPU mem GiB | host CPU % | host ms/token" in head and "| 20.50 | 153% | 2.50 |" in line
    row["tests"][0].pop("gpu")
    assert "GPU util" not in bench.format_table([row])


def test_disk_read_bandwidth_is_the_best_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The IO limit's bandwidth is the fastest of its rounds (a limit: a slow round must not lower it), each round
    reading other offsets; a real round on a real file gives a positive rate."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"\1" * (1 << 20))
    assert bench._read_round(str(f), 8192, 4, 2, 0) > 0
    seeds: list[int] = []
    rates = iter([2.0e9, 5.0e9, 3.0e9])

    def fake(path: str, chunk: int, n: int, threads: int, seed: int) -> float:
        seeds.append(seed)
        return next(rates)

    monkeypatch.setattr(bench, "_read_round", fake)
    assert bench.disk_read_bandwidth(str(f), 8192, seed=7) == 5.0e9
    assert seeds == [7, 8, 9]
