"""Constrained sampling: the output must follow a grammar (a JSON schema, or a Lark grammar with JSON schemas in it).

The grammar engine is llguidance (PyPI ``llguidance``, the library behind llama.cpp's ``--llguidance`` build,
vLLM's and SGLang's structured outputs), imported only when a request or a command uses a grammar (start time:
docs/start-time.md). Per generated token, :class:`Constraint` asks it for the set of tokens that keep the text a
prefix of some string of the grammar, and sets every other logit to -inf; once the grammar is complete the
end-of-generation tokens are allowed, and once nothing can be added they are the only ones. Each sequence has its
own Constraint (its own parser state), so a batch's neighbours never change one another's output.

The vocabulary is handed to llguidance as each token's bytes (:meth:`GGUFTokenizer.token_bytes`), control tokens
marked special (llguidance's 0xFF prefix: a grammar's text never matches them; a Lark grammar names one as
``<[id]>``), and the GGUF tokenizer's plain-text encoder.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any

import numpy as np
import torch

from .errors import MoestreamError
from .tokenizer import TokenType


class GrammarError(MoestreamError, ValueError):
    """A schema or grammar llguidance cannot compile, or a generation that left the grammar (message: what and
    why)."""


_LOCK = threading.Lock()
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Vocab:
    """What llguidance's ``LLTokenizer`` reads of a tokenizer (its ``TokenizerWrapper`` protocol): ``tokens``
    (bytes per id, control tokens prefixed with 0xFF), ``eos_token_id``, ``bos_token_id``, ``special_token_ids``
    and ``__call__(bytes) -> ids`` (plain text: control-token text is not parsed)."""

    def __init__(self, tok: Any, n_vocab: int):
        self.tok = tok
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(tok.vocab_size):
            kind = tok.token_types[i]
            if kind == TokenType.CONTROL:
                tokens.append(b"\xff" + tok.token_bytes(i))
                special.append(i)
            elif kind == TokenType.UNUSED:
                tokens.append(b"")
            else:
                tokens.append(tok.token_bytes(i))
        tokens += [b""] * (n_vocab - len(tokens))  # the model's padded rows: never allowed
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = min(tok.eos_ids) if tok.eos_ids else (tok.eos_id or 0)
        self.bos_token_id = tok.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tok: Any, n_vocab: int) -> Any:
    """llguidance's ``LLTokenizer`` of GGUFTokenizer ``tok`` for logits of ``n_vocab`` entries (built once per
    tokenizer: about a second for a 150k vocabulary); every id of ``tok.eos_ids`` ends generation."""
    import llguidance

    with _LOCK:
        cached = _TOKENIZERS.get(tok)
        if cached is not None and cached[0] == n_vocab:
            return cached[1]
        vocab = _Vocab(tok, max(n_vocab, tok.vocab_size))
        eos = sorted(tok.eos_ids) or [vocab.eos_token_id]
        llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens), eos_token=eos)
        _TOKENIZERS[tok] = (n_vocab, llt)
        return llt


#: llguidance's JSON options: compact separators, no free whitespace (a model cannot pad a reply with blanks)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


#: the keywords whose value is one schema, a list of schemas, or an object of schemas (closed by close_objects)
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, _in_all_of: bool = False) -> Any:
    """A copy of JSON schema ``schema`` where every object schema that declares ``properties`` and says nothing of
    ``additionalProperties`` gets ``"additionalProperties": false``: llama.cpp's JSON-schema-to-grammar converter
    writes only the declared keys there (JSON Schema itself would allow any other key, and llguidance follows
    JSON Schema), so a model cannot add keys until it runs out of tokens. The members of an ``allOf`` are not
    closed themselves (each would forbid the others' keys), their nested schemas are."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE_SCHEMA + ("additionalProperties",):
        if isinstance(out.get(k), dict):
            out[k] = close_objects(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [close_objects(s) for s in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, _in_all_of=True) for s in out["allOf"]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: close_objects(s) for name, s in out[k].items()}
    kind = out.get("type")
    is_object = kind in (None, "object") or isinstance(kind, list) and "object" in kind
    if (not _in_all_of and is_object and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out and "allOf" not in out):
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: dict | bool) -> str:
    """The llguidance grammar of a JSON schema (a dict, or True: any JSON value), its objects closed as llama.cpp
    closes them (:func:`close_objects`). GrammarError when it is not one."""
    import llguidance

    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {json.dumps(schema)[:80]}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"not a JSON schema llguidance takes ({one_line_error(str(e))})") from None


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect: ``%json {schema}``, ``<[id]>``)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def text_grammar(text: str) -> str:
    """The llguidance grammar of a GBNF (llama.cpp's) or Lark grammar text. GrammarError when it cannot be read."""
    import llguidance

    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise GrammarError(one_line_error(str(e)) if str(e) else "the grammar cannot be read") from None


def json_lark(schema: dict) -> str:
    """``%json {...}``: a JSON schema inside a Lark grammar (llguidance's JSON options as :data:`JSON_OPTIONS`)."""
    schema = close_objects(schema)
    schema.setdefault("x-guidance", {k: v for k, v in JSON_OPTIONS.items()})
    return "%json " + json.dumps(schema, ensure_ascii=False)


_REGEX_ERROR = re.compile(r"(?:invalid regex .*?: )?regex parse error:\n {4}(?P<regex>.*)\n.*?\nerror: (?P<why>[^\n]*)",
                          re.S)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(?P<keys>[^\]]*)\]")


def one_line_error(message: str, schema: bool = False) -> str:
    """llguidance's error message as one line that names the problem: without the position in the grammar it built
    and the listing of that grammar (internal: a request's schema is a line of it); a regex that cannot be read as
    ``the regex "..." (a 'pattern') cannot be read: why``; unimplemented keys as the JSON schema keywords that
    cannot be enforced. ``schema``: the grammar holds a JSON schema (a regex there is a ``pattern``'s)."""
    text = re.sub(r"^at \d+\(\d+\): ", "", message.strip())
    text = text.removeprefix("failed to compile JSON schema: ")
    if m := _REGEX_ERROR.search(text):
        where = " (a 'pattern')" if schema or "JSON schema" in message else ""
        return f"the regex {json.dumps(m['regex'], ensure_ascii=False)}{where} cannot be read: {m['why']}"
    if m := _UNIMPLEMENTED.search(text):
        keys = [k.strip() for k in m["keys"].split(",") if k.strip()]
        names = ", ".join(f"'{k.strip(chr(34))}'" for k in keys)
        return (f"the keyword{'s' if len(keys) > 1 else ''} {names} {'are' if len(keys) > 1 else 'is'} not "
                f"supported (leave {'them' if len(keys) > 1 else 'it'} out, or check the value after the reply)")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "the grammar does not compile"


def check_grammar(grammar: str, tok: Any, n_vocab: int) -> None:
    """GrammarError with llguidance's message (:func:`one_line_error`) when ``grammar`` does not compile for this
    vocabulary."""
    import llguidance

    bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tok, n_vocab))
    if bad:
        schema = "%json" in grammar or "json_schema" in grammar
        raise GrammarError(one_line_error(messages[0], schema) if messages else "the grammar does not compile")


class Constraint:
    """One sequence's grammar state. ``mask(logits)`` -> float32 logits [n_vocab] with every token the grammar
    forbids at -inf (a new tensor on the logits' device); ``consume(token)`` advances it by the sampled token.
    GrammarError when the grammar does not compile, or a token it forbade was consumed."""

    def __init__(self, grammar: str, tok: Any, n_vocab: int):
        import llguidance

        self.n_vocab = n_vocab
        self.llt = ll_tokenizer(tok, n_vocab)
        self.matcher = llguidance.LLMatcher(self.llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(one_line_error(self.matcher.get_error()))
        self.eos = sorted(tok.eos_ids)

    def allowed(self) -> torch.Tensor:
        """bool [n_vocab]: the tokens the grammar allows next."""
        # little-endian bits: token 8*b + k is bit k of byte b (numpy's unpackbits: ~50x faster than the same in
        # torch ops on a 150k vocabulary, where it was most of a constrained step's sampling time)
        ok = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.n_vocab, dtype=np.bool_)
        n = min(self.n_vocab, ok.size)
        out[:n] = ok[:n]
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        if not out.any():  # nothing fits (the grammar is done): end the generation
            out[self.eos[:1]] = True
        return torch.from_numpy(out)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        ok = self.allowed().to(logits.device)
        return torch.where(ok, logits.float(), torch.tensor(float("-inf"), device=logits.device))

    def consume(self, token: int) -> None:
        if token in self.eos and (self.matcher.is_accepting() or self.matcher.is_stopped()):
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar ({self.matcher.get_error()})")

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete string of the grammar."""
        return self.matcher.is_accepting() or self.matcher.is_stopped()
