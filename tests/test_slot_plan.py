"""The slot plan in C (csrc/iokern.c ``ms_slot_plan``) makes CachePolicy.plan's choices: the same slots, loads, slot
maps and use counts, for LFU and LRU, with pinned experts and busy slots, over random steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moestream import kernels
from moestream.experts import policy as policy_mod
from moestream.experts.policy import POLICIES, SlotMap

pytestmark = pytest.mark.skipif(kernels.io_ops() is None, reason="no C kernels here")


@pytest.mark.parametrize("name", ["lfu", "lru"])
@pytest.mark.parametrize("n_slots", [8, 13, 46])
def test_c_plan_equals_the_python_plan(name, n_slots):
    assert policy_mod._c_lib() is not None
    n_exp, rng = 64, np.random.default_rng(n_slots)
    cls = POLICIES[name]
    py_cls = type(f"Py{cls.__name__}", (cls,), {})  # a subclass plans in Python (_c_kind is the class's own)
    c_pol, py_pol = cls(n_exp), py_cls(n_exp)
    c_map, py_map = SlotMap(n_exp, n_slots), SlotMap(n_exp, n_slots)
    for step in range(400):
        k = int(rng.integers(1, min(8, n_slots) + 1))
        experts = [int(e) for e in rng.choice(n_exp, size=k, replace=False)]
        room = n_slots - k
        keep = [int(e) for e in rng.choice(n_exp, size=int(rng.integers(0, min(room, 4) + 1)), replace=False)]
        keep = [e for e in keep if e not in experts]
        busy = rng.random(n_slots) < 0.1 if step % 3 == 0 else None
        a = c_pol.plan(c_map, experts, keep, busy)
        b = py_pol.plan(py_map, experts, keep, busy)
        assert (a.slot_ids, a.loads) == (b.slot_ids, b.loads), step
        assert np.array_equal(c_map.slot_of, py_map.slot_of) and np.array_equal(c_map.expert_of, py_map.expert_of)
        assert np.array_equal(c_pol.uses, py_pol.uses) and np.array_equal(c_pol.last, py_pol.last)
        assert all(isinstance(s, int) for s in a.slot_ids) and all(isinstance(x, int) for ld in a.loads for x in ld)


def test_admit_promotes_a_miss_only_over_a_less_needed_expert() -> None:
    """CachePolicy.admit (MOESTREAM_ADMIT=freq on the device-planned step): empty slots take misses; a full pool
    takes a miss only over an expert needed fewer times, the most needed misses first; this step's experts are
    never evicted; the uses are counted as plan() counts them."""
    pol, sm = POLICIES["lfu"](8), SlotMap(8, 3)
    first = pol.admit(sm, [0, 1])  # two empty slots: both admitted
    assert sorted(e for e, _ in first.loads) == [0, 1] and min(first.slot_ids) >= 0
    pol.admit(sm, [0, 1])  # 0, 1 needed twice
    third = pol.admit(sm, [2, 3])  # one empty slot: the first of the equally needed misses; the other left out
    assert third.loads == [(2, int(sm.slot_of[2]))] and third.slot_ids[1] == -1 and sm.slot_of[3] == -1
    assert pol.admit(sm, [3]).loads == [(3, int(sm.slot_of[3]))] and sm.slot_of[2] == -1  # 2 needed twice > once
    assert pol.admit(sm, [2]).loads == [] and sm.slot_of[2] == -1  # twice, as every expert in the pool: left out
    loads = pol.admit(sm, [2, 0]).loads  # 2, needed a third time, beats 1 (twice, the older); 0 is this step's
    assert loads == [(2, int(sm.slot_of[2]))] and sm.slot_of[1] == -1 and sm.slot_of[0] >= 0
    assert list(pol.uses[:4]) == [3, 2, 3, 2]
    assert sorted(sm.expert_of.tolist()) == [0, 2, 3] and all(sm.slot_of[sm.expert_of] == np.arange(3))


def test_streaming_store_builds_the_planner_kernels_at_load(monkeypatch) -> None:
    """A StreamingStore loads the slot planner's C kernels when it is made (on a machine's first run: compiled,
    half a minute on 2 cores), so the compile is part of the load, not of the first step's time (the first
    decode on a fresh GPU machine read 1.28 tok/s)."""
    from moestream.experts.pool import StreamingStore
    from moestream.models.base import LoadOptions, load_model
    model = load_model(str(Path(kernels.__file__).parent / "data" / "default.gguf"), LoadOptions(moe_stream=False))
    monkeypatch.setattr(policy_mod, "_C_LIB", [None])
    store = StreamingStore(model.gguf, model.layout, 8, model.top_k, io_threads=1)
    try:
        assert policy_mod._C_LIB[0] is not None
    finally:
        store.close()
