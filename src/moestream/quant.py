"""Dequantization of ggml block formats with PyTorch.

Weights in a GGUF file are stored row by row; each row of ``n_cols`` elements is a
sequence of fixed-size blocks (``block_size`` elements packed into ``type_size``
bytes).  The block layouts are those of ggml (``ggml-common.h`` in llama.cpp /
ggml); the arithmetic reproduces the reference numpy dequantization of the
``gguf`` Python package (``gguf.quants.dequantize``) bit for bit: every scale is
an IEEE fp16 value widened to float32, every product and difference is a single
float32 operation performed in the same order as the reference, and no fused
multiply-add is used.

The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) index code books ("grids") of 4 or 8
values; those tables are format data and are taken from the pinned ``gguf`` package at run time
(``gguf.quants.<TYPE>.grid``, ``IQ2_XXS.ksigns``, ``MXFP4.kvalues``); the block arithmetic is written here.

Everything here is vectorized torch code (no Python loop over blocks, no numpy),
so it runs on whatever device the raw bytes live on (CPU or CUDA). Multi-byte
fields are read the way GGUF stores them, little-endian, through views of the
host's (little-endian) integer types.

Throughput on a 2048x768 matrix, 2 CPU cores (torch 2.13): Q8_0 about 9e9
elements/s, Q4_K about 2.7e9 elements/s (the gguf numpy reference: 7e8 and 1e8).

Public API: :func:`is_supported`, :func:`row_bytes`, :func:`dequantize`,
:func:`linear`, :data:`SUPPORTED_TYPES` and :class:`UnsupportedTypeError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedTypeError",
    "dequantize",
    "is_supported",
    "linear",
    "row_bytes",
]

T = GGMLQuantizationType

QK_K = 256  # elements in one k-quant super-block (ggml-common.h QK_K)
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales/mins in Q4_K and Q5_K

# Non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml-common.h kvalues_iq4nl).
_IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedTypeError(ValueError):
    """A ggml tensor type that this module cannot dequantize (message names it and its number)."""


def _type_label(ggml_type: int) -> str:
    try:
        return f"{T(int(ggml_type)).name} ({int(ggml_type)})"
    except ValueError:
        return f"unknown ggml type number {int(ggml_type)}"


# ---------------------------------------------------------------------------
# small helpers
#
# Bit fields are pulled out with scalar shifts/masks on whole byte planes and interleaved
# with torch.stack: on CPU that is several times faster than broadcasting against a tensor
# of shift amounts or writing through strided ``out=`` views.
# ---------------------------------------------------------------------------

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Lookup table ``name`` on ``device``, made once by ``make()`` (on the CPU) and cached."""
    t = _TABLES.get((name, device))
    if t is None:
        t = _TABLES[(name, device)] = make().to(device)
    return t


def _iq4nl_table(device: torch.device) -> torch.Tensor:
    return _table("iq4nl", device, lambda: torch.tensor(_IQ4NL_VALUES, dtype=torch.float32))


def _gguf_grid(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """The code book of an i-quant as float32 ``[n_entries, width]`` (IQ2_XXS: 256 x 8, IQ3_S: 512 x 4, ...).

    Format data, not code: taken from the pinned ``gguf`` package (``gguf.quants.<TYPE>.grid``, ggml's
    ``iq2xxs_grid`` etc. with each byte mapped to its value).
    """
    def make() -> torch.Tensor:
        cls = getattr(gguf_quants, qtype.name)
        cls.init_grid()
        return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype("float32", copy=True))

    return _table(qtype.name, device, make)


def _ksigns_table(device: torch.device) -> torch.Tensor:
    """float32 ``[128, 8]``: entry ``k`` is the 8 signs (+1 / -1) that ggml's ``ksigns_iq2xs[k]`` encodes
    (bit ``j`` set = element ``j`` negative; bit 7 is the parity of the other seven)."""
    def make() -> torch.Tensor:
        bits = _bit_bytes(torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8), 0)
        return _sign_of(bits.view(128, 8))

    return _table("ksigns", device, make)


def _mxfp4_table(device: torch.device) -> torch.Tensor:
    # e2m1 code book, doubled (ggml-common.h kvalues_mxfp4; the e8m0 scale is halved to match)
    return _table("mxfp4", device, lambda: torch.tensor(gguf_quants.MXFP4.kvalues, dtype=torch.float32))


def _lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]``: rows of a ``[n, w]`` table (float32 ``[*idx.shape, w]``) or entries of a ``[n]`` one."""
    flat = table.index_select(0, idx.reshape(-1).to(torch.int32))
    return flat.view(*idx.shape, *table.shape[1:])


def _sign_of(bits: torch.Tensor) -> torch.Tensor:
    """float32 +1 where ``bits`` (uint8 0/1) is 0, -1 where it is 1."""
    return bits.to(torch.float32).mul_(-2.0).add_(1.0)


def _reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.view(dtype)`` along the last dim; copies first only when the bytes are misaligned for ``dtype``."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(blocks: torch.Tensor, offset: int, count: int = 1) -> torch.Tensor:
    """``count`` consecutive fp16 fields at byte ``offset`` of every block, widened to float32.

    Returns float32 ``[..., n_blocks, count]``.
    """
    return _reinterpret(blocks[..., offset : offset + 2 * count], torch.float16).to(torch.float32)


def _f16_to_f32_exact(h: torch.Tensor) -> torch.Tensor:
    """Widen fp16 to float32 exactly as numpy does, signalling NaNs included.

    numpy keeps a NaN's bits: sign, all-ones exponent, the 10 mantissa bits << 13. torch's
    conversion does not: on x86 CPUs (F16C) it sets the quiet bit of a signalling NaN, on
    CUDA every NaN becomes 0x7FFFFFFF. NaN lanes are rebuilt numpy's way (on CPU only when
    a NaN is present at all, which a cheap sum detects).
    """
    out = h.to(torch.float32)
    # cheap CPU pre-check: a sum is NaN when any term is (or inf - inf: a harmless false alarm)
    if out.device.type == "cpu" and not bool(out.sum().isnan()):
        return out
    bits = h.view(torch.int16).to(torch.int32)  # sign-extended
    exact = (bits << 13).bitwise_or_(0x7F800000).view(torch.float32)
    return torch.where(out.isnan(), exact, out)


def _field(v: torch.Tensor, shift: int, width: int, to: int) -> torch.Tensor:
    """``((v >> shift) & (2**width - 1)) << to`` on uint8, as one shift and one mask."""
    mask = ((1 << width) - 1) << to
    if shift == to:
        return v & mask
    return (v >> (shift - to) if shift > to else v << (to - shift)) & mask


def _planes(v: torch.Tensor, width: int, to: int = 0, dim: int = -2) -> torch.Tensor:
    """All ``8 // width`` bit fields of each byte, field ``f`` = bits ``width*f ..``, moved to bit ``to``.

    ``v``: uint8 ``[..., m]``; the fields are stacked at ``dim``: ``[..., 8 // width, m]`` for
    ``dim=-2`` (field-major), ``[..., m, 8 // width]`` for ``dim=-1``. The bytes are first
    gathered into one contiguous buffer (one cheap copy) so that the shifts and masks run
    over flat memory instead of a short strided run per block.
    """
    v = v.contiguous()
    return torch.stack([_field(v, width * f, width, to) for f in range(8 // width)], dim=dim)


def _bit_bytes(qh: torch.Tensor, to: int) -> torch.Tensor:
    """One byte per bit: uint8 ``[..., m]`` -> ``[..., 8 * m]``, byte ``8i + k`` = bit ``k`` of ``qh[i]`` << ``to``.

    Done in int64 "lanes" (byte ``k`` of an int64 is its bits ``8k..8k+7``: little-endian):
    one multiplication copies bits 0-6 of a byte into every lane, lane ``k`` (< 7) keeps bit
    ``k``, adding 0x7F per lane (no carry crosses lanes) sets a lane's bit 7 exactly when its
    bit was set, and a shift plus a mask moves that to bit ``to``; bit 7 goes straight to lane
    7. A handful of flat passes, no per-element interleaving, no signed overflow.
    """
    lanes = qh.to(torch.int64)
    top = lanes >> 7
    lanes.bitwise_and_(0x7F).mul_(0x0101010101010101).bitwise_and_(0x0040201008040201)
    lanes.add_(0x007F7F7F7F7F7F7F).bitwise_right_shift_(7 - to).bitwise_and_(0x0001010101010101 << to)
    lanes.bitwise_or_(top.bitwise_left_shift_(56 + to))
    return lanes.view(torch.uint8)


def _iq4nl_lookup(codes: torch.Tensor) -> torch.Tensor:
    """float32 ``kvalues_iq4nl[codes]`` for uint8 codes 0..15, same shape as ``codes``."""
    table = _iq4nl_table(codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Low nibbles of each run of ``group`` bytes, then its high nibbles.

    ``qs``: uint8 ``[..., m]``; returns uint8 ``[..., m // group, 2, group]``.
    """
    return _planes(qs.unflatten(-1, (-1, group)), 4)


def _k4_scales(blocks: torch.Tensor, d_offset: int, sc_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-32 scales ``d * sc`` and offsets ``dmin * mn`` of Q4_K/Q5_K, each float32 ``[..., n_blocks, 8, 1]``.

    The 12-byte table packs 8 six-bit (scale, min) pairs: bytes 0-3 hold scales 0-3 in their
    low 6 bits, bytes 4-7 mins 0-3; pair 4+i takes its low 4 bits from byte 8+i (scale: low
    nibble, min: high nibble) and its top 2 bits from the top bits of byte i (scale) / 4+i
    (min) (ggml-common.h block_q4_K, get_scale_min_k4). The bytes are unpacked four at a time
    as little-endian int32 words (byte k of a word = its bits 8k..8k+7).
    """
    words = blocks[..., sc_offset : sc_offset + K_SCALE_SIZE].contiguous().view(torch.int32)
    d, m, md = words[..., 0], words[..., 1], words[..., 2]
    sc_mn = torch.stack(
        (
            d & 0x3F3F3F3F,
            (md & 0x0F0F0F0F).bitwise_or_((d >> 2).bitwise_and_(0x30303030)),
            m & 0x3F3F3F3F,
            (md >> 4).bitwise_and_(0x0F0F0F0F).bitwise_or_((m >> 2).bitwise_and_(0x30303030)),
        ),
        dim=-1,
    ).view(torch.uint8).to(torch.float32)  # [..., n_blocks, 16]: 8 scales, then 8 mins
    d_dmin = _f16(blocks, d_offset, 2)
    dl = d_dmin[..., 0:1] * sc_mn[..., 0:8]
    ml = d_dmin[..., 1:2] * sc_mn[..., 8:16]
    return dl.unsqueeze(-1), ml.unsqueeze(-1)


def _codes_minus(codes: torch.Tensor, offset: int) -> torch.Tensor:
    """float32 of ``codes - offset`` (codes uint8 below 128; the subtraction is exact in int8)."""
    return (codes.view(torch.int8) - offset).to(torch.float32)


# ---------------------------------------------------------------------------
# per-format block decoders: blocks uint8 [..., n_blocks, type_size] -> float32 [..., n_blocks, block_size]
# (byte layouts: ggml-common.h; arithmetic order: gguf/quants.py)
# ---------------------------------------------------------------------------


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_0: fp16 d | 16 bytes: element i low nibble of byte i, element 16+i high nibble
    # x = d * (q - 8)
    d = _f16(blocks, 0)
    return _codes_minus(_nibbles(blocks[..., 2:18], 16).flatten(-3), 8).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_1: fp16 d | fp16 m | 16 bytes of nibbles as Q4_0; x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)  # separate: contiguous broadcast operands are faster
    q = _nibbles(blocks[..., 4:20], 16).flatten(-3).to(torch.float32)
    return q.mul_(d).add_(m)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # 5th bit of element j is bit j of the little-endian u32 qh = bit j % 8 of byte j // 8
    return _nibbles(qs, 16).flatten(-3).bitwise_or_(_bit_bytes(qh, 4))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_0: fp16 d | u32 qh | 16 bytes of nibbles; x = d * (q - 16)
    d = _f16(blocks, 0)
    return _codes_minus(_q5_codes(blocks[..., 2:6], blocks[..., 6:22]), 16).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_1: fp16 d | fp16 m | u32 qh | 16 bytes of nibbles; x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _q5_codes(blocks[..., 4:8], blocks[..., 8:24]).to(torch.float32)
    return q.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q8_0: fp16 d | 32 int8; x = q * d
    d = _f16(blocks, 0)
    return blocks[..., 2:34].view(torch.int8).to(torch.float32).mul_(d)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q2_K: 16 bytes scales (low nibble scale, high nibble min) | 64 bytes of 2-bit quants
    # | fp16 d | fp16 dmin. Element 128h + 32f + i is bits 2f.. of byte 32h + i; groups of 16:
    # x = (d * sc) * q - (dmin * mn)
    sc_mn = _planes(blocks[..., 0:16], 4).to(torch.float32)  # [..., n_blocks, 2, 16]
    d_dmin = _f16(blocks, 80, 2)
    dl = (d_dmin[..., 0:1] * sc_mn[..., 0, :]).unsqueeze(-1)  # [..., n_blocks, 16, 1]
    ml = (d_dmin[..., 1:2] * sc_mn[..., 1, :]).unsqueeze(-1)
    q = _planes(blocks[..., 16:80].unflatten(-1, (2, 32)), 2).to(torch.float32)  # [..., 2, 4, 32]
    q = q.view(*q.shape[:-3], 16, 16)
    return q.mul_(dl).sub_(ml).flatten(-2)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q3_K: 32 bytes hmask | 64 bytes low 2 bits | 12 bytes 6-bit scales | fp16 d
    # 16 groups of 16: x = (d * (sc - 32)) * (q_low - (hbit ? 0 : 4))
    # Scale s (0..15): low 4 bits = nibble s // 8 of byte s % 8; top 2 bits = bits 2(s // 4)..
    # of byte 8 + s % 4. Element j: q_low from bits 2((j // 32) % 4).. of qs[32(j // 128) + j % 32],
    # hbit = bit j // 32 of hmask[j % 32].
    table = blocks[..., 96:108]
    low = _planes(table[..., 0:8], 4).flatten(-2)  # [..., 16]
    high = _planes(table[..., 8:12], 2, to=4).flatten(-2)  # [..., 16]
    d = _f16(blocks, 108)
    dl = (d * _codes_minus(low.bitwise_or_(high), 32)).unsqueeze(-1)  # [..., n_blocks, 16, 1]
    q = _planes(blocks[..., 32:96].unflatten(-1, (2, 32)), 2).flatten(-3)
    q.bitwise_or_(_planes(blocks[..., 0:32], 1, to=2).flatten(-2))  # q_low + 4 * hbit
    q = _codes_minus(q, 4)
    return q.view(*q.shape[:-1], 16, 16).mul_(dl).flatten(-2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_K: fp16 d | fp16 dmin | 12 bytes scales/mins | 128 bytes: group 2c is the low
    # nibbles of bytes 32c.., group 2c+1 their high nibbles; x = (d * sc) * q - (dmin * mn)
    dl, ml = _k4_scales(blocks, 0, 4)
    q = _nibbles(blocks[..., 16:144], 32).flatten(-3, -2).to(torch.float32)  # [..., 8, 32]
    return q.mul_(dl).sub_(ml).flatten(-2)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_K: fp16 d | fp16 dmin | 12 bytes scales/mins | 32 bytes qh | 128 bytes nibbles
    # as Q4_K; group g takes its 5th bit from bit g of qh[i]
    dl, ml = _k4_scales(blocks, 0, 4)
    q = _nibbles(blocks[..., 48:176], 32).flatten(-3, -2)  # [..., 8, 32]
    q = q.bitwise_or_(_planes(blocks[..., 16:48], 1, to=4)).to(torch.float32)
    return q.mul_(dl).sub_(ml).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q6_K: 128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | fp16 d
    # element 128h + 64n + k: nibble n of ql[64h + k], high bits 2(f).. of qh[32h + i] for
    # 128h + 32f + i; 16 groups of 16: x = (d * sc) * (q - 32)
    d = _f16(blocks, 208)
    dl = (d * blocks[..., 192:208].view(torch.int8).to(torch.float32)).unsqueeze(-1)
    q = _nibbles(blocks[..., 0:128], 64).flatten(-3)
    q.bitwise_or_(_planes(blocks[..., 128:192].unflatten(-1, (2, 32)), 2, to=4).flatten(-3))
    q = _codes_minus(q, 32)
    return q.view(*q.shape[:-1], 16, 16).mul_(dl).flatten(-2)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq4_nl: fp16 d | 16 bytes of nibbles (order as Q4_0) indexing kvalues_iq4nl
    # x = d * kvalues[q]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[..., 2:18], 16).flatten(-3)
    return _iq4nl_lookup(q).mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq4_xs: fp16 d | u16 scales_h | 4 bytes scales_l | 128 bytes: group g is the low
    # nibbles of bytes 16g.. then their high nibbles. Scale g: low 4 bits = nibble g % 2 of
    # scales_l[g // 2], top 2 bits = bits 2g.. of scales_h. x = (d * (sc - 32)) * kvalues[q]
    d = _f16(blocks, 0)
    low = _planes(blocks[..., 4:8], 4, dim=-1).flatten(-2)  # [..., 8]
    high = _planes(blocks[..., 2:4], 2, to=4, dim=-1).flatten(-2)  # [..., 8]
    dl = (d * _codes_minus(low.bitwise_or_(high), 32)).unsqueeze(-1)  # [..., n_blocks, 8, 1]
    q = _nibbles(blocks[..., 8:136], 16).flatten(-2)  # [..., 8, 32]
    return _iq4nl_lookup(q).mul_(dl).flatten(-2)


def _u16(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Little-endian uint16 fields of bytes ``start:stop`` of every block, as int32 ``[..., n_blocks, n]``."""
    return _reinterpret(blocks[..., start:stop], torch.int16).to(torch.int32).bitwise_and_(0xFFFF)


def _u32(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Little-endian uint32 fields of bytes ``start:stop`` of every block, as int64 ``[..., n_blocks, n]``."""
    return _reinterpret(blocks[..., start:stop], torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)


def _ksigns(words: torch.Tensor) -> torch.Tensor:
    """Signs of 4 groups of 8 from the 4 seven-bit ksigns indices in bits 0-27 of each uint32 word.

    ``words``: int64 ``[...]``; returns float32 ``[..., 4, 8]`` of +1 / -1.
    """
    idx = torch.stack([(words >> (7 * k)).bitwise_and_(0x7F) for k in range(4)], dim=-1)
    return _lookup(_ksigns_table(words.device), idx)


def _half_up_scale(d: torch.Tensor, codes: torch.Tensor, factor: float) -> torch.Tensor:
    """``d * (0.5 + codes) * factor`` in float32, in that order (IQ2/IQ3_XXS sub-block scales)."""
    return (d * codes.to(torch.float32).add_(0.5)).mul_(factor)


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xxs: fp16 d | 8 x (u32 grid indices: 4 bytes into iq2xxs_grid (256 x 8);
    # u32 signs: 4 x 7-bit ksigns indices, bits 28-31 the scale). 8 groups of 32:
    # x = (d * (0.5 + scale) * 0.25) * grid[idx] * sign
    d = _f16(blocks, 0)
    aux = _u32(blocks, 2, 66).unflatten(-1, (8, 2))  # [..., n_blocks, 8, 2]
    db = _half_up_scale(d, aux[..., 1] >> 28, 0.25)  # [..., n_blocks, 8]
    idx = blocks[..., 2:66].unflatten(-1, (8, 8))[..., 0:4]  # [..., n_blocks, 8, 4]
    grid = _lookup(_gguf_grid(T.IQ2_XXS, blocks.device), idx)  # [..., n_blocks, 8, 4, 8]
    return grid.mul_(db[..., None, None]).mul_(_ksigns(aux[..., 1])).flatten(-3)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xs: fp16 d | 32 u16 (bits 0-8 index into iq2xs_grid (512 x 8), bits 9-15 a ksigns index)
    # | 8 bytes of 4-bit scales, one per 16 elements (low nibble first):
    # x = (d * (0.5 + scale) * 0.25) * grid[idx] * sign
    d = _f16(blocks, 0)
    qs = _u16(blocks, 2, 66)  # [..., n_blocks, 32]
    sc = _planes(blocks[..., 66:74], 4, dim=-1).flatten(-2)  # [..., n_blocks, 16]
    db = _half_up_scale(d, sc, 0.25)
    grid = _lookup(_gguf_grid(T.IQ2_XS, blocks.device), qs & 511)  # [..., n_blocks, 32, 8]
    signs = _lookup(_ksigns_table(blocks.device), qs >> 9)
    out = grid.unflatten(-2, (16, 2)).mul_(db[..., None, None]).mul_(signs.unflatten(-2, (16, 2)))
    return out.flatten(-3)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_s: fp16 d | 32 bytes low index bits | 32 bytes of sign bits (one per element) | 8 bytes of
    # 2-bit high index bits (4 per byte) | 8 bytes of 4-bit scales, one per 16 elements (low nibble first).
    # grid: iq2s_grid (1024 x 8); x = (d * (0.5 + scale) * 0.25) * grid[idx] * sign
    d = _f16(blocks, 0)
    sc = _planes(blocks[..., 74:82], 4, dim=-1).flatten(-2)  # [..., n_blocks, 16]
    db = _half_up_scale(d, sc, 0.25)
    high = _planes(blocks[..., 66:74], 2, dim=-1).flatten(-2).to(torch.int32) << 8  # [..., n_blocks, 32]
    idx = blocks[..., 2:34].to(torch.int32).bitwise_or_(high)
    grid = _lookup(_gguf_grid(T.IQ2_S, blocks.device), idx).unflatten(-2, (16, 2))  # [..., 16, 2, 8]
    signs = _sign_of(_bit_bytes(blocks[..., 34:66], 0)).unflatten(-1, (16, 2, 8))
    return grid.mul_(db[..., None, None]).mul_(signs).flatten(-3)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_xxs: fp16 d | 64 bytes of indices into iq3xxs_grid (256 x 4) | 8 u32 (4 x 7-bit ksigns
    # indices, bits 28-31 the scale), one per 32 elements: x = (d * (0.5 + scale) * 0.5) * grid[idx] * sign
    d = _f16(blocks, 0)
    aux = _u32(blocks, 66, 98)  # [..., n_blocks, 8]
    db = _half_up_scale(d, aux >> 28, 0.5)
    grid = _lookup(_gguf_grid(T.IQ3_XXS, blocks.device), blocks[..., 2:66])  # [..., n_blocks, 64, 4]
    grid = grid.view(*grid.shape[:-2], 8, 4, 8)
    return grid.mul_(db[..., None, None]).mul_(_ksigns(aux)).flatten(-3)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_s: fp16 d | 64 bytes low index bits | 8 bytes of 9th index bits (one per index, LSB first)
    # | 32 bytes of sign bits | 4 bytes of 4-bit scales, one per 32 elements (low nibble first).
    # grid: iq3s_grid (512 x 4); x = (d * (1 + 2 * scale)) * grid[idx] * sign
    d = _f16(blocks, 0)
    sc = _planes(blocks[..., 106:110], 4, dim=-1).flatten(-2)  # [..., n_blocks, 8]
    db = d * sc.to(torch.float32).mul_(2.0).add_(1.0)
    idx = blocks[..., 2:66].to(torch.int32).bitwise_or_(_bit_bytes(blocks[..., 66:74], 0).to(torch.int32) << 8)
    grid = _lookup(_gguf_grid(T.IQ3_S, blocks.device), idx)  # [..., n_blocks, 64, 4]
    grid = grid.view(*grid.shape[:-2], 8, 4, 8)
    signs = _sign_of(_bit_bytes(blocks[..., 74:106], 0)).unflatten(-1, (8, 4, 8))
    return grid.mul_(db[..., None, None]).mul_(signs).flatten(-3)


_IQ1_DELTA = 0.125  # ggml-common.h IQ1S_DELTA (also IQ1_M's)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_s: fp16 d | 32 bytes low index bits | 8 u16, one per 32 elements: bits 0-11 four 3-bit high
    # index parts, bits 12-14 the scale, bit 15 the sign of delta. grid: iq1s_grid (2048 x 8, values -1/0/1);
    # x = (d * (2 * scale + 1)) * (grid[idx] + (bit15 ? -delta : delta))
    d = _f16(blocks, 0)
    qh = _u16(blocks, 34, 50)  # [..., n_blocks, 8]
    dl = d * ((qh >> 12).bitwise_and_(7).mul_(2).add_(1)).to(torch.float32)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(torch.float32)
    high = torch.stack([(qh >> (3 * k)).bitwise_and_(7) for k in range(4)], dim=-1).flatten(-2) << 8
    idx = blocks[..., 2:34].to(torch.int32).bitwise_or_(high)
    grid = _lookup(_gguf_grid(T.IQ1_S, blocks.device), idx).unflatten(-2, (8, 4))  # [..., n_blocks, 8, 4, 8]
    return grid.add_(delta[..., None, None]).mul_(dl[..., None, None]).flatten(-3)


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_m: 32 bytes low index bits | 16 bytes qh: per nibble a 3-bit high index part and the sign of
    # delta (bit 3) | 4 u16 scales: 3-bit scales, one per 16 elements, in bits 0-11, and the fp16 super-scale
    # d spread over their top nibbles (nibble k of d in u16 k). x = (d * (2 * scale + 1)) * (grid[idx] +- delta)
    sc = _u16(blocks, 48, 56)  # [..., n_blocks, 4]
    top = sc & 0xF000
    d_bits = (top[..., 0] >> 12) | (top[..., 1] >> 8) | (top[..., 2] >> 4) | top[..., 3]
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32).unsqueeze(-1)  # [..., n_blocks, 1]
    scales = torch.stack([(sc >> (3 * k)).bitwise_and_(7) for k in range(4)], dim=-1).flatten(-2)  # [..., 16]
    dl = d * scales.mul_(2).add_(1).to(torch.float32)
    halves = _planes(blocks[..., 32:48], 4, dim=-1).flatten(-2)  # [..., n_blocks, 32]
    delta = torch.where((halves & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(torch.float32)
    idx = blocks[..., 0:32].to(torch.int32).bitwise_or_((halves & 7).to(torch.int32) << 8)
    grid = _lookup(_gguf_grid(T.IQ1_M, blocks.device), idx)  # [..., n_blocks, 32, 8]
    grid = grid.add_(delta[..., None]).unflatten(-2, (16, 2))  # [..., n_blocks, 16, 2, 8]
    return grid.mul_(dl[..., None, None]).flatten(-3)


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_tq1_0: 48 bytes qs | 4 bytes qh | fp16 d. Each byte holds 5 (qs) or 4 (qh) base-3 digits as a
    # fixed-point fraction: digit m of byte b is ((b * 3**m mod 256) * 3) >> 8. Element order: digit m of
    # qs[j] (j < 32) is element 32m + j, of qs[32 + j] (j < 16) element 160 + 16m + j, of qh[j] element
    # 240 + 4m + j. x = d * (digit - 1)
    d = _f16(blocks, 52)
    parts = []
    for start, stop, digits in ((0, 32, 5), (32, 48, 5), (48, 52, 4)):
        v = blocks[..., start:stop]
        parts.append(torch.stack([v * (3**m) for m in range(digits)], dim=-2).flatten(-2))  # uint8 wraps
    q = torch.cat(parts, dim=-1).to(torch.int16).mul_(3).bitwise_right_shift_(8).sub_(1)
    return q.to(torch.float32).mul_(d)


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_tq2_0: 64 bytes of 2-bit codes | fp16 d. Element 128c + 32k + j is bits 2k.. of byte 32c + j;
    # x = d * (code - 1)
    d = _f16(blocks, 64)
    q = _planes(blocks[..., 0:64].unflatten(-1, (2, 32)), 2).flatten(-3)
    return _codes_minus(q, 1).mul_(d)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block_mxfp4: e8m0 exponent e | 16 bytes of e2m1 codes (element i low nibble of byte i, 16 + i high).
    # The code book is doubled, so the scale is half of 2**(e - 127): float32 bits (e - 1) << 23, or for
    # e < 2 the subnormal 0x00200000 << e = (e + 1) * 0x00200000 (ggml_e8m0_to_fp32_half). x = scale * kvalues[q]
    e = blocks[..., 0:1].to(torch.int32)
    d = torch.where(e < 2, (e + 1) * 0x00200000, (e - 1) << 23).view(torch.float32)  # [..., n_blocks, 1]
    q = _nibbles(blocks[..., 1:17], 16).flatten(-3)
    return _lookup(_mxfp4_table(blocks.device), q).mul_(d)


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
    T.MXFP4: _mxfp4,
}

#: the float types and their torch dtypes' names (getattr(torch, name): no torch attribute is read at import)
_FLOAT_TYPES: dict[GGMLQuantizationType, str] = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16"}

#: ggml types that :func:`dequantize` and :func:`linear` accept.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset((*_FLOAT_TYPES, *_BLOCK_DECODERS))


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def is_supported(ggml_type: int) -> bool:
    """Whether :func:`dequantize` handles ggml type number ``ggml_type`` (a ``GGMLQuantizationType`` or int)."""
    try:
        return T(int(ggml_type)) in SUPPORTED_TYPES
    except ValueError:
        return False


def _supported(ggml_type: int, where: str) -> GGMLQuantizationType:
    if not is_supported(ggml_type):
        names = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedTypeError(
            f"{where}: ggml type {_type_label(ggml_type)} is not supported by moestream.quant "
            f"(supported: {names})"
        )
    return T(int(ggml_type))


def row_bytes(ggml_type: int, n_cols: int) -> int:
    """Bytes taken by one row of ``n_cols`` elements of ggml type ``ggml_type``.

    Works for every type in ``gguf.GGML_QUANT_SIZES`` (also those :func:`dequantize` cannot
    decode): ``n_cols // block_size * type_size``.

    Raises:
        UnsupportedTypeError: ``ggml_type`` is not a known ggml type number.
        ValueError: ``n_cols`` is negative or not a multiple of the type's block size.
    """
    try:
        qtype = T(int(ggml_type))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedTypeError(
            f"row_bytes: ggml type {_type_label(ggml_type)} has no known block size"
        ) from None
    if n_cols < 0 or n_cols % block_size != 0:
        raise ValueError(
            f"row_bytes: n_cols={n_cols} is not a non-negative multiple of the {qtype.name} "
            f"block size {block_size}"
        )
    return n_cols // block_size * type_size


def dequantize(raw: torch.Tensor, ggml_type: int, n_cols: int) -> torch.Tensor:
    """Decode ggml-encoded rows to float32, bit-identical to ``gguf.quants.dequantize``.

    Args:
        raw: uint8 tensor ``[..., row_bytes(ggml_type, n_cols)]``: the bytes of rows, any leading
            shape (e.g. ``[n_experts, n_rows, row_bytes]``), any strides, on any device.
        ggml_type: a ``GGMLQuantizationType`` (or its int); see :data:`SUPPORTED_TYPES`. Block
            layouts are ggml's (``ggml-common.h``): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, IQ4_NL and MXFP4
            blocks of 32; k-quants Q2_K..Q6_K, the i-quants IQ1_S..IQ4_XS and TQ1_0/TQ2_0 super-blocks
            of 256; F32/F16/BF16 plain. The i-quant code books (grids, sign table) come from the
            ``gguf`` package.
        n_cols: elements per row (a multiple of the type's block size).

    Returns:
        float32 tensor ``[..., n_cols]`` on ``raw.device``. For F32 this is a view of ``raw``
        whenever its bytes are 4-byte aligned (a copy otherwise); F16 and BF16 are converted
        exactly (NaN payloads included). Quantized types allocate the output plus temporaries
        of about one byte per element. Bit-identical to the reference on CPU and CUDA; the
        one exception is a block whose fp16 scale is itself NaN: CUDA arithmetic returns the
        canonical NaN where numpy propagates the scale's payload (still NaN, other bits).

    Raises:
        UnsupportedTypeError: ``ggml_type`` is not supported (message names it and its number).
        TypeError: ``raw`` is not a uint8 tensor.
        ValueError: ``raw`` has no dimensions or its last dimension is not ``row_bytes``.
    """
    qtype = _supported(ggml_type, "dequantize")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        got = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"dequantize({qtype.name}): raw must be a torch.uint8 tensor, got {got}")
    nbytes = row_bytes(qtype, n_cols)
    if raw.dim() == 0 or raw.shape[-1] != nbytes:
        raise ValueError(
            f"dequantize({qtype.name}, n_cols={n_cols}): raw shape {tuple(raw.shape)} must end in "
            f"row_bytes={nbytes}"
        )
    if raw.stride(-1) != 1:
        raw = raw.contiguous()

    float_dtype = getattr(torch, _FLOAT_TYPES[qtype]) if qtype in _FLOAT_TYPES else None
    if float_dtype is not None:
        vals = _reinterpret(raw, float_dtype)
        if float_dtype == torch.float16:
            return _f16_to_f32_exact(vals)
        return vals if float_dtype == torch.float32 else vals.to(torch.float32)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.unflatten(-1, (n_cols // block_size, type_size))
    return _BLOCK_DECODERS[qtype](blocks).flatten(-2)


_LINEAR_CHUNK_ELEMENTS = 1 << 20  # float32 elements per dequantized band in linear() (4 MiB)


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n_cols: int) -> torch.Tensor:
    """``x @ W.T`` for a ggml-encoded weight ``W = dequantize(raw, ggml_type, n_cols)``.

    Args:
        x: float32 ``[..., n_cols]`` on ``raw.device``.
        raw: uint8 ``[n_rows, row_bytes(ggml_type, n_cols)]`` (a GGUF tensor of ggml shape
            ``[n_cols, n_rows]``). F32 weights are reinterpreted in place, not copied.
        ggml_type, n_cols: as for :func:`dequantize`.

    Returns:
        float32 ``[..., n_rows]``; exactly ``torch.nn.functional.linear(x, W)`` (a weight of more than
        ``_LINEAR_CHUNK_ELEMENTS`` elements: of each band of rows, which equals the single matmul where torch's
        matmul does not depend on the row count; one CPU's torch gives a single x row other last bits for some row
        counts: tests/test_quant.py). Nothing
        nondeterministic (no atomics, no sampling) is involved: the same inputs give the same
        bits on every call (for a fixed device and thread count).

    Raises:
        UnsupportedTypeError, TypeError, ValueError: as for :func:`dequantize`, or when ``x``
        is not float32, its last dimension is not ``n_cols``, ``raw`` is not 2-D, or the
        devices differ.
    """
    qtype = _supported(ggml_type, "linear")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"linear({qtype.name}): x must be a torch.float32 tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] != n_cols:
        raise ValueError(f"linear({qtype.name}): x shape {tuple(x.shape)} must end in n_cols={n_cols}")
    if not isinstance(raw, torch.Tensor) or raw.dim() != 2:
        got = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"linear({qtype.name}): raw must be 2-D [n_rows, row_bytes], got {got}")
    if x.device != raw.device:
        raise ValueError(f"linear({qtype.name}): x is on {x.device} but raw is on {raw.device}")
    if qtype == T.F32 or raw.shape[0] * n_cols <= _LINEAR_CHUNK_ELEMENTS:
        return torch.nn.functional.linear(x, dequantize(raw, qtype, n_cols))
    # Large weights (an output projection, a big dense layer): dequantize a band of rows at a time so the
    # float32 band stays in cache instead of streaming a whole float32 copy through memory.
    rows = max(1, _LINEAR_CHUNK_ELEMENTS // n_cols)
    out = x.new_empty((*x.shape[:-1], raw.shape[0]))
    for r in range(0, raw.shape[0], rows):
        torch.nn.functional.linear(x, dequantize(raw[r:r + rows], qtype, n_cols), out=out[..., r:r + rows])
    return out
