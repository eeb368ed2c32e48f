"""Headless Chromium for the replay page's tests and screenshot (tests/test_replay.py, tools/replay_screenshot.py).

Debian's Chromium (``apt-get install -y chromium``: /usr/bin/chromium; scripts/test.sh installs it) driven by
Playwright's Python package (pinned in pyproject.toml's ``test`` extra). Playwright's own browser download
(``playwright install``) is never used: :func:`launch` points it at the system binary.
"""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("MOESTREAM_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def available() -> str | None:
    """None when the browser can be used, else why not (one line)."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[test]')"
    return None


def launch(p):  # noqa: ANN001, ANN201 - playwright.sync_api.Playwright -> Browser
    """The system Chromium, headless, through Playwright ``p`` (``with sync_playwright() as p``)."""
    return p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
