#!/usr/bin/env python3
"""Where a CUDA run's host memory goes, stage by stage, against the memory plan (issue 24.6: ``--pool host``).

    python benchmarks/host_mem_probe.py MODEL [--device cuda] [--pool host] [--mem 5GiB] [-n 32] [--cap 8G]

Loads MODEL with the options given (through ``load_model``, as ``run`` does), then decodes ``-n`` greedy tokens,
and prints at each stage (imports, CUDA context, load, first token: Triton's compiles, the rest) the process's
memory from ``/proc/self/status`` (VmRSS, RssAnon, RssFile, RssShmem, VmLck, VmPin; kB -> MiB) and, where the
process sits in a memory cgroup, that group's ``memory.current`` and the anon / file / kernel / shmem lines of its
``memory.stat`` (v2) or ``memory.usage_in_bytes`` and rss / cache (v1); then the plan's parts. ``--cap SIZE``
runs the same in a fresh memory cgroup of SIZE (moestream.memcap; root) and prints its peak and OOM count.
One JSON line per stage too (prefix ``JSON``), for a log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MiB = 2**20


def _status() -> dict[str, float]:
    """MiB of the memory lines of /proc/self/status that say where resident memory is."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def _cgroup() -> dict[str, float]:
    """MiB of this process's memory cgroup (v2 memory.current + memory.stat's main lines, or v1's), {} if none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":  # v2
            base = "/sys/fs/cgroup" + path
            cur, stat = os.path.join(base, "memory.current"), os.path.join(base, "memory.stat")
            keys = ("anon", "file", "kernel", "shmem", "sock", "unevictable")
        elif "memory" in ctrl.split(","):
            base = "/sys/fs/cgroup/memory" + path
            cur, stat = os.path.join(base, "memory.usage_in_bytes"), os.path.join(base, "memory.stat")
            keys = ("rss", "cache", "shmem", "mapped_file", "unevictable")
        else:
            continue
        try:
            with open(cur) as f:
                out = {"current": int(f.read()) / MiB}
            with open(stat) as f:
                for sl in f:
                    k, v = sl.split()
                    if k in keys:
                        out[k] = int(v) / MiB
            return out
        except OSError:
            continue
    return {}


def stage(name: str, t0: float) -> None:
    s, c = _status(), _cgroup()
    parts = " ".join(f"{k} {v:.0f}" for k, v in s.items())
    cg = (" | cgroup " + " ".join(f"{k} {v:.0f}" for k, v in c.items())) if c else ""
    print(f"== {name:<28} {time.perf_counter() - t0:6.1f} s | MiB: {parts}{cg}", flush=True)
    print("JSON " + json.dumps({"stage": name, "status_mib": s, "cgroup_mib": c}), flush=True)


def child(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    stage("start", t0)
    import torch

    from moestream.memcap import parse_size
    from moestream.models.base import LoadOptions, load_model

    stage("imports (torch, moestream)", t0)
    if a.device.startswith("cuda"):
        torch.zeros(1, device=a.device)
        stage("CUDA context", t0)
    opts = LoadOptions(device=a.device, pool=a.pool, mem=parse_size(a.mem) if a.mem else None,
                       host_cache=parse_size(a.host_cache) if a.host_cache else 0,
                       gpu_mem=parse_size(a.gpu_mem) if a.gpu_mem else None, moe_stream=True)
    model = load_model(a.model, opts, n_ctx=a.n + 8)
    stage("loaded", t0)
    from moestream.engine import Engine

    eng = Engine(model)
    ids = [(37 * i + 11) % 1000 for i in range(8)]
    eng.generate(ids, 1, lambda logits: int(torch.argmax(logits)))
    stage("first token (compiles)", t0)
    eng.generate(ids, a.n, lambda logits: int(torch.argmax(logits)))
    stage(f"{a.n} tokens", t0)
    plan = model.memory_plan
    if plan is not None:
        print("plan:", " ".join(f"{k} {getattr(plan, k) / MiB:.0f}" for k in ("process", "dense", "kv", "scratch",
                                                                              "pools", "tier", "budget")
                                if isinstance(getattr(plan, k, None), int)), "MiB", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pool", default="host")
    ap.add_argument("--mem", default=None)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--host-cache", default=None)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--cap", default=None, help="run in a memory cgroup of this size (root)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child or not a.cap:
        return child(a)
    from moestream.memcap import MemCap, parse_cap

    argv = [x for x in sys.argv[1:]]
    i = argv.index("--cap")
    del argv[i:i + 2]
    res = MemCap(parse_cap(a.cap)).run([sys.executable, os.path.abspath(__file__), "--child", *argv])
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr[-4000:])
    print(f"cap {a.cap}: exit {res.returncode}, cgroup peak {res.peak_bytes / MiB:.0f} MiB ({res.peak_source}), "
          f"OOM-killed {res.oom_killed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
