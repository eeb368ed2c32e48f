"""Per-token run traces (``--trace FILE`` of ``run``, ``bench`` and ``serve``): what each token cost, for replay.

Not the *routing* trace (``--routing-trace``, experts/trace.py: every slot request, for the replacement
simulators); this one is a timeline of tokens with the machine's state, read back by ``moestream replay``.

File format (JSON lines, UTF-8; ``FORMAT`` / ``VERSION``). Every line is an object with a ``kind``:

- line 1, ``"header"``: ``format``, ``version``, ``command`` (run, bench, serve), ``started`` (UTC, ISO 8601),
  ``model`` (path, name, arch, experts, top-k, file bytes), ``layers`` (the MoE layer numbers: the order of every
  record's ``hits`` / ``misses`` lists), ``options`` (the command's options), ``machine`` (host, platform, CPUs,
  memory, GPU), ``versions`` (moestream, Python, torch, numpy, nvidia-ml-py), ``device`` (cpu or cuda:N),
  ``store`` (streaming or resident, slots per layer, policy, IO mode), ``gpu_telemetry`` (``"nvml"`` or null).
- ``"token"``: one interval of the timeline. A generation gives one record of ``phase`` ``"prefill"`` for the
  whole prompt (``n``: its tokens, ``text``: its text), then one of phase ``"decode"`` per generated token
  (``n`` 1, ``id``, ``text``: the text the token releases, possibly "" mid-character; ``eog``: true on the
  end-of-generation token, which is not part of the output). A generated token's interval runs from the end of
  the previous record to the moment the token was sampled: it holds the forward pass of the token before it (the
  first generated token is sampled from the prefill's logits, so its record holds only its sampling). Fields:
  ``i`` (record number in the file, from 0), ``t`` (seconds from the trace's start to the end of the interval),
  ``dt`` (the interval's seconds), ``hits`` / ``misses`` (expert uses that found / had to read their expert,
  per MoE layer in the header's ``layers`` order; see StoreStats), ``read_bytes`` (expert bytes read into the
  slots), ``io_wait_s`` (seconds the compute thread was blocked on expert reads: StoreStats.stall_seconds), ``rss``
  (resident set size at the end, bytes: read at most every ``RSS_SECONDS``, the latest reading in between),
  ``cpu_pct`` (the process's CPU time over the interval's wall time,
  x 100: 400 is four cores busy), ``gpu`` (null without GPU telemetry, else ``util_pct``, ``mem_bytes``,
  ``power_w``: the mean of the NVML samples taken in the interval, ``samples`` their count; with 0 the interval
  was shorter than the sampling period and holds the latest reading before its end). Optional tags name where
  the record belongs: ``row``, ``test``, ``rep`` (bench), ``request`` (serve), ``turn`` (-cnv).
- ``"end"``: after a generation's records: its tags, ``stop_reason``, ``n_prompt``, ``n_decode``,
  ``prompt_tps``, ``decode_tps``, ``hit_rate``, ``disk_bytes`` (bytes the process made the disk read over the
  generation: /proc/self/io, page-cache hits excluded; per generation, not per token: reading it costs ~30 us).

Cost: a record takes about 50-100 us of the generating thread's time (the counters, /proc/self/statm, one
line formatted by hand; the file is flushed at most every ``FLUSH_SECONDS``): benchmarks/trace_overhead.py
measures it against the time per token.
- ``"row"`` (bench): a row's ``row`` number, ``label`` and, when it ran here, its ``store``.

:class:`TraceWriter` writes it (``header``, then ``begin`` / ``token`` / ``end`` per generation, ``close``);
:func:`read_trace` reads it back, with :class:`RunTraceError` (one line naming the file and the problem) for a
file that is missing, not JSON lines, or of another format.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import MoestreamError, OutputError

FORMAT = "moestream-run-trace"
VERSION = 1
#: NVML sampling period of a trace's GPU readings (seconds)
GPU_INTERVAL = 0.02
#: the trace file is flushed when a record comes this many seconds after the last flush (and at the end)
FLUSH_SECONDS = 0.5
#: a record's RSS is read at most this often (seconds); records in between repeat the latest reading
RSS_SECONDS = 0.05


class RunTraceError(MoestreamError):
    """A run trace file that cannot be read: missing, not JSON lines, another format, a malformed record."""


# ------------------------------------------------------------------------------------------------ cheap probes
class _Proc:
    """This process's RSS (/proc/self/statm), disk reads (/proc/self/io) and CPU seconds, read through file
    descriptors kept open (a few microseconds per reading)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm = self._open("/proc/self/statm")
        self._io = self._open("/proc/self/io")
        self._rss, self._rss_t = 0, -1e9

    @staticmethod
    def _open(path: str) -> int | None:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError:
            return None

    def rss(self, now: float | None = None) -> int:
        """Bytes resident; with ``now`` (time.monotonic()) the last reading when it is younger than RSS_SECONDS
        (reading /proc/self/statm costs ~20 us in a busy multi-threaded process; RSS moves slowly)."""
        if now is not None and now - self._rss_t < RSS_SECONDS:
            return self._rss
        if self._statm is None:
            return 0
        try:
            self._rss = int(os.pread(self._statm, 256, 0).split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            self._rss = 0
        self._rss_t = now if now is not None else time.monotonic()
        return self._rss

    def disk_bytes(self) -> int:
        if self._io is None:
            return 0
        try:
            data = os.pread(self._io, 1024, 0)
            at = data.index(b"\nread_bytes:") + 12
            return int(data[at:data.index(b"\n", at)])
        except (OSError, ValueError):
            return 0

    @staticmethod
    def cpu_seconds() -> float:
        return time.process_time()  # CLOCK_PROCESS_CPUTIME_ID: every thread, ns resolution (os.times: 10 ms ticks)

    def close(self) -> None:
        for fd in (self._statm, self._io):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._statm = self._io = None


class GpuWindow:
    """Per-interval GPU readings from a running :class:`~moestream.telemetry.GpuSampler`: :meth:`reading` gives the
    mean of the samples taken in (start, end] and their count, or the latest sample before ``end`` with count 0
    when none fell inside (an interval shorter than the sampling period). Samples are consumed in order, so each
    call scans only the new ones."""

    def __init__(self, sampler) -> None:  # noqa: ANN001 - telemetry.GpuSampler
        self.sampler = sampler
        self._next = 0
        self._last = None

    def reading(self, start: float, end: float) -> dict | None:
        samples = self.sampler.samples  # append-only list (the sampler thread appends under its lock)
        n = len(samples)
        util = power = 0.0
        mem = 0
        k = 0
        i = self._next
        while i < n and samples[i].t <= end:
            s = samples[i]
            if s.t > start:
                util += s.util_pct
                power += s.power_w
                mem = max(mem, s.mem_bytes)
                k += 1
            self._last = s
            i += 1
        self._next = i
        if k:
            return {"util_pct": round(util / k, 2), "mem_bytes": mem, "power_w": round(power / k, 2), "samples": k}
        s = self._last
        if s is None:
            return None
        return {"util_pct": s.util_pct, "mem_bytes": s.mem_bytes, "power_w": round(s.power_w, 2), "samples": 0}


def gpu_index(device: str) -> int:
    """NVML index of a torch CUDA device name (``cuda`` / ``cuda:N``), through ``CUDA_VISIBLE_DEVICES`` when it
    lists numbers (NVML numbers every GPU of the machine, torch only the visible ones)."""
    n = int(device.split(":")[1]) if ":" in device else 0
    vis = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if vis and all(x.isdigit() for x in vis) and n < len(vis):
        return int(vis[n])
    return n


# ------------------------------------------------------------------------------------------------ header
def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name, dist in (("moestream", "moestream"), ("torch", "torch"), ("numpy", "numpy"),
                       ("nvidia-ml-py", "nvidia-ml-py")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = None
    return out


def _machine(device: str) -> dict:
    import psutil

    out = {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "memory_bytes": psutil.virtual_memory().total, "gpu": None}
    if device.startswith("cuda"):
        with contextlib.suppress(Exception):
            import torch
            out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def model_info(model) -> dict:  # noqa: ANN001 - models.base.MoEModel
    """The header's ``model``: path, name, arch, MoE layers, experts, top-k, file bytes."""
    g = model.gguf
    return {"path": os.path.abspath(g.path), "name": os.path.basename(g.path), "arch": model.arch,
            "moe_layers": len(model.layout.moe_layers), "n_experts": model.n_experts, "top_k": model.top_k,
            "file_bytes": getattr(g, "file_bytes", None)}


def store_info(store) -> dict | None:  # noqa: ANN001 - experts.pool.ExpertStore
    """The header's ``store``: streaming or resident, slots per layer, pool bytes, IO mode, host tier bytes."""
    if store is None:
        return None
    if not store.streaming:
        return {"streaming": False}
    per = list(store.slots_per_layer().values())
    tier = getattr(store, "tier", None)
    return {"streaming": True, "slots_per_layer": per, "pool_bytes": store.pool_bytes,
            "io": "direct" if store.direct else "buffered", "io_threads": store.reader.io_threads,
            "host_tier_bytes": None if tier is None else tier.nbytes}


def jsonable(options: dict) -> dict:
    """``options`` (e.g. ``vars(args)``) with what JSON cannot hold dropped (functions) or made text."""
    out = {}
    for k, v in options.items():
        if callable(v):
            continue
        out[k] = v if v is None or isinstance(v, (bool, int, float, str, list, dict)) else str(v)
    return out


# ------------------------------------------------------------------------------------------------ writer
class TraceWriter:
    """Writes a run trace (the module docstring has the format) to ``path``.

    Usage: ``header(...)`` once, then per generation ``begin(model, **tags)``, ``token(text, ...)`` per record
    (``phase="prefill"`` once for the prompt, then one per generated token) and ``end(gen)``; ``close()`` at the
    end. :meth:`follow` does the per-generation part around a :class:`~moestream.engine.Generation`. Each record
    measures from the end of the previous one (or ``begin``) to the call.

    The lines go to a temporary file beside ``path`` (flushed per record: a crash leaves ``.PATH.*.tmp`` to read),
    renamed onto ``path`` by :meth:`close`; ``abort()`` removes it instead. A path that is not a regular file (a
    FIFO, /dev/null) is written into directly. OutputError naming ``option`` when the file cannot be written.
    ``gpu``: a device name (``cuda:0``) to sample with NVML every :data:`GPU_INTERVAL` seconds (nothing when
    nvidia-ml-py or the GPU is missing: records hold ``gpu`` null); None: no GPU telemetry. Thread-safe (one lock
    per record), so a server's worker thread can write while another closes it; but it follows one generation
    at a time (each record measures from the previous one), as the engine runs them: a server that interleaved
    generations would need one writer each.
    """

    def __init__(self, path: str, gpu: str | None = None, option: str = "--trace", *, header_written: bool = False):
        self.path, self.option = path, option
        self._lock = threading.Lock()
        self._proc = _Proc()
        self._t0 = time.monotonic()
        self._i = 0
        self._flushed = self._t0
        self._tag_json = ""
        self._disk0 = 0
        self._closed = False
        self._headed = header_written
        self._store = None
        self._tags: dict = {}
        self._mark: tuple | None = None
        self._layers: list[int] = []
        self._sampler = None
        self._gpu: GpuWindow | None = None
        self.gpu_device = gpu if gpu and gpu.startswith("cuda") else None
        if self.gpu_device is not None:
            from .telemetry import GpuSampler, nvml_source
            src = nvml_source(gpu_index(self.gpu_device))
            if src is not None:
                self._sampler = GpuSampler(src, GPU_INTERVAL).start()
                self._gpu = GpuWindow(self._sampler)
        real = os.path.realpath(path)
        self._real, self._tmp = real, None
        try:
            try:
                st = os.stat(real)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                self._f = open(real, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
            else:
                fd, self._tmp = tempfile.mkstemp(prefix="." + os.path.basename(real) + ".", suffix=".tmp",
                                                 dir=os.path.dirname(real))
                mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
                os.fchmod(fd, mode)
                self._f = os.fdopen(fd, "w", encoding="utf-8")
        except OSError as e:
            self._stop_sampler()
            raise OutputError(f"{option} {path}: cannot write the trace ({e.strerror or e})") from None

    @property
    def records(self) -> int:
        """``"token"`` records written so far."""
        return self._i

    # -- lines
    def _write(self, obj: dict | str) -> None:
        try:
            self._f.write((obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
                          + "\n")
            now = time.monotonic()
            if now - self._flushed >= FLUSH_SECONDS or not isinstance(obj, str):
                self._f.flush()
                self._flushed = now
        except OSError as e:
            raise OutputError(f"{self.option} {self.path}: cannot write the trace ({e.strerror or e})") from None

    def header(self, model=None, command: str = "run", options: dict | None = None,  # noqa: ANN001
               **extra: Any) -> None:
        """Line 1. ``model``: the loaded MoEModel (its file, layers and store go in), or None with ``extra``'s
        ``model`` / ``layers`` given instead (bench's parent process). ``options``: the command's options (e.g.
        ``vars(args)``; made JSON-safe). ``extra``: more header fields."""
        with self._lock:
            if self._headed:
                raise RuntimeError("the trace header is already written")
            device = str(getattr(model, "device", None) or extra.get("device") or "cpu")
            h = {"kind": "header", "format": FORMAT, "version": VERSION, "command": command,
                 "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "model": model_info(model) if model is not None else None,
                 "layers": list(model.layout.moe_layers) if model is not None else [],
                 "options": jsonable(options or {}), "machine": _machine(device), "versions": _versions(),
                 "device": device, "store": store_info(getattr(model, "store", None)) if model is not None else None,
                 "gpu_telemetry": "nvml" if self._gpu is not None else None}
            h.update(extra)
            self._headed = True
            self._write(h)

    def record(self, obj: dict) -> None:
        """Write another line as it is (e.g. bench's ``"row"`` lines); ``kind`` must be set."""
        with self._lock:
            self._write(obj)

    # -- one generation
    def _snapshot(self) -> tuple:
        store = self._store
        if store is None:
            counts: list = []
            stall = 0.0
            read = 0
        else:
            lc = store.layer_counts
            counts = [tuple(lc[layer]) for layer in self._layers]
            stall = store.stats.stall_seconds
            read = store.bytes_read
        return time.monotonic(), self._proc.cpu_seconds(), counts, stall, read

    def begin(self, model, **tags: Any) -> None:  # noqa: ANN001
        """Start a generation on ``model`` (its current store is read from here on): the next record measures from
        now. ``tags`` (``row=``, ``request=``, ...) go into every record until the next ``begin``."""
        with self._lock:
            self._store = model.store
            self._layers = list(model.layout.moe_layers)
            self._tags = {k: v for k, v in tags.items() if v is not None}
            self._tag_json = "".join(f",{json.dumps(k)}:{json.dumps(v, ensure_ascii=False)}"
                                     for k, v in self._tags.items())
            self._disk0 = self._proc.disk_bytes()
            self._mark = self._snapshot()

    def token(self, text: str, phase: str = "decode", n: int = 1, token_id: int | None = None,
              eog: bool = False) -> None:
        """One record: the interval from the previous record (or ``begin``) to now. ``text``: the prompt's text
        (prefill) or the text the token releases; ``n``: tokens in the record; ``token_id``: a decode token's id;
        ``eog``: the end-of-generation token (not part of the output)."""
        with self._lock:
            if self._mark is None:
                raise RuntimeError("TraceWriter.token before begin")
            now = self._snapshot()
            t0, c0, k0, s0, r0 = self._mark
            t1, c1, k1, s1, r1 = now
            self._mark = now
            dt = t1 - t0
            gpu = self._gpu.reading(t0, t1) if self._gpu is not None else None
            # formatted by hand: json.dumps of the whole record costs several times more (see FLUSH_SECONDS)
            line = (f'{{"kind":"token","i":{self._i}{self._tag_json},"phase":"{phase}","n":{n}'
                    + (f',"id":{int(token_id)}' if token_id is not None else "") + (',"eog":true' if eog else "")
                    + f',"text":{json.dumps(text, ensure_ascii=False)},"t":{t1 - self._t0:.6f},"dt":{dt:.6f}'
                    f',"hits":[{",".join([str(b[0] - a[0]) for a, b in zip(k0, k1, strict=True)])}]'
                    f',"misses":[{",".join([str(b[1] - a[1]) for a, b in zip(k0, k1, strict=True)])}]'
                    f',"read_bytes":{r1 - r0},"io_wait_s":{s1 - s0:.6f},"rss":{self._proc.rss(t1)}'
                    f',"cpu_pct":{100 * (c1 - c0) / dt if dt > 0 else 0.0:.1f}'
                    f',"gpu":{"null" if gpu is None else json.dumps(gpu)}}}')
            self._i += 1
            self._write(line)

    def end(self, gen) -> None:  # noqa: ANN001 - engine.Generation
        """After ``gen`` has finished: a record for its end-of-generation token (the interval that sampled it) when
        it stopped at one, then its ``"end"`` line."""
        if gen.eog is not None:
            self.token("", token_id=gen.eog, eog=True)
        st = gen.stats
        with self._lock:
            self._write({"kind": "end", **self._tags, "stop_reason": st.stop_reason, "n_prompt": st.n_prompt,
                         "n_decode": st.n_decode, "prompt_tps": round(st.prompt_tps, 3),
                         "decode_tps": round(st.decode_tps, 3), "hit_rate": round(st.hit_rate, 6),
                         "disk_bytes": self._proc.disk_bytes() - self._disk0})
            self._mark = None

    def follow(self, gen, tokenizer, prompt_text: str, model=None, **tags: Any) -> Iterator[int]:  # noqa: ANN001
        """Iterate ``gen`` (an unstarted Generation of ``model``, default ``gen.engine.model``), yielding its token
        ids and writing its records: the prompt's (``prompt_text``) when the prefill has run, then one per token
        (its text from ``tokenizer``'s stream decoder), then ``end``."""
        dec = tokenizer.stream_decoder()

        def record(tok: int) -> None:
            self.token(dec.push(tok), token_id=tok)

        return self._traced(iter(gen), gen, prompt_text, model, tags, record)

    def follow_events(self, events, gen, prompt_text: str, model=None, **tags: Any) -> Iterator:  # noqa: ANN001
        """:meth:`follow` around :mod:`moestream.textgen` events of ``gen`` (``iter(TextEvents(gen, ...))``,
        unstarted): yields the events, recording each token with the text it released (what a front end printed:
        stop-string hold-back and UTF-8 completion included), then ``end`` after the DoneEvent. Text a DoneEvent
        flushes (held back until the end) belongs to no token and is not recorded."""
        from .textgen import DoneEvent

        def record(ev) -> None:  # noqa: ANN001
            if isinstance(ev, DoneEvent):
                self.end(gen)
            else:
                self.token(ev.text, token_id=ev.id)

        return self._traced(events, gen, prompt_text, model, tags, record)

    def _traced(self, items: Iterator, gen, prompt_text: str, model, tags: dict, record) -> Iterator:  # noqa: ANN001
        """Yield ``items`` (``gen``'s tokens or events), ``record(item)`` before each; the prompt's record when the
        prefill has run; ``end`` when the generation is over (if ``record`` did not write it)."""
        self.begin(model if model is not None else gen.engine.model, **tags)
        n_prompt = len(gen.tokens)
        gen.on_prefill = lambda g: self.token(prompt_text, phase="prefill", n=n_prompt)
        try:
            for item in items:
                record(item)
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
            if self._mark is not None and not self._closed:
                self.end(gen)

    # -- the file
    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    def _shut(self) -> bool:
        """Mark closed and stop the samplers (under the lock); False when it was closed already."""
        if self._closed:
            return False
        self._closed = True
        self._stop_sampler()
        self._proc.close()
        return True

    def close(self) -> None:
        """Finish the file: flush, close, rename the temporary file onto ``path``. Idempotent."""
        with self._lock:
            if not self._shut():
                return
            try:
                self._f.close()
                if self._tmp is not None:
                    os.replace(self._tmp, self._real)
            except OSError as e:
                self._discard()
                raise OutputError(f"{self.option} {self.path}: cannot write the trace ({e.strerror or e})") from None

    def abort(self) -> None:
        """Give up (the run failed): close and remove the temporary file; ``path`` is left as it was."""
        with self._lock:
            if not self._shut():
                return
            with contextlib.suppress(OSError):
                self._f.close()
            self._discard()

    def _discard(self) -> None:
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:  # noqa: ANN001
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            self.close()
        else:
            self.abort()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def check_trace_path(path: str, inputs: list[str] = (), option: str = "--trace") -> None:
    """ConfigError, before the model runs, when ``--trace PATH`` cannot be written or names a model file."""
    from .output import check_json_path
    check_json_path(path, list(inputs), option=option, what="the trace")


# ------------------------------------------------------------------------------------------------ reader
TOKEN_FIELDS = ("phase", "n", "text", "t", "dt", "hits", "misses", "read_bytes", "io_wait_s")


@dataclass
class RunTrace:
    """A run trace read back: its header, its ``"token"`` records (in file order), ``"end"`` and ``"row"`` lines."""

    path: str
    header: dict
    tokens: list[dict] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return list(self.header.get("layers") or [])

    def select(self, row: int | None) -> list[dict]:
        """The token records of bench row ``row`` (None: every record)."""
        if row is None:
            return list(self.tokens)
        return [r for r in self.tokens if r.get("row") == row]


def read_trace(path: str) -> RunTrace:
    """The trace in ``path``. RunTraceError (one line naming the file and the problem) when it is missing,
    unreadable, not UTF-8 JSON lines, not a moestream run trace (a routing trace is named as one), of another
    version, or holds a malformed record (its line number)."""
    if not str(path).strip():
        raise RunTraceError("the trace file name is empty: give the FILE that run --trace FILE wrote")
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise RunTraceError(f"{path}: is a directory, not a trace file")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise RunTraceError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise RunTraceError(f"{path}: not a moestream run trace (not UTF-8 text at byte {e.start})") from None
    except OSError as e:
        raise RunTraceError(f"{path}: cannot read it ({e.strerror or e})") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise RunTraceError(f"{path}: empty, not a moestream run trace (write one with moestream run --trace FILE)")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        raise RunTraceError(f"{path}: not a moestream run trace (line 1 is not JSON; write one with moestream run "
                            f"--trace FILE)") from None
    if isinstance(head, dict) and head.get("format") == "moestream-routing-trace":
        raise RunTraceError(f"{path}: a routing trace (run --routing-trace; moestream trace reads it), not a run "
                            f"trace (run --trace FILE)")
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("kind") != "header":
        raise RunTraceError(f"{path}: not a moestream run trace (line 1 is not its header; write one with moestream "
                            f"run --trace FILE)")
    if head.get("version") != VERSION:
        raise RunTraceError(f"{path}: run trace version {head.get('version')!r}; this moestream reads version "
                            f"{VERSION}")
    n_layers = len(head.get("layers") or [])
    out = RunTrace(path=path, header=head)
    for n, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            last = " (the last line: a run cut off while writing?)" if n == len(lines) else ""
            raise RunTraceError(f"{path}: line {n} is not JSON{last}") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "token":
            missing = [k for k in TOKEN_FIELDS if k not in rec]
            bad = missing or rec["phase"] not in ("prefill", "decode") or not isinstance(rec["text"], str) \
                or not all(isinstance(rec[k], (int, float)) and not isinstance(rec[k], bool)
                           for k in ("t", "dt", "n", "read_bytes", "io_wait_s")) \
                or not isinstance(rec["hits"], list) or not isinstance(rec["misses"], list)
            if not bad and n_layers and (len(rec["hits"]) != n_layers or len(rec["misses"]) != n_layers):
                raise RunTraceError(f"{path}: line {n}: {len(rec['hits'])} hit counts for the header's {n_layers} "
                                    f"MoE layers")
            if bad:
                what = f"lacks {', '.join(missing)}" if missing else "has a field of the wrong type"
                raise RunTraceError(f"{path}: line {n}: a token record that {what}")
            out.tokens.append(rec)
        elif kind == "end":
            out.ends.append(rec)
        elif kind == "row":
            out.rows.append(rec)
        else:
            raise RunTraceError(f"{path}: line {n}: not a run trace record (kind {kind!r})")
    return out


def summary_line(trace: RunTrace, records: list[dict] | None = None) -> str:
    """``N records (P prefill, D decode), S s, H% expert hit rate, X GiB read`` of ``records`` (default all)."""
    recs = trace.tokens if records is None else records
    hits = sum(sum(r["hits"]) for r in recs)
    misses = sum(sum(r["misses"]) for r in recs)
    pre = sum(1 for r in recs if r["phase"] == "prefill")
    rate = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
    return (f"{len(recs)} records ({pre} prefill, {len(recs) - pre} decode), {sum(r['dt'] for r in recs):.3f} s, "
            f"expert hit rate {rate}, {sum(r['read_bytes'] for r in recs) / 2**30:.4f} GiB read")
