"""Routing traces and replacement simulators: what the slot policy saw, replayed through LRU, LFU and Belady.

A *routing trace* is the sequence of slot requests an expert store received: one ``(layer, experts, pinned)``
per ``ExpertStore.prepare`` call (experts: the distinct real expert ids of one step or prefill tile, sorted;
pinned: real ids whose slots had to survive the request, the previous prefill tile). ``StreamingStore`` and
``ResidentStore`` append to ``store.trace`` when it is a list (:meth:`RoutingTrace.attach`).

:func:`simulate` replays a trace through per-layer pools of a given size and counts hits and misses the way
``StoreStats`` does: per request, each requested expert already in a slot is a hit, each other one a miss.

- ``"lru"`` and ``"lfu"`` follow ``experts/policy.py`` exactly (written again here, not called, so that a test
  can hold one against the other): every expert of a request and every ``pinned`` one is pinned; empty slots
  fill first, lowest slot first; then LRU evicts the least recently requested expert, LFU the least often
  requested one (ties: least recently), ties on both by lowest slot.
- ``"belady"`` is Belady's optimal offline replacement (L. A. Belady, "A study of replacement algorithms for a
  virtual-storage computer", IBM Systems Journal 5(2), 1966): on a miss, evict the resident, non-pinned
  expert whose next request is furthest in the future, one never requested again first. No policy that
  reads experts only on a miss can have more hits on the same requests (tests/test_trace.py checks it
  against an exhaustive search over every eviction choice), as long as every pinned expert was in the layer's
  previous request, as MoE pins the previous prefill tile. (With pins that need not be resident, evicting an
  expert early, before it is pinned, can pay, and the bound can be passed: the test shows a case.) When only a
  window of requests is counted, a miss before the window costs nothing, so an expert whose next request comes
  before the window (or never) is evicted first, furthest next request first, then the others by furthest next
  request: the optimum of the window's hits (checked against the same search).

Trace files (``moestream run --routing-trace FILE``) are JSON lines: line 1 is a header object
(``"format": "moestream-routing-trace"``, ``"version": 1``, ``model``, ``arch``, ``top_k``, ``n_experts``
{layer: experts}, ``slots`` {layer: slots} or null for ``--moe-stream off``, ``policy`` (null when resident),
``overlap``, ``requests`` (the count), ``decode_start`` (index of the first decode-step request), and the
store's own ``hits``/``misses`` and ``decode_hits``/``decode_misses``); each next line is one request
``[layer, [experts...], [pinned...]]``, in order. Layer keys are strings (JSON object keys).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MoestreamError

#: One slot request: (MoE layer, distinct real expert ids, pinned real expert ids).
Request = tuple[int, tuple[int, ...], tuple[int, ...]]

SIMULATED = ("lru", "lfu", "belady")
FORMAT = "moestream-routing-trace"
VERSION = 1


class TraceFileError(MoestreamError):
    """A routing trace file that cannot be read (missing, not a trace, a malformed line)."""


@dataclass
class SimResult:
    """Counts of one simulation: hits and misses over (request, requested expert) pairs in the window."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0


def _caps(slots: int | Mapping[int, int], layers: set[int]) -> dict[int, int]:
    if isinstance(slots, Mapping):
        missing = sorted(layers - set(slots))
        if missing:
            raise ValueError(f"no slot count for layer {missing[0]}")
        caps = {int(k): int(v) for k, v in slots.items()}
    else:
        caps = {layer: int(slots) for layer in layers}
    bad = [(k, v) for k, v in caps.items() if v < 1]
    if bad:
        raise ValueError(f"layer {bad[0][0]}: {bad[0][1]} slots; a pool needs at least 1")
    return caps


def simulate(requests: Sequence[Request], policy: str, slots: int | Mapping[int, int],
             window: tuple[int, int | None] | None = None) -> SimResult:
    """Replay ``requests`` through per-layer pools under ``policy`` (``"lru"``, ``"lfu"`` or ``"belady"``).

    slots: slots per layer (one int for every layer, or {layer: slots}), from an empty pool. window:
    ``(start, stop)`` request indices (``stop`` None: the end): only requests in ``range(start, stop)`` are
    counted, earlier ones are replayed to warm the pools (for Belady, as free misses: see the module
    docstring), later ones are not replayed (Belady looks no further than ``stop``). Returns the SimResult.
    ValueError when a request's experts plus its pinned experts need more slots than its layer's pool has (see
    :func:`retile`).
    """
    if policy not in SIMULATED:
        raise ValueError(f"unknown policy {policy!r}; simulated: {', '.join(SIMULATED)}")
    start, stop = (0, None) if window is None else window
    stop = len(requests) if stop is None else min(stop, len(requests))
    reqs = requests[:stop]
    caps = _caps(slots, {r[0] for r in reqs})
    expert_of = {layer: [-1] * n for layer, n in caps.items()}  # slot -> expert (-1 empty)
    slot_of: dict[int, dict[int, int]] = {layer: {} for layer in caps}  # expert -> slot
    clock = dict.fromkeys(caps, 0)
    uses: dict[int, dict[int, int]] = {layer: {} for layer in caps}
    last: dict[int, dict[int, int]] = {layer: {} for layer in caps}
    when: dict[tuple[int, int], list[int]] = {}  # (layer, expert) -> request indices that need it (belady)
    if policy == "belady":
        for i, (layer, experts, _) in enumerate(reqs):
            for e in experts:
                when.setdefault((layer, e), []).append(i)
    never = len(reqs)  # a next use past every request
    res = SimResult()
    for i, (layer, experts, pinned) in enumerate(reqs):
        cap, ex_of, sl_of = caps[layer], expert_of[layer], slot_of[layer]
        need = set(experts)
        keep = {p for p in pinned if p not in need}
        if len(experts) + len(keep) > cap:
            raise ValueError(f"request {i} (layer {layer}): {len(experts)} experts and {len(keep)} pinned need "
                             f"more than the {cap} slots of the pool")
        if policy != "belady":
            clock[layer] += 1
            u, la = uses[layer], last[layer]
            for e in experts:
                u[e] = u.get(e, 0) + 1
                la[e] = clock[layer]
        misses = [e for e in experts if e not in sl_of]
        if i >= start:
            res.misses += len(misses)
            res.hits += len(experts) - len(misses)
        if not misses:
            continue
        empty = [s for s in range(cap) if ex_of[s] < 0]
        held = [s for s in range(cap) if ex_of[s] >= 0 and ex_of[s] not in need and ex_of[s] not in keep]
        if policy == "lru":
            held.sort(key=lambda s: (last[layer][ex_of[s]], s))
        elif policy == "lfu":
            held.sort(key=lambda s: (uses[layer][ex_of[s]], last[layer][ex_of[s]], s))
        else:
            def next_use(s: int, layer: int = layer, ex_of: list[int] = ex_of, i: int = i) -> int:
                times = when.get((layer, ex_of[s]), ())
                j = bisect.bisect_right(times, i)
                return times[j] if j < len(times) else never
            # a miss before the window costs nothing: an expert next needed before it (or never) is evicted first
            held.sort(key=lambda s: (start <= next_use(s) < never, -next_use(s), s))
        for e, s in zip(misses, (empty + held)[:len(misses)], strict=True):
            old = ex_of[s]
            if old >= 0:
                del sl_of[old]
            ex_of[s] = e
            sl_of[e] = s
    return res


def retile(requests: Sequence[Request], slots: int | Mapping[int, int], overlap: bool = True
           ) -> tuple[list[Request], int]:
    """``requests`` made to fit pools of ``slots`` slots per layer, as ``MoE`` would have asked them of such a pool:
    a request whose experts exceed the pool is walked in tiles (``overlap``: half the pool each, each tile with
    the previous one pinned; else the whole pool, no pins); a request that fits but whose pinned experts do not
    keeps only the pinned experts that fit. An approximation for prefill tiles recorded through a larger pool
    (decode steps always fit). Returns (the requests, how many recorded requests were changed)."""
    caps = _caps(slots, {r[0] for r in requests})
    out: list[Request] = []
    changed = 0
    for layer, experts, pinned in requests:
        cap = caps[layer]
        keep = tuple(p for p in pinned if p not in set(experts))
        if len(experts) + len(keep) <= cap:
            out.append((layer, experts, pinned))
            continue
        changed += 1
        if len(experts) <= cap:
            out.append((layer, experts, keep[:cap - len(experts)]))
            continue
        size = cap // 2 if overlap and cap >= 2 else cap
        prev: tuple[int, ...] = ()
        for j in range(0, len(experts), size):
            tile = experts[j:j + size]
            out.append((layer, tile, prev if overlap else ()))
            prev = tile
    return out, changed


def hit_rates(requests: Sequence[Request], slots: int | Mapping[int, int],
              window: tuple[int, int | None] | None = None) -> dict[str, float]:
    """``{"lru_hit_rate", "lfu_hit_rate", "belady_hit_rate"}`` of :func:`simulate` (fractions in [0, 1])."""
    return {f"{p}_hit_rate": simulate(requests, p, slots, window).hit_rate for p in SIMULATED}


@dataclass
class RoutingTrace:
    """A routing trace in memory: ``requests`` (what ``store.trace`` appends to) and ``meta`` (the file header,
    see the module docstring); ``store``: the ExpertStore it records (None for a trace read from a file)."""

    requests: list[Request] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    store: Any = field(default=None, repr=False)
    _at_decode: tuple[int, int] = (0, 0)  # the store's (hits, misses) when the decode steps began

    @classmethod
    def attach(cls, model: Any) -> RoutingTrace:
        """A trace that ``model.store`` (a fresh store: its stats count from zero) appends every request to from
        now on, with the header filled from the model."""
        store = model.store
        layout = model.layout
        t = cls(store=store)
        store.trace = t.requests
        streaming = store.streaming
        t.meta = {
            "format": FORMAT, "version": VERSION, "model": model.gguf.path, "arch": model.arch,
            "top_k": model.top_k, "n_experts": {str(layer): layout.n_experts(layer) for layer in layout.moe_layers},
            "slots": ({str(layer): store.capacity(layer) for layer in layout.moe_layers} if streaming else None),
            "policy": model.opts.policy if streaming else None, "overlap": model.opts.overlap,
            "decode_start": None,
        }
        return t

    def mark_decode(self) -> None:
        """The requests from here on are decode steps (call it after the prefill)."""
        st = self.store.stats
        self.meta["decode_start"] = len(self.requests)
        self._at_decode = (st.hits, st.misses)

    def finish(self) -> None:
        """Record the store's own counts (all requests and decode only) in the header."""
        st = self.store.stats
        if self.meta.get("decode_start") is None:
            self.mark_decode()
        h0, m0 = self._at_decode
        self.meta.update(requests=len(self.requests), hits=st.hits, misses=st.misses,
                         decode_hits=st.hits - h0, decode_misses=st.misses - m0)

    # --- the header, typed -----------------------------------------------------------------------
    @property
    def n_experts(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.meta["n_experts"].items()}

    @property
    def slots(self) -> dict[int, int] | None:
        s = self.meta.get("slots")
        return None if s is None else {int(k): int(v) for k, v in s.items()}

    @property
    def decode_start(self) -> int:
        d = self.meta.get("decode_start")
        return len(self.requests) if d is None else int(d)

    # --- files -------------------------------------------------------------------------------------
    def text(self) -> str:
        """The trace file's text (JSON lines)."""
        lines = [json.dumps(self.meta)]
        lines += [json.dumps([layer, list(e), list(p)]) for layer, e, p in self.requests]
        return "\n".join(lines) + "\n"

    def write(self, path: str, option: str = "--routing-trace") -> None:
        """Write the file atomically (``output.write_output``); OutputError naming ``option`` on failure."""
        from ..output import write_output
        write_output(path, self.text(), option, "the routing trace")

    @classmethod
    def read(cls, path: str) -> RoutingTrace:
        """The trace in ``path``. TraceFileError naming the file (and the line) when it cannot be read, is not a
        moestream routing trace, or holds a malformed request."""
        if not str(path).strip():
            raise TraceFileError("the trace file name is empty: give the FILE that run --routing-trace wrote")
        try:
            import stat as _stat
            if not _stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path):
                raise TraceFileError(f"{path}: not a regular file (a routing trace is a file run --routing-trace "
                                     f"wrote)")
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            raise TraceFileError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise TraceFileError(f"{path}: is a directory, not a trace file") from None
        except UnicodeDecodeError as e:
            raise TraceFileError(f"{path}: not a moestream routing trace (not UTF-8 text at byte {e.start})") from None
        except OSError as e:
            raise TraceFileError(f"{path}: cannot read it ({e.strerror or e})") from None
        try:
            meta = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise TraceFileError(f"{path}: not a moestream routing trace (line 1 is not its header; write one with "
                                 f"moestream run --routing-trace FILE)")
        if meta.get("version") != VERSION:
            raise TraceFileError(f"{path}: routing trace version {meta.get('version')!r}; this moestream reads "
                                 f"version {VERSION}")
        try:
            n_exp = {int(k): int(v) for k, v in meta["n_experts"].items()}
            slots = meta.get("slots")
            if slots is not None:
                slots = {int(k): int(v) for k, v in slots.items()}
            n_req, top_k, decode = int(meta["requests"]), int(meta["top_k"]), int(meta["decode_start"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise TraceFileError(f"{path}: line 1: the header lacks a valid n_experts, slots, top_k, requests or "
                                 f"decode_start") from None
        requests: list[Request] = []
        for n, line in enumerate(lines[1:], 2):
            try:
                layer, experts, pinned = json.loads(line)
                req = (int(layer), tuple(int(e) for e in experts), tuple(int(e) for e in pinned))
            except (json.JSONDecodeError, TypeError, ValueError):
                raise TraceFileError(f"{path}: line {n}: expected [layer, [experts...], [pinned...]], got "
                                     f"{line[:80]!r}") from None
            ne = n_exp.get(req[0])
            if ne is None:
                raise TraceFileError(f"{path}: line {n}: layer {req[0]} is not an MoE layer of the header")
            bad = [e for e in req[1] + req[2] if not 0 <= e < ne]
            if bad or len(set(req[1])) != len(req[1]):
                what = f"expert {bad[0]} is outside 0..{ne - 1}" if bad else "an expert is listed twice"
                raise TraceFileError(f"{path}: line {n}: {what}")
            requests.append(req)
        if len(requests) != n_req:
            raise TraceFileError(f"{path}: the header says {n_req} requests but the file holds {len(requests)} "
                                 f"(truncated?)")
        if not 0 <= decode <= n_req or top_k < 1:
            raise TraceFileError(f"{path}: line 1: decode_start {decode} or top_k {top_k} is out of range")
        return cls(requests=requests, meta={**meta, "n_experts": {str(k): v for k, v in n_exp.items()},
                                            "slots": None if slots is None else {str(k): v for k, v in slots.items()}})


def check_trace_path(path: str, inputs: Sequence[str] = ()) -> None:
    """ConfigError, before the model runs, when ``--routing-trace PATH`` cannot be written or names a model file."""
    from ..output import check_json_path
    check_json_path(path, inputs, option="--routing-trace", what="the trace")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def trace_table(trace: RoutingTrace, slot_counts: Sequence[int] | None = None, name: str = "") -> str:
    """``moestream trace``'s report: a header line, then a markdown table with one line per slot count (default:
    the recorded one; a resident trace: a quarter of the experts, at least top-k): the recorded policy's own hit
    rate (at the recorded count only) and the LRU, LFU and Belady hit rates, over the decode steps' requests
    (warmed by every earlier request) and over all requests."""
    from .policy import default_slots

    n_exp = trace.n_experts
    top_k = int(trace.meta["top_k"])
    recorded = trace.slots
    meta = trace.meta
    if slot_counts is None:
        slot_counts = [] if recorded else [default_slots(max(n_exp.values()), top_k)]
    rows: list[tuple[dict[int, int], bool]] = [] if slot_counts else [(recorded, True)]  # default: the recorded
    for n in slot_counts:
        caps = {layer: min(n, ne) for layer, ne in n_exp.items()}
        if all(c != caps for c, _ in rows):  # counts above the experts clamp to the same row
            rows.append((caps, caps == recorded))
    d0, n_req = trace.decode_start, len(trace.requests)
    layers = len(n_exp)
    rec = ("resident (--moe-stream off)" if recorded is None
           else f"{_slots_label(recorded)} slots/layer, policy {meta.get('policy')}")
    out = [f"trace {name or meta.get('model')}: {os.path.basename(str(meta.get('model')))} ({meta.get('arch')}), "
           f"{layers} MoE layers, top-{top_k} of {max(n_exp.values())} experts; recorded {rec}; {n_req} requests, "
           f"the decode steps' from request {d0} on ({n_req - d0})",
           "", "| slots/layer | own decode | LRU decode | LFU decode | Belady decode | own all | LRU all | LFU all "
           "| Belady all |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for caps, is_recorded in rows:
        overlap = bool(meta.get("overlap", True))
        reqs, changed = retile(trace.requests, caps, overlap)
        d = len(retile(trace.requests[:d0], caps, overlap)[0]) if changed else d0  # where decode starts now
        if changed:
            notes.append(f"note: at {_slots_label(caps)} slots, {changed} prefill requests recorded through the "
                         f"larger pool were re-tiled as MoE tiles a chunk (an approximation of what that run would "
                         f"have requested).")
        own_d = own_a = None
        if is_recorded:
            dh, dm = meta.get("decode_hits", 0), meta.get("decode_misses", 0)
            own_d = dh / (dh + dm) if dh + dm else None
            h, m = meta.get("hits", 0), meta.get("misses", 0)
            own_a = h / (h + m) if h + m else None
        dec = hit_rates(reqs, caps, (d, None)) if d < len(reqs) else dict.fromkeys(
            ("lru_hit_rate", "lfu_hit_rate", "belady_hit_rate"))
        al = hit_rates(reqs, caps)
        out.append(f"| {_slots_label(caps)}{' (recorded)' if is_recorded else ''} | {_pct(own_d)} | "
                   f"{_pct(dec['lru_hit_rate'])} | {_pct(dec['lfu_hit_rate'])} | {_pct(dec['belady_hit_rate'])} | "
                   f"{_pct(own_a)} | {_pct(al['lru_hit_rate'])} | {_pct(al['lfu_hit_rate'])} | "
                   f"{_pct(al['belady_hit_rate'])} |")
    out.append("")
    out.append("Hit rate = hits / (hits + misses) over each request's distinct experts, from empty pools. decode: the "
               "decode steps' requests, every earlier one replayed first; all: every request, prefill included. own: "
               "the recorded run's policy as the store counted it (recorded slot count only). Belady: the optimal "
               "offline replacement, the bound no policy can pass.")
    out += notes
    return "\n".join(out)


def _slots_label(caps: Mapping[int, int]) -> str:
    vals = sorted(set(caps.values()))
    return str(vals[0]) if len(vals) == 1 else f"{vals[0]}-{vals[-1]}"
