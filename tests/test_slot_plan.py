"""The slot plan in C (csrc/iokern.c ``ms_slot_plan``) makes CachePolicy.plan's choices: the same slots, loads, slot
maps and use counts, for LFU and LRU, with pinned experts and busy slots, over random steps."""

from __future__ import annotations

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
