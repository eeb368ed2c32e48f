"""Qwen3-MoE (GGUF ``general.architecture = qwen3moe``).

Per layer: RMSNorm -> GQA attention with per-head q/k RMSNorm and NEOX RoPE -> residual ->
RMSNorm -> softmax router, top-k, weights renormalized to sum 1 -> SwiGLU experts -> residual.
Layers without routed experts (``mlp_only_layers``) use a dense SwiGLU FFN. Semantics follow
transformers' Qwen3MoeForCausalLM and llama.cpp's qwen3moe graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..experts.moe import MoE
from .base import LoadOptions, MoEModel, register
from .layers import KVCache, attention, rms_norm, rope_neox


@register("qwen3moe")
class Qwen3MoE(MoEModel):
    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        g = gguf.arch_get
        self.n_layers = int(g("block_count", required=True))
        self.n_embd = int(g("embedding_length", required=True))
        self.n_head = int(g("attention.head_count", required=True))
        self.n_kv = int(g("attention.head_count_kv", self.n_head))
        self.head_dim = int(g("attention.key_length", self.n_embd // self.n_head))
        self.head_dim_v = int(g("attention.value_length", self.head_dim))
        self.eps = float(g("attention.layer_norm_rms_epsilon", 1e-6))
        self.rope_base = float(g("rope.freq_base", 10000.0))
        self.embd = self.weight("token_embd.weight")
        self.n_vocab = self.embd.shape[0]
        self.out_norm = self.norm("output_norm.weight")
        self.output = self.weight("output.weight") if self.has("output.weight") else self.embd
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
                b["moe"] = MoE(i, self.layout, lambda: self.store)
            else:
                b["gate"], b["up"] = self.weight(p + "ffn_gate.weight"), self.weight(p + "ffn_up.weight")
                b["down"] = self.weight(p + "ffn_down.weight")
            self.blocks.append(b)

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.n_layers, n_ctx, self.n_kv, self.head_dim, self.head_dim_v, self.device)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, sum 1)."""
        probs = torch.softmax(router_logits, dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits_all: bool = False) -> torch.Tensor:
        n_tok = tokens.shape[0]
        if start + n_tok > cache.n_ctx:
            raise ValueError(f"context full: {start + n_tok} tokens > n_ctx {cache.n_ctx}")
        pos = torch.arange(start, start + n_tok, device=self.device)
        x = self.embd.rows_of(tokens)  # [T, hidden]
        scale = 1.0 / math.sqrt(self.head_dim)
        for i, b in enumerate(self.blocks):
            h = rms_norm(x, b["attn_norm"], self.eps)
            q = rms_norm(b["q"].linear(h).view(n_tok, self.n_head, self.head_dim), b["q_norm"], self.eps)
            k = rms_norm(b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim), b["k_norm"], self.eps)
            v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
            q, k = rope_neox(q, pos, self.rope_base), rope_neox(k, pos, self.rope_base)
            cache.k[i][start:start + n_tok] = k
            cache.v[i][start:start + n_tok] = v
            a = attention(q, cache.k[i][: start + n_tok], cache.v[i][: start + n_tok], start, scale)
            x = x + b["o"].linear(a)
            h = rms_norm(x, b["ffn_norm"], self.eps)
            if "moe" in b:
                ids, w = self.route(b["router"].linear(h))
                routed, _ = b["moe"](h, ids, w, overlap=self.opts.overlap)
                x = x + routed
            else:
                x = x + b["down"].linear(F.silu(b["gate"].linear(h)) * b["up"].linear(h))
        if not logits_all:
            x = x[-1:]
        return self.output.linear(rms_norm(x, self.out_norm, self.eps))
