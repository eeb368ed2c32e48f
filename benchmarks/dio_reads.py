"""Random expert-sized reads through moestream's ExpertReader: O_DIRECT vs buffered (cold and warm page cache).

    PYTHONPATH=src python benchmarks/dio_reads.py FILE [--size BYTES] [--reads N] [--threads T]

Reads N ranges of SIZE bytes at random 32-byte-aligned offsets (as GGUF experts are), T at a time, each into
its own slot-like buffer: O_DIRECT (the aligned range that covers the expert, as StreamingStore reads it),
buffered after evicting the file from the page cache (posix_fadvise DONTNEED: cold), and buffered again over
the same offsets (warm: served by the page cache). Prints MB/s and reads/s; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

from moestream.experts.reader import ExpertReader, ReadJob, dio_alignment


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(path: str, offsets: list[int], size: int, threads: int, direct: bool, align: int) -> tuple[float, int]:
    """(seconds, bytes read) of one pass: batches of ``threads`` reads, joined together (as one MoE layer's
    misses are)."""
    stride = -(-(size + align) // align) * align
    raw = np.empty(threads * stride + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    bufs = [memoryview(raw[skip + i * stride: skip + (i + 1) * stride]) for i in range(threads)]
    r = ExpertReader(threads)
    r.open(path, direct=direct)
    t0 = time.perf_counter()
    for i in range(0, len(offsets), threads):
        jobs = []
        for j, off in enumerate(offsets[i:i + threads]):
            if direct:
                lead = off % align
                end = -(-(lead + size) // align) * align
                jobs.append(ReadJob(path, off - lead, bufs[j][:end], lead, size, True))
            else:
                jobs.append(ReadJob(path, off, bufs[j][:size]))
        r.wait(r.submit(jobs))
    secs = time.perf_counter() - t0
    n = r.bytes_read
    r.close()
    return secs, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--size", type=int, default=884736, help="bytes per read (default: a Qwen3-30B-A3B Q4_K "
                    "expert matrix, 768 x 2048)")
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    fsize = os.path.getsize(a.file)
    rng = random.Random(0)
    offsets = [rng.randrange(0, fsize - a.size) // 32 * 32 for _ in range(a.reads)]
    align = dio_alignment(a.file)
    print(f"{a.file}: {fsize / 2**20:.0f} MiB, {a.reads} reads of {a.size} bytes, {a.threads} threads, O_DIRECT "
          f"alignment {align}")
    rows = []
    if align:
        evict(a.file)
        rows.append(("O_DIRECT", *run(a.file, offsets, a.size, a.threads, True, align)))
    evict(a.file)
    rows.append(("buffered, cold", *run(a.file, offsets, a.size, a.threads, False, 4096)))
    rows.append(("buffered, warm", *run(a.file, offsets, a.size, a.threads, False, 4096)))
    for name, secs, n in rows:
        print(f"  {name:15s} {n / secs / 1e6:8.0f} MB/s  {a.reads / secs:8.0f} reads/s  ({n / a.reads / 1024:.0f} "
              f"KiB read per expert)")


if __name__ == "__main__":
    main()
