#!/usr/bin/env python3
"""Record the logits of GGUF files, to check that a refactor keeps every bit (run it at the old and the new commit).

    PYTHONPATH=<checkout>/src python tools/record_logits.py OUT.npz FILE.gguf [FILE.gguf ...]
    python tools/record_logits.py --compare A.npz B.npz

Per file: a 24-token prompt's logits (every position), then 6 greedy decode steps, resident (``--moe-stream off``)
and streaming through top-k slots per layer, without and with the router lookahead (``--prefetch on``: the same bits
are its contract; batches of sequences are checked by tests/test_runner.py).
``--compare`` exits 1 naming the first file and array whose bits differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def record(path: str) -> dict[str, np.ndarray]:
    import torch

    from moestream.models.base import LoadOptions, load_model

    out: dict[str, np.ndarray] = {}
    top_k = load_model(path, LoadOptions(metadata_only=True)).top_k
    for mode, opts in (("resident", LoadOptions(moe_stream=False)), ("stream", LoadOptions(slots=top_k)),
                       ("stream-prefetch", LoadOptions(slots=top_k, prefetch=True))):
        model = load_model(path, opts)
        n_vocab = model.n_vocab
        ids = [(37 * i + 11) % min(n_vocab, 5000) for i in range(24)]
        cache = model.new_cache(40)
        with torch.inference_mode():
            logits = model.forward(torch.tensor(ids), 0, cache, logits_all=True)
            steps = [logits]
            tok = int(logits[-1].argmax())
            for j in range(6):
                lg = model.forward(torch.tensor([tok]), len(ids) + j, cache)
                steps.append(lg)
                tok = int(lg[0].argmax())
        out[f"{mode}"] = torch.cat(steps).numpy()
        model.store.close()
    return out


def main() -> int:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] != "--compare" and (len(args) < 2
                                                                             or not args[0].endswith(".npz"))):
        print(__doc__.strip())
        return 0 if args and args[0] in ("-h", "--help") else 2
    if sys.argv[1] == "--compare":
        a, b = np.load(sys.argv[2]), np.load(sys.argv[3])
        bad = 0
        for k in a.files:
            if k not in b.files:
                print(f"missing in {sys.argv[3]}: {k}")
                bad += 1
            elif a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes():
                d = np.abs(a[k] - b[k]).max() if a[k].shape == b[k].shape else "shape"
                print(f"DIFFERENT: {k} (max |diff| {d})")
                bad += 1
        print(f"{len(a.files) - bad} of {len(a.files)} arrays bitwise equal")
        return 1 if bad else 0
    res: dict[str, np.ndarray] = {}
    for f in sys.argv[2:]:
        for k, v in record(f).items():
            res[f"{Path(f).name}:{k}"] = v
        print(f"recorded {f}", file=sys.stderr)
    np.savez(sys.argv[1], **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
