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
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, elementwise, linear_bias, rms_norm, rope_inv_freq, softmax_topk, swiglu_ffn

if TYPE_CHECKING:
    from ..runtime.step import Step


@register("qwen2moe")
class Qwen2MoE(MoEModel):
    expert_width_key = None  # the width is checked (or derived, as llama.cpp does) in this file

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        d, g, n_embd = self.meta_desc, self.gguf.arch_get, self.n_embd
        n_head, n_kv, hd = self.read_heads()
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        #: top-k weights renormalized (transformers' norm_topk_prob; published false, llama.cpp never)
        self.norm_topk = self.softmax_routing(norm=False, switchable=True)
        self.n_ff_exp = self.expert_widths()
        self.check_rope_pairs(hd)
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        ff_key = self._key("expert_feed_forward_length")
        if g("expert_feed_forward_length") is not None and g("expert_feed_forward_length") != 0:
            why = f"{ff_key}={g('expert_feed_forward_length')}"
        else:
            why = (f"{ff_key} absent: {self._key('feed_forward_length')}={g('feed_forward_length')} / "
                   f"{self._key('expert_used_count')}={self.top_k}, as llama.cpp derives it")
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.require_moe(i)
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 **self.attention_tensors(p, n_head, n_kv, hd)}
            b["bq"], b["bk"], b["bv"] = self.qkv_biases(p, n_head, n_kv, hd).values()
            b.update(ffn_norm=self.tensor(p + "ffn_norm.weight", (n_embd,), emb, kind="norm"),
                     router=self.router_tensor(p), moe=self.moe(i))
            self.check_expert_widths(i, self.n_ff_exp[i], why)
            b["sh_gate_inp"] = self.shared_gate_tensor(p)
            if g("expert_shared_feed_forward_length") is not None:
                n_sh = self.meta_int("expert_shared_feed_forward_length")
                b.update(self.ffn_tensors(p, "_shexp", n_sh, emb + ", " + d(expert_shared_feed_forward_length=n_sh),
                                          names=("sh_gate", "sh_up", "sh_down")))
            else:
                b.update(self.ffn_tensors(p, "_shexp", names=("sh_gate", "sh_up", "sh_down")))
            blocks.append(b)
        self.check_heads_grouped(n_head, n_kv)  # after the shapes: reported with the tensor it contradicts
        #: the shared expert's width (rows of ffn_gate_shexp, equal to the key where the file has it)
        self.n_ff_shexp = self.gguf.tensor_info("blk.0.ffn_gate_shexp.weight").shape[0]
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.head_dim, self.device))
        self.load_declared(ends, blocks)

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

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] float32 -> (ids [T, top_k] int64, weights [T, top_k] float32): the top-k
        softmax probabilities themselves (not renormalized: transformers' ``norm_topk_prob=False``, llama.cpp's
        ``norm_w=false``), or renormalized when the file sets ``expert_weights_norm`` true."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix`, the routed experts and :meth:`shared` in the fast decode step's terms: q/k/v biases, no q/k
        norms, softmax routing, the shared expert (this class's own code) added after the routed sum."""
        b = self.blocks[i]
        return FastLayer(1.0 / math.sqrt(self.head_dim), biases=(b["bq"], b["bk"], b["bv"]), norm_topk=self.norm_topk,
                         shared=True)

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
        gate = elementwise(torch.sigmoid, b["sh_gate_inp"].linear(h))
        return gate * swiglu_ffn(b["sh_gate"], b["sh_up"], b["sh_down"], h)
