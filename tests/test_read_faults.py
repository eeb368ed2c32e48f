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

import pytest

from helpers import assert_bitwise, assert_slots_hold_their_experts, cli, logits_of
from moestream.engine import Engine
from moestream.errors import ExpertReadError, ModelFileChanged
from moestream.experts import reader as reader_mod
from moestream.experts.pool import ResidentStore, StreamingStore
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.tokenizer import GGUFTokenizer

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
    assert str(err) == f"{path}: model file was modified while in use; stopping"
    fault.armed = False
    restore()
    check_after_fault(model, model.store, err, ids, ref)


def test_replaced_by_rename_during_a_read(own_copy, qwen3, monkeypatch):
    """Another file is renamed over the path in the middle of a step: the open descriptors still read the inode
    checked at load (consistent bytes: this step's logits are right), and the next step stops with
    ModelFileChanged. Renaming the original back (same inode) makes the model usable again."""
    model, path, restore = own_copy
    start, end = last_layer_range(model)
    backup = path + ".orig"

    def replace_then_read(fd, buffers, offset):
        os.link(path, backup)  # keeps the original inode to put back afterwards
        with open(path + ".new", "wb") as f:
            f.write(b"GGUF something else")
        os.replace(path + ".new", path)
        return REAL_PREADV(fd, buffers, offset)

    fault = Fault(path, start, end, replace_then_read)
    monkeypatch.setattr(os, "preadv", fault)
    _, ids, ref = qwen3
    eng = Engine(model)
    cache = model.new_cache(len(ids) + 1)
    fault.armed = True
    logits = eng.prefill(ids, cache, logits_all=True)
    assert fault.fired == 1
    assert_bitwise([logits], ref[:1])
    with pytest.raises(ModelFileChanged, match=f"^{path}: model file was replaced by another file while in use"):
        eng.decode_step(int(logits[-1].argmax()), len(ids), cache)
    os.replace(backup, path)
    check_after_fault(model, model.store, ModelFileChanged(), ids, ref)


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
