"""Make docs/replay.png: a real trace of the embedded default model, its replay page, a headless-Chromium shot.

    PYTHONPATH=src python tools/replay_screenshot.py [OUT.png]

Runs ``moestream run -n 48 --slots 8 --trace`` in this process (a pool of 8 slots per layer, so that experts
are read during decode), writes the page with ``moestream replay --html``, opens it in Debian's Chromium through
Playwright (tools/browser.py), scrubs to the middle token, hovers a token, and saves a full-page PNG.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import browser  # noqa: E402
from moestream.cli import main  # noqa: E402


def main_(out: str) -> int:
    why = browser.available()
    if why:
        print(f"replay_screenshot: {why}", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as d:
        trace, page_path = os.path.join(d, "run.jsonl"), os.path.join(d, "replay.html")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "-n", "48", "--slots", "8", "--temp", "0", "-p", "The history of the printing press",
                       "--trace", trace])
            rc = rc or main(["replay", trace, "--html", page_path])
        if rc:
            return rc
        with sync_playwright() as p:
            b = browser.launch(p)
            pg = b.new_page(viewport={"width": 1000, "height": 900})
            pg.goto("file://" + page_path)
            n = pg.evaluate("window.moestreamReplay.count")
            pg.evaluate(f"window.moestreamReplay.set({n // 2})")
            pg.hover(f"#text .tok[data-i='{n // 2 + 5}']")
            pg.screenshot(path=out, full_page=True)
            b.close()
    print(f"replay_screenshot: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main_(sys.argv[1] if len(sys.argv) > 1 else "docs/replay.png"))
