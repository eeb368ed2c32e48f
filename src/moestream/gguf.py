"""GGUF model files: metadata, tensor table and split parts.

Parsing is done by the `gguf` package (GGUFReader); this module adds what moestream needs on top:
split models (``NAME-00001-of-0000N.gguf``, llama.cpp's gguf-split naming and ``split.*`` keys),
absolute per-part offsets, clear one-line errors for bad files, and a guard against the file
being truncated or replaced while it is in use.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GGUFError, ModelFileChanged

_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model.

    shape: row-major torch order (ggml ``ne`` reversed), e.g. ``[n_expert, n_ff, n_embd]`` for
    ``ffn_gate_exps``; the last dim is the row length in elements. offset: absolute byte offset of the
    tensor data in ``path``. n_bytes: bytes of the whole tensor.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_bytes: int
    path: str
    part: int
    offset: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.shape[-1] // block * size


class _CheckedReader(GGUFReader):
    """GGUFReader that refuses to read past the end of the file instead of reshaping a short array.

    It also slices a plain ndarray view of the map instead of the np.memmap subclass: the tokenizer's
    ~300k strings make the base class's per-item memmap indexing take ~10 s; this takes under 2 s.
    """

    _dtypes: dict = {}

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001 - mirrors the base class
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        order = self.byte_order if override_order is None else override_order
        key = (dtype, order)
        dt = self._dtypes.get(key)
        if dt is None:
            dt = self._dtypes[key] = np.dtype(dtype).newbyteorder(order)
        count = int(count)
        end = offset + count * dt.itemsize
        if end > len(plain):
            raise _Truncated(offset, end, len(plain))
        return plain[offset:end].view(dt)

    def _get_field_parts(self, orig_offs, raw_type):  # noqa: ANN001, ANN202 - mirrors the base class
        # The base class walks an array item by item, a numpy view per item. A corrupt count (4 billion token
        # types, say) then reads for minutes and holds millions of views before it meets the end of the file. So an
        # array's count must fit in the bytes left (each item takes at least its scalar size, a string 8 bytes, an
        # array 12), and an array of scalars is read as one view (contents() gives the same list).
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(int(raw_itype[0]))  # ValueError "N is not a valid GGUFValueType", as the base class
        nptype = self.gguf_scalar_to_np.get(itype)
        least = np.dtype(nptype).itemsize if nptype is not None else 8 if itype == GGUFValueType.STRING else 12
        start = orig_offs + 12
        if start + int(alen[0]) * least > len(self.data):
            raise _Truncated(start, start + int(alen[0]) * least, len(self.data))
        if nptype is None:
            return super()._get_field_parts(orig_offs, raw_type)
        items = self._get(start, nptype, int(alen[0]))
        return 12 + int(items.nbytes), [raw_itype, alen, items], [2], [GGUFValueType.ARRAY, itype]

    def _build_tensors(self, start_offs, fields):  # noqa: ANN001 - mirrors the base class
        # name the tensor whose type id the gguf package does not know (it raises a bare ValueError), or whose data
        # offset is far past the end of the file, as a corrupt length is (the base class adds it to the data start
        # in uint64, which wraps); one a little past the end is a truncated file, which _get reports
        for field in fields:
            _len, name_data, _n_dims, _dims, raw_dtype, offset = field.parts
            if int(start_offs) + int(offset[0]) > 2 * len(self.data) + (1 << 20):
                raise _OffsetPastEnd(bytes(name_data).decode("utf-8", errors="replace"), int(offset[0]))
            type_id = int(raw_dtype[0])
            try:
                known = GGMLQuantizationType(type_id) in GGML_QUANT_SIZES
            except ValueError:
                known = False
            if not known:
                raise _UnknownType(bytes(name_data).decode("utf-8", errors="replace"), type_id)
        return super()._build_tensors(start_offs, fields)


class _UnknownType(Exception):
    def __init__(self, tensor: str, type_id: int):
        self.tensor, self.type_id = tensor, type_id


class _OffsetPastEnd(Exception):
    def __init__(self, tensor: str, offset: int):
        self.tensor, self.offset = tensor, offset


class _Truncated(Exception):
    def __init__(self, offset: int, need: int, size: int):
        self.offset, self.need, self.size = offset, need, size


def _field_value(field) -> Any:  # noqa: ANN001 - gguf ReaderField
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - unusual field types: keep raw parts
        return None


def split_parts(path: str) -> list[str]:
    """All part paths of a split model given any one part; ``[path]`` for a single-file model.

    Raises GGUFError naming the first missing part.
    """
    m = _SPLIT_RE.match(path)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    for p in parts:
        try:
            os.stat(p)
        except FileNotFoundError:
            raise GGUFError(f"{path}: split part {p} is missing ({count} parts expected)") from None
        except OSError as e:
            raise GGUFError(f"{p}: {_os_problem(e)}") from None
    return parts


_FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"))


def _os_problem(e: OSError) -> str:
    """'permission denied', 'no such file', ... for an OSError from stat/open of a model file."""
    if isinstance(e, PermissionError):
        return "permission denied (check the permissions of the file and of the folders above it)"
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, NotADirectoryError):
        return "no such file (a component of the path is not a directory)"
    return f"cannot open: {e.strerror or e}"


def _stat_model(path: str) -> os.stat_result:
    """os.stat of a model file (following links); GGUFError naming the problem (missing, permission denied)."""
    try:
        return os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: {_os_problem(e)}") from None


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """The `gguf` package's GGUFReader over ``path`` (opened read-only), parsing the header several times faster
    than ``gguf.GGUFReader`` on tokenizer-sized metadata (``_CheckedReader``) and refusing to read past the end.

    Raises GGUFError naming the file and the problem: missing, a directory or other non-regular file, empty,
    not GGUF (magic), truncated, a corrupt header, an unknown ggml type id, an unsupported GGUF version.
    """
    path = os.fspath(path)
    st = _stat_model(path)
    if stat.S_ISDIR(st.st_mode):
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise GGUFError(f"{path}: is {kind}, not a regular file; a GGUF model must be a regular file")
    size = st.st_size
    if size == 0:
        raise GGUFError(f"{path}: empty file, not a GGUF model")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: {_os_problem(e)}") from None
    if magic != _GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _CheckedReader(path, "r")
    except _UnknownType as e:
        raise GGUFError(f"{path}: tensor {e.tensor} has ggml type {e.type_id}, which is not a known ggml type "
                        "(a newer llama.cpp, or a corrupt tensor table)") from None
    except _OffsetPastEnd as e:
        raise GGUFError(f"{path}: tensor {e.tensor} has data offset {e.offset}, far past the end of the file ("
                        f"{size} bytes): a corrupt tensor table") from None
    except _Truncated as e:
        if e.need > 2 * size + (1 << 20):  # a length field far past the end: garbage, not a cut file
            raise GGUFError(f"{path}: corrupt GGUF header (a length field points {e.need} bytes in, "
                            f"the file has {size})") from None
        raise GGUFError(
            f"{path}: truncated GGUF: needs at least {e.need} bytes, file has {size}"
        ) from None
    except ValueError as e:
        msg = str(e)
        m = re.search(r"version (\d+) which we cannot handle", msg)
        if m:
            raise GGUFError(f"{path}: GGUF version {m.group(1)} is not supported (versions 2 and 3 are)") from None
        msg = re.sub(r"np\.\w+\((-?\d+)\)", r"\1", msg)  # numpy's scalar repr, e.g. np.uint32(77) -> 77
        raise GGUFError(f"{path}: invalid GGUF: {msg}") from None
    except Exception as e:  # noqa: BLE001 - gguf raises assorted errors on corrupt headers
        raise GGUFError(f"{path}: invalid GGUF: {type(e).__name__}: {e}") from None


def describe_change(old: tuple[int, int, int, int], new: tuple[int, int, int, int]) -> str:
    """What changed between two (st_dev, st_ino, st_size, st_mtime_ns) identities of a file, for messages."""
    if new[:2] != old[:2]:
        return "was replaced by another file"
    if new[2] != old[2]:
        return f"changed size from {old[2]} to {new[2]} bytes"
    return "was modified"


class GGUFModel:
    """A GGUF model, possibly split into parts.

    Attributes:
        path: the path given by the user. paths: all part paths in order.
        fields: metadata key -> Python value (from part 1). arch: ``general.architecture``.
        tensors: name -> TensorInfo across all parts.
    Raises GGUFError for a missing/non-GGUF/truncated file or a missing split part.
    """

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        self.path = path
        self.paths = split_parts(path)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._identity: list[tuple[int, int, int, int]] = []
        self._maps: dict[int, mmap.mmap] = {}
        for part, p in enumerate(self.paths):
            reader = open_reader(p)
            if part == 0:
                for key, field in reader.fields.items():
                    if not key.startswith("GGUF."):
                        self.fields[key] = _field_value(field)
            size = os.path.getsize(p)
            align, expect = int(reader.alignment), 0
            for t in reader.tensors:
                # llama.cpp's gguf loader: each tensor's data follows the previous one's, padded to the alignment
                rel = int(t.data_offset) - int(reader.data_offset)
                if rel != expect:
                    raise GGUFError(f"{p}: tensor {t.name} has data offset {rel}, expected {expect} (tensors follow "
                                    f"each other in table order, each padded to {align} bytes)")
                expect += -(-int(t.n_bytes) // align) * align
                info = TensorInfo(
                    name=t.name,
                    ggml_type=int(t.tensor_type),
                    shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                    n_bytes=int(t.n_bytes),
                    path=p,
                    part=part,
                    offset=int(t.data_offset),
                )
                if info.offset + info.n_bytes > size:
                    raise GGUFError(
                        f"{p}: truncated GGUF: tensor {t.name} ends at byte {info.offset + info.n_bytes}, "
                        f"file has {size} bytes"
                    )
                if info.name in self.tensors:
                    raise GGUFError(f"{p}: tensor {info.name} appears in more than one split part")
                self.tensors[info.name] = info
            st = os.stat(p)
            self._identity.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            del reader
        n_split = self.fields.get("split.count")
        if n_split is not None and int(n_split) != len(self.paths):
            raise GGUFError(
                f"{path}: metadata says split.count={n_split} but {len(self.paths)} part(s) were found"
            )
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: metadata has no general.architecture")
        self.arch: str = arch

    # --- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_get(self, suffix: str, default: Any = None, required: bool = False) -> Any:
        """``{arch}.{suffix}`` metadata; GGUFError naming the key when required and absent."""
        key = f"{self.arch}.{suffix}"
        if key not in self.fields:
            if required:
                raise GGUFError(f"{self.path}: metadata key {key} is missing")
            return default
        return self.fields[key]

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name} is missing")
        return self.tensors[name]

    @property
    def file_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)

    # --- data -----------------------------------------------------------------------------
    def _map(self, part: int) -> mmap.mmap:
        """Copy-on-write map of one part (never written: pages stay backed by the file)."""
        if part not in self._maps:
            with open(self.paths[part], "rb") as f:
                self._maps[part] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[part]

    def mapped(self, info: TensorInfo) -> torch.Tensor:
        """uint8 tensor [n_bytes] viewing the tensor data in a memory map of the file (no read)."""
        self.check_unchanged()
        return torch.frombuffer(self._map(info.part), dtype=torch.uint8, count=info.n_bytes, offset=info.offset)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """uint8 tensor [n_bytes] holding a private copy of the tensor data (read with pread)."""
        out = torch.empty(info.n_bytes, dtype=torch.uint8)
        buf = memoryview(out.numpy())
        fd = os.open(info.path, os.O_RDONLY)
        try:
            done = 0
            while done < info.n_bytes:
                n = os.preadv(fd, [buf[done:]], info.offset + done)
                if n <= 0:
                    raise GGUFError(
                        f"{info.path}: short read of tensor {info.name} at offset {info.offset + done}"
                    )
                done += n
        finally:
            os.close(fd)
        return out

    def check_unchanged(self) -> None:
        """Raise ModelFileChanged if any part was truncated or replaced since it was opened.

        A memory map of a truncated file faults (SIGBUS) on access, so resident mode calls this
        before touching mapped expert data.
        """
        for p, ident in zip(self.paths, self._identity, strict=True):
            try:
                st = os.stat(p)
            except OSError as e:
                raise ModelFileChanged(f"{p}: model file disappeared while in use ({e.strerror})") from None
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if now != ident:
                raise ModelFileChanged(f"{p}: model file {describe_change(ident, now)} while in use; stopping")

    @property
    def identity(self) -> dict[str, tuple[int, int, int, int]]:
        """path -> (st_dev, st_ino, st_size, st_mtime_ns) of every part when the model was opened."""
        return dict(zip(self.paths, self._identity, strict=True))

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # tensors still view it; the map closes when they are gone
        self._maps.clear()
