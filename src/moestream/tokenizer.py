"""Tokenizer and chat template from a GGUF file's own metadata.

A GGUF file carries its tokenizer as metadata under llama.cpp's key names (``tokenizer.ggml.model``,
``.tokens``, ``.token_type``, ``.merges`` / ``.scores``, the special token ids, ``add_bos_token``)
and its chat template as a Jinja string (``tokenizer.chat_template``). This module builds a
Hugging Face ``tokenizers.Tokenizer`` from those fields with transformers' own GGUF conversion
(:func:`transformers.integrations.gguf.convert_gguf_tokenizer`, the function behind
``AutoTokenizer.from_pretrained(..., gguf_file=...)``), and renders the chat template with a sandboxed
Jinja environment set up the way transformers sets up its own.

Supported ``tokenizer.ggml.model`` values: ``gpt2`` (byte-level BPE: Qwen, DeepSeek, Llama 3, ...) and
``llama`` / ``gemma4`` (SentencePiece-style BPE with byte fallback: Llama 2, Mistral, Gemma).

Where this differs from transformers' GGUF tokenizer, on purpose:

* Every id of ``tokenizer.ggml.tokens`` is an id, as llama.cpp reads the file: a byte-level vocabulary is
  rebuilt from the token list as written (transformers respells control / user-defined tokens outside the
  byte alphabet, DeepSeek's ``<｜User｜>``, and collapses ids whose respelled text collides with a NORMAL
  entry, which a tokenizer saved from transformers' own GGUF loading has); ``[PADn]`` fill of any length
  stays; tokens transformers' builder invents (GPT-2's ``<|endoftext|>``) are dropped.
* Token types follow llama.cpp's load-time rules by name (:func:`_llama_types`): end-of-generation and
  fill-in-the-middle names become CONTROL, and the same ids end generation as in llama.cpp.
* Pieces and whole-text decoding are llama.cpp's (``token_to_piece``, ``llama_detokenize`` with its space
  clean-up where the pre-tokenizer uses it).
* A ``llama`` (SentencePiece) file with ``tokenizer.ggml.add_space_prefix = false`` gets no dummy
  prefix space (transformers' LlamaTokenizer always adds one; Gemma's builder never does).
* ``tokenizer.ggml.add_bos_token`` is followed as written (transformers forces it off for ``gemma4``),
  and ``add_special=True`` adds no second BOS when the text already starts with the BOS token (a chat
  template that writes ``{{ bos_token }}`` itself); llama.cpp adds it twice and warns.

Measured on a 2-core machine: ``from_fields`` takes about 1-3 s for a 152k-token byte-level vocabulary with
151,387 merges (transformers' conversion, then the rebuild from the file's tokens; 2.7 s measured under load) and about
2.7 s for Gemma 3's 262,144 tokens (transformers rebuilds the merges from the vocabulary); ``from_gguf``
adds about 0.6 s of header reading, and the first call in a process about 2.5 s of importing transformers.

So the converted tokenizer is cached on disk when the caller gives the metadata's digest (``from_fields(...,
metadata_digest=...)``; ``from_gguf`` and the command line do): ``~/.cache/moestream/converted-tokenizers/``
(``$XDG_CACHE_HOME`` respected), one ``tokenizers`` JSON per digest of the file's metadata bytes and of what the
conversion depends on besides them (this module's source, the installed transformers and tokenizers). A hit skips
transformers entirely (the ``tokenizers`` library reads the JSON back: the same tokenizer); a cache that cannot be
read or written is passed over.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import itertools
import json
import os
import re
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import MoestreamError

__all__ = ["EncodeAhead", "GGUFTokenizer", "StreamDecoder", "TokenizerError", "TokenType"]


class TokenizerError(MoestreamError, ValueError):
    """The file has no usable tokenizer / chat template, or rendering the template failed.

    The message is one line and names the file.
    """


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

# Token texts llama.cpp treats as end of generation (llama-vocab.cpp's EOG detection by text, as of
# llama-cpp-python 0.3.36). Unlike llama.cpp, which promotes any token so named to CONTROL, we count one
# only when the file itself marks it CONTROL: DeepSeek-R1-Distill-Qwen has a NORMAL "</s>" and Gemma 3 a
# USER_DEFINED "</s>" (the HTML strike-through tag), which llama.cpp would both make stop tokens.
END_OF_TURN_NAMES = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)


#: Fill-in-the-middle token names llama.cpp looks for when the file declares none of a kind
#: (``tokenizer.ggml.fim_<kind>_token_id``), as of llama-cpp-python 0.3.36; a token so found becomes CONTROL,
#: and the pad, repo and file-separator ones end generation.
FIM_NAMES: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "\u2581<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "\u2581<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "\u2581<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def _llama_types(
    tokens: list[str], types: list[int], declared: Iterable[int | None], fim: Mapping[str, int | None]
) -> tuple[list[int], set[int]]:
    """Token types as llama.cpp uses them after loading a vocabulary, and the end-of-generation ids.

    llama.cpp (llama-vocab.cpp, ``load``) adjusts the file's types by name, and moestream does the same so that
    tokenization, detokenization and stopping agree with it on every file:

    * a token named in :data:`END_OF_TURN_NAMES` ends generation and becomes CONTROL (matched whole in text
      with special parsing, plain text without; left out of detokenization without control text), whatever
      the file says (Qwen's NORMAL ``</s>``, Gemma 4's USER_DEFINED ``<|tool_response>``);
    * gpt-oss's ``<|channel|>``, ``<|message|>``, ``<|start|>``, ``<|constrain|>`` become USER_DEFINED (always
      rendered);
    * ``<|end|>`` neither ends generation nor is CONTROL (USER_DEFINED) when ``<|return|>`` and ``<|call|>``
      (harmony) or ``<|calls|>`` and ``<|flush|>`` end it; ``</s>`` stays NORMAL text when
      ``<|tool_response>`` or ``<|plamo:eos|>`` end generation (Gemma 4, PLaMo).

    * the fill-in-the-middle tokens of :data:`FIM_NAMES` become CONTROL where ``fim`` (kind -> declared id)
      declares none of their kind; the pad, repo and file-separator ones (declared or found) end generation.

    The declared eos / eot / eom ids end generation too. Returns (types, eos_ids).
    """
    out = list(types)
    # llama.cpp's token_to_id (the last id of a text) for the names looked up below, found by one scan in C
    wanted = END_OF_TURN_NAMES.union(*FIM_NAMES.values(), ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))
    found = itertools.compress(range(len(tokens)), map(wanted.__contains__, tokens))
    by_text = {tokens[i]: i for i in found}
    eos = {i for i in declared if i is not None}
    for kind, names in FIM_NAMES.items():
        i = fim.get(kind)
        if i is None:
            i = next((by_text[name] for name in names if name in by_text), None)
            if i is not None:
                out[i] = TokenType.CONTROL
        if i is not None and kind in ("pad", "rep", "sep"):
            eos.add(i)
    for name in END_OF_TURN_NAMES:
        i = by_text.get(name)
        if i is not None:
            eos.add(i)
            out[i] = TokenType.CONTROL
    for name in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if name in by_text:
            out[by_text[name]] = TokenType.USER_DEFINED
    texts = {tokens[i] for i in eos}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and texts & {"<|call|>", "<|calls|>"}) or (texts & {"<|call|>", "<|calls|>"}
                                                                         and "<|flush|>" in texts)
    ):
        i = next(i for i in eos if tokens[i] == "<|end|>")
        eos.discard(i)
        out[i] = TokenType.USER_DEFINED
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        i = next(i for i in eos if tokens[i] == "</s>")
        eos.discard(i)
        out[i] = TokenType.NORMAL
    return out, eos


#: ``tokenizer.ggml.pre`` values for which llama.cpp does not clean up spaces when it detokenizes a byte-level
#: BPE sequence (llama-vocab.cpp, llama-cpp-python 0.3.36); every other BPE vocabulary is cleaned.
NO_CLEAN_SPACES_PRE = frozenset({
    "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "sarvam-moe", "command-r", "qwen2",
    "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35", "poro-chat", "viking",
})


def _clean_up_spaces(data: bytes) -> bytes:
    """llama.cpp's ``clean_up_tokenization_spaces`` on detokenized bytes (``llama_vocab::impl::detokenize``):
    drop the space before ``? ! . ,``, the spaces around a lone ``'``, and the space before ``'s 'm 're 've``.
    Three in-place passes over a byte buffer, each reading what the previous writes left (as the C code does)."""
    text = bytearray(data)
    total = len(text)
    # pass 1
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        text[total] = x
        total += 1
    # pass 2
    n, total = total, 1 if total else 0
    i = 1
    while i < n:
        x = text[i]
        if x == 0x27 and i + 1 < n and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    # pass 3
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = text[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes(text[i + 1:i + 3]) in (b"re", b"ve")):
                total -= 1
        text[total] = x
        total += 1
    return bytes(text[:total])


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _str_list(value: Any, key: str, path: str) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TokenizerError(f"{path}: {key} is not an array of strings (got {type(value).__name__})")
    if hasattr(value, "tolist") and not hasattr(value, "dtype"):  # moestream.gguf.StringArray: str entries
        try:
            return value.tolist()
        except MoestreamError as e:
            raise TokenizerError(str(e)) from None
    if type(value) is list and set(map(type, value)) <= {str}:  # the common case, without a loop in Python
        return list(value)
    out = []
    for item in value:
        if isinstance(item, bytes):
            item = item.decode("utf-8", errors="replace")
        elif not isinstance(item, str):
            raise TokenizerError(f"{path}: {key} holds a {type(item).__name__}, expected strings")
        out.append(item)
    return out


def _num_list(value: Any, key: str, path: str, kind: type) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TokenizerError(f"{path}: {key} is not a numeric array (got {type(value).__name__})")
    if type(value) is list and set(map(type, value)) <= {kind}:
        return list(value)
    try:
        return [kind(v) for v in value]
    except (TypeError, ValueError) as e:
        raise TokenizerError(f"{path}: {key} is not a numeric array ({_one_line(e)})") from None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, byte -> character (``bytes_to_unicode`` of GPT-2's encoder.py, as transformers
    has it): the printable Latin-1 bytes map to themselves, the other 68 to U+0100.. in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of :func:`bytes_to_unicode`)."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moestream", "converted-tokenizers")


@functools.cache
def _conversion_key() -> str:
    """What a converted tokenizer depends on besides the file's metadata: this module's source, transformers' (the
    conversion; its ``__init__.py``'s size and mtime, without importing it) and tokenizers' version (the JSON)."""
    import importlib.util

    import tokenizers

    h = hashlib.blake2b(digest_size=8)
    with open(__file__, "rb") as f:
        h.update(f.read())
    h.update(f"tokenizers={tokenizers.__version__};".encode())
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin:
        with contextlib.suppress(OSError):
            st = os.stat(spec.origin)
            h.update(f"transformers={spec.origin}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _cache_file(metadata_digest: str) -> str:
    return os.path.join(_cache_root(), f"{metadata_digest}-{_conversion_key()}.json")


def is_cached(metadata_digest: str | None) -> bool:
    """Whether the converted tokenizer of the metadata with this digest is in the cache (see the module)."""
    return bool(metadata_digest) and os.path.isfile(_cache_file(metadata_digest))


def _load_cached(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` cached at ``path``, or None (absent, unreadable, or not a tokenizer)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception:  # noqa: BLE001 - a damaged cache file: convert again (and replace it)
        return None


def _store_cached(path: str, backend: Any) -> None:
    """Write ``backend`` to the cache at ``path`` atomically (a temporary file renamed); nothing on failure."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(backend.to_str())
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class GGUFTokenizer:
    """Tokenizer + chat template of one GGUF file.

    Attributes:
        path: the file, for messages.
        model: ``tokenizer.ggml.model`` (``"gpt2"``, ``"llama"`` or ``"gemma4"``).
        vocab_size: number of tokens (``len(tokenizer.ggml.tokens)``); every id is in ``[0, vocab_size)``.
        bos_id: ``tokenizer.ggml.bos_token_id`` or None.
        add_bos / add_eos: whether ``encode(..., add_special=True)`` adds BOS / EOS.
        eos_ids: end-of-generation ids, a set of int: ``tokenizer.ggml.eos_token_id``, ``eot_token_id``
            and ``eom_token_id`` when present, plus every token the file marks CONTROL whose text
            is one llama.cpp treats as end of turn (``<|im_end|>``, ``<|endoftext|>``,
            ``<end_of_turn>``, ``<|eot_id|>``, ``<｜end▁of▁sentence｜>``, ... see ``END_OF_TURN_NAMES``).
        chat_template: ``tokenizer.chat_template`` or None (the command line's --chat-template replaces it).
        template_origin: where ``chat_template`` came from, for messages (``path`` unless replaced).
        token_types: ``tokenizer.ggml.token_type`` per id (list of int, :class:`TokenType` values).
        backend: the ``tokenizers.Tokenizer`` doing the work.
    """

    def __init__(
        self,
        backend: Any,
        *,
        path: str,
        model: str,
        tokens: list[str],
        token_types: list[int],
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: set[int],
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
        pre: str | None = None,
        make_backend: Callable[[], Any] | None = None,
    ):
        """Use :meth:`from_fields` or :meth:`from_gguf`; this only stores what they computed. ``backend`` None:
        ``make_backend()`` makes it on first use (:meth:`from_fields` with ``lazy``)."""
        self._backend = backend
        self._make_backend = make_backend
        self._backend_lock = threading.Lock()
        self.path = path
        self.model = model
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        #: where chat_template came from, for messages: the file, or the option that replaced it
        self.template_origin = path
        self.token_types = token_types
        self._template_tokens = template_tokens
        self._tokens = tokens
        #: llama.cpp cleans up spaces in detokenized byte-level BPE text unless the pre-tokenizer says not to
        self._clean_spaces = model in ("gpt2", "gemma4") and pre not in NO_CLEAN_SPACES_PRE
        ids = range(len(token_types))  # itertools.compress: the 152k-entry scans without a loop in Python
        self._unused_ids = frozenset(itertools.compress(ids, map(TokenType.UNUSED.__eq__, token_types)))
        self._byte_level = model == "gpt2"
        self._byte_fallback = not self._byte_level
        self._piece_cache: dict[int, bytes] = {}
        self._char_bytes: dict[str, int] | None = None
        self._plain_lock = threading.Lock()

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` doing the work (made on first use where :meth:`from_fields` was ``lazy``)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    @property
    def backend_read(self) -> bool:
        """Whether :attr:`backend` is in this process (False: a lazy tokenizer that has not needed it yet)."""
        return self._backend is not None

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """Ids left out of text with ``skip_special``: the special added tokens and every CONTROL token."""
        ids = range(len(self.token_types))
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special) | set(
            itertools.compress(ids, map(TokenType.CONTROL.__eq__, self.token_types))
        )

    @functools.cached_property
    def _strip_left(self) -> int:
        """Leading spaces the decoder strips from a whole text (:func:`_decoder_strip`)."""
        return _decoder_strip(self.backend)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token string of the vocabulary in UTF-8 bytes: no token stands for more bytes of text
        (a byte-level token's characters are one byte each, SentencePiece's '▁' three bytes for one space, a byte
        token ``<0xAB>`` six for one), so a text of B bytes needs at least B / max_token_bytes tokens."""
        return max((len(str(t).encode("utf-8", "surrogatepass")) for t in self._tokens), default=1) or 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], path: str, metadata_digest: str | None = None,
                    lazy: bool = False) -> GGUFTokenizer:
        """Build from GGUF metadata.

        Args:
            fields: metadata key -> Python value (strings as str, arrays as lists or 1-D numpy arrays),
                e.g. ``{k: f.contents() for k, f in gguf.GGUFReader(p).fields.items()}``. Uses
                ``general.architecture`` and the ``tokenizer.*`` keys.
            path: the file the fields came from, only for messages.
            metadata_digest: a digest of the metadata bytes ``fields`` were read from
                (``moestream.gguf.GGUFModel.metadata_digest``): the converted tokenizer is cached on disk under it
                (module docstring). None: no cache.
            lazy: where the cache holds the converted tokenizer, read it on first use of :attr:`backend` (not
                here): ``run`` then needs none for a byte-level file whose prompt :class:`EncodeAhead` encoded.
        Raises:
            TokenizerError: no ``tokenizer.ggml.tokens``, a missing or unsupported
                ``tokenizer.ggml.model``, arrays of the wrong type or length, a special token id out of
                range, or transformers failing to convert the vocabulary. One line, naming ``path``.
        """
        tok_key, model_key = "tokenizer.ggml.tokens", "tokenizer.ggml.model"
        if fields.get(tok_key) is None:
            raise TokenizerError(f"{path}: no {tok_key} in the GGUF metadata: the file carries no tokenizer")
        model = fields.get(model_key)
        if model is None:
            raise TokenizerError(f"{path}: no {model_key} in the GGUF metadata")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"{path}: unsupported {model_key} {model!r} (supported: {', '.join(SUPPORTED_MODELS)})"
            )
        tokens = _str_list(fields[tok_key], tok_key, path)
        n = len(tokens)
        if n == 0:
            raise TokenizerError(f"{path}: {tok_key} is empty")
        arrays: dict[str, Any] = {"tokens": tokens}
        for key, name, kind in (
            ("token_type", "token_type", int),
            ("scores", "scores", float),
        ):
            value = fields.get(f"tokenizer.ggml.{key}")
            if value is not None:
                arrays[name] = _num_list(value, f"tokenizer.ggml.{key}", path, kind)
                if len(arrays[name]) != n:
                    raise TokenizerError(
                        f"{path}: tokenizer.ggml.{key} has {len(arrays[name])} entries for {n} tokens"
                    )
        merges = fields.get("tokenizer.ggml.merges")  # read below only to convert (not on a cache hit)
        if merges is not None and (isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable)):
            raise TokenizerError(f"{path}: tokenizer.ggml.merges is not an array of strings (got "
                                 f"{type(merges).__name__})")
        if model == "gpt2" and merges is None:
            raise TokenizerError(f"{path}: byte-level BPE (gpt2) tokenizer without tokenizer.ggml.merges")
        if model != "gpt2" and merges is None and "scores" not in arrays:
            raise TokenizerError(f"{path}: {model} tokenizer has neither tokenizer.ggml.merges nor .scores")
        token_types = arrays.get("token_type") or [TokenType.NORMAL] * n

        def token_id(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise TokenizerError(f"{path}: tokenizer.ggml.{key} is not an integer: {value!r}") from None
            if not 0 <= value < n:
                # llama.cpp writes -1 / 0xFFFFFFFF for "none" in some converters
                if value in (-1, 0xFFFFFFFF):
                    return None
                raise TokenizerError(f"{path}: tokenizer.ggml.{key} {value} is outside the {n} tokens")
            return value

        bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
        special_ids = {name: token_id(f"{name}_token_id") for name in ("unknown", "padding", "eot", "eom")}
        fim = {kind: token_id(f"fim_{kind}_token_id") for kind in FIM_NAMES}
        token_types, eos_ids = _llama_types(tokens, token_types, (eos_id, special_ids["eot"], special_ids["eom"]), fim)

        architecture = str(fields.get("general.architecture") or "")
        pre = fields.get("tokenizer.ggml.pre")
        cache_file = _cache_file(metadata_digest) if metadata_digest else None

        def make_backend() -> Any:
            backend = _load_cached(cache_file) if cache_file is not None else None
            if backend is None:
                if merges is not None:
                    arrays["merges"] = _str_list(merges, "tokenizer.ggml.merges", path)
                backend = _convert(architecture, model, pre, fields, arrays, path)
                backend = _repair(backend, tokens, token_types, arrays.get("merges"), model == "gpt2", path)
                if cache_file is not None:
                    _store_cached(cache_file, backend)
            return backend

        lazy = lazy and cache_file is not None and os.path.isfile(cache_file)  # a miss converts now, as without
        backend = None if lazy else make_backend()

        add_bos = fields.get("tokenizer.ggml.add_bos_token")
        # llama.cpp's default when the key is absent: BOS for SentencePiece vocabularies, none for BPE
        add_bos = bool(add_bos) if add_bos is not None else model != "gpt2"
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token") or False)
        if add_bos and bos_id is None:
            add_bos = False
        if add_eos and eos_id is None:
            add_eos = False


        template = fields.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{path}: tokenizer.chat_template is not a string")
        template_tokens = {}
        for name, i in (
            ("bos_token", bos_id),
            ("eos_token", eos_id),
            ("unk_token", special_ids["unknown"]),
            ("pad_token", special_ids["padding"]),
        ):
            if i is not None:
                template_tokens[name] = tokens[i]
        return cls(
            backend,
            path=path,
            model=model,
            tokens=tokens,
            token_types=token_types,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=eos_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=template or None,
            template_tokens=template_tokens,
            pre=pre if isinstance(pre, str) else None,
            make_backend=make_backend if lazy else None,
        )

    @classmethod
    def from_gguf(cls, path: str) -> GGUFTokenizer:
        """Read the metadata of the GGUF file at ``path`` and build from it (see :meth:`from_fields`).

        Reads with transformers' struct-based GGUF header reader (well under a second for a 152k
        vocabulary; ``gguf.GGUFReader`` takes 7-10 s on the same header), falling back to
        ``gguf.GGUFReader`` for headers that reader refuses. Only the header is read, never tensor data.

        Raises:
            TokenizerError: the file is missing, not GGUF, truncated, or has no usable tokenizer.
        """
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: no such file")
        from .errors import GGUFError
        from .gguf import read_metadata

        try:  # moestream's own header parser, with the metadata's digest: the converted tokenizer is cached
            fields, digest = read_metadata(path)
            if digest is not None:
                return cls.from_fields(fields, path, metadata_digest=digest)
        except GGUFError:
            pass
        try:
            from transformers.integrations.gguf import read_gguf_metadata

            fields, _ = read_gguf_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
        except Exception as first:  # noqa: BLE001 - any header the fast reader refuses
            try:
                import gguf

                reader = gguf.GGUFReader(path)
                fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            except Exception:  # noqa: BLE001
                raise TokenizerError(f"{path}: cannot read the GGUF header ({_one_line(first)})") from None
        return cls.from_fields(fields, path)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids (list of int) for ``text``.

        With ``parse_special`` (the default), special tokens written in the text (``<|im_start|>``,
        ``<｜User｜>``, ``<start_of_turn>``...: every token the file marks CONTROL or USER_DEFINED) become
        their single ids, as llama.cpp's tokenizer does with ``parse_special=True``. Without it, CONTROL
        tokens written in the text are tokenized as the plain text they spell (so user text can never
        forge a turn or an end of generation); USER_DEFINED tokens are still matched whole, as llama.cpp
        does with ``parse_special=False`` (``tokenizer_st_partition`` in llama-vocab.cpp).

        Args:
            add_special: add BOS in front when the file says to (``tokenizer.ggml.add_bos_token``; when
                absent, yes for SentencePiece vocabularies, no for byte-level BPE) unless the text
                already starts with the BOS token; add EOS at the end when
                ``tokenizer.ggml.add_eos_token`` is true.
            parse_special: match CONTROL tokens written in the text (see above).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if parse_special:
            ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        else:
            with self._plain_lock:  # the backend's flag is shared state: one plain encode at a time
                self.backend.encode_special_tokens = True
                try:
                    ids = list(self.backend.encode(text, add_special_tokens=False).ids)
                finally:
                    self.backend.encode_special_tokens = False
        if add_special:
            if self.add_bos and not (ids and ids[0] == self.bos_id):
                ids.insert(0, self.bos_id)
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for token ids.

        Tokens the file marks UNUSED (Qwen's ``[PAD151665]``... fillers) decode to nothing, as in llama.cpp. The
        text is llama.cpp's ``llama_detokenize``: each token's bytes (:meth:`token_bytes`), then, for byte-level
        BPE vocabularies whose pre-tokenizer is not in :data:`NO_CLEAN_SPACES_PRE`, its space clean-up (so a
        whole decode may differ from the concatenated stream of pieces, as llama-cli's printed text does).

        Args:
            ids: token ids, each in ``[0, vocab_size)``.
            skip_special: leave out control tokens (BOS, EOS, ``<|im_end|>``...).
        Raises:
            TokenizerError: an id outside the vocabulary.
        """
        ids = self._checked(ids)
        if self._clean_spaces:
            data = b"".join(self.token_bytes(i, skip_special) for i in ids)
            strip = self._strip_left
            while strip and data.startswith(b" "):
                data, strip = data[1:], strip - 1
            return _clean_up_spaces(data).decode("utf-8", errors="replace")
        dec = StreamDecoder(self, skip_special)
        return "".join(dec.push(i) for i in ids) + dec.flush()

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for printing tokens as they are generated."""
        return StreamDecoder(self, skip_special)

    def token_to_id(self, text: str) -> int | None:
        """Id of the token spelled ``text`` as the file spells it (``"<|im_end|>"``), or None."""
        return self.backend.token_to_id(text)

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The UTF-8 bytes token ``token_id`` contributes to decoded text (maybe half a character).

        Mirrors the ``tokenizers`` decoder chain token by token (it runs over added tokens too): byte-level
        vocabularies map each character back to its byte (a token with characters outside that alphabet
        gives its own UTF-8); SentencePiece ones turn ``<0xNN>`` into the byte and ``\u2581`` into a
        space. Control tokens give ``b""`` when ``skip_special``, UNUSED tokens always. The SentencePiece
        decoder's strip of the dummy-prefix space at the start of a text is not applied here (see
        :class:`StreamDecoder`).
        """
        (token_id,) = self._checked((token_id,))
        if (skip_special and token_id in self._special_ids) or token_id in self._unused_ids:
            return b""
        cached = self._piece_cache.get(token_id)
        if cached is not None:
            return cached
        kind = self.token_types[token_id]
        if self._byte_level or self.backend.token_to_id(piece := self.backend.id_to_token(token_id) or "") != token_id:
            # the file's own text (byte-level files always; a SentencePiece id the conversion lost to a text
            # another id shares): CONTROL / USER_DEFINED text as written, NORMAL text decoded (llama.cpp's
            # token_to_piece)
            piece = self._tokens[token_id]
            if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
                out = piece.encode("utf-8")
            elif self._byte_level:
                if self._char_bytes is None:
                    self._char_bytes = _byte_decoder()
                table = self._char_bytes
                if all(c in table for c in piece):
                    out = bytes(table[c] for c in piece)
                else:  # what the ByteLevel decoder does with a token outside its alphabet
                    out = piece.encode("utf-8")
            else:
                out = self._sentencepiece_bytes(piece)
        else:
            out = self._sentencepiece_bytes(piece)
        self._piece_cache[token_id] = out
        return out

    def _sentencepiece_bytes(self, piece: str) -> bytes:
        m = _BYTE_TOKEN.fullmatch(piece) if self._byte_fallback else None
        return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")

    def _checked(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"{self.path}: token id {i} is outside the {self.vocab_size} tokens")
            out.append(i)
        return out

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """Render the file's chat template, as transformers' ``apply_chat_template(tokenize=False)`` does.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...]``.
                Keys whose value is None are dropped first (as transformers does);
                ``reasoning_content`` / ``thinking`` / ``reasoning`` are aliased to each other.
            add_generation_prompt: end with the header that starts an assistant turn.
            tools: JSON-schema tool descriptions, passed to the template as ``tools``.
            template_vars: extra template variables (e.g. ``enable_thinking=False`` for Qwen 3); they
                override ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token``, which are the
                file's token strings.
        Returns:
            The prompt text; encode it with :meth:`encode` (special tokens in it are parsed; no second
            BOS is added when the template wrote one).
        Raises:
            TokenizerError: the file has no chat template, the template does not compile, or it raised
                an error (``raise_exception(...)``, e.g. roles not alternating).
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.path}: the GGUF has no tokenizer.chat_template (--chat-template NAME or "
                                 f"--chat-template-file FILE gives one)")
        template = compile_chat_template(self.chat_template, self.template_origin)
        chat = [_alias_reasoning(_plain({k: v for k, v in dict(m).items() if v is not None})) for m in messages]
        variables = {**self._template_tokens, **_plain(template_vars)}
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as e:  # noqa: BLE001 - TemplateError from raise_exception, UndefinedError...
            raise TokenizerError(f"{self.template_origin}: chat template: {_one_line(e)}") from None


class EncodeAhead:
    """A prompt encoded by a forked helper process while this one goes on (``run`` imports torch meanwhile), so
    that reading the cached converted tokenizer (``tokenizers.Tokenizer.from_str``, about half a second for a 152k
    vocabulary, holding the GIL) takes no time of the run on a machine with a second core, and the tokenizer's
    backend is never in this process where nothing else needs it (``run``'s peak RSS on the embedded model: 0.28
    instead of 0.45 GiB).

    :meth:`start` forks only where it pays and is safe: ``tok`` has not read its backend (:meth:`GGUFTokenizer.
    from_fields` ``lazy``, the converted tokenizer in the cache), it is byte-level (``gpt2``: a SentencePiece
    tokenizer needs its backend to print tokens anyway), ``os.fork`` is available and this is the process's only
    thread. The helper, a copy of this process, encodes ``text`` with ``tok.encode`` (``add_special``), reading the
    backend there: the same ids as here. :meth:`apply` waits for them; None where the helper failed (the caller
    encodes itself, and meets the same error if there is one). A helper not waited for is killed and reaped when
    this object goes.
    """

    def __init__(self, pid: int, fd: int):
        self._pid, self._fd = pid, fd
        self._finalizer = weakref.finalize(self, EncodeAhead._reap, pid, fd, True)

    @classmethod
    def start(cls, tok: GGUFTokenizer, text: str) -> EncodeAhead | None:
        """Fork the helper for ``text`` (see the class), or None where it would not pay or not be safe."""
        if tok.backend_read or tok.model != "gpt2" or not hasattr(os, "fork") or threading.active_count() != 1:
            return None
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the helper: never returns
            status = 1
            try:
                os.close(r)
                data = json.dumps({"ids": tok.encode(text, add_special=True), "strip_left": tok._strip_left})
                with os.fdopen(w, "wb") as f:
                    f.write(data.encode())
                status = 0
            finally:
                os._exit(status)
        os.close(w)
        return cls(pid, r)

    def apply(self, tok: GGUFTokenizer) -> list[int] | None:
        """The helper's ids (None where it failed), once; what it learnt from the backend is given to ``tok``."""
        self._finalizer.detach()
        try:
            with os.fdopen(self._fd, "rb") as f:
                data = f.read()
        finally:
            status = EncodeAhead._reap(self._pid, None, False)
        if status != 0:
            return None
        try:
            got = json.loads(data)
        except ValueError:
            return None
        tok._strip_left = got["strip_left"]
        return got["ids"]

    @staticmethod
    def _reap(pid: int, fd: int | None, kill: bool) -> int:
        """Close ``fd``, kill the helper where ``kill`` and wait for it; its exit status (-1: not known)."""
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if kill:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        try:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except (OSError, ValueError):
            return -1


class StreamDecoder:
    """Incremental detokenizer: ``push(token_id)`` returns the text that token completes.

    Works on bytes: each token's bytes (:meth:`GGUFTokenizer.token_bytes`) go through an incremental
    UTF-8 decoder, so a character split over several byte tokens (an emoji as 4 byte-level tokens) comes
    out whole with the token that completes it, and nothing is ever half a character. For valid UTF-8,
    ``"".join(push(t) for t in ids) + flush() == tokenizer.decode(ids, skip_special)``. Invalid byte
    sequences become U+FFFD (``errors="replace"``); there the count of U+FFFD may differ from
    ``decode()``, which replaces per SentencePiece byte token.
    """

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_pending = tokenizer._strip_left  # SentencePiece: drop the dummy-prefix space once
        self.ids: list[int] = []

    def push(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text (possibly ``""``).

        Raises TokenizerError for an id outside the vocabulary.
        """
        data = self._tok.token_bytes(token_id, self._skip)
        self.ids.append(int(token_id))
        if self._strip_pending and data:  # the decoder strips the start of the whole text only
            strip = self._strip_pending
            while strip and data.startswith(b" "):
                data, strip = data[1:], strip - 1
            self._strip_pending = 0
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Text for bytes still held at the end of a stream (U+FFFD for an unfinished character)."""
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------------- conversion helpers
def _convert(architecture: str, model: str, pre: Any, fields: Mapping[str, Any], arrays: dict, path: str) -> Any:
    """``tokenizers.Tokenizer`` from transformers' GGUF conversion."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError as e:  # pragma: no cover - pinned dependency
        raise TokenizerError(f"{path}: transformers' GGUF tokenizer conversion is unavailable ({e})") from None
    tokenizer_dict: dict[str, Any] = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        if name in arrays:
            tokenizer_dict[name] = arrays[name]
        elif f"tokenizer.{key}" in fields and fields[f"tokenizer.{key}"] is not None:
            tokenizer_dict[name] = fields[f"tokenizer.{key}"]
    if model == "gpt2" and pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in (None, "gpt2"):
        warnings.warn(
            f"{path}: tokenizer.ggml.pre {pre!r} has no pre-tokenizer in transformers' GGUF conversion; "
            f"using GPT-2's, which may split some text differently from llama.cpp",
            stacklevel=3,
        )
    try:
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:  # noqa: BLE001 - transformers raises assorted errors on odd vocabularies
        raise TokenizerError(f"{path}: cannot build the {model} tokenizer ({_one_line(e)})") from None
    if model == "llama" and fields.get("tokenizer.ggml.add_space_prefix") is False:
        _no_space_prefix(backend, architecture)
    return backend


def _no_space_prefix(backend: Any, architecture: str) -> None:
    """SentencePiece without the dummy-prefix space (``add_space_prefix = false``).

    transformers' LlamaTokenizer always prepends one; Gemma's builder already has none.
    """
    from tokenizers import decoders, pre_tokenizers

    if architecture.startswith("gemma") or architecture == "phi3":
        return
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])


def _placeholder(i: int) -> str:
    """A vocabulary string for id ``i`` that no text can produce: private-use characters are outside the
    byte-level alphabet and no merge builds them. Used for ids whose text another id owns (duplicates)."""
    return f"\ue000{i}\ue001"


def _repair(
    backend: Any, tokens: list[str], types: list[int], merges: list[str] | None, byte_level: bool, path: str
) -> Any:
    """Make the converted tokenizer's ids the file's, with its special tokens whole.

    Byte-level BPE (``gpt2``): the vocabulary is rebuilt from ``tokenizer.ggml.tokens`` as the file spells it
    (:func:`_file_vocab`), with the file's merges and the converted normalizer, pre-tokenizer and decoder. Every
    CONTROL / USER_DEFINED token is an added token matched whole in the raw text under its own id (transformers
    respells those outside the byte alphabet, ``<｜User｜>``, and collapses ids whose respelled text collides
    with another entry). About 0.5 s for 152k tokens.

    SentencePiece: transformers' vocabulary is kept; added tokens it invents past the file's ids are dropped and
    every CONTROL / USER_DEFINED token is matched whole in the raw text, as llama.cpp and SentencePiece match
    user-defined symbols (see :func:`_add_raw_tokens`; Gemma's runs of 2..31 spaces, ids 138-167, which
    transformers respells as ``\u2581`` runs and leaves to the BPE merges). Ids the conversion lost (a text two
    ids share) stay ids: they are never produced by tokenization and detokenize from the file's text.
    """
    from tokenizers import Tokenizer, models

    n = len(tokens)
    if byte_level and merges is not None and isinstance(backend.model, models.BPE):
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        try:
            vocab, added = _file_vocab(tokens, types, pairs)
        except ValueError as e:
            raise TokenizerError(f"{path}: {e}") from None
        old = backend.model
        try:
            fixed = Tokenizer(
                models.BPE(
                    vocab=vocab,
                    merges=pairs,
                    dropout=old.dropout,
                    unk_token=old.unk_token,
                    continuing_subword_prefix=old.continuing_subword_prefix,
                    end_of_word_suffix=old.end_of_word_suffix,
                    fuse_unk=old.fuse_unk,
                    byte_fallback=old.byte_fallback,
                    ignore_merges=old.ignore_merges,
                )
            )
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"{path}: cannot rebuild the tokenizer ({_one_line(e)})") from None
        for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
            value = getattr(backend, part)
            if value is not None:
                setattr(fixed, part, value)
        fixed.add_special_tokens([t for t in added if t.special])
        fixed.add_tokens([t for t in added if not t.special])
        wrong = [t.content for t in added if fixed.token_to_id(t.content) != vocab[t.content]]
        if wrong or len(set(vocab.values())) != n or max(vocab.values()) != n - 1:
            raise TokenizerError(f"{path}: cannot keep the file's token ids (first: {wrong[:1]})")
        return fixed
    added = backend.get_added_tokens_decoder()
    extra = [i for i in added if i >= n or types[i] == TokenType.NORMAL]  # past the file; made text by name
    missing = [
        i for i, kind in enumerate(types) if kind in (TokenType.CONTROL, TokenType.USER_DEFINED) and i not in added
    ]
    promoted = {i for i, t in added.items() if i < n and types[i] == TokenType.CONTROL and not t.special}
    if not extra and not missing and not promoted:
        return backend
    data = json.loads(backend.to_str())
    data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] < n and types[a["id"]] != TokenType.NORMAL]
    for a in data["added_tokens"]:
        if a["id"] in promoted:
            a["special"] = True
    if missing and not byte_level:
        _add_raw_tokens(data, tokens, types, missing)
    try:
        fixed = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    except Exception as e:  # noqa: BLE001
        raise TokenizerError(f"{path}: cannot rebuild the tokenizer ({_one_line(e)})") from None
    got = fixed.get_vocab_size(with_added_tokens=True)
    if got > n:
        raise TokenizerError(f"{path}: the converted tokenizer has {got} ids for the file's {n} tokens")
    return fixed


def _file_vocab(tokens: list[str], types: list[int], pairs: list[tuple[str, ...]]) -> tuple[dict[str, int], list]:
    """A byte-level BPE vocabulary with every id of the file, and the added tokens (CONTROL / USER_DEFINED, raw
    text, ``special`` for CONTROL) in id order.

    Ids whose text another id owns get :func:`_placeholder` strings (unreachable), as llama.cpp resolves them:
    of NORMAL (and UNUSED, BYTE, ...) tokens sharing a text the last id keeps it (llama.cpp's ``token_to_id``
    map is filled in id order); an added token takes its text from a NORMAL entry (it is matched in the raw
    text first), unless a merge needs that entry, and of added tokens sharing a text the first id keeps it.
    """
    from tokenizers import AddedToken

    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
            continue
        if text in vocab:
            vocab[_placeholder(vocab[text])] = vocab[text]
        vocab[text] = i
    in_merges: set[str] = set()
    for pair in pairs:
        in_merges.update((*pair, "".join(pair)))
    added: list[Any] = []
    taken: set[str] = set()
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (TokenType.CONTROL, TokenType.USER_DEFINED):
            continue
        if text in taken or (text in vocab and text in in_merges):
            vocab[_placeholder(i)] = i
            continue
        if text in vocab:
            vocab[_placeholder(vocab[text])] = vocab[text]
        vocab[text] = i
        taken.add(text)
        added.append(AddedToken(text, normalized=False, special=kind == TokenType.CONTROL))
    # A merge may build a string the file no longer has: the converter writes an added token's decoded text
    # (" Hello" for a vocabulary entry "ĠHello" that the tokenizer marks added). The BPE model needs the string;
    # alias it to the added token that owns its text, which the raw-text match always takes first, so the
    # alias is never produced.
    table = _byte_decoder()
    owner = {text: i for text, i in vocab.items() if text in taken}
    for text in sorted(in_merges - vocab.keys()):
        raw = bytes(table[c] for c in text).decode("utf-8", "replace") if all(c in table for c in text) else None
        if raw not in owner:
            raise ValueError(f"the merges use {text!r}, which is not a token")
        vocab[text] = owner[raw]
    return vocab, added


def _add_raw_tokens(data: dict, tokens: list[str], types: list[int], ids: list[int]) -> None:
    """Add SentencePiece CONTROL / USER_DEFINED tokens ``ids`` to a tokenizer's JSON ``data`` as added tokens
    matched on the raw text (``normalized=False``), longest match first, like llama.cpp's special-token
    partition (``tokenizer_st_partition`` in llama-vocab.cpp) and SentencePiece's user-defined symbols.

    A token the converted vocabulary spells differently from the file (``"\u2581\u2581"`` for two spaces) is
    renamed to the file's text under the same id, and merges that build or use the respelled form are
    dropped: in the file the token is not reachable by merging, so a literal ``\u2581\u2581`` in the text must
    not become it (llama.cpp agrees).
    """
    vocab = data["model"].get("vocab")
    if not isinstance(vocab, dict):  # not a BPE vocabulary: nothing to respell
        vocab = {}
    by_id = {i: t for t, i in vocab.items()}
    renamed: set[str] = set()
    for i in ids:
        raw, spelled = tokens[i], by_id.get(i)
        if spelled is not None and spelled != raw and raw not in vocab:
            del vocab[spelled]
            vocab[raw] = i
            renamed.add(spelled)
    if renamed and data["model"].get("merges") is not None:
        kept = []
        for m in data["model"]["merges"]:
            left, right = m if isinstance(m, list) else m.split(" ", 1)
            if left not in renamed and right not in renamed and left + right not in renamed:
                kept.append(m)
        data["model"]["merges"] = kept
    for i in ids:
        data["added_tokens"].append({
            "id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": types[i] == TokenType.CONTROL,
        })


def _decoder_strip(backend: Any) -> int:
    """How many leading spaces the decoder strips from the start of a decoded text (SentencePiece's
    dummy prefix; ``Strip`` runs after ``Fuse``, so on the whole text, added tokens included)."""
    decoder = backend.decoder
    if decoder is None:
        return 0
    spec = json.loads(decoder.__getstate__()) if hasattr(decoder, "__getstate__") else {}
    parts = spec.get("decoders", [spec]) if isinstance(spec, dict) else []
    for part in parts:
        if part.get("type") == "Strip" and part.get("content") == " ":
            return int(part.get("start", 0))
        if part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never":
            return 1
    return 0


# ---------------------------------------------------------------------- chat template helpers
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning under every name templates read it by (as transformers does)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types only (the sandbox sees nothing else)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    return f"<{type(value).__name__}>"


def compile_chat_template(source: str, origin: str) -> Any:
    """The compiled chat template ``source`` (:func:`_compile_template`); TokenizerError naming ``origin`` (the
    file or flag it came from) when it does not compile: what ``apply_chat_template`` checks first, and ``serve``
    before it listens."""
    try:
        return _compile_template(source)
    except Exception as e:  # noqa: BLE001 - jinja2 syntax / security errors
        raise TokenizerError(f"{origin}: the chat template does not compile ({_one_line(e)})") from None


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """Compile a chat template in a sandboxed Jinja environment with transformers' conventions:
    ``trim_blocks`` / ``lstrip_blocks``, loop controls, a ``{% generation %}`` block that renders its
    body, ``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` filter that keeps non-ASCII
    text and takes ``indent`` / ``separators`` / ``sort_keys``, and ``namespace`` / ``dict`` that
    refuse underscore names."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class _Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=_Dict(), namespace=_Namespace
    )
    return env.from_string(source)
