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

from .base import LoadOptions, MoEModel, register
from .graphs import DecodeGraphs
from .layers import (
    KVArena,
    KVCache,
    Rope,
    Weight,
    attention,
    attention_at,
    decode_keys,
    elementwise,
    rms_norm,
    rope_at,
    rope_inv_freq,
    softmax_topk,
)


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
        self.graphs = DecodeGraphs()
        self._kv_arena = KVArena()
        self._segs: list[list[int]] | None = None
        self._kpos: torch.Tensor | None = None

    def new_cache(self, n_ctx: int) -> KVCache:
        def make(n: int) -> KVCache:
            return KVCache(self.n_layers, n, self.n_kv, self.head_dim, self.head_dim_v, self.device)

        if self.device.type == "cuda":  # at the last cache's addresses where it is free: its graphs serve this one
            return self._kv_arena.get(n_ctx, make)
        return make(n_ctx)

    def cache_bytes(self, n_ctx: int) -> int:
        return 4 * self.n_layers * n_ctx * self.n_kv * (self.head_dim + self.head_dim_v)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits: [T, n_experts] -> (ids [T, top_k] int64, weights [T, top_k] float32, summing to 1 unless
        the file sets ``expert_weights_norm`` false)."""
        return softmax_topk(router_logits, self.top_k, norm=self.norm_topk)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] the FFN-normed input of MoE block ``b`` -> :meth:`route` of its router logits."""
        return self.route(b["router"].linear(h))

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        b = self.blocks[layer]
        return self.gate(b, rms_norm(x, b["ffn_norm"], self.eps))[0]

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits_all: bool = False) -> torch.Tensor:
        n_tok = tokens.shape[0]
        if start + n_tok > cache.n_ctx:
            raise ValueError(f"context full: {start + n_tok} tokens > n_ctx {cache.n_ctx}")
        if n_tok == 1 and self.device.type == "cuda" and not logits_all and self.graphs.opted_in:
            return self.decode_cuda(tokens, start, cache)
        end = start + n_tok
        x = self.embd.rows_of(tokens)  # [T, hidden]
        scale = 1.0 / math.sqrt(self.head_dim)
        for i, b in enumerate(self.blocks):
            self.begin_layer(i, x)  # x: the input of layer i; its reads run behind the attention
            h = rms_norm(x, b["attn_norm"], self.eps)
            q = rms_norm(b["q"].linear(h).view(n_tok, self.n_head, self.head_dim), b["q_norm"], self.eps)
            k = rms_norm(b["k"].linear(h).view(n_tok, self.n_kv, self.head_dim), b["k_norm"], self.eps)
            q = self.rope(q, start)
            self.rope(k, start, out=cache.k[i][start:end])  # rotated keys straight into the cache
            cache.v[i][start:end] = b["v"].linear(h).view(n_tok, self.n_kv, self.head_dim_v)
            a = attention(q, cache.k[i][:end], cache.v[i][:end], start, scale)
            x = x + b["o"].linear(a)
            h = rms_norm(x, b["ffn_norm"], self.eps)
            if "moe" in b:
                ids, w = self.gate(b, h)
                routed, _ = b["moe"](h, ids, w)
                x = x + routed
            else:
                x = x + b["down"].linear(elementwise(F.silu, b["gate"].linear(h)) * b["up"].linear(h))
        if not logits_all:
            x = x[-1:]
        return self.output.linear(rms_norm(x, self.out_norm, self.eps))

    def graphable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (models/graphs.py): every expert resident where
        the GPU addresses it, every MoE layer computable by ``MoE.resident_step``, every dense weight on the
        Triton kernels or float32, no router lookahead."""
        store = self.store
        if self.opts.prefetch or not all(b["moe"].on_device(store) for b in self.blocks if "moe" in b):
            return False
        weights = [self.embd, self.output, *(w for b in self.blocks for w in b.values() if isinstance(w, Weight))]
        return all(w.dense is not None or w.gpu for w in weights)

    def decode_cuda(self, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """One token at ``start`` on CUDA -> logits [1, vocab]. Where :meth:`graphable` (every expert resident), one
        replay of a CUDA graph of the whole step; else (streaming) one replay per segment between MoE layers with
        the MoE layers run eagerly between them (their router top-k goes to the host to plan the slots); with
        ``--prefetch on`` or when a capture failed, the same code eagerly. All three run the same kernels in the
        same order, so they give the same bits (models/graphs.py)."""
        n_keys = decode_keys(start, cache.n_ctx)
        self.rope.reserve(cache.n_ctx)  # the whole context: a graph holds the tables' address
        if self._kpos is None or self._kpos.shape[0] < cache.n_ctx:
            self._kpos = torch.arange(cache.n_ctx, dtype=torch.int64, device=self.device)
        key = (self.rope.cos.data_ptr(), self._kpos.data_ptr())
        store = self.store
        if self.graphable():
            n_moe = sum("moe" in b for b in self.blocks)

            def count() -> None:  # the hits a replay does not count: top_k distinct experts per MoE layer
                store.stats.hits += n_moe * self.top_k

            out = self.graphs.step(self._decode_body, tokens, start, n_keys, cache, store, key, count)
            if out is not None:
                return out
        elif not self.opts.prefetch and self.graphs.off_reason is None:
            return self._decode_segmented(tokens, start, n_keys, cache, key)
        pos = torch.full((1,), start, dtype=torch.int64, device=self.device)
        return self._decode_body(tokens, pos, n_keys, cache, eager=True)

    def _segments(self) -> list[list[int]]:
        """The decode step cut at the MoE layers: segment j ends with MoE layer j's attention and router (the
        last segment: the layers after the last MoE layer and the output head). Made once per model."""
        if self._segs is None:
            segs, cur = [], []
            for i, b in enumerate(self.blocks):
                cur.append(i)
                if "moe" in b:
                    segs.append(cur)
                    cur = []
            self._segs = [*segs, cur]
        return self._segs

    def _segment(self, j: int, layers: list[int], x: torch.Tensor, routed: torch.Tensor | None, pos: torch.Tensor,
                 n_keys: int, cache: KVCache, look: bool = False) -> tuple[torch.Tensor, ...]:
        """Segment ``j`` of the decode step: x float32 [1, hidden] (segment 0: tokens int64 [1]) plus the previous
        MoE layer's routed output -> (x, h, ids, w) at the next MoE layer's experts, or the logits (last segment).
        Nothing in it depends on the host (CUDA-graph capturable), except ``look``: the router lookahead of each
        layer (eager only)."""
        x = self.embd.rows_of(x) if j == 0 else x + routed
        kpos = self._kpos[:n_keys]
        for i in layers:
            b = self.blocks[i]
            if look:
                self.begin_layer(i, x)
            x = self._attention_at(i, b, x, pos, n_keys, kpos, cache)
            h = rms_norm(x, b["ffn_norm"], self.eps)
            if "moe" in b:
                ids, w = self.gate(b, h)
                return x, h, ids, w
            x = x + b["down"].linear(elementwise(F.silu, b["gate"].linear(h)) * b["up"].linear(h))
        return (self.output.linear(rms_norm(x, self.out_norm, self.eps)),)

    def _attention_at(self, i: int, b: dict, x: torch.Tensor, pos: torch.Tensor, n_keys: int, kpos: torch.Tensor,
                      cache: KVCache) -> torch.Tensor:
        """Layer ``i``'s attention for one token at a device position, residual added: x [1, hidden] -> same."""
        h = rms_norm(x, b["attn_norm"], self.eps)
        q = rms_norm(b["q"].linear(h).view(1, self.n_head, self.head_dim), b["q_norm"], self.eps)
        k = rms_norm(b["k"].linear(h).view(1, self.n_kv, self.head_dim), b["k_norm"], self.eps)
        q = rope_at(self.rope, q, pos)
        cache.k[i].index_copy_(0, pos, rope_at(self.rope, k, pos))
        cache.v[i].index_copy_(0, pos, b["v"].linear(h).view(1, self.n_kv, self.head_dim_v))
        a = attention_at(q, cache.k[i][:n_keys], cache.v[i][:n_keys], pos, kpos, 1.0 / math.sqrt(self.head_dim))
        return x + b["o"].linear(a)

    def _decode_segmented(self, tokens: torch.Tensor, start: int, n_keys: int, cache: KVCache,
                          key: tuple) -> torch.Tensor:
        """:meth:`decode_cuda` while streaming: each segment a graph replay, each MoE layer through the store."""
        segs = self._segments()
        pos = torch.full((1,), start, dtype=torch.int64, device=self.device)
        x, routed = tokens, None
        for j, layers in enumerate(segs):
            def seg(x_in: torch.Tensor, r_in: torch.Tensor | None, p_in: torch.Tensor, j: int = j,
                    layers: list[int] = layers) -> tuple[torch.Tensor, ...]:
                return self._segment(j, layers, x_in, r_in, p_in, n_keys, cache)

            out = self.graphs.segment((n_keys, j), seg, (x, routed, pos), cache, key)
            if out is None:  # a capture failed: the rest of this step (and every later one) eagerly
                out = self._segment(j, layers, x, routed, pos, n_keys, cache)
            if j == len(segs) - 1:
                return out[0].clone()
            x, h, ids, w = out
            routed, _ = self.blocks[layers[-1]]["moe"](h, ids, w)
        raise AssertionError("unreachable: the last segment returns the logits")

    def _decode_body(self, tokens: torch.Tensor, pos: torch.Tensor, n_keys: int, cache: KVCache,
                     eager: bool = False) -> torch.Tensor:
        """The decode step of :meth:`decode_cuda`: tokens int64 [1], pos int64 [1] on the device; attention over
        the first ``n_keys`` cache rows (layers.attention_at). ``eager``: the MoE layers go through the store
        (router top-k to the host, slots planned, misses read; with the router lookahead); else
        ``MoE.resident_step`` (nothing on the host, capturable). The same segments as
        :meth:`_decode_segmented`, so every path gives the same bits."""
        segs = self._segments()
        x, routed = tokens, None
        for j, layers in enumerate(segs):
            out = self._segment(j, layers, x, routed, pos, n_keys, cache, look=eager)
            if j == len(segs) - 1:
                return out[0]
            x, h, ids, w = out
            b = self.blocks[layers[-1]]
            if eager:
                routed, _ = b["moe"](h, ids, w)
            else:
                routed = b["moe"].resident_step(self.store, h, ids, w)
        raise AssertionError("unreachable: the last segment returns the logits")
