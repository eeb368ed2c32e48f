"""moestream.gpu.tkernels: Triton kernels on ggml blocks, bit-exact decoding and deterministic matmuls.

Where CUDA is available and ``TRITON_INTERPRET`` is not set by the user, the tests run on CUDA tensors;
otherwise ``TRITON_INTERPRET=1`` is set here, before triton is imported, and they run on CPU tensors through
Triton's interpreter (numpy). Shapes are kept small for the interpreter.

Tolerance against the float64 reference ``x.double() @ W.double().T`` (``W`` = the exact float32 weights
of :func:`moestream.quant.dequantize`): the standard bound for a float32 dot product of ``n`` terms in any
summation order, ``|err| <= gamma_n * sum_k |x_k| |w_k|`` with ``gamma_n = n u / (1 - n u)``,
``u = 2**-24`` (one rounding per product and per addition; FMA only tightens it). It holds for every order
the kernels may use (sub-block sums, tree reductions, sequential FMA chains), so it is rigorous, not tuned.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

ON_CUDA = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tkernels imports it)

pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

import realblocks  # noqa: E402
from moestream import quant  # noqa: E402
from moestream.gpu import tkernels  # noqa: E402
from test_quant import random_blocks, random_floats  # noqa: E402

T = GGMLQuantizationType

ALL_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
REQUIRED = {T.F16, T.BF16, T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS}
FLOATS = (T.F32, T.F16, T.BF16)
#: m_hint values: decode GEMV with one row per tile, GEMV with a tile of 8 rows, prefill GEMM
M_HINTS = (1, 6, 33)
U = 2.0 ** -24


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if ON_CUDA else "cpu"


def ids(t: GGMLQuantizationType) -> str:
    return t.name


def make_raw(qtype: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """uint8 [n_rows, row_bytes] of valid random blocks (finite fp16 scales) or random finite floats."""
    block = GGML_QUANT_SIZES[qtype][0]
    if qtype in FLOATS:
        return torch.from_numpy(random_floats(qtype, n_rows, n_cols, seed))
    return torch.from_numpy(random_blocks(qtype, n_rows, n_cols // block, seed))


def wide(qtype: GGMLQuantizationType) -> int:
    """A test width: two 256-chunks for the k-quants, a ragged tail (9 blocks) for blocks of 32, 100 for floats."""
    return {1: 100, 32: 288, 256: 512}[GGML_QUANT_SIZES[qtype][0]]


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {len(bad)} of {g.numel()} values differ; first at {i}: "
                             f"{got[i].item()!r} vs {want[i].item()!r}")


def assert_close_to_f64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """``y`` (float32 [T, N]) within gamma_n * (|x| @ |w|.T) of the float64 product (module docstring)."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    ref = x64 @ w64.T
    n = x.shape[1]
    bound = (n * U / (1 - n * U)) * (x64.abs() @ w64.abs().T)
    err = (y.double().cpu() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0.0, f"{what}: error exceeds gamma_n bound by {worst:g} (max err {err.max().item():g})"


# ---------------------------------------------------------------------------
# API surface
# ---------------------------------------------------------------------------


def test_types_and_computes():
    assert {int(t) for t in REQUIRED} <= tkernels.TYPES
    assert tkernels.available()
    assert tkernels.computes(T.Q4_K, 512) and not tkernels.computes(T.Q4_K, 384)
    assert tkernels.computes(T.Q8_0, 96) and not tkernels.computes(T.Q8_0, 100)
    assert tkernels.computes(T.F16, 7)
    assert not tkernels.computes(T.Q2_K, 256)  # not computed here
    assert not tkernels.computes(9999, 256)


def test_errors(device):
    raw = make_raw(T.Q8_0, 4, 64, 0).to(device)
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="Q2_K"):
        tkernels.dequantize(raw, T.Q2_K, 256)
    with pytest.raises(ValueError, match="block size"):
        tkernels.linear(x[:, :40].contiguous(), raw, T.Q8_0, 40)
    with pytest.raises(TypeError):
        tkernels.linear(x.double(), raw, T.Q8_0, 64)
    with pytest.raises(ValueError, match="outside the pool"):
        tkernels.grouped(x, raw.reshape(-1), [8], [0, 2], [0, 1], T.Q8_0, 4, 64, 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        tkernels.grouped(x, raw.reshape(-1), [0, 0], [0, 2, 1], [0, 1], T.Q8_0, 4, 64, 2)
    with pytest.raises(ValueError, match="src_rows"):
        tkernels.grouped(x, raw.reshape(-1), [0], [0, 2], [0, 2], T.Q8_0, 4, 64, 2)


# ---------------------------------------------------------------------------
# 1. dequantize: the kernels' decoders are bit-identical to moestream.quant (= gguf's reference)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids)
def test_dequantize_bit_exact(device, qtype):
    for n_rows, n_cols, seed in ((20, wide(qtype), 1), (3, GGML_QUANT_SIZES[qtype][0], 2)):  # wide; one block
        raw = make_raw(qtype, n_rows, n_cols, seed)
        got = tkernels.dequantize(raw.to(device), qtype, n_cols)
        assert got.dtype == torch.float32
        assert_bits_equal(got.cpu(), quant.dequantize(raw, qtype, n_cols), f"{qtype.name} {n_rows}x{n_cols}")


@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if t not in FLOATS], ids=ids)
def test_dequantize_edge_scales(device, qtype):
    """fp16 scales that are subnormal (the smallest too), +-0, tiny and huge normals: still bit-exact."""
    scales = np.array([5.96e-8, -1.2e-7, 3.0e-6, -6.0e-5, 6.1e-5, 0.0, -0.0, 0.33, -2.0, 65504.0])
    block = GGML_QUANT_SIZES[qtype][0]
    n_cols = 256 if block == 256 else 64
    raw = torch.from_numpy(random_blocks(qtype, 24, n_cols // block, 7, scales=scales))
    got = tkernels.dequantize(raw.to(device), qtype, n_cols)
    assert_bits_equal(got.cpu(), quant.dequantize(raw, qtype, n_cols), qtype.name)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32], ids=ids)
def test_dequantize_float_specials(device, qtype):
    """Every fp16 bit pattern (subnormals, infs, NaN payloads), and bf16/f32 specials, exactly as numpy does."""
    if qtype == T.F16:
        raw = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).reshape(256, 512)
        n_cols = 256
    elif qtype == T.BF16:
        raw = torch.arange(0, 65536, 17, dtype=torch.int32).to(torch.int16).view(torch.uint8)[:7680]
        raw, n_cols = raw.reshape(30, 256), 128
    else:
        vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-40, 3.4e38, 1.0] * 8)
        raw, n_cols = vals.view(torch.uint8).reshape(2, 128), 32
    got = tkernels.dequantize(raw.to(device), qtype, n_cols)
    assert_bits_equal(got.cpu(), quant.dequantize(raw, qtype, n_cols), qtype.name)


def test_unaligned_view(device):
    """A row-slice view at an odd byte address of a bigger buffer: same decode, same linear bits as a copy."""
    raw = make_raw(T.Q4_K, 9, 256, 3)
    big = torch.zeros(1 + raw.numel(), dtype=torch.uint8)
    big[1:] = raw.reshape(-1)
    view = big.to(device)[1:].view(9, raw.shape[1])[2:7]
    assert_bits_equal(tkernels.dequantize(view, T.Q4_K, 256).cpu(), quant.dequantize(raw[2:7], T.Q4_K, 256), "view")
    x = torch.randn(2, 256).to(device)
    assert_bits_equal(tkernels.linear(x, view, T.Q4_K, 256), tkernels.linear(x, raw[2:7].clone().to(device),
                                                                            T.Q4_K, 256), "linear on a view")


def test_real_blocks(device):
    """Real llama.cpp-made blocks (gemma-3-270m Q4_K_M chunks): bit-exact decoding and a close linear."""
    try:
        samples = list(realblocks.real_samples(max_rows=16, per_type=1))
    except realblocks.RealBlocksUnavailable as exc:
        pytest.skip(f"real GGUF chunk wheels unavailable (network?): {exc}")
    done = set()
    for info, _first, raw_np in samples:
        if not tkernels.computes(info.ggml_type, info.n_cols):
            continue
        raw = torch.from_numpy(np.ascontiguousarray(raw_np))
        want = quant.dequantize(raw, info.ggml_type, info.n_cols)
        assert_bits_equal(tkernels.dequantize(raw.to(device), info.ggml_type, info.n_cols).cpu(), want, info.name)
        x = torch.randn(2, info.n_cols, generator=torch.Generator().manual_seed(0))
        y = tkernels.linear(x.to(device), raw.to(device), info.ggml_type, info.n_cols, m_hint=1)
        assert_close_to_f64(y, x, want, info.name)
        done.add(info.ggml_type)
    assert {T.Q8_0, T.Q4_K, T.Q6_K} <= done, f"real types exercised: {sorted(t.name for t in done)}"


# ---------------------------------------------------------------------------
# 2. linear against the float64 reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("m_hint", (None, *M_HINTS))
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids)
def test_linear_vs_float64(device, qtype, m_hint):
    n_cols = wide(qtype)
    raw = make_raw(qtype, 40, n_cols, 11)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(5, n_cols, generator=torch.Generator().manual_seed(5))
    y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m_hint)
    assert y.shape == (5, 40) and y.dtype == torch.float32
    assert_close_to_f64(y, x, w, f"{qtype.name} m_hint={m_hint}")
    y2 = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m_hint)
    assert_bits_equal(y2, y, "second call")


# ---------------------------------------------------------------------------
# 3. grouped: one launch for many experts, the same bits wherever an expert sits
# ---------------------------------------------------------------------------


def build_pool(mats: list[torch.Tensor], order: list[int], lead: int, gaps: list[int]) -> tuple[torch.Tensor, list]:
    """uint8 pool: ``lead`` junk bytes, then the matrices in ``order``, each followed by a junk gap.

    Returns (pool, offsets) with offsets[e] the byte offset of matrix e.
    """
    rng = np.random.default_rng(lead)
    parts, offsets, pos = [rng.integers(0, 256, lead, dtype=np.uint8)], [0] * len(mats), lead
    for e, gap in zip(order, gaps, strict=True):
        offsets[e] = pos
        parts.append(mats[e].reshape(-1).numpy())
        parts.append(rng.integers(0, 256, gap, dtype=np.uint8))
        pos += mats[e].numel() + gap
    return torch.from_numpy(np.concatenate(parts)), offsets


def route(n_tok: int, n_exp: int, k: int, seed: int, empty: tuple[int, ...]) -> list[list[int]]:
    """For each expert, the tokens routed to it (top-k of random scores; experts in ``empty`` get none)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((n_tok, n_exp))
    scores[:, list(empty)] = -np.inf
    top = np.argsort(-scores, axis=1)[:, :k]
    return [[t for t in range(n_tok) if e in top[t]] for e in range(n_exp)]


def launch(x, pool, offsets, groups, order, qtype, n_rows, n_cols, m_hint, device):
    """grouped() over experts in ``order``: returns {(expert, token): output row}."""
    starts, src, offs = [0], [], []
    for e in order:
        src += groups[e]
        starts.append(len(src))
        offs.append(offsets[e])
    out = tkernels.grouped(x, pool, np.array(offs, dtype=np.int64), np.array(starts, dtype=np.int32),
                           np.array(src, dtype=np.int32), qtype, n_rows, n_cols, m_hint)
    assert out.shape == (len(src), n_rows)
    rows, p = {}, 0
    for e in order:
        for t in groups[e]:
            rows[(e, t)] = out[p]
            p += 1
    return rows, out


@pytest.mark.parametrize("m_hint", M_HINTS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids)
def test_grouped(device, qtype, m_hint):
    n_exp, n_rows = 5, 24
    n_cols = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    n_tok = 1 if m_hint == 1 else 6
    mats = [make_raw(qtype, n_rows, n_cols, 100 + e) for e in range(n_exp)]
    groups = route(n_tok, n_exp, 2 if n_tok == 1 else 3, m_hint, empty=(3,))
    x = torch.randn(n_tok, n_cols, generator=torch.Generator().manual_seed(9)).to(device)

    # resident layout: odd lead and odd gaps (any byte alignment), experts in a shuffled order
    pool_a, off_a = build_pool(mats, [2, 0, 4, 1, 3], lead=7, gaps=[3, 33, 1, 130, 5])
    rows_a, out_a = launch(x, pool_a.to(device), off_a, groups, range(n_exp), qtype, n_rows, n_cols, m_hint, device)
    # streamed layout: other slots, other order of groups in the launch
    pool_b, off_b = build_pool(mats, [3, 1, 4, 0, 2], lead=4098, gaps=[0, 2, 9, 64, 17])
    order_b = [4, 1, 3, 0, 2]
    rows_b, _ = launch(x, pool_b.to(device), off_b, groups, order_b, qtype, n_rows, n_cols, m_hint, device)
    # twice in a row
    _, out_a2 = launch(x, pool_a.to(device), off_a, groups, range(n_exp), qtype, n_rows, n_cols, m_hint, device)
    assert_bits_equal(out_a2, out_a, "second launch")

    for e in range(n_exp):
        if not groups[e]:
            continue
        w = quant.dequantize(mats[e], qtype, n_cols)
        xs = x[groups[e]].contiguous()
        lin = tkernels.linear(xs, mats[e].to(device), qtype, n_cols, m_hint=m_hint)
        alone, _ = launch(x, pool_b.to(device), off_b, groups, [e], qtype, n_rows, n_cols, m_hint, device)
        for j, t in enumerate(groups[e]):
            what = f"{qtype.name} m_hint={m_hint} expert {e} token {t}"
            assert_bits_equal(rows_a[(e, t)], lin[j], f"{what}: grouped vs linear")
            assert_bits_equal(rows_b[(e, t)], rows_a[(e, t)], f"{what}: relocated/permuted")
            assert_bits_equal(alone[(e, t)], rows_a[(e, t)], f"{what}: alone in its launch")
        assert_close_to_f64(lin, xs.cpu(), w, f"{qtype.name} expert {e}")


def test_grouped_out_and_empty(device):
    qtype, n_rows, n_cols = T.Q4_0, 8, 64
    mat = make_raw(qtype, n_rows, n_cols, 1)
    pool = mat.reshape(-1).to(device)
    x = torch.randn(3, n_cols).to(device)
    empty = tkernels.grouped(x, pool, [0, 0], [0, 0, 0], np.zeros(0, np.int32), qtype, n_rows, n_cols, 3)
    assert empty.shape == (0, n_rows)
    out = torch.full((4, n_rows), float("nan"), device=device)
    got = tkernels.grouped(x, pool, torch.tensor([0, 0]), torch.tensor([0, 0, 4], dtype=torch.int32),
                           torch.tensor([2, 0, 1, 2], dtype=torch.int32), qtype, n_rows, n_cols, 3, out=out)
    assert got is out
    assert_bits_equal(out, tkernels.linear(x[[2, 0, 1, 2]].contiguous(), mat.to(device), qtype, n_cols, m_hint=3),
                      "out=")


# ---------------------------------------------------------------------------
# 4. the GEMV path of _gemv_kernel (m_hint <= 8): its documented summation order, whatever the alignment
# ---------------------------------------------------------------------------

GEMV_TYPES = (T.Q4_K, T.Q6_K, T.Q4_0, T.Q8_0)


def assert_unaligned_same(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, n_cols: int, m: int,
                          ref: torch.Tensor, what: str, device: str) -> None:
    """linear on ``raw`` copied to 1 and 2 bytes past a 16-byte boundary (byte loads; 16-bit loads where the type's
    words are 16-bit) gives the bits ``ref``."""
    for lead in (1, 2):
        big = torch.zeros(lead + raw.numel(), dtype=torch.uint8)
        big[lead:] = raw.reshape(-1)
        yu = tkernels.linear(x.to(device), big.to(device)[lead:].view(raw.shape), qtype, n_cols, m_hint=m)
        assert_bits_equal(yu.cpu(), ref, f"{what}: matrix at {lead} mod 16")


def gemv2_lane_order(qtype: GGMLQuantizationType, n_cols: int, ks: int, lpb: int = 8) -> np.ndarray:
    """int [steps, lanes * 4]: the elements k that _gemv2_kernel's lane-element ``4 g + e`` of a row multiplies, in
    its documented order (module docstring of tkernels), -1 where it multiplies nothing (a ragged last K step): lane
    ``g = LPB c + li``, K steps ``kb = 0, KS, ...`` over blocks ``b = kb + c``. Super-blocks of 256: Q4_K (``B = 128 /
    LPB`` bytes per lane from ``B li = 32 p + o``): for r < B/4, for half = 0, 1: ``256 b + 64 p + o + 32 half + 4 r +
    e``; Q6_K (``R = 64 / LPB``, ``h = li // (LPB/2)``, ``l = R (li % (LPB/2))``): for v < R/4, for q = 0..3: ``256 b +
    128 h + l + 32 q + 4 v + e``. Blocks of 32 (``QB = 16 / LPB`` quant bytes per lane for Q4_0, ``32 / LPB`` for
    Q8_0, from ``QB li``; -1 for ``b`` past the row): Q4_0, for r < QB/4, for half = 0, 1 (low, high nibbles): ``32 b +
    16 half + QB li + 4 r + e``; Q8_0, for r < QB/4: ``32 b + QB li + 4 r + e``. Written from the ggml block layouts,
    not from the kernel's code."""
    unit = 256 if qtype in (T.Q4_K, T.Q6_K) else 32
    n_b = n_cols // unit
    assert unit == 32 or n_b % ks == 0
    b_len, r_len, half_lanes = 128 // lpb, 64 // lpb, lpb // 2
    qb = (16 if qtype == T.Q4_0 else 32) // lpb
    inner = {T.Q4_K: [(r, half) for r in range(b_len // 4) for half in range(2)],
             T.Q6_K: [(v, q) for v in range(r_len // 4) for q in range(4)],
             T.Q4_0: [(r, half) for r in range(qb // 4) for half in range(2)],
             T.Q8_0: [(r, 0) for r in range(qb // 4)]}[qtype]
    steps = []
    for kb in range(0, n_b, ks):
        for i, j in inner:
            row = []
            for g in range(lpb * ks):
                c, li = divmod(g, lpb)
                b = kb + c
                if b >= n_b:
                    first = None
                elif qtype == T.Q4_K:
                    first = 256 * b + 64 * (b_len * li // 32) + (b_len * li) % 32 + 32 * j + 4 * i
                elif qtype == T.Q6_K:
                    first = 256 * b + 128 * (li // half_lanes) + r_len * (li % half_lanes) + 32 * j + 4 * i
                else:  # Q4_0 (j: the half), Q8_0 (j = 0)
                    first = 32 * b + 16 * j + qb * li + 4 * i
                row += [-1] * 4 if first is None else [first + e for e in range(4)]
            steps.append(row)
    idx = np.array(steps)
    assert sorted(idx[idx >= 0].tolist()) == list(range(n_cols)), "every element exactly once"
    return idx


def gemv2_order(x: torch.Tensor, w: torch.Tensor, qtype: GGMLQuantizationType, ks: int, lpb: int | None = None
                ) -> torch.Tensor:
    """``x @ w.T`` (float32 [T, N]) in _gemv2_kernel's order: :func:`lane_sum` of :func:`gemv2_lane_order` (the
    ``4 LANES`` lane-elements). ``lpb``: by default :func:`tkernels.gemv2_lpb` of the type."""
    return lane_sum(x, w, gemv2_lane_order(qtype, w.shape[1], ks,
                                           tkernels.gemv2_lpb(int(qtype)) if lpb is None else lpb))


def gemv32_lane_order(qtype: GGMLQuantizationType, n_cols: int, vw: int) -> np.ndarray:
    """int [steps, 32 * vw]: the elements k that _gemv32_kernel's lane-element ``vw l + e`` of a row multiplies, in
    its documented order, -1 where it multiplies nothing (a ragged last step). Lane ``l = LPB c + li`` (``LPB = 16 /
    vw`` for Q4_0, ``32 / vw`` for Q8_0; ``KS = 32 / LPB`` blocks side by side) owns quant bytes ``vw li .. vw li +
    vw - 1`` of block ``b = KS s + c`` in K step s: Q4_0 adds the low nibbles (``32 b + vw li + e``), then the high
    ones (``32 b + 16 + vw li + e``); Q8_0 ``32 b + vw li + e``. Written from the ggml block layouts, not from the
    kernel's code."""
    n_b = n_cols // 32
    lpb = (16 if qtype == T.Q4_0 else 32) // vw
    ks = 32 // lpb
    steps = []
    for s in range(-(-n_b // ks)):
        for half in range(2 if qtype == T.Q4_0 else 1):
            row = []
            for lane in range(32):
                c, li = divmod(lane, lpb)
                b = ks * s + c
                row += [-1 if b >= n_b else 32 * b + 16 * half + vw * li + e for e in range(vw)]
            steps.append(row)
    idx = np.array(steps)
    assert sorted(idx[idx >= 0].tolist()) == list(range(n_cols)), "every element exactly once"
    return idx


def lane_sum(x: torch.Tensor, w: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """``x @ w.T`` (float32 [T, N]) with float32 torch ops (one rounding each): lane-element j of a row accumulates
    ``w[n, k] * x[k]`` for the k of column j of ``idx`` (int [steps, lanes]), step by step from +0.0 (-1 entries add
    nothing); then the lane-elements are summed pairwise (``a[2l] + a[2l+1]``, level by level)."""
    idx = torch.from_numpy(idx)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    for m in range(x.shape[0]):
        acc = torch.zeros((w.shape[0], idx.shape[1]), dtype=torch.float32)
        for st in idx:
            used, k = st >= 0, st.clamp_min(0)
            acc = torch.where(used, acc + w[:, k] * x[m, k], acc)
        while acc.shape[1] > 1:
            acc = acc[:, 0::2] + acc[:, 1::2]
        out[m] = acc[:, 0]
    return out


def gemv32_order(x: torch.Tensor, w: torch.Tensor, qtype: GGMLQuantizationType, vw: int | None = None
                 ) -> torch.Tensor:
    """``x @ w.T`` in _gemv32_kernel's order (:func:`gemv32_lane_order`; ``vw``: by default tkernels.GEMV32_VW)."""
    return lane_sum(x, w, gemv32_lane_order(qtype, w.shape[1], tkernels.GEMV32_VW if vw is None else vw))


def gemv_order(x: torch.Tensor, w: torch.Tensor, qtype: GGMLQuantizationType, ks: int | None = None,
               grouped: bool = False) -> torch.Tensor:
    """``x @ w.T`` (float32 [T, N]) in _gemv_kernel's order, with float32 torch ops on the CPU (one rounding each):
    lane (g, e) of an output accumulates ``x[k] * w[n, k]`` for ``k = 256 KS c + SUB g + VW j + e`` in the order of
    (c, j), from +0.0; then the lanes ``VW g + e`` are summed pairwise (``a[2l] + a[2l+1]``, level by level).
    ``ks``: KS, by default :func:`tkernels.gemv_ksplit` of the matrix through linear() (or the grouped launches).
    Where the matrix takes _gemv2_kernel (:func:`tkernels.gemv2_uses`), :func:`gemv2_order` with its KS instead; where
    it takes _gemv32_kernel (:func:`tkernels.gemv32_uses`), :func:`gemv32_order`."""
    n, k = w.shape
    if tkernels.gemv2_uses(int(qtype), grouped):
        return gemv2_order(x, w, qtype, tkernels.gemv2_ksplit(int(qtype), k, n, grouped) if ks is None else ks)
    if tkernels.gemv32_uses(int(qtype), grouped):
        return gemv32_order(x, w, qtype)
    sub, vw = (16 if qtype == T.Q6_K else 32), tkernels.GEMV_VW[int(qtype)]
    ks = tkernels.gemv_ksplit(int(qtype), k, n, grouped) if ks is None else ks
    step = 256 * ks
    kp = -(-k // step) * step
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    for m in range(x.shape[0]):
        p = torch.zeros((n, kp), dtype=torch.float32)
        p[:, :k] = w * x[m]
        p = p.view(n, kp // step, step // sub, sub // vw, vw)
        acc = torch.zeros((n, step // sub, vw), dtype=torch.float32)
        for c in range(kp // step):
            for j in range(sub // vw):
                acc = acc + p[:, c, :, j, :]
        a = acc.reshape(n, -1)
        while a.shape[1] > 1:
            a = a[:, 0::2] + a[:, 1::2]
        out[m] = a[:, 0]
    return out


def gemv_cols(qtype: GGMLQuantizationType) -> int:
    """Two 256-chunks for the k-quants, nine blocks of 32 (a ragged chunk) for Q4_0/Q8_0."""
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 288


@pytest.mark.parametrize("m", (1, 2, 5, 8))
@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=ids)
def test_gemv_documented_order(device, qtype, m, monkeypatch):
    """linear at m_hint = T <= 8: bitwise the order of gemv_order (on CUDA as in the interpreter), so the same
    bits for every m_hint of the GEMV path; and within the float64 bound."""
    n_cols = gemv_cols(qtype)
    raw = make_raw(qtype, 17, n_cols, 20 + m)  # 17 rows: a partial block of rows (programs of 2 to 16 rows)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(m, n_cols, generator=torch.Generator().manual_seed(m))
    assert tkernels._config(int(qtype), 17, n_cols, m)["WIDE"]
    y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m)
    assert_bits_equal(y.cpu(), gemv_order(x, w, qtype), f"{qtype.name} m={m}")
    assert_close_to_f64(y, x, w, f"{qtype.name} m={m}")
    if not ON_CUDA:  # the interpreter's rows per program (GEMV_INTERP_BLOCK_N) and the GPU's: the same bits
        cfg = tkernels._config(int(qtype), 17, n_cols, m, grouped=False)
        gpu_rows = (tkernels.GEMV32_ROWS if cfg.get("G32") else
                    max(1, 32 * tkernels.GEMV2_WARPS // cfg["NSUB"]) if cfg.get("K2") else
                    max(1, 32 * tkernels.GEMV_WARPS // (256 // tkernels._sub(int(qtype))
                                                        * tkernels.gemv_ksplit(int(qtype), n_cols, 17))))
        monkeypatch.setattr(tkernels, "GEMV_INTERP_BLOCK_N", gpu_rows)
        assert tkernels._config(int(qtype), 17, n_cols, m)["BLOCK_N"] == gpu_rows < 17
        y_gpu_rows = tkernels.linear(x, raw, qtype, n_cols, m_hint=m)
        assert_bits_equal(y_gpu_rows, y, f"{qtype.name} m={m}: {gpu_rows} rows per program")


@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=ids)
def test_gemv_ksplit_order(device, qtype, monkeypatch):
    """Wide rows (K = 2048: 8 chunks side by side for Q4_K, 4 for Q6_K; 2816 = 11 chunks of Q4_0/Q8_0: 8 side by
    side, the rest masked) in gemv_order's order for the K split gemv_ksplit picks, and with
    MOESTREAM_GEMV_KSPLIT=1 in the order of one chunk per step; the two orders differ (the knob is real). On
    _gemv_kernel (MOESTREAM_GEMV2=0, MOESTREAM_GEMV32=0)."""
    monkeypatch.setattr(tkernels, "GEMV2", "0")
    monkeypatch.setattr(tkernels, "GEMV32", False)
    n_cols = 2048 if GGML_QUANT_SIZES[qtype][0] == 256 else 2816
    raw = make_raw(qtype, 5, n_cols, 41)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(4))
    ks = tkernels.gemv_ksplit(int(qtype), n_cols, 5)
    assert ks == (4 if qtype == T.Q6_K else 8)
    assert tkernels.gemv_ksplit(int(qtype), n_cols, 5, grouped=True) == 1
    assert tkernels.gemv_ksplit(int(qtype), n_cols, tkernels.GEMV_KSPLIT_MAX_ROWS + 1) == 1
    y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=2)
    assert_bits_equal(y.cpu(), gemv_order(x, w, qtype, ks), f"{qtype.name} KS={ks}")
    assert_close_to_f64(y, x, w, f"{qtype.name} KS={ks}")
    monkeypatch.setattr(tkernels, "GEMV_KSPLIT", "1")
    y1 = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=2)
    assert_bits_equal(y1.cpu(), gemv_order(x, w, qtype, 1), f"{qtype.name} KS=1")
    assert not torch.equal(y1.cpu().view(torch.int32), y.cpu().view(torch.int32)), "KS=1 and KS>1: the same bits"


@pytest.mark.parametrize("m_hint", (1, 5))
@pytest.mark.parametrize("qtype,kernel", [pytest.param(q, k, id=f"{q.name}-{k}") for q in GEMV_TYPES
                                          for k in ("gemv", "gemv2") + (("gemv32",) if q in (T.Q4_0, T.Q8_0) else ())])
def test_gemv_alignment_never_changes_bits(device, qtype, m_hint, kernel, monkeypatch):
    """grouped with matrices starting at every byte offset mod 4 (byte loads) and a 16-aligned pool (wide loads),
    several matrices per launch: every row bitwise equal to linear on the aligned matrix and to gemv_order. On
    _gemv_kernel, on _gemv2_kernel (MOESTREAM_GEMV2=all, Q4_0/Q8_0 with MOESTREAM_GEMV2_B32=1) and on
    _gemv32_kernel (Q4_0, Q8_0)."""
    monkeypatch.setattr(tkernels, "GEMV2", "0" if kernel == "gemv" else "all")
    monkeypatch.setattr(tkernels, "GEMV2_B32", kernel == "gemv2")
    monkeypatch.setattr(tkernels, "GEMV32", kernel == "gemv32")
    n_exp, n_rows = 4, 8
    n_cols = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    mats = [make_raw(qtype, n_rows, n_cols, 40 + e) for e in range(n_exp)]
    n_tok = 1 if m_hint == 1 else 5
    groups = route(n_tok, n_exp, 2 if n_tok == 1 else 3, 3, empty=())
    x = torch.randn(n_tok, n_cols, generator=torch.Generator().manual_seed(4)).to(device)
    size = mats[0].numel()  # bytes of one matrix
    # matrices at byte offsets 1, 2, 3 and 0 mod 4 in one pool; and a pool where all start at multiples of 16
    gaps, pos = [], 1
    for want in (2, 3, 0, 0):  # matrix e starts at 1 + e mod 4
        gaps.append((want - pos - size) % 4 + 4)
        pos += size + gaps[-1]
    pool_u, off_u = build_pool(mats, [0, 1, 2, 3], lead=1, gaps=gaps)
    assert sorted(o % 4 for o in off_u) == [0, 1, 2, 3], off_u
    pool_a, off_a = build_pool(mats, [3, 2, 1, 0], lead=32, gaps=[(-size) % 16] * n_exp)
    assert tkernels.alignment(off_a) == 16
    rows_u, _ = launch(x, pool_u.to(device), off_u, groups, range(n_exp), qtype, n_rows, n_cols, m_hint, device)
    rows_a, _ = launch(x, pool_a.to(device), off_a, groups, range(n_exp), qtype, n_rows, n_cols, m_hint, device)
    for e in range(n_exp):
        if not groups[e]:
            continue
        xs = x[groups[e]].contiguous()
        lin = tkernels.linear(xs, mats[e].to(device), qtype, n_cols, m_hint=m_hint)
        ref = gemv_order(xs.cpu(), quant.dequantize(mats[e], qtype, n_cols), qtype, grouped=True)
        assert torch.equal(ref.view(torch.int32), gemv_order(xs.cpu(), quant.dequantize(mats[e], qtype, n_cols),
                                                             qtype).view(torch.int32))  # one order here
        for j, t in enumerate(groups[e]):
            what = f"{qtype.name} m_hint={m_hint} expert {e} (offset {off_u[e]} mod 4 = {off_u[e] % 4}) token {t}"
            assert_bits_equal(rows_u[(e, t)], lin[j], f"{what}: unaligned vs linear")
            assert_bits_equal(rows_a[(e, t)], lin[j], f"{what}: aligned vs linear")
            assert_bits_equal(lin[j].cpu(), ref[j], f"{what}: vs gemv_order")


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K, T.Q4_0, T.F16), ids=ids)
def test_grouped_selected(device, qtype, monkeypatch):
    """grouped_selected (the offsets looked up by expert id in the kernel; two matrices of one launch in two
    pools, the second addressed by its distance from the first, in both directions) gives each row the bits of
    linear() on that expert's matrix, on both kernels (the GEMV path and, with MOESTREAM_GEMV_WIDE=0, the
    older one). A wrong id, table or stride would pick another expert's rows: each expert's blocks differ."""
    n_exp, n_rows, top_k = 6, 16, 3
    n_cols = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 64
    gate = [make_raw(qtype, n_rows, n_cols, 200 + e) for e in range(n_exp)]
    up = [make_raw(qtype, n_rows, n_cols, 300 + e) for e in range(n_exp)]
    x = torch.randn(1, n_cols, generator=torch.Generator().manual_seed(5)).to(device)
    ids = torch.tensor([4, 0, 5], dtype=torch.int64, device=device)
    for wide in (True, False):
        monkeypatch.setattr(tkernels, "GEMV_WIDE", wide)
        want = {(j, e): tkernels.linear(x, m[e].to(device), qtype, n_cols, m_hint=1)[0]
                for j, m in enumerate((gate, up)) for e in ids.tolist()}
        pools = [torch.stack(gate).reshape(n_exp, -1).to(device), torch.stack(up).reshape(n_exp, -1).to(device)]
        for first, second in ((0, 1), (1, 0)):  # the second pool after, then before the first in memory
            a, b = pools[first], pools[second]
            e = torch.arange(n_exp, dtype=torch.int64)
            table = torch.cat([e * a.stride(0), b.data_ptr() - a.data_ptr() + e * b.stride(0)]).to(device)
            tiles = torch.from_numpy(tkernels.plan_tiles(np.arange(2 * top_k + 1), 1)).to(device)
            src = torch.zeros(2 * top_k, dtype=torch.int32, device=device)
            out = torch.empty((2 * top_k, n_rows), device=device)
            tkernels.grouped_selected(x, a, table, ids, 2, tiles, src, qtype, n_rows, n_cols, 1, out,
                                      align=tkernels.alignment(table.cpu()))
            for j, which in enumerate((first, second)):
                for i, ex in enumerate(ids.tolist()):
                    assert_bits_equal(out[j * top_k + i], want[(which, ex)],
                                      f"{qtype.name} wide={wide} table {j} pair {i} (expert {ex})")


def test_gemv_switch(device, monkeypatch):
    """MOESTREAM_GEMV_WIDE=0 (tkernels.GEMV_WIDE False) selects _matmul_kernel's GEMV branch, which sums each
    256-chunk with tl.sum first: still within the float64 bound, and (on these blocks) not the bits of the new
    path; grouped_planned's ``align`` never changes a bit."""
    qtype, n_cols = T.Q4_K, 256
    raw = make_raw(qtype, 16, n_cols, 3)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(1, n_cols, generator=torch.Generator().manual_seed(3))
    new = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=1)
    pool = raw.reshape(-1).to(device)
    args = (x.to(device), pool, torch.zeros(1, dtype=torch.int64, device=device),
            torch.from_numpy(tkernels.plan_tiles(np.array([0, 1]), 1)).to(device),
            torch.zeros(1, dtype=torch.int32, device=device), qtype, 16, n_cols, 1)
    for align in (1, 2, 16):
        got = tkernels.grouped_planned(*args, torch.empty((1, 16), device=device), align=align)
        assert_bits_equal(got, new, f"grouped_planned align={align}")
    monkeypatch.setattr(tkernels, "GEMV_WIDE", False)
    assert not tkernels._config(int(qtype), 16, n_cols, 1)["WIDE"]
    old = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=1)
    assert_close_to_f64(old, x, w, "old path")
    assert not torch.equal(old.cpu().view(torch.int32), new.cpu().view(torch.int32)), "the switch did not switch"


# ---------------------------------------------------------------------------
# 5. _gemv2_kernel (Q4_K, Q6_K, Q4_0, Q8_0): its documented order, its K split, its switch
# ---------------------------------------------------------------------------

GEMV2_KQ_TYPES = (T.Q4_K, T.Q6_K)
GEMV2_B32_TYPES = (T.Q4_0, T.Q8_0)
GEMV2_TYPES = GEMV2_KQ_TYPES + GEMV2_B32_TYPES


def test_gemv2_types():
    """Every type the kernel computes is in tkernels.GEMV2_TYPES (MOESTREAM_GEMV2=all takes them) and tested here."""
    assert set(tkernels.GEMV2_TYPES) == {int(t) for t in GEMV2_TYPES}


@pytest.mark.parametrize("qtype,m,lpb", [pytest.param(q, m, lpb, id=f"{q.name}-{m}-{lpb}") for q in GEMV2_TYPES
                                          for m, lpb in (((1, 8), (3, 8), (8, 8), (2, 4)) if q in GEMV2_KQ_TYPES
                                                         else ((1, 1), (3, 2), (8, 1), (2, 4)))])
def test_gemv2_order(device, qtype, m, lpb, monkeypatch):
    """linear on _gemv2_kernel: bitwise gemv2_order for the K split gemv2_ksplit picks, within the float64 bound, the
    same bits at the GPU's rows per program and from a matrix at an odd address (byte loads) or 2 mod 16 (16-bit
    loads: Q6_K, Q4_0, Q8_0); the grouped launch equals gemv2_order with its KS. Q4_K, Q6_K at 8 and 4 lanes per
    super-block (MOESTREAM_GEMV2_LPB): K = 2048, 8 super-blocks side by side for a small matrix, 1 with GEMV2_THREADS
    lowered (as an LM head gets); K = 768: 3 super-blocks, KS 1; grouped KS 1. Q4_0, Q8_0 at 1, 2 and 4 lanes per
    block (MOESTREAM_GEMV2_LPB32): K = 2816, 88 blocks: KS 32, the last of 3 K steps ragged (24 blocks); KS 8 / LPB
    with GEMV2_THREADS lowered, 11 or more whole steps; K = 704, 22 blocks as Gemma's expert down rows: KS 8, the
    last step ragged; grouped KS 8 / LPB."""
    b32 = qtype in GEMV2_B32_TYPES
    knob = "GEMV2_LPB32" if b32 else "GEMV2_LPB"
    monkeypatch.setattr(tkernels, "GEMV2", "all")
    monkeypatch.setattr(tkernels, "GEMV2_B32", True)  # Q4_0/Q8_0 on _gemv2_kernel too (opt-in)
    monkeypatch.setattr(tkernels, knob, lpb)
    threads = tkernels.GEMV2_THREADS
    cases = (((5, 2816, threads, 32), (5, 2816, 1, 8 // lpb), (9, 704, threads, 8)) if b32 else
             ((5, 2048, threads, 8), (5, 2048, 1, 1), (9, 768, threads, 1)))
    for n_rows, n_cols, threads, want_ks in cases:
        monkeypatch.setattr(tkernels, "GEMV2_THREADS", threads)
        raw = make_raw(qtype, n_rows, n_cols, 50 + m)
        w = quant.dequantize(raw, qtype, n_cols)
        x = torch.randn(m, n_cols, generator=torch.Generator().manual_seed(m))
        cfg = tkernels._config(int(qtype), n_rows, n_cols, m, grouped=False)
        assert cfg.get("K2") and tkernels.gemv2_ksplit(int(qtype), n_cols, n_rows) == want_ks
        assert cfg["NSUB"] == want_ks * lpb and cfg["LPB"] == lpb
        what = f"{qtype.name} {n_rows}x{n_cols} m={m} LPB={lpb} KS={want_ks}"
        y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m)
        ref = gemv2_order(x, w, qtype, want_ks)
        assert_bits_equal(y.cpu(), ref, what)
        assert_close_to_f64(y, x, w, what)
        assert_unaligned_same(x, raw, qtype, n_cols, m, ref, what, device)
        if not ON_CUDA:
            gpu_rows = max(1, 32 * tkernels.GEMV2_WARPS // cfg["NSUB"])
            monkeypatch.setattr(tkernels, "GEMV_INTERP_BLOCK_N", gpu_rows)
            assert_bits_equal(tkernels.linear(x, raw, qtype, n_cols, m_hint=m), ref, f"{what}: {gpu_rows} rows")
            monkeypatch.undo()
            monkeypatch.setattr(tkernels, "GEMV2", "all")
            monkeypatch.setattr(tkernels, "GEMV2_B32", True)  # Q4_0/Q8_0 on _gemv2_kernel too (opt-in)
            monkeypatch.setattr(tkernels, knob, lpb)
        ks_g = tkernels.gemv2_ksplit(int(qtype), n_cols, n_rows, grouped=True)
        assert ks_g == (8 // lpb if b32 else 1)
        g = tkernels.grouped(x.to(device), raw.reshape(-1).to(device), [0], [0, m], np.arange(m), qtype, n_rows,
                             n_cols, m)
        assert_bits_equal(g.cpu(), gemv2_order(x, w, qtype, ks_g), f"{what}: grouped")


@pytest.mark.parametrize("qtype", GEMV2_B32_TYPES, ids=ids)
def test_gemv2_b32_edge_scales(device, qtype, monkeypatch):
    """Q4_0 / Q8_0 blocks whose fp16 d is subnormal (the smallest too), +-0, tiny or huge: _gemv2_kernel still
    multiplies exactly moestream.quant's weights in gemv2_order's order (a ragged K step: 9 blocks, KS 8)."""
    monkeypatch.setattr(tkernels, "GEMV2", "all")
    monkeypatch.setattr(tkernels, "GEMV2_B32", True)  # Q4_0/Q8_0 on _gemv2_kernel too (opt-in)
    scales = np.array([5.96e-8, -1.2e-7, 3.0e-6, -6.0e-5, 6.1e-5, 0.0, -0.0, 0.33, -2.0, 65504.0])
    n_rows, n_cols = 12, 288
    raw = torch.from_numpy(random_blocks(qtype, n_rows, n_cols // 32, 8, scales=scales))
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(8))
    ks = tkernels.gemv2_ksplit(int(qtype), n_cols, n_rows)
    assert ks * tkernels.gemv2_lpb(int(qtype)) == 8
    y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=2)
    assert_bits_equal(y.cpu(), gemv2_order(x, w, qtype, ks), qtype.name)
    assert_close_to_f64(y, x, w, qtype.name)


@pytest.mark.parametrize("qtype", GEMV2_TYPES, ids=ids)
def test_gemv2_switch(device, qtype, monkeypatch):
    """MOESTREAM_GEMV2: "0" takes _gemv_kernel (gemv_order's _gemv_kernel order), "linear" only linear(), "grouped"
    only the grouped launches; the two kernels' bits differ (the switch is real), both within the float64 bound."""
    n_rows, n_cols = 6, 512
    raw = make_raw(qtype, n_rows, n_cols, 77)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(1, n_cols, generator=torch.Generator().manual_seed(7))
    out = {}
    for mode in ("all", "0", "linear", "grouped"):
        monkeypatch.setattr(tkernels, "GEMV2", mode)
        monkeypatch.setattr(tkernels, "GEMV2_B32", True)  # Q4_0/Q8_0 on _gemv2_kernel too (opt-in)
        lin = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=1).cpu()
        grp = tkernels.grouped(x.to(device), raw.reshape(-1).to(device), [0], [0, 1], [0], qtype, n_rows, n_cols,
                               1).cpu()
        assert tkernels.gemv2_uses(int(qtype), False) == (mode in ("all", "linear"))
        assert tkernels.gemv2_uses(int(qtype), True) == (mode in ("all", "grouped"))
        assert_bits_equal(lin, gemv_order(x, w, qtype), f"{mode}: linear")
        assert_bits_equal(grp, gemv_order(x, w, qtype, grouped=True), f"{mode}: grouped")
        assert_close_to_f64(lin, x, w, mode)
        out[mode] = (lin, grp)
    assert not torch.equal(out["all"][0].view(torch.int32), out["0"][0].view(torch.int32)), "GEMV2=0 did not switch"
    assert_bits_equal(out["linear"][0], out["all"][0], "linear mode, linear")
    assert_bits_equal(out["linear"][1], out["0"][1], "linear mode, grouped")
    assert_bits_equal(out["grouped"][1], out["all"][1], "grouped mode, grouped")


# ---------------------------------------------------------------------------
# 6. _gemv32_kernel (Q4_0, Q8_0: lanes along a row's bytes): its documented order, its switch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype,m,vw", [pytest.param(q, m, vw, id=f"{q.name}-{m}-{vw}") for q in (T.Q4_0, T.Q8_0)
                                        for m, vw in ((1, 4), (3, 4), (8, 4), (2, 2))])
def test_gemv32_order(device, qtype, m, vw, monkeypatch):
    """linear and grouped on _gemv32_kernel: bitwise gemv32_order, within the float64 bound, the same bits from a
    matrix at an odd address (byte loads) or at 2 mod 16 (16-bit loads), at the GPU's rows per program, and with
    fewer K steps per loop iteration (MOESTREAM_GEMV32_U: the loop's shape, never a bit). K = 2816 (88 blocks:
    Gemma's expert gate/up and attention rows, whole steps), 704 (22 blocks, Gemma's expert down rows) and 288 (9
    blocks): ragged last steps."""
    monkeypatch.setattr(tkernels, "GEMV32", True)
    monkeypatch.setattr(tkernels, "GEMV32_VW", vw)
    for n_rows, n_cols in ((5, 2816), (9, 704), (6, 288)):
        raw = make_raw(qtype, n_rows, n_cols, 60 + m)
        w = quant.dequantize(raw, qtype, n_cols)
        x = torch.randn(m, n_cols, generator=torch.Generator().manual_seed(m))
        for grouped in (False, True):
            assert tkernels.gemv32_uses(int(qtype), grouped)
            cfg = tkernels._config(int(qtype), n_rows, n_cols, m, grouped=grouped)
            assert cfg.get("G32") and cfg["VW"] == vw and cfg["LPB"] == (16 if qtype == T.Q4_0 else 32) // vw
        what = f"{qtype.name} {n_rows}x{n_cols} m={m} VW={vw}"
        ref = gemv32_order(x, w, qtype, vw)
        y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m)
        assert_bits_equal(y.cpu(), ref, what)
        assert_close_to_f64(y, x, w, what)
        assert_unaligned_same(x, raw, qtype, n_cols, m, ref, what, device)
        g = tkernels.grouped(x.to(device), raw.reshape(-1).to(device), [0], [0, m], np.arange(m), qtype, n_rows,
                             n_cols, m)
        assert_bits_equal(g.cpu(), ref, f"{what}: grouped")
        with monkeypatch.context() as mp:
            mp.setattr(tkernels, "GEMV32_U", 2)
            if not ON_CUDA:
                mp.setattr(tkernels, "GEMV_INTERP_BLOCK_N", tkernels.GEMV32_ROWS)
                assert tkernels._config(int(qtype), n_rows, n_cols, m)["BLOCK_N"] == tkernels.GEMV32_ROWS < n_rows
            yg = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=m)
            assert_bits_equal(yg.cpu(), ref, f"{what}: U 2, the GPU's rows per program")


@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q8_0), ids=ids)
def test_gemv32_edge_scales(device, qtype, monkeypatch):
    """Blocks whose fp16 d is subnormal (the smallest too), +-0, tiny or huge: _gemv32_kernel still multiplies
    exactly moestream.quant's weights in gemv32_order's order (9 blocks: a ragged last step)."""
    monkeypatch.setattr(tkernels, "GEMV32", True)
    scales = np.array([5.96e-8, -1.2e-7, 3.0e-6, -6.0e-5, 6.1e-5, 0.0, -0.0, 0.33, -2.0, 65504.0])
    n_rows, n_cols = 12, 288
    raw = torch.from_numpy(random_blocks(qtype, n_rows, n_cols // 32, 8, scales=scales))
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(8))
    y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=2)
    assert_bits_equal(y.cpu(), gemv32_order(x, w, qtype), qtype.name)
    assert_close_to_f64(y, x, w, qtype.name)


@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q8_0), ids=ids)
def test_gemv32_switch(device, qtype, monkeypatch):
    """MOESTREAM_GEMV32: on by default, "0" takes _gemv_kernel (its order, other bits); MOESTREAM_GEMV2_B32=1 takes
    _gemv2_kernel's lanes over it. Every path within the float64 bound."""
    assert tkernels.GEMV32 == (os.environ.get("MOESTREAM_GEMV32", "1") != "0")
    n_rows, n_cols = 6, 704
    raw = make_raw(qtype, n_rows, n_cols, 78)
    w = quant.dequantize(raw, qtype, n_cols)
    x = torch.randn(1, n_cols, generator=torch.Generator().manual_seed(9))
    out = {}
    for name, g32, b32 in (("gemv32", True, False), ("gemv", False, False), ("gemv2", True, True)):
        monkeypatch.setattr(tkernels, "GEMV32", g32)
        monkeypatch.setattr(tkernels, "GEMV2_B32", b32)
        assert tkernels.gemv32_uses(int(qtype), False) == (name == "gemv32")
        y = tkernels.linear(x.to(device), raw.to(device), qtype, n_cols, m_hint=1).cpu()
        assert_bits_equal(y, gemv_order(x, w, qtype), name)
        assert_close_to_f64(y, x, w, name)
        out[name] = y.view(torch.int32)
    assert not torch.equal(out["gemv32"], out["gemv"]) and not torch.equal(out["gemv32"], out["gemv2"])


def test_build_seconds_count_triton_builds_and_keep_other_hooks() -> None:
    """gpu.count_compiles: the time between Triton's jit_cache_hook and jit_post_compile_hook (a kernel's build:
    compiled, or loaded from Triton's cache) adds to gpu.build_seconds, a hook installed before keeps its answer
    (truthy: Triton skips the build), the hooks are on the real triton once tkernels is imported, and the
    generation's stats line says the builds' share of its times (the first prompt on a GPU machine looked like
    0.2 tok/s: 20 s of builds)."""
    import time
    import types

    from moestream import gpu
    from moestream.engine import GenStats

    rt = types.SimpleNamespace(jit_cache_hook=lambda **kw: "skip", jit_post_compile_hook=None)
    gpu.count_compiles(types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=rt)))
    before = gpu.build_seconds()
    assert rt.jit_cache_hook(key=1, repr="k") == "skip"
    time.sleep(0.02)
    rt.jit_post_compile_hook(key=1, repr="k")
    assert gpu.build_seconds() - before >= 0.02
    rt.jit_post_compile_hook(key=2)  # no build started on this thread: nothing counted
    assert gpu.build_seconds() - before < 1
    assert getattr(tkernels.triton.knobs.runtime, "_moestream_counted", False)
    line = GenStats(n_prompt=4, prompt_seconds=20.0, build_seconds=19.6).line()
    assert line.startswith("prompt 4 tok, 0.2 tok/s") and "kernels built at first use: 19.6 s" in line
    assert "built" not in GenStats(build_seconds=0.01).line()
