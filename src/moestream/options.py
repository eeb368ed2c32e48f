"""What the commands (cli.py, bench.py) share between parsed arguments and the library: the model path, the compute
threads and their bounds."""

from __future__ import annotations

import argparse
import os
from importlib import resources

from .errors import ConfigError

#: Upper bounds of thread options: more IO threads than this only adds contention; more compute threads than
#: 4 per CPU only oversubscribes the cores.
MAX_IO_THREADS = 256


def max_threads() -> int:
    """Upper bound of -t: 4 x the CPUs."""
    return 4 * (os.cpu_count() or 1)


def default_model_path() -> str:
    """The small Qwen3-MoE GGUF embedded in the package (src/moestream/data/default.gguf)."""
    return str(resources.files("moestream") / "data" / "default.gguf")


def model_path(args: argparse.Namespace) -> str:
    """``-m`` or, when it is not given, the embedded model; ConfigError for an empty ``-m ''`` (which must not
    silently mean the embedded model)."""
    if args.model == "":
        raise ConfigError("-m: the model path is empty (leave -m out to use the embedded model)")
    return args.model if args.model is not None else default_model_path()


def set_compute_threads(threads: int, matmul: str) -> None:
    """``-t``: with ``--matmul blocks`` the C kernels get ``threads`` and torch one (what is left to torch --
    norms, RoPE, attention, sampling -- is small per token, and torch's thread pool collapses when another job
    competes for the CPUs; one thread also keeps those ops' bits independent of -t); with ``dequant`` torch
    gets them all."""
    import torch

    from . import kernels
    kernels.set_threads(threads)
    torch.set_num_threads(1 if matmul == "blocks" else threads)


def choose_threads(cpus: int, torch_threads: int, running: list[int], load1: float) -> int:
    """The default -t from what :func:`default_threads` reads: ``cpus`` usable, at most ``torch_threads`` (torch's
    own default, the physical cores), less the busy ones -- the larger of the median of ``running`` (other
    runnable tasks, sampled) and the 1-minute load average ``load1`` rounded down -- at least 1."""
    busy = max(sorted(running)[len(running) // 2] if running else 0, int(load1))
    return max(1, min(cpus, torch_threads) - busy)


def default_threads() -> int:
    """Compute threads when -t is not given (:func:`choose_threads`): the CPUs this process may use
    (``os.sched_getaffinity``), at most torch's default, less the CPUs other jobs keep busy: the runnable tasks
    other than this one (``/proc/loadavg``'s running count, 5 reads over 20 ms) or the 1-minute load average.

    More compute threads than free CPUs collapses torch's thread pool (each of the thousands of small parallel
    ops per token waits for a thread the scheduler gave to the other job: 3.9 vs 43 tok/s measured), while one
    thread too few costs little; so a busy machine gets fewer threads."""
    import time

    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    running, load = [], 0.0
    try:
        for i in range(5):
            if i:
                time.sleep(0.005)
            with open("/proc/loadavg") as f:
                fields = f.read().split()
            running.append(int(fields[3].split("/")[0]) - 1)  # this process is running while it reads
            load = float(fields[0])
    except (OSError, ValueError, IndexError):
        running, load = [], 0.0
    return choose_threads(cpus, torch.get_num_threads(), running, load)
