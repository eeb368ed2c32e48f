"""``moestream replay TRACE``: play a per-token run trace (moestream/runtrace.py) back.

In a terminal (a Textual app): three regions, as a recording of the run -- the text as it arrived (the current
token highlighted), a strip of sparklines over the tokens (GPU utilisation and power on a CUDA run, the process's
CPU % on a CPU run, where there is no power reading), and the current token's statistics. It plays at the
recorded speed (each token shown after its own recorded interval, scaled by ``--speed``); space pauses and
resumes, the arrow keys step one token (page up / down: ten), home / end jump to the first / last, + / - change
the speed, q quits. Without a terminal on stdout it prints the frame at ``--at N`` (default: the last token).

``--html OUT.html`` writes one self-contained page instead (no network at view time: the trace's data, the
script and the style are inline, the plots SVG drawn by the script): the text with each token hoverable (a
tooltip with its statistics), plots of per-token latency, IO wait, expert hit rate, load and power lined up
against the tokens, and a scrubber (a range input) that moves one cursor through the text, every plot and the
readout (``#readout``).

Positions are shown 1-based: token 1 is the first record (a generation's prompt, phase prefill).
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass

from .runtrace import RunTrace, RunTraceError, summary_line

BLOCKS = "▁▂▃▄▅▆▇█"
GiB = 2**30


# ------------------------------------------------------------------------------------------------ timeline
@dataclass
class Timeline:
    """The records to play (one bench row, or all of a run) and their per-token series.

    ``records``: the trace's token records. Series (one value per record, None where there is none):
    ``latency_ms`` (the interval), ``io_wait_ms``, ``hit_pct`` (hits / uses of the record, None without expert
    uses), ``load_pct`` (GPU utilisation, or CPU % on a CPU trace), ``power_w`` (GPU power; None on the CPU).
    ``load_name`` / ``power_name``: what the load and power series are."""

    trace: RunTrace
    records: list[dict]
    row: int | None
    latency_ms: list[float]
    io_wait_ms: list[float]
    hit_pct: list[float | None]
    load_pct: list[float | None]
    power_w: list[float | None]
    load_name: str
    power_name: str
    gpu: bool

    def __len__(self) -> int:
        return len(self.records)


def timeline(trace: RunTrace, row: int | None = None) -> Timeline:
    """The :class:`Timeline` of ``trace``: of bench row ``row``, or (None) of every record -- for a bench trace,
    the first row that has records. RunTraceError when there are no records to play (or no such row)."""
    recs = trace.select(row)
    if row is None and trace.header.get("command") == "bench" and trace.tokens:
        row = trace.tokens[0].get("row")
        recs = trace.select(row)
    if not recs:
        if row is not None and trace.tokens:
            have = sorted({r.get("row") for r in trace.tokens if r.get("row") is not None})
            if not have:
                raise RunTraceError(f"{trace.path}: --row {row}: this is a trace of moestream "
                                    f"{trace.header.get('command')}, which has no rows (--row is for bench traces)")
            raise RunTraceError(f"{trace.path}: no records of row {row} (rows with records: "
                                f"{', '.join(map(str, have))})")
        raise RunTraceError(f"{trace.path}: the trace holds no token records (the run ended before its prefill?)")
    gpu = any(r.get("gpu") for r in recs)

    def hit(r: dict) -> float | None:
        h, m = sum(r["hits"]), sum(r["misses"])
        return 100.0 * h / (h + m) if h + m else None

    if gpu:
        load = [r["gpu"]["util_pct"] if r.get("gpu") else None for r in recs]
        power = [r["gpu"]["power_w"] if r.get("gpu") else None for r in recs]
        load_name, power_name = "GPU util %", "GPU power W"
    else:
        load = [r.get("cpu_pct") for r in recs]
        power = [None] * len(recs)
        load_name, power_name = "CPU %", "power W (no reading on the CPU)"
    return Timeline(trace=trace, records=recs, row=row, latency_ms=[1000 * r["dt"] for r in recs],
                    io_wait_ms=[1000 * r["io_wait_s"] for r in recs], hit_pct=[hit(r) for r in recs],
                    load_pct=load, power_w=power, load_name=load_name, power_name=power_name, gpu=gpu)


def _bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _num(x: float | None, digits: int = 1, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def stats_lines(tl: Timeline, i: int) -> list[str]:
    """The statistics of record ``i`` (0-based) as lines of text (what the terminal's stats region and the
    page's readout show)."""
    r = tl.records[i]
    n = len(tl)
    what = (f"prefill of {r['n']} prompt tokens" if r["phase"] == "prefill"
            else ("end-of-generation token" if r.get("eog") else "decode") + (f", id {r['id']}" if "id" in r else ""))
    tags = "".join(f"  {k} {r[k]}" for k in ("row", "test", "rep", "request", "turn") if k in r)
    tps = r["n"] / r["dt"] if r["dt"] > 0 else None
    h, m = sum(r["hits"]), sum(r["misses"])
    per = " ".join(f"L{layer} {a}/{b}" for layer, a, b in zip(tl.trace.layers or range(len(r["hits"])),
                                                             r["hits"], r["misses"], strict=False))
    gpu = r.get("gpu")
    gpu_s = ("GPU -" if gpu is None else f"GPU {gpu['util_pct']:.0f}% {_bytes(gpu['mem_bytes'])} "
             f"{gpu['power_w']:.0f} W ({gpu['samples']} samples)")
    return [
        f"token {i + 1}/{n}  {what}  text {json.dumps(r['text'], ensure_ascii=False)[:80]}  t {r['t']:.3f} s{tags}",
        f"latency {1000 * r['dt']:.2f} ms ({_num(tps, 1)} tok/s)  IO wait {1000 * r['io_wait_s']:.2f} ms  "
        f"read {_bytes(r['read_bytes'])}",
        f"experts: {h} hits, {m} misses (hit rate {_num(tl.hit_pct[i], 1, '%')})  per layer hits/misses: {per}",
        f"RSS {_bytes(r.get('rss', 0))}  CPU {_num(r.get('cpu_pct'), 0, '%')}  {gpu_s}",
    ]


def spark(values: list[float | None], top: float | None = None) -> str:
    """One block character per value, scaled to ``top`` (default the largest value); a space for None."""
    got = [v for v in values if v is not None]
    top = top if top is not None else (max(got) if got else 0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(BLOCKS[0])
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, max(0, int(round(v / top * (len(BLOCKS) - 1)))))])
    return "".join(out)


def strip_window(n: int, i: int, width: int) -> tuple[int, int]:
    """(start, stop) of the ``width`` records of ``n`` the strip shows, ``i`` inside (centred where it can be)."""
    if n <= width:
        return 0, n
    start = min(max(0, i - width // 2), n - width)
    return start, start + width


def strip_lines(tl: Timeline, i: int, width: int = 60) -> list[str]:
    """The sparkline strip around record ``i``: load, power and latency rows over the same tokens, and a caret
    row under the current token."""
    a, b = strip_window(len(tl), i, width)
    rows = []
    for name, series in ((tl.load_name, tl.load_pct), (tl.power_name, tl.power_w), ("latency ms", tl.latency_ms)):
        got = [v for v in series if v is not None]
        label = f"{name} (max {_num(max(got) if got else None, 1)})"
        rows.append((label, spark(series[a:b], max(got) if got else None)))
    lw = max(len(x) for x, _ in rows)
    out = [f"{label:<{lw}} |{line}|" for label, line in rows]
    out.append(" " * (lw + 2 + i - a) + f"^ token {i + 1}")
    return out


def text_upto(tl: Timeline, i: int) -> tuple[str, str]:
    """(text before record ``i``, record ``i``'s text): the text as it had arrived at token ``i + 1``."""
    return "".join(r["text"] for r in tl.records[:i]), tl.records[i]["text"]


def frame_text(tl: Timeline, i: int, width: int = 60) -> str:
    """The three regions at record ``i`` as plain text (the non-interactive output)."""
    before, cur = text_upto(tl, i)
    return "\n".join([before + "[" + cur + "]", "", *strip_lines(tl, i, width), "", *stats_lines(tl, i)])


# ------------------------------------------------------------------------------------------------ terminal
def make_app(tl: Timeline, speed: float = 1.0, start: int = 0, autoplay: bool = True):  # noqa: ANN201
    """The Textual app that plays ``tl`` (see the module docstring for its keys). ``app.pos``: the record shown
    (0-based); ``app.playing``."""
    from rich.text import Text
    from textual.app import App, ComposeResult
    from textual.binding import Binding
    from textual.containers import VerticalScroll
    from textual.widgets import Static

    class ReplayApp(App):
        CSS = """
        #title { height: 1; background: $primary-background; }
        #textbox { height: 1fr; border: round $secondary; }
        #strip { height: auto; border: round $secondary; }
        #stats { height: auto; max-height: 12; border: round $secondary; }
        """
        BINDINGS = [
            Binding("space", "toggle", "play/pause"), Binding("right", "step(1)", "next"),
            Binding("left", "step(-1)", "previous"), Binding("pagedown", "step(10)", "+10"),
            Binding("pageup", "step(-10)", "-10"), Binding("home", "jump(0)", "first"),
            Binding("end", "jump(-1)", "last"), Binding("plus,equals_sign", "speed(2)", "faster"),
            Binding("minus", "speed(0.5)", "slower"), Binding("q,escape", "quit", "quit"),
        ]

        def __init__(self) -> None:
            super().__init__()
            self.tl, self.speed = tl, speed
            self.pos = min(max(start, 0), len(tl) - 1)
            self.playing = autoplay
            self._timer = None

        def compose(self) -> ComposeResult:
            yield Static(id="title")
            with VerticalScroll(id="textbox"):
                yield Static(id="text")
            yield Static(id="strip")
            yield Static(id="stats")

        def on_mount(self) -> None:
            self.show()
            if self.playing:
                self._schedule()

        # -- drawing
        def show(self) -> None:
            tl, i = self.tl, self.pos
            h = tl.trace.header
            model = (h.get("model") or {}).get("name", "?")
            state = "playing" if self.playing else "paused"
            row = f" row {tl.row}" if tl.row is not None else ""
            self.query_one("#title", Static).update(Text(
                f" moestream replay {os.path.basename(tl.trace.path)}: {h.get('command')} of {model} on "
                f"{h.get('device')}{row} | token {i + 1}/{len(tl)} | {state} x{self.speed:g} | "
                f"space play/pause, arrows step, q quit", no_wrap=True, overflow="ellipsis"))
            before, cur = text_upto(tl, i)
            text = Text()
            text.append(before)
            text.append(cur if cur else " ", style="reverse bold")
            self.query_one("#text", Static).update(text)
            self.query_one("#textbox", VerticalScroll).scroll_end(animate=False)
            width = max(10, (self.size.width or 80) - 50)
            self.query_one("#strip", Static).update(Text("\n".join(strip_lines(tl, i, width)), no_wrap=True))
            self.query_one("#stats", Static).update(Text("\n".join(stats_lines(tl, i))))

        # -- playback
        def _schedule(self) -> None:
            if self._timer is not None:
                self._timer.stop()
                self._timer = None
            if self.playing and self.pos + 1 < len(self.tl):
                delay = self.tl.records[self.pos + 1]["dt"] / self.speed
                self._timer = self.set_timer(max(delay, 0.001), self._advance)
            elif self.playing:
                self.playing = False
                self.show()

        def _advance(self) -> None:
            self._timer = None
            if self.playing and self.pos + 1 < len(self.tl):
                self.pos += 1
                self.show()
                self._schedule()

        def action_toggle(self) -> None:
            self.playing = not self.playing
            if self.playing and self.pos + 1 >= len(self.tl):
                self.pos = 0  # at the end: play again from the start
            self.show()
            self._schedule()

        def action_step(self, k: int) -> None:
            self.playing = False
            self.pos = min(max(self.pos + k, 0), len(self.tl) - 1)
            self._schedule()
            self.show()

        def action_jump(self, k: int) -> None:
            self.action_step((k if k >= 0 else len(self.tl) - 1) - self.pos)

        def action_speed(self, f: float) -> None:
            self.speed = min(max(self.speed * f, 1 / 64), 64)
            self.show()
            self._schedule()

    return ReplayApp()


# ------------------------------------------------------------------------------------------------ HTML
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1d2330;background:#fafbfc}
h1{font-size:17px;margin:0 0 4px} #meta{color:#555;margin-bottom:10px;font-size:12.5px}
#text{white-space:pre-wrap;font:13px/1.55 ui-monospace,monospace;background:#fff;border:1px solid #d7dbe2;
 border-radius:6px;padding:10px;max-height:220px;overflow:auto}
.tok{border-radius:2px;cursor:pointer} .tok:hover{background:#ffe9a8;outline:1px solid #e0b000}
.tok.prefill{color:#6a7280} .tok.later{color:#aab0bb} .tok.cur{background:#2f6fde;color:#fff}
#controls{margin:12px 0 6px;display:flex;flex-wrap:wrap;gap:4px 14px;align-items:center} #scrub{flex:1 1 420px}
#cur-text{white-space:pre;background:#eef2f8;padding:0 3px}
#readout{font:12.5px/1.5 ui-monospace,monospace;background:#fff;border:1px solid #d7dbe2;border-radius:6px;
 padding:8px 10px;white-space:pre-wrap}
.plot{display:block;margin-top:6px;background:#fff;border:1px solid #e3e6ea;border-radius:4px}
.plot text{font:11px system-ui,sans-serif;fill:#444} .plot .line{fill:none;stroke-width:1.5}
.plot .cursor{stroke:#d62828;stroke-width:1.5} .plot .dot{fill:#d62828}
#tip{position:fixed;pointer-events:none;background:#1d2330;color:#fff;font:12px/1.45 ui-monospace,monospace;
 padding:6px 8px;border-radius:5px;white-space:pre;display:none;z-index:9}
"""

_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('trace-data').textContent);
const N = D.tokens.length, W = 940, H = 92, PADL = 150, PADR = 10;
const xs = i => PADL + (i + 0.5) * (W - PADL - PADR) / N;
const fmt = (v, d, u) => v === null || v === undefined ? '-' : v.toFixed(d) + (u || '');
function bytes(n){ if (n >= 1073741824) return (n/1073741824).toFixed(2)+' GiB';
  if (n >= 1048576) return (n/1048576).toFixed(1)+' MiB'; return (n/1024).toFixed(1)+' KiB'; }
function lines(i){
  const r = D.tokens[i], s = D.series;
  const h = r.hits.reduce((a,b)=>a+b,0), m = r.misses.reduce((a,b)=>a+b,0);
  const what = r.phase === 'prefill' ? 'prefill of ' + r.n + ' prompt tokens' :
    (r.eog ? 'end-of-generation token' : 'decode') + (r.id !== undefined ? ', id ' + r.id : '');
  const g = r.gpu;
  return ['token ' + (i+1) + '/' + N + '  ' + what,
    'text ' + JSON.stringify(r.text),
    'latency ' + (1000*r.dt).toFixed(2) + ' ms (' + fmt(r.dt > 0 ? r.n/r.dt : null, 1) + ' tok/s)  IO wait ' +
      (1000*r.io_wait_s).toFixed(2) + ' ms  read ' + bytes(r.read_bytes),
    'experts ' + h + ' hits, ' + m + ' misses (hit rate ' + fmt(s.hit_pct[i], 1, '%') + ')',
    D.load_name + ' ' + fmt(s.load_pct[i], 0) + '  ' + (g ? 'GPU power ' + g.power_w.toFixed(0) + ' W  GPU memory ' +
      bytes(g.mem_bytes) : 'power -') + '  RSS ' + bytes(r.rss || 0) + '  t ' + r.t.toFixed(3) + ' s'];
}
const text = document.getElementById('text'), tip = document.getElementById('tip');
const spans = [];
D.tokens.forEach((r, i) => {
  const s = document.createElement('span');
  s.className = 'tok' + (r.phase === 'prefill' ? ' prefill' : '');
  s.dataset.i = i; s.textContent = r.text === '' ? '\u200b' : r.text;
  s.addEventListener('mouseenter', e => { tip.textContent = lines(i).join('\n'); tip.style.display = 'block';
    const tw = tip.offsetWidth, th = tip.offsetHeight;
    tip.style.left = Math.max(4, Math.min(e.clientX + 12, window.innerWidth - tw - 8)) + 'px';
    tip.style.top = (e.clientY + 14 + th > window.innerHeight ? e.clientY - th - 10 : e.clientY + 14) + 'px';
    document.getElementById('hovered').textContent = String(i + 1); });
  s.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  s.addEventListener('click', () => set(i));
  text.appendChild(s); spans.push(s);
});
const NS = 'http://www.w3.org/2000/svg', cursors = [];
function el(tag, attrs, parent){ const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
D.plots.forEach(p => {
  const svg = el('svg', {class: 'plot', id: 'plot-' + p.key, width: W, height: H, viewBox: '0 0 ' + W + ' ' + H},
                 document.getElementById('plots'));
  const vals = D.series[p.key], got = vals.filter(v => v !== null);
  const top = got.length ? Math.max(...got, p.min_top || 0) : 1;
  const y = v => H - 14 - (H - 24) * (top > 0 ? v / top : 0);
  el('text', {x: 6, y: 16}, svg).textContent = p.name;
  el('text', {x: 6, y: 32}, svg).textContent = 'max ' + (got.length ? top.toFixed(1) : '-');
  el('line', {x1: PADL, x2: W - PADR, y1: H - 14, y2: H - 14, stroke: '#ccd'}, svg);
  if (!got.length) { el('text', {x: PADL + 8, y: H / 2}, svg).textContent = 'no readings in this trace'; }
  let d = '', pen = false;
  vals.forEach((v, i) => { if (v === null) { pen = false; return; }
    d += (pen ? ' L' : ' M') + xs(i).toFixed(1) + ' ' + y(v).toFixed(1); pen = true; });
  if (d) el('path', {class: 'line', d: d, stroke: p.color}, svg);
  if (N === 1 && got.length) el('circle', {cx: xs(0), cy: y(vals[0]), r: 2.5, fill: p.color}, svg);
  const cur = el('line', {class: 'cursor', y1: 4, y2: H - 14}, svg);
  const dot = el('circle', {class: 'dot', r: 3.5}, svg);
  cursors.push({cur, dot, vals, y});
  svg.addEventListener('click', e => { const b = svg.getBoundingClientRect();
    const i = Math.floor((e.clientX - b.left - PADL) / ((W - PADL - PADR) / N));
    if (i >= 0 && i < N) set(i); });
});
const scrub = document.getElementById('scrub'), readout = document.getElementById('readout');
scrub.max = N - 1;
let at = -1;
function set(i){
  i = Math.max(0, Math.min(N - 1, i|0));
  if (at >= 0) spans[at].classList.remove('cur');
  at = i; scrub.value = i;
  spans.forEach((s, k) => s.classList.toggle('later', k > i));
  spans[i].classList.add('cur');
  readout.textContent = lines(i).join('\n');
  document.getElementById('pos').textContent = 'token ' + (i + 1) + '/' + N;
  document.getElementById('cur-text').textContent = D.tokens[i].text;
  cursors.forEach(c => { const x = xs(i); c.cur.setAttribute('x1', x); c.cur.setAttribute('x2', x);
    const v = c.vals[i]; if (v === null) { c.dot.setAttribute('display', 'none'); } else {
      c.dot.removeAttribute('display'); c.dot.setAttribute('cx', x); c.dot.setAttribute('cy', c.y(v)); } });
}
scrub.addEventListener('input', () => set(+scrub.value));
window.moestreamReplay = {set: set, count: N};
set(N - 1);
})();
"""


def page(tl: Timeline) -> str:
    """The self-contained HTML page of ``tl`` (see the module docstring)."""
    h = tl.trace.header
    model = h.get("model") or {}
    plots = [
        {"key": "latency_ms", "name": "latency ms", "color": "#2f6fde"},
        {"key": "io_wait_ms", "name": "IO wait ms", "color": "#c2410c"},
        {"key": "hit_pct", "name": "expert hit rate %", "color": "#15803d", "min_top": 100},
        {"key": "load_pct", "name": tl.load_name, "color": "#7c3aed", "min_top": 100},
        {"key": "power_w", "name": tl.power_name if tl.gpu else "power W", "color": "#b45309"},
    ]
    data = {"tokens": tl.records, "plots": plots, "load_name": tl.load_name,
            "series": {"latency_ms": tl.latency_ms, "io_wait_ms": tl.io_wait_ms, "hit_pct": tl.hit_pct,
                       "load_pct": tl.load_pct, "power_w": tl.power_w}}
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # no </script> or <!-- in the page
    row = f", row {tl.row}" if tl.row is not None else ""
    title = f"moestream replay: {model.get('name', '?')}{row}"
    meta = (f"{h.get('command')} of {model.get('name', '?')} ({model.get('arch', '?')}, top-{model.get('top_k', '?')} "
            f"of {model.get('n_experts', '?')} experts) on {h.get('device')} | {h.get('started', '')} | "
            f"{(h.get('machine') or {}).get('host', '')} | {summary_line(tl.trace, tl.records)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src \
'unsafe-inline'; img-src data:">
<title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div id="meta">{html.escape(meta)}</div>
<div id="text" aria-label="generated text"></div>
<div id="controls"><label for="scrub">scrub</label><input type="range" id="scrub" min="0" max="0" value="0">
<span id="pos"></span> <span>current: <code id="cur-text"></code></span>
<span>hovered: <span id="hovered">-</span></span></div>
<div id="readout"></div>
<div id="plots"></div>
<div id="tip"></div>
<script type="application/json" id="trace-data">{blob}</script>
<script>{_JS}</script>
</body></html>
"""


def write_page(tl: Timeline, path: str) -> None:
    """Write :func:`page` to ``path`` (atomically, as bench's outputs: output.write_output); OutputError."""
    from .output import write_output
    write_output(path, page(tl), "--html", "the page")
