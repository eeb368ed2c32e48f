"""Continuous batching for ``serve -np N``: the forward passes of up to N generations run as one step.

Each running request is a :class:`~moestream.engine.Generation` driven, as when it runs alone, by its own thread
(sampling, stop strings, events); its engine is a :class:`SlotEngine`, whose ``forward`` hands the pass (a prefill
chunk of at most ``ubatch`` tokens, or one decode token) to the :class:`StepScheduler` and waits for its logits.
The scheduler's thread (the server's worker) waits until every running generation has handed in its next pass,
then runs them as one :meth:`Runner.step <moestream.runtime.runner.Runner.step>`: every projection, router and
expert call sees all their rows at once (each expert a step uses is read once for all of them), attention and
recurrent state per sequence. A new request joins with its first prefill chunk; to keep the running requests
going, a step takes every decode token but prefill chunks only up to a token budget (``ubatch``, at least one
chunk: the oldest first), so a long prompt is prefilled over several steps, each also decoding the others. A
request that ends (finished, cancelled, disconnected, failed) leaves the set at once and the next step runs
without it.

A request's tokens are those it gets alone: its passes are the same (the same chunks at the same positions, the
chunking depends on its own prompt only), and on the CPU every row of a step is computed on its own (the C
kernels; tests/test_runner.py), so its logits have the same bits whatever runs beside it; its sampler (and seed)
is its own. Logits that are not finite, or a failure in the step, fail the requests concerned with the errors
:meth:`Engine.forward <moestream.engine.Engine.forward>` raises.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .engine import Engine
from .errors import ForwardError


@dataclass
class _Pass:
    """One forward pass handed in by a slot: tokens int64 [T] at ``start`` of ``cache``; ``order``: arrival."""

    tokens: torch.Tensor
    start: int
    cache: Any
    order: int
    result: Any = None
    done: bool = False


@dataclass
class StepStats:
    """What the scheduler ran: forward steps, the rows they computed, and the most sequences in one step."""

    steps: int = 0
    rows: int = 0
    seqs: int = 0
    widest: int = 0
    #: called after each step with the number of sequences it ran
    on_step: list[Callable[[int], None]] = field(default_factory=list)


class StepScheduler:
    """Runs the passes of the slots that take part (:meth:`enter` .. :meth:`leave`) as steps of ``engine``'s model.

    Slot threads call :meth:`forward` (it blocks until the step that runs their pass is done); the scheduler's
    thread calls :meth:`wait_ready` then :meth:`step`. ``ubatch``: the prefill token budget of a step (decode
    tokens come on top)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cond = threading.Condition()
        self.active: set[int] = set()
        self.pending: dict[int, _Pass] = {}
        self._order = itertools.count()
        self.stats = StepStats()

    # --- slot side ------------------------------------------------------------------------------------------
    def enter(self, slot: int) -> None:
        with self.cond:
            self.active.add(slot)

    def leave(self, slot: int) -> None:
        with self.cond:
            self.active.discard(slot)
            self.pending.pop(slot, None)
            self.cond.notify_all()

    def forward(self, slot: int, tokens: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """The logits float32 [1, vocab] of the last of ``tokens`` (int64 [T] at ``start`` of ``cache``), computed
        in the next step the scheduler runs; raises what the step raised for this slot."""
        p = _Pass(tokens, start, cache, next(self._order))
        with self.cond:
            self.pending[slot] = p
            self.cond.notify_all()
            while not p.done:
                self.cond.wait()
        if isinstance(p.result, BaseException):
            raise p.result
        return p.result

    # --- scheduler side -------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every slot that takes part has handed in its next pass (and at least one does)."""
        return bool(self.active) and all(s in self.pending for s in self.active)

    def wait_ready(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(self.ready, timeout)

    def pick(self) -> list[tuple[int, _Pass]]:
        """The passes of the next step: every one-token pass (decode), then prefill chunks oldest first while they
        fit in ``ubatch`` tokens (the first always)."""
        with self.cond:
            items = sorted(self.pending.items(), key=lambda kv: kv[1].order)
        decode = [(s, p) for s, p in items if p.tokens.shape[0] == 1]
        budget, chosen = self.engine.ubatch, []
        for s, p in items:
            n = p.tokens.shape[0]
            if n == 1:
                continue
            if chosen and n > budget:
                break
            chosen.append((s, p))
            budget -= n
        return decode + chosen

    def step(self) -> int:
        """Run one step (call after :meth:`wait_ready`); returns the sequences it ran."""
        batch = self.pick()
        if not batch:
            return 0
        eng, model = self.engine, self.engine.model
        try:
            with torch.inference_mode():
                model.gguf.check_unchanged()
                if len(batch) == 1:  # alone: Engine.forward itself (on CUDA: the decode graphs)
                    p = batch[0][1]
                    logits = eng.forward(p.tokens, p.start, p.cache)
                else:
                    logits = model.runner.step([(p.tokens, p.start, p.cache) for _, p in batch])
            results: list[Any] = []
            for i, (_, p) in enumerate(batch):
                try:
                    eng.check_finite(logits[i:i + 1], p.start, int(p.tokens.shape[0]))
                    results.append(logits[i:i + 1])
                except Exception as e:  # noqa: BLE001 - this request's error, delivered to its thread
                    results.append(e)
        except RuntimeError as e:
            err: BaseException = e
            if not isinstance(e, (NotImplementedError, RecursionError)):
                first = (str(e).strip().splitlines() or [""])[0][:300]
                err = ForwardError(f"{model.gguf.path}: a forward step of {len(batch)} sequences failed (internal "
                                   f"error: {type(e).__name__}: {first})")
            results = [err] * len(batch)
        except Exception as e:  # noqa: BLE001 - a read fault, a changed file: every request of the step gets it
            results = [e] * len(batch)
        st = self.stats
        st.steps += 1
        st.seqs += len(batch)
        st.rows += sum(int(p.tokens.shape[0]) for _, p in batch)
        st.widest = max(st.widest, len(batch))
        for fn in st.on_step:
            fn(len(batch))
        with self.cond:
            for (slot, p), r in zip(batch, results, strict=True):
                p.result, p.done = r, True
                if self.pending.get(slot) is p:
                    del self.pending[slot]
            self.cond.notify_all()
        return len(batch)


class SlotEngine(Engine):
    """The engine a slot's :class:`~moestream.engine.Generation` runs on: ``forward`` goes through the scheduler
    (one-row logits only: a generation never asks for all rows)."""

    def __init__(self, scheduler: StepScheduler, slot: int):
        super().__init__(scheduler.engine.model, scheduler.engine.ubatch)
        self.scheduler, self.slot = scheduler, slot

    def forward(self, tokens: torch.Tensor, start: int, cache: object, logits_all: bool = False) -> torch.Tensor:
        if logits_all and tokens.shape[0] > 1:
            raise ValueError("a batched slot computes the last row's logits only")
        return self.scheduler.forward(self.slot, tokens, start, cache)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    """A slot of the server: its KV cache (made at first use, ``n_ctx`` positions) and the tokens whose keys and
    values it holds at positions 0..len-1 (what the next request may reuse); ``used``: when it was last given a
    request (for LRU)."""

    index: int
    cache: Any = None
    tokens: list[int] = field(default_factory=list)
    used: int = 0
    busy: bool = False


def reusable(slot: Slot, ids: list[int]) -> int:
    """How many of ``ids``'s first tokens ``slot``'s cache can serve: the common prefix with what it holds, at most
    ``len(ids) - 1`` (the last prompt token is always computed: its logits give the first token). A cache with
    recurrent state (Qwen 3.5: ``cache.pos``), which cannot be rewound, serves only all it holds or nothing."""
    if slot.cache is None or not slot.tokens:
        return 0
    n = min(common_prefix(slot.tokens, ids), len(ids) - 1)
    if getattr(slot.cache, "pos", None) is not None and (n != len(slot.tokens) or slot.cache.pos != n):
        return 0
    return n


def choose_slot(slots: list[Slot], ids: list[int], reuse: bool) -> tuple[Slot, int]:
    """The free slot for a request of prompt ``ids`` and the prompt tokens it reuses: the slot with the longest
    reusable prefix (``reuse``), else the least recently used (ties: the least recently used). ValueError when no
    slot is free."""
    free = [s for s in slots if not s.busy]
    if not free:
        raise ValueError("no free slot")
    scored = [(reusable(s, ids) if reuse else 0, -s.used, s) for s in free]
    n, _, best = max(scored, key=lambda t: (t[0], t[1]))
    return best, n
