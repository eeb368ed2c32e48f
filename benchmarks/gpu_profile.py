"""Where a CUDA decode step goes: tok/s and torch.profiler's top operations for one model, every expert in GPU
memory (the upper bound), then streaming through a small VRAM budget.

    python benchmarks/gpu_profile.py MODEL.gguf [--gpu-mem 2GiB] [-n 32] [--direct-io on|off] [--streaming-only]
        [--cprofile 40]

Prints, per configuration, decode tok/s over ``-n`` steps (after 4 warm-up steps) and the 25 operations with the
most self CPU time (Python dispatch and launches: what bounds a small-batch decode) and CUDA time. With
``--cprofile N``, the streaming configuration's steps also run once under cProfile: the N Python functions with the
most own time and the N with the most cumulative time (where the host path of a segmented step goes; cProfile's
overhead inflates every Python call, so only its ranking is read). ``--direct-io on`` reads the experts past the
page cache (the IO of a capped row without the cap: nothing is cached between reads).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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
    ap.add_argument("--direct-io", choices=("on", "off", "auto"), default="auto")
    ap.add_argument("--streaming-only", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    a = ap.parse_args()
    gm = parse_mem(a.gpu_mem, "--gpu-mem")
    dio = {"on": True, "off": False, "auto": None}[a.direct_io]
    configs = [] if a.streaming_only else [("every expert in VRAM", LoadOptions(moe_stream=False, device="cuda"))]
    configs.append((f"streaming --gpu-mem {a.gpu_mem} --direct-io {a.direct_io}",
                    LoadOptions(device="cuda", gpu_mem=gm, n_ctx=a.n + 48, direct_io=dio,
                                gpu_mem_source=f"--gpu-mem {a.gpu_mem}")))
    for label, opts in configs:
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
        if a.cprofile and opts.moe_stream:
            pr = cProfile.Profile()
            pr.enable()
            decode(engine, 16, a.n + 8)
            pr.disable()
            for key in ("tottime", "cumulative"):
                pstats.Stats(pr).sort_stats(key).print_stats(a.cprofile)
        model.store.close()
        del model, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
