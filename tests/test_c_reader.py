"""The reader's C threads (csrc/iokern.c through experts/reader.py): the same bytes and the same errors as its Python
threads, low-priority reads behind demand ones, cancel and promote."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from moestream import kernels
from moestream.errors import ExpertReadError, ModelFileChanged
from moestream.experts import reader as reader_mod
from moestream.experts.reader import ExpertReader, ReadJob, dio_alignment

pytestmark = pytest.mark.skipif(kernels.io_ops() is None, reason="no C kernels here")


def _file(tmp_path, size: int) -> tuple[str, bytes]:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def _buf(n: int, align: int = 4096) -> memoryview:
    raw = np.zeros(n + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return memoryview(raw[skip:skip + n])


def _read(reader: ExpertReader, jobs: list[ReadJob], low: bool = False):  # noqa: ANN202
    t = reader.submit(jobs, low=low)
    reader.wait(t)
    return t


@pytest.mark.parametrize("split", ["0", "1"])
@pytest.mark.parametrize("direct", [False, True])
def test_same_bytes_and_counters_as_the_python_threads(tmp_path, monkeypatch, direct, split):
    """Also with the reads cut into pieces over the threads (MOESTREAM_READ_SPLIT=1), the last one past the end of
    the file for a direct read."""
    monkeypatch.setenv("MOESTREAM_READ_SPLIT", split)
    path, data = _file(tmp_path, 3 << 20)
    align = dio_alignment(path) if direct else None
    if direct and align is None:
        pytest.skip("the file system here refuses O_DIRECT")
    offs = [0, 12345 * 32, (1 << 20) + 64, (3 << 20) - 5000, (3 << 20) - 700_000]
    got = {}
    for c in ("1", "0"):
        monkeypatch.setenv("MOESTREAM_C_READER", c)
        r = ExpertReader(3)
        try:
            r.open(path, direct=direct)
            jobs = []
            for off in offs:
                n = min(200_000 if off < (3 << 20) - 700_000 else 700_000, len(data) - off)
                if direct:  # the aligned range around the bytes, as StreamingStore reads an expert
                    lead = off % align
                    end = -(-(lead + n) // align) * align
                    jobs.append(ReadJob(path, off - lead, _buf(end), lead, n, True))
                else:
                    jobs.append(ReadJob(path, off, _buf(n)))
            t = _read(r, jobs)
            assert all(isinstance(f, reader_mod._CFuture) == (c == "1") for f in t.futures)
            for j, off in zip(jobs, offs, strict=True):
                n = j.need - j.lead
                assert bytes(j.dest[j.lead:j.lead + n]) == data[off:off + n]
            got[c] = (r.bytes_read, r.reads)
        finally:
            r.close()
    assert got["1"] == got["0"]


def _error(monkeypatch, c: str, make) -> BaseException:  # noqa: ANN001
    monkeypatch.setenv("MOESTREAM_C_READER", c)
    r = ExpertReader(2)
    try:
        with pytest.raises((ExpertReadError, ModelFileChanged)) as info:
            _read(r, make(r))
        return info.value
    finally:
        r.close()


@pytest.mark.parametrize("split", ["0", "1"])
def test_short_read_is_the_same_error(tmp_path, monkeypatch, split):
    monkeypatch.setenv("MOESTREAM_READ_SPLIT", split)
    path, data = _file(tmp_path, 1_000_000)
    errs = [_error(monkeypatch, c, lambda r: [ReadJob(path, 100_000, _buf(1_000_000))]) for c in ("1", "0")]
    assert str(errs[0]) == str(errs[1]) and "short read: got 900000 bytes" in str(errs[0])


def test_os_error_is_the_same_error(tmp_path, monkeypatch):
    d = str(tmp_path / "dir")
    os.mkdir(d)
    errs = [_error(monkeypatch, c, lambda r: [ReadJob(d, 0, _buf(4096))]) for c in ("1", "0")]
    assert str(errs[0]) == str(errs[1]) and "Is a directory" in str(errs[0])


def test_changed_file_is_the_same_error(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 100_000)

    def make(r: ExpertReader) -> list[ReadJob]:
        r.open(path)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten underneath
        return [ReadJob(path, 0, _buf(4096))]

    errs = [_error(monkeypatch, c, make) for c in ("1", "0")]
    assert type(errs[0]) is ModelFileChanged and str(errs[0]) == str(errs[1])


def test_refused_direct_read_is_read_buffered(tmp_path, monkeypatch):
    """A direct read the kernel refuses (EINVAL: here an unaligned offset) is read again buffered, with one note;
    the file is read buffered from then on."""
    path, data = _file(tmp_path, 1 << 20)
    if dio_alignment(path) is None:
        pytest.skip("the file system here refuses O_DIRECT")
    monkeypatch.setenv("MOESTREAM_C_READER", "1")
    notes = []
    r = ExpertReader(2, note=notes.append)
    try:
        assert r.open(path, direct=True)
        job = ReadJob(path, 1000, _buf(8192), 0, 8192, True)  # not aligned: EINVAL
        _read(r, [job])
        assert bytes(job.dest) == data[1000:1000 + 8192]
        assert len(notes) == 1 and "O_DIRECT read refused" in notes[0] and path in r.direct_refused
    finally:
        r.close()


def test_low_reads_yield_to_demand_reads_and_cancel(tmp_path, monkeypatch):
    """One thread: a large low-priority read submitted first is read in chunks and lets a demand read submitted after
    it finish first; queued low reads cancelled never write; a promoted one is read."""
    monkeypatch.setenv("MOESTREAM_C_READER", "1")
    path, data = _file(tmp_path, 64 << 20)
    r = ExpertReader(1)
    try:
        r.open(path)
        big = ReadJob(path, 0, _buf(48 << 20))
        low = r.submit([big], low=True)
        demand = ReadJob(path, 50 << 20, _buf(1 << 20))
        t = r.submit([demand])
        r.wait(t)
        r.wait(low)
        (f_big,), (f_dem,) = low.futures, t.futures
        assert f_dem.times[1] < f_big.times[1], "the demand read waited for the whole low one"
        assert bytes(big.dest) == data[:48 << 20] and bytes(demand.dest) == data[50 << 20:51 << 20]
        # queued low reads behind a running one: cancelled ones never write; a promoted one is read
        jobs = [ReadJob(path, i << 20, _buf(1 << 20)) for i in range(8)]
        lt = r.submit([ReadJob(path, 0, _buf(32 << 20))] + jobs, low=True)
        cancelled = [f.cancel() for f in lt.futures[1:]]
        lt.futures[0].promote()
        time.sleep(0.01)
        for f, j, c in zip(lt.futures[1:], jobs, cancelled, strict=True):
            if c:
                assert f.cancelled() and not any(bytes(j.dest))
        rest = reader_mod.Ticket([f for f in lt.futures if not f.cancelled()])
        r.wait(rest)
        assert bytes(lt.futures[0].job.dest) == data[:32 << 20]
    finally:
        r.close()
