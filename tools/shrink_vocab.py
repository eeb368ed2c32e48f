"""Cut a GGUF's vocabulary to its first N tokens, for small test files of real converter output.

Every tensor whose rows are the vocabulary (token_embd, output, per_layer_token_embd: ggml shape
``[..., n_vocab]``) keeps its first N rows, byte for byte (rows of a ggml tensor are contiguous blocks, so a row
range is a byte range); every other tensor and every metadata key is copied as it is, except the ``tokenizer.*``
keys, which are dropped (the vocabulary they describe is gone: the result is for feeding token ids, not text).
The blocks are the converter's and quantizer's own, so the result exercises the kernels on real blocks, at a
size that travels (a 100 MB fixture whose bulk is a 152k-row embedding becomes a few MB).

    python tools/shrink_vocab.py IN.gguf OUT.gguf --vocab 512
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def _n_vocab(reader: GGUFReader) -> int:
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(t.shape[-1])


def shrink(src: str, dst: str, vocab: int) -> None:
    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_vocab = _n_vocab(r)
    if vocab >= n_vocab:
        raise SystemExit(f"{src}: --vocab {vocab} is not below the file's {n_vocab} tokens")
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name.startswith("tokenizer.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else GGUFValueType.INT32
            if sub == GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode() for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, vals, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[-1]).decode(), vtype)
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], vtype)
    for t in r.tensors:
        dims = [int(x) for x in reversed(t.shape)]  # torch order, last = row length
        data = np.asarray(t.data)
        # the reader's array drops size-1 dims: give it the tensor's own rank (quantized: [..., row bytes])
        data = data.reshape(*dims[:-1], -1)
        if dims[0] == n_vocab and (t.name.endswith("token_embd.weight") or t.name == "output.weight"):
            data = data[:vocab]
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args(argv)
    shrink(a.src, a.dst, a.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
