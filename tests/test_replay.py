"""``moestream replay``: the terminal player (a Textual app driven by its pilot) and the HTML page (in a real
headless Chromium through Playwright), on a trace of a real run of the embedded model.

Chromium: Debian's /usr/bin/chromium (scripts/test.sh installs it); without it the page tests skip, unless
``MOESTREAM_REQUIRE_BROWSER=1`` (scripts/test.sh sets it) makes that a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from conftest import load_tool
from helpers import cli
from moestream.replay import BLOCKS, frame_text, make_app, strip_lines, timeline
from moestream.runtrace import read_trace

PROMPT = "The history of the printing press"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> str:
    """A trace of ``run -n 8 --slots 8``: 9 records (the prompt, then 8 tokens)."""
    path = str(tmp_path_factory.mktemp("replay") / "run.jsonl")
    p = cli("run", "-n", "8", "--temp", "0", "--slots", "8", "-p", PROMPT, "--trace", path)
    assert p.returncode == 0, p.stderr
    return path


@pytest.fixture(scope="module")
def tl(trace_path):
    return timeline(read_trace(trace_path))


def plain(widget) -> str:  # noqa: ANN001 - a Static holding a rich Text
    return widget.content.plain


def screen(app) -> str:  # noqa: ANN001
    """What the terminal shows: the text of Textual's own screenshot (SVG), one string per row, joined."""
    import html
    import re

    svg = app.export_screenshot()
    return "\n".join(html.unescape(t).replace("\xa0", " ") for t in re.findall(r"<text[^>]*>(.*?)</text>", svg))


# ------------------------------------------------------------------------------------------------ terminal
def test_terminal_player_scrubbed_with_the_arrow_keys(tl):
    recs = tl.records
    assert len(recs) == 9

    async def go() -> None:
        app = make_app(tl, autoplay=False)
        async with app.run_test(size=(110, 32)) as pilot:
            stats, text = app.query_one("#stats"), app.query_one("#text")
            assert app.pos == 0 and "token 1/9" in plain(stats) and "prefill of" in plain(stats)
            assert plain(text) == recs[0]["text"]
            for _ in range(3):
                await pilot.press("right")
            await pilot.pause()
            assert app.pos == 3
            s = plain(stats)
            r = recs[3]
            assert f"token 4/9  decode, id {r['id']}" in s and json.dumps(r["text"], ensure_ascii=False) in s
            assert f"latency {1000 * r['dt']:.2f} ms" in s and f"IO wait {1000 * r['io_wait_s']:.2f} ms" in s
            h, m = sum(r["hits"]), sum(r["misses"])
            assert f"experts: {h} hits, {m} misses" in s
            # the text as it had arrived at token 4, nothing after it
            assert plain(text) == "".join(x["text"] for x in recs[:4])
            strip = plain(app.query_one("#strip")).splitlines()
            assert strip[-1].endswith("^ token 4") and strip[0].startswith("CPU %")
            caret = strip[-1].index("^")
            assert strip[0][caret - 4] == "|" and strip[0][caret] in BLOCKS  # under the 4th token's column
            assert strip[0].count("|") == 2 and len(strip[0].split("|")[1]) == 9  # one column per token
            assert "token 4/9" in plain(app.query_one("#title")) and "paused" in plain(app.query_one("#title"))
            await pilot.press("left")
            await pilot.press("end")
            await pilot.pause()
            assert app.pos == 8 and "token 9/9" in plain(stats)
            await pilot.press("right")  # past the end: stays
            await pilot.press("pageup")
            await pilot.pause()
            assert app.pos == 0
            await pilot.press("left")
            await pilot.pause()
            assert app.pos == 0
            await pilot.press("q")
        assert not app.is_running

    asyncio.run(go())


def test_terminal_player_plays_at_the_recorded_speed(tl):
    """Playing shows every token in turn, each after its own recorded interval (x the speed): the whole trace
    takes at least the recorded time; the player stops at the last token."""
    recorded = sum(r["dt"] for r in tl.records[1:])

    async def go(speed: float) -> tuple[float, list[int]]:
        app = make_app(tl, speed=speed, autoplay=True)
        seen = []
        async with app.run_test(size=(110, 32)) as pilot:
            t0 = time.monotonic()
            while app.playing and time.monotonic() - t0 < 30:
                if not seen or seen[-1] != app.pos:
                    seen.append(app.pos)
                await asyncio.sleep(0.001)
            elapsed = time.monotonic() - t0
            if seen[-1] != app.pos:
                seen.append(app.pos)
            await pilot.pause()
            assert app.pos == len(tl) - 1 and "token 9/9" in plain(app.query_one("#stats"))
            assert "paused" in plain(app.query_one("#title"))
        return elapsed, seen

    elapsed, seen = asyncio.run(go(1.0))
    assert elapsed >= 0.95 * recorded, (elapsed, recorded)
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 8
    fast, _ = asyncio.run(go(0.25))  # a quarter of the speed: four times the recorded time at least
    assert fast >= 0.95 * 4 * recorded


def test_replay_without_a_terminal_prints_the_frame(trace_path, tl):
    p = cli("replay", trace_path, "--at", "5")
    assert p.returncode == 0, p.stderr
    assert p.stdout == frame_text(tl, 4) + "\n"
    r = tl.records[4]
    assert "".join(x["text"] for x in tl.records[:4]) + "[" + r["text"] + "]" in p.stdout
    assert "token 5/9" in p.stdout and "\n".join(strip_lines(tl, 4)) in p.stdout
    p = cli("replay", trace_path)
    assert "token 9/9" in p.stdout
    p = cli("replay", trace_path, "--at", "10")
    assert p.returncode == 1 and "tokens 1 to 9" in p.stderr


def test_terminal_player_fits_an_80x24_terminal(tl):
    """On an 80 x 24 terminal every region is on screen: the title, the text, the strip's caret, and all four
    lines of the current token's statistics."""
    async def go() -> str:
        app = make_app(tl, autoplay=False)
        async with app.run_test(size=(80, 24)) as pilot:
            for _ in range(4):
                await pilot.press("right")
            await pilot.pause()
            return screen(app)

    shown = asyncio.run(go())
    r = tl.records[4]
    assert "token 5/9 |" in shown and "^ token 5" in shown
    assert f"token 5/9  decode, id {r['id']}" in shown and f"latency {1000 * r['dt']:.2f} ms" in shown
    assert "experts:" in shown and "RSS " in shown and "CPU " in shown


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_trace_files_are_one_line_and_exit_1(tmp_path, trace_path):
    """A bad input file is exit status 1 for replay as for trace (2 is argparse's, for usage errors)."""
    rt = tmp_path / "routing.jsonl"
    assert cli("run", "-n", "2", "--routing-trace", str(rt)).returncode == 0  # a real file of another format
    good = open(trace_path, encoding="utf-8").read().splitlines()
    (tmp_path / "garbage.txt").write_text("this is not\nJSON lines\n")
    (tmp_path / "other.jsonl").write_text('{"format": "chrome-trace", "traceEvents": []}\n')
    (tmp_path / "cut.jsonl").write_text("\n".join(good[:4]) + "\n" + good[4][:30])
    (tmp_path / "header-only.jsonl").write_text(good[0] + "\n")
    cases = {"missing.jsonl": "no such file", "garbage.txt": "not JSON", "other.jsonl": "not a moestream run trace",
             "routing.jsonl": "a routing trace", "cut.jsonl": "line 5 is not JSON",
             "header-only.jsonl": "no token records"}
    for name, why in cases.items():
        path = str(tmp_path / name)
        for extra in ([], ["--html", str(tmp_path / "out.html")]):
            p = cli("replay", path, *extra)
            assert p.returncode == 1, (name, p.stderr)
            assert p.stdout == "" and p.stderr.count("\n") == 1 and path in p.stderr and why in p.stderr, p.stderr
            assert "Traceback" not in p.stderr
    assert not (tmp_path / "out.html").exists()
    for name in ("missing.jsonl", "garbage.txt"):  # trace: the same kind of error, the same status
        p = cli("trace", str(tmp_path / name))
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert cli("replay", trace_path, "--speed").returncode == 2  # usage: argparse's status


# ------------------------------------------------------------------------------------------------ HTML
@pytest.fixture(scope="module")
def browser_tool():
    tool = load_tool("browser")
    why = tool.available()
    if why:
        if os.environ.get("MOESTREAM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MOESTREAM_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    return tool


def test_html_page_in_headless_chromium(tmp_path, trace_path, tl, browser_tool):
    """The page, opened from disk in an offline browser: no request leaves it; scrubbing the range input to token
    N moves the cursor of the text, of every plot and the readout to N; hovering a token shows its statistics."""
    from playwright.sync_api import sync_playwright

    out = tmp_path / "replay.html"
    p = cli("replay", trace_path, "--html", str(out))
    assert p.returncode == 0 and p.stdout == "" and "page of 9 tokens" in p.stderr
    src = out.read_text(encoding="utf-8")
    assert "<script src" not in src and "<link" not in src
    recs = tl.records
    with sync_playwright() as pw:
        b = browser_tool.launch(pw)
        ctx = b.new_context(offline=True, viewport={"width": 1100, "height": 900})
        page = ctx.new_page()
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        page.wait_for_selector("#plots svg")
        assert errors == [] and requests == [out.as_uri()]
        # every token is a span of the text, prefill first
        spans = page.locator("#text .tok")
        assert spans.count() == 9
        assert page.inner_text("#text").replace("\u200b", "") == "".join(r["text"] for r in recs)
        # the page opens at the last token; Home, then 4 x ArrowRight on the scrubber: token 5
        scrub = page.locator("#scrub")
        assert scrub.input_value() == "8" and "token 9/9" in page.inner_text("#readout")
        scrub.focus()
        page.keyboard.press("Home")
        for _ in range(4):
            page.keyboard.press("ArrowRight")
        assert scrub.input_value() == "4"
        r = recs[4]
        ro = page.inner_text("#readout")
        assert ro.startswith(f"token 5/9  decode, id {r['id']}")
        assert f"text {json.dumps(r['text'], ensure_ascii=False)}" in ro
        assert f"latency {1000 * r['dt']:.2f} ms" in ro and f"IO wait {1000 * r['io_wait_s']:.2f} ms" in ro
        h, m = sum(r["hits"]), sum(r["misses"])
        assert f"experts {h} hits, {m} misses" in ro
        assert page.inner_text("#pos") == "token 5/9"
        assert page.locator("#cur-text").text_content() == r["text"]
        assert page.locator("#text .tok.cur").get_attribute("data-i") == "4"
        assert page.locator("#text .tok.later").count() == 4
        # one cursor through all five plots, at the same x
        xs = page.eval_on_selector_all(".plot .cursor", "els => els.map(e => e.getAttribute('x1'))")
        assert len(xs) == 5 and len(set(xs)) == 1
        x5 = float(xs[0])
        page.keyboard.press("ArrowRight")
        assert float(page.get_attribute(".plot .cursor", "x1")) > x5
        assert "token 6/9" in page.inner_text("#readout")
        # the plots hold the trace's values: the latency plot's highest point is the slowest token
        names = page.eval_on_selector_all(".plot > text:first-of-type", "els => els.map(e => e.textContent)")
        assert names == ["latency ms", "IO wait ms", "expert hit rate %", "CPU %", "power W"]
        top = page.text_content("#plot-latency_ms text:nth-of-type(2)")
        assert top == f"max {max(tl.latency_ms):.1f}"
        # hovering a token shows its statistics without moving the cursor
        page.hover("#text .tok[data-i='2']")
        tip = page.locator("#tip")
        assert tip.is_visible() and tip.inner_text().startswith("token 3/9  decode")
        assert json.dumps(recs[2]["text"], ensure_ascii=False) in tip.inner_text()
        assert page.inner_text("#hovered") == "3" and scrub.input_value() == "5"
        page.mouse.move(5, 5)
        assert not tip.is_visible()
        # clicking a token moves the cursor there
        page.click("#text .tok[data-i='0']")
        assert scrub.input_value() == "0" and page.inner_text("#readout").startswith("token 1/9  prefill of")
        assert errors == [] and requests == [out.as_uri()]
        b.close()


def test_html_page_holds_markup_as_text(tmp_path, browser_tool):
    """A prompt that looks like markup (a script end tag, a comment start, an element) is text on the page."""
    from playwright.sync_api import sync_playwright

    prompt = 'a </script><!-- <b onmouseover="x()">bold</b> & c'
    trace, out = tmp_path / "t.jsonl", tmp_path / "t.html"
    assert cli("run", "-n", "3", "--temp", "0", "-p", prompt, "--trace", str(trace)).returncode == 0
    assert cli("replay", str(trace), "--html", str(out)).returncode == 0
    recs = read_trace(str(trace)).tokens
    with sync_playwright() as pw:
        b = browser_tool.launch(pw)
        page = b.new_context(offline=True).new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        page.wait_for_selector("#plots svg")
        assert errors == []
        assert page.locator("#text .tok").first.text_content() == recs[0]["text"] and prompt in recs[0]["text"]
        assert page.locator("#text b").count() == 0
        b.close()
