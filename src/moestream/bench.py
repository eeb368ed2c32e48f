"""``moestream bench``: llama-bench-style pp/tg rows, one subprocess per configuration.

Each row runs in a fresh process so that its peak RSS and disk reads are its own. A row does one warm-up
pass, then ``-r`` repetitions of the pp test (prefill ``-p`` random tokens into an empty context) and the
tg test (``-n`` single-token decode steps), and reports mean +- sd tok/s, the expert hit rate,
the IO stall (share of the test's time the compute thread spent blocked waiting for expert reads: what
``--overlap on`` hides behind the shared/dense FFN and the expert matmuls), GiB streamed into slots, GiB read from disk
(/proc/self/io), and peak RSS. No timing is asserted anywhere:
this is a measurement tool.

Tokens are random, as llama-bench's (tools/llama-bench/llama-bench.cpp, test_prompt / test_gen): each tg
step decodes a random token rather than the previous step's argmax, so that greedy decoding of random
weights (which repeats a few tokens) does not turn decode into a cache-hit test. The token sequence comes
from a fixed seed, so every row of a run, llama.cpp's included, decodes the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from .errors import ConfigError, OutputError
from .output import check_distinct_outputs, check_json_path, write_json, write_output, write_stdout

GiB = 2**30


def _list(s: str, conv, name: str, what: str = "integers") -> list:  # noqa: ANN001
    """A comma-separated option as a list of ``conv`` values, duplicates dropped (first occurrence kept)."""
    items = [x.strip() for x in str(s).split(",")]
    if not items or any(not x for x in items):
        raise ConfigError(f"{name}: expected a comma-separated list with no empty items, got {s!r}")
    try:
        return _dedupe([conv(x) for x in items])
    except ValueError:
        raise ConfigError(f"{name}: expected a comma-separated list of {what}, got {s!r}") from None


def _dedupe(items: list) -> list:
    """``items`` without repeats, in first-occurrence order (``--slots 4,4`` is one row, not two)."""
    return list(dict.fromkeys(items))


def _on_off_list(s: str, name: str) -> list[bool]:
    """``on``, ``off`` or both, comma-separated; case does not matter (as run's and verify's on|off)."""
    out = []
    for x in _list(s, str.lower, name, "on/off values"):
        if x not in ("on", "off"):
            raise ConfigError(f"{name}: expected on, off or on,off, got {s!r}")
        out.append(x == "on")
    return _dedupe(out)


def evict_page_cache(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED) for a cold run."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bandwidth(path: str, chunk_bytes: int, n_reads: int = 48, threads: int = 8, seed: int = 0,
                        rounds: int = 3) -> float:
    """Random-read bandwidth of the file's disk in bytes/s: the best of ``rounds`` rounds, each ``n_reads`` reads
    of ``chunk_bytes`` (rounded up to 4 KiB) at random 4 KiB-aligned offsets (other offsets each round),
    ``threads`` at a time, with O_DIRECT so the page cache is not measured (falls back to buffered reads after
    evicting the file where O_DIRECT is refused). The best round, because the result is a limit: a round slowed by
    other work on the disk or the machine would put the IO limit below speeds the rows reach."""
    return max(_read_round(path, chunk_bytes, n_reads, threads, seed + r) for r in range(rounds))


def _read_round(path: str, chunk_bytes: int, n_reads: int, threads: int, seed: int) -> float:
    """One round of :func:`disk_read_bandwidth`: bytes/s."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    chunk = -(-chunk_bytes // 4096) * 4096
    size = os.path.getsize(path)
    rng = random.Random(seed)
    offsets = [rng.randrange(0, max(size - chunk, 1)) // 4096 * 4096 for _ in range(n_reads)]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        evict_page_cache([path])
        fd = os.open(path, os.O_RDONLY)
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

    def read(i: int) -> int:
        try:
            return os.preadv(fd, [bufs[i % threads]], offsets[i])
        except OSError:
            return os.pread(fd, chunk, offsets[i]).__len__()

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(read, range(n_reads)))
        return total / (time.perf_counter() - t0)
    finally:
        os.close(fd)


#: a row's LoadOptions fields that bench's lists vary (the rest are bench's base options, shared by every row)
ROW_FIELDS = ("moe_stream", "slots", "io_threads", "overlap", "prefetch", "direct_io", "pool", "mem", "gpu_mem",
              "host_cache")


def row_options(cfg: dict, base=None):  # noqa: ANN001, ANN201 - LoadOptions
    """The LoadOptions of one row: ``dataclasses.replace`` of ``base`` (the options every row shares: bench's
    arguments through options.load_options in the parent; in the row's own process, those the row's ``cfg``
    carries) by the row's own values. Checked by ``LoadOptions.__post_init__``: the parent makes every row's
    before any runs, so a bad combination is one line naming the flags (cli.main), not one failed row each."""
    from dataclasses import replace

    from .models.base import LoadOptions

    if base is None:
        base = LoadOptions(expand_dense=cfg.get("expand_dense", False), matmul=cfg.get("matmul", "blocks"),
                           policy=cfg.get("policy", "lfu"), device=cfg.get("device", "cpu"))
    size = {k: cfg.get(k) for k in ("mem", "gpu_mem", "host_cache")}
    row = {k: cfg[k] for k in ROW_FIELDS if k in cfg and k not in size}
    return replace(base, **row, n_ctx=max(cfg["n_prompt"], cfg["n_gen"] + 1),
                   mem=None if size["mem"] is None else size["mem"]["bytes"],
                   mem_source=None if size["mem"] is None else size["mem"]["source"],
                   gpu_mem=None if size["gpu_mem"] is None else size["gpu_mem"]["bytes"],
                   gpu_mem_source=None if size["gpu_mem"] is None else size["gpu_mem"]["source"],
                   host_cache=0 if size["host_cache"] is None else size["host_cache"]["bytes"])


def run_row(cfg: dict) -> dict:
    """Run one configuration in this process; returns the row as a dict."""
    import random

    from .engine import Engine, check_cache_fits, disk_read_bytes, peak_rss_bytes
    from .models.base import load_model

    if cfg.get("threads"):
        from .options import set_compute_threads
        set_compute_threads(cfg["threads"], cfg.get("matmul", "blocks"))
    opts = row_options(cfg)
    t_load = time.perf_counter()
    model = load_model(cfg["model"], opts)
    load_seconds = time.perf_counter() - t_load
    check_cache_fits(model, max(cfg["n_prompt"], cfg["n_gen"] + 1), "-p/-n", "-p or -n")
    if cfg.get("routing", "model") == "calibrated":  # the same seeded sequence in every row
        from .experts.synthetic import SyntheticRouting, fit_for
        model.set_routing(SyntheticRouting.fitted(model.n_experts, model.top_k, fit_for(model.arch)))
    engine = Engine(model, cfg.get("ubatch", 128))
    rng = random.Random(1234)  # the same seed and draws as run_llamacpp_row: every row sees the same tokens
    store = model.store
    trace: list | None = [] if store.streaming else None  # the row's routing trace (experts/trace.py)
    store.trace = trace
    result = {**cfg, "load_seconds": load_seconds, "tests": []}
    if getattr(model, "device", None) is not None:
        result["device_used"] = str(model.device)  # what "auto" became
    sync = _cuda_sync(model)
    tw = _row_trace(cfg, model)  # --trace: this row's records (moestream/runtrace.py), or None
    from .telemetry import sampler
    gpu = sampler()  # None without nvidia-ml-py or a GPU

    def snapshot() -> tuple[int, int, int, int, float, object]:
        if getattr(store, "plan", None) is not None:  # the device-planned step counts one step behind: catch up
            store.plan.flush()
        st = store.stats
        return st.hits, st.misses, store.bytes_read, disk_read_bytes(), st.stall_seconds, st.copy()

    def pp(n: int, tags: dict | None = None) -> float:
        toks = [rng.randrange(model.n_vocab) for _ in range(n)]
        cache = model.new_cache(cfg["n_prompt"])  # warm-up and test the same size: on CUDA the same memory
        sync()
        if tags is not None:
            tw.begin(model, **tags)
        t0 = time.perf_counter()
        engine.prefill(toks, cache)
        sync()
        secs = time.perf_counter() - t0
        if tags is not None:
            tw.token(tw.tokenizer.decode(toks), phase="prefill", n=n)
        return secs

    def tg(n: int, tags: dict | None = None) -> float:
        toks = [rng.randrange(model.n_vocab) for _ in range(n)]
        cache = model.new_cache(cfg["n_gen"] + 1)  # (models/layers.KVArena: the decode graphs stay valid)
        sync()
        if tags is not None:
            tw.begin(model, **tags)
            dec = tw.tokenizer.stream_decoder()
        t0 = time.perf_counter()
        for pos, tok in enumerate(toks):
            engine.decode_step(tok, pos, cache)
            if tags is not None:  # the record of the token this step decoded (bench feeds random tokens)
                tw.token(dec.push(tok), token_id=tok)
        sync()
        return time.perf_counter() - t0

    # warm-up, as llama-bench does (tools/llama-bench/llama-bench.cpp: one prompt run of the test's whole size, one
    # generation step; here 4): compiles the kernels of the test's shapes (on CUDA a 64-token chunk takes other
    # Triton tiles than a 16-token one) and fills the slot pools, the host tier and the page cache as its run did
    if cfg["n_prompt"]:
        pp(cfg["n_prompt"])
    if cfg["n_gen"]:
        tg(min(cfg["n_gen"], 4))
    for name, n, fn in (("pp", cfg["n_prompt"], pp), ("tg", cfg["n_gen"], tg)):
        if not n:
            continue
        s0, i0 = snapshot(), len(trace or ())
        c0 = _cpu_seconds()
        w0 = time.monotonic()
        secs = [fn(n, None if tw is None else {"row": cfg["trace"]["row"], "test": f"{name}{n}", "rep": r})
                for r in range(1, cfg["repetitions"] + 1)]
        w1 = time.monotonic()
        c1 = _cpu_seconds()
        s1 = snapshot()
        tps = [n / s for s in secs]
        hits, misses = s1[0] - s0[0], s1[1] - s0[1]
        d = s1[5] - s0[5]  # the store's counters over the test (StoreStats)
        test = {
            "test": f"{name}{n}", "tok_s_mean": statistics.mean(tps),
            "tok_s_sd": statistics.stdev(tps) if len(tps) > 1 else 0.0, "samples_tok_s": tps,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "streamed_gib": (s1[2] - s0[2]) / GiB, "disk_read_gib": (s1[3] - s0[3]) / GiB,
            "disk_bytes_per_token": (s1[3] - s0[3]) / (n * cfg["repetitions"]),
            "streamed_bytes_per_token": (s1[2] - s0[2]) / (n * cfg["repetitions"]),
            "io_stall_fraction": (s1[4] - s0[4]) / sum(secs),
            # the process's CPU time over the test (every thread: compute, IO, launches): as a share of one core
            # (100% = one core busy throughout) and per token
            "host_cpu_pct": 100.0 * (c1 - c0) / max(w1 - w0, 1e-9),
            "host_ms_per_token": 1000.0 * (c1 - c0) / (n * cfg["repetitions"]),
            # router lookahead (None without predictions, i.e. prefetch off or streaming off): see StoreStats
            "prefetch_recall": d.recall, "miss_bytes_ready": d.ready_share if d.recall is not None else None,
            "prefetch_issued": d.prefetch_issued, "prefetch_wasted": d.prefetch_wasted,
        }
        if name == "tg" and trace is not None:  # the tg requests replayed, every earlier request warming the pools
            from .experts.trace import hit_rates
            caps = {layer: store.capacity(layer) for layer in model.layout.moe_layers}
            test.update(hit_rates(trace, caps, (i0, len(trace))))
        if gpu is not None:
            summary = gpu.window(w0, w1)
            test["gpu"] = summary.as_dict() if summary else None
        result["tests"].append(test)
    if gpu is not None:
        gpu.stop()
        from .telemetry import merge
        summary = merge([t.get("gpu") for t in result["tests"]])
        result["gpu"] = summary.as_dict() if summary else None
    result["peak_rss_gib"] = peak_rss_bytes() / GiB
    result["pool_gib"] = getattr(store, "pool_bytes", 0) / GiB
    if store.streaming:
        result["slots_per_layer"] = list(store.slots_per_layer().values())
    plan = model.memory_plan
    if plan is not None and store.streaming:
        result["memory_plan"] = {"budget": plan.budget, "source": plan.source, "process": plan.process,
                                 "dense": plan.dense, "kv": plan.kv, "n_ctx": plan.n_ctx, "scratch": plan.scratch,
                                 "pools": plan.pools, "left": plan.left, "all_fit": plan.all_fit}
    result["direct_io_used"] = getattr(store, "direct_io", False)  # O_DIRECT to the end of the row
    g = model.runner.graphs if hasattr(model, "runner") else None
    if g is not None and getattr(model, "device", None) is not None and model.device.type == "cuda":
        result["cuda_graphs"] = {"captures": g.captures, "replays": g.replays,  # warm-up included
                                 "segment_replays": g.segment_replays, "off": g.off_reason}
    tier = getattr(store, "tier", None)
    if tier is not None:  # the host tier's counters over the whole row (warm-up included)
        result["host_tier"] = {"gib": tier.nbytes / GiB, "rows_per_layer": min(tier.rows.values()),
                               "hits": tier.hits, "misses": tier.misses}
    store.close()
    if tw is not None:
        tw.close()
    return result


def _row_trace(cfg: dict, model):  # noqa: ANN001, ANN202
    """bench --trace: a TraceWriter of this row's records into ``cfg["trace"]["path"]`` (run_bench puts the header
    and the rows together), its ``"row"`` line written, with the model's tokenizer as ``.tokenizer``; or None."""
    if not cfg.get("trace"):
        return None
    from .runtrace import TraceWriter, store_info
    from .tokenizer import GGUFTokenizer
    tw = TraceWriter(cfg["trace"]["path"], gpu=str(model.device), header_written=True)
    tw.tokenizer = GGUFTokenizer.from_fields(model.gguf.fields, model.gguf.path, model.gguf.metadata_digest)
    tw.record({"kind": "row", "row": cfg["trace"]["row"], "label": cfg["trace"]["label"],
               "store": store_info(model.store), "device": str(model.device)})
    return tw


def write_bench_trace(path: str, header: dict, cfgs: list[dict], rows: list[dict]) -> None:
    """bench --trace PATH: one file, the header (``header``: the options, the model, the rows' labels), then each
    row's ``"row"`` line and records in row order (a row that failed or is llama.cpp's: its ``"row"`` line with
    ``traced`` false and the error, if any), written as :func:`write_output` writes."""
    import datetime

    from .runtrace import FORMAT, VERSION, _machine, _versions
    head = {"kind": "header", "format": FORMAT, "version": VERSION, "command": "bench",
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **header,
            "machine": _machine(header.get("device", "cpu")), "versions": _versions()}
    parts = [json.dumps(head, ensure_ascii=False, separators=(",", ":")) + "\n"]
    for i, (cfg, row) in enumerate(zip(cfgs, rows, strict=True), 1):
        t = cfg.get("trace")
        text = ""
        if t and "error" not in row:
            with contextlib.suppress(OSError):
                with open(t["path"], encoding="utf-8") as f:
                    text = f.read()
        if text:
            parts.append(text)
        else:
            label = " ".join(_row_label(cfg)) if not t else t["label"]
            parts.append(json.dumps({"kind": "row", "row": i, "label": label, "traced": False,
                                     "error": row.get("error")}) + "\n")
    write_output(path, "".join(parts), "--trace", "the trace")


def _cuda_sync(model):  # noqa: ANN001, ANN202
    """A function that waits for the model's CUDA device to finish queued work (a no-op on CPU), so that the
    timers around prefill and decode see the kernels, not just their launches."""
    dev = str(getattr(model, "device", "cpu"))
    if dev.startswith("cuda"):
        import torch
        if torch.cuda.is_available():
            return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def run_llamacpp_row(cfg: dict) -> dict:
    """llama.cpp's own pp/tg on the same file, through llama-cpp-python's bindings (its default mmap loading;
    on CPU that is the --cpu-moe situation). cfg["repack"]: False turns off CPU weight repacking
    (llama.cpp's --repack 0 / use_extra_bufts=false), which keeps the weights file-backed under a memory cap."""
    import random

    import llama_cpp

    if not cfg.get("repack", True):
        import llama_cpp.llama_cpp as low  # Llama() takes its model defaults from this module

        default_params = low.llama_model_default_params

        def no_repack():  # noqa: ANN202
            params = default_params()
            params.use_extra_bufts = False
            return params
        low.llama_model_default_params = no_repack
    threads = cfg.get("threads") or os.cpu_count()
    n_ctx = max(cfg["n_prompt"], cfg["n_gen"] + 1, 32) + 8
    t_load = time.perf_counter()
    llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=n_ctx, n_batch=max(cfg.get("ubatch", 128), 32),
                          n_ubatch=max(cfg.get("ubatch", 128), 32), n_threads=threads, n_threads_batch=threads,
                          use_mmap=True, verbose=False)
    load_seconds = time.perf_counter() - t_load
    rng = random.Random(1234)
    n_vocab = llm.n_vocab()

    def pp(n: int) -> float:
        llm.reset()
        toks = [rng.randrange(n_vocab) for _ in range(n)]
        t0 = time.perf_counter()
        llm.eval(toks)
        return time.perf_counter() - t0

    def tg(n: int) -> float:
        llm.reset()
        toks = [rng.randrange(n_vocab) for _ in range(n)]
        t0 = time.perf_counter()
        for tok in toks:
            llm.eval([tok])
        return time.perf_counter() - t0

    from .engine import disk_read_bytes, peak_rss_bytes
    if cfg["n_prompt"]:
        pp(min(cfg["n_prompt"], 16))
    if cfg["n_gen"]:
        tg(min(cfg["n_gen"], 4))
    result = {**cfg, "load_seconds": load_seconds, "tests": []}
    for name, n, fn in (("pp", cfg["n_prompt"], pp), ("tg", cfg["n_gen"], tg)):
        if not n:
            continue
        d0 = disk_read_bytes()
        secs = [fn(n) for _ in range(cfg["repetitions"])]
        d1 = disk_read_bytes()
        tps = [n / x for x in secs]
        result["tests"].append({
            "test": f"{name}{n}", "tok_s_mean": statistics.mean(tps),
            "tok_s_sd": statistics.stdev(tps) if len(tps) > 1 else 0.0, "samples_tok_s": tps,
            "hit_rate": None, "streamed_gib": 0.0, "disk_read_gib": (d1 - d0) / GiB,
            "disk_bytes_per_token": (d1 - d0) / (n * cfg["repetitions"]), "streamed_bytes_per_token": 0,
        })
    result["peak_rss_gib"] = peak_rss_bytes() / GiB
    return result


#: llama-bench rows (``--llama-bench PATH``): kind -> (table label, device, extra llama-bench flags). Every row
#: also gets ``-t THREADS``; "gpu" and "cpu_moe" are the rows of a GPU run, "cpu" the row of ``--device cpu``.
LLAMA_BENCH_ROWS = {
    "gpu": ("llama.cpp all-GPU", "cuda", ["-ngl", "99"]),
    "cpu_moe": ("llama.cpp experts on CPU", "cuda+cpu", ["-ngl", "99", "-ncmoe", "99"]),
    # -dev none: a CUDA build otherwise still sends big prompt batches to the GPU with -ngl 0
    "cpu": ("llama.cpp CPU", "cpu", ["-ngl", "0", "-dev", "none"]),
}
_PROGRESS = re.compile(r"llama-bench: benchmark (\d+)/(\d+): (starting|warmup|prompt run|generation run|depth run)")


def llama_bench_cmd(cfg: dict) -> list[str]:
    """The llama-bench command line of a ``--llama-bench`` row: ``-m FILE -p N -n N -r R -o json -fa 0`` (flash
    attention off: moestream has none), the row kind's flags, ``-t``, ``--repack 0`` when ``cfg["repack"]`` is
    False, and ``--progress`` (its stderr lines mark where each test's timed repetitions start)."""
    _, _, flags = LLAMA_BENCH_ROWS[cfg["kind"]]
    cmd = [cfg["llama_bench"], "-m", cfg["model"], "-p", str(cfg["n_prompt"]), "-n", str(cfg["n_gen"]),
           "-r", str(cfg["repetitions"]), "-o", "json", "-fa", "0", *flags, "-t", str(cfg["threads"]), "--progress"]
    if not cfg.get("repack", True):
        cmd += ["--repack", "0"]
    return cmd


def _proc_read_bytes(pid: int) -> int | None:
    """``read_bytes`` of /proc/PID/io (bytes the process made the disk read), None once it cannot be read."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def parse_llama_bench_json(text: str) -> list[dict]:
    """llama-bench ``-o json`` output -> one test dict per entry (``pp<N>`` / ``tg<N>``, tok/s mean, sd and
    samples from its avg_ts, stddev_ts, samples_ts); OutputError when it is not a JSON array of tests."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise OutputError(f"llama-bench did not print JSON ({e}); its output began {text[:200]!r}") from None
    if not isinstance(entries, list):
        raise OutputError("llama-bench's JSON is not a list of tests")
    tests = []
    for e in entries:
        n_p, n_g = int(e.get("n_prompt", 0)), int(e.get("n_gen", 0))
        name = f"pp{n_p}" if n_p and not n_g else f"tg{n_g}" if n_g and not n_p else f"pp{n_p}+tg{n_g}"
        tests.append({"test": name, "tok_s_mean": float(e["avg_ts"]), "tok_s_sd": float(e.get("stddev_ts", 0.0)),
                      "samples_tok_s": [float(x) for x in e.get("samples_ts", [])],
                      "n_gpu_layers": e.get("n_gpu_layers"), "n_cpu_moe": e.get("n_cpu_moe"),
                      "n_batch": e.get("n_batch"), "n_ubatch": e.get("n_ubatch"), "backends": e.get("backends"),
                      "gpu_info": e.get("gpu_info"), "model_type": e.get("model_type")})
    return tests


def test_windows(stamps: list[tuple[float, str]], end: float) -> dict[int, tuple[float, float]]:
    """benchmark index (1-based) -> (start, end) of its timed repetitions, from llama-bench's ``--progress``
    stderr lines stamped with the time they arrived: from its first "prompt run"/"generation run" line to the
    next benchmark's "starting" line (the last one: ``end``, the process's exit)."""
    first: dict[int, float] = {}
    starts: dict[int, float] = {}
    for t, line in stamps:
        m = _PROGRESS.search(line)
        if not m:
            continue
        k = int(m.group(1))
        if m.group(3) == "starting":
            starts[k] = t
        elif m.group(3) in ("prompt run", "generation run"):
            first.setdefault(k, t)
    return {k: (t0, min([starts[j] for j in starts if j > k] or [end])) for k, t0 in first.items()}


def run_llamabench_row(cfg: dict) -> dict:
    """A ``--llama-bench`` row: the binary's pp/tg on the same file (``llama_bench_cmd``), run from this process
    (so that under ``--mem-cap`` it is inside the same cgroup, this small Python wrapper with it), with its
    stderr lines and /proc/PID/io read_bytes stamped as they arrive: they give each test's timed window for the
    GPU telemetry and its disk reads. Peak RSS: the binary's (getrusage of the children)."""
    import resource
    import threading

    from .telemetry import merge, sampler

    cmd = llama_bench_cmd(cfg)
    gpu = sampler()
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    stamps: list[tuple[float, str]] = []
    reads: list[tuple[float, int | None]] = []
    err_lines: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            t = time.monotonic()
            stamps.append((t, line))
            reads.append((t, _proc_read_bytes(proc.pid)))
            if not _PROGRESS.search(line):
                err_lines.append(line.rstrip())

    th = threading.Thread(target=read_stderr, daemon=True)
    th.start()
    assert proc.stdout is not None
    out = proc.stdout.read()
    th.join()
    rc = proc.wait()
    t_end = time.monotonic()
    if gpu is not None:
        gpu.stop()
    if rc != 0:
        killed = f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else None
        why = next((x for x in reversed(err_lines) if x.strip()), killed or f"exit status {rc}")
        raise OutputError(f"llama-bench exited with status {rc}: {why}")
    tests = parse_llama_bench_json(out)
    windows = test_windows(stamps, t_end)

    def read_at(t: float) -> int | None:
        got = [b for s, b in reads if s <= t and b is not None]
        return got[-1] if got else None

    for k, test in enumerate(tests, 1):
        a, b = windows.get(k, (None, None))
        n = int(test["test"][2:]) if test["test"][2:].isdigit() else 0
        r0, r1 = (read_at(a), read_at(b)) if a is not None else (None, None)
        disk = None if r0 is None or r1 is None or r1 < r0 else r1 - r0
        test.update({"hit_rate": None, "streamed_gib": 0.0, "streamed_bytes_per_token": 0,
                     "disk_read_gib": None if disk is None else disk / GiB,
                     "disk_bytes_per_token": None if disk is None or not n else disk / (n * cfg["repetitions"])})
        if gpu is not None:
            summary = gpu.window(a, b) if a is not None else None
            test["gpu"] = summary.as_dict() if summary else None
    label, device, _ = LLAMA_BENCH_ROWS[cfg["kind"]]
    result = {**cfg, "label": label, "device": device, "command": " ".join(cmd), "tests": tests,
              "seconds": t_end - t_start,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GiB}
    if gpu is not None:
        summary = merge([t.get("gpu") for t in tests])
        result["gpu"] = summary.as_dict() if summary else None
    return result


def _row_label(r: dict) -> tuple[str, str, str, str, str]:
    """(mode, slots, io threads, overlap, prefetch, reads) cells of a row. reads: ``direct`` (O_DIRECT) or
    ``buffered``, what the row used (a row that did not finish: what was asked, ``auto`` for the default)."""
    if r.get("engine") == "llama-bench":
        label = LLAMA_BENCH_ROWS[r["kind"]][0] + ("" if r.get("repack", True) else ", repack off")
        return label, "-", "-", "-", "-", "-"
    if r.get("engine") == "llama.cpp":
        return f"llama.cpp mmap, repack {'on' if r.get('repack', True) else 'off'}", "-", "-", "-", "-", "-"
    gpu = str(r.get("device_used") or r.get("device") or "cpu").startswith("cuda")
    if not r["moe_stream"]:
        if gpu:
            where = "GPU memory" if r.get("pool", "device") == "device" else "pinned host memory (--pool host)"
            return f"resident: every expert in {where}", "-", "-", "-", "-", "-"
        return "resident (mmap)", "-", "-", "-", "-", "-"
    per = r.get("slots_per_layer")
    slots = str(r["slots"]) if r.get("slots") is not None else (
        (f"{min(per)}" if min(per) == max(per) else f"{min(per)}-{max(per)}") if per else "budget")
    mode = "streaming" if r.get("mem") is None or gpu else f"streaming, --mem {r['mem']['text']}"
    if gpu:
        if r.get("gpu_mem"):
            mode += f", --gpu-mem {r['gpu_mem']['text']}"
        if r.get("pool", "device") == "host":
            mode += ", --pool host"

    if r.get("host_cache"):
        mode += f", host tier {r['host_cache']['text']}"
    if "direct_io_used" in r:
        reads = "direct" if r["direct_io_used"] else "buffered"
    else:
        reads = {None: "auto", True: "direct", False: "buffered"}[r.get("direct_io")]
    return (mode, slots, str(r["io_threads"]), "on" if r["overlap"] else "off",
            "on" if r.get("prefetch", False) else "off", reads)


def format_table(rows: list[dict], bandwidth: float | None = None) -> str:
    """Markdown table, one line per (configuration, test)."""
    capped = any(r.get("mem_cap") for r in rows)
    vs = any(r.get("engine") in LLAMA_ENGINES for r in rows)
    gpu = any(t.get("gpu") for r in rows for t in r.get("tests", ()))
    cols = ["model", "device", "mode", "slots", "io threads", "overlap", "prefetch", "reads", "test", "t/s", "hit rate",
            "Belady hit rate", "IO stall", "prefetch recall", "miss bytes ready", "GiB streamed", "GiB disk",
            "peak RSS GiB"]
    if capped:
        cols.append("cgroup peak GiB")
    cols.append("IO limit t/s")
    if gpu:
        cols += ["GPU util", "GPU W", "GPU mem GiB", "host CPU %", "host ms/token"]
    if vs:
        cols.append("moestream / llama.cpp")
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    llama = {}  # test -> t/s of the llama.cpp row that the ratio uses (ratio_baseline)
    base = ratio_baseline(rows)
    if base is not None:
        for t in base["tests"]:
            llama[t["test"]] = t["tok_s_mean"]
    for r in rows:
        cells = [os.path.basename(r["model"]), _device_cell(r), *_row_label(r)]
        if "error" in r:
            cells += ["-", f"failed: {r['error']}"]
            cells += [""] * (len(cols) - len(cells))
            out.append("| " + " | ".join(cells) + " |")
            continue
        for t in r["tests"]:
            hit = "-" if t.get("hit_rate") is None else f"{100 * t['hit_rate']:.1f}%"
            opt = "-" if t.get("belady_hit_rate") is None else f"{100 * t['belady_hit_rate']:.1f}%"
            stall = "-" if t.get("io_stall_fraction") is None else f"{100 * t['io_stall_fraction']:.0f}%"
            recall = "-" if t.get("prefetch_recall") is None else f"{100 * t['prefetch_recall']:.1f}%"
            ready = "-" if t.get("miss_bytes_ready") is None else f"{100 * t['miss_bytes_ready']:.1f}%"
            row = cells + [t["test"], f"{t['tok_s_mean']:.2f} ± {t['tok_s_sd']:.2f}", hit, opt, stall, recall, ready,
                           f"{t['streamed_gib']:.3f}", _num(t.get("disk_read_gib"), 3), f"{r['peak_rss_gib']:.2f}"]
            if capped:
                row.append(f"{r['cgroup_peak_gib']:.2f}" if r.get("cgroup_peak_gib") is not None else "-")
            row.append(_limit(t, bandwidth))
            if gpu:
                g = t.get("gpu") or {}
                row += [_num(g.get("util_mean_pct"), 0, "%"), _num(g.get("power_mean_w"), 0),
                        _num(g.get("mem_peak_gib"), 2), _num(t.get("host_cpu_pct"), 0, "%"),
                        _num(t.get("host_ms_per_token"), 2)]
            if vs:
                ref = llama.get(t["test"])
                ours = r.get("engine") not in LLAMA_ENGINES
                row.append(f"{t['tok_s_mean'] / ref:.3g}" if ours and ref else "-")
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread; ``getrusage(RUSAGE_SELF)``)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


#: The engines of llama.cpp's rows: the bindings (llama-cpp-python) or a llama-bench binary (--llama-bench).
LLAMA_ENGINES = ("llama.cpp", "llama-bench")


def _num(x: float | None, digits: int, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _device_cell(r: dict) -> str:
    """The device column: what a moestream row ran on (``device_used`` when it finished, else what was asked),
    a llama.cpp row's ``device``."""
    return str(r.get("device_used") or r.get("device") or "cpu")


def ratio_baseline(rows: list[dict]) -> dict | None:
    """The llama.cpp row that the "moestream / llama.cpp" column divides by, None if none finished. llama-bench
    rows: the one marked ``baseline`` (experts on CPU on a GPU run: the set-up that, as streaming does, keeps the
    experts out of GPU memory; the CPU row on a CPU run). Binding rows: repack on uncapped, off capped (else the
    one that finished)."""
    capped = any(r.get("mem_cap") for r in rows)
    for r in rows:
        if "error" in r:
            continue
        if r.get("engine") == "llama-bench" and r.get("baseline"):
            return r
        if r.get("engine") == "llama.cpp" and r.get("repack", True) == (not capped):
            return r
    # the preferred binding row failed (uncapped: its repacking crashed, and a repack-off row followed it)
    return next((r for r in rows if r.get("engine") == "llama.cpp" and "error" not in r), None)


#: ``bench --routing``: the router's own expert ids, or experts/synthetic.py's calibrated ones
ROUTING_MODES = ("model", "calibrated")


def routing_note(mode: str, calibration: dict | None, llama: bool) -> str:
    """The lines under the table that say how the rows were routed, and what the Belady column is."""
    if mode == "calibrated":
        c = calibration or {}
        out = [f"Routing: calibrated. Every moestream row's expert ids come from the synthetic generator "
               f"(experts/synthetic.py, fit to {c.get('model')}: zipf {c.get('zipf')}, cutoff {c.get('cutoff')}, reuse "
               f"{c.get('reuse')}; the same seeded sequence in every row), the router's weights kept."]
    else:
        out = ["Routing: model. Each row's own router picks the experts for the test's random token ids (a "
               "random-weight model's router, or a trained one's on random ids, does not route as a trained model "
               "does on text; --routing calibrated gives every row routing fitted to a trained model's hit rates)."]
    if llama:
        out.append("Note: llama.cpp's rows always route with the model's own router (their expert ids cannot be "
                   "replaced)" + (", so they do not see the calibrated routing." if mode == "calibrated" else "."))
    out.append("Belady hit rate: the optimal offline replacement on the same slot count, over the tg test's "
               "requests of the row's routing trace (every earlier request of the row replayed first); no policy "
               "can pass it. The JSON also has lru_hit_rate and lfu_hit_rate, simulated the same way.")
    return "\n".join(out)


def _limit(test: dict, bandwidth: float | None) -> str:
    """IO-bound ceiling: disk bandwidth / bytes read from disk per token (the larger of streamed and disk)."""
    per_tok = max(test.get("disk_bytes_per_token") or 0, test.get("streamed_bytes_per_token") or 0)
    if not bandwidth or per_tok <= 0:
        return "-"
    return f"{bandwidth / per_tok:.1f}"


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``moestream bench`` (see cli.py for the flags)."""
    from .gguf import GGUFModel
    from .limits import check_tokens
    from .options import check_pool, default_threads, load_options, model_path

    device = str(getattr(args, "device", "cpu") or "cpu").strip().lower()
    # the options every row shares, checked once here (a CPU build of torch asked for CUDA: one line, not one per
    # row); the lists (--slots, --mem, --io-threads, ...) vary per row: see row_options
    shared = argparse.Namespace(**{**vars(args), **dict.fromkeys(ROW_FIELDS)})
    base_opts = load_options(shared, moe_stream=True)
    if device != "auto":
        device = base_opts.device
    llama_bench = getattr(args, "llama_bench", None)
    if llama_bench is not None:
        if args.vs is None:
            raise ConfigError("--llama-bench PATH gives the llama.cpp rows of --vs llama.cpp: add --vs llama.cpp")
        if not os.path.isfile(llama_bench) or not os.access(llama_bench, os.X_OK):
            raise ConfigError(f"--llama-bench {llama_bench}: not an executable file (build one with "
                              f"tools/llamacpp_cuda.py build)")
        llama_bench = os.path.abspath(llama_bench)
    for opt, value in (("--json", args.json), ("--vs", args.vs), ("--mem-cap", args.mem_cap)):
        if value is not None and not value.strip():
            raise ConfigError(f"{opt}: the value is empty" + (" (e.g. 4GiB); without a cap, leave --mem-cap out"
                                                               if opt == "--mem-cap" else ""))
    model = model_path(args)
    # the lists every row takes, read before the file and torch (a refused value is answered at once)
    from .experts.reader import check_io_threads
    if args.slots is not None:
        _list(args.slots, int, "--slots")
    for n in _list(args.io_threads, int, "--io-threads") if args.io_threads is not None else []:
        check_io_threads(n)
    for flag, value in (("--moe-stream", args.moe_stream), ("--overlap", args.overlap),
                        ("--direct-io", args.direct_io), ("--prefetch", args.prefetch)):
        if value is not None:
            _on_off_list(value, flag)
    if args.repetitions < 1:
        raise ConfigError(f"-r must be at least 1, got {args.repetitions}")
    from .models.base import architecture_of
    g = GGUFModel(model)  # validates the file up front: one clear error instead of one per row
    architecture_of(g)
    top_k = int(g.arch_get("expert_used_count", 0))
    n_exp = int(g.arch_get("expert_count", 0))
    if args.json is not None:
        check_json_path(args.json, g.paths)
    trace_path = getattr(args, "trace", None)
    if trace_path is not None:
        check_json_path(trace_path, g.paths, option="--trace", what="the trace")
    check_distinct_outputs([("--json", args.json), ("--trace", trace_path)])
    routing = str(getattr(args, "routing", "model")).strip().lower()
    if routing not in ROUTING_MODES:
        raise ConfigError(f"--routing: expected model or calibrated, got {getattr(args, 'routing', None)!r}")
    check_tokens(args.n_prompt, "n_prompt", minimum=0)
    check_tokens(args.n_gen, "n_gen", minimum=0)
    if args.n_prompt == 0 and args.n_gen == 0:
        raise ConfigError("-p and -n must not both be 0")
    from .engine import check_cache_fits, check_trained_context
    from .models.base import LoadOptions, open_model
    shape = open_model(model, LoadOptions())  # hyperparameters and tensor table only, no weight read
    n_ctx = max(args.n_prompt, args.n_gen + 1)
    warning = check_trained_context(shape, n_ctx, f"-p {args.n_prompt} / -n {args.n_gen}", args.override_ctx)
    check_cache_fits(shape, n_ctx, "-p/-n", "-p or -n")
    if warning:
        print(f"moestream: {warning}", file=sys.stderr, flush=True)
    modes = _on_off_list(args.moe_stream, "--moe-stream")
    overlaps = _on_off_list(args.overlap, "--overlap")
    directs = [None] if args.direct_io is None else _on_off_list(args.direct_io, "--direct-io")
    from .budget import parse_mem
    mems = None
    if args.mem is not None:
        mems = [{"text": t, "bytes": parse_mem(t), "source": f"--mem {t}"}
                for t in _dedupe([x.strip() for x in args.mem.split(",")])]
    elif args.mem_cap is not None and args.slots is None:  # capped rows: run's auto budget in the cap (filled below)
        mems = [{"text": None, "bytes": None, "source": None}]
    gpu_mems: list = [None]
    if getattr(args, "gpu_mem", None) is not None:  # CUDA rows: VRAM budgets of the pools
        gpu_mems = [{"text": t, "bytes": parse_mem(t, "--gpu-mem"), "source": f"--gpu-mem {t}"}
                    for t in _dedupe([x.strip() for x in args.gpu_mem.split(",")])]
    host_caches: list = [None]
    if getattr(args, "host_cache", None) is not None:  # host tier sizes; "off" for none
        host_caches = [None if t.lower() in ("off", "0") else {"text": t, "bytes": parse_mem(t, "--host-cache")}
                       for t in _dedupe([x.strip() for x in args.host_cache.split(",")])]
    pools = _dedupe([x.strip().lower() for x in str(getattr(args, "pool", None) or "device").split(",")])
    for pl in pools:  # before the CPU drops the list: a misspelt place is refused on any device
        check_pool(pl)
    slots = _list(args.slots, int, "--slots") if args.slots is not None else [None]
    prefetches = _on_off_list(args.prefetch, "--prefetch")
    if device == "cpu":  # CUDA-only lists would give identical rows on the CPU
        gpu_mems, pools = [None], ["device"]
    ios = _list(args.io_threads, int, "--io-threads")
    for s in slots:
        if s is not None and s < top_k:
            raise ConfigError(f"--slots {s} is below the experts used per token ({top_k})")
    slots = _dedupe([s if s is None else min(s, n_exp) for s in slots])  # above the count: clamped, as run does
    threads = args.threads if args.threads is not None else default_threads()  # one count for every row
    base = {"model": model, "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
            "threads": threads, "ubatch": args.ubatch, "expand_dense": args.expand_dense,
            "matmul": getattr(args, "matmul", "blocks"),
            "policy": args.policy, "routing": routing, "device": device}
    cfgs = []
    for on in modes:
        if on:
            for s, mem, t, ov, pf, dio, gm, hc, pl in itertools.product(slots, mems or [None], ios, overlaps,
                                                                      prefetches, directs, gpu_mems, host_caches,
                                                                      pools):
                cfgs.append({**base, "moe_stream": True, "slots": s, "mem": mem, "io_threads": t, "overlap": ov,
                             "prefetch": pf, "direct_io": dio, "gpu_mem": gm, "host_cache": hc, "pool": pl})
        else:
            for pl in pools:
                cfgs.append({**base, "moe_stream": False, "pool": pl})
    cap = None
    if args.mem_cap is not None:
        from .memcap import MemCap, parse_cap
        cap = MemCap(parse_cap(args.mem_cap))
        MemCap.check()  # say plainly why not, instead of running uncapped
        for c in cfgs:
            if c.get("mem") and c["mem"]["bytes"] is None:
                from .budget import capped_budget
                n = capped_budget(cap.limit_bytes)
                text = f"{n / 2**30:.2f}GiB"
                c["mem"] = {"text": text, "bytes": n, "source": f"--mem {text} (the cap less run's auto margin)"}
    for c in cfgs:  # every row's options checked before any row runs (one line naming the flags: cli.main)
        row_options(c, base_opts)
    if args.vs is not None and args.vs != "llama.cpp":
        raise ConfigError(f"--vs: only llama.cpp is known, got {args.vs!r}")
    if args.vs is not None and llama_bench is None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ConfigError(f"--vs llama.cpp needs llama-cpp-python in this environment: install it from the "
                              f"moestream checkout with `{sys.executable} tools/llamacpp.py install` (builds "
                              f"llama.cpp once into a cached wheel, about 5 minutes)") from None
    if args.vs is not None and llama_bench is not None:
        # the binary's rows instead of the bindings'. A GPU run: all layers on the GPU, and experts on the CPU
        # (the ratio's baseline); a CPU run: the CPU row. Capped: --repack 0 on the rows with CPU weights (their
        # repacked weights would be anonymous memory that the cap cannot page back to the file).
        gpu_run = device.startswith("cuda") or (device == "auto" and _cuda_available())
        kinds = ["gpu", "cpu_moe"] if gpu_run else ["cpu"]
        lb = {k: v for k, v in base.items() if k != "device"}
        for kind in kinds:
            cfgs.append({**lb, "engine": "llama-bench", "moe_stream": False, "llama_bench": llama_bench,
                         "kind": kind, "device": LLAMA_BENCH_ROWS[kind][1], "baseline": kind != "gpu",
                         "repack": not (cap and kind != "gpu")})
    elif args.vs is not None:
        lbase = {**base, "engine": "llama.cpp", "moe_stream": False}
        # uncapped: llama.cpp's defaults (CPU repack on). Capped: its repacked weights are anonymous memory
        # that the cap cannot page back to the file, so the default gets its own row (expected to fail) and
        # the comparison uses repack off, mmap.
        cfgs.append({**lbase, "repack": True})
        if cap:
            cfgs.append({**lbase, "repack": False})
    calibration = None
    if routing == "calibrated":
        from .experts.synthetic import calibration_summary, fit_for
        calibration = calibration_summary(n_exp, top_k, fit_for(g.arch))
        print(calibration["summary"], file=sys.stderr, flush=True)
    bandwidth = None
    if args.cold:
        from .experts.layout import ExpertLayout
        layout = ExpertLayout(g)
        chunk = max(m.bytes_per_expert for m in layout[layout.moe_layers[0]].values())
        bandwidth = disk_read_bandwidth(g.paths[0], chunk)
        print(f"disk random-read bandwidth: {bandwidth / 1e9:.2f} GB/s ({chunk / 2**20:.2f} MiB reads, 8 threads, "
              f"O_DIRECT, the best of 3 rounds of 48)", file=sys.stderr, flush=True)
    trace_dir = tempfile.mkdtemp(prefix="moestream-bench-trace-") if trace_path is not None else None
    if trace_dir is not None:
        for i, cfg in enumerate(cfgs, 1):
            if cfg.get("engine") is None:  # moestream's rows; llama.cpp's are not traced
                cfg["trace"] = {"path": os.path.join(trace_dir, f"row{i}.jsonl"), "row": i,
                                "label": " ".join(_row_label(cfg))}
    rows = None
    try:
        rows = _run_rows(args, cfgs, g, cap)
    finally:
        if trace_dir is not None and rows is None:  # interrupted: no trace, as no --json
            import shutil
            shutil.rmtree(trace_dir, ignore_errors=True)
        elif trace_dir is not None:
            try:
                from .experts.layout import ExpertLayout
                write_bench_trace(trace_path, {
                    "model": {"path": os.path.abspath(model), "name": os.path.basename(model), "arch": g.arch,
                              "n_experts": n_exp, "top_k": top_k, "file_bytes": g.file_bytes},
                    "layers": ExpertLayout(g).moe_layers, "device": device,
                    "options": {k: v for k, v in vars(args).items() if not callable(v)},
                    "rows": [{"row": i, "label": " ".join(_row_label(c)), "traced": bool(c.get("trace"))}
                             for i, c in enumerate(cfgs, 1)]}, cfgs, rows)
            finally:
                import shutil
                shutil.rmtree(trace_dir, ignore_errors=True)
    return _report(args, rows, bandwidth, routing, calibration, g, model)


#: how a killed process's status reads: a negative signal number (subprocess), or 128 + it (a shell)
_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)


def _crashed_with_repack(cfg: dict, returncode: int, err: str) -> bool:
    """Whether a llama.cpp row with CPU repacking on died of a crash signal (its own process, or llama-bench's
    ``exited with status -11``), not of an error it reported or of the memory cap."""
    if cfg.get("engine") not in ("llama.cpp", "llama-bench") or not cfg.get("repack", True) or "OOM" in err:
        return False
    codes = {-int(s) for s in _CRASH_SIGNALS} | {128 + int(s) for s in _CRASH_SIGNALS}
    if returncode in codes:
        return True
    m = re.search(r"llama-bench exited with status (-?\d+)", err)
    return m is not None and int(m.group(1)) in codes


def _run_rows(args: argparse.Namespace, cfgs: list[dict], g, cap) -> list[dict]:  # noqa: ANN001
    """Each row in its own process (under the cap's cgroup with --mem-cap): the rows' results, in order. A
    llama.cpp row with CPU repacking on that crashes is followed by the same row with repack off (``cfgs``
    grows by that row)."""
    rows = []
    i = 0
    while i < len(cfgs):
        cfg = cfgs[i]
        i += 1
        mode, s, t, ov, pf, reads = _row_label(cfg)
        print(f"[{i}/{len(cfgs)}] {mode} slots={s} io={t} overlap={ov} prefetch={pf} reads={reads} ...",
              file=sys.stderr,
              flush=True)
        if args.cold or cap:
            evict_page_cache(g.paths)
        cmd = [sys.executable, "-m", "moestream.bench", json.dumps(cfg)]
        peak = None
        if cap:
            res = cap.run(cmd)
            proc = subprocess.CompletedProcess(cmd, res.returncode, res.stdout, res.stderr)
            peak = res.peak_bytes / GiB
            if not res.peak_exact and i == 1:
                print(f"note: the cgroup peak column is {res.peak_source}", file=sys.stderr, flush=True)
            if res.oom_killed:
                proc.stderr += f"\nOOM-killed under the {args.mem_cap} memory cap"
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            err = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            err = err.removeprefix("moestream: error: ")
            rows.append({**cfg, "error": err, "mem_cap": args.mem_cap, "cgroup_peak_gib": peak})
            if _crashed_with_repack(cfg, proc.returncode, err) and not any(
                    c.get("engine") == cfg["engine"] and c.get("kind") == cfg.get("kind") and not c.get("repack", True)
                    for c in cfgs):
                # llama.cpp's CPU repacking crashes on some shapes (its Q4_0 repack on Gemma's 704-wide expert
                # rows, this machine): the same row once more with repack off, so the table still has a baseline
                print(f"[{i}/{len(cfgs)}] llama.cpp crashed with CPU repacking on ({err}): that row again with "
                      f"--repack 0", file=sys.stderr, flush=True)
                cfgs.insert(i, {**cfg, "repack": False})
                rows[-1]["retried"] = "with --repack 0, the next row"
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({**row, "mem_cap": args.mem_cap, "cgroup_peak_gib": peak})
        rows[-1].pop("trace", None)  # a temporary file of --trace, gone after the run
    return rows


def _report(args: argparse.Namespace, rows: list[dict], bandwidth, routing, calibration, g, model) -> int:  # noqa: ANN001
    """The table on stdout, --json, and the exit status of run_bench."""

    table = format_table(rows, bandwidth)
    write_stdout(table + "\n\n" + routing_note(routing, calibration, args.vs is not None) + "\n")
    if bandwidth:
        write_stdout(f"\nIO limit t/s = disk random-read bandwidth ({bandwidth / 1e9:.2f} GB/s, the best of 3 probes "
                     f"before the rows) / bytes read per token in that row (the larger of streamed and disk reads): "
                     f"the speed if every streamed byte came from the disk; streamed bytes the page cache still "
                     f"holds (room left under the cap, a warm file) do not, so a row can exceed it.\n")
    if args.json:
        meta = {"machine": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cold": args.cold,
                "disk_read_bandwidth_bytes_s": bandwidth, "mem_cap": args.mem_cap,
                "file_gib": g.file_bytes / GiB, "command": " ".join(sys.argv), "routing": routing,
                "routing_calibration": calibration}
        write_json(args.json, {"meta": meta, "rows": rows})
    failed = [r for r in rows if "error" in r and not r.get("retried")]  # a crashed repack row: its retry counts
    if failed:  # the table says which rows; stderr gets the one error line every failing command gives
        print(f"moestream: error: {model}: {len(failed)} of {len(rows)} bench rows failed (first: "
              f"{failed[0]['error']})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from .errors import MoestreamError

    try:
        cfg = json.loads(sys.argv[1])
        run = {"llama.cpp": run_llamacpp_row, "llama-bench": run_llamabench_row}.get(cfg.get("engine"), run_row)
        print(json.dumps(run(cfg)))
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        sys.exit(1)
