"""Issue 26's capped serving row: ``moestream serve`` and ``llama-server`` each in a memory cgroup, one after the
other, under the same streamed chat load (tools/serve_load.py).

    sudo python benchmarks/serve_capped.py -m q30b-8l-q4_k_m.gguf --cap 1.6GiB --llama-server PATH \\
        [--clients 4] [--tokens 128] [--threads 2] [--json OUT.json]

Each server runs in a fresh memory cgroup of ``--cap`` (moestream/memcap.py: page cache included, swap off), the
model file evicted from the page cache first (a cold start, as bench ``--cold``); once its /health answers 200, the
load sends ``--clients`` concurrent streamed chat requests of ``--tokens`` tokens (``--temperature 1``, request i
seeded 1000 + i), then the server gets SIGTERM. Prints per server the aggregate tok/s, TTFT p50/p95, the cgroup's
peak and whether the OOM killer fired, then moestream's aggregate over llama-server's.

moestream: ``serve -t T -np CLIENTS -c 1024 --mem MEM --direct-io on`` (``--mem`` 0.1 GiB under the cap by
default: the plan counts the process, the cgroup also counts the page cache of what it reads). llama-server: ``-t T
-np CLIENTS -c 1024*CLIENTS --no-repack`` (its weights stay in the memory map, which the cap's page cache holds as it
can: llama-bench's ``--repack 0`` rows; with repacking on, a native build dies on an AMX CPU, docs/serving.md).
Needs root. Measurement only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "src"))

from moestream.bench import evict_page_cache  # noqa: E402
from moestream.memcap import MemCap, parse_cap  # noqa: E402


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def pids_listening(port: int) -> list[int]:
    """Processes whose command line names ``--port PORT`` (the server just started)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"--port" in args and args[args.index(b"--port") + 1:][:1] == [str(port).encode()]:
                found.append(int(d))
    return found


def one(name: str, cmd: list[str], port: int, a: argparse.Namespace, cap: int) -> dict:
    evict_page_cache([a.model])
    box: dict = {}

    def serve() -> None:
        try:
            box["result"] = MemCap(cap).run(cmd, timeout=a.timeout)
        except Exception as e:  # noqa: BLE001 - reported with the row
            box["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=serve, daemon=True)
    t0 = time.monotonic()
    th.start()
    while not healthy(port):
        if not th.is_alive() or time.monotonic() - t0 > a.load_timeout:
            break
        time.sleep(0.5)
    row: dict = {"server": name, "cmd": cmd, "load_s": time.monotonic() - t0}
    if healthy(port):
        out = os.path.join(a.out_dir, f"{name}.json")
        p = subprocess.run([sys.executable, os.path.join(HERE, "tools", "serve_load.py"), "--port", str(port),
                            "--clients", str(a.clients), "--requests", str(a.clients), "--max-tokens",
                            str(a.tokens), "--temperature", "1", "--json", out],
                           capture_output=True, text=True, timeout=a.timeout)
        row["load_stdout"] = p.stdout[-2000:]
        if os.path.exists(out):
            with open(out) as f:
                row["load"] = json.load(f)
    for pid in pids_listening(port):
        os.kill(pid, signal.SIGTERM)
    th.join(60)
    res = box.get("result")
    if res is not None:
        row.update(returncode=res.returncode, peak_gib=res.peak_bytes / 2**30, oom_killed=res.oom_killed,
                   stderr_tail=res.stderr[-1500:])
    if "error" in box:
        row["error"] = box["error"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--cap", default="1.6GiB")
    ap.add_argument("--mem", default=None, help="moestream's --mem (default: the cap less 0.1 GiB)")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per server (load and serving)")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--out-dir", default="/tmp/serve_capped")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    cap = parse_cap(a.cap)
    mem = a.mem or f"{(cap - (1 << 30) // 10) / 2**30:.2f}GiB"
    rows = [
        one("moestream", [sys.executable, "-m", "moestream", "serve", "-m", a.model, "-t", str(a.threads), "-np",
                          str(a.clients), "-c", "1024", "--mem", mem, "--direct-io", "on", "--host", "127.0.0.1",
                          "--port", "18971"], 18971, a, cap),
        one("llama-server", [a.llama_server, "-m", a.model, "-t", str(a.threads), "-np", str(a.clients), "-c",
                             str(1024 * a.clients), "--no-repack", "--host", "127.0.0.1", "--port", "18972"],
            18972, a, cap),
    ]
    agg = {}
    for r in rows:
        ld = (r.get("load") or {}).get("summary", {})
        agg[r["server"]] = ld.get("aggregate_tps")
        print(f"{r['server']}: {ld.get('tokens')} tokens, aggregate {ld.get('aggregate_tps')} tok/s, TTFT p50/p95 "
              f"{ld.get('ttft_p50')} / {ld.get('ttft_p95')} s, cgroup peak {r.get('peak_gib', float('nan')):.2f} "
              f"GiB, OOM killed {r.get('oom_killed')}, loaded in {r['load_s']:.0f} s"
              + (f"; {r['error']}" if "error" in r else ""))
    if agg.get("moestream") and agg.get("llama-server"):
        print(f"moestream / llama-server: {agg['moestream'] / agg['llama-server']:.2f}x at {a.clients} clients, "
              f"cap {a.cap}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cap": a.cap, "clients": a.clients, "tokens": a.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
