"""The step kernels (csrc/stepkern.c: RMSNorm, RoPE, attention over the KV cache, the router) against numpy
references written here with the same arithmetic, bit for bit, on every build the CPU runs and at 1 and 8 threads;
and against torch's own ops (the functions the C replaces) within float32 rounding, so the references compute the
right thing.

The references spell out each C operation in numpy float32 (products and sums rounded on their own), sequential
sums with ``np.cumsum`` (which adds in order), double sums in float64 the same way, ``expf`` / ``tanhf`` from
the C library through ctypes (the functions the kernels call), and fused multiply-adds (attention, in llama.cpp's
arithmetic) with :func:`fmaf`. tests/test_llamacpp.py checks the attention reference's arithmetic is llama.cpp's
own, bit for bit, on llama.cpp's intermediate tensors.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from moestream import kernels
from moestream.experts import moe
from moestream.models import layers, routing
from test_kernels import _LIBM, BUILDS

F32, F64 = np.float32, np.float64


@pytest.fixture(scope="module")
def libs() -> dict:
    return {b: kernels.load(b) for b in BUILDS}


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    kernels.set_threads(0)


def expf(a: np.ndarray) -> np.ndarray:
    """libm's expf, element by element (float(np.float32) is exact)."""
    flat = np.asarray(a, dtype=F32).ravel()
    return np.array([_LIBM.expf(float(v)) for v in flat], dtype=F32).reshape(np.shape(a))


def tanhf(a: np.ndarray) -> np.ndarray:
    flat = np.asarray(a, dtype=F32).ravel()
    return np.array([_LIBM.tanhf(float(v)) for v in flat], dtype=F32).reshape(np.shape(a))


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return np.ascontiguousarray(a, dtype=F32).view(np.int32)


def each_build_and_threads(libs: dict, fn) -> list:  # noqa: ANN001
    """fn(lib) for every build at 1 and 8 threads."""
    out = []
    for lib in libs.values():
        for t in (1, 8):
            kernels.set_threads(t)
            out.append(fn(lib))
    return out


# --- RMSNorm ---------------------------------------------------------------------------------------------------

def ref_rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """ggml's RMSNorm: squares in float32, summed in double in index order; mean, scale, products in float32."""
    sq = (x * x).astype(F64)
    mean = (np.cumsum(sq, axis=-1)[..., -1] / x.shape[-1]).astype(F32)
    scale = F32(1.0) / np.sqrt(mean + F32(eps))
    y = x * scale[..., None]
    return y if w is None else y * w


@pytest.mark.parametrize("shape", [(1, 2048), (5, 3, 128), (300, 64), (2, 7)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_bitwise(libs, shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if weighted else None
    want = ref_rms_norm(x.numpy(), None if w is None else w.numpy(), 1e-6)
    for got in each_build_and_threads(libs, lambda lib: kernels.rms_norm(x, w, 1e-6, lib=lib)):
        assert np.array_equal(bits(got), bits(want))
    torch_y = torch.rms_norm(x, (shape[-1],), w, 1e-6)
    assert torch.allclose(torch.from_numpy(want), torch_y, rtol=2e-6, atol=1e-7)


def test_rms_norm_strided_rows(libs):
    """A view whose rows are not contiguous (MLA's ``kv[:, :r]``) is read in place, same bits as a copy."""
    kv = torch.randn(6, 40)
    view = kv[:, :32]
    for lib in libs.values():
        assert torch.equal(kernels.rms_norm(view, None, 1e-5, lib=lib), kernels.rms_norm(view.contiguous(), None,
                                                                                          1e-5, lib=lib))


# --- RoPE ------------------------------------------------------------------------------------------------------

def ref_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    n_rot = cos.shape[1]
    xr = x[..., :n_rot]
    if interleaved:
        partner = xr.reshape(*xr.shape[:-1], -1, 2)[..., ::-1].reshape(xr.shape)
    else:
        partner = np.concatenate((xr[..., n_rot // 2:], xr[..., :n_rot // 2]), axis=-1)
    y = x.copy()
    y[..., :n_rot] = xr * cos[:, None] + partner * sin[:, None]
    return y


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,n_rot", [(128, 128), (64, 32), (576, 64)])
def test_rope_bitwise_and_as_layers_rope(libs, interleaved, d, n_rot):
    """The C rotation equals the numpy reference and layers.Rope's torch ops bit for bit, whole and partial,
    NEOX and interleaved, written into a strided destination (cache rows)."""
    rope = layers.Rope(layers.rope_inv_freq(10000.0, n_rot), scale=1.1, interleaved=interleaved)
    start, n_tok, heads = 37, 5, 3
    rope.reserve(start + n_tok)
    x = torch.randn(n_tok, heads, d, generator=torch.Generator().manual_seed(d + n_rot))
    cos, sin = rope.cos[start:start + n_tok], rope.sin[start:start + n_tok]
    want = ref_rope(x.numpy(), cos.numpy(), sin.numpy(), interleaved)
    kernels.set_step_ops(False)
    try:
        torch_y = rope(x, start)
    finally:
        kernels.set_step_ops(True)
    assert np.array_equal(bits(torch_y), bits(want))

    def run(lib):  # noqa: ANN001, ANN202
        cache = torch.full((start + n_tok + 2, heads + 1, d), 7.0)
        out = cache[start:start + n_tok, 1:]
        kernels.rope(x, cos, sin, interleaved, out, lib=lib)
        assert (cache[:start] == 7).all() and (cache[:, 0] == 7).all()
        return out.clone()

    for got in each_build_and_threads(libs, run):
        assert np.array_equal(bits(got), bits(want))


# --- attention -------------------------------------------------------------------------------------------------

def fmaf(a, b, c) -> np.ndarray:  # noqa: ANN001
    """float32 fused multiply-add, a * b + c rounded once: the product is exact in float64, the sum is rounded to
    odd in float64 (TwoSum's exact error decides the last bit), and rounding that to float32 is then the single
    rounding of the exact value (53 >= 24 + 2 bits; Boldo & Melquiond, "Emulation of FMA and correctly rounded
    sums: proved algorithms using rounding to odd", 2008)."""
    a, b, c = (np.asarray(x, dtype=F32).astype(F64) for x in (a, b, c))
    p = a * b
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))
    odd = (s.view(np.int64) & 1) == 1
    s = np.where((err != 0) & ~odd & np.isfinite(s), np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def hexf(h: str) -> np.float32:
    return F32(float.fromhex(h))


def gexpf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (ggml-cpu/vec.h, its AVX2 + FMA form), lane by lane."""
    x = np.asarray(x, dtype=F32)
    r = hexf("0x1.8p23")
    z = fmaf(x, hexf("0x1.715476p+0"), r)
    n = z - r
    b = fmaf(-n, hexf("0x1.7f7d1cp-20"), fmaf(-n, hexf("0x1.62e4p-1"), x))
    e = z.view(np.uint32) << np.uint32(23)
    k = (e + np.array(1.0, F32).view(np.uint32)).view(F32)
    u = b * b
    j = fmaf(fmaf(fmaf(hexf("0x1.0e4020p-7"), b, hexf("0x1.573e2ep-5")), u,
                  fmaf(hexf("0x1.555e66p-3"), b, hexf("0x1.fffdb6p-2"))), u, hexf("0x1.ffffecp-1") * b)
    g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
    s1, s2 = (g + np.uint32(0x7F000000)).view(F32), (e - g).view(F32)
    slow = np.where(np.abs(n) > 192, s1 * s1, fmaf(s2, j, s2) * s1)
    return np.where(np.abs(n) > 126, slow, fmaf(k, j, k)).astype(F32)


def hsum8(a: np.ndarray) -> np.ndarray:
    """[..., 8] -> ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))."""
    return ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))


def vdot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 (AVX2) of the rows of x [m, n] with y [n]: 32 lanes of fmaf over n & ~31, folded, then the
    remaining elements added one by one."""
    m, n = x.shape
    n32 = n & ~31
    lanes = np.zeros((m, 4, 8), F32)
    for i in range(0, n32, 32):
        lanes = fmaf(x[:, i:i + 32].reshape(m, 4, 8), y[i:i + 32].reshape(1, 4, 8), lanes)
    f = (lanes[:, 0] + lanes[:, 2]) + (lanes[:, 1] + lanes[:, 3])
    t = f[:, :4] + f[:, 4:]
    s = (t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])
    for i in range(n32, n):
        s = s + x[:, i] * y[i]
    return s


def ref_attention(q, k, v, start, scale, window=None, sinks=None, softcap=0.0):  # noqa: ANN001, ANN201
    """llama.cpp's CPU attention (ggml AVX2, F32 cache, no flash attention): vdot scores, ggml_v_expf, the exp sum
    in blocks of 8 keys (float hsum8, then double), p = e * (float)(1 / sum); values by vdot over the keys for one
    token, by 8 fmaf lanes over the keys and hsum8 for a chunk."""
    n_tok, n_head, _ = q.shape
    n_kv, dv = k.shape[1], v.shape[2]
    out = np.zeros((n_tok, n_head * dv), dtype=F32)
    for t in range(n_tok):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        n, n32 = pos + 1, -(-(pos + 1) // 32) * 32  # keys 0..pos, padded with masked ones
        for h in range(n_head):
            g = h // (n_head // n_kv)
            s = vdot(k[:n, g], q[t, h]) * F32(scale)
            if softcap:
                s = F32(softcap) * tanhf(s / F32(softcap))
            m = s[lo:].max() if sinks is None else max(s[lo:].max(), sinks[h])
            e = np.zeros(n32, dtype=F32)
            e[lo:n] = gexpf(s[lo:] - m)
            total = F64(0.0)
            for block in hsum8(e.reshape(-1, 8)):
                total += F64(block)
            if sinks is not None:
                total += F64(expf(np.array([sinks[h] - m], dtype=F32))[0])
            p = e * F32(1.0 / total)
            vv = np.zeros((n32, dv), dtype=F32)
            vv[:n] = v[:n, g]
            if n_tok == 1:
                o = vdot(np.ascontiguousarray(vv.T), p)
            else:
                lanes = np.zeros((dv, 8), dtype=F32)
                for j0 in range(0, n32, 8):
                    lanes = fmaf(vv[j0:j0 + 8].T, p[None, j0:j0 + 8], lanes)
                o = hsum8(lanes)
            out[t, h * dv:(h + 1) * dv] = o
    return out


CASES = {  # name: (n_tok, start, n_head, n_kv, d, dv, window, sinks, softcap, K = V)
    "decode_gqa": (1, 40, 8, 2, 128, 128, None, False, 0.0),
    "prefill_chunk": (6, 3, 4, 4, 64, 64, None, False, 0.0),
    "window_sinks": (5, 20, 4, 2, 64, 64, 8, True, 0.0),
    "softcap_odd_dims": (3, 9, 6, 3, 20, 12, None, False, 30.0),
    "mla_k_eq_v": (2, 11, 4, 1, 72, 64, None, False, 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_bitwise(libs, case):
    n_tok, start, n_head, n_kv, d, dv, window, with_sinks, softcap = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    n_ctx = start + n_tok + 3  # rows past the last position exist and must be ignored
    q = torch.randn(n_tok, n_head, d, generator=g)
    kc = torch.randn(n_ctx, n_kv, d, generator=g)
    mla = case == "mla_k_eq_v"
    vc = kc[..., :dv] if mla else torch.randn(n_ctx, n_kv, dv, generator=g)
    sinks = torch.randn(n_head, generator=g) if with_sinks else None
    scale = 1.0 / math.sqrt(d)
    want = ref_attention(q.numpy(), kc.numpy(), vc.numpy(), start, scale, window,
                         None if sinks is None else sinks.numpy(), softcap)
    for got in each_build_and_threads(libs, lambda lib: kernels.attention(q, kc, vc, start, scale, window, sinks,
                                                                          softcap, lib=lib)):
        assert np.array_equal(bits(got), bits(want))
    if not softcap:  # torch's (layers.attention's) ops compute the same function
        kernels.set_step_ops(False)
        try:
            torch_out = layers.attention(q, kc[:start + n_tok], vc[:start + n_tok], start, scale, window, sinks)
        finally:
            kernels.set_step_ops(True)
        assert torch.allclose(torch.from_numpy(want), torch_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_tok,start", [(1, 45), (4, 30)])
def test_attention_bitwise_wide_scores(libs, n_tok, start):
    """Scores spread over hundreds: exp's arguments past its polynomial's range (the lanes the 8-wide exp
    recomputes one by one) and below its flush to 0, in whole blocks of 8 keys and in partial ones."""
    g = torch.Generator().manual_seed(n_tok + start)
    q = torch.randn(n_tok, 4, 32, generator=g) * 8
    kc, vc = torch.randn(start + n_tok, 2, 32, generator=g) * 8, torch.randn(start + n_tok, 2, 24, generator=g)
    with np.errstate(invalid="ignore", over="ignore"):  # the reference's exp computes both of its branches
        want = ref_attention(q.numpy(), kc.numpy(), vc.numpy(), start, 0.5)
    for got in each_build_and_threads(libs, lambda lib: kernels.attention(q, kc, vc, start, 0.5, lib=lib)):
        assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("n_tok,start,norms,interleaved,n_rot", [(1, 40, True, False, 64), (5, 11, True, True, 64),
                                                                 (3, 7, False, False, 32), (1, 9, False, True, 0)])
def test_attn_block_is_the_ops_in_order(libs, n_tok, start, norms, interleaved, n_rot):
    """kernels.attn_block: per-head RMSNorm of q and k, RoPE, k and v written into their cache rows, attention over
    the cache: the numpy references of those ops composed, bit for bit (whole and partial rotation, none, NEOX and
    interleaved; rows before and after the new ones untouched)."""
    n_head, n_kv, d, dv = 8, 2, 64, 48
    g = torch.Generator().manual_seed(n_tok * 100 + start)
    q = torch.randn(n_tok, n_head, d, generator=g) * 2
    kv = torch.randn(n_tok, n_kv * (d + dv), generator=g)  # k and v as views of one projection (strided rows)
    k, v = kv[:, :n_kv * d].view(n_tok, n_kv, d), kv[:, n_kv * d:].view(n_tok, n_kv, dv)
    qn, kn = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5) if norms else (None, None)
    rope = layers.Rope(layers.rope_inv_freq(10000.0, n_rot or 2), interleaved=interleaved) if n_rot else None
    cos = sin = None
    if rope is not None:
        rope.reserve(start + n_tok)
        cos, sin = rope.cos, rope.sin
    n_ctx = start + n_tok + 2
    kc0, vc0 = torch.randn(n_ctx, n_kv, d, generator=g), torch.randn(n_ctx, n_kv, dv, generator=g)
    qq, kk = q.numpy(), k.numpy()
    if norms:
        qq, kk = ref_rms_norm(qq, qn.numpy(), 1e-6), ref_rms_norm(kk, kn.numpy(), 1e-6)
    if rope is not None:
        c, s_ = cos[start:start + n_tok].numpy(), sin[start:start + n_tok].numpy()
        qq, kk = ref_rope(qq, c, s_, interleaved), ref_rope(kk, c, s_, interleaved)
    want_k, want_v = kc0.numpy().copy(), vc0.numpy().copy()
    want_k[start:start + n_tok], want_v[start:start + n_tok] = kk, v.numpy()
    want = ref_attention(qq, want_k, want_v, start, 0.125)

    def run(lib):  # noqa: ANN001, ANN202
        kc, vc = kc0.clone(), vc0.clone()
        out = kernels.attn_block(q.clone(), k, v, kc, vc, start, 0.125, qn, kn, 1e-6, cos, sin, interleaved, lib=lib)
        return out, kc, vc

    for out, kc, vc in each_build_and_threads(libs, run):
        assert np.array_equal(bits(out), bits(want))
        assert np.array_equal(bits(kc), bits(want_k)) and np.array_equal(bits(vc), bits(want_v))


def test_attention_rows_do_not_depend_on_the_chunk(libs):
    """A token's output is the same bits in any prefill chunk that holds it (and with any other tokens beside
    it); alone (decode) its values are summed as llama.cpp sums one token's (ggml_vec_dot_f32 over the keys, not
    its sgemm), so they may differ in the last bits."""
    lib = libs[BUILDS[-1]]
    q = torch.randn(7, 4, 32)
    kc, vc = torch.randn(20, 2, 32), torch.randn(20, 2, 32)
    whole = kernels.attention(q, kc, vc, 5, 0.2, lib=lib)
    for t in range(6):
        assert torch.equal(kernels.attention(q[t:t + 2], kc, vc, 5 + t, 0.2, lib=lib), whole[t:t + 2])
    alone = torch.stack([kernels.attention(q[t:t + 1], kc, vc, 5 + t, 0.2, lib=lib)[0] for t in range(7)])
    assert torch.allclose(alone, whole, rtol=1e-5, atol=1e-6)


# --- router ----------------------------------------------------------------------------------------------------

def ref_route(logits, top_k, gating, bias=None, n_group=1, topk_group=1, norm=True, floor=0.0, scale=1.0):  # noqa: ANN001, ANN201
    ids_all, w_all = [], []
    for row in logits:
        if gating == kernels.GATING_SOFTMAX:
            e = expf(row - row.max())
            s = e / F32(np.cumsum(e.astype(F64))[-1])
        elif gating == kernels.GATING_SIGMOID:
            s = F32(1.0) / (F32(1.0) + expf(-row))
        else:
            s = row.copy()
        ch = s if bias is None else s + bias
        if n_group > 1:
            gs = len(ch) // n_group
            top2 = [sorted(ch[j * gs:(j + 1) * gs].tolist(), reverse=True)[:2] for j in range(n_group)]
            gscore = [F32(a) + F32(b) for a, b in top2]
            keep = sorted(range(n_group), key=lambda j: (-gscore[j], j))[:topk_group]
            ch = ch.copy()
            for j in range(n_group):
                if j not in keep:
                    ch[j * gs:(j + 1) * gs] = -np.inf
        ids = sorted(range(len(ch)), key=lambda i: (-ch[i], i))[:top_k]
        w = s[ids]
        if norm:
            w = w / max(F32(np.cumsum(w.astype(F64))[-1]), F32(floor))
        if scale != 1.0:
            w = w * F32(scale)
        ids_all.append(ids)
        w_all.append(w)
    return np.array(ids_all, dtype=np.int64), np.array(w_all, dtype=F32)


ROUTES = {  # name: (n_exp, top_k, gating, bias, n_group, topk_group, norm, floor, scale)
    "softmax_norm": (128, 8, kernels.GATING_SOFTMAX, False, 1, 1, True, 0.0, 1.0),
    "softmax_plain": (60, 4, kernels.GATING_SOFTMAX, False, 1, 1, False, 0.0, 1.0),
    "sigmoid_groups": (64, 6, kernels.GATING_SIGMOID, True, 8, 3, True, routing.WEIGHT_SUM_FLOOR, 2.5),
    "scores_groups": (32, 4, kernels.GATING_SCORES, True, 4, 2, True, routing.WEIGHT_SUM_FLOOR, 1.0),
    "512_top10": (512, 10, kernels.GATING_SOFTMAX, False, 1, 1, True, 0.0, 1.0),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_route_bitwise(libs, case):
    n_exp, top_k, gating, with_bias, n_group, topk_group, norm, floor, scale = ROUTES[case]
    g = torch.Generator().manual_seed(n_exp + top_k)
    logits = torch.randn(9, n_exp, generator=g) * 2
    if gating == kernels.GATING_SCORES:
        logits = torch.sigmoid(logits)
    bias = torch.randn(n_exp, generator=g) * 0.1 if with_bias else None
    want_ids, want_w = ref_route(logits.numpy(), top_k, gating, None if bias is None else bias.numpy(), n_group,
                                 topk_group, norm, floor, scale)
    for ids, w in each_build_and_threads(libs, lambda lib: kernels.route(logits, top_k, gating, bias, n_group,
                                                                          topk_group, norm, floor, scale, lib=lib)):
        assert np.array_equal(ids.numpy(), want_ids)
        assert np.array_equal(bits(w), bits(want_w))
    # the torch functions it replaces choose the same experts and weights within float32 rounding
    kernels.set_step_ops(False)
    try:
        if gating == kernels.GATING_SOFTMAX and bias is None and n_group == 1 and scale == 1.0:
            t_ids, t_w = layers.softmax_topk(logits, top_k, norm)
        elif gating == kernels.GATING_SIGMOID:
            t_ids, t_w = routing.sigmoid_group_topk(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                                                    norm=norm, scale=scale)
        else:
            t_ids, t_w = routing.group_topk(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                                            norm=norm, scale=scale)
    finally:
        kernels.set_step_ops(True)
    assert np.array_equal(t_ids.numpy(), want_ids)
    assert torch.allclose(t_w, torch.from_numpy(want_w), rtol=1e-6, atol=1e-7)


def test_route_refuses_sizes_that_do_not_fit(libs):
    lib = libs[BUILDS[0]]
    with pytest.raises(ValueError, match="top-9 of 16 experts in 4 groups"):
        kernels.route(torch.zeros(1, 16), 9, kernels.GATING_SIGMOID, n_group=4, topk_group=2, lib=lib)


# --- the MoE call's bookkeeping -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 8, 128), (3, 4, 64), (128, 8, 128), (40, 10, 512), (1, 1, 4)])
def test_moe_pairs_is_a_stable_argsort(libs, shape):
    """ms_moe_pairs groups the (token, k) pairs as numpy's stable argsort of the flat ids does (both of its sorts:
    insertion for few pairs, counting for many), with each pair's token, weight and output row, and gathers the
    address tables' entries of the distinct experts."""
    n_tok, top_k, n_exp = shape
    g = torch.Generator().manual_seed(n_tok * top_k + n_exp)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(n_tok)])
    if n_tok > 2:
        ids[1] = ids[0]  # repeated experts across tokens
    w = torch.rand(n_tok, top_k, generator=g)
    tabs = np.arange(3 * n_exp, dtype=np.int64).reshape(3, n_exp) * 1000 + 7
    flat = ids.reshape(-1).numpy()
    order = np.argsort(flat, kind="stable")
    experts = np.unique(flat)
    for lib in libs.values():
        pairs = kernels.MoEPairs(n_exp, 3, lib=lib)
        n = pairs.plan(ids, w, tabs)
        p = flat.size
        assert n == len(experts) and np.array_equal(pairs.experts[:n], experts)
        assert np.array_equal(pairs.dst[:p], order) and np.array_equal(pairs.tok[:p], order // top_k)
        assert np.array_equal(bits(pairs.w[:p]), bits(w.reshape(-1).numpy()[order]))
        assert np.array_equal(pairs.start[:n + 1], np.searchsorted(flat[order], [*experts, n_exp]))
        assert np.array_equal(pairs.addr[:, :n], tabs[:, experts])


def test_moe_pairs_refuses_an_id_out_of_range(libs):
    pairs = kernels.MoEPairs(16, lib=libs[BUILDS[0]])
    with pytest.raises(ValueError, match="outside 0..15"):
        pairs.plan(torch.tensor([[3, 16]]), torch.ones(1, 2))


@pytest.mark.parametrize("shape", [(1, 8, 2048), (7, 4, 64), (128, 8, 128), (3, 16, 2880), (128, 8, 100), (2, 1, 5)])
def test_topk_sum_is_torch_sum(libs, shape):
    """ms_topk_sum: each token's rows added in k order from +0 (the reference), signed zeros included; and the bits
    of torch's sum over dim 1 (which it replaces) where experts/moe.py calls it (:func:`moe.topk_sum`: rows of a
    multiple of 64, top-k <= 16; elsewhere torch's own sum)."""
    g = torch.Generator().manual_seed(sum(shape))
    out = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
    out[0, :, :3] = -0.0
    ref = np.zeros((shape[0], shape[2]), dtype=F32)
    for k in range(shape[1]):
        ref = ref + out[:, k].numpy()
    for y in each_build_and_threads(libs, lambda lib: kernels.topk_sum(out, lib=lib)):
        assert np.array_equal(bits(y), bits(ref))
        assert np.array_equal(bits(moe.topk_sum(out)), bits(out.sum(dim=1)))


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_first_nonfinite(libs, bad):
    """ms_first_nonfinite: the first NaN / Inf's index (np.isfinite's), -1 when there is none, at any position
    (whole blocks of 8 and the tail)."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3)) * 1e30
    for lib in libs.values():
        for at in ([] if bad is None else [0, 7, 8, 500, 999, 1000]):
            y = x.clone()
            y[at] = bad
            y[at + 1:] = bad if at % 2 else y[at + 1:]
            assert kernels.first_nonfinite(y, lib=lib) == int(np.flatnonzero(~np.isfinite(y.numpy()))[0]) == at
        assert bad is not None or kernels.first_nonfinite(x, lib=lib) == -1


@pytest.mark.parametrize("k", [0, 1, 8])
@pytest.mark.parametrize("weighted", [True, False])
def test_residual_norm(libs, k, weighted):
    """ms_residual_norm: x += r (one add per element) or += the sum of r's k rows (in k order from +0), in place,
    then h = the RMSNorm reference of the new x; without h only the add."""
    g = torch.Generator().manual_seed(k + 10 * weighted)
    x0 = torch.randn(3, 256, generator=g) * 2
    r = torch.randn(3, 256, generator=g) if k == 0 else torch.randn(3, k, 256, generator=g)
    w = torch.rand(256, generator=g) + 0.5 if weighted else None
    s = r.numpy() if k == 0 else np.zeros((3, 256), dtype=F32)
    for j in range(k):
        s = s + r[:, j].numpy()
    want_x = x0.numpy() + s
    want_h = ref_rms_norm(want_x, None if w is None else w.numpy(), 1e-6)

    def run(lib):  # noqa: ANN001, ANN202
        x, h = x0.clone(), torch.empty(3, 256)
        kernels.residual_norm(x, r, w, 1e-6, h, lib=lib)
        x2 = x0.clone()
        kernels.residual_norm(x2, r, w, 1e-6, None, lib=lib)
        assert torch.equal(x2, x)
        return x, h

    for x, h in each_build_and_threads(libs, run):
        assert np.array_equal(bits(x), bits(want_x)) and np.array_equal(bits(h), bits(want_h))


def test_route_plan_is_route_then_pairs(libs):
    """ms_route_plan (the fast decode step's router) = ms_route into the given arrays, then ms_moe_pairs of its
    choice: the ids, weights and pair arrays of kernels.route and MoEPairs.plan."""
    n_exp, top_k = 64, 6
    logits = torch.randn(1, n_exp, generator=torch.Generator().manual_seed(9))
    tabs = np.arange(3 * n_exp, dtype=np.int64).reshape(3, n_exp) * 64
    for lib in libs.values():
        want_ids, want_w = kernels.route(logits, top_k, kernels.GATING_SOFTMAX, norm=True, lib=lib)
        want = kernels.MoEPairs(n_exp, 3, lib=lib)
        n_want = want.plan(want_ids, want_w, tabs)
        got = kernels.MoEPairs(n_exp, 3, lib=lib)
        ids, w = torch.empty(1, top_k, dtype=torch.int64), torch.empty(1, top_k)
        count, experts, start, tok, pw, dst, addr = got.ptrs
        n = lib.ms_route_plan(1, n_exp, logits.data_ptr(), kernels.GATING_SOFTMAX, None, 1, 1, top_k, 1, 0.0, 1.0,
                              ids.data_ptr(), w.data_ptr(), tabs.ctypes.data, 3, count, experts, start, tok, pw, dst,
                              addr, got.cap, 1)
        assert n == n_want == top_k and torch.equal(ids, want_ids) and np.array_equal(bits(w), bits(want_w))
        for name in ("experts", "start", "tok", "w", "dst"):
            assert np.array_equal(getattr(got, name)[:top_k], getattr(want, name)[:top_k]), name
        assert np.array_equal(got.addr[:, :n], want.addr[:, :n])


@pytest.mark.parametrize("ggml_type,block,size,scales", [(8, 32, 34, [0]), (12, 256, 144, [0, 2]),
                                                         (14, 256, 210, [208]), (30, 1, 2, [])])
def test_dequant_rows_is_quant_dequantize(libs, ggml_type, block, size, scales):
    """kernels.dequant_rows (embedding rows) = quant.dequantize of those rows (itself gguf.quants' arithmetic), bit
    for bit, on random blocks (finite fp16 scales, subnormal ones included); ids out of range or another type: None
    (the caller's own path)."""
    from moestream import quant

    n_rows, n_cols = 40, 512
    rng = np.random.default_rng(ggml_type)
    raw = rng.integers(0, 256, size=(n_rows, n_cols // block, size), dtype=np.uint8)
    for off in scales:
        raw[..., off + 1] &= 0xBF  # fp16 exponent below all-ones: finite
    raw = torch.from_numpy(raw.reshape(n_rows, -1).copy())
    ids = torch.tensor([3, 0, 39, 3, 17])
    want = quant.dequantize(raw[ids], ggml_type, n_cols)
    for lib in libs.values():
        got = kernels.dequant_rows(raw, ggml_type, n_cols, ids, lib=lib)
        assert np.array_equal(bits(got), bits(want))
        assert kernels.dequant_rows(raw, ggml_type, n_cols, torch.tensor([40]), lib=lib) is None
    assert kernels.dequant_rows(raw, 2, n_cols, ids) is None  # Q4_0: decoded by quant.py


# --- the gated delta rule's recurrent step ---------------------------------------------------------------------

def ref_delta_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                   s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """csrc/stepkern.c's ms_delta_step in numpy float32: value head h reads key head h % n_k; S' = decay S;
    kv = sum_i S'[i] k[i] in i order from +0; delta = (v - kv) beta; S = S' + k delta^T; o = sum_i S[i] q[i].
    Returns (o [n_v, d_v], the new S)."""
    n_v, d_k, _ = s.shape
    kh = np.arange(n_v) % q.shape[0]
    qh, kk = q[kh], k[kh]  # [n_v, d_k]
    s1 = decay[:, None, None] * s
    kv = np.zeros(v.shape, dtype=F32)
    for i in range(d_k):
        kv = kv + s1[:, i, :] * kk[:, i, None]
    delta = (v - kv) * beta[:, None]
    s2 = s1 + kk[:, :, None] * delta[:, None, :]
    o = np.zeros(v.shape, dtype=F32)
    for i in range(d_k):
        o = o + s2[:, i, :] * qh[:, i, None]
    return o, s2


@pytest.mark.parametrize("n_v, n_k, d_k, d_v", [(4, 2, 64, 64), (32, 16, 128, 128), (3, 3, 24, 40), (6, 2, 8, 72)])
def test_delta_step_bitwise(libs, n_v, n_k, d_k, d_v):
    """ms_delta_step equals its numpy reference bit for bit (every build, 1 and 8 threads), and transformers'
    recurrence as this project writes it in torch (models/qwen35moe.gated_delta_rule, the key heads repeated)
    within float32 rounding."""
    from moestream.models.qwen35moe import gated_delta_rule, l2_norm

    g = torch.Generator().manual_seed(n_v * 1000 + d_k)
    q = l2_norm(torch.randn(n_k, d_k, generator=g)) * d_k ** -0.5
    k = l2_norm(torch.randn(n_k, d_k, generator=g))
    v = torch.randn(n_v, d_v, generator=g)
    log_decay = -torch.rand(n_v, generator=g) * 3
    beta = torch.rand(n_v, generator=g)
    s0 = torch.randn(n_v, d_k, d_v, generator=g) * 0.2
    o_ref, s_ref = ref_delta_step(q.numpy(), k.numpy(), v.numpy(), log_decay.exp().numpy(), beta.numpy(), s0.numpy())

    def run(lib):  # noqa: ANN001
        s = s0.clone()
        return kernels.delta_step(q, k, v, log_decay.exp(), beta, s, lib), s

    for o, s in each_build_and_threads(libs, run):
        assert np.array_equal(bits(o), bits(o_ref)) and np.array_equal(bits(s), bits(s_ref))
    s_t = s0.clone()
    rep = n_v // n_k
    o_t = gated_delta_rule(q.repeat(rep, 1)[None], k.repeat(rep, 1)[None], v[None], log_decay[None], beta[None], s_t)
    torch.testing.assert_close(torch.from_numpy(o_ref), o_t[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(s_ref), s_t, rtol=1e-5, atol=1e-5)


def test_delta_step_refuses_shapes_that_do_not_fit(libs):
    z = torch.zeros
    with pytest.raises(ValueError, match="do not fit"):  # 3 value heads over 2 key heads
        kernels.delta_step(z(2, 8), z(2, 8), z(3, 8), z(3), z(3), z(3, 8, 8))
    with pytest.raises(ValueError, match="do not fit"):  # the state's d_k is not q's
        kernels.delta_step(z(2, 8), z(2, 8), z(2, 8), z(2), z(2), z(2, 4, 8))


def log1pf(a: np.ndarray) -> np.ndarray:
    fn = _LIBM.log1pf
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    flat = np.asarray(a, dtype=F32).ravel()
    return np.array([fn(float(v)) for v in flat], dtype=F32).reshape(np.shape(a))


def ref_dnet_decode(qkv, st, w, beta_raw, alpha_raw, dt, a, s, z, norm_w, eps, n_k):  # noqa: ANN001, ANN201
    """ms_dnet_decode in numpy float32, operation by operation as csrc/stepkern.c writes it; returns (out, the new
    conv state, the new recurrent state)."""
    n_v, d_k, d_v = s.shape
    k_w = w.shape[1]
    acc = np.zeros(qkv.shape, dtype=F32)
    for j in range(k_w - 1):
        acc = acc + w[:, j] * st[j]
    acc = acc + w[:, k_w - 1] * qkv
    new_st = np.concatenate((st[1:], qkv[None]), axis=0)
    one = F32(1)
    y = acc / (one + expf(-acc))

    def l2(x: np.ndarray, mul: np.float32) -> np.ndarray:  # [heads, d]: the sum in float32, in order
        sq = np.zeros(x.shape[0], dtype=F32)
        for i in range(x.shape[1]):
            sq = sq + x[:, i] * x[:, i]
        r = one / np.sqrt(sq + F32(1e-6))
        return (x * r[:, None]) * mul

    kd = n_k * d_k
    q = l2(y[:kd].reshape(n_k, d_k), one / np.sqrt(F32(d_k)))
    k = l2(y[kd:2 * kd].reshape(n_k, d_k), one)
    v = y[2 * kd:].reshape(n_v, d_v)
    beta = one / (one + expf(-beta_raw))
    x = alpha_raw + dt
    sp = np.where(x > F32(20), x, log1pf(expf(x)))
    decay = expf(a * sp)
    o, s2 = ref_delta_step(q, k, v, decay, beta, s)
    o = ref_rms_norm(o, norm_w, eps)
    zz = z.reshape(n_v, d_v)
    return (o * (zz / (one + expf(-zz)))).reshape(-1), new_st, s2


@pytest.mark.parametrize("n_v, n_k, d_k, d_v, k_w", [(4, 2, 16, 16, 4), (6, 3, 8, 24, 4), (2, 2, 8, 8, 2),
                                                      (32, 16, 128, 128, 4)])
def test_dnet_decode_bitwise_and_as_the_torch_layer(libs, n_v, n_k, d_k, d_v, k_w):
    """ms_dnet_decode equals its numpy reference bit for bit (every build, 1 and 8 threads: conv state, recurrent
    state, output), and the torch ops it replaces (models/qwen35moe.py's prefill path run on one token: conv1d,
    SiLU, l2_norm, sigmoid, softplus, the recurrence, the gated RMSNorm) within float32 rounding; alpha + dt
    past softplus's threshold of 20 included."""
    from moestream.models.qwen35moe import causal_conv1d, gated_delta_rule, l2_norm

    conv_dim = 2 * n_k * d_k + n_v * d_v
    g = torch.Generator().manual_seed(conv_dim + k_w)
    qkv = torch.randn(conv_dim, generator=g)
    st = torch.randn(k_w - 1, conv_dim, generator=g)
    w = torch.randn(conv_dim, k_w, generator=g) * 0.5
    beta_raw, alpha_raw = torch.randn(n_v, generator=g), torch.randn(n_v, generator=g) * 4
    alpha_raw[0] = 25.0  # softplus(x) = x past 20
    dt, a = torch.randn(n_v, generator=g), -torch.rand(n_v, generator=g)
    s0 = torch.randn(n_v, d_k, d_v, generator=g) * 0.2
    z, norm_w = torch.randn(n_v * d_v, generator=g), torch.rand(d_v, generator=g) + 0.5
    eps = 1e-6
    want = ref_dnet_decode(*(t.numpy() for t in (qkv, st, w, beta_raw, alpha_raw, dt, a, s0, z, norm_w)), eps, n_k)

    def run(lib):  # noqa: ANN001
        q, c, s = qkv.clone(), st.clone(), s0.clone()
        return kernels.dnet_decode(q, c, w, beta_raw, alpha_raw, dt, a, s, z, norm_w, eps, n_k, lib), c, s

    for got in each_build_and_threads(libs, run):
        for x, y in zip(got, want, strict=True):
            assert np.array_equal(bits(x), bits(y))
    # the torch layer's arithmetic on the same values (qwen35moe.delta_net's prefill path, T = 1)
    c_t, s_t = st.clone(), s0.clone()
    y = torch.nn.functional.silu(causal_conv1d(qkv[None], c_t, w))
    kd, rep = n_k * d_k, n_v // n_k
    q = l2_norm(y[:, :kd].reshape(1, n_k, d_k)).repeat(1, rep, 1) * (1.0 / math.sqrt(d_k))
    k = l2_norm(y[:, kd:2 * kd].reshape(1, n_k, d_k)).repeat(1, rep, 1)
    gl = a * torch.nn.functional.softplus(alpha_raw + dt)
    o = gated_delta_rule(q, k, y[:, 2 * kd:].reshape(1, n_v, d_v), gl[None], torch.sigmoid(beta_raw)[None], s_t)
    o = layers.rms_norm(o, norm_w, eps) * torch.nn.functional.silu(z.view(1, n_v, d_v))
    assert torch.equal(c_t, torch.from_numpy(want[1]))  # the conv state is copies of inputs
    torch.testing.assert_close(torch.from_numpy(want[2]), s_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(want[0]), o.reshape(-1), rtol=1e-5, atol=1e-5)


def test_dnet_decode_refuses_sizes_that_do_not_fit(libs):
    z = torch.zeros
    with pytest.raises(ValueError, match="do not fit"):  # conv_dim is not 2 n_k d_k + n_v d_v
        kernels.dnet_decode(z(40), z(3, 40), z(40, 4), z(2), z(2), z(2), z(2), z(2, 8, 8), z(16), z(8), 1e-6, 1)
