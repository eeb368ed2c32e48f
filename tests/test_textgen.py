"""moestream.textgen: text events with stop strings and hold-back (the library generation API)."""

from __future__ import annotations

import random

import pytest

from conftest import DEFAULT_GGUF
from moestream.engine import Engine, Sampler, SamplingParams
from moestream.errors import ConfigError
from moestream.models.base import LoadOptions, load_model
from moestream.textgen import DoneEvent, StopStrings, TokenEvent, text_events
from moestream.tokenizer import GGUFTokenizer


def test_hold_back_release_and_stop() -> None:
    m = StopStrings(["abc"])
    assert m.feed("xa") == ("x", None)  # "a" may start "abc": held
    assert m.feed("b") == ("", None)
    assert m.feed("d") == ("abd", None)  # not a stop after all: released
    assert m.feed("zab") == ("z", None)
    assert m.feed("cq") == ("", "abc")  # completed across pieces: nothing of it (or after it) is released
    m = StopStrings(["abc"])
    m.feed("ab")
    assert m.flush() == "ab"  # the end came first: the held text is flushed


def test_earliest_stop_wins() -> None:
    assert StopStrings(["world", "lo w"]).feed("hello world") == ("hel", "lo w")
    assert StopStrings(["b", "ab"]).feed("xab") == ("x", "ab")
    with pytest.raises(ConfigError):
        StopStrings([""])


def test_random_pieces_match_a_reference() -> None:
    rng = random.Random(5)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m = StopStrings(stops)
        out, found = "", None
        for p in pieces:
            released, found = m.feed(p)
            out += released
            if found:
                break
        if not found:
            out += m.flush()
        hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        want = text[:min(hits)[0]] if hits else text
        assert out == want, (text, stops, pieces)
        assert (found is not None) == bool(hits)


@pytest.fixture(scope="module")
def model_and_tok():  # noqa: ANN201
    model = load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False))
    return model, GGUFTokenizer.from_fields(model.gguf.fields, model.gguf.path)


def _events(model, tok, n: int, stop=()):  # noqa: ANN001, ANN202
    engine = Engine(model)
    prompt = tok.encode("The history of the printing press")
    gen = engine.stream(prompt, n, Sampler(SamplingParams(temp=0)))
    return list(text_events(gen, tok, stop)), gen


def test_text_equals_decode_and_a_stop_string_ends_it(model_and_tok) -> None:  # noqa: ANN001
    model, tok = model_and_tok
    events, gen = _events(model, tok, 24)
    assert isinstance(events[-1], DoneEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    ids = [e.id for e in events[:-1]]
    full = "".join(e.text for e in events)
    assert full == tok.decode(ids, skip_special=True)
    assert events[-1].stop is None and gen.stats.stop_reason in ("n_predict", "eos")
    cut = len(full) // 2
    stop = full[cut:cut + 3]
    if len(stop) < 3 or not stop.strip():
        pytest.skip("the greedy text is too short or blank here")
    events2, gen2 = _events(model, tok, 24, [stop])
    text2 = "".join(e.text for e in events2)
    assert text2 == full[:full.find(stop)]
    assert events2[-1].stop == stop and gen2.stats.stop_reason == "stop"
    assert len(events2) < len(events)  # the stop string is mid-text: the generation ended there
    assert gen2.stats.n_decode == len(events2) - 2  # no forward pass after the token that completed it
    assert [e.id for e in events2[:-1]] == ids[:len(events2) - 1]
