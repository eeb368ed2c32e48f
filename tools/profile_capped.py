"""Where a decode token's time goes in the fast CPU step (runtime/fastdecode.py), per layer, streaming or resident.

For issue 25 item 3 (a capped decode step reaching only part of its IO limit): the step's calls are timed as they
run -- the q/k/v/o projections, the attention block, the norms, the router and its plan, the store's ``prepare``
(slot plan, reads submitted), the hits' and the misses' expert calls, every ``wait`` on the reads (the stall) --
and every expert read on the IO threads (queued, started, finished). Nothing in the library is edited: the
functions are wrapped at run time, as tools/profile_decode.py does.

Per layer and on average over the decode steps it prints, in ms per token: each part's time, the time blocked on
reads, what is left unaccounted (Python glue between the calls), and the reads' timeline relative to the
router's end: when the first read started on an IO thread, when the last one finished, and whether the hits'
compute ran while reads were in flight. Page faults (minor, major) and the process's CPU time per token too.

With ``--mem-cap SIZE`` the measured part runs in a memory cgroup of that size (page cache included; root), the
file evicted from the page cache first, the pools planned for ``--mem`` = the cap less run's auto margin (bench's
defaults: budget.capped_budget), as in
``moestream bench --mem-cap SIZE --cold``::

    python tools/profile_capped.py -m q30b-8l-q4_k_m.gguf --mem-cap 1.6GiB -t 2      # streaming under a cap
    python tools/profile_capped.py -m q30b-8l-q4_k_m.gguf --resident -t 2            # --moe-stream off
    python tools/profile_capped.py -m q30b-8l-q4_k_m.gguf --slots 128 -t 2           # streaming, every expert
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import threading
import time
from collections import defaultdict

#: the parts of a layer, in the order the fast step runs them
PARTS = ("lookahead", "qkv", "attn", "o", "norm", "router", "plan", "prepare", "glue", "hits", "wait", "misses",
         "moe", "norm2")


class Profile:
    """Wraps a FastDecode, its store and reader: records (step, layer, part, t0, t1) and the reads' times."""

    def __init__(self, model, fast) -> None:  # noqa: ANN001
        from moestream import kernels
        from moestream.runtime import fastdecode

        self.model, self.fast, self.kernels = model, fast, kernels
        self.ev: list[tuple[int, int, str, float, float]] = []
        self.reads: list[tuple[int, int, float, float, float, int]] = []  # step, layer, queued, start, end, bytes
        self.step_times: list[tuple[float, float]] = []
        self.faults: list[tuple[int, int]] = []
        self.cpu: list[float] = []
        self.step_no, self.layer, self.active = -1, -1, False
        self._depth = 0
        prof = self

        def timed(part_of, fn):  # noqa: ANN001, ANN202
            def inner(*a, **k):  # noqa: ANN002, ANN003, ANN202
                if not prof.active or prof._depth:
                    return fn(*a, **k)
                prof._depth += 1
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    prof._depth -= 1
                    part = part_of(a) if callable(part_of) else part_of
                    prof.ev.append((prof.step_no, prof.layer, part, t0, time.perf_counter()))
            return inner

        class Lib:  # the step library with its step kernels timed
            def __init__(self, lib) -> None:  # noqa: ANN001
                self._lib = lib

            def __getattr__(self, name):  # noqa: ANN001, ANN204
                fn = getattr(self._lib, name)
                if name == "ms_attn_block":
                    def attn(*a):  # noqa: ANN002, ANN202
                        return timed("attn", fn)(*a)
                    return attn
                if name == "ms_residual_norm":  # x (+= o or the experts' rows), then the next norm
                    return timed(lambda a: "norm" if a[3] else "norm0", fn)
                if name == "ms_route_plan":
                    return timed("plan", fn)
                return fn

        fast.lib = Lib(fast.lib)
        self._plan = fastdecode.plan
        fastdecode.plan = lambda m: fast if m is model else self._plan(m)  # (plan() would make a new one: lib differs)
        self._linear_to = kernels.linear_to

        def linear_to(spec, x, n, y, lib):  # noqa: ANN001, ANN202
            if prof.active and not prof._depth and spec[1] in prof._q:
                prof.layer = prof._q[spec[1]]  # the q projection starts a layer
            part = "qkv" if spec[1] in prof._qkv else "o"
            return timed(part, prof._linear_to)(spec, x, n, y, lib)

        self._q = {lay[1][1]: lay[0] for lay in fast.layers if lay[1] is not None}
        self._qkv = {lay[j][1] for lay in fast.layers for j in (1, 2, 3) if lay[j] is not None}  # (no V: K = V)
        kernels.linear_to = linear_to
        self._moe_to = kernels.moe_to
        kernels.moe_to = lambda *a, **k: timed("moe", prof._moe_to)(*a, **k)
        self._fd_moe = fastdecode.FastDecode._moe
        fast._moe = lambda spec, first, n, hp, outp: timed("hits" if first == 0 else "misses", prof._fd_moe)(
            fast, spec, first, n, hp, outp)
        for lay in fast.layers:  # (i, q, k, v, o, attn, fn, dense, ffn, ...): an MoE layer's ffn[0][0] is its router
            if lay[7] or lay[8][0][0] is None:
                continue
            r = lay[8][0][0]
            r.linear = timed("router", r.linear)
        model.output.linear = timed("head", model.output.linear)
        begin = model.begin_layer  # the router lookahead (--prefetch on): its prediction and prefetch submit

        def begin_layer(i, x):  # noqa: ANN001, ANN202
            if prof.active and not prof._depth:
                prof.layer = i
            return timed("lookahead", begin)(i, x)

        model.begin_layer = begin_layer
        if hasattr(fast, "_look"):  # the fast step's own lookahead (its C prediction and the gated prefetch)
            fast._look = timed("lookahead", fast._look)
        model.embd.rows_of = timed("embed", model.embd.rows_of)
        store = fast.store
        if store.streaming:
            self._wrap_store(store, timed)

    def _wrap_store(self, store, timed) -> None:  # noqa: ANN001
        prof = self
        store.prepare = timed("prepare", store.prepare)
        store.wait = timed("wait", store.wait)
        store.ready = timed("glue", store.ready)
        reader = store.reader
        orig_submit, orig_read = reader.submit, reader._read
        lock = threading.Lock()
        queued: dict[int, tuple[int, int, float]] = {}

        def submit(jobs, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            t = time.perf_counter()
            with lock:
                for j in jobs:
                    queued[id(j)] = (prof.step_no, prof.layer, t)
            return orig_submit(jobs, *a, **k)

        def read(job):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            try:
                return orig_read(job)
            finally:
                t1 = time.perf_counter()
                with lock:
                    s, la, tq = queued.pop(id(job), (-1, -1, t0))
                    if prof.active:
                        prof.reads.append((s, la, tq, t0, t1, len(job.dest) if job.dest is not None else job.size))

        reader.submit, reader._read = submit, read
        if hasattr(reader, "_c_settle"):  # the C read threads: each read's start and end, taken when joined
            orig_settle = reader._c_settle
            ns = time.perf_counter() - time.monotonic_ns() / 1e9  # perf_counter and CLOCK_MONOTONIC: one clock here

            def settle(futures):  # noqa: ANN001, ANN202
                orig_settle(futures)
                with lock:
                    for f in futures:
                        if f.times is None:
                            continue
                        s, la, tq = queued.pop(id(f.job), (-1, -1, 0.0))
                        if prof.active or s >= 0:
                            prof.reads.append((s, la, tq, f.times[0] / 1e9 + ns, f.times[1] / 1e9 + ns,
                                               len(f.job.dest)))

            reader._c_settle = settle

    def step(self, engine, tok: int, pos: int, cache) -> None:  # noqa: ANN001
        self.step_no += 1
        self.layer = -1
        self.active = True
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = time.process_time()
        t0 = time.perf_counter()
        engine.decode_step(tok, pos, cache)
        t1 = time.perf_counter()
        c1 = time.process_time()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.active = False
        self.step_times.append((t0, t1))
        self.faults.append((r1.ru_minflt - r0.ru_minflt, r1.ru_majflt - r0.ru_majflt))
        self.cpu.append(c1 - c0)


def thread_cpu() -> dict[int, float]:
    """{thread id: CPU seconds (user + system)} of this process's threads (/proc/self/task)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_by_kind(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two :func:`thread_cpu` snapshots by kind of thread: main, IO (the reader's threads),
    other (the kernels' workers, torch's)."""
    io = {t.native_id for t in threading.enumerate() if t.name.startswith("moestream-io")}
    kinds: dict[str, float] = defaultdict(float)
    for tid, c in after.items():
        kind = "main" if tid == os.getpid() else "io" if tid in io else "workers"
        kinds[kind] += c - before.get(tid, 0.0)
    return kinds


def report(p: Profile, n_layers: int, label: str) -> dict:
    steps = len(p.step_times)
    per_step = [1000 * (b - a) for a, b in p.step_times]
    part_ms: dict[str, float] = defaultdict(float)
    for _s, _la, part, t0, t1 in p.ev:
        part_ms[part] += 1000 * (t1 - t0)
    total = sum(per_step)
    known = sum(part_ms.values())
    out = {"label": label, "steps": steps, "ms_per_token_mean": statistics.mean(per_step),
           "ms_per_token_median": statistics.median(per_step),
           "ms_per_token_sd": statistics.stdev(per_step) if steps > 1 else 0.0,
           "parts_ms": {k: v / steps for k, v in part_ms.items()}, "unaccounted_ms": (total - known) / steps,
           "minflt": sum(f[0] for f in p.faults) / steps, "majflt": sum(f[1] for f in p.faults) / steps,
           "cpu_ms": 1000 * sum(p.cpu) / steps}
    print(f"== {label}: {steps} decode steps, {statistics.mean(per_step):.2f} ms/token mean "
          f"(median {statistics.median(per_step):.2f}, sd {out['ms_per_token_sd']:.2f}); process CPU "
          f"{out['cpu_ms']:.1f} ms/token; faults/token minor {out['minflt']:.0f} major {out['majflt']:.1f}")
    if steps >= 2:
        mf = [f[0] for f in p.faults]
        print(f"   minor faults per step: {' '.join(str(x) for x in mf[:4])} ... {' '.join(str(x) for x in mf[-4:])} "
              f"(first and last steps)")
    order = [q for q in ("embed", "lookahead", "norm0", "qkv", "attn", "o", "norm", "router", "plan", "prepare", "glue",
                         "hits", "wait", "misses", "moe", "head") if q in part_ms]
    for q in order:
        print(f"   {q:10s} {part_ms[q] / steps:8.3f} ms/token")
    print(f"   {'(other)':10s} {(total - known) / steps:8.3f} ms/token  (Python between the calls, the engine's "
          f"checks)")
    stall = part_ms.get("wait", 0.0)
    print(f"   not blocked on reads: {(total - stall) / steps:.2f} ms/token")
    if p.reads:
        # per (step, layer): the router's end (the prepare's start), first read queued/started, last read finished,
        # the hits' compute span, misses' spans
        by: dict[tuple[int, int], dict] = defaultdict(dict)
        for s, la, part, t0, t1 in p.ev:
            d = by[(s, la)]
            if part == "prepare":
                d["prep0"], d["prep1"] = t0, t1
            elif part == "hits":
                d["hits"] = (t0, t1)
            elif part == "misses":
                d.setdefault("misses", []).append((t0, t1))
            elif part == "wait":
                d["wait"] = d.get("wait", 0.0) + (t1 - t0)
            elif part == "norm":
                d.setdefault("end", t1)
                d["end"] = max(d["end"], t1)
        for s, la, tq, t0, t1, nb in p.reads:
            d = by[(s, la)]
            d.setdefault("rs", []).append((tq, t0, t1, nb))
        rows = []
        for (_s, la), d in by.items():
            if "rs" not in d or "prep0" not in d:
                continue
            r0 = d["prep0"]
            rs = d["rs"]
            first_q = min(x[0] for x in rs) - r0
            first_s = min(x[1] for x in rs) - r0
            last_e = max(x[2] for x in rs) - r0
            busy = sum(x[2] - x[1] for x in rs)
            nbytes = sum(x[3] for x in rs)
            h = d.get("hits")
            hits_end = (h[1] - r0) if h else 0.0
            hits_ms = (h[1] - h[0]) if h else 0.0
            miss_ms = sum(b - a for a, b in d.get("misses", []))
            rows.append((la, len(rs), nbytes, first_q, first_s, last_e, busy, hits_ms, hits_end, d.get("wait", 0.0),
                         miss_ms))
        if rows:
            print("   reads, per layer with misses (mean over steps; ms from the start of prepare(), i.e. the router's "
                  "end):")
            print("   layer  reads    MB  queued  1st start  last end  read-thread ms  hits ms  hits end  wait ms  "
                  "misses ms")
            agg: dict[int, list] = defaultdict(list)
            for r in rows:
                agg[r[0]].append(r)
            for la in sorted(agg):
                rr = agg[la]
                m = [statistics.mean(x[i] for x in rr) for i in range(1, 11)]
                print(f"   {la:5d} {m[0]:6.1f} {m[1] / 1e6:6.2f} {1000 * m[2]:7.3f} {1000 * m[3]:10.3f} "
                      f"{1000 * m[4]:9.3f} {1000 * m[5]:15.3f} {1000 * m[6]:8.3f} {1000 * m[7]:9.3f} "
                      f"{1000 * m[8]:8.3f} {1000 * m[9]:10.3f}")
            out["read_layers"] = [{"layer": r[0], "reads": r[1], "bytes": r[2], "first_queued_ms": 1000 * r[3],
                                   "first_start_ms": 1000 * r[4], "last_end_ms": 1000 * r[5],
                                   "read_thread_ms": 1000 * r[6], "hits_ms": 1000 * r[7], "hits_end_ms": 1000 * r[8],
                                   "wait_ms": 1000 * r[9], "misses_ms": 1000 * r[10]} for r in rows]
            span = statistics.mean(r[5] for r in rows)
            print(f"   per layer with misses: reads span {1000 * span:.2f} ms from the router's end; "
                  f"{len(rows) / steps:.1f} such layers per token; {sum(r[2] for r in rows) / steps / 1e6:.1f} MB read "
                  f"per token")
        busy = max(sum(x[4] - x[3] for x in p.reads), 1e-9)
        print(f"   read throughput while reading: {sum(x[5] for x in p.reads) / busy / 1e9:.2f} GB/s per read thread")
    return out


def memory_split() -> dict[str, int]:
    """Where this process's memory is now, bytes: /proc/self/status's RssAnon, RssFile (mapped file pages: the
    libraries' code, the embedding table's map) and RssShmem; and, where the process is in a memory cgroup with a
    limit (v1 ``memory.stat``: rss, cache, mapped_file; v2: anon, file, file_mapped), that group's limit and its
    charges. Under a cap, anonymous memory beyond the plan leaves the file pages less room: they are reclaimed and
    fault back in (the minor faults per token)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            if ctrl == "" or "memory" in ctrl.split(","):
                base = "/sys/fs/cgroup" + ("" if ctrl == "" else "/memory") + path
                try:
                    limit = open(base + ("/memory.max" if ctrl == "" else "/memory.limit_in_bytes")).read().strip()
                    stat = dict(line.split() for line in open(base + "/memory.stat"))
                except OSError:
                    continue
                if limit == "max" or int(limit) >= 2**60:
                    continue
                out["cgroup_limit"] = int(limit)
                for k in ("rss", "cache", "mapped_file", "anon", "file", "file_mapped"):
                    if k in stat:
                        out["cgroup_" + k] = int(stat[k])
    return out


def child(a: argparse.Namespace) -> None:
    from moestream.bench import row_options
    from moestream.engine import Engine
    from moestream.models.base import load_model
    from moestream.options import set_compute_threads
    from moestream.runtime import fastdecode

    set_compute_threads(a.threads, "blocks")
    cfg = {"model": a.model, "n_prompt": a.prompt, "n_gen": a.steps, "moe_stream": not a.resident,
           "direct_io": a.direct_io == "on", "io_threads": a.io_threads, "prefetch": a.prefetch == "on",
           "overlap": True}
    if a.slots:
        cfg["slots"] = a.slots
    if (a.mem or a.mem_cap) and not a.resident and not a.slots:
        from moestream.budget import capped_budget
        from moestream.memcap import parse_cap
        cfg["mem"] = ({"bytes": parse_cap(a.mem), "source": f"--mem {a.mem}"} if a.mem else
                      {"bytes": capped_budget(parse_cap(a.mem_cap)),
                       "source": f"--mem-cap {a.mem_cap} less run's margin"})
    opts = row_options(cfg)
    model = load_model(a.model, opts)
    engine = Engine(model)
    rng = random.Random(1234)
    # bench's warm-up: one prompt of -p, 4 decode steps
    cache = model.new_cache(a.prompt + 1)
    engine.prefill([rng.randrange(model.n_vocab) for _ in range(a.prompt)], cache)
    cache = model.new_cache(a.steps + 1)
    for pos in range(4):
        engine.decode_step(rng.randrange(model.n_vocab), pos, cache)
    fast = fastdecode.plan(model)
    if fast is None:
        sys.exit("the fast decode step does not apply to this model/store")
    p = Profile(model, fast)
    st0 = model.store.stats.copy()
    results = []
    tc0 = thread_cpu()
    for _rep in range(a.repetitions):
        cache = model.new_cache(a.steps + 1)
        for pos in range(a.steps):
            p.step(engine, rng.randrange(model.n_vocab), pos, cache)
    st = model.store.stats - st0
    kinds = cpu_by_kind(tc0, thread_cpu())
    budget = a.mem or (f"{cfg['mem']['bytes'] / 2**30:.2f}GiB" if "mem" in cfg else "-")
    label = ("resident" if a.resident else f"streaming {a.slots or 'mem ' + budget} slots") + \
        f", -t {a.threads}, io {a.io_threads}, prefetch {a.prefetch}"
    r = report(p, model.n_layers, label)
    r["hit_rate"] = st.hit_rate
    r["stall_s_store"] = st.stall_seconds
    print(f"   hit rate {100 * st.hit_rate:.1f}%, store stall {1000 * st.stall_seconds / len(p.step_times):.2f} "
          f"ms/token; slots/layer {getattr(model.store, 'n_slots', '-')}")
    if st.recall is not None:
        print(f"   lookahead: recall {100 * st.recall:.1f}%, miss bytes ready {100 * (st.ready_share or 0):.1f}%, "
              f"issued {st.prefetch_issued}, used {st.prefetch_used}, wasted {st.prefetch_wasted} (cancelled "
              f"{st.prefetch_cancelled}, failed {st.prefetch_failed}) over {len(p.step_times)} tokens")
    n_steps = len(p.step_times)
    r["thread_cpu_ms"] = {k: 1000 * v / n_steps for k, v in kinds.items()}
    print("   CPU per token by thread: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(r["thread_cpu_ms"].items())))
    r["memory"] = mem = memory_split()
    line = "   memory now: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in mem.items())
    if (mp := getattr(model, "memory_plan", None)) is not None:
        line += (f"; plan: process {mp.process / 2**20:.0f} MiB, dense {mp.dense / 2**20:.0f} MiB, kv+scratch "
                 f"{(mp.kv + mp.scratch) / 2**20:.0f} MiB, pools {mp.pools / 2**20:.0f} MiB, "
                 f"left {mp.left / 2**20:.0f} MiB")
    print(line)
    results.append(r)
    if a.cprofile:
        import cProfile
        import pstats
        p.active = False
        cache = model.new_cache(a.cprofile + 1)
        with cProfile.Profile() as cp:
            for pos in range(a.cprofile):
                engine.decode_step(rng.randrange(model.n_vocab), pos, cache)
        print(f"cProfile over {a.cprofile} steps (per step = total / {a.cprofile}):")
        pstats.Stats(cp).sort_stats("tottime").print_stats(25)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    model.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=64, help="prompt tokens of the warm-up prefill")
    ap.add_argument("-n", "--steps", type=int, default=32, help="timed decode steps per repetition")
    ap.add_argument("-r", "--repetitions", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--resident", action="store_true", help="--moe-stream off")
    ap.add_argument("--slots", type=int, default=0, help="streaming with this many slots per layer (not --mem)")
    ap.add_argument("--mem-cap", default=None, help="run in a memory cgroup of this size")
    ap.add_argument("--mem", default=None, help="the memory budget the pools are planned for (default: the cap "
                    "less run's auto margin, as bench)")
    ap.add_argument("--direct-io", default="on")
    ap.add_argument("--prefetch", default="off")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cprofile", type=int, default=0, help="after the timed steps, this many more under cProfile: "
                    "the Python functions by own time")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child or not a.mem_cap:
        child(a)
        return
    from moestream.bench import evict_page_cache
    from moestream.memcap import MemCap, parse_cap

    evict_page_cache([a.model])
    cap = MemCap(parse_cap(a.mem_cap))
    res = cap.run([sys.executable, *sys.argv, "--child"])
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.oom_killed:
        print("OOM-killed under the cap", file=sys.stderr)
    sys.exit(res.returncode)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
