"""Thread scaling, moestream beside llama.cpp: pp and tg tok/s at each thread count, measured in one run.

For every ``-t`` value this runs ``moestream bench`` (resident experts, ``--moe-stream off``; one subprocess per
row, as bench does) and llama.cpp's own ``llama-bench`` (CPU only: ``-ngl 0``, plus ``-dev none`` when the
binary was built with a GPU backend) on the same file with the same prompt / generation lengths, then prints a
markdown table, writes JSON, and draws the decode curve as an SVG (no plotting library needed).

    python benchmarks/threads.py -m q30b-8l-q4_k_m.gguf --llama-bench build/bin/llama-bench -t 1,2,4,8,16 \\
        -p 512 -n 128 -r 2 --json benchmarks/threads.json --svg benchmarks/threads.svg

Both programs read the file through the page cache (run it once first so neither pays the cold read).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def moestream_row(model: str, threads: int, p: int, n: int, r: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [sys.executable, "-m", "moestream", "bench", "-m", model, "-p", str(p), "-n", str(n), "-r", str(r),
               "--moe-stream", "off", "-t", str(threads), "--json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as fh:
            data = json.load(fh)
    finally:
        os.unlink(out)
    rows = data["rows"] if isinstance(data, dict) else data
    res = {}
    for row in rows:
        for t in row.get("tests", []):
            res["pp" if t["test"].startswith("pp") else "tg"] = (t["tok_s_mean"], t["tok_s_sd"])
    return res


def llama_row(binary: str, model: str, threads: int, p: int, n: int, r: int, gpu_build: bool) -> dict:
    cmd = [binary, "-m", model, "-p", str(p), "-n", str(n), "-r", str(r), "-t", str(threads), "-ngl", "0",
           "-o", "json"]
    if gpu_build:
        cmd += ["-dev", "none"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = {}
    for row in json.loads(out):
        key = "pp" if row["n_gen"] == 0 else "tg"
        res[key] = (row["avg_ts"], row["stddev_ts"])
    return res


def svg(rows: list[dict], path: str) -> None:
    """Decode tok/s against threads, both programs, as a small SVG line chart."""
    w, h, pad = 520, 320, 50
    ts = [row["threads"] for row in rows]
    ymax = max(max(row["moestream"]["tg"][0], row["llama.cpp"]["tg"][0]) for row in rows) * 1.1
    xs = {t: pad + i * (w - 2 * pad) / max(1, len(ts) - 1) for i, t in enumerate(ts)}

    def y(v: float) -> float:
        return h - pad - v / ymax * (h - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">threads</text>',
             f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">decode tok/s</text>']
    for t in ts:
        parts.append(f'<text x="{xs[t]}" y="{h - pad + 16}" text-anchor="middle">{t}</text>')
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<text x="{pad - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
    for name, color in (("moestream", "#d62728"), ("llama.cpp", "#1f77b4")):
        pts = " ".join(f"{xs[row['threads']]:.1f},{y(row[name]['tg'][0]):.1f}" for row in rows)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        last = rows[-1]
        parts.append(f'<text x="{xs[last["threads"]] - 4}" y="{y(last[name]["tg"][0]) - 6}" text-anchor="end" '
                     f'fill="{color}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--gpu-build", action="store_true", help="llama-bench has a GPU backend: add -dev none")
    ap.add_argument("-t", "--threads", default="1,2,4,8,16")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--svg", default=None)
    a = ap.parse_args()
    rows = []
    print("| threads | moestream pp | llama.cpp pp | pp ratio | moestream tg | llama.cpp tg | tg ratio |")
    print("|---|---|---|---|---|---|---|")
    for t in (int(v) for v in a.threads.split(",")):
        ms = moestream_row(a.model, t, a.p, a.n, a.r)
        ll = llama_row(a.llama_bench, a.model, t, a.p, a.n, a.r, a.gpu_build)
        rows.append({"threads": t, "moestream": ms, "llama.cpp": ll})
        print(f"| {t} | {ms['pp'][0]:.1f} ± {ms['pp'][1]:.1f} | {ll['pp'][0]:.1f} ± {ll['pp'][1]:.1f} | "
              f"{ms['pp'][0] / ll['pp'][0]:.2f} | {ms['tg'][0]:.2f} ± {ms['tg'][1]:.2f} | "
              f"{ll['tg'][0]:.2f} ± {ll['tg'][1]:.2f} | {ms['tg'][0] / ll['tg'][0]:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(a.model), "p": a.p, "n": a.n, "r": a.r, "rows": rows}, f, indent=1)
    if a.svg:
        svg(rows, a.svg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
