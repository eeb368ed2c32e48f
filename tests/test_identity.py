"""Streaming on vs off: every logit of every step must be bitwise identical (the project's correctness bar)."""

from __future__ import annotations

import pytest

from helpers import (
    assert_slots_hold_their_experts,
    distinct_experts_per_layer,
    expert_slots,
    moestream,
    streaming_prefill,
    verify_identical,
)
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model
from moestream.tokenizer import GGUFTokenizer
from moestream.verify import verify

PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot pool "
          "keeps the hot ones in memory while misses are read by the IO threads.")


@pytest.fixture(scope="module")
def resident(qwen3moe_tiny):
    model = load_model(qwen3moe_tiny["q8_0"], LoadOptions(moe_stream=False))
    ids = GGUFTokenizer.from_gguf(qwen3moe_tiny["q8_0"]).encode(PROMPT)
    return model, ids


@pytest.mark.parametrize("slots,io_threads,policy,ubatch,overlap", [
    ("top_k", 1, "lfu", 128, True),      # the smallest legal pool
    ("top_k", 8, "lfu", 7, True),        # smallest pool, prompt in several chunks
    ("top_k", 8, "lfu", 128, False),     # tiles of the whole pool, no prefetch of the next tile
    ("half", 8, "lfu", 128, True),       # fewer slots than the prompt's distinct experts: tiled prefill
    ("half", 1, "lru", 128, True),
    ("half", 8, "lru", 128, False),
    ("all", 8, "lfu", 128, True),        # every expert fits
])
def test_verify_identical(resident, slots, io_threads, policy, ubatch, overlap):
    model, ids = resident
    verify_identical(model, ids, 32, slots, ubatch=ubatch, io_threads=io_threads, policy=policy, overlap=overlap)


@pytest.mark.parametrize("overlap", [True, False])
def test_tiled_prefill_prefetches_the_next_tile_with_overlap(resident, monkeypatch, overlap):
    """With overlap on, a tiled prefill starts tile i+1's reads (tile i pinned) before joining tile i's, and
    tiles are half the pool; with overlap off each tile fills the pool and is prepared after the previous one's
    compute. verify() must pass its overlap setting on to the streaming run."""
    from moestream.experts.pool import StreamingStore
    model, ids = resident
    events: list[tuple] = []
    real_prepare, real_wait = StreamingStore.prepare, StreamingStore.wait

    def prepare(self, layer, experts, pinned=()):
        slot_ids, ticket = real_prepare(self, layer, experts, pinned)
        events.append(("prepare", layer, len(experts), tuple(pinned), id(ticket) if ticket else None))
        return slot_ids, ticket

    def wait(self, ticket, through=None):
        events.append(("wait", id(ticket) if ticket else None, through))
        return real_wait(self, ticket, through)

    monkeypatch.setattr(StreamingStore, "prepare", prepare)
    monkeypatch.setattr(StreamingStore, "wait", wait)
    slots = model.top_k
    res = verify(model, ids, 2, LoadOptions(slots=slots, io_threads=4, overlap=overlap), ubatch=len(ids))
    assert res.identical
    # the first MoE layer's prefill: every event until the first prepare of another layer
    end = next(i for i, e in enumerate(events) if e[0] == "prepare" and e[1] != events[0][1])
    prefill = events[:end]
    preps = [e for e in prefill if e[0] == "prepare"]
    assert len(preps) > 2, "the prompt must need several tiles in a layer"
    sizes = {e[2] for e in preps[:-1]}
    if overlap:
        assert sizes == {slots // 2}
        # the second prepare comes before the first wait, with the first tile pinned
        assert [e[0] for e in prefill[:3]] == ["prepare", "prepare", "wait"]
        assert len(prefill[1][3]) == slots // 2
    else:
        assert sizes == {slots}
        assert [e[0] for e in prefill[:4]] == ["prepare", "wait", "prepare", "wait"]
        assert all(not e[3] for e in preps)


def test_decode_computes_hits_first_and_each_miss_after_its_own_join(qwen3moe_tiny, monkeypatch):
    """``--matmul dequant`` (one call per expert): with overlap, a decode step's hits are computed before any
    join, and each miss right after the join of its own reads (not one join for all); identical logits are
    covered by verify above."""
    from moestream.experts import moe as moe_mod
    from moestream.experts.pool import ResidentStore, StreamingStore
    model = load_model(qwen3moe_tiny["q8_0"], LoadOptions(moe_stream=False, matmul="dequant"))
    ids = GGUFTokenizer.from_gguf(qwen3moe_tiny["q8_0"]).encode(PROMPT)
    store = model.make_store(LoadOptions(slots=model.n_experts // 2, io_threads=2))
    model.set_store(store)
    events: list[tuple] = []
    real_wait, real_expert = StreamingStore.wait, moe_mod.MoE._expert

    def wait(self, ticket, through=None):
        events.append(("wait", through))
        return real_wait(self, ticket, through)

    def expert(self, st, slot, xs, real_id):
        assert int(st.slots[self.layer].expert_of[slot]) == real_id  # the slot holds the expert it is computed as
        events.append(("expert", real_id))
        return real_expert(self, st, slot, xs, real_id)

    try:
        engine = Engine(model)
        cache = model.new_cache(len(ids) + 8)
        engine.prefill(ids, cache)
        monkeypatch.setattr(StreamingStore, "wait", wait)
        monkeypatch.setattr(moe_mod.MoE, "_expert", expert)
        seen_mixed = False
        for pos in range(len(ids), len(ids) + 8):
            events.clear()
            engine.decode_step(ids[pos % len(ids)], pos, cache)
            ends = [i for i, e in enumerate(events) if e[0] == "expert"]
            layer0 = events[: ends[model.top_k - 1] + 1]  # a token uses top_k experts in the first MoE layer
            waited = [e[1] for e in layer0 if e[0] == "wait"]
            computed = [e[1] for e in layer0 if e[0] == "expert"]
            assert None not in waited, "overlap on joins expert by expert, never the whole ticket at once"
            hits = [e for e in computed if e not in waited]
            assert computed == hits + waited, "hits first, then the misses in read order"
            for e in waited:  # each miss is computed right after its own join
                i = layer0.index(("wait", e))
                assert layer0[i + 1] == ("expert", e)
            seen_mixed |= bool(hits) and bool(waited)
        assert seen_mixed, "no decode step had both hits and misses in layer 0: the test checked nothing"
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
def test_fused_decode_computes_hits_in_one_call_then_misses_as_their_reads_are_joined(resident, monkeypatch, fast):
    """``--matmul blocks`` (one C call per set of experts): with overlap, a decode step's hits go to the kernels
    in one call before any join; every later call computes misses only, right after a join that covers them
    (``wait(through=its last expert)``), in read order, each miss once; identical logits: verify above. In the
    eager step (MoE.__call__) and in the fast decode step (runtime/fastdecode.py, whose calls address the slots:
    each call's experts are read back from its down matrices' addresses)."""
    from moestream.experts import moe as moe_mod
    from moestream.experts.pool import ResidentStore, StreamingStore
    from moestream.runtime import fastdecode
    model, ids = resident
    store = model.make_store(LoadOptions(slots=model.n_experts // 2, io_threads=2))
    model.set_store(store)
    events: list[tuple] = []
    moe0 = min(model.layout.layers)
    real_wait, real_fused, real_moe = StreamingStore.wait, moe_mod.MoE._fused, fastdecode.FastDecode._moe

    def wait(self, ticket, through=None):
        if ticket is not None and ticket.loads[0] == moe0:
            events.append(("wait", through, tuple(self.reading(ticket))))
        return real_wait(self, ticket, through)

    def fused(self, st, groups, experts, slot_of, x, out):
        if self.layer == moe0:
            events.append(("compute", tuple(experts)))
        return real_fused(self, st, groups, experts, slot_of, x, out)

    def fast_moe(self, spec, first, n, hp, outp):
        pool, lead = store.matrix(moe0, "down"), store.lead(moe0, "down")
        slots = (self.o_addr[2, first:first + n] - pool.data_ptr()) // pool.stride(0)
        if ((slots >= 0) & (slots < pool.shape[0])).all():
            assert (self.o_addr[2, first:first + n] == pool.data_ptr() + slots * pool.stride(0) + lead[slots]).all()
            events.append(("compute", tuple(store.slots[moe0].expert_of[slots].tolist())))
        return real_moe(self, spec, first, n, hp, outp)

    if not fast:
        monkeypatch.setattr(fastdecode, "plan", lambda m: None)
    try:
        engine = Engine(model)
        cache = model.new_cache(len(ids) + 8)
        engine.prefill(ids, cache)
        assert (fastdecode.plan(model) is not None) == fast
        monkeypatch.setattr(StreamingStore, "wait", wait)
        monkeypatch.setattr(moe_mod.MoE, "_fused", fused)
        monkeypatch.setattr(fastdecode.FastDecode, "_moe", fast_moe)
        seen_mixed = False
        for pos in range(len(ids), len(ids) + 8):
            events.clear()
            engine.decode_step(ids[pos % len(ids)], pos, cache)
            first = next(i for i, e in enumerate(events) if e[0] == "compute")
            waits = [e for e in events if e[0] == "wait"]
            layer0 = events[: max(i for i, e in enumerate(events) if e[0] == "compute") + 1]
            computed = [e for ev in layer0 if ev[0] == "compute" for e in ev[1]]
            assert len(computed) == len(set(computed)) == model.top_k, "each of the top-k experts computed once"
            reading = next((e[2] for e in waits), ())
            hits = [e for e in computed if e not in reading]
            if hits:
                assert set(events[first][1]) == set(hits), "the hits go first, in one call"
                assert all(ev[0] != "wait" for ev in events[:first]), "no join before the hits are computed"
            assert [e for e in computed if e in reading] == list(reading), "misses in read order"
            done: set = set()
            for i, ev in enumerate(layer0):
                if ev[0] != "compute" or (hits and i == first):
                    continue
                joined = [w for w in layer0[:i] if w[0] == "wait"][-1]
                assert joined[1] is not None, "overlap joins a prefix of the reads, never the whole ticket at once"
                assert joined[1] == ev[1][-1], "a batch of misses right after the join through its last expert"
                assert not set(ev[1]) & done
                done |= set(ev[1])
            seen_mixed |= bool(hits) and bool(reading)
        assert seen_mixed, "no decode step had both hits and misses in layer 0: the test checked nothing"
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


@pytest.mark.parametrize("direct_io", [True, False])
def test_read_error_in_a_prefetched_tile_leaves_no_half_read_slot(resident, monkeypatch, direct_io):
    """A read error while the next tile is in flight: the error surfaces, and afterwards every slot that still
    maps an expert holds that expert's exact bytes (unjoined reads are discarded, their slots emptied); with
    O_DIRECT reads (padded slots) and buffered ones."""
    from moestream.errors import ExpertReadError
    from moestream.experts import reader as reader_mod
    from moestream.experts.pool import ResidentStore
    model, ids = resident
    real = reader_mod.ExpertReader._read
    last = max(model.layout.layers)
    last_ranges = [(m.expert_offset(0), m.expert_offset(m.n_experts - 1) + m.bytes_per_expert)
                   for m in model.layout[last].values()]
    calls = {"n": 0}

    def flaky(self, job):  # fails a read of the last MoE layer's second tile (3 matrices x 4 experts a tile)
        if any(a <= job.offset + job.lead < b for a, b in last_ranges):  # the expert's own first byte
            calls["n"] += 1
            if calls["n"] == 3 * 4 + 4:
                raise ExpertReadError(job.path, job.offset, len(job.dest), "injected")
        return real(self, job)

    monkeypatch.setattr(reader_mod.ExpertReader, "_read", flaky)
    store = model.make_store(LoadOptions(slots=model.top_k * 2, io_threads=1, direct_io=direct_io))
    model.set_store(store)
    try:
        assert store.direct is direct_io
        with pytest.raises(ExpertReadError, match="injected"):
            Engine(model, ubatch=len(ids)).prefill(ids, model.new_cache(len(ids)))
        checked = assert_slots_hold_their_experts(model, store)
        assert checked > 0
        assert (store.slots[last].expert_of < 0).all(), "the failed tile and the prefetched one are emptied"
    finally:
        store.close()
        model.set_store(ResidentStore(model.gguf, model.layout))


def test_pool_smaller_than_prompt_experts_really_tiles(resident):
    model, ids = resident
    distinct = distinct_experts_per_layer(model, ids)
    assert distinct > model.n_experts // 2, "prompt must select more experts than the 'half' pool holds"


def test_slot_ids_differ_from_expert_ids(resident):
    """The streaming run must actually address experts through slots that are not their ids."""
    model, ids = resident
    with streaming_prefill(model, ids, LoadOptions(slots=model.top_k + 1, io_threads=2)) as store:
        moved = [(e, s) for e, s in expert_slots(store) if e != s]
        assert moved, "every expert sat in the slot of its own id: the test would not catch slot/expert mixups"


def test_stream_tokens_equal_resident_tokens(resident):
    """Same greedy tokens through Engine.generate with both stores (the run path, not only verify)."""
    model, ids = resident
    from moestream.engine import Sampler, SamplingParams
    from moestream.experts.pool import ResidentStore
    out = []
    for store in (ResidentStore(model.gguf, model.layout),
                  model.make_store(LoadOptions(slots=model.top_k, io_threads=4))):
        model.set_store(store)
        st = Engine(model).generate(ids, 16, Sampler(SamplingParams(temp=0)))
        out.append(st.tokens)
        store.close()
    assert out[0] == out[1] and len(out[0]) == 16


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_verify_cli(qwen3moe_tiny, fmt):
    """The command itself, on the other formats, with the smallest pool."""
    p = moestream("verify", "-m", qwen3moe_tiny[fmt], "--steps", "32", "--slots", "4", "--io-threads", "8",
                  "-p", PROMPT, timeout=None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("identical: 33 steps"), p.stdout
    assert "logits compared bytewise on the CPU;" in p.stdout


def test_verify_detects_a_difference(resident, monkeypatch):
    """The harness must be able to fail: corrupt one slot read and expect a reported difference."""
    model, ids = resident
    from moestream.experts import reader as reader_mod
    real = reader_mod.ExpertReader._read

    def corrupt(self, job):
        n = real(self, job)
        job.dest[job.lead] = (job.dest[job.lead] + 1) % 256  # the expert's first byte (after a direct read's lead)
        return n
    monkeypatch.setattr(reader_mod.ExpertReader, "_read", corrupt)
    res = verify(model, ids, 4, LoadOptions(slots=model.top_k, io_threads=2))
    assert not res.identical and res.first_diff[0] == 0


# ------------------------------------------------------------------------------------------------ mixed types
@pytest.fixture(scope="module")
def mixed(qwen3moe_tiny_iquants):
    """llama-quantize's mixed file (tools/fixtures.py TOOL_QUANTS["mix"]): experts IQ1_M / IQ2_XXS / IQ3_XXS /
    Q4_K / Q6_K matrix by matrix, attention Q8_0 and BF16, output Q6_K, token embedding Q4_K."""
    path = qwen3moe_tiny_iquants["mix"]
    model = load_model(path, LoadOptions(moe_stream=False))
    ids = GGUFTokenizer.from_gguf(path).encode(PROMPT)
    yield model, ids
    model.store.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("slots,overlap,ubatch", [
    ("top_k", True, 128), ("top_k", False, 128), ("half", True, 7), ("all", True, 128),
])
def test_verify_identical_mixed_types(mixed, slots, overlap, ubatch):
    model, ids = mixed
    types = {m.type_name for mats in model.layout.layers.values() for m in mats.values()}
    assert {"IQ1_M", "IQ2_XXS", "IQ3_XXS", "Q4_K", "Q6_K"} <= types, types
    verify_identical(model, ids, 32, slots, ubatch=ubatch, overlap=overlap, io_threads=4, label="mix: ")


@pytest.mark.llamacpp
def test_mixed_types_slot_ids_differ_from_expert_ids(mixed):
    model, ids = mixed
    with streaming_prefill(model, ids, LoadOptions(slots=model.top_k + 1, io_threads=2)) as store:
        assert [(e, s) for e, s in expert_slots(store) if e != s], "every expert sat in the slot of its own id"


@pytest.mark.parametrize("populate", ["1", "0"])
def test_verify_identical_with_pools_in_huge_page_memory(resident, monkeypatch, populate):
    """The CPU pools of a real run (2 MiB and larger) live in huge_empty's mapping: 2 MiB-aligned, advised huge pages,
    populated at start or not. This model's pools are smaller, so the threshold is lowered to one page to put them
    there: streaming through them keeps every logit bit of the resident run, with direct and buffered reads, and
    each pool really starts on a huge_empty boundary."""
    from moestream.experts import pool as pool_mod

    monkeypatch.setattr(pool_mod, "HUGE_PAGE", 4096)
    monkeypatch.setattr(pool_mod, "POPULATE_MIN", 0)
    monkeypatch.setenv("MOESTREAM_POOL_POPULATE", populate)
    made = []
    real = pool_mod.huge_empty
    monkeypatch.setattr(pool_mod, "huge_empty", lambda n, populate=True: made.append(t := real(n, populate)) or t)
    model, ids = resident
    for direct_io in (True, False):
        verify_identical(model, ids, 16, "half", direct_io=direct_io)
    assert made and all(t.data_ptr() % 4096 == 0 for t in made)
