"""moestream.gpu.tdense: RMSNorm and a float32 router GEMV, one Triton launch each.

On CUDA when present, else under Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` set before triton is
imported). References are float64 torch ops on the same inputs; the bars are derived from the kernels' orders
(u = 2^-24, float32's unit roundoff):

- ``rms_norm``: the sum of squares of n <= 4096 positive terms is at most 16 sequential additions per thread and
  a 12-level tree (tl.sum over one block): relative error <= 28 u; the mean (one division), sqrt (halves the
  relative error, plus one rounding), the reciprocal, x times it and times w add 5 more roundings: each output
  element within 24 u relative of float64 (bar: 64 u).
- ``linear``: each of B = block_k(K) lanes adds ceil(K / B) products in column order (every product and sum
  rounded once), then tl.sum's log2(B)-level tree: |error| <= (ceil(K / B) + log2(B) + 1) u * sum_k |x_k w_k|
  (bar: twice that).

Also: two launches give the same bits; a row's result does not depend on the other rows of the call (a token
alone or in a batch of decode steps); on CUDA, where layers.py routes ``rms_norm`` and a float32 ``Weight``'s
``linear`` through these kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from moestream.gpu import tdense  # noqa: E402

DEV = "cuda" if ON_CUDA else "cpu"
U = 2.0 ** -24


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):  # noqa: ANN001, ANN202
    monkeypatch.setattr(tdense, "ON_CPU", True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("rows,n,weighted", [(1, 2048, True), (3, 2816, True), (2, 128, False), (1, 7, True)])
def test_rms_norm_within_float32_rounding(rows: int, n: int, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, n, generator=gen) * 3.0
    w = torch.randn(n, generator=gen) if weighted else None
    eps = 1e-6
    assert tdense.norm_applies(x.to(DEV), None if w is None else w.to(DEV))
    got = tdense.rms_norm(x.to(DEV), None if w is None else w.to(DEV), eps).cpu()
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps)
    if w is not None:
        ref = ref * w.double()
    err = (got.double() - ref).abs()
    assert float((err / ref.abs().clamp_min(1e-30)).max()) <= 64 * U
    again = tdense.rms_norm(x.to(DEV), None if w is None else w.to(DEV), eps)
    assert torch.equal(bits(got), bits(again))
    alone = tdense.rms_norm(x[-1:].to(DEV).contiguous(), None if w is None else w.to(DEV), eps)
    assert torch.equal(bits(alone), bits(got[-1:]))


def test_rms_norm_heads_of_a_3d_tensor() -> None:
    """Per-head norms (olmoe, gemma4): x [T, heads, d] normed over d, the same bits as the rows one by one."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 128, generator=gen).to(DEV)
    w = torch.randn(128, generator=gen).to(DEV)
    got = tdense.rms_norm(x, w, 1e-5)
    rows = tdense.rms_norm(x.reshape(8, 128).contiguous(), w, 1e-5)
    assert got.shape == x.shape and torch.equal(bits(got.reshape(8, 128)), bits(rows))


def test_norm_applies_refuses_what_it_cannot_take() -> None:
    x = torch.zeros(2, 64).to(DEV)
    assert not tdense.norm_applies(x.t(), None)  # not contiguous
    assert not tdense.norm_applies(x, torch.zeros(32).to(DEV))  # wrong weight length
    assert not tdense.norm_applies(x.double(), None)
    assert not tdense.norm_applies(torch.zeros(1, tdense.MAX_NORM + 1).to(DEV), None)


@pytest.mark.parametrize("t,rows,cols", [(1, 128, 2048), (4, 128, 2048), (2, 6, 300), (1, 64, 2816)])
def test_linear_within_bound_and_batch_invariant(t: int, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows + cols + t)
    x = torch.randn(t, cols, generator=gen)
    w = torch.randn(rows, cols, generator=gen) * 0.05
    assert tdense.linear_applies(x.to(DEV), w.to(DEV))
    got = tdense.linear(x.to(DEV), w.to(DEV)).cpu()
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    bk = tdense.block_k(cols)
    k_seq, levels = -(-cols // bk), bk.bit_length() - 1
    assert bool(((got.double() - ref).abs() <= 2 * (k_seq + levels + 1) * U * scale).all())
    for i in range(t):  # a token alone gives the bits it gets in the batch
        alone = tdense.linear(x[i:i + 1].to(DEV), w.to(DEV))
        assert torch.equal(bits(alone), bits(got[i:i + 1]))
    assert torch.equal(bits(tdense.linear(x.to(DEV), w.to(DEV))), bits(got))


def test_linear_applies_only_to_decode_sized_inputs() -> None:
    w = torch.zeros(8, 32).to(DEV)
    assert tdense.linear_applies(torch.zeros(tdense.MAX_TOKENS, 32).to(DEV), w)
    assert not tdense.linear_applies(torch.zeros(tdense.MAX_TOKENS + 1, 32).to(DEV), w)  # a prompt chunk: cuBLAS
    assert not tdense.linear_applies(torch.zeros(1, 32).to(DEV), w.t().contiguous().t())  # not contiguous
    assert not tdense.linear_applies(torch.zeros(1, 16).to(DEV), w)


@pytest.mark.skipif(not ON_CUDA, reason="layers.py routes CUDA tensors only")
def test_layers_route_cuda_norms_and_float32_routers_here() -> None:
    from moestream.models import layers

    x = torch.randn(1, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    assert torch.equal(bits(layers.rms_norm(x, w, 1e-6)), bits(tdense.rms_norm(x, w, 1e-6)))
    weight = layers.Weight.__new__(layers.Weight)
    weight.dense = torch.randn(16, 256, device="cuda")
    assert torch.equal(bits(weight.linear(x)), bits(tdense.linear(x, weight.dense)))
