"""Where a CUDA prompt chunk goes when the pinned host tier holds every expert (issue 24, item 5): per MoE layer the
host time (router ids to the host, planning, enqueueing copies and launches) and the GPU time of the layer's MoE
(CUDA events around ``MoE.__call__``), then torch.profiler's totals for one chunk: host-to-device copy time and bytes
(the tier rows into scratch or slots) against kernel time.

    MOESTREAM_TIER_PREFILL=copy python benchmarks/tier_prefill_profile.py MODEL.gguf [-p 64] [--gpu-mem 4GiB]
        [--host-cache 16GiB]

Prints one line per configuration: chunk time, pp tok/s, the MoE layers' host and GPU ms (mean per layer), and the
scratch's copies; then the profiler's memcpy and kernel totals and its top 15 operations by CUDA time. The mode
comes from MOESTREAM_TIER_PREFILL (experts/devplan.py: copy, gather, direct, off).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from moestream.budget import parse_mem
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model


def chunk(engine: Engine, n: int, n_ctx: int, seed: int) -> float:
    """Seconds of one prefill of ``n`` tokens (one chunk when ``n`` <= the engine's ubatch), synchronised."""
    model = engine.model
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.n_vocab, (n,), generator=g).tolist()
    cache = model.new_cache(n_ctx)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.prefill(toks, cache)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("--gpu-mem", default="4GiB")
    ap.add_argument("--host-cache", default="16GiB")
    a = ap.parse_args()
    mode = os.environ.get("MOESTREAM_TIER_PREFILL", "copy")
    opts = LoadOptions(device="cuda", gpu_mem=parse_mem(a.gpu_mem, "--gpu-mem"), gpu_mem_source="--gpu-mem",
                       host_cache=parse_mem(a.host_cache, "--host-cache"), direct_io=False, n_ctx=a.p + 8)
    t0 = time.perf_counter()
    model = load_model(a.model, opts, ubatch=max(a.p, 128))
    print(f"load {time.perf_counter() - t0:.1f} s, mode {mode}, device plan {model.store.plan is not None}, "
          f"slots/layer {min(model.store.slots_per_layer().values())}", flush=True)
    engine = Engine(model, max(a.p, 128))
    for seed in (1, 2):  # compile every kernel configuration of the chunk's size
        chunk(engine, a.p, a.p + 8, seed)
    # per MoE layer: host time of MoE.__call__ and GPU time between events around it
    from moestream.experts.moe import MoE

    host: list[float] = []
    evs: list[tuple] = []
    real = MoE.__call__

    def timed(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # what the call's own ids.cpu() waits for anyway: host time below is the host's work
        e0.record()
        h0 = time.perf_counter()
        r = real(self, *args, **kw)
        host.append(time.perf_counter() - h0)
        e1.record()
        evs.append((e0, e1))
        return r

    MoE.__call__ = timed
    sc = getattr(model.store.plan, "prefill", None) if model.store.plan is not None else None
    c0 = (sc.copies, sc.bytes_copied) if sc is not None else (0, 0)
    dt = chunk(engine, a.p, a.p + 8, 3)
    gpu = [e0.elapsed_time(e1) for e0, e1 in evs]
    n = max(len(host), 1)
    copies = f", scratch copies {sc.copies - c0[0]} ({(sc.bytes_copied - c0[1]) / 2**30:.2f} GiB)" if sc else ""
    print(f"== mode {mode}: chunk of {a.p} tokens {dt * 1e3:.1f} ms, pp {a.p / dt:.2f} tok/s (with a sync before "
          f"each MoE layer); MoE layers: host work {sum(host) / n * 1e3:.2f} ms/layer, GPU from the call's start to "
          f"its last kernel {sum(gpu) / n:.2f} ms/layer (max {max(gpu, default=0):.2f}){copies}", flush=True)
    MoE.__call__ = real
    dt = chunk(engine, a.p, a.p + 8, 5)
    print(f"   the same chunk without the syncs: {dt * 1e3:.1f} ms, pp {a.p / dt:.2f} tok/s", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        chunk(engine, a.p, a.p + 8, 4)
    copy_us = kern_us = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:  # CPU ops: their kernels count below
            continue
        if "Memcpy HtoD" in ev.key:
            copy_us += t
        elif "Memcpy" not in ev.key and "Memset" not in ev.key:
            kern_us += t
    print(f"profile: HtoD copies {copy_us / 1e3:.1f} ms, kernels {kern_us / 1e3:.1f} ms (device time summed over "
          f"streams; the chunk without the per-layer syncs took {dt * 1e3:.1f} ms)")
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=48))
            break
        except (KeyError, AttributeError, ValueError):
            continue
    model.store.close()


if __name__ == "__main__":
    main()
