"""Unit tests of the slot map, the replacement policies and the expert reader (no model needed)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moestream.errors import ConfigError, ExpertReadError
from moestream.experts.policy import LFUPolicy, LRUPolicy, SlotMap
from moestream.experts.reader import ExpertReader, ReadJob


def check_consistent(slots: SlotMap) -> None:
    for s, e in enumerate(slots.expert_of):
        if e >= 0:
            assert slots.slot_of[e] == s
    for e, s in enumerate(slots.slot_of):
        if s >= 0:
            assert slots.expert_of[s] == e


def test_hits_and_misses_and_pinning():
    slots, pol = SlotMap(8, 3), LFUPolicy(8)
    plan = pol.plan(slots, [1, 5, 6])
    assert sorted(e for e, _ in plan.loads) == [1, 5, 6]  # cold: all misses, into empty slots
    assert sorted(plan.slot_ids) == [0, 1, 2]
    plan = pol.plan(slots, [5, 1, 6])
    assert plan.loads == []  # all hits, same slots
    plan = pol.plan(slots, [5, 2, 6])  # 2 misses; 5 and 6 are pinned, so 1 must go
    assert plan.loads == [(2, plan.slot_ids[1])]
    assert slots.slot_of[1] == -1 and slots.slot_of[2] == plan.slot_ids[1]
    check_consistent(slots)


def test_lfu_evicts_least_frequent_with_recency_tiebreak():
    slots, pol = SlotMap(8, 3), LFUPolicy(8)
    for _ in range(3):
        pol.plan(slots, [0, 1, 2])  # all used 3 times
    pol.plan(slots, [0, 1])  # 0 and 1 used 4 times, 2 used 3 times
    plan = pol.plan(slots, [0, 3])  # one miss: evicts the least frequent, 2
    assert plan.loads == [(3, 2)] or slots.slot_of[2] == -1
    assert slots.slot_of[2] == -1
    # tie on frequency: the least recently used goes
    slots, pol = SlotMap(8, 2), LFUPolicy(8)
    pol.plan(slots, [4])
    pol.plan(slots, [5])
    pol.plan(slots, [6])  # 4 and 5 both used once; 4 is older
    assert slots.slot_of[4] == -1 and slots.slot_of[5] >= 0
    check_consistent(slots)


def test_lru():
    slots, pol = SlotMap(8, 2), LRUPolicy(8)
    for _ in range(5):
        pol.plan(slots, [0])
    pol.plan(slots, [1])
    pol.plan(slots, [2])  # LRU evicts 0 although it was used most
    assert slots.slot_of[0] == -1 and slots.slot_of[1] >= 0


def test_plan_larger_than_pool_is_refused():
    with pytest.raises(ValueError, match="3 experts in one step but the pool has 2 slots"):
        LFUPolicy(8).plan(SlotMap(8, 2), [0, 1, 2])


def test_random_plans_stay_consistent():
    rng = np.random.default_rng(0)
    slots, pol = SlotMap(32, 6), LFUPolicy(32)
    for _ in range(500):
        ids = rng.choice(32, size=rng.integers(1, 7), replace=False).tolist()
        plan = pol.plan(slots, ids)
        assert [slots.expert_of[s] for s in plan.slot_ids] == ids
        assert len(set(plan.slot_ids)) == len(ids)
        check_consistent(slots)


def test_pinned_experts_are_never_evicted():
    """The tile being computed is pinned while the next tile's slots are chosen (prefill's tile prefetch)."""
    rng = np.random.default_rng(1)
    slots, pol = SlotMap(64, 8), LFUPolicy(64)
    prev: list[int] = []
    for _ in range(500):
        ids = rng.choice(64, size=rng.integers(1, 5), replace=False).tolist()
        before = {e: int(slots.slot_of[e]) for e in prev}
        plan = pol.plan(slots, ids, pinned=prev)
        assert {e: int(slots.slot_of[e]) for e in prev} == before  # same slots, still mapped
        assert not {s for _, s in plan.loads} & set(before.values())
        assert [slots.expert_of[s] for s in plan.slot_ids] == ids
        check_consistent(slots)
        prev = ids


def test_plan_with_pinned_larger_than_pool_is_refused():
    slots, pol = SlotMap(8, 4), LFUPolicy(8)
    pol.plan(slots, [0, 1])
    pol.plan(slots, [2, 3], pinned=[0, 1])  # exactly fills the pool
    with pytest.raises(ValueError, match="3 experts in one step and 2 pinned but the pool has 4 slots"):
        pol.plan(slots, [4, 5, 0], pinned=[0, 1, 2])


def test_reader_reads_into_slot_memory(tmp_path):
    data = os.urandom(1 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    pool = torch.zeros((4, 4096), dtype=torch.uint8)
    views = [memoryview(pool.numpy()[s]) for s in range(4)]
    for threads in (1, 8):
        r = ExpertReader(threads)
        offsets = [0, 4096 * 7, 12345, len(data) - 4096]
        r.wait(r.submit([ReadJob(str(path), o, views[s]) for s, o in enumerate(offsets)]))
        for s, o in enumerate(offsets):
            assert bytes(pool[s].numpy()) == data[o:o + 4096]
        assert r.bytes_read == 4 * 4096
        r.close()


def test_reader_joins_a_prefix_then_the_rest(tmp_path):
    """wait(ticket, upto) joins the first reads only (what the per-expert join of a decode step uses); a later
    wait joins the rest; bytes are counted once."""
    data = os.urandom(1 << 16)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    pool = torch.zeros((6, 1024), dtype=torch.uint8)
    views = [memoryview(pool.numpy()[s]) for s in range(6)]
    r = ExpertReader(1)
    ticket = r.submit([ReadJob(str(path), 1024 * s, views[s]) for s in range(6)])
    r.wait(ticket, 2)
    assert ticket.joined == 2 and r.bytes_read == 2 * 1024
    assert bytes(pool[:2].numpy()) == data[:2048]
    r.wait(ticket, 2)  # nothing new to join
    assert r.bytes_read == 2 * 1024
    r.wait(ticket)
    assert ticket.joined == 6 and r.bytes_read == 6 * 1024 and r.reads == 6
    assert bytes(pool.numpy()) == data[: 6 * 1024]
    r.close()


def test_reader_error_in_a_prefix_settles_every_read(tmp_path):
    """An error while joining a prefix waits for the ticket's other reads too, so none is still writing into
    slot memory when the caller empties the slots."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * 8192)
    pool = torch.zeros((3, 4096), dtype=torch.uint8)
    views = [memoryview(pool.numpy()[s]) for s in range(3)]
    r = ExpertReader(2)
    ticket = r.submit([ReadJob(str(path), 6000, views[0]), ReadJob(str(path), 0, views[1]),
                       ReadJob(str(path), 4096, views[2])])
    with pytest.raises(ExpertReadError, match="short read"):
        r.wait(ticket, 1)
    assert ticket.joined == 3 and all(f.done() for f in ticket.futures)
    r.close()


def test_reader_short_read_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 5000)
    pool = torch.zeros((1, 4096), dtype=torch.uint8)
    r = ExpertReader(2)
    with pytest.raises(ExpertReadError, match=r"short\.bin: reading 4096 bytes of expert data at offset 4000 "
                       r"failed: short read"):
        r.wait(r.submit([ReadJob(str(path), 4000, memoryview(pool.numpy()[0]))]))
    r.close()


def test_reader_rejects_zero_threads():
    with pytest.raises(ConfigError, match="io_threads must be at least 1, got 0"):
        ExpertReader(0)
