"""The commands a user types, on the embedded default model and the fixture."""

from __future__ import annotations

import json

from helpers import moestream
from moestream.engine import Sampler, SamplingParams


def test_run_default_model_streams_and_reports():
    p = moestream("run", "-n", "16", "--temp", "0", "-p", "Once upon a time")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Once upon a time") and len(p.stdout.strip()) > len("Once upon a time")
    err = p.stderr.strip().splitlines()
    assert "streaming:" in err[0] and "slots/layer" in err[0]
    stats = err[-1]
    for field in ("prompt", "tok/s", "decode", "expert hit rate", "streamed", "GiB", "peak RSS"):
        assert field in stats, stats


def test_run_resident_and_streaming_print_the_same_text():
    args = ("run", "-n", "12", "--temp", "0", "-p", "The printing press")
    a, b = moestream(*args, "--moe-stream", "off"), moestream(*args, "--slots", "4", "--io-threads", "1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    assert "resident" in a.stderr.splitlines()[0]


def test_run_chat_and_sampling_flags(qwen3moe_tiny):
    p = moestream("run", "-m", str(qwen3moe_tiny["q8_0"]), "--chat", "-p", "Hi!", "-n", "8", "--temp", "0.7",
                  "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "-s", "3", "-t", "1", "-c", "256")
    assert p.returncode == 0, p.stderr
    q = moestream("run", "-m", str(qwen3moe_tiny["q8_0"]), "--chat", "-p", "Hi!", "-n", "8", "--temp", "0.7",
                  "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "-s", "3", "-t", "1", "-c", "256")
    assert p.stdout == q.stdout  # same seed, same text


def test_inspect_default():
    p = moestream("inspect", "--slots", "8")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for field in ("architecture    qwen3moe", "experts         64 per layer, 4 used per token",
                  "bytes/expert", "dense weights", "routed experts", "--slots 8"):
        assert field in out, out


def test_bench_writes_table_and_json(tmp_path):
    out = tmp_path / "b.json"
    p = moestream("bench", "-p", "8", "-n", "4", "-r", "2", "--slots", "4,8", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("| default.gguf |") == 6  # 3 configurations x (pp, tg)
    rows = json.loads(out.read_text())["rows"]
    assert [r["moe_stream"] for r in rows] == [True, True, False]
    for r in rows:
        assert {t["test"] for t in r["tests"]} == {"pp8", "tg4"}
        assert all(t["tok_s_mean"] > 0 for t in r["tests"])
    assert rows[0]["tests"][0]["streamed_gib"] > 0 and rows[2]["tests"][0]["streamed_gib"] == 0


def test_sampler_greedy_and_filters():
    import torch

    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert Sampler(SamplingParams(temp=0))(logits) == 1
    # top-k 1 is greedy whatever the temperature
    assert {Sampler(SamplingParams(temp=5.0, top_k=1, seed=s))(logits) for s in range(20)} == {1}
    # probabilities ~ [0.085, 0.63, 0.23, 0.05]; min-p 0.3 keeps p >= 0.19: tokens 1 and 2
    picked = {Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=s))(logits) for s in range(200)}
    assert picked == {1, 2}
    # top-p keeps the smallest prefix reaching p: with p=0.5 only the top token (p~0.63)
    picked = {Sampler(SamplingParams(temp=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=s))(logits) for s in range(200)}
    assert picked == {1}
    # same seed, same draws
    a = [Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9))(logits) for _ in range(5)]
    b = [Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9))(logits) for _ in range(5)]
    assert a == b
