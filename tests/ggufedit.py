"""Make variants of a real GGUF with the `gguf` package's writer: split parts, another architecture name,
a tensor stored in another type. Used for split-model and bad-input tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from moestream.gguf import open_reader


def read(path: str | Path) -> GGUFReader:
    """The `gguf` package's reader over ``path`` with moestream's faster header parsing (``moestream.gguf.open_reader``:
    a 152k-token vocabulary takes ~2 s instead of ~12 s); the fields and tensors are the package's own objects."""
    return open_reader(path)


def rewrite(src: str | Path, dst: str | Path, arch: str | None = None, split_max_tensors: int = 0,
            convert: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None,
            set_kv: dict[str, object] | None = None,
            add_kv: dict[str, tuple[object, GGUFValueType]] | None = None,
            drop_kv: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = (),
            add_tensors: dict[str, np.ndarray] | None = None) -> list[Path]:
    """Copy ``src`` to ``dst`` (with split parts when ``split_max_tensors``), optionally renaming the
    architecture or replacing tensors by ``convert[name](float32 array)`` (a numpy array of a plain dtype
    such as float64) or metadata values by ``set_kv`` (same value type), adding keys the file lacks,
    ``add_kv[key] = (value, type)``, or leaving out the metadata keys ``drop_kv`` or the tensors ``drop_tensors``,
    or appending tensors ``add_tensors[name]`` (float32 arrays in torch order, written F32).
    Returns the written paths."""
    r = read(src)
    old_arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch or old_arch, split_max_tensors=split_max_tensors)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or key.startswith("split."):
            continue
        if key in drop_kv:
            continue
        if arch and key.startswith(old_arch + "."):
            key = arch + key[len(old_arch):]
        if set_kv and key in set_kv:
            w.add_key_value(key, set_kv[key], f.types[0])
        elif f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for key, (value, vtype) in (add_kv or {}).items():
        if key in r.fields:
            raise ValueError(f"{src}: add_kv key {key} is already in the file (use set_kv)")
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if convert and t.name in convert:
            from gguf.quants import dequantize
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
            w.add_tensor(t.name, convert[t.name](arr))
        elif t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (add_tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    paths = [Path(p) for p in w.format_shard_names(Path(dst))] if split_max_tensors else [Path(dst)]
    w.close()
    return paths
