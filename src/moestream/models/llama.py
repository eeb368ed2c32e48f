"""Mixtral: llama with routed experts (GGUF ``general.architecture = llama``).

Per layer: RMSNorm -> GQA attention with RoPE (no biases, no q/k norms) -> residual -> RMSNorm -> softmax router
over all experts, top-k of the probabilities, the k weights renormalized to sum 1 -> SwiGLU experts -> residual.
Final RMSNorm and an untied ``output`` matrix (``token_embd`` when the file has none). Semantics follow
transformers' MixtralForCausalLM (MixtralTopKRouter: softmax, topk, divide by the sum) and llama.cpp's llama
graph (build_moe_ffn with softmax gating and normalized weights).

RoPE: llama.cpp's llama uses the "normal" RoPE mode, rotating adjacent pairs (2i, 2i+1) of each head; its
converter permuted the q/k rows of the checkpoint so that this equals transformers' rotate-half RoPE on the
original weights. Here q and k are de-interleaved (dims 0,2,4,... then 1,3,5,...) and rotated NEOX style
(layers.Rope): the same rotation, with the head's dims permuted alike in q and k, which leaves every q.k
product unchanged. A dense llama file (no ``ffn_*_exps`` tensors) is refused by MoEModel.
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


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [T, heads, head_dim] -> the same values with each head's dims reordered (0, 2, 4, ..., 1, 3,
    5, ...): llama.cpp's adjacent RoPE pairs (2i, 2i+1) become NEOX pairs (i, i + head_dim/2)."""
    t, h, d = x.shape
    return x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)


@register("llama")
class Mixtral(MoEModel):
    expert_width_key = "feed_forward_length"  # llama.cpp: the experts are n_ff wide

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        d, n_embd = self.meta_desc, self.n_embd
        n_head, n_kv, hd = self.read_heads(value_length=True)
        self.n_rot = self.meta_int("rope.dimension_count", self.head_dim)
        # llama.cpp requires this key for llama files; the default is Mixtral-8x7B's published rms_norm_eps
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-5)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        self.softmax_routing(norm=True, switchable=False)  # Mixtral: always renormalized
        self.check_rope_pairs(hd)
        if self.n_rot != hd:
            raise GGUFError(f"{self.gguf.path}: metadata {d(rope__dimension_count=self.n_rot)} differs from "
                            f"{d(attention__key_length=hd)}: partial RoPE is not supported for llama files")
        unsupported = [n for n in self.gguf.tensors if n.startswith(("rope_freqs.", "rope_factors_"))
                       or "_shexp." in n or n.endswith(".bias")]
        unsupported += [f"metadata key {self.gguf.arch}.{k}" for k in ("attention.scale",)
                        if self.has_meta(k)]
        if unsupported:  # llama.cpp's llama graph knows these (Llama 3 RoPE factors, Granite), moestream does not
            raise GGUFError(f"{self.gguf.path}: llama file with {unsupported[0]}: only Mixtral-style llama files "
                            f"(no RoPE frequency factors, biases, shared experts or scales) are supported")
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 **self.attention_tensors(p, n_head, n_kv, hd, self.head_dim_v),
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

    def has_meta(self, suffix: str) -> bool:
        """Whether the file holds the metadata key ``<arch>.<suffix>``."""
        return self.gguf.arch_get(suffix) is not None

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: float32 [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, sum 1):
        softmax over all experts, top-k of the probabilities, renormalized (transformers MixtralTopKRouter;
        llama.cpp build_moe_ffn, softmax gating, norm_w)."""
        return softmax_topk(router_logits, self.top_k, norm=True)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: float32 [T, hidden], the FFN-normed input of MoE block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix` and the routed experts in the fast decode step's terms: no q/k norms, each q and k head
        de-interleaved before NEOX RoPE, softmax routing renormalised."""
        return FastLayer(1.0 / math.sqrt(self.head_dim), deinterleave=True, norm_topk=True)

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with RoPE, residual added: x [T, hidden] -> same. The cache holds the keys de-interleaved
        and rotated (see the module docstring)."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = deinterleave(b["q"].linear(h).view(n_tok, self.n_head, self.head_dim))
        k = deinterleave(b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim))
        v = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
        return x + b["o"].linear(step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim)))
