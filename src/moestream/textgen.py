"""Generation as text events, for every front end (issue 13's library API; ``run`` does not use it yet).

:func:`text_events` turns a token-level :class:`~moestream.engine.Generation` into events: one
:class:`TokenEvent` per generated token with the text it releases (valid UTF-8 only: a character split over byte
tokens comes out whole, see :class:`~moestream.tokenizer.StreamDecoder`), then one :class:`DoneEvent` with the
final statistics. Stop strings hold text back: text that may be the start of a stop string is held until it is
known not to be (then released), or the stop string completes (then the generation ends there, the stop string
and anything after it are not emitted, as OpenAI's API and llama-server do), or the generation ends for another
reason (then the held text is flushed in the :class:`DoneEvent`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .engine import Generation, GenStats
from .errors import ConfigError


@dataclass
class TokenEvent:
    """A generated token: its id, and the text it releases (``""`` while held back or mid-character)."""

    id: int
    text: str


@dataclass
class DoneEvent:
    """The end: ``text`` is what was still held back (flushed: no stop string completed), ``stop`` the stop string
    that ended the generation (None otherwise), ``stats`` the generation's statistics (``stop_reason`` ``"stop"``
    when a stop string ended it)."""

    text: str
    stop: str | None
    stats: GenStats


class StopStrings:
    """The hold-back matcher of a set of stop strings.

    ``feed(piece)`` -> (text to release, the stop string found or None). When a stop string occurs in what was held
    plus ``piece``, the text before its first occurrence (the earliest; at equal positions the one listed first)
    is released and the rest dropped; otherwise everything is released except the longest end that is the start
    of some stop string. ``flush()`` releases what is held. ConfigError for an empty stop string.
    """

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in dict.fromkeys(stops)]
        for s in self.stops:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop: a stop string must be non-empty text, got {s!r}")
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


def text_events(gen: Generation, tokenizer, stop: Iterable[str] = (), skip_special: bool = True  # noqa: ANN001
                ) -> Iterator[TokenEvent | DoneEvent]:
    """Iterate ``gen`` (an unstarted :class:`Generation`) as events; ``tokenizer``: the model's GGUFTokenizer
    (its stream decoder; control tokens give no text when ``skip_special``). A stop string ends the generation at
    once (no further forward pass). The last event is always a :class:`DoneEvent`."""
    matcher = StopStrings(stop)
    dec = tokenizer.stream_decoder(skip_special)
    it = iter(gen)
    found = None
    try:
        for tok in it:
            text, found = matcher.feed(dec.push(tok))
            yield TokenEvent(tok, text)
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
