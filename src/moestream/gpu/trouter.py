"""The softmax router's top-k as one Triton launch (CUDA).

torch computes ``topk(softmax(logits))`` and the renormalisation in five launches (softmax, the top-k's gather
and sort, sum, divide: ~17 µs per MoE layer of a decode step on an H200, more than the router's matmul);
:func:`softmax_topk` does it in one program per token:

- softmax over the experts in float32: ``p_e = exp(x_e - max) / sum_e exp(x_e - max)``, the sum a tree over the
  (power-of-two padded) expert axis, fixed for a given expert count;
- top-k by k passes of arg-max, each taking the largest remaining probability and, among equal ones, the lowest
  expert id (torch.topk leaves the order of ties unspecified); ids in descending order of probability, as
  ``torch.topk(sorted=True)``;
- with ``norm``, the k weights divided by their sum, added in selection order (transformers' ``norm_topk_prob``,
  llama.cpp's ``build_moe_ffn`` with softmax gating and ``norm_w``).

Deterministic (no atomics; the configuration depends on the expert count and k only), so the streaming and
resident steps, graphed or eager, get the same ids and weights. Not the bits of torch's softmax (another
summation order; the weights agree within a few float32 ulps: tests/test_trouter.py). The CPU keeps the step
kernels' router (layers.softmax_topk).
"""

from __future__ import annotations

import os

import torch

try:  # the CUDA path needs triton; the CPU path never imports it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available() -> bool:
    """Whether the kernel can run: triton imports, and CUDA is available or ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _softmax_topk_kernel(x_ptr, ids_ptr, w_ptr, n_exp, K: tl.constexpr, BLOCK: tl.constexpr,
                             NORM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        ok = e < n_exp
        x = tl.load(x_ptr + row * n_exp + e, mask=ok, other=float("-inf"))
        mx = tl.max(x, axis=0)
        p = tl.where(ok, tl.exp(x - mx), 0.0)
        p = p / tl.sum(p, axis=0)
        left = tl.where(ok, p, -1.0)  # probabilities are >= 0: -1 marks padding and taken experts
        total = 0.0
        for j in tl.static_range(K):
            best = tl.max(left, axis=0)
            idx = tl.min(tl.where(left == best, e, BLOCK), axis=0)
            tl.store(ids_ptr + row * K + j, idx.to(tl.int64))
            tl.store(w_ptr + row * K + j, best)
            total = total + best
            left = tl.where(e == idx, -1.0, left)
        if NORM:  # the same program wrote them: its own stores are visible to its loads
            for j in tl.static_range(K):
                tl.store(w_ptr + row * K + j, tl.load(w_ptr + row * K + j) / total)


def softmax_topk(router_logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits float32 [T, n_experts] (contiguous rows are made) -> (ids int64 [T, top_k], weights float32
    [T, top_k]): see the module docstring. ``top_k`` a power of two or not, at most n_experts."""
    x = router_logits.contiguous()
    n_tok, n_exp = x.shape
    ids = torch.empty((n_tok, top_k), dtype=torch.int64, device=x.device)
    w = torch.empty((n_tok, top_k), dtype=torch.float32, device=x.device)
    if n_tok:
        _softmax_topk_kernel[(n_tok,)](x, ids, w, n_exp, K=top_k, BLOCK=triton.next_power_of_2(n_exp),
                                       NORM=bool(norm), num_warps=1 if n_exp <= 128 else 4)
    return ids, w
