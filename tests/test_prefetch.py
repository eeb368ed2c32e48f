"""Router-lookahead prefetch (``--prefetch``): the store's prefetch, its statistics, and bitwise identity.

Store level (``StreamingStore.prefetch`` driven directly, reads gated by a fake ``ExpertReader._read``): an exact
prediction gives recall 1.0 and every miss byte ready; reads still in flight join prepare()'s ticket; a slot whose
prefetch read is in flight is never handed to another expert before that read settles; a failed prefetch read
empties its slot (raised only when a step needed the expert while it was being read).

Model level, on the fixture models of the three architectures: streaming with prefetch on and off gives logits
bitwise equal to the resident run with small pools (misses and mispredictions happen), in decode and prefill; an
adversarial predictor changes nothing; with every attention output zeroed the prediction is the real routing,
so recall is exactly 1.0 (the prediction uses each arch's own routing code); a prefetch read error leaves the
pool consistent and a later run is still identical; ``verify --prefetch on`` passes through ``cli.main``.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from helpers import cli, moestream, verify_identical
from moestream import bench
from moestream.engine import Engine, Sampler, SamplingParams
from moestream.errors import ExpertReadError
from moestream.experts import reader as reader_mod
from moestream.experts.pool import ResidentStore, StreamingStore
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.tokenizer import GGUFTokenizer

PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot pool "
          "keeps the hot ones in memory while misses are read by the IO threads.")


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def qwen3(qwen3moe_tiny) -> tuple[MoEModel, list[int]]:
    path = str(qwen3moe_tiny["q8_0"])
    model = load_model(path, LoadOptions(moe_stream=False, prefetch=True))  # prefetch: off by default
    return model, GGUFTokenizer.from_gguf(path).encode(PROMPT)


@pytest.fixture(scope="module")
def models(qwen3, fixtures_tool) -> Any:
    """arch -> (a resident model of its tiny fixture's Q8_0 file, the prompt's ids), loaded on first use."""
    cache: dict[str, tuple[MoEModel, list[int]]] = {"qwen3moe": qwen3}

    def get(arch: str) -> tuple[MoEModel, list[int]]:
        if arch not in cache:
            path = str(fixtures_tool.build_fixture(f"{arch}-tiny")["q8_0"])
            # Gemma 4: dense weights expanded at load (its tied 262k-row output matrix), as test_gemma4 does
            model = load_model(path, LoadOptions(moe_stream=False, prefetch=True, expand_dense=arch == "gemma4"))
            cache[arch] = model, GGUFTokenizer.from_gguf(path).encode(PROMPT)
        return cache[arch]
    return get


class Gate:
    """Stands in for ``ExpertReader._read``: reads of layer ``layer``'s experts in ``hold`` wait until
    ``release()``; those in ``fail`` raise ExpertReadError("injected") instead of reading; every read of the layer
    logs ``("start"|"end"|"fail", expert)`` in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: MoEModel, layer: int):
        self.owner = {m.expert_offset(e): e for m in model.layout[layer].values() for e in range(m.n_experts)}
        self.hold: set[int] = set()
        self.fail: set[int] = set()
        self.log: list[tuple[str, int]] = []
        self.opened = threading.Event()
        real = reader_mod.ExpertReader._read

        def read(reader: reader_mod.ExpertReader, job: reader_mod.ReadJob) -> int:
            e = self.owner.get(job.offset + job.lead)  # the expert's own offset (a direct read starts before it)
            if e is None:
                return real(reader, job)
            self.log.append(("start", e))
            if e in self.hold:
                assert self.opened.wait(20), "the gate was never released"
            if e in self.fail:
                self.log.append(("fail", e))
                raise ExpertReadError(job.path, job.offset + job.lead, job.nbytes or len(job.dest), "injected")
            n = real(reader, job)
            self.log.append(("end", e))
            return n

        monkeypatch.setattr(reader_mod.ExpertReader, "_read", read)

    def release(self) -> None:
        self.opened.set()


def new_store(model: MoEModel, n_slots: int, io_threads: int = 4) -> StreamingStore:
    """Buffered reads: the byte counts below are the experts' own (direct reads add alignment padding; the
    prefetch paths are the same either way, and the identity tests run direct)."""
    return StreamingStore(model.gguf, model.layout, n_slots, model.top_k, io_threads, direct_io=False)


def settle(store: StreamingStore, layer: int) -> None:
    """Block until every prefetch read of ``layer`` has finished (the store joins them at its next call)."""
    futures = [f for r in store._pending[layer].values() for f in r.ticket.futures]
    end = time.monotonic() + 20  # (the C reader's futures are not concurrent.futures ones: poll done())
    while not all(f.done() for f in futures) and time.monotonic() < end:
        time.sleep(0.001)


def file_bytes(m: Any, expert: int) -> bytes:
    with open(m.path, "rb") as f:
        f.seek(m.expert_offset(expert))
        return f.read(m.bytes_per_expert)


def check_consistent(store: StreamingStore) -> None:
    """Every layer's slot map is a bijection between mapped experts and slots."""
    for sm in store.slots.values():
        for s, e in enumerate(sm.expert_of.tolist()):
            if e >= 0:
                assert sm.slot_of[e] == s
        for e, s in enumerate(sm.slot_of.tolist()):
            if s >= 0:
                assert sm.expert_of[s] == e


def check_bytes(store: StreamingStore, layer: int, experts: list[int] | None = None) -> int:
    """``experts`` (default: every mapped one) sit in their slots with the file's exact bytes; returns how many
    matrices were compared."""
    sm = store.slots[layer]
    experts = [e for e in sm.expert_of.tolist() if e >= 0] if experts is None else experts
    n = 0
    for e in experts:
        s = int(sm.slot_of[e])
        assert s >= 0, f"expert {e} is not in a slot"
        for name, m in store.layout[layer].items():
            lead = int(store.lead(layer, name)[s])
            got = bytes(store.matrix(layer, name)[s, lead:lead + m.bytes_per_expert].numpy())
            assert got == file_bytes(m, e), (layer, e, name)
            n += 1
    return n


# ------------------------------------------------------------------------------------------------ store level
def test_exact_prediction_recall_one_and_every_miss_byte_ready(qwen3):
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    store = new_store(model, model.top_k)
    try:
        experts = [3, 9, 0, 14]
        assert store.prefetch(layer, experts) == 4
        settle(store, layer)
        slot_ids, ticket = store.prepare(layer, experts)
        assert ticket is None, "finished prefetch reads are joined by prepare: nothing left to wait for"
        st = store.stats
        assert (st.hits, st.misses, st.prefetch_issued, st.prefetch_used, st.prefetch_wasted) == (4, 0, 4, 4, 0)
        assert st.recall == 1.0 and st.ready_share == 1.0
        assert st.miss_bytes == st.miss_bytes_ready == 4 * sum(m.bytes_per_expert for m in model.layout[layer].values())
        assert [int(store.slots[layer].slot_of[e]) for e in experts] == slot_ids
        assert check_bytes(store, layer, experts) == 4 * len(model.layout[layer])
        assert store.bytes_read == st.miss_bytes
        # a half-right prediction: recall 1/2; the two wrong guesses are evicted unused (wasted)
        store.prefetch(layer, [1, 2, 5, 6])
        settle(store, layer)
        store.wait(store.prepare(layer, [1, 2, 7, 8])[1])
        st = store.stats
        assert st.predicted - 4 == 2 and st.predictable - 4 == 4
        assert st.prefetch_wasted == 2 and st.misses == 2
        check_bytes(store, layer, [1, 2, 7, 8])
        check_consistent(store)
    finally:
        store.close()


def test_gated_prefetch_closes_the_ranks_whose_reads_are_wasted(qwen3, monkeypatch):
    """prefetch(gate=True): each rank of a prediction is read while its reads are counted fewer than LOOK_WARM
    times or at least the minimum share of them was used by the step (prepare() counts them); a rank whose reads
    are wasted closes (its expert is then only predicted, neither read nor evicted), one whose reads are used stays
    open; with every rank closed look_wanted() says yes only every LOOK_EXPLORE-th time."""
    from moestream.experts import pool as pool_mod

    monkeypatch.setenv("MOESTREAM_LOOKAHEAD_MIN", "0.5")
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    store = new_store(model, 8)
    try:
        closed = None
        for t in range(24):
            right, wrong = [e for e in range(model.n_experts) if store.slots[layer].slot_of[e] < 0][:2]
            n = store.prefetch(layer, [right, wrong], gate=True, kind=1)  # rank 0 right, rank 1 wrong
            if closed is None and n == 1:
                closed = t
            assert n == (2 if closed is None else 1), (t, n)
            settle(store, layer)
            store.wait(store.prepare(layer, [right])[1])
        assert closed is not None and closed >= pool_mod.LOOK_WARM
        assert store.look_worth(1, 0) and not store.look_worth(1, 1)
        assert store.look_worth(0, 1), "the other kind's counts are its own"
        assert store._predicted[layer] == {right, wrong}, "a closed rank is still predicted (recall)"
        store.look_stats[1, 0] = (20.0, 0.0)  # every rank of kind 1 closed
        wanted = [store.look_wanted(1, 2) for _ in range(2 * pool_mod.LOOK_EXPLORE)]
        assert sum(wanted) == 2 and wanted[pool_mod.LOOK_EXPLORE - 1]
        check_consistent(store)
    finally:
        store.close()


def test_a_refined_prediction_cancels_the_queued_guesses_it_drops(qwen3, monkeypatch):
    """prefetch(cancel=True), the prediction from the layer's input after an early one: an early guess it no longer
    names whose reads are still queued is cancelled and leaves the pool (its slot free for the new guesses); one it
    names again keeps its reads; the bytes of every expert the step then uses are the file's."""
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, 8, io_threads=1)  # one read thread: the first read held, the rest queued
    try:
        gate.hold = {0}
        assert store.prefetch(layer, [0, 1, 2]) == 3
        assert store.prefetch(layer, [0, 2, 3], cancel=True) == 1  # 1 cancelled (queued), 3 read
        assert store.stats.prefetch_cancelled == 1 and 1 not in store._pending[layer]
        assert store.slots[layer].slot_of[1] < 0
        gate.release()
        settle(store, layer)
        store.wait(store.prepare(layer, [0, 2, 3])[1])
        assert store.stats.prefetch_used == 3
        check_bytes(store, layer, [0, 2, 3])
        check_consistent(store)
    finally:
        store.close()


def test_prefetch_reads_in_flight_join_the_ticket_first(qwen3, monkeypatch):
    """A step that needs experts whose prefetch reads are still running: they count as hits, their reads lead
    the ticket (then the step's own misses), none of their bytes counts as ready, and wait joins them."""
    model, _ = qwen3
    layer = model.layout.moe_layers[1]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, model.top_k + 2)
    try:
        gate.hold = {4, 11}
        assert store.prefetch(layer, [11, 4]) == 2
        slot_ids, ticket = store.prepare(layer, [2, 4, 11, 13])
        assert store.reading(ticket) == [4, 11, 2, 13]  # prefetched (in the step's order), then misses
        assert store.ready(ticket) == 0  # the first expert of the ticket is still held
        assert (store.stats.hits, store.stats.misses) == (2, 2)
        assert store.stats.miss_bytes_ready == 0 and store.stats.ready_share == 0.0
        gate.release()
        store.wait(ticket, through=4)
        store.wait(ticket)
        check_bytes(store, layer, [2, 4, 11, 13])
        assert dict(zip([2, 4, 11, 13], slot_ids, strict=True)) == {
            e: int(store.slots[layer].slot_of[e]) for e in (2, 4, 11, 13)}
    finally:
        gate.release()
        store.close()


def test_pending_slot_is_not_handed_to_another_expert_before_its_read_settles(qwen3, monkeypatch):
    """Every slot holds a prefetch whose reads are blocked; a step needing four other experts must wait for those
    reads before any of its own starts (no read may land in a slot that then belongs to another expert)."""
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, model.top_k)
    try:
        held, step = [0, 1, 2, 3], [8, 9, 10, 11]
        gate.hold = set(held)
        assert store.prefetch(layer, held) == 4
        assert store.prefetch(layer, [5, 6]) == 0, "a prefetch must not take a slot whose read is in flight"
        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("r", store.prepare(layer, step)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive(), "prepare() reused a slot whose prefetch read was still in flight"
        assert not [e for _, e in gate.log if e in step], "a read of the step started before the held ones settled"
        gate.release()
        worker.join(20)
        assert not worker.is_alive()
        store.wait(out["r"][1])
        first_step_read = next(i for i, (_, e) in enumerate(gate.log) if e in step)
        starts = [i for i, (ev, e) in enumerate(gate.log) if ev == "start" and e in held]
        ends = [i for i, (ev, e) in enumerate(gate.log) if ev == "end" and e in held]
        assert len(starts) == len(ends) >= 1 and max(ends) < first_step_read, gate.log
        check_bytes(store, layer, step)
        check_consistent(store)
        st = store.stats
        assert st.prefetch_wasted == 4 and st.stall_seconds > 0.3
        # 4 IO threads, 3 reads per expert: the queued reads of the unneeded experts were cancelled at prepare()
        assert len(starts) == 4 and st.prefetch_cancelled >= 1
    finally:
        gate.release()
        store.close()


def test_unneeded_prefetch_reads_still_queued_are_cancelled(qwen3, monkeypatch):
    """One IO thread, its read held: the step needs none of the prefetched experts, so prepare() cancels their
    queued reads (they never run) and drops them; the slot whose read had started is reused only after it ends."""
    model, _ = qwen3
    layer = model.layout.moe_layers[1]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, model.top_k, io_threads=1)
    try:
        gate.hold = {5}
        assert store.prefetch(layer, [5, 6]) == 2  # 5's first read runs (held); the rest is queued
        deadline = time.monotonic() + 10
        while ("start", 5) not in gate.log and time.monotonic() < deadline:
            time.sleep(0.01)
        step = [0, 1, 2, 3]
        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("r", store.prepare(layer, step)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive(), "5's slot must wait for its running read"
        sm = store.slots[layer]
        assert sm.slot_of[5] == -1 and sm.slot_of[6] == -1, "cancelled experts leave the pool at once"
        gate.release()
        worker.join(20)
        store.wait(out["r"][1])
        assert gate.log.count(("start", 5)) == 1 and ("start", 6) not in gate.log, "cancelled reads never run"
        assert gate.log.index(("end", 5)) < next(i for i, (_, e) in enumerate(gate.log) if e in step)
        st = store.stats
        assert (st.prefetch_issued, st.prefetch_cancelled, st.prefetch_wasted, st.prefetch_used) == (2, 2, 2, 0)
        check_bytes(store, layer, step)
        check_consistent(store)
        assert store.bytes_read == 4 * sum(m.bytes_per_expert for m in model.layout[layer].values()) + (
            next(iter(model.layout[layer].values())).bytes_per_expert), "the one read of 5 that ran is counted"
    finally:
        gate.release()
        store.close()


def test_free_slots_are_used_before_a_pending_one(qwen3, monkeypatch):
    """With slots to spare, a step's misses go around the slots whose prefetch reads are in flight (no wait), and
    those experts keep their slots. (More IO threads than held reads: the reader is FIFO, so a demand read queues
    behind the prefetch reads submitted before it.)"""
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, 2 * model.top_k, io_threads=4 * len(model.layout[layer]) + 4)
    try:
        gate.hold = {0, 1, 2, 3}
        store.prefetch(layer, [0, 1, 2, 3])
        pending = {e: int(store.slots[layer].slot_of[e]) for e in (0, 1, 2, 3)}
        t0 = time.perf_counter()
        slot_ids, ticket = store.prepare(layer, [8, 9, 10, 11])
        store.wait(ticket)
        assert time.perf_counter() - t0 < 5 and not set(slot_ids) & set(pending.values())
        assert {e: int(store.slots[layer].slot_of[e]) for e in (0, 1, 2, 3)} == pending
        gate.release()
        settle(store, layer)
        assert store.prepare(layer, [0, 1, 2, 3]) == (list(pending.values()), None)
        check_bytes(store, layer)
    finally:
        gate.release()
        store.close()


def test_prefetch_never_evicts_pinned_or_predicted_experts(qwen3):
    model, _ = qwen3
    layer = model.layout.moe_layers[0]
    store = new_store(model, 6)
    try:
        store.wait(store.prepare(layer, [0, 1, 2, 3])[1])
        store.wait(store.prepare(layer, [4, 5])[1])
        before = {e: int(store.slots[layer].slot_of[e]) for e in (0, 1, 4)}
        # pinned 0 and 1; 4 is predicted and resident: only 2, 3 and 5 may go, so 3 of the 4 new ones are read
        assert store.prefetch(layer, [4, 12, 13, 14, 15], pinned=[0, 1]) == 3
        assert {e: int(store.slots[layer].slot_of[e]) for e in (0, 1, 4)} == before
        assert [store.slots[layer].slot_of[e] >= 0 for e in (12, 13, 14, 15)] == [True, True, True, False]
        settle(store, layer)
        check_bytes(store, layer)
        assert store.stats.misses == 6 and store.stats.hits == 0, "prefetch counts no use"
    finally:
        store.close()


def test_unneeded_failed_prefetch_empties_its_slot_and_is_read_again_on_demand(qwen3, monkeypatch):
    model, _ = qwen3
    layer = model.layout.moe_layers[2]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, model.top_k)
    try:
        gate.fail = {7}
        assert store.prefetch(layer, [7, 6]) == 2
        settle(store, layer)
        store.wait(store.prepare(layer, [6, 1, 2, 3])[1])  # the failure is seen, not raised: 7 was not needed
        assert store.slots[layer].slot_of[7] == -1
        assert store.stats.prefetch_failed == 1 and store.stats.prefetch_wasted == 1
        check_consistent(store)
        check_bytes(store, layer)
        gate.fail = set()
        store.wait(store.prepare(layer, [7, 6, 1, 2])[1])  # read again on demand
        check_bytes(store, layer, [7, 6, 1, 2])
        assert store.stats.misses == 4 and store.stats.hits == 4
    finally:
        store.close()


def test_needed_failed_prefetch_raises_at_wait_and_leaves_the_pool_consistent(qwen3, monkeypatch):
    model, _ = qwen3
    layer = model.layout.moe_layers[2]
    gate = Gate(monkeypatch, model, layer)
    store = new_store(model, model.top_k + 1)
    try:
        gate.hold, gate.fail = {7}, {7}
        store.prefetch(layer, [7])
        _, ticket = store.prepare(layer, [7, 1, 2, 3])
        assert store.reading(ticket)[0] == 7
        gate.release()
        with pytest.raises(ExpertReadError, match="injected"):
            store.wait(ticket, through=7)
        sm = store.slots[layer]
        assert all(sm.slot_of[e] == -1 for e in (7, 1, 2, 3)), "the failed step's slots are emptied"
        check_consistent(store)
        gate.fail = set()
        store.wait(store.prepare(layer, [7, 1, 2, 3])[1])
        check_bytes(store, layer)
    finally:
        gate.release()
        store.close()


def test_random_prefetch_and_steps_keep_every_slot_exact(qwen3, monkeypatch):
    """Random predictions and steps, reads of random duration: after each step its experts hold their exact
    bytes, the pinned tile keeps its slots, and the slot map stays a bijection."""
    model, _ = qwen3
    layer = model.layout.moe_layers[3]
    rng = random.Random(7)
    real = reader_mod.ExpertReader._read

    def slow(reader, job):  # noqa: ANN001, ANN202
        time.sleep(rng.random() * 0.002)
        return real(reader, job)

    monkeypatch.setattr(reader_mod.ExpertReader, "_read", slow)
    store = new_store(model, 7, io_threads=3)
    n = model.n_experts
    try:
        prev: list[int] = []
        for _ in range(120):
            store.prefetch(layer, rng.sample(range(n), rng.randint(1, 6)), pinned=prev)
            step = rng.sample(range(n), rng.randint(1, 3))
            kept = {e: int(store.slots[layer].slot_of[e]) for e in prev}
            _, ticket = store.prepare(layer, step, pinned=prev)
            assert {e: int(store.slots[layer].slot_of[e]) for e in prev} == kept
            store.wait(ticket)
            check_consistent(store)
            check_bytes(store, layer, step)
            prev = step if rng.random() < 0.5 else []
        settle(store, layer)
        store.bytes_read  # noqa: B018 - joins the finished prefetch reads
        check_bytes(store, layer)
        st = store.stats
        assert st.prefetch_issued > 0 and st.prefetch_used > 0 and st.prefetch_wasted > 0
    finally:
        store.close()


# ------------------------------------------------------------------------------------------------ model level
ARCHS = ["qwen3moe", "qwen35moe", pytest.param("gemma4", marks=pytest.mark.slow)]  # gemma4: a 262k vocabulary


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("pool,ubatch", [("top_k", 128), ("top_k", 1), ("half", 7)])
def test_identical_with_prefetch(models, arch, prefetch, pool, ubatch):
    """Streaming with prefetch on/off against the resident run, bitwise, with small pools: decode steps, one
    prefill chunk (prediction only), one-token chunks (prefetched) and 7-token chunks."""
    model, ids = models(arch)
    steps = 16 if arch == "qwen3moe" else 8
    res = verify_identical(model, ids, steps, pool, ubatch=ubatch, io_threads=4, prefetch=prefetch,
                           label=f"{arch} prefetch {prefetch}: ")
    st = res.stats
    if prefetch:
        assert st.prefetch_issued > 0 and st.recall is not None and st.recall > 0
        assert st.predicted < st.predictable, "no misprediction: the test would not show that one is harmless"
        assert st.prefetch_wasted > 0
        print(f"{arch} {pool} ub{ubatch}: recall {st.recall:.3f}, miss bytes ready {st.ready_share:.3f}, "
              f"{st.prefetch_issued} prefetched, {st.prefetch_wasted} wasted")
    else:
        assert st.recall is None and st.prefetch_issued == 0 and st.miss_bytes_ready == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_adversarial_prediction_changes_nothing(models, arch, monkeypatch):
    """A predictor that names only experts the real predictor does not: every prefetch is a wrong guess that
    evicts hits; the logits stay bitwise equal."""
    model, ids = models(arch)
    real = type(model).predict

    def wrong(self, layer, x):  # noqa: ANN001, ANN202
        ids_ = real(self, layer, x)
        keep = torch.ones(ids_.shape[0], self.n_experts).scatter_(1, ids_, 0.0)
        return torch.argsort(keep, dim=1, descending=True, stable=True)[:, : self.top_k]

    monkeypatch.setattr(type(model), "predict", wrong)
    res = verify_identical(model, ids, 8, "top_k", ubatch=1, io_threads=4, prefetch=True, label=f"{arch}: ")
    assert res.stats.prefetch_issued > 0 and res.stats.prefetch_wasted > 0
    assert res.stats.recall < 0.5


def zero_mixers(model: MoEModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every attention / DeltaNet output zero, so that each layer's FFN input residual equals the layer's
    input: the lookahead's prediction is then the real routing, token for token. Through ``Weight.linear``, which
    the fast decode step (runtime/fastdecode.py: the C kernels on the blocks' addresses) does not call: it is off."""
    from moestream.runtime import fastdecode

    monkeypatch.setattr(fastdecode, "plan", lambda m: None)
    for b in model.blocks:
        for name in ("o", "out"):
            if name in b:
                w = b[name]
                monkeypatch.setattr(w, "linear", lambda x, w=w: x.new_zeros((*x.shape[:-1], w.rows)))


@pytest.mark.parametrize("arch", ARCHS)
def test_recall_is_one_when_the_prediction_is_exact(models, arch, monkeypatch):
    """With the mixers zeroed, the prediction (each arch's routing code applied to the layer's input) must equal
    the real routing exactly: recall 1.0 over the prefill and the decode steps (every expert computed was
    predicted). A prediction through the wrong norm would fall short on qwen35moe and gemma4 (checked: 93-94%);
    qwen3moe-tiny's norm weights are all ones, so there only a wrong router or gating would."""
    model, ids = models(arch)
    zero_mixers(model, monkeypatch)
    store = model.make_store(LoadOptions(slots=model.top_k, io_threads=4))
    model.set_store(store)
    try:
        gen = Engine(model, ubatch=4).stream(ids[:12], 6, Sampler(SamplingParams(temp=0)))
        assert len(list(gen)) == 6
        st = gen.stats.store
        assert st.predictable == st.predicted > 0 and st.recall == 1.0
        assert st.prefetch_issued > 0 and st.prefetch_used > 0
        assert "prefetch recall 100.0%" in gen.stats.line()
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


def test_prefill_chunks_prefetch_only_when_the_prediction_fits_half_the_pool(qwen3, monkeypatch):
    """Decode steps always read; a prefill chunk reads only when its predicted distinct experts fit in half the
    pool (else only the prediction is recorded, for recall)."""
    monkeypatch.setenv("MOESTREAM_LOOKAHEAD_MIN", "0")  # every rank pays: no decode prediction skipped by the gate
    model, ids = qwen3
    calls: list[tuple[int, int, bool]] = []
    rows: list[int] = []
    real_predict, real_prefetch = type(model).predict, StreamingStore.prefetch

    def predict(self, layer, x):  # noqa: ANN001, ANN202
        rows.append(x.shape[0])
        return real_predict(self, layer, x)

    def prefetch(self, layer, experts, pinned=(), read=True, **kw):  # noqa: ANN001, ANN002, ANN202
        calls.append((rows[-1], len(experts), read))
        return real_prefetch(self, layer, experts, pinned, read, **kw)

    monkeypatch.setattr(type(model), "predict", predict)
    monkeypatch.setattr(StreamingStore, "prefetch", prefetch)
    for slots, ubatch in ((model.top_k, len(ids)), (model.n_experts, 2)):
        calls.clear()
        store = model.make_store(LoadOptions(slots=slots, io_threads=2))
        model.set_store(store)
        try:
            Engine(model, ubatch=ubatch).generate(ids, 3, Sampler(SamplingParams(temp=0)))
        finally:
            store.close()
            model.set_store(ResidentStore(model.gguf, model.layout))
        assert len(calls) == len(model.layout.moe_layers) * (-(-len(ids) // ubatch) + 2)
        for n_tok, n_exp, read in calls:
            assert read == (n_tok == 1 or n_exp <= slots // 2), (slots, n_tok, n_exp, read)
        assert {read for n_tok, _, read in calls if n_tok > 1} == ({False} if slots == model.top_k else {True})


def test_moe_stream_off_ignores_prefetch(qwen3, monkeypatch):
    model, ids = qwen3
    assert model.opts.prefetch and not model.store.streaming

    def never(self, layer, x):  # noqa: ANN001, ANN202
        raise AssertionError("a resident model must not predict")

    monkeypatch.setattr(type(model), "predict", never)
    st = Engine(model).generate(ids[:8], 2, Sampler(SamplingParams(temp=0)))
    assert st.store.recall is None and "prefetch" not in st.line()


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_prefetch_read_error_leaves_pool_consistent_and_a_later_run_identical(qwen3, monkeypatch, delay):
    """The 5th prefetch's first read fails (at once: the failure is seen before any step asks; or after 0.3 s:
    a step may ask while it is in flight). Either the run raises that error, or it completes with the failure
    counted; afterwards every mapped slot holds its expert's exact bytes, and a second run through the same
    store gives logits bitwise equal to the resident run's."""
    model, ids = qwen3
    ids = ids[:10]
    resident = Engine(model, ubatch=1).prefill(ids, model.new_cache(len(ids)), logits_all=True)
    state = {"in_prefetch": False, "n": 0}
    real_submit, real_prefetch, real_read = (reader_mod.ExpertReader.submit, StreamingStore.prefetch,
                                             reader_mod.ExpertReader._read)

    def submit(self, jobs, **k):  # noqa: ANN001, ANN003, ANN202
        if state["in_prefetch"] and jobs:
            state["n"] += 1
            if state["n"] == 5:
                jobs[0].fail = True
        return real_submit(self, jobs, **k)

    def prefetch(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
        state["in_prefetch"] = True
        try:
            return real_prefetch(self, *a, **k)
        finally:
            state["in_prefetch"] = False

    def read(self, job):  # noqa: ANN001, ANN202
        if getattr(job, "fail", False):
            time.sleep(delay)
            raise ExpertReadError(job.path, job.offset, len(job.dest), "injected")
        return real_read(self, job)

    monkeypatch.setattr(reader_mod.ExpertReader, "submit", submit)
    monkeypatch.setattr(StreamingStore, "prefetch", prefetch)
    monkeypatch.setattr(reader_mod.ExpertReader, "_read", read)
    store = model.make_store(LoadOptions(slots=model.top_k + 1, io_threads=2))
    model.set_store(store)
    try:
        engine = Engine(model, ubatch=1)
        raised = False
        try:
            engine.prefill(ids, model.new_cache(len(ids)), logits_all=True)
        except ExpertReadError as e:
            assert "injected" in str(e)
            raised = True
        assert state["n"] >= 5, "the injected failure never ran"
        store.bytes_read  # noqa: B018 - joins the finished prefetch reads
        for layer in store.slots:
            settle(store, layer)
            store.prefetch(layer, [], read=True)  # sees any failure that finished meanwhile
        assert raised or store.stats.prefetch_failed == 1
        check_consistent(store)
        assert sum(check_bytes(store, layer) for layer in store.slots) > 0
        again = engine.prefill(ids, model.new_cache(len(ids)), logits_all=True)
        assert torch.equal(again.view(torch.int32), resident.view(torch.int32))
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


# ------------------------------------------------------------------------------------------------ commands
def test_verify_prefetch_on_through_cli_main(qwen3moe_tiny):
    for value in ("on", "off"):
        p = cli("verify", "-m", str(qwen3moe_tiny["q8_0"]), "--prefetch", value, "--slots", "4", "--steps", "8",
                "-t", "1", "-p", PROMPT)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("identical: 9 steps"), p.stdout
        assert ("prefetch on (recall " in p.stdout) == (value == "on")
        assert ("prefetch off" in p.stdout) == (value == "off")


def test_run_line_reports_prefetch(qwen3moe_tiny):
    path = str(qwen3moe_tiny["q8_0"])
    lines = {}
    for args in (("--prefetch", "on"), ("--prefetch", "off"), ("--moe-stream", "off", "--prefetch", "on")):
        p = cli("run", "-m", path, "--slots", "4", "-n", "6", "--temp", "0", "-t", "1", "-p", "hello", *args)
        assert p.returncode == 0, p.stderr
        lines[args] = p.stderr.strip().splitlines()[-1]
    assert "| prefetch recall " in lines[("--prefetch", "on")] and "wasted |" in lines[("--prefetch", "on")]
    assert "prefetch" not in lines[("--prefetch", "off")]
    assert "prefetch" not in lines[("--moe-stream", "off", "--prefetch", "on")]


def test_bench_row_and_table(qwen3moe_tiny):
    path = str(qwen3moe_tiny["q8_0"])
    base = {"model": path, "moe_stream": True, "slots": 4, "io_threads": 2, "overlap": True, "n_prompt": 4,
            "n_gen": 6, "repetitions": 1, "threads": 1, "ubatch": 128}
    rows = [bench.run_row({**base, "prefetch": pf}) for pf in (False, True)]
    off, on = ({t["test"]: t for t in r["tests"]} for r in rows)
    assert off["tg6"]["prefetch_recall"] is None and off["tg6"]["prefetch_issued"] == 0
    assert off["tg6"]["miss_bytes_ready"] is None
    assert 0 < on["tg6"]["prefetch_recall"] <= 1 and on["tg6"]["prefetch_issued"] > 0
    assert on["tg6"]["miss_bytes_ready"] is not None
    table = bench.format_table(rows).splitlines()
    cols = [c.strip() for c in table[0].strip("|").split("|")]
    assert {"prefetch", "prefetch recall", "miss bytes ready"} <= set(cols)
    cells = [dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in table[2:]]
    assert [c["prefetch"] for c in cells] == ["off", "off", "on", "on"]
    assert cells[1]["prefetch recall"] == "-" and cells[3]["prefetch recall"].endswith("%")
    failed = bench.format_table([{**base, "prefetch": True, "error": "boom"}]).splitlines()[2]
    assert failed.count("|") == table[0].count("|") and "failed: boom" in failed


def test_bench_prefetch_list(tmp_path):
    out = tmp_path / "b.json"
    p = moestream("bench", "-p", "4", "-n", "2", "-r", "1", "--moe-stream", "on", "--slots", "4", "-t", "1",
                  "--prefetch", "off,on", "--json", str(out))
    assert p.returncode == 0, p.stderr
    import json
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefetch"] for r in rows] == [False, True]
    assert "prefetch=off" in p.stderr and "prefetch=on" in p.stderr
    bad = cli("bench", "-p", "4", "-n", "2", "--prefetch", "maybe")
    assert bad.returncode == 1 and bad.stderr.strip() == ("moestream: error: --prefetch: expected on, off or on,off, "
                                                          "got 'maybe'")


def test_store_stats_difference_and_copy():
    from moestream.experts.pool import StoreStats

    a = StoreStats(hits=5, predicted=3, predictable=4, miss_bytes=10, miss_bytes_ready=4)
    b = a.copy()
    b.hits += 2
    b.predicted += 1
    b.predictable += 4
    d = b - a
    assert dataclasses.asdict(d)["hits"] == 2 and d.recall == 0.25 and d.ready_share is None
    assert a.recall == 0.75 and a.ready_share == 0.4 and np.isclose(a.hit_rate, 1.0)
