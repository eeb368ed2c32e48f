#!/usr/bin/env python3
"""Real-tool fixtures shaped like the published checkpoints: every config value that is not a size is the
published model's; only layers, widths and expert counts are cut.

The tiny fixtures of ``fixtures.py``, ``fixtures_gemma4.py`` and ``fixtures_qwen35moe.py`` have a vocabulary
exactly as long as their tokenizer and test-friendly settings (a sliding window of 8, 4k context). Real
downloads do not look like that: their ``vocab_size`` is padded past the tokenizer (llama.cpp's converter fills
``tokenizer.ggml.tokens`` with ``[PADn]`` UNUSED entries), their tokenizers carry entries that collide after
conversion, and their context lengths, RoPE bases, window sizes and chat templates are the published ones.
These fixtures go through the same pipeline (transformers checkpoint with random weights -> llama.cpp's
converter) with those values:

* ``qwen3moe-published`` -- Qwen3-30B-A3B's ``config.json`` (values below, cited per field) with the real
  Qwen2-family vocabulary llama.cpp ships for its tokenizer tests (``models/ggml-vocab-qwen2.gguf`` in the pinned
  llama-cpp-python sdist: 151,643 BPE tokens, 151,387 merges, ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>``) and Qwen3's chat template (``models/templates/Qwen-Qwen3-0.6B.jinja``, the template of the
  whole Qwen3 family). ``vocab_size`` 151,936: the converter pads 290 UNUSED ``[PADn]`` entries.
* ``qwen3moe-collide`` -- the tokenizer a user gets by loading a GGUF tokenizer with transformers and saving it
  (``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` on the DeepSeek-R1-Distill-Qwen header, then
  ``save_pretrained``: 152,067 entries, two CONTROL tokens whose raw text is also in the vocabulary in byte-level
  spelling), plus an added token " Hello" whose byte-level spelling is a NORMAL entry. ``vocab_size`` 152,128
  (60 UNUSED pads). This file reproduced "the converted tokenizer has 152126 ids for the file's 152128 tokens".
* ``qwen35moe-published`` -- Qwen3.5-35B-A3B's text config (``vocab_size`` 248,320 over the 151,646-entry Qwen2
  vocabulary: 96,674 pads, rope_theta 1e7, partial rotary 0.25 with MRoPE sections [11, 11, 10] of a 256 head
  dim, 262,144 context) with Qwen 3.5's chat template (``models/templates/Qwen3.5-4B.jinja``).
* ``gemma4-published`` -- gemma-4-26B-A4B's text config (the values its GGUF metadata carries in llama.cpp's
  ``models/ggml-vocab-gemma-4.gguf``: 5 sliding layers to 1 global, window 1024, head dims 256 / 512, K = V on
  global layers, RoPE bases 1e4 / 1e6 with partial rotary 0.25, softcap 30, 262,144 context, no shared-KV
  layers, no per-layer inputs, tied embeddings) with the real Gemma 4 tokenizer and chat template from that
  file.

Initializer ranges are not the published 0.02 (that is an init setting, not a property of the trained model):
random weights at 0.02 give near-flat logits and greedy continuations stuck on one token, so the oracle tests
would compare nothing.

Use: ``build("qwen3moe-published")`` or ``python tools/fixtures_published.py [NAME...] [--force]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402 - tools/ is not a package
import fixtures_gemma4  # noqa: E402
import fixtures_qwen35moe  # noqa: E402
import llamacpp  # noqa: E402

FixtureError = fixtures.FixtureError

# ---------------------------------------------------------------------------------------------------------
# Inputs from the pinned llama-cpp-python sdist (llama.cpp's own tokenizer test vocabularies and templates)
# ---------------------------------------------------------------------------------------------------------

sdist, sdist_member = llamacpp.sdist, llamacpp.sdist_member


# ---------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------

QWEN2_VOCAB = "models/ggml-vocab-qwen2.gguf"
GEMMA4_VOCAB = "models/ggml-vocab-gemma-4.gguf"
QWEN3_TEMPLATE = "models/templates/Qwen-Qwen3-0.6B.jinja"
QWEN35_TEMPLATE = "models/templates/Qwen3.5-4B.jinja"

#: Added token of ``qwen2-collide`` beyond what transformers' GGUF loading makes: " Hello", whose byte-level
#: spelling "ĠHello" is a NORMAL vocabulary entry, so the two ids' texts collide once transformers respells
#: the added token. (The same text at two ids in the file itself is not loadable: llama.cpp asserts
#: ``id_to_token.size() == token_to_id.size()``; the converter writes it for a tokenizer that marks an existing
#: vocabulary entry added, e.g. "ĠHello", next to " Hello".)
COLLIDE_ADDED = " Hello"


def _tok_key(name: str, **extra: Any) -> str:
    return fixtures._sha({"name": name, "src": fixtures._source_hash(__file__), "versions": fixtures._versions(),
                          "sdist": llamacpp.SDIST_SHA256, **extra})[:16]


def _tokenizer_dir(name: str, header: bytes, write: Any, *, force: bool = False) -> Path:
    """``$MOESTREAM_CACHE/tokenizers/<name>-<key>`` with ``header.gguf`` (the metadata-only GGUF the tokenizer
    comes from) and what ``write(header_path, dir)`` makes of it."""
    root = fixtures.cache_root() / "tokenizers"
    final = root / f"{name}-{_tok_key(name)}"
    if not force and (final / "tokenizer.json").exists():
        return final
    with fixtures._build_lock():
        if not force and (final / "tokenizer.json").exists():
            return final
        t0 = time.monotonic()
        fixtures._prune(root, name)
        with fixtures._staging(final) as tmp:
            (tmp / "header.gguf").write_bytes(header)
            write(tmp / "header.gguf", tmp)
        fixtures._prune(root, name, final)
        fixtures.log(f"{name} tokenizer: ready in {time.monotonic() - t0:.1f}s ({final})")
        return final


def _qwen2_published(header: Path, out: Path, template: str) -> None:
    """llama.cpp's Qwen2 vocabulary as a transformers ``Qwen2Tokenizer``: its 151,646 real entries (the file's
    290 ``[PADn]`` fillers are left out, as Qwen's own ``tokenizer.json`` has none), the chat template
    ``template`` (a path inside the sdist's ``vendor/llama.cpp``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    field = fixtures.gguf_fields(header, "qwen2 vocabulary")
    tokens, types, merges = (field(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges"))
    control = 3
    n_used = next(i for i, t in enumerate(tokens) if t.startswith("[PAD"))
    vocab = {t: i for i, t in enumerate(tokens[:n_used]) if types[i] != control}
    special = {"bos": None, "eos": "<|im_end|>", "padding": "<|endoftext|>"}  # Qwen3's tokenizer_config.json
    # special tokens are named in tokenizer_config.json only: given here, they would be added out of id order
    tok = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], unk_token=None,
                         bos_token=None, eos_token=None, pad_token=None)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens[:n_used])
                    if types[i] == control], special_tokens=True)
    if len(tok) != n_used or any(tok.convert_tokens_to_ids(tokens[i]) != i for i in range(n_used)):
        raise FixtureError("qwen2 vocabulary: transformers did not keep the file's ids")
    tok.backend_tokenizer.post_processor = None
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_eos_token": False,
        "add_prefix_space": False, "bos_token": None, "eos_token": special["eos"], "pad_token": special["padding"],
        "unk_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "chat_template": sdist_member(template).decode(),
    }
    ids = {"bos": tok.convert_tokens_to_ids("<|endoftext|>"), "eos": tok.convert_tokens_to_ids("<|im_end|>"),
           "padding": tok.convert_tokens_to_ids("<|endoftext|>"), "n_used_tokens": n_used}
    fixtures.save_tokenizer(out, tok, config, ids)


def qwen2_published_tokenizer(*, template: str = QWEN3_TEMPLATE, force: bool = False) -> Path:
    """Tokenizer directory for the Qwen fixtures: llama.cpp's Qwen2 vocabulary with the chat template ``template``
    (a path inside the sdist's ``vendor/llama.cpp``)."""
    name = "qwen2-published" if template == QWEN3_TEMPLATE else "qwen2-published-" + Path(template).stem.lower()
    return _tokenizer_dir(name, sdist_member(QWEN2_VOCAB), lambda h, o: _qwen2_published(h, o, template),
                          force=force)


def _qwen2_collide(header: Path, out: Path) -> None:
    """transformers' GGUF tokenizer loading of the DeepSeek-R1-Distill-Qwen header, saved with ``save_pretrained``
    (what a user who makes a tokenizer that way gets), plus :data:`COLLIDE_ADDED`. No BOS post-processor and
    ``add_bos_token`` false, as Qwen's (the converter recognises the ``qwen2`` pre-tokenizer only then)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(header.parent), gguf_file=header.name)
    tok.add_tokens([AddedToken(COLLIDE_ADDED, normalized=False)])
    tok.backend_tokenizer.post_processor = None
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        cfg = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
        cfg.update(add_bos_token=False, add_eos_token=False, chat_template=tok.chat_template)  # transformers 5
        # saves the template as chat_template.jinja, which the converter does not read
        tok_json = (Path(tmp) / "tokenizer.json").read_text()
    (out / "tokenizer.json").write_text(tok_json)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    field = fixtures.gguf_fields(header, "tokenizer header")
    (out / "tokenizer_meta.json").write_text(json.dumps({**fixtures.special_token_ids(field),
                                                         "n_used_tokens": len(tok)}) + "\n")


def qwen2_collide_tokenizer(*, force: bool = False) -> Path:
    """Tokenizer directory of ``qwen3moe-collide`` (see :func:`_qwen2_collide`)."""
    wheel = fixtures.download_wheel(fixtures.TOKENIZER_WHEEL, fixtures.tools_venv(), "tokenizer", "~95 MB")
    return _tokenizer_dir("qwen2-collide", fixtures.wheel_gguf_header(wheel), _qwen2_collide, force=force)


def gemma4_published_tokenizer(*, force: bool = False) -> Path:
    """Tokenizer directory of ``gemma4-published``: the Gemma 4 vocabulary and chat template from llama.cpp's
    ``ggml-vocab-gemma-4.gguf``, written the way ``fixtures_gemma4`` writes Gemma's."""

    def write(header: Path, out: Path) -> None:
        fixtures_gemma4.write_gemma_tokenizer(header, out, {"model": "gemma4", "n_tokens": 262144})
        field = fixtures.gguf_fields(header, "gemma4 vocabulary")
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = field("tokenizer.chat_template")
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    return _tokenizer_dir("gemma4-published", sdist_member(GEMMA4_VOCAB), write, force=force)


# ---------------------------------------------------------------------------------------------------------
# Model specs: published values, sizes cut
# ---------------------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B ``config.json``: vocab_size 151936, rope_theta 1000000, max_position_embeddings 40960,
#: rms_norm_eps 1e-6, norm_topk_prob true, tie_word_embeddings false, head_dim 128, 32 heads / 4 KV heads
#: (GQA 8:1), 128 experts top-8, decoder_sparse_step 1, no mlp_only_layers. Cut: 4 layers, hidden 256,
#: 8 heads / 1 KV head (8:1 kept), 32 experts (top-8 kept), expert FFN 256 (K-quant-able), dense FFN 1024.
QWEN3MOE = fixtures.ModelSpec(
    hidden_size=256, num_hidden_layers=4, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=256,
    intermediate_size=1024, num_attention_heads=8, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False,
    initializer_range=0.1, seed=3, outtypes=("f32",), rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=40960, norm_topk_prob=True, vocab_size=151936,
)

#: The issue's reproduction: the transformers-saved tokenizer (152,067 entries) under vocab_size 152,128.
QWEN3MOE_COLLIDE = dataclasses.replace(QWEN3MOE, vocab_size=152128, seed=4)

#: Qwen3.5-35B-A3B text config: vocab_size 248320, rope_theta 1e7, partial_rotary_factor 0.25, mrope_section
#: [11, 11, 10] (interleaved) of head_dim 256, max_position_embeddings 262144, rms_norm_eps 1e-6,
#: full_attention_interval 4, 16 heads / 2 KV heads, linear attention 16 key / 32 value heads of 128,
#: conv kernel 4, 256 experts top-8, tie_word_embeddings false. Cut: 4 layers, hidden 256, 8 / 1 heads (8:1
#: kept), linear 2 key / 4 value heads (1:2 kept), 32 experts (top-8 kept), expert and shared FFN 256.
QWEN35MOE = fixtures_qwen35moe.Qwen35MoeSpec(
    hidden_size=256, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=8, num_key_value_heads=1,
    head_dim=256, partial_rotary_factor=0.25, mrope_section=(11, 11, 10), linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=32, num_experts_per_tok=8, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    initializer_range=0.07, seed=5, outtypes=("f32",), rope_theta=1e7, rms_norm_eps=1e-6,
    max_position_embeddings=262144, tie_word_embeddings=False, vocab_size=248320,
)

#: gemma-4-26B-A4B (its GGUF metadata in llama.cpp's ggml-vocab-gemma-4.gguf): sliding_window 1024, pattern 5
#: sliding : 1 global, head dims 256 (sliding) / 512 (global), 8 / 2 KV heads, K = V on global layers, rope
#: bases 1e4 / 1e6, partial rotary 0.25 on global layers (proportional), final_logit_softcapping 30,
#: context 262144, shared_kv_layers 0, embedding_length_per_layer_input 0, 128 experts top-8, tied
#: embeddings, rms eps 1e-6. Cut: 6 layers (one period of the pattern), hidden 256, 4 heads, 2 / 1 KV heads,
#: 32 experts (top-8 kept), expert FFN 256, dense FFN 512.
GEMMA4 = fixtures_gemma4.Gemma4Spec(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=32, top_k_experts=8,
    num_hidden_layers=6, layer_types=("sliding_attention",) * 5 + ("full_attention",), num_attention_heads=4,
    num_key_value_heads=2, head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=1024, num_kv_shared_layers=0, use_double_wide_mlp=False, hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0, rope_local_theta=10000.0, rope_global_theta=1e6, partial_rotary_factor=0.25,
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True, initializer_range=0.05, seed=6,
    outtypes=("f32",), vocab_size=262144,
)

#: name -> (spec, tokenizer builder, checkpoint writer, converter venv, converter arguments)
FIXTURES: dict[str, tuple[Any, Any, Any, Any, tuple[str, ...]]] = {
    "qwen3moe-published": (QWEN3MOE, qwen2_published_tokenizer, fixtures._write_checkpoint, fixtures.tools_venv, ()),
    "qwen3moe-collide": (QWEN3MOE_COLLIDE, qwen2_collide_tokenizer, fixtures._write_checkpoint, fixtures.tools_venv,
                         ()),
    "qwen35moe-published": (QWEN35MOE, lambda: qwen2_published_tokenizer(template=QWEN35_TEMPLATE),
                            fixtures_qwen35moe._write_checkpoint, fixtures.tools_venv, fixtures_qwen35moe.CONVERT_ARGS),
    "gemma4-published": (GEMMA4, gemma4_published_tokenizer, fixtures_gemma4.write_checkpoint,
                         fixtures_gemma4.converter_venv, ()),
}


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config",
    "f32"}`` (paths; ``config`` the spec as a dict). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec, tokenizer, write, venv, args = FIXTURES[name]
    key = fixtures.model_key(name, spec, module=__file__, tokenizer=_tok_key(name), convert_args=args,
                             family_src=[fixtures._source_hash(fixtures_gemma4.__file__),
                                         fixtures._source_hash(fixtures_qwen35moe.__file__)])
    return fixtures.build_model(name, spec, force=force, key=key, venv=venv, tokenizer=tokenizer,
                                write_checkpoint=write, convert_args=args,
                                manifest={"converter": fixtures.CONVERTER_REQUIREMENTS[0], "sdist": sdist().name})


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
