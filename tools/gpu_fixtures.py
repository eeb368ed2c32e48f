#!/usr/bin/env python3
"""The folder of small GGUFs that ``tests/test_cuda.py`` reads (``MOESTREAM_GPU_FIXTURES=DIR``).

A GPU machine here reaches no network, so it cannot build the test fixtures; this makes them on a machine that
can, small enough to travel. For every family's tiny fixture (tools/fixtures.py: transformers checkpoint,
llama.cpp's converter) it quantizes the F32 file with llama.cpp's own quantizer (``tools/llamacpp.py quantize``,
Q4_K_M by default: Q4_K, Q6_K and Q8_0 blocks from the real tool) and cuts the vocabulary to 512 rows
(``tools/shrink_vocab.py``), giving ``DIR/<fixture>-<ftype>.gguf`` of a few MB each.

    .venv/bin/python tools/gpu_fixtures.py build/dev/fix [--ftype Q4_K_M] [--only qwen3moe-tiny ...]

Needs llama-cpp-python in this interpreter (``.venv/bin/python tools/llamacpp.py install``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures  # noqa: E402
import llamacpp  # noqa: E402
import shrink_vocab  # noqa: E402

#: one tiny fixture per family (tools/fixtures_<family>.py and fixtures.py's own)
FAMILIES = ("qwen3moe-tiny", "gemma4-tiny", "qwen35moe-tiny", "qwen2moe-tiny", "olmoe-tiny", "mixtral-tiny",
            "glm4moe-tiny", "deepseek2-tiny", "gpt-oss-tiny")


def make(out: Path, ftype: str, names: list[str], vocab: int = 512) -> list[Path]:
    """Build ``out/<name>-<ftype>.gguf`` for each fixture name; returns the paths (existing ones are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name in names:
        dst = out / f"{name}-{ftype.lower()}.gguf"
        if not dst.exists():
            f32 = fixtures.build_fixture(name)["f32"]
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                q = Path(tmp) / "q.gguf"
                llamacpp.quantize(f32, q, ftype)
                part = Path(tmp) / "s.gguf"
                shrink_vocab.shrink(str(q), str(part), vocab)
                part.rename(dst)  # whole files only: a stopped build leaves none half-written
        print(dst, f"{dst.stat().st_size / 2**20:.1f} MiB")
        made.append(dst)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ftype", default="Q4_K_M", help="llama.cpp ftype name (default Q4_K_M)")
    ap.add_argument("--only", nargs="*", choices=FAMILIES, help="these fixtures only (default: every family)")
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args(argv)
    try:
        make(a.out, a.ftype, list(a.only or FAMILIES), a.vocab)
    except (fixtures.FixtureError, llamacpp.LlamaCppError) as e:
        print(f"gpu_fixtures: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
