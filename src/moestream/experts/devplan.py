"""The device-planned decode step: when the host tier holds every expert, the GPU decides hits and misses itself.

A streaming decode step normally sends each MoE layer's router top-k to the host, which plans the slots, starts
the copies and launches the expert kernels: a round trip per layer (runtime/graphs.py cuts the step there). When
``--host-cache`` holds every expert of every MoE layer in pinned host memory, nothing the step needs comes from the
disk, and the step stays on the GPU (issue 24, item 1):

- per MoE layer a device table ``slot_of`` (int32 [n_experts]: the expert's pool slot, -1 for none) that the
  router's top-k indexes on the device;
- every selected expert without a slot is copied from its pinned tier row (the GPU reads the pinned memory over
  PCIe through its device address) into one of ``top_k`` scratch rows that every layer shares, by a small Triton
  copy kernel that skips the hits (:func:`gather_misses`);
- the expert matmuls address the pool through the resulting rows (slot or scratch), with the same kernels and
  configuration as the resident step (``MoE.resident_step``), so the bits equal every other path's.

The whole decode step is then one CUDA graph replay. The slot policy stays on the host, off the critical path: the
step's expert ids of every layer go to the host in one asynchronous copy; after the *next* step is enqueued the
host counts that step's hits and misses, runs the policy (the store's own ``SlotMap`` and LFU/LRU policy), marks
evicted experts absent in the device table at once (before the step after it), and copies each admitted expert
from its tier row into its new slot on a copy stream that first waits for the enqueued step (which may still read
the evicted expert). An admitted expert appears in the device table only once its copy has finished (an event
queried on a later step), so no step ever reads a slot being written. The counters therefore lag one step behind
the replays; :meth:`DevicePlan.flush` brings them up to date (prepare(), close()).

Each promoted miss so crosses PCIe twice: into the scratch in its step, into its slot after it. With
``MOESTREAM_PROMOTE=inline`` (pools in GPU memory) the step places its misses itself: before each step the host
picks each layer's ``top_k`` victim slots in the policy's eviction order, never a victim of the step before (the
host has not replayed that one's placements yet), and uploads them; in the step a one-program kernel
(:func:`place_misses`) gives the j-th miss the j-th victim whose expert the step does not select, updating the
device tables (expert -> slot and slot -> expert), and the gather copies each placed miss from its tier row into its
new slot (the others into the scratch, :func:`gather_placed`). The host replays the same placement one step behind
(:meth:`DevicePlan._place_host`) and never uploads the tables between steps (the device's are ahead of its own).

Pools: the MoE layers' pools of one matrix whose slots have one stride are views of one tensor, with ``top_k``
scratch rows after the last layer's slots, so the expert kernels reach a scratch row from any of those layers' pools
at a positive offset (a Q4_K_M file whose ``down`` matrices are Q4_K in some layers and Q6_K in others has two
such tensors for ``down``). The scratch rows (``DevicePlan.scratch_bytes``: top-k experts' matrices per tensor,
about 31 MiB for the Qwen3-30B-A3B shape at Q4_K_M) are in ``--gpu-mem``'s plan, as scratch
(``MoEModel._device_plan_scratch``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch

try:  # triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


#: tests only: plan stores on a CPU device too (the kernels under Triton's interpreter; tests/test_gpu_path.py)
ON_CPU = False


def enabled() -> bool:
    """False when ``MOESTREAM_DEVICE_PLAN`` is ``0``/``off``/``false``/``no`` (default: on where it applies)."""
    return os.environ.get("MOESTREAM_DEVICE_PLAN", "1").strip().lower() not in ("0", "off", "false", "no")


if triton is not None:
    @triton.jit
    def _gather_kernel(src, dst, ids, slot_of, dst_row0, n_words, BLOCK: tl.constexpr):
        """Program (k, c): words [c * BLOCK, (c + 1) * BLOCK) of tier row ``ids[k]`` (src int32 [rows, n_words])
        into row ``dst_row0 + k`` of dst (int32 [rows, n_words]) when ``slot_of[ids[k]] < 0``; nothing otherwise."""
        k = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(ids + k)
        s = tl.load(slot_of + e)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = (offs < n_words) & (s < 0)
        v = tl.load(src + e * n_words + offs, mask=m)
        tl.store(dst + (dst_row0 + k) * n_words + offs, v, mask=m)


    @triton.jit
    def _place_kernel(ids, slot_of, expert_of, victims, newslot, K: tl.constexpr, KP: tl.constexpr):
        """One program: the step's misses (``slot_of[ids[k]] < 0``) take the victim slots in order, skipping a
        victim whose expert this step selects; the j-th miss takes the j-th usable victim, misses past the last
        usable victim none. Writes newslot[k] (int32: -2 hit, -1 a miss left to the scratch row k, else the
        slot the miss now holds) and updates slot_of (int32 [n_experts]) and expert_of (int32 [n_slots]): the
        victim's expert loses its slot, the miss gets it. ids int64 [K] distinct; victims int32 [K] (-1: none)."""
        kk = tl.arange(0, KP)
        km = kk < K
        idv = tl.load(ids + kk, mask=km, other=-1)
        sv = tl.load(slot_of + idv, mask=km, other=0)
        miss = km & (sv < 0)
        vic = tl.load(victims + kk, mask=km, other=-1)
        vexp = tl.load(expert_of + vic, mask=km & (vic >= 0), other=-1).to(tl.int64)
        clash = tl.sum(((vexp[:, None] == idv[None, :]) & km[None, :]).to(tl.int32), axis=1) > 0
        usable = (vic >= 0) & (clash == 0)
        ui = usable.to(tl.int32)
        mi = miss.to(tl.int32)
        urank = tl.cumsum(ui, 0) - ui
        mrank = tl.cumsum(mi, 0) - mi
        match = (mi[:, None] > 0) & (ui[None, :] > 0) & (mrank[:, None] == urank[None, :])
        got = tl.sum(match.to(tl.int32), axis=1) > 0
        v_k = tl.sum(tl.where(match, vic[None, :], 0), axis=1)
        old_k = tl.sum(tl.where(match, vexp[None, :], 0), axis=1)
        tl.store(newslot + kk, tl.where(miss, tl.where(got, v_k, -1), -2), mask=km)
        tl.store(slot_of + old_k, tl.full([KP], -1, tl.int32), mask=got & (old_k >= 0))
        tl.store(slot_of + idv, v_k, mask=got)
        tl.store(expert_of + v_k, idv.to(tl.int32), mask=got)

    @triton.jit
    def _gather_placed_kernel(src, dst, ids, newslot, pool_row0, scratch_row0, n_words, BLOCK: tl.constexpr):
        """Program (k, c): words [c * BLOCK, (c + 1) * BLOCK) of tier row ``ids[k]`` into dst row ``pool_row0 +
        newslot[k]`` (a miss placed in a slot) or ``scratch_row0 + k`` (a miss left to the scratch); nothing for
        a hit (newslot -2)."""
        k = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(ids + k)
        ns = tl.load(newslot + k)
        row = tl.where(ns >= 0, pool_row0 + ns, scratch_row0 + k).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = (offs < n_words) & (ns > -2)
        v = tl.load(src + e * n_words + offs, mask=m)
        tl.store(dst + row * n_words + offs, v, mask=m)


_GATHER_BLOCK = 2048  # int32 words per program: 8 KiB


def place_misses(ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor, victims: torch.Tensor,
                 newslot: torch.Tensor) -> None:
    """:func:`_place_kernel` on the device (capturable): ids int64 [k] distinct real expert ids, slot_of int32
    [n_experts] and expert_of int32 [n_slots] updated in place, victims int32 [k] (slots, -1 none), newslot int32
    [k] written (-2 hit, -1 miss to scratch, else the miss's new slot)."""
    k = ids.shape[0]
    _place_kernel[(1,)](ids, slot_of, expert_of, victims, newslot, K=k, KP=triton.next_power_of_2(k))


def gather_placed(tier: torch.Tensor, big: torch.Tensor, ids: torch.Tensor, newslot: torch.Tensor,
                  pool_row0: int, scratch_row0: int) -> None:
    """Each miss of :func:`place_misses` copied from its tier row into its new slot (row ``pool_row0 + slot`` of
    ``big``) or, when it got none, into scratch row ``scratch_row0 + k``; shapes as :func:`gather_misses`."""
    stride = tier.shape[1]
    if stride % 4 or big.shape[1] != stride:
        raise ValueError(f"gather_placed: strides {stride} and {big.shape[1]} must be equal multiples of 4")
    n_words = stride // 4
    grid = (ids.shape[0], triton.cdiv(n_words, _GATHER_BLOCK))
    _gather_placed_kernel[grid](tier.view(torch.int32), big.view(torch.int32), ids, newslot, pool_row0,
                                scratch_row0, n_words, BLOCK=_GATHER_BLOCK)


def gather_misses(tier: torch.Tensor, big: torch.Tensor, ids: torch.Tensor, slot_of: torch.Tensor,
                  dst_row0: int) -> None:
    """Copy tier row ``ids[k]`` to row ``dst_row0 + k`` of ``big`` for every k whose expert has no slot
    (``slot_of[ids[k]] < 0``), on the device, with no host synchronisation (CUDA-graph capturable).

    tier: uint8 [n_experts, stride] (pinned host memory seen through its device address, or any device tensor);
    big: uint8 [rows, stride] on the device; ids: int64 [k]; slot_of: int32 [n_experts]; stride a multiple of 4.
    """
    stride = tier.shape[1]
    if stride % 4 or big.shape[1] != stride:
        raise ValueError(f"gather_misses: strides {stride} and {big.shape[1]} must be equal multiples of 4")
    n_words = stride // 4
    grid = (ids.shape[0], triton.cdiv(n_words, _GATHER_BLOCK))
    _gather_kernel[grid](tier.view(torch.int32), big.view(torch.int32), ids, slot_of, dst_row0, n_words,
                         BLOCK=_GATHER_BLOCK)


#: MOESTREAM_TIER_PREFILL: how a prompt chunk's experts that have no slot reach the expert kernels when the tier
#: holds every expert (:class:`PrefillScratch`): "copy" (contiguous runs of tier rows copied by the copy
#: engine into double-buffered VRAM scratch on a copy stream, overlapping the kernels of the batch before),
#: "gather" (the same scratch filled by :func:`gather_misses`' copy kernel, one launch per matrix and batch),
#: "direct" (no scratch: the expert kernels read the mapped pinned tier rows themselves) or "off" (through the
#: pool's slots in tiles, the streaming store's own path). Default "gather": on the H200 (q32, --gpu-mem 4GiB
#: --host-cache 16GiB, pp64, 2026-12-04, benchmarks/gpu-h200/2026-12-04-session7) gather 150.68 tok/s, direct
#: 132.58, off 113.47, copy 41.77 (one copy per run of rows: the copy engine's per-copy cost)
PREFILL_MODES = ("copy", "gather", "direct", "off")
#: experts per scratch batch by default (MOESTREAM_TIER_PREFILL_BATCH): 8 Qwen3-30B-A3B Q4_K_M experts are
#: about 23 MiB, 0.5 ms at 50 GB/s, long enough to hide one batch's kernel launches
PREFILL_BATCH = 8
#: scratch buffers the batches rotate through (double buffering: batch i + 1 is copied while batch i computes)
PREFILL_BUFFERS = 2


def prefill_mode() -> str:
    """MOESTREAM_TIER_PREFILL (one of :data:`PREFILL_MODES`; default "gather"); ValueError for another value."""
    mode = os.environ.get("MOESTREAM_TIER_PREFILL", "gather").strip().lower() or "gather"
    if mode not in PREFILL_MODES:
        raise ValueError(f"MOESTREAM_TIER_PREFILL={mode!r}: expected one of {', '.join(PREFILL_MODES)}")
    return mode


def prefill_batch() -> int:
    """Experts per scratch batch (MOESTREAM_TIER_PREFILL_BATCH, default :data:`PREFILL_BATCH`, at least 1)."""
    return max(1, int(os.environ.get("MOESTREAM_TIER_PREFILL_BATCH", PREFILL_BATCH)))


def prefill_scratch_bytes(strides: dict[int, dict[str, int]], n_experts: int) -> int:
    """Bytes of :class:`PrefillScratch` for pools of slot strides ``strides`` ({layer: {matrix: bytes}}) and
    layers of at most ``n_experts`` experts: :data:`PREFILL_BUFFERS` buffers of a batch of experts of the widest
    layer; 0 where the mode needs no scratch ("direct", "off")."""
    if prefill_mode() not in ("copy", "gather") or not strides:
        return 0
    return PREFILL_BUFFERS * min(prefill_batch(), n_experts) * max(sum(s.values()) for s in strides.values())


def _stream_after(stream: Any, *events: Any) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)`` once ``stream`` waits (on the GPU) for every event of ``events`` that is not
    None; a null context when ``stream`` is None (a CPU device: everything is synchronous)."""
    if stream is None:
        return contextlib.nullcontext()
    for ev in events:
        if ev is not None:
            stream.wait_event(ev)
    return torch.cuda.stream(stream)


def mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over pinned host tensor ``t``'s memory (unified addressing: the GPU reads it over
    PCIe through the same address); ``t`` itself on a CPU device. The caller keeps ``t`` alive."""
    if device.type != "cuda":
        return t

    class _Interface:  # the CUDA array interface (numba's protocol), which torch.as_tensor takes
        __cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1", "data": (t.data_ptr(), False),
                                    "version": 3, "strides": None}

    if not t.is_contiguous() or t.dtype != torch.uint8:
        raise ValueError("mapped: a contiguous uint8 tensor is needed")
    return torch.as_tensor(_Interface(), device=device)


class DevicePlan:
    """The device tables, the scratch rows and the host bookkeeping of the device-planned step for ``store`` (a
    StreamingStore whose host tier holds every expert, see the module).

    groups: {layer: {matrix name: (tensor, first row)}}: the uint8 [rows + top_k, stride] tensor that holds the
    layer's pool of that matrix from its first row on (every layer whose matrix has that stride shares it), its
    last ``top_k`` rows the scratch; top_k: experts per token."""

    def __init__(self, store: Any, groups: dict[int, dict[str, tuple[torch.Tensor, int]]], top_k: int):
        self.store = store
        self.top_k = top_k
        self.layers = list(store.pools)
        self.index = {la: i for i, la in enumerate(self.layers)}
        dev = store.device
        self.device = dev
        n_exp = max(store.layout.n_experts(la) for la in self.layers)
        tier = store.tier
        #: per layer and matrix: (the group tensor, the absolute row of its first scratch row)
        self.scratch = {la: {n: (t, t.shape[0] - top_k) for n, (t, _) in mats.items()} for la, mats in groups.items()}
        #: per layer and matrix: the pinned tier rows as the GPU addresses them (row = real expert id)
        self.tier_dev = {la: {n: mapped(t, dev) for n, t in tier.pools[la].items()} for la in self.layers}
        #: int32 [layers, n_experts]: each expert's slot in its layer's pool as the device sees it (-1: none)
        self.host_table = np.full((len(self.layers), n_exp), -1, dtype=np.int32)
        self.slot_dev = torch.full((len(self.layers), n_exp), -1, dtype=torch.int32, device=dev)
        names = list(groups[self.layers[0]])
        #: per matrix: int64 [layers, top_k], the rows of each layer's scratch relative to the layer's pool
        self.scratch_dev = {}
        #: per matrix: int64 [layers, n_experts], each expert's lead in its tier row (= in a slot or scratch row)
        self.lead_dev = {}
        #: per matrix: the largest power of two (<= 16) dividing every lead (tkernels.alignment), for the kernels
        self.lead_align = {}
        from ..gpu.tkernels import alignment  # the plan computes through the kernels: triton is needed anyway

        for name in names:
            rel = np.zeros((len(self.layers), top_k), dtype=np.int64)
            lead = np.zeros((len(self.layers), n_exp), dtype=np.int64)
            for i, la in enumerate(self.layers):
                t, row0 = groups[la][name]
                rel[i] = t.shape[0] - top_k - row0 + np.arange(top_k)
                lead[i, :store.layout.n_experts(la)] = tier.leads[la][name]
            self.scratch_dev[name] = torch.from_numpy(rel).to(dev)
            self.lead_dev[name] = torch.from_numpy(lead).to(dev)
            self.lead_align[name] = alignment(lead)
        #: int64 [layers, top_k]: the step's top-k ids of every layer, written on the device by each step
        self.ids_dev = torch.zeros((len(self.layers), top_k), dtype=torch.int64, device=dev)
        gpu = dev.type == "cuda"
        self._ids_host = [torch.zeros((len(self.layers), top_k), dtype=torch.int64, pin_memory=gpu)
                          for _ in range(2)]
        self._flip = 0
        self._prev: tuple | None = None  # (host ids, event) of the step not yet counted
        self._pending: list[tuple[int, int, int, Any]] = []  # (layer index, expert, slot, copy event)
        self._copy = torch.cuda.Stream(dev) if gpu else None
        self.dirty = True  # host_table must be rebuilt from the slot maps and uploaded before the next step
        self.steps = 0
        mode = prefill_mode()
        #: the prompt chunks' scratch (PrefillScratch; None in the modes "direct" and "off")
        self.prefill = PrefillScratch(self, mode, prefill_batch()) if mode in ("copy", "gather") else None
        #: MOESTREAM_ADMIT=freq: a miss is promoted only when needed more often than its victim (CachePolicy.admit);
        #: default: every miss is promoted (CachePolicy.plan), as the slot path loads every miss
        self.admission = os.environ.get("MOESTREAM_ADMIT", "all").strip().lower() == "freq"
        #: promotions started (tier row -> slot copies) and bytes they copied
        self.promotions = 0
        self.bytes_promoted = 0
        #: MOESTREAM_PROMOTE=inline (pools in GPU memory only): the step itself copies each miss from its tier row
        #: into a victim slot the host chose before the step (one PCIe crossing per miss, where a promotion after
        #: the step is a second), and updates the device tables; the host replays the same placement one step
        #: behind (:meth:`_place_host`). Default "copy": misses into the scratch, promotions between steps.
        pools_on_device = all(p.device.type == dev.type for la in self.layers for p in store.pools[la].values())
        self.inline = os.environ.get("MOESTREAM_PROMOTE", "copy").strip().lower() == "inline" and pools_on_device
        #: per layer and matrix: the absolute row of the layer's slot 0 in its group tensor
        self.pool_row0 = {la: {n: r for n, (_, r) in mats.items()} for la, mats in groups.items()}
        #: misses placed into slots by the steps (inline)
        self.placed = 0
        if self.inline:
            n_slots = max(store.slots[la].n_slots for la in self.layers)
            #: int32 [layers, n_slots]: each slot's expert (-1 none), as the device sees it
            self.host_expert = np.full((len(self.layers), n_slots), -1, dtype=np.int32)
            self.expert_dev = torch.full((len(self.layers), n_slots), -1, dtype=torch.int32, device=dev)
            #: int32 [layers, top_k]: the slots the next step's misses may take (-1 none), chosen by the host
            self.victims_dev = torch.full((len(self.layers), top_k), -1, dtype=torch.int32, device=dev)
            self.newslot_dev = torch.zeros((len(self.layers), top_k), dtype=torch.int32, device=dev)
            self._victims_last: np.ndarray | None = None  # those of the step enqueued last, not yet counted

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch rows (top_k rows of each distinct group tensor) and of the prompt chunks' scratch
        (:class:`PrefillScratch`)."""
        seen = {id(t): t.shape[1] * self.top_k for mats in self.scratch.values() for t, _ in mats.values()}
        return sum(seen.values()) + (self.prefill.nbytes if self.prefill is not None else 0)

    # --- on the device, inside the step -------------------------------------------------------------------
    def slots(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [top_k] (one token's real expert ids) -> int32 [top_k]: each expert's slot in ``layer``'s pool,
        -1 for a miss, which is copied into the layer's scratch row of its pair first. Device work only: capturable."""
        i = self.index[layer]
        self.ids_dev[i].copy_(ids)
        table = self.slot_dev[i]
        if self.inline:  # misses into the victim slots where they can, the tables updated on the device
            place_misses(ids, table, self.expert_dev[i], self.victims_dev[i], self.newslot_dev[i])
            for name, t in self.tier_dev[layer].items():
                big, row0 = self.scratch[layer][name]
                gather_placed(t, big, ids, self.newslot_dev[i], self.pool_row0[layer][name], row0)
            return table.index_select(0, ids)
        for name, t in self.tier_dev[layer].items():
            big, row0 = self.scratch[layer][name]
            gather_misses(t, big, ids, table, row0)
        return table.index_select(0, ids)

    def offsets(self, layer: int, name: str, ids: torch.Tensor, slots: torch.Tensor, stride: int) -> torch.Tensor:
        """int64 [top_k]: the byte offset of each expert of ``ids`` in ``layer``'s pool of ``name`` (row stride
        ``stride``): its slot's row, or its scratch row for a miss (``slots`` from :meth:`slots`), plus its lead."""
        i = self.index[layer]
        rows = torch.where(slots >= 0, slots.to(torch.int64), self.scratch_dev[name][i])
        return rows * stride + self.lead_dev[name][i].index_select(0, ids)

    # --- on the host, between steps -----------------------------------------------------------------------
    def before_step(self) -> None:
        """Before a device step is enqueued: the device table brought up to date when something else (prepare(),
        a prefill) moved experts, and the promotions whose copies finished published."""
        changed = self._publish(block=False)
        if self.dirty:
            self.flush()
            self._rebuild()
            changed = True
        if changed:
            self._upload()
        if self.inline:
            self._choose_victims()

    def after_step(self) -> None:
        """Right after a device step was enqueued: its ids go to the host (asynchronously); the previous step's
        ids are counted and drive the policy (evictions, promotions), and the table changes are uploaded for the
        next step."""
        self.steps += 1
        buf = self._ids_host[self._flip]
        self._flip ^= 1
        if self.device.type == "cuda":
            buf.copy_(self.ids_dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:
            buf.copy_(self.ids_dev)
            ev = None
        prev, self._prev = self._prev, (buf, ev, self._victims_last if self.inline else None)
        changed = self._publish(block=False)
        if prev is not None:
            changed |= self._book(prev, after=ev)
        if changed:
            self._upload()

    def flush(self) -> None:
        """Count the last step's ids (waits for that step) and finish every promotion copy."""
        prev, self._prev = self._prev, None
        changed = prev is not None and self._book(prev, after=None)
        if self.inline:
            self._victims_last = None  # every step counted: no victim is held by a step in flight
        if self._copy is not None:
            self._copy.synchronize()
        changed |= self._publish(block=True)
        if changed and not self.dirty:
            self._upload()

    def _book(self, prev: tuple, after: Any) -> bool:
        """Count one step's ids and run the policy; evicted experts leave the device table now, admitted ones get
        their copy started (after ``after``, the event of the step enqueued since, which may still read an evicted
        expert's slot). Returns whether the host table changed."""
        buf, ev, victims = prev
        if ev is not None:
            ev.synchronize()
        ids = buf.numpy()
        store = self.store
        changed = False
        for i, la in enumerate(self.layers):
            experts = sorted(set(ids[i].tolist()))  # distinct, ascending: as the MoE layer asks prepare()
            if store.trace is not None:  # the routing trace (bench's Belady column) as prepare() records it
                store.trace.append((la, tuple(experts), ()))
            sm = store.slots[la]
            held = int((sm.slot_of[np.asarray(experts)] >= 0).sum())
            store.stats.hits += held
            store.stats.misses += len(experts) - held
            store.layer_counts[la][0] += held
            store.layer_counts[la][1] += len(experts) - held
            if victims is not None:  # inline: the step placed its misses already; the same placement here
                store.policies[la].count(experts)
                self._place_host(i, la, ids[i], victims[i])
                continue
            if held == len(experts):
                store.policies[la].plan(sm, experts)  # counts the uses (LFU) and the clock
                continue
            old = sm.expert_of.copy()
            pol = store.policies[la]
            plan = pol.admit(sm, experts) if self.admission else pol.plan(sm, experts)
            for e, s in plan.loads:
                o = int(old[s])
                if o >= 0:
                    self.host_table[i, o] = -1
                self.host_table[i, e] = -1
                changed = True
                self._promote(i, la, e, s, after)
        return changed

    def _place_host(self, i: int, layer: int, ids: np.ndarray, victims: np.ndarray) -> None:
        """The placement :func:`place_misses` made on the device for one step of ``layer`` (index ``i``), replayed
        on the store's slot map, the slots' leads and the host tables: ids int64 [top_k] in top-k order, victims
        int32 [top_k] as uploaded for that step. Same rule: the j-th miss takes the j-th victim whose expert the
        step does not select."""
        store = self.store
        sm = store.slots[layer]
        miss = [int(e) for e in ids if sm.slot_of[e] < 0]
        chosen = set(int(e) for e in ids)
        usable = [int(v) for v in victims if v >= 0 and int(sm.expert_of[v]) not in chosen]
        for e, v in zip(miss, usable, strict=False):
            old = sm.put(e, v)
            if old >= 0:
                self.host_table[i, old] = -1
            self.host_table[i, e] = v
            self.host_expert[i, v] = e
            for name in store.pools[layer]:
                store._leads[layer][name][v] = store.tier.leads[layer][name][e]
            self.placed += 1

    def _choose_victims(self) -> None:
        """Before a step (inline): each layer's ``top_k`` victim slots in the policy's eviction order, never one that
        the step in flight may still fill (its own victims: the host has not counted it yet), uploaded."""
        store = self.store
        v = np.full((len(self.layers), self.top_k), -1, dtype=np.int32)
        last = self._victims_last
        for i, la in enumerate(self.layers):
            sm = store.slots[la]
            busy = None
            if last is not None:
                busy = np.zeros(sm.n_slots, dtype=np.bool_)
                busy[last[i][last[i] >= 0]] = True
            got = store.policies[la].victims(sm, self.top_k, busy=busy)
            v[i, :len(got)] = got
        self._victims_last = v
        if self.device.type == "cuda":
            from ..gpu.tkernels import _upload
            self.victims_dev.copy_(_upload(v, self.device))
        else:
            self.victims_dev.copy_(torch.from_numpy(v))

    def _promote(self, i: int, layer: int, e: int, s: int, after: Any) -> None:
        """Copy expert ``e``'s tier row into slot ``s`` of ``layer``'s pool (after ``after``, on the copy stream).
        Pools in pinned host memory (``--pool host``) are copied by the CPU, which no CUDA stream orders: that copy
        waits in the pending list until ``after`` (the step enqueued since, which may still read the victim's
        slot through its mapping) has completed."""
        store = self.store
        row = int(store.tier.slots[layer].slot_of[e])
        gpu = self._copy is not None
        if gpu and any(p.device.type != "cuda" for p in store.pools[layer].values()):
            self.promotions += 1
            self._pending.append((i, e, s, _HostCopy(self, layer, e, s, row, after)))
            return
        with _stream_after(self._copy, after):
            for name, pool in store.pools[layer].items():
                src = store.tier.pools[layer][name][row]
                pool[s].copy_(src, non_blocking=gpu)
                store._leads[layer][name][s] = store.tier.leads[layer][name][e]
                self.bytes_promoted += src.numel()
            done = None
            if gpu:
                done = torch.cuda.Event()
                done.record(self._copy)
        self.promotions += 1
        self._pending.append((i, e, s, done))

    def _publish(self, block: bool) -> bool:
        """Promotions whose copies finished enter the host table (when their slot still holds them)."""
        changed = False
        keep = []
        for i, e, s, done in self._pending:
            if done is not None and not block and not done.query():
                keep.append((i, e, s, done))
                continue
            if done is not None and block:
                done.synchronize()
            if isinstance(done, _HostCopy):
                done.run()
            if int(self.store.slots[self.layers[i]].slot_of[e]) == s:
                self.host_table[i, e] = s
                changed = True
        self._pending = keep
        return changed

    def _rebuild(self) -> None:
        """The host table from the slot maps (every copy into a slot joined: after flush and a prepare())."""
        self.host_table[:] = -1
        for i, la in enumerate(self.layers):
            sm = self.store.slots[la]
            self.host_table[i, :sm.n_experts] = sm.slot_of.astype(np.int32)
            if self.inline:
                self.host_expert[i] = -1
                self.host_expert[i, :sm.n_slots] = sm.expert_of.astype(np.int32)
        self.dirty = False

    def _upload(self) -> None:
        """The host table to the device table, in stream order (the next step reads it)."""
        if self.device.type == "cuda":
            from ..gpu.tkernels import _upload
            self.slot_dev.copy_(_upload(self.host_table, self.device))
            if self.inline:
                self.expert_dev.copy_(_upload(self.host_expert, self.device))
        else:
            self.slot_dev.copy_(torch.from_numpy(self.host_table))
            if self.inline:
                self.expert_dev.copy_(torch.from_numpy(self.host_expert))

    def close(self) -> None:
        if self._copy is not None:
            self._copy.synchronize()
        if self.prefill is not None:
            self.prefill.close()


class PrefillScratch:
    """VRAM scratch for a prompt chunk's experts that have no slot, when the tier holds every expert (issue 24,
    item 5): :data:`PREFILL_BUFFERS` buffers of ``batch`` experts, each a row of every matrix at the layer's slot
    stride, allocated once (one flat uint8 tensor of :func:`prefill_scratch_bytes`) and shared by every layer.

    A chunk's misses go in batches of ``batch`` experts, batch j into buffer ``j % PREFILL_BUFFERS``. :meth:`fill`
    enqueues a batch's copies from the pinned tier rows on the copy stream, after the kernels that last read the
    buffer (:meth:`release`'s event); the expert kernels of the batch wait (on the GPU) for its copies
    (:meth:`ready`). The host enqueues batch j + 1's copies before batch j's kernels, so the copy engine moves the
    next experts while the SMs compute the current ones, and never waits on the host.

    mode "copy": each run of consecutive tier rows in a batch is one copy per matrix (cudaMemcpyAsync from pinned
    memory: the copy engine at PCIe speed); "gather": one :func:`gather_misses` launch per matrix (SMs reading the
    mapped tier). On a CPU device (tests) every copy is synchronous."""

    def __init__(self, plan: DevicePlan, mode: str, batch: int):
        store = plan.store
        self.plan, self.mode, self.device = plan, mode, plan.device
        n_exp = max(store.layout.n_experts(la) for la in plan.layers)
        self.batch = min(batch, n_exp)
        strides = {la: {n: p.shape[1] for n, p in store.pools[la].items()} for la in plan.layers}
        self.nbytes = prefill_scratch_bytes(strides, n_exp)
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        rows = PREFILL_BUFFERS * self.batch
        #: per layer and matrix: uint8 [PREFILL_BUFFERS * batch, stride]; buffer h is rows h * batch ..
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        for la, sts in strides.items():
            at, self.views[la] = 0, {}
            for name, st in sts.items():
                self.views[la][name] = self.flat[at:at + rows * st].view(rows, st)
                at += rows * st
        gpu = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if gpu else None
        #: per buffer: the event after the kernels that last read it (None: nothing in flight)
        self._free: list[Any] = [None] * PREFILL_BUFFERS
        #: per buffer: the event after its last copies
        self._ready: list[Any] = [None] * PREFILL_BUFFERS
        #: int32 [n_experts] of -1: gather_misses' slot table that copies every row it is given
        self._none = torch.full((n_exp,), -1, dtype=torch.int32, device=self.device)
        #: copies enqueued (one per run of rows and matrix, or one launch per matrix) and bytes they copy
        self.copies = 0
        self.bytes_copied = 0

    def fill(self, layer: int, buf: int, rows: np.ndarray, rows_dev: torch.Tensor | None = None,
             after: Any = None) -> None:
        """Enqueue the copies of tier rows ``rows`` (int64 [n <= batch] of ``layer``'s tier) into rows
        ``buf * batch ..`` of ``layer``'s scratch (buffer ``buf``), on the copy stream after the kernels that
        last read the buffer. "gather" mode: ``rows_dev`` is ``rows`` on the device (int64 [n]), ``after`` an
        event after its upload (None: nothing to wait for)."""
        tier = self.plan.store.tier.pools[layer]
        views = self.views[layer]
        row0 = buf * self.batch
        gpu = self.stream is not None
        with _stream_after(self.stream, self._free[buf], after):
            if self.mode == "gather":
                for name, t in self.plan.tier_dev[layer].items():
                    gather_misses(t, views[name], rows_dev, self._none, row0)
                    self.copies += 1
                if gpu:
                    rows_dev.record_stream(self.stream)
            else:  # one copy per run of consecutive tier rows and matrix
                cut = (np.flatnonzero(np.diff(rows) != 1) + 1).tolist()
                for a, b in zip([0, *cut], [*cut, len(rows)], strict=True):
                    r = int(rows[a])
                    for name, src in tier.items():
                        views[name][row0 + a:row0 + b].copy_(src[r:r + b - a], non_blocking=gpu)
                        self.copies += 1
            self.bytes_copied += len(rows) * sum(v.shape[1] for v in views.values())
            if gpu:
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._ready[buf] = ev

    def ready(self, buf: int) -> None:
        """Before the kernels that read buffer ``buf``: the current stream waits for its copies (on the GPU)."""
        if self.stream is not None and self._ready[buf] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready[buf])

    def release(self, buf: int) -> None:
        """After the kernels that read buffer ``buf`` were enqueued (current stream): its next copies wait for
        them."""
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record()
            self._free[buf] = ev

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class _HostCopy:
    """A promotion into a pool in pinned host memory, held until the step that may still read the slot is done:
    ``query``/``synchronize`` as a CUDA event's (on ``after``, None: nothing in flight), ``run`` does the copy."""

    def __init__(self, plan: DevicePlan, layer: int, e: int, s: int, row: int, after: Any):
        self.plan, self.layer, self.e, self.s, self.row, self.after = plan, layer, e, s, row, after

    def query(self) -> bool:
        return self.after is None or self.after.query()

    def synchronize(self) -> None:
        if self.after is not None:
            self.after.synchronize()

    def run(self) -> None:
        store, layer = self.plan.store, self.layer
        for name, pool in store.pools[layer].items():
            src = store.tier.pools[layer][name][self.row]
            pool[self.s].copy_(src)
            store._leads[layer][name][self.s] = store.tier.leads[layer][name][self.e]
            self.plan.bytes_promoted += src.numel()


def lean_segments() -> bool:
    """Whether the segmented streaming step computes each MoE layer's experts inside the next segment's graph
    (:class:`SegmentOffsets`): on unless ``MOESTREAM_LEAN_SEGMENTS`` is ``0``/``off``/``false``/``no`` (then each
    MoE layer's experts run eagerly through ``MoE.__call__`` between two replays). On by default since
    ``tests/test_cuda.py`` passed with it on an H100 (2026-12-05)."""
    return os.environ.get("MOESTREAM_LEAN_SEGMENTS", "1").strip().lower() not in ("0", "off", "false", "no")


class SegmentOffsets:
    """The expert addresses of the segmented streaming decode step (issue 24, item 2: the tier does not hold every
    expert, so each MoE layer's top-k goes to the host, which plans the slots and reads the misses from the disk).

    The host plans a layer's slots (``store.prepare``: one call), joins its reads and writes, per matrix, the byte
    offset of each top-k pair's expert in the layer's pool (``slot * stride + lead``, in the router's top-k order)
    into a pinned row that one asynchronous copy takes to the device (:meth:`write`). The next segment's CUDA graph
    then computes the layer's experts through ``MoE.resident_step`` with these offsets (:meth:`offsets`, read on
    the device) before the layer's combine: the expert kernels are inside the graph, and the host does no expert
    launch, tile plan or upload of its own per layer. The kernels and their configuration are the resident
    step's, so the bits are those of every other path (tests/test_gpu_path.py, tests/test_cuda.py).

    The pinned row of a layer is written again only at the next token, after the host has synchronised on that
    layer's next top-k, which the GPU computes after the copy from the row: no copy reads a row being written.

    store: a StreamingStore; top_k: experts per token."""

    def __init__(self, store: Any, top_k: int):
        self.store = store
        dev = store.device
        gpu = dev.type == "cuda"
        from ..gpu.tkernels import alignment

        #: per layer: its matrices' names in pool order (rows of the offset tables)
        self.names = {la: list(p) for la, p in store.pools.items()}
        self.row = {la: {n: k for k, n in enumerate(names)} for la, names in self.names.items()}
        #: per layer: int64 [matrices, top_k] byte offsets, on the host (pinned) and on the device
        self.host = {la: torch.zeros((len(n), top_k), dtype=torch.int64, pin_memory=gpu)
                     for la, n in self.names.items()}
        self.dev = {la: torch.zeros((len(n), top_k), dtype=torch.int64, device=dev) for la, n in self.names.items()}
        #: per matrix: a power of two dividing every lead a slot of it can get (the file offset of an expert
        #: modulo the direct-IO alignment, or 0): with the pool's stride, the alignment the kernels are promised
        self.lead_align: dict[str, int] = {}
        for mats in store.layout.layers.values():
            for name, m in mats.items():
                a = alignment(m.offset, m.bytes_per_expert)
                self.lead_align[name] = min(a, self.lead_align.get(name, a))
        self.writes = 0

    def write(self, layer: int, ids: np.ndarray, experts: list[int], slot_ids: list[int]) -> None:
        """After ``store.prepare(layer, experts)`` gave ``slot_ids`` and its reads were joined: the offsets of the
        top-k pairs ``ids`` (int64 [top_k], real ids in the router's order) to the device, in stream order."""
        slot_of = dict(zip(experts, slot_ids, strict=True))
        s = np.fromiter((slot_of[int(e)] for e in ids), dtype=np.int64, count=len(ids))
        h = self.host[layer].numpy()
        store = self.store
        for k, name in enumerate(self.names[layer]):
            h[k] = s * store.pools[layer][name].stride(0) + store.lead(layer, name)[s]
        self.dev[layer].copy_(self.host[layer], non_blocking=self.dev[layer].is_cuda)
        self.writes += 1

    # --- on the device, inside the step (the DevicePlan interface of MoE.resident_step) ----------------------
    def slots(self, layer: int, ids: torch.Tensor) -> None:
        """Nothing to look up on the device: every pair's expert is in a slot (the host joined its reads)."""
        return None

    def offsets(self, layer: int, name: str, ids: torch.Tensor, slots: Any, stride: int) -> torch.Tensor:
        """int64 [top_k]: the byte offsets :meth:`write` put on the device for ``layer``'s matrix ``name``."""
        return self.dev[layer][self.row[layer][name]]
