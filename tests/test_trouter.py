"""moestream.gpu.trouter: the softmax router's top-k in one Triton launch, against torch's ops.

On CUDA when present, else under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set before triton is
imported). Bars: the same expert ids in the same order as ``torch.topk(torch.softmax(x))`` in float64 wherever
the k-th and (k+1)-th probabilities are apart (ties: the lowest id first, checked on purpose-made ties); weights
within 2e-6 of float64's (a float32 softmax rounds each exp, the sum and the division: a few ulps of values <= 1,
plus the difference between Triton's and libm's exp); two launches give the same bits.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from moestream.gpu import trouter  # noqa: E402

DEV = "cuda" if ON_CUDA else "cpu"


def reference(x: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = torch.topk(torch.softmax(x.double(), dim=-1), k, dim=-1)
    return ids, (w / w.sum(dim=-1, keepdim=True) if norm else w)


@pytest.mark.parametrize("n_exp,k", [(128, 8), (64, 6), (256, 8), (32, 4), (60, 4), (512, 10)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_torch(n_exp: int, k: int, norm: bool) -> None:
    x = torch.randn(5, n_exp, generator=torch.Generator().manual_seed(n_exp + k)) * 3
    ids, w = trouter.softmax_topk(x.to(DEV), k, norm)
    rid, rw = reference(x, k, norm)
    p = torch.sort(torch.softmax(x.double(), dim=-1), dim=-1, descending=True).values
    apart = (p[:, k - 1] - p[:, k]) > 1e-6  # rows where the top-k set is not decided by rounding
    assert apart.all(), "random logits with a near-tie: pick another seed"
    assert torch.equal(ids.cpu(), rid), (ids, rid)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == (5, k)
    assert float((w.cpu().double() - rw).abs().max()) <= 2e-6
    ids2, w2 = trouter.softmax_topk(x.to(DEV), k, norm)
    assert torch.equal(ids2, ids) and torch.equal(w2.view(torch.int32), w.view(torch.int32))


def test_ties_take_the_lowest_id_and_no_expert_twice() -> None:
    x = torch.zeros(2, 16)
    x[0, [3, 7, 11]] = 2.0  # three equal largest
    x[1, :] = -1.0
    ids, w = trouter.softmax_topk(x.to(DEV), 4, True)
    assert ids[0].tolist() == [3, 7, 11, 0]
    assert ids[1].tolist() == [0, 1, 2, 3]
    assert torch.allclose(w[1].cpu(), torch.full((4,), 0.25))
    assert all(len(set(r)) == len(r) for r in ids.tolist())


def test_empty_and_non_contiguous() -> None:
    ids, w = trouter.softmax_topk(torch.zeros(0, 8, device=DEV), 2, True)
    assert ids.shape == (0, 2) and w.shape == (0, 2)
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1)).t()  # [3, 16], strided
    ids, _ = trouter.softmax_topk(x.to(DEV), 2, False)
    assert torch.equal(ids.cpu(), reference(x, 2, False)[0])
