"""Triton matmul kernels that read ggml blocks directly: dense ``linear`` and the MoE ``grouped`` matmul.

The weights stay in the file's own bytes (block layouts: ggml's ``ggml-common.h``; the arithmetic of every
decoder is that of :mod:`moestream.quant`, which equals the ``gguf`` package's reference). Each kernel decodes
its weight tile in registers with the same ``@triton.jit`` helpers, so :func:`dequantize` here is
bit-identical to :func:`moestream.quant.dequantize` and the matmuls multiply exactly those float32 weights.

Loads
    Weight bytes are loaded as ``uint8`` lanes and combined with integer shifts (the GEMV kernel lets the
    compiler merge aligned runs of them into wider loads, see below), so no alignment is required of anything:
    a matrix may start at any byte offset of the pool (an O_DIRECT slot with a lead, a row-slice view of a
    bigger tensor). fp16 scales are widened with integer arithmetic (subnormals, infs
    and NaN payloads exact, as numpy does). ``enable_fp_fusion=False`` is passed to every launch, so the
    decoder's ``q * dl - ml`` is never contracted into an FMA (the reference rounds twice).

Kernel configuration (fixed, no autotune), a function of the matrix (type, shape, linear or grouped) and ``m_hint``
only:

* ``m_hint <= 8`` (decode), Q4_K, Q6_K, Q4_0, Q8_0 (:data:`GEMV_VW`): ``_gemv_kernel``. ``BLOCK_M =
  next_pow2(m_hint)`` x rows (one tile; each weight byte read once per launch), 2 warps, one thread per (weight row,
  sub-block lane): ``BLOCK_N = max(1, 64 / NSUB)`` weight rows (256 under Triton's interpreter:
  :data:`GEMV_INTERP_BLOCK_N`), ``NSUB = KS * 256 / SUB`` sub-block lanes per row: ``KS`` consecutive 256-element
  chunks side by side (:func:`gemv_ksplit`: for a matrix of at most 2048 rows through :func:`linear`, 8 chunks of K =
  2048 for Q4_K, one row per program; 1 for the grouped expert launches), each ``256 / SUB`` sub-blocks of ``SUB``
  elements (8 x 32; 16 x 16 for Q6_K). A thread walks its sub-block ``VW`` elements at a time (``VW`` = 4 for Q4_K, 2
  for the others: the block sizes 144, 210, 18 and 34 bytes keep runs of VW bytes VW-aligned), each load a [BN, NSUB,
  VW] tensor: the quant bytes, the fp16 scales and the scale bytes are all read as such runs (fields picked out with
  exact integer sums) and x as [BN, NSUB, VW] too (the same pointer for every weight row), so all loads and the
  arithmetic share one register layout: no shared-memory shuffle or barrier in the K loop, and the compiler can issue
  the loads of a K iteration (up to 32 steps, several chunks) together. Summation order, fixed by the source
  (element-wise adds only, never ``tl.sum`` on floats): lane ``(g, e)`` of an output (one float32 accumulator per
  weight row, x row and lane, from +0.0) adds the products ``x[k] * w[n, k]`` of ``k = 256 KS c + SUB g + VW j + e``
  in the order of ``(c, j)``; at the end the ``NSUB * VW`` lanes (index ``VW g + e``) are summed pairwise, ``a[2l] +
  a[2l+1]`` level by level (tests/test_tkernels.py ``gemv_order`` is this order in torch). The bits are therefore the
  same on the GPU as in the interpreter, for every ``m_hint <= 8`` and whatever the alignment. Masked elements (a
  ragged last chunk, chunks past ``n_cols`` in the last K iteration) add ``+0.0`` to an accumulator that cannot be
  ``-0.0``: no change. Alignment: where the matrix's base address, every used group offset and ``row_bytes`` are
  multiples of ``VW`` (checked on the host at launch: :func:`alignment`; ``grouped_planned`` takes the caller's
  ``align``), the compiler is told so and merges each run into one 16/32-bit load; otherwise (``ALIGN = 1``) the same
  code loads single bytes: the same values, the same bits, only slower.
* ``m_hint <= 8``, Q4_K, Q6_K, Q4_0 and Q8_0 (:data:`GEMV2_TYPES`; :data:`GEMV2`, ``MOESTREAM_GEMV2``: "all" by
  default, "linear", "grouped" or "0" (the kernel above)): ``_gemv2_kernel``. On the H200 it made the q32 decode
  step 1.31x faster (tg32 330.75 vs 253.28, 2026-12-04); its Q4_K/Q6_K order tests and the matmul tests with it
  passed on CUDA there (2026-12-04, benchmarks/gpu-h200/2026-12-04-session7). Q4_0 and Q8_0 were added after that
  run and take it only with :data:`GEMV2_B32` (``MOESTREAM_GEMV2_B32=1``): slower on the H200 (session 8); the
  next kernel, ``_gemv32_kernel``, takes them by default. The kernel
  above spends ~23 (Q6_K) / ~14 (Q4_K) / ~11 (Q4_0) /
  ~9 (Q8_0) SASS instructions per weight on sm_90 (per-element byte picks, 64-bit addresses, I2F): issue-bound, not
  memory-bound (an LM head at 822 GB/s of the H200's ~4 TB/s). Here a lane owns a run of one block's quant bytes
  and decodes its header once per K step; ``LPB`` lanes per block (:data:`GEMV2_LPB` per super-block, 8 or 4;
  :data:`GEMV2_LPB32` per block of 32, 1, 2 or 4). Q4_K: lane ``li`` reads the ``B = 128 / LPB`` quant bytes from
  ``B li = 32 p + o`` as 32-bit words: weights ``64 p + o + (0..B-1)`` (low nibbles, sub-block 2p) and the same +
  32 (high nibbles, sub-block 2p + 1). Q6_K: lane ``li`` of half ``h = li // (LPB/2)`` at ``l = R (li % (LPB/2))``,
  ``R = 64 / LPB``, reads ``ql[64 h + l ..+R]``, ``ql[64 h + 32 + l ..+R]`` and ``qh[32 h + l ..+R]`` as 16-bit
  loads (a 210-byte block leaves odd blocks 2-aligned): weights ``128 h + 32 q + l + (0..R-1)``, q = 0..3, scales
  ``sc[8 h + 2 q + l // 16]``. Quants are extracted four per word (``0x0F0F0F0F`` masks, qh bits shifted in place),
  each byte ORed into the mantissa of a power of two and that power subtracted (``q`` or ``q - 32`` as an exact
  float32 without I2F). Q4_0 (fp16 d | 16 bytes) and Q8_0 (fp16 d | 32 int8): lane ``li`` reads its block's d (a
  16-bit load) and the ``QB = 16 / LPB`` (Q4_0) or ``32 / LPB`` (Q8_0) quant bytes from ``QB li`` as 16-bit words,
  two per run of 4 bytes (blocks of 18 and 34 bytes are only 2-aligned; a 32-bit word would cost as many
  instructions: a field above bit 19 must be shifted down first, so one load plus one shift per 4 bytes either way,
  and a lane owning two blocks would save only a d load): weights ``QB li + (0..QB-1)`` (Q4_0: the low nibbles,
  then the same + 16, the high ones). Each field (a nibble or byte at bit ``p`` < 16 of its word) is ANDed in place
  and XORed with the bits of ``2**(23 - p)`` (Q8_0: and with 0x80 in the field, which makes the int8 ``q + 128``) in
  one LOP3, then ``2**(23 - p) + 8`` (Q4_0) / ``+ 128`` (Q8_0) is subtracted: ``q - 8`` / ``q`` as an exact float32,
  times d (moestream.quant's one rounding). x is read as [LANES, BN, 4] runs (16-byte loads), the weights multiply
  it in the same register layout: ~8 (Q6_K) / ~9 (Q4_K) instructions per weight at LPB 8, ~6 (Q4_0, Q8_0) at LPB
  1 (``tools/gemv_sass.py``). ``KS`` blocks of a row side by side (:func:`gemv2_ksplit`), ``LANES = LPB KS``
  threads per row, ``BLOCK_N = 32 GEMV2_WARPS / LANES`` rows per program (4 warps; 256 rows under the
  interpreter); rows past the matrix read its last row and are not stored, so the K loop has no masked loads.
  Super-blocks: KS 1 for grouped launches and tall matrices, up to 8 for small ``linear`` ones, always a divisor of
  the row's super-blocks. Blocks of 32: KS ``8 / LPB`` for grouped launches, more for small ``linear`` ones, not
  always a divisor (Gemma's expert down rows have 22 blocks): then a last, ragged K step after the loop, whose lanes
  past the row read the row's last block with d = 0 and x as 0.0 (adding +-0.0 to an accumulator that is never
  -0.0: no change). Summation order (tests/test_tkernels.py ``gemv2_lane_order``/``gemv2_order``): lane-element
  ``(g, e)`` (``g = LPB c + li``, ``e < 4``) of an output adds from +0.0, for K steps ``kb = 0, KS, ..`` (block ``b
  = kb + c``, while ``b`` is in the row): Q4_K, for r = 0..B/4-1, low then high nibble: ``k = 256 b + 64 p + o + 32
  half + 4 r + e``; Q6_K, for v = 0..R/4-1, for q = 0..3: ``k = 256 b + 128 h + l + 32 q + 4 v + e``; Q4_0, for r =
  0..QB/4-1, low then high nibble: ``k = 32 b + 16 half + QB li + 4 r + e``; Q8_0, for r = 0..QB/4-1: ``k = 32 b +
  QB li + 4 r + e``; then the ``4 LANES`` lane-elements (index ``4 g + e``) are summed pairwise as above.
  Alignment: 32-bit (Q4_K) / 16-bit (Q6_K, Q4_0, Q8_0) loads where the matrix's address, offsets and row bytes
  allow, byte loads otherwise: the same bits. fp16 scales use the hardware conversion (exact but for NaN payloads).
* ``m_hint <= 8``, Q4_0 and Q8_0 (:data:`GEMV32`, ``MOESTREAM_GEMV32``: on by default, "0" for ``_gemv_kernel``;
  ``MOESTREAM_GEMV2_B32=1`` takes them to ``_gemv2_kernel`` instead): ``_gemv32_kernel``. A weight row is read by
  one warp, ``LANES = 32`` lanes along its bytes: ``LPB = 16 / VW`` (Q4_0) or ``32 / VW`` (Q8_0) lanes per block of
  32, ``KS = 32 / LPB`` blocks side by side per K step, lane ``li`` of a block owning its quant bytes ``VW li ..
  VW li + VW - 1`` (:data:`GEMV32_VW` 4: two 16-bit loads; 2: one) and loading the block's fp16 d; x is read as
  [BN, LANES, VW] runs (16-byte loads at VW 4, contiguous across a warp). Q4_0 adds the low nibbles (elements ``32 b
  + VW li + e``), then the high ones (``+ 16``), ``w = (q - 8) d``; Q8_0 elements ``32 b + VW li + e``, ``w = q d``
  (quants made floats without I2F, as in ``_gemv2_kernel``; the weights are exactly moestream.quant's). :data:`GEMV32_U`
  K steps per loop iteration are straight-line code (their loads issue together: ``_gemv_kernel`` kept about 2
  bytes of weights in flight per thread), the steps after the last whole iteration unrolled, a ragged last step
  (lanes past the row: d = 0, x 0.0) where ``KS`` does not divide the row's blocks; :data:`GEMV32_ROWS` rows per
  program (4 warps). Summation order (tests/test_tkernels.py ``gemv32_lane_order``/``gemv32_order``): lane-element
  ``VW l + e`` accumulates from +0.0 over K steps ``s = 0, 1, ..`` (block ``b = KS s + c``, lane ``l = LPB c + li``),
  Q4_0 low then high nibble; then the ``32 VW`` lane-elements are summed pairwise. U and the rows per program never
  change a bit; VW does. On the H200 (benchmarks/gemv_ab.py, 2026-12-05): Gemma-4 expert gate/up 13.66 -> 8.65 µs,
  down 13.42 -> 10.79, Q8_0 attention [2816, 2816] 12.92 -> 5.84; g30's decode step 8.23 -> 6.17 ms on an H100.
* ``m_hint <= 8``, the other types (and every type with ``MOESTREAM_GEMV_WIDE=0``): GEMV branch of
  ``_matmul_kernel``. ``BLOCK_N = 16`` weight rows, ``BLOCK_K = 256``, 4 warps; byte loads. Each program
  decodes its ``16 x 256`` weight tile once per K chunk and multiplies it with each of its x rows: float32
  products, ``tl.sum`` over the 32 (16 for Q6_K) elements of a sub-block, then over the sub-blocks, then added
  to the running sum (a reduction tree that the compiler's register layout decides, fixed per configuration).
* ``m_hint > 8`` (prefill): GEMM path. ``BLOCK_M = 32``, ``BLOCK_N = 64``, ``BLOCK_K = 64``, 4 warps: the
  decoded ``64 x 64`` tile goes through ``tl.dot(x, w.T, acc, input_precision="ieee")`` (float32 FMA, never
  tf32).

Determinism: no atomics; every output element is reduced over K in chunk order with the same in-chunk order
whatever tile, program or launch computes it, and the configuration never depends on the number of groups,
the offsets or the row counts. So an output row of a (matrix, x row) pair has the same bits wherever the
matrix sits in the pool, whatever else shares the launch, and through :func:`linear` or :func:`grouped`,
given the same ``m_hint``.

``MOESTREAM_GEMV_WIDE=0`` in the environment (read at import into :data:`GEMV_WIDE`, which may also be set at
run time) selects the old GEMV branch for every type, for A/B runs (benchmarks/gemv_ab.py; whole models). The
two paths sum in different orders, so their outputs differ in the last bits (both within the float32 bound).

K is masked: ``n_cols`` need only be a multiple of the type's block size (no K-chunk multiple required). The
matmul kernel takes ``n_cols`` as a compile-time constant (one compile per distinct width: a model has a few;
it also keeps the K loop a plain Python range under the interpreter with numpy 2.4).

Public API: :data:`TYPES`, :func:`computes`, :func:`available`, :func:`dequantize`, :func:`linear`,
:func:`grouped`, :func:`grouped_planned`, :func:`alignment`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

try:  # triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl

    from . import count_compiles
    count_compiles(triton)  # the generation's stats say how long the kernels' first builds took
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["TYPES", "alignment", "available", "computes", "dequantize", "grouped", "grouped_planned", "linear"]

T = GGMLQuantizationType

#: ggml types the kernels compute.
TYPES: frozenset[int] = frozenset(int(t) for t in (
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
))

_IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

GEMV_MAX_M = 8  # m_hint up to this: GEMV path

#: the GEMV path's kernel for these types (ggml type -> bytes per load, VW): _gemv_kernel; the others (and every
#: type with MOESTREAM_GEMV_WIDE=0) take _matmul_kernel's GEMV branch
GEMV_VW: dict[int, int] = {int(T.Q4_K): 4, int(T.Q6_K): 2, int(T.Q4_0): 2, int(T.Q8_0): 2}
#: whether _gemv_kernel is used (the environment's MOESTREAM_GEMV_WIDE at import; "0" selects _matmul_kernel's
#: GEMV branch for every type, the path before it existed: for A/B runs). Read at each launch: may be changed.
GEMV_WIDE: bool = os.environ.get("MOESTREAM_GEMV_WIDE", "1") != "0"
#: _gemv_kernel's warps per program (BLOCK_N = max(1, 32 * GEMV_WARPS / NSUB) weight rows: never a bit of the
#: result, which each row's lanes sum in a fixed order); MOESTREAM_GEMV_WARPS at import, for A/B runs
GEMV_WARPS = int(os.environ.get("MOESTREAM_GEMV_WARPS", "2"))
#: the most lanes (threads) one weight row gets from the K split (:func:`gemv_ksplit`; a constant: the bits
#: depend on it)
GEMV_KSPLIT_LANES = 64
#: _gemv_kernel's weight rows per program under Triton's interpreter (``TRITON_INTERPRET=1``, CPU CI). There a
#: program costs per operation, not per element, and the GPU's 8 rows made a default-model decode step about 26x
#: slower than the old kernel (a [16384, 64] Q8_0 GEMV: 259 s vs 9.8 s; 8.5 s at 256 rows). Every weight row sums
#: its own lanes, so the rows per program never change a bit (tests/test_tkernels.py checks both sizes).
GEMV_INTERP_BLOCK_N = 256
#: _gemv_kernel's chunks per lane group: "auto" (:func:`gemv_ksplit`) or a power of two (1: one 256-element chunk
#: per K step, the order before the split; for A/B runs). The environment's MOESTREAM_GEMV_KSPLIT at import; read
#: at each launch: may be changed.
GEMV_KSPLIT: str = os.environ.get("MOESTREAM_GEMV_KSPLIT", "auto")
#: the lane kernel's types (ggml type -> alignment of its word loads): _gemv2_kernel (Q4_K: 32-bit loads; Q6_K,
#: Q4_0, Q8_0: 16-bit loads: blocks of 210, 18 and 34 bytes leave odd blocks only 2-aligned)
GEMV2_TYPES: dict[int, int] = {int(T.Q4_K): 4, int(T.Q6_K): 2, int(T.Q4_0): 2, int(T.Q8_0): 2}
#: _gemv2_kernel's lanes per 256-element super-block (Q4_K, Q6_K), 8 (32 weights per lane and K step) or 4 (64: the
#: header decoded half as often, twice the registers and fewer threads); MOESTREAM_GEMV2_LPB at import, read at each
#: launch. The bits depend on it (the lanes' order changes).
GEMV2_LPB = int(os.environ.get("MOESTREAM_GEMV2_LPB", "8"))
#: _gemv2_kernel's lanes per 32-element block (Q4_0, Q8_0): 1 (a lane reads a whole block: 32 weights per K step),
#: 2 or 4 (16 or 8 weights: the scale loaded by every lane of the block, the x and weight loads of a warp on fewer
#: cache lines); MOESTREAM_GEMV2_LPB32 at import, read at each launch. The bits depend on it.
GEMV2_LPB32 = int(os.environ.get("MOESTREAM_GEMV2_LPB32", "1"))
#: which GEMV launches of the GEMV2_TYPES take _gemv2_kernel: "all", "linear" (matrices through linear() only),
#: "grouped" (the expert launches only) or "0" (none: _gemv_kernel, the kernel before it; for A/B runs). The
#: environment's MOESTREAM_GEMV2 at import; read at each launch: may be changed. The two kernels sum in different
#: fixed orders: a weight's bits depend on it (set it for a whole run). Default "all".
GEMV2: str = os.environ.get("MOESTREAM_GEMV2", "all")
#: whether Q4_0 and Q8_0 launches take _gemv2_kernel too (where :data:`GEMV2` selects it): MOESTREAM_GEMV2_B32 at
#: import ("1"/"on"), read at each launch. Off by default: on the H200 they were slower than _gemv_kernel (Q4_0
#: 0.65-0.67x, 2026-12-05 session 8) and _gemv32_kernel takes these types (:data:`GEMV32`); kept for A/B runs.
GEMV2_B32: bool = os.environ.get("MOESTREAM_GEMV2_B32", "0").strip().lower() in ("1", "on", "true", "yes")
_B32_TYPES = frozenset((int(T.Q4_0), int(T.Q8_0)))
#: whether Q4_0 and Q8_0 GEMV launches take _gemv32_kernel (lanes along a row's bytes, one 16-bit quant word each;
#: module docstring): MOESTREAM_GEMV32 at import ("0": off, the launches take _gemv_kernel), read at each launch.
#: Where :data:`GEMV2_B32` sends them to _gemv2_kernel, that wins (an opt-in for A/B runs). The bits depend on it.
GEMV32: bool = os.environ.get("MOESTREAM_GEMV32", "1") != "0"
#: _gemv32_kernel's K steps per loop iteration (straight-line code whose loads issue together; never a bit of the
#: result) and weight rows per program (4 warps: one row per warp at 4); MOESTREAM_GEMV32_U / _ROWS at import
GEMV32_U = int(os.environ.get("MOESTREAM_GEMV32_U", "8"))
GEMV32_ROWS = int(os.environ.get("MOESTREAM_GEMV32_ROWS", "4"))
GEMV32_WARPS = 4
#: _gemv32_kernel's quant bytes per lane and K step (2 or 4: one or two 16-bit loads); the bits depend on it
GEMV32_VW = int(os.environ.get("MOESTREAM_GEMV32_VW", "4"))
#: _gemv2_kernel's warps per program (BLOCK_N = 32 * GEMV2_WARPS / LANES rows; never a bit of the result)
GEMV2_WARPS = int(os.environ.get("MOESTREAM_GEMV2_WARPS", "4"))
#: _gemv2_kernel, :func:`linear` launches: the K split doubles (up to the super-blocks of a row and
#: GEMV2_MAX_LANES lanes) while the launch has fewer than this many threads (132 SMs x ~1000 resident)
GEMV2_THREADS = 1 << 17
GEMV2_MAX_LANES = 128


def available() -> bool:
    """Whether the kernels can run: triton imports, and CUDA is available or ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def computes(ggml_type: int, n_cols: int) -> bool:
    """Whether ``ggml_type`` (a number) is in :data:`TYPES` and ``n_cols`` a positive multiple of its block size."""
    try:
        t = int(ggml_type)
    except (TypeError, ValueError):
        return False
    if t not in TYPES:
        return False
    block = GGML_QUANT_SIZES[T(t)][0]
    return n_cols > 0 and n_cols % block == 0


def _sub(ggml_type: int) -> int:
    """Elements per sub-block (the unit sharing one scale): 16 for Q6_K, 32 for the rest."""
    return 16 if ggml_type == int(T.Q6_K) else 32


#: :func:`gemv_ksplit` splits K only for a matrix computed alone (:func:`linear`: attention projections, dense FFNs)
#: of at most this many rows. Measured on an H200 (benchmarks/gemv_ab.py --old ks1, 2026-12-04, µs per call, KS 1
#: -> 8): k/v [512, 2048] Q4_K 8.3 -> 3.4, o [2048, 4096] 18.3 -> 12.0; slower: q [4096, 2048] 10.6 -> 12.2, the
#: Q6_K LM head 310 -> 447, Q8_0 [2816, 2816] 13.0 -> 23.2, and every grouped expert launch (8 or 16 matrices:
#: Q4_K gate/up 12.7 -> 17.9, Q4_0 [704, 2816] 13.7 -> 39.7), which have rows enough to fill the GPU.
GEMV_KSPLIT_MAX_ROWS = 2048


def gemv_ksplit(ggml_type: int, n_cols: int, n_rows: int = 1, grouped: bool = False) -> int:
    """256-element chunks that _gemv_kernel's lanes of one weight row cover side by side (``KS``). 1 for grouped
    launches (experts) and for matrices of more than :data:`GEMV_KSPLIT_MAX_ROWS` rows; otherwise the largest power
    of two with ``KS`` chunks in ``n_cols`` and ``KS * 256 / SUB`` lanes (one per sub-block) within
    :data:`GEMV_KSPLIT_LANES` (a row of K = 2048 Q4_K, 8 chunks, read by 64 threads instead of 8: more programs
    and loads in flight for a small matrix); :data:`GEMV_KSPLIT` when that is a number. A function of the matrix
    (type, shape, and whether it goes through :func:`linear` or the grouped launches: a weight always takes the
    same one), never of the tokens or groups of a call; the bits depend on it (module docstring)."""
    if GEMV_KSPLIT != "auto":
        return int(GEMV_KSPLIT)
    if grouped or n_rows > GEMV_KSPLIT_MAX_ROWS:
        return 1
    lanes, chunks, ks = 256 // _sub(int(ggml_type)), -(-int(n_cols) // 256), 1
    while 2 * ks <= chunks and 2 * ks * lanes <= GEMV_KSPLIT_LANES:
        ks *= 2
    return ks


def gemv2_uses(ggml_type: int, grouped: bool) -> bool:
    """Whether a GEMV launch of this type (through :func:`linear`, or grouped) takes _gemv2_kernel (:data:`GEMV2`)."""
    if int(ggml_type) not in GEMV2_TYPES or not GEMV_WIDE or (int(ggml_type) in _B32_TYPES and not GEMV2_B32):
        return False
    return GEMV2 == "all" or GEMV2 == ("grouped" if grouped else "linear")


def gemv32_uses(ggml_type: int, grouped: bool) -> bool:
    """Whether a GEMV launch of this type takes _gemv32_kernel: Q4_0 / Q8_0 with :data:`GEMV32` on, unless
    :data:`GEMV2_B32` sends it to _gemv2_kernel (:func:`gemv2_uses`)."""
    t = int(ggml_type)
    return t in _B32_TYPES and GEMV_WIDE and GEMV32 and not gemv2_uses(t, grouped)


def gemv32_lpb(ggml_type: int) -> int:
    """_gemv32_kernel's lanes per block of 32 (:data:`GEMV32_VW` quant bytes each): 16 / VW for Q4_0 (16 bytes),
    32 / VW for Q8_0."""
    return (16 if int(ggml_type) == int(T.Q4_0) else 32) // GEMV32_VW


def gemv2_lpb(ggml_type: int) -> int:
    """_gemv2_kernel's lanes per block of ``ggml_type``: :data:`GEMV2_LPB` per 256-element super-block (Q4_K, Q6_K),
    :data:`GEMV2_LPB32` per 32-element block (Q4_0, Q8_0)."""
    return GEMV2_LPB if GGML_QUANT_SIZES[T(int(ggml_type))][0] == 256 else GEMV2_LPB32


def gemv2_ksplit(ggml_type: int, n_cols: int, n_rows: int = 1, grouped: bool = False) -> int:
    """Blocks that _gemv2_kernel's lanes of one weight row cover side by side (``KS``; a power of two; ``LANES = KS
    LPB`` threads per row, :func:`gemv2_lpb`). A function of the matrix only; the bits depend on it.

    Q4_K, Q6_K (super-blocks of 256): 1 for grouped launches (experts: 8-16 matrices, rows enough); for
    :func:`linear`, doubled while ``2 KS`` super-blocks fit in the row, ``2 KS LPB`` lanes within
    :data:`GEMV2_MAX_LANES` and the launch has fewer than :data:`GEMV2_THREADS` threads (``n_rows * KS * LPB``): an LM
    head keeps 1 (16 lanes per Q6_K row, 8 rows per program), a [4096, 2048] Q4_K projection gets 4; always a
    divisor of the row's super-blocks.

    Q4_0, Q8_0 (blocks of 32): ``8 / LPB`` (8 lanes per row, as above) for grouped launches; for :func:`linear`,
    doubled while ``2 KS LPB`` lanes fit in :data:`GEMV2_MAX_LANES`, the launch has fewer than
    :data:`GEMV2_THREADS` threads and the row's blocks rounded up to a multiple of ``2 KS`` stay within 9/8 of them
    (a [2816, 2816] Q8_0 matrix: 88 blocks, KS 32 at LPB 1, three K steps of which the last has 24 blocks). Not a
    divisor of the row's blocks in general (Gemma's expert down rows have 22): the last K step is then ragged."""
    lpb = gemv2_lpb(ggml_type)
    if GGML_QUANT_SIZES[T(int(ggml_type))][0] == 32:
        n_b, ks = int(n_cols) // 32, max(1, 8 // lpb)
        if grouped:
            return ks
        while (2 * ks * lpb <= GEMV2_MAX_LANES and n_rows * ks * lpb < GEMV2_THREADS
               and 8 * (-(-n_b // (2 * ks)) * 2 * ks) <= 9 * n_b):
            ks *= 2
        return ks
    if grouped:
        return 1
    n_sb, ks = int(n_cols) // 256, 1
    while n_sb % (2 * ks) == 0 and 2 * ks * lpb <= GEMV2_MAX_LANES and n_rows * ks * lpb < GEMV2_THREADS:
        ks *= 2
    return ks


def _config(ggml_type: int, n_rows: int, n_cols: int, m_hint: int, grouped: bool = True) -> dict[str, Any]:
    """The fixed kernel configuration for a matrix ``(ggml_type, n_rows, n_cols)``, through :func:`linear` or the
    grouped launches, at ``m_hint`` (never the tokens or groups of a call)."""
    sub = _sub(ggml_type)
    if m_hint <= GEMV_MAX_M:
        bm = 1
        while bm < m_hint:
            bm *= 2
        if gemv32_uses(ggml_type, grouped):
            bn = GEMV_INTERP_BLOCK_N if os.environ.get("TRITON_INTERPRET") == "1" else GEMV32_ROWS
            return dict(BLOCK_M=bm, BLOCK_N=bn, NSUB=32, SUB=32, VW=GEMV32_VW, WA=2, LPB=gemv32_lpb(ggml_type),
                        U=GEMV32_U, GEMM=False, WIDE=True, G32=True, num_warps=GEMV32_WARPS)
        if gemv2_uses(ggml_type, grouped):
            wa, lpb = GEMV2_TYPES[int(ggml_type)], gemv2_lpb(ggml_type)
            lanes = lpb * gemv2_ksplit(ggml_type, n_cols, n_rows, grouped)
            bn = (GEMV_INTERP_BLOCK_N if os.environ.get("TRITON_INTERPRET") == "1"
                  else max(1, 32 * GEMV2_WARPS // lanes))
            return dict(BLOCK_M=bm, BLOCK_N=bn, NSUB=lanes, SUB=sub, VW=4, WA=wa, LPB=lpb, GEMM=False, WIDE=True,
                        K2=True, num_warps=GEMV2_WARPS)
        if GEMV_WIDE and ggml_type in GEMV_VW:
            nsub = 256 // sub * gemv_ksplit(ggml_type, n_cols, n_rows, grouped)
            bn = (GEMV_INTERP_BLOCK_N if os.environ.get("TRITON_INTERPRET") == "1"
                  else max(1, 32 * GEMV_WARPS // nsub))
            return dict(BLOCK_M=bm, BLOCK_N=bn, NSUB=nsub, SUB=sub, VW=GEMV_VW[ggml_type],
                        GEMM=False, WIDE=True, num_warps=GEMV_WARPS)
        return dict(BLOCK_M=bm, BLOCK_N=16, NSUB=256 // sub, SUB=sub, GEMM=False, WIDE=False, num_warps=4)
    return dict(BLOCK_M=32, BLOCK_N=64, NSUB=64 // sub, SUB=sub, GEMM=True, WIDE=False, num_warps=4)


def alignment(*values: Any) -> int:
    """The largest power of two, at most 16, dividing every value (ints, int arrays or tensors on the host: a
    pool's ``data_ptr()``, byte offsets, a row stride)."""
    o = 0
    for v in values:
        a = np.asarray(v, dtype=np.int64).reshape(-1)
        if a.size:
            o |= int(np.bitwise_or.reduce(a))
    o |= 16
    return o & -o


# ---------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _u8(p, m):
        """Byte(s) at ``p`` as int32 (0 where masked)."""
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _f16_bits_to_f32(h):
        """fp16 bit patterns (int32 0..65535) to float32, exactly (subnormals, inf, NaN payload kept)."""
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        normal = sign | ((e + 112) << 23) | (m << 13)
        special = sign | 0x7F800000 | (m << 13)
        subn = (m.to(tl.float32) * 5.9604644775390625e-08).to(tl.int32, bitcast=True) | sign  # m * 2**-24
        bits = tl.where(e == 0, subn, tl.where(e == 31, special, normal))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _f16at(p, m):
        """Little-endian fp16 at byte pointer(s) ``p``, widened to float32."""
        return _f16_bits_to_f32(_u8(p, m) | (_u8(p + 1, m) << 8))

    @triton.jit
    def _k4_scale_min(sp, t, m):
        """Q4_K/Q5_K sub-block ``t`` (0..7) scale and min (int32) from the 12-byte table at ``sp``.

        t < 4: scale = b[t] & 63, min = b[t+4] & 63; t >= 4: scale = (b[t+4] & 15) | (b[t-4] >> 6) << 4,
        min = (b[t+4] >> 4) | (b[t] >> 6) << 4 (ggml-common.h block_q4_K; quant._k4_scales).
        """
        b_t = _u8(sp + t, m)
        b_t4 = _u8(sp + t + 4, m)
        b_lo = _u8(sp + (t % 4), m)
        lo = t < 4
        sc = tl.where(lo, b_t & 63, (b_t4 & 15) | ((b_lo >> 6) << 4))
        mn = tl.where(lo, b_t4 & 63, (b_t4 >> 4) | ((b_t >> 6) << 4))
        return sc, mn

    @triton.jit
    def _q6k_w(bb, t, i, mel, dl):
        """Q6_K weights (float32) of elements ``i`` of group ``t`` (of 16) of the super-blocks at byte pointers
        ``bb``, given ``dl = d * sc``: 6-bit quants from ql (low 4 bits) and qh (high 2 bits), ``(q - 32) * dl``."""
        j = 16 * t + i  # element of the super-block
        h = j // 128
        r = j % 128
        lo4 = (_u8(bb + 64 * h + (r % 64), mel) >> (4 * (r // 64))) & 15
        hi2 = (_u8(bb + 128 + 32 * h + (r % 32), mel) >> (2 * (r // 32))) & 3
        w = (lo4 | (hi2 << 4)) - 32
        return w.to(tl.float32) * dl

    @triton.jit
    def _decode(wp, msub, mel, k0, kv_ptr, QTYPE: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr):
        """Weights ``k0 + SUB*g + i`` (g < NSUB, i < SUB) of the rows at byte pointers ``wp`` [BN, 1, 1].

        Returns float32 [BN, NSUB, SUB] (0 where ``mel`` is false). ``msub`` [BN, NSUB, 1] masks whole
        sub-blocks, ``mel`` [BN, NSUB, SUB] elements; ``k0`` is a multiple of ``NSUB * SUB``. Block layouts:
        ggml-common.h; arithmetic order: moestream.quant (one float32 rounding per operation).
        """
        g = tl.arange(0, NSUB)[None, :, None]
        i = tl.arange(0, SUB)[None, None, :]
        s = k0 // SUB + g  # global sub-block index
        if QTYPE == 0:  # F32
            p = wp + 4 * (k0 + SUB * g + i)
            bits = _u8(p, mel) | (_u8(p + 1, mel) << 8) | (_u8(p + 2, mel) << 16) | (_u8(p + 3, mel) << 24)
            w = bits.to(tl.float32, bitcast=True)
        elif QTYPE == 1:  # F16
            w = _f16at(wp + 2 * (k0 + SUB * g + i), mel)
        elif QTYPE == 30:  # BF16: the top half of a float32
            p = wp + 2 * (k0 + SUB * g + i)
            w = ((_u8(p, mel) | (_u8(p + 1, mel) << 8)) << 16).to(tl.float32, bitcast=True)
        elif QTYPE == 2:  # Q4_0: fp16 d | 16 bytes (element i: low nibble of byte i % 16 for i < 16, else high)
            bb = wp + 18 * s
            d = _f16at(bb, msub)
            q = (_u8(bb + 2 + (i % 16), mel) >> (4 * (i // 16))) & 15
            w = (q - 8).to(tl.float32) * d
        elif QTYPE == 3:  # Q4_1: fp16 d | fp16 m | 16 bytes as Q4_0; x = d * q + m
            bb = wp + 20 * s
            d = _f16at(bb, msub)
            mm = _f16at(bb + 2, msub)
            q = (_u8(bb + 4 + (i % 16), mel) >> (4 * (i // 16))) & 15
            w = q.to(tl.float32) * d + mm
        elif QTYPE == 6:  # Q5_0: fp16 d | u32 qh (bit i: 5th bit of element i) | 16 bytes; x = d * (q - 16)
            bb = wp + 22 * s
            d = _f16at(bb, msub)
            hb = (_u8(bb + 2 + i // 8, mel) >> (i % 8)) & 1
            q = ((_u8(bb + 6 + (i % 16), mel) >> (4 * (i // 16))) & 15) | (hb << 4)
            w = (q - 16).to(tl.float32) * d
        elif QTYPE == 7:  # Q5_1: fp16 d | fp16 m | u32 qh | 16 bytes; x = d * q + m
            bb = wp + 24 * s
            d = _f16at(bb, msub)
            mm = _f16at(bb + 2, msub)
            hb = (_u8(bb + 4 + i // 8, mel) >> (i % 8)) & 1
            q = ((_u8(bb + 8 + (i % 16), mel) >> (4 * (i // 16))) & 15) | (hb << 4)
            w = q.to(tl.float32) * d + mm
        elif QTYPE == 8:  # Q8_0: fp16 d | 32 int8; x = q * d
            bb = wp + 34 * s
            d = _f16at(bb, msub)
            q = (_u8(bb + 2 + i, mel) ^ 128) - 128
            w = q.to(tl.float32) * d
        elif QTYPE == 20:  # IQ4_NL: fp16 d | 16 bytes as Q4_0 indexing kvalues_iq4nl; x = kvalues[q] * d
            bb = wp + 18 * s
            d = _f16at(bb, msub)
            q = (_u8(bb + 2 + (i % 16), mel) >> (4 * (i // 16))) & 15
            w = tl.load(kv_ptr + q) * d
        elif QTYPE == 12:  # Q4_K: fp16 d | fp16 dmin | 12 bytes scales | 128 bytes; x = (d*sc) * q - (dmin*mn)
            t = s % 8
            bb = wp + 144 * (s // 8)
            d = _f16at(bb, msub)
            dmin = _f16at(bb + 2, msub)
            sc, mn = _k4_scale_min(bb + 4, t, msub)
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            q = (_u8(bb + 16 + 32 * (t // 2) + i, mel) >> (4 * (t % 2))) & 15
            w = q.to(tl.float32) * dl - ml
        elif QTYPE == 13:  # Q5_K: as Q4_K with 32 bytes qh (bit t of qh[i]: 5th bit) before 128 bytes of nibbles
            t = s % 8
            bb = wp + 176 * (s // 8)
            d = _f16at(bb, msub)
            dmin = _f16at(bb + 2, msub)
            sc, mn = _k4_scale_min(bb + 4, t, msub)
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            hb = (_u8(bb + 16 + i, mel) >> t) & 1
            q = ((_u8(bb + 48 + 32 * (t // 2) + i, mel) >> (4 * (t % 2))) & 15) | (hb << 4)
            w = q.to(tl.float32) * dl - ml
        elif QTYPE == 14:  # Q6_K: 128 bytes ql | 64 bytes qh | 16 int8 scales | fp16 d; x = (d*sc) * (q - 32)
            t = s % 16  # group of 16 inside the super-block
            bb = wp + 210 * (s // 16)
            d = _f16at(bb + 208, msub)
            sc = (_u8(bb + 192 + t, msub) ^ 128) - 128
            dl = d * sc.to(tl.float32)
            w = _q6k_w(bb, t, i, mel, dl)
        elif QTYPE == 23:  # IQ4_XS: fp16 d | u16 scales_h | 4 bytes scales_l | 128 bytes; x = (d*(ls-32)) * kv[q]
            t = s % 8
            bb = wp + 136 * (s // 8)
            d = _f16at(bb, msub)
            sh = (_u8(bb + 2 + t // 4, msub) >> (2 * (t % 4))) & 3
            sl = (_u8(bb + 4 + t // 2, msub) >> (4 * (t % 2))) & 15
            dl = d * ((sl | (sh << 4)) - 32).to(tl.float32)
            q = (_u8(bb + 8 + 16 * t + (i % 16), mel) >> (4 * (i // 16))) & 15
            w = tl.load(kv_ptr + q) * dl
        else:
            tl.static_assert(False, "tkernels: unsupported ggml type")
        return tl.where(mel, w, 0.0)

    @triton.jit
    def _dequant_kernel(w_ptr, out_ptr, kv_ptr, n_rows, n_cols, row_stride,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = (rn < n_rows)[:, None, None]
        rn64 = rn.to(tl.int64)[:, None, None]
        wp = w_ptr + rn64 * row_stride
        k0 = pid_k * (NSUB * SUB)
        g = tl.arange(0, NSUB)[None, :, None]
        i = tl.arange(0, SUB)[None, None, :]
        msub = rmask & ((k0 + SUB * g) < n_cols)
        kel = k0 + SUB * g + i
        mel = rmask & (kel < n_cols)
        w = _decode(wp, msub, mel, k0, kv_ptr, QTYPE, NSUB, SUB)
        tl.store(out_ptr + rn64 * n_cols + kel, w, mask=mel)

    @triton.jit
    def _group_offset(off_ptr, grp, sel_ptr, n_sel, sel_stride, SELECT: tl.constexpr):
        """Byte offset (int64) of group ``grp``'s matrix: ``off[grp]``, or with ``SELECT`` a table lookup by
        selected id, ``off[sel[grp % n_sel] + (grp // n_sel) * sel_stride]`` (the router's top-k ids on the
        device index a table of per-expert offsets; ``sel_stride`` > 0 stacks several matrices' tables)."""
        if SELECT:
            idx = tl.load(sel_ptr + grp % n_sel).to(tl.int64) + (grp // n_sel).to(tl.int64) * sel_stride
            return tl.load(off_ptr + idx)
        return tl.load(off_ptr + grp)

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, off_ptr, tiles_ptr, src_ptr, out_ptr, kv_ptr, n_rows, row_bytes,
                       sel_ptr, n_sel, sel_stride,
                       n_cols: tl.constexpr, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       NSUB: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, GEMM: tl.constexpr,
                       SELECT: tl.constexpr):
        # program (tile, n block): tile = (group, first output row, row count <= BLOCK_M)
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        grp = tl.load(tiles_ptr + 3 * pid_t)
        p0 = tl.load(tiles_ptr + 3 * pid_t + 1)
        cnt = tl.load(tiles_ptr + 3 * pid_t + 2)
        base = w_ptr + _group_offset(off_ptr, grp, sel_ptr, n_sel, sel_stride, SELECT)  # int64 bytes
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < n_rows
        rmask = nmask[:, None, None]
        wp = base + rn.to(tl.int64)[:, None, None] * row_bytes
        rm = tl.arange(0, BLOCK_M)
        pmask = rm < cnt
        prow = p0 + rm
        g = tl.arange(0, NSUB)[None, :, None]
        i = tl.arange(0, SUB)[None, None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GEMM:
            src = tl.load(src_ptr + prow, mask=pmask, other=0).to(tl.int64)
            xrow = x_ptr + src * n_cols
            kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, n_cols, BLOCK_K):
            msub = rmask & ((k0 + SUB * g) < n_cols)
            kel = k0 + SUB * g + i
            kmask = kel < n_cols
            w = _decode(wp, msub, rmask & kmask, k0, kv_ptr, QTYPE, NSUB, SUB)  # [BN, NSUB, SUB]
            if GEMM:
                w2 = tl.reshape(w, [BLOCK_N, BLOCK_K])
                xk = k0 + kk
                xt = tl.load(xrow[:, None] + xk[None, :], mask=pmask[:, None] & (xk < n_cols)[None, :], other=0.0)
                acc = tl.dot(xt, tl.trans(w2), acc, input_precision="ieee")
            else:
                for m in tl.static_range(BLOCK_M):
                    src_m = tl.load(src_ptr + p0 + m, mask=m < cnt, other=0).to(tl.int64)
                    xm = tl.load(x_ptr + src_m * n_cols + kel, mask=kmask & (m < cnt), other=0.0)  # [1, NSUB, SUB]
                    part = tl.sum(tl.sum(w * xm, axis=2), axis=1)  # [BN]
                    acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
        optr = out_ptr + prow.to(tl.int64)[:, None] * n_rows + rn[None, :]
        tl.store(optr, acc, mask=pmask[:, None] & nmask[None, :])

    # --- GEMV path (m_hint <= 8) for the types in GEMV_TYPES: see the module docstring ---------------------

    @triton.jit
    def _pick(b, e, k, NB: tl.constexpr):
        """Little-endian ``NB``-byte integer (int32 >= 0, NB <= 2) starting at byte ``NB*k`` of the bytes ``b``
        [.., VW] (int32 0..255 along the last axis ``e``); keeps that axis as size 1. An integer sum over the
        vector axis: exact whatever the order."""
        sh = tl.where(e // NB == k, b << (8 * (e % NB)), 0)
        return tl.sum(sh, axis=2, keep_dims=True)

    @triton.jit
    def _gv_decode(wp, rmask, s, i0, e, n_cols, QTYPE: tl.constexpr, SUB: tl.constexpr, VW: tl.constexpr):
        """Weights ``SUB*s + i0 + e`` (float32 [BN, NSUB, VW], 0 where masked) of the rows at byte pointers
        ``wp`` [BN, 1, 1]: global sub-blocks ``s`` [1, NSUB, 1], first element ``i0`` (a multiple of VW),
        ``e`` = arange(VW) [1, 1, VW].

        Every load is a run of ``VW`` bytes at a multiple of ``VW`` in the block (given an aligned row), read into
        a [BN, NSUB, VW] tensor, so that the compiler gives all of them the layout of the x loads; fp16 fields and
        scale bytes are picked out of such runs with exact integer sums. The same arithmetic as :func:`_decode`
        (moestream.quant): the same float32 values.
        """
        msub = rmask & (SUB * s < n_cols)
        i = i0 + e
        mel = rmask & (SUB * s + i < n_cols)
        if QTYPE == 12:  # Q4_K (VW 4): fp16 d | fp16 dmin | 12 bytes scales | 128 bytes; x = (d*sc) * q - (dmin*mn)
            t = s % 8
            bb = wp + 144 * (s // 8)
            hdr = _u8(bb + e, msub)  # d, dmin
            d = _f16_bits_to_f32(_pick(hdr, e, 0, 2))
            dmin = _f16_bits_to_f32(_pick(hdr, e, 1, 2))
            b_t = _pick(_u8(bb + 4 + 4 * (t // 4) + e, msub), e, t % 4, 1)  # scale byte t
            b_t4 = _pick(_u8(bb + 8 + 4 * (t // 4) + e, msub), e, t % 4, 1)  # scale byte t + 4
            b_lo = _pick(_u8(bb + 4 + e, msub), e, t % 4, 1)  # scale byte t % 4
            lo = t < 4
            sc = tl.where(lo, b_t & 63, (b_t4 & 15) | ((b_lo >> 6) << 4))
            mn = tl.where(lo, b_t4 & 63, (b_t4 >> 4) | ((b_t >> 6) << 4))
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            q = (_u8(bb + 16 + 32 * (t // 2) + i, mel) >> (4 * (t % 2))) & 15
            w = q.to(tl.float32) * dl - ml
        elif QTYPE == 14:  # Q6_K (VW 2): 128 bytes ql | 64 bytes qh | 16 int8 scales | fp16 d; x = (d*sc) * (q - 32)
            t = s % 16
            bb = wp + 210 * (s // 16)
            d = _f16_bits_to_f32(_pick(_u8(bb + 208 + e, msub), e, 0, 2))
            sc = (_pick(_u8(bb + 192 + 2 * (t // 2) + e, msub), e, t % 2, 1) ^ 128) - 128
            dl = d * sc.to(tl.float32)
            w = _q6k_w(bb, t, i, mel, dl)
        elif QTYPE == 2:  # Q4_0 (VW 2): fp16 d | 16 bytes (element i: low nibble of byte i % 16 for i < 16, else high)
            bb = wp + 18 * s
            d = _f16_bits_to_f32(_pick(_u8(bb + e, msub), e, 0, 2))
            q = (_u8(bb + 2 + (i % 16), mel) >> (4 * (i // 16))) & 15
            w = (q - 8).to(tl.float32) * d
        elif QTYPE == 8:  # Q8_0 (VW 2): fp16 d | 32 int8; x = q * d
            bb = wp + 34 * s
            d = _f16_bits_to_f32(_pick(_u8(bb + e, msub), e, 0, 2))
            q = (_u8(bb + 2 + i, mel) ^ 128) - 128
            w = q.to(tl.float32) * d
        else:
            tl.static_assert(False, "tkernels: no GEMV decoder for this ggml type")
        return tl.where(mel, w, 0.0)

    @triton.jit
    def _pair_sum(a, R: tl.constexpr, LOGN: tl.constexpr):
        """float32 [R, 2**LOGN] -> [R]: the pairwise tree ``a[2j] + a[2j+1]``, level by level (LOGN levels).

        Element-wise adds in a fixed order, so the bits never depend on how the compiler lays the tensor out
        over threads (unlike a float ``tl.sum``)."""
        for lvl in tl.static_range(LOGN):
            lo, hi = tl.split(tl.reshape(a, [R, (1 << LOGN) >> (lvl + 1), 2]))
            a = lo + hi
        return tl.reshape(a, [R])

    @triton.jit
    def _gv_xrow(x_ptr, src_ptr, p0, cnt, m: tl.constexpr, n_cols: tl.constexpr, BLOCK_N: tl.constexpr,
                 LANE_MAJOR: tl.constexpr = False):
        """Row ``m`` of the tile: (x row pointers [BN, 1, 1] ([1, BN, 1] with ``LANE_MAJOR``), all the same, so that
        the x loads get the weight tile's shape and register layout: no shuffle between loads and products; whether
        the row exists)."""
        ok = m < cnt
        src = tl.load(src_ptr + p0 + m, mask=ok, other=0).to(tl.int64)
        if LANE_MAJOR:
            z = tl.zeros([1, BLOCK_N, 1], dtype=tl.int64)
        else:
            z = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int64)
        return x_ptr + src * n_cols + z, ok

    @triton.jit
    def _gv_acc(acc, w, xp, ok, kel, n_cols: tl.constexpr):
        """``acc + w * x[kel]`` (float32 [BN, NSUB, VW], one rounding each; x 0 where masked or ``ok`` false)."""
        return acc + w * tl.load(xp + kel, mask=ok & (kel < n_cols), other=0.0)

    @triton.jit
    def _gv_store(acc, out_ptr, prow, rn, nmask, ok, n_rows, BLOCK_N: tl.constexpr, LOG2_LANES: tl.constexpr):
        """Output row ``prow``: each weight row's lanes summed by :func:`_pair_sum`."""
        part = _pair_sum(tl.reshape(acc, [BLOCK_N, 1 << LOG2_LANES]), BLOCK_N, LOG2_LANES)
        tl.store(out_ptr + prow.to(tl.int64) * n_rows + rn, part, mask=nmask & ok)

    @triton.jit
    def _gv_tile(w_ptr, off_ptr, tiles_ptr, sel_ptr, n_sel, sel_stride, ALIGN: tl.constexpr, SELECT: tl.constexpr):
        """The GEMV program's tile (grid axis 1): (first output row, rows, its matrix's base pointer). The base is
        written as a multiple of ALIGN (the host checked the offsets) so that the compiler sees the alignment."""
        pid_t = tl.program_id(1)
        grp = tl.load(tiles_ptr + 3 * pid_t)
        p0 = tl.load(tiles_ptr + 3 * pid_t + 1)
        cnt = tl.load(tiles_ptr + 3 * pid_t + 2)
        off = _group_offset(off_ptr, grp, sel_ptr, n_sel, sel_stride, SELECT)
        return p0, cnt, w_ptr + (off // ALIGN) * ALIGN

    @triton.jit
    def _gv_xrows(x_ptr, src_ptr, p0, cnt, n_cols: tl.constexpr, BLOCK_N: tl.constexpr,
                  LANE_MAJOR: tl.constexpr = False):
        """:func:`_gv_xrow` for the 8 rows of a tile: 8 pointers, then 8 flags (rows past ``cnt``: unused)."""
        xp0, ok0 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 0, n_cols, BLOCK_N, LANE_MAJOR)
        xp1, ok1 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 1, n_cols, BLOCK_N, LANE_MAJOR)
        xp2, ok2 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 2, n_cols, BLOCK_N, LANE_MAJOR)
        xp3, ok3 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 3, n_cols, BLOCK_N, LANE_MAJOR)
        xp4, ok4 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 4, n_cols, BLOCK_N, LANE_MAJOR)
        xp5, ok5 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 5, n_cols, BLOCK_N, LANE_MAJOR)
        xp6, ok6 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 6, n_cols, BLOCK_N, LANE_MAJOR)
        xp7, ok7 = _gv_xrow(x_ptr, src_ptr, p0, cnt, 7, n_cols, BLOCK_N, LANE_MAJOR)
        return xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7

    @triton.jit
    def _gv_store8(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7,
                   out_ptr, p0, rn, nmask, n_rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   LOG2_LANES: tl.constexpr):
        """:func:`_gv_store` of the tile's first ``BLOCK_M`` rows."""
        _gv_store(acc0, out_ptr, p0, rn, nmask, ok0, n_rows, BLOCK_N, LOG2_LANES)
        if BLOCK_M > 1:
            _gv_store(acc1, out_ptr, p0 + 1, rn, nmask, ok1, n_rows, BLOCK_N, LOG2_LANES)
        if BLOCK_M > 2:
            _gv_store(acc2, out_ptr, p0 + 2, rn, nmask, ok2, n_rows, BLOCK_N, LOG2_LANES)
            _gv_store(acc3, out_ptr, p0 + 3, rn, nmask, ok3, n_rows, BLOCK_N, LOG2_LANES)
        if BLOCK_M > 4:
            _gv_store(acc4, out_ptr, p0 + 4, rn, nmask, ok4, n_rows, BLOCK_N, LOG2_LANES)
            _gv_store(acc5, out_ptr, p0 + 5, rn, nmask, ok5, n_rows, BLOCK_N, LOG2_LANES)
            _gv_store(acc6, out_ptr, p0 + 6, rn, nmask, ok6, n_rows, BLOCK_N, LOG2_LANES)
            _gv_store(acc7, out_ptr, p0 + 7, rn, nmask, ok7, n_rows, BLOCK_N, LOG2_LANES)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, off_ptr, tiles_ptr, src_ptr, out_ptr, n_rows, row_units,
                     sel_ptr, n_sel, sel_stride, n_cols: tl.constexpr, QTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                     VW: tl.constexpr, LOG2_LANES: tl.constexpr,
                     ALIGN: tl.constexpr, UNROLL: tl.constexpr, SELECT: tl.constexpr):
        # program (tile, n block) as in _matmul_kernel. row_units = row_bytes // ALIGN and every group offset a
        # multiple of ALIGN (the host checked both), written so that the compiler sees the alignment. The x rows
        # of the tile (BLOCK_M <= 8) have one accumulator each (acc0 .. acc7; the unused ones compile away).
        # Row blocks on grid axis 0 (up to 2**31 - 1 of them: an LM head at one row per program), tiles on axis 1.
        pid_n = tl.program_id(0)
        p0, cnt, base = _gv_tile(w_ptr, off_ptr, tiles_ptr, sel_ptr, n_sel, sel_stride, ALIGN, SELECT)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < n_rows
        rmask = nmask[:, None, None]
        wp = base + rn.to(tl.int64)[:, None, None] * (row_units.to(tl.int64) * ALIGN)  # [BN, 1, 1]
        g = tl.arange(0, NSUB)[None, :, None]
        e = tl.arange(0, VW)[None, None, :]
        xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7 = _gv_xrows(
            x_ptr, src_ptr, p0, cnt, n_cols, BLOCK_N)
        # lane (n, g, e) of row m accumulates x[m, k] * w[n, k] for k = k0 + SUB*g + VW*j + e, in the order of
        # (k0 = 0, NSUB*SUB, ...; j = 0 .. SUB/VW - 1); float32, one rounding per product and per addition
        acc0 = tl.zeros([BLOCK_N, NSUB, VW], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        acc4 = acc0
        acc5 = acc0
        acc6 = acc0
        acc7 = acc0
        for kb in range(0, n_cols, UNROLL * NSUB * SUB):
            for u in tl.static_range(UNROLL):
                s = (kb + u * NSUB * SUB) // SUB + g  # global sub-block index [1, NSUB, 1]
                for j in tl.static_range(SUB // VW):
                    w = _gv_decode(wp, rmask, s, VW * j, e, n_cols, QTYPE, SUB, VW)  # [BN, NSUB, VW]
                    kel = SUB * s + VW * j + e
                    acc0 = _gv_acc(acc0, w, xp0, ok0, kel, n_cols)
                    if BLOCK_M > 1:
                        acc1 = _gv_acc(acc1, w, xp1, ok1, kel, n_cols)
                    if BLOCK_M > 2:
                        acc2 = _gv_acc(acc2, w, xp2, ok2, kel, n_cols)
                        acc3 = _gv_acc(acc3, w, xp3, ok3, kel, n_cols)
                    if BLOCK_M > 4:
                        acc4 = _gv_acc(acc4, w, xp4, ok4, kel, n_cols)
                        acc5 = _gv_acc(acc5, w, xp5, ok5, kel, n_cols)
                        acc6 = _gv_acc(acc6, w, xp6, ok6, kel, n_cols)
                        acc7 = _gv_acc(acc7, w, xp7, ok7, kel, n_cols)
        _gv_store8(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7,
                   out_ptr, p0, rn, nmask, n_rows, BLOCK_M, BLOCK_N, LOG2_LANES)

    @triton.jit
    def _w32(p, ALIGN: tl.constexpr):
        """Little-endian 32-bit word (uint32) at byte pointer(s) ``p``, unmasked: one 32-bit load where ``ALIGN`` is a
        multiple of 4, two 16-bit loads where it is 2, four bytes otherwise (the caller guarantees that ``p`` is a
        multiple of ``ALIGN``). The same value whatever the alignment."""
        if ALIGN % 4 == 0:
            wv = tl.load(p.to(tl.pointer_type(tl.uint32)))
        elif ALIGN % 2 == 0:
            p16 = p.to(tl.pointer_type(tl.uint16))
            wv = tl.load(p16).to(tl.uint32) | (tl.load(p16 + 1).to(tl.uint32) << 16)
        else:
            wv = (tl.load(p).to(tl.uint32) | (tl.load(p + 1).to(tl.uint32) << 8)
                  | (tl.load(p + 2).to(tl.uint32) << 16) | (tl.load(p + 3).to(tl.uint32) << 24))
        return wv

    @triton.jit
    def _w16(p, ALIGN: tl.constexpr):
        """Little-endian 16-bit word (uint32 0..65535) at byte pointer(s) ``p``, unmasked (as :func:`_w32`)."""
        if ALIGN % 2 == 0:
            wv = tl.load(p.to(tl.pointer_type(tl.uint16))).to(tl.uint32)
        else:
            wv = tl.load(p).to(tl.uint32) | (tl.load(p + 1).to(tl.uint32) << 8)
        return wv

    @triton.jit
    def _f16w(h):
        """fp16 bit patterns (uint32 0..65535) to float32 with the hardware conversion: exact for every finite,
        subnormal and infinite value (a NaN scale stays NaN; its payload may differ from numpy's)."""
        return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k4_sm_w(sp, t, ALIGN: tl.constexpr):
        """:func:`_k4_scale_min` from the 12-byte table at ``sp`` read as three words (``t`` 0..7)."""
        w0 = _w32(sp, ALIGN)
        w1 = _w32(sp + 4, ALIGN)
        w2 = _w32(sp + 8, ALIGN)
        sh = (8 * (t % 4)).to(tl.uint32)
        b_t = (tl.where(t < 4, w0, w1) >> sh) & 0xFF  # byte t
        b_t4 = (tl.where(t < 4, w1, w2) >> sh) & 0xFF  # byte t + 4
        b_lo = (w0 >> sh) & 0xFF  # byte t % 4
        lo = t < 4
        sc = tl.where(lo, b_t & 63, (b_t4 & 15) | ((b_lo >> 6) << 4))
        mn = tl.where(lo, b_t4 & 63, (b_t4 >> 4) | ((b_t >> 6) << 4))
        return sc.to(tl.int32), mn.to(tl.int32)

    @triton.jit
    def _gv2_acc(acc, w, xp, kel):
        """``acc + w * x[kel]`` (float32, one rounding each), unmasked (``kel`` < n_cols; a missing x row reads
        row 0 and is never stored)."""
        return acc + w * tl.load(xp + kel)

    @triton.jit
    def _gv_bytes_f(packed, e, bias, magic0):
        """float32 ``b - bias`` for byte ``b`` (< 64) number ``e`` (arange [1, 1, 4]) of the words ``packed`` [.., 1]
        (uint32); [.., 4]. Exact, without int-to-float conversions: byte ``e <= 2`` is kept in place and ORed into
        the mantissa of ``M = 2**(23 - 8e)`` (the float ``M + b``), byte 3 is first shifted down one byte and
        treated as byte 2; then ``(M + b) - (M + bias)`` (one exact float subtraction). ``magic0``: 0x4B000000, the
        bits of 2**23, a run-time argument so that the compiler keeps it in a register and fuses mask and OR into
        one LOP3."""
        m = tl.minimum(e, 2)
        magic = magic0 - (m << 26)  # float bits of 2**(23 - 8m)
        t = (packed >> (8 * (e - m)).to(tl.uint32)) & (0x3F << (8 * m)).to(tl.uint32)
        mf = magic.to(tl.float32, bitcast=True)
        return (t | magic.to(tl.uint32)).to(tl.float32, bitcast=True) - (mf + bias)

    @triton.jit
    def _gv2_acc8(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel,
                  BLOCK_M: tl.constexpr):
        """:func:`_gv2_acc` for the tile's first ``BLOCK_M`` x rows (the others returned as they are)."""
        acc0 = _gv2_acc(acc0, w, xp0, kel)
        if BLOCK_M > 1:
            acc1 = _gv2_acc(acc1, w, xp1, kel)
        if BLOCK_M > 2:
            acc2 = _gv2_acc(acc2, w, xp2, kel)
            acc3 = _gv2_acc(acc3, w, xp3, kel)
        if BLOCK_M > 4:
            acc4 = _gv2_acc(acc4, w, xp4, kel)
            acc5 = _gv2_acc(acc5, w, xp5, kel)
            acc6 = _gv2_acc(acc6, w, xp6, kel)
            acc7 = _gv2_acc(acc7, w, xp7, kel)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    @triton.jit
    def _gv2_acc8m(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel,
                   ok, BLOCK_M: tl.constexpr):
        """:func:`_gv2_acc8` with x read as 0.0 where ``ok`` is false (a ragged K step's lanes past the row, whose
        ``kel`` lies past it and whose ``w`` is +-0: they add +-0.0 to an accumulator that is never -0.0)."""
        acc0 = acc0 + w * tl.load(xp0 + kel, mask=ok, other=0.0)
        if BLOCK_M > 1:
            acc1 = acc1 + w * tl.load(xp1 + kel, mask=ok, other=0.0)
        if BLOCK_M > 2:
            acc2 = acc2 + w * tl.load(xp2 + kel, mask=ok, other=0.0)
            acc3 = acc3 + w * tl.load(xp3 + kel, mask=ok, other=0.0)
        if BLOCK_M > 4:
            acc4 = acc4 + w * tl.load(xp4 + kel, mask=ok, other=0.0)
            acc5 = acc5 + w * tl.load(xp5 + kel, mask=ok, other=0.0)
            acc6 = acc6 + w * tl.load(xp6 + kel, mask=ok, other=0.0)
            acc7 = acc7 + w * tl.load(xp7 + kel, mask=ok, other=0.0)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    @triton.jit
    def _gv_field_f(word, p, MASK: tl.constexpr, FLIP: tl.constexpr, BIAS: tl.constexpr, magic0):
        """float32 ``(f ^ FLIP) - BIAS`` for the bit field ``f = (word >> p) & MASK`` of ``word`` (uint32 < 2**16), in
        place: ``p`` (int32, + ``MASK``'s width at most 16) per element. Exact, without int-to-float conversions or
        shifts: the field is ANDed out where it lies and XORed with the bits of ``M = 2**(23 - p)`` (and ``FLIP``) in
        one LOP3, the float ``M + (f ^ FLIP)``; then ``- (M + BIAS)``, one exact float subtraction. ``magic0``: as in
        :func:`_gv_bytes_f` (0x4B000000, for the LOP3's register operand); ``M + BIAS`` is built from the literal, so
        that it folds into the subtraction's immediate."""
        # the float bits of 2**(23 - p) (its mantissa's unit is 2**-p) with FLIP in the field: an add, which the
        # compiler keeps in a register (an OR of magic0 and a constant it folds into the LOP3, as a second one)
        km = magic0 + ((FLIP << p) - (p << 23))
        t = (word & (MASK << p).to(tl.uint32)) ^ km.to(tl.uint32)
        mf = (0x4B000000 - (p << 23)).to(tl.float32, bitcast=True)
        return t.to(tl.float32, bitcast=True) - (mf + BIAS)

    @triton.jit
    def _b32_block(wp, b, n_cols: tl.constexpr, QTYPE: tl.constexpr, ALIGN: tl.constexpr, RAGGED: tl.constexpr):
        """Block ``b`` of Q4_0 (fp16 d | 16 bytes) / Q8_0 (fp16 d | 32 int8) rows at byte pointers ``wp``: (whether
        ``b`` lies in the row, the block's byte pointers, its d as float32). ``RAGGED``: a ``b`` past the row reads
        the row's last block with d = 0 (its weights +-0); else every ``b`` is in the row."""
        N_B: tl.constexpr = n_cols // 32
        if RAGGED:
            ok = b < N_B
            bc = tl.minimum(b, N_B - 1)
        else:
            ok = True
            bc = b
        bb = wp + (18 if QTYPE == 2 else 34) * bc
        d = _f16w(_w16(bb, ALIGN))
        if RAGGED:
            d = tl.where(ok, d, 0.0)
        return ok, bb, d

    @triton.jit
    def _gv2_b32_step(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7,
                      wp, b, li, e, magic0, n_cols: tl.constexpr, QTYPE: tl.constexpr, LPB: tl.constexpr,
                      ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, RAGGED: tl.constexpr):
        """One K step of _gemv2_kernel on Q4_0 / Q8_0 rows (byte pointers ``wp`` [1, BN, 1]): lane ``li`` (of LPB) of
        block ``b`` [LANES, 1, 1] reads the block's fp16 d and its ``QB = 16 / LPB`` (Q4_0) or ``32 / LPB`` (Q8_0)
        quant bytes from ``QB li`` as 16-bit words, two per run of 4 bytes (elements ``e`` 0, 1 from the first, 2, 3
        from the second), and adds ``w * x`` to the accumulators: Q4_0, for each run r, the low nibbles (elements
        ``QB li + 4 r + e``), then the high ones (the same + 16), ``w = (q - 8) * d``; Q8_0, elements ``QB li + 4 r +
        e``, ``w = q * d``. ``RAGGED``: lanes with ``b`` past the row read its last block with d = 0 (w = +-0) and x
        as 0.0 (no change; module docstring)."""
        # Q4_0: element i < 16 is the low nibble of quant byte i, 16 + i its high nibble
        QB: tl.constexpr = (16 if QTYPE == 2 else 32) // LPB
        ok, bb, d = _b32_block(wp, b, n_cols, QTYPE, ALIGN, RAGGED)  # d [LANES, BN, 1]
        k0 = 32 * b + QB * li
        qp = bb + 2 + QB * li
        pe = 8 * (e % 2)  # where byte e lies in its 16-bit word
        for r in tl.static_range(QB // 4):
            h = tl.where(e < 2, _w16(qp + 4 * r, ALIGN), _w16(qp + 4 * r + 2, ALIGN))  # [LANES, BN, 4]
            for half in tl.static_range(2 if QTYPE == 2 else 1):
                if QTYPE == 2:  # the low nibbles (half 0), then the high ones: q - 8
                    w = _gv_field_f(h, pe + 4 * half, 0xF, 0, 8.0, magic0) * d
                else:  # (q + 128) - 128: the int8 q
                    w = _gv_field_f(h, pe, 0xFF, 0x80, 128.0, magic0) * d
                kel = k0 + 16 * half + 4 * r + e
                if RAGGED:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8m(
                        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w,
                        xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel, ok, BLOCK_M)
                else:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8(
                        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w,
                        xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel, BLOCK_M)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    # --- GEMV path, lane kernel (_gemv2_kernel: Q4_K, Q6_K, Q4_0, Q8_0; GEMV2_TYPES): see the module docstring -----

    @triton.jit
    def _gemv2_kernel(x_ptr, w_ptr, off_ptr, tiles_ptr, src_ptr, out_ptr, n_rows, row_units,
                      sel_ptr, n_sel, sel_stride, magic0, n_cols: tl.constexpr, QTYPE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, LPB: tl.constexpr,
                      VW: tl.constexpr, LOG2_LANES: tl.constexpr, ALIGN: tl.constexpr, SELECT: tl.constexpr):
        # program (tile, n block) as in _gemv_kernel. A weight row has LANES threads: KS = LANES / LPB
        # blocks side by side, LPB lanes each (Q4_K: 8 lanes of 16 quant bytes = 32 weights of 2 sub-blocks;
        # Q6_K: 16 lanes of 4 ql + 4 ql + 4 qh bytes = 16 weights of 4 groups; Q4_0 / Q8_0 at LPB 1: one lane of 16 /
        # 32 quant bytes = the block's 32 weights). A lane decodes its block's header (fp16 scales, sub-block scales)
        # once per K step and then only its quant bytes, VW at a time;
        # every tensor is [LANES, BLOCK_N, VW] (or [.., 1] broadcast), one register layout, no shuffles.
        pid_n = tl.program_id(0)
        p0, cnt, base = _gv_tile(w_ptr, off_ptr, tiles_ptr, sel_ptr, n_sel, sel_stride, ALIGN, SELECT)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < n_rows
        # rows past the matrix read its last row (never stored): no masked loads in the K loop
        rc = tl.minimum(rn, n_rows - 1)
        # tensors are [LANES, BLOCK_N, VW], lanes first: the compiler orders threads by the first dimension when no
        # dimension of a load is contiguous (the weight words), so a warp's threads take neighbouring lanes of a row
        # (its loads touch few cache lines), not the same lane of many rows
        wp = base + rc.to(tl.int64)[None, :, None] * (row_units.to(tl.int64) * ALIGN)  # [1, BN, 1]
        g = tl.arange(0, LANES)[:, None, None]
        e = tl.arange(0, VW)[None, None, :]
        c = g // LPB  # super-block of the lane within a K step
        li = g % LPB  # lane within the super-block
        xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7 = _gv_xrows(
            x_ptr, src_ptr, p0, cnt, n_cols, BLOCK_N, True)
        acc0 = tl.zeros([LANES, BLOCK_N, VW], dtype=tl.float32)  # one per x row of the tile (unused ones vanish)
        acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
        KS: tl.constexpr = LANES // LPB
        if QTYPE == 2 or QTYPE == 8:  # blocks of 32: KS per K step, the last step ragged where KS does not divide
            N_B: tl.constexpr = n_cols // 32
            N_FULL: tl.constexpr = N_B // KS * KS
            for kb in range(0, N_FULL, KS):
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_b32_step(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7,
                    wp, kb + c, li, e, magic0, n_cols, QTYPE, LPB, ALIGN, BLOCK_M, False)
            if N_FULL < N_B:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_b32_step(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7,
                    wp, N_FULL + c, li, e, magic0, n_cols, QTYPE, LPB, ALIGN, BLOCK_M, True)
        else:  # super-blocks of 256: KS of them per K step, always a divisor of the row's
            N_SB: tl.constexpr = n_cols // 256
            tl.static_assert(N_SB % KS == 0, "_gemv2_kernel: KS must divide the super-blocks of a row")
            for kb in range(0, N_SB, KS):
                sb = kb + c  # super-block [LANES, 1, 1], always < N_SB: no masks
                if QTYPE == 12:  # Q4_K: fp16 d | fp16 dmin | 12 bytes scales | 128 bytes; x = (d*sc) * q - (dmin*mn)
                    # lane li: the B = 128 / LPB quant bytes from 32 p + o = B li (p = B li // 32) as B / 4 words:
                    # the low nibbles are elements 64 p + o + (0..B-1) (sub-block 2p), the high ones the same + 32
                    # (sub-block 2p+1)
                    BPL: tl.constexpr = 128 // LPB
                    bb = wp + 144 * sb
                    p = li // (32 // BPL)
                    dd = _w32(bb, ALIGN)  # fp16 d | fp16 dmin
                    d = _f16w(dd & 0xFFFF)
                    dmin = _f16w(dd >> 16)
                    sc0, mn0 = _k4_sm_w(bb + 4, 2 * p, ALIGN)
                    sc1, mn1 = _k4_sm_w(bb + 4, 2 * p + 1, ALIGN)
                    dl0 = d * sc0.to(tl.float32)
                    ml0 = dmin * mn0.to(tl.float32)
                    dl1 = d * sc1.to(tl.float32)
                    ml1 = dmin * mn1.to(tl.float32)
                    k0 = 256 * sb + 64 * p + BPL * (li % (32 // BPL))  # (a form whose divisibility the compiler sees)
                    for r in tl.static_range(BPL // 4):
                        word = _w32(bb + 16 + BPL * li + 4 * r, ALIGN)  # [LANES, BN, 1]
                        lo = word & 0x0F0F0F0F
                        hi = (word >> 4) & 0x0F0F0F0F
                        w_lo = _gv_bytes_f(lo, e, 0.0, magic0) * dl0 - ml0
                        w_hi = _gv_bytes_f(hi, e, 0.0, magic0) * dl1 - ml1
                        for half in tl.static_range(2):
                            if half == 0:
                                w = w_lo
                            else:
                                w = w_hi
                            kel = k0 + 32 * half + 4 * r + e
                            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8(
                                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w,
                                xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel, BLOCK_M)
                else:  # Q6_K (14): 128 bytes ql | 64 bytes qh | 16 int8 scales | fp16 d; x = (d*sc) * (q - 32)
                    # lane li: half h = li // (LPB / 2) of the super-block, l = R (li % (LPB / 2)) (R = 64 / LPB
                    # elements): elements 128 h + 32 q + l + (0..R-1) (q = 0..3) from ql[64 h + 32 (q % 2) + l + i]
                    # (nibble q // 2) and qh[32 h + l + i] (bits 2q, 2q+1), scale sc[8 h + 2 q + l // 16]; words of 4
                    # elements
                    RL: tl.constexpr = 64 // LPB
                    bb = wp + 210 * sb
                    h = li // (LPB // 2)
                    l8 = RL * (li % (LPB // 2))
                    d = _f16w(_w16(bb + 208, ALIGN))
                    sp = bb + 192 + 8 * h + l8 // 16
                    dl0 = d * ((tl.load(sp).to(tl.int32) ^ 128) - 128).to(tl.float32)
                    dl1 = d * ((tl.load(sp + 2).to(tl.int32) ^ 128) - 128).to(tl.float32)
                    dl2 = d * ((tl.load(sp + 4).to(tl.int32) ^ 128) - 128).to(tl.float32)
                    dl3 = d * ((tl.load(sp + 6).to(tl.int32) ^ 128) - 128).to(tl.float32)
                    k0 = 256 * sb + 128 * h + l8
                    for v in tl.static_range(RL // 4):
                        qa = _w32(bb + 64 * h + l8 + 4 * v, ALIGN)  # [LANES, BN, 1]
                        qb = _w32(bb + 64 * h + 32 + l8 + 4 * v, ALIGN)
                        qh = _w32(bb + 128 + 32 * h + l8 + 4 * v, ALIGN)
                        for q in tl.static_range(4):
                            # the bytes of 6-bit quants q, then q - 32 as float32 (exact)
                            if q == 0:
                                packed = (qa & 0x0F0F0F0F) | ((qh << 4) & 0x30303030)
                                dl = dl0
                            elif q == 1:
                                packed = (qb & 0x0F0F0F0F) | ((qh << 2) & 0x30303030)
                                dl = dl1
                            elif q == 2:
                                packed = ((qa >> 4) & 0x0F0F0F0F) | (qh & 0x30303030)
                                dl = dl2
                            else:
                                packed = ((qb >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030)
                                dl = dl3
                            w = _gv_bytes_f(packed, e, 32.0, magic0) * dl
                            kel = k0 + 32 * q + 4 * v + e
                            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8(
                                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w,
                                xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, kel, BLOCK_M)
        _gv_store8(tl.permute(acc0, (1, 0, 2)), tl.permute(acc1, (1, 0, 2)), tl.permute(acc2, (1, 0, 2)),
                   tl.permute(acc3, (1, 0, 2)), tl.permute(acc4, (1, 0, 2)), tl.permute(acc5, (1, 0, 2)),
                   tl.permute(acc6, (1, 0, 2)), tl.permute(acc7, (1, 0, 2)), ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7,
                   out_ptr, p0, rn, nmask, n_rows, BLOCK_M, BLOCK_N, LOG2_LANES)


    # --- GEMV path, blocks of 32 (_gemv32_kernel: Q4_0, Q8_0): lanes along a row's bytes --------------------------

    @triton.jit
    def _g32_xrow(x_ptr, src_ptr, p0, cnt, m: tl.constexpr, n_cols: tl.constexpr, BLOCK_N: tl.constexpr):
        """Row ``m`` of the tile: (pointers [BN, 1, 1] to its x row, all the same, so that the x loads get the weight
        tile's shape and register layout (no shuffle through shared memory); whether the row exists: a missing
        row reads x row 0 and is never stored)."""
        ok = m < cnt
        src = tl.load(src_ptr + p0 + m, mask=ok, other=0).to(tl.int64)
        return x_ptr + src * n_cols + tl.zeros([BLOCK_N, 1, 1], dtype=tl.int64), ok

    @triton.jit
    def _g32_step(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                  wp, b, li, e, magic0, n_cols: tl.constexpr, QTYPE: tl.constexpr, VW: tl.constexpr,
                  ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, RAGGED: tl.constexpr):
        """One K step of _gemv32_kernel: lane ``li`` of block ``b`` ([1, LANES, 1]) of each weight row (byte
        pointers ``wp`` [BN, 1, 1]) reads the block's fp16 d and its ``VW`` quant bytes from ``VW li`` (``VW / 2``
        16-bit loads; element ``e`` < VW of the [BN, LANES, VW] tensors is byte ``VW li + e``) and adds ``w * x``
        to the accumulators: Q4_0, the low nibbles (elements ``VW li + e``) then the high ones (``16 + VW li +
        e``), ``w = (q - 8) d``; Q8_0, elements ``VW li + e``, ``w = q d``. The weight is exactly moestream.quant's
        (a 4- or 8-bit integer times an fp16: exact in float32). ``RAGGED``: lanes with ``b`` past the row read its
        last block with d = 0 and x as 0.0."""
        ok, bb, d = _b32_block(wp, b, n_cols, QTYPE, ALIGN, RAGGED)  # d [BN, LANES, 1]
        qp = bb + 2 + VW * li
        if VW == 2:
            h = _w16(qp, ALIGN)  # [BN, LANES, 1]: bytes VW li (low half), VW li + 1
        else:  # VW 4: two words, bytes e = 0, 1 from the first, 2, 3 from the second
            h = tl.where(e < 2, _w16(qp, ALIGN), _w16(qp + 2, ALIGN))  # [BN, LANES, 4]
        pe = 8 * (e % 2)  # where byte e lies in its word
        for half in tl.static_range(2 if QTYPE == 2 else 1):
            if QTYPE == 2:
                w = _gv_field_f(h, pe + 4 * half, 0xF, 0, 8.0, magic0) * d  # [BN, LANES, VW]
            else:
                w = _gv_field_f(h, pe, 0xFF, 0x80, 128.0, magic0) * d
            kel = 32 * b + 16 * half + VW * li + e  # [1, LANES, VW]
            if RAGGED:  # x 0.0 for the lanes past the row (w is +-0 there)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8m(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                    kel, ok, BLOCK_M)
            else:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gv2_acc8(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                    kel, BLOCK_M)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    @triton.jit
    def _gemv32_kernel(x_ptr, w_ptr, off_ptr, tiles_ptr, src_ptr, out_ptr, n_rows, row_units,
                       sel_ptr, n_sel, sel_stride, magic0, n_cols: tl.constexpr, QTYPE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VW: tl.constexpr, U: tl.constexpr,
                       ALIGN: tl.constexpr, SELECT: tl.constexpr):
        # program (tile, n block) as in _gemv_kernel; BLOCK_N weight rows, each read by LANES = 32 lanes: KS = 32 /
        # LPB blocks side by side per K step, LPB lanes per block (VW quant bytes each); U K steps per loop
        # iteration (straight-line code: their loads issue together), the steps past the last whole iteration
        # unrolled, a ragged last step where KS does not divide the row's blocks. Tensors [BN, LANES, VW]: lanes
        # along a row's bytes (a warp's weight loads on one or two cache lines, its x loads contiguous runs).
        LANES: tl.constexpr = 32
        LPB: tl.constexpr = (16 if QTYPE == 2 else 32) // VW
        KS: tl.constexpr = LANES // LPB
        pid_n = tl.program_id(0)
        p0, cnt, base = _gv_tile(w_ptr, off_ptr, tiles_ptr, sel_ptr, n_sel, sel_stride, ALIGN, SELECT)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < n_rows
        rc = tl.minimum(rn, n_rows - 1)  # rows past the matrix read its last row (never stored)
        wp = base + rc.to(tl.int64)[:, None, None] * (row_units.to(tl.int64) * ALIGN)  # [BN, 1, 1]
        lane = tl.arange(0, LANES)[None, :, None]
        c = lane // LPB  # block of the lane within a K step
        li = lane % LPB  # quant word of the lane within its block
        e = tl.arange(0, VW)[None, None, :]
        xr0, ok0 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 0, n_cols, BLOCK_N)
        xr1, ok1 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 1, n_cols, BLOCK_N)
        xr2, ok2 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 2, n_cols, BLOCK_N)
        xr3, ok3 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 3, n_cols, BLOCK_N)
        xr4, ok4 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 4, n_cols, BLOCK_N)
        xr5, ok5 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 5, n_cols, BLOCK_N)
        xr6, ok6 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 6, n_cols, BLOCK_N)
        xr7, ok7 = _g32_xrow(x_ptr, src_ptr, p0, cnt, 7, n_cols, BLOCK_N)
        acc0 = tl.zeros([BLOCK_N, LANES, VW], dtype=tl.float32)  # one per x row of the tile (unused ones vanish)
        acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
        N_B: tl.constexpr = n_cols // 32
        N_FULL: tl.constexpr = N_B // KS  # whole K steps
        N_LOOP: tl.constexpr = N_FULL // U * U
        for s0 in range(0, N_LOOP, U):
            for u in tl.static_range(U):
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _g32_step(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                    wp, (s0 + u) * KS + c, li, e, magic0, n_cols, QTYPE, VW, ALIGN, BLOCK_M, False)
        for s in tl.static_range(N_LOOP, N_FULL):
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _g32_step(
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                wp, s * KS + c, li, e, magic0, n_cols, QTYPE, VW, ALIGN, BLOCK_M, False)
        if N_FULL * KS < N_B:
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _g32_step(
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xr0, xr1, xr2, xr3, xr4, xr5, xr6, xr7,
                wp, N_FULL * KS + c, li, e, magic0, n_cols, QTYPE, VW, ALIGN, BLOCK_M, True)
        _gv_store8(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, ok0, ok1, ok2, ok3, ok4, ok5, ok6, ok7,
                   out_ptr, p0, rn, nmask, n_rows, BLOCK_M, BLOCK_N, 5 + VW // 2)


# ---------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------

_KV: dict[torch.device, torch.Tensor] = {}


def _kv(device: torch.device) -> torch.Tensor:
    t = _KV.get(device)
    if t is None:
        t = _KV[device] = torch.tensor(_IQ4NL_VALUES, dtype=torch.float32, device=device)
    return t


def _label(ggml_type: int) -> str:
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"ggml type {int(ggml_type)}"


def _check(ggml_type: int, n_cols: int, where: str) -> tuple[int, int]:
    """(block_size, type_size) after validating the type and n_cols."""
    if triton is None:
        raise RuntimeError(f"tkernels.{where}: triton is not installed")
    if not computes(ggml_type, n_cols):
        if int(ggml_type) not in TYPES:
            names = ", ".join(sorted(T(t).name for t in TYPES))
            raise ValueError(f"tkernels.{where}: {_label(ggml_type)} is not computed (types: {names})")
        raise ValueError(f"tkernels.{where}: n_cols={n_cols} is not a positive multiple of the "
                         f"{_label(ggml_type)} block size {GGML_QUANT_SIZES[T(int(ggml_type))][0]}")
    return GGML_QUANT_SIZES[T(int(ggml_type))]


def _row_bytes(ggml_type: int, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[T(int(ggml_type))]
    return n_cols // block * size


def dequantize(raw: torch.Tensor, ggml_type: int, n_cols: int) -> torch.Tensor:
    """Decode ggml rows to float32 with the kernels' own decoders.

    Args:
        raw: uint8 ``[rows, row_bytes]`` (rows may have any stride, bytes within a row contiguous; any byte
            alignment), on CUDA (or CPU under ``TRITON_INTERPRET=1``). Block layouts: ggml-common.h.
        ggml_type: a number in :data:`TYPES`.
        n_cols: elements per row, a multiple of the type's block size.

    Returns:
        float32 ``[rows, n_cols]`` on ``raw.device``, bit-identical to :func:`moestream.quant.dequantize`
        (F32/F16/BF16 NaN payloads included); the one exemption is a block whose fp16 *scale* is NaN
        (the result is NaN either way, the payload may differ).

    Raises:
        ValueError: type not computed, ``n_cols`` not a multiple of the block size, or bad ``raw`` shape.
        TypeError: ``raw`` is not uint8.
    """
    _check(ggml_type, n_cols, "dequantize")
    if raw.dtype != torch.uint8:
        raise TypeError(f"tkernels.dequantize: raw must be uint8, got {raw.dtype}")
    nb = _row_bytes(ggml_type, n_cols)
    if raw.dim() != 2 or raw.shape[1] != nb:
        raise ValueError(f"tkernels.dequantize({_label(ggml_type)}, n_cols={n_cols}): raw shape "
                         f"{tuple(raw.shape)} must be [rows, {nb}]")
    if raw.stride(1) != 1:
        raw = raw.contiguous()
    rows = raw.shape[0]
    out = torch.empty((rows, n_cols), dtype=torch.float32, device=raw.device)
    if rows == 0:
        return out
    sub = _sub(ggml_type)
    bn, nsub = 16, 256 // sub
    grid = (triton.cdiv(rows, bn), triton.cdiv(n_cols, nsub * sub))
    _dequant_kernel[grid](raw, out, _kv(raw.device), rows, n_cols, raw.stride(0) if rows > 1 else nb,
                          QTYPE=int(ggml_type), BLOCK_N=bn, NSUB=nsub, SUB=sub,
                          num_warps=4, enable_fp_fusion=False)
    return out


def _as_tensor(v: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu" and device.type == "cuda":
            return _upload(v.to(dtype).numpy(), device)
        return v.to(device=device, dtype=dtype).contiguous()
    return _upload(np.ascontiguousarray(v, dtype=torch.empty(0, dtype=dtype).numpy().dtype), device)


def _upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without a synchronisation: copied into a ring of pinned host memory
    (``_PinnedRing``) and from there asynchronously on the current stream (a pageable copy would wait for the
    stream; torch's ``pin_memory()`` per array costs more host time than the copy). Same dtype and shape."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = _PinnedRing()
    return ring.upload(t, device)


class _PinnedRing:
    """Pinned staging for :func:`_upload`: arrays are copied in one after another (256-byte aligned); when the
    ring is full it starts again from the front after a synchronisation of the device (every copy out of the ring
    is then done; once per ``size`` bytes uploaded). Arrays larger than a quarter of the ring, and any
    upload while a CUDA graph is being captured (a graph would replay the copy from memory reused since), take
    torch's ``pin_memory()`` instead."""

    def __init__(self, size: int = 4 << 20) -> None:
        import threading

        self.size = size
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.off = 0
        self.lock = threading.Lock()

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if n == 0 or 4 * n > self.size or torch.cuda.is_current_stream_capturing():
            return t.pin_memory().to(device, non_blocking=True)
        with self.lock:
            if self.off + n > self.size:
                torch.cuda.synchronize(device)  # every stream: a graph's warm-up uploads on a side stream
                self.off = 0
            o = self.off
            self.off = (o + n + 255) & ~255
            self.host[o:o + n] = t.reshape(-1).view(torch.uint8).numpy()
            out = torch.empty(n, dtype=torch.uint8, device=device)
            out.copy_(self.buf[o:o + n], non_blocking=True)
        return out.view(t.dtype).view(t.shape)


_RINGS: dict[torch.device, _PinnedRing] = {}


#: linear()'s per-(device, tokens, BLOCK_M) constants: group offset 0, the rows 0..T-1, the tiles
_LINEAR_CONST: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}


def _host(v: Any) -> np.ndarray | None:
    """``v`` as a numpy array when it is on the host already (numpy, list, CPU tensor), else None."""
    if isinstance(v, torch.Tensor):
        return v.numpy() if v.device.type == "cpu" else None
    return np.asarray(v)


def _tiles(starts: np.ndarray, block_m: int) -> np.ndarray:
    """int32 [n_tiles, 3]: (group, first row, rows <= block_m) covering every non-empty group."""
    counts = np.diff(starts)
    n_tiles = (counts + block_m - 1) // block_m
    grp = np.repeat(np.arange(len(counts), dtype=np.int64), n_tiles)
    first_tile = np.cumsum(n_tiles) - n_tiles
    j = np.arange(int(n_tiles.sum()), dtype=np.int64) - np.repeat(first_tile, n_tiles)
    p0 = starts[grp] + j * block_m
    cnt = np.minimum(block_m, starts[grp + 1] - p0)
    return np.stack([grp, p0, cnt], axis=1).astype(np.int32)


def _launch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, tiles: np.ndarray | torch.Tensor,
            src: torch.Tensor, out: torch.Tensor, ggml_type: int, n_rows: int, n_cols: int, row_bytes: int,
            cfg: dict, align: int, select: tuple[torch.Tensor, int] | None = None) -> None:
    """One launch; ``align``: a power of two dividing ``w.data_ptr()``, ``row_bytes`` and every used offset
    (:func:`alignment`; 1 when unknown): picks wide or byte loads in _gemv_kernel, never the bits. ``select``:
    (ids [k] on the device, table stride): group g's offset is ``offsets[ids[g % k] + (g // k) * stride]``
    (_group_offset)."""
    if len(tiles) == 0 or n_rows == 0:
        return
    sel, n_sel, sel_stride = (offsets, 1, 0) if select is None else (select[0], select[0].numel(), select[1])
    tiles_d = tiles if isinstance(tiles, torch.Tensor) else _upload(tiles, x.device)
    grid = (len(tiles), triton.cdiv(n_rows, cfg["BLOCK_N"]))
    if cfg["WIDE"]:
        grid = grid[::-1]  # _gemv_kernel: row blocks on axis 0
        vw = cfg["VW"]
        a = vw if align % vw == 0 and w.data_ptr() % vw == 0 and row_bytes % vw == 0 else 1
        if cfg.get("G32"):
            a = 2 if align % 2 == 0 and w.data_ptr() % 2 == 0 and row_bytes % 2 == 0 else 1
            _gemv32_kernel[grid](x, w, offsets, tiles_d, src, out, n_rows, row_bytes // a, sel, n_sel, sel_stride,
                                 0x4B000000, n_cols, QTYPE=int(ggml_type), BLOCK_M=cfg["BLOCK_M"],
                                 BLOCK_N=cfg["BLOCK_N"], VW=cfg["VW"], U=cfg["U"], ALIGN=a,
                                 SELECT=select is not None, num_warps=cfg["num_warps"], enable_fp_fusion=False)
            return
        if cfg.get("K2"):
            wa = cfg["WA"]
            a = wa if align % wa == 0 and w.data_ptr() % wa == 0 and row_bytes % wa == 0 else 1
            lanes = cfg["NSUB"] * vw
            _gemv2_kernel[grid](x, w, offsets, tiles_d, src, out, n_rows, row_bytes // a, sel, n_sel, sel_stride,
                                0x4B000000, n_cols, QTYPE=int(ggml_type), BLOCK_M=cfg["BLOCK_M"],
                                BLOCK_N=cfg["BLOCK_N"], LANES=cfg["NSUB"], LPB=cfg["LPB"], VW=vw,
                                LOG2_LANES=lanes.bit_length() - 1, ALIGN=a, SELECT=select is not None,
                                num_warps=cfg["num_warps"], enable_fp_fusion=False)
            return
        # lane-group steps (NSUB * SUB elements) per K-loop iteration: at most about 32 decode steps of
        # straight-line code (loads that the compiler may issue together), a bounded compile; steps past n_cols
        # are masked (they add +0.0: no bit changes)
        unroll = max(1, min(triton.cdiv(n_cols, cfg["NSUB"] * cfg["SUB"]), 32 * vw // cfg["SUB"]))
        lanes = cfg["NSUB"] * vw
        _gemv_kernel[grid](x, w, offsets, tiles_d, src, out, n_rows, row_bytes // a, sel, n_sel, sel_stride,
                           n_cols, QTYPE=int(ggml_type), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                           NSUB=cfg["NSUB"], SUB=cfg["SUB"], VW=vw, LOG2_LANES=lanes.bit_length() - 1, ALIGN=a,
                           UNROLL=unroll,
                           SELECT=select is not None, num_warps=cfg["num_warps"], enable_fp_fusion=False)
        return
    _matmul_kernel[grid](x, w, offsets, tiles_d, src, out, _kv(x.device), n_rows, row_bytes, sel, n_sel, sel_stride,
                         n_cols, QTYPE=int(ggml_type), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                         NSUB=cfg["NSUB"], SUB=cfg["SUB"], BLOCK_K=cfg["NSUB"] * cfg["SUB"], GEMM=cfg["GEMM"],
                         SELECT=select is not None, num_warps=cfg["num_warps"], enable_fp_fusion=False)


def block_m(ggml_type: int, m_hint: int) -> int:
    """Rows of x per tile of the configuration ``grouped`` uses for ``m_hint`` (the same for every type)."""
    return _config(int(ggml_type), 1, 1, int(m_hint))["BLOCK_M"]


def plan_tiles(starts: np.ndarray, m_hint: int) -> np.ndarray:
    """int32 [n_tiles, 3] tiles (group, first row, rows) of ``starts`` (int [G+1], non-decreasing from 0) for
    the configuration of ``m_hint``: what :func:`grouped` plans, for :func:`grouped_planned`."""
    return _tiles(np.asarray(starts, dtype=np.int64), block_m(0, m_hint))


def grouped_planned(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, tiles: torch.Tensor,
                    src_rows: torch.Tensor, ggml_type: int, n_rows: int, n_cols: int, m_hint: int,
                    out: torch.Tensor, align: int = 1) -> torch.Tensor:
    """:func:`grouped` with everything already on the device and nothing checked on the host (the caller built
    the arguments: the MoE layer, one upload for all of them): offsets int64 [G], tiles int32 [n_tiles, 3] from
    :func:`plan_tiles` with the same ``m_hint``, src_rows int32 [P], out float32 [P, n_rows]. ``align``: a power
    of two that the caller guarantees divides every offset (:func:`alignment` of the offsets' parts; 1: no
    promise); it lets the GEMV path load wide words and never changes a bit. The same bits as :func:`grouped`.
    Returns ``out``."""
    cfg = _config(int(ggml_type), n_rows, n_cols, int(m_hint))
    _launch(x, pool, offsets, tiles, src_rows, out, ggml_type, n_rows, n_cols, _row_bytes(ggml_type, n_cols), cfg,
            int(align))
    return out


def grouped_selected(x: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, ids: torch.Tensor,
                     n_tables: int, tiles: torch.Tensor, src_rows: torch.Tensor, ggml_type: int, n_rows: int,
                     n_cols: int, m_hint: int, out: torch.Tensor, align: int = 1) -> torch.Tensor:
    """:func:`grouped_planned` whose groups are addressed by id on the device: ids int64 [k] (a router's top-k),
    table int64 [n_tables * E] (byte offsets from ``pool.data_ptr()``, one table of E per matrix, stacked); group
    g = j * k + i (j < n_tables, i < k) reads the matrix at ``table[j * E + ids[i]]``. So the offsets need no
    kernel of their own, and several matrices of one shape and type (a layer's separate gate and up experts: the
    up table holds its pool's distance from the gate pool) go in one launch. tiles from :func:`plan_tiles` over
    ``n_tables * k`` groups; ``align`` divides every table entry. Each output row has the bits it has from
    :func:`grouped_planned` (the configuration depends on the type, shape and ``m_hint`` only). Returns ``out``."""
    cfg = _config(int(ggml_type), n_rows, n_cols, int(m_hint))
    _launch(x, pool, table, tiles, src_rows, out, ggml_type, n_rows, n_cols, _row_bytes(ggml_type, n_cols), cfg,
            int(align), select=(ids, table.numel() // n_tables))
    return out


def _check_x(x: torch.Tensor, n_cols: int, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"tkernels.{where}: x must be a float32 tensor, got {got}")
    if x.dim() != 2 or x.shape[1] != n_cols or not x.is_contiguous():
        raise ValueError(f"tkernels.{where}: x must be contiguous [T, {n_cols}], got {tuple(x.shape)}")


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n_cols: int, m_hint: int | None = None
           ) -> torch.Tensor:
    """``x @ W.T`` for ``W = dequantize(raw, ggml_type, n_cols)``, computed on the ggml blocks.

    Args:
        x: float32 ``[T, n_cols]``, contiguous, on ``raw.device``.
        raw: uint8 ``[rows, row_bytes]``: rows of ggml blocks (layouts: ggml-common.h), bytes within a row
            contiguous, rows at any stride (a row-slice view of a bigger tensor is fine), any byte alignment.
        ggml_type: a number in :data:`TYPES`; n_cols: a multiple of its block size.
        m_hint: token count that picks the kernel configuration (default ``T``); see the module docstring.

    Returns:
        float32 ``[T, rows]``. Bitwise equal to :func:`grouped` with this matrix as one group and the same
        ``m_hint``; deterministic (no atomics, fixed reduction order).

    Raises:
        ValueError, TypeError: unsupported type / n_cols, wrong shapes, dtypes or devices.
    """
    _check(ggml_type, n_cols, "linear")
    _check_x(x, n_cols, "linear")
    nb = _row_bytes(ggml_type, n_cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != nb or (raw.shape[0] > 1 and raw.stride(1) != 1):
        raise ValueError(f"tkernels.linear({_label(ggml_type)}): raw must be uint8 [rows, {nb}] with contiguous "
                         f"rows, got {raw.dtype} {tuple(raw.shape)}")
    if raw.device != x.device:
        raise ValueError(f"tkernels.linear: x is on {x.device} but raw is on {raw.device}")
    n_tok, rows = x.shape[0], raw.shape[0]
    out = torch.empty((n_tok, rows), dtype=torch.float32, device=x.device)
    if n_tok == 0 or rows == 0:
        return out
    cfg = _config(int(ggml_type), rows, n_cols, n_tok if m_hint is None else int(m_hint), grouped=False)
    stride = raw.stride(0) if rows > 1 else nb
    key = (x.device, n_tok, cfg["BLOCK_M"])
    const = _LINEAR_CONST.get(key)
    if const is None:
        tiles = _tiles(np.array([0, n_tok], dtype=np.int64), cfg["BLOCK_M"])
        const = _LINEAR_CONST[key] = (torch.zeros(1, dtype=torch.int64, device=x.device),
                                      torch.arange(n_tok, dtype=torch.int32, device=x.device),
                                      torch.from_numpy(tiles).to(x.device), len(tiles))
        if len(_LINEAR_CONST) > 4096:  # many distinct prefill lengths: keep it bounded
            _LINEAR_CONST.clear()
    offsets, src, tiles_d, _ = const
    _launch(x, raw, offsets, tiles_d, src, out, ggml_type, rows, n_cols, stride, cfg, 16)
    return out


def grouped(x: torch.Tensor, pool: torch.Tensor, offsets: Any, starts: Any, src_rows: Any, ggml_type: int,
            n_rows: int, n_cols: int, m_hint: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE expert matmul in one launch: output row ``p`` of group ``g`` is ``x[src_rows[p]] @ W_g.T``.

    Args:
        x: float32 ``[T, n_cols]``, contiguous (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        pool: contiguous uint8 tensor of any shape holding the group matrices (a device tensor, or on CUDA a
            pinned host tensor, read through unified addressing).
        offsets: int64 ``[G]``: byte offset in ``pool`` of group ``g``'s matrix, ``n_rows`` rows of
            ``row_bytes(ggml_type, n_cols)`` bytes back to back (ggml blocks, ggml-common.h). Any byte
            alignment.
        starts: int ``[G + 1]``, non-decreasing, ``starts[0] == 0``: group ``g`` owns output rows
            ``starts[g] .. starts[g+1] - 1`` (empty groups allowed); ``P = starts[G]``.
        src_rows: int ``[P]``: the row of ``x`` each output row multiplies (values in ``[0, T)``).
            offsets / starts / src_rows may be numpy arrays, lists or tensors on any device.
        ggml_type: a number in :data:`TYPES`; n_rows, n_cols: each matrix's shape (``n_cols`` a multiple of the
            block size).
        m_hint: token count of the whole MoE call; with the type it alone picks the kernel configuration.
        out: optional float32 ``[P, n_rows]`` contiguous output on ``x.device``.

    Returns:
        float32 ``[P, n_rows]`` (``out`` when given). Each row is bitwise the same as :func:`linear` of
        ``x[src_rows[p]]`` with ``W_g`` and the same ``m_hint``, wherever ``W_g`` sits in the pool and
        whatever other groups share the launch.

    Raises:
        ValueError, TypeError: unsupported type / n_cols, bad shapes, starts not monotonic, an offset whose
        matrix does not fit in ``pool``, a source row out of range (checked when src_rows is on the host).
    """
    _check(ggml_type, n_cols, "grouped")
    _check_x(x, n_cols, "grouped")
    if pool.dtype != torch.uint8 or not pool.is_contiguous():
        raise ValueError(f"tkernels.grouped: pool must be a contiguous uint8 tensor, got {pool.dtype}")
    if x.device.type == "cpu" and pool.device != x.device:
        raise ValueError(f"tkernels.grouped: x is on {x.device} but pool is on {pool.device}")
    nb = _row_bytes(ggml_type, n_cols)
    st = _host(starts)
    st = (st if st is not None else starts.cpu().numpy()).astype(np.int64).reshape(-1)
    off_h = _host(offsets)
    off_h = (off_h if off_h is not None else offsets.cpu().numpy()).astype(np.int64).reshape(-1)
    n_groups = len(off_h)
    if len(st) != n_groups + 1 or st[0] != 0 or np.any(np.diff(st) < 0):
        raise ValueError(f"tkernels.grouped: starts must be non-decreasing [G+1={n_groups + 1}] from 0, got {st}")
    p_total = int(st[-1])
    used = np.diff(st) > 0
    if np.any(used & ((off_h < 0) | (off_h + n_rows * nb > pool.numel()))):
        raise ValueError(f"tkernels.grouped: a group's matrix ({n_rows} x {nb} bytes) lies outside the pool "
                         f"({pool.numel()} bytes): offsets {off_h}")
    src_h = _host(src_rows)
    if src_h is not None:
        src_h = np.asarray(src_h).reshape(-1)
        if len(src_h) != p_total or (p_total and (src_h.min() < 0 or src_h.max() >= x.shape[0])):
            raise ValueError(f"tkernels.grouped: src_rows must be [{p_total}] rows of x (< {x.shape[0]})")
    if out is None:
        out = torch.empty((p_total, n_rows), dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (p_total, n_rows) or not out.is_contiguous() \
            or out.device != x.device:
        raise ValueError(f"tkernels.grouped: out must be contiguous float32 [{p_total}, {n_rows}] on {x.device}")
    if p_total == 0:
        return out
    cfg = _config(int(ggml_type), n_rows, n_cols, int(m_hint))
    off_d = _as_tensor(off_h, torch.int64, x.device)
    src_d = _as_tensor(src_rows, torch.int32, x.device)
    _launch(x, pool, off_d, _tiles(st, cfg["BLOCK_M"]), src_d, out, ggml_type, n_rows, n_cols, nb, cfg,
            alignment(off_h[used]))
    return out
