"""Parallel expert reads: ``os.preadv`` from the GGUF file straight into slot memory, buffered or O_DIRECT.

O_DIRECT (``--direct-io``) bypasses the page cache, so the slot pools are the only cache of expert bytes and
a memory budget holds (the page cache is charged to the reading process's cgroup too). It needs the file
offset, the length and the buffer address aligned; :func:`dio_alignment` asks the kernel how much (statx
``STATX_DIOALIGN``, Linux >= 6.1) and the store reads the aligned range that covers an expert into a slot
padded for it (see experts/pool.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ExpertReadError, GGUFError, ModelFileChanged, OptionError, shown
from ..gguf import describe_change
from ..limits import MAX_IO_THREADS

#: Alignment assumed where the kernel does not report one (statx without STATX_DIOALIGN): the page size and
#: the block size of common file systems (ext4, XFS, btrfs), which satisfies every smaller requirement.
DEFAULT_DIO_ALIGN = 4096
#: Largest alignment taken from a file system's preferred block size when the kernel reports none (NFS and
#: FUSE report 1 MiB there, which O_DIRECT does not need; past this we use DEFAULT_DIO_ALIGN).
MAX_FALLBACK_ALIGN = 1 << 16

O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: direct IO is then never used

_STATX_DIOALIGN = 0x2000  # stx_dio_mem_align, stx_dio_offset_align (Linux 6.1)
_STATX_DIO_READ_ALIGN = 0x20000  # stx_dio_read_offset_align (Linux 6.14; XFS may allow smaller read offsets)
_AT_FDCWD = -100


def _statx_dio(path: str) -> tuple[int, int, int] | None:
    """(mem_align, offset_align, read_offset_align) from statx(2), 0 where not reported; None where statx or
    STATX_DIOALIGN is not available (older kernel or libc, another OS, a file system that does not say)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx is 0x100 bytes
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN | _STATX_DIO_READ_ALIGN, buf) != 0:
        return None
    raw = buf.raw
    mask = struct.unpack_from("<I", raw, 0x00)[0]
    if not mask & _STATX_DIOALIGN:
        return None
    mem, off = struct.unpack_from("<II", raw, 0x98)
    read_off = struct.unpack_from("<I", raw, 0xB4)[0] if mask & _STATX_DIO_READ_ALIGN else 0
    return mem, off, read_off


def dio_alignment(path: str) -> int | None:
    """Bytes to which O_DIRECT reads of ``path`` must align their file offset, length and buffer address (one
    power of two for all three), or None where O_DIRECT cannot be used on the file.

    Where the kernel tells (statx STATX_DIOALIGN, Linux >= 6.1): the larger of ``stx_dio_mem_align`` and the
    offset alignment (``stx_dio_read_offset_align`` when reported, Linux >= 6.14, else
    ``stx_dio_offset_align``); both 0 means the file does not support direct IO (None). Where it does not
    tell: open(2) with O_DIRECT failing with EINVAL (tmpfs, some FUSE file systems) means None, else the
    file system's preferred block size if it is a power of two in [DEFAULT_DIO_ALIGN, MAX_FALLBACK_ALIGN],
    else DEFAULT_DIO_ALIGN (4096). GGUFError naming the file if it cannot be opened at all.
    """
    if not O_DIRECT:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise GGUFError(f"{path}: cannot open the model file ({e.strerror or e})") from None
    try:
        blksize = os.fstat(fd).st_blksize
    finally:
        os.close(fd)
    dio = _statx_dio(path)
    if dio is not None:
        mem, off, read_off = dio
        off = read_off or off
        if not off:
            return None
        return _pow2_at_least(max(mem, off, 1))
    if DEFAULT_DIO_ALIGN <= blksize <= MAX_FALLBACK_ALIGN and blksize & (blksize - 1) == 0:
        return blksize
    return DEFAULT_DIO_ALIGN


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def stderr_note(text: str) -> None:
    """The default ``note`` of an ExpertReader: one line ``moestream: note: TEXT`` on stderr."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"moestream: note: {text}", file=sys.stderr, flush=True)


@dataclass
class ReadJob:
    """Read ``len(dest)`` bytes at absolute ``offset`` of ``path`` into ``dest`` (a writable memoryview).

    The expert's own bytes are ``dest[lead:lead + nbytes]`` (``nbytes`` None: all of ``dest`` after ``lead``);
    the rest is alignment padding of a direct read, which may lie past the end of the file (a read that stops
    at the end of the file is fine once the expert's bytes arrived). ``direct``: read with O_DIRECT (then
    ``offset``, ``len(dest)`` and dest's address are multiples of the file's dio_alignment).
    """

    path: str
    offset: int
    dest: memoryview | None
    lead: int = 0
    nbytes: int | None = None
    direct: bool = False
    #: instead of ``dest``: a staged read (a slot in GPU memory, experts/pool.py ``DeviceSink``): the reader
    #: thread takes a pinned staging buffer from ``sink.acquire(size)``, reads ``size`` bytes into it and hands
    #: it to ``sink.commit(buf, n)``, which copies it to the slot asynchronously; ``sink.release(buf)`` after a
    #: failed read
    sink: object | None = None
    size: int = 0
    #: with ``sink``: the sink's buffer already holds the bytes (a host-tier hit): nothing is read, commit only
    copy_only: bool = False

    @property
    def need(self) -> int:
        """Bytes from the start of ``dest`` that must arrive: the lead and the expert."""
        n = len(self.dest) if self.dest is not None else self.size
        return n if self.nbytes is None else self.lead + self.nbytes


#: entries of a C reader's job table (csrc/iokern.c): reads queued or not yet joined at once; past it a submit goes
#: to the Python threads
C_JOBS = 4096
#: low-priority (speculative) reads a C reader runs at once, and only while no demand read is queued or running
LOW_MAX = 2
#: bytes a low-priority read takes per pread; between two it yields to a demand read that is waiting
LOW_CHUNK = 256 << 10
#: MOESTREAM_READ_SPLIT=1: one submit's demand reads cut into pieces of at least SPLIT_MIN bytes (a multiple of
#: SPLIT_ALIGN, which every O_DIRECT alignment here divides) so that every read thread has one: more reads in flight
#: for a device that needs a deeper queue for its bandwidth (off by default: on this project's 2-core machine's disk
#: one expert's three reads already take its bandwidth)
SPLIT_MIN, SPLIT_ALIGN = 256 << 10, 64 << 10
#: ms_io_result's outcomes (csrc/iokern.c)
_OK, _ERRNO, _REFUSED, _CHANGED = 0, 1, 2, 3


class _CFuture:
    """One read on the C threads (csrc/iokern.c), with the calls of a ``concurrent.futures.Future`` that the reader
    and the store make: ``done``, ``cancel``, ``cancelled``, ``result``. ``result`` interprets the outcome in the
    calling thread as ExpertReader._read would have in its own: the same errors, the same buffered retry of a
    refused O_DIRECT read, the same identity check. ``idx``: the C entries of its chunks, in file order (one, or
    several read in parallel: MOESTREAM_READ_SPLIT); ``lens``: their lengths."""

    __slots__ = ("reader", "idx", "lens", "job", "fd", "t0", "times", "_out", "_cancelled", "__weakref__")

    def __init__(self, reader: ExpertReader, idx: list[int], lens: list[int], job: ReadJob, fd: int):
        self.reader, self.idx, self.lens, self.job, self.fd = reader, idx, lens, job, fd
        self._out: tuple | None = None  # ("ok", bytes) or ("err", exception) once settled
        self._cancelled = False
        #: (start, end) of the read on its C threads, time.monotonic_ns clock, once settled (diagnostics)
        self.times: tuple[int, int] | None = None

    def _h(self) -> int | None:
        return self.reader._c_handle

    def done(self) -> bool:
        if self._out is not None or self._cancelled:
            return True
        h = self._h()
        return h is None or all(self.reader._c.ms_io_state(h, i) >= 3 for i in self.idx)

    def cancel(self) -> bool:
        """Cancel a read still queued (not one split in chunks: only demand reads are, and they are not cancelled)."""
        if self._out is not None or self._cancelled:
            return self._cancelled
        h = self._h()
        if h is None or len(self.idx) != 1 or not self.reader._c.ms_io_cancel(h, self.idx[0]):
            return False
        self._cancelled = True
        self.reader._c.ms_io_release(h, self.idx[0])
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def promote(self) -> None:
        """A step needs this read now: a low-priority read still queued (or between two chunks) becomes a demand
        read."""
        h = self._h()
        if self._out is None and not self._cancelled and h is not None:
            for i in self.idx:
                self.reader._c.ms_io_promote(h, i)

    def result(self) -> int:
        if self._out is None:
            self.reader._c_settle([self])
        if self._cancelled:
            from concurrent.futures import CancelledError
            raise CancelledError()
        kind, value = self._out  # type: ignore[misc]
        if kind == "err":
            raise value
        return value

    def __del__(self) -> None:
        if self._out is None and not self._cancelled:
            h = self._h()
            if h is not None:
                with contextlib.suppress(Exception):
                    for i in self.idx:
                        self.reader._c.ms_io_release(h, i)


class Ticket:
    """Handle of one submit(); pass it to ExpertReader.wait(). ``joined``: how many of its reads (a prefix, in
    submit order) have been joined so far."""

    def __init__(self, futures: list[Future]):
        self.futures = futures
        self.joined = 0


class _Refused(Exception):
    """An O_DIRECT read was refused (EINVAL) before any byte arrived."""

    def __init__(self, cause: str):
        self.cause = cause


def check_io_threads(n: object) -> None:
    """OptionError (field ``io_threads``) unless ``n`` is an integer from 1 to :data:`MAX_IO_THREADS`."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise OptionError(f"{{io_threads}} must be an integer, got {shown(n)}", io_threads=n)
    if n < 1:
        raise OptionError(f"{{io_threads}} must be at least 1, got {n}", io_threads=n)
    if n > MAX_IO_THREADS:
        raise OptionError(f"{{io_threads}} must be at most {MAX_IO_THREADS}, got {n}", io_threads=n)


class ExpertReader:
    """A pool of ``io_threads`` threads reading expert bytes into slot memory.

    Each job is one expert matrix: one ``os.preadv`` into the slot's memoryview (the GIL is released during
    the read; no bounce buffer, no copy), more only if the kernel returns less. A direct job's first read goes
    through an O_DIRECT descriptor; what a short direct read left (the end of the file, a signal) is read
    through the buffered one. Counts ``bytes_read`` (bytes that arrived, alignment padding included),
    ``reads`` and ``read_seconds`` (wall time during which at least one read was in flight).

    ``identity``: path -> (st_dev, st_ino, st_size, st_mtime_ns) the file had when the model was loaded (a path
    not in it: what fstat says when the reader first opens it). After every read the descriptor's fstat must
    still say so: a file rewritten in place (size or mtime changed) raises ModelFileChanged instead of letting
    changed bytes be computed; a write updates mtime before it changes bytes, so a read that saw new bytes sees
    the new mtime after it. ``sources``: path -> what to open for it, e.g. ``/proc/self/fd/N`` of the descriptor
    the model opened at load (GGUFModel.open_path): then a path renamed, replaced by another file or deleted is
    not seen at all -- the reads go on from the inode that was loaded -- and only its own bytes changing stops
    them.

    Where an O_DIRECT read is refused (EINVAL) the reader retries it buffered, reads that file buffered for the
    rest of its life and says so once through ``note`` (default: a line on stderr); the bytes are the same.

    Errors surface at ``wait``: ExpertReadError(path, offset, nbytes, cause) naming the expert's own offset and
    size for an OS error (EIO ...) or a short read (file truncated underneath); ModelFileChanged for a
    changed file.
    """

    def __init__(self, io_threads: int = 8, identity: dict[str, tuple[int, int, int, int]] | None = None,
                 note: Callable[[str], None] = stderr_note, sources: dict[str, str] | None = None):
        check_io_threads(io_threads)
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="moestream-io")
        self._fds: dict[tuple[str, bool], int] = {}
        self._identity: dict[str, tuple[int, int, int, int]] = dict(identity or {})
        self._sources: dict[str, str] = dict(sources or {})
        self._lock = threading.Lock()
        self._note = note
        #: paths whose O_DIRECT reads were refused mid-run: read buffered from then on
        self.direct_refused: set[str] = set()
        self.bytes_read = 0
        self.reads = 0
        self.read_seconds = 0.0
        self.wait_seconds = 0.0  # time compute spent blocked in wait()
        #: the C read threads (csrc/iokern.c): None until the first read that can use them; False where they cannot
        #: be had (no kernels here, MOESTREAM_C_READER=0): the Python threads read everything
        self._c = None
        self._c_handle: int | None = None

    def open(self, path: str, direct: bool = False) -> bool:
        """Open ``path`` (buffered, and with O_DIRECT when ``direct``) now rather than at the first read, and
        check it is still the file of ``identity``. Returns whether O_DIRECT reads will be used (False where
        the open with O_DIRECT is refused: EINVAL). GGUFError / ModelFileChanged naming the file otherwise."""
        self._fd(path, False)
        return bool(direct and self._fd(path, True) is not None)

    def _fd(self, path: str, direct: bool) -> int | None:
        """The descriptor of ``path`` (O_DIRECT when ``direct``; None where O_DIRECT is refused)."""
        key = (path, direct)
        with self._lock:
            if direct and (path in self.direct_refused or not O_DIRECT):
                return None
            if key in self._fds:
                return self._fds[key]
            try:
                fd = os.open(self._sources.get(path, path), os.O_RDONLY | (O_DIRECT if direct else 0))
            except OSError as e:
                if direct and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    self.direct_refused.add(path)
                    return None
                raise GGUFError(f"{path}: cannot open the model file ({e.strerror or e})") from None
            try:
                self._check(path, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fds[key] = fd
            return fd

    def _check(self, path: str, fd: int) -> None:
        now = _identity(os.fstat(fd))
        was = self._identity.setdefault(path, now)
        if now != was:
            raise ModelFileChanged(f"{path}: model file {describe_change(was, now)} while in use")

    def _refuse(self, path: str, cause: str) -> None:
        with self._lock:
            if path in self.direct_refused:
                return
            self.direct_refused.add(path)
        self._note(f"{path}: O_DIRECT read refused ({cause}); reading this file through the page cache from now "
                   f"on (same bytes)")

    def _read(self, job: ReadJob) -> int:
        if job.sink is None:
            return self._read_into(job)
        sink = job.sink
        buf = sink.acquire(job.size)  # type: ignore[attr-defined]
        if job.copy_only:
            sink.commit(buf, job.size)  # type: ignore[attr-defined]
            return 0  # no byte came from the file
        try:
            done = self._read_into(replace(job, dest=buf[:job.size], sink=None))
        except BaseException:
            sink.release(buf)  # type: ignore[attr-defined]
            raise
        sink.commit(buf, done)  # type: ignore[attr-defined]
        return done

    def _read_into(self, job: ReadJob) -> int:
        fd = self._fd(job.path, False)
        dfd = self._fd(job.path, True) if job.direct else None
        try:
            done = self._fill(job, fd, dfd)
        except _Refused as r:
            self._refuse(job.path, r.cause)
            done = self._fill(job, fd, None)
        self._check(job.path, fd)
        return done

    def _fill(self, job: ReadJob, fd: int, dfd: int | None) -> int:
        """Read the job's range (the first read through ``dfd`` when it is not None); returns bytes read."""
        total, need = len(job.dest), job.need
        nbytes = need - job.lead
        done = 0
        while done < total:
            use = dfd if dfd is not None and done == 0 else fd
            try:
                n = os.preadv(use, [job.dest[done:]], job.offset + done)
            except OSError as e:
                if use is dfd and e.errno == errno.EINVAL:
                    raise _Refused(e.strerror or str(e)) from None
                raise ExpertReadError(job.path, job.offset + job.lead, nbytes, e.strerror or str(e)) from None
            if n <= 0:
                break
            done += n
        if done < need:
            got = max(0, done - job.lead)
            raise ExpertReadError(job.path, job.offset + job.lead, nbytes,
                                  f"short read: got {got} bytes, the file ends early (truncated?)")
        return done

    def read_now(self, job: ReadJob) -> int:
        """Run one read in the calling thread, not the pool (a health probe: it does not wait behind expert reads
        and is not counted in ``bytes_read``); returns the bytes read. Raises what a pool read raises at ``wait``:
        ExpertReadError naming the file, offset and size; ModelFileChanged."""
        return self._read(job)

    def submit(self, jobs: list[ReadJob], low: bool = False, group: int = 0) -> Ticket:
        """Start the reads; returns at once. An empty job list gives an empty ticket. ``group``: jobs per expert
        (MOESTREAM_READ_SPLIT's pieces are sized by the first group). ``low``: speculative reads (a
        prefetch), which the C read threads start only while no other read is queued or running, at most
        :data:`LOW_MAX` at a time (the Python threads, where the C ones are not had, read them in order)."""
        if not jobs:
            return Ticket([])
        t0 = time.perf_counter()
        # a test standing in for the reads (ExpertReader._read, os.preadv: injected faults) gets the Python threads
        plain = (type(self)._read is _PLAIN_READ and os.preadv is _PREADV
                 and all(j.sink is None and j.dest is not None for j in jobs))
        futures = self._c_submit(jobs, low, group) if plain else None
        if futures is None:
            futures = [self._pool.submit(self._read, j) for j in jobs]
        futures[0].t0 = t0  # type: ignore[attr-defined]
        return Ticket(futures)

    def _c_lib(self):  # noqa: ANN202 - the ctypes library or None
        if self._c is None:
            from .. import kernels

            lib = kernels.io_ops()
            low_max = int(os.environ.get("MOESTREAM_LOW_MAX", LOW_MAX))
            h = lib.ms_io_new(self.io_threads, C_JOBS, low_max, LOW_CHUNK) if lib is not None else None
            self._c, self._c_handle = (lib, h) if h else (False, None)
        return self._c or None

    def _c_submit(self, jobs: list[ReadJob], low: bool, group: int = 0) -> list[_CFuture] | None:
        """The reads queued on the C threads, or None (the Python threads read them): no C reader here, or its job
        table is full. Descriptors are opened here, as a Python thread opens them at its first read."""
        lib = self._c_lib()
        if lib is None:
            return None
        split = 0
        if not low and os.environ.get("MOESTREAM_READ_SPLIT", "0") == "1":  # demand reads over every thread
            # pieces of one group of jobs (an expert's matrices: ``group`` jobs) over every thread, so that the
            # groups finish one after the other, in submit order, each as soon as the device can read it
            total = sum(len(j.dest) for j in jobs[:group or len(jobs)])
            split = max(SPLIT_MIN, -(-total // self.io_threads))
            split = -(-split // SPLIT_ALIGN) * SPLIT_ALIGN
        rows, fds, files, parts = [], [], {}, []
        for j in jobs:
            f = files.get((j.path, j.direct))
            if f is None:  # per file: its descriptors (opened now if need be) and identity
                fd = self._fd(j.path, False)
                dfd = self._fd(j.path, True) if j.direct else None
                f = files[(j.path, j.direct)] = (fd, -1 if dfd is None else dfd, *self._identity[j.path])
            addr, n = ctypes.addressof(ctypes.c_char.from_buffer(j.dest)), len(j.dest)
            lens = [n] if not split or n <= split else [min(split, n - a) for a in range(0, n, split)]
            at = 0
            for ln in lens:
                rows.append((f[0], f[1], j.offset + at, addr + at, ln, low, *f[2:], 0))
                at += ln
            fds.append(f[0])
            parts.append(lens)
        spec = np.array(rows, dtype=np.int64)
        ids = np.empty(len(rows), dtype=np.int64)
        if lib.ms_io_submit(self._c_handle, len(rows), spec.ctypes.data, ids.ctypes.data) < 0:
            return None
        out, k = [], 0
        idl = ids.tolist()
        for j, fd, lens in zip(jobs, fds, parts, strict=True):
            out.append(_CFuture(self, idl[k:k + len(lens)], lens, j, fd))
            k += len(lens)
        return out

    def _c_settle(self, futures: list[_CFuture]) -> None:
        """Block (GIL released) until ``futures``' reads finish, then take their outcomes: bytes, or the error a
        Python thread's read would have raised (a refused O_DIRECT read is read again buffered here)."""
        lib, h = self._c, self._c_handle
        todo = [f for f in futures if f._out is None and not f._cancelled]
        if not todo:
            return
        if h is None:
            for f in todo:
                f._out = ("err", ExpertReadError(f.job.path, f.job.offset + f.job.lead, f.job.need - f.job.lead,
                                                 "the reader was closed"))
            return
        ids = np.array([i for f in todo for i in f.idx], dtype=np.int64)
        lib.ms_io_wait(h, len(ids), ids.ctypes.data)
        out = np.empty(5, dtype=np.int64)
        for f in todo:
            res = []
            for i in f.idx:
                lib.ms_io_result(h, i, out.ctypes.data)
                res.append(out.tolist())
                lib.ms_io_release(h, i)
            f.times = (min(r[3] for r in res), max(r[4] for r in res))
            bad = next((r for r in res if r[0] in (_ERRNO, _REFUSED)), None)
            done = 0
            for r, ln in zip(res, f.lens, strict=True):  # the bytes that arrived, from the start of the range
                done += r[2]
                if r[2] < ln:
                    break
            job = f.job
            try:
                if bad is not None and bad[0] == _REFUSED:
                    self._refuse(job.path, os.strerror(bad[1]))
                    done = self._fill(job, f.fd, None)
                    self._check(job.path, f.fd)
                elif bad is not None:
                    raise ExpertReadError(job.path, job.offset + job.lead, job.need - job.lead, os.strerror(bad[1]))
                else:
                    if done < job.need:
                        got = max(0, done - job.lead)
                        raise ExpertReadError(job.path, job.offset + job.lead, job.need - job.lead,
                                              f"short read: got {got} bytes, the file ends early (truncated?)")
                    if any(r[0] == _CHANGED for r in res):
                        self._check(job.path, f.fd)
                f._out = ("ok", done)
            except BaseException as e:  # noqa: BLE001 - handed to result(), as a Future holds its exception
                f._out = ("err", e)

    def wait(self, ticket: Ticket, upto: int | None = None) -> None:
        """Block until the reads of ``ticket`` are done: all of them, or the first ``upto`` in submit order (the
        rest keep running). Raises the first error (ExpertReadError, ModelFileChanged); after an error every
        read of the ticket has settled (none is left writing into slot memory)."""
        end = len(ticket.futures) if upto is None else min(upto, len(ticket.futures))
        if end <= ticket.joined:
            return
        t_wait = time.perf_counter()
        error: BaseException | None = None
        n = 0
        cfut = [f for f in ticket.futures[ticket.joined:end] if isinstance(f, _CFuture)]
        if cfut:
            self._c_settle(cfut)  # one blocking call for all of them
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
        if self._c_handle is not None:
            h, self._c_handle = self._c_handle, None
            self._c.ms_io_free(h)  # after the reads running finish
        with self._lock:
            for fd in self._fds.values():
                if fd is not None:
                    os.close(fd)
            self._fds.clear()


#: ExpertReader's own ``_read`` and ``os.preadv``: where either is replaced (tests injecting failures), every read runs
#: on the Python threads
_PLAIN_READ = ExpertReader._read
_PREADV = os.preadv
