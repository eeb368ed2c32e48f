"""The CUDA path on a real GPU: identity streaming on/off, the oracle against the CPU path, the CLI.

Skipped where torch sees no CUDA device (CI); run on the GPU machine before an issue touching it is resolved:

    MOESTREAM_GPU_FIXTURES=DIR python -m pytest -q tests/test_cuda.py

``MOESTREAM_GPU_FIXTURES``: a folder of small GGUFs of every family made from the test fixtures by
``tools/shrink_vocab.py`` (real converter / quantizer blocks, the vocabulary cut to 512 rows so the files travel
to a GPU machine that cannot build fixtures: no network there); without it, the embedded default model only.

Bars (the same as the CPU path's): bitwise identity between the resident store (every expert in GPU memory)
and streaming through GPU or pinned-host pools at several slot counts, overlap on and off, buffered and direct
reads; GPU logits within 1e-4 of the largest logit of the CPU's float32 dequantize path (``--matmul dequant``,
itself checked against transformers in CI): both are float32 products of the same dequantized weights, and
only the order of the additions differs (a few float32 ulps per dot product), and the greedy tokens equal.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import DEFAULT_GGUF as DEFAULT_MODEL
from helpers import cli, logits_of
from moestream.experts.pool import ResidentStore, StreamingStore
from moestream.models.base import LoadOptions, load_model
from moestream.verify import verify

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _files() -> list[Path]:
    files = [Path(DEFAULT_MODEL)]
    d = os.environ.get("MOESTREAM_GPU_FIXTURES")
    if d:
        files += sorted(Path(d).glob("*.gguf"))
    return files


FILES = _files()
IDS = [1, 5, 9, 200, 7, 3, 77, 12, 40, 41, 300, 2]


def _ids(model) -> list[int]:  # noqa: ANN001
    return [i % model.n_vocab for i in IDS]


@pytest.fixture(scope="module", params=FILES, ids=lambda p: p.stem)
def gpu_model(request):  # noqa: ANN001, ANN201
    return load_model(str(request.param), LoadOptions(moe_stream=False, device="cuda"))


def test_triton_on(gpu_model) -> None:  # noqa: ANN001
    assert gpu_model.use_triton
    moes = [b["moe"] for b in gpu_model.blocks if isinstance(b, dict) and "moe" in b]
    from moestream.gpu import tkernels

    assert moes
    for m in moes:  # Triton's types take the grouped path, biased experts (gpt-oss) included; other types (MXFP4)
        types = {mm.ggml_type for mm in m.mats.values()}  # are dequantized on the GPU, one expert at a time
        grouped = types <= tkernels.TYPES
        assert m.gpu == grouped, f"layer {m.layer}: types {sorted(types)}, biases {m.bias is not None}, grouped {m.gpu}"


@pytest.mark.parametrize("pool", ["device", "host"])
@pytest.mark.parametrize("slots", ["top_k", "twice"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_identity(gpu_model, pool: str, slots: str, overlap: bool) -> None:  # noqa: ANN001
    n = gpu_model.top_k if slots == "top_k" else min(2 * gpu_model.top_k, gpu_model.n_experts)
    res = verify(gpu_model, _ids(gpu_model), 8, LoadOptions(slots=n, device="cuda", pool=pool, overlap=overlap),
                 ubatch=5)
    assert res.identical, f"first difference at step/position {res.first_diff}"
    assert res.streamed_bytes > 0 and res.hit_rate < 1.0


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_identity_io_modes(gpu_model, direct: bool) -> None:  # noqa: ANN001
    """One IO thread (a staging ring of two buffers, reused all the time) and many threads; O_DIRECT and not."""
    for threads in (1, 16):
        res = verify(gpu_model, _ids(gpu_model), 6, LoadOptions(slots=gpu_model.top_k, device="cuda",
                                                                io_threads=threads, direct_io=direct), ubatch=12)
        assert res.identical, (threads, res.first_diff)


def test_prefetch_identity(gpu_model) -> None:  # noqa: ANN001
    res = verify(gpu_model, _ids(gpu_model), 8, LoadOptions(slots=gpu_model.top_k + 1, device="cuda",
                                                            prefetch=True))
    assert res.identical, res.first_diff


def test_slots_hold_their_experts(gpu_model) -> None:  # noqa: ANN001
    from helpers import assert_slots_hold_their_experts

    store = gpu_model.make_store(LoadOptions(slots=gpu_model.top_k, device="cuda"))
    saved = gpu_model.store
    gpu_model.set_store(store)
    try:
        logits_of(gpu_model, _ids(gpu_model), 2, 4)
        torch.cuda.synchronize()
        assert assert_slots_hold_their_experts(gpu_model, store) > 0
    finally:
        gpu_model.set_store(saved)
        store.close()


def test_lean_segments_across_stores(gpu_model, monkeypatch) -> None:  # noqa: ANN001
    """The lean segmented step (graphs reading a streaming store's pools and the MoE layers' device tables) through
    two streaming stores one after the other, then the resident store's whole-step graphs again: the same bits
    each time. A store made after another was closed may sit at its address (Python id); graphs and tables kept
    for the first would read the freed pools (session 8 and 9: an illegal memory access in the next test)."""
    from helpers import assert_bitwise

    monkeypatch.setenv("MOESTREAM_LEAN_SEGMENTS", "1")
    want = logits_of(gpu_model, _ids(gpu_model), 6, 5)
    saved = gpu_model.store
    for _ in range(2):
        store = gpu_model.make_store(LoadOptions(slots=gpu_model.top_k, device="cuda"))
        gpu_model.set_store(store)
        try:
            assert gpu_model.runner.lean()
            assert_bitwise(logits_of(gpu_model, _ids(gpu_model), 6, 5), want)
            assert store.stats.misses > 0
        finally:
            gpu_model.set_store(saved)
            store.close()
        del store
    assert_bitwise(logits_of(gpu_model, _ids(gpu_model), 6, 5), want)
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def cpu_reference():  # noqa: ANN201
    cache: dict[str, list[torch.Tensor]] = {}

    def get(path: str, model) -> list[torch.Tensor]:  # noqa: ANN001
        if path not in cache:
            ref = load_model(path, LoadOptions(moe_stream=False, matmul="dequant"))
            cache[path] = logits_of(ref, _ids(model), 8, 5)
        return cache[path]
    return get


def test_oracle_vs_cpu(gpu_model, cpu_reference) -> None:  # noqa: ANN001
    want = cpu_reference(gpu_model.gguf.path, gpu_model)
    got = logits_of(gpu_model, _ids(gpu_model), 8, 5)
    scale = max(float(w.abs().max()) for w in want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        err = float((g.cpu() - w).abs().max())
        assert err <= 1e-4 * scale, (step, err, scale)
    # greedy: same argmax at every step (the logits above were fed by each path's own argmax)
    assert [int(g[-1].argmax()) for g in got] == [int(w[-1].argmax()) for w in want]


def test_streaming_store_places(gpu_model) -> None:  # noqa: ANN001
    s = gpu_model.make_store(LoadOptions(slots=gpu_model.top_k, device="cuda"))
    h = gpu_model.make_store(LoadOptions(slots=gpu_model.top_k, device="cuda", pool="host"))
    try:
        assert isinstance(s, StreamingStore) and s.place == "device"
        assert all(p.device.type == "cuda" for mats in s.pools.values() for p in mats.values())
        assert h.place == "host" and all(p.is_pinned() for mats in h.pools.values() for p in mats.values())
    finally:
        s.close()
        h.close()
    r = ResidentStore(gpu_model.gguf, gpu_model.layout, device="cuda")
    assert all(t.device.type == "cuda" for mats in r._mats.values() for t in mats.values())


def test_cli_cuda() -> None:
    r = cli("run", "--device", "cuda", "-n", "12", "--temp", "0", "--slots", "8")
    assert r.returncode == 0, r.stderr
    assert "cuda" in r.stderr and "Triton" in r.stderr and "pools in GPU memory" in r.stderr
    g = cli("run", "--device", "cpu", "-n", "12", "--temp", "0", "--slots", "8", "--matmul", "dequant")
    assert g.returncode == 0 and g.stdout == r.stdout  # greedy text equal to the CPU float32 path's
    for pool in ("device", "host"):
        v = cli("verify", "--device", "cuda", "--slots", "4", "--steps", "8", "--pool", pool)
        assert v.returncode == 0 and "identical" in (v.stdout + v.stderr).lower(), v.stdout + v.stderr
        where = "GPU" if pool == "device" else "pinned host"
        assert "compared bytewise on cuda" in v.stdout and f"pools in {where} memory" in v.stdout, v.stdout
    i = cli("inspect", "--gpu-mem", "1GiB")
    assert i.returncode == 0 and "GPU memory plan" in i.stdout
    m = cli("run", "--device", "cuda", "-n", "4", "--gpu-mem", "90MiB")
    assert m.returncode == 0 and "GPU memory plan: --gpu-mem 90MiB" in m.stderr, m.stderr
    bad = cli("run", "--device", "cuda", "-n", "4", "--gpu-mem", "1GiB", "--slots", "8")
    assert bad.returncode != 0 and "--gpu-mem" in bad.stderr and "Traceback" not in bad.stderr
    tier = cli("run", "--device", "cuda", "-n", "12", "--temp", "0", "--slots", "4", "--host-cache", "64MiB")
    assert tier.returncode == 0 and tier.stdout == r.stdout and "host tier" in tier.stderr, tier.stderr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_cli_cuda_every_family(path: Path) -> None:
    """bench and inspect through the CLI on CUDA for every file (the fixtures carry no tokenizer, so run and verify
    are checked on them through the API above): bench's streaming and resident rows run on the GPU."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b.json"
        b = cli("bench", "-m", str(path), "-p", "8", "-n", "4", "-r", "1", "--device", "cuda", "--moe-stream",
                "on,off", "--slots", "4", "--json", str(out))
        assert b.returncode == 0, b.stderr
        rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r.get("device_used", "").startswith("cuda") for r in rows), rows
    assert all(t["tok_s_mean"] > 0 for r in rows for t in r["tests"]), rows
    i = cli("inspect", "-m", str(path), "--device", "cuda")
    assert i.returncode == 0 and "Traceback" not in i.stderr, i.stdout + i.stderr
    g = cli("inspect", "-m", str(path), "--gpu-mem", "1GiB")
    assert g.returncode == 0 and "GPU memory plan" in g.stdout, g.stdout + g.stderr


@pytest.mark.parametrize("pool", ["device", "host"])
def test_identity_host_tier(gpu_model, pool: str) -> None:  # noqa: ANN001
    """Misses served by the host tier (pinned rows copied to the slots) give the same bits, and it does serve."""
    opts = LoadOptions(slots=gpu_model.top_k, device="cuda", pool=pool, host_cache=256 << 20)
    res = verify(gpu_model, _ids(gpu_model), 8, opts, ubatch=5)
    assert res.identical, res.first_diff
    store = gpu_model.make_store(opts)
    saved = gpu_model.store
    gpu_model.set_store(store)
    try:
        logits_of(gpu_model, _ids(gpu_model), 4, 5)
        logits_of(gpu_model, _ids(gpu_model), 4, 5)  # the same experts again: the tier holds them now
        assert store.tier.hits > 0 and store.bytes_read <= store.tier.misses * max(
            sum(p.shape[1] for p in mats.values()) for mats in store.pools.values())
    finally:
        gpu_model.set_store(saved)
        store.close()


@pytest.fixture
def graphed(gpu_model, monkeypatch):  # noqa: ANN001, ANN201
    """``gpu_model``'s file loaded again with the CUDA-graph decode on (MOESTREAM_CUDA_GRAPHS=1). Every family
    whose experts run on the grouped Triton path (GPT-OSS's biased experts included) decodes a resident step as one
    graph; a file whose expert types Triton does not compute (MXFP4) is graphed in segments, see
    test_cuda_graph_segments_streaming."""
    monkeypatch.setenv("MOESTREAM_CUDA_GRAPHS", "1")
    model = load_model(gpu_model.gguf.path, LoadOptions(moe_stream=False, device="cuda"))
    assert model.runner.graphs.opted_in
    return model


def _whole_step(model) -> None:  # noqa: ANN001
    if not all(model.experts(i).gpu for i in model.layout.moe_layers):
        pytest.skip(f"{model.gguf.arch}: experts off the grouped path (types Triton does not compute) "
                    f"cannot be one graph; its segments are graphed")
    assert model.runner.graphable(), "a resident model on CUDA should decode through one graph per step"


def test_cuda_graphs_same_bits_as_eager(graphed, cpu_reference) -> None:  # noqa: ANN001
    """Every decode step of the resident model is a graph replay, with the same bits as the same steps run
    eagerly (graphs off), as many hits counted, and within the oracle's bar of the CPU float32 path."""
    from helpers import assert_bitwise
    from moestream.runtime.graphs import DecodeGraphs

    _whole_step(graphed)
    graphs = graphed.runner.graphs
    hits = graphed.store.stats.hits
    on = logits_of(graphed, _ids(graphed), 6, 5)
    assert graphs.off_reason is None and graphs.replays == 6 and graphs.captures == 1
    graphed_hits = graphed.store.stats.hits - hits
    graphed.runner.graphs = DecodeGraphs()
    graphed.runner.graphs.opted_in, graphed.runner.graphs.off_reason = True, "off for the test"
    hits = graphed.store.stats.hits
    off = logits_of(graphed, _ids(graphed), 6, 5)
    assert graphed.store.stats.hits - hits == graphed_hits
    assert_bitwise(on, off)
    want = cpu_reference(graphed.gguf.path, graphed)[:7]
    scale = max(float(w.abs().max()) for w in want)
    for step, (g, w) in enumerate(zip(on, want, strict=True)):
        assert float((g.cpu() - w).abs().max()) <= 1e-4 * scale, step


def test_cuda_graphs_across_key_counts(graphed) -> None:  # noqa: ANN001
    """A decode that crosses 256 cache rows captures a second graph; streaming (eager steps, top-k on the host)
    gives the same bits as the graphed resident steps there too."""
    _whole_step(graphed)
    prompt = [(7 * i + 3) % graphed.n_vocab for i in range(250)]
    logits_of(graphed, prompt, 10, 64)
    graphs = graphed.runner.graphs
    assert graphs.captures == 2 and graphs.off_reason is None  # 256 rows, then the 260 of the context
    for slots in (graphed.top_k, 2 * graphed.top_k):
        res = verify(graphed, prompt, 10, LoadOptions(slots=slots, device="cuda"), ubatch=64)
        assert res.identical, (slots, res.first_diff)


@pytest.mark.parametrize("lean", ["1", "0"])
@pytest.mark.parametrize("pool", ["device", "host"])
def test_cuda_graph_segments_streaming(graphed, pool: str, lean: str, monkeypatch) -> None:  # noqa: ANN001
    """Streaming decode replays one graph per segment between MoE layers (the experts inside the next segment's
    graph where the lean segments apply, the default; eager between the replays with MOESTREAM_LEAN_SEGMENTS=0):
    the same bits as the resident whole-step graph, at top-k slots (misses every step) and with the host tier (the
    device-planned step, which a tier holding every expert turns on, off here: test_device_planned_step)."""
    monkeypatch.setenv("MOESTREAM_DEVICE_PLAN", "0")
    monkeypatch.setenv("MOESTREAM_LEAN_SEGMENTS", lean)
    for opts in (LoadOptions(slots=graphed.top_k, device="cuda", pool=pool),
                 LoadOptions(slots=graphed.top_k, device="cuda", pool=pool, host_cache=256 << 20)):
        before = graphed.runner.graphs.segment_replays
        res = verify(graphed, _ids(graphed), 8, opts, ubatch=5)
        assert res.identical, res.first_diff
        assert res.streamed_bytes > 0 and graphed.runner.graphs.off_reason is None
        assert graphed.runner.graphs.segment_replays - before >= 7 * len(graphed.runner.segments()), \
            "streaming ran eagerly"


@pytest.mark.parametrize(("pool", "admit", "promote"), [("device", "all", "copy"), ("host", "all", "copy"),
                                                        ("device", "freq", "copy"), ("device", "all", "inline")])
def test_device_planned_step(graphed, pool: str, admit: str, promote: str, monkeypatch) -> None:  # noqa: ANN001
    """A host tier holding every expert makes the decode step device-planned (experts/devplan.py): one graph replay
    per step, the misses copied from the pinned tier on the GPU, the slot policy run between steps (every miss
    promoted, or with MOESTREAM_ADMIT=freq only those needed more often than their victim). The same bits as the
    resident whole-step graph (verify), nothing read from the file after the fill, and after the last step's
    bookkeeping the device table equals the slot maps. MOESTREAM_PROMOTE=inline: the step copies its misses into
    victim slots itself (no promotion after it)."""
    monkeypatch.setenv("MOESTREAM_ADMIT", admit)
    monkeypatch.setenv("MOESTREAM_PROMOTE", promote)
    _whole_step(graphed)
    opts = LoadOptions(slots=graphed.top_k, device="cuda", pool=pool, host_cache=256 << 20)
    res = verify(graphed, _ids(graphed), 8, opts, ubatch=5)
    assert res.identical, res.first_diff
    store = graphed.make_store(opts)
    assert store.plan is not None
    saved = graphed.store
    graphed.set_store(store)
    try:
        replays = graphed.runner.graphs.replays
        logits_of(graphed, _ids(graphed), 6, 5)
        assert graphed.runner.graphs.replays - replays == 6 and store.plan.steps == 6
        store.plan.flush()
        assert store.stats.misses > 0 and store.bytes_read == 0
        assert store.plan.inline == (promote == "inline") and (store.plan.placed > 0) == store.plan.inline
        for i, la in enumerate(store.plan.layers):
            sm = store.slots[la]
            assert (store.plan.slot_dev[i][:sm.n_experts].cpu().numpy() == sm.slot_of).all(), la
            if store.plan.inline:
                assert (store.plan.expert_dev[i][:sm.n_slots].cpu().numpy() == sm.expert_of).all(), la
    finally:
        graphed.set_store(saved)
        store.close()


def test_pool_host_budget_holds_in_a_memory_cgroup_default_model() -> None:
    """--pool host under a real memory cgroup (issue 24.6): the smallest --mem the plan accepts runs and peaks
    within it (page cache included, 64 MiB of slack), and the default budget (the cgroup's memory less the
    margin) is not OOM-killed."""
    import re
    import subprocess
    import sys

    from moestream.errors import ConfigError
    from moestream.memcap import MemCap

    try:
        MemCap.check()
    except ConfigError as e:
        pytest.skip(str(e))
    small = cli("run", "--device", "cuda", "--pool", "host", "--mem", "100MiB", "-n", "16")
    m = re.search(r"--mem (\S+) works", small.stderr)
    assert small.returncode != 0 and m, small.stderr
    from moestream.memcap import parse_size

    least = parse_size(m.group(1))
    cmd = [sys.executable, "-m", "moestream", "run", "--device", "cuda", "--pool", "host", "-n", "16", "--temp", "0",
           "-p", "Once upon a time"]
    env_ok = subprocess.run([sys.executable, "-c", "import moestream"], capture_output=True).returncode == 0
    assert env_ok
    for extra, bound in ((["--mem", m.group(1)], least + 64 * 2**20), ([], None)):
        res = MemCap(3 * 2**30).run(cmd + extra, timeout=300)
        assert res.returncode == 0 and not res.oom_killed, (extra, res.stderr[-2000:])
        if bound is not None:
            assert res.peak_bytes <= bound, (res.peak_bytes / 2**20, least / 2**20, res.stderr[-1500:])
