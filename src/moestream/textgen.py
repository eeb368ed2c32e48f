"""Generation as text events, for every front end (``run``, ``run -cnv`` and ``serve`` use it).

:func:`text_events` turns a token-level :class:`~moestream.engine.Generation` into events: one
:class:`TokenEvent` per generated token with the text it releases (valid UTF-8 only: a character split over byte
tokens comes out whole, see :class:`~moestream.tokenizer.StreamDecoder`), then one :class:`DoneEvent` with the
final statistics. Stop strings hold text back: text that may be the start of a stop string is held until it is
known not to be (then released), or the stop string completes (then the generation ends there, the stop string
and anything after it are not emitted, as OpenAI's API and llama-server do), or the generation ends for another
reason (then the held text is flushed in the :class:`DoneEvent`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:  # torch is imported with the engine: a front end may start before it (serve)
    from .engine import Generation, GenStats


@dataclass
class TokenEvent:
    """A generated token: its id, and the text it releases (``""`` while held back or mid-character), with what it
    cost, for traces and metrics.

    - ``index``: 0 for the first generated token, 1 for the next, ...; ``pos``: its position in the sequence (the
      prompt's tokens come first).
    - ``phase``: ``"prefill"`` for the first token (sampled from the prefill's logits: its ``seconds`` are the
      whole prefill), ``"decode"`` for the others (one decode step each).
    - ``seconds``: wall time from the previous event (the first: from the start of the generation) to this one,
      the forward pass(es) and the sampling included; ``elapsed``: seconds since the start of the generation.
    - ``hits`` / ``misses`` / ``streamed_bytes`` / ``stall_seconds``: the expert store's counters since the start
      of the generation, up to this token (see :class:`~moestream.experts.pool.StoreStats`; ``stall_seconds``
      is the compute thread's IO wait).
    """

    id: int
    text: str
    index: int = 0
    pos: int = 0
    phase: str = "decode"
    seconds: float = 0.0
    elapsed: float = 0.0
    hits: int = 0
    misses: int = 0
    streamed_bytes: int = 0
    stall_seconds: float = 0.0


@dataclass
class DoneEvent:
    """The end: ``text`` is what was still held back (flushed: no stop string completed), ``stop`` the stop string
    that ended the generation (None otherwise), ``stats`` the generation's statistics (``stop_reason`` ``"stop"``
    when a stop string ended it)."""

    text: str
    stop: str | None
    stats: GenStats

    @property
    def finish_reason(self) -> str:
        """OpenAI's words: ``"stop"`` (an end-of-generation token or a stop string), ``"length"`` (the token
        limit or a full context), ``"interrupted"`` (cancelled: Ctrl-C, a client that went away, shutdown)."""
        return FINISH_REASONS.get(self.stats.stop_reason, "stop")


#: GenStats.stop_reason -> DoneEvent.finish_reason.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "n_predict": "length", "context full": "length",
                  "interrupted": "interrupted"}


class StopStrings:
    """The hold-back matcher of a set of stop strings (``option``: how errors name them).

    ``feed(piece)`` -> (text to release, the stop string found or None). When a stop string occurs in what was held
    plus ``piece``, the text before its first occurrence (the earliest; at equal positions the one listed first)
    is released and the rest dropped; otherwise everything is released except the longest end that is the start
    of some stop string. ``flush()`` releases what is held. ConfigError for an empty stop string.
    """

    def __init__(self, stops: Iterable[str] = (), option: str = "stop"):
        self.stops = [s for s in dict.fromkeys(stops)]
        for s in self.stops:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"{option}: a stop string must be non-empty text, got {s!r}")
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, piece: str) -> tuple[str, str | None]:
        buf = self._held + piece
        if not self.stops:
            self._held = ""
            return buf, None
        best: tuple[int, int] | None = None
        for i, s in enumerate(self.stops):
            at = buf.find(s)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, i)
        if best is not None:
            self._held = ""
            return buf[:best[0]], self.stops[best[1]]
        keep = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class TextEvents:
    """Iterate ``gen`` (an unstarted :class:`Generation`) as events: a :class:`TokenEvent` per generated token,
    then one :class:`DoneEvent`; ``tokenizer``: the model's GGUFTokenizer (its stream decoder; control tokens give
    no text when ``skip_special``). A stop string ends the generation at once (no further forward pass).

    Iterate once. When the iteration raises (a read fault, an interrupted stdout), :meth:`pending` gives the text
    that was still held (incomplete UTF-8 flushed as the decoder does, then held-back text), for a front end that
    ends its partial output.
    """

    def __init__(self, gen: Generation, tokenizer, stop: Iterable[str] = (), skip_special: bool = True):  # noqa: ANN001
        self.gen = gen
        self.matcher = StopStrings(stop)
        self.dec = tokenizer.stream_decoder(skip_special)

    def pending(self) -> str:
        """What is held back (decoder bytes, stop-string prefix), released; "" afterwards."""
        text, _ = self.matcher.feed(self.dec.flush())
        return text + self.matcher.flush()

    def __iter__(self) -> Iterator[TokenEvent | DoneEvent]:
        gen, matcher, dec = self.gen, self.matcher, self.dec
        store = gen.engine.model.store
        s0 = store.stats.copy() if store is not None else None
        b0 = store.bytes_read if store is not None else 0
        it = iter(gen)
        found = None
        t0 = last = time.perf_counter()
        try:
            for index, tok in enumerate(it):
                now = time.perf_counter()
                text, found = matcher.feed(dec.push(tok))
                ev = TokenEvent(tok, text, index=index, pos=gen.pos,
                                phase="prefill" if index == 0 else "decode", seconds=now - last, elapsed=now - t0)
                if s0 is not None:
                    d = store.stats - s0
                    ev.hits, ev.misses, ev.stall_seconds = d.hits, d.misses, d.stall_seconds
                    ev.streamed_bytes = store.bytes_read - b0
                last = now
                yield ev
                if found is not None:
                    break
        finally:
            it.close()  # the Generation's own finally completes its statistics
        if found is not None:
            gen.stats.stop_reason = "stop"
            yield DoneEvent("", found, gen.stats)
            return
        text, found = matcher.feed(dec.flush())
        if found is not None:
            gen.stats.stop_reason = "stop"
            yield DoneEvent(text, found, gen.stats)
            return
        yield DoneEvent(text + matcher.flush(), None, gen.stats)


def text_events(gen: Generation, tokenizer, stop: Iterable[str] = (), skip_special: bool = True  # noqa: ANN001
                ) -> Iterator[TokenEvent | DoneEvent]:
    """``iter(TextEvents(gen, tokenizer, stop, skip_special))``: see :class:`TextEvents`. The last event is always
    a :class:`DoneEvent`."""
    return iter(TextEvents(gen, tokenizer, stop, skip_special))
