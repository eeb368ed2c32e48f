"""Two small launches of the MoE layer on CUDA, each replacing two torch kernels.

- :func:`silu_mul`: the SwiGLU experts' activation ``silu(gate) * up`` (torch: a silu kernel, then a multiply);
  ``silu(g) = g / (1 + exp(-g))``, then times ``up``, each operation rounded once (no FMA contraction). Not
  torch's bits (Triton's exp); the same bits on every path that calls it.
- :func:`weighted_sum`: the routed rows' weighted sum ``out[t] = sum_j y[t, j] * w[t, j]`` (torch: ``y *= w``,
  then ``sum(dim=1)``), added in top-k order ``j = 0, 1, ..``, from +0.0, each product and each addition rounded
  once (tests/test_tmoe.py emulates it bitwise in torch). The streaming step (experts/moe.py ``_resident``) and
  the resident step (``MoE.resident_step``) both end with it on CUDA, so streaming on and off keep identical bits.

Deterministic (no atomics; the configuration depends on the shapes only). ``MOESTREAM_MOE_FUSED=0`` at import
(or :data:`ENABLED` False) gives torch's ops instead, for A/B runs. On a CPU device the callers keep their own
code (the C kernels' activation and in-order top-k sum).
"""

from __future__ import annotations

import torch

from . import env_on, runs_on

try:  # the CUDA path needs triton; the CPU path never imports it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

#: whether the CUDA MoE layer uses these launches (``MOESTREAM_MOE_FUSED=0`` at import: torch's ops)
ENABLED: bool = env_on("MOESTREAM_MOE_FUSED")
#: tests only: run on CPU tensors too (under Triton's interpreter)
ON_CPU = False
BLOCK = 1024


def applies(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensor ``t``: on, triton importable, a CUDA tensor (or :data:`ON_CPU` under
    ``TRITON_INTERPRET=1``), float32."""
    return runs_on(t, ENABLED, ON_CPU, triton is not None)


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n
        g = tl.load(g_ptr + r * g_stride + c, mask=m, other=0.0)
        u = tl.load(u_ptr + r * u_stride + c, mask=m, other=0.0)
        tl.store(out_ptr + r * n + c, g / (1.0 + tl.exp(-g)) * u, mask=m)

    @triton.jit
    def _weighted_sum_kernel(y_ptr, w_ptr, out_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + t * K + j)
            acc = acc + tl.load(y_ptr + (t * K + j) * n + c, mask=m, other=0.0) * wj
        tl.store(out_ptr + t * n + c, acc, mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up float32 [P, n] (rows at any stride, elements contiguous: a split of a merged gate_up is fine) ->
    silu(gate) * up, float32 [P, n] contiguous."""
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    p, n = gate.shape
    out = torch.empty((p, n), dtype=torch.float32, device=gate.device)
    if p and n:
        _silu_mul_kernel[(p, triton.cdiv(n, BLOCK))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=BLOCK,
                                                     num_warps=4, enable_fp_fusion=False)
    return out


def weighted_sum(y: torch.Tensor, w: torch.Tensor, top_k: int) -> torch.Tensor:
    """y float32 [T * top_k, n] (row t * top_k + j: token t's j-th routed expert, contiguous), w float32 [T, top_k]
    (made contiguous) -> float32 [T, n], the rows summed in top-k order (module docstring)."""
    y = y.contiguous()
    w = w.reshape(-1, top_k).contiguous()
    n_tok, n = w.shape[0], y.shape[1]
    out = torch.empty((n_tok, n), dtype=torch.float32, device=y.device)
    if n_tok and n:
        _weighted_sum_kernel[(n_tok, triton.cdiv(n, BLOCK))](y, w, out, n, K=int(top_k), BLOCK=BLOCK, num_warps=4,
                                                             enable_fp_fusion=False)
    return out
