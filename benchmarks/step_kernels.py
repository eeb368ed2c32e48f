"""The kernels of one CUDA decode step, every expert in VRAM: what runs, how often per token, how long.

    python benchmarks/step_kernels.py MODEL.gguf [-n 16] [--json OUT.json]

Decodes 4 warm-up tokens, then profiles ``-n`` decode steps (torch.profiler, CUPTI): per CUDA kernel its calls
per token, mean µs per call and µs per token, sorted by time; the kernel count and summed kernel time per token
beside the wall time per token (the gap is what the GPU spends idle or between launches). Then the same steps with
CUDA graphs off (eager): the aten operations per token, which say which Python op launches what. The model loads
with ``--moe-stream off`` (every expert in its pools; the whole step is one graph replay).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from moestream.engine import Engine
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


def profile(engine: Engine, n: int) -> tuple[float, torch.profiler.profile]:
    cache = engine.model.new_cache(64 + n)
    steps(engine, cache, 0, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        dt = steps(engine, cache, 4, n)
    return dt, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    report: dict = {"model": os.path.basename(a.model)}
    for label, graphs in (("graphs", "1"), ("eager", "0")):
        os.environ["MOESTREAM_CUDA_GRAPHS"] = graphs
        model = load_model(a.model, LoadOptions(moe_stream=False, device="cuda"))
        engine = Engine(model)
        cache = model.new_cache(64 + a.n)
        steps(engine, cache, 0, 4)
        wall = steps(engine, cache, 4, a.n) / a.n  # unprofiled
        _, prof = profile(engine, a.n)
        kern = kernel_table(prof, a.n, cuda=True)
        k_calls = sum(r["per_token"] for r in kern)
        k_us = sum(r["us_per_token"] for r in kern)
        print(f"== {label}: wall {wall * 1e3:.3f} ms/token ({1 / wall:.2f} tok/s); kernels {k_calls:.0f} per token, "
              f"{k_us / 1e3:.3f} ms of kernel time per token", flush=True)
        print(f"{'us/token':>9} {'calls':>6} {'us/call':>8}  kernel")
        for r in kern[:40]:
            print(f"{r['us_per_token']:9.1f} {r['per_token']:6.1f} {r['us_per_call']:8.2f}  {r['name'][:150]}")
        entry = {"wall_ms": wall * 1e3, "kernels_per_token": k_calls, "kernel_ms": k_us / 1e3, "kernels": kern}
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
