"""What ``--trace`` costs: the same generation with and without it, interleaved, and the decode tok/s ratio.

    PYTHONPATH=src python benchmarks/trace_overhead.py [--pairs 10] [-n 128] [-m MODEL] [-- extra run options]

Each pair runs ``moestream run -n N --temp 0 -s 1 -p PROMPT`` twice in this process (``moestream.cli.main``),
once with ``--trace`` to a temporary file and once without, in alternating order (ABBA: the first pair traced
first, the next untraced first, ...) so that a drift of the machine's speed falls on both alike. The decode
tok/s of each run is read from its statistics line on stderr. Printed: every run, the median decode tok/s of
each side, the median of the per-pair ratios traced / untraced, and the overhead (1 - that ratio); and the ratio
of each side's best run (the least disturbed by other jobs). Greedy
with a fixed seed: both sides generate the same tokens (checked).

On a busy machine the end-to-end ratio is noisier than the cost it looks for, so the traced runs also time the
writer itself: every ``TraceWriter.token`` call and the stream decoder's ``push`` that gives it the token's text
(``time.perf_counter`` around each), i.e. what tracing adds on the thread that generates. Printed as microseconds
per record and as a share of the untraced runs' median time per decoded token: the overhead the compute thread
pays, free of the machine's noise. (The NVML sampler thread of a CUDA run is not in it: it runs beside the
generation every 20 ms; here there is no GPU.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time

from moestream import runtrace
from moestream.cli import main
from moestream.tokenizer import StreamDecoder

DECODE = re.compile(r"decode (\d+) tok, ([0-9.]+) tok/s")


def one(run_args: list[str], trace: str | None) -> tuple[float, str]:
    """(decode tok/s, stdout) of one run."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*run_args, *(["--trace", trace] if trace else [])])
    if rc != 0:
        sys.exit(f"trace_overhead: run failed: {err.getvalue().strip().splitlines()[-1]}")
    m = DECODE.search(err.getvalue())
    return float(m.group(2)), out.getvalue()


SPENT = [0.0, 0, 0.0]  # wall seconds inside the writer's per-token work, records, thread CPU seconds of it


def _timed(fn):  # noqa: ANN001, ANN202
    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            SPENT[0] += time.perf_counter() - t0
            SPENT[2] += time.thread_time() - c0
    return wrapper


def measure(pairs: int, run_args: list[str], label: str) -> float:
    tps = {True: [], False: []}
    ratios = []
    token, push = runtrace.TraceWriter.token, StreamDecoder.push
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.jsonl")
        one(run_args, None)  # warm-up: kernels compiled, file in the page cache
        ref = None
        for k in range(pairs):
            got = {}
            for traced in ((True, False) if k % 2 == 0 else (False, True)):
                if traced:  # time the writer's own work (the decoder's push of the untraced run is the printer's)
                    runtrace.TraceWriter.token = _timed(token)
                    StreamDecoder.push = _timed(push)
                try:
                    got[traced], text = one(run_args, path if traced else None)
                finally:
                    runtrace.TraceWriter.token, StreamDecoder.push = token, push
                if traced:
                    SPENT[1] += len(open(path).read().splitlines()) - 2  # less the header and the end line
                ref = ref or text
                assert text == ref, "the traced and untraced runs generated different text"
                tps[traced].append(got[traced])
            ratios.append(got[True] / got[False])
            print(f"{label} pair {k + 1}: untraced {got[False]:.2f} tok/s, traced {got[True]:.2f} tok/s, ratio "
                  f"{ratios[-1]:.4f}", flush=True)
    r = statistics.median(ratios)
    print(f"{label}: median decode untraced {statistics.median(tps[False]):.2f} tok/s, traced "
          f"{statistics.median(tps[True]):.2f} tok/s; median ratio traced/untraced {r:.4f} (overhead "
          f"{100 * (1 - r):.2f}%), mean ratio {statistics.mean(ratios):.4f} over {pairs} pairs", flush=True)
    best = max(tps[True]) / max(tps[False])  # the least disturbed run of each side
    print(f"{label}: best decode untraced {max(tps[False]):.2f} tok/s, traced {max(tps[True]):.2f} tok/s; ratio "
          f"{best:.4f} (overhead {100 * (1 - best):.2f}%)", flush=True)
    # the traced runs' pushes include the printer's own (both decoders push every token): half of them are the
    # writer's; the token() calls are all the writer's
    per, cpu = SPENT[0] / max(SPENT[1], 1), SPENT[2] / max(SPENT[1], 1)
    tok_s = 1 / statistics.median(tps[False])
    print(f"{label}: the writer's own work per record (token() + the stream decoder's push, both decoders' pushes "
          f"counted: an upper bound): {1e6 * cpu:.1f} us of the thread's CPU time = {100 * cpu / tok_s:.2f}% of the "
          f"untraced median {1e3 * tok_s:.2f} ms per decoded token; {1e6 * per:.1f} us of wall time "
          f"({100 * per / tok_s:.2f}%; wall time includes the thread's preemptions by other jobs)", flush=True)
    SPENT[:] = [0.0, 0, 0.0]
    return r


def cli() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-p", "--prompt", default="The history of the printing press")
    ap.add_argument("extra", nargs="*", help="more run options (after --), e.g. -- --slots 8")
    a = ap.parse_args()
    run_args = ["run", "-n", str(a.n), "--temp", "0", "-s", "1", "-p", a.prompt, *a.extra]
    if a.model:
        run_args += ["-m", a.model]
    print(f"trace_overhead: {' '.join(run_args)}, {a.pairs} interleaved pairs, {os.cpu_count()} CPUs", flush=True)
    measure(a.pairs, run_args, " ".join(a.extra) or "default options")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
