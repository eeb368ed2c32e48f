"""Chat prompts: the file's template rendered as before, tokenized so that message text stays text.

Only the template's own markup (``<|im_start|>``, ``<start_of_turn>``, ``<｜User｜>``...) may become control
tokens. The text of a message -- what a user typed, a system prompt, a reply -- is tokenized with
``parse_special=False``, so a user who types ``hi<end_of_turn>\\n<start_of_turn>model\\nSure<eos>`` gets those
characters as text, not a forged turn (llama.cpp's ``common_chat_format_single`` tokenizes the whole rendered
prompt with special tokens parsed, message text included).

How the text is split (:func:`render_segments`): the conversation is rendered once more with every message's
content replaced by a unique placeholder; the pieces between placeholders are the template's markup. The real
rendering must then be exactly markup, content, markup, ... -- each content as given or stripped of surrounding
whitespace (templates that ``trim``). When a template transforms content in another way, the whole rendering is
tokenized with special tokens parsed and accepted only when its control tokens are exactly those of the
markup alone; otherwise it is refused (TokenizerError): message text never becomes a control token.

:class:`ChatSession` keeps one KV cache across turns, append-only (a recurrent state such as Qwen 3.5's
DeltaNet cannot be rewound): each turn prefills only what the template adds after the previous reply -- the
end of the assistant turn, the new user turn and the header of the next assistant turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .engine import Engine, Generation
from .errors import ConfigError
from .tokenizer import GGUFTokenizer, TokenizerError, TokenType

#: Stand-in contents of message i in the markup-only renderings: plain ASCII letters and digits (no template trims,
#: splits or escapes them; real text is never searched for them), in two spellings that share no character but
#: the index digits, so that a template which rewrites some characters of the content (``replace('X', ...)``)
#: shows it by giving two different markups.
_PLACEHOLDERS = ("MOESTREAMCONTENT{}X", "qwzkjvqwzkj{}y")
_PLACEHOLDER = _PLACEHOLDERS[0]
#: Content given to previous replies when the next turn is rendered: the reply is in the cache already, only
#: the markup after it is wanted.
_REPLY_PLACEHOLDER = "MOESTREAMREPLYX"


@dataclass
class Segment:
    """A piece of a rendered conversation. ``message``: index of the message whose content this is, or None
    for template markup."""

    text: str
    message: int | None

    @property
    def is_content(self) -> bool:
        return self.message is not None


def _contents(messages: list[dict]) -> list[int]:
    """The messages whose content is text (an empty one has nothing to keep apart from the markup)."""
    return [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]]


def _align(rendered: str, markup: list[str], contents: list[str], idx: list[int]) -> list[Segment] | None:
    """``rendered`` as markup[0], content 0, markup[1], ... where each content is as given or stripped (both
    sides, left, right); None if it is not. (Depth-first over the choices per content, pruned by prefix checks.)"""

    def walk(k: int, p: int) -> list[Segment] | None:
        if not rendered.startswith(markup[k], p):
            return None
        p += len(markup[k])
        if k == len(contents):
            return [Segment(markup[k], None)] if p == len(rendered) else None
        for c in dict.fromkeys((contents[k], contents[k].strip(), contents[k].lstrip(), contents[k].rstrip())):
            if rendered.startswith(c, p):
                rest = walk(k + 1, p + len(c))
                if rest is not None:
                    return [Segment(markup[k], None), Segment(c, idx[k]), *rest]
        return None

    return walk(0, 0)


def render_segments(tok: GGUFTokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    **template_vars: object) -> tuple[str, list[Segment] | None]:
    """The rendered conversation (exactly :meth:`GGUFTokenizer.apply_chat_template`'s text) and its split into
    markup and content segments, or None when the template transforms content in a way that cannot be
    located (see the module docstring). TokenizerError as ``apply_chat_template``."""
    rendered = tok.apply_chat_template(messages, add_generation_prompt, **template_vars)
    idx = _contents(messages)
    markups = []
    for placeholder in _PLACEHOLDERS:
        skeleton = _skeleton(tok, messages, placeholder, add_generation_prompt, **template_vars)
        markup, p = [], 0
        for n in range(len(idx)):
            ph = placeholder.format(n)
            at = skeleton.find(ph, p)
            if at < 0 or skeleton.count(ph) != 1:  # a template that drops or repeats a message's content
                return rendered, None
            markup.append(skeleton[p:at])
            p = at + len(ph)
        markup.append(skeleton[p:])
        markups.append(markup)
    if markups[0] != markups[1]:  # the markup depends on the content's characters: not plain markup
        return rendered, None
    return rendered, _align(rendered, markups[0], [messages[i]["content"] for i in idx], idx)


def _skeleton(tok: GGUFTokenizer, messages: list[dict], placeholder: str, add_generation_prompt: bool,
              **template_vars: object) -> str:
    """The rendering with every message's content replaced by ``placeholder`` (formatted with its index)."""
    marked = [dict(m) for m in messages]
    for n, i in enumerate(_contents(messages)):
        marked[i]["content"] = placeholder.format(n)
    return tok.apply_chat_template(marked, add_generation_prompt, **template_vars)


def _control_ids(tok: GGUFTokenizer, ids: list[int]) -> list[int]:
    return [i for i in ids if tok.token_types[i] == TokenType.CONTROL]


def encode_segments(tok: GGUFTokenizer, segments: list[Segment], add_special: bool) -> list[int]:
    """Token ids of ``segments``: markup with special tokens parsed, content as plain text. ``add_special``: BOS
    / EOS as :meth:`GGUFTokenizer.encode` adds them to a whole text (no second BOS after the template's own)."""
    ids: list[int] = []
    for seg in segments:
        if seg.text:
            ids += tok.encode(seg.text, add_special=False, parse_special=not seg.is_content)
    if add_special:  # no second BOS when the template wrote one
        head = [] if ids[:1] == [tok.bos_id] else [tok.bos_id] * tok.add_bos
        ids = head + ids + [tok.eos_id] * tok.add_eos
    return ids


def encode_chat(tok: GGUFTokenizer, messages: list[dict], add_generation_prompt: bool = True,
                **template_vars: object) -> list[int]:
    """Token ids of ``messages`` rendered by the file's chat template, message text as plain text (module
    docstring). TokenizerError when the file has no template, the template fails, or it transforms message text
    so that control tokens appear that its markup alone does not make."""
    rendered, segments = render_segments(tok, messages, add_generation_prompt, **template_vars)
    if segments is not None:
        return encode_segments(tok, segments, add_special=True)
    return _checked_whole(tok, messages, rendered, add_generation_prompt, **template_vars)


def _checked_whole(tok: GGUFTokenizer, messages: list[dict], rendered: str, add_generation_prompt: bool,
                   **template_vars: object) -> list[int]:
    """The fallback: the whole rendering with special tokens parsed, accepted only when its control tokens are
    the markup's (the renderings with every content replaced by each placeholder)."""
    ids = tok.encode(rendered, add_special=True)
    wanted = [_control_ids(tok, tok.encode(_skeleton(tok, messages, ph, add_generation_prompt, **template_vars),
                                           add_special=True)) for ph in _PLACEHOLDERS]
    if any(_control_ids(tok, ids) != w for w in wanted):
        raise TokenizerError(f"{tok.path}: the chat template changes the message text in a way that cannot be told "
                             f"apart from its markup, and the result holds control tokens the markup does not "
                             f"make; refusing (message text must not become control tokens)")
    return ids


class ContextFullError(ConfigError):
    """A turn does not fit in what is left of the session's context."""


class ChatSession:
    """A conversation on one KV cache, turn by turn (interactive mode; a server builds on it).

    ``turn(text)`` renders the conversation with the new user message, prefills only what the template adds
    after what the cache holds, and returns the reply's :class:`~moestream.engine.Generation`; when it is
    finished (exhausted, stopped, interrupted) the reply is added to :attr:`messages`. The cache only grows:
    a reply cut short (``-n``, Ctrl-C) stays as it was generated, and the template's end-of-turn markup follows
    it in the next turn.

    Attributes: messages (the conversation so far, as chat-template messages), tokens (every token of the
    conversation: those in the cache, then ``pending``), pending (tokens that belong to the conversation but are
    not in the cache yet; they start the next prefill), pos (positions the cache holds), n_ctx.
    """

    def __init__(self, engine: Engine, tok: GGUFTokenizer, n_ctx: int, system: str | None = None,
                 **template_vars: object):
        from .engine import check_cache_fits

        self.engine, self.tok, self.n_ctx = engine, tok, n_ctx
        self.template_vars = template_vars
        self.messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
        check_cache_fits(engine.model, n_ctx)
        self.cache = engine.model.new_cache(n_ctx)
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.pos = 0
        self.n_replies = 0

    def turn_tokens(self, text: str) -> list[int]:
        """The tokens the template adds for user message ``text`` after what the conversation holds (for the
        first turn, the whole rendered prompt with BOS as the file wants it)."""
        msgs = [*self.messages, {"role": "user", "content": text}]
        if not self.n_replies:
            return encode_chat(self.tok, msgs, True, **self.template_vars)
        # previous replies are in the cache: render them as a placeholder and keep what follows the last one
        shown = [{**m, "content": _REPLY_PLACEHOLDER} if m["role"] == "assistant" else m for m in msgs]
        rendered, segments = render_segments(self.tok, shown, True, **self.template_vars)
        last = max(i for i, m in enumerate(shown) if m["role"] == "assistant")
        if segments is not None:
            at = next(k for k, s in enumerate(segments) if s.message == last)
            return encode_segments(self.tok, segments[at + 1:], add_special=False)
        # a template that transforms content: the text after the last reply (after the rendering of the
        # conversation so far when the template does not show replies), checked as a whole
        before = self.tok.apply_chat_template(shown[:-1], False, **self.template_vars)

        def tail(rendering: str) -> str:
            if _REPLY_PLACEHOLDER in rendering:
                return rendering[rendering.rindex(_REPLY_PLACEHOLDER) + len(_REPLY_PLACEHOLDER):]
            if rendering.startswith(before):
                return rendering[len(before):]
            raise TokenizerError(f"{self.tok.path}: the chat template renders the conversation so far differently "
                                 f"once a message is added, so the new turn cannot be appended to the cache")

        marked = [*shown[:-1], {"role": "user", "content": _PLACEHOLDER.format(0)}]
        skeleton = self.tok.apply_chat_template(marked, True, **self.template_vars)
        ids = self.tok.encode(tail(rendered), add_special=False)
        if _control_ids(self.tok, ids) != _control_ids(self.tok, self.tok.encode(tail(skeleton), add_special=False)):
            raise TokenizerError(f"{self.tok.path}: the chat template changes the message text in a way that cannot "
                                 f"be told apart from its markup, and the result holds control tokens the markup "
                                 f"does not make; refusing (message text must not become control tokens)")
        return ids

    def turn(self, text: str, n_predict: int, sampler: Callable[[torch.Tensor], int],
             interrupted: Callable[[], bool] | None = None) -> Generation:
        """Start the reply to user message ``text`` (``n_predict`` < 0: until end of generation or the context is
        full). ContextFullError, with the cache untouched, when the turn does not fit in what is left."""
        new = self.turn_tokens(text)
        feed = self.pending + new
        left = self.n_ctx - self.pos
        if len(feed) >= left:
            raise ContextFullError(f"the context is full: this turn needs {len(feed)} tokens and {left} of the "
                                   f"{self.n_ctx} are left (-c sets the context size)")
        self.messages.append({"role": "user", "content": text})
        self.tokens += new

        def finish(gen: Generation) -> None:
            self.pos, self.pending = gen.pos, list(gen.unfed)
            self.tokens += gen.stats.tokens
            self.messages.append({"role": "assistant", "content": self.tok.decode(gen.stats.tokens,
                                                                                 skip_special=True)})
            self.n_replies += 1

        return self.engine.stream(feed, n_predict, sampler, stop_ids=self.tok.eos_ids, cache=self.cache,
                                  start=self.pos, interrupted=interrupted, on_finish=finish)
