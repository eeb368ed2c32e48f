"""Gemma 4 (GGUF ``general.architecture = gemma4``; the MoE member is gemma-4-26B-A4B).

Per layer, as transformers' Gemma4TextDecoderLayer and llama.cpp's gemma4 graph compute it:
RMSNorm -> attention -> RMSNorm -> residual, then the FFN block: a dense GeGLU FFN (own pre/post norms) and,
in MoE layers, routed GeGLU experts beside it (own pre/post norms; the router reads the un-normed residual
through a scale-free RMSNorm, a learned per-channel scale and 1/sqrt(hidden); softmax, top-k, renormalized,
times a learned per-expert scale), summed, RMSNorm -> residual; then the per-layer input embedding (PLE)
branch when the file has one, and a learned per-layer output scale.

Attention: sliding-window layers and global layers differ in head dim, KV heads and RoPE (global layers use
"proportional" partial RoPE, given in the file as ``rope_freqs``: factor 1 rotates, 1e30 leaves a pair
unrotated); q/k RMSNorm with weights, v RMSNorm without; no 1/sqrt(d) score scaling; on global layers
without ``attn_v`` the value is the key projection (K=V). The last ``shared_kv_layers`` layers own no K/V:
each reads the cache of the last earlier layer of its own kind. Embeddings are scaled by sqrt(hidden);
logits are soft-capped: cap * tanh(logits / cap) (cap 30 when the file has no key, as llama.cpp).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .. import kernels
from ..errors import GGUFError
from ..runtime.fastdecode import FastLayer
from .base import LoadOptions, MoEModel, Route, register
from .layers import LayerKVCache, Rope, elementwise, rms_norm, rope_inv_freq, softmax_topk

if TYPE_CHECKING:
    from ..runtime.step import Step


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (transformers' ``gelu_pytorch_tanh``, llama.cpp's ggml_gelu). float32 -> float32,
    the same bits with any thread count (:func:`~moestream.models.layers.elementwise`)."""
    return elementwise(_gelu_tanh, x)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(gate) * up: the activation of Gemma's dense FFN and experts."""
    return gelu_tanh(gate) * up


geglu.kernel_act = kernels.ACT_GELU_TANH  # type: ignore[attr-defined]  # the C kernels' code for it


@register("gemma4")
class Gemma4(MoEModel):
    def __init__(self, gguf, opts: LoadOptions):  # noqa: ANN001 - GGUFModel
        super().__init__(gguf, opts)
        g = gguf.arch_get
        path = gguf.path
        self.eps = self.meta_float("attention.layer_norm_rms_epsilon", 1e-6)
        swa = g("attention.sliding_window_pattern", [False] * self.n_layers)
        if not isinstance(swa, (list, tuple)) or len(swa) != self.n_layers:
            raise GGUFError(f"{path}: gemma4.attention.sliding_window_pattern must list {self.n_layers} layers, "
                            f"got {swa!r}")
        self.is_swa = [bool(s) for s in swa]
        self.window = self.meta_int("attention.sliding_window", required=True) if any(self.is_swa) else 0
        self.softcap = self.meta_float("final_logit_softcapping", 30.0, allow_zero=True)
        n_head = self.meta_ints("attention.head_count", self.n_layers, required=True)
        n_kv = self.meta_ints("attention.head_count_kv", self.n_layers, n_head)
        d_full = self.meta_int("attention.key_length", required=True)
        d_swa = self.meta_int("attention.key_length_swa", d_full)
        n_shared = self.meta_int("attention.shared_kv_layers", 0, minimum=0)
        first_shared = self.n_layers - n_shared
        self.ple_dim = self.meta_int("embedding_length_per_layer_input", 0, minimum=0)
        base_full = self.meta_float("rope.freq_base", 10000.0)
        base_swa = self.meta_float("rope.freq_base_swa", base_full)
        self.rope_scaling()  # refuses RoPE scaling (YaRN, linear, ...): not computed for this family
        self.softmax_routing(norm=True, switchable=False)  # always renormalized (no norm_topk_prob)
        n_rot_full = self.meta_int("rope.dimension_count", d_full)
        n_rot_swa = self.meta_int("rope.dimension_count_swa", d_swa)
        for key, n_rot, hd, hd_key in (("rope.dimension_count", n_rot_full, d_full, "attention.key_length"),
                                       ("rope.dimension_count_swa", n_rot_swa, d_swa, "attention.key_length_swa")):
            if n_rot % 2 or n_rot > hd:
                raise GGUFError(f"{path}: metadata {self.meta_desc(**{key.replace('.', '__'): n_rot})} must be "
                                f"even and at most {self.meta_desc(**{hd_key.replace('.', '__'): hd})}")
        d, n_embd = self.meta_desc, self.n_embd
        ends, blocks, emb = self.declare_ends(), [], d(embedding_length=n_embd)
        factors = self.tensor("rope_freqs.weight", (n_rot_full // 2,), d(rope__dimension_count=n_rot_full) + " / 2",
                              kind="norm", optional=True)
        if self.ple_dim:
            pd = d(block_count=self.n_layers, embedding_length_per_layer_input=self.ple_dim)
            ends.update(  # [vocab, n_layers * ple_dim], [n_layers * ple_dim, hidden], [ple_dim]
                ple_embd=self.tensor("per_layer_token_embd.weight", (self.n_vocab, self.n_layers * self.ple_dim), pd,
                                     kind="table"),
                ple_proj=self.tensor("per_layer_model_proj.weight", (self.n_layers * self.ple_dim, n_embd),
                                     pd + ", " + emb),
                ple_proj_norm=self.tensor("per_layer_proj_norm.weight", (self.ple_dim,),
                                          d(embedding_length_per_layer_input=self.ple_dim), kind="norm"))
        for i in range(self.n_layers):
            p, nh = f"blk.{i}.", n_head[i]
            hd, hd_key = (d_swa, "attention__key_length_swa") if self.is_swa[i] else (d_full, "attention__key_length")
            heads = d(attention__head_count=nh, **{hd_key: hd}, embedding_length=n_embd) + f" (layer {i})"
            b: dict = {
                "n_head": nh, "n_kv": n_kv[i], "head_dim": hd, "swa": self.is_swa[i],
                "q": self.tensor(p + "attn_q.weight", (nh * hd, n_embd), heads),
                "o": self.tensor(p + "attn_output.weight", (n_embd, nh * hd), heads),
                "q_norm": self.tensor(p + "attn_q_norm.weight", (hd,), d(**{hd_key: hd}), kind="norm"),
                **{key: self.tensor(p + name, (n_embd,), emb, kind="norm") for key, name in (
                    ("attn_norm", "attn_norm.weight"), ("attn_post_norm", "post_attention_norm.weight"),
                    ("ffn_norm", "ffn_norm.weight"), ("ffn_post_norm", "post_ffw_norm.weight"))},
                **self.ffn_tensors(p),
            }
            # shared KV: the last non-shared layer of the same kind (transformers' kv_sharing_modes)
            src = [j for j in range(first_shared) if self.is_swa[j] == self.is_swa[i]]
            b["kv_layer"] = i if i < first_shared else (src[-1] if src else i)
            if nh % n_kv[b["kv_layer"]]:
                raise GGUFError(f"{path}: metadata {d(attention__head_count=nh)} (layer {i}) is not a multiple of "
                                f"{d(attention__head_count_kv=n_kv[b['kv_layer']])} (layer {b['kv_layer']})")
            if i < first_shared:
                kv = d(attention__head_count_kv=n_kv[i], **{hd_key: hd}, embedding_length=n_embd) + f" (layer {i})"
                b["k"] = self.tensor(p + "attn_k.weight", (n_kv[i] * hd, n_embd), kv)
                b["k_norm"] = self.tensor(p + "attn_k_norm.weight", (hd,), d(**{hd_key: hd}), kind="norm")
                b["v"] = self.tensor(p + "attn_v.weight", (n_kv[i] * hd, n_embd), kv, optional=True)  # None: V = K
            elif not src:
                raise GGUFError(f"{path}: layer {i} shares KV but no earlier layer of its kind "
                                f"({'sliding' if self.is_swa[i] else 'global'}) owns a cache")
            if i in self.layout:
                b.update(router=self.router_tensor(p),  # [n_experts, hidden]
                         router_scale=self.tensor(p + "ffn_gate_inp.scale", (n_embd,), emb, kind="norm"),
                         # [n_experts], by real expert id
                         expert_scale=self.tensor(p + "ffn_down_exps.scale", (self.n_experts,),
                                                  d(expert_count=self.n_experts), kind="norm", optional=True),
                         **{key: self.tensor(p + name, (n_embd,), emb, kind="norm") for key, name in (
                             ("pre_norm_2", "pre_ffw_norm_2.weight"), ("post_norm_1", "post_ffw_norm_1.weight"),
                             ("post_norm_2", "post_ffw_norm_2.weight"))},
                         moe=self.moe(i, act=geglu))
            if self.ple_dim:
                pd = d(embedding_length_per_layer_input=self.ple_dim, embedding_length=n_embd)
                b.update(ple_gate=self.tensor(p + "inp_gate.weight", (self.ple_dim, n_embd), pd),  # [ple_dim, hidden]
                         ple_proj=self.tensor(p + "proj.weight", (n_embd, self.ple_dim), pd),  # [hidden, ple_dim]
                         ple_post_norm=self.tensor(p + "post_norm.weight", (n_embd,), emb, kind="norm"))
            b["out_scale"] = self.tensor(p + "layer_output_scale.weight", (1,), "a per-layer scalar", kind="norm",
                                         optional=True)  # [1]
            blocks.append(b)
        # (KV heads, head dim) of each layer that owns a KV cache; K and V both cached (K = V layers too)
        self.kv_owners = [(n_kv[i], d_swa if self.is_swa[i] else d_full) for i in range(first_shared)]
        if opts.metadata_only:
            return
        self.load_declared(ends, blocks)
        for b in self.blocks:  # the per-expert output scale, indexed by real expert id, applied by the MoE block
            if "moe" in b:
                b["moe"].expert_scale = b["expert_scale"]
        # RoPE per layer kind, inverse frequencies base^(-2i/n_rot) / freq_factor_i; cos/sin tables kept
        factors = self.loaded(factors)
        inv_full = rope_inv_freq(base_full, n_rot_full, self.device)
        self.rope_full = Rope(inv_full if factors is None else inv_full / factors)
        self.rope_swa = Rope(rope_inv_freq(base_swa, n_rot_swa, self.device))

    def mapped_tables(self) -> list[str]:
        return super().mapped_tables() + (["per_layer_token_embd.weight"] if self.has("per_layer_token_embd.weight")
                                          else [])

    def make_cache(self, n_ctx: int) -> LayerKVCache:
        """KV cache for ``n_ctx`` positions: float32 [n_ctx, n_kv, head_dim] per layer that owns K/V (each layer
        with its own head dim and KV heads), none for the shared-KV layers."""
        shapes = [(b["n_kv"], b["head_dim"], b["head_dim"]) if b["kv_layer"] == i else None
                  for i, b in enumerate(self.blocks)]
        return LayerKVCache(n_ctx, shapes, self.device)

    def cache_bytes(self, n_ctx: int) -> int:
        return sum(4 * n_ctx * n_kv * 2 * hd for n_kv, hd in self.kv_owners)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] residual stream (before any FFN norm) -> (ids [T, top_k] int64 real expert ids, weights
        [T, top_k] float32 summing to 1). Router input: RMSNorm without weight * router scale / sqrt(hidden)
        (transformers' Gemma4TextRouter); the per-expert scale is applied later, by the MoE layer."""
        x = rms_norm(h, b["router_scale"], self.eps) * self.n_embd ** -0.5
        return softmax_topk(b["router"].linear(x), self.top_k, norm=True)

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE inputs [T, n_layers, ple_dim] float32 from tokens [T] and the scaled embeddings x [T, hidden]:
        (RMSNorm(x @ W_proj^T / sqrt(hidden)) + E_ple[tokens] * sqrt(ple_dim)) / sqrt(2) (transformers'
        get_per_layer_inputs + project_per_layer_inputs)."""
        n_tok = tokens.shape[0]
        tok = self.ple_embd.rows_of(tokens) * torch.tensor(self.ple_dim ** 0.5)
        proj = self.ple_proj.linear(x) * self.n_embd ** -0.5
        proj = rms_norm(proj.view(n_tok, self.n_layers, self.ple_dim), self.ple_proj_norm, self.eps)
        return (proj + tok.view(n_tok, self.n_layers, self.ple_dim)) * 2.0 ** -0.5

    def embed(self, step: Step) -> torch.Tensor:
        """Scaled embeddings [T, hidden]; the per-layer inputs [T, n_layers, ple_dim] go to ``step.data["ple"]``."""
        x = self.embd.rows_of(step.tokens) * torch.tensor(self.n_embd ** 0.5)  # [T, hidden]
        if self.ple_dim:
            step.data["ple"] = self.per_layer_inputs(step.tokens, x)
        return x

    def mix(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Attention (q/k RMSNorm, V RMSNorm without weight, sliding or global RoPE, scale 1; a shared-KV layer
        reads an earlier layer's cache), its post-norm, residual added: x [T, hidden] -> same."""
        b, n_tok, hd = self.blocks[i], x.shape[0], self.blocks[i]["head_dim"]
        h = rms_norm(x, b["attn_norm"], self.eps)
        rope = self.rope_swa if b["swa"] else self.rope_full
        q = step.rope(rope, rms_norm(b["q"].linear(h).view(n_tok, b["n_head"], hd), b["q_norm"], self.eps))
        src = b["kv_layer"]
        if src == i:  # this layer owns K/V: its rows first
            kraw = b["k"].linear(h).view(n_tok, b["n_kv"], hd)
            vraw = b["v"].linear(h).view(n_tok, b["n_kv"], hd) if b["v"] is not None else kraw
            step.rope_into(rope, rms_norm(kraw, b["k_norm"], self.eps), "k", i)
            step.store("v", i, rms_norm(vraw, 1.0, self.eps))
        a = step.attend(q, src, 1.0, self.window if b["swa"] else None)
        return x + rms_norm(b["o"].linear(a), b["attn_post_norm"], self.eps)

    def route_layer(self, i: int, x: torch.Tensor) -> Route:
        """The router reads the residual stream x itself (:meth:`gate`); the experts read it normed by
        ``pre_norm_2``."""
        b = self.blocks[i]
        ids, w = self.gate(b, x)
        return Route(rms_norm(x, b["pre_norm_2"], self.eps), ids, w)

    def has_shared(self, i: int) -> bool:
        return True

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The dense GeGLU FFN beside the experts, on the residual stream x [T, hidden] -> [T, hidden]."""
        b = self.blocks[i]
        hf = rms_norm(x, b["ffn_norm"], self.eps)
        return b["down"].linear(geglu(b["gate"].linear(hf), b["up"].linear(hf)))

    def combine(self, i: int, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None,
                step: Step) -> torch.Tensor:
        f = rms_norm(shared, self.blocks[i]["post_norm_1"], self.eps) + rms_norm(routed, self.blocks[i]["post_norm_2"],
                                                                              self.eps)
        return self.layer_out(i, x, f, step)

    def dense(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        return self.layer_out(i, x, self.shared(i, x, x), step)

    def layer_out(self, i: int, x: torch.Tensor, f: torch.Tensor, step: Step) -> torch.Tensor:
        """Layer i's output from its residual stream x and FFN output f [T, hidden]: post-FFN norm, residual,
        the per-layer input's gated projection (PLE), the layer's output scale."""
        b = self.blocks[i]
        x = x + rms_norm(f, b["ffn_post_norm"], self.eps)
        if self.ple_dim:
            x = self.ple_add(i, x, step)
        if b["out_scale"] is not None:
            x = x * b["out_scale"]
        return x

    def ple_add(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] plus layer i's per-layer input branch: RMSNorm(W_proj (GELU-tanh(W_gate x) * ple_i)) by
        ``ple_post_norm``, ple_i = ``step.data["ple"][:, i]`` [T, ple_dim] (:meth:`embed`) -> [T, hidden]."""
        b = self.blocks[i]
        g = gelu_tanh(b["ple_gate"].linear(x)) * step.data["ple"][:, i]
        return x + rms_norm(b["ple_proj"].linear(g), b["ple_post_norm"], self.eps)

    def fast_layer(self, i: int) -> FastLayer | None:
        """Layer i in the fast CPU decode step's terms (runtime/fastdecode.FastLayer): its own head dim, KV heads,
        RoPE and window, q/k norms, V normed without weight (V = K without ``attn_v``), the cache of ``kv_layer``,
        scale 1, the post-attention norm; the router on RMSNorm(x) by ``router_scale`` times 1/sqrt(hidden), the
        experts on RMSNorm(x) by ``pre_norm_2`` (the per-expert scale: the MoE layer's), the dense FFN as the
        shared expert (:meth:`shared`), the post norms of :meth:`combine` and :meth:`layer_out`, PLE by
        :meth:`ple_add`, the layer's output scale. A layer without routed experts: None (the eager step)."""
        b = self.blocks[i]
        if "moe" not in b:
            return None
        src = b["kv_layer"]
        tail = functools.partial(self.ple_add, i) if self.ple_dim else None
        return FastLayer(1.0, q_norm=b["q_norm"], k_norm=b.get("k_norm"), n_head=b["n_head"],
                         n_kv=self.blocks[src]["n_kv"], head_dim=b["head_dim"],
                         rope=self.rope_swa if b["swa"] else self.rope_full, window=self.window if b["swa"] else 0,
                         v_norm=True, v_is_k=src == i and b["v"] is None, kv_layer=src,
                         attn_post_norm=b["attn_post_norm"], norm_topk=True, shared=True,
                         router_norm=b["router_scale"], router_mul=self.n_embd ** -0.5, moe_norm=b["pre_norm_2"],
                         post_norms=(b["post_norm_1"], b["post_norm_2"], b["ffn_post_norm"]), tail=tail,
                         out_scale=b["out_scale"])

    def head(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Final RMSNorm and output, soft-capped: x [R, hidden] -> logits [R, vocab]."""
        logits = self.output.linear(rms_norm(x, self.out_norm, self.eps))
        if self.softcap:
            logits = elementwise(torch.tanh, logits / self.softcap) * self.softcap
        return logits
