"""GPU A/B of the decode (GEMV, m_hint <= 8) matmuls of gpu/tkernels.py: the old path (``_matmul_kernel``'s GEMV
branch, byte loads) against ``_gemv_kernel`` (vector loads, per-lane accumulators), on the shapes of the bench
models, for Q4_K, Q6_K, Q4_0 and Q8_0.

    PYTHONPATH=src python3 benchmarks/gemv_ab.py --json OUT.json [--m 1] [--all] [--jobs 8]

Shapes: Qwen3-30B-A3B (hidden 2048; 8 of 128 experts, expert ffn 768, grouped: gate/up [768, 2048] and down
[2048, 768]; attention q [4096, 2048], k/v [512, 2048], o [2048, 4096]; LM head [151936, 2048] Q6_K) and
Gemma-4 26B-A4B (hidden 2816; 8 of 128 experts, expert ffn 704: gate/up [704, 2816], down [2816, 704], the latter
for the 32-blocks only, 704 not being a multiple of 256). Without ``--all`` the types run are those the bench
files use there (Q4_K_M: Q4_K and Q6_K; Gemma: Q4_0 and Q8_0); with it every type on every shape it fits.

Weights are random ggml blocks with finite fp16 scales (one pool of 128 experts for the grouped cases, the 8
used ones spread over it). Each path's call is captured ``--reps`` times in a CUDA graph (no host launch cost in
the timing), replayed after warm-up, timed with CUDA events; the median of ``--n`` replays gives us per call.
GB/s: the weight bytes one call reads / time. Kernels are compiled first in ``--jobs`` worker processes (Triton's
disk cache), so the run stays well under a minute on an H200.

Checks, per case: the new path with wide loads is bitwise equal to the new path forced to byte loads
(``align=1``: what an unaligned matrix gets); old vs new: not bitwise (the new path sums in another fixed order),
the max |new - old| relative to max |old| is printed. Exit status 1 if a wide/byte check fails.
``MOESTREAM_GEMV_WIDE=0`` in the environment makes the whole engine take the old path (for model-level A/B).
``--old ks1``: the baseline is ``_gemv_kernel`` with one 256-chunk per lane step (``MOESTREAM_GEMV_KSPLIT=1``, the
kernel before the K split) instead of the matmul kernel's GEMV branch. ``--old gemv1``: the baseline is
``_gemv_kernel`` as it is (K split "auto") and the new path ``_gemv2_kernel`` for every type here (Q4_K, Q6_K, Q4_0,
Q8_0: ``tkernels.GEMV2_TYPES``, ``MOESTREAM_GEMV2``; a type outside them would run the same kernel on both sides).
Its lanes per block come from the environment of the run: ``MOESTREAM_GEMV2_LPB`` (Q4_K, Q6_K: 8 or 4) and
``MOESTREAM_GEMV2_LPB32`` (Q4_0, Q8_0: 1, 2 or 4), read by the compile workers too.

``--check``: the new path's output against the float64 product of the exactly decoded weights (tkernels.dequantize,
bit-identical to moestream.quant) on up to 2048 rows per matrix: every |new - ref| within the float32 bound
``gamma_K * sum |x| |w|`` (the bound of tests/test_tkernels.py); the worst ratio err / bound is printed (exit 1 if
above 1). With ``--old gemv1`` the wide == byte check also runs the matrix at 2 mod 4 (16-bit loads of Q6_K, Q4_0 and
Q8_0; byte loads for Q4_K, whose words are 32-bit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from moestream.gpu import tkernels

#: (model, matrix, rows, cols, groups of the grouped launch (0: linear), types of the bench file)
SHAPES = [
    ("qwen3-30b-a3b", "expert gate/up", 768, 2048, 8, (T.Q4_K,)),
    ("qwen3-30b-a3b", "expert gate+up", 768, 2048, 16, (T.Q4_K,)),  # both in one launch (MoE.resident_step)
    ("qwen3-30b-a3b", "expert down", 2048, 768, 8, (T.Q4_K, T.Q6_K)),
    ("qwen3-30b-a3b", "attn q", 4096, 2048, 0, (T.Q4_K,)),
    ("qwen3-30b-a3b", "attn k/v", 512, 2048, 0, (T.Q4_K, T.Q6_K)),
    ("qwen3-30b-a3b", "attn o", 2048, 4096, 0, (T.Q4_K,)),
    ("qwen3-30b-a3b", "lm head", 151936, 2048, 0, (T.Q6_K,)),
    ("gemma4-26b-a4b", "expert gate/up", 704, 2816, 8, (T.Q4_0,)),
    ("gemma4-26b-a4b", "expert down", 2816, 704, 8, (T.Q4_0,)),
    ("gemma4-26b-a4b", "attn (2816)", 2816, 2816, 0, (T.Q8_0,)),
]
TYPES = (T.Q4_K, T.Q6_K, T.Q4_0, T.Q8_0)
N_EXPERTS = 128
#: byte offsets of the fp16 scale fields in a block, per type
F16_FIELDS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q4_0: (0,), T.Q8_0: (0,)}


def cases(all_types: bool, m: int) -> list[dict]:
    out = []
    for model, name, rows, cols, groups, types in SHAPES:
        for t in (TYPES if all_types else types):
            if name == "lm head" and t != T.Q6_K:
                continue
            if cols % GGML_QUANT_SIZES[t][0]:
                continue
            out.append(dict(model=model, matrix=name, type=t.name, rows=rows, cols=cols, groups=groups, m=m))
    return out


def random_blocks(t: T, n_blocks: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """uint8 [n_blocks * type_size]: random bytes, each fp16 scale field a finite value in [2**-10, 2**-6)."""
    size = GGML_QUANT_SIZES[t][1]
    raw = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, device=dev, generator=gen)
    for f in F16_FIELDS[t]:
        h = (torch.rand(n_blocks, device=dev, generator=gen) * 0.015 + 2.0 ** -10).to(torch.float16)
        raw[:, f:f + 2] = h.view(torch.uint8).view(n_blocks, 2)
    return raw.reshape(-1)


def setup(c: dict, dev: torch.device) -> dict:
    """Inputs of one case: x, the weight bytes (a pool of 128 experts for the grouped cases) and the calls."""
    t = T[c["type"]]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    rows, cols, groups, m = c["rows"], c["cols"], c["groups"], c["m"]
    block, size = GGML_QUANT_SIZES[t]
    nb = cols // block * size
    x = torch.randn(m, cols, device=dev, generator=gen)
    if groups == 0:
        raw = random_blocks(t, rows * cols // block, gen, dev).view(rows, nb)

        # the byte variant: the same matrix one byte past a 16-byte boundary (linear() then loads single bytes)
        odd = torch.empty(rows * nb + 1, dtype=torch.uint8, device=dev)[1:].view(rows, nb)
        odd.copy_(raw)

        two = torch.empty(rows * nb + 2, dtype=torch.uint8, device=dev)[2:].view(rows, nb)
        two.copy_(raw)

        def call(align: int) -> torch.Tensor:
            return tkernels.linear(x, {16: raw, 2: two}.get(align, odd), t, cols, m_hint=m)

        return dict(call=call, bytes=rows * nb, x=x, mats=[raw], m=m)
    pool = random_blocks(t, N_EXPERTS * rows * cols // block, gen, dev)
    experts = np.sort(np.random.default_rng(7).choice(N_EXPERTS, groups, replace=False))
    offsets = torch.from_numpy(experts * rows * nb).to(dev)
    # m tokens, each routed to every one of the groups (a decode step's pairs: one per (token, expert))
    starts = np.arange(groups + 1) * m
    tiles = torch.from_numpy(tkernels.plan_tiles(starts, m)).to(dev)
    src = torch.from_numpy(np.tile(np.arange(m, dtype=np.int32), groups)).to(dev)
    out = torch.empty((groups * m, rows), device=dev)

    def call(align: int) -> torch.Tensor:
        return tkernels.grouped_planned(x, pool, offsets, tiles, src, t, rows, cols, m, torch.empty_like(out),
                                        align=tkernels.alignment(experts * rows * nb) if align == 16 else align)

    mats = [pool[int(o):int(o) + rows * nb].view(rows, nb) for o in experts * rows * nb]
    return dict(call=call, bytes=groups * rows * nb, x=x, mats=mats, m=m)


def bound_ratio(c: dict, s: dict, y: torch.Tensor) -> float:
    """max over up to 2048 rows per matrix of |y - ref| / (gamma_K sum |x| |w|) (float64 on the device; <= 1: within
    the float32 bound of any summation order). ``y``: [groups * m, rows] (grouped: group-major) or [m, rows]."""
    t = T[c["type"]]
    k = c["cols"]
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    x = s["x"].double()
    worst = 0.0
    for gi, raw in enumerate(s["mats"]):
        sel = torch.linspace(0, raw.shape[0] - 1, min(2048, raw.shape[0]), device=raw.device).long()
        w = tkernels.dequantize(raw[sel], t, k).double()
        ref = x @ w.T
        bound = gamma * (x.abs() @ w.abs().T)
        got = y[gi * s["m"]:(gi + 1) * s["m"]][:, sel].double()
        worst = max(worst, ((got - ref).abs() / bound.clamp_min(1e-300)).max().item())
    return worst


def use(old: bool, kind: str) -> None:
    """Select the baseline (``old``: the matmul kernel's GEMV branch, or with kind "ks1" _gemv_kernel without the
    K split) or the current path."""
    tkernels.GEMV_WIDE = not old or kind in ("ks1", "gemv1")
    tkernels.GEMV_KSPLIT = "1" if old and kind == "ks1" else "auto"
    tkernels.GEMV2 = "0" if old or kind != "gemv1" else "all"
    # Q4_0 / Q8_0: the baseline is _gemv_kernel, the new path _gemv32_kernel (MOESTREAM_GEMV32; or _gemv2_kernel's
    # lanes with MOESTREAM_GEMV2_B32=1)
    tkernels.GEMV32 = not old and os.environ.get("MOESTREAM_GEMV32", "1") != "0"


def warm(c: dict) -> float:
    """Worker: compile (into Triton's disk cache) the kernels of case ``c``; returns the seconds it took."""
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    s = setup(c, dev)
    for old in (True, False):
        use(old, c["old"])
        s["call"](16)
        if not old:
            s["call"](1)
            s["call"](2)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_call(fn, reps: int, n: int) -> float:
    """Median microseconds per call: ``reps`` calls in a CUDA graph, ``n`` timed replays after 3 warm-ups."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm (allocator, kernels) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--m", type=int, default=1, help="tokens (m_hint), 1..8")
    ap.add_argument("--all", action="store_true", help="every type on every shape it fits")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile workers")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--old", choices=("matmul", "ks1", "gemv1"), default="gemv1", help="the baseline (see above)")
    ap.add_argument("--check", action="store_true", help="the new path within the float64 bound (see above)")
    ap.add_argument("--only", default="", help="run only the matrices whose name contains this (e.g. 'lm head')")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemv_ab: needs CUDA", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cs = [dict(c, old=a.old) for c in cases(a.all, a.m) if a.only in c["matrix"]]
    if a.jobs > 1:
        import multiprocessing as mp
        with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as ex:
            warm_s = list(ex.map(warm, cs))
        print(f"compiled in {time.perf_counter() - t_start:.1f} s (worker seconds {sum(warm_s):.1f})")
    dev = torch.device("cuda")
    rows_out, ok = [], True
    head = (f"{'model':16} {'matrix':15} {'type':5} {'rows x cols':>14} {'G':>2} {'old us':>8} {'new us':>8} "
            f"{'old GB/s':>8} {'new GB/s':>8} {'speedup':>7}  wide==byte  |new-old|/max|old|  err/bound  new")
    print(head)
    for c in cs:
        s = setup(c, dev)
        use(True, a.old)
        y_old = s["call"](16).clone()
        t_old = time_call(lambda f=s["call"]: f(16), a.reps, a.n)
        use(False, a.old)
        y_new = s["call"](16).clone()
        y_byte = s["call"](1).clone()
        y_two = s["call"](2).clone()
        t_new = time_call(lambda f=s["call"]: f(16), a.reps, a.n)
        same = bool(torch.equal(y_new.view(torch.int32), y_byte.view(torch.int32))
                    and torch.equal(y_new.view(torch.int32), y_two.view(torch.int32)))
        ok &= same
        ratio = bound_ratio(c, s, y_new) if a.check else float("nan")
        ok &= not ratio > 1.0
        rel = ((y_new - y_old).abs().max() / y_old.abs().max().clamp_min(1e-30)).item()
        r = dict(c, old_us=t_old, new_us=t_new, old_gbs=s["bytes"] / t_old / 1e3, new_gbs=s["bytes"] / t_new / 1e3,
                 speedup=t_old / t_new, wide_equals_byte=same, old_equals_new=bool(torch.equal(y_new, y_old)),
                 rel_diff=rel, weight_bytes=s["bytes"], err_over_bound=ratio,
                 new_kernel="gemv2" if a.old == "gemv1" and tkernels.gemv2_uses(int(T[c["type"]]), c["groups"] > 0)
                 else "gemv32" if tkernels.gemv32_uses(int(T[c["type"]]), c["groups"] > 0)
                 else "same" if a.old == "gemv1" else "gemv")
        rows_out.append(r)
        print(f"{c['model']:16} {c['matrix']:15} {c['type']:5} {c['rows']:>7}x{c['cols']:<6} {c['groups']:>2} "
              f"{t_old:8.2f} {t_new:8.2f} {r['old_gbs']:8.0f} {r['new_gbs']:8.0f} {r['speedup']:7.2f}  "
              f"{str(same):10}  {rel:.2e}  {ratio:.3f}  {r['new_kernel']}")
        del s
        torch.cuda.empty_cache()
    tkernels.GEMV_WIDE = os.environ.get("MOESTREAM_GEMV_WIDE", "1") != "0"
    tkernels.GEMV2 = os.environ.get("MOESTREAM_GEMV2", "all")
    tkernels.GEMV32 = os.environ.get("MOESTREAM_GEMV32", "1") != "0"
    total = time.perf_counter() - t_start
    meta = dict(device=torch.cuda.get_device_name(), m=a.m, reps=a.reps, n=a.n, seconds=total,
                triton=__import__("triton").__version__, torch=torch.__version__, all_wide_equal_byte=ok, check=a.check,
                old=a.old)
    with open(a.json, "w") as f:
        json.dump(dict(meta=meta, cases=rows_out), f, indent=1)
    print(f"{len(rows_out)} cases in {total:.1f} s; wide == byte (and within the bound with --check) everywhere: "
          f"{ok}; wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
