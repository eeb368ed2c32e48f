"""Sigmoid routing with a selection bias and group-limited expert choice (GLM-4.5 MoE; DeepSeek-V3's ``noaux_tc``).

``layers.softmax_topk`` is the softmax router the other families share; this is the other kind.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..ops import elementwise

#: llama.cpp's floor for the sum the top-k weights are divided by (the smallest normal float16)
WEIGHT_SUM_FLOOR = 6.103515625e-5


def sigmoid_group_topk(router_logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None,
                       n_group: int = 1, topk_group: int = 1, norm: bool = True,
                       scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits float32 [T, n_experts] -> (ids int64 [T, top_k], weights float32 [T, top_k]).

    1. scores = sigmoid(logits).
    2. Choice scores = scores + ``bias`` ([n_experts], the per-expert score correction), or the scores alone.
       The bias only decides WHICH experts are chosen; the weights are taken from the unbiased scores.
    3. With ``n_group`` > 1: the experts are ``n_group`` consecutive groups of ``n_experts / n_group``; a group's
       score is the sum of its two best choice scores; only the experts of the ``topk_group`` best groups can be
       chosen (the others' choice scores become -inf).
    4. ids = the ``top_k`` best choice scores (best first); weights = their sigmoid scores.
    5. ``norm``: weights divided by their sum (floored at :data:`WEIGHT_SUM_FLOOR`, as llama.cpp does).
    6. weights multiplied by ``scale`` (``routed_scaling_factor``; 1.0: left as they are).

    The caller checks that ``n_group`` divides n_experts into groups of at least two and that
    ``topk_group`` <= ``n_group``. Ids are real expert ids. On the CPU the step kernels' router (kernels.route),
    elsewhere torch's ops.
    """
    if router_logits.device.type == "cpu" and (lib := kernels.step_ops()) is not None:
        return kernels.route(router_logits, top_k, kernels.GATING_SIGMOID, bias, n_group, topk_group, norm,
                             WEIGHT_SUM_FLOOR, scale, lib=lib)
    return group_topk(elementwise(torch.sigmoid, router_logits), top_k, bias=bias, n_group=n_group,
                      topk_group=topk_group, norm=norm, scale=scale)


def group_topk(scores: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None, n_group: int = 1,
               topk_group: int = 1, norm: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-6 of :func:`sigmoid_group_topk` on gating scores float32 [T, n_experts] that are already computed
    (sigmoid, or softmax: llama.cpp's build_moe_ffn applies the same bias, group choice, renormalization and
    scale whatever the gating function) -> (ids int64 [T, top_k], weights float32 [T, top_k])."""
    if scores.device.type == "cpu" and (lib := kernels.step_ops()) is not None:
        return kernels.route(scores, top_k, kernels.GATING_SCORES, bias, n_group, topk_group, norm, WEIGHT_SUM_FLOOR,
                             scale, lib=lib)
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        n_tok, n_exp = choice.shape
        groups = choice.view(n_tok, n_group, n_exp // n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(n_tok, n_exp)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(WEIGHT_SUM_FLOOR)
    if scale != 1.0:
        w = w * scale
    return ids, w
