"""Qwen 3.5 / 3.6 MoE (GGUF ``general.architecture = qwen35moe``; transformers ``Qwen3_5MoeForCausalLM``).

A hybrid stack: of every ``full_attention_interval`` layers, the last is gated full attention and the others
are gated DeltaNet (linear attention with a recurrent state). Every layer then has the same MoE FFN.

- Gated DeltaNet layer: ``qkv = W_qkv h`` through a causal depthwise conv1d (kernel K, state = the last K-1
  inputs) and SiLU; q, k L2-normalized, q scaled by 1/sqrt(d_k); per value head a decay
  ``g = -exp(A_log) * softplus(W_alpha h + dt_bias)`` and a write strength ``beta = sigmoid(W_beta h)``; the
  gated delta rule ``S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q`` (S: [d_k, d_v] per value head;
  prefill runs it in chunks of 64 tokens, decode one step); output ``W_out(RMSNorm(o) * silu(W_gate h))``.
- Gated attention layer: ``W_q`` gives per head [query | gate]; q/k RMSNorm, NEOX RoPE on the first
  ``rope.dimension_count`` dims of the head (MRoPE with text positions, which is plain RoPE), causal GQA,
  output times ``sigmoid(gate)``, then ``W_o``.
- MoE: softmax router, top-k, weights renormalized to sum 1; plus a shared SwiGLU expert scaled by
  ``sigmoid(W_shexp_gate h)``.

Semantics follow transformers' ``modeling_qwen3_5_moe.py`` and llama.cpp's ``qwen35moe`` graph. The GGUF holds
some tensors transformed by llama.cpp's converter: ``ssm_a = -exp(A_log)``; the zero-centred RMSNorm weights
``+1`` (all but ``ssm_norm``); ``ssm_conv1d`` as [conv_dim, K]; and, where there are fewer key heads than value
heads, the value heads in *tiled* order (file head j belongs to key head ``j % n_k_heads``) in every tensor
indexed by value head, so q and k are repeated by tiling, not interleaving.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from .. import kernels
from ..errors import GGUFError
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, elementwise, rms_norm, rope_inv_freq, softmax_topk, swiglu_ffn

if TYPE_CHECKING:
    from ..runtime.step import Step


class HybridCache:
    """Per-layer state of a Qwen 3.5 stack, carried across prefill chunks and decode steps.

    Attention layers: k, v float32 [n_ctx, n_kv_heads, head_dim]. DeltaNet layers: conv float32
    [K-1, conv_dim] (the last K-1 conv inputs, oldest first; zeros at the start) and ssm float32
    [n_v_heads, d_k, d_v] (the recurrent state S). ``k``/``v``/``conv``/``ssm`` are dicts keyed by layer.
    ``pos``: tokens consumed so far. The recurrent state cannot be rewound, so the next forward must start at
    ``pos`` (ValueError otherwise).
    """

    def __init__(self, model: Qwen35MoE, n_ctx: int):
        self.n_ctx, self.pos = n_ctx, 0
        dev = model.device
        self.k = {i: torch.zeros((n_ctx, model.n_kv, model.head_dim), device=dev) for i in model.attn_layers}
        self.v = {i: torch.zeros((n_ctx, model.n_kv, model.head_dim), device=dev) for i in model.attn_layers}
        self.conv = {i: torch.zeros((model.conv_kernel - 1, model.conv_dim), device=dev) for i in model.recr_layers}
        self.ssm = {i: torch.zeros((model.n_v_heads, model.d_k, model.d_v), device=dev) for i in model.recr_layers}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for d in (self.k, self.v, self.conv, self.ssm) for t in d.values())


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (transformers' ``l2norm``, as the FLA library)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d over time, continuing from ``state``; updates ``state`` in place.

    x: [T, C] new inputs; state: [K-1, C] the previous K-1 inputs (oldest first); weight: [C, K].
    Returns [T, C]: out[t, c] = sum_j weight[c, j] * [state; x][t + j, c] (transformers' causal_conv1d_fn with
    the cached inputs prepended; no activation).
    """
    xin = torch.cat((state, x), dim=0)  # [K-1+T, C]
    out = torch.nn.functional.conv1d(xin.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])  # [1, C, T]
    state.copy_(xin[x.shape[0]:])
    return out[0].t()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule, token by token (transformers' ``torch_recurrent_gated_delta_rule``); updates
    ``state`` in place.

    q, k: [T, H, d_k] (q already L2-normalized and scaled, k L2-normalized); v: [T, H, d_v]; g: [T, H] log
    decay (<= 0); beta: [T, H]; state: [H, d_k, d_v] float32. Per token t and head h:
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q. Returns o: [T, H, d_v].
    """
    out = v.new_empty(v.shape)
    decay = g.exp()
    for t in range(q.shape[0]):  # the state is updated where it is: no per-token copies of it
        state.mul_(decay[t, :, None, None])
        kv_mem = torch.bmm(k[t].unsqueeze(1), state).squeeze(1)  # [H, d_v] = S^T k
        delta = (v[t] - kv_mem) * beta[t, :, None]
        state.add_(k[t].unsqueeze(2) * delta.unsqueeze(1))  # outer product k delta^T
        torch.bmm(q[t].unsqueeze(1), state, out=out[t].unsqueeze(1))
    return out


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule over chunks of ``chunk`` tokens (the form of transformers'
    ``torch_chunk_gated_delta_rule``, after the DeltaNet papers' WY/UT transform); updates ``state`` in place.

    Same arguments, result and state as :func:`gated_delta_rule` up to float32 rounding. Within a chunk, with
    G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i (else 0): the chunk's corrected values
    U = (I + tril(diag(beta) K K^T * D, -1))^-1 [diag(beta) V | diag(beta exp(G)) K] split into (U_v, W),
    V' = U_v - W S, O = diag(exp(G)) Q S + (Q K^T * D) V', S = exp(G_last) S + (exp(G_last - G) K)^T V'.
    """
    n_tok, n_head, _ = q.shape
    d_v = v.shape[-1]
    out = v.new_empty(v.shape)
    s = state
    q, k, v, g, beta = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t()  # head-major
    for c0 in range(0, n_tok, chunk):
        c1 = min(c0 + chunk, n_tok)
        n = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]
        cum = g[:, c0:c1].cumsum(-1)  # [H, n]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, cum[:, :, None] - cum[:, None, :], float("-inf")).exp()  # [H, n, n]
        kb = kc * bc
        system = torch.eye(n, device=q.device) + ((kb @ kc.transpose(1, 2)) * decay).tril(-1)
        rhs = torch.cat((vc * bc, kb * cum.exp()[..., None]), dim=-1)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        v_new = sol[..., :d_v] - sol[..., d_v:] @ s  # [H, n, d_v]
        o = (qc * cum.exp()[..., None]) @ s + ((qc @ kc.transpose(1, 2)) * decay) @ v_new
        out[c0:c1] = o.transpose(0, 1)
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(1, 2) @ v_new
    state.copy_(s)
    return out


@register("qwen35moe")
class Qwen35MoE(MoEModel):
    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        g = gguf.arch_get
        path = gguf.path
        # MTP (next-token prediction) blocks, if the file has them, come after the trunk and are not run: the
        # base class's n_layers is the trunk
        self.n_head = self.meta_int("attention.head_count", required=True)
        self.n_kv = self.meta_int("attention.head_count_kv", self.n_head)
        self.head_dim = self.meta_int("attention.key_length", required=True)
        self.n_rot = self.meta_int("rope.dimension_count", self.head_dim)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        self.softmax_routing(norm=True, switchable=False)  # always renormalized (no norm_topk_prob)
        self.conv_kernel = self.meta_int("ssm.conv_kernel", required=True)
        self.d_k = self.meta_int("ssm.state_size", required=True)
        self.n_k_heads = self.meta_int("ssm.group_count", required=True)
        self.n_v_heads = self.meta_int("ssm.time_step_rank", required=True)
        inner = self.meta_int("ssm.inner_size", required=True)
        if inner % self.n_v_heads:
            raise GGUFError(f"{path}: metadata {self.meta_desc(ssm__inner_size=inner)} is not a multiple of "
                            f"{self.meta_desc(ssm__time_step_rank=self.n_v_heads)} (value heads)")
        self.d_v = inner // self.n_v_heads
        self.conv_dim = 2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
        if self.n_v_heads % self.n_k_heads:
            raise GGUFError(f"{gguf.path}: ssm.time_step_rank {self.n_v_heads} (value heads) is not a multiple of "
                            f"ssm.group_count {self.n_k_heads} (key heads)")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise GGUFError(f"{path}: metadata {self.meta_desc(rope__dimension_count=self.n_rot)} must be even and "
                            f"at most {self.meta_desc(attention__key_length=self.head_dim)}")
        recr = g("attention.recurrent_layers")
        if recr is None:
            interval = self.meta_int("full_attention_interval", 4)
            recr = [(i + 1) % interval != 0 for i in range(self.n_layers)]
        if not isinstance(recr, (list, tuple)) or len(recr) < self.n_layers:
            raise GGUFError(f"{path}: metadata key qwen35moe.attention.recurrent_layers must list {self.n_layers} "
                            f"layers, got {recr!r}")
        self.recr_layers = [i for i in range(self.n_layers) if recr[i]]
        self.attn_layers = [i for i in range(self.n_layers) if not recr[i]]
        d, n_embd, hd, nh, nkv, nv, dv = (self.meta_desc, self.n_embd, self.head_dim, self.n_head, self.n_kv,
                                          self.n_v_heads, self.d_v)
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        ssm = d(ssm__state_size=self.d_k, ssm__group_count=self.n_k_heads, ssm__time_step_rank=nv,
                ssm__inner_size=nv * dv)
        heads = d(attention__head_count=nh, attention__key_length=hd, embedding_length=n_embd)
        kv = d(attention__head_count_kv=nkv, attention__key_length=hd, embedding_length=n_embd)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.require_moe(i)
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 "ffn_norm": self.tensor(p + "post_attention_norm.weight", (n_embd,), emb, kind="norm"),
                 "router": self.router_tensor(p), "moe": self.moe(i), "sh_gate_inp": self.shared_gate_tensor(p),
                 **self.ffn_tensors(p, "_shexp", names=("sh_gate", "sh_up", "sh_down"))}
            if recr[i]:
                rank = d(ssm__time_step_rank=nv) + ", " + emb
                b.update(qkv=self.tensor(p + "attn_qkv.weight", (self.conv_dim, n_embd), ssm + ", " + emb),
                         conv=self.tensor(p + "ssm_conv1d.weight", (self.conv_dim, self.conv_kernel),
                                          ssm + ", " + d(ssm__conv_kernel=self.conv_kernel), kind="float"),
                         z=self.tensor(p + "attn_gate.weight", (nv * dv, n_embd), ssm + ", " + emb),
                         beta=self.tensor(p + "ssm_beta.weight", (nv, n_embd), rank),
                         alpha=self.tensor(p + "ssm_alpha.weight", (nv, n_embd), rank),
                         dt=self.tensor(p + "ssm_dt.bias", (nv,), d(ssm__time_step_rank=nv), kind="norm"),
                         a=self.tensor(p + "ssm_a", (nv,), d(ssm__time_step_rank=nv), kind="norm"),
                         ssm_norm=self.tensor(p + "ssm_norm.weight", (dv,), ssm, kind="norm"),
                         out=self.tensor(p + "ssm_out.weight", (n_embd, nv * dv), ssm + ", " + emb))
            else:
                b.update(q=self.tensor(p + "attn_q.weight", (nh * 2 * hd, n_embd),
                                       heads + " (query and gate per head)"),
                         k=self.tensor(p + "attn_k.weight", (nkv * hd, n_embd), kv),
                         v=self.tensor(p + "attn_v.weight", (nkv * hd, n_embd), kv),
                         o=self.tensor(p + "attn_output.weight", (n_embd, nh * hd), heads),
                         q_norm=self.tensor(p + "attn_q_norm.weight", (hd,), d(attention__key_length=hd), kind="norm"),
                         k_norm=self.tensor(p + "attn_k_norm.weight", (hd,), d(attention__key_length=hd), kind="norm"))
            blocks.append(b)
        self.check_heads_grouped(nh, nkv)  # after the shapes: reported with the tensor it contradicts
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.n_rot, self.device))
        self.load_declared(ends, blocks)

    def make_cache(self, n_ctx: int) -> HybridCache:
        return HybridCache(self, n_ctx)

    def cache_bytes(self, n_ctx: int) -> int:
        attn = 4 * 2 * n_ctx * self.n_kv * self.head_dim * len(self.attn_layers)
        recr = 4 * ((self.conv_kernel - 1) * self.conv_dim + self.n_v_heads * self.d_k * self.d_v)
        return attn + recr * len(self.recr_layers)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, sum 1)."""
        return softmax_topk(router_logits, self.top_k, norm=True)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def delta_net(self, cache: HybridCache, h: torch.Tensor, b: dict, i: int) -> torch.Tensor:
        """Gated DeltaNet mixer of layer i. h: [T, hidden] (normed) -> [T, hidden]; advances cache.conv/ssm[i]."""
        n_tok = h.shape[0]
        lib = kernels.step_ops() if n_tok == 1 and h.device.type == "cpu" else None
        if lib is not None:  # decode on the CPU: everything between the matmuls in one C call
            o = kernels.dnet_decode(b["qkv"].linear(h).reshape(-1).contiguous(), cache.conv[i], b["conv"],
                                    b["beta"].linear(h)[0], b["alpha"].linear(h)[0], b["dt"], b["a"], cache.ssm[i],
                                    b["z"].linear(h)[0], b["ssm_norm"], self.eps, self.n_k_heads, lib)
            return b["out"].linear(o.view(1, -1))
        qkv = causal_conv1d(b["qkv"].linear(h), cache.conv[i], b["conv"])  # [T, conv_dim]
        qkv = elementwise(torch.nn.functional.silu, qkv)
        kd = self.n_k_heads * self.d_k
        q = qkv[:, :kd].reshape(n_tok, self.n_k_heads, self.d_k)
        k = qkv[:, kd:2 * kd].reshape(n_tok, self.n_k_heads, self.d_k)
        v = qkv[:, 2 * kd:].reshape(n_tok, self.n_v_heads, self.d_v)
        rep = self.n_v_heads // self.n_k_heads
        beta = torch.sigmoid(b["beta"].linear(h))  # [T, n_v]
        g = b["a"] * torch.nn.functional.softplus(b["alpha"].linear(h) + b["dt"])  # [T, n_v], ssm_a = -exp(A_log)
        # value heads are in tiled order in the file: value head j reads key head j % n_k_heads
        q = l2_norm(q).repeat(1, rep, 1) * (1.0 / math.sqrt(self.d_k))
        k = l2_norm(k).repeat(1, rep, 1)
        # prefill: the chunked form (as transformers); decode (a GPU's, or with the C step ops off): the recurrence
        rule = gated_delta_rule_chunked if n_tok > 1 else gated_delta_rule
        o = rule(q, k, v, g, beta, cache.ssm[i])  # [T, n_v, d_v]
        z = b["z"].linear(h).view(n_tok, self.n_v_heads, self.d_v)
        o = rms_norm(o, b["ssm_norm"], self.eps) * elementwise(torch.nn.functional.silu, z)
        return b["out"].linear(o.reshape(n_tok, -1))

    def attn(self, b: dict, h: torch.Tensor, i: int, step: Step) -> torch.Tensor:
        """Gated full attention of layer i. h: [T, hidden] (normed) -> [T, hidden]; writes layer i's cache
        rows."""
        n_tok = h.shape[0]
        qg = b["q"].linear(h).view(n_tok, self.n_head, 2 * self.head_dim)
        q = qg[..., :self.head_dim]
        k = b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim)
        v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim)
        # the q/k norms inside the attention block (one launch with RoPE on CUDA); q, a view of qg, may be
        # overwritten there: only its half of qg, not the gate's
        a = step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim), q_norm=b["q_norm"],
                                  k_norm=b["k_norm"], eps=self.eps)
        return b["o"].linear(self.gated(a, qg))

    def gated(self, a: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
        """The output projection's input of a gated attention layer: a float32 [T, n_head * head_dim] the attention
        output, qg float32 [T, n_head, 2 * head_dim] the q projection (each head's [query | gate]; only the gate
        halves are read) -> a * sigmoid(gate), float32 [T, n_head * head_dim]."""
        return a * elementwise(torch.sigmoid, qg[..., self.head_dim:].reshape(a.shape[0], -1))

    def begin_step(self, step: Step) -> None:
        """ValueError unless each sequence starts where its cache's recurrent state is (it cannot be rewound)."""
        for s in step.seqs:
            if s.start != s.cache.pos:
                raise ValueError(f"the cache's recurrent state is at position {s.cache.pos}, cannot run from "
                                 f"position {s.start} (qwen35moe caches cannot be rewound: use a new cache)")

    def end_step(self, step: Step) -> None:
        for s in step.seqs:
            s.cache.pos = s.end

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Gated DeltaNet (recurrent layers, per sequence) or gated attention, residual added: x [T, hidden] ->
        same."""
        b = self.blocks[i]
        h = rms_norm(x, b["attn_norm"], self.eps)
        if "qkv" in b:
            return x + self.recurrent(i, h, step)
        return x + self.attn(b, h, i, step)

    def recurrent(self, i: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        """Gated DeltaNet layer i on h float32 [T, hidden] (the ``attn_norm``-normed x), each sequence on its own
        cache's conv and recurrent state -> float32 [T, hidden], the residual not added."""
        b = self.blocks[i]
        return step.per_seq(lambda cache, hs: self.delta_net(cache, hs, b, i), h)

    def fast_layer(self, i: int) -> FastLayer:
        """Layer i in the fast CPU decode step's terms (runtime/fastdecode.FastLayer): a Gated DeltaNet layer is
        its projections and ms_dnet_decode as :meth:`delta_net` computes a CPU decode (``dnet``), or this class's own
        :meth:`recurrent` where the step cannot (the ``mixer`` hook); a gated attention layer is per-head q/k
        norms, partial NEOX RoPE and each head's query and gate interleaved in the q projection, the attention
        output times sigmoid(gate) by :meth:`gated` (``q_gate``); every layer: softmax top-k routing renormalised,
        the shared expert (:meth:`shared`, with its sigmoid gate) added after the routed sum."""
        b = self.blocks[i]
        if "qkv" in b:
            return FastLayer(0.0, mixer=functools.partial(self.recurrent, i), shared=True,
                             dnet=(b["qkv"], b["beta"], b["alpha"], b["z"], b["out"], b["conv"], b["dt"], b["a"],
                                   b["ssm_norm"], self.n_k_heads))
        return FastLayer(1.0 / math.sqrt(self.head_dim), q_norm=b["q_norm"], k_norm=b["k_norm"], q_gate=self.gated,
                         shared=True)

    def has_shared(self, i: int) -> bool:
        return True

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The shared expert of layer i on h [T, hidden] -> [T, hidden], scaled by its sigmoid gate."""
        b = self.blocks[i]
        gate = elementwise(torch.sigmoid, b["sh_gate_inp"].linear(h))
        return gate * swiglu_ffn(b["sh_gate"], b["sh_up"], b["sh_down"], h)
