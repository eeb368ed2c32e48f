"""The kernels of one CUDA decode step, every expert in VRAM: what runs, how often per token, how long.

    python benchmarks/step_kernels.py MODEL.gguf [-n 16] [--json OUT.json]
    python benchmarks/step_kernels.py MODEL.gguf --gpu-mem 4GiB --host-cache 16GiB [--graphs-only]

Decodes 4 warm-up tokens, then profiles ``-n`` decode steps (torch.profiler, CUPTI): per CUDA kernel its calls
per token, mean µs per call and µs per token, sorted by time; the kernel count and summed kernel time per token
beside the wall time per token (the gap is what the GPU spends idle or between launches). Then the same steps with
CUDA graphs off (eager): the aten operations per token, which say which Python op launches what. The model loads
with ``--moe-stream off`` (every expert in its pools; the whole step is one graph replay). With ``--gpu-mem`` and
``--host-cache`` it streams instead (``--direct-io off``): where the tier holds every expert, the device-planned
step (one graph replay, misses gathered from the pinned tier, promotions on the copy stream between steps); the
report adds the hit rate, the promotions and their bytes per token, and the host's share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from moestream.engine import Engine
from moestream.memcap import parse_size
from moestream.models.base import LoadOptions, load_model


def steps(engine: Engine, cache: object, first: int, n: int) -> float:
    """Decode positions first..first+n-1 -> seconds (synchronised)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for pos in range(first, first + n):
        engine.decode_step((11 * (pos + 1)) % engine.model.n_vocab, pos, cache)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def kernel_table(prof: torch.profiler.profile, n: int, cuda: bool) -> list[dict]:
    """Per kernel (cuda) or per aten op (not cuda): calls per token, µs per call, µs per token."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if cuda != on_gpu:
            continue
        if not cuda and not e.name.startswith("aten::"):
            continue
        r = rows[e.name]
        r[0] += 1
        r[1] += e.device_time if cuda else e.cpu_time
    out = [{"name": k, "per_token": c / n, "us_per_call": t / c, "us_per_token": t / n} for k, (c, t) in rows.items()]
    return sorted(out, key=lambda d: -d["us_per_token"])


def profile(engine: Engine, n: int, first: int = 4) -> tuple[float, torch.profiler.profile]:
    """``n`` decode steps from position ``first`` of a new cache (4 warm-up steps first) under torch.profiler."""
    cache = engine.model.new_cache(first + n + 64)
    steps(engine, cache, 0, first)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        dt = steps(engine, cache, first, n)
    return dt, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--gpu-mem", help="stream the experts with this GPU budget (with --host-cache)")
    ap.add_argument("--host-cache", help="the pinned host tier's size (with --gpu-mem)")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager pass")
    a = ap.parse_args()
    report: dict = {"model": os.path.basename(a.model)}
    stream = a.gpu_mem is not None
    if stream:
        opts = dict(moe_stream=True, device="cuda", gpu_mem=parse_size(a.gpu_mem), direct_io=False,
                    host_cache=parse_size(a.host_cache) if a.host_cache else 0)
    else:
        opts = dict(moe_stream=False, device="cuda")
    for label, graphs in (("graphs", "1"), ("eager", "0"))[:1 if a.graphs_only else 2]:
        os.environ["MOESTREAM_CUDA_GRAPHS"] = graphs
        model = load_model(a.model, LoadOptions(**opts))
        engine = Engine(model)
        cache = model.new_cache(64 + 2 * a.n)
        steps(engine, cache, 0, 4)
        st, plan = model.store.stats, getattr(model.store, "plan", None)
        h0, m0, p0, b0 = st.hits, st.misses, getattr(plan, "promotions", 0), getattr(plan, "bytes_promoted", 0)
        c0 = time.process_time()
        wall = steps(engine, cache, 4, a.n) / a.n  # unprofiled
        host = (time.process_time() - c0) / a.n
        if stream:
            if plan is not None:
                plan.flush()  # the last step's ids counted
            hits, misses = st.hits - h0, st.misses - m0
            promo = (getattr(plan, "promotions", 0) - p0) / a.n
            mib = (getattr(plan, "bytes_promoted", 0) - b0) / a.n / 2**20
            print(f"== {label}, streaming ({'device-planned' if plan is not None else 'segmented'}): hit rate "
                  f"{hits / max(hits + misses, 1):.1%}, {misses / a.n:.1f} misses, {promo:.1f} promotions "
                  f"({mib:.1f} MiB) per token; host CPU {host * 1e3:.3f} ms per token", flush=True)
        _, prof = profile(engine, a.n, first=4 + a.n)
        kern = kernel_table(prof, a.n, cuda=True)
        k_calls = sum(r["per_token"] for r in kern)
        k_us = sum(r["us_per_token"] for r in kern)
        print(f"== {label}: wall {wall * 1e3:.3f} ms/token ({1 / wall:.2f} tok/s); kernels {k_calls:.0f} per token, "
              f"{k_us / 1e3:.3f} ms of kernel time per token", flush=True)
        print(f"{'us/token':>9} {'calls':>6} {'us/call':>8}  kernel")
        for r in kern[:40]:
            print(f"{r['us_per_token']:9.1f} {r['per_token']:6.1f} {r['us_per_call']:8.2f}  {r['name'][:150]}")
        entry = {"wall_ms": wall * 1e3, "kernels_per_token": k_calls, "kernel_ms": k_us / 1e3, "kernels": kern,
                 "host_cpu_ms": host * 1e3}
        if stream:
            entry.update(hit_rate=hits / max(hits + misses, 1), misses_per_token=misses / a.n,
                         promotions_per_token=promo, promoted_mib_per_token=mib)
        if label == "eager":
            ops = kernel_table(prof, a.n, cuda=False)
            print(f"{'calls':>6}  aten op (eager, per token)")
            for r in sorted(ops, key=lambda d: -d["per_token"])[:40]:
                print(f"{r['per_token']:6.1f}  {r['name']}")
            entry["aten"] = ops
        report[label] = entry
        model.store.close()
        del model, engine
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
