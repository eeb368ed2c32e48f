"""OLMoE (GGUF ``general.architecture = olmoe``), e.g. allenai/OLMoE-1B-7B-0924.

Per layer: RMSNorm -> attention (n_head query heads, n_kv key/value heads) whose q and k projections are each
RMSNormed over the WHOLE projected vector (q: [n_head * head_dim], k: [n_kv * head_dim], one norm weight of
that length, not per head), then NEOX RoPE -> residual -> RMSNorm -> softmax router over all experts, top-k
of the probabilities -> SwiGLU experts weighted by those probabilities -> residual. No shared expert, no dense
layers. Semantics follow transformers' OlmoeForCausalLM (OlmoeAttention, OlmoeTopKRouter) and llama.cpp's
olmoe graph (src/models/olmoe.cpp).

Routing weights: transformers renormalizes the top-k probabilities only when ``norm_topk_prob`` (false in
the published config); llama.cpp's olmoe graph never does and reads no key for it. moestream reads
``olmoe.expert_weights_norm`` (a bool, the key other families use for the same switch) and defaults to
false when the file lacks it, which is what llama.cpp computes and what the published model was trained
with. ``clip_qkv`` (null in the published config) has no GGUF key and is not applied, as in llama.cpp.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import GGUFError
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, rms_norm, rope_inv_freq, softmax_topk

if TYPE_CHECKING:
    from ..runtime.step import Step


@register("olmoe")
class Olmoe(MoEModel):
    expert_width_key = "feed_forward_length"  # llama.cpp: the experts are n_ff wide

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        d, n_embd = self.meta_desc, self.n_embd
        n_head, n_kv, hd = self.read_heads(value_length=True)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-5)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        #: whether the top-k router probabilities are renormalized to sum 1 (transformers' norm_topk_prob)
        self.norm_topk = self.softmax_routing(norm=False, switchable=True)
        self.check_rope_pairs(hd)
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        q_desc = d(attention__head_count=n_head, attention__key_length=hd)
        k_desc = d(attention__head_count_kv=n_kv, attention__key_length=hd)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            if i not in self.layout:
                raise GGUFError(f"{self.gguf.path}: tensor {p}ffn_gate_exps.weight is missing (every olmoe layer "
                                f"has routed experts; {d(block_count=self.n_layers)})")
            blocks.append({
                "attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                **self.attention_tensors(p, n_head, n_kv, hd, self.head_dim_v),
                "q_norm": self.tensor(p + "attn_q_norm.weight", (n_head * hd,), q_desc + " (q is normed whole)",
                                      kind="norm"),
                "k_norm": self.tensor(p + "attn_k_norm.weight", (n_kv * hd,), k_desc + " (k is normed whole)",
                                      kind="norm"),
                "ffn_norm": self.tensor(p + "ffn_norm.weight", (n_embd,), emb, kind="norm"),
                "router": self.router_tensor(p),
                "moe": self.moe(i),
            })
        self.check_heads_grouped(n_head, n_kv)  # after the shapes: reported with the tensor it contradicts
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.head_dim, self.device))
        self.load_declared(ends, blocks)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] float32 -> (ids [T, top_k] int64, weights [T, top_k] float32): the
        top-k of softmax(logits) over all experts, as they are (transformers' OlmoeTopKRouter with
        norm_topk_prob false; llama.cpp's build_moe_ffn with softmax gating, norm_w false), or divided by their
        sum when the file sets ``expert_weights_norm``."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix` and the routed experts in the fast decode step's terms: q/k norms over the whole projection."""
        b = self.blocks[i]
        return FastLayer(1.0 / math.sqrt(self.head_dim), q_norm=b["q_norm"], k_norm=b["k_norm"], whole_norm=True,
                         norm_topk=self.norm_topk)

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Attention with q/k RMSNorm over the whole projection (OlmoeAttention), then split into heads and
        NEOX RoPE; residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = rms_norm(b["q"].linear(h), b["q_norm"], self.eps).view(n_tok, self.n_head, self.head_dim)
        k = rms_norm(b["k"].linear(h), b["k_norm"], self.eps).view(n_tok, self.n_kv, self.head_dim)
        v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
        return x + b["o"].linear(step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim)))
