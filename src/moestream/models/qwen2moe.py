"""Qwen2-MoE (GGUF ``general.architecture = qwen2moe``; transformers ``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B).

Per layer (every layer is an MoE layer, as llama.cpp's qwen2moe graph requires):

- ``h = RMSNorm(x)``; GQA attention with biased projections ``q = W_q h + b_q``, ``k = W_k h + b_k``,
  ``v = W_v h + b_v`` (no q/k norm), NEOX RoPE over the whole head, scale ``1/sqrt(head_dim)``, causal;
  ``x += W_o a`` (no output bias).
- ``h = RMSNorm(x)``; router ``p = softmax(W_r h)`` over all experts, the top-k ids and their probabilities
  as weights, NOT renormalized (published ``norm_topk_prob`` false; llama.cpp's qwen2moe graph passes
  ``norm_w = false`` and no weight scale); routed SwiGLU experts ``sum_e p_e W_down,e(silu(W_gate,e h) *
  W_up,e h)``; plus a shared SwiGLU expert scaled by ``sigmoid(w_shexp_gate . h)`` (one scalar per token;
  llama.cpp writes it as ``silu(z) / z``); ``x += routed + shared``.

Widths. The routed expert's width is ``{arch}.expert_feed_forward_length`` (the converter writes it from
``moe_intermediate_size``), checked against the expert tensors. A file without that key is handled as llama.cpp
does (``llama_model_qwen2moe::load_arch_tensors``): the width is ``feed_forward_length / expert_used_count``
(integer division), and a file whose expert tensors disagree with it is refused (llama.cpp refuses it at its
tensor-shape check). The shared expert's width is ``{arch}.expert_shared_feed_forward_length`` checked against
``ffn_gate_shexp``; without the key, the tensor's (llama.cpp would take ``feed_forward_length``: a file where that
differs from the tensor loads here and not there).

Semantics follow transformers' ``modeling_qwen2_moe.py`` and llama.cpp's ``src/models/qwen2moe.cpp``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import GGUFError
from .base import LoadOptions, MoEModel, register
from .layers import KVCache, Rope, linear_bias, rms_norm, rope_inv_freq, softmax_topk, swiglu_ffn

if TYPE_CHECKING:
    from ..runtime.step import Step


@register("qwen2moe")
class Qwen2MoE(MoEModel):
    expert_width_key = None  # the width is checked (or derived, as llama.cpp does) in this file

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        self.n_layers = self.meta_int("block_count", required=True)
        self.n_embd = self.meta_int("embedding_length", required=True)
        self.n_head = self.meta_int("attention.head_count", required=True)
        self.n_kv = self.meta_int("attention.head_count_kv", self.n_head)
        self.head_dim = self.meta_int("attention.key_length", max(self.n_embd // self.n_head, 1))
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        #: top-k weights renormalized (transformers' norm_topk_prob; published false, llama.cpp never)
        self.norm_topk = self.softmax_routing(norm=False, switchable=True)
        self.n_ff_exp = self.expert_widths()
        self.check_shapes()
        #: the shared expert's width (rows of ffn_gate_shexp, equal to the key where the file has it)
        self.n_ff_shexp = self.gguf.tensor_info("blk.0.ffn_gate_shexp.weight").shape[0]
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.head_dim, self.device))
        self.load_ends()
        self.blocks = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.blocks.append({
                "attn_norm": self.norm(p + "attn_norm.weight"),
                "q": self.weight(p + "attn_q.weight"), "k": self.weight(p + "attn_k.weight"),
                "v": self.weight(p + "attn_v.weight"), "o": self.weight(p + "attn_output.weight"),
                "bq": self.norm(p + "attn_q.bias"), "bk": self.norm(p + "attn_k.bias"),
                "bv": self.norm(p + "attn_v.bias"),
                "ffn_norm": self.norm(p + "ffn_norm.weight"),
                "router": self.weight(p + "ffn_gate_inp.weight"),
                "moe": self.moe(i),
                "sh_gate_inp": self.weight(p + "ffn_gate_inp_shexp.weight"),
                "sh_gate": self.weight(p + "ffn_gate_shexp.weight"), "sh_up": self.weight(p + "ffn_up_shexp.weight"),
                "sh_down": self.weight(p + "ffn_down_shexp.weight"),
            })

    def expert_widths(self) -> list[int]:
        """The routed experts' width per layer: ``expert_feed_forward_length`` (one value or one per layer), or,
        where the file lacks it (or writes 0), llama.cpp's fallback ``feed_forward_length // expert_used_count``.
        GGUFError naming the file and the keys where neither is there."""
        g = self.gguf.arch_get
        if g("expert_feed_forward_length") is not None:
            widths = self.meta_ints("expert_feed_forward_length", self.n_layers, minimum=0)
            if all(widths):
                return widths
        if g("feed_forward_length") is None:
            raise GGUFError(f"{self.gguf.path}: metadata key {self._key('expert_feed_forward_length')} is missing "
                            f"(and {self._key('feed_forward_length')}, from which llama.cpp derives it, too)")
        n_ff = self.meta_ints("feed_forward_length", self.n_layers)
        return [f // self.top_k for f in n_ff]

    def check_shapes(self) -> None:
        """Metadata against the tensor shapes (GGUFError naming the tensor and the keys), before any weight is read."""
        d = self.meta_desc
        n_embd, n_head, n_kv, hd = self.n_embd, self.n_head, self.n_kv, self.head_dim
        if hd % 2:
            raise GGUFError(f"{self.gguf.path}: metadata {d(attention__key_length=hd)} must be even (RoPE rotates "
                            f"pairs of dimensions)")
        emb = d(embedding_length=n_embd)
        self.check_common_shapes(n_embd, emb)
        g = self.gguf.arch_get
        ff_key = self._key("expert_feed_forward_length")
        if g("expert_feed_forward_length") is not None and g("expert_feed_forward_length") != 0:
            why = f"{ff_key}={g('expert_feed_forward_length')}"
        else:
            why = (f"{ff_key} absent: {self._key('feed_forward_length')}={g('feed_forward_length')} / "
                   f"{self._key('expert_used_count')}={self.top_k}, as llama.cpp derives it")
        sh_key = g("expert_shared_feed_forward_length")
        for i in range(self.n_layers):
            p = f"blk.{i}."
            if i not in self.layout:
                raise GGUFError(f"{self.gguf.path}: layer {i} has no routed experts (blk.{i}.ffn_*_exps); every "
                                f"qwen2moe layer is an MoE layer")
            self.expect_shape(p + "attn_norm.weight", (n_embd,), emb)
            q_desc = d(attention__head_count=n_head, attention__key_length=hd, embedding_length=n_embd)
            kv_desc = d(attention__head_count_kv=n_kv, attention__key_length=hd, embedding_length=n_embd)
            self.expect_shape(p + "attn_q.weight", (n_head * hd, n_embd), q_desc)
            self.expect_shape(p + "attn_k.weight", (n_kv * hd, n_embd), kv_desc)
            self.expect_shape(p + "attn_v.weight", (n_kv * hd, n_embd), kv_desc)
            self.expect_shape(p + "attn_q.bias", (n_head * hd,), q_desc)
            self.expect_shape(p + "attn_k.bias", (n_kv * hd,), kv_desc)
            self.expect_shape(p + "attn_v.bias", (n_kv * hd,), kv_desc)
            self.expect_shape(p + "attn_output.weight", (n_embd, n_head * hd), q_desc)
            self.expect_shape(p + "ffn_norm.weight", (n_embd,), emb)
            self.expect_shape(p + "ffn_gate_inp.weight", (self.n_experts, n_embd),
                              d(expert_count=self.n_experts, embedding_length=n_embd))
            for name, m in self.layout[i].items():
                rows = m.cols if name == "down" else (m.rows // 2 if name == "gate_up" else m.rows)
                if rows != self.n_ff_exp[i]:
                    raise GGUFError(f"{self.gguf.path}: tensor blk.{i}.ffn_{name}_exps.weight has experts of width "
                                    f"{rows} but the metadata ({why}) implies {self.n_ff_exp[i]}")
            # [1, n_embd] as the converter writes it; llama-quantize writes it 1-D (ggml_n_dims drops the 1)
            if tuple(self.gguf.tensor_info(p + "ffn_gate_inp_shexp.weight").shape) != (n_embd,):
                self.expect_shape(p + "ffn_gate_inp_shexp.weight", (1, n_embd), emb)
            if sh_key is not None:
                n_sh = self.meta_int("expert_shared_feed_forward_length")
                sh = emb + ", " + d(expert_shared_feed_forward_length=n_sh)
            else:
                n_sh = self.gguf.tensor_info(p + "ffn_gate_shexp.weight").shape[0]
                sh = emb + f" and ffn_gate_shexp's {n_sh} rows"
            self.expect_shape(p + "ffn_gate_shexp.weight", (n_sh, n_embd), sh)
            self.expect_shape(p + "ffn_up_shexp.weight", (n_sh, n_embd), sh)
            self.expect_shape(p + "ffn_down_shexp.weight", (n_embd, n_sh), sh)
        if n_head % n_kv:  # after the shapes: a wrong head count is best reported with the tensor it contradicts
            raise GGUFError(f"{self.gguf.path}: metadata {d(attention__head_count=n_head)} is not a multiple of "
                            f"{d(attention__head_count_kv=n_kv)}")

    def make_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.n_layers, n_ctx, self.n_kv, self.head_dim, self.head_dim, self.device)

    def cache_bytes(self, n_ctx: int) -> int:
        return 4 * self.n_layers * n_ctx * self.n_kv * 2 * self.head_dim

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] float32 -> (ids [T, top_k] int64, weights [T, top_k] float32): the top-k
        softmax probabilities themselves (not renormalized: transformers' ``norm_topk_prob=False``, llama.cpp's
        ``norm_w=false``), or renormalized when the file sets ``expert_weights_norm`` true."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with q/k/v biases and NEOX RoPE, residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = linear_bias(b["q"], h, b["bq"]).view(n_tok, self.n_head, self.head_dim)
        k = linear_bias(b["k"], h, b["bk"]).view(n_tok, self.n_kv, self.head_dim)
        v = linear_bias(b["v"], h, b["bv"]).view(n_tok, self.n_kv, self.head_dim)
        return x + b["o"].linear(step.cached_attention(q, k, v, self.rope, i, 1.0 / math.sqrt(self.head_dim)))

    def has_shared(self, i: int) -> bool:
        return True

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The shared expert of layer i on h [T, hidden] -> [T, hidden], scaled by its sigmoid gate."""
        b = self.blocks[i]
        return torch.sigmoid(b["sh_gate_inp"].linear(h)) * swiglu_ffn(b["sh_gate"], b["sh_up"], b["sh_down"], h)
