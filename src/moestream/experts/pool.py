"""Expert stores: where the expert matmul finds an expert's bytes.

``StreamingStore``: per MoE layer, per expert matrix, one slot pool ``[n_slots, stride]`` (uint8, allocated
once) filled by an ExpertReader; the matmul addresses it through slot ids. Buffered reads: stride =
bytes_per_expert and the expert fills its slot. O_DIRECT reads (``direct_io``): the file offset, length and
buffer must be aligned (``reader.dio_alignment``, e.g. 512 or 4096 bytes) but GGUF experts are only 32-byte
aligned, so a slot receives the aligned range that covers its expert, straight from the file (no bounce
buffer, no copy): the pool starts aligned, stride is rounded up to the alignment and holds the widest such
range of the matrix, and the expert's first byte is ``lead(layer, name)[slot]`` bytes into its slot (its file
offset modulo the alignment).
``ResidentStore``: the "pool" is the whole expert tensor ``[n_experts, bytes_per_expert]`` viewed in a
read-only memory map of the file, and slot id = expert id (the ``--moe-stream off`` baseline).
Both expose the same ``prepare`` / ``wait`` / ``matrix`` / ``lead`` calls, so the compute code is the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ExpertReadError, OptionError
from ..gguf import GGUFModel
from ..params import check_pool
from .layout import ExpertLayout, ExpertMatrix
from .policy import POLICIES, CachePolicy, SlotMap, _c_lib, check_policy
from .reader import ExpertReader, ReadJob, Ticket, dio_alignment, stderr_note


@dataclass
class StoreStats:
    """Counters over all MoE layers (each a running total; ``a - b`` gives the counts between two snapshots).

    hits / misses count (prepare() call, expert) uses of distinct experts: a miss is an expert that prepare()
    had to read (a demand read); a hit one already in a slot, including one that a prefetch brought, whose reads
    may still be in flight (prepare() then joins them before it is computed; see ``StreamingStore.prefetch``).
    With ``--prefetch on`` the hit rate therefore counts correctly predicted experts as hits.

    Router lookahead (``--prefetch``), counted in experts and bytes:

    - ``predictable`` / ``predicted``: experts that prepare() asked for in a layer for which a prediction had
      been made since the layer's previous step, and how many of them were predicted. ``recall`` is their ratio.
    - ``miss_bytes`` / ``miss_bytes_ready``: bytes of the experts a step needed that were not in the pool before
      the prediction (the demand misses, and the first use of each prefetched expert), and how many of those
      bytes were already read when prepare() asked for them. ``ready_share`` is their ratio.
    - ``prefetch_issued``: experts whose reads a prefetch started; ``prefetch_used``: of those, the ones a later
      prepare() asked for; ``prefetch_wasted``: the ones evicted, cancelled or dropped after a failed read
      before any use (prefetched experts still in the pool and unused are neither); ``prefetch_cancelled``: of
      the wasted, those a step of their layer did not need while some of their reads were still queued (those
      reads were cancelled, the expert dropped); ``prefetch_failed``: prefetched experts whose read failed
      before any step needed them (dropped quietly, see ``StreamingStore.prefetch``).
    """

    hits: int = 0
    misses: int = 0
    #: Seconds the compute thread spent blocked in ``wait`` for reads (what the overlap hides), and in
    #: prepare()/prefetch() waiting for an in-flight prefetch read of a slot it had to reuse.
    stall_seconds: float = 0.0
    predictable: int = 0
    predicted: int = 0
    miss_bytes: int = 0
    miss_bytes_ready: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    prefetch_failed: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    @property
    def recall(self) -> float | None:
        """Share of the experts the steps used that the lookahead had predicted; None without predictions."""
        return self.predicted / self.predictable if self.predictable else None

    @property
    def ready_share(self) -> float | None:
        """Share of the miss bytes (see the class) already read when a step needed them; None without misses."""
        return self.miss_bytes_ready / self.miss_bytes if self.miss_bytes else None

    def __sub__(self, other: StoreStats) -> StoreStats:
        return StoreStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> StoreStats:
        return replace(self)


#: the gated lookahead (StreamingStore.prefetch's ``gate``): ranks counted; reads of a (kind, rank) started while
#: fewer than LOOK_WARM were counted, then while at least look_min_precision() of them were used; counts decay by
#: LOOK_DECAY per read counted; a kind none of whose ranks pays predicts only every LOOK_EXPLORE-th time
LOOK_RANKS, LOOK_WARM, LOOK_DECAY, LOOK_EXPLORE = 32, 6.0, 0.98, 16


def look_min_precision() -> float:
    """The share of a (kind, rank)'s lookahead reads that the steps must use for its reads to go on
    (``MOESTREAM_LOOKAHEAD_MIN``, default 0.5: below it a read wastes more bytes than it brings ahead)."""
    try:
        return float(os.environ.get("MOESTREAM_LOOKAHEAD_MIN", "0.5"))
    except ValueError:
        return 0.5


@dataclass
class _Prefetched:
    """A prefetched expert not yet used by any step: its slot and the ticket of its reads (one per matrix)."""

    slot: int
    ticket: Ticket

    @property
    def settled(self) -> bool:
        """Every read joined (its bytes are in the slot)."""
        return self.ticket.joined == len(self.ticket.futures)


class ExpertStore:
    """Interface. ``capacity(layer)``: experts that fit at once. ``prepare(layer, experts, pinned)`` -> (slot
    ids, ticket), never evicting ``pinned``; ``wait(ticket)``; ``discard(ticket)`` (a prepared tile that will
    not be computed); ``matrix(layer, name)`` -> uint8 tensor [capacity, stride] (stride >= bytes_per_expert);
    ``lead(layer, name)`` -> int64 [capacity]: the byte offset of the expert's first byte in each slot, so
    slot s's expert is ``matrix(layer, name)[s, lead[s]:lead[s] + bytes_per_expert]``;
    ``prefetch(layer, experts)``: a hint that the coming step of ``layer`` will need ``experts``."""

    streaming = False

    def __init__(self, model: GGUFModel, layout: ExpertLayout):
        self.model, self.layout = model, layout
        self.stats = StoreStats()
        #: per MoE layer: [hits, misses], running totals counted as ``stats.hits`` / ``stats.misses`` are (a
        #: per-token trace takes their differences, moestream/runtrace.py)
        self.layer_counts: dict[int, list[int]] = {layer: [0, 0] for layer in layout.moe_layers}
        #: a list to append every prepare()'s (layer, experts, pinned) to (a routing trace, experts/trace.py)
        self.trace: list | None = None

    def capacity(self, layer: int) -> int:
        raise NotImplementedError

    def _jobs(self, layer: int, loads: list[tuple[int, int]], pinned: list[int] = ()) -> list[ReadJob]:
        """The reads of ``loads`` [(expert, slot)] of ``layer``, one per matrix, consecutive per expert; a direct
        read covers the aligned range around the expert and records its lead in the slot."""
        mats = self.layout[layer]
        views, leads, direct, align = self._views[layer], self._leads[layer], self._direct[layer], self.align
        sinks = getattr(self, "_sinks", None)
        tier = getattr(self, "tier", None)
        if tier is not None and loads:  # misses of the pool: hits of the host tier are copied, the rest read into it
            tier_rows, tier_hits = tier.plan(layer, [e for e, _ in loads], pinned)
        jobs = []
        for e, s in loads:
            for name, m in mats.items():
                off = m.expert_offset(e)
                if direct[name]:  # the aligned range that covers the expert
                    lead = off % align
                    end = -(-(lead + m.bytes_per_expert) // align) * align
                else:
                    lead, end = 0, m.bytes_per_expert
                if tier is not None:  # through the host tier: its row is the staging (or holds the expert)
                    h = tier_rows[e]
                    sink = TierSink(tier, layer, (h, name), tier.views[layer][name][h],
                                    tier.pools[layer][name][h, :end], self.pools[layer][name][s, :end], sinks)
                    jobs.append(ReadJob(m.path, off - lead, None, lead, m.bytes_per_expert, direct[name],
                                        sink=sink, size=end, copy_only=e in tier_hits))
                elif sinks is not None:  # a slot in GPU memory: read into pinned staging, then copy
                    sink = DeviceSink(sinks, layer, self.pools[layer][name][s, :end])
                    jobs.append(ReadJob(m.path, off - lead, None, lead, m.bytes_per_expert, direct[name],
                                        sink=sink, size=end))
                elif direct[name]:
                    jobs.append(ReadJob(m.path, off - lead, views[name][s][:end], lead, m.bytes_per_expert, True))
                else:
                    jobs.append(ReadJob(m.path, off, views[name][s]))
                leads[name][s] = lead
        return jobs

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        raise NotImplementedError

    def prefetch(self, layer: int, experts: list[int], pinned: list[int] = (), read: bool = True,
                 cancel: bool = False, predicted: list[int] | None = None, gate: bool = False,
                 kind: int = 1) -> int:
        """Start reading ``experts`` of ``layer`` ahead of the step that needs them; returns how many experts'
        reads were started (0 here: nothing to read)."""
        return 0

    def look_wanted(self, kind: int, top_k: int) -> bool:
        """Whether a lookahead prediction of ``kind`` is worth making now (StreamingStore's measure; here yes)."""
        return True

    def wait(self, ticket: Ticket | None, through: int | None = None) -> None:
        pass

    def reading(self, ticket: Ticket | None) -> list[int]:
        """Real ids of the experts ``ticket`` is reading (the misses of its prepare()), in read order."""
        return []

    def ready(self, ticket: Ticket | None) -> int:
        """How many of ``reading(ticket)``'s experts (a prefix, in read order) have every read finished, without
        blocking (joining them is still ``wait``'s job)."""
        return 0

    def discard(self, ticket: Ticket | None) -> None:
        pass

    def matrix(self, layer: int, name: str) -> torch.Tensor:
        raise NotImplementedError

    def used(self, layer: int) -> None:
        """The kernels reading ``layer``'s experts were launched (GPU stores order later reads after them)."""

    def device_ready(self, layer: int) -> None:
        """Before kernels read ``layer``'s experts (GPU stores: wait for joined copies)."""

    def lead(self, layer: int, name: str) -> np.ndarray:
        raise NotImplementedError

    @property
    def bytes_read(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ResidentStore(ExpertStore):
    """Experts addressed in place in a memory map of the file; slot id = expert id."""

    def __init__(self, model: GGUFModel, layout: ExpertLayout, device: str | torch.device = "cpu",
                 pool: str = "device"):
        super().__init__(model, layout)
        self.device = torch.device(device)
        check_pool(pool)
        self.place = pool if self.device.type == "cuda" else "host"
        self._mats: dict[int, dict[str, torch.Tensor]] = {}
        for layer, mats in layout.layers.items():
            self._mats[layer] = {}
            for name, m in mats.items():
                info = model.tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
                t = model.mapped(info).view(m.n_experts, m.bytes_per_expert)
                if self.device.type == "cuda":  # every expert copied once: into GPU memory, or pinned host memory
                    if self.place == "device":
                        t = t.to(self.device)
                    else:
                        t = pinned_empty(t.numel()).copy_(t.reshape(-1)).view(t.shape)
                self._mats[layer][name] = t
        self._zeros = {layer: np.zeros(layout.n_experts(layer), dtype=np.int64) for layer in layout.layers}

    def capacity(self, layer: int) -> int:
        return self.layout.n_experts(layer)

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        if self.trace is not None:
            self.trace.append((layer, tuple(experts), tuple(pinned)))
        self.stats.hits += len(experts)
        self.layer_counts[layer][0] += len(experts)
        return list(experts), None

    def matrix(self, layer: int, name: str) -> torch.Tensor:
        return self._mats[layer][name]

    def lead(self, layer: int, name: str) -> np.ndarray:
        """Zeros [n_experts]: every expert starts its row."""
        return self._zeros[layer]


class StreamingStore(ExpertStore):
    """Per-layer slot pools filled from the file on a miss.

    n_slots: slots per MoE layer (one count, or layer -> count from a memory plan), at least ``min_slots``
    (experts used per token); clamped to each layer's experts. io_threads: reader threads.
    policy: a name in POLICIES. pin_memory: allocate pools in pinned host memory (for a CUDA device).
    direct_io: read experts with O_DIRECT (True), through the page cache (False), or O_DIRECT where the file
    system allows it (None). Where it refuses (open with O_DIRECT fails with EINVAL, e.g. tmpfs, or statx
    says the file cannot do direct IO) that file is read buffered: with ``direct_io=True`` ``note`` says so
    (one line naming the file), with None quietly (on tmpfs the file's pages are memory anyway). A read that
    the kernel refuses later (EINVAL) falls back to buffered for the rest of the run (experts/reader.py).
    align: for tests, a power of two to align direct reads to instead of the kernel's alignment when it is
    larger. Attributes: ``direct`` (some matrix is read with O_DIRECT at construction), ``align`` (bytes;
    1 when nothing is direct). Raises ConfigError for a bad n_slots, policy or align; GGUFError /
    ModelFileChanged when a file cannot be opened or is no longer the one loaded.
    """

    streaming = True

    def __init__(self, model: GGUFModel, layout: ExpertLayout, n_slots: int | dict[int, int], min_slots: int,
                 io_threads: int = 8, policy: str = "lfu", pin_memory: bool = False,
                 direct_io: bool | None = None, align: int | None = None,
                 note: Callable[[str], None] = stderr_note, device: str | torch.device = "cpu",
                 pool: str = "device", host_cache: int = 0):
        super().__init__(model, layout)
        self.device = torch.device(device)
        check_pool(pool)
        #: the pools' place: "device" (GPU memory, filled through pinned staging) or "host" (pinned host memory
        #: the GPU kernels address directly: the unified-memory mode); on a CPU device, host memory
        self.place = pool if self.device.type == "cuda" else "host"
        gpu = self.device.type == "cuda"
        pin_memory = pin_memory or gpu
        per_layer = n_slots if isinstance(n_slots, dict) else dict.fromkeys(layout.moe_layers, n_slots)
        low = min(per_layer.values())
        if low < min_slots:
            raise OptionError("{slots} " f"{low} is below the experts used per token ({min_slots}); "
                              f"a step needs at least {min_slots} slots per layer", slots=low)
        n_slots = max(per_layer.values())
        check_policy(policy)
        if align is not None and (align < 1 or align & (align - 1)):
            raise ConfigError(f"direct IO alignment must be a power of two, got {align}")
        paths = sorted({m.path for mats in layout.layers.values() for m in mats.values()})
        # the reads go through the descriptors the model opened at load: the path may be renamed or deleted
        self.reader = ExpertReader(io_threads, identity=model.identity, note=note,
                                   sources={p: model.open_path(p) for p in paths})
        direct_paths: set[str] = set()
        aligns = [1]
        try:
            for p in paths:
                a = dio_alignment(model.open_path(p)) if direct_io is not False else None
                if a is not None and self.reader.open(p, direct=True):
                    direct_paths.add(p)
                    aligns.append(a)
                else:
                    self.reader.open(p)
                    if direct_io:
                        note(f"{p}: the file system refuses O_DIRECT (--direct-io on); expert reads go through "
                             f"the page cache")
        except BaseException:
            self.reader.close()
            raise
        self.direct = bool(direct_paths)
        self._direct_paths = direct_paths
        self._probe_buf: memoryview | None = None  # probe()'s block, made at its first call
        self.align = max(aligns) if not self.direct or align is None else max(max(aligns), align)
        self.n_slots = n_slots
        self.slots: dict[int, SlotMap] = {}
        self.policies: dict[int, CachePolicy] = {}
        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        self._views: dict[int, dict[str, list[memoryview]]] = {}
        #: per layer: prefetched experts no step has used yet (in prefetch order), see prefetch()
        self._pending: dict[int, dict[int, _Prefetched]] = {}
        #: per layer: slot -> the reads still running into it of a dropped (cancelled) prefetch; busy till done
        self._draining: dict[int, dict[int, Ticket]] = {}
        #: per layer: the experts the last prefetch() of the layer predicted (for the recall statistic)
        self._predicted: dict[int, frozenset[int]] = {}
        #: the lookahead's worth (prefetch(gate=True)): per kind of prediction (0: from a layer before, 1: from the
        #: layer's input) and rank (top-k order), decayed counts of the reads started and of those a step used
        self.look_stats = np.zeros((2, LOOK_RANKS, 2))
        #: per layer: the gated reads started for its coming step, (expert, kind, rank), scored by prepare()
        self._issued: dict[int, list[tuple[int, int, int]]] = {}
        self._look_tick = [0, 0]
        #: layers whose prediction was made since their last prepare() (a skipped one then leaves it for recall)
        self._fresh: set[int] = set()
        self._expert_bytes: dict[int, int] = {}
        self._leads: dict[int, dict[str, np.ndarray]] = {}
        self._direct: dict[int, dict[str, bool]] = {}
        widest = 1
        # the device-planned step (experts/devplan.py): the tier holds every expert; the layers' pools of one matrix
        # and one stride share one tensor, with top-k scratch rows after them
        strides = {la: {name: slot_stride(m, self.align if m.path in direct_paths else 1) for name, m in mats.items()}
                   for la, mats in layout.layers.items()}
        planned = self._plannable(layout, strides, per_layer, host_cache, min_slots, gpu)
        #: planned: per layer and matrix, (its group's tensor, the layer's first row in it)
        groups: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        if planned:  # whole 64-byte lines (a multiple of the direct-IO alignment still): the scratch copies move
            # aligned 32-bit words
            strides = {la: {name: -(-st // 64) * 64 for name, st in sts.items()} for la, sts in strides.items()}
            members: dict[tuple[str, int], list[int]] = {}
            for la, sts in strides.items():
                for name, st in sts.items():
                    members.setdefault((name, st), []).append(la)
            for (name, st), layers in members.items():
                rows = 0
                first = {}
                for la in layers:
                    first[la] = rows
                    rows += min(per_layer[la], layout.n_experts(la))
                if self.place == "device":
                    t = torch.empty((rows + min_slots, st), dtype=torch.uint8, device=self.device)
                else:
                    t = _aligned_pool(rows + min_slots, st, self.align, pin_memory)
                for la in layers:
                    groups.setdefault(la, {})[name] = (t, first[la])
        _c_lib()  # the slot planner's C kernels compiled (a machine's first run) at load, not in the first step
        for layer, mats in layout.layers.items():
            n_exp = layout.n_experts(layer)
            n = min(per_layer[layer], n_exp)
            self.slots[layer] = SlotMap(n_exp, n)
            self.policies[layer] = POLICIES[policy](n_exp)
            self.pools[layer], self._views[layer], self._leads[layer], self._direct[layer] = {}, {}, {}, {}
            self._pending[layer], self._draining[layer] = {}, {}
            self._expert_bytes[layer] = sum(m.bytes_per_expert for m in mats.values())
            for name, m in mats.items():
                direct = m.path in direct_paths
                stride = strides[layer][name]
                widest = max(widest, stride)
                if planned:
                    t, row0 = groups[layer][name]
                    pool = t[row0:row0 + n]
                    self.pools[layer][name] = pool
                    self._views[layer][name] = ([] if self.place == "device" else
                                                [memoryview(pool[s].numpy()) for s in range(n)])
                elif self.place == "device":
                    self.pools[layer][name] = torch.empty((n, stride), dtype=torch.uint8, device=self.device)
                    self._views[layer][name] = []
                else:
                    pool = _aligned_pool(n, stride, self.align if direct else 1, pin_memory)
                    self.pools[layer][name] = pool
                    arr = pool.numpy()
                    self._views[layer][name] = [memoryview(arr[s]) for s in range(n)]
                self._leads[layer][name] = np.zeros(n, dtype=np.int64)
                self._direct[layer][name] = direct
        #: GPU only: per layer, the event after the last kernels that read its pool (store.used); a read into the
        #: layer's slots is ordered after it
        self._last_use: dict[int, object] = {}
        if self.place == "device":
            self._sinks = _Staging(2 * io_threads, widest, self.align, self.device)
        #: the host tier (--host-cache): None, or a second-level cache of experts in (pinned) host memory
        self.tier: HostTier | None = None
        if host_cache:
            self.tier = HostTier(self, host_cache, policy)
        #: the device-planned decode step's tables (experts/devplan.py), or None
        self.plan = None
        if planned:
            from .devplan import DevicePlan
            self.tier.fill(model)
            self.plan = DevicePlan(self, groups, min_slots)

    @staticmethod
    def _plannable(layout: ExpertLayout, strides: dict[int, dict[str, int]], per_layer: dict[int, int],
                   host_cache: int, top_k: int, gpu: bool) -> bool:
        """Whether the device-planned step applies: a GPU (or ``devplan.ON_CPU``, for tests), a host tier large
        enough for every expert of every layer, at least top-k slots per layer, MOESTREAM_DEVICE_PLAN not 0."""
        if not host_cache:  # before importing devplan, which imports Triton: a run without a host tier needs neither
            return False
        from . import devplan

        if not devplan.enabled() or not layout.moe_layers:
            return False
        if not gpu and not devplan.ON_CPU:
            return False
        if any(min(per_layer[la], layout.n_experts(la)) < top_k for la in layout.layers):
            return False
        # HostTier's rows per layer: host_cache // (one slot of every layer); every expert needs n_experts rows
        per_slot = sum(-(-st // 64) * 64 for sts in strides.values() for st in sts.values())
        return host_cache // max(per_slot, 1) >= max(layout.n_experts(la) for la in layout.layers)

    @staticmethod
    def read_mode(layout: ExpertLayout, direct_io: bool | None) -> tuple[bool, int]:
        """(direct, align) that a store made with ``direct_io`` will use, from the file system alone (no store
        needed: what a memory plan prices pools with): direct is False where ``direct_io`` is False or no
        expert file allows O_DIRECT; align is the largest ``reader.dio_alignment`` of the files that do (1 when
        not direct). GGUFError naming a file that cannot be opened."""
        if direct_io is False:
            return False, 1
        paths = sorted({m.path for mats in layout.layers.values() for m in mats.values()})
        aligns = [a for a in (dio_alignment(p) for p in paths) if a is not None]
        return (True, max(aligns)) if aligns else (False, 1)

    def probe(self) -> int:
        """Read one block (the direct-IO alignment, at least 4 KiB) at a random aligned offset of each expert file,
        through the descriptors the expert reads use: with O_DIRECT where they use it, so that the device answers
        rather than the page cache. For a health check: raises ExpertReadError (an OS error such as EIO, a short
        read) or ModelFileChanged as an expert read would; returns the bytes read."""
        block = max(self.align, 4096)
        if self._probe_buf is None:
            self._probe_buf = memoryview(_aligned_pool(1, block, block, False)[0].numpy())
        done = 0
        for path in sorted({m.path for mats in self.layout.layers.values() for m in mats.values()}):
            size = self.model.identity[path][2]
            offset = random.randrange(max(size // block, 1)) * block
            done += self.reader.read_now(ReadJob(path, offset, self._probe_buf, 0, min(block, size - offset),
                                                 path in self._direct_paths))
        return done

    @staticmethod
    def slot_bytes(layout: ExpertLayout, layer: int, direct: bool = False, align: int = 1) -> int:
        """Bytes of one slot of ``layer``, all its expert matrices, padding included (what a memory plan prices):
        what a StreamingStore allocates per slot when its reads are ``direct`` with alignment ``align`` (bytes, a
        power of two: ``read_mode``), or buffered (``direct`` False: ``layout.bytes_per_expert(layer)``). A
        direct pool also over-allocates at most ``align`` bytes per matrix to start aligned."""
        return sum(slot_stride(m, align if direct else 1) for m in layout[layer].values())

    @staticmethod
    def pool_bytes_of(layout: ExpertLayout, n_slots: int | dict[int, int], direct: bool = False,
                      align: int = 1) -> int:
        """Bytes of the pools of ``n_slots`` slots per MoE layer (one count or layer -> count; ``slot_bytes`` x
        slots; buffered with one count: equal to ``layout.pool_bytes(n_slots)``)."""
        per = n_slots if isinstance(n_slots, dict) else dict.fromkeys(layout.layers, n_slots)
        return sum(StreamingStore.slot_bytes(layout, layer, direct, align) * min(per[layer], layout.n_experts(layer))
                   for layer in layout.layers)

    def slots_per_layer(self) -> dict[int, int]:
        """layer -> slots of its pool."""
        return {layer: m.n_slots for layer, m in self.slots.items()}

    @property
    def pool_bytes(self) -> int:
        return sum(p.numel() for mats in self.pools.values() for p in mats.values())

    def capacity(self, layer: int) -> int:
        return self.slots[layer].n_slots

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        """Assign slots to ``experts`` (distinct real ids) and start reading the misses. ``pinned``: experts
        whose slots are still in use (the tile being computed while this one loads); never evicted.

        A prefetched expert (see :meth:`prefetch`) is present: it keeps its slot and counts as a hit. If its reads
        are still in flight they join the returned ticket, ahead of the misses' reads, so that ``reading`` /
        ``ready`` / ``wait`` treat it as an expert being read (``wait`` raises its read error). A slot whose
        prefetch read is in flight is reused for a miss only when no other slot is left, and only after that read
        has settled (that wait counts as stall). A prefetched expert that this call does not ask for and whose
        reads are partly still queued (not started) has those cancelled and is dropped, so that the step's own
        reads do not wait behind a wrong guess's in the reader's queue (in a tiled prefill, an expert a later
        tile needs is then read again by that tile)."""
        if self.trace is not None:
            self.trace.append((layer, tuple(experts), tuple(pinned)))
        if self.plan is not None:  # the device-planned step's promotions done; its table rebuilt before the next
            self.plan.flush()
            self.plan.dirty = True
        self._settle(layer)
        slots, pending = self.slots[layer], self._pending[layer]
        if pending:
            self._cancel_unneeded(layer, set(experts))
        pred = self._predicted.get(layer)
        self._fresh.discard(layer)
        if pred is not None:
            self.stats.predictable += len(experts)
            self.stats.predicted += sum(e in pred for e in experts)
        issued = self._issued.pop(layer, None)
        if issued:  # the gated lookahead's reads for this step: used or not
            self._score(issued, set(experts))
        before = slots.expert_of.copy() if pending else None  # who held the slots the plan may reuse
        plan = self.policies[layer].plan(slots, experts, pinned, busy=self._busy(layer))
        self.stats.misses += len(plan.loads)
        self.stats.hits += len(experts) - len(plan.loads)
        counts = self.layer_counts[layer]
        counts[0] += len(experts) - len(plan.loads)
        counts[1] += len(plan.loads)
        per_expert = self._expert_bytes[layer]
        self.stats.miss_bytes += per_expert * len(plan.loads)
        mats = self.layout[layer]
        joining: list[tuple[int, int]] = []  # prefetched experts of this step whose reads are in flight
        futures: list = []
        for e, s in zip(experts, plan.slot_ids, strict=True):
            rec = pending.pop(e, None) if pending else None
            if rec is None:
                continue
            self.stats.prefetch_used += 1
            self.stats.miss_bytes += per_expert
            if rec.settled:
                self.stats.miss_bytes_ready += per_expert
            else:
                self.stats.miss_bytes_ready += sum(m.bytes_per_expert for f, m in
                                                   zip(rec.ticket.futures, mats.values(), strict=True) if f.done())
                joining.append((e, s))
                futures += rec.ticket.futures
                for f in rec.ticket.futures:  # a speculative read now needed: no longer behind the demand reads
                    if not f.done() and hasattr(f, "promote"):
                        f.promote()
        if before is not None:
            for _, s in plan.loads:  # a prefetched expert evicted before any use
                rec = pending.pop(int(before[s]), None)
                if rec is not None:
                    self.stats.prefetch_wasted += 1
                    self._join_quietly(rec.ticket)  # its read must not land in the slot after the new expert's
        draining = self._draining[layer]
        if draining:
            for _, s in plan.loads:  # a slot still receiving a cancelled prefetch's running read
                if s in draining:
                    self._join_quietly(draining.pop(s))
        if not plan.loads and not joining:
            return plan.slot_ids, None
        jobs = self._jobs(layer, plan.loads, pinned)
        if jobs:
            self._before_reads(layer)
        ticket = self.reader.submit(jobs, group=len(mats))
        if joining:  # the first future is a prefetch's first, which carries its submit time
            ticket = Ticket(futures + ticket.futures)
        ticket.loads = (layer, joining + plan.loads)  # type: ignore[attr-defined]
        ticket.n_mats = len(mats)  # type: ignore[attr-defined]  # jobs per expert, consecutive
        return plan.slot_ids, ticket

    def look_worth(self, kind: int, rank: int) -> bool:
        """Whether a read of the ``rank``-th expert (top-k order) of a ``kind`` prediction pays (prefetch's
        ``gate``): while fewer than LOOK_WARM such reads are counted, yes; then when at least
        look_min_precision() of them were used by the step they were read for (decayed counts: the pool's contents
        change what a guess is worth)."""
        if rank >= LOOK_RANKS:
            return True
        n, used = self.look_stats[kind, rank]
        return n < LOOK_WARM or used >= look_min_precision() * n

    def look_wanted(self, kind: int, top_k: int, layer: int | None = None) -> bool:
        """Whether a ``kind`` prediction (for ``layer``'s coming step) is worth making now: while the kind's reads
        are counted fewer than LOOK_WARM times per rank in all, or some rank of it has proved to pay (counted at
        least LOOK_WARM times, at least look_min_precision() of them used), else every LOOK_EXPLORE-th call (its
        reads then all started, to go on measuring; see prefetch's ``gate``). When not, an older prediction of the
        layer (one made before its last prepare()) is dropped, so that the recall statistic counts only the steps
        that were predicted."""
        r = min(top_k, LOOK_RANKS)
        n, used = self.look_stats[kind, :r, 0], self.look_stats[kind, :r, 1]
        if n.sum() < LOOK_WARM * r or ((n >= LOOK_WARM) & (used >= look_min_precision() * n)).any():
            return True
        self._look_tick[kind] += 1
        if self._look_tick[kind] % LOOK_EXPLORE == 0:
            return True
        if layer is not None and layer not in self._fresh:
            self._predicted.pop(layer, None)
        return False

    def _score(self, issued: list[tuple[int, int, int]], used: set[int]) -> None:
        st = self.look_stats
        for e, kind, r in issued:
            if r < LOOK_RANKS:
                st[kind, r] *= LOOK_DECAY
                st[kind, r, 0] += 1
                st[kind, r, 1] += e in used

    def prefetch(self, layer: int, experts: list[int], pinned: list[int] = (), read: bool = True,
                 cancel: bool = False, predicted: list[int] | None = None, gate: bool = False,
                 kind: int = 1) -> int:
        """Router lookahead: start reading ``experts`` (distinct real ids predicted for ``layer``'s coming step,
        most likely first) into free or evictable slots, so that the step's prepare() finds them present.

        Predicted experts already in a slot stay (this prefetch never evicts them); each other one takes a victim
        in the policy's eviction order, without counting a use, never the slot of an expert in ``experts`` or
        ``pinned`` and never a slot whose prefetch read is still in flight; when fewer slots are evictable, only
        the first experts are read. The slot is marked as holding the expert at once, its reads pending;
        prepare() joins them, and cancels the queued reads of those it does not ask for (see there). ``read`` false
        only records the prediction. ``cancel``: this prediction replaces an earlier one of the coming step (a
        later, better guess): the earlier guesses it drops whose reads are partly still queued are cancelled and
        leave the pool first (as prepare() does), so their reads do not hold this one's back. ``predicted``: the
        whole prediction when ``experts`` is the part of it worth reading (the recall statistic's; its experts in a
        slot are not evicted by this prefetch either); None: ``experts``. ``gate``: ``experts`` is one prediction
        of one token's experts in top-k order, of ``kind`` (0: made from a layer before ``layer``, 1: from its
        input); only the ranks whose reads pay (:meth:`look_worth`, or all while :meth:`look_wanted` explores) are
        read, and the next prepare() of the layer counts which of them it used.

        The prediction is what the ``recall`` statistic compares the following prepare() calls of the layer with,
        until the next prefetch() of the layer. Not to be called while a ticket of ``layer`` is not yet joined
        (models call it for a layer before that layer's MoE step, never during it).

        Errors: a prefetch read that fails before a step asks for its expert is never raised: its slot is emptied
        as soon as the failure is seen (by the next prefetch() or prepare() of the layer), it counts as failed and
        wasted, and a step that needs the expert reads it again like any miss (that read's error, if any, is
        raised by ``wait``). A failed read of an expert that a step asked for while the read was in flight is
        raised by that step's ``wait``, like any read error. Returns the number of experts whose reads started.
        """
        self._predicted[layer] = frozenset(experts if predicted is None else predicted)
        self._fresh.add(layer)
        if predicted is not None:
            pinned = [*pinned, *predicted]
        if not read:
            return 0
        self._settle(layer)
        slots, pending = self.slots[layer], self._pending[layer]
        if cancel and pending:
            self._cancel_unneeded(layer, set(experts if predicted is None else predicted))
        want = [e for e in experts if slots.slot_of[e] < 0]
        if gate:
            ranked = experts if predicted is None else predicted
            rank = {e: r for r, e in enumerate(ranked)}
            if any(self.look_worth(kind, r) for r in range(min(len(ranked), LOOK_RANKS))):
                want = [e for e in want if self.look_worth(kind, rank[e])]
        if not want:
            return 0
        victims = self.policies[layer].victims(slots, len(want), [*experts, *pinned], self._busy(layer))
        if victims:
            self._before_reads(layer)
        for e, s in zip(want, victims, strict=False):  # fewer victims than wanted: the first ones only
            old = slots.put(e, s)
            if old >= 0 and pending.pop(old, None) is not None:  # settled (victims are never busy): nothing in flight
                self.stats.prefetch_wasted += 1
            jobs = self._jobs(layer, [(e, s)])
            pending[e] = _Prefetched(s, self.reader.submit(jobs, low=True))  # behind every demand read
        n = min(len(want), len(victims))
        self.stats.prefetch_issued += n
        if gate and n:
            self._issued.setdefault(layer, []).extend((e, kind, rank[e]) for e in want[:n])
        return n

    def _cancel_unneeded(self, layer: int, needed: set[int]) -> None:
        """Cancel the queued reads of ``layer``'s prefetched experts not in ``needed`` whose reads are in flight.
        An expert with a cancelled read leaves the pool at once; its slot stays busy (``_draining``) until the
        reads of it that had started finish."""
        pending = self._pending[layer]
        for e, rec in list(pending.items()):
            if e in needed or rec.settled:
                continue
            if sum(f.cancel() for f in rec.ticket.futures):  # cancel() is False for a running or finished read
                del pending[e]
                self._empty(layer, e, rec.slot)
                self.stats.prefetch_cancelled += 1
                self.stats.prefetch_wasted += 1
                ran = [f for f in rec.ticket.futures if not f.cancelled()]
                if ran:
                    rest = Ticket(ran)
                    ran[0].t0 = getattr(ran[0], "t0", None) or rec.ticket.futures[0].t0  # type: ignore[attr-defined]
                    self._draining[layer][rec.slot] = rest

    def _busy(self, layer: int) -> np.ndarray | None:
        """bool [n_slots]: the slots of ``layer`` that prefetch reads are still writing (None: none)."""
        busy_slots = [r.slot for r in self._pending[layer].values() if not r.settled] + list(self._draining[layer])
        if not busy_slots:
            return None
        busy = np.zeros(self.slots[layer].n_slots, dtype=bool)
        busy[busy_slots] = True
        return busy

    def _settle(self, layer: int) -> None:
        """Join the prefetch reads of ``layer`` that have all finished (never blocks): their bytes are counted;
        one that failed empties its slot (failed and wasted). An error other than ExpertReadError (a bug, not an
        IO error) is raised after its slot is emptied."""
        draining = self._draining[layer]
        for slot, ticket in list(draining.items()):
            if all(f.done() for f in ticket.futures):
                del draining[slot]
                self._join_quietly(ticket)  # finished: does not block
        pending = self._pending[layer]
        for e, rec in list(pending.items()):
            if rec.settled or not all(f.done() for f in rec.ticket.futures):
                continue
            try:
                self.reader.wait(rec.ticket)
            except BaseException as err:
                del pending[e]
                self._empty(layer, e, rec.slot)
                self.stats.prefetch_failed += 1
                self.stats.prefetch_wasted += 1
                if not isinstance(err, ExpertReadError):
                    raise

    def _empty(self, layer: int, expert: int, slot: int) -> None:
        slots = self.slots[layer]
        slots.slot_of[expert] = -1
        slots.expert_of[slot] = -1

    def _join_quietly(self, ticket: Ticket) -> None:
        """Let the reads of a prefetch whose expert left the pool settle (before its slot is reused): their bytes
        are counted; a read error is dropped, counted as failed (the expert is not in the pool any more). The
        time spent blocked counts as stall."""
        if ticket.joined == len(ticket.futures):
            return
        t0 = time.perf_counter()
        try:
            self.reader.wait(ticket)
        except ExpertReadError:
            self.stats.prefetch_failed += 1
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0

    def reading(self, ticket: Ticket | None) -> list[int]:
        return [] if ticket is None else [e for e, _ in ticket.loads[1]]  # type: ignore[attr-defined]

    def ready(self, ticket: Ticket | None) -> int:
        if ticket is None:
            return 0
        per = ticket.n_mats  # type: ignore[attr-defined]
        n = 0
        for f in ticket.futures:
            if not f.done():
                break
            n += 1
        return n // per

    def wait(self, ticket: Ticket | None, through: int | None = None) -> None:
        """Join the reads of one prepare(): all of them, or (``through`` = a real expert id from
        ``reading(ticket)``) those of the experts up to and including that one, in read order. On a read error
        every read of the ticket settles and its slots are emptied before the error is raised."""
        if ticket is None:
            return
        upto = None
        if through is not None:
            upto = (self.reading(ticket).index(through) + 1) * ticket.n_mats  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        try:
            self.reader.wait(ticket, upto)
        except BaseException:
            self._forget(ticket)
            raise
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0

    def discard(self, ticket: Ticket | None) -> None:
        """Abandon a prepared tile (an error came first): let its reads settle, then empty its slots, so no
        later step uses a slot whose read was never joined."""
        if ticket is None:
            return
        try:
            self.reader.wait(ticket)
        except BaseException:  # noqa: BLE001 - the error that made us discard is the one to report
            pass
        self._forget(ticket)

    def _forget(self, ticket: Ticket) -> None:
        layer, loads = ticket.loads  # type: ignore[attr-defined]
        slots = self.slots[layer]
        for e, s in loads:
            slots.slot_of[e] = -1
            slots.expert_of[s] = -1

    def matrix(self, layer: int, name: str) -> torch.Tensor:
        """The pool: uint8 [n_slots, stride]; stride is a multiple of ``align`` and the pool starts aligned (host
        pools; a GPU pool holds the same bytes at the same places)."""
        return self.pools[layer][name]

    # --- GPU ordering -------------------------------------------------------------------------
    def used(self, layer: int) -> None:
        """The kernels that read ``layer``'s pool were launched (on the current CUDA stream): reads into its slots
        from now on are ordered after them (no-op on a CPU device, where compute is synchronous)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._last_use[layer] = ev

    def device_ready(self, layer: int) -> None:
        """Before kernels read ``layer``'s pool: the current CUDA stream waits (on the GPU, not the host) for the
        copies from staging into the layer's slots whose reads were joined (``wait``) so far. No-op for pools
        the reads land in directly (host memory)."""
        if self.place == "device":
            self._sinks.join(layer)

    def _before_reads(self, layer: int) -> None:
        """Order the reads about to start into ``layer``'s slots after the kernels that last read them: GPU pools
        through the copy stream (it waits for that event), host pools the GPU addresses by waiting on the host
        (the IO threads write the slots themselves)."""
        ev = self._last_use.pop(layer, None)
        if ev is None:
            return
        if self.place == "device":
            self._sinks.stream.wait_event(ev)
        else:
            ev.synchronize()

    def lead(self, layer: int, name: str) -> np.ndarray:
        """int64 [n_slots] (read-only: the store's own array): byte offset of the expert's first byte in each
        slot; 0 for buffered reads, the expert's file offset modulo ``align`` for direct ones."""
        return self._leads[layer][name]

    @property
    def direct_io(self) -> bool:
        """Some matrix is still read with O_DIRECT (False after every direct file fell back to buffered)."""
        return bool(self._direct_paths - self.reader.direct_refused)

    @property
    def bytes_read(self) -> int:
        """Bytes of the joined reads (finished prefetch reads are joined first, without blocking)."""
        for layer in self._pending:
            self._settle(layer)
        return self.reader.bytes_read

    def close(self) -> None:
        if self.plan is not None:
            self.plan.close()
        self.reader.close()
        if self.place == "device":
            self._sinks.stream.synchronize()




class HostTier:
    """``--host-cache SIZE``: a second-level expert cache in host memory (pinned when a GPU computes) between the
    slot pools and the disk. Per MoE layer, the same number of rows per layer (as many as ``size`` bytes hold,
    at most every expert), each row the layout of one pool slot (the same stride and lead), and the same policy
    code as the pools (experts/policy.py) deciding which expert a row holds.

    A miss of the pools that the tier holds is copied from its row (host to device on the copy stream: PCIe speed,
    no disk read); one it does not hold is read from the disk into a row the policy frees (the row is the staging
    buffer) and copied from there, so the next miss of it is served from memory. Rows of the experts of the
    current and the previous tile are never taken (they may still be read into, or copied out of). ConfigError
    when ``size`` holds fewer rows per layer than twice the pools' slots (a tier smaller than that would evict
    what the pools are still loading).

    Counters: ``hits`` (pool misses served from the tier), ``misses`` (read from the disk), ``bytes_copied``;
    ``fill_bytes`` / ``fill_seconds`` of :meth:`fill`.
    """

    def __init__(self, store: StreamingStore, size: int, policy: str):
        layout = store.layout
        per_slot = {la: sum(p.shape[1] for p in store.pools[la].values()) for la in store.pools}
        rows = size // max(sum(per_slot.values()), 1)
        self.rows = {la: min(rows, layout.n_experts(la)) for la in store.pools}
        need = {la: min(2 * store.slots[la].n_slots, layout.n_experts(la)) for la in store.pools}
        short = [la for la in store.pools if self.rows[la] < need[la]]
        if short:
            want = sum(per_slot[la] * need[la] for la in store.pools)
            raise OptionError("{host_cache} " f"{size / 2**30:.2f} GiB holds {rows} experts per layer, fewer than "
                              f"twice the {store.slots[short[0]].n_slots} slots of the pools: give at least "
                              f"{-(-want // 2**20)}MiB, or leave " "{host_cache} out", host_cache=size)
        gpu = store.device.type == "cuda"
        self.gpu = gpu
        self.slots: dict[int, SlotMap] = {}
        self.policies: dict[int, CachePolicy] = {}
        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        self.views: dict[int, dict[str, list[memoryview]]] = {}
        self.events: dict[int, dict] = {}
        for la, mats in store.pools.items():
            n = self.rows[la]
            self.slots[la] = SlotMap(layout.n_experts(la), n)
            self.policies[la] = POLICIES[policy](layout.n_experts(la))
            self.pools[la] = {name: _aligned_pool(n, p.shape[1], max(store.align, 64), gpu) for name, p in mats.items()}
            self.views[la] = {name: [memoryview(t[i].numpy()) for i in range(n)] for name, t in self.pools[la].items()}
            self.events[la] = {}  # (row, matrix name) -> the event after the last copy out of it
        self.nbytes = sum(t.numel() for mats in self.pools.values() for t in mats.values())
        self.hits = self.misses = self.bytes_copied = 0
        #: the device-planned step's fill at load (:meth:`fill`): bytes read into the rows, seconds
        self.fill_bytes, self.fill_seconds = 0, 0.0
        self._store = store
        #: per layer and matrix: int64 [n_experts], the lead of each expert in a row (and a slot): its file offset
        #: modulo the alignment for direct reads, else 0
        self.leads: dict[int, dict[str, np.ndarray]] = {}
        for la, mats in layout.layers.items():
            self.leads[la] = {}
            for name, m in mats.items():
                offs = m.offset + np.arange(m.n_experts, dtype=np.int64) * m.bytes_per_expert
                self.leads[la][name] = offs % store.align if store._direct[la][name] else np.zeros_like(offs)

    def fill(self, model: GGUFModel) -> None:
        """Read every expert into the tier, row = real expert id (the tier must hold every expert): the
        device-planned step's source (experts/devplan.py). One pread per expert and matrix straight into its row:
        through the file's memory map, the mapped pages counted in the process's resident set beside the tier (a
        newcomer's 10.9 GiB tier peaked at 23 GiB of RSS on the H100 machine, 2026-12-05)."""
        store = self._store
        t0 = time.perf_counter()
        for la, mats in store.layout.layers.items():
            sm = self.slots[la]
            if sm.n_slots < sm.n_experts:
                raise ValueError(f"layer {la}: the tier holds {sm.n_slots} of {sm.n_experts} experts")
            for name, m in mats.items():
                info = model.tensors[f"blk.{la}.ffn_{name}_exps.weight"]
                dst = self.pools[la][name].numpy()
                lead = self.leads[la][name]
                for e in range(m.n_experts):
                    a = int(lead[e])
                    model.read_into(info, e * m.bytes_per_expert, memoryview(dst[e, a:a + m.bytes_per_expert]))
                self.fill_bytes += m.n_experts * m.bytes_per_expert
            sm.slot_of[:] = np.arange(sm.n_experts)
            sm.expert_of[:] = np.arange(sm.n_experts)
        self.fill_seconds = time.perf_counter() - t0

    def plan(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[dict[int, int], set[int]]:
        """Rows for ``experts`` (misses of the pools, distinct real ids): (expert -> row, the experts the tier
        already holds). The others' rows are taken from the policy's victims (never a row of ``pinned``)."""
        sm = self.slots[layer]
        held = {e for e in experts if sm.slot_of[e] >= 0}
        plan = self.policies[layer].plan(sm, experts, pinned=[e for e in pinned if sm.slot_of[e] >= 0])
        self.hits += len(held)
        self.misses += len(experts) - len(held)
        return dict(zip(experts, plan.slot_ids, strict=True)), held

    def forget(self, layer: int, row: int) -> None:
        """Row ``row``'s read failed: it holds no expert."""
        sm = self.slots[layer]
        e = int(sm.expert_of[row])
        if e >= 0:
            sm.slot_of[e] = -1
        sm.expert_of[row] = -1


class TierSink:
    """The destination of one read or copy through the host tier (``ReadJob.sink``): row ``row`` of ``layer``'s
    tier (``src``, a view of it) is the staging buffer; ``commit`` copies it into the pool slot ``dest`` (on the
    copy stream of ``staging`` for a GPU pool; a plain copy for a host pool)."""

    def __init__(self, tier: HostTier, layer: int, row: tuple[int, str], view: memoryview, src: torch.Tensor,
                 dest: torch.Tensor, staging: _Staging | None):
        self.tier, self.layer, self.row, self.view = tier, layer, row, view
        self.src, self.dest, self.staging = src, dest, staging

    def acquire(self, size: int) -> memoryview:
        ev = self.tier.events[self.layer].get(self.row)
        if ev is not None:  # a copy out of this row still running: it must finish before the row is overwritten
            ev.synchronize()
        return self.view

    def commit(self, buf: memoryview, n: int) -> None:
        n = min(n, self.dest.shape[0])
        self.tier.bytes_copied += n
        if self.staging is None:
            self.dest[:n].copy_(self.src[:n])
            return
        with torch.cuda.stream(self.staging.stream):
            self.dest[:n].copy_(self.src[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.staging.stream)
        self.tier.events[self.layer][self.row] = ev
        with self.staging.lock:
            self.staging.copied.setdefault(self.layer, []).append(ev)

    def release(self, buf: memoryview) -> None:
        self.tier.forget(self.layer, self.row[0])



class _Staging:
    """Pinned host staging for reads into GPU slots: ``n`` buffers of ``size`` bytes (``align``-aligned, for
    O_DIRECT), one copy stream, and per layer the events of the copies not yet joined by compute.

    A reader thread takes a free buffer (``acquire``: first waiting for the copy out of it to finish), reads into
    it and ``commit``s: the copy to the slot is queued on the copy stream, an event recorded after it, and the
    buffer goes back to the free list with that event. With ``n`` at least the reader threads no thread ever
    waits for another's buffer. The pinned memory is ``n * size`` bytes, not a copy of the pools.
    """

    def __init__(self, n: int, size: int, align: int, device: torch.device):
        import queue
        import threading

        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.bufs = _aligned_pool(n, size, max(align, 64), True)
        self.views = [memoryview(self.bufs[i].numpy()) for i in range(n)]
        self.events: list = [None] * n
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            self.free.put(i)
        self.lock = threading.Lock()
        self.copied: dict[int, list] = {}

    def acquire(self) -> int:
        i = self.free.get()
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        return i

    def commit(self, i: int, layer: int, dest: torch.Tensor, n: int) -> None:
        n = min(n, dest.shape[0])
        with torch.cuda.stream(self.stream):
            dest[:n].copy_(self.bufs[i, :n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[i] = ev
        with self.lock:
            self.copied.setdefault(layer, []).append(ev)
        self.free.put(i)

    def release(self, i: int) -> None:
        self.free.put(i)

    def join(self, layer: int) -> None:
        with self.lock:
            evs = self.copied.pop(layer, ())
        stream = torch.cuda.current_stream(self.device)
        for ev in evs:
            stream.wait_event(ev)


class DeviceSink:
    """The destination of one staged read (``ReadJob.sink``): a slot row range in GPU memory, via ``staging``."""

    def __init__(self, staging: _Staging, layer: int, dest: torch.Tensor):
        self.staging, self.layer, self.dest = staging, layer, dest
        self._buf = -1

    def acquire(self, size: int) -> memoryview:
        self._buf = self.staging.acquire()
        return self.staging.views[self._buf]

    def commit(self, buf: memoryview, n: int) -> None:
        self.staging.commit(self._buf, self.layer, self.dest, n)

    def release(self, buf: memoryview) -> None:
        self.staging.release(self._buf)


def slot_stride(m: ExpertMatrix, align: int) -> int:
    """Bytes of one slot of matrix ``m`` for reads aligned to ``align`` (1: buffered, the expert's own
    bytes): the widest aligned range that covers one of its experts, rounded up to ``align``."""
    if align <= 1:
        return m.bytes_per_expert
    # expert e starts at (offset + e * bytes) mod align into its aligned range; the pattern repeats with a
    # period of align / gcd(bytes, align) experts
    period = min(m.n_experts, align // np.gcd(m.bytes_per_expert, align))
    leads = (m.offset + np.arange(period, dtype=np.int64) * m.bytes_per_expert) % align
    return int(-(-(int(leads.max()) + m.bytes_per_expert) // align) * align)


def _aligned_pool(n: int, stride: int, align: int, pin_memory: bool) -> torch.Tensor:
    """uint8 [n, stride] whose first byte is ``align``-aligned (torch.empty is not page-aligned: over-allocate
    by ``align`` bytes and view the aligned part); page-locked (:func:`pinned_empty`) when ``pin_memory``."""
    if pin_memory:
        raw = pinned_empty(n * stride + (align if align > 4096 else 0))  # mmap'd: page-aligned already
    elif n * stride >= HUGE_PAGE and os.environ.get("MOESTREAM_POOL_HUGEPAGE", "1") != "0":
        raw = huge_empty(n * stride)  # 2 MiB-aligned
    elif align <= 1:
        return torch.empty((n, stride), dtype=torch.uint8)
    else:
        raw = torch.empty(n * stride + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % max(align, 1)
    return raw[skip:skip + n * stride].view(n, stride)


#: Bytes of a transparent huge page on x86-64 and most arm64 kernels (4 KiB base pages)
HUGE_PAGE = 2 * 2**20


def huge_empty(nbytes: int, populate: bool = True) -> torch.Tensor:
    """uint8 [nbytes] of private anonymous memory starting on a :data:`HUGE_PAGE` boundary, advised
    ``MADV_HUGEPAGE`` and, with ``populate``, faulted in now (``MADV_POPULATE_WRITE``, Linux 5.14+, on a few threads).

    A slot pool is otherwise touched slot by slot as misses fill it, and each first touch is a page fault that
    zeroes the page inside a decode step (on the 32-layer bench file under a 6 GiB cap at 2 threads: 121k minor
    faults in the first decode step after a 64-token prefill, ~2.7k per step after 16). Populating moves that cost to
    the start: on this project's 2-core VM 1.0-1.4 s per GiB of memory the host had taken back, about 0.1 s per GiB
    of memory in use shortly before (docs/memory.md). Huge pages (where the kernel's
    transparent huge pages are ``always`` or ``madvise``, ``/sys/kernel/mm/transparent_hugepage``) make it one
    fault per 2 MiB and let the expert matmuls walk one TLB entry per 2 MiB of a slot. Where the kernel refuses
    either advice the memory is the same 4 KiB pages torch.empty gives, faulted in on first use. The mapping lives
    as long as the tensor. Pools under :data:`POPULATE_MIN` are not populated; ``MOESTREAM_POOL_POPULATE=0``: none
    is (A/B)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, dtype=np.uint8)
    skip = -arr.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_HUGEPAGE, skip, nbytes - nbytes % HUGE_PAGE)
    if populate and nbytes >= POPULATE_MIN and os.environ.get("MOESTREAM_POOL_POPULATE", "1") != "0":
        _populate(arr.ctypes.data + skip, nbytes)
    return torch.from_numpy(arr)[skip:skip + nbytes]


#: Pools smaller than this are left to fault in on first use (a few misses fill them; the test models' pools)
POPULATE_MIN = 8 * 2**20
#: madvise's MADV_POPULATE_WRITE (linux/mman.h, Linux 5.14): fault the range in, writable, as a write would
_MADV_POPULATE_WRITE = 23
_LIBC: Any = None


def _populate(addr: int, nbytes: int) -> None:
    """Fault ``nbytes`` at ``addr`` (a page-aligned private anonymous range) in with MADV_POPULATE_WRITE, in up to 8
    slices on as many threads (the calls run outside the interpreter lock: ctypes). Nothing where the kernel or
    platform has no such advice (the pages fault in on first use instead)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return
    n = max(1, min(8, os.cpu_count() or 1, nbytes // HUGE_PAGE))
    step = -(-nbytes // n // HUGE_PAGE) * HUGE_PAGE
    spans = [(addr + i * step, min(step, nbytes - i * step)) for i in range(n) if i * step < nbytes]
    if len(spans) == 1:
        _LIBC.madvise(spans[0][0], spans[0][1], _MADV_POPULATE_WRITE)
        return
    import threading
    ts = [threading.Thread(target=_LIBC.madvise, args=(a, k, _MADV_POPULATE_WRITE), daemon=True) for a, k in spans]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


#: cudaHostRegisterPortable | cudaHostRegisterMapped (CUDA runtime API, cuda_runtime_api.h): pinned for every
#: context, and mapped into the device's address space (with unified addressing the GPU reads it at the same
#: address, as experts/devplan.py's ``mapped`` does)
_HOST_REGISTER_FLAGS = 3


def pinned_empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of page-locked host memory that costs ``nbytes`` rounded up to whole pages.

    torch's ``pin_memory`` allocator (CachingHostAllocator) rounds every block up to the next power of two, so a
    pool of 160 MiB costs 256 MiB of locked memory that the memory plan does not know of (issue 24.6: ``--pool
    host`` under a cgroup went 2 GiB past ``--mem``). Here: an anonymous mmap of exactly ``nbytes``, registered
    with ``cudaHostRegister`` (flags :data:`_HOST_REGISTER_FLAGS`) and unregistered when the last tensor over it is
    freed (a finalizer on the numpy array the tensor holds; it runs before the mapping goes). Falls back to
    torch's allocator when the registration fails. ``MOESTREAM_PIN=torch`` selects torch's allocator (A/B)."""
    if os.environ.get("MOESTREAM_PIN", "register") == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mm = mmap.mmap(-1, max(nbytes, 1))
    arr = np.frombuffer(mm, dtype=np.uint8)
    cudart = torch.cuda.cudart()
    ptr = arr.ctypes.data
    err = int(cudart.cudaHostRegister(ptr, arr.nbytes, _HOST_REGISTER_FLAGS))
    _pin_trace("register", ptr, arr.nbytes, err)
    if err != 0:
        _clear_cuda_error()
        del arr
        mm.close()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(arr, _unregister, cudart, ptr, arr.nbytes)
    return torch.from_numpy(arr)[:nbytes]


def _unregister(cudart: Any, ptr: int, nbytes: int) -> None:
    """The finalizer of :func:`pinned_empty`'s memory: ``cudaHostUnregister``, its error (if any) cleared."""
    err = int(cudart.cudaHostUnregister(ptr))
    _pin_trace("unregister", ptr, nbytes, err)
    if err != 0:
        _clear_cuda_error()


def _pin_trace(what: str, ptr: int, nbytes: int, err: int) -> None:
    """With ``MOESTREAM_PIN_TRACE=1``: one stderr line per registration and unregistration (diagnostics)."""
    if os.environ.get("MOESTREAM_PIN_TRACE") == "1":
        print(f"moestream: pin {what} 0x{ptr:x} {nbytes} bytes -> cuda error {err}", file=sys.stderr, flush=True)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error on this thread (``cudaGetLastError``). A failed cudaHostRegister or
    cudaHostUnregister leaves it set, and torch checks it after its next kernel launch, which then raises an
    error that has nothing to do with that kernel (seen on the H200: cudaErrorHostMemoryAlreadyRegistered from a
    ``zero_``). The runtime library is the one torch loaded (found in /proc/self/maps); nothing where none is."""
    global _CUDART_LIB
    if _CUDART_LIB is None:
        path = ""
        with contextlib.suppress(OSError), open("/proc/self/maps") as f:
            path = next((ln.split()[-1] for ln in f if "libcudart.so" in ln), "")
        try:
            _CUDART_LIB = ctypes.CDLL(path) if path else False
        except OSError:
            _CUDART_LIB = False
    if _CUDART_LIB:
        _CUDART_LIB.cudaGetLastError()


_CUDART_LIB: Any = None
