"""RoPE pieces against transformers: YaRN's inverse frequencies and attention factor
(``modeling_rope_utils._compute_yarn_parameters``) and the rotary tables of a model that uses them (computed in
float64 and rounded to float32), bitwise; the RoPE-scaling metadata reader's defaults and refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

from helpers import float64_inside
from moestream.models.layers import Rope, yarn_attention_factor, yarn_inv_freq

# (rope_theta, head_dim, rope_parameters): gpt-oss-20b's (truncated: the only form a GGUF carries), DeepSeek-V3's,
# and one whose correction range collapses to a single pair (the 0.001 guard)
CASES = [
    (150000.0, 64, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}),
    (10000.0, 64, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    (10000.0, 128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (1e6, 8, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
              "beta_fast": 4.0, "beta_slow": 4.0}),
]


def _config(theta: float, head_dim: int, params: dict) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                          max_position_embeddings=131072, rope_parameters={"rope_theta": theta, **params})


@pytest.mark.parametrize("theta,head_dim,params", CASES)
def test_yarn_matches_transformers(theta: float, head_dim: int, params: dict) -> None:
    cfg = _config(theta, head_dim, params)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = yarn_inv_freq(theta, head_dim, params["factor"], params["original_max_position_embeddings"],
                        params.get("beta_fast", 32.0), params.get("beta_slow", 1.0))
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    assert torch.equal(got, want_inv)
    factor = yarn_attention_factor(params["factor"], params.get("mscale", 0.0), params.get("mscale_all_dim", 0.0))
    assert factor == want_factor
    # the interpolated and extrapolated ends both occur (the ramp is not degenerate)
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert torch.equal(got[0], plain[0]) and not torch.equal(got[-1], plain[-1])


@pytest.mark.parametrize("theta,head_dim,params", CASES[:2])
def test_yarn_tables_match_transformers_rotary(theta: float, head_dim: int, params: dict) -> None:
    """cos/sin with the attention factor applied (Rope(scale=)) equal transformers' rotary embedding run in float64
    (helpers.float64_inside: the angles, cos, sin and the factor in float64), rounded to float32, bitwise; and
    differ from its float32 run (the angles rounded to float32) at some positions."""
    cfg = _config(theta, head_dim, params)
    rot = Qwen3MoeRotaryEmbedding(cfg)
    n_pos = 300
    pos = torch.arange(n_pos)[None]
    with float64_inside({sys.modules[type(rot).__module__]}):
        cos64, sin64 = rot(torch.zeros(1, n_pos, head_dim, dtype=torch.float64), pos)
    assert cos64.dtype == torch.float64
    cos, sin = cos64.float(), sin64.float()
    assert not torch.equal(cos, rot(torch.zeros(1, n_pos, head_dim), pos)[0])
    inv = yarn_inv_freq(theta, head_dim, params["factor"], params["original_max_position_embeddings"],
                        params.get("beta_fast", 32.0), params.get("beta_slow", 1.0))
    rope = Rope(inv, scale=yarn_attention_factor(params["factor"], params.get("mscale", 0.0),
                                                 params.get("mscale_all_dim", 0.0)))
    rope.reserve(n_pos)
    assert torch.equal(rope.cos[:n_pos], cos[0])
    half = head_dim // 2
    assert torch.equal(rope.sin[:n_pos, half:], sin[0, :, half:])
    assert torch.equal(rope.sin[:n_pos, :half], -sin[0, :, :half])


def test_rope_scale_one_is_unscaled() -> None:
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    a, b = Rope(inv), Rope(inv, scale=1.0)
    a.reserve(100)
    b.reserve(100)
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


def test_yarn_bad_arguments() -> None:
    with pytest.raises(ValueError, match="factor"):
        yarn_inv_freq(10000.0, 64, 0.5, 4096)
    with pytest.raises(ValueError, match="even"):
        yarn_inv_freq(10000.0, 63, 2.0, 4096)
