"""Where a CUDA decode step goes: tok/s and torch.profiler's top operations for one model, every expert in GPU
memory (the upper bound), then streaming through a small VRAM budget.

    python benchmarks/gpu_profile.py MODEL.gguf [--gpu-mem 2GiB] [-n 32]

Prints, per configuration, decode tok/s over ``-n`` steps (after 4 warm-up steps) and the 25 operations with the
most self CPU time (Python dispatch and launches: what bounds a small-batch decode) and CUDA time.
"""

from __future__ import annotations

import argparse
import time

import torch

from moestream.budget import parse_mem
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model


def decode(engine: Engine, n: int, n_ctx: int, start_tok: int = 11) -> float:
    model = engine.model
    cache = model.new_cache(n_ctx)  # one size for every call: the same memory, so the decode graphs stay valid
    for pos in range(4):
        engine.decode_step(start_tok + pos, pos, cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for pos in range(4, 4 + n):
        engine.decode_step((start_tok * pos) % model.n_vocab, pos, cache)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gpu-mem", default="2GiB")
    ap.add_argument("-n", type=int, default=32)
    a = ap.parse_args()
    gm = parse_mem(a.gpu_mem, "--gpu-mem")
    for label, opts in (("every expert in VRAM", LoadOptions(moe_stream=False, device="cuda")),
                        (f"streaming --gpu-mem {a.gpu_mem}", LoadOptions(device="cuda", gpu_mem=gm, n_ctx=64,
                                                                         gpu_mem_source=f"--gpu-mem {a.gpu_mem}"))):
        t0 = time.perf_counter()
        model = load_model(a.model, opts)
        load = time.perf_counter() - t0
        engine = Engine(model)
        tps = decode(engine, a.n, a.n + 8)
        st = model.store.stats
        g = model.runner.graphs
        graphs = "" if g is None else (f", graphs: {g.captures} captures, {g.replays} replays"
                                       f" ({g.segment_replays} segments), off: {g.off_reason}")
        print(f"== {label}: load {load:.1f} s, decode {tps:.2f} tok/s, hit rate {st.hit_rate:.1%}, "
              f"stall {st.stall_seconds:.2f} s, pools {getattr(model.store, 'pool_bytes', 0) / 2**30:.2f} GiB{graphs}",
              flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode(engine, 8, a.n + 8)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48))
        model.store.close()
        del model, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
