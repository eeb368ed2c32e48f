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

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from ..gguf import GGUFModel
from .layout import ExpertLayout, ExpertMatrix
from .policy import POLICIES, CachePolicy, SlotMap
from .reader import ExpertReader, ReadJob, Ticket, dio_alignment, stderr_note


@dataclass
class StoreStats:
    """Counts over all MoE layers: hits/misses count (token-step, expert) uses of distinct experts."""

    hits: int = 0
    misses: int = 0
    #: Seconds the compute thread spent blocked in ``wait`` for reads (what the overlap hides).
    stall_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0


class ExpertStore:
    """Interface. ``capacity(layer)``: experts that fit at once. ``prepare(layer, experts, pinned)`` -> (slot
    ids, ticket), never evicting ``pinned``; ``wait(ticket)``; ``discard(ticket)`` (a prepared tile that will
    not be computed); ``matrix(layer, name)`` -> uint8 tensor [capacity, stride] (stride >= bytes_per_expert);
    ``lead(layer, name)`` -> int64 [capacity]: the byte offset of the expert's first byte in each slot, so
    slot s's expert is ``matrix(layer, name)[s, lead[s]:lead[s] + bytes_per_expert]``."""

    streaming = False

    def __init__(self, model: GGUFModel, layout: ExpertLayout):
        self.model, self.layout = model, layout
        self.stats = StoreStats()

    def capacity(self, layer: int) -> int:
        raise NotImplementedError

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        raise NotImplementedError

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

    def lead(self, layer: int, name: str) -> np.ndarray:
        raise NotImplementedError

    @property
    def bytes_read(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ResidentStore(ExpertStore):
    """Experts addressed in place in a memory map of the file; slot id = expert id."""

    def __init__(self, model: GGUFModel, layout: ExpertLayout):
        super().__init__(model, layout)
        self._mats: dict[int, dict[str, torch.Tensor]] = {}
        for layer, mats in layout.layers.items():
            self._mats[layer] = {}
            for name, m in mats.items():
                info = model.tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
                self._mats[layer][name] = model.mapped(info).view(m.n_experts, m.bytes_per_expert)
        self._zeros = {layer: np.zeros(layout.n_experts(layer), dtype=np.int64) for layer in layout.layers}

    def capacity(self, layer: int) -> int:
        return self.layout.n_experts(layer)

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        self.stats.hits += len(experts)
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
                 note: Callable[[str], None] = stderr_note):
        super().__init__(model, layout)
        per_layer = n_slots if isinstance(n_slots, dict) else dict.fromkeys(layout.moe_layers, n_slots)
        low = min(per_layer.values())
        if low < min_slots:
            raise ConfigError(f"--slots {low} is below the experts used per token ({min_slots}); "
                              f"a step needs at least {min_slots} slots per layer")
        n_slots = max(per_layer.values())
        if policy not in POLICIES:
            raise ConfigError(f"--policy: unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if align is not None and (align < 1 or align & (align - 1)):
            raise ConfigError(f"direct IO alignment must be a power of two, got {align}")
        self.reader = ExpertReader(io_threads, identity=model.identity, note=note)
        paths = sorted({m.path for mats in layout.layers.values() for m in mats.values()})
        direct_paths: set[str] = set()
        aligns = [1]
        try:
            for p in paths:
                a = dio_alignment(p) if direct_io is not False else None
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
        self.align = max(aligns) if not self.direct or align is None else max(max(aligns), align)
        self.n_slots = n_slots
        self.slots: dict[int, SlotMap] = {}
        self.policies: dict[int, CachePolicy] = {}
        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        self._views: dict[int, dict[str, list[memoryview]]] = {}
        self._leads: dict[int, dict[str, np.ndarray]] = {}
        self._direct: dict[int, dict[str, bool]] = {}
        for layer, mats in layout.layers.items():
            n_exp = layout.n_experts(layer)
            n = min(per_layer[layer], n_exp)
            self.slots[layer] = SlotMap(n_exp, n)
            self.policies[layer] = POLICIES[policy](n_exp)
            self.pools[layer], self._views[layer], self._leads[layer], self._direct[layer] = {}, {}, {}, {}
            for name, m in mats.items():
                direct = m.path in direct_paths
                stride = slot_stride(m, self.align if direct else 1)
                pool = _aligned_pool(n, stride, self.align if direct else 1, pin_memory)
                self.pools[layer][name] = pool
                arr = pool.numpy()
                self._views[layer][name] = [memoryview(arr[s]) for s in range(n)]
                self._leads[layer][name] = np.zeros(n, dtype=np.int64)
                self._direct[layer][name] = direct

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
        whose slots are still in use (the tile being computed while this one loads); never evicted."""
        plan = self.policies[layer].plan(self.slots[layer], experts, pinned)
        self.stats.misses += len(plan.loads)
        self.stats.hits += len(experts) - len(plan.loads)
        if not plan.loads:
            return plan.slot_ids, None
        mats = self.layout[layer]
        views, leads, direct, align = self._views[layer], self._leads[layer], self._direct[layer], self.align
        jobs = []
        for e, s in plan.loads:
            for name, m in mats.items():
                off = m.expert_offset(e)
                if direct[name]:  # the aligned range that covers the expert
                    lead = off % align
                    end = -(-(lead + m.bytes_per_expert) // align) * align
                    jobs.append(ReadJob(m.path, off - lead, views[name][s][:end], lead, m.bytes_per_expert, True))
                else:
                    lead = 0
                    jobs.append(ReadJob(m.path, off, views[name][s]))
                leads[name][s] = lead
        ticket = self.reader.submit(jobs)
        ticket.loads = (layer, plan.loads)  # type: ignore[attr-defined]
        ticket.n_mats = len(mats)  # type: ignore[attr-defined]  # jobs per expert, consecutive
        return plan.slot_ids, ticket

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
        """The pool: uint8 [n_slots, stride]; stride is a multiple of ``align`` and the pool starts aligned."""
        return self.pools[layer][name]

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
        return self.reader.bytes_read

    def close(self) -> None:
        self.reader.close()


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
    by ``align`` bytes and view the aligned part)."""
    if align <= 1:
        return torch.empty((n, stride), dtype=torch.uint8, pin_memory=pin_memory)
    raw = torch.empty(n * stride + align, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % align
    return raw[skip:skip + n * stride].view(n, stride)
