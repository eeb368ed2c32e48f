"""Synthetic expert routing for benchmarks: top-k expert choices per (layer, token) with a trained model's
locality, fitted to published expert-cache hit rates.

Random-weight test models route almost uniformly in prefill and their decode hit rates are not those of a
trained model, so a benchmark of them says little about the slot pool under real routing. ``bench --routing
calibrated`` replaces the router's expert ids (``MoE.routing``; the router's weights are kept) with this
generator's. Per MoE layer:

- popularity skew: the expert of popularity rank ``j`` (0 = most popular; ranks are a per-layer random
  permutation of the experts) is drawn with probability proportional to ``(j + 1) ** -zipf * exp(-j / (cutoff *
  n_experts))``: Zipf-like at the top, an exponential cut-off in the tail (a trained model's layer uses only
  part of its experts over a few hundred tokens; a pure Zipf tail keeps missing where the published curves have
  stopped);
- token-to-token reuse: each of a token's top-k experts is, with probability ``reuse``, one of the previous
  token's experts (uniformly among those this token has not chosen yet), else a popularity draw (again among
  the experts not chosen yet), so a token's experts are distinct.

Deterministic from ``seed``: each layer draws from its own generator, ``numpy.random.default_rng([seed,
layer])``, and token ``t`` of layer ``l`` is the same whatever the calls' chunking, so every row of a bench run
(one process each, same calls) sees the same sequence.

The fitted parameters (:data:`FITS`) come from ``benchmarks/calibrate_routing.py --fit``: a grid search for the
``(zipf, cutoff, reuse)`` whose LRU hit rates (experts/trace.py's simulator, the published protocol: per-layer
pools, empty at the start, ``N_TOKENS`` decode tokens, every request counted) are closest (least squares, in
points) to the published ones. The parameters are dimensionless (``cutoff`` is a fraction of the experts,
``reuse`` a probability, and the Zipf head puts about the same share of the draws on the same top fraction of the
experts whatever their number), so the rule for another shape is: the same parameters with the model's own
n_experts and top_k. Only the 128-expert top-8 shape of the sources has been checked against published numbers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .trace import Request, simulate

#: Decode tokens of the calibration protocol (kekzl/imp#1374: "256 cold decode tokens").
N_TOKENS = 256


@dataclass(frozen=True)
class RoutingFit:
    """Generator parameters fitted to one published curve.

    name: model the curve is of. zipf, cutoff, reuse: see the module docstring. n_experts, top_k, n_layers: the source
    model's shape. targets: ((experts resident per layer, published LRU hit rate in %), ...). source: where the
    numbers are from and how their unit was read; cite: the source in a few words.
    """

    name: str
    zipf: float
    cutoff: float
    reuse: float
    n_experts: int
    top_k: int
    n_layers: int
    targets: tuple[tuple[int, float], ...]
    source: str
    cite: str
    #: published figures not fitted, to check the fit against: (what, experts resident per layer, low, high) with
    #: what ``"lru"`` (LRU hit rate in %) or ``"belady-lfu"`` (Belady's hit rate minus LFU's, in points)
    checks: tuple[tuple[str, int, float, float], ...] = ()


FITS: dict[str, RoutingFit] = {
    "qwen3-30b-a3b": RoutingFit(
        name="Qwen3-30B-A3B", zipf=0.55, cutoff=0.165, reuse=0.06, n_experts=128, top_k=8, n_layers=48,
        targets=((8, 36.6), (24, 74.1), (49, 89.4), (81, 96.2)),
        source="kekzl/imp#1374 (Qwen3-30B-A3B Q4_K_M, LRU, 256 cold decode tokens): 24/73/146/244 slots/layer -> "
               "36.6/74.1/89.4/96.2% hits. A slot there holds one projection (gate, up or down) of one expert "
               "(imp#1375: 'n_layers x kExpertProjCount x top_k'; 3 x top_k = 24 slots 'barely holds a single "
               "token'), so experts resident per layer = slots / 3, rounded: 8/24/49/81 of 128",
        cite="kekzl/imp#1374",
        checks=(("lru", 51, 90.0, 95.0),),  # issue 11: "LRU over 40% of experts resident: 90-95%"
    ),
    "gemma4-26b-a4b": RoutingFit(
        name="Gemma-4-26B-A4B", zipf=0.5, cutoff=0.27, reuse=0.06, n_experts=128, top_k=8, n_layers=30,
        targets=((64, 89.0), (32, 67.0), (16, 45.0)),
        source="issue 11's figures for Gemma-4-26B-A4B with LRU: 50/25/12.5% of the 128 experts resident -> "
               "89/67/45% hits (their source and protocol were not found in a public search; read as experts "
               "resident per layer and the same protocol as Qwen3-30B-A3B's)",
        cite="figures of issue 11, source not found",
        checks=(("belady-lfu", 16, 8.0, 11.0),),  # issue 11: "Belady 8-11 points above LFU at 16 slots"
    ),
}

#: The fit ``bench --routing calibrated`` uses for a model of GGUF architecture ``arch``: Gemma-4's for gemma4,
#: Qwen3-30B-A3B's for every other one.
DEFAULT_FIT = "qwen3-30b-a3b"
ARCH_FITS = {"gemma4": "gemma4-26b-a4b"}


def fit_for(arch: str) -> str:
    """The name in FITS that ``bench --routing calibrated`` uses for GGUF architecture ``arch``."""
    return ARCH_FITS.get(arch, DEFAULT_FIT)


class SyntheticRouting:
    """Expert choices per (layer, token): see the module docstring.

    n_experts, top_k: the model's. zipf >= 0, cutoff > 0, 0 <= reuse <= 1: the parameters. seed: the sequence.
    Call it as ``MoE.routing``: ``routing(layer, ids)`` with ids [tokens, top_k] int64 returns the next tokens'
    choices of that layer as a tensor of the same shape, dtype and device.
    """

    def __init__(self, n_experts: int, top_k: int, zipf: float, cutoff: float, reuse: float, seed: int = 0):
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be within 1..n_experts ({n_experts})")
        if zipf < 0 or cutoff <= 0 or not 0 <= reuse <= 1:
            raise ValueError(f"zipf {zipf} must be >= 0, cutoff {cutoff} > 0 and reuse {reuse} within 0..1")
        self.n_experts, self.top_k, self.seed = n_experts, top_k, seed
        self.zipf, self.cutoff, self.reuse = zipf, cutoff, reuse
        rank = np.arange(n_experts, dtype=np.float64)
        w = (rank + 1) ** -zipf * np.exp(-rank / (cutoff * n_experts))
        self._cdf_w = np.cumsum(w / w.sum()).tolist()  # over popularity ranks
        #: layer -> (its generator, expert of each popularity rank, the previous token's experts)
        self._state: dict[int, tuple[np.random.Generator, list[int], list[int]]] = {}

    @classmethod
    def fitted(cls, n_experts: int, top_k: int, fit: str = DEFAULT_FIT, seed: int = 0) -> SyntheticRouting:
        """The generator with :data:`FITS` ``[fit]``'s parameters for a model of this shape."""
        f = FITS[fit]
        return cls(n_experts, top_k, f.zipf, f.cutoff, f.reuse, seed)

    def _layer(self, layer: int) -> tuple[np.random.Generator, list[int], list[int]]:
        st = self._state.get(layer)
        if st is None:
            rng = np.random.default_rng([self.seed, layer])
            st = self._state[layer] = (rng, rng.permutation(self.n_experts).tolist(), [])
        return st

    def tokens(self, layer: int, n: int) -> np.ndarray:
        """The next ``n`` tokens' experts of ``layer``: int64 [n, top_k], distinct real ids in each row."""
        rng, expert_of_rank, prev = self._layer(layer)
        k, reuse, cdf = self.top_k, self.reuse, self._cdf_w
        out = np.empty((n, k), dtype=np.int64)
        last = len(cdf) - 1
        for t in range(n):
            chosen: list[int] = []
            u = rng.random(2 * k).tolist()
            for j in range(k):
                left = [e for e in prev if e not in chosen] if prev else ()
                if left and u[2 * j] < reuse:
                    e = left[min(int(u[2 * j + 1] * len(left)), len(left) - 1)]
                else:
                    x = u[2 * j + 1]
                    for _ in range(64):  # rejection: a draw already chosen is drawn again
                        e = expert_of_rank[min(bisect.bisect_right(cdf, x), last)]
                        if e not in chosen:
                            break
                        x = rng.random()
                    else:  # pathological skew: the most popular expert not chosen yet
                        e = next(expert_of_rank[r] for r in range(len(cdf)) if expert_of_rank[r] not in chosen)
                chosen.append(e)
            out[t] = chosen
            prev = chosen
        self._state[layer] = (rng, expert_of_rank, prev)
        return out

    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids: [tokens, top_k] int64 (the router's; only the shape is used) -> this generator's, same shape."""
        n, k = ids.shape
        if k != self.top_k:
            raise ValueError(f"layer {layer}: the router gives top-{k}, the generator top-{self.top_k}")
        return torch.from_numpy(self.tokens(layer, n)).to(ids.device)


def decode_requests(gen: SyntheticRouting, n_layers: int, n_tokens: int = N_TOKENS) -> list[Request]:
    """The slot requests of ``n_tokens`` decode steps through ``n_layers`` MoE layers (0..n_layers-1), token by
    token, as a StreamingStore records them: (layer, sorted experts, no pins)."""
    per_layer = [gen.tokens(layer, n_tokens) for layer in range(n_layers)]
    return [(layer, tuple(sorted(per_layer[layer][t].tolist())), ()) for t in range(n_tokens)
            for layer in range(n_layers)]


def lru_curve(zipf: float, cutoff: float, reuse: float, n_experts: int, top_k: int, resident: Sequence[int],
              n_layers: int = 48, n_tokens: int = N_TOKENS, seed: int = 0, policy: str = "lru") -> list[float]:
    """Hit rates in % of ``policy`` (default LRU) at each count of ``resident`` experts per layer, over the
    generator's requests under the calibration protocol (empty pools, ``n_tokens`` decode tokens, all counted)."""
    reqs = decode_requests(SyntheticRouting(n_experts, top_k, zipf, cutoff, reuse, seed), n_layers, n_tokens)
    return [100 * simulate(reqs, policy, r).hit_rate for r in resident]


def calibration_summary(n_experts: int, top_k: int, fit: str = DEFAULT_FIT, n_layers: int = 16) -> dict:
    """What ``bench --routing calibrated`` reports: the fit, its published targets, the generator's LRU hit rates
    at the targets' resident counts (scaled to ``n_experts`` for another shape; ``n_layers`` layers simulated) and
    a one-line ``summary``."""
    f = FITS[fit]
    resident = [max(top_k, min(n_experts, round(r * n_experts / f.n_experts))) for r, _ in f.targets]
    got = lru_curve(f.zipf, f.cutoff, f.reuse, n_experts, top_k, resident, n_layers=n_layers)
    same = (n_experts, top_k) == (f.n_experts, f.top_k)
    pairs = ", ".join(f"{r}: {g:.1f}% (published {t:.1f}%{'' if same else f' at {p} of {f.n_experts}'})"
                      for r, g, (p, t) in zip(resident, got, f.targets, strict=True))
    line = (f"routing: synthetic, calibrated to {f.name} ({f.cite}; zipf {f.zipf}, cutoff {f.cutoff}, reuse "
            f"{f.reuse}); LRU hit rates, experts resident/layer of {n_experts}, top-{top_k}: {pairs}")
    return {"fit": fit, "model": f.name, "zipf": f.zipf, "cutoff": f.cutoff, "reuse": f.reuse, "source": f.source,
            "n_experts": n_experts, "top_k": top_k, "resident": resident, "lru_hit_rate_pct": got,
            "published_pct": [t for _, t in f.targets], "summary": line}
