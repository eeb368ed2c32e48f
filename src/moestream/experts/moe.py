"""The shared MoE layer: router output -> slot plan -> reads -> (shared/dense FFN overlap) -> expert matmuls.

Every architecture file uses this. It supplies the top-k real expert ids and weights (its own gating),
an optional shared/dense FFN to run while the reads are in flight, and the expert activation; this
layer does the rest, the same way whether the store streams or is resident, so streaming on and off
give bitwise-identical results.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import kernels, quant
from ..ops import decode_batch, elementwise
from .layout import ExpertLayout
from .pool import ExpertStore, ResidentStore

#: (gate, up) float32 [n, n_ff] each -> the hidden activation [n, n_ff] (a string: no torch at import)
Activation = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (Qwen/Mixtral experts); on CUDA one launch (gpu/tmoe.py ``silu_mul``)."""
    if (tmoe := _tmoe_if(gate)) is not None:
        return tmoe.silu_mul(gate, up)
    return torch.nn.functional.silu(gate) * up


def _tmoe_on_cpu() -> bool:
    """Whether a test asked gpu/tmoe.py's kernels to run on CPU tensors (without importing triton otherwise)."""
    import sys
    mod = sys.modules.get("moestream.gpu.tmoe")
    return bool(mod is not None and mod.ON_CPU)


swiglu.kernel_act = kernels.ACT_SILU  # type: ignore[attr-defined]  # the C kernels' code for it


def _tmoe_if(t: torch.Tensor):  # noqa: ANN202 - the module or None
    """gpu/tmoe.py when its kernels apply to ``t`` (CUDA float32, on), else None."""
    if t.device.type == "cpu" and not _tmoe_on_cpu():
        return None
    from ..gpu import tmoe
    return tmoe if tmoe.applies(t) else None


#: Most values of the routed rows [tokens, top_k, hidden] a resident CPU call writes into a buffer kept per layer
#: (decode steps; 512 KiB: 8 x 7168 fits), not a new tensor
KEPT_ROWS_FLOATS = 1 << 17


def topk_sum(out: torch.Tensor) -> torch.Tensor:
    """``out.sum(dim=1)`` of the routed outputs float32 [tokens, top_k, hidden] (contiguous, CPU) -> [tokens, hidden],
    the same bits: the step kernels' in-order sum (kernels.topk_sum) where torch's sum adds the k rows in order
    (measured on torch 2.13: rows of a multiple of its vector block, up to 16 rows before its cascade starts; a
    multiple of 64 covers the AVX-512 build), torch's own sum elsewhere."""
    if out.shape[2] % 64 or out.shape[1] > 16:
        return out.sum(dim=1)
    return kernels.topk_sum(out)


class ClampedSwiGLU:
    """GPT-OSS's expert activation (transformers' ``GptOssExperts._apply_gate``, ggml's ``swiglu_oai``):
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``.
    float32 [n, n_ff] x2 -> [n, n_ff]; the sigmoid in fixed slices (ops.elementwise: the same bits whatever the
    thread count). With llama.cpp's constants (alpha 1.702, limit 7) it has a C-kernel code, ``kernel_act`` =
    kernels.ACT_SWIGLU_OAI: a fused layer computes it in ms_moe as ggml's ``swiglu_oai`` does
    (``x / (1 + expf(alpha * -x)) * (y + 1)``: the same value, other last bits than this torch form); other constants
    have none (the layer computes per expert)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = float(alpha), float(limit)
        if (self.alpha, self.limit) == (kernels.SWIGLU_OAI_ALPHA, kernels.SWIGLU_OAI_LIMIT):
            self.kernel_act = kernels.ACT_SWIGLU_OAI

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * elementwise(torch.sigmoid, gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


class MoE:
    """Routed experts of one layer.

    layer: MoE layer index. layout: the file's ExpertLayout. store_of: callable returning the current
    ExpertStore (so a model can swap resident/streaming stores). act: (gate, up) -> hidden activation; an
    ``act.kernel_act`` attribute names it for the C kernels. blocks: compute the experts with moestream's C
    kernels on the ggml blocks, one call per set of ready experts (kernels.moe), where they compute the
    layer's types and activation; otherwise one dequantize-then-matmul per matrix per expert.
    bias: optional per-expert output biases that stay resident, ``{matrix: float32 [n_experts, rows]}`` for some of
    ``gate``, ``up``, ``down`` (``gate_up`` for a merged matrix), added to that matrix's output and indexed by the
    REAL expert id (the matmul itself addresses the pool by slot id). On CUDA the grouped launches add them to
    each (token, expert) pair's row, gathered by the pair's real id; on the CPU the fused C call (ms_moe) gathers
    them by each group's real id too (separate gate / up / down biases; a merged ``gate_up`` bias computes per
    expert). overlap_of: callable returning whether a call without
    ``overlap=`` hides the reads behind compute (a model's ``opts.overlap``, read at each call); absent: on.
    Architecture files make it with ``MoEModel.moe(layer, ...)``, which passes the store, kernels and overlap.
    """

    def __init__(self, layer: int, layout: ExpertLayout, store_of: Callable[[], ExpertStore],
                 act: Activation = swiglu, blocks: bool = False, gpu: bool = False,
                 bias: dict[str, torch.Tensor] | None = None, overlap_of: Callable[[], bool] | None = None,
                 expert_scale: torch.Tensor | None = None):
        self.layer = layer
        #: optional float32 [n_experts] per-expert output scale, indexed by real expert id (Gemma 4)
        self.expert_scale = expert_scale
        self.overlap_of = overlap_of
        self.mats = layout[layer]
        self.store_of = store_of
        self.act = act
        self.merged = "gate_up" in self.mats
        m = self.mats
        gate, up, down = (m["gate_up"], m["gate_up"], m["down"]) if self.merged else (m["gate"], m["up"], m["down"])
        self.n_ff = gate.rows // 2 if self.merged else gate.rows
        #: per-expert biases by matrix name, [n_experts, rows] float32, indexed by real expert id (or None)
        self.bias = {k: v for k, v in (bias or {}).items() if v is not None} or None
        if self.bias is not None:
            for name, b in self.bias.items():
                mat = m.get(name)
                if mat is None or tuple(b.shape) != (mat.n_experts, mat.rows):
                    raise ValueError(f"layer {layer}: bias {name} of shape {list(b.shape)} fits no expert matrix "
                                     f"{'' if mat is None else [mat.n_experts, mat.rows]}")
        kact = getattr(act, "kernel_act", None)
        #: one C call per set of experts (types equal for gate and up, computed by the kernels, CPU)
        #: (gate, up, down) bias tables for the fused C call (each contiguous float32 [n_experts, rows] or None), or
        #: None: no biases
        self.kernel_bias: tuple | None = None
        fusable_bias = self.bias is None
        if self.bias is not None and not self.merged and set(self.bias) <= {"gate", "up", "down"}:
            if all(b.device.type == "cpu" and b.dtype == torch.float32 for b in self.bias.values()):
                self.bias = {k: b.contiguous() for k, b in self.bias.items()}
                self.kernel_bias = tuple(self.bias.get(k) for k in ("gate", "up", "down"))
                fusable_bias = True
        self.fused = (blocks and kact is not None and fusable_bias and gate.ggml_type == up.ggml_type
                      and kernels.computes(gate.ggml_type, gate.cols) and kernels.computes(down.ggml_type, down.cols))
        #: per-matrix C kernels where the layer cannot be fused (mixed gate/up types)
        self.blocks = blocks
        #: CUDA: the Triton kernels on the ggml blocks, one grouped launch per matrix (gpu/tkernels.py), where
        #: they compute every matrix's type; otherwise one dequantize-then-matmul per matrix per expert
        self.gpu = False
        if gpu:
            from ..gpu import tkernels
            self.gpu = all(tkernels.computes(mm.ggml_type, mm.cols) for mm in m.values())
        self.kernel_act = kact
        #: None, or ``(layer, ids) -> ids`` replacing the router's expert ids (bench --routing calibrated)
        self.routing: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self._pair_bufs: kernels.MoEPairs | None = None
        self._tab_key: tuple | None = None
        self._out_buf: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 overlap: bool | None = None, expert_scale: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [tokens, hidden] float32; ids: [tokens, top_k] int64 real expert ids; weights: [tokens, top_k]
        float32 routing weights. shared: the shared expert / dense FFN, run while the misses are read when
        ``overlap`` (else before the reads start); ``overlap`` None: ``overlap_of()`` (on without one).
        expert_scale: optional [n_experts] per-expert output scale, indexed by real expert id (default: the
        layer's own, ``self.expert_scale``). Returns (routed
        output [tokens, hidden], shared output or None).

        With ``overlap`` (the default) the reads hide behind every computation that does not need them:
        after the router's top-k the misses go to the IO threads, the shared/dense FFN runs, then the hits'
        matmuls, then each miss's matmul right after its own reads are joined (reads finish roughly in the
        order they were queued). Without it: shared FFN, then the reads, one join, then the experts.

        When a chunk selects more distinct experts than the pool holds (prefill through a small pool), the
        experts are walked in tiles: load a tile, compute every token routed to it, next tile. With
        ``overlap`` a tile is half the pool, and the next tile's reads start (its slots chosen with the current
        tile pinned) before the current tile is computed, so reads hide behind expert compute too; without it,
        tiles fill the pool and each load waits for the previous tile's compute. Each token's top-k outputs are
        summed in top-k order at the end and every expert sees the same tokens either way, so neither tiling
        nor overlap changes a bit of the result.

        On the grouped (CUDA) path with a device-planned store (its host tier holds every expert), a chunk of
        several tokens (or one that selects more experts than the pool holds) skips the slot path:
        :meth:`_tier_prefill` computes the experts with a slot from the pool and the rest from the tier rows
        (MOESTREAM_TIER_PREFILL, experts/devplan.py), without changing a slot. A prompt chunk narrower than the
        pool took the slot path before (misses copied into slots by the IO threads, one host round per expert):
        on the H200, 15.5 ms of host work per MoE layer for 64 tokens (benchmarks/tier_prefill_profile.py). A
        batch of decode tokens of several sequences (ops.decode_batch: ``serve -np N``) that fits the pool keeps
        the slot path: its misses are promoted into slots, as a lone decode step's are between tokens, where the
        tier path would leave the pool as it was for as long as requests run side by side.
        """
        if self.routing is not None:  # synthetic routing: other expert ids, the router's weights
            ids = self.routing(self.layer, ids)
        store = self.store_of()
        if expert_scale is None:
            expert_scale = self.expert_scale
        if expert_scale is not None:
            weights = weights * expert_scale[ids]  # real ids, never slot ids
        if self.fused and not x.is_cuda and (tabs := self._tables(store)) is not None:
            return self._resident(store, tabs, x.contiguous(), ids, weights, shared)
        if overlap is None:
            overlap = self.overlap_of() if self.overlap_of is not None else True
        n_tok, top_k = ids.shape
        cuda = x.device.type == "cuda"
        groups = None
        batch = self._fused
        if self.gpu:  # (on a CPU tensor only under Triton's interpreter, in tests)
            x = x.contiguous()
            groups = _Groups(ids.cpu(), weights, keep=True)  # the router's choice to the host: one sync per layer
            batch = self._grouped
            out = x.new_empty((n_tok, top_k, x.shape[-1]))  # every row written once by the kernels
            plan = getattr(store, "plan", None)
            wide = len(groups.experts) > store.capacity(self.layer)
            if (plan is not None and (wide or n_tok > 1 and not decode_batch())  # a prompt chunk (or wide)
                    and not store._pending[self.layer] and not store._draining[self.layer]):  # no prefetch in flight
                from .devplan import prefill_mode
                if (mode := prefill_mode()) != "off":
                    shared_out = self._tier_prefill(store, plan, mode, groups, x, out, shared)
                    return self._finish(out, weights, groups, cuda), shared_out
        elif self.fused and not cuda:
            x = x.contiguous()
            groups = _Groups(ids, weights, pairs=self._pairs())
            out = x.new_empty((n_tok, top_k, x.shape[-1]))  # every row written once by the kernels
        else:
            out = x.new_zeros((n_tok, top_k, x.shape[-1]))
        if groups is not None:
            experts = groups.experts  # sorted real ids
        elif cuda:  # the router's choice to the host: one small copy (and the one sync) per layer
            experts = np.unique(ids.cpu().numpy()).tolist()
        else:
            experts = torch.unique(ids).tolist()  # sorted real ids
        cap = store.capacity(self.layer)
        size = cap // 2 if overlap and len(experts) > cap and cap >= 2 else cap
        tiles = [experts[i:i + size] for i in range(0, len(experts), size)]
        shared_out = None
        if shared is not None and not overlap:
            shared_out = shared(x)
        unjoined: list = []  # tickets whose reads were started and not yet joined (discarded on an error)

        def start(tile: list[int], pinned: list[int] = ()) -> tuple[list[int], object]:
            slot_ids, ticket = store.prepare(self.layer, tile, pinned=pinned)
            unjoined.append(ticket)
            return slot_ids, ticket

        try:
            nxt = start(tiles[0])
            if shared is not None and overlap:
                shared_out = shared(x)  # runs while the IO threads read the first tile's misses
            for ti, tile in enumerate(tiles):
                slot_ids, ticket = nxt
                if overlap and ti + 1 < len(tiles):  # start the next tile's reads; this tile stays pinned
                    nxt = start(tiles[ti + 1], pinned=tile)
                slot_of = dict(zip(tile, slot_ids, strict=True))
                if overlap:  # hits first, then each miss as soon as its own reads are joined
                    reading = store.reading(ticket)
                    misses = set(reading)
                    order = [e for e in tile if e not in misses] + reading
                else:  # one join, then the tile in order
                    store.wait(ticket)
                    reading, misses, order = [], set(), tile
                if groups is not None:  # hits in one call, then each batch of misses whose reads are joined
                    hits = [e for e in order if e not in misses]
                    if hits:
                        batch(store, groups, hits, slot_of, x, out)
                    done = 0
                    while done < len(reading):
                        ready = max(done + 1, store.ready(ticket))
                        store.wait(ticket, through=reading[ready - 1])
                        batch(store, groups, reading[done:ready], slot_of, x, out)
                        done = ready
                else:
                    for expert in order:
                        if expert in misses:
                            store.wait(ticket, through=expert)
                        tok, kk = (ids == expert).nonzero(as_tuple=True)
                        if cuda:
                            store.device_ready(self.layer)
                        y = self._expert(store, slot_of[expert], x[tok], expert)
                        out[tok, kk] = y * weights[tok, kk, None]
                        if cuda:
                            store.used(self.layer)
                unjoined.remove(ticket)  # every read of it was joined above
                if not overlap and ti + 1 < len(tiles):
                    nxt = start(tiles[ti + 1])
        except BaseException:
            for ticket in unjoined:
                store.discard(ticket)
            raise
        return self._finish(out, weights, groups, cuda), shared_out

    def _finish(self, out: torch.Tensor, weights: torch.Tensor, groups: _Groups | None, cuda: bool) -> torch.Tensor:
        """The routed output [tokens, hidden] from the rows ``out`` float32 [tokens, top_k, hidden], each token's
        top-k rows summed in top-k order (the grouped path on CUDA: weighted there, gpu/tmoe.py)."""
        if self.gpu and (tmoe := _tmoe_if(out)) is not None:  # _grouped left the rows unweighted
            return tmoe.weighted_sum(out.view(-1, out.shape[-1]), weights, out.shape[1])
        if groups is not None and not cuda:
            return topk_sum(out)
        return out.sum(dim=1)

    def _resident(self, store: ExpertStore, tabs: np.ndarray, x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, shared: Callable[[torch.Tensor], torch.Tensor] | None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`__call__` when every expert is in place (``tabs``: :meth:`_tables`): one planned C call, no tiles,
        nothing to read or join (so ``overlap`` changes nothing); x float32 [tokens, hidden] contiguous. The output
        rows of a call of at most :data:`KEPT_ROWS_FLOATS` values (a decode step) go to a buffer kept between calls
        (every row written once by the kernels)."""
        groups = _Groups(ids, weights, pairs=self._pairs(), tabs=tabs)
        store.prepare(self.layer, groups.experts)  # counts the hits (and records the routing trace)
        shared_out = shared(x) if shared is not None else None
        shape = (ids.shape[0], ids.shape[1], x.shape[1])
        n = shape[0] * shape[1] * shape[2]
        if n > KEPT_ROWS_FLOATS:
            out = x.new_empty(shape)
        else:
            if self._out_buf is None or self._out_buf.numel() < n:
                self._out_buf = torch.empty(n, dtype=torch.float32)
            out = self._out_buf[:n].view(shape)
        self._fused(store, groups, groups.experts, {e: e for e in groups.experts}, x, out)
        return topk_sum(out), shared_out

    def _pairs(self) -> kernels.MoEPairs:
        """This layer's pair plan arrays (kernels.MoEPairs), made at the first call."""
        p = self._pair_bufs
        if p is None:
            p = self._pair_bufs = kernels.MoEPairs(self.mats["down"].n_experts, 3)
        return p

    def _tables(self, store: ExpertStore) -> np.ndarray | None:
        """int64 [3, n_experts]: each expert's gate, up and down address when ``store`` holds every expert in place
        (a CPU :class:`ResidentStore`: slot = expert, lead 0, its tensors fixed), else None. Kept per store."""
        if type(store) is not ResidentStore or store.device.type != "cpu":
            return None
        key = self._tab_key
        if key is not None and key[0]() is store:
            return key[1]
        tabs, leads = self.slot_rows(store)
        for m, lead in enumerate(leads):
            tabs[m] += lead
        self._tab_key = (weakref.ref(store), tabs)
        return tabs

    def slot_rows(self, store: ExpertStore) -> tuple[np.ndarray, list[np.ndarray]]:
        """(int64 [3, slots], [3 x int64 [slots]]) for a CPU store's pools: each slot's gate, up and down address
        without its lead (a merged gate_up's ``up`` n_ff rows after its gate), and the store's own lead arrays of
        those matrices (``store.lead``, updated in place as reads land): slot s's matrix m starts at
        ``rows[m, s] + leads[m][s]``."""
        names = ("gate_up", "gate_up", "down") if self.merged else ("gate", "up", "down")
        n = store.capacity(self.layer)
        rows = np.empty((3, n), dtype=np.int64)
        for m, name in enumerate(names):
            pool = store.matrix(self.layer, name)
            rows[m] = pool.data_ptr() + np.arange(n, dtype=np.int64) * pool.stride(0)
        if self.merged:
            rows[1] += self.n_ff * (self.mats["gate_up"].bytes_per_expert // self.mats["gate_up"].rows)
        return rows, [store.lead(self.layer, name) for name in names]

    def _fused(self, store: ExpertStore, groups: _Groups, experts: list[int], slot_of: dict[int, int],
               x: torch.Tensor, out: torch.Tensor) -> None:
        """``experts`` (real ids, their slots in ``slot_of``) for every token routed to them, in one C call:
        writes their rows of ``out`` [tokens, top_k, hidden], routing weights applied."""
        m = self.mats
        if groups.addr is not None and experts is groups.experts:  # resident: every expert, addresses planned
            gu_info = m["gate_up" if self.merged else "gate"]
            kernels.moe_planned(x, gu_info.ggml_type, m["down"].ggml_type, groups.pairs, len(experts),
                                gu_info.bytes_per_expert // gu_info.rows, m["down"].bytes_per_expert // m["down"].rows,
                                self.n_ff, self.kernel_act, out.view(-1, out.shape[-1]), bias=self.kernel_bias)
            return
        slots = np.fromiter((slot_of[e] for e in experts), dtype=np.int64, count=len(experts))

        def first_byte(name: str) -> np.ndarray:  # address of each expert's matrix: pool + slot row + lead
            pool = store.matrix(self.layer, name)
            return pool.data_ptr() + slots * pool.stride(0) + store.lead(self.layer, name)[slots]

        if self.merged:
            gate = first_byte("gate_up")
            up = gate + self.n_ff * (m["gate_up"].bytes_per_expert // m["gate_up"].rows)
            t_gu, gu_info = m["gate_up"].ggml_type, m["gate_up"]
        else:
            gate, up = first_byte("gate"), first_byte("up")
            t_gu, gu_info = m["gate"].ggml_type, m["gate"]
        down = first_byte("down")
        start, tok, w, dst = groups.select(experts)
        kernels.moe(x, t_gu, m["down"].ggml_type, gate, up, down, gu_info.bytes_per_expert // gu_info.rows,
                    m["down"].bytes_per_expert // m["down"].rows, self.n_ff, self.kernel_act, start, tok, w, dst,
                    out.view(-1, out.shape[-1]), bias=self.kernel_bias,
                    real=None if self.kernel_bias is None else np.asarray(experts, dtype=np.int64))

    def _grouped(self, store: ExpertStore, groups: _Groups, experts: list[int], slot_of: dict[int, int],
                 x: torch.Tensor, out: torch.Tensor) -> None:
        """CUDA: ``experts`` (real ids, their slots in ``slot_of``) for every token routed to them, as one grouped
        Triton launch per matrix (gpu/tkernels.py ``grouped``: slot ids address the pool, real ids everything
        else); writes their rows of ``out`` [tokens, top_k, hidden], routing weights applied. The kernels'
        configuration depends on the call's token count only (``m_hint``), so which experts share a launch (hits,
        each batch of joined misses, resident: all) never changes a bit."""
        from ..gpu import tkernels

        slots = np.fromiter((slot_of[e] for e in experts), dtype=np.int64, count=len(experts))
        start, tok, _, dst = groups.select(experts)
        mats = self._mat_names()
        offs = [slots * store.matrix(self.layer, n).stride(0) + store.lead(self.layer, n)[slots] for n in mats]
        (launch,) = self._upload_launches([(offs, start, tok, dst, np.asarray(experts, dtype=np.int64))], out, x.device)
        store.device_ready(self.layer)
        self._run({n: store.matrix(self.layer, n) for n in mats}, launch, [tkernels.alignment(o) for o in offs],
                  groups, x, out)
        store.used(self.layer)

    def _mat_names(self) -> list[str]:
        """The layer's matrices in launch order: gate_up or gate and up, then down."""
        return ["gate_up", "down"] if self.merged else ["gate", "up", "down"]

    def _upload_launches(self, launches: list[tuple], out: torch.Tensor, dev: torch.device,
                         extra: np.ndarray | None = None) -> list[tuple]:
        """Everything the grouped launches of ``launches`` need, on the device in one upload (no host sync).

        launches: per launch ``(offs, start, tok, dst, experts)``: offs a list of int64 [G] byte offsets (one per
        matrix, :meth:`_mat_names` order) from the pool the launch reads; start int [G + 1] (the pairs of group g are
        start[g]..start[g + 1]); tok int [P] (each pair's row of x); dst int [P] (each pair's row of ``out`` viewed
        [tokens * top_k, hidden]); experts int64 [G] (real ids: the biases). extra: int64 [n] uploaded with them
        (returned last; None: nothing). Returns per launch ``(offsets [int64 [G] per matrix], tiles int32
        [n_tiles, 3], tok int32 [P], rows int32 [P] (0..P-1), dst int64 [P], real int64 [P] (or empty), P)``,
        tiles planned for ``m_hint`` = the call's token count, followed by ``extra`` on the device when given."""
        from ..gpu import tkernels

        m_hint = out.shape[0]
        h64, h32, spans = [], [], []
        for offs, start, tok, dst, experts in launches:
            start = np.asarray(start, dtype=np.int64)
            p, g = int(start[-1]), len(start) - 1
            tiles = tkernels.plan_tiles(start, m_hint)
            real = np.repeat(experts, np.diff(start)) if self.bias is not None else np.zeros(0, np.int64)
            spans.append((g, p, len(real), len(tiles)))
            h64 += [*offs, np.asarray(dst, dtype=np.int64), real]
            h32 += [np.asarray(tok, dtype=np.int32), np.arange(p, dtype=np.int32), tiles.reshape(-1)]
        if extra is not None:
            h64.append(extra)
        a64 = np.concatenate(h64).astype(np.int64, copy=False)
        a32 = np.concatenate(h32).astype(np.int32, copy=False)
        blob = tkernels._upload(np.concatenate([a64.view(np.uint8), a32.view(np.uint8)]), dev)  # one upload
        i64, i32 = blob[:a64.nbytes].view(torch.int64), blob[a64.nbytes:].view(torch.int32)
        res, at64, at32 = [], 0, 0
        n_mats = len(self._mat_names())
        for g, p, n_real, n_tiles in spans:
            offs_dev = [i64[at64 + k * g:at64 + (k + 1) * g] for k in range(n_mats)]
            at64 += n_mats * g
            d_dst, d_real = i64[at64:at64 + p], i64[at64 + p:at64 + p + n_real]
            at64 += p + n_real
            d_tok, d_rows = i32[at32:at32 + p], i32[at32 + p:at32 + 2 * p]
            d_tiles = i32[at32 + 2 * p:at32 + 2 * p + 3 * n_tiles].view(-1, 3)
            at32 += 2 * p + 3 * n_tiles
            res.append((offs_dev, d_tiles, d_tok, d_rows, d_dst, d_real, p))
        if extra is not None:
            res.append(i64[at64:at64 + len(extra)])
        return res

    def _run(self, pools: dict[str, torch.Tensor], launch: tuple, aligns: list[int], groups: _Groups,
             x: torch.Tensor, out: torch.Tensor) -> None:
        """One grouped launch per matrix of ``launch`` (from :meth:`_upload_launches`) over ``pools`` (matrix name
        -> uint8 [rows, stride], the tensor its offsets address; ``aligns``: a power of two dividing each matrix's
        offsets), the activation, and the pairs' rows scattered into ``out`` [tokens, top_k, hidden] (weighted
        here unless gpu/tmoe.py weights them at the end)."""
        from ..gpu import tkernels

        offs, d_tiles, d_tok, d_rows, d_dst, d_real, p = launch
        m, dev, m_hint = self.mats, x.device, out.shape[0]

        def mm(k: int, name: str, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            mat = m[name]
            y = torch.empty((p, mat.rows), dtype=torch.float32, device=dev)
            y = tkernels.grouped_planned(v, pools[name], offs[k], d_tiles, rows, mat.ggml_type, mat.rows, mat.cols,
                                         m_hint, y, align=aligns[k])
            return self._add_bias(name, y, d_real)

        if self.merged:
            gate, up = mm(0, "gate_up", x, d_tok).split(self.n_ff, dim=-1)
            y = mm(1, "down", self.act(gate, up).contiguous(), d_rows)
        else:
            gate, up = mm(0, "gate", x, d_tok), mm(1, "up", x, d_tok)
            y = mm(2, "down", self.act(gate, up).contiguous(), d_rows)
        if _tmoe_if(y) is None:  # else the weights are applied by tmoe.weighted_sum at the end of __call__
            y.mul_(groups.weights.reshape(-1)[d_dst, None])
        out.view(-1, out.shape[-1]).index_copy_(0, d_dst, y)

    def _tier_prefill(self, store: ExpertStore, plan: object, mode: str, groups: _Groups, x: torch.Tensor,
                      out: torch.Tensor, shared: Callable[[torch.Tensor], torch.Tensor] | None,
                      ) -> torch.Tensor | None:
        """A prompt chunk's experts when the store's host tier holds every expert (experts/devplan.py; issue 24,
        item 5): one pass over each selected expert, its tokens in tiles, nothing read from the disk and no slot
        changed. Writes the rows of ``out`` float32 [tokens, top_k, hidden] as :meth:`_grouped` does; returns the
        shared/dense FFN's output (or None), computed while the first copies run.

        The experts that hold a slot are computed from the pool in one launch per matrix. The others (misses)
        come from the pinned tier rows, by ``mode`` (devplan.PREFILL_MODES): "copy"/"gather" in batches of
        ``plan.prefill.batch`` experts through the double-buffered VRAM scratch (batch j + 1's copies run on the
        copy stream while batch j computes, devplan.PrefillScratch); "direct": one launch per matrix whose kernels
        read the mapped tier rows themselves (each expert's bytes cross PCIe once per tile of tokens). Host work
        per layer: the one sync that brought the ids to the host (``__call__``), one upload, the copies (one per
        run of consecutive tier rows and matrix) and the launches; no allocation beyond the launches' outputs.
        The kernels and their configuration (``m_hint`` = the chunk's tokens) are those of every other path, so
        only the addresses differ: the bits equal the resident store's and streaming off's."""
        from ..gpu import tkernels
        from .devplan import PREFILL_BUFFERS

        la = self.layer
        plan.flush()  # promotions' copies done: the slot maps say what each slot holds
        experts = np.asarray(groups.experts, dtype=np.int64)
        slot = store.slots[la].slot_of[experts].astype(np.int64)
        hit = np.flatnonzero(slot >= 0)
        miss = np.flatnonzero(slot < 0)
        tier = store.tier
        if store.trace is not None:  # the routing trace, in requests a pool can hold (bench replays it through one)
            cap = store.capacity(la)
            for i in range(0, len(groups.experts), cap):
                store.trace.append((la, tuple(groups.experts[i:i + cap]), ()))
        store.stats.hits += len(hit)
        store.stats.misses += len(miss)
        store.stats.miss_bytes += store._expert_bytes[la] * len(miss)
        store.layer_counts[la][0] += len(hit)
        store.layer_counts[la][1] += len(miss)
        tier.hits += len(miss)
        names = self._mat_names()
        sc = plan.prefill if mode in ("copy", "gather") else None
        size = sc.batch if sc is not None else max(len(miss), 1)
        batches = [miss[i:i + size] for i in range(0, len(miss), size)]
        rows = tier.slots[la].slot_of[experts].astype(np.int64)  # each expert's tier row
        launches, pools, aligns = [], [], []
        if len(hit):
            offs = [slot[hit] * store.matrix(la, n).stride(0) + store.lead(la, n)[slot[hit]] for n in names]
            launches.append((offs, *groups.subset(hit), experts[hit]))
            pools.append({n: store.matrix(la, n) for n in names})
            aligns.append([tkernels.alignment(o) for o in offs])
        for j, b in enumerate(batches):
            if sc is not None:  # scratch rows of buffer j % PREFILL_BUFFERS
                at = (j % PREFILL_BUFFERS) * sc.batch + np.arange(len(b), dtype=np.int64)
                src = sc.views[la]
            else:  # the tier rows themselves, through their device address
                at, src = rows[b], plan.tier_dev[la]
            offs = [at * src[n].stride(0) + tier.leads[la][n][experts[b]] for n in names]
            launches.append((offs, *groups.subset(b), experts[b]))
            pools.append({n: src[n] for n in names})
            aligns.append([tkernels.alignment(o) for o in offs])
        gather = sc is not None and sc.mode == "gather"
        extra = rows[miss] if gather and len(miss) else None
        launches_dev = self._upload_launches(launches, out, x.device, extra=extra) if launches else []
        rows_dev = launches_dev.pop() if extra is not None else None
        after = None
        if rows_dev is not None and x.device.type == "cuda":  # gather kernels on the copy stream read the upload
            after = torch.cuda.Event()
            after.record()
        n_hit = 1 if len(hit) else 0

        def fill(j: int) -> None:
            b = batches[j]
            ids = None if rows_dev is None else rows_dev[j * sc.batch:j * sc.batch + len(b)]
            sc.fill(la, j % PREFILL_BUFFERS, rows[b], ids, after)

        if sc is not None:
            for j in range(min(PREFILL_BUFFERS, len(batches))):
                fill(j)
            tier.bytes_copied += sum(len(b) for b in batches) * sum(v.shape[1] for v in sc.views[la].values())
        store.device_ready(la)  # (nothing staged into the slots is pending here; kept for the ordering contract)
        shared_out = shared(x) if shared is not None else None  # while the first copies run
        if n_hit:
            self._run(pools[0], launches_dev[0], aligns[0], groups, x, out)
        for j in range(len(batches)):
            k = n_hit + j
            if sc is not None:
                sc.ready(j % PREFILL_BUFFERS)
            self._run(pools[k], launches_dev[k], aligns[k], groups, x, out)
            if sc is not None:
                sc.release(j % PREFILL_BUFFERS)
                if j + PREFILL_BUFFERS < len(batches):
                    fill(j + PREFILL_BUFFERS)
        store.used(la)
        return shared_out

    def on_device(self, store: ExpertStore) -> bool:
        """Whether :meth:`resident_step` can compute this layer: Triton kernels, every expert addressed by the GPU
        in place (a ResidentStore on CUDA: VRAM or pinned host pools, no routing trace) or a device-planned store
        (experts/devplan.py), no synthetic routing."""
        planned = getattr(store, "plan", None) is not None  # records its routing trace itself (devplan.py)
        return (self.gpu and self.routing is None and store.device.type == "cuda"
                and (planned or (isinstance(store, ResidentStore) and getattr(store, "trace", None) is None)))

    def resident_step(self, store: ExpertStore, x: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, planned: Any = None) -> torch.Tensor:
        """One decode token's routed experts with nothing on the host: x float32 [1, hidden], ids int64 [1, top_k]
        real expert ids (= slot ids: every expert is resident), weights float32 [1, top_k] -> [1, hidden].
        With a device-planned store (experts/devplan.py: its host tier holds every expert) the pool rows come from
        the device table instead, the misses copied from the tier into scratch rows first (``store.plan.slots``).
        ``planned`` (a streaming store's segmented step, devplan.SegmentOffsets): the pairs' byte offsets in the
        pools were written to the device by the host, after it planned this token's slots and joined its reads.

        No synchronisation and no host-dependent shapes, so a CUDA graph can capture it (models/graphs.py). Without
        a device plan the kernels look each pair's expert up in a table of offsets by its id (no kernels to compute
        offsets), and separate gate and up experts of one type and shape go in one launch. The pairs stay in top-k
        order, one tile each; every pair's row is computed by the same kernel configuration
        as in ``__call__`` (``m_hint`` 1) and the rows are summed in top-k order, so the bits equal the streaming
        path's. Counts nothing: the graph runner counts each replay's hits."""
        from ..gpu import tkernels

        dev = x.device
        top_k = ids.shape[1]
        plan = getattr(store, "plan", None) if planned is None else planned
        # kept per (store, plan) object, not per id(): a closed store's id is soon another store's, and its tables
        # (offsets between that store's pools) must never address the new one's
        const = getattr(self, "_dev_const", None)
        if (const is None or const[0]() is not store or const[1] != (top_k, dev)
                or (const[2] is None) != (plan is None) or (plan is not None and const[2]() is not plan)):
            const = self._dev_const = (weakref.ref(store), (top_k, dev), None if plan is None else weakref.ref(plan),
                                       self._device_tables(store, top_k, dev, plan))
        c = const[3]
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]  # real ids (= slot ids here), as in __call__
        flat = ids.reshape(-1)
        x = x.contiguous()
        slots = None if plan is None else plan.slots(self.layer, flat)  # misses copied into scratch rows first

        def mm(names: list[str], v: torch.Tensor, src: torch.Tensor) -> list[torch.Tensor]:
            """The matrices ``names`` (one type and shape) of every pair, in one launch -> [top_k, rows] each."""
            mat, pool = self.mats[names[0]], store.matrix(self.layer, names[0])
            n = len(names)
            y = torch.empty((n * top_k, mat.rows), dtype=torch.float32, device=dev)
            if plan is None:  # the offsets looked up by the kernel: table[j * E + ids[i]] (tkernels.grouped_selected)
                tkernels.grouped_selected(v, pool, c["table"][tuple(names)], flat, n, c["tiles"][n], src,
                                          mat.ggml_type, mat.rows, mat.cols, 1, y, align=c["align"][tuple(names)])
            else:
                offs = plan.offsets(self.layer, names[0], flat, slots, pool.stride(0))
                tkernels.grouped_planned(v, pool, offs, c["tiles"][1], src, mat.ggml_type, mat.rows, mat.cols, 1,
                                         y, align=c["align"][tuple(names)])
            return [self._add_bias(name, y[j * top_k:(j + 1) * top_k], flat) for j, name in enumerate(names)]

        if self.merged:
            gate, up = mm(["gate_up"], x, c["zeros"][1])[0].split(self.n_ff, dim=-1)
        elif c["gate_up_together"]:
            gate, up = mm(["gate", "up"], x, c["zeros"][2])
        else:
            (gate,), (up,) = mm(["gate"], x, c["zeros"][1]), mm(["up"], x, c["zeros"][1])
        (y,) = mm(["down"], self.act(gate, up).contiguous(), c["rows"])
        if (tmoe := _tmoe_if(y)) is not None:  # as __call__ ends on the grouped path: the same bits
            return tmoe.weighted_sum(y, weights, top_k)
        y.mul_(weights.reshape(-1)[:, None])
        return y.view(1, top_k, -1).sum(dim=1)

    def _device_tables(self, store: ExpertStore, top_k: int, dev: torch.device, plan: Any) -> dict:
        """What :meth:`resident_step` keeps on the device per (store, top_k, plan): tiles and x rows for 1 or 2
        matrices per launch; without a ``plan`` (a DevicePlan or SegmentOffsets), per group of matrices launched
        together, the table of per-expert byte offsets from the first matrix's pool (``e * stride + lead[e]``; the
        second matrix's table adds its pool's distance from the first) and its alignment; whether separate gate and
        up experts (one type and shape) go in one launch."""
        from ..gpu import tkernels

        names = ["gate_up"] if self.merged else ["gate", "up"]
        together = (not self.merged and plan is None
                    and (self.mats["gate"].ggml_type, self.mats["gate"].rows, self.mats["gate"].cols)
                    == (self.mats["up"].ggml_type, self.mats["up"].rows, self.mats["up"].cols))
        groups = ([["gate", "up"]] if together else [[n] for n in names]) + [["down"]]
        table, align = {}, {}
        for g in groups:
            first = store.matrix(self.layer, g[0])
            if plan is not None:  # a power of two dividing every offset plan.offsets can compute
                align[tuple(g)] = tkernels.alignment(first.stride(0), plan.lead_align[g[0]])
                continue
            parts = []
            for n in g:
                pool, lead = store.matrix(self.layer, n), store.lead(self.layer, n).astype(np.int64)
                parts.append(pool.data_ptr() - first.data_ptr() + np.arange(len(lead), dtype=np.int64)
                             * pool.stride(0) + lead)
            t = np.concatenate(parts)
            table[tuple(g)] = torch.from_numpy(t).to(dev)
            align[tuple(g)] = tkernels.alignment(t)
        return {"table": table, "align": align, "gate_up_together": together,
                "tiles": {n: torch.from_numpy(tkernels.plan_tiles(np.arange(n * top_k + 1), 1)).to(dev)
                          for n in (1, 2)},
                "zeros": {n: torch.zeros(n * top_k, dtype=torch.int32, device=dev) for n in (1, 2)},
                "rows": torch.arange(top_k, dtype=torch.int32, device=dev)}

    def _add_bias(self, name: str, y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """y float32 [pairs, rows] of matrix ``name`` plus its per-expert bias rows gathered by ``real`` (int64
        [pairs], each pair's real expert id; the biases stay resident, never in a slot): one float32 add per
        element, as :meth:`_expert`'s ``y + bias[expert]``. y itself when the layer has no bias for ``name``."""
        if self.bias is None or name not in self.bias:
            return y
        return y.add_(self.bias[name].index_select(0, real))

    def _expert(self, store: ExpertStore, slot: int, xs: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert's FFN on xs [n, hidden] with its matrices at ``slot`` of the store's pools; its biases (if
        any) are those of real expert id ``expert``."""
        def lin(name: str, v: torch.Tensor) -> torch.Tensor:
            m = self.mats[name]
            lead = int(store.lead(self.layer, name)[slot])
            raw = store.matrix(self.layer, name)[slot, lead:lead + m.bytes_per_expert].view(m.rows, -1)
            if raw.device != v.device:  # a host pool (--pool host) on CUDA: copy the expert's blocks over
                raw = raw.to(v.device)
            if self.blocks and v.device.type == "cpu" and kernels.computes(m.ggml_type, m.cols):
                y = kernels.linear(v, raw, m.ggml_type, m.cols)
            else:
                y = quant.linear(v, raw, m.ggml_type, m.cols)
            if self.bias is not None and name in self.bias:
                y = y + self.bias[name][expert]  # real id: the biases stay resident, never in a slot
            return y

        if self.merged:
            gu = lin("gate_up", xs)
            gate, up = gu.chunk(2, dim=-1)
        else:
            gate, up = lin("gate", xs), lin("up", xs)
        return lin("down", self.act(gate, up))


class _Groups:
    """The (token, k) pairs of one MoE call grouped by expert once (a stable sort of the real ids).

    ids: [tokens, top_k] int64 real expert ids; weights: [tokens, top_k] float32 routing weights.
    """

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, keep: bool = False,
                 pairs: kernels.MoEPairs | None = None, tabs: np.ndarray | None = None):
        #: with ``tabs``: int64 [3, groups], each expert's gate, up and down address (rows of ``pairs.addr``)
        self.addr = None
        self.pairs = pairs
        if pairs is not None:  # CPU: grouped by the step kernels into kept arrays (the same order as below)
            ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
            if weights.dtype != torch.float32 or not weights.is_contiguous():
                weights = weights.to(torch.float32).contiguous()
            n, p = pairs.plan(ids, weights, tabs), ids.numel()
            self.weights, self.tok, self.dst, self.w = weights, pairs.tok[:p], pairs.dst[:p], pairs.w[:p]
            self._start = pairs.start[:n + 1]
            self.experts = pairs.experts[:n].tolist()
            self._span: dict | None = None
            self._all = (self._start, self.tok, self.w, self.dst)
            if tabs is not None:
                self.addr = pairs.addr[:, :n]
            return
        flat = ids.reshape(-1).cpu().numpy()
        top_k = ids.shape[1]
        order = np.argsort(flat, kind="stable")  # pairs sorted by expert, token order inside
        self.tok = (order // top_k).astype(np.int32)  # row of x
        self.dst = order.astype(np.int32)  # row of out viewed [tokens * top_k, hidden]
        self.weights = weights  # [tokens, top_k] where they are (the GPU path gathers them by pair there)
        if keep or weights.device.type == "cuda":
            self.w = None
        else:
            self.w = np.ascontiguousarray(weights.reshape(-1).detach().cpu().numpy()[order], dtype=np.float32)
        by_expert = flat[order]
        bounds = (np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1).tolist()
        first, end = [0, *bounds], [*bounds, len(flat)]
        #: the distinct real ids, ascending
        self.experts = by_expert[first].tolist()
        self._span = {e: (f, b) for e, f, b in zip(self.experts, first, end, strict=True)}
        self._all = (np.array([*first, len(flat)], dtype=np.int32), self.tok, self.w, self.dst)

    @property
    def span(self) -> dict[int, tuple[int, int]]:
        """{real id: (first, end)}: the positions of its pairs in the grouped order."""
        if self._span is None:
            bounds = self._start.tolist()
            self._span = {e: (bounds[g], bounds[g + 1]) for g, e in enumerate(self.experts)}
        return self._span

    def subset(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start int64 [len(idx) + 1], tok int32, dst int32) of the pairs of the groups ``idx`` (int64 indices
        into ``experts``, in that order), without a loop over them."""
        first = self._all[0].astype(np.int64)
        cnt = first[idx + 1] - first[idx]
        start = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(cnt, out=start[1:])
        pos = np.repeat(first[idx] - start[:-1], cnt) + np.arange(start[-1], dtype=np.int64)
        return start, self.tok[pos], self.dst[pos]

    def select(self, experts: list[int]) -> tuple:
        """(start int32 [len(experts) + 1], tok int32, w float32 (None for GPU weights), dst int32) of ``experts``'
        pairs, in that order."""
        if experts == self.experts:  # every expert of the call, ascending (a decode step whose experts are all hits)
            return self._all
        spans = [self.span[e] for e in experts]
        start = np.zeros(len(spans) + 1, dtype=np.int32)
        np.cumsum([b - a for a, b in spans], out=start[1:])
        idx = np.concatenate([np.arange(a, b) for a, b in spans]) if len(spans) > 1 else np.arange(*spans[0])
        w = None if self.w is None else self.w[idx]
        return start, self.tok[idx], w, self.dst[idx]
