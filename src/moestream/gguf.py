"""GGUF model files: metadata, tensor table and split parts.

The header of a well-formed little-endian GGUF file is parsed here (:func:`_fast_header`: a 152k-token vocabulary in
a fraction of a second); anything else -- a header that parser does not take, a big-endian file, a corrupt or
truncated one -- goes through the `gguf` package's GGUFReader (:func:`open_reader`), whose errors this module turns
into one-line messages, so both give the same fields and the same errors. On top: split models
(``NAME-00001-of-0000N.gguf``, llama.cpp's gguf-split naming and ``split.*`` keys), absolute per-part offsets, and
the file's lifetime: each part is opened once, at load, and every later read -- dense weights, the memory map of
resident experts, the expert reader's descriptors (``/proc/self/fd``) -- goes through that descriptor. So the path
may be renamed, replaced or deleted while the model runs (the descriptor keeps the bytes that were loaded, as
llama.cpp's map does); only a change of the open file's own bytes (its size or modification time, by fstat) stops
the model with :class:`ModelFileChanged` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import stat
import struct
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GGUFError, ModelFileChanged

if TYPE_CHECKING:
    import torch

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

    def _build_fields(self, offs, count):  # noqa: ANN001, ANN202 - mirrors the base class
        # the base class decodes each key's name with str(..., 'utf-8'): a name that is not UTF-8 raised Python's
        # UnicodeDecodeError ("can't decode byte 0xff in position 4"); here it is named by its index and byte offset
        # (and the key before it) and is a _NotText
        # A read past the end is named too (_Truncated.where: the key, or the key's index where its name is what
        # cannot be read), for open_reader to tell a corrupt length from a cut file
        prev = None
        for i in range(int(count)):
            where = f"metadata key {i} at byte {offs}" + (f" (after {prev})" if prev else "")
            with _naming(where + ": its name"):
                klen, kdata = self._get_str(offs)
            _check_text(bytes(kdata), where + ": its name", offs + 8)
            prev = bytes(kdata).decode("utf-8")
            if not (prev.isprintable() and len(prev) <= 200):  # a corrupt name length: name the key by its place
                prev = f"key {i} at byte {offs} (a name of {len(kdata)} bytes)"
            with _naming(f"metadata {prev}"):
                offs = super()._build_fields(offs, 1)
        return offs

    def _build_tensor_info(self, offs, count):  # noqa: ANN001, ANN202 - mirrors the base class
        # a tensor name that is not UTF-8 is a _NotText (the base class's str(..., 'utf-8') raised Python's message)
        fields = []
        for i in range(int(count)):
            with _naming(f"tensor {i} at byte {offs}: its name"):
                _n, name = self._get_str(offs)
            _check_text(bytes(name), f"tensor {i} at byte {offs}: its name", offs + 8)
            with _naming(f"tensor {bytes(name).decode('utf-8')}"):
                field = self._get_tensor_info_field(offs)
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        return offs, fields

    def _build_tensors(self, start_offs, fields):  # noqa: ANN001 - mirrors the base class
        # name the tensor whose type id the gguf package does not know (it raises a bare ValueError), or whose data
        # offset is far past the end of the file, as a corrupt length is (the base class adds it to the data start
        # in uint64, which wraps) -- unless the offsets follow each other in table order, as a cut file's do: that
        # is a truncated file, which _get reports
        last = 0
        for field in fields:
            _len, name_data, _n_dims, _dims, raw_dtype, offset = field.parts
            rel = int(offset[0])
            in_order, last = rel >= last, max(last, rel)
            if int(start_offs) + rel > 2 * len(self.data) + (1 << 20) and (not in_order or rel >= _PLAUSIBLE):
                raise _OffsetPastEnd(bytes(name_data).decode("utf-8", errors="replace"), int(offset[0]))
            type_id = int(raw_dtype[0])
            try:
                known = GGMLQuantizationType(type_id) in GGML_QUANT_SIZES
            except ValueError:
                known = False
            if not known:
                raise _UnknownType(bytes(name_data).decode("utf-8", errors="replace"), type_id)
        return super()._build_tensors(start_offs, fields)


#: a length or offset past this (1 TiB) is garbage, not a file that was cut short
_PLAUSIBLE = 1 << 40
#: A header field (a metadata value or key name, a tensor's name or dims) whose length field asks for more bytes
#: than this (16 MiB) is garbage too, wherever the file ends: the biggest of real models are a few MB (a 262k-token
#: vocabulary's strings: about 4 MB). Smaller, a read past the end is a cut file: one cut inside its metadata (a
#: 1000-byte head whose vocabulary array needs a megabyte) has a field longer than the whole file.
_FIELD_PLAUSIBLE = 16 << 20


class _NotText(Exception):
    def __init__(self, what: str, at: int, byte: int):
        self.what, self.at, self.byte = what, at, byte


def _check_text(raw: bytes, what: str, start: int) -> None:
    """_NotText naming ``what`` and the file offset of the first bad byte unless ``raw`` (at byte ``start`` of the
    file) is UTF-8."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _NotText(what, start + e.start, raw[e.start]) from None


class _UnknownType(Exception):
    def __init__(self, tensor: str, type_id: int):
        self.tensor, self.type_id = tensor, type_id


class _OffsetPastEnd(Exception):
    def __init__(self, tensor: str, offset: int):
        self.tensor, self.offset = tensor, offset


class _Truncated(Exception):
    """A read of bytes ``offset`` to ``need`` past the file's ``size``; ``where``: the header field it was for (None:
    tensor data, or not known)."""

    def __init__(self, offset: int, need: int, size: int):
        self.offset, self.need, self.size = offset, need, size
        self.where: str | None = None


class _naming:  # noqa: N801 - a context manager used as a phrase
    """Names the header field a _Truncated raised inside was for (the innermost name wins)."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:  # noqa: ANN001
        if isinstance(e, _Truncated) and e.where is None:
            e.where = self.where
        elif isinstance(e, ValueError) and "GGUFValueType" in str(e) and getattr(e, "where", None) is None:
            e.where = self.where  # the enum's "N is not a valid GGUFValueType": open_reader names the field
        return False


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


def _check_kind(path: str, st: os.stat_result) -> None:
    """GGUFError unless ``st`` is a non-empty regular file."""
    if stat.S_ISDIR(st.st_mode):
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise GGUFError(f"{path}: is {kind}, not a regular file; a GGUF model must be a regular file")
    if st.st_size == 0:
        raise GGUFError(f"{path}: empty file, not a GGUF model")


def _check_magic(path: str, magic: bytes) -> None:
    if magic != _GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")


def open_model_file(path: str) -> int:
    """A read-only descriptor of the model file ``path`` (the caller closes it), after the checks of
    :func:`open_reader`: GGUFError naming the file when it is missing, unreadable, a directory or another non-regular
    file (checked before opening: a FIFO would block), empty, or not GGUF."""
    _check_kind(path, _stat_model(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise GGUFError(f"{path}: {_os_problem(e)}") from None
    try:
        _check_kind(path, os.fstat(fd))  # what was opened, should the path have changed since the stat
        _check_magic(path, os.pread(fd, 4, 0))
    except OSError as e:
        os.close(fd)
        raise GGUFError(f"{path}: {_os_problem(e)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_reader(path: str | os.PathLike[str], fd: int | None = None) -> GGUFReader:
    """The `gguf` package's GGUFReader over ``path`` (opened read-only; or over the open descriptor ``fd``, with
    ``path`` naming it in messages), parsing the header several times faster than ``gguf.GGUFReader`` on
    tokenizer-sized metadata (``_CheckedReader``) and refusing to read past the end.

    Raises GGUFError naming the file and the problem: missing, a directory or other non-regular file, empty,
    not GGUF (magic), truncated, a corrupt header, an unknown ggml type id, an unsupported GGUF version.
    """
    path = os.fspath(path)
    if fd is None:
        fd = open_model_file(path)
        try:
            return open_reader(path, fd)
        finally:
            os.close(fd)
    st = os.fstat(fd)
    _check_kind(path, st)
    size = st.st_size
    try:
        _check_magic(path, os.pread(fd, 4, 0))
        source = os.fdopen(os.dup(fd), "rb")  # np.memmap maps it; the map outlives the descriptor
    except OSError as e:
        raise GGUFError(f"{path}: {_os_problem(e)}") from None
    try:
        return _CheckedReader(source, "r")
    except _UnknownType as e:
        raise GGUFError(f"{path}: tensor {e.tensor} has ggml type {e.type_id}, which is not a known ggml type "
                        "(a newer llama.cpp, or a corrupt tensor table)") from None
    except _OffsetPastEnd as e:
        raise GGUFError(f"{path}: tensor {e.tensor} has data offset {e.offset}, far past the end of the file ("
                        f"{size} bytes): a corrupt tensor table") from None
    except _NotText as e:
        raise GGUFError(f"{path}: invalid GGUF: {e.what} is not UTF-8 text (byte 0x{e.byte:02x} at byte {e.at})"
                        ) from None
    except _Truncated as e:
        # a file cut short keeps its lengths, so what it needs can be far past its end (a cut inside the header: a
        # 1000-byte head of a model whose vocabulary takes a megabyte); a length past any file, or a header field's
        # longer than any real one (_FIELD_PLAUSIBLE), is garbage
        if e.need > _PLAUSIBLE or e.where is not None and e.need - e.offset > _FIELD_PLAUSIBLE:
            where = f"{e.where}: " if e.where is not None else ""
            raise GGUFError(f"{path}: corrupt GGUF header ({where}a length field asks for at least "
                            f"{e.need - e.offset} bytes from byte {e.offset}, the file has {size})") from None
        raise GGUFError(
            f"{path}: truncated GGUF: the file ends at byte {size}, a read at byte {e.offset} needs at least "
            f"{e.need} bytes"
        ) from None
    except ValueError as e:
        msg = str(e)
        m = re.search(r"version (\d+) which we cannot handle", msg)
        if m:
            raise GGUFError(f"{path}: GGUF version {m.group(1)} is not supported (versions 2 and 3 are)") from None
        m = re.fullmatch(r"(?:np\.\w+\()?(\d+)\)? is not a valid GGUFValueType", msg)
        if m:  # a value type id no GGUF writer uses: a corrupt byte in the metadata
            where = getattr(e, "where", None)
            raise GGUFError(f"{path}: corrupt GGUF header ({where + ': ' if where else ''}value type {m.group(1)} "
                            "is not one of GGUF's 0-12)") from None
        msg = re.sub(r"np\.\w+\((-?\d+)\)", r"\1", msg)  # numpy's scalar repr, e.g. np.uint32(77) -> 77
        raise GGUFError(f"{path}: invalid GGUF: {msg}") from None
    except Exception as e:  # noqa: BLE001 - gguf raises assorted errors on corrupt headers
        raise GGUFError(f"{path}: invalid GGUF: {type(e).__name__}: {e}") from None
    finally:
        source.close()


@dataclass
class Header:
    """What GGUFModel takes from one part's header. fields: key -> value as ``gguf``'s ``ReaderField.contents()``
    gives it (GGUF.* keys left out; a field whose strings are not UTF-8 is None); tensors: (name, ggml type id,
    ggml ne dims, byte offset from ``data_offset``, n_bytes) in table order; data_offset: absolute.
    metadata_digest: hex BLAKE2b-128 of the header's bytes up to the end of the metadata (the key of what is derived
    from the metadata, e.g. the converted tokenizer); None where GGUFReader read the header."""

    fields: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], int, int]]
    alignment: int
    data_offset: int
    metadata_digest: str | None = None

    @classmethod
    def of_reader(cls, reader: GGUFReader) -> Header:
        fields = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        base = int(reader.data_offset)
        tensors = [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape.tolist()), int(t.data_offset) - base,
                    int(t.n_bytes)) for t in reader.tensors]
        return cls(fields, tensors, int(reader.alignment), base)


#: GGUF value type id -> numpy dtype of its scalar (little-endian); 8 is STRING, 9 ARRAY
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


#: string arrays of at least this many entries are decoded on first use (StringArray)
LAZY_STRINGS = 1024


class StringArray(Sequence):
    """A GGUF array of ``count`` strings kept as its raw bytes (each a uint64 length and UTF-8 bytes) and decoded on
    first use: a tokenizer whose conversion is cached never needs the 151k merges. Equal to a list of the same
    strings. GGUFError (naming ``path`` and ``key``) if an entry turns out not to be UTF-8."""

    __slots__ = ("_count", "_items", "_key", "_path", "_raw")

    def __init__(self, raw: bytes, count: int, path: str = "", key: str = ""):
        self._raw, self._count, self._path, self._key = raw, count, path, key
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            raw, u64, off = self._raw, _U64.unpack_from, 0
            out: list[str] = []
            push = out.append
            try:
                for _ in range(self._count):
                    (n,) = u64(raw, off)
                    push(raw[off + 8:off + 8 + n].decode("utf-8"))
                    off += 8 + n
            except UnicodeDecodeError as e:
                raise GGUFError(f"{self._path}: metadata {self._key}: entry {len(out)} is not UTF-8 ({e.reason})"
                                ) from None
            self._items, self._raw = out, b""
        return self._items

    def tolist(self) -> list[str]:
        """The strings, as a new list."""
        return list(self._decoded())

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as list
        return self._decoded()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, StringArray)):
            return self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class _NotFast(Exception):
    """The header is not one :func:`_fast_header` takes: GGUFReader reads it (and names any error)."""


def _fast_header(fd: int, size: int, fields_only: bool = False, path: str = "") -> Header | None:
    """The header of a little-endian GGUF v2/v3 file read straight from a map of ``fd`` (``size`` bytes), with the
    same values as GGUFReader's (numeric arrays through numpy's ``tolist`` as ``contents()`` does, strings UTF-8);
    None for anything it does not take -- another byte order or version, a value it does not know, a string that is
    not UTF-8 (in a long string array: GGUFError when it is first read, see StringArray), a duplicate key or
    tensor, an unknown ggml type, a row that is not whole blocks, an alignment that is
    not a power of two, tensor data past the end -- so that GGUFReader reads it and says what is wrong.
    ``fields_only``: stop after the metadata (no tensors; a header-only file is fine). String arrays of
    :data:`LAZY_STRINGS` or more entries are :class:`StringArray` (``path`` names the file in its errors)."""
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        return _parse_header(mm, size, fields_only, path)
    except (_NotFast, struct.error, IndexError, ValueError, KeyError, OverflowError, MemoryError):
        return None
    finally:
        mm.close()


def _parse_header(mm: mmap.mmap, size: int, fields_only: bool, path: str) -> Header:
    u64, u32 = _U64.unpack_from, _U32.unpack_from

    def string(off: int) -> tuple[str, int]:
        (n,) = u64(mm, off)
        end = off + 8 + n
        if end > size:
            raise _NotFast
        return mm[off + 8:end].decode("utf-8"), end

    def array(off: int, vtype: int, count: int, key: str = "") -> tuple[Any, int]:
        if vtype == 8 and count >= LAZY_STRINGS:
            start = off
            for _ in range(count):
                off += 8 + u64(mm, off)[0]
            if off > size:
                raise _NotFast
            return StringArray(mm[start:off], count, path, key), off
        if vtype == 8:
            out: list = []
            push = out.append
            for _ in range(count):
                (n,) = u64(mm, off)
                end = off + 8 + n
                if end > size:
                    raise _NotFast
                push(mm[off + 8:end].decode("utf-8"))
                off = end
            return out, off
        dt = np.dtype(_SCALARS[vtype])
        end = off + count * dt.itemsize
        if end > size:
            raise _NotFast
        return np.frombuffer(mm, dtype=dt, count=count, offset=off).tolist(), end

    if mm[:4] != _GGUF_MAGIC or u32(mm, 4)[0] not in (2, 3):
        raise _NotFast
    n_tensors, n_kv = u64(mm, 8)[0], u64(mm, 16)[0]
    off = 24
    fields: dict[str, Any] = {}
    alignment = 32
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = u32(mm, off)
        off += 4
        if key in fields or key.startswith("GGUF."):
            raise _NotFast
        if vtype == 8:
            value, off = string(off)
        elif vtype == 9:
            (itype,) = u32(mm, off)
            (count,) = u64(mm, off + 4)
            if itype == 9 or (itype != 8 and itype not in _SCALARS):
                raise _NotFast
            value, off = array(off + 12, itype, count, key)
        else:
            value, off = array(off, vtype, 1)
            value = value[0]
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise _NotFast
            alignment = value
        fields[key] = value
    digest = hashlib.blake2b(mm[:off], digest_size=16).hexdigest()
    if fields_only:
        return Header(fields, [], alignment, 0, digest)
    tensors = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name, off = string(off)
        (n_dims,) = u32(mm, off)
        if n_dims > 8:
            raise _NotFast
        dims = struct.unpack_from(f"<{n_dims}Q", mm, off + 4)
        off += 4 + 8 * n_dims
        (ggml_type,) = u32(mm, off)
        (rel,) = u64(mm, off + 4)
        off += 12
        if name in names:
            raise _NotFast
        names.add(name)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        n_elems = 1
        for d in dims:
            n_elems *= d
        if n_elems >= 2**63 or (block > 1 and n_dims and dims[0] % block):
            raise _NotFast
        tensors.append((name, ggml_type, tuple(dims), rel, n_elems * type_size // block))
    data_offset = -(-off // alignment) * alignment
    if any(data_offset + rel + n > size for _, _, _, rel, n in tensors):
        raise _NotFast
    return Header(fields, tensors, alignment, data_offset, digest)


def read_metadata(path: str) -> tuple[dict[str, Any], str | None]:
    """(fields, metadata_digest) of the GGUF file ``path`` (see :class:`Header`), reading the metadata only (a
    header-only file is fine). GGUFError naming the file where it cannot be read."""
    fd = open_model_file(path)
    try:
        header = _fast_header(fd, os.fstat(fd).st_size, fields_only=True, path=path)
        if header is None:
            return Header.of_reader(open_reader(path, fd)).fields, None
        return header.fields, header.metadata_digest
    finally:
        os.close(fd)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def describe_change(old: tuple[int, int, int, int], new: tuple[int, int, int, int]) -> str:
    """What changed between two (st_dev, st_ino, st_size, st_mtime_ns) identities of a file, for messages."""
    if new[:2] != old[:2]:
        return "was replaced by another file"
    if new[2] != old[2]:
        return f"changed size from {old[2]} to {new[2]} bytes"
    return "was modified (its mtime changed)"


class GGUFModel:
    """A GGUF model, possibly split into parts.

    Attributes:
        path: the path given by the user. paths: all part paths in order.
        fields: metadata key -> Python value (from part 1). arch: ``general.architecture``.
        metadata_digest: of part 1's metadata bytes (:class:`Header`), or None.
        tensors: name -> TensorInfo across all parts.
    Raises GGUFError for a missing/non-GGUF/truncated file or a missing split part.
    """

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        self.path = path
        self.paths = split_parts(path)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata_digest: str | None = None
        self._identity: list[tuple[int, int, int, int]] = []
        self._maps: dict[int, mmap.mmap] = {}
        #: one read-only descriptor per part, opened here; every read of the file goes through it
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        try:
            for part, p in enumerate(self.paths):
                self._open_part(part, p)
        except BaseException:
            self.close()
            raise
        n_split = self.fields.get("split.count")
        if n_split is not None and int(n_split) != len(self.paths):
            raise GGUFError(
                f"{path}: metadata says split.count={n_split} but {len(self.paths)} part(s) were found"
            )
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            if "general.architecture" in self.fields:  # None: a string that is not UTF-8 (Header)
                raise GGUFError(f"{path}: metadata general.architecture is not UTF-8 text")
            raise GGUFError(f"{path}: metadata has no general.architecture")
        self.arch: str = arch

    def _open_part(self, part: int, p: str) -> None:
        fd = open_model_file(p)
        self._fds.append(fd)
        st = os.fstat(fd)
        header = _fast_header(fd, st.st_size, path=p)
        if header is None:
            header = Header.of_reader(open_reader(p, fd))
        if part == 0:
            self.fields.update(header.fields)
            self.metadata_digest = header.metadata_digest
        size = st.st_size
        align, expect = header.alignment, 0
        for name, ggml_type, dims, rel, n_bytes in header.tensors:
            # llama.cpp's gguf loader: each tensor's data follows the previous one's, padded to the alignment
            if rel != expect:
                raise GGUFError(f"{p}: tensor {name} has data offset {rel}, expected {expect} (tensors follow "
                                f"each other in table order, each padded to {align} bytes)")
            expect += -(-n_bytes // align) * align
            info = TensorInfo(name=name, ggml_type=ggml_type, shape=tuple(reversed(dims)), n_bytes=n_bytes, path=p,
                              part=part, offset=header.data_offset + rel)
            if info.offset + info.n_bytes > size:
                raise GGUFError(
                    f"{p}: truncated GGUF: tensor {name} ends at byte {info.offset + info.n_bytes}, "
                    f"file has {size} bytes"
                )
            if info.name in self.tensors:
                raise GGUFError(f"{p}: tensor {info.name} appears in more than one split part")
            self.tensors[info.name] = info
        self._identity.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

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
        """Bytes of all parts as loaded."""
        return sum(ident[2] for ident in self._identity)

    # --- data -----------------------------------------------------------------------------
    def descriptor(self, path: str) -> int:
        """The descriptor of part ``path`` opened at load (owned by this model: do not close it)."""
        return self._fds[self.paths.index(path)]

    def open_path(self, path: str) -> str:
        """A path that opens the file part ``path`` was at load, renamed or deleted since: ``/proc/self/fd/N`` of
        its descriptor (Linux), else ``path`` itself. Opening it gives a new open file description (so O_DIRECT
        may be asked for) of the same inode."""
        fd_path = f"/proc/self/fd/{self.descriptor(path)}"
        return fd_path if os.path.exists(fd_path) else path

    def _map(self, part: int) -> mmap.mmap:
        """Copy-on-write map of one part (never written: pages stay backed by the file)."""
        if part not in self._maps:
            self._maps[part] = mmap.mmap(self._fds[part], 0, access=mmap.ACCESS_COPY)
        return self._maps[part]

    def mapped(self, info: TensorInfo) -> torch.Tensor:
        """uint8 tensor [n_bytes] viewing the tensor data in a memory map of the file (no read)."""
        import torch

        self.check_unchanged()
        return torch.frombuffer(self._map(info.part), dtype=torch.uint8, count=info.n_bytes, offset=info.offset)

    def advise_random(self, info: TensorInfo) -> None:
        """Tell the kernel the tensor's pages in the map are read at random (MADV_RANDOM): a page fault there reads
        that page, not the readahead window around it. For a row-lookup table (the token embeddings): its
        neighbouring rows are other tokens, and under a memory cap, where its pages are reclaimed and fault again,
        each readahead of them cost a few ms of a decode step (tools/profile_capped.py). Nothing where the platform
        has no madvise."""
        mm = self._map(info.part)
        if not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_RANDOM"):
            return
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_RANDOM, start, info.offset + info.n_bytes - start)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """uint8 tensor [n_bytes] holding a private copy of the tensor data (read with pread)."""
        import torch

        out = torch.empty(info.n_bytes, dtype=torch.uint8)
        self.read_into(info, 0, memoryview(out.numpy()))
        return out

    def read_into(self, info: TensorInfo, start: int, buf: memoryview) -> None:
        """Fill ``buf`` (a writable byte buffer) with the tensor's bytes from ``start`` (bytes into the tensor) by
        pread: no memory map, so nothing of the file counts in the process's resident set afterwards. GGUFError on
        a short read or a range past the tensor."""
        n_bytes = buf.nbytes
        if start < 0 or start + n_bytes > info.n_bytes:
            raise GGUFError(f"{info.path}: bytes {start}..{start + n_bytes} lie outside tensor {info.name} "
                            f"({info.n_bytes} bytes)")
        fd = self._fds[info.part]
        buf = buf.cast("B")
        done = 0
        while done < n_bytes:
            n = os.preadv(fd, [buf[done:]], info.offset + start + done)
            if n <= 0:
                raise GGUFError(f"{info.path}: short read of tensor {info.name} at offset {info.offset + start + done}")
            done += n

    def check_unchanged(self) -> None:
        """Raise ModelFileChanged (one line naming the part) if the bytes of a part the model opened changed since:
        its size or modification time, by fstat of the descriptor opened at load. A rename, a replacement of the
        path by another file or a deletion is no change: the descriptor still reads the loaded bytes.

        A memory map of a truncated file faults (SIGBUS) on access, so resident mode calls this
        before touching mapped expert data.
        """
        for p, fd, ident in zip(self.paths, self._fds, self._identity, strict=True):
            st = os.fstat(fd)
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if now != ident:
                raise ModelFileChanged(f"{p}: model file {describe_change(ident, now)} while in use")

    @property
    def identity(self) -> dict[str, tuple[int, int, int, int]]:
        """path -> (st_dev, st_ino, st_size, st_mtime_ns) of every part when the model was opened."""
        return dict(zip(self.paths, self._identity, strict=True))

    def close(self) -> None:
        """Close the maps (those tensors still view close when they are gone) and the descriptors."""
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # tensors still view it; the map closes when they are gone
        self._maps.clear()
        self._finalizer()
