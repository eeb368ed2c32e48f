"""Per-token run traces (moestream/runtrace.py; ``run --trace`` and ``bench --trace``) on the embedded model.

Every trace here comes from a real run. Its numbers are held against things the writer does not compute: the
text against what ``run`` printed on stdout, the per-layer hits and misses against the routing trace of the same
run replayed through the LFU simulator (experts/trace.py, written independently of the store), the bytes read
against the misses times the layout's expert sizes (buffered reads), the sums against the generation's own
statistics, the GPU readings against the samples of a fake NVML source, bench's records against its JSON.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from helpers import cli
from moestream import runtrace, telemetry
from moestream.engine import Engine, Sampler, SamplingParams
from moestream.experts.trace import RoutingTrace, simulate
from moestream.models.base import LoadOptions, load_model
from moestream.options import default_model_path
from moestream.runtrace import GpuWindow, RunTraceError, TraceWriter, read_trace
from moestream.telemetry import GpuSample
from moestream.tokenizer import GGUFTokenizer

PROMPT = "The history of the printing press"


def lines_of(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8").read().splitlines()]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """``run -n 8 --slots 8 --direct-io off --trace T --routing-trace R``: (CompletedProcess, run trace, routing
    trace)."""
    d = tmp_path_factory.mktemp("runtrace")
    t, r = d / "run.jsonl", d / "routing.jsonl"
    p = cli("run", "-n", "8", "--temp", "0", "--slots", "8", "--direct-io", "off", "-p", PROMPT, "--trace", str(t),
            "--routing-trace", str(r))
    assert p.returncode == 0, p.stderr
    return p, read_trace(str(t)), RoutingTrace.read(str(r))


def test_run_trace_header_and_records(traced_run):
    p, tr, _ = traced_run
    h = tr.header
    assert h["format"] == "moestream-run-trace" and h["version"] == 1 and h["command"] == "run"
    assert h["model"]["name"] == "default.gguf" and h["model"]["arch"] == "qwen3moe"
    assert h["model"]["path"] == os.path.abspath(default_model_path())
    model = load_model(default_model_path(), LoadOptions(metadata_only=True))
    assert h["layers"] == model.layout.moe_layers
    assert h["options"]["n_predict"] == 8 and h["options"]["slots"] == 8 and h["options"]["prompt"] == PROMPT
    assert h["store"]["streaming"] is True and h["store"]["slots_per_layer"] == [8] * len(h["layers"])
    assert h["store"]["io"] == "buffered"
    import torch
    assert h["versions"]["torch"] == torch.__version__ and h["versions"]["python"]
    assert h["machine"]["cpus"] == os.cpu_count() and h["device"] == "cpu" and h["gpu_telemetry"] is None
    assert "trace of 9 records written to" in p.stderr
    # one prefill record for the whole prompt, then one per generated token
    recs = tr.tokens
    assert [r["phase"] for r in recs] == ["prefill"] + ["decode"] * 8
    assert [r["i"] for r in recs] == list(range(9))
    tok = GGUFTokenizer.from_gguf(default_model_path())
    prompt_ids = tok.encode(PROMPT, add_special=True)
    assert recs[0]["n"] == len(prompt_ids) and recs[0]["text"] == tok.decode(prompt_ids)
    # the generated text, token by token, is what run printed after the prompt echo
    assert p.stdout == PROMPT + "".join(r["text"] for r in recs[1:]) + "\n"
    assert tok.decode([r["id"] for r in recs[1:]]) == "".join(r["text"] for r in recs[1:])
    end = tr.ends[0]
    assert end["stop_reason"] == "n_predict" and end["n_prompt"] == len(prompt_ids) and end["n_decode"] == 7
    # the time line: each record ends where the next begins
    for a, b in zip(recs, recs[1:], strict=False):
        assert b["t"] == pytest.approx(a["t"] + b["dt"], abs=2e-6)
        assert b["dt"] > 0
    for r in recs:
        assert r["rss"] > 50 * 2**20 and r["cpu_pct"] >= 0 and r["io_wait_s"] >= 0 and r["gpu"] is None


def test_run_trace_expert_counts_match_the_routing_trace(traced_run):
    """Per record and per layer, hits and misses are those of the same run's slot requests replayed through the
    LFU simulator: the prefill record gets the prefill's requests; decode record k (k >= 2) the requests of the
    decode step that fed token k-1 (the first generated token comes from the prefill's logits: nothing)."""
    _, tr, rt = traced_run
    layers = tr.layers
    per_layer = {layer: [q for q in rt.requests if q[0] == layer] for layer in layers}
    # request index -> (hits, misses) of the request, from the simulator run on that layer alone
    counts = {}
    for layer, reqs in per_layer.items():
        for j in range(len(reqs)):
            res = simulate(reqs, "lfu", 8, window=(j, j + 1))
            counts[(layer, j)] = (res.hits, res.misses)
    idx = {layer: 0 for layer in layers}  # next request of each layer
    decode_start = rt.decode_start
    seen = 0

    def take(until_global: int) -> tuple[list[int], list[int]]:
        nonlocal seen
        hits, misses = [0] * len(layers), [0] * len(layers)
        while seen < until_global:
            layer = rt.requests[seen][0]
            h, m = counts[(layer, idx[layer])]
            idx[layer] += 1
            k = layers.index(layer)
            hits[k] += h
            misses[k] += m
            seen += 1
        return hits, misses

    recs = tr.tokens
    assert (recs[0]["hits"], recs[0]["misses"]) == take(decode_start)
    assert sum(recs[1]["hits"]) + sum(recs[1]["misses"]) == 0  # sampled from the prefill's logits
    for k, r in enumerate(recs[2:]):
        assert (r["hits"], r["misses"]) == take(decode_start + (k + 1) * len(layers)), f"record {k + 2}"
    assert seen == len(rt.requests)
    # and the routing trace's header has the store's own totals
    assert sum(sum(r["hits"]) for r in recs) == rt.meta["hits"]
    assert sum(sum(r["misses"]) for r in recs) == rt.meta["misses"]


def test_run_trace_bytes_are_the_misses_expert_sizes(traced_run):
    """Buffered reads: every miss reads its expert's bytes, once (the layout's sizes), and the disk is asked for
    no more than the expert bytes read (page-cache hits are not disk reads)."""
    _, tr, _ = traced_run
    model = load_model(default_model_path(), LoadOptions(metadata_only=True))
    size = {layer: model.layout.bytes_per_expert(layer) for layer in tr.layers}
    for r in tr.tokens:
        assert r["read_bytes"] == sum(m * size[layer] for layer, m in zip(tr.layers, r["misses"], strict=True))
        assert "disk_bytes" not in r  # per generation (the end line), not per token


def test_writer_sums_match_the_generation_stats(tmp_path):
    """The library writer around an Engine generation (as serve uses it): the records' sums are the
    generation's own statistics; a stop at an end-of-generation token gets its record (eog) and the end line."""
    model = load_model(default_model_path(), LoadOptions(moe_stream=True, slots=8, direct_io=False))
    tok = GGUFTokenizer.from_gguf(default_model_path())
    engine = Engine(model)
    ids = tok.encode(PROMPT, add_special=True)
    path = tmp_path / "lib.jsonl"
    tw = TraceWriter(str(path))
    tw.header(model, "serve", {"port": 8080})
    gen = engine.stream(ids, 12, Sampler(SamplingParams(temp=0)), stop_ids=tok.eos_ids)
    out = list(tw.follow(gen, tok, PROMPT, request="req-1"))
    # a second generation whose stop ids hold a later greedy token (one not generated before it): it ends at that
    # end-of-generation token
    k = next(k for k in range(2, len(out)) if out[k] not in out[:k])
    gen2 = engine.stream(ids, 12, Sampler(SamplingParams(temp=0)), stop_ids={out[k]})
    out2 = list(tw.follow(gen2, tok, PROMPT, request="req-2"))
    tw.close()
    assert out2 == out[:k] and gen2.eog == out[k]
    tr = read_trace(str(path))
    assert tr.header["command"] == "serve" and tr.header["options"] == {"port": 8080}
    r1 = [r for r in tr.tokens if r["request"] == "req-1"]
    r2 = [r for r in tr.tokens if r["request"] == "req-2"]
    assert [r["id"] for r in r1[1:]] == out and len(r1) == 1 + len(out)
    st = gen.stats
    assert sum(sum(r["hits"]) for r in r1) == st.hits and sum(sum(r["misses"]) for r in r1) == st.misses
    assert sum(r["read_bytes"] for r in r1) == st.streamed_bytes
    assert sum(r["io_wait_s"] for r in r1) == pytest.approx(st.store.stall_seconds, abs=1e-4)
    # the records' intervals are the engine's own timings plus the writer's bookkeeping (loose: a busy machine
    # preempts the thread between the two clocks)
    assert r1[0]["dt"] == pytest.approx(st.prompt_seconds, rel=0.25, abs=0.02)
    assert sum(r["dt"] for r in r1[1:]) == pytest.approx(st.decode_seconds, rel=0.25, abs=0.02)
    # the eog record: the decode step of token k and the sampling of the stop token, not part of the output
    assert [r.get("eog", False) for r in r2] == [False] * (k + 1) + [True] and r2[-1]["id"] == out[k]
    assert r2[-1]["text"] == "" and sum(sum(r["hits"]) + sum(r["misses"]) for r in r2) == gen2.stats.hits + \
        gen2.stats.misses
    assert [e["request"] for e in tr.ends] == ["req-1", "req-2"]
    assert tr.ends[1]["stop_reason"] == "eos" and tr.ends[0]["n_decode"] == st.n_decode


def test_gpu_window_gives_each_interval_its_own_reading():
    class Fake:
        samples = [GpuSample(t, util, 2**30 * k, 100.0 + util) for k, (t, util) in
                   enumerate([(0.0, 10.0), (0.05, 20.0), (0.10, 40.0), (0.15, 80.0), (0.30, 5.0)])]

    w = GpuWindow(Fake())
    a = w.reading(-1.0, 0.07)  # samples at 0.0 and 0.05
    assert a == {"util_pct": 15.0, "mem_bytes": 2**30, "power_w": 115.0, "samples": 2}
    b = w.reading(0.07, 0.12)  # the one at 0.10
    assert b == {"util_pct": 40.0, "mem_bytes": 2 * 2**30, "power_w": 140.0, "samples": 1}
    c = w.reading(0.12, 0.13)  # none inside: the latest before its end (0.10), marked 0 samples
    assert c == {"util_pct": 40.0, "mem_bytes": 2 * 2**30, "power_w": 140.0, "samples": 0}
    d = w.reading(0.13, 1.0)  # 0.15 and 0.30
    assert d["samples"] == 2 and d["util_pct"] == 42.5 and d["mem_bytes"] == 4 * 2**30


def test_trace_on_a_gpu_device_samples_nvml(tmp_path, monkeypatch):
    """The writer asked for a CUDA device's telemetry samples NVML (here a fake source in its place: this machine
    may have no GPU) on the sampler thread, and each record carries the readings taken in its interval."""
    n = [0]

    def fake_nvml(index: int = 0):
        assert index == 0

        def read() -> GpuSample:
            n[0] += 1
            return GpuSample(time.monotonic(), float(n[0] % 100), 5 * 2**30, 250.0)
        return read

    monkeypatch.setattr(telemetry, "nvml_source", fake_nvml)
    monkeypatch.setattr(runtrace, "GPU_INTERVAL", 0.001)
    model = load_model(default_model_path(), LoadOptions(moe_stream=True, slots=8))
    tok = GGUFTokenizer.from_gguf(default_model_path())
    path = tmp_path / "gpu.jsonl"
    with TraceWriter(str(path), gpu="cuda:0") as tw:
        tw.header(model, "run", {})
        gen = Engine(model).stream(tok.encode(PROMPT), 6, Sampler(SamplingParams(temp=0)))
        list(tw.follow(gen, tok, PROMPT))
    tr = read_trace(str(path))
    assert tr.header["gpu_telemetry"] == "nvml"
    readings = [r["gpu"] for r in tr.tokens]
    assert all(g is not None and g["mem_bytes"] == 5 * 2**30 and g["power_w"] == 250.0 for g in readings)
    assert all(0 <= g["util_pct"] < 100 for g in readings)
    long = [r for r in tr.tokens if r["dt"] > 0.005]
    assert long and all(r["gpu"]["samples"] >= 1 for r in long)


def test_trace_path_refused_before_the_model_runs(tmp_path):
    p = cli("run", "-n", "2", "--trace", str(tmp_path / "no" / "such" / "dir" / "t.jsonl"))
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "--trace" in p.stderr and "folder" in p.stderr
    p = cli("run", "-n", "2", "--trace", str(tmp_path))
    assert p.returncode == 1 and "directory" in p.stderr
    p = cli("run", "-n", "2", "--trace", default_model_path())
    assert p.returncode == 1 and "model file" in p.stderr
    assert os.listdir(tmp_path) == []


def test_failed_run_leaves_no_trace(tmp_path):
    """An error once the writer is open (the prompt does not fit the context) leaves neither the trace nor its
    temporary file."""
    path = tmp_path / "t.jsonl"
    p = cli("run", "-n", "4", "-c", "3", "-p", PROMPT, "--trace", str(path))
    assert p.returncode == 1 and "context" in p.stderr
    assert os.listdir(tmp_path) == []
    model = load_model(default_model_path(), LoadOptions(moe_stream=True, slots=8))
    tw = TraceWriter(str(path))
    tw.header(model)
    with pytest.raises(RuntimeError):
        tw.token("x")  # before begin
    tw.abort()
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_bench_trace_matches_its_json(tmp_path):
    """bench --trace: one file, the header, then per row its "row" line and its timed repetitions' records, tagged
    with row, test and repetition; the records' sums over a test are the test's numbers in --json."""
    t, j = tmp_path / "b.jsonl", tmp_path / "b.json"
    p = cli("bench", "-p", "8", "-n", "4", "-r", "2", "--slots", "8", "--moe-stream", "on,off", "--direct-io", "off",
            "--trace", str(t), "--json", str(j))
    assert p.returncode == 0, p.stderr
    tr, res = read_trace(str(t)), json.load(open(j))
    assert tr.header["command"] == "bench" and [r["row"] for r in tr.header["rows"]] == [1, 2]
    assert [r["row"] for r in tr.rows] == [1, 2] and tr.rows[0]["store"]["streaming"] is True
    assert tr.rows[1]["store"] == {"streaming": False}
    for row, rr in zip((1, 2), res["rows"], strict=True):
        recs = tr.select(row)
        assert [(r["test"], r["rep"], r["phase"], r["n"]) for r in recs] == \
            [("pp8", 1, "prefill", 8), ("pp8", 2, "prefill", 8)] + [("tg4", k, "decode", 1) for k in (1, 2)
                                                                   for _ in range(4)]
        for test in rr["tests"]:
            tr_recs = [r for r in recs if r["test"] == test["test"]]
            hits = sum(sum(r["hits"]) for r in tr_recs)
            misses = sum(sum(r["misses"]) for r in tr_recs)
            assert hits / (hits + misses) == pytest.approx(test["hit_rate"], abs=1e-12)
            assert sum(r["read_bytes"] for r in tr_recs) == round(test["streamed_gib"] * 2**30)
        assert "trace" not in rr  # the rows' temporary trace files are not in the results


def test_reader_refuses_bad_files(tmp_path, traced_run):
    _, tr, _ = traced_run
    good = open(tr.path, encoding="utf-8").read().splitlines()
    cases = {
        "missing": (None, "no such file"),
        "empty": ("", "empty"),
        "garbage": ("hello\nworld\n", "line 1 is not JSON"),
        "other": (json.dumps({"format": "something-else"}) + "\n", "not a moestream run trace"),
        "version": (json.dumps({**tr.header, "version": 99}) + "\n", "version 99"),
        "cut": ("\n".join(good[:3] + [good[3][:40]]) + "\n", "line 4 is not JSON"),
        "fields": ("\n".join(good[:2] + [json.dumps({"kind": "token", "phase": "decode"})]) + "\n", "line 3"),
        "kind": ("\n".join(good[:2] + [json.dumps({"kind": "mystery"})]) + "\n", "line 3"),
    }
    for name, (text, why) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text, encoding="utf-8")
        with pytest.raises(RunTraceError) as e:
            read_trace(str(path))
        assert str(path) in str(e.value) and why in str(e.value), (name, str(e.value))
        assert "\n" not in str(e.value)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(RunTraceError, match="not UTF-8"):
        read_trace(str(tmp_path / "bin"))
    with pytest.raises(RunTraceError, match="directory"):
        read_trace(str(tmp_path))


def test_writer_around_text_events(tmp_path):
    """The serve recipe (docs/traces.md): begin, on_prefill, token per TokenEvent, end after the DoneEvent; a stop
    string ends the generation, and the records' texts are what the events released."""
    from moestream.textgen import DoneEvent, TokenEvent, text_events

    model = load_model(default_model_path(), LoadOptions(moe_stream=True, slots=8))
    tok = GGUFTokenizer.from_gguf(default_model_path())
    engine = Engine(model)
    ids = tok.encode(PROMPT)
    free = "".join(tok.decode([t]) for t in list(engine.stream(ids, 10, Sampler(SamplingParams(temp=0)))))
    stop = free[len(free) // 2:len(free) // 2 + 3]  # a stop string inside the greedy text
    path = tmp_path / "serve.jsonl"
    tw = TraceWriter(str(path))
    tw.header(model, "serve", {})
    gen = engine.stream(ids, 10, Sampler(SamplingParams(temp=0)))
    tw.begin(model, request="r1")
    gen.on_prefill = lambda g: tw.token(PROMPT, phase="prefill", n=len(ids))
    released = []
    for ev in text_events(gen, tok, stop=[stop]):
        if isinstance(ev, TokenEvent):
            tw.token(ev.text, token_id=ev.id)
            released.append(ev.text)
        else:
            assert isinstance(ev, DoneEvent) and ev.stop == stop
            tw.end(gen)
    tw.close()
    tr = read_trace(str(path))
    assert [r["phase"] for r in tr.tokens] == ["prefill"] + ["decode"] * len(released)
    assert [r["text"] for r in tr.tokens[1:]] == released and "".join(released) == free[:free.index(stop)]
    assert tr.ends[0]["stop_reason"] == "stop" and tr.ends[0]["request"] == "r1"
    assert sum(sum(r["hits"]) + sum(r["misses"]) for r in tr.tokens) == gen.stats.hits + gen.stats.misses


def test_interactive_trace_records_every_turn(tmp_path):
    """``run -cnv --trace FILE``: each turn is one generation of the trace (tagged ``turn``), its token texts what
    the turn printed."""
    t = tmp_path / "cnv.jsonl"
    p = cli("run", "-cnv", "-n", "6", "--temp", "0", "--slots", "8", "--trace", str(t),
            stdin="Hello there\nAnd again\n/exit\n")
    assert p.returncode == 0, p.stderr
    tr = read_trace(str(t))
    assert [e["turn"] for e in tr.ends] == [1, 2]
    replies = "".join("".join(r["text"] for r in tr.tokens if r["turn"] == n and r["phase"] == "decode") + "\n"
                      for n in (1, 2))
    assert replies == p.stdout
    prefills = [r for r in tr.tokens if r["phase"] == "prefill"]
    assert [r["turn"] for r in prefills] == [1, 2] and "Hello there" in prefills[0]["text"]
