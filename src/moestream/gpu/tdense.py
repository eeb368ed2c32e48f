"""Two small dense launches of a CUDA step, each replacing torch's (issue 24, item 3: fewer, cheaper launches).

- :func:`rms_norm`: RMSNorm of float32 rows, ``x * (1 / sqrt(mean(x^2) + eps)) * w``, one program per row (torch:
  ``vectorized_layer_norm_kernel``, 3.4 us per call in a graphed q32 step on the H200, 65 calls per token). The
  sum of squares is Triton's ``tl.sum`` over one block (a fixed tree for a fixed block size and warp count); the
  square root and the division are IEEE round-to-nearest (``sqrt_rn``, ``div_rn``); each product rounded once
  (no FMA contraction). Not torch's bits (another reduction order); the same bits on every path that calls it.
- :func:`linear`: ``x @ W.T`` for a float32 weight ``W`` [rows, cols] and at most :data:`MAX_TOKENS` rows of x
  (decode steps: the routers of every family, kept float32 at load). torch ran cuBLAS's gemv as two kernels
  (``dot_kernel`` + ``reduce_1Block_kernel``, 4.4 us per router in the graphed step); here one launch, blocks of
  :data:`BLOCK_R` weight rows per program, each row's products accumulated over :func:`block_k` lanes in
  column order, then the lanes summed by ``tl.sum``. An output element depends only on its own x row and weight
  row, so a token's result is the same alone or in a batch of up to :data:`MAX_TOKENS`.

Deterministic (no atomics; configurations depend on shapes only). ``MOESTREAM_TDENSE=0`` at import (or
:data:`ENABLED` False) gives torch's ops, for A/B runs. Used by models/layers.py's ``rms_norm`` and
``Weight.linear`` on CUDA tensors; the CPU keeps its C kernels.
"""

from __future__ import annotations

import torch

from . import env_on, runs_on

try:  # the CUDA path needs triton; the CPU path never imports it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

#: whether CUDA steps use these launches (``MOESTREAM_TDENSE=0`` at import: torch's ops)
ENABLED: bool = env_on("MOESTREAM_TDENSE")
#: tests only: run on CPU tensors too (under Triton's interpreter)
ON_CPU = False
#: the widest row :func:`rms_norm` takes in one block (wider rows: torch)
MAX_NORM = 16384
#: at most this many x rows through :func:`linear` (more: cuBLAS, which tiles a prompt chunk better)
MAX_TOKENS = 8
#: weight rows per program of :func:`linear` (one: a router's 128 rows are 128 programs, each one pass over its
#: row when it has at most :data:`MAX_BLOCK_K` columns; the H200's graphed q32 step took 4.2 us per router with
#: 4 rows and 256 lanes per program, 8 passes)
BLOCK_R = 1
#: the most lanes across a row of :func:`linear` (:func:`block_k`)
MAX_BLOCK_K = 4096


def block_k(n_cols: int) -> int:
    """Lanes across a weight row in :func:`linear`: the power of two covering ``n_cols``, at most
    :data:`MAX_BLOCK_K` (each lane then adds ``ceil(n_cols / block_k)`` products in column order)."""
    return min(_pow2(n_cols), MAX_BLOCK_K)


def applies(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensor ``t``: on, triton importable, float32, a CUDA tensor (or :data:`ON_CPU`
    under ``TRITON_INTERPRET=1``)."""
    return runs_on(t, ENABLED, ON_CPU, triton is not None)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, n: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < n
        v = tl.load(x_ptr + r * n + c, mask=m, other=0.0)
        ss = tl.sum(v * v, axis=0)
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, float(n)) + eps))
        y = v * inv
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=m, other=0.0)
        tl.store(out_ptr + r * n + c, y, mask=m)

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        pr = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = rows < n_rows
        wrow = w_ptr + rows.to(tl.int64)[:, None] * n_cols
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < n_cols
            xv = tl.load(x_ptr + t * n_cols + k, mask=km, other=0.0)
            wv = tl.load(wrow + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            acc = acc + wv * xv[None, :]
        tl.store(out_ptr + t * n_rows + rows, tl.sum(acc, axis=1), mask=rm)


def norm_applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether :func:`rms_norm` takes ``x`` (and ``weight``): :func:`applies`, x contiguous with a last dim of at
    most :data:`MAX_NORM`, weight None or float32 [last dim] contiguous on x's device."""
    if not applies(x) or not x.is_contiguous() or x.dim() == 0 or not 0 < x.shape[-1] <= MAX_NORM:
        return False
    return weight is None or (weight.dtype == torch.float32 and weight.is_contiguous()
                              and weight.shape == (x.shape[-1],) and weight.device == x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x float32 [..., n] contiguous, weight float32 [n] or None -> RMSNorm over the last dim, float32 [..., n]
    (module docstring). The caller checked :func:`norm_applies`."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        block = _pow2(n)
        _rms_norm_kernel[(rows,)](x, weight if weight is not None else x, out, float(eps), n=n,
                                  HAS_W=weight is not None, BLOCK=block, num_warps=4 if block <= 4096 else 8,
                                  enable_fp_fusion=False)
    return out


def linear_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` takes ``x`` [..., cols] and ``w`` float32 [rows, cols]: :func:`applies`, at most
    :data:`MAX_TOKENS` x rows, both on one device, ``w`` contiguous."""
    if not applies(x) or w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous():
        return False
    return w.device == x.device and x.shape[-1] == w.shape[1] and x.numel() // max(1, w.shape[1]) <= MAX_TOKENS


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x float32 [..., cols], w float32 [rows, cols] contiguous -> x @ w.T float32 [..., rows] (module
    docstring). The caller checked :func:`linear_applies`."""
    n_rows, n_cols = w.shape
    x2 = x.reshape(-1, n_cols)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n_rows), dtype=torch.float32, device=x.device)
    if x2.shape[0] and n_rows:
        bk = block_k(n_cols)
        _linear_kernel[(triton.cdiv(n_rows, BLOCK_R), x2.shape[0])](x2, w, out, n_rows, n_cols=n_cols, BLOCK_R=BLOCK_R,
                                                                    BLOCK_K=bk, num_warps=4 if bk <= 2048 else 8,
                                                                    enable_fp_fusion=False)
    return out.view(*x.shape[:-1], n_rows)
