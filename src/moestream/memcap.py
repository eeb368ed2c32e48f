"""Run a command inside a memory cgroup, page cache included: cgroup v2 or v1, chosen automatically.

This is how a benchmark reproduces "the model is larger than RAM" on a machine that has plenty: the
limit covers the process's anonymous memory *and* the file pages it reads, so an mmap baseline has to
page experts back in from disk just as it would on a small board.

Which hierarchy (``find_hierarchy``): the mounts are read from ``/proc/self/mountinfo`` (``/proc/mounts`` if
that cannot be read). A ``cgroup2`` mount whose ``cgroup.controllers`` lists ``memory`` is used (v2; the
unified hierarchy, normally ``/sys/fs/cgroup``, ``/sys/fs/cgroup/unified`` on hybrid systems); otherwise a
``cgroup`` (v1) mount with the ``memory`` controller that has ``memory.limit_in_bytes`` (normally
``/sys/fs/cgroup/memory``). Needs root; ``MemCap.check()`` says in one line why no cap can be applied.

The cap group is made directly under the hierarchy's mount point and removed afterwards:

- v1: ``memory.limit_in_bytes`` (limit), ``cgroup.procs`` (the command), ``memory.max_usage_in_bytes`` (peak),
  ``memory.oom_control`` (``oom_kill``).
- v2: ``+memory`` in the mount point's ``cgroup.subtree_control`` (enabled when it is not, and left enabled),
  ``memory.max`` (limit), ``memory.swap.max`` = 0 where it exists (so that the cap is not swap), ``cgroup.procs``,
  ``memory.peak`` (peak; kernel 5.19+, else ``memory.current`` sampled, a lower bound), ``memory.events``
  (``oom_kill``), ``cgroup.kill`` (only for processes left in the group when it is removed).

``MOUNTINFO``, ``MOUNTS`` and ``CGROUP_V1`` are module attributes so that tests can point them elsewhere.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .errors import ConfigError

#: The mount table read to find the cgroup hierarchies (mountinfo format), and the fallback (fstab format).
MOUNTINFO = "/proc/self/mountinfo"
MOUNTS = "/proc/mounts"
#: Where the v1 memory controller is looked for when neither mount table can be read.
CGROUP_V1 = "/sys/fs/cgroup/memory"
#: Where the v2 hierarchy is looked for when neither mount table can be read.
CGROUP_V2 = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
#: How often memory.current is read when the kernel has no memory.peak (before Linux 5.19).
PEAK_SAMPLE_S = 0.01
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
#: The smallest cap ``parse_cap`` accepts: a row's Python, torch and model must fit in it.
MIN_CAP = 64 * 2**20
#: The largest value cgroup v1's memory.limit_in_bytes takes (v2's memory.max clamps anything larger).
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
        typed = text.strip().replace(" ", "")[len(num):]  # the unit as the user wrote it, case kept
        raise ConfigError(f"{bad}: unknown unit {typed!r} (B; K/KiB, M/MiB, G/GiB, T/TiB: powers of 2; KB, MB, GB, "
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
    oom_killed: the kernel's OOM killer fired inside the cgroup; version: 1 or 2 (the cgroup hierarchy);
    peak_source: where peak_bytes came from (``memory.max_usage_in_bytes``, ``memory.peak``, or, on a v2 kernel
    before 5.19, ``memory.current`` sampled: a lower bound); peak_exact: False for the sampled one."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    oom_killed: bool
    version: int = 1
    peak_source: str = "memory.max_usage_in_bytes"
    peak_exact: bool = True


@dataclass(frozen=True)
class Hierarchy:
    """A cgroup hierarchy that has the memory controller: version 1 or 2, and its mount point (``root``), under
    which the cap groups are made."""

    version: int
    root: str


def _unescape(field: str) -> str:
    """A mount point as the kernel writes it in a mount table (space, tab, newline, backslash as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> tuple[list[str], list[str]]:
    """(cgroup2 mount points, cgroup v1 mount points that have the memory controller) in a
    ``/proc/self/mountinfo`` text, in the order listed. Lines that are not mountinfo lines are ignored."""
    v2: list[str] = []
    v1: list[str] = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        if tail[0] == "cgroup2":
            v2.append(point)
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            v1.append(point)
    return v2, v1


def parse_mounts(text: str) -> tuple[list[str], list[str]]:
    """As ``parse_mountinfo``, for a ``/proc/mounts`` text (device, mount point, type, options, ...)."""
    v2: list[str] = []
    v1: list[str] = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        if f[2] == "cgroup2":
            v2.append(_unescape(f[1]))
        elif f[2] == "cgroup" and "memory" in f[3].split(","):
            v1.append(_unescape(f[1]))
    return v2, v1


def cgroup_mounts() -> tuple[list[str], list[str], str]:
    """(cgroup2 mount points, v1 memory mount points, the file they were read from) from ``MOUNTINFO``, else
    ``MOUNTS``; where neither can be read, the usual places (``CGROUP_V2``, ``CGROUP_V1``) that exist."""
    for path, parse in ((MOUNTINFO, parse_mountinfo), (MOUNTS, parse_mounts)):
        try:
            text = open(path).read()
        except OSError:
            continue
        return (*parse(text), path)
    return ([p for p in CGROUP_V2 if os.path.isdir(p)], [CGROUP_V1] if os.path.isdir(CGROUP_V1) else [],
            "the usual places (no mount table could be read)")


def _read_words(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def find_hierarchy(version: int | None = None) -> Hierarchy:
    """The hierarchy a cap is made in: v2 where a cgroup2 mount's ``cgroup.controllers`` lists ``memory``, else
    v1 where a v1 memory mount has ``memory.limit_in_bytes`` (``version`` 1 or 2 looks for that one only).

    ConfigError, one line, saying what was found in each hierarchy looked at when neither can be used.
    """
    v2, v1, source = cgroup_mounts()
    why = []
    if version in (None, 2):
        if not v2:
            why.append(f"no cgroup v2 hierarchy is mounted (no cgroup2 mount in {source})")
        for root in v2:
            path = os.path.join(root, "cgroup.controllers")
            try:
                ctrls = _read_words(path)
            except OSError as e:
                why.append(f"cannot read {path}: {e.strerror or e}")
                continue
            if "memory" in ctrls:
                return Hierarchy(2, root)
            why.append(f"the cgroup v2 hierarchy at {root} has no memory controller ({path} lists "
                       f"{' '.join(ctrls) or 'nothing'})")
    if version in (None, 1):
        if not v1:
            why.append(f"no cgroup v1 memory controller is mounted (none in {source})")
        for root in v1:
            if os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
                return Hierarchy(1, root)
            why.append(f"the cgroup v1 memory mount at {root} has no memory.limit_in_bytes")
    raise ConfigError(f"--mem-cap needs a memory cgroup and found none: {'; '.join(why)}; the rows would run "
                      f"uncapped, so nothing was run")


def _no_internal_processes(root: str) -> str | None:
    """Why child groups of v2 ``root`` cannot be given the memory controller, or None when they have it or it
    can be enabled: ``root`` is a non-root group (it has ``cgroup.type``; a container's cgroup namespace) with
    processes in ``cgroup.procs``, and cgroup v2 lets no such group enable controllers for its children."""
    control = os.path.join(root, "cgroup.subtree_control")
    try:
        if "memory" in _read_words(control):
            return None
        if not os.path.exists(os.path.join(root, "cgroup.type")):  # the root cgroup is exempt from the rule
            return None
        if not _read_words(os.path.join(root, "cgroup.procs")):
            return None
    except OSError as e:
        return f"cannot read {e.filename}: {e.strerror or e}"
    return (f"{control} does not give the memory controller to child groups and it cannot be enabled: {root} "
            f"is not the root cgroup and has processes in it (cgroup v2's no-internal-processes rule); move them "
            f"into a child group first or mount a cgroup tree whose top has no processes")


def _write(path: str, value: str) -> None:
    """Write ``value`` to a cgroup file; ConfigError naming the file and the kernel's reason."""
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise ConfigError(f"--mem-cap: {path}: cannot write {value!r}: {e.strerror or e}") from None


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _count(path: str, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (memory.events, memory.oom_control), 0 if absent."""
    try:
        for line in open(path):
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


class MemCap:
    """A memory limit in bytes for commands run through ``run``; ``version`` None picks the cgroup hierarchy
    (``find_hierarchy``), 1 or 2 insists on that one."""

    def __init__(self, limit_bytes: int, version: int | None = None):
        self.limit_bytes = limit_bytes
        self.version = version

    @staticmethod
    def check(version: int | None = None) -> Hierarchy:
        """The hierarchy a cap would be made in; ConfigError, one line, saying why a cap cannot be applied here:
        not root, no memory controller in either hierarchy (``find_hierarchy``), its mount point not writable
        (a read-only cgroup mount), or, v2, child groups that cannot be given the memory controller."""
        if os.geteuid() != 0:
            raise ConfigError("--mem-cap needs root to create a memory cgroup; run as root or drop --mem-cap")
        h = find_hierarchy(version)
        if not os.access(h.root, os.W_OK):
            raise ConfigError(f"--mem-cap: {h.root}: cannot create a cgroup there (not writable: a read-only cgroup "
                              f"mount, as in a container without write access to it); nothing was run")
        if h.version == 2 and (why := _no_internal_processes(h.root)):
            raise ConfigError(f"--mem-cap: {why}; nothing was run")
        return h

    def run(self, cmd: list[str], timeout: float | None = None) -> CappedResult:
        """Run ``cmd`` in a fresh cgroup limited to ``limit_bytes`` (see the module docstring for the files); the
        cgroup is removed afterwards, also on errors. ConfigError (one line, naming the file) where the kernel
        refuses a step; ``subprocess.TimeoutExpired`` after killing the command when it outlives ``timeout``."""
        h = self.check(self.version)
        group = os.path.join(h.root, f"moestream-{os.getpid()}-{time.monotonic_ns()}")
        if h.version == 2:
            control = os.path.join(h.root, "cgroup.subtree_control")
            try:
                if "memory" not in _read_words(control):
                    with open(control, "w") as f:
                        f.write("+memory")
            except OSError as e:
                raise ConfigError(f"--mem-cap: {control}: cannot enable the memory controller for child groups "
                                  f"(+memory): {e.strerror or e}") from None
        try:
            os.mkdir(group)
        except OSError as e:
            raise ConfigError(f"--mem-cap: {group}: cannot create the cap group: {e.strerror or e}") from None
        try:
            if h.version == 1:
                _write(os.path.join(group, "memory.limit_in_bytes"), str(self.limit_bytes))
            else:
                limit = os.path.join(group, "memory.max")
                if not os.path.exists(limit):
                    raise ConfigError(f"--mem-cap: {limit} does not exist: the memory controller is not enabled "
                                      f"for {group}")
                _write(limit, str(self.limit_bytes))
                swap = os.path.join(group, "memory.swap.max")
                if os.path.exists(swap):
                    _write(swap, "0")
            return self._run_in(h, group, cmd, timeout)
        finally:
            _remove(group, h.version)

    def _run_in(self, h: Hierarchy, group: str, cmd: list[str], timeout: float | None) -> CappedResult:
        procs = os.path.join(group, "cgroup.procs")
        r, w = os.pipe()  # the child's reason, when moving itself into the group fails

        def enter() -> None:  # runs in the child before exec: the whole command is charged to the cgroup
            try:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            except OSError as e:
                os.write(w, str(e.strerror or e).encode())
                raise

        try:
            try:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=enter)
            except subprocess.SubprocessError:
                os.close(w)
                w = -1
                why = os.read(r, 4096).decode(errors="replace") or "the kernel refused"
                raise ConfigError(f"--mem-cap: {procs}: cannot move the command into the cap group: {why}") from None
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        peak_file = os.path.join(group, "memory.max_usage_in_bytes" if h.version == 1 else "memory.peak")
        sampler = None if os.path.exists(peak_file) else _Sampler(os.path.join(group, "memory.current"))
        with p:
            try:
                out, err = p.communicate(timeout=timeout)
            except BaseException:
                p.kill()
                p.wait()
                raise
            finally:
                if sampler:
                    sampler.stop()
        if sampler:
            peak, source = sampler.peak, (f"memory.current sampled every {PEAK_SAMPLE_S * 1000:g} ms (a lower "
                                          f"bound: this kernel has no memory.peak, which Linux 5.19 added)")
        else:
            try:
                peak = _read_int(peak_file)
            except (OSError, ValueError) as e:
                raise ConfigError(f"--mem-cap: {peak_file}: cannot read the peak: {e}") from None
            source = os.path.basename(peak_file)
        if h.version == 1:
            oom = _count(os.path.join(group, "memory.oom_control"), "oom_kill") > 0
        else:
            oom = _count(os.path.join(group, "memory.events"), "oom_kill") > 0
        oom = oom or p.returncode in (-9, 137)
        return CappedResult(p.returncode, out, err, peak, oom, h.version, source, sampler is None)


class _Sampler:
    """The largest value of ``path`` (memory.current) read every PEAK_SAMPLE_S seconds until ``stop``."""

    def __init__(self, path: str):
        self.path, self.peak = path, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self.peak = max(self.peak, _read_int(self.path))
        except (OSError, ValueError):
            pass

    def _loop(self) -> None:
        while not self._done.wait(PEAK_SAMPLE_S):
            self._read()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._read()  # page cache stays charged after the command exits


def _remove(group: str, version: int) -> None:
    """rmdir the cap group, retrying for 5 s (it can be removed once its last process has exited); processes
    still in it after 1 s (left behind by the command) are killed (v2 ``cgroup.kill``, else SIGKILL to each pid
    in ``cgroup.procs``). A warning on stderr, naming the group, if it still cannot be removed."""
    for i in range(50):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            if i == 10:
                kill = os.path.join(group, "cgroup.kill")
                try:
                    if version == 2 and os.path.exists(kill):
                        with open(kill, "w") as f:
                            f.write("1")
                    else:
                        for pid in _read_words(os.path.join(group, "cgroup.procs")):
                            os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            time.sleep(0.1)
    print(f"moestream: warning: {group}: could not remove the memory cgroup; remove it with rmdir", file=sys.stderr)
