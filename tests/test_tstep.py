"""moestream.gpu.tstep: the decode step's attention kernels (norm + RoPE + cache rows, attention over 0..pos).

Where CUDA is available and ``TRITON_INTERPRET`` is not set by the user, the kernel tests run on CUDA tensors;
otherwise ``TRITON_INTERPRET=1`` is set here, before triton is imported, and they run on CPU tensors through
Triton's interpreter (numpy). Shapes: the published configs' head counts shrunk (8 query heads, 2 KV heads,
head dim 64; MLA: one KV head of 80 dims whose first 64 are the values; a group of 20 heads: two head blocks).

Bars, against float64 references of the same formulas (u = 2**-24, float32's unit roundoff):

- norm + RoPE: the sum of squares of d positive terms is within gamma_d = d u / (1 - d u) of its value (any
  order), so rsqrt(mean + eps) is within gamma_d / 2 + 4 u (the rsqrt itself: <= 2 ulps on the GPU, exact
  rounding in numpy), times x and w two more roundings, and the rotation ``xn * cos + xn' * sin`` three:
  |y - y64| <= (gamma_d / 2 + 9 u) (|xn cos| + |xn' sin|). The test uses (d + 16) u (...) (twice that; the
  tables are float32 in both). Without a norm the rotation is the torch code's arithmetic: bit for bit.
- attention: a score s_j = scale q.k_j is within ds_j = (gamma_d + u) scale sum_i |q_i k_ji| of its value; the
  weights exp(s_j - m) / l are then within a relative 2 max_j ds_j + (4 + n) u (exp's rounding and, on the GPU,
  ex2.approx's 2 ulps plus the rounding of (s - m) log2 e: u |s_j - m|; the n-term sum l), and the weighted sum of
  n value rows adds gamma_n sum_j p_j |v_j|: |o - o64| <= (2 max ds + (8 + 2 n + 2 max|s - m|) u) max_j |v_j|.
  The torch reference (layers.attention_at, float32) is checked against the same bar, so it is not tighter
  than what torch itself achieves.

Exact properties: the cache rows at ``pos`` are written and no other row is touched; keys past ``pos`` (and
before the window) never influence the result (poisoned with NaN and 1e30, the bits do not change); two runs
give the same bits.

Model level: the default model and the family fixtures decoded through the device step (runtime/runner.py's
``decode_device``, graphs off: the code a CUDA graph captures) with the kernels under the interpreter, within
1e-5 of the largest logit of the usual CPU forward (as tests/test_gpu_path.py's bar: the same float32 model,
attention and norms summed in other orders).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tstep imports it)

pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from conftest import DEFAULT_GGUF  # noqa: E402
from helpers import logits_of  # noqa: E402
from moestream.engine import Engine  # noqa: E402
from moestream.gpu import tstep  # noqa: E402
from moestream.models.base import LoadOptions, load_model  # noqa: E402
from moestream.models.layers import Rope, attention_at, rope_at, rope_inv_freq  # noqa: E402
from moestream.runtime.step import Seq, Step  # noqa: E402

U = 2.0 ** -24
DEV = "cuda" if ON_CUDA else "cpu"
N_HEAD, N_KV, D = 8, 2, 64


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(tstep, "ON_CPU", True)
    monkeypatch.setattr(tstep, "ENABLED", True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEV)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().view(torch.int32).cpu()


def _rope(n_rot: int, interleaved: bool, n_pos: int = 300) -> Rope:
    r = Rope(rope_inv_freq(10000.0, n_rot, DEV), interleaved=interleaved)
    r.reserve(n_pos)
    return r


def _partner(n_rot: int, d: int, interleaved: bool) -> torch.Tensor:
    i = torch.arange(d)
    if interleaved:
        p = i ^ 1
    else:
        p = torch.where(i < n_rot // 2, i + n_rot // 2, i - n_rot // 2)
    return torch.where(i < n_rot, p, i)


def _norm_rope64(x: torch.Tensor, w: torch.Tensor | None, eps: float, rope: Rope, pos: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 norm + RoPE of x [1, H, d] and the bar of the module docstring."""
    x64 = x.double().cpu()
    d, n_rot = x.shape[-1], rope.n_rot
    if w is not None:
        x64 = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double().cpu()
    cos = torch.ones(d, dtype=torch.float64)
    sin = torch.zeros(d, dtype=torch.float64)
    cos[:n_rot], sin[:n_rot] = rope.cos[pos].double().cpu(), rope.sin[pos].double().cpu()
    xp = x64[..., _partner(n_rot, d, rope.interleaved)]
    y = x64 * cos + xp * sin
    return y, (d + 16) * U * ((x64 * cos).abs() + (xp * sin).abs()) + 1e-30


def _assert_within(got: torch.Tensor, want: torch.Tensor, bar: torch.Tensor, what: str) -> None:
    err = (got.double().cpu() - want).abs()
    worst = float((err / bar).max())
    assert worst <= 1.0, f"{what}: error {float(err.max()):.3g}, {worst:.3g} of the bar"


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("n_rot", [D, D // 2], ids=["full", "partial"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_norm_rope_store(interleaved: bool, n_rot: int, norm: bool) -> None:
    rope = _rope(n_rot, interleaved)
    p = 137
    pos = torch.tensor([p], device=DEV)
    qg = _randn(1, N_HEAD, 2 * D, seed=1)  # q a strided view (qwen35moe's gated q: head stride 2 d)
    q = qg[..., :D]
    k, v = _randn(1, N_KV, D, seed=2), _randn(1, N_KV, D, seed=3)
    qw = (torch.rand(D, generator=_gen(4)) + 0.5).to(DEV) if norm else None
    kw = (torch.rand(D, generator=_gen(5)) + 0.5).to(DEV) if norm else None
    kc, vc = _randn(300, N_KV, D, seed=6), _randn(300, N_KV, D, seed=7)
    kc0, vc0 = kc.clone(), vc.clone()
    eps = 1e-6
    qo = tstep.norm_rope_store(rope, pos, q, k, v, kc, vc, qw, kw, eps)
    assert qo.shape == q.shape and qo.is_contiguous()
    for got, x, w, what in ((qo, q, qw, "q"), (kc[p:p + 1], k, kw, "k")):
        want, bar = _norm_rope64(x, w, eps, rope, p)
        _assert_within(got, want, bar, what)
        if w is None:  # the rotation alone is the torch code's arithmetic
            assert torch.equal(_bits(got), _bits(rope_at(rope, x, pos))), what
        else:  # torch's own float32 reference meets the same bar
            _assert_within(rope_at(rope, torch.rms_norm(x, (D,), w, eps), pos), want, bar, f"torch {what}")
    assert torch.equal(_bits(vc[p]), _bits(v[0]))
    rest = torch.arange(300, device=DEV) != p
    assert torch.equal(_bits(kc[rest]), _bits(kc0[rest])) and torch.equal(_bits(vc[rest]), _bits(vc0[rest]))


def test_norm_rope_store_pieces_and_determinism() -> None:
    """q alone, k alone (Step.rope, Step.rope_into) give the bits of the fused call; two runs the same bits."""
    rope = _rope(D, False)
    pos = torch.tensor([5], device=DEV)
    q, k, v = _randn(1, N_HEAD, D, seed=1), _randn(1, N_KV, D, seed=2), _randn(1, N_KV, D, seed=3)
    qw, kw = _randn(D, seed=4), _randn(D, seed=5)
    kc, vc = torch.zeros(16, N_KV, D, device=DEV), torch.zeros(16, N_KV, D, device=DEV)
    qo = tstep.norm_rope_store(rope, pos, q, k, v, kc, vc, qw, kw, 1e-5)
    kc2, vc2 = kc.clone(), vc.clone()
    assert torch.equal(_bits(tstep.norm_rope_store(rope, pos, q, k, v, kc2, vc2, qw, kw, 1e-5)), _bits(qo))
    assert torch.equal(_bits(kc2), _bits(kc)) and torch.equal(_bits(vc2), _bits(vc))
    assert torch.equal(_bits(tstep.norm_rope_store(rope, pos, q=q, q_norm=qw, eps=1e-5)), _bits(qo))
    kc3 = torch.zeros_like(kc)
    assert tstep.norm_rope_store(rope, pos, k=k, k_cache=kc3, k_norm=kw, eps=1e-5) is None
    assert torch.equal(_bits(kc3), _bits(kc))


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float, window: int | None,
                 sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of q [1, H, d] over k [S, n_kv, d], v [S, n_kv, dv] rows 0..pos, and its bar."""
    n_head, d = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    lo = 0 if window is None else max(0, pos - window + 1)
    q64 = q.double().cpu().view(n_kv, n_head // n_kv, d)
    k64, v64 = k[lo:pos + 1].double().cpu(), v[lo:pos + 1].double().cpu()
    n = pos + 1 - lo
    s = torch.einsum("kgd,nkd->kgn", q64, k64) * scale
    ds = (d * U / (1 - d * U) + U) * scale * torch.einsum("kgd,nkd->kgn", q64.abs(), k64.abs())
    if sinks is not None:
        s = torch.cat((s, sinks.double().cpu().view(n_kv, -1, 1)), dim=-1)
        ds = torch.cat((ds, torch.zeros_like(ds[..., :1])), dim=-1)
    m = s.max(-1, keepdim=True).values
    p = torch.softmax(s, dim=-1)[..., :n]
    o = torch.einsum("kgn,nkd->kgd", p, v64).reshape(1, -1)
    vmax = v64.abs().amax(dim=(0, 2)).view(n_kv, 1, 1)  # per KV head
    rel = 2 * ds.amax(-1, keepdim=True) + (8 + 2 * n + 2 * (s - m).abs().amax(-1, keepdim=True)) * U
    bar = (rel * vmax).expand(n_kv, n_head // n_kv, v.shape[2]).reshape(1, -1)
    return o, bar + 1e-30


CASES = [  # (n_head, n_kv, d, v_dim or None, window, sinks)
    (N_HEAD, N_KV, D, None, None, False),
    (N_HEAD, N_KV, D, None, 16, False),  # sliding window (gemma4, gpt-oss)
    (N_HEAD, N_KV, D, None, 40, True),  # window and sinks (gpt-oss)
    (N_HEAD, N_KV, D, None, None, True),
    (N_HEAD, 1, 80, 64, None, False),  # MLA absorbed: one KV head, the values its first 64 dims (deepseek2)
    (20, 1, 32, None, None, False),  # a group of 20: two head blocks of BLOCK_G
    (N_HEAD, 1, 288, 256, 24, False),  # wide heads (the 16-key blocks of attn_config), MLA form, a window
]
CASE_IDS = ["gqa", "window", "window-sinks", "sinks", "mla", "group20", "wide"]


def _case_tensors(n_head: int, n_kv: int, d: int, v_dim: int | None, n_rows: int, seed: int):  # noqa: ANN202
    q = _randn(1, n_head, d, seed=seed)
    k = _randn(n_rows, n_kv, d, seed=seed + 1)
    v = None if v_dim is not None else _randn(n_rows, n_kv, d, seed=seed + 2) * 3
    return q, k, v


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n_keys", [256, 1024], ids=["keys256", "split1024"])
def test_decode_attention_vs_reference(case: tuple, n_keys: int) -> None:
    n_head, n_kv, d, v_dim, window, has_sinks = case
    q, k, v = _case_tensors(n_head, n_kv, d, v_dim, n_keys, 10)
    sinks = _randn(n_head, seed=20) if has_sinks else None
    vals = k[..., :v_dim] if v_dim is not None else v
    scale = 1.0 / math.sqrt(d)
    kpos = torch.arange(n_keys, device=DEV)
    for p in (0, 37, n_keys - 1) if n_keys == 256 else (3, 700):
        pos = torch.tensor([p], device=DEV)
        got = tstep.decode_attention(q, k, v, pos, n_keys, scale, window, sinks, v_dim)
        want, bar = _attention64(q, k, vals, p, scale, window, sinks)
        _assert_within(got, want, bar, f"pos {p}")
        ref = attention_at(q, k, vals, pos, kpos, scale, window, sinks)
        _assert_within(ref, want, bar, f"torch attention_at, pos {p}")
        again = tstep.decode_attention(q, k, v, pos, n_keys, scale, window, sinks, v_dim)
        assert torch.equal(_bits(again), _bits(got)), f"pos {p}: two runs differ"


@pytest.mark.parametrize("case", CASES[:5], ids=["gqa", "window", "window-sinks", "sinks", "mla"])
def test_decode_attention_masking_is_exact(case: tuple) -> None:
    """Rows past pos (and before the window) poisoned with NaN and 1e30 change no bit, at one split and four."""
    n_head, n_kv, d, v_dim, window, has_sinks = case
    sinks = _randn(n_head, seed=20) if has_sinks else None
    for n_keys, p in ((256, 70), (1024, 300)):
        q, k, v = _case_tensors(n_head, n_kv, d, v_dim, n_keys + 8, 30)
        pos = torch.tensor([p], device=DEV)
        clean = tstep.decode_attention(q, k[:n_keys], None if v is None else v[:n_keys], pos, n_keys, 0.125,
                                       window, sinks, v_dim)
        lo = 0 if window is None else p - window + 1
        for poison in (float("nan"), 1e30, -1e30):
            kp = k.clone()
            kp[p + 1:] = poison
            kp[:lo] = poison
            vp = None
            if v is not None:
                vp = v.clone()
                vp[p + 1:] = poison
                vp[:lo] = poison
            got = tstep.decode_attention(q, kp[:n_keys], None if vp is None else vp[:n_keys], pos, n_keys, 0.125,
                                         window, sinks, v_dim)
            assert torch.equal(_bits(got), _bits(clean)), (n_keys, poison)


def test_splits_cover_the_keys() -> None:
    for block_n in (tstep.BLOCK_N, tstep.BLOCK_N_WIDE):
        for n_keys in (1, 31, 256, 257, 1000, 4096, 65536, 1 << 20):
            n, chunk = tstep.splits(n_keys, block_n)
            assert chunk % block_n == 0 and n * chunk >= n_keys and (n - 1) * chunk < n_keys
            assert n <= tstep.MAX_SPLITS and (n == 1) == (n_keys <= tstep.SPLIT_KEYS)


#: (n_head, n_kv, d, dv) of published configs: Qwen3-30B-A3B, GPT-OSS, Gemma 4 global layers, DeepSeek MLA
COMPILED = [(32, 4, 128, 128), (64, 8, 64, 64), (16, 2, 512, 512), (16, 1, 576, 512)]

#: compiles the kernels for sm_90 in a process without TRITON_INTERPRET (where @triton.jit gives real
#: JITFunctions) and prints one JSON line: {"skip": why} or {"shape": [shared bytes, spilled], ...}
_COMPILE_SCRIPT = r"""
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moestream.gpu import tstep
    target = GPUTarget("cuda", 90, 32)
    triton.compile(ASTSource(tstep._combine_kernel, {n: "constexpr" if n.isupper() else "*fp32"
                                                     for n in tstep._combine_kernel.arg_names},
                             dict(N_HEAD=8, DV=64, N_SPLIT=4, BLOCK_S=4, BLOCK_DV=64, HAS_SINKS=True)),
                   target=target, options=dict(num_warps=1, enable_fp_fusion=False))
except Exception as e:
    print(json.dumps({"skip": f"{type(e).__name__}: {str(e)[:200]}"}))
    sys.exit(0)
out = {}
ints = {"k_rs", "k_hs", "v_rs", "v_hs", "window", "chunk"}
for n_head, n_kv, d, dv in json.loads(sys.argv[1]):
    cfg = tstep.attn_config(d, dv)
    for n_split in (1, 4):
        const = dict(N_HEAD=n_head, GROUP=n_head // n_kv, D=d, DV=dv, N_SPLIT=n_split, HAS_WINDOW=True,
                     HAS_SINKS=True, LOOP_WHILE=False, **{k: v for k, v in cfg.items() if k.isupper()})
        sig = {n: "constexpr" if n in const else "i32" if n in ints else "fp32" if n == "scale" else
               "*i64" if n == "pos_ptr" else "*fp32" for n in tstep._decode_attn_kernel.arg_names}
        k = triton.compile(ASTSource(tstep._decode_attn_kernel, sig, const), target=target,
                           options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                        enable_fp_fusion=False))
        out[f"{n_head}x{n_kv}x{d}x{dv}/{n_split}"] = [k.metadata.shared, "st.local" in k.asm["ptx"]]
    const = dict(N_Q=n_head, N_K=n_kv, HAS_V=True, D=d, DV=dv, N_ROT=d // 2, INTERLEAVED=False, Q_NORM=True,
                 K_NORM=True, BLOCK_D=tstep._pow2(d), BLOCK_DV=tstep._pow2(dv))
    sig = {n: "constexpr" if n in const else "i32" if n.endswith(("_hs", "_rs")) else "fp32" if n == "eps" else
           "*i64" if n == "pos_ptr" else "*fp32" for n in tstep._norm_rope_store_kernel.arg_names}
    k = triton.compile(ASTSource(tstep._norm_rope_store_kernel, sig, const), target=target,
                       options=dict(num_warps=1 if max(d, dv) <= 128 else 4, enable_fp_fusion=False))
    out[f"{n_head}x{n_kv}x{d}x{dv}/norm_rope_store"] = [k.metadata.shared, "st.local" in k.asm["ptx"]]
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90() -> None:
    """The GPU form of the kernels (the ``for`` loop over key blocks that the interpreter cannot run) compiles
    for an H100/H200 (sm_90) with its launch configuration, within the 227 KiB of shared memory a block may use
    and without register spills (no local stores in the PTX), for the published head shapes: compiled to a cubin
    by Triton's own ptxas in a child process without TRITON_INTERPRET; no GPU needed (skipped where this triton
    has no CUDA backend)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(COMPILED)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot compile for sm_90 here: {out['skip']}")
    assert len(out) == 3 * len(COMPILED)
    for what, (shared, spills) in out.items():
        assert shared <= 227 * 1024 and not spills, (what, shared, spills)


def test_step_device_branches_use_the_kernels(monkeypatch) -> None:  # noqa: ANN001
    """Step's device branches (cached_attention, rope, rope_into, attend with v_dim) through the kernels: the
    same cache rows and outputs as the torch ops (tstep off) within the bars; rows other than pos untouched."""
    class Cache:
        def __init__(self) -> None:
            self.k = [_randn(64, N_KV, D, seed=40)]
            self.v = [_randn(64, N_KV, D, seed=41)]

    def run(on: bool) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(tstep, "ENABLED", on)
        cache = Cache()
        step = Step(torch.tensor([1]), [Seq(cache, -1, 1)], pos=torch.tensor([9], device=DEV), n_keys=32,
                    kpos=torch.arange(32, device=DEV))
        rope = _rope(D, False, 64)
        q, k, v = _randn(1, N_HEAD, D, seed=1), _randn(1, N_KV, D, seed=2), _randn(1, N_KV, D, seed=3)
        a = step.cached_attention(q.clone(), k, v, rope, 0, 0.125, q_norm=_randn(D, seed=4),
                                  k_norm=_randn(D, seed=5), eps=1e-6)
        r = step.rope(rope, q)
        step.rope_into(rope, k, "k", 0)
        b = step.attend(q, 0, 0.125, window=4, v_dim=D // 2)
        return a, r, b, cache.k[0], cache.v[0]

    calls = []
    for name in ("norm_rope_store", "decode_attention"):
        real = getattr(tstep, name)
        monkeypatch.setattr(tstep, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    on = run(True)
    assert calls == ["norm_rope_store", "decode_attention", "norm_rope_store", "norm_rope_store",
                     "decode_attention"]
    calls.clear()
    off = run(False)
    assert not calls
    for i, (g, w) in enumerate(zip(on, off, strict=True)):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max()), i
    rest = torch.arange(64, device=DEV) != 9
    assert torch.equal(_bits(on[3][rest]), _bits(Cache().k[0][rest]))
    assert torch.equal(_bits(on[4][rest]), _bits(Cache().v[0][rest]))


# --- model level ------------------------------------------------------------------------------------------
IDS = [1, 5, 9, 200, 7, 3]


def _device_decode(model, ids: list[int], steps: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Prefill ``ids``, then ``steps`` greedy steps through Runner.decode_device with graphs off (the eager run of
    the code a CUDA graph captures: device position, attention over decode_keys rows)."""
    runner = model.runner
    runner.graphs.off_reason = "CPU test: no CUDA graphs"
    ids = [i % model.n_vocab for i in ids]
    eng = Engine(model, 8)
    cache = model.new_cache(len(ids) + steps)
    out = [eng.prefill(ids, cache)]
    tok = int(out[0][-1].argmax())
    for i in range(steps):
        with torch.inference_mode():
            logits = runner.decode_device(torch.tensor([tok]), len(ids) + i, cache)
        out.append(logits)
        tok = int(logits[0].argmax())
    return out


def _check_model(path: str, steps: int, monkeypatch) -> None:  # noqa: ANN001
    if ON_CUDA:
        pytest.skip("CPU tensors under the interpreter; tests/test_cuda.py runs the model on the GPU")
    calls = []
    real = tstep.decode_attention
    monkeypatch.setattr(tstep, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = load_model(path, LoadOptions(moe_stream=False, matmul="dequant"))
    got = _device_decode(model, IDS, steps)
    assert calls, "the device step never reached the kernels"
    ref = load_model(path, LoadOptions(moe_stream=False, matmul="dequant"))
    want = logits_of(ref, [i % ref.n_vocab for i in IDS], steps, 8)
    for step, (g, w) in enumerate(zip(got[1:], want[1:], strict=True)):
        assert int(g.argmax()) == int(w.argmax()), step
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max()), step


def test_default_model_device_step(monkeypatch) -> None:  # noqa: ANN001
    _check_model(str(DEFAULT_GGUF), 4, monkeypatch)


@pytest.mark.parametrize("fixture", ["gemma4-tiny", "deepseek2-tiny", "gpt-oss-tiny", "qwen35moe-tiny",
                                     "glm4moe-qknorm-tiny", "olmoe-tiny"])
def test_family_device_step(fixture: str, monkeypatch, request) -> None:  # noqa: ANN001
    """Every attention pattern: gemma4 (window, its own norms, partial RoPE, shared-KV layers: Step.rope,
    rope_into, attend), deepseek2 (MLA: interleaved RoPE of the rope dims, attend with v_dim), gpt-oss (sinks,
    window), qwen35moe (gated attention between DeltaNet layers, q a strided view), glm4moe (per-head norms in
    the kernel, partial RoPE), olmoe (norms over the whole projection, before the call)."""
    if ON_CUDA:  # before the fixture: a GPU machine may have no network to build it
        pytest.skip("CPU tensors under the interpreter; tests/test_cuda.py runs the families on the GPU")
    fixtures_tool = request.getfixturevalue("fixtures_tool")
    _check_model(str(fixtures_tool.build_fixture(fixture)["f32"]), 3, monkeypatch)
