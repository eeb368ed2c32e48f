"""Parallel expert reads: ``os.preadv`` from the GGUF file straight into slot memory."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ConfigError, ExpertReadError


@dataclass
class ReadJob:
    """Read ``nbytes`` at absolute ``offset`` of ``path`` into ``dest`` (a writable memoryview of nbytes)."""

    path: str
    offset: int
    dest: memoryview


class Ticket:
    """Handle of one submit(); pass it to ExpertReader.wait(). ``joined``: how many of its reads (a prefix, in
    submit order) have been joined so far."""

    def __init__(self, futures: list[Future]):
        self.futures = futures
        self.joined = 0


class ExpertReader:
    """A pool of ``io_threads`` threads reading expert bytes into slot memory.

    Each job is one expert matrix: a single ``os.preadv`` into the slot's memoryview (the GIL is
    released during the read; no bounce buffer, no copy). Counts ``bytes_read`` and ``read_seconds``
    (wall time during which at least one read was in flight). Errors surface at ``wait`` as
    ExpertReadError(path, offset, nbytes, cause); a short read (file truncated underneath) is one.
    """

    def __init__(self, io_threads: int = 8):
        if io_threads < 1:
            raise ConfigError(f"--io-threads must be at least 1, got {io_threads}")
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="moestream-io")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self.read_seconds = 0.0
        self.wait_seconds = 0.0  # time compute spent blocked in wait()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _read(self, job: ReadJob) -> int:
        fd = self._fd(job.path)
        nbytes = len(job.dest)
        done = 0
        while done < nbytes:
            try:
                n = os.preadv(fd, [job.dest[done:]], job.offset + done)
            except OSError as e:
                raise ExpertReadError(job.path, job.offset, nbytes, e.strerror or str(e)) from None
            if n == 0:
                raise ExpertReadError(job.path, job.offset, nbytes,
                                      f"short read: got {done} bytes, the file ends early (truncated?)")
            done += n
        return nbytes

    def submit(self, jobs: list[ReadJob]) -> Ticket:
        """Start the reads; returns at once. An empty job list gives an empty ticket."""
        if not jobs:
            return Ticket([])
        t0 = time.perf_counter()
        futures = [self._pool.submit(self._read, j) for j in jobs]
        futures[0].t0 = t0  # type: ignore[attr-defined]
        return Ticket(futures)

    def wait(self, ticket: Ticket, upto: int | None = None) -> None:
        """Block until the reads of ``ticket`` are done: all of them, or the first ``upto`` in submit order (the
        rest keep running). Raises the first ExpertReadError; after an error every read of the ticket has
        settled (none is left writing into slot memory)."""
        end = len(ticket.futures) if upto is None else min(upto, len(ticket.futures))
        if end <= ticket.joined:
            return
        t_wait = time.perf_counter()
        error: BaseException | None = None
        n = 0
        for f in ticket.futures[ticket.joined:end]:
            try:
                n += f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below after all reads settle
                error = error or e
        if error is not None:  # let the reads not yet joined finish before the caller reuses their slots
            for f in ticket.futures[end:]:
                with contextlib.suppress(BaseException):
                    f.result()
            end = len(ticket.futures)
        now = time.perf_counter()
        self.wait_seconds += now - t_wait
        if end == len(ticket.futures):
            self.read_seconds += now - ticket.futures[0].t0  # type: ignore[attr-defined]
        self.bytes_read += n
        self.reads += end - ticket.joined
        ticket.joined = end
        if error is not None:
            raise error

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
