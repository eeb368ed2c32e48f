"""Dequantization of ggml block formats with PyTorch.

Weights in a GGUF file are stored row by row; each row of ``n_cols`` elements is a
sequence of fixed-size blocks (``block_size`` elements packed into ``type_size``
bytes).  The block layouts are those of ggml (``ggml-common.h`` in llama.cpp /
ggml); the arithmetic reproduces the reference numpy dequantization of the
``gguf`` Python package (``gguf.quants.dequantize``) bit for bit: every scale is
an IEEE fp16 value widened to float32, every product and difference is a single
float32 operation performed in the same order as the reference, and no fused
multiply-add is used.

Everything here is vectorized torch code (no Python loop over blocks, no numpy),
so it runs on whatever device the raw bytes live on (CPU or CUDA).

Public API: :func:`is_supported`, :func:`row_bytes`, :func:`dequantize`,
:func:`linear`, :data:`SUPPORTED_TYPES` and :class:`UnsupportedTypeError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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
# ---------------------------------------------------------------------------

_CONSTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _shifts(name: str, values: tuple[int, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small cached uint8 constant (shift amounts) of ``shape`` on ``device``."""
    key = (name, device)
    t = _CONSTS.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)
        _CONSTS[key] = t
    return t


def _iq4nl_table(device: torch.device) -> torch.Tensor:
    key = ("iq4nl", device)
    t = _CONSTS.get(key)
    if t is None:
        t = torch.tensor(_IQ4NL_VALUES, dtype=torch.float32, device=device)
        _CONSTS[key] = t
    return t


def _reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.view(dtype)`` along the last dim; copies first only when the bytes are misaligned for ``dtype``."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, widened to float32: shape [..., n_blocks, 1]."""
    return _reinterpret(blocks[..., offset : offset + 2], torch.float16).to(torch.float32)


def _f16_to_f32_exact(h: torch.Tensor) -> torch.Tensor:
    """Widen fp16 to float32 exactly as numpy does, signalling NaNs included.

    torch's conversion (x86 F16C, and CUDA's cvt) sets the quiet bit of a signalling NaN;
    numpy keeps the payload bits untouched: sign, all-ones exponent, 10 mantissa bits << 13.
    NaN lanes are rebuilt that way; on CPU only when a NaN is present at all.
    """
    out = h.to(torch.float32)
    nan = out.isnan()
    if out.device.type == "cpu" and not bool(nan.any()):
        return out
    bits = h.view(torch.int16).to(torch.int32)  # sign-extended
    exact = (bits << 13).bitwise_or_(0x7F800000).view(torch.float32)
    return torch.where(nan, exact, out)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes into 4-bit values, low nibbles of each ``group`` bytes first, then the high nibbles.

    ``qs``: uint8 [..., n_blocks, m]; returns uint8 [..., n_blocks, m // group, 2, group].
    """
    q = qs.unflatten(-1, (-1, 1, group)) >> _shifts("nib", (0, 4), (2, 1), qs.device)
    return q.bitwise_and_(0x0F)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bit ``k`` of byte ``i`` at position ``[..., k, i]``: uint8 [..., n, m] -> [..., n, 8, m] of 0/1."""
    q = qh.unsqueeze(-2) >> _shifts("bit8", tuple(range(8)), (8, 1), qh.device)
    return q.bitwise_and_(1)


def _crumbs(q: torch.Tensor) -> torch.Tensor:
    """2-bit fields: uint8 [..., n, m] -> [..., n, 4, m]; field ``s`` is bits 2s..2s+1."""
    out = q.unsqueeze(-2) >> _shifts("crumb", (0, 2, 4, 6), (4, 1), q.device)
    return out.bitwise_and_(3)


def _le_bits(qh: torch.Tensor) -> torch.Tensor:
    """Bits of a little-endian 32-bit field stored as 4 bytes: uint8 [..., 4] -> [..., 32], bit ``j`` at ``j``."""
    q = qh.unsqueeze(-1) >> _shifts("bit8r", tuple(range(8)), (8,), qh.device)
    return q.bitwise_and_(1).flatten(-2)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit (scale, min) table of Q4_K/Q5_K: [..., 12] -> two uint8 [..., 8].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take
    their low 4 bits from bytes 8-11 (low/high nibble) and their top 2 bits from the top
    bits of bytes 0-3 / 4-7 (ggml-common.h block_q4_K, get_scale_min_k4).
    """
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _to_f32(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32)


# ---------------------------------------------------------------------------
# per-format block decoders: blocks uint8 [..., n_blocks, type_size] -> float32 [..., n_blocks, block_size]
# ---------------------------------------------------------------------------


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q4_0: fp16 d | 16 bytes of nibbles; x = d * (q - 8)
    d = _f16(blocks, 0)
    out = _to_f32(_nibbles(blocks[..., 2:18], 16).flatten(-3))
    return out.sub_(8.0).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q4_1: fp16 d | fp16 m | 16 bytes of nibbles; x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    out = _to_f32(_nibbles(blocks[..., 4:20], 16).flatten(-3))
    return out.mul_(d).add_(m)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    q = _nibbles(qs, 16).flatten(-3)
    return q.bitwise_or_(_le_bits(qh) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q5_0: fp16 d | u32 high bits | 16 bytes of nibbles; x = d * (q - 16)
    d = _f16(blocks, 0)
    out = _to_f32(_q5_codes(blocks[..., 2:6], blocks[..., 6:22]))
    return out.sub_(16.0).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q5_1: fp16 d | fp16 m | u32 high bits | 16 bytes of nibbles; x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    out = _to_f32(_q5_codes(blocks[..., 4:8], blocks[..., 8:24]))
    return out.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q8_0: fp16 d | 32 int8; x = q * d
    d = _f16(blocks, 0)
    return _to_f32(blocks[..., 2:34].view(torch.int8)).mul_(d)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q2_K: 16 bytes scales (low nibble scale, high nibble min) | 64 bytes 2-bit quants
    # | fp16 d | fp16 dmin; 16 groups of 16: x = (d * sc) * q - (dmin * mn)
    scales = blocks[..., 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * _to_f32(scales & 0x0F)).unsqueeze(-1)
    ml = (dmin * _to_f32(scales >> 4)).unsqueeze(-1)
    q = _crumbs(blocks[..., 16:80].unflatten(-1, (2, 32)))  # [..., 2, 4, 32]: j = 128h + 32s + i
    out = _to_f32(q).view(*q.shape[:-3], 16, 16)
    return out.mul_(dl).sub_(ml).flatten(-2)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q3_K: 32 bytes hmask | 64 bytes low 2 bits | 12 bytes packed 6-bit scales | fp16 d
    # x = (d * (sc - 32)) * (q_low - (hbit ? 0 : 4)), 16 groups of 16
    hmask, qs, sc = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks, 108)
    low = sc[..., 0:8].unflatten(-1, (1, 8)) >> _shifts("nib", (0, 4), (2, 1), sc.device)  # [..., 2, 8]
    high = _crumbs(sc[..., 8:12])  # [..., 4, 4]
    s = (low.bitwise_and_(0x0F).flatten(-2)).bitwise_or_(high.flatten(-2) << 4)
    dl = (d * _to_f32(s.view(torch.int8) - 32)).unsqueeze(-1)  # [..., 16, 1]
    q = _crumbs(qs.unflatten(-1, (2, 32))).flatten(-3)  # j = 128h + 32s + i
    q.bitwise_or_(_bits(hmask).flatten(-2) << 2)  # bit j//32 of hmask[j % 32]
    out = _to_f32(q).sub_(4.0)
    return out.view(*out.shape[:-1], 16, 16).mul_(dl).flatten(-2)


def _k4_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    return (d * _to_f32(sc)).unsqueeze(-1), (dmin * _to_f32(mn)).unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q4_K: fp16 d | fp16 dmin | 12 bytes scales/mins | 128 bytes nibbles
    # 8 groups of 32: x = (d * sc) * q - (dmin * mn)
    dl, ml = _k4_scales(blocks)
    q = _nibbles(blocks[..., 16:144], 32).flatten(-3, -2)  # [..., 8, 32]
    return _to_f32(q).mul_(dl).sub_(ml).flatten(-2)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q5_K: fp16 d | fp16 dmin | 12 bytes scales/mins | 32 bytes high bits | 128 bytes nibbles
    dl, ml = _k4_scales(blocks)
    q = _nibbles(blocks[..., 48:176], 32).flatten(-3, -2)  # [..., 8, 32]
    q.bitwise_or_(_bits(blocks[..., 16:48]) << 4)  # group s takes bit s of qh[i]
    return _to_f32(q).mul_(dl).sub_(ml).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_q6_K: 128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | fp16 d
    # 16 groups of 16: x = (d * sc) * (q - 32)
    d = _f16(blocks, 208)
    dl = (d * _to_f32(blocks[..., 192:208].view(torch.int8))).unsqueeze(-1)
    ql = _nibbles(blocks[..., 0:128], 64).flatten(-3)  # j = 128h + 64n + k from byte 64h + k
    qh = _crumbs(blocks[..., 128:192].unflatten(-1, (2, 32))).flatten(-3)  # j = 128h + 32s + i
    q = ql.bitwise_or_(qh << 4)
    out = _to_f32(q.view(torch.int8) - 32)
    return out.view(*out.shape[:-1], 16, 16).mul_(dl).flatten(-2)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_iq4_nl: fp16 d | 16 bytes of nibbles indexing kvalues_iq4nl; x = d * kvalues[q]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[..., 2:18], 16).flatten(-3)
    vals = _iq4nl_table(blocks.device)[q.to(torch.int32)]
    return vals.mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # ggml block_iq4_xs: fp16 d | u16 scales_h | 4 bytes scales_l | 128 bytes nibbles
    # 8 groups of 32: x = (d * (sc - 32)) * kvalues[q]
    d = _f16(blocks, 0)
    low = blocks[..., 4:8].unsqueeze(-1) >> _shifts("nibr", (0, 4), (2,), blocks.device)  # [..., 4, 2]
    high = _crumbs(blocks[..., 2:4]).transpose(-1, -2)  # [..., 2, 4]: byte b, field f -> scale 4b + f
    s = low.bitwise_and_(0x0F).flatten(-2).bitwise_or_(high.flatten(-2) << 4)
    dl = (d * _to_f32(s.view(torch.int8) - 32)).unsqueeze(-1)  # [..., 8, 1]
    q = _nibbles(blocks[..., 8:136], 16).flatten(-2)  # [..., 8, 32]
    vals = _iq4nl_table(blocks.device)[q.to(torch.int32)]
    return vals.mul_(dl).flatten(-2)


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
}

_FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    T.F32: torch.float32,
    T.F16: torch.float16,
    T.BF16: torch.bfloat16,
}

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
            layouts are ggml's (``ggml-common.h``): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and IQ4_NL blocks
            of 32, k-quants Q2_K..Q6_K and IQ4_XS super-blocks of 256; F32/F16/BF16 plain.
        n_cols: elements per row (a multiple of the type's block size).

    Returns:
        float32 tensor ``[..., n_cols]`` on ``raw.device``. For F32 this is a view of ``raw``
        whenever its bytes are 4-byte aligned (a copy otherwise); F16 and BF16 are converted
        exactly. Quantized types allocate the output and uint8 temporaries of one byte per
        element.

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

    float_dtype = _FLOAT_TYPES.get(qtype)
    if float_dtype is not None:
        vals = _reinterpret(raw, float_dtype)
        if float_dtype == torch.float16:
            return _f16_to_f32_exact(vals)
        return vals if float_dtype == torch.float32 else vals.to(torch.float32)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.unflatten(-1, (n_cols // block_size, type_size))
    return _BLOCK_DECODERS[qtype](blocks).flatten(-2)


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n_cols: int) -> torch.Tensor:
    """``x @ W.T`` for a ggml-encoded weight ``W = dequantize(raw, ggml_type, n_cols)``.

    Args:
        x: float32 ``[..., n_cols]`` on ``raw.device``.
        raw: uint8 ``[n_rows, row_bytes(ggml_type, n_cols)]`` (a GGUF tensor of ggml shape
            ``[n_cols, n_rows]``). F32 weights are reinterpreted in place, not copied.
        ggml_type, n_cols: as for :func:`dequantize`.

    Returns:
        float32 ``[..., n_rows]``; exactly ``torch.nn.functional.linear(x, W)``, so the same
        inputs give the same bits on every call.

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
    weight = dequantize(raw, qtype, n_cols)
    return torch.nn.functional.linear(x, weight)
