#!/usr/bin/env python3
"""A small, bounded load generator for ``moestream serve`` (or any OpenAI-compatible server): loopback only.

    python tools/serve_load.py --port 8080 --clients 4 --requests 8 --max-tokens 64
    python tools/serve_load.py --port 8080 --clients 4 --requests 4 --max-tokens 128 --metrics   # bytes/token
    python tools/serve_load.py --port 8080 --turns 5 --max-tokens 128                             # a chat

``--clients`` threads each send streamed chat requests one after another (``--requests`` in all, shared out; each
client's prompts differ from the others', and ``cache_prompt`` is false unless ``--cache-prompt``), each
generating up to ``--max-tokens`` tokens (greedy; a reply may end earlier at an end token: the count used is the
reply's ``usage.completion_tokens``). Prints one line per
request and a summary: aggregate tok/s (every request's generated tokens over the wall time from the first send
to the last reply), time to first token p50/p95 (from a request's send to its first content chunk), and the
per-request decode tok/s (llama-server's ``timings.predicted_per_second``) median. ``--json FILE`` writes them.

``--metrics`` (moestream only) polls ``/metrics`` during the run: expert bytes read per generated token over the
whole run (prefills included) and over the steady decode of ``--clients`` requests at once (no prefill, no queue:
streamed bytes / step sequences between the first and last such sample). ``--turns T`` sends one conversation
instead (after one uncounted warm-up request): each turn the previous messages, the previous reply and a new
user message, with ``cache_prompt``; per turn the prompt tokens, the cached ones
(``usage.prompt_tokens_details.cached_tokens``, else llama-server's ``timings.cache_n``), the prefilled ones
(``timings.prompt_n``) and the TTFT.

Refuses a host that is not a loopback address (it is a measuring tool, not a load-testing service). Exit 1 when a
request fails (the server's error is printed).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
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


def one(base: str, prompt: str | list[dict], max_tokens: int, cache_prompt: bool, temperature: float = 0.0,
        seed: int | None = None) -> dict:
    """One streamed chat request (``prompt``: a user message, or the whole list of messages): its TTFT (s),
    generated tokens, decode tok/s, wall seconds, the reply's text, prompt tokens and cached prompt tokens."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt}
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    first = None
    usage, timings = None, {}
    text: list[str] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=3600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message"))
            for c in ev.get("choices") or []:
                delta = c.get("delta") or {}
                # llama-server may put a reply that its template's reasoning parser takes for thinking into
                # reasoning_content: its first token counts as the first token too
                if delta.get("content") or delta.get("reasoning_content"):
                    first = first or time.perf_counter()
                    text.append(delta.get("content") or "")
            if ev.get("usage"):
                usage, timings = ev["usage"], ev.get("timings") or {}
    end = time.perf_counter()
    usage = usage or {}
    return {"ttft": (first or end) - t0, "tokens": usage.get("completion_tokens", 0),
            "decode_tps": timings.get("predicted_per_second", 0.0), "seconds": end - t0, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n")),
            "prompt_n": timings.get("prompt_n")}


def scrape(base: str) -> dict[str, float]:
    """moestream's /metrics as {name: value} (unlabelled samples; labelled ones summed by name)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


class MetricsPoller(threading.Thread):
    """Polls moestream's /metrics every ``period`` s while the load runs, keeping the samples taken while
    exactly ``batch`` generations were running, none of them prefilling and none queued: the steady decode of a
    batch of ``batch``. Its bytes read per generated token are (streamed bytes) / (step sequences) between the
    first and the last such sample (each decode step of the batch generates one token per sequence)."""

    def __init__(self, base: str, batch: int, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.base, self.batch, self.period = base, batch, period
        self.stop = threading.Event()
        self.steady: list[dict[str, float]] = []
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self.error: str | None = None

    def sample(self) -> dict[str, float]:
        """One scrape (its time in "t"), kept as the last sample (and the first, if none yet)."""
        m = scrape(self.base)
        m["t"] = time.perf_counter()
        self.first = self.first or m
        self.last = m
        return m

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                m = self.sample()
            except (httpx.HTTPError, ValueError) as e:
                self.error = str(e)
                return
            if (m.get("moestream_requests_processing") == self.batch and not m.get("moestream_queue_depth")
                    and m.get("moestream_running_prefilled_tokens") == m.get("moestream_running_prompt_tokens")):
                self.steady.append(m)
            self.stop.wait(self.period)

    def summary(self) -> dict:
        out: dict = {}
        if self.first and self.last:
            d = {k: self.last[k] - self.first.get(k, 0.0) for k in self.last}
            out["run"] = {"streamed_bytes": d.get("moestream_streamed_bytes_total", 0.0),
                          "step_sequences": d.get("moestream_step_sequences_total", 0.0),
                          "forward_steps": d.get("moestream_forward_steps_total", 0.0),
                          "expert_hits": d.get("moestream_expert_hits_total", 0.0),
                          "expert_misses": d.get("moestream_expert_misses_total", 0.0),
                          "io_wait_seconds": d.get("moestream_io_wait_seconds_total", 0.0),
                          "seconds": d["t"]}
        if len(self.steady) >= 2:
            a, b = self.steady[0], self.steady[-1]
            seqs = b["moestream_step_sequences_total"] - a["moestream_step_sequences_total"]
            steps = b["moestream_forward_steps_total"] - a["moestream_forward_steps_total"]
            nbytes = b["moestream_streamed_bytes_total"] - a["moestream_streamed_bytes_total"]
            hits = b["moestream_expert_hits_total"] - a["moestream_expert_hits_total"]
            misses = b["moestream_expert_misses_total"] - a["moestream_expert_misses_total"]
            secs = b["t"] - a["t"]
            out["steady_decode"] = {
                "batch": self.batch, "seconds": secs, "forward_steps": steps, "tokens": seqs,
                "streamed_bytes": nbytes, "bytes_per_token": nbytes / seqs if seqs else None,
                "bytes_per_step": nbytes / steps if steps else None, "tokens_per_second": seqs / secs if secs else None,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "io_wait_seconds": b["moestream_io_wait_seconds_total"] - a["moestream_io_wait_seconds_total"]}
        return out


def turns(base: str, n_turns: int, max_tokens: int, cache_prompt: bool, temperature: float = 0.0,
          seed: int = 0) -> list[dict]:
    """One conversation of ``n_turns`` requests, each the previous messages, the previous reply (as the server
    sent it) and a new user message; one result per turn (turn k sampled with ``seed + k`` when
    ``temperature`` > 0)."""
    # a first request of another conversation, not counted: the server's first call pays one-off costs (kernels
    # compiled or loaded, buffers allocated) that would otherwise land on turn 1
    one(base, "Say something about the weather (warm-up).", max_tokens, False)
    tag = time.strftime("%H:%M:%S")
    messages: list[dict] = []
    out = []
    for k in range(n_turns):
        # the first message names the conversation (the time it started), so that no slot holds its start already
        opening = f"Conversation {tag}. " if k == 0 else ""
        messages.append({"role": "user", "content": f"{opening}Turn {k + 1}: now tell me about "
                                                     f"{TOPICS[k % len(TOPICS)]}, in a few sentences."})
        r = one(base, messages, max_tokens, cache_prompt, temperature, seed + k if temperature > 0 else None)
        r["turn"] = k + 1
        print(f"turn {k + 1}: prompt {r['prompt_tokens']} tokens, cached {r['cached_tokens']}, prefilled "
              f"{r['prompt_n']}, {r['tokens']} generated, ttft {r['ttft']:.2f} s, decode {r['decode_tps']:.2f} tok/s",
              flush=True)
        messages.append({"role": "assistant", "content": r["text"]})
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default: 2 per client)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-prompt", action="store_true", help="let the server reuse slots' KV caches")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy); above 0 request i is sent with seed --seed + i. "
                    "Greedy decoding of a random-weight model soon repeats one token, whose routing then repeats "
                    "too: sampling gives the varied routing of real text")
    ap.add_argument("--seed", type=int, default=1000, help="first request's seed when --temperature > 0")
    ap.add_argument("--turns", type=int, default=0, metavar="T",
                    help="instead: one conversation of T turns (each request the previous messages, the previous "
                    "reply and a new user message; cache_prompt on); per turn: prompt, cached and prefilled tokens, "
                    "TTFT")
    ap.add_argument("--metrics", action="store_true",
                    help="moestream only: poll /metrics during the run and report expert bytes read per generated "
                    "token, over the whole run and in the steady decode of --clients requests at once")
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
    if a.turns:
        if not 1 <= a.turns <= 64:
            print("serve_load: error: --turns must be 1-64", file=sys.stderr)
            return 2
        load0 = os.getloadavg()[0]
        try:
            res = turns(base, a.turns, a.max_tokens, True, a.temperature, a.seed)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"serve_load: error: {e}", file=sys.stderr)
            return 1
        ratio = res[-1]["ttft"] / res[0]["ttft"]
        print(f"{a.turns} turns: ttft turn 1 {res[0]['ttft']:.2f} s, turn {a.turns} {res[-1]['ttft']:.2f} s "
              f"({ratio:.2f}x)")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump({"summary": {"turns": a.turns, "max_tokens": a.max_tokens, "temperature": a.temperature,
                                       "ttft_last_over_first": ratio,
                                       "loadavg_1min_start": load0, "loadavg_1min_end": os.getloadavg()[0]},
                           "requests": res}, f, indent=1)
        return 0
    poller = MetricsPoller(base, a.clients) if a.metrics else None
    if poller is not None:
        try:
            poller.sample()  # before the first request: the whole run's counters start here
        except (httpx.HTTPError, ValueError) as e:
            print(f"serve_load: error: --metrics: {base}/metrics: {e}", file=sys.stderr)
            return 1
        poller.start()
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
                r = one(base, prompt, a.max_tokens, a.cache_prompt, a.temperature,
                        a.seed + i if a.temperature > 0 else None)
            except (RuntimeError, httpx.HTTPError) as e:
                with lock:
                    failures.append(f"request {i}: {e}")
                return
            r["request"], r["client"] = i, c
            print(f"request {i:3d} client {c:2d}: {r['tokens']} tokens, ttft {r['ttft']:.2f} s, decode "
                  f"{r['decode_tps']:.2f} tok/s, {r['seconds']:.2f} s", flush=True)
            with lock:
                results.append(r)

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if poller is not None:
        poller.stop.set()
        poller.join()
        if poller.error is None:
            try:
                poller.sample()  # after the last reply
            except (httpx.HTTPError, ValueError) as e:
                poller.error = str(e)
    if failures:
        print(f"serve_load: error: {failures[0]}", file=sys.stderr)
        return 1
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    summary = {"clients": a.clients, "requests": n_req, "max_tokens": a.max_tokens, "temperature": a.temperature,
               "wall_seconds": wall, "loadavg_1min_start": load0, "loadavg_1min_end": os.getloadavg()[0],
               "tokens": tokens, "aggregate_tps": tokens / wall,
               "ttft_p50": statistics.median(ttft), "ttft_p95": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
               "decode_tps_median": statistics.median(r["decode_tps"] for r in results)}
    print(f"{a.clients} clients, {n_req} requests of {a.max_tokens} tokens: {tokens} tokens in {wall:.2f} s = "
          f"{summary['aggregate_tps']:.2f} tok/s aggregate; ttft p50 {summary['ttft_p50']:.2f} s, p95 "
          f"{summary['ttft_p95']:.2f} s; per-request decode {summary['decode_tps_median']:.2f} tok/s (median)")
    if poller is not None:
        summary["metrics"] = m = poller.summary()
        if poller.error:
            print(f"serve_load: note: /metrics: {poller.error}", file=sys.stderr)
        if "run" in m:
            print(f"whole run: {m['run']['streamed_bytes'] / 2**20:.0f} MiB of experts read for {tokens} tokens = "
                  f"{m['run']['streamed_bytes'] / max(tokens, 1) / 2**20:.1f} MiB per generated token (prefills "
                  f"included)")
        sd = m.get("steady_decode")
        if sd and sd["bytes_per_token"] is not None:
            print(f"steady decode of {a.clients}: {sd['forward_steps']:.0f} steps, {sd['tokens']:.0f} tokens, "
                  f"{sd['bytes_per_token'] / 2**20:.1f} MiB per token ({sd['bytes_per_step'] / 2**20:.1f} MiB per "
                  f"step), hit rate {100 * (sd['hit_rate'] or 0):.1f}%, {sd['tokens_per_second']:.2f} tok/s")
        else:
            print("steady decode: no two samples with every client decoding (run longer?)")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "requests": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
