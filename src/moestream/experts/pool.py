"""Expert stores: where the expert matmul finds an expert's bytes.

``StreamingStore``: per MoE layer, per expert matrix, one slot pool ``[n_slots, bytes_per_expert]``
(uint8, allocated once) filled by an ExpertReader; the matmul addresses it through slot ids.
``ResidentStore``: the "pool" is the whole expert tensor ``[n_experts, bytes_per_expert]`` viewed in a
read-only memory map of the file, and slot id = expert id (the ``--moe-stream off`` baseline).
Both expose the same ``prepare`` / ``wait`` / ``matrix`` calls, so the compute code is the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..gguf import GGUFModel
from .layout import ExpertLayout
from .policy import POLICIES, CachePolicy, SlotMap
from .reader import ExpertReader, ReadJob, Ticket


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
    not be computed); ``matrix(layer, name)`` -> uint8 tensor [capacity, bytes_per_expert]."""

    streaming = False

    def __init__(self, model: GGUFModel, layout: ExpertLayout):
        self.model, self.layout = model, layout
        self.stats = StoreStats()
        #: a list to append every prepare()'s (layer, experts, pinned) to (a routing trace, experts/trace.py)
        self.trace: list | None = None

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

    def capacity(self, layer: int) -> int:
        return self.layout.n_experts(layer)

    def prepare(self, layer: int, experts: list[int], pinned: list[int] = ()) -> tuple[list[int], Ticket | None]:
        if self.trace is not None:
            self.trace.append((layer, tuple(experts), tuple(pinned)))
        self.stats.hits += len(experts)
        return list(experts), None

    def matrix(self, layer: int, name: str) -> torch.Tensor:
        return self._mats[layer][name]


class StreamingStore(ExpertStore):
    """Per-layer slot pools filled from the file on a miss.

    n_slots: slots per MoE layer (one count, or layer -> count from a memory plan), at least ``min_slots``
    (experts used per token); clamped to each layer's experts. io_threads: reader threads.
    policy: a name in POLICIES. pin_memory: allocate pools in pinned host memory (for a CUDA device).
    Raises ConfigError for a bad n_slots or policy.
    """

    streaming = True

    def __init__(self, model: GGUFModel, layout: ExpertLayout, n_slots: int | dict[int, int], min_slots: int,
                 io_threads: int = 8, policy: str = "lfu", pin_memory: bool = False):
        super().__init__(model, layout)
        per_layer = n_slots if isinstance(n_slots, dict) else dict.fromkeys(layout.moe_layers, n_slots)
        low = min(per_layer.values())
        if low < min_slots:
            raise ConfigError(f"--slots {low} is below the experts used per token ({min_slots}); "
                              f"a step needs at least {min_slots} slots per layer")
        n_slots = max(per_layer.values())
        if policy not in POLICIES:
            raise ConfigError(f"--policy: unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.reader = ExpertReader(io_threads)
        self.n_slots = n_slots
        self.slots: dict[int, SlotMap] = {}
        self.policies: dict[int, CachePolicy] = {}
        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        self._views: dict[int, dict[str, list[memoryview]]] = {}
        for layer, mats in layout.layers.items():
            n_exp = layout.n_experts(layer)
            n = min(per_layer[layer], n_exp)
            self.slots[layer] = SlotMap(n_exp, n)
            self.policies[layer] = POLICIES[policy](n_exp)
            self.pools[layer], self._views[layer] = {}, {}
            for name, m in mats.items():
                pool = torch.empty((n, m.bytes_per_expert), dtype=torch.uint8, pin_memory=pin_memory)
                self.pools[layer][name] = pool
                arr = pool.numpy()
                self._views[layer][name] = [memoryview(arr[s]) for s in range(n)]

    @staticmethod
    def slot_bytes(layout: ExpertLayout, layer: int) -> int:
        """Bytes of one slot of ``layer``'s pools, all its expert matrices together (what a memory plan prices)."""
        return layout.bytes_per_expert(layer)

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
        if self.trace is not None:
            self.trace.append((layer, tuple(experts), tuple(pinned)))
        plan = self.policies[layer].plan(self.slots[layer], experts, pinned)
        self.stats.misses += len(plan.loads)
        self.stats.hits += len(experts) - len(plan.loads)
        if not plan.loads:
            return plan.slot_ids, None
        mats = self.layout[layer]
        jobs = [ReadJob(m.path, m.expert_offset(e), self._views[layer][name][s])
                for e, s in plan.loads for name, m in mats.items()]
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
        return self.pools[layer][name]

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def close(self) -> None:
        self.reader.close()
