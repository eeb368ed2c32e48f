"""GPT-OSS (GGUF ``general.architecture = gpt-oss``; transformers ``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b).

Per layer, as transformers' ``modeling_gpt_oss.py`` and llama.cpp's ``src/models/openai-moe.cpp`` compute it:

- ``h = RMSNorm(x)``; GQA attention with ``q = W_q h + b_q``, ``k = W_k h + b_k``, ``v = W_v h + b_v`` (biases
  optional, present in the published models), NEOX RoPE with YaRN (``rope.scaling.*``: inverse frequencies mixed
  between extrapolation and interpolation over the truncated correction range, cos/sin times
  ``0.1 ln(factor) + 1`` and ``rope.scaling.attn_factor``), scale ``1/sqrt(head_dim)``, causal; sliding-window
  layers see the last ``attention.sliding_window`` positions only; the softmax of every head has one more logit in
  its denominator, the head's learned sink (``attn_sinks``), that attends to nothing; ``x += W_o a + b_o``.
- ``h = RMSNorm(x)`` (``post_attention_norm``); router logits ``W_r h + b_r``; the top-k logits, softmaxed among
  themselves (llama.cpp's SOFTMAX_WEIGHT gating), weight the experts; each expert is
  ``W_down a + b_down`` with ``a = (u + 1) * g * sigmoid(1.702 g)``, ``g = min(W_gate h + b_gate, 7)``,
  ``u = clamp(W_up h + b_up, -7, 7)`` (the clamped SwiGLU, experts/moe.py ``ClampedSwiGLU``; the expert biases
  stay resident and are indexed by real expert id); ``x += sum_k w_k expert_k(h)``.

Then ``RMSNorm`` and the (untied, required) output matrix.

Keys, when the file lacks them (llama.cpp's ``llama_model_openai_moe::load_arch_hparams`` and the generic loader):

- ``attention.layer_norm_rms_epsilon``, ``expert_feed_forward_length``, ``attention.sliding_window``: required.
- ``attention.sliding_window_pattern``: absent = 2 (layers 0, 2, 4, ... sliding, the others full, as transformers'
  default ``layer_types``); one integer n: layer i slides when ``n == 0`` or ``i % n < n - 1``; a list of bools:
  per layer.
- ``rope.freq_base``: 10000; ``rope.freq_base_swa``: the same as ``rope.freq_base``.
- ``rope.scaling.*``: the shared reader (``MoEModel.rope_scaling``): type none or yarn (any other type is refused);
  ``yarn_log_multiplier`` must be 0 (DeepSeek's mscale form; no GPT-OSS uses it).
- The SwiGLU's alpha 1.702 and limit 7.0 are constants in llama.cpp (no GGUF key) and here.
- ``expert_gating_func``, ``expert_weights_norm``, ``expert_weights_scale``: llama.cpp does not read them for this
  architecture (its graph always uses SOFTMAX_WEIGHT, 3, and no scale) and the converter writes none; absent is
  that routing. A file that sets them is checked by ``MoEModel.softmax_routing``: 0 or 3, true (the top-k
  weights sum to 1), 0 or 1 are accepted; another gating function, ``expert_weights_norm`` false or another
  scale is refused in one line instead of being ignored.

The truncated YaRN range is the only one a GGUF can give (FIELD-NOTES: gpt-oss-20b's published config says
``truncate: false``, which transformers computes and llama.cpp cannot); moestream computes llama.cpp's.
``attention.key_length`` must equal ``rope.dimension_count`` (llama.cpp's openai-moe shapes take the head dim from
it): partial rotary is refused. No CUDA-graph decode for this family.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import GGUFError
from ..experts.moe import ClampedSwiGLU
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import Rope, linear_bias, rms_norm, rope_inv_freq, yarn_attention_factor, yarn_inv_freq

if TYPE_CHECKING:
    from ..runtime.step import Step

#: transformers' ``swiglu_alpha`` / ``swiglu_limit`` of the published configs; llama.cpp's constants
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@register("gpt-oss")
class GptOss(MoEModel):
    expert_width_key = None  # the width is checked (or derived, as llama.cpp does) in this file

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        n_head, n_kv, hd = self.read_heads()
        self.n_rot = self.meta_int("rope.dimension_count", self.head_dim)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", required=True)
        self.n_ff_exp = self.meta_int("expert_feed_forward_length", required=True)
        self.window = self.meta_int("attention.sliding_window", required=True)
        self.is_swa = self.swa_pattern()
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.rope_base_swa = self.meta_float("rope.freq_base_swa", self.rope_base)
        self.softmax_routing(norm=True, switchable=False, gating=3)
        self.scaling = self.rope_scaling(("yarn",))
        if self.scaling is not None and self.scaling.log_multiplier:
            raise GGUFError(f"{gguf.path}: metadata "
                            f"{self.meta_desc(rope__scaling__yarn_log_multiplier=self.scaling.log_multiplier)} asks "
                            f"for DeepSeek's YaRN magnitude, which moestream does not compute for gpt-oss")
        d, path, n_embd, n_exp = self.meta_desc, self.gguf.path, self.n_embd, self.n_experts
        if self.n_rot != hd:
            raise GGUFError(f"{path}: metadata {d(rope__dimension_count=self.n_rot, attention__key_length=hd)} "
                            f"differ: partial rotary, which moestream does not compute for gpt-oss")
        if hd % 2:
            raise GGUFError(f"{path}: metadata {d(attention__key_length=hd)} must be even (NEOX RoPE)")
        self.check_heads_grouped(n_head, n_kv)
        # every tensor the forward pass reads
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        if not self.has("output.weight"):
            raise GGUFError(f"{path}: tensor output.weight is missing (gpt-oss has an untied output matrix; "
                            f"llama.cpp requires it too)")
        exp_desc = d(expert_count=n_exp, expert_feed_forward_length=self.n_ff_exp)
        biases = []  # per layer: the routed experts' biases, float32 [n_experts, rows], indexed by real expert id
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.require_moe(i)
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm"),
                 **self.attention_tensors(p, n_head, n_kv, hd),
                 "o_bias": self.tensor(p + "attn_output.bias", (n_embd,), emb, kind="norm"),
                 **self.qkv_biases(p, n_head, n_kv, hd, optional=True),
                 "sinks": self.tensor(p + "attn_sinks.weight", (n_head,),
                                      d(attention__head_count=n_head) + " (one sink per head)", kind="norm"),
                 "ffn_norm": self.tensor(p + "post_attention_norm.weight", (n_embd,), emb, kind="norm"),
                 "router": self.router_tensor(p),
                 "router_bias": self.tensor(p + "ffn_gate_inp.bias", (n_exp,), d(expert_count=n_exp), kind="norm"),
                 "swa": self.is_swa[i]}
            mats = self.layout[i]
            if set(mats) != {"gate", "up", "down"}:
                raise GGUFError(f"{path}: layer {i} has expert matrices {sorted(mats)}; gpt-oss needs separate "
                                f"ffn_gate_exps, ffn_up_exps and ffn_down_exps (as llama.cpp)")
            self.check_expert_widths(i, self.n_ff_exp, exp_desc)
            biases.append({name: self.tensor(p + f"ffn_{name}_exps.bias", (n_exp, n), exp_desc + ", " + emb,
                                             kind="float")
                           for name, n in (("gate", self.n_ff_exp), ("up", self.n_ff_exp), ("down", n_embd))})
            blocks.append(b)
        if opts.metadata_only:
            return
        self.rope_full = self.make_rope(self.rope_base)
        self.rope_swa = self.rope_full if self.rope_base_swa == self.rope_base else self.make_rope(self.rope_base_swa)
        self.load_declared(ends, blocks)
        act = ClampedSwiGLU(SWIGLU_ALPHA, SWIGLU_LIMIT)
        for i, b in enumerate(self.blocks):
            b["moe"] = self.moe(i, act=act, bias=self.loaded(biases[i]))

    # --- metadata ---------------------------------------------------------------------------------------------
    def swa_pattern(self) -> list[bool]:
        """Which layers slide (see the module docstring): ``attention.sliding_window_pattern`` as llama.cpp's
        ``load_swa_pattern(ml, 2)`` reads it."""
        key, path = self._key("attention.sliding_window_pattern"), self.gguf.path
        v = self.gguf.arch_get("attention.sliding_window_pattern", 2)
        if isinstance(v, (list, tuple)):
            if len(v) != self.n_layers or not all(isinstance(x, (bool, int)) for x in v):
                raise GGUFError(f"{path}: metadata key {key} must list one bool per layer ({self.n_layers}), "
                                f"got {list(v)!r}")
            return [bool(x) for x in v]
        n = self._as_int("attention.sliding_window_pattern", v, 0)
        return [n == 0 or i % n < n - 1 for i in range(self.n_layers)]

    def make_rope(self, base: float) -> Rope:
        """NEOX RoPE of ``base`` over the whole head, YaRN-scaled when the file says so."""
        s = self.scaling
        if s is None:
            return Rope(rope_inv_freq(base, self.n_rot, self.device))
        inv = yarn_inv_freq(base, self.n_rot, s.factor, s.orig_ctx, s.beta_fast, s.beta_slow, self.device)
        return Rope(inv, scale=yarn_attention_factor(s.factor) * s.attn_factor)

    # --- compute ----------------------------------------------------------------------------------------------
    def fast_layer(self, i: int) -> FastLayer:
        """:meth:`mix`, :meth:`gate` and the routed experts in the fast decode step's terms (runtime/fastdecode.py):
        q/k/v biases, no q/k norms, the layer's RoPE (``rope_swa`` or ``rope_full``), sliding window on the sliding
        layers, the sinks, the o bias; the router is :meth:`gate` itself (``own_gate``); the experts' clamped SwiGLU
        and biases are the MoE layer's own (ms_moe)."""
        b = self.blocks[i]
        return FastLayer(1.0 / math.sqrt(self.head_dim), biases=tuple(b[f"attn_{n}.bias"] for n in "qkv"),
                         own_gate=True, rope=self.rope_swa if b["swa"] else self.rope_full,
                         window=self.window if b["swa"] else 0, sinks=b["sinks"], o_bias=b["o_bias"])

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of block ``b`` -> (ids [T, top_k] int64 real expert ids, weights
        [T, top_k] float32): the top-k of the biased router logits, softmaxed among themselves (torch's ops; the
        fast decode step calls this too)."""
        logits = b["router"].linear(h) + b["router_bias"]  # [T, n_experts]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """GQA attention with q/k/v/o biases, YaRN RoPE, a sliding window on every other layer and one sink logit
        per head; residual added: x [T, hidden] -> same."""
        b, n_tok = self.blocks[i], x.shape[0]
        h = rms_norm(x, b["attn_norm"], self.eps)
        q, k, v = (linear_bias(b[n], h, b[f"attn_{n}.bias"]) for n in "qkv")
        rope = self.rope_swa if b["swa"] else self.rope_full
        a = step.cached_attention(q.view(n_tok, self.n_head, self.head_dim), k.view(n_tok, self.n_kv, self.head_dim),
                                  v.view(n_tok, self.n_kv, self.head_dim), rope, i, 1.0 / math.sqrt(self.head_dim),
                                  window=self.window if b["swa"] else None, sinks=b["sinks"])
        return x + (b["o"].linear(a) + b["o_bias"])
