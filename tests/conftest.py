"""Shared pytest fixtures.

``qwen3moe_tiny`` is a real tiny Qwen3-MoE model: a transformers checkpoint plus the F32/BF16/Q8_0 GGUF
files llama.cpp's converter makes from it (built once by ``tools/fixtures.py`` and cached under
``$MOESTREAM_CACHE``, default ``~/.cache/moestream``; a cold build takes a few minutes).

``llama_cpp`` is the ``llama_cpp`` module of llama-cpp-python, built from source once by
``tools/llamacpp.py`` and installed by ``scripts/test.sh``; tests that use it are marked ``llamacpp``. Where
it is not installed they are skipped, unless ``MOESTREAM_REQUIRE_LLAMACPP=1`` (``scripts/test.sh`` sets it)
makes that a failure. ``qwen3moe_tiny_quants`` holds llama.cpp's own quantizations (Q4_K_M, Q5_K_M, Q6_K,
Q8_0, Q4_0, IQ4_XS) of the F32 file; ``qwen3moe_tiny_iquants`` the importance-matrix types (IQ1_S ... IQ3_S,
TQ1_0, TQ2_0, MXFP4_MOE) and a mixed per-tensor file made by llama.cpp's ``llama-quantize`` tool.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.register_assert_rewrite("helpers")  # tests/helpers.py: shared helpers that assert

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO_ROOT / "src" / "moestream" / "data" / "default.gguf"

# The slowest files (Triton's interpreter; in one process on the busy 2-core machine, 2026-12-05: test_gpu_path.py
# 14.6 min, test_gpu_path_tier.py 15.4 min). Under xdist they go first: with xdist's own order (most tests first)
# test_gpu_path.py was the 39th file of 59, and a clean-clone CI run of 56.5 min ended with one worker alone in it
# (then 33.5 min in one process, the tier cases included) for ~20 min.
SLOW_FIRST = ("test_gpu_path.py", "test_gpu_path_tier.py")


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In an xdist worker: SLOW_FIRST's files first, then the others in the order xdist's loadfile gives them
    by default (most tests first, ties in collection order), each file's tests in their own order. scripts/test.sh
    passes ``--no-loadscope-reorder``, so the workers' files are handed out in this order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files = [item.nodeid.split("::", 1)[0] for item in items]  # xdist's loadfile scope
    count = Counter(files)

    def rank(f: str) -> tuple[int, int]:
        name = Path(f).name
        return (SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST), -count[f])

    order = sorted(range(len(items)), key=lambda i: rank(files[i]))  # stable
    items[:] = [items[i] for i in order]


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` by path (``tools`` is not a package) as ``moestream_tools_<name>``."""
    mod_name = f"moestream_tools_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, REPO_ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fixtures_tool() -> ModuleType:
    """The ``tools/fixtures.py`` module."""
    return load_tool("fixtures")


@pytest.fixture(scope="session")
def make_default_model_tool() -> ModuleType:
    """The ``tools/make_default_model.py`` module (its ``DEFAULT_SPEC`` records the default model)."""
    return load_tool("make_default_model")


@pytest.fixture(scope="session")
def qwen3moe_tiny(fixtures_tool: ModuleType) -> dict[str, Any]:
    """``{"ckpt", "f32", "bf16", "q8_0", "source_header", "config", ...}`` of the ``qwen3moe-tiny`` fixture."""
    return fixtures_tool.build_fixture("qwen3moe-tiny")


@pytest.fixture(scope="session")
def llama_cpp() -> ModuleType:
    """The ``llama_cpp`` module (llama-cpp-python), with llama.cpp's log output silenced."""
    try:
        import llama_cpp
    except ImportError as e:
        msg = (f"llama-cpp-python is not installed ({e}); install it with: "
               f"{sys.executable} tools/llamacpp.py install")
        if os.environ.get("MOESTREAM_REQUIRE_LLAMACPP") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    return llama_cpp


@pytest.fixture(scope="session")
def qwen3moe_tiny_quants(fixtures_tool: ModuleType, llama_cpp: ModuleType) -> dict[str, Any]:
    """``{"source", "types", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "iq4_xs", ...}``: llama.cpp's
    quantizations of the ``qwen3moe-tiny`` F32 file (fixture ``qwen3moe-tiny-llamacpp``)."""
    return fixtures_tool.build_fixture("qwen3moe-tiny-llamacpp")


@pytest.fixture(scope="session")
def qwen3moe_tiny_iquants(fixtures_tool: ModuleType, llama_cpp: ModuleType) -> dict[str, Any]:
    """``{"types", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_m", "iq3_xxs", "iq3_s", "tq1_0", "tq2_0",
    "mxfp4_moe", "mix", ...}``: llama.cpp's ``llama-quantize`` of the ``qwen3moe-tiny`` F32 file with an
    importance matrix from ``llama-imatrix`` (fixture ``qwen3moe-tiny-iquants``; the tools are built once)."""
    return fixtures_tool.build_fixture("qwen3moe-tiny-iquants")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model (``src/moestream/data/default.gguf``): trained, Shakespeare and Milton."""
    if not DEFAULT_GGUF.exists():
        pytest.fail(f"{DEFAULT_GGUF} is missing; build it with tools/train_default_model.py (docs/default-model.md)")
    return DEFAULT_GGUF


@pytest.fixture(scope="session")
def random_default_gguf(make_default_model_tool: ModuleType) -> Path:
    """The random-weight model of the embedded model's shape (``tools/make_default_model.py``, cached like every
    fixture), for the tests that need random routing."""
    return make_default_model_tool.build_random()
