"""Shared building blocks: resident weights in the file's own format, RMSNorm, RoPE, attention, KV cache."""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from .. import kernels, quant
from ..errors import GGUFError
from ..gguf import GGUFModel, TensorInfo


def check_computable(info: TensorInfo) -> None:
    """GGUFError naming the file and the tensor unless moestream can compute ``info``'s ggml type."""
    if not quant.is_supported(info.ggml_type):
        raise GGUFError(f"{info.path}: tensor {info.name} is ggml type {info.ggml_type} "
                        f"({info.type_name}), which moestream cannot compute")


class Weight:
    """A resident dense weight, kept in the file's own ggml format unless ``expand``.

    raw: uint8 [rows, row_bytes] (quantized types) or the float32 tensor itself (F32, or expanded).
    shape: torch order, last dim = row length. blocks: ``linear`` runs moestream's C kernels on the blocks
    (moestream/kernels.py) where they compute the type; otherwise dequantize-then-matmul (quant.linear).
    Raises GGUFError for a type moestream cannot compute.
    """

    def __init__(self, model: GGUFModel, info: TensorInfo, device: torch.device, expand: bool = False,
                 blocks: bool = False):
        check_computable(info)
        self.name, self.ggml_type, self.shape = info.name, info.ggml_type, info.shape
        self.cols = info.shape[-1]
        self.rows = math.prod(info.shape[:-1])
        data = model.read(info).view(self.rows, info.row_bytes)
        if info.ggml_type == GGMLQuantizationType.F32 or expand:
            self.dense: torch.Tensor | None = quant.dequantize(data, info.ggml_type, self.cols).to(device)
            self.raw: torch.Tensor | None = None
        else:
            self.dense, self.raw = None, data.to(device)
        self.blocks = (blocks and self.raw is not None and self.raw.device.type == "cpu"
                       and kernels.computes(info.ggml_type, self.cols))

    @property
    def nbytes(self) -> int:
        t = self.dense if self.dense is not None else self.raw
        return t.numel() * t.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., cols] float32 -> [..., rows] float32 (x @ W.T)."""
        if self.dense is not None:
            return torch.nn.functional.linear(x, self.dense)
        if self.blocks:
            return kernels.linear(x, self.raw, self.ggml_type, self.cols)
        return quant.linear(x, self.raw, self.ggml_type, self.cols)

    def float(self) -> torch.Tensor:
        """The whole weight as float32 [shape]."""
        if self.dense is not None:
            return self.dense.view(self.shape)
        return quant.dequantize(self.raw, self.ggml_type, self.cols).view(self.shape)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows ``ids`` [n] int64 -> float32 [n, cols], dequantizing only those rows."""
        if self.dense is not None:
            return self.dense[ids]
        return quant.dequantize(self.raw[ids], self.ggml_type, self.cols)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (float32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_neox(x: torch.Tensor, positions: torch.Tensor, base: float, n_rot: int | None = None) -> torch.Tensor:
    """Rotary embedding, NEOX style (rotate halves), on the first ``n_rot`` dims of the head.

    x: [tokens, heads, head_dim] float32; positions: [tokens] int64. theta_i = base^(-2i/n_rot).
    """
    d = x.shape[-1]
    n_rot = n_rot or d
    inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.int64, device=x.device).float() / n_rot))
    ang = positions.float()[:, None] * inv_freq[None, :]  # [tokens, n_rot/2]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xr, rest = x[..., :n_rot], x[..., n_rot:]
    x1, x2 = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = xr * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if n_rot < d else out


class KVCache:
    """Per-layer key/value cache. k, v: float32 [n_ctx, n_kv_heads, head_dim] per layer."""

    def __init__(self, n_layers: int, n_ctx: int, n_kv: int, head_dim_k: int, head_dim_v: int,
                 device: torch.device):
        self.n_ctx = n_ctx
        self.k = [torch.zeros((n_ctx, n_kv, head_dim_k), device=device) for _ in range(n_layers)]
        self.v = [torch.zeros((n_ctx, n_kv, head_dim_v), device=device) for _ in range(n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.k + self.v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal GQA attention of new queries over the cache.

    q: [T, n_head, d] for positions start..start+T-1; k, v: [start+T, n_kv, d] (cache up to the last new
    token). Returns [T, n_head * d_v] float32.
    """
    n_tok, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [n_head, S, d]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qq = q.transpose(0, 1)  # [n_head, T, d]
    scores = torch.matmul(qq, kk.transpose(1, 2)) * scale  # [n_head, T, S]
    n_keys = k.shape[0]
    qpos = torch.arange(start, start + n_tok, device=q.device)[:, None]
    kpos = torch.arange(n_keys, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vv)  # [n_head, T, d_v]
    return out.transpose(0, 1).reshape(n_tok, -1)


def rope_neox_inv_freq(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, NEOX style (rotate halves), with explicit inverse frequencies.

    x: [tokens, heads, head_dim] float32; positions: [tokens] int64; inv_freq: [n_rot/2] float32, so the first
    n_rot = 2 * len(inv_freq) dims of each head rotate (dim i pairs with i + n_rot/2). Angle of pair i at
    position p: p * inv_freq[i] (llama.cpp's ggml_rope_ext with freq_factors: theta_i / freq_factor_i).
    """
    n_rot = 2 * inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq[None, :]  # [tokens, n_rot/2]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xr, rest = x[..., :n_rot], x[..., n_rot:]
    x1, x2 = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if n_rot < x.shape[-1] else out


class LayerKVCache:
    """Key/value cache whose layers may differ in KV heads and head dims, or own no cache at all.

    shapes: per layer ``(n_kv_heads, head_dim_k, head_dim_v)``, or None for a layer that reads another layer's
    cache (shared-KV layers). k[i], v[i]: float32 [n_ctx, n_kv_heads, head_dim] (None where shapes[i] is None).
    """

    def __init__(self, n_ctx: int, shapes: list[tuple[int, int, int] | None], device: torch.device):
        self.n_ctx = n_ctx
        self.k = [None if s is None else torch.zeros((n_ctx, s[0], s[1]), device=device) for s in shapes]
        self.v = [None if s is None else torch.zeros((n_ctx, s[0], s[2]), device=device) for s in shapes]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.k + self.v if t is not None)


def attention_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of new queries over the cache, optionally limited to a sliding window.

    q: [T, n_head, d] for positions start..start+T-1; k, v: [start+T, n_kv, d] (cache up to the last new token).
    window: a query at position p sees keys at positions p - window < j <= p (transformers'
    ``sliding_window``; llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p - j >= n_swa); None: every j <= p.
    Returns [T, n_head * d_v] float32.
    """
    n_tok = q.shape[0]
    first = 0 if window is None else max(0, start - window + 1)  # keys before this are masked for every query
    k, v = k[first:], v[first:]
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [n_head, S, d]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * scale  # [n_head, T, S]
    qpos = torch.arange(start, start + n_tok, device=q.device)[:, None]
    kpos = torch.arange(first, first + k.shape[0], device=q.device)[None, :]
    masked = kpos > qpos
    if window is not None:
        masked = masked | (qpos - kpos >= window)
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    return torch.matmul(probs, vv).transpose(0, 1).reshape(n_tok, -1)
