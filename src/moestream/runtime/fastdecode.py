"""The CPU decode step of a Qwen3-MoE-shaped model (and of the families close to it, Gemma 4, Qwen 3.5 and DeepSeek
too) as a handful of C calls per layer.

Between two matmuls a decode step has little arithmetic, but every torch op and Python frame there runs with cold
caches (the matmul before it streamed tens of MB of weights through them): measured on a 2-core EPYC, an empty
``torch.empty`` costs 1 us hot and 60 us right after such a stream. So the eager step (runner.py) spends ms per
token outside its matmuls. This step keeps one token's activations in buffers made once per model (sized for the
largest layer: Gemma 4's layers differ in head dim and KV heads), takes x from the family's own ``embed`` and runs
each layer as:

- the q, k, v projections (kernels.linear_to: ms_linear into the kept buffers), their biases added
  (ms_residual_norm's add) and RMSNorm over each whole projection (ms_rms_norm) where the family has them;
- ms_attn_block: per-head q/k RMSNorm (where the family has it), RoPE by the layer's tables (after each head's dims
  are de-interleaved, for llama files), the cache rows written, attention over the cache (with the layer's sliding
  window and sinks, gpt-oss); each layer with its own head dim, KV heads, RoPE tables and sliding window, V normed
  without weight first (ms_rms_norm) where the family norms it, V = the raw K projection where the layer has no V
  projection (Gemma 4). A layer that reads an earlier layer's cache (Gemma 4's shared KV) writes none: its queries
  normed (ms_rms_norm) and rotated (ms_rope), then ms_attention over that cache;
- the output projection (plus its bias, gpt-oss; RMSNorm'd by the family's post-attention norm where it has one:
  ms_rms_norm); ms_residual_norm: x += o, h = RMSNorm(x) by ``ffn_norm`` (Gemma 4: by the router's norm, times
  1/sqrt(hidden));
- the router's own ``linear`` (as the eager step calls it); ms_route_plan: softmax top-k, renormalisation and the
  pairs grouped by expert (resident: with each expert's addresses, the store holds every expert in place); or the
  family's own torch router (gpt-oss's ``gate``: top-k of the biased logits, softmax among them) and the pairs
  grouped by ms_moe_pairs; each pair's weight times its expert's output scale where the layer has one (Gemma 4,
  MoE.__call__'s product); the experts' input normed again by the family's own norm where it has one (Gemma 4's
  ``pre_norm_2``);
- resident: ms_moe (kernels.moe_to) over every expert, with the layer's activation code and per-expert biases
  gathered by real id (gpt-oss). Streaming (a CPU StreamingStore, --moe-stream on): the store
  plans the slots (``store.prepare``: hits, misses, evictions by its policy, this step's experts pinned) and starts
  the misses' reads at once; the hits are computed first, in one ms_moe call over their slots' addresses, then each
  batch of misses whose reads are joined (``ready`` / ``wait``), as MoE.__call__ overlaps them;
- a shared expert (qwen2moe; Gemma 4's dense GeGLU FFN): the family's own ``shared`` (torch), run where
  MoE.__call__ runs it (after the slots are planned and the reads started);
- ms_residual_norm: x += the sum of the top-k rows (then + the shared expert's output), h = RMSNorm(x) by the next
  layer's ``attn_norm``. Gemma 4 instead: x += RMSNorm(RMSNorm(dense FFN) + RMSNorm(routed sum)) by its post norms
  (ms_topk_sum, ms_rms_norm, ms_residual_norm), then its PLE branch (the family's torch code, ``ple_add``), x times
  the layer's output scale, and the next layer's norm. After the last layer, the family's own ``head`` (RMSNorm,
  the output projection, Gemma 4's logit softcap).

Qwen 3.5: a Gated DeltaNet layer is its qkv, beta, alpha and z projections of h (kernels.linear_to into kept
buffers), ms_dnet_decode on them and the cache's conv and recurrent state (kernels.dnet_decode's call, as the
family's ``delta_net`` makes it), its output projection, then ms_residual_norm as above (where one of those five
weights is not on the C kernels: the family's own ``delta_net`` through the ``mixer`` hook); a gated
attention layer's q projection holds each head's query and gate, the query halves read in place by ms_attn_block
(head stride 2 * head_dim) and the output projection reads the family's own torch ``a * sigmoid(gate)``. The step
calls the family's ``begin_step`` before the embedding and ``end_step`` before the head, as the eager step does
(qwen35moe: the ValueError for a cache used at another position than its recurrent state's, ``cache.pos``
advanced); a cache's ``k``/``v`` may be lists or dicts keyed by layer (qwen35moe's HybridCache).

DeepSeek-V2/V3 (and GLM-4.7-Flash, written as deepseek2): a layer's MLA, absorbed as the family's ``mix`` computes
it: the q projection of h (or of the q LoRA: ms_linear, ms_rms_norm in place, ms_linear), the latent projection
[c | k_pe] into a kept buffer, the cache row written in place (ms_rms_norm of c by kv_a_norm, ms_rope of k_pe),
each head's absorbed query [attn_k_b[h] q_nope | RoPE(q_pe)] (ms_linear_heads and ms_rope writing into one kept
buffer, head stride kv_lora_rank + rope), ms_attention with one KV head whose values are the first kv_lora_rank
dims of the keys, attn_v_b[h] of each head's output (ms_linear_heads), the output projection. Its router's
sigmoid or softmax stays the family's torch code (``router_scores``: a C sigmoid or softmax would not give
torch's bits), ms_route_plan then reads the scores as they are (bias, groups, renormalisation, scale).

What differs between families is stated by the family (``MoEModel.fast_layer`` -> :class:`FastLayer`: its q/k norms,
biases, RoPE layout, attention scale, top-k renormalisation, shared expert, per-layer shapes, Gemma 4's norms,
scales and PLE hook, Qwen 3.5's mixer and query gate hooks), not written again here.

Each of those is the kernel the eager step runs, on the same values in the same order (the rows of one ms_moe call
do not depend on which other experts share the call), so the logits are the same bits, streaming or resident
(tools/record_logits.py; tests/test_runner.py), and the store sees the same calls in the same order (its counters
and routing trace are the eager step's). With the router lookahead (``--prefetch on``) each layer starts with the
eager step's own ``MoEModel.begin_layer`` on its input (the family's ``predict``, then ``store.prefetch``). A read
error is raised by ``store.wait`` as in the eager step; on any error after the slots are planned the step's reads
settle and their slots are emptied (``store.discard``, as MoE.__call__) before it propagates.

It runs where :func:`plan` finds the model fits it: a family class that defines ``fast_layer`` itself (not inherited:
qwen3moe, llama (Mixtral), olmoe, qwen2moe, glm4moe, gpt-oss, gemma4, qwen35moe, deepseek2) and returns a FastLayer for
every layer (a layer without routed experts: MoEModel.dense's SwiGLU only), every MoE layer fused (one ms_moe call:
MoE.fused), one sequence of one token on the CPU, the q, k, v and output projections (of each layer without the
family's own mixer; an MLA layer's projections and its attn_k_b / attn_v_b) and the experts on the C kernels (an F32
file's are not: the eager step), a resident store or a streaming one with host pools on the CPU (not the
device-planned step of experts/devplan.py), no synthetic routing, the step kernels on (layers.C_RMS_NORM,
C_ATTENTION). Anything else runs the eager step.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import kernels
from ..experts.moe import KEPT_ROWS_FLOATS
from ..experts.pool import ResidentStore, StreamingStore
from ..models import layers
from .step import Seq, Step


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
    that overrides ``dense`` runs the eager step).

    Per-layer attention shapes (Gemma 4's sliding and global layers; None: the model's ``n_head``, ``n_kv``,
    ``head_dim``, ``head_dim_v``): ``n_head``, ``n_kv``, ``head_dim`` (d of q, k and v). ``v_norm``: each V head
    RMSNorm'd without weight (``rms_norm(v, 1.0)``) before the cache; ``v_is_k``: no V projection, V is the raw K
    projection (Gemma 4's K = V layers); ``kv_layer``: the layer whose cache this one reads (None: its own; another:
    no K/V projections, nothing written: Gemma 4's shared-KV layers). ``attn_post_norm``: the output projection
    RMSNorm'd by it before the residual add.

    Gemma 4's FFN block: ``router_norm`` (float32 [hidden]): the router reads RMSNorm(x) by it times
    ``router_mul`` (a float32 multiply), not the ``ffn_norm``-normed x; ``moe_norm``: the experts read RMSNorm(x)
    by it; ``post_norms`` (p1, p2, p3): the layer adds RMSNorm(RMSNorm(shared, p1) + RMSNorm(routed, p2), p3)
    instead of routed + shared (the routed sum is the top-k rows' sum from +0); ``tail``: the family's torch code
    ``tail(x, step) -> x`` [1, hidden] run after that residual add (Gemma 4's PLE); ``out_scale`` (float32 [1]):
    x multiplied by it last. The experts' per-expert output scale (``MoE.expert_scale``, float32 [n_experts] by
    real id) multiplies each pair's routing weight, as MoE.__call__ does.

    Qwen 3.5's layers: ``mixer``: the family's torch code ``mixer(h, step) -> y`` (h float32 [1, hidden] the
    ``attn_norm``-normed x, y float32 [1, hidden]) in place of the attention (its Gated DeltaNet layers: their own
    projections and kernels.dnet_decode on the cache's conv and recurrent state), x += y; such a layer has no q, k,
    v, o projections the step runs. ``q_gate``: the q projection holds each head's [query | gate] (2 * head_dim rows
    per head; the attention reads the query halves in place, head stride 2 * head_dim) and the output projection
    reads the family's torch ``q_gate(a, qg)`` (a float32 [1, n_head * head_dim] the attention output, qg float32
    [1, n_head, 2 * head_dim] the q projection, its gate halves as projected) instead of a (Qwen 3.5's gated
    attention: a * sigmoid(gate)). ``dnet``: (qkv, beta, alpha, z, out) the layer's Weights and (conv_w float32
    [conv_dim, K], dt [n_v], a [n_v], norm_w [d_v]) and n_k (int): a Gated DeltaNet layer the step computes itself
    as the family's decode does (the four projections of h by ms_linear into kept buffers, ms_dnet_decode on the
    cache's ``conv[i]`` and ``ssm[i]``, the output projection: kernels.dnet_decode's call); where one of the five
    Weights is not on the C kernels, ``mixer`` runs instead.

    DeepSeek-V2/V3's MLA, absorbed (models/deepseek2.py): ``mla`` = (q_a, q_a_norm, q, kv_a, kv_a_norm, k_b, v_b,
    r, nope, rot, dv): queries ``q`` (Weight, [H x (nope + rot), cols]) of h, or of RMSNorm(q_a h) by q_a_norm
    (the q LoRA; q_a None: none); the latent ``kv_a h`` = [c | k_pe] (r + rot), the cache row [RMSNorm(c) by
    kv_a_norm | RoPE(k_pe)] written in place (one KV head of r + rot dims); each head's [k_b[h] q_nope | RoPE(q_pe)]
    (k_b, v_b: (uint8 [H x rows, row bytes], ggml type), ms_linear_heads, as kernels.linear_heads); attention over
    the cache with the values its first r dims (K = V); v_b[h] of each head's output; the output projection. Such a
    layer states ``n_head`` (H), ``n_kv`` (1) and ``head_dim`` (r + rot), the attention's shapes. ``router_scores``:
    the family's torch code ``router_scores(logits) -> scores`` (float32 [1, n_experts]; deepseek2's sigmoid or
    softmax) between the router's linear and the C router, which then reads them as scores (``gating`` =
    kernels.GATING_SCORES)."""

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
    n_head: int | None = None
    n_kv: int | None = None
    head_dim: int | None = None
    v_norm: bool = False
    v_is_k: bool = False
    kv_layer: int | None = None
    attn_post_norm: Any = None
    router_norm: Any = None
    router_mul: float = 1.0
    moe_norm: Any = None
    post_norms: tuple | None = None
    tail: Any = None
    out_scale: Any = None
    mixer: Any = None
    q_gate: Any = None
    dnet: tuple | None = None
    mla: tuple | None = None
    router_scores: Any = None


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
        n = m.n_embd
        f32 = torch.float32
        self.x_dim = n
        # each layer's (query heads, KV heads, q/k head dim, v head dim, Rope): the buffers fit the largest
        shapes = []
        q_rows = []  # each layer's q projection rows (twice n_head * head_dim with ``q_gate``)
        for fl in fls:
            hd = m.head_dim if fl.head_dim is None else fl.head_dim
            hdv = getattr(m, "head_dim_v", hd) if fl.head_dim is None else hd  # as MoEModel.make_cache
            shapes.append((m.n_head if fl.n_head is None else fl.n_head, m.n_kv if fl.n_kv is None else fl.n_kv,
                           hd, hdv, m.rope if fl.rope is None else fl.rope))
            q_rows.append(shapes[-1][0] * hd * (2 if fl.q_gate is not None else 1))
        self.h = torch.empty((1, n), dtype=f32)
        self.q = torch.empty((1, max(q_rows)), dtype=f32)
        # a shared-KV layer's rotated queries (ms_rope does not run in place)
        self.qr = torch.empty((1, max(nh * hd for nh, _, hd, _, _ in shapes)), dtype=f32)
        self.k = torch.empty((1, max(nkv * hd for _, nkv, hd, _, _ in shapes)), dtype=f32)
        self.v = torch.empty((1, max(nkv * hdv for _, nkv, _, hdv, _ in shapes)), dtype=f32)
        self.a = torch.empty((1, max(nh * hdv for nh, _, _, hdv, _ in shapes)), dtype=f32)
        self.o = torch.empty((1, n), dtype=f32)
        self.r = torch.empty((1, n), dtype=f32)  # the routed sum of a layer with ``post_norms``
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
        #: the distinct RoPEs of the layers (each layer names one by its index here; gpt-oss, gemma4: sliding and
        #: full layers have their own)
        self.ropes: list[Any] = []
        for s in shapes:
            if not any(r is s[4] for r in self.ropes):
                self.ropes.append(s[4])
        blocks = m.blocks
        dnets = [_dnet(fl.dnet) for fl in fls]
        # a Gated DeltaNet layer's projections (qkv, beta, alpha, z) and its ms_dnet_decode output
        sizes = [(d[2][5], d[2][1], d[2][1] * d[2][3]) for d in dnets if d is not None] or [(0, 0, 0)]
        self.dqkv = torch.empty(max(c for c, _, _ in sizes), dtype=f32)
        self.dbeta = torch.empty(max(v for _, v, _ in sizes), dtype=f32)
        self.dalpha = torch.empty_like(self.dbeta)
        self.dz = torch.empty(max(z for _, _, z in sizes), dtype=f32)
        self.dy = torch.empty_like(self.dz)
        mlas = [_mla(fl.mla) for fl in fls]
        # an MLA layer's q projection (H x (nope + rot)), q LoRA (rank) and the up-projected heads' output (H x dv);
        # its absorbed queries, latent and attention output use self.q, self.k and self.a
        dims = [ml[7] for ml in mlas if ml is not None] or [(0, 0, 0, 0, 0, 0)]
        self.mq = torch.empty(max(h * (nope + rot) for h, nope, rot, _, _, _ in dims), dtype=f32)
        self.mqa = torch.empty(max(qr for *_, qr in dims), dtype=f32)
        self.mo = torch.empty(max(h * dv for h, _, _, _, dv, _ in dims), dtype=f32)
        self.layers = []
        for i, b in enumerate(blocks):
            # the last layer leaves x un-normed: the family's own ``head`` norms it
            nxt = blocks[i + 1]["attn_norm"] if i + 1 < len(blocks) else None
            fl = fls[i]
            nh, nkv, hd, hdv, rope = shapes[i]
            head = not fl.whole_norm
            # (per-head q, k norms, the whole projections' norms, q/k/v biases, ms_attn_block's RoPE mode, scale,
            # the index of the layer's RoPE in self.ropes, window, sinks, o bias, the layer's shapes, V norm, V = K,
            # the cache it reads, post-attention norm, the q head stride)
            attn = (_ptr(fl.q_norm) if head else None, _ptr(fl.k_norm) if head else None,
                    None if head else (_ptr(fl.q_norm), _ptr(fl.k_norm)),
                    None if fl.biases is None else [(yp, _ptr(t), rows) for yp, t, rows in zip(
                        (self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr()), fl.biases,
                        (nh * hd, nkv * hd, nkv * hdv), strict=True) if t is not None],
                    2 if fl.deinterleave else int(rope.interleaved), fl.scale,
                    next(j for j, r in enumerate(self.ropes) if r is rope), int(fl.window or 0), _ptr(fl.sinks),
                    _ptr(fl.o_bias), nh, nkv, hd, hdv, fl.v_norm, fl.v_is_k,
                    i if fl.kv_layer is None else fl.kv_layer, _ptr(fl.attn_post_norm),
                    hd * (2 if fl.q_gate is not None else 1))
            # (the family's mixer, (its q gate, views of the attention output and of the q projection), the DeltaNet
            # layer the step computes)
            hooks = (fl.mixer, None if fl.q_gate is None else (fl.q_gate, self.a[:, :nh * hdv],
                                                                self.q[:, :2 * nh * hd].view(1, nh, 2 * hd)),
                     dnets[i], mlas[i])
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
                         int(fl.norm_topk), fl.floor, fl.route_scale, b if fl.own_gate else None, fl.router_scores)
                es = None if moe.expert_scale is None else moe.expert_scale.contiguous().numpy()
                # (router input multiplier, experts' input norm, per-expert scale by real id, post norms)
                gem = (fl.router_mul, _ptr(fl.moe_norm), es,
                       None if fl.post_norms is None else tuple(_ptr(t) for t in fl.post_norms))
                ffn = (route, fl.shared, None if self.streaming else tabs[i].ctypes.data, moe_spec, gem)
            out_scale = None if fl.out_scale is None else np.float32(fl.out_scale.reshape(-1)[0].item())
            fn = fl.router_norm if fl.router_norm is not None else b["ffn_norm"]
            self.layers.append((i, *specs[i], attn, _ptr(fn), moe is None, ffn, _ptr(nxt), (fl.tail, out_scale),
                                hooks))
        #: resident: int64 [3, n_experts] per layer, each expert's gate, up and down address (the layers point into
        #: them); streaming: per layer, (int64 [3, n_slots] each slot's matrices' first row, [the store's lead
        #: arrays of gate, up, down]): a slot's expert starts lead[slot] bytes into its row
        self.tabs = tabs
        self.attn_norm0 = _ptr(blocks[0]["attn_norm"])
        # the router lookahead's own buffers (a prediction never writes the step's) and, per layer, the next MoE
        # layer (the one the early prediction reads ahead for)
        self.lh = torch.empty((1, n), dtype=f32)
        self.lids = torch.empty((1, m.top_k), dtype=torch.int64)
        self.lw = torch.empty((1, m.top_k), dtype=f32)
        moe_layers = [i for i, mo in enumerate(moes) if mo is not None]
        self.next_moe = [next((j for j in moe_layers if j > i), None) for i in range(len(blocks))]
        # the step predicts by the router it runs (C) unless the model's lookahead is its own (a family's or a
        # test's ``predict``/``begin_layer``): then MoEModel.begin_layer at each layer's input, as the eager step
        cls = type(m)
        self.c_predict = (cls.predict.__qualname__ == "MoEModel.predict" and "predict" not in vars(m)
                          and cls.begin_layer.__qualname__ == "MoEModel.begin_layer" and "begin_layer" not in vars(m))
        self._cache: tuple | None = None
        self.sh: torch.Tensor | None = None  # a layer's shared expert output (_shared)

    def _cache_ptrs(self, cache: Any) -> list[tuple[int | None, int | None]]:
        c = self._cache
        if c is None or c[0]() is not cache:
            if isinstance(cache.k, dict):  # keyed by layer (qwen35moe's HybridCache: K, V of the attention layers,
                # conv and recurrent state of the DeltaNet layers)
                conv, ssm = getattr(cache, "conv", {}), getattr(cache, "ssm", {})
                kv = [(_ptr(cache.k.get(i)), _ptr(cache.v.get(i)), _ptr(conv.get(i)), _ptr(ssm.get(i)))
                      for i in range(len(self.layers))]
            else:
                kv = [(_ptr(k), _ptr(v)) for k, v in zip(cache.k, cache.v, strict=True)]
            c = self._cache = (weakref.ref(cache), kv)
        return c[1]

    def step(self, tokens: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """One token (tokens int64 [1]) at position ``start`` of ``cache`` -> logits float32 [1, vocab]."""
        m, lib = self.model, self.lib
        nt = kernels.threads()
        n, eps, top_k = self.x_dim, m.eps, m.top_k
        step = Step(tokens, [Seq(cache, start, 1)])  # for the family's own embed, tail, mixer and head
        m.begin_step(step)  # the family's check of the cache (qwen35moe: its recurrent state's position)
        x = m.embed(step).contiguous()  # [1, hidden]: the residual stream, updated in place
        xp, hp, qp, kp, vp, ap, op = (x.data_ptr(), self.h.data_ptr(), self.q.data_ptr(), self.k.data_ptr(),
                                      self.v.data_ptr(), self.a.data_ptr(), self.o.data_ptr())
        qrp, rp = self.qr.data_ptr(), self.r.data_ptr()
        idp, wp, outp = self.ids.data_ptr(), self.w.data_ptr(), self.out.data_ptr()
        count, experts, pstart, ptok, pw, pdst, addr = self.pairs.ptrs
        cap = self.pairs.cap
        tables = []  # per RoPE: (n_rot, its cos and sin rows of this position)
        for rope in self.ropes:
            rope.reserve(start + 1)
            n_rot = rope.n_rot
            tables.append((n_rot, rope.cos.data_ptr() + 4 * start * n_rot, rope.sin.data_ptr() + 4 * start * n_rot))
        kv = self._cache_ptrs(cache)
        store, streaming = self.store, self.streaming
        look = streaming and m.opts.prefetch  # the router lookahead
        early = look and self.c_predict and lookahead_mode() != "input"
        at_input = look and (not self.c_predict or lookahead_mode() != "early")
        overlap = m.opts.overlap
        lib.ms_residual_norm(1, n, xp, None, 0, self.attn_norm0, eps, hp, nt)
        dqp, dbp, dap, dzp, dyp = (t.data_ptr() for t in (self.dqkv, self.dbeta, self.dalpha, self.dz, self.dy))
        mqp, mqap, mop = self.mq.data_ptr(), self.mqa.data_ptr(), self.mo.data_ptr()
        for (i, q_s, k_s, v_s, o_s, attn, fn, dense, ffn, nxt, (tail, out_scale), (mixer, gate, dn, mla)) in \
                self.layers:
            if at_input:  # layer i's experts predicted from its input (replacing what the early guess read)
                if not self.c_predict:
                    m.begin_layer(i, x)  # the eager step's own call: x is the layer's input
                elif not dense:
                    self._look(i, xp, 1)
            if dn is not None:  # a Gated DeltaNet layer, as the family's delta_net computes a CPU decode
                (qkv_s, beta_s, alpha_s, z_s, out_s), (cw, dt, av, nw), (n_k, n_v, d_k, d_v, k_w, c_dim) = dn[:3]
                kernels.linear_to(qkv_s, hp, 1, dqp, lib)
                kernels.linear_to(beta_s, hp, 1, dbp, lib)
                kernels.linear_to(alpha_s, hp, 1, dap, lib)
                kernels.linear_to(z_s, hp, 1, dzp, lib)
                conv_p, ssm_p = kv[i][2:]
                if lib.ms_dnet_decode(c_dim, k_w, n_k, n_v, d_k, d_v, dqp, conv_p, cw, dbp, dap, dt, av, ssm_p, dzp,
                                      nw, eps, dyp, nt):
                    raise ValueError(f"dnet_decode: {n_v} value heads over {n_k} key heads (d_k {d_k}, d_v {d_v}) "
                                     f"do not fit a conv of {c_dim} channels")
                kernels.linear_to(out_s, dyp, 1, op, lib)
                lib.ms_residual_norm(1, n, xp, op, 0, fn, eps, hp, nt)
            elif mla is not None:  # DeepSeek's MLA, absorbed, as the family's ``mix`` computes it
                qa_s, qan, mq_s, kva_s, kvan, kb_s, vb_s, (n_head, nope, rot, r, dv, q_rank) = mla[:8]
                hk, dk = nope + rot, r + rot
                mode, scale, r_idx = attn[4:7]
                n_rot, cos_p, sin_p = tables[r_idx]
                if qa_s is not None:  # q = W_qb RMSNorm(W_qa h)
                    kernels.linear_to(qa_s, hp, 1, mqap, lib)
                    lib.ms_rms_norm(1, q_rank, mqap, q_rank, qan, eps, mqap, q_rank, nt)
                    kernels.linear_to(mq_s, mqap, 1, mqp, lib)
                else:
                    kernels.linear_to(mq_s, hp, 1, mqp, lib)
                kernels.linear_to(kva_s, hp, 1, kp, lib)  # [c | k_pe]
                kcp = kv[i][0]
                row = kcp + 4 * start * dk  # the cache row: [RMSNorm(c) | RoPE(k_pe)]
                lib.ms_rms_norm(1, r, kp, r, kvan, eps, row, r, nt)
                lib.ms_rope(1, 1, rot, n_rot, mode, kp + 4 * r, dk, dk, cos_p, sin_p, row + 4 * r, dk, dk, nt)
                # each head's query [k_b[h] q_nope | RoPE(q_pe)] (r + rot dims) into self.q
                kernels.linear_heads_to(kb_s, mqp, (n_head * hk, hk), 1, qp, (n_head * dk, dk), lib)
                lib.ms_rope(1, n_head, rot, n_rot, mode, mqp + 4 * nope, n_head * hk, hk, cos_p, sin_p, qp + 4 * r,
                            n_head * dk, dk, nt)
                # one KV head, the values the first r dims of the keys (K = V)
                if lib.ms_attention(1, n_head, 1, dk, r, qp, n_head * dk, dk, kcp, dk, dk, kcp, dk, dk, start, 0, None,
                                    scale, 0.0, ap, n_head * r, nt):
                    raise MemoryError("attention: out of memory for the score buffer")
                # each head's output up-projected: v_b[h] a_h
                kernels.linear_heads_to(vb_s, ap, (n_head * r, r), 1, mop, (n_head * dv, dv), lib)
                kernels.linear_to(o_s, mop, 1, op, lib)
                lib.ms_residual_norm(1, n, xp, op, 0, fn, eps, hp, nt)
            elif mixer is not None:  # the family's own mixer on h (Qwen 3.5's Gated DeltaNet), x += its output
                y = mixer(self.h, step).contiguous()
                lib.ms_residual_norm(1, n, xp, y.data_ptr(), 0, fn, eps, hp, nt)
            else:
                (qn, kn, whole, biases, mode, scale, r, window, sinks, o_bias, n_head, n_kv, hd, hdv, v_norm, v_is_k,
                 src, post, qhs) = attn
                n_rot, cos_p, sin_p = tables[r]
                kernels.linear_to(q_s, hp, 1, qp, lib)
                if src == i:  # the layer's own K/V: its rows written, then attention (ms_attn_block)
                    kernels.linear_to(k_s, hp, 1, kp, lib)
                    if v_s is not None:
                        kernels.linear_to(v_s, hp, 1, vp, lib)
                    if biases is not None:  # y + b: one add per element (layers.linear_bias)
                        for yp, bp, rows in biases:
                            lib.ms_residual_norm(1, rows, yp, bp, 0, None, 0.0, None, nt)
                    if whole is not None:  # RMSNorm of each whole projection, in place (olmoe)
                        lib.ms_rms_norm(1, n_head * hd, qp, n_head * hd, whole[0], eps, qp, n_head * hd, nt)
                        lib.ms_rms_norm(1, n_kv * hd, kp, n_kv * hd, whole[1], eps, kp, n_kv * hd, nt)
                    vsp = kp if v_is_k else vp
                    if v_norm:  # each V head's RMSNorm without weight, from the raw projection (Gemma 4)
                        lib.ms_rms_norm(n_kv, hdv, vsp, hdv, None, eps, vp, hdv, nt)
                        vsp = vp
                    kcp, vcp = kv[i][:2]
                    rc = lib.ms_attn_block(1, n_head, n_kv, hd, hdv, qp, n_head * qhs, qhs, kp, n_kv * hd, hd, vsp,
                                           n_kv * hdv, hdv, qn, kn, eps, n_rot, mode, cos_p, sin_p, kcp, n_kv * hd, hd,
                                           vcp, n_kv * hdv, hdv, start, window, sinks, scale, 0.0, ap, n_head * hdv, nt)
                else:  # a shared-KV layer: its queries normed and rotated (rms_norm, Rope), attention over src's cache
                    if qn is not None:
                        lib.ms_rms_norm(n_head, hd, qp, hd, qn, eps, qp, hd, nt)
                    lib.ms_rope(1, n_head, hd, n_rot, mode, qp, n_head * hd, hd, cos_p, sin_p, qrp, n_head * hd, hd, nt)
                    kcp, vcp = kv[src][:2]
                    rc = lib.ms_attention(1, n_head, n_kv, hd, hdv, qrp, n_head * hd, hd, kcp, n_kv * hd, hd, vcp,
                                          n_kv * hdv, hdv, start, window, sinks, scale, 0.0, ap, n_head * hdv, nt)
                if rc:
                    raise MemoryError("attention: out of memory for the score buffer")
                if gate is None:
                    kernels.linear_to(o_s, ap, 1, op, lib)
                else:  # the output projection of the family's gated attention output (torch: Qwen 3.5's sigmoid gate)
                    y = gate[0](gate[1], gate[2]).contiguous()
                    kernels.linear_to(o_s, y.data_ptr(), 1, op, lib)
                if o_bias is not None:  # W_o a + b_o, then the residual add
                    lib.ms_residual_norm(1, n, op, o_bias, 0, None, 0.0, None, nt)
                if post is not None:  # the output projection's own RMSNorm before the residual (Gemma 4)
                    lib.ms_rms_norm(1, n, op, n, post, eps, op, n, nt)
                lib.ms_residual_norm(1, n, xp, op, 0, fn, eps, hp, nt)
            plain = tail is None and out_scale is None  # x's next norm fused into its last add
            if dense:  # x + SwiGLU(h), as MoEModel.dense
                y = layers.swiglu_ffn(*ffn[:3], self.h).contiguous()
                lib.ms_residual_norm(1, n, xp, y.data_ptr(), 0, nxt, eps, hp if nxt else None, nt)
                continue
            route, has_shared, tabs, moe_s, (r_mul, moe_norm, e_scale, post_norms) = ffn
            router, gating, r_bias, n_group, topk_group, norm_topk, floor, r_scale, gate_b, r_scores = route
            if r_mul != 1.0:  # the router's input times a scalar, as a float32 multiply (Gemma 4's 1/sqrt(hidden))
                hn = self.h.numpy()
                np.multiply(hn, np.float32(r_mul), out=hn)
            if gate_b is not None:  # the family's own router (torch), then the pairs grouped as ms_route_plan does
                ids, w = m.gate(gate_b, self.h)
                g = self.pairs.plan(ids.contiguous(), w.contiguous(), None if tabs is None else self.tabs[i])
            else:
                logits = router.linear(self.h).contiguous()
                if r_scores is not None:  # the family's own scores (torch: deepseek2's sigmoid or softmax)
                    logits = r_scores(logits).contiguous()
                g = lib.ms_route_plan(1, logits.shape[1], logits.data_ptr(), gating, r_bias, n_group, topk_group,
                                      top_k, norm_topk, floor, r_scale, idp, wp, tabs, 3, count, experts, pstart,
                                      ptok, pw, pdst, addr, cap, nt)
                if g < 0:
                    raise ValueError(f"route: top-{top_k} of {logits.shape[1]} experts does not fit (rc {g})")
            if e_scale is not None:  # each pair's weight times its expert's scale (MoE.__call__'s float32 product)
                pwn = self.pairs.w[:g]  # one token: pair j is group j, expert experts[j]
                np.multiply(pwn, e_scale[self.pairs.experts[:g]], out=pwn)
            if moe_norm is not None:  # the experts' own input norm (Gemma 4's pre_norm_2)
                lib.ms_rms_norm(1, n, xp, n, moe_norm, eps, hp, n, nt)
            chosen = self.pairs.experts[:g].tolist()  # ascending, as MoE.__call__ hands them to the store
            run_shared = functools.partial(self._shared, i, x) if has_shared else None
            if streaming:
                ahead = self.next_moe[i] if early else None
                self._streamed(i, moe_s, chosen, overlap, hp, outp, run_shared,
                               None if ahead is None else functools.partial(self._look_ahead, ahead, xp))
            else:
                store.prepare(i, chosen)  # counts the hits (and records the routing trace)
                if run_shared is not None:
                    run_shared()
                kernels.moe_to(moe_s, self.pairs, g, hp, 1, outp)
            fin, fin_h = (nxt, hp if nxt else None) if plain else (None, None)
            if post_norms is not None:  # x + RMSNorm(RMSNorm(shared, p1) + RMSNorm(routed, p2), p3), as combine
                p1, p2, p3 = post_norms
                lib.ms_topk_sum(1, top_k, n, outp, rp, nt)  # the routed sum (topk_sum)
                lib.ms_rms_norm(1, n, rp, n, p2, eps, rp, n, nt)
                sh, self.sh = self.sh.contiguous(), None
                shp = sh.data_ptr()
                lib.ms_rms_norm(1, n, shp, n, p1, eps, shp, n, nt)
                lib.ms_residual_norm(1, n, shp, rp, 0, p3, eps, shp, nt)
                lib.ms_residual_norm(1, n, xp, shp, 0, fin, eps, fin_h, nt)
            elif has_shared:  # (x + routed) + shared, as combine adds them
                lib.ms_residual_norm(1, n, xp, outp, top_k, None, eps, None, nt)
                sh, self.sh = self.sh.contiguous(), None
                lib.ms_residual_norm(1, n, xp, sh.data_ptr(), 0, fin, eps, fin_h, nt)
            else:
                lib.ms_residual_norm(1, n, xp, outp, top_k, fin, eps, fin_h, nt)
            if plain:
                continue
            if tail is not None:  # the family's torch code on x (Gemma 4's PLE), its result into x
                x.copy_(tail(x, step))
            if out_scale is not None:  # x times the layer's scale (a float32 multiply, as ``x * out_scale``)
                xn = x.numpy()
                np.multiply(xn, out_scale, out=xn)
            if nxt:
                lib.ms_rms_norm(1, n, xp, n, nxt, eps, hp, n, nt)
        m.end_step(step)  # (qwen35moe: cache.pos advanced) before the head, as the eager step
        return m.head(x, step)

    def _shared(self, i: int, x: torch.Tensor) -> None:
        """Layer i's shared expert by the family's own code (``shared(i, x, h)``, as the eager step calls it) into
        ``self.sh``."""
        self.sh = self.model.shared(i, x, self.h)

    def _predict(self, j: int, xp: int) -> list[int]:
        """The experts MoE layer j's router picks for the residual stream at ``xp`` (float32 [1, hidden]) taken as
        that layer's FFN input: its norm, router and top-k as the step runs them (the family's own ``gate`` where it
        has one), into the lookahead's own buffers; distinct real ids, top-k order."""
        m, lib, nt, n = self.model, self.lib, kernels.threads(), self.x_dim
        _, _, _, _, _, _, fn, _, ffn, *_ = self.layers[j]
        router, gating, r_bias, n_group, topk_group, norm_topk, floor, r_scale, gate_b, r_scores = ffn[0]
        lhp = self.lh.data_ptr()
        lib.ms_rms_norm(1, n, xp, n, fn, m.eps, lhp, n, nt)
        r_mul = ffn[4][0]
        if r_mul != 1.0:
            hn = self.lh.numpy()
            np.multiply(hn, np.float32(r_mul), out=hn)
        if gate_b is not None:
            ids, _ = m.gate(gate_b, self.lh)
            return list(dict.fromkeys(ids.reshape(-1).tolist()))
        logits = router.linear(self.lh).contiguous()
        if r_scores is not None:  # the family's own scores, as the step computes them
            logits = r_scores(logits).contiguous()
        if lib.ms_route(1, logits.shape[1], logits.data_ptr(), gating, r_bias, n_group, topk_group, m.top_k,
                        norm_topk, floor, r_scale, self.lids.data_ptr(), self.lw.data_ptr(), nt):
            return []  # (the step's own routing raises on the same shapes)
        return self.lids[0].tolist()

    def _look_ahead(self, j: int, xp: int) -> None:
        """The early lookahead: MoE layer j's experts predicted from the residual stream at ``xp`` (a layer before
        j, after its attention) and their reads started at low priority, behind the demand reads just submitted."""
        self._look(j, xp, 0)

    def _look(self, j: int, xp: int, kind: int) -> None:
        """MoE layer j's experts predicted from the residual stream at ``xp`` (``kind`` 0: a layer before j, after its
        attention; 1: j's input, which replaces an early guess: those it drops are cancelled), their reads started
        where they pay (the store's gate, StreamingStore.prefetch); the prediction itself (a router matmul) is
        skipped while no rank of ``kind`` pays, but for the store's exploring calls (``look_wanted``)."""
        store = self.store
        if store.look_wanted(kind, self.model.top_k, j):
            store.prefetch(j, self._predict(j, xp), cancel=kind == 1, gate=True, kind=kind)

    def _streamed(self, i: int, spec: tuple, experts: list[int], overlap: bool, hp: int, outp: int,
                  shared: Any = None, ahead: Any = None) -> None:
        """Layer i's routed experts through the streaming store (``experts``: the step's distinct real ids,
        ascending, group j = pair j of ``self.pairs``): the slots planned and the misses' reads started, then the
        hits in one ms_moe call over their slots, then each batch of misses as soon as its reads are joined
        (``overlap``; else one join, then every expert). ``shared``: the layer's shared expert, run once the reads
        are started, as MoE.__call__ runs it. On any error the step's reads settle and their slots are emptied
        before it propagates (MoE.__call__'s ``discard``)."""
        store = self.store
        slot_ids, ticket = store.prepare(i, experts)
        try:
            if ahead is not None:  # the next MoE layer's likely experts, queued behind this layer's misses
                ahead()
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


def lookahead_mode() -> str:
    """Where the fast step's router lookahead predicts a layer's experts (``MOESTREAM_LOOKAHEAD``, for measuring):
    ``both`` (default): from the layer before's residual after its attention (reads queued behind that layer's
    misses), then again from the layer's input (queued guesses it drops are cancelled); ``early``: the first only;
    ``input``: the second only (the eager step's ``begin_layer``)."""
    mode = os.environ.get("MOESTREAM_LOOKAHEAD", "both")
    return mode if mode in ("both", "early", "input") else "both"


def _dnet(d: tuple | None) -> tuple | None:
    """FastLayer.dnet as the step's call needs it: ((qkv, beta, alpha, z, out) specs, (conv_w, dt, a, norm_w)
    addresses, (n_k, n_v, d_k, d_v, K, conv_dim), the contiguous tensors kept); None without one or where a Weight
    is not on the C kernels (then the layer's ``mixer``)."""
    if d is None:
        return None
    specs = tuple(_spec(w) for w in d[:5])
    if None in specs:
        return None
    ts = tuple(t.contiguous() for t in d[5:9])
    cw, _, a, nw = ts
    n_k, (c_dim, k_w), n_v, d_v = int(d[9]), cw.shape, a.numel(), nw.numel()
    return specs, tuple(t.data_ptr() for t in ts), (n_k, n_v, (c_dim - n_v * d_v) // (2 * n_k), d_v, k_w, c_dim), ts


def _mla(d: tuple | None) -> tuple | None:
    """FastLayer.mla as the step's calls need it: (q_a spec (None without the q LoRA), q_a_norm address, q spec,
    kv_a spec, kv_a_norm address, k_b and v_b specs (kernels.linear_heads_to's), (H, nope, rot, r, dv, q LoRA rank),
    the contiguous norms kept); None without one or where a projection is not on the C kernels or the shapes do not
    fit."""
    if d is None:
        return None
    q_a, q_a_norm, q, kv_a, kv_a_norm, (kb, t_kb), (vb, t_vb), r, nope, rot, dv = d
    qa_s, q_s, kva_s = (None if q_a is None else _spec(q_a)), _spec(q), _spec(kv_a)
    if None in (q_s, kva_s) or (q_a is not None and qa_s is None) or not (kb.is_contiguous() and vb.is_contiguous()):
        return None
    hk = nope + rot
    n_head = q_s[3] // hk
    if (q_s[3] != n_head * hk or kva_s[3] != r + rot or kb.shape[0] != n_head * r or vb.shape[0] != n_head * dv
            or not (kernels.computes(t_kb, nope) and kernels.computes(t_vb, r))):
        return None
    norms = tuple(None if t is None else t.contiguous() for t in (q_a_norm, kv_a_norm))
    kb_s = (int(t_kb), kb.data_ptr(), r * kb.shape[1], kb.shape[1], r, nope, n_head)  # kernels.linear_heads_to's
    vb_s = (int(t_vb), vb.data_ptr(), dv * vb.shape[1], vb.shape[1], dv, r, n_head)
    return (qa_s, _ptr(norms[0]), q_s, kva_s, _ptr(norms[1]), kb_s, vb_s,
            (n_head, nope, rot, r, dv, 0 if qa_s is None else qa_s[3]), norms)


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
        own_kv = fl.kv_layer in (None, i)
        if not own_kv and (fl.whole_norm or fl.deinterleave or fl.biases is not None or fl.q_gate is not None):
            return None  # a shared-KV layer's queries: per-head norm and NEOX RoPE only
        moe = b.get("moe")
        if fl.mla is not None:  # MLA: its own projections (_mla), the output projection
            s = [None, None, None, _spec(b["o"])]
            if s[3] is None or _mla(fl.mla) is None:
                return None
        elif fl.mixer is not None or fl.dnet is not None:  # a DeltaNet layer or the family's own mixer: no q, k, v, o
            s = [None] * 4
        else:  # q, k, v, o; a layer without its own K/V has no k, v; with ``v_is_k`` no v
            s = [_spec(b["q"]), _spec(b["k"]) if own_kv else None,
                 _spec(b["v"]) if own_kv and not fl.v_is_k else None, _spec(b["o"])]
            if None in (s[0], s[3]) or (own_kv and s[1] is None) or (own_kv and not fl.v_is_k and s[2] is None):
                return None
        if fl.mixer is None and fl.dnet is not None and _dnet(fl.dnet) is None:
            return None  # a DeltaNet layer off the C kernels, without the family's mixer
        if (moe is None and (not own_dense or fl.post_norms or fl.tail or fl.out_scale is not None)) or (
                fl.post_norms is not None and not fl.shared):
            return None
        t = None
        if moe is not None:
            if not moe.fused or moe.routing is not None:
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
