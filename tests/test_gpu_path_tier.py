"""The tier prefill (MoE._tier_prefill) on the CPU under Triton's interpreter, as tests/test_gpu_path.py runs the
rest of the GPU data path (whose helpers it uses). A file of its own so that pytest-xdist (``--dist loadfile``)
runs it beside test_gpu_path.py: the two are the suite's slowest files (its three cases took 15.4 min, the rest of
test_gpu_path.py 14.6 min, in one process on the busy 2-core machine) and tests/conftest.py hands both out first.

Bar: a prompt through the tier holding every expert gives the same bits as the resident store through the same
kernels.
"""

from __future__ import annotations

import pytest
import torch

# isort: split
# first: test_gpu_path sets TRITON_INTERPRET (or skips the module) before triton is imported
from test_gpu_path import _decode_on_device_path, _grouped_model

# isort: split
from helpers import assert_bitwise, logits_of
from moestream.errors import GGUFError
from moestream.experts.pool import ResidentStore
from moestream.models.base import LoadOptions

PROMPT = [1, 5, 9, 200, 7, 3, 11, 42, 99, 2, 17, 64]
_RESIDENT: list = []


def _resident_prompt(model) -> tuple[list[torch.Tensor], list]:  # noqa: ANN001
    """The resident store's prefill logits of PROMPT in chunks of 6 through the grouped kernels, and its routing
    trace (each chunk's experts per layer), made once."""
    if not _RESIDENT:
        store = ResidentStore(model.gguf, model.layout)
        store.trace = []
        model.set_store(store)
        _RESIDENT.extend([logits_of(model, PROMPT, 0, 6), store.trace])
    return _RESIDENT[0], _RESIDENT[1]


@pytest.mark.parametrize(("mode", "batch"), [("copy", 2), ("gather", 3), ("direct", 8)])
def test_tier_prefill_equals_resident(monkeypatch, mode, batch) -> None:  # noqa: ANN001
    """A prompt chunk through the tier holding every expert (issue 24 item 5; MoE._tier_prefill): the experts with a
    slot from the pool, the others copied from the tier rows into the double-buffered scratch in batches ("copy":
    runs of rows; "gather": the copy kernel) or read by the expert kernels from the tier rows ("direct"). Chunks of
    6 tokens select up to 24 of 64 experts through 4 slots (4 of them hits: given slots first), so the scratch's 2
    buffers of 2-3 experts are reused many times per layer and across layers and chunks. The prefill logits at
    every position equal, bit for bit, the resident store's through the same kernels; nothing is read from the
    file and no slot changes. "copy" also: the tiled slot path (MOESTREAM_TIER_PREFILL=off) gives the same bits,
    and so do the planned decode steps after the tier prefill (against the resident step's)."""
    from moestream.experts import devplan

    model, moes = _grouped_model(4)
    resident, trace = _resident_prompt(model)
    monkeypatch.setattr(devplan, "ON_CPU", True)
    monkeypatch.setenv("MOESTREAM_TIER_PREFILL", mode)
    monkeypatch.setenv("MOESTREAM_TIER_PREFILL_BATCH", str(batch))
    opts = LoadOptions(slots=4, matmul="dequant", host_cache=1 << 30)
    store = model.make_store(opts)
    plan = store.plan
    assert plan is not None and (plan.prefill is None) == (mode == "direct")
    model.set_store(store)
    for la, experts, _ in trace[:len(moes)]:  # the first chunk's first 4 experts of each layer get slots: hits
        _, ticket = store.prepare(la, list(experts[:4]))
        store.wait(ticket)
    chunks = []
    real = type(moes[0])._tier_prefill

    def spy(self, store, plan, mode, groups, x, out, shared):  # noqa: ANN001, ANN202
        held = int((store.slots[self.layer].slot_of[groups.experts] >= 0).sum())
        chunks.append((self.layer, groups.experts, held))
        return real(self, store, plan, mode, groups, x, out, shared)

    monkeypatch.setattr(type(moes[0]), "_tier_prefill", spy)
    ops: list[tuple[str, int]] = []  # the scratch's calls in host order: (fill | ready | release, buffer)
    if plan.prefill is not None:
        def logged(op: str, real):  # noqa: ANN001, ANN202
            def log(*args):  # noqa: ANN002, ANN202
                ops.append((op, args[1] if op == "fill" else args[0]))
                return real(*args)
            return log

        for op in ("fill", "ready", "release"):
            monkeypatch.setattr(plan.prefill, op, logged(op, getattr(plan.prefill, op)))
    maps = {la: sm.slot_of.copy() for la, sm in store.slots.items()}
    read = store.bytes_read
    store.trace = []  # bench's routing trace: replayed through a pool, so no request wider than the pool
    tiered = logits_of(model, PROMPT, 0, 6)
    assert store.trace and max(len(e) for _, e, _ in store.trace) <= 4
    assert sum(len(e) for _, e, _ in store.trace) == sum(len(e) for _, e, _ in chunks)  # every chunk's experts
    store.trace = None
    state: dict[int, str] = {}  # per buffer: fill, then its kernels (ready), then release, before the next fill
    for op, buf in ops:
        want = {"fill": ("release", None), "ready": ("fill",), "release": ("ready",)}[op]
        assert state.get(buf) in want, (op, buf, state.get(buf))
        state[buf] = op
    if ops:  # two buffers in flight: batch j + 1 filled before batch j computes
        assert [o for o, _ in ops[:3]] == ["fill", "fill", "ready"] and len({b for _, b in ops}) == 2
    assert len(chunks) == 2 * len(moes) and max(len(e) for _, e, _ in chunks) > max(2 * batch, 4)
    assert all(held == 4 for _, _, held in chunks[:len(moes)]), "the slots' experts are hits"
    assert all((store.slots[la].slot_of == maps[la]).all() for la in maps), "the prefill moved an expert"
    assert store.bytes_read == read
    if plan.prefill is not None:
        assert plan.prefill.copies > 0 and plan.prefill.bytes_copied > 0
    assert_bitwise(tiered, resident)
    if mode != "copy":
        store.close()
        return
    tiered_steps = _decode_on_device_path(model, PROMPT, 2, eager=False)  # chunks of 8 and 4, then planned steps
    store.close()
    monkeypatch.setenv("MOESTREAM_TIER_PREFILL", "off")
    slot_store = model.make_store(opts)
    model.set_store(slot_store)
    assert slot_store.plan is not None and slot_store.plan.prefill is None
    n = len(chunks)
    through_slots = logits_of(model, PROMPT, 0, 6)
    assert len(chunks) == n and slot_store.stats.misses > 0
    assert_bitwise(through_slots, resident)
    slot_store.close()
    model.set_store(ResidentStore(model.gguf, model.layout))
    assert_bitwise(tiered_steps, _decode_on_device_path(model, PROMPT, 2, eager=False))


def test_tier_prefill_takes_chunks_narrower_than_the_pool(monkeypatch) -> None:  # noqa: ANN001
    """A prompt chunk that selects fewer experts than the pool holds (32 slots of 64 experts, chunks of 6 tokens:
    at most 24 experts) also goes through MoE._tier_prefill ("gather"), not the slot path: the H200's 64-token
    chunks of the 32-layer bench file selected at most the ~36 slots' worth in 30 of 32 layers and spent 15.5 ms
    of host time per layer copying their misses into slots. The same bits as the resident store, no slot changed,
    nothing read from the file after the tier's fill, which reads by pread (not through the file's map)."""
    from moestream.experts import devplan

    model, moes = _grouped_model(4)
    resident, _ = _resident_prompt(model)
    monkeypatch.setattr(devplan, "ON_CPU", True)
    monkeypatch.setenv("MOESTREAM_TIER_PREFILL", "gather")
    with monkeypatch.context() as mp:  # the tier's fill reads by pread: the map's pages would count in the RSS
        mp.setattr(type(model.gguf), "mapped", lambda *a: (_ for _ in ()).throw(AssertionError("mapped")))
        store = model.make_store(LoadOptions(slots=32, matmul="dequant", host_cache=1 << 30))
    assert store.plan is not None
    want = sum(m.n_experts * m.bytes_per_expert for mats in model.layout.layers.values() for m in mats.values())
    assert store.tier.fill_bytes == want and store.tier.fill_seconds > 0
    from moestream.cli import _tier_line
    assert f"filled with every expert at load: {want / 2**30:.3f} GiB" in _tier_line(store)
    info = next(i for n, i in model.gguf.tensors.items() if n.endswith("_exps.weight"))
    buf = bytearray(64)
    model.gguf.read_into(info, info.n_bytes - 64, memoryview(buf))
    assert bytes(buf) == model.gguf.mapped(info)[-64:].numpy().tobytes()
    with pytest.raises(GGUFError, match="outside tensor"):
        model.gguf.read_into(info, info.n_bytes - 63, memoryview(buf))
    model.set_store(store)
    chunks = []
    real = type(moes[0])._tier_prefill

    def spy(self, store, plan, mode, groups, x, out, shared):  # noqa: ANN001, ANN202
        chunks.append((self.layer, len(groups.experts), store.capacity(self.layer)))
        return real(self, store, plan, mode, groups, x, out, shared)

    monkeypatch.setattr(type(moes[0]), "_tier_prefill", spy)
    maps = {la: sm.slot_of.copy() for la, sm in store.slots.items()}
    read = store.bytes_read
    tiered = logits_of(model, PROMPT, 0, 6)
    assert len(chunks) == 2 * len(moes) and all(n <= cap for _, n, cap in chunks)
    assert all((store.slots[la].slot_of == maps[la]).all() for la in maps), "the prefill moved an expert"
    assert store.bytes_read == read and store.plan.prefill.copies > 0
    assert_bitwise(tiered, resident)
    # a step of three sequences' decode tokens (serve -np 3) keeps the slot path: its misses get slots, as a
    # lone decode step's do; a step with a two-token chunk beside a decode token is a prompt chunk: the tier path
    n = len(chunks)
    maps = {la: sm.slot_of.copy() for la, sm in store.slots.items()}
    decodes = _step(model, [[5], [99], [200]])
    assert len(chunks) == n and any((store.slots[la].slot_of != maps[la]).any() for la in maps)
    mixed = _step(model, [[5, 7], [99]])
    assert len(chunks) == n + len(moes)
    store.close()
    model.set_store(ResidentStore(model.gguf, model.layout))
    assert_bitwise([decodes, mixed], [_step(model, [[5], [99], [200]]), _step(model, [[5, 7], [99]])])


def _step(model, seqs: list[list[int]]) -> torch.Tensor:  # noqa: ANN001
    """One Runner.step of the given sequences' tokens, each from position 0 of a cache of its own -> logits."""
    with torch.inference_mode():
        return model.runner.step([(torch.tensor(t), 0, model.new_cache(4)) for t in seqs])
