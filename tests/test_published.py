"""Files shaped like the published checkpoints people download (``tools/fixtures_published.py``).

Each fixture is a transformers checkpoint with random weights whose config carries the published model's values
for everything that is not a size (vocab_size and its padding, RoPE, context length, window and layer pattern,
tying, softcapping, the chat template), converted by llama.cpp's converter:

* ``qwen3moe-published`` (Qwen3-30B-A3B's values, llama.cpp's Qwen2 vocabulary padded to 151,936 with UNUSED
  ``[PADn]`` entries, Qwen3's chat template);
* ``qwen3moe-collide`` (the tokenizer a user gets from transformers' GGUF loading + ``save_pretrained``:
  NORMAL and CONTROL / USER_DEFINED spellings of one text, 60 pads; the file that moestream used to
  refuse with "the converted tokenizer has 152126 ids for the file's 152128 tokens");
* ``qwen35moe-published`` (Qwen3.5-35B-A3B's values: 248,320 ids over a 151,646-entry vocabulary);
* ``gemma4-published`` (gemma-4-26B-A4B's values with the real Gemma 4 tokenizer and chat template).

Oracles: llama.cpp on the same file for tokenization and for the detokenization of every id of the file;
transformers on the source checkpoint for the logits (within 1e-4, the project's float32 oracle bar, and 32
greedy tokens equal); streaming off for streaming on (``verify``, bitwise). The published chat templates are
checked against forged turns in tests/test_chat.py.
"""

from __future__ import annotations

import ctypes
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import gguf
import pytest

from conftest import load_tool
from helpers import hf_greedy, hf_logits, hf_model, load, moestream, ours_greedy, verify_identical
from moestream.tokenizer import GGUFTokenizer, TokenType
from test_tokenizer import FRAGMENTS, HARD_STRINGS, N_RANDOM, llama_decode

NAMES = ("qwen3moe-published", "qwen3moe-collide", "qwen35moe-published", "gemma4-published")
PROMPT = "The printing press spread across Europe within fifty years, and books became cheap."
N_GREEDY = 32
TOL = 1e-4

#: Special-token text of each family, glued into the random strings (so the raw-text matching is exercised).
SPECIAL_FRAGMENTS = {
    "qwen": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", " Hello", "Hello", "<｜User｜>",
             "<｜end▁of▁sentence｜>", "[PAD151700]", "<｜begin▁of▁sentence｜>"],
    "gemma": ["<|turn>", "<turn|>", "<bos>", "<eos>", "<|think|>", "<|channel>", "<|tool_call>", "<pad>", "<mask>"],
}


@pytest.fixture(scope="module", params=NAMES)
def pub(request: pytest.FixtureRequest) -> dict[str, Any]:
    """``{"name", "ckpt", "f32", "config", ...}`` of one published-shape fixture."""
    return load_tool("fixtures_published").build(request.param)


def _fields(path: Path) -> tuple[list[str], list[int]]:
    r = gguf.GGUFReader(path)
    return r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.token_type"].contents()


def _family(pub: dict[str, Any]) -> str:
    return "gemma" if pub["name"].startswith("gemma") else "qwen"


@pytest.fixture(scope="module")
def tok(pub: dict[str, Any]) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(str(pub["f32"]))


@pytest.fixture(scope="module")
def llm(llama_cpp: Any, pub: dict[str, Any]) -> Any:  # noqa: ANN401
    m = llama_cpp.Llama(model_path=str(pub["f32"]), vocab_only=True, verbose=False)
    yield m
    m.close()


# ------------------------------------------------------------------------------------------------ the files
def test_files_are_shaped_like_the_published_ones(pub: dict[str, Any]) -> None:
    """The guard: what the converter wrote carries the published values (a fixture that drifts fails here)."""
    r = gguf.GGUFReader(pub["f32"])
    arch = r.fields["general.architecture"].contents()
    meta = {k.removeprefix(f"{arch}."): f.contents() for k, f in r.fields.items()}
    tokens, types = _fields(pub["f32"])
    want = {
        "qwen3moe-published": dict(vocab=151936, ctx=40960, rope=1e6, pads=290),
        "qwen3moe-collide": dict(vocab=152128, ctx=40960, rope=1e6, pads=60),
        "qwen35moe-published": dict(vocab=248320, ctx=262144, rope=1e7, pads=248320 - 151646),
        "gemma4-published": dict(vocab=262144, ctx=262144, rope=1e6, pads=0),
    }[pub["name"]]
    assert len(tokens) == want["vocab"]
    assert meta["context_length"] == want["ctx"]
    assert meta["rope.freq_base"] == pytest.approx(want["rope"])
    assert sum(t == TokenType.UNUSED for t in types) == want["pads"]
    assert meta.get("tokenizer.chat_template")
    if arch == "gemma4":
        assert meta["attention.sliding_window"] == 1024 and meta["final_logit_softcapping"] == 30.0
        assert list(meta["attention.sliding_window_pattern"]) == [True] * 5 + [False]
        assert "<|turn>" in meta["tokenizer.chat_template"]
    elif pub["name"] == "qwen3moe-collide":  # the DeepSeek-R1-Distill-Qwen template the header came with
        assert "<｜Assistant｜>" in meta["tokenizer.chat_template"]
    else:
        assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_collide_file_has_both_kinds_of_collision() -> None:
    """The fixture really holds what the tokenizer must survive: NORMAL byte-level spellings of a CONTROL and
    a USER_DEFINED text, which transformers' GGUF conversion respells into one string, and UNUSED pads."""
    tokens, types = _fields(load_tool("fixtures_published").build("qwen3moe-collide")["f32"])
    by_text: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(tokens):
        by_text[t].append(i)
    assert by_text[" Hello"] == [152067] and types[152067] == TokenType.USER_DEFINED
    assert tokens[21927] == "\u0120Hello" and types[21927] == TokenType.NORMAL  # " Hello" in byte-level spelling
    assert types[151643] == TokenType.NORMAL and types[152066] == TokenType.CONTROL
    assert tokens[152066] == "<｜end▁of▁sentence｜>" and tokens[151643] == "<ï½ľendâĸģofâĸģsentenceï½ľ>"


# ------------------------------------------------------------------------------------------------ tokenizer
def _texts(family: str) -> list[str]:
    rng = random.Random(11)
    pool = FRAGMENTS + SPECIAL_FRAGMENTS[family]
    rand = ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 13))) for _ in range(N_RANDOM)]
    return HARD_STRINGS + SPECIAL_FRAGMENTS[family] + rand


@pytest.mark.llamacpp
def test_tokenization_matches_llama_cpp(pub: dict[str, Any], tok: GGUFTokenizer, llm: Any) -> None:  # noqa: ANN401
    """Hard strings, every family special text and 300 random strings, with special parsing on and off, and
    with the file's BOS: moestream's ids equal llama.cpp's (so pads and unreachable duplicates never come out
    of our tokenizer where they do not come out of llama.cpp's)."""
    bad = []
    for text in _texts(_family(pub)):
        for special in (True, False):
            ours = tok.encode(text, add_special=False, parse_special=special)
            theirs = list(llm.tokenize(text.encode(), add_bos=False, special=special))
            if ours != theirs:
                bad.append((text, special, ours, theirs))
        # with the file's BOS; moestream adds no second BOS to a text that starts with it (llama.cpp adds it
        # twice and warns: a documented difference)
        theirs = list(llm.tokenize(text.encode(), add_bos=tok.add_bos, special=True))
        if tok.add_bos and theirs[1:2] == [tok.bos_id]:
            theirs = theirs[1:]
        if tok.encode(text) != theirs:
            bad.append((text, "bos"))
    assert not bad, f"{len(bad)} differ; first: {bad[:3]}"
    unused = {i for i, t in enumerate(tok.token_types) if t == TokenType.UNUSED}
    produced = {i for text in _texts(_family(pub)) for i in tok.encode(text)}
    assert not produced & unused


@pytest.mark.llamacpp
def test_every_id_detokenizes_like_llama_cpp(pub: dict[str, Any], tok: GGUFTokenizer, llm: Any) -> None:  # noqa: ANN401
    """Each id of the file (pads, CONTROL, USER_DEFINED, byte tokens, ids whose text collides after transformers'
    conversion), with and without control text: the bytes moestream prints for it equal llama.cpp's
    ``llama_token_to_piece``; ``decode`` of random sequences equals ``llama_detokenize``; the end-of-generation
    ids are llama.cpp's."""
    import llama_cpp

    vocab = llm._model.vocab
    buf = ctypes.create_string_buffer(4096)
    bad = []
    for i in range(tok.vocab_size):
        for skip in (False, True):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, not skip)
            assert n >= 0, f"id {i}: token longer than the buffer"
            if tok.token_bytes(i, skip_special=skip) != buf.raw[:n]:
                bad.append((i, skip, tok.token_bytes(i, skip_special=skip), buf.raw[:n]))
    assert not bad, f"{len(bad)} ids differ; first: {bad[:5]}"
    # and the same tokens end generation (llama.cpp promotes some by name: Qwen's NORMAL "</s>", Gemma 4's
    # USER_DEFINED "<|tool_response>")
    assert tok.eos_ids == {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    rng = random.Random(5)
    punct = [i for i in range(tok.vocab_size) if tok.token_bytes(i).strip() in (b".", b",", b"'s", b"'", b"?")]
    for _ in range(300):  # and whole sequences (llama.cpp's leading-space strip and space clean-up)
        ids = [rng.choice(punct) if rng.random() < 0.3 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 16))]
        theirs = llama_decode(llm, ids)
        try:
            text = theirs.decode()
        except UnicodeDecodeError:
            continue
        assert tok.decode(ids) == text, ids


# ------------------------------------------------------------------------------------------------ the model
@pytest.fixture(scope="module")
def hf(pub: dict[str, Any]) -> Any:  # noqa: ANN401
    """transformers on the checkpoint, in float64 (helpers.hf_model)."""
    return hf_model(pub["ckpt"])


@pytest.mark.slow
def test_logits_match_transformers(pub: dict[str, Any], tok: GGUFTokenizer, hf: Any) -> None:  # noqa: ANN401
    """F32 file vs transformers on the source checkpoint: every prompt position within 1e-4, 32 greedy tokens
    equal, streaming through top-k slots (slot ids differ from expert ids)."""
    ids = tok.encode(PROMPT)
    ref = hf_logits(hf, ids)
    ref_tokens = hf_greedy(hf, ids, N_GREEDY)
    model = load(pub["f32"], stream=True, slots=None)
    try:
        got, toks = ours_greedy(model, ids, N_GREEDY)
    finally:
        model.store.close()
    assert got.shape == ref.shape  # padded vocabulary included
    diff = (got - ref).abs().max().item()
    print(f"{pub['name']} vs transformers: max |logit diff| {diff:.3g} over {len(ids)} positions")
    assert diff < TOL
    assert toks == ref_tokens
    assert len(set(toks)) > N_GREEDY // 4, "the fixture's greedy continuation should be varied"


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["top_k", "half"])
def test_verify_bitwise(pub: dict[str, Any], tok: GGUFTokenizer, pool: str) -> None:
    model = load(pub["f32"], stream=False)
    try:
        verify_identical(model, tok.encode(PROMPT), 8, pool, label=f"{pub['name']} {pool}: ")
    finally:
        model.store.close()


@pytest.mark.slow
def test_run_chat_command(pub: dict[str, Any]) -> None:
    p = moestream("run", "-m", str(pub["f32"]), "--chat", "-p", "Hi!", "-n", "6", "--temp", "0", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "streaming:" in p.stderr and "decode" in p.stderr.splitlines()[-1]
