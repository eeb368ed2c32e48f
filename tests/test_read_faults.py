"""Faults on the expert read path: EIO, short reads, the file truncated / rewritten / replaced underneath, and
O_DIRECT refused mid-run.

Each must end with one clear error (or, for O_DIRECT refused, one note and the same logits), leave the pool
consistent (no slot maps an expert whose bytes did not arrive) and leave the model usable: the next
generation with the same model and store gives logits bitwise equal to a fresh run (what a server needs to
fail one request, not the process). Faults are injected by wrapping ``os.preadv`` for the IO threads' reads.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import assert_bitwise, assert_slots_hold_their_experts, cli, logits_of
from moestream.engine import Engine
from moestream.errors import ExpertReadError, ModelFileChanged
from moestream.experts import reader as reader_mod
from moestream.experts.pool import ResidentStore, StreamingStore
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.tokenizer import GGUFTokenizer

DEFAULT_GGUF = Path(__file__).resolve().parents[1] / "src" / "moestream" / "data" / "default.gguf"

PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot pool "
          "keeps the hot ones in memory while misses are read by the IO threads.")
STEPS = 8
REAL_PREADV = os.preadv


class Fault:
    """``os.preadv`` for the IO threads: the first read of ``path`` (while armed) whose byte range meets
    ``[start, end)`` goes to ``action(fd, buffers, offset)`` instead; every other read is the real one.
    ``fired``: how many reads the action took; ``direct_after``: O_DIRECT reads seen after the first firing."""

    def __init__(self, path: str, start: int, end: int, action: Callable, times: int = 1):
        self.path, self.start, self.end, self.action, self.times = os.path.realpath(path), start, end, action, times
        self.armed = False
        self.fired = 0
        self.direct_after = 0
        self._lock = threading.Lock()

    def __call__(self, fd: int, buffers: list, offset: int) -> int:
        if not threading.current_thread().name.startswith("moestream-io"):
            return REAL_PREADV(fd, buffers, offset)
        try:
            mine = os.readlink(f"/proc/self/fd/{fd}") == self.path
        except OSError:
            mine = False
        if mine and self.fired and fcntl.fcntl(fd, fcntl.F_GETFL) & reader_mod.O_DIRECT:
            self.direct_after += 1
        n = sum(len(b) for b in buffers)
        with self._lock:
            take = mine and self.armed and self.fired < self.times and offset < self.end and offset + n > self.start
            if take:
                self.fired += 1
        return self.action(fd, buffers, offset) if take else REAL_PREADV(fd, buffers, offset)


def eio(fd, buffers, offset):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def last_layer_range(model: MoEModel, name: str = "up") -> tuple[int, int]:
    """File byte range of the last MoE layer's ``name`` experts."""
    m = model.layout[max(model.layout.layers)][name]
    return m.offset, m.offset + m.n_experts * m.bytes_per_expert


def expert_at(model: MoEModel, offset: int) -> tuple[int, int]:
    """(layer, expert) whose matrix starts at ``offset`` (an error's offset)."""
    for layer, mats in model.layout.layers.items():
        for m in mats.values():
            if m.offset <= offset < m.offset + m.n_experts * m.bytes_per_expert:
                assert (offset - m.offset) % m.bytes_per_expert == 0, "the error names the expert's own offset"
                return layer, (offset - m.offset) // m.bytes_per_expert
    raise AssertionError(f"offset {offset} is no expert's")


def run_until_error(model: MoEModel, ids: list[int], arm: Callable[[], None], phase: str,
                    fault: Fault) -> BaseException:
    """Prefill ``ids`` and decode greedily; ``arm()`` before the prefill or (``phase`` "decode") after it; returns
    the error that stops the run, which must come from the forward pass during which ``fault`` fired (not a
    later one: its logits would have been computed on what the fault did)."""
    eng = Engine(model)
    cache = model.new_cache(len(ids) + 64)
    if phase == "prefill":
        arm()
    try:
        tok = int(eng.prefill(ids, cache)[-1].argmax())
        assert not fault.fired, "the prefill's fault did not stop the prefill"
        if phase == "decode":
            arm()
        for i in range(64):
            tok = int(eng.decode_step(tok, len(ids) + i, cache).argmax())
            assert not fault.fired, "the decode step's fault did not stop that step"
    except (ExpertReadError, ModelFileChanged) as e:
        assert fault.fired, f"an error before the fault fired: {e}"
        return e
    raise AssertionError("the injected fault never fired")


def check_after_fault(model: MoEModel, store: StreamingStore, err: BaseException, ids: list[int], ref: list) -> None:
    """The failed expert is not mapped, every mapped slot holds its expert's bytes, and the next generation
    through the same model and store equals the fresh run ``ref`` bitwise."""
    if isinstance(err, ExpertReadError):
        layer, expert = expert_at(model, err.offset)
        assert store.slots[layer].slot_of[expert] == -1, "the expert whose read failed is still mapped"
    assert assert_slots_hold_their_experts(model, store) > 0
    assert_bitwise(logits_of(model, ids, STEPS, 128), ref)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def qwen3(qwen3moe_tiny):
    """(resident Q8_0 model, prompt ids, its logits: the fresh-run reference)."""
    path = str(qwen3moe_tiny["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False))
    ids = GGUFTokenizer.from_gguf(path).encode(PROMPT)
    yield model, ids, logits_of(model, ids, STEPS, 128)
    model.store.close()


@pytest.fixture
def streamed(qwen3):
    """(model, store, ids, ref) with a fresh streaming store (direct_io auto) of 2 x top-k slots; the
    resident store is put back afterwards."""
    made = []

    def make(direct_io: bool | None = None, note: Callable[[str], None] = reader_mod.stderr_note):
        model, ids, ref = qwen3
        store = StreamingStore(model.gguf, model.layout, 2 * model.top_k, model.top_k, io_threads=4,
                               direct_io=direct_io, note=note)
        model.set_store(store)
        made.append(store)
        return model, store, ids, ref

    yield make
    model = qwen3[0]
    for s in made:
        s.close()
    model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.fixture
def own_copy(qwen3, tmp_path):
    """A copy of the Q8_0 file in tmp_path, loaded streaming (2 x top-k slots, direct_io auto, one IO thread: the
    reads run in submit order, so the first error of a ticket is the changed read's own, not that of a read
    beside it that the change caught too): (model, path, restore) where ``restore()`` puts the original bytes
    and mtime back (same inode: the model's identity)."""
    src = qwen3[0].gguf.path
    path = str(tmp_path / "copy.gguf")
    shutil.copy(src, path)
    st = os.stat(path)
    model = load_model(path, LoadOptions(slots=2 * qwen3[0].top_k, io_threads=1))
    original = open(src, "rb").read()

    def restore() -> None:
        with open(path, "r+b") as f:
            f.write(original)
            f.truncate(len(original))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        model.gguf.check_unchanged()

    yield model, path, restore
    model.store.close()


# ------------------------------------------------------------------------------------------------ EIO
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("direct", [True, False])
def test_eio(streamed, monkeypatch, direct, phase):
    model, store, ids, ref = streamed(direct_io=direct)
    assert store.direct is direct
    fault = Fault(model.gguf.path, *last_layer_range(model), eio)
    monkeypatch.setattr(os, "preadv", fault)
    err = run_until_error(model, ids, lambda: setattr(fault, "armed", True), phase, fault)
    assert fault.fired == 1
    assert isinstance(err, ExpertReadError)
    assert str(err).startswith(f"{model.gguf.path}: reading ") and str(err).endswith("Input/output error")
    fault.armed = False
    check_after_fault(model, store, err, ids, ref)


# ------------------------------------------------------------------------------------------------ short reads
def short_then_zero(fd, buffers, offset):
    """A read that returns 4096 bytes of what was asked; the reader's next read (of the rest) gets 0."""
    return REAL_PREADV(fd, [buffers[0][:4096]], offset)


@pytest.mark.parametrize("direct", [True, False])
def test_short_read_then_zero(streamed, monkeypatch, direct):
    model, store, ids, ref = streamed(direct_io=direct)
    rest: dict = {}  # the short read's thread and where its rest starts
    lock = threading.Lock()

    def short(fd, buffers, offset):
        n = short_then_zero(fd, buffers, offset)
        rest.update(thread=threading.get_ident(), offset=offset + n)
        return n

    first = Fault(model.gguf.path, *last_layer_range(model), short)
    zero = {"n": 0}

    def preadv(fd, buffers, offset):
        """The same IO thread's next read (of the rest, from where the short one stopped) returns 0; other IO
        threads' reads of nearby experts are real (they once raced for the zero)."""
        with lock:
            take = (not zero["n"] and rest.get("thread") == threading.get_ident()
                    and offset == rest["offset"] and os.readlink(f"/proc/self/fd/{fd}") == first.path)
            if take:
                zero["n"] += 1
        return 0 if take else first(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    err = run_until_error(model, ids, lambda: setattr(first, "armed", True), "prefill", first)
    assert first.fired == 1 and zero["n"] == 1
    assert isinstance(err, ExpertReadError) and "short read" in str(err) and model.gguf.path in str(err)
    first.armed = False
    check_after_fault(model, store, err, ids, ref)


@pytest.mark.parametrize("direct", [True, False])
def test_partial_reads_are_completed(streamed, monkeypatch, direct):
    """A read that returns less than asked (without reaching the end of the file) is continued: the same logits
    (for a direct read, the rest is read buffered)."""
    model, store, ids, ref = streamed(direct_io=direct)
    fault = Fault(model.gguf.path, 0, 1 << 62, short_then_zero, times=50)
    fault.armed = True
    monkeypatch.setattr(os, "preadv", fault)
    assert_bitwise(logits_of(model, ids, STEPS, 128), ref)
    assert fault.fired == 50
    assert_slots_hold_their_experts(model, store)


# ------------------------------------------------------------------------------------------------ file changed
def test_truncated_during_a_read_is_a_short_read(own_copy, qwen3, monkeypatch):
    """The file is cut in the middle of a step, between the engine's check and a read of the expert at the cut:
    the read comes back short -> the short-read error naming the file; with the bytes and mtime put back, the
    same model reads on."""
    model, path, restore = own_copy
    start, end = last_layer_range(model)

    def cut_then_read(fd, buffers, offset):
        os.truncate(path, max(offset, start) + 100)
        return REAL_PREADV(fd, buffers, offset)

    fault = Fault(path, start, end, cut_then_read)
    monkeypatch.setattr(os, "preadv", fault)
    _, ids, ref = qwen3
    err = run_until_error(model, ids, lambda: setattr(fault, "armed", True), "prefill", fault)
    assert isinstance(err, ExpertReadError), err
    assert str(err).startswith(f"{path}: reading ") and "short read" in str(err)
    fault.armed = False
    restore()
    check_after_fault(model, model.store, err, ids, ref)


def test_rewritten_in_place_during_a_read(own_copy, qwen3, monkeypatch):
    """The expert's bytes are overwritten (same size) just before its read: the read sees new bytes, and the
    descriptor's changed mtime stops it with ModelFileChanged instead of computing on them."""
    model, path, restore = own_copy
    start, end = last_layer_range(model)

    def rewrite_then_read(fd, buffers, offset):
        wfd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(wfd, b"\xff" * 64, max(offset, start) + 64)
        finally:
            os.close(wfd)
        return REAL_PREADV(fd, buffers, offset)

    fault = Fault(path, start, end, rewrite_then_read)
    monkeypatch.setattr(os, "preadv", fault)
    _, ids, ref = qwen3
    err = run_until_error(model, ids, lambda: setattr(fault, "armed", True), "prefill", fault)
    assert isinstance(err, ModelFileChanged), err
    # what follows is the caller's to say (the CLI stops, the server answers 503): test_run_stops_..., test_serve
    assert str(err) == f"{path}: model file was modified (its mtime changed) while in use"
    fault.armed = False
    restore()
    check_after_fault(model, model.store, err, ids, ref)


def _move_path(path: str, how: str) -> None:
    """Take the path away from the loaded file: ``replace`` renames another file over it (the loaded inode stays
    under ``path + '.orig'``, a hard link made first), ``rename`` renames it, ``delete`` unlinks it."""
    if how == "replace":
        os.link(path, path + ".orig")
        with open(path + ".new", "wb") as f:
            f.write(b"GGUF something else")
        os.replace(path + ".new", path)
    elif how == "rename":
        os.rename(path, path + ".moved")
    else:
        os.unlink(path)


@pytest.mark.parametrize("how", ["replace", "rename", "delete"])
def test_path_replaced_renamed_or_deleted_during_a_read(own_copy, qwen3, monkeypatch, how):
    """The path is replaced by another file, renamed or deleted in the middle of the prefill: the reads go on from
    the descriptors opened at load (the loaded inode, whose bytes did not change), so that step and every later one
    give the fresh run's logits bitwise, and nothing stops (llama.cpp's map keeps going too)."""
    model, path, _ = own_copy
    start, end = last_layer_range(model)

    def move_then_read(fd, buffers, offset):
        _move_path(path, how)
        return REAL_PREADV(fd, buffers, offset)

    fault = Fault(path, start, end, move_then_read)
    monkeypatch.setattr(os, "preadv", fault)
    _, ids, ref = qwen3
    fault.armed = True
    got = logits_of(model, ids, STEPS, 128)
    assert fault.fired == 1
    assert_bitwise(got, ref)
    model.gguf.check_unchanged()


@pytest.mark.parametrize("how", ["replace", "rename", "delete"])
def test_resident_model_goes_on_after_the_path_moves(qwen3, tmp_path, how):
    """--moe-stream off: the experts are a map of the descriptor opened at load; moving the path away changes
    nothing."""
    _, ids, ref = qwen3
    path = str(tmp_path / "copy.gguf")
    shutil.copy(qwen3[0].gguf.path, path)
    model = load_model(path, LoadOptions(moe_stream=False))
    _move_path(path, how)
    assert_bitwise(logits_of(model, ids, STEPS, 128), ref)


def _copy_changed_on_first_output(tmp_path, monkeypatch, change: Callable[[str], None]) -> str:
    """A copy of the embedded model; ``change(path)`` runs at the first text the CLI writes (the prompt echo, after
    the prefill: the decode steps that follow read experts the pools do not hold yet)."""
    from moestream import cli as cli_mod

    path = str(tmp_path / "copy.gguf")
    shutil.copy(DEFAULT_GGUF, path)
    real = cli_mod.write_stdout
    done = []

    def write(text: str) -> None:
        if not done:
            done.append(1)
            change(path)
        real(text)

    monkeypatch.setattr(cli_mod, "write_stdout", write)
    return path


@pytest.mark.parametrize("stream", ["on", "off"])
@pytest.mark.parametrize("how", ["replace", "rename", "delete"])
def test_run_goes_on_when_the_file_moves(tmp_path, monkeypatch, how, stream):
    """The issue's case: run -m copy.gguf, then rm copy.gguf (or mv, or a byte-identical copy renamed over it)
    while it runs: the run finishes with the text of an undisturbed run."""
    argv = ["-n", "12", "--temp", "0", "--slots", "4", "--moe-stream", stream]
    ref = cli("run", "-m", str(DEFAULT_GGUF), *argv)
    assert ref.returncode == 0, ref.stderr

    def move(path: str) -> None:
        if how == "replace":  # a byte-identical copy renamed over the path: another inode
            shutil.copy(path, path + ".new")
            os.replace(path + ".new", path)
        else:
            _move_path(path, how)

    path = _copy_changed_on_first_output(tmp_path, monkeypatch, move)
    p = cli("run", "-m", path, *argv)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ref.stdout


@pytest.mark.parametrize("stream", ["on", "off"])
def test_run_stops_when_the_file_changes_in_place(tmp_path, monkeypatch, stream):
    """The open file's own bytes change (here it grows: size and mtime): one line naming the file, exit 1."""
    def append(path: str) -> None:
        with open(path, "ab") as f:
            f.write(b"\0" * 16)

    path = _copy_changed_on_first_output(tmp_path, monkeypatch, append)
    size = os.path.getsize(DEFAULT_GGUF)
    p = cli("run", "-m", path, "-n", "12", "--temp", "0", "--slots", "4", "--moe-stream", stream)
    assert p.returncode == 1
    err = [line for line in p.stderr.splitlines() if "error" in line]
    assert err == [f"moestream: error: {path}: model file changed size from {size} to {size + 16} bytes while in "
                   f"use; stopping"], p.stderr


# ------------------------------------------------------------------------------------------------ O_DIRECT refused
def einval(fd, buffers, offset):
    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))


def test_direct_refused_mid_run_falls_back_once(streamed, monkeypatch):
    """EINVAL from an O_DIRECT read after the run started: that read is retried buffered, the file is read
    buffered from then on, one note says so, and the logits are the same."""
    notes: list[str] = []
    model, store, ids, ref = streamed(direct_io=True, note=notes.append)
    assert store.direct_io
    fault = Fault(model.gguf.path, *last_layer_range(model), einval, times=1)
    fault.armed = True
    monkeypatch.setattr(os, "preadv", fault)
    assert_bitwise(logits_of(model, ids, STEPS, 128), ref)
    assert fault.fired == 1
    assert len(notes) == 1 and notes[0].startswith(f"{model.gguf.path}: O_DIRECT read refused"), notes
    assert not store.direct_io and store.reader.direct_refused == {model.gguf.path}
    assert_slots_hold_their_experts(model, store)
    # the next run (reads in flight at the refusal may still have been direct; none started after this one)
    fault.direct_after, reads = 0, store.reader.reads
    assert_bitwise(logits_of(model, ids, STEPS, 128), ref)
    assert store.reader.reads > reads and fault.direct_after == 0, "after the refusal no read may use O_DIRECT"
    assert len(notes) == 1


def test_direct_refused_mid_run_through_the_cli(qwen3moe_tiny, monkeypatch):
    """``verify --direct-io on`` with O_DIRECT refused at one read: identical, one note line on stderr."""
    path = str(qwen3moe_tiny["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False))
    fault = Fault(path, *last_layer_range(model), einval)
    model.store.close()
    fault.armed = True
    monkeypatch.setattr(os, "preadv", fault)
    p = cli("verify", "-m", path, "--steps", "4", "--slots", "4", "--direct-io", "on", "-p", PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("identical: 5 steps") and "buffered IO" in p.stdout, p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"moestream: note: {path}: O_DIRECT read refused"), p.stderr
    assert fault.fired == 1


# ------------------------------------------------------------------------------------------------ command line
@pytest.mark.parametrize("direct", ["on", "off"])
def test_run_with_eio_is_one_error_line(qwen3moe_tiny, monkeypatch, direct):
    path = str(qwen3moe_tiny["q8_0"])
    fault = Fault(path, 0, 1 << 62, eio, times=1 << 30)
    fault.armed = True
    monkeypatch.setattr(os, "preadv", fault)
    p = cli("run", "-m", path, "-n", "4", "--slots", "4", "--direct-io", direct, "-p", PROMPT)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"moestream: error: {path}: reading ") and lines[0].endswith("Input/output error")
    assert p.stdout == ""
    assert fault.fired >= 1
