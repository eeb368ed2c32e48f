"""DeepSeek-V2/V3 (GGUF ``general.architecture = deepseek2``; transformers ``DeepseekV3ForCausalLM`` /
``DeepseekV2ForCausalLM``; also GLM-4.7-Flash, which llama.cpp's converter writes as deepseek2).

Per trunk layer, with H heads, ``nope`` = ``key_length_mla - rope.dimension_count`` (qk_nope_head_dim), ``rope`` =
``rope.dimension_count`` (qk_rope_head_dim), ``dk = nope + rope``, ``dv`` = ``value_length_mla`` (v_head_dim),
``r`` = ``attention.kv_lora_rank``:

- ``h = RMSNorm(x)``. Queries: ``q = W_qb RMSNorm(W_qa h)`` (q LoRA: ``attention.q_lora_rank`` > 0, tensors
  ``attn_q_a``, ``attn_q_a_norm``, ``attn_q_b``) or ``q = W_q h`` (no q LoRA, DeepSeek-V2-Lite: ``attn_q``);
  per head ``q = [q_nope | q_pe]`` (nope + rope dims).
- Latent: ``[c | k_pe] = W_kva h`` (``attn_kv_a_mqa``, r + rope rows), ``c = RMSNorm(c)`` (``attn_kv_a_norm``);
  ``k_pe`` is one head shared by all heads. RoPE on ``q_pe`` and ``k_pe`` only, interleaved (GPT-J pairs:
  llama.cpp's LLAMA_ROPE_TYPE_NORM for deepseek2; transformers' ``rope_interleave`` / DeepSeek's own
  view-transpose permutation), theta ``rope.freq_base``, YaRN where the file says so (below).
- Per head the up-projections ``k_nope = W_kb[h] c`` and ``v = W_vb[h] c``. The converter of the pinned llama.cpp
  writes them split (``attn_k_b`` [H, r, nope], ``attn_v_b`` [H, dv, r], with ``attention.key_length_mla`` /
  ``value_length_mla``); older files have one ``attn_kv_b`` [H x (nope + dv), r] (transformers' ``kv_b_proj``),
  split here at load. Both are read.
- Scores ``(q_nope . k_nope + q_pe . k_pe) * kq_scale``, causal softmax, ``a = sum p v``, ``x += W_o a``.

**The absorbed form.** moestream computes MLA absorbed, as llama.cpp does for the split tensors: the cache holds
per position only ``[c | rope(k_pe)]`` (r + rope floats per layer, shared by every head), queries become
``[W_kb[h]^T q_nope | rope(q_pe)]`` (r + rope dims), attention is multi-query attention with one KV head whose
values are ``c``, and each head's output is ``W_vb[h] (sum p c)``. This equals transformers' unabsorbed form
(which decompresses every cached latent into per-head keys and values) by associativity alone:
``q_nope . (W_kb[h] c) = (W_kb[h]^T q_nope) . c`` and ``sum_s p_s W_vb[h] c_s = W_vb[h] sum_s p_s c_s``; only float
rounding differs (tests/test_deepseek2.py, the published YaRN: 8.0e-5 from transformers over a 33-token prompt;
on 16 tokens 6.6e-5 absorbed where the unabsorbed form in the same code gives 3.6e-5; llama.cpp, absorbed too, is
1.7e-4 from transformers on that file). The interleaved RoPE
leaves q_pe/k_pe in the interleaved layout where transformers writes the same values de-interleaved: a permutation
of the rope dims applied to queries and keys alike, which leaves every q.k unchanged.

The absorbed up-projections are per-head linears on the file's row-major tensors: head h's
``W_kb[h]^T q_nope = attn_k_b[h] q_nope`` (r rows of nope) and ``W_vb[h] a = attn_v_b[h] a`` (dv rows of r), each
head a contiguous range of rows. On the CPU with the C kernels (``--matmul blocks``, the default) the split
tensors stay in the file's blocks and both run as one :func:`kernels.linear_heads` call each (ggml's arithmetic,
as llama.cpp's ``ggml_mul_mat`` on them: the activation row of each (token, head) quantized to Q8 for a quantized
type; a token's bits do not depend on the other tokens of the call nor on the thread count). For DeepSeek-V3
(128 heads, r 512, nope 128, dv 128) float32 copies would be 64 MiB a layer read every token, Q8_0 blocks 17 MiB.
Elsewhere (a GPU, ``--matmul dequant``, ``--expand-dense``, the legacy ``attn_kv_b``, a type or row length the
kernels do not compute) both are held dequantized to float32 (``[H, nope, r]`` and ``[H, dv, r]``) and multiplied by
torch's batched matmuls per sequence; :meth:`DeepSeek2.dense_estimate` counts what is held.

- ``h = RMSNorm(x)`` (``ffn_norm``). The first ``leading_dense_block_count`` layers are dense SwiGLU; the others
  are MoE: router ``W_r h``, gating (below) with the optional per-expert ``exp_probs_b`` bias (transformers'
  ``e_score_correction_bias``, added only to choose), group-limited choice, weights renormalized and scaled
  (:func:`routing.group_topk`), SwiGLU experts, plus ungated SwiGLU shared experts (``expert_shared_count``
  of them, one matrix ``expert_feed_forward_length x expert_shared_count`` wide): ``x += routed + shared``.

Then ``RMSNorm`` and the output matrix (``token_embd`` when the file has no ``output``).

YaRN (``rope.scaling.type = yarn``; the published DeepSeek-V2/V3 configs): the inverse frequencies are
:func:`layers.yarn_inv_freq` of ``rope.scaling.factor``, ``rope.scaling.original_context_length`` and beta_fast
32 / beta_slow 1 (``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` where the file has them; the llama.cpp of the
pinned sdist does not read those keys for deepseek2 and always uses 32 / 1, the published values); the original
context ``rope.scaling.original_context_length`` (absent: ``context_length``, as llama.cpp).
The attention scale is DeepSeek's:
``kq_scale = m^2 / sqrt(dk)`` with ``m = 1 + 0.1 * mscale_all_dim * ln(factor)``, where
``mscale_all_dim = rope.scaling.yarn_log_multiplier / 0.1`` (the converter writes 0.1 x mscale_all_dim; llama.cpp
divides it back), and the cos/sin are not scaled: transformers scales them by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, which is 1 for every published config (mscale ==
mscale_all_dim: 1.0 for V3, 0.707 for V2) and which llama.cpp, that never reads ``mscale``, also makes 1 for
deepseek2. A YaRN file without ``yarn_log_multiplier`` is refused: there llama.cpp scales both cos/sin and kq by
``1 + 0.1 ln(factor)`` while transformers scales cos/sin only. ``rope.scaling.attn_factor`` other than 1 and other
scaling types are refused; rope.scaling.type none (or absent) is plain RoPE.

Routing keys, when the file lacks them (llama.cpp's ``llama_model_deepseek2::load_arch_hparams`` and the
generic loader), and where moestream decides:

- ``expert_gating_func``: 1 softmax, 2 sigmoid; others are refused. **Absent (or 0)**: llama.cpp picks softmax
  (the DeepSeek-V2/V2.5 GGUFs made before the key existed) except for one shape it recognises as GLM-4.7-Flash
  (47 or 48 layers and a 154,880-token vocabulary), for which it picks sigmoid; GLM-4.7-Flash's converter writes
  no gating key. moestream infers sigmoid from the presence of the ``exp_probs_b`` selection bias (DeepSeek-V3's
  and GLM-4.7-Flash's noaux_tc routing has it; V2/V2.5's softmax routing has none) and softmax otherwise. That is
  llama.cpp's choice on every published file of the family (V2/V2.5: no bias, softmax; GLM-4.7-Flash: bias,
  sigmoid; V3: the converter writes 2) and differs from it only on a file with a bias, no key and another shape,
  where llama.cpp would add a sigmoid model's correction bias to softmax probabilities.
- ``expert_weights_norm``: absent = false (no renormalization; the converter writes it only when true).
- ``expert_weights_scale``: absent (or 0.0) = no scaling, as llama.cpp (never a zero weight).
- ``expert_group_count`` / ``expert_group_used_count``: absent = no group limit; with a count > 1 it must divide
  ``expert_count`` into groups of at least two and ``0 < used < count`` (llama.cpp asserts the same). A group's
  score is the sum of its two best choice scores whatever the gating (llama.cpp's build_moe_ffn; transformers'
  DeepSeek-V2 ``group_limited_greedy`` takes the group's maximum instead: softmax with groups, the 236B
  DeepSeek-V2/V2.5, follows llama.cpp here and was not compared with transformers).
- ``leading_dense_block_count``: absent = 0. ``expert_shared_count``, ``expert_feed_forward_length``,
  ``attention.kv_lora_rank``, ``attention.layer_norm_rms_epsilon``: required, as in llama.cpp.
  ``attention.q_lora_rank``: absent = 0 = no q LoRA (llama.cpp requires the key except for the V2-Lite shapes).

NextN / MTP blocks (``nextn_predict_layers``, GLM-4.7-Flash files) are left out by MoEModel (not run, no slot
pool). Refused: DeepSeek-OCR's deepseek2ocr (another architecture name), attention temperature scaling
(``attention.temperature_scale``, Mistral-Large-3 files), q/kv biases. Semantics follow transformers'
``modeling_deepseek_v3.py`` / ``modeling_deepseek_v2.py`` and llama.cpp's ``src/models/deepseek2.cpp``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import kernels
from ..errors import GGUFError
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, register
from .layers import (
    KVCache,
    Rope,
    Weight,
    elementwise,
    rms_norm,
    rope_inv_freq,
    swiglu_ffn,
    yarn_attention_factor,
    yarn_inv_freq,
)
from .routing import WEIGHT_SUM_FLOOR, group_topk

if TYPE_CHECKING:
    from ..runtime.step import Step

#: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values
GATING_NONE, GATING_SOFTMAX, GATING_SIGMOID = 0, 1, 2


@register("deepseek2")
class DeepSeek2(MoEModel):
    expert_width_key = None  # the width is checked (or derived, as llama.cpp does) in this file

    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)  # n_blocks, n_mtp, n_layers (the trunk); MTP blocks get no slot pool
        self.n_head = self.meta_int("attention.head_count", required=True)
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", required=True)
        self.rope_base = self.meta_float("rope.freq_base", 10000.0)
        self.n_rot = self.meta_int("rope.dimension_count", required=True)
        self.kv_rank = self.meta_int("attention.kv_lora_rank", required=True)
        self.q_rank = self.meta_int("attention.q_lora_rank", 0, minimum=0)
        #: the file has attn_k_b / attn_v_b (key_length_mla present) rather than the legacy attn_kv_b
        self.split_kv_b = self.gguf.arch_get("attention.key_length_mla") is not None
        if self.split_kv_b:
            self.head_k = self.meta_int("attention.key_length_mla", required=True)
            self.head_v = self.meta_int("attention.value_length_mla", required=True)
        else:
            self.head_k = self.meta_int("attention.key_length", required=True)
            self.head_v = self.meta_int("attention.value_length", required=True)
        self.n_nope = self.head_k - self.n_rot
        self.n_dense = self.meta_int("leading_dense_block_count", 0, minimum=0)
        self.n_ff_exp = self.meta_int("expert_feed_forward_length", required=True)
        self.n_shared = self.meta_int("expert_shared_count", required=True, minimum=0)
        self.refuse_unsupported()
        self.read_routing_keys()
        self.read_rope_scaling()
        d, path, n_embd, n_head, hk, hv = (self.meta_desc, self.gguf.path, self.n_embd, self.n_head, self.head_k,
                                           self.head_v)
        r, rot, nope = self.kv_rank, self.n_rot, self.n_nope
        k_key = "attention.key_length_mla" if self.split_kv_b else "attention.key_length"
        v_key = "attention.value_length_mla" if self.split_kv_b else "attention.value_length"
        k_desc = f"{self._key(k_key)}={hk}, {d(rope__dimension_count=rot)}"
        if rot % 2 or nope < 1:
            raise GGUFError(f"{path}: metadata {k_desc}: rope.dimension_count must be even and less than the key "
                            f"length")
        if self.split_kv_b:
            want_k = self.meta_int("attention.key_length", r + rot)
            want_v = self.meta_int("attention.value_length", r)
            if (want_k, want_v) != (r + rot, r):
                raise GGUFError(f"{path}: metadata {d(attention__key_length=want_k, attention__value_length=want_v)} "
                                f"but MLA needs kv_lora_rank + rope = {r + rot} and kv_lora_rank = {r} "
                                f"({d(attention__kv_lora_rank=r)})")
        if self.n_dense > self.n_layers:
            raise GGUFError(f"{path}: metadata {d(leading_dense_block_count=self.n_dense)} is more than the "
                            f"{self.n_layers} trunk layers")
        # every trunk tensor the forward pass reads
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        q_desc = f"{d(attention__head_count=n_head)} x {k_desc}"
        v_desc = f"{d(attention__head_count=n_head)} x {self._key(v_key)}={hv}"
        r_desc = d(attention__kv_lora_rank=r)
        qr_desc = d(attention__q_lora_rank=self.q_rank)
        exp_desc = d(expert_feed_forward_length=self.n_ff_exp)
        sh_desc = f"{exp_desc} x {d(expert_shared_count=self.n_shared)}, {emb}"
        for i in range(self.n_layers):
            p = f"blk.{i}."
            b = {"attn_norm": self.tensor(p + "attn_norm.weight", (n_embd,), emb, kind="norm")}
            if self.q_rank:
                b.update(q_a=self.tensor(p + "attn_q_a.weight", (self.q_rank, n_embd), f"{qr_desc}, {emb}"),
                         q_a_norm=self.tensor(p + "attn_q_a_norm.weight", (self.q_rank,), qr_desc, kind="norm"),
                         q_b=self.tensor(p + "attn_q_b.weight", (n_head * hk, self.q_rank), f"{q_desc}, {qr_desc}"))
            else:
                if self.has(p + "attn_q_a.weight"):
                    raise GGUFError(f"{path}: tensor {p}attn_q_a.weight exists but metadata key "
                                    f"{self._key('attention.q_lora_rank')} is absent or 0")
                b["q"] = self.tensor(p + "attn_q.weight", (n_head * hk, n_embd), f"{q_desc}, {emb}")
            b.update(kv_a=self.tensor(p + "attn_kv_a_mqa.weight", (r + rot, n_embd),
                                      f"{r_desc} + {d(rope__dimension_count=rot)}, {emb}"),
                     kv_a_norm=self.tensor(p + "attn_kv_a_norm.weight", (r,), r_desc, kind="norm"))
            # the up-projections: on the C kernels, the file's attn_k_b [H, r, nope] and attn_v_b [H, dv, r] as
            # stored (each a pair (uint8 [H x rows, row bytes], ggml type): kernels.linear_heads); otherwise as
            # float32, W_kb [H, nope, r] (transformers' kv_b_proj rows of k_nope, per head; attn_k_b transposed
            # back) and W_vb [H, dv, r] (attn_v_b), or both split from the legacy attn_kv_b [H x (nope + dv), r]
            if self.kv_b_on_blocks(i):
                b["k_b"] = self.tensor(p + "attn_k_b.weight", (n_head, r, nope), f"{q_desc}, {r_desc}").then(
                    self.heads_blocks)
                b["v_b"] = self.tensor(p + "attn_v_b.weight", (n_head, hv, r), f"{v_desc}, {r_desc}").then(
                    self.heads_blocks)
            elif self.split_kv_b:
                b["w_kb"] = self.tensor(p + "attn_k_b.weight", (n_head, r, nope), f"{q_desc}, {r_desc}",
                                        kind="float").then(lambda t: t.transpose(1, 2).contiguous())
                b["w_vb"] = self.tensor(p + "attn_v_b.weight", (n_head, hv, r), f"{v_desc}, {r_desc}",
                                        kind="float").then(torch.Tensor.contiguous)
            else:
                kv_b = self.tensor(p + "attn_kv_b.weight", (n_head * (nope + hv), r), f"{q_desc}, {v_desc}, {r_desc}",
                                   kind="float").then(lambda t: t.view(n_head, nope + hv, r))
                b["w_kb"] = kv_b.then(lambda t: t[:, :nope].contiguous())
                b["w_vb"] = kv_b.then(lambda t: t[:, nope:].contiguous())
            b.update(o=self.tensor(p + "attn_output.weight", (n_embd, n_head * hv), f"{v_desc}, {emb}"),
                     ffn_norm=self.tensor(p + "ffn_norm.weight", (n_embd,), emb, kind="norm"))
            if self.is_dense_layer(i, self.n_dense):
                b.update(self.ffn_tensors(p))
            else:
                b.update(router=self.router_tensor(p),
                         score_bias=self.tensor(p + "exp_probs_b.bias", (self.n_experts,),
                                                d(expert_count=self.n_experts), kind="norm", optional=True),
                         moe=self.moe(i))
                self.check_expert_widths(i, self.n_ff_exp, exp_desc)
                if self.n_shared:
                    b.update(self.ffn_tensors(p, "_shexp", self.n_ff_exp * self.n_shared, sh_desc,
                                              names=("sh_gate", "sh_up", "sh_down")))
            blocks.append(b)
        if opts.metadata_only:
            return
        self.rope = Rope(self.inv_freq(), scale=self.rope_scale, interleaved=True)
        self.load_declared(ends, blocks)

    # --- metadata ---------------------------------------------------------------------------------------------
    def refuse_unsupported(self) -> None:
        """GGUFError (one line) for what the module docstring lists as refused."""
        path, d = self.gguf.path, self.meta_desc
        temp = self.gguf.arch_get("attention.temperature_scale")
        if temp:
            raise GGUFError(f"{path}: metadata {d(attention__temperature_scale=temp)} asks for attention "
                            f"temperature scaling, which moestream does not compute for deepseek2")
        for name in self.gguf.tensors:
            if name.startswith("blk.") and name.endswith((".attn_q_a.bias", ".attn_kv_a_mqa.bias", ".attn_q.bias")):
                raise GGUFError(f"{path}: tensor {name}: attention biases are not computed for deepseek2")

    def read_routing_keys(self) -> None:
        """The routing keys, with the defaults of the module docstring."""
        g, path, d = self.gguf.arch_get, self.gguf.path, self.meta_desc
        gating = g("expert_gating_func", GATING_NONE)
        if isinstance(gating, bool) or not isinstance(gating, int) or gating not in (GATING_NONE, GATING_SOFTMAX,
                                                                                      GATING_SIGMOID):
            raise GGUFError(f"{path}: metadata {d(expert_gating_func=gating)} is neither softmax ({GATING_SOFTMAX}) "
                            f"nor sigmoid ({GATING_SIGMOID}); moestream computes deepseek2 routing with those only")
        if gating == GATING_NONE:  # absent: sigmoid where the selection bias exists (see the module docstring)
            has_bias = any(n.startswith("blk.") and n.endswith(".exp_probs_b.bias") for n in self.gguf.tensors)
            gating = GATING_SIGMOID if has_bias else GATING_SOFTMAX
        #: "sigmoid" or "softmax"
        self.gating = "sigmoid" if gating == GATING_SIGMOID else "softmax"
        norm_w = g("expert_weights_norm", False)
        if not isinstance(norm_w, bool):
            raise GGUFError(f"{path}: metadata key {self._key('expert_weights_norm')} must be a bool, got {norm_w!r}")
        self.norm_topk = norm_w
        scale = self.meta_float("expert_weights_scale", 0.0, allow_zero=True)
        #: routed_scaling_factor (absent or 0.0: no scaling, as llama.cpp)
        self.routed_scale = scale if scale != 0.0 else 1.0
        self.n_group = self.meta_int("expert_group_count", 0, minimum=0)
        self.topk_group = self.meta_int("expert_group_used_count", 0, minimum=0)
        if self.n_group > 1:
            groups = d(expert_group_count=self.n_group)
            if self.n_experts % self.n_group or self.n_experts // self.n_group < 2:
                raise GGUFError(f"{path}: metadata {groups} does not divide {d(expert_count=self.n_experts)} into "
                                f"groups of at least two experts")
            if not 0 < self.topk_group < self.n_group:
                raise GGUFError(f"{path}: metadata {d(expert_group_used_count=self.topk_group)} must be at least 1 "
                                f"and less than {groups} (as llama.cpp requires)")
        else:
            self.n_group = self.topk_group = 1

    def read_rope_scaling(self) -> None:
        """``self.yarn`` (None, or MoEModel.rope_scaling's :class:`RopeScaling`), ``self.rope_scale`` (the cos/sin
        factor) and ``self.kq_scale`` (module docstring)."""
        path, d = self.gguf.path, self.meta_desc
        self.yarn = self.rope_scaling(("yarn",))  # None: no scaling (absent, none, or factor 1)
        self.kq_scale = 1.0 / math.sqrt(self.head_k)
        self.rope_scale = 1.0
        if self.yarn is None:
            return
        if self.yarn.attn_factor != 1.0:
            raise GGUFError(f"{path}: metadata {d(rope__scaling__attn_factor=self.yarn.attn_factor)} is not "
                            f"computed for deepseek2 (only 1.0)")
        if self.yarn.log_multiplier == 0.0:
            raise GGUFError(f"{path}: yarn rope scaling without metadata key "
                            f"{self._key('rope.scaling.yarn_log_multiplier')} (mscale_all_dim): llama.cpp and "
                            f"transformers scale its attention differently; moestream refuses it")
        mscale_all_dim = self.yarn.log_multiplier / 0.1  # the converter writes 0.1 x mscale_all_dim
        # llama.cpp's deepseek2 takes mscale = mscale_all_dim (it reads no mscale): the cos/sin factor is 1
        self.rope_scale = yarn_attention_factor(self.yarn.factor, mscale_all_dim, mscale_all_dim)
        m = 0.1 * mscale_all_dim * math.log(self.yarn.factor) + 1.0  # factor > 1 here
        self.kq_scale = m * m / math.sqrt(self.head_k)

    def inv_freq(self) -> torch.Tensor:
        """float32 [n_rot/2]: plain RoPE, or YaRN's (:func:`layers.yarn_inv_freq`)."""
        if self.yarn is None:
            return rope_inv_freq(self.rope_base, self.n_rot, self.device)
        y = self.yarn
        return yarn_inv_freq(self.rope_base, self.n_rot, y.factor, y.orig_ctx, y.beta_fast, y.beta_slow,
                             device=self.device)

    # --- the up-projections ------------------------------------------------------------------------------------
    def kv_b_on_blocks(self, i: int) -> bool:
        """Whether layer i keeps attn_k_b / attn_v_b as the file's blocks and computes its per-head matmuls with
        the C kernels (:func:`kernels.linear_heads`): a split file, matmuls on the blocks on the CPU
        (``self.use_blocks``), not ``--expand-dense``, and both types computed at their row lengths (nope and r).
        Otherwise (a GPU, ``--matmul dequant``, the legacy attn_kv_b, a type the kernels do not compute) both are
        held as float32 and multiplied by torch."""
        if not (self.split_kv_b and self.use_blocks and not self.opts.expand_dense):
            return False
        return all(kernels.computes(self.gguf.tensor_info(f"blk.{i}.attn_{m}_b.weight").ggml_type, cols)
                   for m, cols in (("k", self.n_nope), ("v", self.kv_rank)))

    @staticmethod
    def heads_blocks(w: Weight) -> tuple[torch.Tensor, int]:
        """A loaded attn_k_b / attn_v_b Weight (rows H x rows per head) as (uint8 [H x rows, row bytes], ggml type):
        its blocks, or an F32 weight's float32 values as bytes (the same memory)."""
        return (w.raw if w.raw is not None else w.dense.view(torch.uint8)), int(w.ggml_type)

    def dense_estimate(self, mapped: bool = True) -> int:
        """MoEModel.dense_estimate, plus what the up-projections held as float32 (:meth:`kv_b_on_blocks` false)
        take beyond the file's bytes of a quantized type: 4 bytes a value."""
        total = super().dense_estimate(mapped)
        if self.opts.expand_dense:  # counted at 4 bytes a value already
            return total
        for i in range(self.n_layers):
            if self.kv_b_on_blocks(i):
                continue
            for m in ("k_b", "v_b") if self.split_kv_b else ("kv_b",):
                info = self.gguf.tensor_info(f"blk.{i}.attn_{m}.weight")
                if info.ggml_type != 0:  # F32 is counted at 4 bytes a value already
                    total += 4 * math.prod(info.shape) - info.n_bytes
        return total

    # --- compute ----------------------------------------------------------------------------------------------
    def make_cache(self, n_ctx: int) -> KVCache:
        """Per layer ``k``: [n_ctx, 1, r + rope] = [c | rope(k_pe)] (the values are its first r dims)."""
        return KVCache(self.n_layers, n_ctx, 1, self.kv_rank + self.n_rot, 0, self.device)

    def cache_bytes(self, n_ctx: int) -> int:
        return 4 * self.n_layers * n_ctx * (self.kv_rank + self.n_rot)

    def route(self, b: dict, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] float32 of MoE block ``b`` -> (ids [T, top_k] int64, weights [T, top_k]
        float32): the gating scores (:meth:`scores`), then :func:`routing.group_topk` with the block's bias and the
        file's keys."""
        return group_topk(self.scores(router_logits), self.top_k, bias=b["score_bias"], n_group=self.n_group,
                          topk_group=self.topk_group, norm=self.norm_topk, scale=self.routed_scale)

    def scores(self, router_logits: torch.Tensor) -> torch.Tensor:
        """The gating scores of router logits float32 [T, n_experts], same shape: torch's sigmoid
        (ops.elementwise) or softmax (the C router's own sigmoid/softmax would not give these bits)."""
        if self.gating == "sigmoid":
            return elementwise(torch.sigmoid, router_logits)
        return torch.softmax(router_logits, dim=-1)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(b, b["router"].linear(h))

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """MLA, absorbed (module docstring), residual added: x [T, hidden] -> same. The cache row of a token is
        [RMSNorm(c_kv) | RoPE(k_rope)] (kv_lora_rank + rope dims, one KV head); the values are its first
        kv_lora_rank dims (K = V)."""
        b, n_tok, r, nope = self.blocks[i], x.shape[0], self.kv_rank, self.n_nope
        h = rms_norm(x, b["attn_norm"], self.eps)
        if self.q_rank:
            q = b["q_b"].linear(rms_norm(b["q_a"].linear(h), b["q_a_norm"], self.eps))
        else:
            q = b["q"].linear(h)
        q = q.view(n_tok, self.n_head, self.head_k)
        kv = b["kv_a"].linear(h)  # [T, r + rope]
        step.store("k", i, torch.cat((rms_norm(kv[:, :r], b["kv_a_norm"], self.eps)[:, None],
                                      step.rope(self.rope, kv[:, None, r:])), dim=-1))  # [T, 1, r + rope]
        if "k_b" in b:  # the file's blocks (kernels.linear_heads: a token's bits whatever else shares the call)
            (kb, t_kb), (vb, t_vb) = b["k_b"], b["v_b"]
            q_abs = kernels.linear_heads(q[..., :nope], kb, t_kb, nope, self.n_head)  # [T, H, r]: attn_k_b[h] q_nope
        else:
            # float32: the per-head matmuls run per sequence (torch's blocking depends on T: a sequence gets its
            # own bits whatever else shares the step)
            q_abs = step.per_seq(lambda _c, qn: torch.matmul(qn.transpose(0, 1), b["w_kb"]).transpose(0, 1),
                                 q[..., :nope])  # [T, H, r]: W_kb[h]^T q_nope
        qq = torch.cat((q_abs, step.rope(self.rope, q[..., nope:])), dim=-1)  # [T, H, r + rope]
        a = step.attend(qq, i, self.kq_scale, v_dim=r)  # [T, H * r]
        if "k_b" in b:
            out = kernels.linear_heads(a.view(n_tok, self.n_head, r), vb, t_vb, r, self.n_head)  # [T, H, dv]
        else:
            out = step.per_seq(lambda _c, at: torch.matmul(at.view(-1, self.n_head, r).transpose(0, 1),
                                                            b["w_vb"].transpose(1, 2)).transpose(0, 1),
                               a)  # [T, H, dv]
        return x + b["o"].linear(out.reshape(n_tok, self.n_head * self.head_v))

    def fast_layer(self, i: int) -> FastLayer | None:
        """Layer i in the fast CPU decode step's terms (runtime/fastdecode.FastLayer): :meth:`mix` as the step's MLA
        calls (``mla``: the q LoRA or q projection, the latent projection, its norm and RoPE written into the cache
        row, the absorbed up-projections by ms_linear_heads, multi-query attention over the cache with K = V), the
        router's scores by :meth:`scores` (torch) then the C router's bias, groups, renormalisation and scale as
        :func:`routing.group_topk` calls it, the shared experts (:meth:`shared`) after the routed sum; the leading
        dense layers are MoEModel.dense. None (the eager step) where the up-projections are not on the C kernels
        (:meth:`kv_b_on_blocks`)."""
        b = self.blocks[i]
        if "k_b" not in b:
            return None
        r, rot = self.kv_rank, self.n_rot
        mla = (b.get("q_a"), b.get("q_a_norm"), b["q_b"] if self.q_rank else b["q"], b["kv_a"], b["kv_a_norm"],
               b["k_b"], b["v_b"], r, self.n_nope, rot, self.head_v)
        return FastLayer(self.kq_scale, n_head=self.n_head, n_kv=1, head_dim=r + rot, mla=mla,
                         router_scores=self.scores, gating=kernels.GATING_SCORES, route_bias=b.get("score_bias"),
                         n_group=self.n_group, topk_group=self.topk_group, norm_topk=self.norm_topk,
                         floor=WEIGHT_SUM_FLOOR, route_scale=self.routed_scale, shared=self.has_shared(i))

    def has_shared(self, i: int) -> bool:
        return bool(self.n_shared)

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The shared experts of layer i on h [T, hidden] -> [T, hidden] (no gate)."""
        b = self.blocks[i]
        return swiglu_ffn(b["sh_gate"], b["sh_up"], b["sh_down"], h)
