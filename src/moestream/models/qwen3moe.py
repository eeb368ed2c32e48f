"""Qwen3-MoE (GGUF ``general.architecture = qwen3moe``).

Per layer: RMSNorm -> GQA attention with per-head q/k RMSNorm and NEOX RoPE -> residual ->
RMSNorm -> softmax router, top-k, weights renormalized to sum 1 -> SwiGLU experts -> residual.
Layers without routed experts (``mlp_only_layers``) use a dense SwiGLU FFN. Semantics follow
transformers' Qwen3MoeForCausalLM and llama.cpp's qwen3moe graph.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, rms_norm, rope_inv_freq, softmax_topk

if TYPE_CHECKING:
    from ..runtime.step import Step


@register("qwen3moe")
class Qwen3MoE(MoEModel):
    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        d, n_embd = self.meta_desc, self.n_embd
        n_head, n_kv, hd = self.read_heads(value_length=True)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        #: top-k weights renormalized (transformers' norm_topk_prob; published true, llama.cpp always)
        self.norm_topk = self.softmax_routing(norm=True, switchable=True)
        self.check_rope_pairs(hd)
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 **self.attention_tensors(p, n_head, n_kv, hd, self.head_dim_v),
                 "q_norm": self.tensor(p + "attn_q_norm.weight", (hd,), d(attention__key_length=hd), kind="norm"),
                 "k_norm": self.tensor(p + "attn_k_norm.weight", (hd,), d(attention__key_length=hd), kind="norm"),
                 "ffn_norm": self.tensor(p + "ffn_norm.weight", (n_embd,), emb, kind="norm")}
            if i in self.layout:
                b.update(router=self.router_tensor(p), moe=self.moe(i))
            else:
                b.update(self.ffn_tensors(p))
            blocks.append(b)
        self.check_heads_grouped(n_head, n_kv)  # after the shapes: reported with the tensor it contradicts
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.head_dim, self.device))
        self.load_declared(ends, blocks)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, summing to 1 unless
        the file sets ``expert_weights_norm`` false)."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of MoE block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix` and the routed experts in the fast decode step's terms: per-head q/k norms, softmax routing."""
        b = self.blocks[i]
        return FastLayer(1.0 / math.sqrt(self.head_dim), q_norm=b["q_norm"], k_norm=b["k_norm"],
                         norm_topk=self.norm_topk)

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with per-head q/k RMSNorm and NEOX RoPE, residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = b["q"].linear(h).view(n_tok, self.n_head, self.head_dim)
        k = b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim)
        v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
        a = step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim), q_norm=b["q_norm"],
                                  k_norm=b["k_norm"], eps=self.eps)
        return x + b["o"].linear(a)
