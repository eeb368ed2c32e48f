"""Triton kernels of a one-token decode step's attention: fewer launches per layer (issue 24, item 3).

A CUDA decode step (one token, the position in a device tensor, the whole step one CUDA graph:
runtime/graphs.py) ran each attention layer's norms, RoPE, cache writes and attention as about twenty small
torch kernels (q/k RMSNorm 2, RoPE of q and k 12 (index_select of the tables, the half swap, mul/mul/add), two
``index_copy_`` into the cache, then layers.attention_at: matmul, scale, mask, masked_fill, softmax, matmul and
its reduction). Here they are two Triton launches (three when a long context splits the keys):

:func:`norm_rope_store`
    One program per head row: RMSNorm of the head (``x * rsqrt(mean(x^2) + eps) * w``, optional), RoPE at the
    device position from the :class:`~moestream.models.layers.Rope` tables (NEOX halves or interleaved pairs,
    partial rotation: dims past ``n_rot`` copied), written to a new q tensor (q heads) or straight into the k
    cache row at ``pos`` (k heads); v heads are copied into the v cache row at ``pos``. Any of q, k, v may be
    left out (``Step.rope`` and ``Step.rope_into`` use it for one of them). The rotation is the torch code's
    arithmetic exactly (``x * cos + partner * sin``, each product and the sum rounded once: ``enable_fp_fusion``
    is off, so no FMA), the tables carrying the signs (``sin`` = [-s | s]); only the norm's sum of squares is
    reduced in another order than torch.rms_norm's.
:func:`decode_attention`
    One query token over the cache rows 0..pos (pos read on the device; nothing past it is read, so the step has
    no host-dependent value and can be captured), GQA without copies (one program per KV head, its whole query
    group as the rows of ``tl.dot`` tiles), an optional sliding ``window`` (keys at ``pos - window`` or before
    are not read either), optional ``sinks`` (one logit per head in the denominator), ``scale`` applied to
    ``q.k`` after the dot (as torch's matmul then ``mul_``), values either a v cache or the first ``v_dim`` dims
    of the keys (MLA absorbed, K = V). Online softmax in float32 over blocks of :data:`BLOCK_N` keys
    (:data:`BLOCK_N_WIDE` for value heads past 128 dims: :func:`attn_config`) in key order. Where ``n_keys``
    (the step's fixed row count, layers.decode_keys) exceeds :data:`SPLIT_KEYS`, the keys are split over
    ``ceil(n_keys / SPLIT_KEYS)`` programs per head group (at most :data:`MAX_SPLITS`), each writing a partial
    (max, sum, weighted values), and a second launch combines them in split order.

Determinism: no atomics; every configuration (tile sizes, split count and split boundaries) is a function of
the shapes and ``n_keys`` only, the key blocks are visited in order and the splits combined in order, so a
given (pos, n_keys) gives the same bits on every run, graphed or not, streaming or resident. Not bitwise equal
to the torch ops (other reduction orders, the division by the softmax sum at the end, exp on the GPU): within
float32 rounding (tests/test_tstep.py derives the bound; tests/test_cuda.py's oracle bar holds).

Loops over keys: on a GPU a ``for`` over ``range(first, end, BLOCK_N)`` with bounds read on the device; under
Triton's interpreter (numpy 2.4 cannot turn its loaded scalars into a Python range bound) the same body
(:func:`_attn_block`) in a ``while`` loop over the same blocks in the same order: the same arithmetic.

Where they are used (runtime/step.py, the device decode branch, ``Step.pos`` set, when :func:`applies`):

- ``Step.cached_attention`` (qwen3moe, glm4moe and qwen35moe's gated attention layers with their per-head q/k
  norms; olmoe, qwen2moe, mixtral/llama; gpt-oss with window and sinks): :func:`norm_rope_store` +
  :func:`decode_attention`, two launches (three with a split). olmoe norms q and k over the whole projection
  (not per head: torch.rms_norm before the call, one launch each); there the kernel only rotates and stores.
- ``Step.rope`` / ``Step.rope_into`` (gemma4's q and k, deepseek2's rope parts of q and of the cache row):
  :func:`norm_rope_store` without norm, one launch instead of ~6; ``Step.store`` stays one ``index_copy_``
  (gemma4's v, deepseek2's cache row). gemma4's q/k/v norms and deepseek2's cache-row norm and concatenation
  stay torch ops.
- ``Step.attend`` (gemma4: sliding window, a shared-KV layer reading another layer's cache; deepseek2: MLA with
  ``v_dim``): :func:`decode_attention`.

Everything else (prefill, the eager CPU path, tensors other than float32) keeps the torch / C code. The kernels
run on CUDA tensors; :data:`ON_CPU` lets tests run the model's device step on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``). ``MOESTREAM_TSTEP=0`` at import (or :data:`ENABLED` = False) turns them
off (the torch ops of layers.rope_at / attention_at again), for A/B runs.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["BLOCK_N", "MAX_SPLITS", "SPLIT_KEYS", "applies", "attn_config", "available", "decode_attention",
           "norm_rope_store", "splits"]

#: tests only: run the kernels on CPU tensors too (under Triton's interpreter; tests/test_tstep.py)
ON_CPU = False
#: whether the device decode step uses these kernels (``MOESTREAM_TSTEP=0`` at import: the torch ops instead)
ENABLED: bool = os.environ.get("MOESTREAM_TSTEP", "1").strip().lower() not in ("0", "off", "false", "no")
#: keys per block of the attention loop (the rows of a tl.dot tile) for value heads of at most 128 dims;
#: :data:`BLOCK_N_WIDE` above that (see :func:`attn_config`)
BLOCK_N = 32
BLOCK_N_WIDE = 16
#: query heads per tile (tl.dot needs at least 16 rows; a larger group takes several programs per KV head)
BLOCK_G = 16
#: at most this many keys per program: a larger ``n_keys`` splits the keys (and adds the combine launch)
SPLIT_KEYS = int(os.environ.get("MOESTREAM_TSTEP_SPLIT_KEYS", "256"))  # env: for A/B runs
#: at most this many splits per head group
MAX_SPLITS = 64


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the kernels can run: triton imports, and CUDA is available or ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return torch.cuda.is_available() or _interpreted()


def applies(x: torch.Tensor) -> bool:
    """Whether the device decode step computes on ``x`` (float32) with these kernels: :data:`ENABLED`, Triton
    available, and ``x`` on CUDA (or on the CPU with :data:`ON_CPU`, under the interpreter)."""
    if not ENABLED or x.dtype != torch.float32:
        return False
    if x.device.type == "cuda":
        return triton is not None
    return ON_CPU and x.device.type == "cpu" and triton is not None and _interpreted()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def attn_config(d: int, dv: int) -> dict[str, int]:
    """The attention kernel's fixed configuration for key head dim ``d`` and value dim ``dv``: key block, tile
    sizes, warps and pipeline stages. Value heads up to 128 dims (Qwen3, GPT-OSS, ...): blocks of
    :data:`BLOCK_N` keys, 4 warps, 3 stages (about 75 KiB of shared memory at d = 128 on sm_90); wider ones
    (Gemma 4's 512, MLA's 512 + 64): :data:`BLOCK_N_WIDE` keys, 8 warps, 2 stages (about 115 KiB at 576/512:
    3 stages or 32 keys would pass the 227 KiB a block may have)."""
    block_dv = _pow2(dv)
    wide = block_dv > 128
    return dict(BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N_WIDE if wide else BLOCK_N, BLOCK_DK=min(128, _pow2(d)),
                BLOCK_DV=block_dv, num_warps=8 if wide else 4, num_stages=2 if wide else 3)


def splits(n_keys: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(number of splits, keys per split, a multiple of ``block_n``) for ``n_keys`` cache rows: one split up to
    :data:`SPLIT_KEYS` keys, else ``ceil(n_keys / SPLIT_KEYS)`` (at most :data:`MAX_SPLITS`)."""
    n = max(1, min(MAX_SPLITS, -(-n_keys // SPLIT_KEYS)))
    chunk = -(-n_keys // n)
    chunk = -(-chunk // block_n) * block_n
    return -(-n_keys // chunk), chunk


if triton is not None:

    @triton.jit
    def _norm_rope_row(src, w, cos, sin, eps, i, p, m, rot, NORM: tl.constexpr, D: tl.constexpr):
        """One head row at ``src`` (D float32, unit stride), RMSNormed by ``w`` when NORM, rotated on ``rot``
        with partner indices ``p`` and the position's table rows ``cos``/``sin`` (already loaded)."""
        x = tl.load(src + i, mask=m, other=0.0)
        xp = tl.load(src + p, mask=m, other=0.0)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            x = x * r * tl.load(w + i, mask=m, other=0.0)
            xp = xp * r * tl.load(w + p, mask=m, other=0.0)
        return tl.where(rot, x * cos + xp * sin, x)

    @triton.jit
    def _norm_rope_store_kernel(q, q_hs, k, k_hs, v, v_hs, qw, kw, cos, sin, rope_rs, pos_ptr, q_out,
                                kc, kc_rs, kc_hs, vc, vc_rs, vc_hs, eps,
                                N_Q: tl.constexpr, N_K: tl.constexpr, HAS_V: tl.constexpr,
                                D: tl.constexpr, DV: tl.constexpr, N_ROT: tl.constexpr,
                                INTERLEAVED: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Program h: q head h (h < N_Q) -> q_out[h]; k head h - N_Q -> kc[pos, h - N_Q]; v head h - N_Q - N_K
        -> vc[pos, ...] (a copy)."""
        pid = tl.program_id(0)
        pos = tl.load(pos_ptr)
        i = tl.arange(0, BLOCK_D)
        m = i < D
        rot = i < N_ROT
        if INTERLEAVED:
            p = i ^ 1
        else:
            p = tl.where(i < N_ROT // 2, i + N_ROT // 2, i - N_ROT // 2)
        p = tl.where(rot, p, i)
        cs = tl.load(cos + pos * rope_rs + i, mask=rot, other=1.0)
        sn = tl.load(sin + pos * rope_rs + i, mask=rot, other=0.0)
        if pid < N_Q:
            y = _norm_rope_row(q + pid * q_hs, qw, cs, sn, eps, i, p, m, rot, Q_NORM, D)
            tl.store(q_out + pid * D + i, y, mask=m)
        elif pid < N_Q + N_K:
            h = pid - N_Q
            y = _norm_rope_row(k + h * k_hs, kw, cs, sn, eps, i, p, m, rot, K_NORM, D)
            tl.store(kc + pos * kc_rs + h * kc_hs + i, y, mask=m)
        elif HAS_V:
            h = pid - N_Q - N_K
            j = tl.arange(0, BLOCK_DV)
            mv = j < DV
            tl.store(vc + pos * vc_rs + h * vc_hs + j, tl.load(v + h * v_hs + j, mask=mv, other=0.0), mask=mv)

    @triton.jit
    def _attn_block(n0, lo, pos, m_i, l_i, acc, q, k, v, k_rs, v_rs, h, gm, scale,
                    D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
        """The online softmax over keys n0..n0+BLOCK_N-1 (only those in [lo, pos] read): the new
        (running max, running sum, weighted values). ``k``, ``v``: the KV head's row 0; ``h`` [BLOCK_G]: the query
        heads (``gm``: which are real)."""
        n = n0 + tl.arange(0, BLOCK_N)
        valid = (n >= lo) & (n <= pos)
        s = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(0, D, BLOCK_DK):
            d = c + tl.arange(0, BLOCK_DK)
            dm = d < D
            qc = tl.load(q + h[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
            kc = tl.load(k + n[:, None] * k_rs + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            s = tl.dot(qc, tl.trans(kc), s, input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        e = tl.arange(0, BLOCK_DV)
        vv = tl.load(v + n[:, None] * v_rs + e[None, :], mask=valid[:, None] & (e < DV)[None, :], other=0.0)
        acc = tl.dot(pr, vv, acc * alpha[:, None], input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _decode_attn_kernel(q, k, k_rs, k_hs, v, v_rs, v_hs, sinks, pos_ptr, out, part, part_ml,
                            scale, window, chunk,
                            N_HEAD: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
                            BLOCK_DV: tl.constexpr, N_SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                            HAS_SINKS: tl.constexpr, LOOP_WHILE: tl.constexpr):
        """Program (kv head, head block, split): the query heads kv * GROUP + [gb * BLOCK_G, ...) over the keys
        [split * chunk, (split + 1) * chunk) that are in [lo, pos]. N_SPLIT == 1: the normalized output into
        ``out`` [N_HEAD, DV]; else the partial (max, sum) into part_ml [N_SPLIT, N_HEAD, 2] and the weighted
        values into part [N_SPLIT, N_HEAD, DV]."""
        kvh = tl.program_id(0)
        gb = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr)
        g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
        gm = g < GROUP
        h = kvh * GROUP + g
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        else:
            lo = pos * 0
        s0 = sp * chunk
        end = tl.minimum(s0 + chunk, pos + 1)
        first = tl.maximum(s0, (lo // BLOCK_N) * BLOCK_N)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        kb = k + kvh * k_hs
        vb = v + kvh * v_hs
        if LOOP_WHILE:
            n0 = first
            while n0 < end:
                m_i, l_i, acc = _attn_block(n0, lo, pos, m_i, l_i, acc, q, kb, vb, k_rs, v_rs, h, gm, scale,
                                            D, DV, BLOCK_G, BLOCK_N, BLOCK_DK, BLOCK_DV)
                n0 += BLOCK_N
        else:
            for n0 in range(first, end, BLOCK_N):
                m_i, l_i, acc = _attn_block(n0, lo, pos, m_i, l_i, acc, q, kb, vb, k_rs, v_rs, h, gm, scale,
                                            D, DV, BLOCK_G, BLOCK_N, BLOCK_DK, BLOCK_DV)
        e = tl.arange(0, BLOCK_DV)
        om = gm[:, None] & (e < DV)[None, :]
        if N_SPLIT == 1:
            if HAS_SINKS:
                sk = tl.load(sinks + h, mask=gm, other=0.0)
                m_f = tl.maximum(m_i, sk)
                a = tl.exp(m_i - m_f)
                l_i = l_i * a + tl.exp(sk - m_f)
                acc = acc * a[:, None]
            tl.store(out + h[:, None] * DV + e[None, :], acc / l_i[:, None], mask=om)
        else:
            tl.store(part + (sp * N_HEAD + h[:, None]) * DV + e[None, :], acc, mask=om)
            tl.store(part_ml + (sp * N_HEAD + h) * 2, m_i, mask=gm)
            tl.store(part_ml + (sp * N_HEAD + h) * 2 + 1, l_i, mask=gm)

    @triton.jit
    def _combine_kernel(part, part_ml, sinks, out, N_HEAD: tl.constexpr, DV: tl.constexpr,
                        N_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
        """Program h: head h's splits combined in split order: sum_s part[s] e^(m_s - M) over
        (e^(sink - M) +) sum_s l_s e^(m_s - M), M the largest m_s (and sink)."""
        h = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        sm = s < N_SPLIT
        ms = tl.load(part_ml + (s * N_HEAD + h) * 2, mask=sm, other=float("-inf"))
        mx = tl.max(ms, axis=0)
        den = tl.zeros([1], dtype=tl.float32)
        if HAS_SINKS:
            sk = tl.load(sinks + h + tl.arange(0, 1))
            mx = tl.maximum(mx, tl.max(sk, axis=0))
            den = tl.exp(sk - mx)
        e = tl.arange(0, BLOCK_DV)
        em = e < DV
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for j in tl.static_range(N_SPLIT):  # in split order: a fixed summation order
            mj = tl.load(part_ml + (j * N_HEAD + h) * 2 + tl.arange(0, 1))
            lj = tl.load(part_ml + (j * N_HEAD + h) * 2 + 1 + tl.arange(0, 1))
            wj = tl.exp(mj - mx)
            den = den + lj * wj
            acc = acc + tl.load(part + (j * N_HEAD + h) * DV + e, mask=em, other=0.0) * wj
        tl.store(out + h * DV + e, acc / den, mask=em)


def _head_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x [1, heads, d] float32 with unit stride along d (a copy when not)."""
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"tstep.{what}: expected [1, heads, d], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_rope_store(rope, pos: torch.Tensor, q: torch.Tensor | None = None, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
    """One launch: ``q`` [1, n_head, d] RMSNormed by ``q_norm`` (float32 [d], or None: no norm) and rotated at
    the device position ``pos`` (int64 [1]) -> a new float32 [1, n_head, d]; ``k`` [1, n_kv, d] normed by
    ``k_norm`` and rotated into ``k_cache[pos]`` ([n_ctx, n_kv, d]); ``v`` [1, n_kv, d_v] copied into
    ``v_cache[pos]``. Any of q, k, v may be None (k needs k_cache, v needs v_cache). ``rope``: a
    layers.Rope whose tables already cover ``pos`` (``rope.reserve``). Returns the rotated q (None without q)."""
    x = q if q is not None else k if k is not None else v
    if x is None:
        return None
    dev = x.device
    q = None if q is None else _head_rows(q, "norm_rope_store")
    k = None if k is None else _head_rows(k, "norm_rope_store")
    v = None if v is None else _head_rows(v, "norm_rope_store")
    d = (q if q is not None else k).shape[2] if (q is not None or k is not None) else 1
    if q is not None and k is not None and k.shape[2] != d:
        raise ValueError(f"tstep.norm_rope_store: q and k head dims differ ({d}, {k.shape[2]})")
    n_q = 0 if q is None else q.shape[1]
    n_k = 0 if k is None else k.shape[1]
    n_v = 0 if v is None else v.shape[1]
    dv = 1 if v is None else v.shape[2]
    for c, want, name in ((k_cache, k, "k"), (v_cache, v, "v")):
        if want is not None and (c is None or c.stride(-1) != 1 or c.shape[1:] != want.shape[1:]):
            raise ValueError(f"tstep.norm_rope_store: {name} needs a cache [n_ctx, {want.shape[1]}, "
                             f"{want.shape[2]}] with unit stride along the head dim")
    if rope.n_rot > d and (q is not None or k is not None):
        raise ValueError(f"tstep.norm_rope_store: n_rot {rope.n_rot} > head dim {d}")
    q_out = torch.empty((1, n_q, d), dtype=torch.float32, device=dev) if q is not None else None
    dummy = x  # the pointer of an argument left out (never read)
    kc = k_cache if k is not None else dummy
    vc = v_cache if v is not None else dummy
    grid = (n_q + n_k + n_v,)
    _norm_rope_store_kernel[grid](
        q if q is not None else dummy, q.stride(1) if q is not None else 0,
        k if k is not None else dummy, k.stride(1) if k is not None else 0,
        v if v is not None else dummy, v.stride(1) if v is not None else 0,
        q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        rope.cos, rope.sin, rope.cos.stride(0), pos, q_out if q_out is not None else dummy,
        kc, kc.stride(0) if k is not None else 0, kc.stride(1) if k is not None else 0,
        vc, vc.stride(0) if v is not None else 0, vc.stride(1) if v is not None else 0, float(eps),
        N_Q=n_q, N_K=n_k, HAS_V=v is not None, D=d, DV=dv, N_ROT=rope.n_rot, INTERLEAVED=bool(rope.interleaved),
        Q_NORM=q is not None and q_norm is not None, K_NORM=k is not None and k_norm is not None,
        BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), num_warps=1 if max(d, dv) <= 128 else 4, enable_fp_fusion=False)
    return q_out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, pos: torch.Tensor,
                     n_keys: int, scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                     v_dim: int | None = None) -> torch.Tensor:
    """One query token over the cache rows 0..pos (the module docstring): q float32 [1, n_head, d]; k_cache
    [>= n_keys, n_kv, d] (rows at any stride, unit stride along d); v_cache [>= n_keys, n_kv, d_v], or None with
    ``v_dim``: the values are the first v_dim dims of the keys; pos int64 [1] on the device, below ``n_keys``
    (the step's fixed row count: it picks the split, never a host read of pos). Returns float32
    [1, n_head * d_v] (heads in order, GQA: head h reads KV head h // (n_head / n_kv))."""
    q = _head_rows(q, "decode_attention")
    if not q.is_contiguous():
        q = q.contiguous()
    n_head, d = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[1]
    if k_cache.shape[2] != d or n_head % n_kv or k_cache.stride(-1) != 1:
        raise ValueError(f"tstep.decode_attention: q {tuple(q.shape)} and k cache {tuple(k_cache.shape)} "
                         f"(n_head a multiple of n_kv, the same head dim, unit stride)")
    if v_cache is None:
        if v_dim is None or not 0 < v_dim <= d:
            raise ValueError("tstep.decode_attention: without a v cache, v_dim (<= the key head dim) is needed")
        v_cache, dv = k_cache, int(v_dim)
    else:
        dv = v_cache.shape[2]
        if v_cache.shape[1] != n_kv or v_cache.stride(-1) != 1:
            raise ValueError(f"tstep.decode_attention: v cache {tuple(v_cache.shape)} for {n_kv} KV heads")
    group = n_head // n_kv
    cfg = attn_config(d, dv)
    n_split, chunk = splits(int(n_keys), cfg["BLOCK_N"])
    dev = q.device
    out = torch.empty((1, n_head * dv), dtype=torch.float32, device=dev)
    if n_split > 1:
        part = torch.empty((n_split, n_head, dv), dtype=torch.float32, device=dev)
        part_ml = torch.empty((n_split, n_head, 2), dtype=torch.float32, device=dev)
    else:
        part = part_ml = out
    sk = sinks if sinks is not None else out
    grid = (n_kv, -(-group // cfg["BLOCK_G"]), n_split)
    _decode_attn_kernel[grid](
        q, k_cache, k_cache.stride(0), k_cache.stride(1), v_cache, v_cache.stride(0), v_cache.stride(1), sk, pos,
        out, part, part_ml, float(scale), int(window) if window is not None else 0, chunk,
        N_HEAD=n_head, GROUP=group, D=d, DV=dv, N_SPLIT=n_split, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, LOOP_WHILE=_interpreted(), enable_fp_fusion=False, **cfg)
    if n_split > 1:
        _combine_kernel[(n_head,)](part, part_ml, sk, out, N_HEAD=n_head, DV=dv, N_SPLIT=n_split,
                                   BLOCK_S=_pow2(n_split), BLOCK_DV=cfg["BLOCK_DV"], HAS_SINKS=sinks is not None,
                                   num_warps=1 if cfg["BLOCK_DV"] <= 128 else 4, enable_fp_fusion=False)
    return out
