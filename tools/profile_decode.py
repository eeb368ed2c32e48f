"""Profile decode steps: ms per step, and the share of it spent outside the matmuls.

"Matmul" is every call of ``quant.linear``, ``Weight.linear``, the expert FFN (``MoE._expert``, or with the C
kernels ``MoE._fused``, one call per set of experts) and the per-head matmuls (``kernels.linear_heads``: deepseek2's
absorbed attn_k_b / attn_v_b), and in the fast CPU decode step (runtime/fastdecode.py) the same kernels through
``kernels.linear_to``, ``kernels.moe_to`` and ``kernels.linear_heads_to``, nested
calls counted once; everything else in a step (norms, RoPE, attention, routing, the MoE layer's bookkeeping,
the engine's finiteness check) is "outside". The matmul functions are wrapped here, at run time, so the
library is profiled as it is (nothing in it is edited for this).

Two passes over the same decode steps after a prefill of ``-p`` random tokens:

1. time around each step and inside each matmul call (the numbers reported): wall time (perf_counter), or with
   ``--clock thread`` the calling thread's CPU time (thread_time: at ``-t 1`` every kernel runs on that thread, so
   this is the step's whole CPU time, and it holds still on a machine other processes load);
2. torch.profiler over ``--prof-steps`` steps: the aten ops outside the matmul scopes, ranked by self CPU time
   (the profiler adds overhead per op, so only its ranking is used, not its absolute times).

    python tools/profile_decode.py -m /tmp/bench/q30b-8l-q8_0.gguf -p 256 -n 32 -t 2

``--prefill`` times the ``-p`` token prefill itself instead (matmuls and the rest, one per repetition), then lists
the Python functions of one more by own time (cProfile; a C kernel's time counts under the function calling it):

    python tools/profile_decode.py -m q32.gguf -p 128 -r 3 -t 16 --prefill
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moestream import kernels, quant
from moestream.engine import Engine
from moestream.experts import moe as moe_mod
from moestream.models import layers
from moestream.models.base import LoadOptions, load_model

MATMUL_SCOPE = "matmul"
#: the matmuls of the kernels module, wrapped where the tree profiled has them
KERNEL_MATMULS = ("linear_to", "moe_to", "linear_heads", "linear_heads_to")


class MatmulTimer:
    """Wraps the matmul functions: accumulates their wall time (outermost calls only) and, when ``scoped``,
    marks them with a profiler scope named ``matmul``."""

    def __init__(self, clock=time.perf_counter) -> None:  # noqa: ANN001
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0
        self.scoped = False
        self._orig = (quant.linear, layers.Weight.linear, moe_mod.MoE._expert, moe_mod.MoE._fused,
                      *(getattr(kernels, name, None) for name in KERNEL_MATMULS))
        timer = self

        def wrap(fn):  # noqa: ANN001, ANN202
            def inner(*a, **k):  # noqa: ANN002, ANN003, ANN202
                if timer.depth:
                    return fn(*a, **k)
                timer.depth += 1
                t0 = timer.clock()
                try:
                    if timer.scoped:
                        with torch.profiler.record_function(MATMUL_SCOPE):
                            return fn(*a, **k)
                    return fn(*a, **k)
                finally:
                    timer.seconds += timer.clock() - t0
                    timer.calls += 1
                    timer.depth -= 1
            return inner

        quant.linear = wrap(quant.linear)
        layers.Weight.linear = wrap(layers.Weight.linear)
        moe_mod.MoE._expert = wrap(moe_mod.MoE._expert)
        moe_mod.MoE._fused = wrap(moe_mod.MoE._fused)
        for name in KERNEL_MATMULS:  # absent in older trees
            if getattr(kernels, name, None) is not None:
                setattr(kernels, name, wrap(getattr(kernels, name)))

    def restore(self) -> None:
        quant.linear, layers.Weight.linear, moe_mod.MoE._expert, moe_mod.MoE._fused = self._orig[:4]
        for name, fn in zip(KERNEL_MATMULS, self._orig[4:], strict=True):
            if fn is not None:
                setattr(kernels, name, fn)


#: Profiler scopes put around the parts of a step (only in the torch.profiler pass), for the per-part table.
_FAMILIES = ("base", "qwen3moe", "gemma4", "qwen35moe", "deepseek2", "glm4moe", "gpt_oss", "qwen2moe", "olmoe",
             "llama")
PARTS = {
    "moe layer (experts/moe.py, not its matmuls)": [("moestream.experts.moe", "MoE", "__call__")],
    "attention": [(f"moestream.models.{m}", None, f) for m in ("qwen3moe", "gemma4", "qwen35moe")
                  for f in ("attention", "attention_window")] + [("moestream.runtime.step", "Step", "attend")],
    "rope": [("moestream.models.layers", "Rope", "__call__")]  # and the per-call RoPE before it:
            + [(f"moestream.models.{m}", None, f) for m in ("qwen3moe", "gemma4", "qwen35moe")
               for f in ("rope_neox", "rope_neox_inv_freq")],
    "rms_norm": [(f"moestream.models.{m}", None, "rms_norm") for m in _FAMILIES],
    "router (softmax/sigmoid, top-k)": [(f"moestream.models.{m}", None, f) for m in _FAMILIES
                                        for f in ("softmax_topk", "group_topk", "sigmoid_group_topk")],
    "model forward, other": [(f"moestream.models.{m}", c, "forward") for m, c in
                             (("qwen3moe", "Qwen3MoE"), ("gemma4", "Gemma4"), ("qwen35moe", "Qwen35MoE"))]
                            + [("moestream.runtime.runner", "Runner", "run"),
                               ("moestream.runtime.fastdecode", "FastDecode", "step")],
    "engine (finiteness check, step setup)": [("moestream.engine", "Engine", "decode_step")],
}


def scope_parts() -> None:
    """Wrap the functions of :data:`PARTS` in profiler scopes named after their part (those this version of
    moestream does not have are skipped, so the tool also profiles older versions)."""
    import importlib

    for part, targets in PARTS.items():
        for mod_name, cls, attr in targets:
            try:
                owner = importlib.import_module(mod_name)
            except ImportError:  # an older version without that module
                continue
            if cls is not None:
                owner = getattr(owner, cls, None)
            fn = getattr(owner, attr, None)
            if fn is None:
                continue

            def inner(*a, _fn=fn, _part=part, **k):  # noqa: ANN002, ANN003, ANN202
                with torch.profiler.record_function(_part):
                    return _fn(*a, **k)
            setattr(owner, attr, inner)


def outside_parts(prof: torch.profiler.profile) -> dict[str, float]:
    """{part: self CPU microseconds} of the ops outside the matmuls, by the innermost part scope around them.
    A part's own scope counts too: its self time is the Python code of the part between the ops."""
    out: dict[str, float] = {}
    for ev in prof.events():
        if ev.name == MATMUL_SCOPE:
            continue
        p, part = ev.cpu_parent, ev.name if ev.name in PARTS else None
        while p is not None and p.name != MATMUL_SCOPE:
            if part is None and p.name in PARTS:
                part = p.name
            p = p.cpu_parent
        if p is None:
            out[part or "?"] = out.get(part or "?", 0.0) + ev.self_cpu_time_total
    return out


def outside_ops(prof: torch.profiler.profile, by_caller: bool = False) -> dict[str, tuple[float, int]]:
    """{aten op: (self CPU microseconds, calls)} of the events not under a ``matmul`` scope; with
    ``by_caller`` the key is "op < outermost op" (e.g. ``aten::arange < aten::unique_dim``)."""
    out: dict[str, list] = {}
    for ev in prof.events():
        if ev.name == MATMUL_SCOPE or ev.name in PARTS:
            continue
        p, inside, top = ev.cpu_parent, False, None
        while p is not None:
            if p.name == MATMUL_SCOPE:
                inside = True
                break
            top = p
            p = p.cpu_parent
        if inside:
            continue
        key = f"{ev.name} < {top.name}" if by_caller and top is not None and top.name not in PARTS else ev.name
        s = out.setdefault(key, [0.0, 0])
        s[0] += ev.self_cpu_time_total
        s[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=256, help="prefill tokens before the decode steps")
    ap.add_argument("-n", "--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="timed passes of -n steps (fresh cache each)")
    ap.add_argument("--prof-steps", type=int, default=8, help="decode steps under torch.profiler (0: none)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--matmul", default="blocks", help="blocks (the C kernels, default) or dequant")
    ap.add_argument("--stream", action="store_true", help="stream experts through slot pools (default: resident)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall time, or the calling thread's CPU time (meaningful at -t 1; see above)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--by-caller", action="store_true", help="rank ops by (op, outermost op that called it)")
    ap.add_argument("--prefill", action="store_true",
                    help="time the -p token prefill instead (one per repetition, a fresh cache each; -n unused), "
                         "then list the Python functions by own time over one more (cProfile: a kernel call "
                         "counts under the function that makes it)")
    a = ap.parse_args()

    from moestream.options import set_compute_threads
    set_compute_threads(a.threads, a.matmul)  # as run does: the kernels get -t, torch 1 (blocks)
    model = load_model(a.model, LoadOptions(moe_stream=a.stream, matmul=a.matmul))
    engine = Engine(model)
    rng = random.Random(1234)
    n_ctx = a.prompt + a.steps + a.prof_steps + 8
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    timer = MatmulTimer(clock)

    def run(n: int, cache: object, pos: int) -> list[float]:
        per = []
        for i in range(n):
            t0 = clock()
            engine.decode_step(rng.randrange(model.n_vocab), pos + i, cache)
            per.append(clock() - t0)
        return per

    def fresh() -> object:
        cache = model.new_cache(n_ctx)
        engine.prefill([rng.randrange(model.n_vocab) for _ in range(a.prompt)], cache)
        return cache

    if a.prefill:
        prefill(a, model, engine, timer, clock, rng, n_ctx)
        return
    run(4, fresh(), a.prompt)  # warm-up (page cache, allocator)
    steps, mm = [], 0.0
    for _ in range(a.repetitions):
        cache = fresh()
        timer.seconds = 0.0
        per = run(a.steps, cache, a.prompt)
        steps += per
        mm += timer.seconds
    total = sum(steps)
    ms = 1000 * statistics.median(steps)
    print(f"model {a.model}: {model.n_layers} layers, context {a.prompt}..{a.prompt + a.steps}, "
          f"{'streaming' if a.stream else 'resident'}, {a.threads} threads, torch {torch.__version__}, "
          f"{a.clock} clock")
    print(f"decode step: median {ms:.2f} ms, mean {1000 * total / len(steps):.2f} ms over {len(steps)} steps")
    print(f"matmul {1000 * mm / len(steps):.2f} ms/step; outside the matmuls {1000 * (total - mm) / len(steps):.2f} "
          f"ms/step = {100 * (total - mm) / total:.1f}%")
    if a.prof_steps:
        cache = fresh()
        timer.scoped = True
        scope_parts()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(a.prof_steps, cache, a.prompt)
        parts = outside_parts(prof)
        tot = sum(parts.values())
        print(f"outside the matmuls by part, ops and the Python between them (torch.profiler self CPU, "
              f"{a.prof_steps} steps; per step):")
        for name, us in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {name:45s} {us / 1000 / a.prof_steps:8.3f} ms {100 * us / tot:5.1f}%")
        ops = outside_ops(prof, a.by_caller)
        tot = sum(v[0] for v in ops.values())
        print(f"top ops outside the matmuls (torch.profiler self CPU, {a.prof_steps} steps; per step):")
        for name, (us, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"  {name:40s} {us / 1000 / a.prof_steps:8.3f} ms {100 * us / tot:5.1f}%  "
                  f"{calls / a.prof_steps:7.1f} calls")
    timer.restore()
    model.store.close()


def prefill(a: argparse.Namespace, model: object, engine: Engine, timer: MatmulTimer, clock, rng: random.Random,
            n_ctx: int) -> None:  # noqa: ANN001
    """--prefill: ms per -p token prefill (matmuls and the rest), then a cProfile of one more."""
    import cProfile
    import pstats

    def ids() -> list[int]:
        return [rng.randrange(model.n_vocab) for _ in range(a.prompt)]

    engine.prefill(ids(), model.new_cache(n_ctx))  # warm-up
    per, mm = [], []
    for _ in range(a.repetitions):
        cache = model.new_cache(n_ctx)
        timer.seconds = 0.0
        t0 = clock()
        engine.prefill(ids(), cache)
        per.append(clock() - t0)
        mm.append(timer.seconds)
    print(f"model {a.model}: {model.n_layers} layers, prefill of {a.prompt} tokens, "
          f"{'streaming' if a.stream else 'resident'}, {a.threads} threads, {a.clock} clock")
    for t, m in zip(per, mm, strict=True):
        print(f"prefill: {1000 * t:.1f} ms ({a.prompt / t:.1f} tok/s); matmul {1000 * m:.1f} ms; outside the matmuls "
              f"{1000 * (t - m):.1f} ms = {100 * (t - m) / t:.1f}%")
    timer.restore()
    pr = cProfile.Profile()
    cache = model.new_cache(n_ctx)
    tokens = ids()
    pr.enable()
    engine.prefill(tokens, cache)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    model.store.close()


if __name__ == "__main__":
    main()
