"""moestream.quant: bit-exact against gguf.quants.dequantize, on real and random ggml blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import realblocks
from moestream import quant

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields (d, dmin/m) in one block, from ggml-common.h.
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ1_S: (0,),
    T.IQ1_M: (),  # its fp16 scale is spread over the top nibbles of four u16 (set by random_blocks)
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
    T.MXFP4: (),  # an e8m0 exponent byte: every value is a finite scale
}
#: Types whose fp16 scale is split into nibbles: byte offset of the four little-endian u16 whose top nibbles
#: hold it (ggml-common.h block_iq1_m: nibble k of the scale in u16 k).
SPLIT_FP16: dict[GGMLQuantizationType, int] = {T.IQ1_M: 48}
#: The types issue 9 added, all written by llama.cpp's quantizer into MoE files.
IQUANTS = (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.TQ1_0, T.TQ2_0, T.MXFP4)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
REQUIRED = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
            T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *IQUANTS}
# Types that the gguf package can quantize itself (used for "realistic" synthetic blocks).
GGUF_QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def assert_bit_exact(raw: np.ndarray, qtype: GGMLQuantizationType, n_cols: int, what: str) -> None:
    """dequantize(raw) equals gguf.quants.dequantize(raw) in every float32 bit (NaN payloads, -0)."""
    ref = gguf.quants.dequantize(raw, qtype)
    got = quant.dequantize(torch.from_numpy(raw), qtype, n_cols)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {ref.shape}"
    ref_bits = torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32)
    got_bits = got.contiguous().view(torch.int32)
    if not torch.equal(got_bits, ref_bits):
        bad = (got_bits != ref_bits).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {len(bad)} of {ref.size} values differ from gguf reference; first at {i}: "
            f"got {got[i].item()!r} (0x{got_bits[i].item() & 0xFFFFFFFF:08x}) "
            f"expected {float(ref[i])!r} (0x{ref_bits[i].item() & 0xFFFFFFFF:08x})"
        )


def random_fp16(rng: np.random.Generator, shape: tuple[int, ...], lo: float = 1e-4, hi: float = 1.0) -> np.ndarray:
    """Finite fp16 values with magnitude log-uniform in [lo, hi] and random sign, as raw bytes [..., 2]."""
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), shape))
    vals = (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float16)
    return vals.view(np.uint8).reshape(*shape, 2)


def random_blocks(qtype: GGMLQuantizationType, n_rows: int, blocks_per_row: int, seed: int,
                  scales: np.ndarray | None = None) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: random bytes, fp16 scale fields set to ``scales`` or random sane values."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_rows, blocks_per_row * type_size), dtype=np.uint8)
    blocks = raw.reshape(n_rows, blocks_per_row, type_size)
    if qtype == T.MXFP4 and scales is None:  # e8m0 exponents of sane scales (2^-13 .. 2^2); all: edge test
        blocks[..., 0] = rng.integers(127 - 13, 127 + 3, (n_rows, blocks_per_row))
    offsets = FP16_FIELDS[qtype] + ((SPLIT_FP16[qtype],) if qtype in SPLIT_FP16 else ())
    for off in offsets:
        if scales is None:
            field = random_fp16(rng, (n_rows, blocks_per_row))
        else:
            picked = rng.choice(scales, (n_rows, blocks_per_row))
            field = picked.astype(np.float16).view(np.uint8).reshape(n_rows, blocks_per_row, 2)
        if qtype in SPLIT_FP16:  # nibble k of the scale into the top nibble of u16 k, other bits kept
            bits = field.view(np.uint16)[..., 0]
            words = blocks[..., off:off + 8].copy().view(np.uint16)
            for k in range(4):
                words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
            blocks[..., off:off + 8] = words.view(np.uint8)
        else:
            blocks[..., off:off + 2] = field
    return raw


def random_floats(qtype: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    """uint8 [n_rows, n_cols * elem_size]: random finite values of a plain float type."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal((n_rows, n_cols)) * np.exp(rng.uniform(-8, 8, (n_rows, n_cols)))
    if qtype == T.F32:
        return vals.astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return vals.astype(np.float16).view(np.uint8)  # |vals| < 2e4: finite in fp16
    bits = vals.astype(np.float32).view(np.uint32) >> 16  # bf16 = top half of the f32 (truncation)
    return bits.astype(np.uint16).view(np.uint8)


# ---------------------------------------------------------------------------
# 1. real blocks from a llama.cpp-made GGUF (gemma-3-270m Q4_K_M, PyPI chunk wheels)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_samples() -> list[tuple[realblocks.TensorInfo, int, np.ndarray]]:
    try:
        return list(realblocks.real_samples(max_rows=512, per_type=3))
    except realblocks.RealBlocksUnavailable as exc:
        pytest.skip(f"real GGUF chunk wheels unavailable (network?): {exc}")


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_real_blocks_bit_exact(real_samples, qtype):
    samples = [s for s in real_samples if s[0].ggml_type == qtype]
    assert samples, f"no {qtype.name} tensor found in the downloaded chunks"
    for info, first, raw in samples:
        assert_bit_exact(raw, qtype, info.n_cols, f"{info.name} rows {first}..{first + len(raw)}")


def test_real_blocks_all_types_supported(real_samples):
    found = {info.ggml_type for info, _, _ in real_samples}
    assert {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= found
    assert all(quant.is_supported(t) for t in found), sorted(t.name for t in found)


def test_real_linear_matches_dequantized_weight(real_samples):
    info, _, raw = next(s for s in real_samples if s[0].ggml_type == T.Q4_K)
    x = torch.randn(3, info.n_cols, generator=torch.Generator().manual_seed(0))
    w = quant.dequantize(torch.from_numpy(raw), info.ggml_type, info.n_cols)
    y = quant.linear(x, torch.from_numpy(raw), info.ggml_type, info.n_cols)
    assert torch.equal(y, torch.nn.functional.linear(x, w))


# ---------------------------------------------------------------------------
# 1b. real blocks from llama.cpp's quantizer with an importance matrix (fixture qwen3moe-tiny-iquants:
#     llama-imatrix + llama-quantize on the qwen3moe-tiny F32 file)
# ---------------------------------------------------------------------------

#: file of the fixture -> the type llama.cpp's quantizer must have written for its routed experts
IQUANT_FILES = {"iq1_s": T.IQ1_S, "iq1_m": T.IQ1_M, "iq2_xxs": T.IQ2_XXS, "iq2_xs": T.IQ2_XS, "iq2_m": T.IQ2_S,
                "iq3_xxs": T.IQ3_XXS, "iq3_s": T.IQ3_S, "tq1_0": T.TQ1_0, "tq2_0": T.TQ2_0, "mxfp4_moe": T.MXFP4}


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(IQUANT_FILES))
def test_llamacpp_quantized_blocks_bit_exact(qwen3moe_tiny_iquants, name):
    """Every quantized tensor of the file (up to 512 rows of each, spread over the tensor: every expert), in
    the types llama.cpp actually wrote (read from the file, not assumed from the ftype's name)."""
    from moestream.gguf import GGUFModel

    path = qwen3moe_tiny_iquants[name]
    want = IQUANT_FILES[name]
    g = GGUFModel(str(path))
    experts = {t.ggml_type for n, t in g.tensors.items() if n.endswith("_exps.weight")}
    assert experts == {int(want)}, f"{path}: routed experts are {sorted(T(t).name for t in experts)}"
    checked: dict[str, int] = {}
    for info in g.tensors.values():
        if info.ggml_type == T.F32:
            continue
        rows = g.read(info).view(-1, info.row_bytes)
        step = max(1, rows.shape[0] // 512)
        raw = rows[::step][:512].numpy()
        assert_bit_exact(raw, T(info.ggml_type), info.shape[-1], f"{path.name} {info.name}")
        checked[info.type_name] = checked.get(info.type_name, 0) + 1
    print(f"{name}: bit-exact on " + ", ".join(f"{k} x{v}" for k, v in sorted(checked.items())))
    assert checked.get(want.name, 0) >= 12  # 4 layers x gate, up, down at least


# ---------------------------------------------------------------------------
# 2. random blocks of every supported type
# ---------------------------------------------------------------------------


def test_every_required_type_is_supported():
    assert REQUIRED <= quant.SUPPORTED_TYPES
    assert set(FP16_FIELDS) | set(FLOAT_TYPES) == set(quant.SUPPORTED_TYPES)


def test_random_blocks_set_the_split_iq1_m_scale():
    """The harness: random IQ1_M blocks get the fp16 scale asked for (else every block could be NaN/Inf)."""
    raw = random_blocks(T.IQ1_M, n_rows=8, blocks_per_row=2, seed=3, scales=np.array([0.5], dtype=np.float32))
    words = raw.reshape(16, 56)[:, 48:56].copy().view(np.uint16)
    bits = (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0xF0) | ((words[:, 2] >> 4) & 0xF00) | (words[:, 3] & 0xF000)
    assert (bits.astype(np.uint16).view(np.float16) == 0.5).all()


def test_every_mxfp4_exponent_bit_exact():
    """All 256 e8m0 exponents (subnormal half-scales 0 and 1, the largest 255) with every code."""
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.arange(16, dtype=np.uint8) * 0x11  # code i in both nibbles of byte i
    assert_bit_exact(blocks, T.MXFP4, 32, "every MXFP4 exponent")


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    blocks_per_row = 4 if block_size == 256 else 8
    raw = random_blocks(qtype, n_rows=100, blocks_per_row=blocks_per_row, seed=int(qtype))  # 400-800 blocks
    assert_bit_exact(raw, qtype, blocks_per_row * block_size, f"random {qtype.name}")


# fp16 scales at the edges: signed zeros, subnormals, smallest normal, largest finite
EDGE_SCALES = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 6.1e-5, -6.1e-5, 1.0, -1.0, 65504.0, -65504.0, 0.5, 1e-3],
                       dtype=np.float32)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
def test_edge_scales_bit_exact(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, n_rows=64, blocks_per_row=4, seed=1000 + int(qtype), scales=EDGE_SCALES)
    assert_bit_exact(raw, qtype, 4 * block_size, f"edge-scale {qtype.name}")


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_quantized_bit_exact(qtype):
    rng = np.random.default_rng(2000 + int(qtype))
    weights = (rng.standard_normal((64, 512)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    assert_bit_exact(raw, qtype, 512, f"gguf-quantized {qtype.name}")


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_random_floats_bit_exact(qtype):
    raw = random_floats(qtype, n_rows=64, n_cols=96, seed=int(qtype))
    assert np.isfinite(gguf.quants.dequantize(raw, qtype)).all()
    assert_bit_exact(raw, qtype, 96, f"random {qtype.name}")


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16bit_pattern_bit_exact(qtype):
    # all 65536 encodings: zeros, subnormals, infinities, quiet and signalling NaNs
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    assert_bit_exact(raw, qtype, 256, f"all {qtype.name} bit patterns")


# ---------------------------------------------------------------------------
# 3. linear, batched and non-contiguous inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q4_K, T.Q6_K, T.Q2_K, T.IQ2_S, T.MXFP4],
                         ids=lambda t: t.name)
def test_linear_equals_functional_linear(qtype):
    n_rows, n_cols = 48, 512
    if qtype in FLOAT_TYPES:
        raw = torch.from_numpy(random_floats(qtype, n_rows, n_cols, seed=7))
    else:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        raw = torch.from_numpy(random_blocks(qtype, n_rows, n_cols // block_size, seed=7))
    x = torch.randn(2, 3, n_cols, generator=torch.Generator().manual_seed(1))
    y = quant.linear(x, raw, qtype, n_cols)
    assert y.dtype == torch.float32 and tuple(y.shape) == (2, 3, n_rows)
    assert torch.equal(y, torch.nn.functional.linear(x, quant.dequantize(raw, qtype, n_cols)))
    assert torch.equal(y, quant.linear(x, raw, qtype, n_cols))  # deterministic


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 5])
def test_linear_in_row_bands_equals_one_matmul(qtype, n_tok):
    """Weights above the band size are dequantized in bands of rows: each band's output is torch's matmul of that
    band's dequantized rows, bit for bit, and where torch's matmul gives a row the same bits whatever the row count
    (every machine measured until 2026-12-04) that is the whole matrix's single matmul. One 2-core Intel Xeon's
    torch (2026-12-04) gives a single x row other last bits for 77 or 100 weight rows than for 128 or the whole
    matrix: there the banded product is within the float32 bound of the single one."""
    n_cols = 256
    n_rows = 3 * quant._LINEAR_CHUNK_ELEMENTS // n_cols + 77  # several bands and a ragged last one
    if qtype in FLOAT_TYPES:
        raw = torch.from_numpy(random_floats(qtype, n_rows, n_cols, seed=5))
    else:
        raw = torch.from_numpy(random_blocks(qtype, n_rows, n_cols // GGML_QUANT_SIZES[qtype][0], seed=5))
    x = torch.randn(n_tok, n_cols, generator=torch.Generator().manual_seed(2))
    y = quant.linear(x, raw, qtype, n_cols)
    w = quant.dequantize(raw, qtype, n_cols)
    band = quant._LINEAR_CHUNK_ELEMENTS // n_cols
    banded = torch.cat([torch.nn.functional.linear(x, w[r:r + band]) for r in range(0, n_rows, band)], dim=-1)
    assert torch.equal(y, banded)
    whole = torch.nn.functional.linear(x, w)
    if torch.equal(banded, whole):  # torch's matmul does not depend on the row count here: one matmul's bits
        assert torch.equal(y, whole)
    else:  # the float32 bound of a K-term dot product: gamma_K * sum |x| |w|
        bound = n_cols * 2.0**-24 / (1 - n_cols * 2.0**-24) * (x.double().abs() @ w.double().abs().T)
        assert bool(((y.double() - whole.double()).abs() <= 2 * bound).all())


def test_f32_is_a_view_not_a_copy():
    raw = torch.from_numpy(random_floats(T.F32, 8, 64, seed=3))
    w = quant.dequantize(raw, T.F32, 64)
    assert w.data_ptr() == raw.data_ptr() and tuple(w.shape) == (8, 64)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q5_0, T.Q6_K, T.Q3_K, T.F32, T.F16, T.BF16, T.IQ2_XXS,
                                   T.IQ1_M, T.IQ3_S, T.TQ1_0, T.MXFP4], ids=lambda t: t.name)
def test_batched_noncontiguous_leading_dims(qtype):
    n_experts, n_rows = 6, 10
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n_cols = 512 if block_size == 256 else 256
    if qtype in FLOAT_TYPES:
        rows = random_floats(qtype, n_rows * n_experts, n_cols, seed=11)
    else:
        rows = random_blocks(qtype, n_rows * n_experts, n_cols // block_size, seed=11)
    nbytes = rows.shape[1]
    # stored [n_rows, n_experts, nbytes], viewed [n_experts, n_rows, nbytes]: leading dims permuted
    stored = torch.from_numpy(rows).reshape(n_rows, n_experts, nbytes)
    experts = stored.permute(1, 0, 2)
    assert not experts.is_contiguous()
    got = quant.dequantize(experts, qtype, n_cols)
    assert tuple(got.shape) == (n_experts, n_rows, n_cols)
    ref = gguf.quants.dequantize(rows, qtype).reshape(n_rows, n_experts, n_cols).transpose(1, 0, 2)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32))
    # every other expert, and an odd byte offset (misaligned fp16/f32 fields) on a 1-D row
    assert torch.equal(quant.dequantize(experts[::2], qtype, n_cols), got[::2])
    odd = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    odd.copy_(experts[1, 2])
    assert torch.equal(quant.dequantize(odd, qtype, n_cols), got[1, 2])
    # last dim not contiguous
    spread = torch.zeros(n_experts, n_rows, nbytes, 2, dtype=torch.uint8)
    spread[..., 0] = experts
    assert torch.equal(quant.dequantize(spread[..., 0], qtype, n_cols), got)


def test_empty_leading_dims():
    raw = torch.empty(0, 3, 144, dtype=torch.uint8)
    out = quant.dequantize(raw, T.Q4_K, 256)
    assert tuple(out.shape) == (0, 3, 256) and out.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", sorted(quant.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_cuda_matches_reference(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n_cols = 512
    if qtype in FLOAT_TYPES:
        raw = random_floats(qtype, 64, n_cols, seed=5)
    else:
        raw = random_blocks(qtype, 64, n_cols // block_size, seed=5)
    got = quant.dequantize(torch.from_numpy(raw).cuda(), qtype, n_cols)
    assert got.device.type == "cuda"
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(got.cpu().view(torch.int32), ref.view(torch.int32))
    if qtype in (T.F16, T.BF16):  # every encoding: CUDA's own conversion canonicalizes NaNs
        allp = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, 512)
        ref16 = torch.from_numpy(gguf.quants.dequantize(allp, qtype))
        got16 = quant.dequantize(torch.from_numpy(allp).cuda(), qtype, 256).cpu()
        assert torch.equal(got16.view(torch.int32), ref16.view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q5_0, T.F32], ids=lambda t: t.name)
def test_cuda_batched_and_linear(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n_cols = 512
    if qtype in FLOAT_TYPES:
        rows = random_floats(qtype, 24, n_cols, seed=9)
    else:
        rows = random_blocks(qtype, 24, n_cols // block_size, seed=9)
    cpu = torch.from_numpy(rows).reshape(4, 6, -1).permute(1, 0, 2)  # [6, 4, nbytes], non-contiguous
    got = quant.dequantize(cpu.cuda(), qtype, n_cols)
    assert torch.equal(got.cpu().view(torch.int32), quant.dequantize(cpu, qtype, n_cols).view(torch.int32))
    raw = torch.from_numpy(rows).cuda()
    x = torch.randn(5, n_cols, generator=torch.Generator().manual_seed(2)).cuda()
    y = quant.linear(x, raw, qtype, n_cols)
    assert y.device.type == "cuda" and tuple(y.shape) == (5, 24)
    assert torch.equal(y, torch.nn.functional.linear(x, quant.dequantize(raw, qtype, n_cols)))


# ---------------------------------------------------------------------------
# 4. row_bytes, support checks and errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(GGML_QUANT_SIZES), ids=lambda t: t.name)
def test_row_bytes_matches_gguf_sizes(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    for n_blocks in (0, 1, 7):
        assert quant.row_bytes(qtype, n_blocks * block_size) == n_blocks * type_size
        assert quant.row_bytes(int(qtype), n_blocks * block_size) == n_blocks * type_size
    if block_size > 1:
        with pytest.raises(ValueError, match=rf"n_cols={block_size + 1}.*{qtype.name}.*{block_size}"):
            quant.row_bytes(qtype, block_size + 1)


def test_unsupported_type_errors():
    assert quant.is_supported(T.Q4_K) and quant.is_supported(int(T.Q6_K)) and quant.is_supported(T.IQ2_XXS)
    assert not quant.is_supported(T.Q8_K)  # ggml's activation type: never in a model file
    assert not quant.is_supported(999)
    raw = torch.zeros(2, 292, dtype=torch.uint8)
    with pytest.raises(quant.UnsupportedTypeError, match=r"Q8_K \(15\)") as err:
        quant.dequantize(raw, T.Q8_K, 256)
    assert isinstance(err.value, ValueError)
    with pytest.raises(quant.UnsupportedTypeError, match=r"Q8_K \(15\)"):
        quant.linear(torch.zeros(1, 256), raw, T.Q8_K, 256)
    with pytest.raises(quant.UnsupportedTypeError, match="999"):
        quant.dequantize(raw, 999, 256)
    with pytest.raises(quant.UnsupportedTypeError, match="999"):
        quant.row_bytes(999, 256)


def test_bad_arguments():
    raw = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        quant.dequantize(raw.to(torch.int8), T.Q4_K, 256)
    with pytest.raises(ValueError, match=r"row_bytes=288"):
        quant.dequantize(raw, T.Q4_K, 512)
    with pytest.raises(ValueError, match="n_cols=100"):
        quant.dequantize(raw, T.Q4_K, 100)
    with pytest.raises(ValueError, match=r"n_cols=256"):
        quant.linear(torch.zeros(1, 128), raw, T.Q4_K, 256)
    with pytest.raises(TypeError, match="float32"):
        quant.linear(torch.zeros(1, 256, dtype=torch.float64), raw, T.Q4_K, 256)
    with pytest.raises(ValueError, match="2-D"):
        quant.linear(torch.zeros(1, 256), raw[None], T.Q4_K, 256)
