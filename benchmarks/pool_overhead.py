"""The CPU kernels' thread pool: what one job costs the caller beyond its work, by thread count.

A small C driver (compiled here with the system's cc, linked to nothing: the kernel library is opened with dlopen)
runs ``ms_pool_run(n, fn, ctx, n)`` many times with a task of fixed length (a spin of ``--work-ns`` per item,
one item per thread), and prints microseconds per job minus the task's own time. A decode step runs a few hundred
jobs per token (each matmul, attention and norm of a layer), so at 16 threads a few microseconds per job is a few
percent of a 25-30 ms token.

    python benchmarks/pool_overhead.py --threads 1,2,4,8,16 [--jobs 20000] [--work-ns 2000]

Prints one line per thread count: jobs, us per job, overhead us per job (best of 5 rounds).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

DRIVER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef void (*task_fn)(void *ctx, int item);
typedef void (*run_fn)(int, task_fn, void *, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static volatile double sink;
static void task(void *ctx, int item) {
    const double end = now() + *(double *)ctx; double a = item;
    while (now() < end) a += 1.0;
    sink = a;
}
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    run_fn run = (run_fn)dlsym(h, "ms_pool_run");
    int n = atoi(argv[2]), jobs = atoi(argv[3]); double work = atof(argv[4]);
    for (int i = 0; i < 1000; i++) run(n, task, &work, n);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (int i = 0; i < jobs; i++) run(n, task, &work, n);
        double per = (now() - t) / jobs;
        if (per < best) best = per;
    }
    printf("%d %.3f %.3f\n", n, best / 1e3, (best - work) / 1e3);
    return 0;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,16", help="comma-separated thread counts")
    ap.add_argument("--jobs", type=int, default=20000, help="jobs per round (5 rounds, best kept)")
    ap.add_argument("--work-ns", type=float, default=2000.0, help="each item's own time, nanoseconds")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"),
                    help="the moestream source tree whose kernel library to time (default: this checkout's; another "
                         "tree's for an A/B, e.g. a `git archive` of an older commit)")
    a = ap.parse_args()
    sys.path.insert(0, a.src)
    from moestream import kernels

    lib = kernels.load()._name
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "pool_driver"
        src = Path(d) / "pool_driver.c"
        src.write_text(DRIVER)
        subprocess.run(["cc", "-O2", "-o", str(exe), str(src), "-ldl"], check=True)
        print(f"library {lib}; {a.jobs} jobs x 5 rounds, {a.work_ns:.0f} ns per item, one item per thread")
        print("threads  us/job  overhead us/job")
        for n in (int(t) for t in a.threads.split(",")):
            out = subprocess.run([str(exe), lib, str(n), str(a.jobs), str(a.work_ns)], check=True,
                                 capture_output=True, text=True).stdout.split()
            print(f"{int(out[0]):7d}  {float(out[1]):6.2f}  {float(out[2]):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
