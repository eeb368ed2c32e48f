"""O_DIRECT expert reads (``--direct-io``): aligned, padded slots; the same logits, bit for bit.

A direct read covers the expert with the aligned range around it, so the expert sits ``lead`` bytes into its
slot; these tests check that the compute side finds it there (fused kernels and the per-matrix path), that the
leads really are non-zero for the fixture files (GGUF experts are only 32-byte aligned), that pools and strides
are aligned, how pools are priced, and the fallback to buffered reads where O_DIRECT is refused.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from helpers import assert_bitwise, assert_slots_hold_their_experts, cli, logits_of, verify_identical
from moestream.errors import ConfigError, ExpertReadError
from moestream.experts import reader as reader_mod
from moestream.experts.layout import ExpertMatrix
from moestream.experts.pool import ResidentStore, StreamingStore, slot_stride
from moestream.experts.reader import ExpertReader, ReadJob, dio_alignment
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.tokenizer import GGUFTokenizer

PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot pool "
          "keeps the hot ones in memory while misses are read by the IO threads.")
STEPS = 12


# ------------------------------------------------------------------------------------------------ helpers
def assert_direct_layout(model: MoEModel, store: StreamingStore) -> None:
    """Pools start aligned, strides are multiples of the alignment, occupied slots' leads are their experts'
    file offsets modulo it, and some lead is non-zero (the test really addressed unaligned experts)."""
    assert store.direct and store.align >= 512 and store.align & (store.align - 1) == 0
    nonzero = 0
    for layer, mats in model.layout.layers.items():
        sm = store.slots[layer]
        for name, m in mats.items():
            pool, lead = store.matrix(layer, name), store.lead(layer, name)
            assert pool.dtype == torch.uint8 and pool.shape[0] == sm.n_slots
            assert pool.data_ptr() % store.align == 0 and pool.stride(0) % store.align == 0
            assert pool.stride(0) >= m.bytes_per_expert
            assert lead.dtype == np.int64 and lead.shape == (sm.n_slots,)
            for slot, expert in enumerate(sm.expert_of.tolist()):
                if expert >= 0:
                    assert lead[slot] == m.expert_offset(expert) % store.align
                    assert lead[slot] + m.bytes_per_expert <= pool.stride(0)
                    nonzero += lead[slot] != 0
    assert nonzero, "every expert started on an aligned offset: the lead was never exercised"
    assert_slots_hold_their_experts(model, store)


def streaming(model: MoEModel, slots: int, **kw) -> StreamingStore:
    return StreamingStore(model.gguf, model.layout, slots, model.top_k, io_threads=4, **kw)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def qwen3(qwen3moe_tiny):
    """(resident Q8_0 model, prompt ids, resident reference logits for ubatch 128 and 7)."""
    path = str(qwen3moe_tiny["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False))
    ids = GGUFTokenizer.from_gguf(path).encode(PROMPT)
    refs = {ub: logits_of(model, ids, STEPS, ub) for ub in (128, 7)}
    yield model, ids, refs
    model.store.close()


@pytest.fixture(scope="module")
def qwen3_dequant(qwen3moe_tiny):
    """The Q8_0 model with ``--matmul dequant`` (the per-matrix ``MoE._expert`` path) and its reference."""
    path = str(qwen3moe_tiny["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False, matmul="dequant"))
    ids = GGUFTokenizer.from_gguf(path).encode(PROMPT)[:24]
    yield model, ids, logits_of(model, ids, 6, 128)
    model.store.close()


@pytest.fixture(scope="module")
def gemma4(fixtures_tool):
    """Gemma 4 tiny Q8_0 (merged gate_up experts), resident, dense weights expanded (as test_gemma4.py)."""
    path = str(fixtures_tool.build_fixture("gemma4-tiny")["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False, expand_dense=True))
    ids = GGUFTokenizer.from_gguf(path).encode(PROMPT)
    yield model, ids, logits_of(model, ids, 8, 128)
    model.store.close()


# ------------------------------------------------------------------------------------------------ identity
@pytest.mark.parametrize("pool,ubatch,overlap", [
    ("top_k", 128, True),   # smallest pool: tiled prefill with the next tile prefetched, decode misses
    ("top_k", 7, True),     # prompt in several chunks
    ("half", 128, False),   # tiles of the whole pool, no prefetch
])
@pytest.mark.parametrize("direct", [True, False])
def test_qwen3_direct_buffered_resident_identical(qwen3, pool, ubatch, overlap, direct):
    model, ids, refs = qwen3
    slots = {"top_k": model.top_k, "half": model.n_experts // 2}[pool]
    store = streaming(model, slots, direct_io=direct)
    saved = model.opts
    model.opts = LoadOptions(**{**saved.__dict__, "overlap": overlap})
    model.set_store(store)
    try:
        assert_bitwise(logits_of(model, ids, STEPS, ubatch), refs[ubatch])
        assert store.stats.misses and store.stats.hits
        if direct:
            assert_direct_layout(model, store)
        else:
            assert not store.direct and store.align == 1
            for layer, mats in model.layout.layers.items():
                for name, m in mats.items():
                    assert store.matrix(layer, name).stride(0) == m.bytes_per_expert
                    assert not store.lead(layer, name).any()
    finally:
        model.opts = saved
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.mark.parametrize("align", [4096, 1 << 16])
def test_qwen3_direct_identical_at_larger_alignments(qwen3, align):
    """The kernel asks 512 bytes of this machine's ext4; 4096 (common elsewhere) and 64 KiB (more padding than
    an expert matrix's 68 KiB is a multiple of) give the same logits."""
    model, ids, refs = qwen3
    store = streaming(model, model.top_k + 2, direct_io=True, align=align)
    model.set_store(store)
    try:
        assert store.align == align
        assert_bitwise(logits_of(model, ids, STEPS, 128), refs[128])
        assert_direct_layout(model, store)
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.mark.parametrize("direct", [True, False])
def test_qwen3_per_matrix_path_identical(qwen3_dequant, direct):
    """``MoE._expert`` (one matmul per matrix) slices the expert at its lead."""
    model, ids, ref = qwen3_dequant
    store = streaming(model, model.top_k, direct_io=direct, align=4096 if direct else None)
    model.set_store(store)
    try:
        assert_bitwise(logits_of(model, ids, 6, 128), ref)
        if direct:
            assert_direct_layout(model, store)
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.mark.parametrize("direct", [True, False])
def test_gemma4_merged_gate_up_identical(gemma4, direct):
    model, ids, ref = gemma4
    store = streaming(model, model.n_experts // 2, direct_io=direct)
    model.set_store(store)
    try:
        assert_bitwise(logits_of(model, ids, 8, 128), ref)
        if direct:
            assert_direct_layout(model, store)
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


def test_verify_passes_direct_io_through(qwen3, monkeypatch):
    """``moestream.verify`` builds its streaming store with the options' direct_io."""
    model, ids, _ = qwen3
    made = []
    real = model.make_store

    def spy(opts, *a, **k):
        made.append(real(opts, *a, **k))
        return made[-1]

    monkeypatch.setattr(model, "make_store", spy)
    for direct in (True, False):
        res = verify_identical(model, ids, 8, "half", direct_io=direct, io_threads=4)
        assert made[-1].direct is direct and res.direct_io is direct
    model.set_store(ResidentStore(model.gguf, model.layout))


# ------------------------------------------------------------------------------------------------ pricing
def test_slot_bytes_prices_the_pools(qwen3):
    model, _, _ = qwen3
    layout = model.layout
    for direct in (True, False):
        store = streaming(model, 5, direct_io=direct)
        try:
            for layer in layout.layers:
                per_slot = sum(p.stride(0) for p in store.pools[layer].values())
                assert StreamingStore.slot_bytes(layout, layer, direct, store.align) == per_slot
                assert per_slot >= layout.bytes_per_expert(layer)
                if not direct:
                    assert per_slot == layout.bytes_per_expert(layer)
            assert StreamingStore.pool_bytes_of(layout, 5, direct, store.align) == store.pool_bytes
        finally:
            store.close()
    assert StreamingStore.pool_bytes_of(layout, 5, False, 4096) == layout.pool_bytes(5)


@pytest.mark.parametrize("direct", [True, False])
def test_memory_plan_prices_what_the_store_allocates(qwen3, direct):
    """A --mem plan prices slots as the store of its direct_io will allocate them (padded for O_DIRECT)."""
    model, _, _ = qwen3
    layout = model.layout
    mode = StreamingStore.read_mode(layout, direct)
    assert mode[0] is direct and (mode[1] >= 512 if direct else mode[1] == 1)
    if direct:
        assert all(StreamingStore.slot_bytes(layout, la, *mode) > layout.bytes_per_expert(la) for la in layout.layers)
    minimum = model.plan_memory(LoadOptions(mem=2**40, direct_io=direct), n_ctx=64).minimum
    opts = LoadOptions(mem=minimum + 8 * 2**20, n_ctx=64, direct_io=direct)
    store = model.make_store(opts, n_ctx=64)
    try:
        plan = model.memory_plan
        assert store.direct is direct and store.slots_per_layer() == plan.slots
        assert any(n > model.top_k for n in plan.slots.values()), "the budget bought no slot past the minimum"
        assert store.pool_bytes == plan.pools == StreamingStore.pool_bytes_of(layout, plan.slots, *mode)
    finally:
        store.close()
        model.memory_plan = None


@pytest.mark.parametrize("bpe,offset,align", [(1000, 32, 512), (69632, 3136, 4096), (4096, 0, 4096),
                                              (96, 64, 4096), (5000, 4064, 1 << 16)])
def test_slot_stride_holds_every_experts_aligned_range(bpe, offset, align):
    """Against every expert of the matrix: the aligned range around it fits the stride, and the stride is the
    smallest multiple of the alignment that does (experts whose size is not a multiple of it have varying
    leads)."""
    m = ExpertMatrix(layer=0, matrix="down", ggml_type=0, n_experts=64, rows=1, cols=1, bytes_per_expert=bpe,
                     path="x", part=0, offset=offset)
    stride = slot_stride(m, align)
    ends = [m.expert_offset(e) % align + bpe for e in range(m.n_experts)]
    assert stride % align == 0 and stride >= max(ends) and stride - align < max(ends)
    assert slot_stride(m, 1) == bpe


# ------------------------------------------------------------------------------------------------ reader
@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(3 * 4096 + 1234)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return str(path), data


def aligned_buffer(n: int, align: int) -> tuple[np.ndarray, memoryview]:
    raw = np.empty(n + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    arr = raw[skip:skip + n]
    return arr, memoryview(arr)


def test_direct_read_runs_past_the_end_of_the_file(data_file):
    """The aligned range of the last expert runs past EOF: the read stops short, which is fine once the expert's
    own bytes arrived; an expert that itself runs past EOF is the short-read error naming its offset and size."""
    path, data = data_file
    align = dio_alignment(path) or 4096
    r = ExpertReader(2)
    try:
        assert r.open(path, direct=True) == (dio_alignment(path) is not None)
        off, n = len(data) - 1000, 1000
        a0 = off - off % align
        lead = off - a0
        length = -(-(lead + n) // align) * align
        arr, view = aligned_buffer(length, align)
        assert a0 + length > len(data)
        r.wait(r.submit([ReadJob(path, a0, view, lead, n, True)]))
        assert arr[lead:lead + n].tobytes() == data[off:]
        assert r.bytes_read == len(data) - a0
        # the expert one byte earlier, and one byte past the end
        msg = rf"reading 1002 bytes of expert data at offset {off - 1} failed: short read: got 1001 bytes"
        with pytest.raises(ExpertReadError, match=msg):
            r.wait(r.submit([ReadJob(path, a0, view, lead - 1, n + 2, True)]))
    finally:
        r.close()


def test_direct_read_of_unaligned_offsets_lands_at_the_lead(data_file):
    path, data = data_file
    align = 4096
    r = ExpertReader(4)
    try:
        jobs, want = [], []
        for off, n in [(32, 4000), (100, 4096), (4096 - 32, 64), (8192, 4096), (5000, 6000)]:
            a0 = off - off % align
            length = -(-(off - a0 + n) // align) * align
            arr, view = aligned_buffer(length, align)
            jobs.append(ReadJob(path, a0, view, off - a0, n, True))
            want.append((arr, off - a0, data[off:off + n]))
        r.wait(r.submit(jobs))
        for arr, lead, w in want:
            assert arr[lead:lead + len(w)].tobytes() == w
    finally:
        r.close()


# ------------------------------------------------------------------------------------------------ refusal
def _refuse_o_direct_open(monkeypatch, victim: str) -> list[str]:
    """open(2) of ``victim`` with O_DIRECT fails with EINVAL, as on a file system without direct IO (also through
    ``/proc/self/fd/N``, which the reader opens to read the file it was loaded from)."""
    real = os.open
    refused: list[str] = []
    target = os.path.realpath(victim)

    def fake(path, flags, *a, **k):
        if os.path.realpath(os.fspath(path)) == target and flags & reader_mod.O_DIRECT:
            refused.append(victim)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake)
    return refused


@pytest.mark.parametrize("direct_io", [True, None])
def test_refused_at_open_falls_back_with_one_note(qwen3, tmp_path, monkeypatch, direct_io):
    """O_DIRECT refused when the file is opened: buffered reads, identical logits; ``on`` says so in one line
    naming the file, the default (auto) says nothing."""
    model, ids, refs = qwen3
    refused = _refuse_o_direct_open(monkeypatch, model.gguf.path)
    assert dio_alignment(model.gguf.path) is None
    notes: list[str] = []
    store = streaming(model, model.top_k, direct_io=direct_io, note=notes.append)
    model.set_store(store)
    try:
        assert refused and not store.direct and not store.direct_io
        assert_bitwise(logits_of(model, ids, STEPS, 128), refs[128])
        if direct_io:
            assert len(notes) == 1 and model.gguf.path in notes[0] and "refuses O_DIRECT" in notes[0]
        else:
            assert notes == []
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


def test_tmpfs(qwen3moe_tiny, qwen3):
    """The file on tmpfs (/dev/shm). Linux >= 6.6 accepts O_DIRECT there (trivially: the page cache is the
    file), older kernels refuse it; either way the logits are identical, and a refusal is one note line on
    stderr with ``--direct-io on`` (in-process CLI)."""
    df = subprocess.run(["df", "-T", "/dev/shm"], capture_output=True, text=True)
    if df.returncode != 0 or "tmpfs" not in df.stdout:
        pytest.skip(f"/dev/shm is not tmpfs here: {df.stdout.strip() or df.stderr.strip()}")
    model, ids, refs = qwen3
    path = f"/dev/shm/moestream-test-{os.getpid()}.gguf"
    shutil.copy(qwen3moe_tiny["q8_0"], path)
    try:
        shm = load_model(path, LoadOptions(slots=model.top_k, io_threads=4, direct_io=True))
        try:
            assert_bitwise(logits_of(shm, ids, STEPS, 128), refs[128])
            assert shm.store.direct == (dio_alignment(path) is not None)
        finally:
            shm.store.close()
        p = cli("verify", "-m", path, "--steps", "4", "--slots", "4", "--direct-io", "on", "-p", PROMPT)
        assert p.returncode == 0, p.stderr
        notes = [ln for ln in p.stderr.splitlines() if ln.strip()]
        if dio_alignment(path) is None:
            assert len(notes) == 1 and path in notes[0] and "refuses O_DIRECT" in notes[0], p.stderr
            assert "buffered IO" in p.stdout
        else:
            assert notes == [], p.stderr
            assert "direct IO" in p.stdout
    finally:
        os.remove(path)


# ------------------------------------------------------------------------------------------------ command line
def test_verify_direct_io_on_in_process(qwen3moe_tiny):
    p = cli("verify", "-m", str(qwen3moe_tiny["q8_0"]), "--steps", "8", "--slots", "4", "--direct-io", "on",
            "-p", PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("identical: 9 steps") and ", direct IO," in p.stdout, p.stdout
    assert p.stderr == ""


def test_run_describes_the_reads():
    on = cli("run", "-n", "2", "--temp", "0", "--direct-io", "on")
    off = cli("run", "-n", "2", "--temp", "0", "--direct-io", "off")
    assert on.returncode == off.returncode == 0, (on.stderr, off.stderr)
    assert "direct IO (" in on.stderr and "buffered IO" in off.stderr
    assert on.stdout == off.stdout
    resident = cli("run", "-n", "2", "--temp", "0", "--direct-io", "on", "--moe-stream", "off")
    assert resident.returncode == 0 and resident.stdout == on.stdout and "resident" in resident.stderr


def test_bad_direct_io_values():
    p = cli("run", "--direct-io", "maybe")
    assert p.returncode == 2 and "--direct-io: expected on or off, got 'maybe'" in p.stderr
    p = cli("bench", "-p", "4", "-n", "2", "-r", "1", "--direct-io", "on,sometimes")
    assert p.returncode == 1 and "--direct-io: expected on, off or on,off" in p.stderr
    with pytest.raises(ConfigError, match="direct_io: expected on or off"):
        LoadOptions(direct_io="on")  # type: ignore[arg-type]
    # the spellings the docs give, any case; yes / 1 / true ran as on before 2026-12-05 (a newcomer's report)
    import argparse

    from moestream.cli import _on_off
    assert _on_off("ON") is True and _on_off(" off ") is False
    for word in ("yes", "1", "true", "no", "0", "false", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected on or off, got {word!r}"):
            _on_off(word)


def test_bench_rows_per_direct_io_value():
    p = cli("bench", "-p", "8", "-n", "2", "-r", "1", "--slots", "4", "--moe-stream", "on",
            "--direct-io", "on,off")
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if "| streaming |" in ln]
    assert len(rows) == 4
    assert sum("| direct |" in ln for ln in rows) == 2 and sum("| buffered |" in ln for ln in rows) == 2
    assert "| reads |" in p.stdout.splitlines()[0]
