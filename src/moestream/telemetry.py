"""GPU telemetry for ``moestream bench``: utilisation, memory and power sampled in a thread while a test runs.

:class:`GpuSampler` reads a :class:`GpuSample` (utilisation %, memory used in bytes, power in W) from a source
every ``interval`` seconds (50 ms by default) on a daemon thread, each sample stamped with
``time.monotonic()``. :func:`summarize` turns the samples of a time window into a :class:`GpuSummary`: the mean
utilisation, the mean power and the peak memory; :func:`merge` combines summaries (a row's tests into the row).

The source is any callable returning a :class:`GpuSample`. :func:`nvml_source` gives NVML's (nvidia-ml-py,
imported as ``pynvml``: the project's optional ``gpu`` extra), for one GPU index (``CUDA_VISIBLE_DEVICES``
is not applied: NVML numbers every GPU of the machine), or None where the package or a GPU is missing; bench
then shows "-" in the GPU columns. Memory used is the device's (``nvmlDeviceGetMemoryInfo().used``: every
process on it, the CUDA context included), utilisation NVML's "percent of time a kernel was running" over its
own sample period, power the board's draw (``nvmlDeviceGetPowerUsage``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

GiB = 2**30


@dataclass(frozen=True)
class GpuSample:
    """One reading: when (``time.monotonic()``), utilisation %, memory used (bytes), power (W)."""

    t: float
    util_pct: float
    mem_bytes: int
    power_w: float


@dataclass(frozen=True)
class GpuSummary:
    """The samples of one window: their count, mean utilisation %, mean power W, peak memory used GiB."""

    samples: int
    util_mean_pct: float
    power_mean_w: float
    mem_peak_gib: float

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples: list[GpuSample], start: float | None = None, end: float | None = None) -> GpuSummary | None:
    """Summary of the samples taken in [``start``, ``end``] (None: unbounded); None when there are none."""
    s = [x for x in samples if (start is None or x.t >= start) and (end is None or x.t <= end)]
    if not s:
        return None
    return GpuSummary(samples=len(s), util_mean_pct=sum(x.util_pct for x in s) / len(s),
                      power_mean_w=sum(x.power_w for x in s) / len(s),
                      mem_peak_gib=max(x.mem_bytes for x in s) / GiB)


def summarize_windows(samples: list[GpuSample], windows: list[tuple[float, float]]) -> GpuSummary | None:
    """One summary of the samples in any of ``windows`` (e.g. the timed repetitions of one test, without the
    warm-up and the gaps between them); a sample in two overlapping windows counts once."""
    s = [x for x in samples if any(a <= x.t <= b for a, b in windows)]
    return summarize(s)


def merge(parts: list[GpuSummary | dict | None]) -> GpuSummary | None:
    """Summaries (or their ``as_dict``) combined as if their samples had been summarized together: means
    weighted by sample count, the largest peak. None entries are skipped; None when nothing is left."""
    got = [p if isinstance(p, GpuSummary) else GpuSummary(**p) for p in parts if p]
    n = sum(p.samples for p in got)
    if not n:
        return None
    return GpuSummary(samples=n, util_mean_pct=sum(p.util_mean_pct * p.samples for p in got) / n,
                      power_mean_w=sum(p.power_mean_w * p.samples for p in got) / n,
                      mem_peak_gib=max(p.mem_peak_gib for p in got))


class GpuSampler:
    """Samples ``source`` every ``interval`` seconds on a daemon thread from :meth:`start` to :meth:`stop`.

    ``source()`` returns a :class:`GpuSample`; an exception from it ends sampling quietly (the GPU went away:
    the samples so far are kept). ``samples`` holds every reading; :meth:`window` summarizes a time range of
    them. Also a context manager (``with GpuSampler(src) as s: ...``). One reading is taken at start and one
    at stop, so a window shorter than ``interval`` still has samples near its ends.
    """

    def __init__(self, source: Callable[[], GpuSample], interval: float = 0.05):
        self.source, self.interval = source, interval
        self.samples: list[GpuSample] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _read(self) -> bool:
        try:
            s = self.source()
        except Exception:  # noqa: BLE001 - telemetry never fails a benchmark
            return False
        with self._lock:
            self.samples.append(s)
        return True

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            if not self._read():
                return

    def start(self) -> GpuSampler:
        if self._thread is None:
            self._read()
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None and not self._done.is_set():
            self._done.set()
            self._thread.join()
            self._read()

    def window(self, start: float | None = None, end: float | None = None) -> GpuSummary | None:
        with self._lock:
            return summarize(list(self.samples), start, end)

    def windows(self, windows: list[tuple[float, float]]) -> GpuSummary | None:
        with self._lock:
            return summarize_windows(list(self.samples), windows)

    def __enter__(self) -> GpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def nvml_source(index: int = 0) -> Callable[[], GpuSample] | None:
    """NVML reader of GPU ``index``, or None where ``pynvml`` (nvidia-ml-py) is not installed or NVML finds no
    such GPU (no driver, no GPU). Imported lazily: moestream runs without it."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - pynvml.NVMLError and friends: no GPU here
        return None

    def read() -> GpuSample:
        t = time.monotonic()
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # mW
        return GpuSample(t, float(util), int(mem), float(power))

    return read


def sampler(interval: float = 0.05, index: int = 0) -> GpuSampler | None:
    """A started :class:`GpuSampler` on NVML's GPU ``index``, or None where :func:`nvml_source` is None."""
    src = nvml_source(index)
    return None if src is None else GpuSampler(src, interval).start()
