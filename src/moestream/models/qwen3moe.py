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

from ..errors import GGUFError
from .base import LoadOptions, MoEModel, register
from .layers import KVCache, Rope, rms_norm, rope_inv_freq, softmax_topk

if TYPE_CHECKING:
    from ..runtime.step import Step


@register("qwen3moe")
class Qwen3MoE(MoEModel):
    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        self.n_layers = self.meta_int("block_count", required=True)
        self.n_embd = self.meta_int("embedding_length", required=True)
        self.n_head = self.meta_int("attention.head_count", required=True)
        self.n_kv = self.meta_int("attention.head_count_kv", self.n_head)
        self.head_dim = self.meta_int("attention.key_length", max(self.n_embd // self.n_head, 1))
        self.head_dim_v = self.meta_int("attention.value_length", self.head_dim)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        #: top-k weights renormalized (transformers' norm_topk_prob; published true, llama.cpp always)
        self.norm_topk = self.softmax_routing(norm=True, switchable=True)
        self.check_shapes()
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.head_dim, self.device))
        self.load_ends()
        self.blocks = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            b = {
                "attn_norm": self.norm(p + "attn_norm.weight"),
                "q": self.weight(p + "attn_q.weight"), "k": self.weight(p + "attn_k.weight"),
                "v": self.weight(p + "attn_v.weight"), "o": self.weight(p + "attn_output.weight"),
                "q_norm": self.norm(p + "attn_q_norm.weight"), "k_norm": self.norm(p + "attn_k_norm.weight"),
                "ffn_norm": self.norm(p + "ffn_norm.weight"),
            }
            if i in self.layout:
                b["router"] = self.weight(p + "ffn_gate_inp.weight")
                b["moe"] = self.moe(i)
            else:
                b["gate"], b["up"] = self.weight(p + "ffn_gate.weight"), self.weight(p + "ffn_up.weight")
                b["down"] = self.weight(p + "ffn_down.weight")
            self.blocks.append(b)

    def check_shapes(self) -> None:
        """Metadata against the tensor shapes (GGUFError naming the tensor and the keys), before any weight is read."""
        d = self.meta_desc
        n_embd, n_head, n_kv, hd, hdv = self.n_embd, self.n_head, self.n_kv, self.head_dim, self.head_dim_v
        if hd % 2:
            raise GGUFError(f"{self.gguf.path}: metadata {d(attention__key_length=hd)} must be even (RoPE rotates "
                            f"pairs of dimensions)")
        emb = d(embedding_length=n_embd)
        self.check_common_shapes(n_embd, emb)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.expect_shape(p + "attn_norm.weight", (n_embd,), emb)
            self.expect_shape(p + "attn_q.weight", (n_head * hd, n_embd),
                              d(attention__head_count=n_head, attention__key_length=hd, embedding_length=n_embd))
            self.expect_shape(p + "attn_k.weight", (n_kv * hd, n_embd),
                              d(attention__head_count_kv=n_kv, attention__key_length=hd, embedding_length=n_embd))
            self.expect_shape(p + "attn_v.weight", (n_kv * hdv, n_embd),
                              d(attention__head_count_kv=n_kv, attention__value_length=hdv, embedding_length=n_embd))
            self.expect_shape(p + "attn_output.weight", (n_embd, n_head * hdv),
                              d(attention__head_count=n_head, attention__value_length=hdv, embedding_length=n_embd))
            self.expect_shape(p + "attn_q_norm.weight", (hd,), d(attention__key_length=hd))
            self.expect_shape(p + "attn_k_norm.weight", (hd,), d(attention__key_length=hd))
            self.expect_shape(p + "ffn_norm.weight", (n_embd,), emb)
            if i in self.layout:
                self.expect_shape(p + "ffn_gate_inp.weight", (self.n_experts, n_embd),
                                  d(expert_count=self.n_experts, embedding_length=n_embd))
            else:
                n_ff = self.gguf.tensor_info(p + "ffn_gate.weight").shape[0]
                self.expect_shape(p + "ffn_gate.weight", (n_ff, n_embd), emb)
                self.expect_shape(p + "ffn_up.weight", (n_ff, n_embd), emb + f" and ffn_gate's {n_ff} rows")
                self.expect_shape(p + "ffn_down.weight", (n_embd, n_ff), emb + f" and ffn_gate's {n_ff} rows")
        if n_head % n_kv:  # after the shapes: a wrong head count is best reported with the tensor it contradicts
            raise GGUFError(f"{self.gguf.path}: metadata {d(attention__head_count=n_head)} is not a multiple of "
                            f"{d(attention__head_count_kv=n_kv)}")

    def make_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.n_layers, n_ctx, self.n_kv, self.head_dim, self.head_dim_v, self.device)

    def cache_bytes(self, n_ctx: int) -> int:
        return 4 * self.n_layers * n_ctx * self.n_kv * (self.head_dim + self.head_dim_v)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, summing to 1 unless
        the file sets ``expert_weights_norm`` false)."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of MoE block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with per-head q/k RMSNorm and NEOX RoPE, residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = rms_norm(b["q"].linear(h).view(n_tok, self.n_head, self.head_dim), b["q_norm"], self.eps)
        k = rms_norm(b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim), b["k_norm"], self.eps)
        v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
        a = step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim))
        return x + b["o"].linear(a)
