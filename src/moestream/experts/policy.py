"""Slot replacement policies: which slot each expert of a step uses, and which experts must be read."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def default_slots(n_experts: int, top_k: int) -> int:
    """Default pool size (slots per layer) where nothing else sizes it (``inspect``, ``trace``): a quarter of
    the experts, at least top-k."""
    return max(top_k, n_experts // 4)


@dataclass
class Plan:
    """slot_ids[i] is the slot of experts[i]; loads: [(expert, slot)] to read before compute (misses)."""

    slot_ids: list[int]
    loads: list[tuple[int, int]] = field(default_factory=list)


class SlotMap:
    """The slot map of one layer's pool: ``slot_of[expert]`` and ``expert_of[slot]`` (-1 = empty)."""

    def __init__(self, n_experts: int, n_slots: int):
        self.n_experts, self.n_slots = n_experts, n_slots
        self.slot_of = np.full(n_experts, -1, dtype=np.int64)
        self.expert_of = np.full(n_slots, -1, dtype=np.int64)

    def put(self, expert: int, slot: int) -> int:
        """Expert ``expert`` into ``slot``; returns the expert the slot held (-1: none), which has no slot now."""
        old = int(self.expert_of[slot])
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_of[slot] = expert
        self.slot_of[expert] = slot
        return old


def _c_lib():  # noqa: ANN202 - the kernels' ctypes library or None
    """The C kernels for :meth:`CachePolicy.plan` (``ms_slot_plan``), or None: not buildable here, or
    ``MOESTREAM_C_PLAN=0`` (A/B)."""
    if _C_LIB[0] is None:
        import os

        from .. import kernels

        lib = None
        if os.environ.get("MOESTREAM_C_PLAN", "1") != "0":
            try:
                lib = kernels.load()
            except kernels.KernelBuildError:
                lib = None
        _C_LIB[0] = lib or False
    return _C_LIB[0] or None


_C_LIB: list = [None]


class CachePolicy:
    """Base policy. ``plan(slots, experts)`` assigns slots to the distinct ``experts`` of one step.

    All of ``experts`` are pinned for the step: a miss never evicts another expert of the same step, nor an
    expert passed as ``pinned``.
    Subclasses define ``_keys(candidate_experts)``: the expert with the smallest key is evicted first.
    """

    name = "base"
    #: ``ms_slot_plan``'s code for this policy's keys, set by the class itself (a subclass, which may key otherwise,
    #: plans in Python)
    _c_kind: int | None = None

    def __init__(self, n_experts: int):
        self.clock = 0
        self.uses = np.zeros(n_experts, dtype=np.int64)  # times each expert was needed (LFU count)
        self.last = np.zeros(n_experts, dtype=np.int64)  # clock of the last step that needed it

    def _keys(self, experts: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def plan(self, slots: SlotMap, experts: list[int], pinned: list[int] = (), busy: np.ndarray | None = None) -> Plan:
        """experts: distinct real expert ids, len <= slots.n_slots. pinned: other real expert ids whose slots
        must survive this plan (a tile still being computed while this one loads); they are not counted as
        uses. busy: optional bool [n_slots], slots whose reads are still in flight (a prefetch): evicted only when
        no other slot is left (the caller must then let that read settle before reusing the slot). Returns the
        Plan; updates the slot map. ValueError if experts and pinned need more slots than the pool has."""
        keep = [e for e in pinned if e not in set(experts)]
        if len(experts) + len(keep) > slots.n_slots:
            also = f" and {len(keep)} pinned" if keep else ""
            raise ValueError(f"{len(experts)} experts in one step{also} but the pool has {slots.n_slots} slots")
        self.clock += 1
        ids = np.asarray(experts, dtype=np.int64)
        if type(self).__dict__.get("_c_kind") is not None and (lib := _c_lib()) is not None:  # one C call, same plan
            return self._c_plan(lib, slots, ids, keep, busy)
        self.uses[ids] += 1
        self.last[ids] = self.clock
        slot_ids = slots.slot_of[ids].copy()
        miss = np.flatnonzero(slot_ids < 0)
        loads: list[tuple[int, int]] = []
        if len(miss):
            # pinned: needed by this step, or in use by the previous tile
            keys = self._eviction_keys(slots, np.concatenate((ids, np.asarray(keep, dtype=np.int64))), busy)
            victims = np.argsort(keys, kind="stable")[: len(miss)]
            for i, slot in zip(miss.tolist(), victims.tolist(), strict=True):
                slots.put(int(ids[i]), slot)
                slot_ids[i] = slot
                loads.append((int(ids[i]), int(slot)))
        return Plan(slot_ids=slot_ids.tolist(), loads=loads)

    def count(self, experts: list[int]) -> None:
        """:meth:`plan`'s count of one step's distinct ``experts`` (uses and clock) without planning slots: for a
        step that placed its misses itself (experts/devplan.py, MOESTREAM_PROMOTE=inline)."""
        self.clock += 1
        ids = np.asarray(experts, dtype=np.int64)
        self.uses[ids] += 1
        self.last[ids] = self.clock

    def admit(self, slots: SlotMap, experts: list[int]) -> Plan:
        """:meth:`plan`'s count of one step's distinct ``experts`` (uses, clock), but a miss takes a slot only when it
        has been needed more often than the expert it would evict (an empty slot: always): frequency-based admission,
        as TinyLFU's (Einziger, Friedman, Manes, 2017), so that an expert needed once does not push out one needed
        often. For the device-planned step, whose misses are computed from the tier anyway (experts/devplan.py):
        a miss left out costs no copy. Returns the Plan (``slot_ids``: -1 for a miss left out); updates the map."""
        self.count(experts)
        ids = np.asarray(experts, dtype=np.int64)
        slot_ids = slots.slot_of[ids].copy()
        miss = np.flatnonzero(slot_ids < 0)
        loads: list[tuple[int, int]] = []
        if len(miss):
            keys = self._eviction_keys(slots, ids, None)
            victims = np.argsort(keys, kind="stable")
            miss = miss[np.argsort(-self.uses[ids[miss]], kind="stable")]  # the most needed first
            for i, slot in zip(miss.tolist(), victims.tolist(), strict=False):
                old = int(slots.expert_of[slot])
                if keys[slot] == np.inf or old >= 0 and self.uses[ids[i]] <= self.uses[old]:
                    break  # the rest are needed no more often, their victims no less
                slots.put(int(ids[i]), slot)
                slot_ids[i] = slot
                loads.append((int(ids[i]), int(slot)))
        return Plan(slot_ids=slot_ids.tolist(), loads=loads)

    def _c_plan(self, lib, slots: SlotMap, ids: np.ndarray, keep: list[int],  # noqa: ANN001
                busy: np.ndarray | None) -> Plan:
        """:meth:`plan`'s choices computed by ``ms_slot_plan`` (csrc/iokern.c): the same slots, loads and counts."""
        n = len(ids)
        arrays = (slots.slot_of, slots.expert_of, self.uses, self.last)
        ptrs = getattr(slots, "_c_ptrs", None)  # their addresses, kept while they are the same arrays
        if ptrs is None or any(a is not b for a, b in zip(ptrs[0], arrays, strict=True)):
            ptrs = slots._c_ptrs = (arrays, *(a.ctypes.data for a in arrays))
        out = np.empty(3 * n, dtype=np.int64)  # slot ids, then (expert, slot) per load
        o = out.ctypes.data
        kp = np.asarray(keep, dtype=np.int64) if keep else None
        bz = None if busy is None else np.ascontiguousarray(busy, dtype=np.bool_)
        m = lib.ms_slot_plan(self._c_kind, slots.n_slots, ptrs[1], ptrs[2], ptrs[3], ptrs[4], self.clock, n,
                             ids.ctypes.data, 0 if kp is None else len(kp), None if kp is None else kp.ctypes.data,
                             None if bz is None else bz.ctypes.data, o, o + 8 * n)
        if m < 0:
            raise ValueError(f"{n} experts in one step but no slot left for a miss of the {slots.n_slots}")
        flat = out[n:n + 2 * m].tolist()
        return Plan(slot_ids=out[:n].tolist(), loads=list(zip(flat[0::2], flat[1::2], strict=True)))

    def victims(self, slots: SlotMap, n: int, protect: list[int] = (), busy: np.ndarray | None = None) -> list[int]:
        """Up to ``n`` slots a prefetch may fill, in this policy's eviction order (empty slots first), without
        counting a use: never the slot of an expert in ``protect`` (real ids), never a ``busy`` slot (bool
        [n_slots], reads in flight). Does not change the slot map. Fewer than ``n`` when fewer are evictable."""
        keys = self._eviction_keys(slots, np.asarray(list(protect), dtype=np.int64), busy)
        order = np.argsort(keys, kind="stable")
        return [int(s) for s in order[keys[order] < _BUSY][:n]]

    def _eviction_keys(self, slots: SlotMap, protect: np.ndarray, busy: np.ndarray | None) -> np.ndarray:
        """float64 [n_slots]: the slot with the smallest key is evicted first. Empty slots first, then resident
        experts by ``_keys``, then ``busy`` slots (``_BUSY``), never the slots of ``protect`` (inf)."""
        resident = slots.expert_of
        keys = np.full(slots.n_slots, np.iinfo(np.int64).min, dtype=np.float64)  # empty slots first
        occupied = resident >= 0
        keys[occupied] = self._keys(resident[occupied])
        if busy is not None:
            keys[busy] = _BUSY
        if len(protect):  # the slots of the protected experts in the pool (the maps agree: slot_of[expert_of[s]] == s)
            held = slots.slot_of[protect]
            keys[held[held >= 0]] = np.inf
        return keys


#: Eviction key of a slot whose reads are in flight: after every other evictable slot, before the protected ones.
_BUSY = np.finfo(np.float64).max


class LFUPolicy(CachePolicy):
    """Least frequently used; ties broken by least recently used (the seed's policy)."""

    name = "lfu"
    _c_kind = 0

    def _keys(self, experts: np.ndarray) -> np.ndarray:
        return self.uses[experts].astype(np.float64) * 2.0**32 + self.last[experts]


class LRUPolicy(CachePolicy):
    """Least recently used."""

    name = "lru"
    _c_kind = 1

    def _keys(self, experts: np.ndarray) -> np.ndarray:
        return self.last[experts].astype(np.float64)


POLICIES: dict[str, type[CachePolicy]] = {"lfu": LFUPolicy, "lru": LRUPolicy}


def check_policy(name: str) -> None:
    """OptionError (field ``policy``) unless ``name`` is in :data:`POLICIES`."""
    if name not in POLICIES:
        from ..errors import OptionError
        raise OptionError(f"{{policy}}: unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}",
                          policy=name)
