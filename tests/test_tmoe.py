"""moestream.gpu.tmoe: the SwiGLU activation and the routed rows' weighted sum, one launch each.

On CUDA when present, else under Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` set before triton is
imported). Bars: ``weighted_sum`` bitwise equal to its documented order emulated with float32 torch ops (from
+0.0, ``acc = acc + y[j] * w[j]`` for j in top-k order, each product and sum rounded once) and within float32
rounding of float64; ``silu_mul`` within 2e-6 relative of float64 ``silu(g) * u`` (an exp, a division and two
multiplications each rounded once: a few ulps of 2^-24, plus the GPU's fast exp, about 2^-22 relative);
strided gate/up views (a split of a merged gate_up) give the bits of contiguous copies; two launches give the
same bits.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from moestream.gpu import tmoe  # noqa: E402

DEV = "cuda" if ON_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):  # noqa: ANN001, ANN202
    monkeypatch.setattr(tmoe, "ON_CPU", True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("n_tok,top_k,n", [(1, 8, 2048), (3, 6, 1100), (2, 4, 7)])
def test_weighted_sum_documented_order(n_tok: int, top_k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n + top_k)
    y = torch.randn(n_tok * top_k, n, generator=gen)
    w = torch.softmax(torch.randn(n_tok, top_k, generator=gen), dim=-1)
    assert tmoe.applies(y.to(DEV))
    got = tmoe.weighted_sum(y.to(DEV), w.to(DEV), top_k)
    want = torch.zeros(n_tok, n)
    for j in range(top_k):
        want = want + y.view(n_tok, top_k, n)[:, j] * w[:, j:j + 1]
    assert torch.equal(bits(got), bits(want))
    ref = (y.double().view(n_tok, top_k, n) * w.double()[..., None]).sum(dim=1)
    assert float((got.cpu().double() - ref).abs().max()) <= top_k * 2 ** -23 * float(ref.abs().max() + 1)
    assert torch.equal(bits(tmoe.weighted_sum(y.to(DEV), w.to(DEV), top_k)), bits(got))


def test_silu_mul() -> None:
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(5, 2 * 300, generator=gen) * 4
    gate, up = gu.split(300, dim=-1)  # row stride 600: the merged gate_up's halves
    got = tmoe.silu_mul(gate.to(DEV), up.to(DEV))
    assert got.shape == (5, 300) and got.is_contiguous()
    assert torch.equal(bits(got), bits(tmoe.silu_mul(gate.contiguous().to(DEV), up.contiguous().to(DEV))))
    g, u = gate.double(), up.double()
    ref = g / (1 + torch.exp(-g)) * u
    assert float(((got.cpu().double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) <= 2e-6


def test_off_and_cpu_by_default(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(tmoe, "ON_CPU", False)
    assert not tmoe.applies(torch.zeros(2))  # a CPU tensor: the callers keep their CPU code
    monkeypatch.setattr(tmoe, "ON_CPU", True)
    monkeypatch.setattr(tmoe, "ENABLED", False)
    assert not tmoe.applies(torch.zeros(2, device=DEV))
    assert not tmoe.applies(torch.zeros(2, dtype=torch.float64, device=DEV))
