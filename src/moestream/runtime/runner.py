"""The step runner: prefill and decode of every architecture, eager or as CUDA graphs, over a batch of sequences.

A family (models/*.py) describes its layers through a handful of methods of :class:`~moestream.models.base.MoEModel`
and never runs a forward pass itself:

- ``embed(step) -> x`` float32 [T, hidden] (may put per-step tensors in ``step.data``);
- ``mix(i, x, step) -> x``: layer i's attention or recurrent mixer, its residual added (positions and caches only
  through the :class:`~moestream.runtime.step.Step`);
- ``route_layer(i, x) -> Route(h, ids, w)`` for an MoE layer: the routed experts' input and the router's top-k real ids
  and weights; ``shared(i, x, h) -> tensor | None``: its shared expert / dense FFN (run while expert reads are in
  flight); ``combine(i, x, routed, shared_out, step) -> x``: the layer's output; ``dense(i, x, step) -> x``: the
  FFN of a layer without routed experts;
- ``head(x, step) -> logits``.

The runner owns the loop. Eager (CPU, prefill, or graphs off): each MoE layer goes through the shared MoE block
(experts/moe.py: slot plan, reads, overlap). On CUDA a one-token decode step runs with its position on the device
(:class:`Step` with ``pos``): when every expert is resident where the GPU addresses it, the whole step is one CUDA
graph replay (each MoE layer through ``MoE.resident_step``); when streaming, the step is cut at the MoE layers
and each segment (the previous MoE layer's combine, the dense layers, the next MoE layer's mixer and router) is one
replay, the experts running eagerly through the store between replays. The segments are the same code as the
whole step, so the logits have the same bits whether graphed, segmented or eager on the device path
(runtime/graphs.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.layers import Rope, Weight, decode_keys
from ..ops import sequence_rows
from . import fastdecode
from .graphs import DecodeGraphs
from .step import Seq, Step


class Runner:
    """Runs ``model``'s forward steps (see the module docstring for what the model provides)."""

    def __init__(self, model: Any):
        self.model = model
        self.graphs = DecodeGraphs()
        self._segs: list[list[int]] | None = None
        self._kpos: torch.Tensor | None = None
        self._data_keys: list[str] = []

    # --- eager ----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, start: int, cache: Any, logits_all: bool = False) -> torch.Tensor:
        """tokens int64 [T] at positions start..start+T-1 of ``cache`` -> logits float32 [T, vocab] when
        ``logits_all`` else [1, vocab] (the last token). ValueError when the cache cannot hold them."""
        m = self.model
        n_tok = int(tokens.shape[0])
        m.check_room(cache, start, n_tok)
        if n_tok == 1 and m.device.type == "cuda" and not logits_all and self.graphs.opted_in:
            return self.decode_device(tokens, start, cache)
        if n_tok == 1 and m.device.type == "cpu" and (fast := fastdecode.plan(m)) is not None:
            return fast.step(tokens, start, cache)  # the same bits as self.run, a few C calls per layer
        return self.run(Step(tokens, [Seq(cache, start, n_tok)]), logits_all)

    def step(self, batch: list[tuple[torch.Tensor, int, Any]], logits_all: bool = False) -> torch.Tensor:
        """One step over several sequences, each ``(tokens int64 [T_i], start, cache)`` with a cache of its own:
        their tokens go through every projection, router and expert call together (one expert read serves every
        sequence), their positions, caches and attention apart. Returns logits float32 [sum T_i, vocab] when
        ``logits_all``, else [len(batch), vocab] (each sequence's last token). On the CPU each row has the bits it
        has when its sequence runs alone (the C kernels compute each row on its own; the float32 matmuls torch
        computes run per sequence: ops.sequence_rows; attention and recurrent state are per sequence;
        tests/test_runner.py). On CUDA not (the Triton kernels' configuration and torch's matmuls depend on the row
        count): the logits may differ in their last bits (not measured yet)."""
        seqs = [Seq(cache, start, int(t.shape[0])) for t, start, cache in batch]
        for s in seqs:
            self.model.check_room(s.cache, s.start, s.n_tok)
        return self.run(Step(torch.cat([t for t, _, _ in batch]), seqs), logits_all)

    def run(self, step: Step, logits_all: bool = False) -> torch.Tensor:
        """The eager step: every layer in order, each MoE layer through the store (``begin_layer`` starts the
        router lookahead's reads, when on). The matmuls and elementwise functions torch computes run per sequence
        (ops.sequence_rows)."""
        with sequence_rows([s.n_tok for s in step.seqs]):
            return self._run(step, logits_all)

    def _run(self, step: Step, logits_all: bool) -> torch.Tensor:
        m = self.model
        m.begin_step(step)
        x = m.embed(step)  # [T, hidden]
        for i in range(m.n_layers):
            m.begin_layer(i, x)  # x: the input of layer i; its reads run behind the mixer
            x = m.mix(i, x, step)
            if i in m.layout:
                r = m.route_layer(i, x)
                routed, sh = m.experts(i)(r.h, r.ids, r.w, shared=self._shared(i, x, r.h))
                x = m.combine(i, x, routed, sh, step)
            else:
                x = m.dense(i, x, step)
        m.end_step(step)
        if logits_all:
            return m.head(x, step)
        with sequence_rows([1] * len(step.seqs)):  # the head on each sequence's last row, as alone
            return m.head(step.last_rows(x), step)

    def _shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> Any:
        """Layer i's shared FFN as the MoE block's ``shared`` callable (None when the family has none)."""
        if not self.model.has_shared(i):
            return None
        return lambda _h: self.model.shared(i, x, h)

    # --- on the device (CUDA decode) ------------------------------------------------------------------------
    def ropes(self) -> list[Rope]:
        """The model's RoPE tables (every :class:`Rope` attribute)."""
        return [v for v in vars(self.model).values() if isinstance(v, Rope)]

    def graphable(self) -> bool:
        """Whether a whole decode step can be one CUDA graph: every MoE layer computable by
        ``MoE.resident_step`` (every expert resident where the GPU addresses it, Triton kernels), every
        dense weight on the Triton kernels or float32, no router lookahead."""
        m = self.model
        store = m.store
        if m.opts.prefetch or not all(m.experts(i).on_device(store) for i in m.layout.moe_layers):
            return False
        weights = [v for v in vars(m).values() if isinstance(v, Weight)]
        weights += [w for b in getattr(m, "blocks", ()) for w in b.values() if isinstance(w, Weight)]
        return all(w.dense is not None or w.gpu for w in weights)

    def segments(self) -> list[list[int]]:
        """The decode step cut at the MoE layers: segment j ends with MoE layer j's mixer and router (the last
        segment: the layers after the last MoE layer and the head). Made once per model."""
        if self._segs is None:
            segs, cur = [], []
            for i in range(self.model.n_layers):
                cur.append(i)
                if i in self.model.layout:
                    segs.append(cur)
                    cur = []
            self._segs = [*segs, cur]
        return self._segs

    def decode_device(self, tokens: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """One token at ``start`` on CUDA -> logits [1, vocab]. Where :meth:`graphable`, one replay of a CUDA graph
        of the whole step; else (streaming) one replay per segment between MoE layers with the MoE layers run
        eagerly between them; with ``--prefetch on`` or when a capture failed, the same code eagerly. All three
        run the same kernels in the same order, so they give the same bits."""
        m = self.model
        n_keys = decode_keys(start, cache.n_ctx)
        ropes = self.ropes()
        for r in ropes:
            r.reserve(cache.n_ctx)  # the whole context: a graph holds the tables' address
        if self._kpos is None or self._kpos.shape[0] < cache.n_ctx:
            self._kpos = torch.arange(cache.n_ctx, dtype=torch.int64, device=m.device)
        key = (*(r.cos.data_ptr() for r in ropes), self._kpos.data_ptr())
        seq = Seq(cache, start, 1)
        m.begin_step(Step(tokens, [seq]))
        store = m.store
        plan = getattr(store, "plan", None)  # the device-planned step (experts/devplan.py)
        out = None
        graphable = self.graphable()
        if graphable:
            n_moe = len(m.layout.moe_layers)

            def count() -> None:  # the hits a replay does not count: top_k distinct experts per MoE layer
                if plan is None:
                    store.stats.hits += n_moe * m.top_k
                else:  # the step's ids to the host; the previous step's counted, the policy run
                    plan.after_step()

            if plan is not None:
                plan.before_step()
            out = self.graphs.step(self.body, tokens, start, n_keys, cache, store, key, count)
        elif not m.opts.prefetch and self.graphs.off_reason is None:
            out = self._segmented(tokens, start, n_keys, cache, key)
        if out is None:
            pos = torch.full((1,), start, dtype=torch.int64, device=m.device)
            if plan is not None and graphable:  # graphs off: the same device-planned step, eagerly
                plan.before_step()
                out = self.body(tokens, pos, n_keys, cache)
                plan.after_step()
            else:
                out = self.body(tokens, pos, n_keys, cache, eager=True)
        m.end_step(Step(tokens, [seq]))
        return out

    def _device_step(self, tokens: torch.Tensor, pos: torch.Tensor, n_keys: int, cache: Any) -> Step:
        return Step(tokens, [Seq(cache, -1, 1)], pos=pos, n_keys=n_keys, kpos=self._kpos[:n_keys])

    def segment(self, j: int, step: Step, x: torch.Tensor, routed: torch.Tensor | None,
                shared_out: torch.Tensor | None, look: bool = False) -> tuple[torch.Tensor, ...]:
        """Segment ``j`` of the device decode step: x float32 [1, hidden] (segment 0: the tokens) plus the previous
        MoE layer's routed and shared outputs -> (x, h, ids, w) at the next MoE layer's experts, or (logits,) for
        the last segment. Nothing in it depends on the host (CUDA-graph capturable), except ``look``: the router
        lookahead of each layer (eager only)."""
        m = self.model
        layers = self.segments()[j]
        if j == 0:
            x = m.embed(step)
        else:
            x = m.combine(self.segments()[j - 1][-1], x, routed, shared_out, step)
        for i in layers:
            if look:
                m.begin_layer(i, x)
            x = m.mix(i, x, step)
            if i in m.layout:
                r = m.route_layer(i, x)
                return x, r.h, r.ids, r.w
            x = m.dense(i, x, step)
        return (m.head(step.last_rows(x), step),)

    def body(self, tokens: torch.Tensor, pos: torch.Tensor, n_keys: int, cache: Any,
             eager: bool = False, lean: bool = False) -> torch.Tensor:
        """The device decode step: tokens int64 [1], pos int64 [1] on the device; attention over the first
        ``n_keys`` cache rows. ``eager``: the MoE layers go through the store (router top-k to the host, slots
        planned, misses read; with the router lookahead); ``lean``: the store plans and reads on the host, the
        experts run through ``MoE.resident_step`` at the offsets it wrote (:meth:`_plan_layer`, what
        :meth:`_segmented` replays); else ``MoE.resident_step`` alone (nothing on the host, capturable). The same
        segments as :meth:`_segmented`, so every path gives the same bits."""
        m = self.model
        step = self._device_step(tokens, pos, n_keys, cache)
        segs = self.segments()
        x, routed, sh = tokens, None, None
        for j in range(len(segs)):
            out = self.segment(j, step, x, routed, sh, look=eager)
            if j == len(segs) - 1:
                return out[0]
            x, h, ids, w = out
            i = segs[j][-1]
            moe = m.experts(i)
            if eager:
                routed, sh = moe(h, ids, w, shared=self._shared(i, x, h))
            else:
                planned = self._plan_layer(i, ids) if lean else None
                routed = moe.resident_step(m.store, h, ids, w, planned=planned)
                sh = m.shared(i, x, h) if m.has_shared(i) else None
                if lean:
                    m.store.used(i)
        raise AssertionError("unreachable: the last segment returns the logits")

    def lean(self) -> bool:
        """Whether the streaming step computes its experts inside the segments' graphs (:meth:`_plan_layer`,
        devplan.SegmentOffsets): Triton expert kernels on every MoE layer, a streaming store whose pools the GPU
        addresses in place (``--pool device``) without a device plan, no synthetic routing, no router lookahead
        (whose reads the eager MoE call starts), and ``MOESTREAM_LEAN_SEGMENTS`` not ``0`` (devplan.lean_segments)."""
        from ..experts import devplan
        from ..experts.pool import StreamingStore

        m = self.model
        store = m.store
        in_place = store.place == "device" or store.device.type != "cuda"  # (a CPU device: tests, interpreted)
        if not (isinstance(store, StreamingStore) and store.plan is None and in_place
                and not m.opts.prefetch and devplan.lean_segments()):
            return False
        return all(m.experts(i).gpu and m.experts(i).routing is None for i in m.layout.moe_layers)

    def _plan_layer(self, i: int, ids: torch.Tensor) -> Any:
        """MoE layer i's slots for one token's top-k ``ids`` (int64 [1, top_k] on the device): the router's choice
        to the host (the one synchronisation of the layer), ``store.prepare``, every read joined, the copies into
        the slots ordered before the next kernels (``device_ready``), and the pairs' pool offsets written to the
        device (devplan.SegmentOffsets.write). Returns the SegmentOffsets for ``MoE.resident_step``. On a read
        error the layer's reads settle and their slots are emptied before it is raised (as ``MoE.__call__``)."""
        from ..experts.devplan import SegmentOffsets

        store = self.model.store
        offs = getattr(store, "_segment_offsets", None)
        if offs is None:
            offs = store._segment_offsets = SegmentOffsets(store, self.model.top_k)
        row = ids.reshape(-1).cpu().numpy()
        experts = sorted(set(row.tolist()))
        slot_ids, ticket = store.prepare(i, experts)
        try:
            store.wait(ticket)
        except BaseException:
            store.discard(ticket)
            raise
        store.device_ready(i)
        offs.write(i, row, experts, slot_ids)
        return offs

    def _segmented(self, tokens: torch.Tensor, start: int, n_keys: int, cache: Any, key: tuple) -> torch.Tensor:
        """:meth:`decode_device` while streaming: each segment a graph replay, each MoE layer through the store.
        The per-step tensors a family keeps in ``step.data`` (made by segment 0) travel between the segments as
        graph inputs and outputs. A segment whose capture fails runs eagerly (and graphs are off from then on)."""
        m = self.model
        segs = self.segments()
        pos = torch.full((1,), start, dtype=torch.int64, device=m.device)
        if self.lean():
            return self._segmented_lean(tokens, pos, n_keys, cache, key)
        x, routed, sh, data = tokens, None, None, ()
        for j in range(len(segs)):
            def seg(x_in: torch.Tensor, r_in: torch.Tensor | None, s_in: torch.Tensor | None, p_in: torch.Tensor,
                    *d_in: torch.Tensor, j: int = j) -> tuple[torch.Tensor, ...]:
                step = self._device_step(x_in if j == 0 else tokens, p_in, n_keys, cache)
                if j:
                    step.data = dict(zip(self._data_keys, d_in, strict=True))
                out = self.segment(j, step, x_in, r_in, s_in)
                if j == 0:
                    self._data_keys = sorted(step.data)
                return (*out, *(step.data[k] for k in self._data_keys)) if j < len(segs) - 1 else out

            out = self.graphs.segment((n_keys, j), seg, (x, routed, sh, pos, *data), cache, m.store, key)
            if out is None:  # a capture failed: the rest of this step (and every later one) eagerly
                out = seg(x, routed, sh, pos, *data)
            if j == len(segs) - 1:
                return out[0].clone()
            x, h, ids, w, *data = out
            i = segs[j][-1]
            routed, sh = m.experts(i)(h, ids, w, shared=self._shared(i, x, h))
        raise AssertionError("unreachable: the last segment returns the logits")

    def _segmented_lean(self, tokens: torch.Tensor, pos: torch.Tensor, n_keys: int, cache: Any,
                        key: tuple) -> torch.Tensor:
        """:meth:`_segmented` with each MoE layer's experts inside the next segment's graph: between two replays
        the host only plans the layer's slots and joins its reads (:meth:`_plan_layer`); segment j + 1 starts with
        MoE layer j's ``MoE.resident_step`` at the offsets the host wrote, then its shared FFN and combine. The
        same kernels in the same order as :meth:`body` with ``lean``, so the same bits."""
        m = self.model
        segs = self.segments()
        store = m.store
        x, h, ids, w, data = tokens, None, None, None, ()
        planned = None
        for j in range(len(segs)):
            def seg(x_in: torch.Tensor, h_in: torch.Tensor | None, ids_in: torch.Tensor | None,
                    w_in: torch.Tensor | None, p_in: torch.Tensor, *d_in: torch.Tensor,
                    j: int = j, planned: Any = planned) -> tuple[torch.Tensor, ...]:
                step = self._device_step(x_in if j == 0 else tokens, p_in, n_keys, cache)
                routed = sh = None
                if j:
                    step.data = dict(zip(self._data_keys, d_in, strict=True))
                    i = segs[j - 1][-1]
                    routed = m.experts(i).resident_step(store, h_in, ids_in, w_in, planned=planned)
                    sh = m.shared(i, x_in, h_in) if m.has_shared(i) else None
                out = self.segment(j, step, x_in, routed, sh)
                if j == 0:
                    self._data_keys = sorted(step.data)
                return (*out, *(step.data[k] for k in self._data_keys)) if j < len(segs) - 1 else out

            out = self.graphs.segment((n_keys, j, "lean"), seg, (x, h, ids, w, pos, *data), cache, store, key)
            if out is None:  # a capture failed: the rest of this step (and every later one) eagerly
                out = seg(x, h, ids, w, pos, *data)
            if j:
                store.used(segs[j - 1][-1])  # the kernels reading that layer's slots are enqueued
            if j == len(segs) - 1:
                return out[0].clone()
            x, h, ids, w, *data = out
            planned = self._plan_layer(segs[j][-1], ids)
        raise AssertionError("unreachable: the last segment returns the logits")
