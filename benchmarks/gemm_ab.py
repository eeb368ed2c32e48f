"""CPU A/B of the quantized matmul kernels (``ms_linear``: family A, Q8_0, Q4_0, ...; family B, the k-quants) of two
source trees, alternated in one process, with a bitwise check of their outputs.

    python benchmarks/gemm_ab.py --old /path/to/old/src --new src [--threads 2] [--rounds 5] [--types 12,14]

Each tree's ``moestream/csrc`` is compiled with the flags of ``kernels.py`` (``--isa``, default the best this CPU
runs) into a temporary directory; both libraries are loaded with ctypes. Shapes: family A, Gemma-4 26B-A4B's (hidden
2816): a Q8_0 attention/dense matrix [4096, 2816] and Q4_0 expert gate/up [704, 2816] and down [2816, 704]; family
B, Qwen3-30B-A3B's (hidden 2048): expert gate/up [768, 2048], down [2048, 768] and an attention matrix [4096, 2048];
at 1, 8 and 128 tokens (an expert of a 128-token prefill sees about 8). Weights are random blocks with finite fp16
scales (a few blocks with zero or negative scales), activations random normals with some rows scaled
(``--check-only``: also weight blocks with inf / NaN scales, activations with inf, NaN and 1e9, whose block
scale overflows fp16). Per case
and round each library is timed (best of a few calls) in turn; GMAC/s = rows * cols * tokens / seconds. The
outputs of the two libraries must be bitwise equal (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from moestream import kernels  # noqa: E402

#: ggml type -> (block bytes, codes per block, byte offsets of its fp16 scales (d, then dmin or m where it has one))
BYTES = {2: (18, 32, (0,)), 3: (20, 32, (0, 2)), 6: (22, 32, (0,)), 7: (24, 32, (0, 2)), 8: (34, 32, (0,)),
         20: (18, 32, (0,)), 39: (17, 32, ()), 10: (84, 256, (80, 82)), 11: (110, 256, (108,)),
         12: (144, 256, (0, 2)), 13: (176, 256, (0, 2)), 14: (210, 256, (208,)), 23: (136, 256, (0,))}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL", 39: "MXFP4", 10: "Q2_K", 11: "Q3_K",
         12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 23: "IQ4_XS"}
SHAPES = {8: [(4096, 2816)], 2: [(704, 2816), (2816, 704)]}
K_SHAPES = [(768, 2048), (2048, 768), (4096, 2048)]


def build(src: Path, isa: str, out: Path) -> ctypes.CDLL:
    csrc = src / "moestream" / "csrc"
    cmd = [kernels._compiler(), *kernels._BASE_FLAGS, *kernels._ISA_FLAGS[isa],
           *(str(csrc / u) for u in kernels._UNITS), "-o", str(out), "-lm", "-lpthread"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.ms_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return lib


def weights(t: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    bb, qk, offs = BYTES[t]
    nb = cols // qk
    w = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    if t == 39:
        w[:, :, 0] = rng.integers(118, 130, size=(rows, nb), dtype=np.uint8)
    for i, o in enumerate(offs):
        d = (rng.standard_normal((rows, nb)) * 0.01).astype(np.float16)
        if i == 0:
            d.flat[:: 97] = 0
        w[:, :, o:o + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return np.ascontiguousarray(w.reshape(rows, nb * bb))


def run(lib: ctypes.CDLL, t: int, w: np.ndarray, cols: int, x: np.ndarray, y: np.ndarray, threads: int) -> None:
    rc = lib.ms_linear(t, w.ctypes.data, w.shape[1], w.shape[0], cols, x.ctypes.data, x.shape[0], y.ctypes.data,
                       threads)
    assert rc == 0, rc


def timed(lib, t, w, cols, x, y, threads, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run(lib, t, w, cols, x, y, threads)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the old tree's src directory")
    ap.add_argument("--new", required=True, help="the new tree's src directory")
    ap.add_argument("--isa", default=kernels.best_isa())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="calls per timing (the best counts)")
    ap.add_argument("--types", default="8,2", help="ggml type numbers (8 = Q8_0, 2 = Q4_0, 12 = Q4_K, 14 = Q6_K ...)")
    ap.add_argument("--toks", default="1,8,128")
    ap.add_argument("--check-only", action="store_true", help="only the bitwise check, over every family-A and -B type")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gemm_ab."))
    try:
        old = build(Path(a.old), a.isa, tmp / "old.so")
        new = build(Path(a.new), a.isa, tmp / "new.so")
        rng = np.random.default_rng(1)
        types = [int(s) for s in a.types.split(",")]
        toks = [int(s) for s in a.toks.split(",")]
        if a.check_only:
            types, toks = list(BYTES), [1, 2, 3, 5, 8, 13, 17, 40]
        bad = 0
        for t in types:
            big = BYTES[t][1] == 256
            default = K_SHAPES if big else SHAPES.get(t, [(300, 2816), (2816, 704)])
            for rows, cols in ([(37, 768)] if big else [(37, 704)]) if a.check_only else default:
                w = weights(t, rows, cols, rng)
                offs = BYTES[t][2]
                if a.check_only and offs:  # a few weight blocks with an infinite or NaN scale
                    blocks = w.reshape(rows, cols // BYTES[t][1], BYTES[t][0])
                    blocks[rows // 2, 1, offs[0]:offs[0] + 2] = np.array([np.inf], np.float16).view(np.uint8)
                    blocks[rows // 3, 2, offs[-1]:offs[-1] + 2] = np.array([np.nan], np.float16).view(np.uint8)
                for n in toks:
                    x = rng.standard_normal((n, cols)).astype(np.float32)
                    x[:, :: 7] *= 30
                    if n > 2:
                        x[1] *= 1e-3
                        x[2, :64] = 0
                    if a.check_only and n > 5:  # non-finite activations, and one block whose fp16 scale overflows
                        x[3, 5] = np.inf
                        x[4, 100] = np.nan
                        x[5, 200:232] = 1e9
                        x[6, 300:556] = 1e-30  # a k-quant block of tiny values (its inverse scale overflows)
                    yo = np.empty((n, rows), np.float32)
                    yn = np.empty((n, rows), np.float32)
                    for th in ([1, a.threads] if a.check_only else [a.threads]):
                        run(old, t, w, cols, x, yo, th)
                        run(new, t, w, cols, x, yn, th)
                        if yo.tobytes() != yn.tobytes():
                            bad += 1
                            print(f"MISMATCH {NAMES[t]} [{rows}, {cols}] n_tok {n} threads {th}: "
                                  f"{int((yo.view(np.uint32) != yn.view(np.uint32)).sum())} elements")
                            for ti, ri in np.argwhere(yo.view(np.uint32) != yn.view(np.uint32))[:3]:
                                print(f"  token {ti} row {ri}: old {yo[ti, ri]!r} {yo.view(np.uint32)[ti, ri]:08x} "
                                      f"new {yn[ti, ri]!r} {yn.view(np.uint32)[ti, ri]:08x}")
                    if a.check_only:
                        continue
                    to, tn = [], []
                    for _ in range(a.rounds):
                        to.append(timed(old, t, w, cols, x, yo, a.threads, a.reps))
                        tn.append(timed(new, t, w, cols, x, yn, a.threads, a.reps))
                    mac = rows * cols * n / 1e9
                    print(f"{NAMES[t]:6s} [{rows:5d}, {cols:5d}] n_tok {n:4d}  GMAC/s old best {mac / min(to):6.1f} "
                          f"median {mac / statistics.median(to):6.1f}  new best {mac / min(tn):6.1f} "
                          f"median {mac / statistics.median(tn):6.1f}  (x{min(to) / min(tn):.2f} best)", flush=True)
        print("bitwise:", "EQUAL" if not bad else f"{bad} MISMATCHES")
        return 1 if bad else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
