"""GLM-4.5 MoE (GGUF ``general.architecture = glm4moe``; transformers ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air).

Per trunk layer:

- ``h = RMSNorm(x)``; GQA attention with ``q = W_q h + b_q``, ``k = W_k h + b_k``, ``v = W_v h + b_v`` (the biases
  are optional: ``attention_bias``, true in the published models), then, where the file has
  ``attn_q_norm``/``attn_k_norm`` (``use_qk_norm``: GLM-4.5 yes, GLM-4.5-Air no), an RMSNorm of each head of q
  and of k (one weight of ``head_dim``); NEOX RoPE over the first ``rope.dimension_count`` dims of each head only
  (``partial_rotary_factor`` 0.5: half of them), the rest passed through; scale ``1/sqrt(head_dim)``, causal;
  ``x += W_o a``.
- ``h = RMSNorm(x)`` (``post_attention_norm``). The first ``leading_dense_block_count`` layers
  (``first_k_dense_replace``) are dense: ``x += W_down(silu(W_gate h) * W_up h)``. The others are MoE layers:
  router logits ``W_r h``, routed by :func:`routing.sigmoid_group_topk` (sigmoid scores; the per-expert
  ``exp_probs_b`` bias, transformers' ``e_score_correction_bias``, added only to choose; group-limited choice;
  weights renormalized and scaled), SwiGLU experts, plus an ungated SwiGLU shared expert on the same ``h``:
  ``x += routed + shared``.

Then ``RMSNorm`` and the output matrix (``token_embd`` when the file has no ``output``).

NextN / MTP layers. ``block_count`` counts them (the converter adds ``num_nextn_predict_layers`` to the trunk's
layers and writes ``nextn_predict_layers``): the last ``nextn_predict_layers`` blocks are the multi-token
prediction heads, used by llama.cpp only for speculative drafting, never in the main graph. moestream runs the
first ``block_count - nextn_predict_layers`` blocks only, as llama.cpp's glm4moe graph does; it reads none of the
MTP blocks' tensors and keeps their routed experts out of the expert store (no slot pool for them).

Routing keys, when the file lacks them: what llama.cpp does (``llama_model_glm4_moe::load_arch_hparams`` and
the generic hyper-parameter loader), which is

- ``expert_gating_func``: absent (or 0, none) means sigmoid. Only sigmoid is computed here: a file that asks for
  another gating function is refused (llama.cpp would apply it; no published GLM-4.5 uses one).
- ``expert_weights_norm``: absent = false (no renormalization). transformers' config default is true, and both
  published configs set it true (so the converter writes it).
- ``expert_weights_scale``: absent = no scaling (llama.cpp's 0.0, which it treats like 1.0).
- ``expert_group_count`` / ``expert_group_used_count``: absent = 0 = no group limit (the published
  ``n_group = topk_group = 1`` also means none). With a group count > 1, llama.cpp requires it to divide
  ``expert_count`` and ``0 < expert_group_used_count < expert_group_count``; so does moestream (GGUFError), plus
  at least two experts per group (a group's score sums its best two).
- ``leading_dense_block_count``: absent = 0 (every layer MoE).
- ``nextn_predict_layers``: absent = 0 (no MTP blocks). A file whose ``blk.N.nextn.*`` tensors then fall in the
  trunk is refused (llama.cpp refuses it too: it loads no ``nextn`` tensor of a trunk block and stops at its
  tensor count).
- ``expert_shared_count``: required, as in llama.cpp; the shared expert's width is ``expert_feed_forward_length x
  expert_shared_count`` (checked against ``ffn_gate_shexp``).
- ``expert_feed_forward_length``: required, as in llama.cpp; 0 means ``feed_forward_length / expert_used_count``
  (llama.cpp's fallback).

The MoE layers' tensors include ``blk.N.exp_probs_b.bias`` (required, as in llama.cpp). M-RoPE
(``rope.dimension_sections``, GLM-4.5V) is refused. Semantics follow transformers' ``modeling_glm4_moe.py`` and
llama.cpp's ``src/models/glm4-moe.cpp``; the routing function lives in ``models/routing.py``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import kernels
from ..errors import GGUFError
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, linear_bias, rms_norm, rope_inv_freq, swiglu_ffn
from .routing import WEIGHT_SUM_FLOOR, sigmoid_group_topk

if TYPE_CHECKING:
    from ..runtime.step import Step

#: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values: 0 none (glm4moe reads it as sigmoid), 1 softmax, 2 sigmoid
GATING_SIGMOID = 2


@register("glm4moe")
class Glm4MoE(MoEModel):
    expert_width_key = None  # the width is checked (or derived, as llama.cpp does) in this file

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)  # n_blocks, n_mtp, n_layers (the trunk); the MTP blocks get no slot pool
        d, path, n_embd = self.meta_desc, self.gguf.path, self.n_embd
        n_head, n_kv, hd = self.read_heads()
        self.n_rot = self.meta_int("rope.dimension_count", self.head_dim)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", required=True)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        self.n_dense = self.meta_int("leading_dense_block_count", 0, minimum=0)
        self.read_routing_keys()
        self.n_ff_exp = self.expert_width()
        self.n_shared = self.meta_int("expert_shared_count", required=True, minimum=0)
        if self.n_rot % 2 or self.n_rot > hd:
            raise GGUFError(f"{path}: metadata {d(rope__dimension_count=self.n_rot)} must be even and at most "
                            f"{d(attention__key_length=hd)}")
        sections = self.gguf.arch_get("rope.dimension_sections")
        if sections is not None and any(sections):
            raise GGUFError(f"{path}: metadata {d(rope__dimension_sections=list(sections))} asks for M-RoPE "
                            f"(GLM-4.5V), which moestream does not compute")
        if self.n_dense > self.n_layers:
            trunk = d(block_count=self.n_blocks, nextn_predict_layers=self.n_mtp)
            raise GGUFError(f"{path}: metadata {d(leading_dense_block_count=self.n_dense)} is more than the "
                            f"{self.n_layers} trunk layers ({trunk})")
        # every trunk tensor the forward pass reads; the MTP blocks are not declared (they are not run)
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        exp_key = self._key("expert_feed_forward_length")
        exp_desc = (f"{exp_key}={self.n_ff_exp}" if self.gguf.arch_get("expert_feed_forward_length") else
                    f"{exp_key}=0: {self._key('feed_forward_length')} / expert_used_count = {self.n_ff_exp}")
        sh_desc = f"{exp_desc} x {d(expert_shared_count=self.n_shared)}, {emb}"
        nextn = {int(n.split(".")[1]): n for n in self.gguf.tensors if n.startswith("blk.") and ".nextn." in n}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            if i in nextn:  # llama.cpp refuses it too (a tensor it does not load: "wrong number of tensors")
                raise GGUFError(f"{path}: tensor {nextn[i]} belongs to an MTP block but the metadata "
                                f"({d(block_count=self.n_blocks, nextn_predict_layers=self.n_mtp)}) makes block {i} "
                                f"a trunk layer")
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 **self.attention_tensors(p, n_head, n_kv, hd), **self.qkv_biases(p, n_head, n_kv, hd, optional=True),
                 **{name: self.tensor(p + name, (hd,), d(attention__key_length=hd) + " (one norm per head)",
                                      kind="norm", optional=True)
                    for name in ("attn_q_norm.weight", "attn_k_norm.weight")},
                 "ffn_norm": self.tensor(p + "post_attention_norm.weight", (n_embd,), emb, kind="norm")}
            if self.is_dense_layer(i, self.n_dense):
                b.update(self.ffn_tensors(p))
            else:
                b.update(router=self.router_tensor(p),
                         score_bias=self.tensor(p + "exp_probs_b.bias", (self.n_experts,),
                                                d(expert_count=self.n_experts), kind="norm"),
                         moe=self.moe(i))
                self.check_expert_widths(i, self.n_ff_exp, exp_desc)
                if self.n_shared:
                    b.update(self.ffn_tensors(p, "_shexp", self.n_ff_exp * self.n_shared, sh_desc,
                                              names=("sh_gate", "sh_up", "sh_down")))
            blocks.append(b)
        self.check_heads_grouped(n_head, n_kv)  # after the shapes: reported with the tensor it contradicts
        if opts.metadata_only:
            return
        self.rope = Rope(rope_inv_freq(self.rope_base, self.n_rot, self.device))
        self.load_declared(ends, blocks)

    # --- metadata ---------------------------------------------------------------------------------------------
    def read_routing_keys(self) -> None:
        """The routing keys, with llama.cpp's defaults for absent ones (see the module docstring)."""
        g, path, d = self.gguf.arch_get, self.gguf.path, self.meta_desc
        gating = g("expert_gating_func", 0)
        if isinstance(gating, bool) or not isinstance(gating, int) or gating not in (0, GATING_SIGMOID):
            raise GGUFError(f"{path}: metadata {d(expert_gating_func=gating)} is not sigmoid ({GATING_SIGMOID}); "
                            f"moestream computes glm4moe routing with sigmoid gating only")
        norm_w = g("expert_weights_norm", False)
        if not isinstance(norm_w, bool):
            raise GGUFError(f"{path}: metadata key {self._key('expert_weights_norm')} must be a bool, got {norm_w!r}")
        #: the top-k weights are divided by their sum (transformers' norm_topk_prob)
        self.norm_topk = norm_w
        scale = self.meta_float("expert_weights_scale", 0.0, allow_zero=True)
        #: routed_scaling_factor (llama.cpp's 0.0, the absent key's value, scales nothing, like 1.0)
        self.routed_scale = scale if scale != 0.0 else 1.0
        self.n_group = self.meta_int("expert_group_count", 0, minimum=0)
        self.topk_group = self.meta_int("expert_group_used_count", 0, minimum=0)
        n_exp = self.n_experts
        if self.n_group > 1:
            groups = d(expert_group_count=self.n_group)
            if n_exp % self.n_group or n_exp // self.n_group < 2:
                raise GGUFError(f"{path}: metadata {groups} does not divide {d(expert_count=n_exp)} into groups of "
                                f"at least two experts")
            if not 0 < self.topk_group < self.n_group:
                raise GGUFError(f"{path}: metadata {d(expert_group_used_count=self.topk_group)} must be at least 1 "
                                f"and less than {groups} (as llama.cpp requires)")
        else:
            self.n_group = self.topk_group = 1  # no group limit

    def expert_width(self) -> int:
        """The routed experts' width: ``expert_feed_forward_length`` (required, as in llama.cpp; 0: llama.cpp's
        fallback ``feed_forward_length / expert_used_count``)."""
        n_ff_exp = self.meta_int("expert_feed_forward_length", required=True, minimum=0)
        if n_ff_exp:
            return n_ff_exp
        return self.meta_int("feed_forward_length", required=True) // self.top_k

    # --- compute ----------------------------------------------------------------------------------------------
    def route(self, b: dict, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] float32 of MoE block ``b`` -> (ids [T, top_k] int64, weights [T, top_k]
        float32): :func:`routing.sigmoid_group_topk` with the block's score-correction bias and the file's keys."""
        return sigmoid_group_topk(router_logits, self.top_k, bias=b["score_bias"], n_group=self.n_group,
                                  topk_group=self.topk_group, norm=self.norm_topk, scale=self.routed_scale)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of MoE block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b, b["router"].linear(h))

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with optional q/k/v biases and per-head q/k RMSNorm (before RoPE), RoPE on the first
        n_rot dims of each head (the rest copied); residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q, k, v = (linear_bias(b[n], h, b[f"attn_{n}.bias"]) for n in "qkv")
        q = q.view(n_tok, self.n_head, self.head_dim)
        k = k.view(n_tok, self.n_kv, self.head_dim)
        # the optional per-head norms (before RoPE) inside the attention block: one launch with RoPE on CUDA
        a = step.cached_attention(q, k, v.view(n_tok, self.n_kv, self.head_dim), self.rope, i,
                                  1.0 / math.sqrt(self.head_dim), q_norm=b["attn_q_norm.weight"],
                                  k_norm=b["attn_k_norm.weight"], eps=self.eps)
        return x + b["o"].linear(a)

    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix`, :meth:`route` and :meth:`shared` in the fast decode step's terms: optional q/k/v biases and
        per-head q/k norms, sigmoid routing with the score bias and groups, the shared expert (this class's own
        code); the leading dense layers are MoEModel.dense."""
        b = self.blocks[i]
        return FastLayer(1.0 / math.sqrt(self.head_dim), q_norm=b["attn_q_norm.weight"], k_norm=b["attn_k_norm.weight"],
                         biases=(b["attn_q.bias"], b["attn_k.bias"], b["attn_v.bias"]), norm_topk=self.norm_topk,
                         shared=self.has_shared(i), gating=kernels.GATING_SIGMOID, route_bias=b.get("score_bias"),
                         n_group=self.n_group, topk_group=self.topk_group, floor=WEIGHT_SUM_FLOOR,
                         route_scale=self.routed_scale)

    def has_shared(self, i: int) -> bool:
        return bool(self.n_shared)

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The shared expert of layer i on h [T, hidden] -> [T, hidden] (no gate)."""
        b = self.blocks[i]
        return swiglu_ffn(b["sh_gate"], b["sh_up"], b["sh_down"], h)
