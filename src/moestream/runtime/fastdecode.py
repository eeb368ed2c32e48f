"""The CPU decode step of a Qwen3-MoE-shaped model (and of the families close to it) as a handful of C calls per layer.

Between two matmuls a decode step has little arithmetic, but every torch op and Python frame there runs with cold
caches (the matmul before it streamed tens of MB of weights through them): measured on a 2-core EPYC, an empty
``torch.empty`` costs 1 us hot and 60 us right after such a stream. So the eager step (runner.py) spends ms per
token outside its matmuls. This step keeps one token's activations in buffers made once per model and runs each
layer as:

- the q, k, v projections (kernels.linear_to: ms_linear into the kept buffers), their biases added
  (ms_residual_norm's add) and RMSNorm over each whole projection (ms_rms_norm) where the family has them;
- ms_attn_block: per-head q/k RMSNorm (where the family has it), RoPE by the layer's tables (after each head's dims
  are de-interleaved, for llama files), the cache rows written, attention over the cache (with the layer's sliding
  window and sinks, gpt-oss);
- the output projection (plus its bias, gpt-oss); ms_residual_norm: x += o, h = RMSNorm(x) by ``ffn_norm``;
- the router's own ``linear`` (as the eager step calls it); ms_route_plan: softmax top-k, renormalisation and the
  pairs grouped by expert (resident: with each expert's addresses, the store holds every expert in place); or the
  family's own torch router (gpt-oss's ``gate``: top-k of the biased logits, softmax among them) and the pairs
  grouped by ms_moe_pairs;
- resident: ms_moe (kernels.moe_to) over every expert, with the layer's activation code and per-expert biases
  gathered by real id (gpt-oss). Streaming (a CPU StreamingStore, --moe-stream on): the store
  plans the slots (``store.prepare``: hits, misses, evictions by its policy, this step's experts pinned) and starts
  the misses' reads at once; the hits are computed first, in one ms_moe call over their slots' addresses, then each
  batch of misses whose reads are joined (``ready`` / ``wait``), as MoE.__call__ overlaps them;
- a shared expert (qwen2moe): the family's own ``shared`` (torch), run where MoE.__call__ runs it (after the slots
  are planned and the reads started);
- ms_residual_norm: x += the sum of the top-k rows (then + the shared expert's output), h = RMSNorm(x) by the next
  layer's ``attn_norm`` (after the last layer ``out_norm``, then the output projection).

What differs between families is stated by the family (``MoEModel.fast_layer`` -> :class:`FastLayer`: its q/k norms,
biases, RoPE layout, attention scale, top-k renormalisation, shared expert), not written again here.

Each of those is the kernel the eager step runs, on the same values in the same order (the rows of one ms_moe call
do not depend on which other experts share the call), so the logits are the same bits, streaming or resident
(tools/record_logits.py; tests/test_runner.py), and the store sees the same calls in the same order (its counters
and routing trace are the eager step's). With the router lookahead (``--prefetch on``) each layer starts with the
eager step's own ``MoEModel.begin_layer`` on its input (the family's ``predict``, then ``store.prefetch``). A read
error is raised by ``store.wait`` as in the eager step; on any error after the slots are planned the step's reads
settle and their slots are emptied (``store.discard``, as MoE.__call__) before it propagates.

It runs where :func:`plan` finds the model fits it: a family class that defines ``fast_layer`` itself (not inherited:
qwen3moe, llama (Mixtral), olmoe, qwen2moe, glm4moe, gpt-oss), every MoE layer fused (one ms_moe call: MoE.fused)
without a per-expert output scale, one sequence of one token on the CPU, every matmul on the C kernels, a resident
store or a streaming one with host pools on the CPU (not the device-planned step of experts/devplan.py), no
synthetic routing, the step kernels on (layers.C_RMS_NORM, C_ATTENTION). Anything else runs the eager step.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import kernels
from ..experts.moe import KEPT_ROWS_FLOATS
from ..experts.pool import ResidentStore, StreamingStore
from ..models import layers


@dataclass(frozen=True)
class FastLayer:
    """What a family's ``mix`` and MoE layer compute in layer i, in the fast step's terms (``MoEModel.fast_layer``):
    the family states it, the step runs the same kernels in the same order (the eager step's bits).

    Attention: RMSNorm of the ``attn_norm``-normed x, the q, k, v projections (plus ``biases`` (bq, bk, bv),
    float32 vectors added as ``linear_bias`` adds them); with ``whole_norm`` RMSNorm of the whole q and k
    projections by ``q_norm`` / ``k_norm`` (olmoe), else per head (qwen3moe; None: no norm); ``deinterleave``: each
    q and k head's dims reordered (0, 2, 4, ..., 1, 3, 5, ...) before RoPE (llama files, models/llama.py); RoPE by
    ``rope`` (a layers.Rope: its tables, scale and layout; None: ``model.rope``); attention scaled by ``scale``, over
    the last ``window`` positions (0: all; kernels.attention's ``window``) with ``sinks`` (float32 [n_head]
    contiguous: one more logit per head in the softmax's denominator; None: none); the output projection plus
    ``o_bias`` (float32 [hidden], one add per element, before the residual add: ``x + (W_o a + b_o)``; gpt-oss).
    MoE: ``ffn_norm``, the router's ``linear``, then kernels.route's router with these arguments (``gating``,
    ``route_bias``, ``n_group``, ``topk_group``, ``norm_topk``, ``floor``, ``route_scale``: layers.softmax_topk's or
    routing.sigmoid_group_topk's call), or with ``own_gate`` the family's ``gate(block, h)`` (its own torch code,
    as the eager step calls it: gpt-oss, whose top-k-then-softmax routing the C router does not compute in torch's
    bits) and the pairs planned by ms_moe_pairs (kernels.MoEPairs.plan); the routed experts as the layer's MoE
    computes them in one ms_moe call (its activation code and per-expert biases, ``MoE.kernel_bias``, gathered by
    real id); with ``shared`` the family's ``shared(i, x, h)`` (its own torch code) added after the routed sum
    (``combine``'s ``x + routed + shared``). A layer without routed experts is MoEModel.dense's SwiGLU (a family
    that overrides ``dense`` runs the eager step)."""

    scale: float
    q_norm: Any = None
    k_norm: Any = None
    whole_norm: bool = False
    deinterleave: bool = False
    biases: tuple | None = None
    norm_topk: bool = True
    shared: bool = False
    gating: int = kernels.GATING_SOFTMAX
    route_bias: Any = None
    n_group: int = 1
    topk_group: int = 1
    floor: float = 0.0
    route_scale: float = 1.0
    rope: Any = None
    window: int = 0
    sinks: Any = None
    o_bias: Any = None
    own_gate: bool = False


def _spec(w: Any) -> tuple | None:
    """(ggml type, first byte, row bytes, rows, cols) of a Weight the C kernels compute, else None."""
    if not getattr(w, "blocks", False):
        return None
    return (int(w.ggml_type), w.raw.data_ptr(), w.raw.stride(0) * w.raw.element_size(), w.rows, w.cols)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FastDecode:
    """The kept buffers and addresses of one model's fast decode step (see the module docstring); :meth:`step`
    runs one. Made by :func:`plan`, for one store."""

    def __init__(self, model: Any, lib: Any, specs: list[tuple], moes: list[Any], tabs: list[np.ndarray],
                 fls: list[FastLayer]):
        m = self.model = model
        self.lib, self.store = lib, model.store
        n, hd = m.n_embd, m.head_dim
        hdv = self.head_dim_v = getattr(m, "head_dim_v", hd)  # as MoEModel.make_cache
        f32 = torch.float32
        self.x_dim = n
        self.h = torch.empty((1, n), dtype=f32)
        self.q = torch.empty((1, m.n_head * hd), dtype=f32)
        self.k = torch.empty((1, m.n_kv * hd), dtype=f32)
        self.v = torch.empty((1, m.n_kv * hdv), dtype=f32)
        self.a = torch.empty((1, m.n_head * hdv), dtype=f32)
        self.o = torch.empty((1, n), dtype=f32)
        self.ids = torch.empty((1, m.top_k), dtype=torch.int64)
        self.w = torch.empty((1, m.top_k), dtype=f32)
        self.out = torch.empty((m.top_k, n), dtype=f32)
        self.pairs = kernels.MoEPairs(m.n_experts, 3, lib=lib)
        self.streaming = type(self.store) is StreamingStore
        k = m.top_k
        # streaming: the step's groups in compute order (hits, then misses in read order), one pair each
        self.o_addr = np.empty((3, k), dtype=np.int64)  # gate, up, down address of each group's slot
        self.o_w = np.empty(k, dtype=np.float32)
        self.o_dst = np.empty(k, dtype=np.int32)
        self.o_tok = np.zeros(k, dtype=np.int32)  # one token
        self.o_start = np.arange(k + 1, dtype=np.int32)  # group j is pair j
        self.o_real = np.empty(k, dtype=np.int64)  # each group's real expert id (the biases)
        blocks = m.blocks
        self.layers = []
        #: the distinct RoPEs of the layers (gpt-oss: sliding and full layers may have their own)
        self.ropes: list[Any] = []
        for i, b in enumerate(blocks):
            nxt = blocks[i + 1]["attn_norm"] if i + 1 < len(blocks) else m.out_norm
            fl = fls[i]
            head = not fl.whole_norm
            rope = fl.rope if fl.rope is not None else m.rope
            if not any(r is rope for r in self.ropes):
                self.ropes.append(rope)
            # (per-head q, k norms, the whole projections' norms, q/k/v biases, ms_attn_block's RoPE mode, scale,
            # the index of the layer's RoPE in self.ropes, window, sinks, o bias)
            attn = (_ptr(fl.q_norm) if head else None, _ptr(fl.k_norm) if head else None,
                    None if head else (_ptr(fl.q_norm), _ptr(fl.k_norm)),
                    None if fl.biases is None else [(yp, _ptr(t), rows) for yp, t, rows in zip(
                        (self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr()), fl.biases,
                        (m.n_head * hd, m.n_kv * hd, m.n_kv * hdv), strict=True) if t is not None],
                    2 if fl.deinterleave else int(rope.interleaved), fl.scale,
                    next(j for j, r in enumerate(self.ropes) if r is rope), int(fl.window or 0), _ptr(fl.sinks),
                    _ptr(fl.o_bias))
            moe = moes[i]
            if moe is None:  # MoEModel.dense: SwiGLU of h
                ffn = (b["gate"], b["up"], b["down"])
            else:
                gu = moe.mats["gate_up" if moe.merged else "gate"]
                down = moe.mats["down"]
                moe_spec = (int(gu.ggml_type), int(down.ggml_type), gu.bytes_per_expert // gu.rows,
                            down.bytes_per_expert // down.rows, n, moe.n_ff, moe.kernel_act,
                            kernels.bias_ptrs(moe.kernel_bias))
                route = (b["router"], int(fl.gating), _ptr(fl.route_bias), fl.n_group, fl.topk_group,
                         int(fl.norm_topk), fl.floor, fl.route_scale, b if fl.own_gate else None)
                ffn = (route, fl.shared, None if self.streaming else tabs[i].ctypes.data, moe_spec)
            self.layers.append((i, *specs[i], attn, _ptr(b["ffn_norm"]), moe is None, ffn, _ptr(nxt)))
        #: resident: int64 [3, n_experts] per layer, each expert's gate, up and down address (the layers point into
        #: them); streaming: per layer, (int64 [3, n_slots] each slot's matrices' first row, [the store's lead
        #: arrays of gate, up, down]): a slot's expert starts lead[slot] bytes into its row
        self.tabs = tabs
        self.attn_norm0 = _ptr(blocks[0]["attn_norm"])
        self._cache: tuple | None = None
        self.sh: torch.Tensor | None = None  # a layer's shared expert output (_shared)

    def _cache_ptrs(self, cache: Any) -> list[tuple[int, int]]:
        c = self._cache
        if c is None or c[0]() is not cache:
            c = self._cache = (weakref.ref(cache), [(k.data_ptr(), v.data_ptr()) for k, v in zip(cache.k, cache.v,
                                                                                                    strict=True)])
        return c[1]

    def step(self, tokens: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """One token (tokens int64 [1]) at position ``start`` of ``cache`` -> logits float32 [1, vocab]."""
        m, lib = self.model, self.lib
        nt = kernels.threads()
        n, eps, top_k = self.x_dim, m.eps, m.top_k
        n_head, n_kv, hd, hdv = m.n_head, m.n_kv, m.head_dim, self.head_dim_v
        x = m.embd.rows_of(tokens).contiguous()  # [1, hidden]: the residual stream, updated in place
        xp, hp, qp, kp, vp, ap, op = (x.data_ptr(), self.h.data_ptr(), self.q.data_ptr(), self.k.data_ptr(),
                                      self.v.data_ptr(), self.a.data_ptr(), self.o.data_ptr())
        idp, wp, outp = self.ids.data_ptr(), self.w.data_ptr(), self.out.data_ptr()
        count, experts, pstart, ptok, pw, pdst, addr = self.pairs.ptrs
        cap = self.pairs.cap
        tables = []  # per RoPE: (n_rot, its cos and sin rows of this position)
        for rope in self.ropes:
            rope.reserve(start + 1)
            n_rot = rope.n_rot
            tables.append((n_rot, rope.cos.data_ptr() + 4 * start * n_rot, rope.sin.data_ptr() + 4 * start * n_rot))
        kv = self._cache_ptrs(cache)
        kc_p, vc_p = n_kv * hd, n_kv * hdv
        store, streaming = self.store, self.streaming
        look = streaming and m.opts.prefetch  # the router lookahead
        overlap = m.opts.overlap
        lib.ms_residual_norm(1, n, xp, None, 0, self.attn_norm0, eps, hp, nt)
        for (i, q_s, k_s, v_s, o_s, attn, fn, dense, ffn, nxt) in self.layers:
            if look:
                m.begin_layer(i, x)  # the eager step's own call: x is the layer's input
            qn, kn, whole, biases, mode, scale, r, window, sinks, o_bias = attn
            n_rot, cos_p, sin_p = tables[r]
            kernels.linear_to(q_s, hp, 1, qp, lib)
            kernels.linear_to(k_s, hp, 1, kp, lib)
            kernels.linear_to(v_s, hp, 1, vp, lib)
            if biases is not None:  # y + b: one add per element (layers.linear_bias)
                for yp, bp, rows in biases:
                    lib.ms_residual_norm(1, rows, yp, bp, 0, None, 0.0, None, nt)
            if whole is not None:  # RMSNorm of each whole projection, in place (olmoe)
                lib.ms_rms_norm(1, n_head * hd, qp, n_head * hd, whole[0], eps, qp, n_head * hd, nt)
                lib.ms_rms_norm(1, n_kv * hd, kp, n_kv * hd, whole[1], eps, kp, n_kv * hd, nt)
            kcp, vcp = kv[i]
            rc = lib.ms_attn_block(1, n_head, n_kv, hd, hdv, qp, n_head * hd, hd, kp, n_kv * hd, hd, vp, n_kv * hdv,
                                   hdv, qn, kn, eps, n_rot, mode, cos_p, sin_p, kcp, kc_p, hd, vcp, vc_p, hdv, start,
                                   window, sinks, scale, 0.0, ap, n_head * hdv, nt)
            if rc:
                raise MemoryError("attention: out of memory for the score buffer")
            kernels.linear_to(o_s, ap, 1, op, lib)
            if o_bias is not None:  # W_o a + b_o, then the residual add
                lib.ms_residual_norm(1, n, op, o_bias, 0, None, 0.0, None, nt)
            lib.ms_residual_norm(1, n, xp, op, 0, fn, eps, hp, nt)
            if dense:  # x + SwiGLU(h), as MoEModel.dense
                y = layers.swiglu_ffn(*ffn, self.h).contiguous()
                lib.ms_residual_norm(1, n, xp, y.data_ptr(), 0, nxt, eps, hp, nt)
                continue
            route, has_shared, tabs, moe_s = ffn
            router, gating, r_bias, n_group, topk_group, norm_topk, floor, r_scale, gate_b = route
            if gate_b is not None:  # the family's own router (torch), then the pairs grouped as ms_route_plan does
                ids, w = m.gate(gate_b, self.h)
                g = self.pairs.plan(ids.contiguous(), w.contiguous(), None if tabs is None else self.tabs[i])
            else:
                logits = router.linear(self.h).contiguous()
                g = lib.ms_route_plan(1, logits.shape[1], logits.data_ptr(), gating, r_bias, n_group, topk_group,
                                      top_k, norm_topk, floor, r_scale, idp, wp, tabs, 3, count, experts, pstart,
                                      ptok, pw, pdst, addr, cap, nt)
                if g < 0:
                    raise ValueError(f"route: top-{top_k} of {logits.shape[1]} experts does not fit (rc {g})")
            chosen = self.pairs.experts[:g].tolist()  # ascending, as MoE.__call__ hands them to the store
            run_shared = functools.partial(self._shared, i, x) if has_shared else None
            if streaming:
                self._streamed(i, moe_s, chosen, overlap, hp, outp, run_shared)
            else:
                store.prepare(i, chosen)  # counts the hits (and records the routing trace)
                if run_shared is not None:
                    run_shared()
                kernels.moe_to(moe_s, self.pairs, g, hp, 1, outp)
            if has_shared:  # (x + routed) + shared, as combine adds them
                lib.ms_residual_norm(1, n, xp, outp, top_k, None, eps, None, nt)
                sh, self.sh = self.sh.contiguous(), None
                lib.ms_residual_norm(1, n, xp, sh.data_ptr(), 0, nxt, eps, hp, nt)
            else:
                lib.ms_residual_norm(1, n, xp, outp, top_k, nxt, eps, hp, nt)
        return m.output.linear(self.h)

    def _shared(self, i: int, x: torch.Tensor) -> None:
        """Layer i's shared expert by the family's own code (``shared(i, x, h)``, as the eager step calls it) into
        ``self.sh``."""
        self.sh = self.model.shared(i, x, self.h)

    def _streamed(self, i: int, spec: tuple, experts: list[int], overlap: bool, hp: int, outp: int,
                  shared: Any = None) -> None:
        """Layer i's routed experts through the streaming store (``experts``: the step's distinct real ids,
        ascending, group j = pair j of ``self.pairs``): the slots planned and the misses' reads started, then the
        hits in one ms_moe call over their slots, then each batch of misses as soon as its reads are joined
        (``overlap``; else one join, then every expert). ``shared``: the layer's shared expert, run once the reads
        are started, as MoE.__call__ runs it. On any error the step's reads settle and their slots are emptied
        before it propagates (MoE.__call__'s ``discard``)."""
        store = self.store
        slot_ids, ticket = store.prepare(i, experts)
        try:
            if shared is not None:
                shared()
            reading = store.reading(ticket)
            if reading and not overlap:
                store.wait(ticket)
                reading = []
            g = len(experts)
            order = list(range(g))
            if reading:  # hits first, then the misses in read order
                late = [experts.index(e) for e in reading]
                order = [j for j in order if j not in late] + late
            rows, leads = self.tabs[i]
            slots = np.asarray(slot_ids, dtype=np.int64)[order]
            a = self.o_addr
            a[:, :g] = rows[:, slots]
            for mat in range(3):
                a[mat, :g] += leads[mat][slots]  # read after prepare(): a direct read's lead is set there
            self.o_w[:g] = self.pairs.w[order]
            self.o_dst[:g] = self.pairs.dst[order]
            self.o_real[:g] = self.pairs.experts[order]
            n_hit = g - len(reading)
            if n_hit:
                self._moe(spec, 0, n_hit, hp, outp)
            done = 0
            while done < len(reading):
                ready = max(done + 1, store.ready(ticket))
                store.wait(ticket, through=reading[ready - 1])
                self._moe(spec, n_hit + done, ready - done, hp, outp)
                done = ready
        except BaseException:
            store.discard(ticket)
            raise

    def _moe(self, spec: tuple, first: int, n: int, hp: int, outp: int) -> None:
        """ms_moe over groups first..first+n-1 of the compute-order arrays (``o_*``)."""
        a, k = self.o_addr.ctypes.data, self.o_addr.shape[1]
        at = (a + 8 * first, a + 8 * (k + first), a + 8 * (2 * k + first), self.o_start.ctypes.data,
              self.o_tok.ctypes.data + 4 * first, self.o_w.ctypes.data + 4 * first, self.o_dst.ctypes.data + 4 * first,
              self.o_real.ctypes.data + 8 * first)
        kernels.moe_to(spec, self.pairs, n, hp, 1, outp, at=at)


def plan(model: Any) -> FastDecode | None:
    """The fast decode step of ``model`` when it fits it (see the module docstring), else None. Kept on the model
    and made again when its store changes."""
    if "fast_layer" not in vars(type(model)) or model.device.type != "cpu" or model.routing is not None:
        return None
    store = model.store
    streaming = type(store) is StreamingStore and store.device.type == "cpu" and store.plan is None
    if not (type(store) is ResidentStore or streaming) or not (layers.C_RMS_NORM and layers.C_ATTENTION):
        return None
    lib = kernels.step_ops()
    if lib is None:
        return None
    kept = getattr(model, "_fast_decode", None)
    if kept is not None and kept.store is store and kept.lib is lib:
        return kept
    n = model.n_embd
    if n % 64 or model.top_k > 16 or model.top_k * n > KEPT_ROWS_FLOATS:
        return None  # the top-k sum is torch's only there (experts/moe.py topk_sum)
    specs, moes, tabs, fls = [], [], [], []
    # the base class's dense FFN, not a family's own (named, not imported: models.base imports this module)
    dense_fn = type(model).dense
    own_dense = dense_fn.__qualname__ == "MoEModel.dense" and dense_fn.__module__.endswith(".models.base")
    for i, b in enumerate(model.blocks):
        fl = model.fast_layer(i)
        if fl is None:
            return None
        s = [_spec(b[name]) for name in ("q", "k", "v", "o")]
        moe = b.get("moe")
        if None in s or (moe is None and not own_dense):
            return None
        t = None
        if moe is not None:
            if not moe.fused or moe.expert_scale is not None or moe.routing is not None:
                return None
            t = moe.slot_rows(store) if streaming else moe._tables(store)
            if t is None:
                return None
        specs.append(s)
        moes.append(moe)
        tabs.append(t)
        fls.append(fl)
    if not getattr(model.output, "blocks", False) and model.output.dense is None:
        return None
    model._fast_decode = FastDecode(model, lib, specs, moes, tabs, fls)
    return model._fast_decode
