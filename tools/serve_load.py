#!/usr/bin/env python3
"""A small, bounded load generator for ``moestream serve`` (or any OpenAI-compatible server): loopback only.

    python tools/serve_load.py --port 8080 --clients 4 --requests 8 --max-tokens 64

``--clients`` threads each send streamed chat requests one after another (``--requests`` in all, shared out; each
client's prompts differ from the others', and ``cache_prompt`` is false unless ``--cache-prompt``), each
generating up to ``--max-tokens`` tokens (greedy; a reply may end earlier at an end token: the count used is the
reply's ``usage.completion_tokens``). Prints one line per
request and a summary: aggregate tok/s (every request's generated tokens over the wall time from the first send
to the last reply), time to first token p50/p95 (from a request's send to its first content chunk), and the
per-request decode tok/s (llama-server's ``timings.predicted_per_second``) median. ``--json FILE`` writes them.

Refuses a host that is not a loopback address (it is a measuring tool, not a load-testing service). Exit 1 when a
request fails (the server's error is printed).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import statistics
import sys
import threading
import time

import httpx

TOPICS = ["rivers", "printing presses", "lighthouses", "volcanoes", "bees", "glaciers", "trains", "comets",
          "forests", "deserts", "bridges", "harbours", "clocks", "mountains", "libraries", "islands"]


def loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def one(base: str, prompt: str, max_tokens: int, cache_prompt: bool) -> dict:
    """One streamed chat request: its TTFT (s), generated tokens, decode tok/s and wall seconds."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt}
    t0 = time.perf_counter()
    first = None
    usage, timings = None, {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=3600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message"))
            if first is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices") or []):
                first = time.perf_counter()
            if ev.get("usage"):
                usage, timings = ev["usage"], ev.get("timings") or {}
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "tokens": (usage or {}).get("completion_tokens", 0),
            "decode_tps": timings.get("predicted_per_second", 0.0), "seconds": end - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default: 2 per client)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-prompt", action="store_true", help="let the server reuse slots' KV caches")
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    if not loopback(a.host):
        print(f"serve_load: error: --host {a.host} is not a loopback address", file=sys.stderr)
        return 2
    if not 1 <= a.clients <= 64 or not 1 <= a.max_tokens <= 4096:
        print("serve_load: error: --clients must be 1-64 and --max-tokens 1-4096", file=sys.stderr)
        return 2
    n_req = a.requests or 2 * a.clients
    if not 1 <= n_req <= 1024:
        print("serve_load: error: --requests must be 1-1024", file=sys.stderr)
        return 2
    base = f"http://{a.host}:{a.port}"
    todo = list(range(n_req))
    lock = threading.Lock()
    results: list[dict] = []
    failures: list[str] = []

    def client(c: int) -> None:
        while True:
            with lock:
                if not todo or failures:
                    return
                i = todo.pop(0)
            prompt = f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (request {i}, client {c})."
            try:
                r = one(base, prompt, a.max_tokens, a.cache_prompt)
            except (RuntimeError, httpx.HTTPError) as e:
                with lock:
                    failures.append(f"request {i}: {e}")
                return
            r["request"], r["client"] = i, c
            print(f"request {i:3d} client {c:2d}: {r['tokens']} tokens, ttft {r['ttft']:.2f} s, decode "
                  f"{r['decode_tps']:.2f} tok/s, {r['seconds']:.2f} s", flush=True)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        print(f"serve_load: error: {failures[0]}", file=sys.stderr)
        return 1
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    summary = {"clients": a.clients, "requests": n_req, "max_tokens": a.max_tokens, "wall_seconds": wall,
               "tokens": tokens, "aggregate_tps": tokens / wall,
               "ttft_p50": statistics.median(ttft), "ttft_p95": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
               "decode_tps_median": statistics.median(r["decode_tps"] for r in results)}
    print(f"{a.clients} clients, {n_req} requests of {a.max_tokens} tokens: {tokens} tokens in {wall:.2f} s = "
          f"{summary['aggregate_tps']:.2f} tok/s aggregate; ttft p50 {summary['ttft_p50']:.2f} s, p95 "
          f"{summary['ttft_p95']:.2f} s; per-request decode {summary['decode_tps_median']:.2f} tok/s (median)")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "requests": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
