"""moestream.kernels (csrc/moekern.c, csrc/iquants.h) against a numpy reference of the same arithmetic.

The kernels quantize each activation row to 8-bit blocks (Q8_0 blocks of 32 for weight types in blocks of 32,
Q8_K super-blocks of 256 for the k-quants, IQ4_XS, the i-quants and the ternary types; float weights meet the
float32 activations), take integer dot products against the weight blocks and apply the float scales. The
reference here does the same in numpy: the activation quantizers are written below (and checked bit for bit
against the kernels' own, ``ms_quantize_rows``), the weights come from the gguf package's reference
dequantization (``gguf.quants.dequantize``), and the dot is taken in float64. What is left between the two
is float32 rounding, bounded below (``tolerance``).

Every build this CPU runs is checked (portable always, avx2 / avx512 when /proc/cpuinfo has the flags), on
random blocks and on real llama.cpp-made blocks: the Gemma 3 270M Q4_K_M chunks of tests/realblocks.py (F32,
Q8_0, Q5_0, Q4_K, Q6_K) and, when it has been built, the ``qwen3moe-tiny-iquants`` fixture (IQ1_S ... IQ3_S,
TQ1_0, TQ2_0, MXFP4, Q2_K, Q5_K, BF16, ...; read from the cache, never built here: skipped when absent).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import platform
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import realblocks
from moestream import kernels

T = GGMLQuantizationType
U = 2.0 ** -24  # unit roundoff of float32

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
BLOCK32_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4)
SUPER_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS,
               T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.TQ1_0, T.TQ2_0)
ALL_TYPES = FLOAT_TYPES + BLOCK32_TYPES + SUPER_TYPES
FAM_A, FAM_B, FAM_C = "A", "B", "C"  # weight x Q8_0, weight x Q8_K, float x float


def family(t: GGMLQuantizationType) -> str:
    return FAM_C if t in FLOAT_TYPES else FAM_A if t in BLOCK32_TYPES else FAM_B


# fp16 scale fields of each block (byte offsets, ggml-common.h); random blocks get sane finite values there
FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,),
    T.IQ1_S: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.TQ1_0: (52,), T.TQ2_0: (64,), T.IQ1_M: (), T.MXFP4: (),
}
# types whose weights are scale * code + offset: the byte offset of the scale d (the offset part of a weight,
# m or -dmin * mn, is what the reference dequantization gives with d = 0)
D_OF_OFFSET_TYPES = {T.Q4_1: 0, T.Q5_1: 0, T.Q2_K: 80, T.Q4_K: 0, T.Q5_K: 0}


def _cpu_builds() -> list[str]:
    """The builds this CPU runs, read from /proc/cpuinfo here (not from kernels): portable first."""
    builds = ["portable"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return builds
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return builds
    if {"avx2", "fma", "f16c"} <= flags:
        builds.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            builds.append("avx512")
    return builds


BUILDS = _cpu_builds()


@pytest.fixture(scope="module")
def libs() -> dict[str, ctypes.CDLL]:
    return {b: kernels.load(b) for b in BUILDS}


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    kernels.set_threads(0)


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------


def random_fp16(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    """fp16 values, magnitude log-uniform in [lo, hi], random sign, as raw bytes [..., 2]."""
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_weights(t: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int, lo: float = 1e-4,
                   hi: float = 1e-1) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: random blocks (random bytes, finite fp16 scales of magnitude lo..hi), or for
    a float type random finite values."""
    rng = np.random.default_rng(seed)
    if t in FLOAT_TYPES:
        mag = np.exp(rng.uniform(np.log(lo), np.log(hi), (n_rows, 1)))  # per row, as a block scale would be
        v = (rng.standard_normal((n_rows, n_cols)) * mag).astype(np.float32)
        if t == T.F32:
            return v.view(np.uint8)
        if t == T.F16:
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[t]
    nb = n_cols // block
    raw = rng.integers(0, 256, (n_rows, nb * size), dtype=np.uint8)
    blocks = raw.reshape(n_rows, nb, size)
    for off in FP16_FIELDS[t]:
        blocks[..., off:off + 2] = random_fp16(rng, (n_rows, nb), lo, hi)
    if t == T.MXFP4:  # e8m0 exponent: scales 2^-13 .. 2^-2
        blocks[..., 0] = rng.integers(127 - 13, 127 - 1, (n_rows, nb))
    if t == T.IQ1_M:  # fp16 scale spread over the top nibbles of the four u16 at byte 48
        bits = random_fp16(rng, (n_rows, nb), lo, hi).view(np.uint16)[..., 0]
        words = blocks[..., 48:56].copy().view(np.uint16)
        for k in range(4):
            words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[..., 48:56] = words.view(np.uint8)
    return raw


def activations(n_tok: int, n_cols: int, seed: int) -> np.ndarray:
    """float32 activations with per-row magnitudes from 1e-3 to 1e2 and a few outliers (as in real models)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_cols)) * np.exp(rng.uniform(-7, 4.6, (n_tok, 1)))
    x[rng.random((n_tok, n_cols)) < 0.01] *= 20
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# the numpy reference
# ---------------------------------------------------------------------------------------------------------


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 activation blocks of float32 rows [n, c]: (d fp16-rounded as float32 [n, c/32], s = d * sum(q)
    [n, c/32], q int8 [n, c/32, 32]). d = amax / 127 and id = 1 / d in float32, q = round-half-even(x * id)."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    d16 = d.astype(np.float16).astype(np.float32)
    s = d16 * q.astype(np.int32).sum(-1).astype(np.float32)
    return d16, s, q


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_K activation super-blocks of float32 rows [n, c]: (d float32 [n, c/256], bsum int16 [n, c/256, 16],
    q int8 [n, c/256, 256]). mx = the (signed) first element of largest |x|, iscale = -127 / mx,
    q = clip(round-half-even(iscale * x), -127, 127), d = 1 / iscale; an all-zero block: d = 0, q = 0."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 256)
    i = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, i[..., None], -1)[..., 0]
    nz = mx != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(nz, np.float32(-127) / np.where(nz, mx, np.float32(1)), np.float32(0)).astype(np.float32)
        d = np.where(nz, np.float32(1) / np.where(nz, iscale, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(iscale[..., None] * xb), -127, 127).astype(np.int8)
    bsum = q.astype(np.int32).reshape(*q.shape[:2], 16, 16).sum(-1).astype(np.int16)
    return d, bsum, q


def act_dequant(x: np.ndarray, fam: str) -> np.ndarray:
    """float64 of what the kernels multiply the weights with: the dequantized activation blocks (exact)."""
    if fam == FAM_C:
        return x.astype(np.float64)
    if fam == FAM_A:
        d, _, q = quantize_q8_0(x)
    else:
        d, _, q = quantize_q8_k(x)
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(x.shape)


def ref_weights(raw: np.ndarray, t: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(W float64 [rows, cols] from gguf's reference dequantization, |terms| float64 [rows, cols]).

    |terms| is the magnitude of the parts the kernels round separately: |d * q| + |offset| for the types
    with an offset per block (Q4_1, Q5_1: + m; Q2_K, Q4_K, Q5_K: - dmin * mn), |w| for the others."""
    w = gguf.quants.dequantize(raw, t).astype(np.float64)
    if t not in D_OF_OFFSET_TYPES:
        return w, np.abs(w)
    block, size = GGML_QUANT_SIZES[t]
    raw0 = raw.copy().reshape(raw.shape[0], -1, size)
    raw0[..., D_OF_OFFSET_TYPES[t]:D_OF_OFFSET_TYPES[t] + 2] = 0  # d = +0: what is left is the offset part
    off = gguf.quants.dequantize(raw0.reshape(raw.shape), t).astype(np.float64)
    return w, np.abs(w - off) + np.abs(off)


def tolerance(t: GGMLQuantizationType, n_cols: int) -> float:
    """Relative bound: |y - ref| <= tolerance * sum(|terms| * |x|) for every output element.

    The integer parts are exact (int8 codes times int8 activations, int32 sums far from overflow), and the
    reference's activations are the kernels' own bit for bit (test_quantize_rows), so what differs is float
    rounding (unit roundoff u = 2^-24). Per block the kernels make a handful of float32 roundings (scale
    products d_w * d_x, the integer sum converted to float, the product, the offset term, the subtraction:
    at most 5), then add the blocks' contributions in a chain: n_cols / 32 additions per vector lane for
    32-blocks (plus a 3-level horizontal sum and the offset sum), n_cols / 256 for super-blocks, and
    n_cols / 8 fused multiply-adds per lane (plus 3 levels) for float weights. The reference's own weights
    are float32 results of at most 3 roundings each (gguf's dequantization), and the MoE's routing weight is
    one more product. By the standard bound of recursive summation (|error| <= gamma_k * sum |terms|,
    gamma_k ~ k * u), ``2 * (chain + 16) * u`` covers all of that with a factor 2 to spare: 2.3e-6 for Q4_K
    at 768 columns, 5.2e-6 for Q8_0, 1.4e-5 for F16. A single wrong code or scale in a row moves the result
    by about 1 / n_cols of sum(|w||x|) (1e-3 here): far outside.
    """
    fam = family(t)
    chain = {FAM_A: n_cols // 32 + 4, FAM_B: n_cols // 256, FAM_C: n_cols // 8 + 3}[fam]
    return 2 * (chain + 16) * U


def ref_linear(raw: np.ndarray, t: GGMLQuantizationType, n_cols: int, x: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(reference y float64 [n_tok, n_rows], allowed |error| [n_tok, n_rows])."""
    w, terms = ref_weights(raw, t)
    xa = act_dequant(x, family(t))
    return xa @ w.T, tolerance(t, n_cols) * (np.abs(xa) @ terms.T)


def assert_within(y: np.ndarray, ref: np.ndarray, bound: np.ndarray, what: str) -> None:
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == ref.shape, f"{what}: shape {y.shape} != {ref.shape}"
    assert np.isfinite(y).all(), f"{what}: non-finite output"
    err = np.abs(y - ref)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bound > 0, err / np.maximum(bound, 1e-300), np.inf)), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {y.size} outputs off; worst at {i}: got {y[i]!r}, "
                             f"reference {ref[i]!r}, |error| {err[i]:.3g} > bound {bound[i]:.3g}")


def linear(x: np.ndarray, raw: np.ndarray, t: GGMLQuantizationType, n_cols: int, lib: ctypes.CDLL) -> np.ndarray:
    return kernels.linear(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(raw), int(t), n_cols,
                          lib=lib).numpy()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------------------
# builds and types
# ---------------------------------------------------------------------------------------------------------


def test_builds_load_and_report_their_isa(libs, monkeypatch):
    monkeypatch.delenv("MOESTREAM_KERNELS", raising=False)
    assert kernels.best_isa() == BUILDS[-1]  # the fastest build the flags allow
    for b, lib in libs.items():
        assert lib.ms_isa() == {"portable": 0, "avx2": 1, "avx512": 2}[b], b


def test_types_computed_and_block_sizes(libs):
    lib = libs["portable"]
    for t in ALL_TYPES:
        block, size = GGML_QUANT_SIZES[t]
        assert kernels.supports(t), t.name
        if t in FLOAT_TYPES:  # widened 32 elements at a time
            assert (lib.ms_block_size(int(t)), lib.ms_block_bytes(int(t))) == (32, 32 * size), t.name
        else:
            assert (lib.ms_block_size(int(t)), lib.ms_block_bytes(int(t))) == (block, size), t.name
    for t in (T.Q8_1, T.Q8_K, 99):  # not computed, not a type
        assert lib.ms_block_size(int(t)) == 0
    raw = np.zeros((2, 72), np.uint8)  # two Q8_1 rows of 64
    with pytest.raises(ValueError, match="do not compute"):
        linear(np.zeros((1, 64), np.float32), raw, T.Q8_1, 64, lib)
    raw = random_weights(T.Q4_K, 2, 256, 0)  # 256 columns read as 128: not a whole super-block
    with pytest.raises(ValueError, match="do not compute"):
        linear(np.zeros((1, 128), np.float32), raw[:, :72], T.Q4_K, 128, lib)


# ---------------------------------------------------------------------------------------------------------
# linear on random blocks: every type, every build, row counts off the tiles, 1 .. 300 tokens
# ---------------------------------------------------------------------------------------------------------

N_COLS = 768  # 3 super-blocks, 24 blocks of 32
ROW_COUNTS = (1, 3, 37, 100)
TOKEN_COUNTS = (1, 2, 63, 64, 65, 300)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_linear_random_blocks(libs, t):
    raw = random_weights(t, max(ROW_COUNTS), N_COLS, seed=int(t))
    x = activations(max(TOKEN_COUNTS), N_COLS, seed=100 + int(t))
    ref, bound = ref_linear(raw, t, N_COLS, x)
    for b, lib in libs.items():
        for nr in ROW_COUNTS:
            for nt in TOKEN_COUNTS:
                y = linear(x[:nt], raw[:nr], t, N_COLS, lib)
                assert_within(y, ref[:nt, :nr], bound[:nt, :nr], f"{t.name} {b} {nr} rows x {nt} tokens")


def test_linear_zero_and_tiny_activations(libs):
    """All-zero rows give exact zeros; rows of tiny values (Q8_0's fp16 scale underflows to subnormal/zero)
    stay within the bound."""
    x = np.zeros((3, 512), np.float32)
    x[1] = np.float32(1e-6) * activations(1, 512, 5)[0] / 100
    x[2, 7] = np.float32(3e-9)
    for t in (T.Q8_0, T.Q4_K, T.IQ2_XS, T.F16):
        raw = random_weights(t, 5, 512, seed=1)
        ref, bound = ref_linear(raw, t, 512, x)
        for b, lib in libs.items():
            y = linear(x, raw, t, 512, lib)
            assert (y[0] == 0).all(), f"{t.name} {b}: zero row gave {y[0]}"
            assert_within(y, ref, bound, f"{t.name} {b} tiny rows")


# ---------------------------------------------------------------------------------------------------------
# linear on real blocks
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_blocks() -> list[tuple[str, GGMLQuantizationType, int, np.ndarray]]:
    try:
        samples = list(realblocks.real_samples(max_rows=100, per_type=2))
    except realblocks.RealBlocksUnavailable as exc:
        pytest.skip(f"real GGUF chunk wheels unavailable (network?): {exc}")
    return [(info.name, info.ggml_type, info.n_cols, raw) for info, _, raw in samples]


def iquant_fixture_dir():
    """The newest built ``qwen3moe-tiny-iquants`` fixture in the cache, or None (it is never built here:
    ``python tools/fixtures.py build --only qwen3moe-tiny-iquants`` or the llamacpp-marked tests build it)."""
    root = realblocks.cache_dir() / "quantized"
    done = sorted(root.glob("qwen3moe-tiny-iquants-*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return done[-1].parent if done else None


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_table(path) -> tuple[mmap.mmap, int, dict[str, tuple[int, tuple[int, ...], int]]]:
    """(the file mapped, start of the tensor data, {name: (ggml type, dims (ggml order), offset)}): the GGUF
    header walked without decoding its values (moestream.gguf.GGUFModel parses the 152k-token vocabulary:
    2 s a file)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def u32(p: int) -> int:
        return struct.unpack_from("<I", mm, p)[0]

    def u64(p: int) -> int:
        return struct.unpack_from("<Q", mm, p)[0]

    def skip(p: int, vt: int) -> int:
        if vt in _GGUF_SCALAR_BYTES:
            return p + _GGUF_SCALAR_BYTES[vt]
        if vt == 8:  # string
            return p + 8 + u64(p)
        assert vt == 9, f"{path}: GGUF value type {vt}"
        et, n = u32(p), u64(p + 4)
        p += 12
        if et in _GGUF_SCALAR_BYTES:
            return p + n * _GGUF_SCALAR_BYTES[et]
        for _ in range(n):
            p = skip(p, et)
        return p

    assert mm[:4] == b"GGUF", path
    n_tensors, n_kv = u64(8), u64(16)
    pos, align = 24, 32
    for _ in range(n_kv):
        n = u64(pos)
        key = bytes(mm[pos + 8:pos + 8 + n])
        vt = u32(pos + 8 + n)
        pos += 12 + n
        if key == b"general.alignment":
            align = u32(pos)
        pos = skip(pos, vt)
    table = {}
    for _ in range(n_tensors):
        n = u64(pos)
        name = bytes(mm[pos + 8:pos + 8 + n]).decode()
        pos += 8 + n
        nd = u32(pos)
        dims = struct.unpack_from(f"<{nd}Q", mm, pos + 4)
        pos += 4 + 8 * nd
        table[name] = (u32(pos), dims, u64(pos + 4))
        pos += 12
    return mm, (pos + align - 1) // align * align, table


@pytest.fixture(scope="module")
def iquant_blocks() -> list[tuple[str, GGMLQuantizationType, int, np.ndarray]]:
    """Up to 100 rows (spread over the experts) of one matrix per type in the fixture's files."""
    d = iquant_fixture_dir()
    if d is None:
        pytest.skip("fixture qwen3moe-tiny-iquants not built (python tools/fixtures.py build --only "
                    "qwen3moe-tiny-iquants, needs llama-cpp-python): real i-quant blocks not checked")
    files = json.loads((d / "manifest.json").read_text())["files"]
    out: dict[GGMLQuantizationType, tuple[str, GGMLQuantizationType, int, np.ndarray]] = {}
    for name in sorted(files.values()):
        mm, start, table = gguf_tensor_table(d / name)
        for tname, (tt, dims, off) in sorted(table.items(), key=lambda kv: not kv[0].endswith("_exps.weight")):
            if tt not in [int(a) for a in ALL_TYPES] or T(tt) in out or len(dims) < 2:
                continue
            t = T(tt)
            block, size = GGML_QUANT_SIZES[t]
            n_cols, n_rows = dims[0], int(np.prod(dims[1:]))
            rows = np.frombuffer(mm, np.uint8, count=n_rows * n_cols // block * size, offset=start + off)
            rows = rows.reshape(n_rows, -1)
            step = max(1, n_rows // 100)
            out[t] = (f"{name}:{tname}", t, n_cols, rows[::step][:100].copy())
    return list(out.values())


def check_real(samples, libs) -> set[GGMLQuantizationType]:
    for name, t, n_cols, raw in samples:
        x = activations(65, n_cols, seed=7)
        ref, bound = ref_linear(raw, t, n_cols, x)
        ys = {}
        for b, lib in libs.items():
            for nt in (1, 65):
                ys[b, nt] = linear(x[:nt], raw, t, n_cols, lib)
                assert_within(ys[b, nt], ref[:nt], bound[:nt], f"{name} ({t.name}, {b}, {nt} tokens)")
        if "avx2" in libs and "avx512" in libs:  # see test_x86_builds_bitwise_identical
            assert np.array_equal(bits(ys["avx2", 65]), bits(ys["avx512", 65])), f"{name}: avx512 != avx2"
    return {t for _, t, _, _ in samples}


def test_linear_real_gemma_blocks(libs, gemma_blocks):
    found = check_real(gemma_blocks, libs)
    assert {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= found


def test_linear_real_iquant_blocks(libs, iquant_blocks):
    found = check_real(iquant_blocks, libs)
    want = {T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.TQ1_0, T.TQ2_0, T.MXFP4}
    assert want <= found, sorted(t.name for t in want - found)


# ---------------------------------------------------------------------------------------------------------
# determinism: tokens, threads, builds
# ---------------------------------------------------------------------------------------------------------


def test_token_and_thread_independence(libs):
    """Row t of a 65-token call equals a 1-token call on that row, bitwise; so do the tokens of a call in
    another order; 1 thread and 8 threads give the same bits (small and tall matrices: other work splits)."""
    x = activations(65, 512, seed=11)
    perm = np.random.default_rng(0).permutation(65)
    for t in ALL_TYPES:
        raw = random_weights(t, 300, 512, seed=200 + int(t))
        for b, lib in libs.items():
            kernels.set_threads(8)
            y = linear(x, raw, t, 512, lib)
            for k in (0, 1, 31, 63, 64):
                y1 = linear(x[k:k + 1], raw, t, 512, lib)
                assert np.array_equal(bits(y1[0]), bits(y[k])), f"{t.name} {b}: token {k} alone differs"
            assert np.array_equal(bits(linear(x[perm], raw, t, 512, lib)), bits(y[perm])), f"{t.name} {b} perm"
            kernels.set_threads(1)
            assert np.array_equal(bits(linear(x, raw, t, 512, lib)), bits(y)), f"{t.name} {b}: 1 vs 8 threads"
            assert np.array_equal(bits(linear(x[:3], raw[:37], t, 512, lib)), bits(y[:3, :37])), f"{t.name} {b}"


HEADS_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)


def test_linear_heads_is_linear_per_head(libs):
    """kernels.linear_heads (MLA's per-head up-projections) gives, for every (token, head), the bits of
    kernels.linear on that head's rows alone: for 1, 2, 17 tokens, 1 and 2 threads, x read through strides (a
    head-major buffer seen token-major, padded rows), and y written through strides (padded rows; the padding
    is left untouched)."""
    n_heads, n_rows = 3, 37
    for t in HEADS_TYPES:
        for n_cols in (128, 256):
            if not kernels.computes(int(t), n_cols):
                assert t in SUPER_TYPES and n_cols == 128  # 128 columns: half a k-quant super-block
                continue
            raw = random_weights(t, n_heads * n_rows, n_cols, seed=400 + int(t) + n_cols)
            base = activations(17 * n_heads, n_cols + 5, seed=500 + int(t))
            # head-major [H, T, cols + 5] buffer, seen as [T, H, cols]: strides (cols + 5, 17 (cols + 5), 1)
            xs = torch.from_numpy(base).view(n_heads, 17, n_cols + 5).transpose(0, 1)[..., :n_cols]
            for b, lib in libs.items():
                for n_thr in (1, 2):
                    kernels.set_threads(n_thr)
                    for n_tok in (1, 2, 17):
                        x = xs[:n_tok]
                        y = kernels.linear_heads(x, torch.from_numpy(raw), int(t), n_cols, n_heads, lib=lib)
                        assert y.shape == (n_tok, n_heads, n_rows)
                        for h in range(n_heads):
                            want = linear(x[:, h].numpy(), raw[h * n_rows:(h + 1) * n_rows], t, n_cols, lib)
                            assert np.array_equal(bits(y[:, h].numpy()), bits(want)), \
                                f"{t.name} {b} cols {n_cols} {n_thr} threads {n_tok} tokens head {h}"
                    # y through strides: rows of n_rows + 3 floats, heads of 2 such rows apart
                    n_tok = 5
                    out = torch.full((n_tok, n_heads, 2, n_rows + 3), 7.0)
                    rc = lib.ms_linear_heads(int(t), raw.ctypes.data, n_rows * raw.shape[1], raw.shape[1], n_rows,
                                             n_cols, n_heads, xs.data_ptr(), xs.stride(0), xs.stride(1), n_tok,
                                             out.data_ptr(), out.stride(0), out.stride(1), kernels.threads())
                    assert rc == 0
                    want = kernels.linear_heads(xs[:n_tok], torch.from_numpy(raw), int(t), n_cols, n_heads, lib=lib)
                    assert np.array_equal(bits(out[:, :, 0, :n_rows].numpy()), bits(want.numpy())), f"{t.name} {b}"
                    assert (out[:, :, 0, n_rows:] == 7.0).all() and (out[:, :, 1] == 7.0).all(), f"{t.name} {b}"


def test_linear_heads_refuses(libs):
    """A type the kernels do not compute, columns off the block, shapes that do not fit: ValueError."""
    lib = libs["portable"]
    x = torch.zeros((1, 2, 128))
    with pytest.raises(ValueError, match="do not compute"):
        kernels.linear_heads(x, torch.zeros((4, 72), dtype=torch.uint8), int(T.Q8_1), 128, 2, lib=lib)
    with pytest.raises(ValueError, match="do not compute"):  # Q4_K rows of 128: half a super-block
        kernels.linear_heads(x, torch.zeros((4, 72), dtype=torch.uint8), int(T.Q4_K), 128, 2, lib=lib)
    with pytest.raises(ValueError, match="raw must be"):  # 5 rows for 2 heads
        kernels.linear_heads(x, torch.zeros((5, 136), dtype=torch.uint8), int(T.Q8_0), 128, 2, lib=lib)
    with pytest.raises(ValueError, match="x must be"):
        kernels.linear_heads(x[:, :1], torch.zeros((4, 136), dtype=torch.uint8), int(T.Q8_0), 128, 2, lib=lib)


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(BUILDS), reason="this CPU does not run both x86 SIMD builds")
def test_x86_builds_bitwise_identical(libs):
    """The AVX2 and AVX-512 builds differ only in how they form the exact integer block sums (maddubs + madd vs
    VNNI dpbusd / dpwssd); their float arithmetic (vector-lane FMAs, one horizontal sum per row) is the same, so
    every type gives the same bits on both. (The portable build sums in scalar order: equal within the bound
    of test_linear_random_blocks, not bitwise.)"""
    x = activations(70, 1024, seed=12)
    for t in ALL_TYPES:
        raw = random_weights(t, 41, 1024, seed=300 + int(t), lo=1e-5, hi=1.0)
        a, b = (linear(x, raw, t, 1024, libs[name]) for name in ("avx2", "avx512"))
        same = bits(a) == bits(b)
        assert same.all(), f"{t.name}: avx512 differs from avx2 in {(~same).sum()} of {same.size} outputs"


# ---------------------------------------------------------------------------------------------------------
# the activation quantizers, bit for bit
# ---------------------------------------------------------------------------------------------------------

ACT_Q8_0 = np.dtype([("d", "<f4"), ("s", "<f4"), ("q", "i1", 32)])
ACT_Q8_K = np.dtype([("d", "<f4"), ("bsum", "<i2", 16), ("q", "i1", 256)])


def edge_rows(n_cols: int) -> np.ndarray:
    """Rows that probe the quantizers' corners: zeros, exact ties of round-half-even (x * id = k + 0.5), the
    largest |x| negative, equal |x| of both signs, wide magnitudes, fp16-subnormal Q8_0 scales."""
    rng = np.random.default_rng(3)
    rows = [np.zeros(n_cols)]
    tie = np.resize(np.arange(-126.5, 127.0, 1.0), n_cols)  # amax 126.5 ... rescaled to 127 below
    tie[::32] = 127.0
    rows += [tie, -tie]
    r = rng.standard_normal(n_cols)
    r[5] = -10.0
    rows.append(r)
    r = rng.standard_normal(n_cols)
    r[3], r[9] = 8.0, -8.0
    rows.append(r)
    rows += [rng.standard_normal(n_cols) * s for s in (1e-30, 1e-7, 1e-5, 1.0, 1e4)]
    x = np.array(rows, dtype=np.float32)
    x[2, ::256] = -127.0  # Q8_K: signed max negative, iscale = 1: ties at .5 again
    return x


@pytest.mark.parametrize("fam", [FAM_A, FAM_B])
def test_quantize_rows(libs, fam):
    n_cols = 1024
    t = T.Q8_0 if fam == FAM_A else T.Q4_K
    x = np.concatenate([edge_rows(n_cols), activations(40, n_cols, seed=13)])
    for b, lib in libs.items():
        rb = lib.ms_act_row_bytes(int(t), n_cols)
        dt = ACT_Q8_0 if fam == FAM_A else ACT_Q8_K
        assert rb == n_cols // (32 if fam == FAM_A else 256) * dt.itemsize
        out = np.zeros(len(x) * rb, np.uint8)
        lib.ms_quantize_rows(int(t), x.ctypes.data, len(x), n_cols, out.ctypes.data)
        got = out.view(dt).reshape(len(x), -1)
        if fam == FAM_A:
            d, s, q = quantize_q8_0(x)
            assert np.array_equal(got["q"], q), b
            assert np.array_equal(bits(got["d"]), bits(d)), b
            assert np.array_equal(bits(got["s"]), bits(s)), b
        else:
            d, bsum, q = quantize_q8_k(x)
            assert np.array_equal(got["q"], q), b
            assert np.array_equal(bits(got["d"]), bits(d)), b
            assert np.array_equal(got["bsum"], bsum), b
    # the corners were reached: ties rounded to even, a subnormal Q8_0 scale, a negative Q8_K scale
    d0, _, q0 = quantize_q8_0(x)
    assert q0[1, 0, 1] == -126 and q0[1, 0, 2] == -124  # -125.5 -> -126, -124.5 -> -124 (id = 1)
    assert ((d0 > 0) & (d0 < 6.1e-5)).any()
    dk, _, _ = quantize_q8_k(x)
    assert (dk[2] == 1.0).all() and (dk[1] == -1.0).all()


def test_float_activation_rows_are_copies(libs):
    x = activations(3, 64, seed=1)
    for lib in libs.values():
        for t in FLOAT_TYPES:
            assert lib.ms_act_row_bytes(int(t), 64) == 256
            out = np.zeros(3 * 256, np.uint8)
            lib.ms_quantize_rows(int(t), x.ctypes.data, 3, 64, out.ctypes.data)
            assert np.array_equal(out.view(np.float32).reshape(3, 64), x)


# ---------------------------------------------------------------------------------------------------------
# the MoE call
# ---------------------------------------------------------------------------------------------------------

N_EMBD, N_FF, N_GROUPS, TOP_K, N_TOK = 512, 256, 5, 2, 70
# (gate/up type, down type, activation, gate and up merged in one tensor)
MOE_CASES = [
    (T.Q4_K, T.Q6_K, kernels.ACT_SILU, True),
    (T.IQ2_XXS, T.Q8_0, kernels.ACT_GELU_TANH, False),
    (T.Q5_0, T.IQ4_XS, kernels.ACT_SILU, False),
    (T.F16, T.IQ1_M, kernels.ACT_GELU_TANH, True),
    (T.F32, T.Q4_1, kernels.ACT_SILU, False),
    (T.TQ2_0, T.F32, kernels.ACT_GELU_TANH, True),
]


def moe_weights(t: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int, mean_abs: float = 0.05
                ) -> np.ndarray:
    """random_weights with the scales chosen so that the mean |w| is about ``mean_abs`` (the weights are linear
    in the scale fields): gate/up outputs and h of order 1, as in a model."""
    probe = random_weights(t, n_rows, n_cols, seed, 0.5, 2.0)
    m = float(np.abs(gguf.quants.dequantize(probe, t)).mean())
    return random_weights(t, n_rows, n_cols, seed, 0.5 * mean_abs / m, 2.0 * mean_abs / m)


class Experts:
    """n_groups experts' gate, up (one merged tensor or two) and down matrices, contiguous per kind."""

    def __init__(self, t_gu, t_down, merged: bool, seed: int):
        self.t_gu, self.t_down, self.merged = t_gu, t_down, merged
        g = N_GROUPS
        if merged:
            gu = moe_weights(t_gu, g * 2 * N_FF, N_EMBD, seed)
            self.rb_gu = gu.shape[1]
            self.gu = gu.reshape(g, 2 * N_FF, self.rb_gu)
            self.gate_raw = [self.gu[i, :N_FF] for i in range(g)]
            self.up_raw = [self.gu[i, N_FF:] for i in range(g)]
        else:
            self.gate = moe_weights(t_gu, g * N_FF, N_EMBD, seed).reshape(g, N_FF, -1)
            self.up = moe_weights(t_gu, g * N_FF, N_EMBD, seed + 1).reshape(g, N_FF, -1)
            self.rb_gu = self.gate.shape[2]
            self.gate_raw, self.up_raw = list(self.gate), list(self.up)
        self.down = moe_weights(t_down, g * N_EMBD, N_FF, seed + 2).reshape(g, N_EMBD, -1)
        self.rb_down = self.down.shape[2]
        self.down_raw = list(self.down)

    def addresses(self, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        gate = np.array([self.gate_raw[g].ctypes.data for g in groups], dtype=np.int64)
        if self.merged:
            up = gate + N_FF * self.rb_gu  # the layout ms_moe documents for a merged gate_up
            assert all(int(u) == self.up_raw[g].ctypes.data for u, g in zip(up, groups, strict=True))
        else:
            up = np.array([self.up_raw[g].ctypes.data for g in groups], dtype=np.int64)
        down = np.array([self.down_raw[g].ctypes.data for g in groups], dtype=np.int64)
        return gate, up, down


def routing(seed: int, n_tok: int = N_TOK) -> list[tuple[int, int, float, int]]:
    """(group, token, weight, output row) per pair: group 0 gets most tokens (> 64 pairs: two token tiles),
    group 4 none; output rows are a random subset (in random order) of n_tok * TOP_K + 5 rows."""
    rng = np.random.default_rng(seed)
    rows = rng.permutation(n_tok * TOP_K + 5)
    pairs, p = [], 0
    for tok in range(n_tok):
        first = 0 if rng.random() < 0.95 else int(rng.integers(1, 4))
        second = int(rng.choice([g for g in (0, 1, 2, 3) if g != first]))
        for g in (first, second):
            pairs.append((g, tok, float(rng.uniform(0.05, 1.0)), int(rows[p])))
            p += 1
    sizes = np.bincount([g for g, _, _, _ in pairs], minlength=N_GROUPS)
    assert sizes[0] > 64 and sizes[4] == 0 and (sizes[1:4] > 0).all(), sizes  # what the tests rely on
    return pairs


def moe_activations(seed: int) -> np.ndarray:
    """float32 [N_TOK, N_EMBD]: normal rows of rms 0.3 .. 3 (a normed hidden state), a few outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_TOK, N_EMBD)) * np.exp(rng.uniform(np.log(0.3), np.log(3), (N_TOK, 1)))
    x[rng.random(x.shape) < 0.01] *= 8
    return x.astype(np.float32)


def moe_call(ex: Experts, x: np.ndarray, pairs, groups, act: int, y: np.ndarray, lib, bias: tuple | None = None,
             real: np.ndarray | None = None) -> None:
    """kernels.moe on the pairs of ``groups`` (in that order; pairs in the order given) into y; ``bias`` (gate, up,
    down) tables gathered by ``real[g]``, group g's real expert id."""
    start, tok, w, out = [0], [], [], []
    for g in groups:
        for pg, pt, pw, po in pairs:
            if pg == g:
                tok.append(pt)
                w.append(pw)
                out.append(po)
        start.append(len(tok))
    gate, up, down = ex.addresses(groups)
    kernels.moe(torch.from_numpy(x), int(ex.t_gu), int(ex.t_down), gate, up, down, ex.rb_gu, ex.rb_down, N_FF,
                act, np.array(start, np.int32), np.array(tok, np.int32), np.array(w, np.float32),
                np.array(out, np.int32), torch.from_numpy(y), lib=lib, bias=bias,
                real=None if real is None else np.array([real[g] for g in groups], np.int64))


def new_y() -> np.ndarray:
    return np.full((N_TOK * TOP_K + 5, N_EMBD), np.nan, np.float32)


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _fn in (_LIBM.expf, _LIBM.tanhf):
    _fn.restype, _fn.argtypes = ctypes.c_float, [ctypes.c_float]
_EXPF = np.frompyfunc(lambda v: _LIBM.expf(float(v)), 1, 1)  # float(np.float32) is exact
_TANHF = np.frompyfunc(lambda v: _LIBM.tanhf(float(v)), 1, 1)


def act_f32(g: np.ndarray, u: np.ndarray, act: int) -> np.ndarray:
    """act(gate) * up in float32, operation by operation as moekern.c writes it, libm's expf / tanhf."""
    one = np.float32(1)
    if act == kernels.ACT_SWIGLU_OAI:  # ggml's swiglu_oai: min(g, 7) (NaN kept), clamp(u, -7, 7)
        lim = np.float32(kernels.SWIGLU_OAI_LIMIT)
        xg = np.where(g > lim, lim, g)
        yu = np.where(u < -lim, -lim, np.where(u > lim, lim, u))
        with np.errstate(over="ignore"):  # expf overflows to inf for x < -52: x / inf = -0, as in C
            glu = xg / (one + _EXPF(np.float32(kernels.SWIGLU_OAI_ALPHA) * -xg).astype(np.float32))
        return glu * (yu + one)
    if act == kernels.ACT_SILU:
        return g / (one + _EXPF(-g).astype(np.float32)) * u
    inner = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
    return np.float32(0.5) * g * (one + _TANHF(inner).astype(np.float32)) * u


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: f"{c[0].name}-{c[1].name}-{'merged' if c[3] else 'split'}")
def test_moe_equals_linear_composition(libs, case):
    """Bitwise: y[out] = w * linear(down, act(linear(gate, x), linear(up, x))) per pair, the activation in
    float32 with libm as moekern.c computes it; rows no pair writes stay untouched."""
    t_gu, t_down, act, merged = case
    ex = Experts(t_gu, t_down, merged, seed=int(t_gu) * 7 + int(t_down))
    x = moe_activations(21)
    pairs = routing(5)
    for b, lib in libs.items():
        y = new_y()
        moe_call(ex, x, pairs, range(N_GROUPS), act, y, lib)
        ref = new_y()
        for g in range(N_GROUPS):
            mine = [p for p in pairs if p[0] == g]
            if not mine:
                continue
            toks = np.array([p[1] for p in mine])
            gg = linear(x[toks], ex.gate_raw[g], t_gu, N_EMBD, lib)
            uu = linear(x[toks], ex.up_raw[g], t_gu, N_EMBD, lib)
            d = linear(act_f32(gg, uu, act), ex.down_raw[g], t_down, N_FF, lib)
            for k, (_, _, w, out) in enumerate(mine):
                ref[out] = np.float32(w) * d[k]
        assert np.isfinite(ref[[p[3] for p in pairs]]).all()
        same = bits(y) == bits(ref)  # NaN sentinels compare by their bits too
        assert same.all(), f"{b}: {(~same.all(1)).sum()} output rows differ from the composition"


#: the real expert id of each group (slot) in the bias tests: slot ids != real ids, 12 experts in the tables
REAL_OF_SLOT = np.array([7, 2, 11, 0, 5], np.int64)


@pytest.mark.parametrize("case", [(T.MXFP4, T.MXFP4), (T.F32, T.F32), (T.Q8_0, T.Q4_K)],
                         ids=lambda c: f"{c[0].name}-{c[1].name}")
def test_moe_swiglu_oai_with_biases_by_real_id(libs, case):
    """GPT-OSS's experts (ACT_SWIGLU_OAI, per-expert gate / up / down biases): bitwise the composition
    y[out] = (linear(down, h) + b_down[e]) * w, h = swiglu_oai(linear(gate, x) + b_gate[e], linear(up, x) + b_up[e])
    with e the group's REAL id (not its slot), each add one float32 add, the activation as ggml's swiglu_oai in float32
    with libm's expf; some gate and up values past the clamp on both sides; a bias left out (None) is not added;
    -t 1 and -t 2 the same bits."""
    t_gu, t_down = case
    ex = Experts(t_gu, t_down, False, seed=int(t_gu) * 5 + int(t_down))
    x = moe_activations(24)
    pairs = routing(9)
    rng = np.random.default_rng(10)
    n_exp = 12
    tabs = [torch.from_numpy((rng.standard_normal((n_exp, n)) * 4).astype(np.float32)) for n in (N_FF, N_FF, N_EMBD)]
    act = kernels.ACT_SWIGLU_OAI
    for b, lib in libs.items():
        for which in ((0, 1, 2), (2,), (0,)):
            bias = tuple(tabs[m] if m in which else None for m in range(3))
            y = new_y()
            kernels.set_threads(2)
            moe_call(ex, x, pairs, range(N_GROUPS), act, y, lib, bias=bias, real=REAL_OF_SLOT)
            y1 = new_y()
            kernels.set_threads(1)
            moe_call(ex, x, pairs, range(N_GROUPS), act, y1, lib, bias=bias, real=REAL_OF_SLOT)
            assert np.array_equal(bits(y), bits(y1)), f"{b} {which}: -t 1 vs -t 2"
            ref = new_y()
            clamped = [0, 0, 0]
            for g in range(N_GROUPS):
                mine = [p for p in pairs if p[0] == g]
                if not mine:
                    continue
                e = REAL_OF_SLOT[g]
                toks = np.array([p[1] for p in mine])
                gg = linear(x[toks], ex.gate_raw[g], t_gu, N_EMBD, lib)
                uu = linear(x[toks], ex.up_raw[g], t_gu, N_EMBD, lib)
                if bias[0] is not None:
                    gg = gg + tabs[0].numpy()[e]
                if bias[1] is not None:
                    uu = uu + tabs[1].numpy()[e]
                clamped[0] += int((gg > 7).sum())
                clamped[1] += int((uu > 7).sum())
                clamped[2] += int((uu < -7).sum())
                d = linear(act_f32(gg, uu, act), ex.down_raw[g], t_down, N_FF, lib)
                if bias[2] is not None:
                    d = d + tabs[2].numpy()[e]
                for k, (_, _, w, out) in enumerate(mine):
                    ref[out] = d[k] * np.float32(w)
            if which == (0, 1, 2):
                assert min(clamped) > 0, clamped
            assert np.isfinite(ref[[p[3] for p in pairs]]).all()
            same = bits(y) == bits(ref)
            assert same.all(), f"{b} {which}: {(~same.all(1)).sum()} output rows differ from the composition"
            # a bias read by slot id instead of the real id would differ
            if which == (0, 1, 2):
                y2 = new_y()
                moe_call(ex, x, pairs, range(N_GROUPS), act, y2, lib, bias=bias, real=np.arange(N_GROUPS))
                assert not np.array_equal(bits(y2), bits(y))


def moe_numpy_reference(ex: Experts, x: np.ndarray, pairs, act: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y float64 per pair, allowed |error| per pair, the typical size of one hidden value's term
    w * |w_down| |h| / n_ff) from the numpy reference arithmetic alone.

    Per pair: g, u = the reference linear of the quantized x row (as in test_linear_*), within eg, eu of the
    kernels' float32 results (the tolerance bound); h = act(g) * u in float64 (SiLU and GELU-tanh have
    slopes below 1.2, so the kernels' h is within dh = 1.2 eg (|u| + eu) + |act(g)| eu + 8u (|h| + |g u|):
    the last term the float32 activation's own rounding); h is quantized with the numpy quantizer and meets
    the reference down weights in float64. Quantizing two values dh apart gives the same code unless the
    scaled value lies within dh * 127 / amax (plus the block scale's own slack) of a rounding boundary: only
    those codes get one quantum of allowance, and each block the range its scale can take (for Q8_0, an
    fp16 rounding step where amax sits near one).
    The allowances start from the linear bound for g and u (a worst case, ~100x the typical float32 error;
    the kernels' actual error here is ~1e-7 of |y|), so the bound ends up near 2e-3 of |y|, 0.03 .. 0.1 of
    one hidden value's term w * |w_down| |h| / n_ff (asserted below 0.25; the composition test is the
    bitwise one)."""
    fam_gu, fam_d = family(ex.t_gu), family(ex.t_down)
    ys, bounds, one = [], [], []
    weights = {}
    for g in range(N_GROUPS):
        weights[g] = [ref_weights(np.ascontiguousarray(r[g]), t) for r, t in
                      ((ex.gate_raw, ex.t_gu), (ex.up_raw, ex.t_gu), (ex.down_raw, ex.t_down))]
    tol_gu, tol_d = tolerance(ex.t_gu, N_EMBD), tolerance(ex.t_down, N_FF)
    for g, tok, w, _ in pairs:
        (wg, mg), (wu, mu), (wd, md) = weights[g]
        xa = act_dequant(x[tok:tok + 1], fam_gu)[0]
        gv, uv = wg @ xa, wu @ xa
        eg, eu = tol_gu * (mg @ np.abs(xa)), tol_gu * (mu @ np.abs(xa))
        if act == kernels.ACT_SILU:
            a = gv / (1 + np.exp(-gv))
        else:
            a = 0.5 * gv * (1 + np.tanh(np.sqrt(2 / np.pi) * (gv + 0.044715 * gv ** 3)))
        h = a * uv
        dh = 1.2 * eg * (np.abs(uv) + eu) + np.abs(a) * eu + 8 * U * (np.abs(h) + np.abs(gv * uv))
        h32 = h.astype(np.float32)
        dh = dh + U * np.abs(h)  # the reference's own rounding to float32
        if fam_d == FAM_C:  # float32 down weights meet h as it is
            hq = h32.astype(np.float64)
            shift, mag = np.abs(wd) @ dh, np.abs(hq) + dh
        else:
            bs = 32 if fam_d == FAM_A else 256
            d_r, _, q_r = (quantize_q8_0 if fam_d == FAM_A else quantize_q8_k)(h32[None])
            d_r, q_r = d_r[0].astype(np.float64), q_r[0].astype(np.float64)  # [nb], [nb, bs]
            hq = (q_r * d_r[:, None]).reshape(-1)
            hb, db = h32.astype(np.float64).reshape(-1, bs), dh.reshape(-1, bs)
            amax = np.abs(hb).max(1, keepdims=True)
            slack = db.max(1, keepdims=True) + 4 * U * amax  # |amax_kernel - amax|
            a_lo, a_hi = np.maximum(amax - slack, 1e-300), amax + slack
            s = hb * 127 / amax  # what the quantizer rounds, to a few ulp
            sigma = np.abs(s) * 2 * slack / a_lo + db * 127 / a_lo + 1e-4
            near = 0.5 - np.abs(s - np.rint(s)) <= sigma  # codes that may round the other way
            if fam_d == FAM_A:  # the range of the kernel's |d|: fp16 rounding is monotonic
                d_lo = (a_lo / 127 * (1 - 4 * U)).astype(np.float32).astype(np.float16).astype(np.float64)
                d_hi = (a_hi / 127 * (1 + 4 * U)).astype(np.float32).astype(np.float16).astype(np.float64)
            else:
                d_lo, d_hi = a_lo / 127 * (1 - 4 * U), a_hi / 127 * (1 + 4 * U)
            # a code rounded the other way moves its term by one quantum; a block scale that differs moves
            # the block's signed sum of w * q as a whole
            block_sums = np.einsum("onb,nb->on", wd.reshape(len(wd), -1, bs), q_r)
            shift = np.abs(wd) @ (near * d_hi).reshape(-1) + np.abs(block_sums) @ (d_hi - d_lo)[:, 0]
            mag = np.abs(hq) + (near * d_hi + np.abs(q_r) * (d_hi - d_lo)).reshape(-1)
        ys.append(w * (wd @ hq))
        one.append(w * (np.abs(wd) @ np.abs(hq)) / N_FF)
        bounds.append(w * (shift + tol_d * (md @ mag)))
    return np.array(ys), np.array(bounds), np.array(one)


@pytest.mark.parametrize("case", [MOE_CASES[0], MOE_CASES[1], MOE_CASES[5]], ids=lambda c: f"{c[0].name}-{c[1].name}")
def test_moe_numpy_reference(libs, case):
    t_gu, t_down, act, merged = case
    ex = Experts(t_gu, t_down, merged, seed=int(t_gu) * 7 + int(t_down))
    x = moe_activations(22)
    pairs = routing(6)
    ref, bound, one = moe_numpy_reference(ex, x, pairs, act)
    # a wrong hidden value, weight, token, expert or routing weight moves a row by one term or more
    assert bound.mean() < 0.25 * one.mean(), f"bound {bound.mean():.3g} vs one term {one.mean():.3g}"
    rows = [p[3] for p in pairs]
    for b, lib in libs.items():
        y = new_y()
        moe_call(ex, x, pairs, range(N_GROUPS), act, y, lib)
        assert_within(y[rows], ref, bound, f"moe {t_gu.name}/{t_down.name} {b}")


def test_moe_groups_order_subsets_and_threads(libs):
    """The bits of each output row do not depend on which groups share the call, in which order, on the
    order of a group's pairs, or on the thread count."""
    t_gu, t_down, act, merged = MOE_CASES[0]
    ex = Experts(t_gu, t_down, merged, seed=31)
    x = moe_activations(23)
    pairs = routing(7)
    rng = np.random.default_rng(8)
    for b, lib in libs.items():
        kernels.set_threads(8)
        full = new_y()
        moe_call(ex, x, pairs, range(N_GROUPS), act, full, lib)
        touched = np.zeros(len(full), bool)
        touched[[p[3] for p in pairs]] = True
        assert np.isfinite(full[touched]).all() and np.isnan(full[~touched]).all(), b
        variants = {
            "reversed": [[4, 3, 2, 1, 0]],
            "subsets": [[2], [0, 3], [4, 1]],
            "one by one": [[g] for g in rng.permutation(N_GROUPS)],
        }
        for name, calls in variants.items():
            y = new_y()
            for groups in calls:
                moe_call(ex, x, pairs, groups, act, y, lib)
            assert np.array_equal(bits(y), bits(full)), f"{b}: {name}"
        y = new_y()
        moe_call(ex, x, [pairs[i] for i in rng.permutation(len(pairs))], range(N_GROUPS), act, y, lib)
        assert np.array_equal(bits(y), bits(full)), f"{b}: pairs shuffled"
        y = new_y()
        few = [p for p in pairs if p[1] in (3, 40)]  # 2 tokens only: other tiles, other work split
        moe_call(ex, x, few, range(N_GROUPS), act, y, lib)
        rows = [p[3] for p in few]
        assert np.array_equal(bits(y[rows]), bits(full[rows])), f"{b}: 2-token call"
        for th in (1, 2):  # a decode step's call: one pair per group, the down rows in long items (not 64-row tiles)
            kernels.set_threads(th)
            for tok in (0, 9, 69):
                one = [p for p in pairs if p[1] == tok]
                y = new_y()
                moe_call(ex, x, one, range(N_GROUPS), act, y, lib)
                rows = [p[3] for p in one]
                assert np.array_equal(bits(y[rows]), bits(full[rows])), f"{b}: token {tok} alone, {th} threads"
        kernels.set_threads(1)
        y = new_y()
        moe_call(ex, x, pairs, range(N_GROUPS), act, y, lib)
        assert np.array_equal(bits(y), bits(full)), f"{b}: 1 vs 8 threads"


def test_non_finite_activations_give_nan_not_a_number(libs):
    """A NaN or Inf in an activation row makes every output of that row non-finite, on every build and type:
    NaN where the row is quantized (the quantizer would otherwise turn it into a finite code and hide it:
    never wrong output silently), IEEE arithmetic (NaN or +-Inf) for float weights; other rows stay finite."""
    for t in ALL_TYPES:
        raw = random_weights(t, 5, 512, seed=400 + int(t))
        for bad in (np.nan, np.inf, -np.inf):
            x = activations(3, 512, seed=13)
            x[1, 300] = bad
            for b, lib in libs.items():
                y = linear(x, raw, t, 512, lib)
                ok = ~np.isfinite(y[1]) if t in FLOAT_TYPES else np.isnan(y[1])
                assert ok.all(), f"{t.name} {b}: {bad} in the input gave {y[1]}"
                assert np.isfinite(y[[0, 2]]).all(), f"{t.name} {b}"


_FUSED_PROBE = """
import sys, numpy as np, torch
from gguf import GGMLQuantizationType as T
sys.path.insert(0, {tests!r})
import test_kernels as tk
from moestream import kernels
out = {{}}
for t in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.F32, T.F16, T.BF16):
    raw = tk.random_weights(t, 37, 1024, seed=500 + int(t))
    x = tk.activations(70, 1024, seed=14)
    for b in {builds!r}:
        out[f"{{t.name}}_{{b}}"] = tk.linear(x, raw, t, 1024, kernels.load(b))
        # one token per call: the fused kernels' one-token paths (Q6_K's shared offset sums, F32 / F16 / BF16's
        # row quads)
        out[f"{{t.name}}_{{b}}_1"] = np.stack([tk.linear(x[i:i + 1], raw, t, 1024, kernels.load(b))[0]
                                             for i in (0, 33, 69)])
        out[f"{{t.name}}_{{b}}_3"] = tk.linear(x[5:8], raw, t, 1024, kernels.load(b))  # a short tile
np.savez(sys.argv[1], **out)
"""


@pytest.mark.skipif(not {"avx2", "avx512"} & set(BUILDS), reason="the fused kernels are x86 SIMD only")
def test_fused_kernels_bitwise_equal_the_unpack_path(tmp_path):
    """Q4_K, Q5_K, Q6_K, Q8_0, F32, F16 and BF16 run fused kernels on x86 builds (codes formed in registers, float
    rows read in place; on AVX512 builds the k-quants' token tiles, super-blocks prepared once per row and tile);
    ``MS_NO_FUSED=1`` selects the generic unpack-then-dot path. Both must give the same bits (so the fused kernels
    change speed only), for 70 tokens (tiles of 8 and a remainder), 3 tokens and one token per call."""
    import os
    import subprocess
    import sys
    builds = [b for b in ("avx2", "avx512") if b in BUILDS]
    code = _FUSED_PROBE.format(tests=str(Path(__file__).parent), builds=builds)
    runs = {}
    for label, extra in (("fused", {}), ("unpack", {"MS_NO_FUSED": "1"})):
        out = tmp_path / f"{label}.npz"
        env = {**os.environ, **extra}
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, capture_output=True)
        runs[label] = np.load(out)
    assert len(runs["fused"].files) == 21 * len(builds)
    for k in runs["fused"].files:
        a, b = runs["fused"][k], runs["unpack"][k]
        assert np.isfinite(a).all()
        assert np.array_equal(bits(a), bits(b)), f"{k}: fused and unpack paths differ"


def test_damaged_kernel_cache_is_rebuilt_not_loaded(tmp_path):
    """A cached build whose bytes no longer match the digest written after it was built (truncated, emptied)
    is rebuilt instead of loaded: loading a truncated shared object would crash the process (SIGBUS)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "MOESTREAM_KERNELS": "portable"}
    probe = [sys.executable, "-c", "from moestream import kernels; print(kernels.load().ms_isa(), "
             "kernels.build_seconds() > 0)"]
    first = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and first.stdout.split() == ["0", "True"], first.stderr
    assert re.search(r"compiled the CPU kernels in \d+\.\d s", first.stderr), first.stderr
    cached = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert cached.stdout.split() == ["0", "False"] and "compil" not in cached.stderr, cached.stderr
    (lib,) = (tmp_path / "moestream" / "kernels").glob("moekern-portable-*.so")
    size = lib.stat().st_size
    for damage in (lambda f: f.truncate(1000), lambda f: f.truncate(0)):
        with open(lib, "r+b") as f:
            damage(f)
        again = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and again.stdout.split() == ["0", "True"], (again.returncode, again.stderr)
        assert "compiling the CPU kernels" in again.stderr
        assert lib.stat().st_size == size
