"""Run a command inside a memory cgroup (cgroup v1 memory controller), page cache included.

This is how a benchmark reproduces "the model is larger than RAM" on a machine that has plenty: the
limit covers the process's anonymous memory *and* the file pages it reads, so an mmap baseline has to
page experts back in from disk just as it would on a small board. Needs root and a mounted v1 memory
controller (``/sys/fs/cgroup/memory``); ``MemCap.check()`` says plainly why not otherwise.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from dataclasses import dataclass

from .errors import ConfigError

CGROUP_V1 = "/sys/fs/cgroup/memory"
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
#: The smallest cap ``parse_cap`` accepts: a row's Python, torch and model must fit in it.
MIN_CAP = 64 * 2**20
#: The largest value cgroup v1's memory.limit_in_bytes takes.
MAX_CAP = 2**63 - 1


def parse_size(text: str) -> int:
    """'4GiB', '1.5G', '800MiB', '1TiB', '123456' -> bytes.

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 2 (as docker's ``-m 4g``); KB/MB/GB/TB powers of 10; B or no unit
    is bytes; case does not matter. ConfigError for anything else and for a size that is not positive.
    """
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    bad = f"--mem-cap: cannot read {text!r} as a size"
    try:  # plain decimals only: float() alone would also take 1e3, 1_000, +1, nan, inf
        if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", num):
            raise ValueError(num)
        value = float(num)
    except ValueError:
        raise ConfigError(f"{bad} (e.g. 4GiB, 800MiB; units B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB, TB)") from None
    if unit not in _UNITS:
        raise ConfigError(f"{bad}: unknown unit {unit!r} (B; K/KiB, M/MiB, G/GiB, T/TiB: powers of 2; KB, MB, GB, "
                          f"TB: powers of 10)")
    if not math.isfinite(value):
        raise ConfigError(f"{bad}: not a finite number")
    if value <= 0:
        raise ConfigError(f"{bad}: it must be positive")
    return int(value * _UNITS[unit])


def parse_cap(text: str) -> int:
    """``--mem-cap``'s value in bytes: a size (``parse_size``) of at least MIN_CAP (64 MiB); ConfigError otherwise."""
    n = parse_size(text)
    if n < MIN_CAP:
        raise ConfigError(f"--mem-cap {text}: {n} bytes is below the 64 MiB minimum (a row's Python and torch need "
                          f"more; a number without a unit is bytes)")
    if n > MAX_CAP:
        raise ConfigError(f"--mem-cap {text}: {n} bytes is more than a memory cgroup can be given (2^63 - 1)")
    return n


@dataclass
class CappedResult:
    """returncode, stdout, stderr of the command; peak_bytes: the cgroup's max usage (page cache included);
    oom_killed: the kernel's OOM killer fired inside the cgroup."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    oom_killed: bool


class MemCap:
    """A memory limit in bytes for commands run through ``run``."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes

    @staticmethod
    def check() -> None:
        """Raise ConfigError saying why a cap cannot be applied here (not root, no v1 memory controller)."""
        if os.geteuid() != 0:
            raise ConfigError("--mem-cap needs root to create a memory cgroup; run as root or drop --mem-cap")
        if not os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
            raise ConfigError(f"--mem-cap needs the cgroup v1 memory controller at {CGROUP_V1}, which this machine "
                              f"does not have; the rows would run uncapped, so nothing was run")

    def run(self, cmd: list[str], timeout: float | None = None) -> CappedResult:
        """Run ``cmd`` in a fresh cgroup limited to ``limit_bytes``; the cgroup is removed afterwards."""
        self.check()
        name = os.path.join(CGROUP_V1, f"moestream-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(name)
        try:
            with open(os.path.join(name, "memory.limit_in_bytes"), "w") as f:
                f.write(str(self.limit_bytes))
            procs = os.path.join(name, "cgroup.procs")

            def enter() -> None:  # runs in the child before exec: the whole command is charged to the cgroup
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

            p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter, timeout=timeout)
            peak = int(open(os.path.join(name, "memory.max_usage_in_bytes")).read())
            oom = False
            try:
                for line in open(os.path.join(name, "memory.oom_control")):
                    if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                        oom = True
            except OSError:
                pass
            oom = oom or p.returncode in (-9, 137)
            return CappedResult(p.returncode, p.stdout, p.stderr, peak, oom)
        finally:
            for _ in range(50):  # the cgroup can be removed once its last task has exited
                try:
                    os.rmdir(name)
                    break
                except OSError:
                    time.sleep(0.1)
