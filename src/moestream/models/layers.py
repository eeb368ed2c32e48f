"""Shared building blocks: resident weights in the file's own format, RMSNorm, RoPE, attention, KV cache."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType

from .. import kernels, quant
from ..errors import GGUFError
from ..gguf import GGUFModel, TensorInfo
from ..ops import ELEMENTWISE_SLICE, elementwise, per_sequence, sequence_rows  # noqa: F401 - the family files import them from here


def check_computable(info: TensorInfo) -> None:
    """GGUFError naming the file and the tensor unless moestream can compute ``info``'s ggml type."""
    if not quant.is_supported(info.ggml_type):
        raise GGUFError(f"{info.path}: tensor {info.name} is ggml type {info.ggml_type} "
                        f"({info.type_name}), which moestream cannot compute")


class Weight:
    """A resident dense weight, kept in the file's own ggml format unless ``expand``; ``mapped``: left in a memory
    map of the file instead of a private copy (row-lookup tables, see MoEModel.lookup_table).

    raw: uint8 [rows, row_bytes] (quantized types) or the float32 tensor itself (F32, or expanded).
    shape: torch order, last dim = row length. blocks: ``linear`` runs moestream's C kernels on the blocks
    (moestream/kernels.py) where they compute the type; otherwise dequantize-then-matmul (quant.linear). The
    matmuls torch computes run per sequence within :func:`~moestream.ops.sequence_rows` (a step of several
    sequences).
    Raises GGUFError for a type moestream cannot compute.
    """

    def __init__(self, model: GGUFModel, info: TensorInfo, device: torch.device, expand: bool = False,
                 blocks: bool = False, mapped: bool = False, gpu: bool = False):
        check_computable(info)
        self.name, self.ggml_type, self.shape = info.name, info.ggml_type, info.shape
        self.cols = info.shape[-1]
        self.rows = math.prod(info.shape[:-1])
        #: the blocks stay in a read-only memory map of the file (``mapped``): only the pages read become resident
        self.mapped = mapped and info.ggml_type != GGMLQuantizationType.F32 and not expand
        data = (model.mapped(info) if self.mapped else model.read(info)).view(self.rows, info.row_bytes)
        if info.ggml_type == GGMLQuantizationType.F32 or expand:
            self.dense: torch.Tensor | None = quant.dequantize(data, info.ggml_type, self.cols).to(device)
            self.raw: torch.Tensor | None = None
        else:
            self.dense, self.raw = None, data.to(device)
        self.blocks = (blocks and self.raw is not None and self.raw.device.type == "cpu"
                       and kernels.computes(info.ggml_type, self.cols))
        #: an F32 weight on the CPU beside the C kernels (a router, a shared expert's gate): ``linear`` runs
        #: ms_linear's F32 kernel on it too, on every compute thread (torch runs one thread there), each output
        #: the same bits at any token count and thread count (so no per-sequence split)
        self.f32_blocks = (blocks and self.dense is not None and not expand and self.dense.device.type == "cpu"
                           and info.ggml_type == GGMLQuantizationType.F32 and kernels.computes(info.ggml_type,
                                                                                                self.cols))
        #: CUDA: ``linear`` runs the Triton kernels on the blocks (gpu/tkernels.py) where they compute the type
        self.gpu = False
        if gpu and self.raw is not None and self.raw.device.type == "cuda":
            from ..gpu import tkernels
            self.gpu = tkernels.computes(info.ggml_type, self.cols)

    @property
    def nbytes(self) -> int:
        t = self.dense if self.dense is not None else self.raw
        return t.numel() * t.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., cols] float32 -> [..., rows] float32 (x @ W.T)."""
        if self.dense is not None:
            if x.is_cuda and (td := _tdense()) is not None and td.linear_applies(x, self.dense):
                return td.linear(x, self.dense)  # a decode step's router on CUDA: one Triton launch
            if self.f32_blocks and x.device.type == "cpu":
                return kernels.linear(x, self.dense.view(torch.uint8), int(GGMLQuantizationType.F32), self.cols)
            return per_sequence(lambda v: torch.nn.functional.linear(v, self.dense), x)
        if self.blocks:
            return kernels.linear(x, self.raw, self.ggml_type, self.cols)
        if self.gpu:
            from ..gpu import tkernels
            return tkernels.linear(x.reshape(-1, self.cols).contiguous(), self.raw, self.ggml_type,
                                   self.cols).view(*x.shape[:-1], self.rows)
        return per_sequence(lambda v: quant.linear(v, self.raw, self.ggml_type, self.cols), x)

    def float(self) -> torch.Tensor:
        """The whole weight as float32 [shape]."""
        if self.dense is not None:
            return self.dense.view(self.shape)
        return quant.dequantize(self.raw, self.ggml_type, self.cols).view(self.shape)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows ``ids`` [n] int64 -> float32 [n, cols], dequantizing only those rows (on the CPU
        by the step kernels where they decode the type: kernels.dequant_rows, the same bits)."""
        if self.dense is not None:
            return self.dense[ids]
        if self.raw.device.type == "cpu" and ids.dim() == 1 and (lib := kernels.step_ops()) is not None:
            y = kernels.dequant_rows(self.raw, self.ggml_type, self.cols, ids, lib=lib)
            if y is not None:
                return y
        return quant.dequantize(self.raw[ids], self.ggml_type, self.cols)


#: Whether the CPU computes RMSNorm with the step kernels' kernels.rms_norm (ggml's arithmetic: the squares summed
#: in double; bit for bit llama.cpp's, tests/test_llamacpp.py) instead of torch.rms_norm. See docs/how-it-works.md
#: for what it and :data:`C_ATTENTION` do to the oracle tests.
C_RMS_NORM = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (float32; weight: [x.shape[-1]], or 1.0 for none).

    On the CPU with :data:`C_RMS_NORM` (the default) the step kernels' kernels.rms_norm: ggml_rms_norm's arithmetic
    (each square rounded to float32, summed in double in index order; mean and 1/sqrtf(mean + eps) in float32; x
    times that, times the weight), the same bits as llama.cpp's CPU backend. Elsewhere torch.rms_norm (pow, mean,
    add, rsqrt, mul, mul in one C++ call)."""
    w = None if isinstance(weight, float) else weight
    if C_RMS_NORM and x.device.type == "cpu" and x.dtype == torch.float32 and (lib := kernels.step_ops()) is not None:
        return kernels.rms_norm(x, w, eps, lib=lib)
    if x.is_cuda and (td := _tdense()) is not None and td.norm_applies(x, w):  # CUDA: one Triton launch (gpu/tdense.py)
        return td.rms_norm(x, w, eps)
    return torch.rms_norm(x, (x.shape[-1],), w, eps)


def _tdense() -> Any:
    """gpu/tdense.py where triton imports (it is imported on first use, not by a CPU-only process), else None."""
    global _TDENSE
    if _TDENSE is None:
        try:
            from ..gpu import tdense
        except ImportError:  # pragma: no cover - torch without triton
            tdense = False
        _TDENSE = tdense
    return _TDENSE or None


_TDENSE: Any = None


def rope_inv_freq(base: float, n_rot: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """NEOX RoPE inverse frequencies: float32 [n_rot/2], theta_i = base^(-2i/n_rot)."""
    return 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.int64, device=device).float() / n_rot))


def yarn_inv_freq(base: float, n_rot: int, factor: float, orig_ctx: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """YaRN inverse frequencies (Peng et al. 2023, arXiv:2309.00071): float32 [n_rot/2].

    Per pair i: ``theta_i = base^(-2i/n_rot)`` (extrapolated, unscaled) and ``theta_i / factor`` (interpolated),
    mixed by a ramp over the pair index that is 1 (pure extrapolation) below ``low`` and 0 (pure interpolation)
    above ``high``, linear between; ``low``/``high`` are the pair indices that turn ``beta_fast`` and
    ``beta_slow`` times in ``orig_ctx`` positions, floored and ceiled (the "truncated" correction range:
    llama.cpp's ggml_rope_yarn_corr_dims, transformers' ``truncate=True``, the only form a GGUF can give).
    The float32 arithmetic follows transformers' ``_compute_yarn_parameters`` step by step, so the angles are
    the same bits. The cos/sin magnitude factor is separate (:func:`yarn_attention_factor`, ``Rope(scale=)``).
    ValueError unless factor >= 1, orig_ctx >= 1 and n_rot is even.
    """
    if factor < 1.0 or orig_ctx < 1 or n_rot % 2:
        raise ValueError(f"YaRN needs factor >= 1, an original context >= 1 and an even n_rot; got factor {factor}, "
                         f"original context {orig_ctx}, n_rot {n_rot}")

    def corr_dim(n_turns: float) -> float:  # the pair index whose wavelength turns n_turns times in orig_ctx
        return (n_rot * math.log(orig_ctx / (n_turns * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), n_rot - 1)
    if low == high:
        high += 0.001  # no zero-width ramp (transformers' guard)
    ramp = torch.clamp((torch.arange(n_rot // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, n_rot, 2, device=device).float() / n_rot)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's cos/sin magnitude factor: ``0.1 ln(factor) + 1`` (1.0 for factor <= 1); with ``mscale`` and
    ``mscale_all_dim`` both non-zero (DeepSeek's configs), ``m(factor, mscale) / m(factor, mscale_all_dim)`` with
    ``m(s, a) = 0.1 a ln(s) + 1`` (transformers' ``_compute_yarn_parameters``, its ``get_mscale``)."""
    def m(scale: float, a: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * a * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(m(factor, mscale) / m(factor, mscale_all_dim))
    return m(factor)


class Rope:
    """Rotary embedding, NEOX style (rotate halves), with its cos/sin tables kept for the positions reached.

    inv_freq: float32 [n_rot/2]: the first n_rot = 2 * len(inv_freq) dims of each head rotate (dim i pairs with
    i + n_rot/2); the angle of pair i at position p is p * inv_freq[i] (llama.cpp's ggml_rope_ext; with
    freq_factors, inv_freq = theta_i / freq_factor_i). Tables, float32 [n_pos, n_rot] for positions
    0..n_pos-1: ``cos`` = [cos a | cos a], ``sin`` = [-sin a | sin a] (a: the n_rot/2 angles of the position),
    grown (never shrunk) when a call reaches past them, so a decode step only slices them. Each entry is computed
    in float64 (angle p * inv_freq[i], its cos or sin, times ``scale``) and rounded once to float32: the
    correctly rounded value but for float64's own rounding. In float32, as transformers and llama.cpp compute
    them, the angle alone is off by up to p * 2^-24 radians (3e-3 at p = 50,000), the largest rounding of a
    float32 forward pass here: it put the deepseek2 fixture's logits (YaRN) 1.0e-4 from the float64 model with
    the C step kernels, 6.8e-5 with these tables (tests/test_deepseek2.py).

    The tables are computed in fixed blocks of ``block`` positions (at most 16384 angles, below torch's
    parallel grain size), each block on its own: a position's cos/sin are the same bits whatever the order the
    positions were reached in and whatever the thread count.

    scale: cos and sin are multiplied by it (YaRN's attention factor, :func:`yarn_attention_factor`; transformers'
    ``attention_scaling``); 1.0 multiplies nothing.

    ``interleaved``: GPT-J style instead (llama.cpp's LLAMA_ROPE_TYPE_NORM, DeepSeek-V2/V3; transformers'
    ``rope_interleave``): dim 2i pairs with 2i + 1, the tables are [c0, c0, c1, c1, ...] and
    [-s0, s0, -s1, s1, ...], and the partner of (x0, x1, ...) is (x1, x0, x3, x2, ...). Its results stay in the
    interleaved layout (transformers' interleaved form writes the same values de-interleaved; q.k is the same).
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0, interleaved: bool = False):
        self.inv_freq = inv_freq
        self.scale = float(scale)
        self.interleaved = interleaved
        self.n_rot = 2 * inv_freq.shape[0]
        self.block = max(1, 16384 // max(inv_freq.shape[0], 1))
        self.cos = inv_freq.new_empty((0, self.n_rot))
        self.sin = inv_freq.new_empty((0, self.n_rot))

    def reserve(self, n_pos: int) -> None:
        """Make the tables cover positions 0..n_pos-1 (at least doubling them when they grow)."""
        have = self.cos.shape[0]
        if n_pos <= have:
            return
        want = max(n_pos, 2 * have)
        want = -(-want // self.block) * self.block
        cos, sin = [self.cos], [self.sin]
        for b0 in range(have, want, self.block):
            pos = torch.arange(b0, b0 + self.block, dtype=torch.int64, device=self.inv_freq.device)
            ang = pos.double()[:, None] * self.inv_freq.double()[None, :]  # [block, n_rot/2], exact in double
            c, s = ang.cos(), ang.sin()
            if self.scale != 1.0:
                c, s = c * self.scale, s * self.scale
            c, s = c.to(self.inv_freq.dtype), s.to(self.inv_freq.dtype)
            if self.interleaved:
                cos.append(torch.stack((c, c), dim=-1).flatten(-2))
                sin.append(torch.stack((-s, s), dim=-1).flatten(-2))
            else:
                cos.append(torch.cat((c, c), dim=-1))
                sin.append(torch.cat((-s, s), dim=-1))
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def __call__(self, x: torch.Tensor, start: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: float32 [T, heads, head_dim] at positions start..start+T-1 -> rotated, same shape.

        out: where to write the result (e.g. the KV cache rows of those positions; must not overlap x), else a
        new tensor. Per pair (x1, x2) at angle a: (x1 cos a - x2 sin a, x2 cos a + x1 sin a), computed as
        x * [cos | cos] + [x2 | x1] * [-sin | sin]; dims past n_rot are copied unchanged.
        """
        n_tok, n_rot, h = x.shape[0], self.n_rot, self.n_rot // 2
        end = start + n_tok
        if end > self.cos.shape[0]:
            self.reserve(end)
        if x.device.type == "cpu" and x.dtype == torch.float32 and (lib := kernels.step_ops()) is not None:
            if out is None:
                out = torch.empty(x.shape, dtype=torch.float32)
            kernels.rope(x, self.cos[start:end], self.sin[start:end], self.interleaved, out, lib=lib)
            return out  # the same bits as the torch ops below
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]  # [T, 1, n_rot]
        if self.interleaved:
            xr = x[..., :n_rot]
            swapped = _pair_swap(xr)
            if n_rot == x.shape[-1]:
                return torch.add(xr * cos, swapped * sin, out=out)
            if out is None:
                out = torch.empty_like(x)
            torch.add(xr * cos, swapped * sin, out=out[..., :n_rot])
            out[..., n_rot:] = x[..., n_rot:]
            return out
        if n_rot == x.shape[-1]:
            swapped = torch.cat((x[..., h:], x[..., :h]), dim=-1)
            return torch.add(x * cos, swapped * sin, out=out)
        xr = x[..., :n_rot]
        swapped = torch.cat((xr[..., h:], xr[..., :h]), dim=-1)
        if out is None:
            out = torch.empty_like(x)
        torch.add(xr * cos, swapped * sin, out=out[..., :n_rot])
        out[..., n_rot:] = x[..., n_rot:]
        return out


def linear_bias(w: Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``w.linear(x)`` plus ``bias`` (float32 [rows]) when there is one: x float32 [T, cols] -> [T, rows]."""
    y = w.linear(x)
    return y if bias is None else y + bias


def swiglu_ffn(gate: Weight, up: Weight, down: Weight, h: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU FFN (dense layers, shared experts): h float32 [T, hidden] -> ``W_down(silu(W_gate h) *
    W_up h)`` float32 [T, hidden]."""
    return down.linear(elementwise(torch.nn.functional.silu, gate.linear(h)) * up.linear(h))


def _pair_swap(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...) over the last dim (even length): the partners of
    interleaved RoPE."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


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


class KVArena:
    """One model's KV memory on CUDA, reused by its successive caches, so that a cache made for the next request
    lies at the addresses the last one's decode graphs were captured on (models/graphs.py keys them by address).

    ``get(n_ctx, make)``: a cache of ``n_ctx`` rows, zeroed: rows ``[:n_ctx]`` of the arena's cache (its ``k`` and
    ``v`` tensors; any other state it holds, such as recurrent state, whole) when the last
    one handed out is no longer referenced (the arena grows to the largest ``n_ctx`` asked for, once, and keeps
    it), else a new ``make(n_ctx)`` (two caches in use at once never share memory)."""

    def __init__(self) -> None:
        self._base = None
        self._last: weakref.ref | None = None

    def get(self, n_ctx: int, make: Callable[[int], object]) -> object:
        if self._last is not None and self._last() is not None:
            return make(n_ctx)
        if self._base is None or self._base.n_ctx < n_ctx:
            self._base = None  # the old memory back first
            self._base = make(n_ctx)
        cache = copy.copy(self._base)
        cache.n_ctx = n_ctx
        for name, v in vars(self._base).items():  # k/v rows [:n_ctx]; other state (recurrent) whole; zeroed

            def fresh(t: object, rows: bool = name in ("k", "v")) -> object:
                return t[:n_ctx].zero_() if rows and isinstance(t, torch.Tensor) else (
                    t.zero_() if isinstance(t, torch.Tensor) else t)

            if isinstance(v, list):
                setattr(cache, name, [fresh(t) for t in v])
            elif isinstance(v, dict):
                setattr(cache, name, {i: fresh(t) for i, t in v.items()})
            elif isinstance(v, torch.Tensor):
                setattr(cache, name, fresh(v))
        self._last = weakref.ref(cache)
        return cache


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


#: Whether the CPU computes attention with the step kernels' kernels.attention (llama.cpp's CPU arithmetic, bit for
#: bit: tests/test_llamacpp.py; its numpy reference: tests/test_stepkern.py) instead of torch's ops below. On
#: qwen3moe-tiny Q4_K_M through the C matmul kernels it is max |diff| 4.03 from llama.cpp (bar 3.6) unless RMSNorm
#: runs in C too (2.55): a rounding flip somewhere else, not the attention (docs/testing.md).
C_ATTENTION = True


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of new queries over the cache, optionally limited to a sliding window.

    q: float32 [T, n_head, d] for positions start..start+T-1; k: [start+T, n_kv, d], v: [start+T, n_kv, d_v]
    (the cache up to the last new token: views of it are read as they are, nothing is copied). Query head h
    reads KV head h // (n_head / n_kv) (transformers' repeat_kv order). Scores are q.k * scale.
    window: a query at position p sees keys at positions p - window < j <= p (transformers'
    ``sliding_window``; llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p - j >= n_swa); None: every j <= p.
    sinks: optional float32 [n_head], one learned logit per query head that joins the softmax's denominator and
    attends to nothing (GPT-OSS: transformers' ``s_aux``, llama.cpp's ``ggml_soft_max_add_sinks``): weights
    ``exp(s_j) / (sum_j exp(s_j) + exp(sink_h))``. Returns float32 [T, n_head * d_v].

    torch: GQA without copying the cache, the queries of one KV head's group are the rows of one matrix, [n_kv,
    group * T, d], multiplied with that head's keys; a single new token (decode) sees every key it is given, so it
    needs no mask. With :data:`C_ATTENTION` on the CPU, the step kernels' kernels.attention instead.
    """
    if C_ATTENTION and q.device.type == "cpu" and q.dtype == torch.float32 and (lib := kernels.step_ops()):
        return kernels.attention(q, k, v, start, scale, window, sinks, lib=lib)
    n_tok, n_head, d = q.shape
    first = 0 if window is None else max(0, start - window + 1)  # keys before this are masked for every query
    if first:
        k, v = k[first:], v[first:]
    n_keys, n_kv = k.shape[0], k.shape[1]
    group = n_head // n_kv
    if n_tok == 1:  # [n_head, d] is already [n_kv, group, d] in memory
        qq = q.reshape(n_kv, group, d)
    else:
        qq = q.reshape(n_tok, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * n_tok, d)  # rows (g, t)
    scores = torch.matmul(qq, k.permute(1, 2, 0))  # [n_kv, group * T, S]
    if scale != 1.0:
        scores.mul_(scale)
    if n_tok > 1:
        qpos = torch.arange(start, start + n_tok, device=q.device)[:, None]
        kpos = torch.arange(first, first + n_keys, device=q.device)[None, :]
        masked = kpos > qpos
        if window is not None:
            masked = masked | (qpos - kpos >= window)
        scores.view(n_kv, group, n_tok, n_keys).masked_fill_(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per row (the head's sink), dropped after the softmax
        sink = sinks.view(n_kv, group, 1, 1).expand(n_kv, group, n_tok, 1).reshape(n_kv, group * n_tok, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :n_keys]
    out = torch.matmul(probs, v.transpose(0, 1))  # [n_kv, group * T, d_v]
    if n_tok == 1:
        return out.view(1, -1)
    return out.view(n_kv, group, n_tok, -1).permute(2, 0, 1, 3).reshape(n_tok, -1)


#: Fewest keys a one-token decode step on CUDA attends over (see :func:`decode_keys`)
DECODE_MIN_KEYS = 256


def decode_keys(pos: int, n_ctx: int) -> int:
    """Keys a one-token CUDA decode step at position ``pos`` attends over (:func:`attention_at`): the next power of
    two above ``pos``, at least :data:`DECODE_MIN_KEYS`, at most ``n_ctx``. The shapes of a step then change only
    when it crosses a power of two, so one captured CUDA graph serves every step up to there (models/graphs.py)."""
    n = max(DECODE_MIN_KEYS, 1 << pos.bit_length())
    return min(n, n_ctx)


def rope_at(rope: Rope, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """:class:`Rope` of one token at a position held on the device: x float32 [1, heads, head_dim], pos int64 [1]
    -> rotated, same shape. The same arithmetic (and bits) as ``rope(x, start)``; the tables must already cover
    the position (``rope.reserve``): a device position cannot grow them."""
    n_rot, h = rope.n_rot, rope.n_rot // 2
    cos, sin = rope.cos.index_select(0, pos)[:, None], rope.sin.index_select(0, pos)[:, None]  # [1, 1, n_rot]
    if rope.interleaved:
        xr = x[..., :n_rot]
        rot = torch.add(xr * cos, _pair_swap(xr) * sin)
        return rot if n_rot == x.shape[-1] else torch.cat((rot, x[..., n_rot:]), dim=-1)
    if n_rot == x.shape[-1]:
        swapped = torch.cat((x[..., h:], x[..., :h]), dim=-1)
        return torch.add(x * cos, swapped * sin)
    xr = x[..., :n_rot]
    swapped = torch.cat((xr[..., h:], xr[..., :h]), dim=-1)
    return torch.cat((torch.add(xr * cos, swapped * sin), x[..., n_rot:]), dim=-1)


def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, kpos: torch.Tensor,
                 scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query at a position held on the device, over a fixed number of cache rows (CUDA decode).

    q: float32 [1, n_head, d]; k: [S, n_kv, d], v: [S, n_kv, d_v] (the first S cache rows, S from
    :func:`decode_keys`); pos: int64 [1]; kpos: int64 [S] (0..S-1). Keys past ``pos`` are masked (their
    softmax weight is exactly 0). Returns float32 [1, n_head * d_v]. Same semantics as :func:`attention` for
    one token (values within float rounding: the reductions run over S keys, not pos + 1); the shapes depend on
    S only, so the step can be captured once in a CUDA graph and replayed at every position below S.
    ``window``: keys at pos - window or before are masked too (sliding window); ``sinks``: one logit per
    query head in the softmax's denominator (as in :func:`attention`).
    """
    n_head, d = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    qq = q.reshape(n_kv, n_head // n_kv, d)
    scores = torch.matmul(qq, k.permute(1, 2, 0))  # [n_kv, group, S]
    if scale != 1.0:
        scores.mul_(scale)
    masked = kpos > pos
    if window is not None:
        masked = masked | (pos - kpos >= window)
    scores.masked_fill_(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per query head, dropped after the softmax
        sink = sinks.view(n_kv, n_head // n_kv, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :k.shape[0]]
    out = torch.matmul(probs, v.transpose(0, 1))  # [n_kv, group, d_v]
    return out.view(1, -1)


def softmax_topk(router_logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: router_logits float32 [T, n_experts] -> (ids int64 [T, top_k], weights float32
    [T, top_k]): the top-k of softmax over all experts, divided by their sum when ``norm`` (transformers'
    ``norm_topk_prob``; llama.cpp build_moe_ffn with softmax gating and ``norm_w``), else as they are. On the CPU
    the step kernels' router (kernels.route), on CUDA one Triton launch (gpu/trouter.py: another summation order,
    ties to the lowest id), elsewhere torch's ops."""
    if router_logits.device.type == "cpu" and (lib := kernels.step_ops()) is not None:
        return kernels.route(router_logits, top_k, kernels.GATING_SOFTMAX, norm=norm, lib=lib)
    if router_logits.device.type == "cuda" and router_logits.dtype == torch.float32:
        from ..gpu import trouter
        if trouter.available():
            return trouter.softmax_topk(router_logits, top_k, norm)  # one launch instead of five
    w, ids = torch.topk(torch.softmax(router_logits, dim=-1), top_k, dim=-1)
    return ids, (w / w.sum(dim=-1, keepdim=True) if norm else w)
