#!/usr/bin/env python3
"""Markdown rows from tools/serve_load.py's JSON files (as benchmarks/serve_targets.sh names them).

    python benchmarks/serve_tables.py DIR [DIR ...] [--disk-mbps MB/S]

One row per file, in the order the runs were made (their file times): server, clients, aggregate tok/s, TTFT
p50/p95, per-request decode tok/s (median), the 1-minute load average at start and end, and for moestream's runs
(``--metrics``) the steady decode of the batch: tok/s, MiB of experts read per generated token, hit rate, and the
IO limit (``--disk-mbps`` / bytes per token). Then, per server, the ratio of each client count's mean aggregate
tok/s to one client's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict

NAME = re.compile(r"^(?P<server>.+)-c(?P<clients>\d+)-r(?P<rep>\d+)\.json$")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--disk-mbps", type=float, default=None, help="O_DIRECT read bandwidth, MB/s (10**6 bytes)")
    a = ap.parse_args(argv)
    files = []
    for d in a.dirs:
        for f in os.listdir(d):
            m = NAME.match(f)
            if m:
                p = os.path.join(d, f)
                files.append((os.path.getmtime(p), p, m["server"], int(m["clients"])))
    files.sort()
    print("| server | clients | aggregate tok/s | TTFT p50 / p95 s | per-request decode tok/s | load avg start-end "
          "| steady decode tok/s | MiB read per token | hit rate | IO limit tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    agg: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _, p, server, clients in files:
        with open(p, encoding="utf-8") as fh:
            s = json.load(fh)["summary"]
        agg[server][clients].append(s["aggregate_tps"])
        sd = (s.get("metrics") or {}).get("steady_decode") or {}
        bpt = sd.get("bytes_per_token")
        steady = (f"{sd['tokens_per_second']:.2f} | {bpt / 2**20:.1f} | {100 * sd['hit_rate']:.1f}% | "
                  + (f"{a.disk_mbps * 1e6 / bpt:.0f}" if a.disk_mbps and bpt else "-")) if bpt is not None \
            else "- | - | - | -"
        load = (f"{s['loadavg_1min_start']:.1f}-{s['loadavg_1min_end']:.1f}" if "loadavg_1min_start" in s else "-")
        print(f"| {server} | {clients} | {s['aggregate_tps']:.2f} | {s['ttft_p50']:.2f} / {s['ttft_p95']:.2f} | "
              f"{s['decode_tps_median']:.2f} | {load} | {steady} |")
    print()
    for server, by in agg.items():
        if 1 not in by:
            continue
        one = statistics.mean(by[1])
        parts = [f"{c} clients {statistics.mean(v) / one:.2f}x" for c, v in sorted(by.items()) if c != 1]
        print(f"{server}: aggregate tok/s over one client's (means): " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
