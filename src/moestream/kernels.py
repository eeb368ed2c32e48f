"""moestream's CPU kernels (``csrc/moekern.c``): matmuls on ggml blocks as stored, and one call per MoE layer;
and the step kernels (``csrc/stepkern.c``, the same library): RMSNorm, RoPE, attention over the KV cache and the
router, the operations of a forward step between the matmuls (:func:`rms_norm`, :func:`rope`, :func:`attention`,
:func:`route`).

The C source is the project's own; it is compiled on the user's machine at first use (once per ISA with gcc or
clang: 10.7-35.8 s for AVX-512 on a busy 2-core machine, most of it moekern.c) and cached under
``~/.cache/moestream/kernels/`` (``$XDG_CACHE_HOME`` respected), keyed by the source, the compiler and the flags,
then loaded with ctypes (no Python headers needed). Calls release the GIL, so expert reads keep running on the IO
threads while a kernel computes.

The build is chosen at run time from the CPU: ``avx512`` (AVX-512 F/BW/VL + VNNI), ``avx2`` (AVX2 + FMA + F16C)
or ``portable`` (plain C, any CPU: ARM included). ``MOESTREAM_KERNELS=portable|avx2|avx512`` forces one.

Arithmetic, as ggml's CPU backend does it: each activation row is quantized once per matmul to 8-bit blocks
(Q8_0 blocks of 32 for weight types in blocks of 32, Q8_K super-blocks of 256 for the k-quants and IQ4_XS),
weight blocks are unpacked to int8 codes and integer scales, dot products are integer, scales are float.
F32 / F16 / BF16 weights meet float32 activations. Every output element is computed by one thread in a fixed
order, so the result does not depend on the thread count or on how tokens are grouped.

Errors: :class:`KernelBuildError` (one line: no compiler, or the compile failed and where its log is).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from .errors import MoestreamError

__all__ = ["KernelBuildError", "isa", "load", "linear", "moe", "set_threads", "threads", "supports", "computes",
           "linear_heads", "step_ops", "set_step_ops", "rms_norm", "rope", "attention", "route", "MoEPairs", "topk_sum",
           "attn_block", "first_nonfinite", "residual_norm", "linear_to", "moe_to",
           "dequant_rows"]

_SRC = Path(__file__).with_name("csrc")
_SOURCES = ("moekern.c", "iquants.h", "stepkern.c", "iokern.c")
_UNITS = ("moekern.c", "stepkern.c", "iokern.c")  # compiled into one library

# flags per ISA build; -ffp-contract=off: no fused multiply-add the source does not spell out
_ISA_FLAGS = {
    "portable": [],
    "avx2": ["-DMS_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DMS_ISA_AVX2", "-DMS_ISA_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512vnni"],
}
_BASE_FLAGS = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]

#: activation codes of :func:`moe`: SiLU(gate) * up; GELU-tanh(gate) * up; ggml's swiglu_oai with llama.cpp's
#: constants alpha 1.702, limit 7 (GPT-OSS: ``x = min(gate, 7)``, then
#: ``x / (1 + expf(1.702 * -x)) * (clamp(up, -7, 7) + 1)``, each operation rounded to float32)
ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI = 0, 1, 2
#: the constants ACT_SWIGLU_OAI computes with (csrc/moekern.c SWIGLU_OAI_ALPHA / SWIGLU_OAI_LIMIT)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


class KernelBuildError(MoestreamError):
    """The C kernels could not be compiled (no compiler, or a compile error): the message is one line."""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream" / "kernels"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def best_isa() -> str:
    """The fastest build this CPU runs (``MOESTREAM_KERNELS`` overrides): avx512, avx2 or portable."""
    forced = os.environ.get("MOESTREAM_KERNELS", "").strip().lower()
    if forced:
        if forced not in _ISA_FLAGS:
            raise KernelBuildError(f"MOESTREAM_KERNELS={forced!r}: choose one of {', '.join(_ISA_FLAGS)}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "portable"
    f = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"} <= f:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= f:
        return "avx2"
    return "portable"


def _compiler() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise KernelBuildError("no C compiler found (tried $CC, cc, gcc, clang): moestream compiles its CPU kernels "
                           "at first use; install one (Debian/Ubuntu: apt install gcc; Fedora: dnf install gcc; "
                           "macOS: xcode-select --install), or run with --matmul dequant")


def _build(which: str) -> Path:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} --version failed ({e}); set CC to a working C compiler") from None
    flags = _BASE_FLAGS + _ISA_FLAGS[which]
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_SRC / name).read_bytes())
    h.update(" ".join([cc, version, *flags, sys.platform]).encode())
    out_dir = _cache_root()
    lib = out_dir / f"moekern-{which}-{h.hexdigest()[:16]}.so"
    if _intact(lib):
        return lib
    print(f"moestream: compiling the CPU kernels ({which}) once (cached under {out_dir}) ...", file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel cache {out_dir}: {e.strerror or e}; set XDG_CACHE_HOME to a "
                               f"writable directory") from None
    log = out_dir / f"build-{which}.log"
    cmd = [cc, *flags, *(str(_SRC / u) for u in _UNITS), "-o", tmp, "-lm", "-lpthread"]
    what = " and ".join(str(_SRC / u) for u in _UNITS)
    try:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"compiling {what} with {cc} failed to start: {e}") from None
        if r.returncode != 0 or not os.path.isfile(tmp) or os.path.getsize(tmp) == 0:
            with contextlib.suppress(OSError):
                log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
            why = f"exit {r.returncode}" if r.returncode != 0 else "it wrote no library"
            raise KernelBuildError(f"compiling {what} with {cc} failed ({why}); the compiler's "
                                   f"messages are in {log}")
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, lib)  # atomic: concurrent builders each produce the same file
        Path(str(lib) + ".sha256").write_text(digest + "\n")
        _BUILT[0] += time.perf_counter() - t0
        print(f"moestream: compiled the CPU kernels in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel cache {out_dir}: {e.strerror or e}; set XDG_CACHE_HOME to a "
                               f"writable directory") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return lib


#: seconds this process spent compiling the kernels (:func:`build_seconds`)
_BUILT = [0.0]


def build_seconds() -> float:
    """Seconds this process spent compiling the C kernels (0 when the cached build was used)."""
    return _BUILT[0]


def _intact(lib: Path) -> bool:
    """A cached build is used only when its bytes match the digest written after it was built (a truncated or
    emptied file would crash the process when loaded: it is rebuilt instead)."""
    try:
        want = Path(str(lib) + ".sha256").read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError:
        return False


_LIBS: dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()
_THREADS = [0]  # 0: torch.get_num_threads()

_P, _I, _SZ, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_float


def load(which: str | None = None) -> ctypes.CDLL:
    """The kernel library of build ``which`` (default :func:`best_isa`), compiled at first use.

    Raises KernelBuildError (one line) when it cannot be built."""
    which = which or best_isa()
    with _LOCK:
        lib = _LIBS.get(which)
        if lib is None:
            lib = ctypes.CDLL(str(_build(which)))
            lib.ms_linear.argtypes = [_I, _P, _SZ, _I, _I, _P, _I, _P, _I]
            lib.ms_linear.restype = _I
            lib.ms_moe.argtypes = [_I, _I, _P, _P, _P, _SZ, _SZ, _I, _I, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I,
                                   _P, _I]
            lib.ms_moe.restype = _I
            lib.ms_quantize_rows.argtypes = [_I, _P, _I, _I, _P]
            lib.ms_quantize_rows.restype = None
            lib.ms_act_row_bytes.argtypes = [_I, _I]
            lib.ms_act_row_bytes.restype = _SZ
            lib.ms_block_size.argtypes = [_I]
            lib.ms_block_bytes.argtypes = [_I]
            lib.ms_set_table.argtypes = [_I, _P]
            lib.ms_set_table.restype = None
            _L = ctypes.c_long
            lib.ms_linear_heads.argtypes = [_I, _P, _SZ, _SZ, _I, _I, _I, _P, _L, _L, _I, _P, _L, _L, _I]
            lib.ms_linear_heads.restype = _I
            lib.ms_rms_norm.argtypes = [_L, _I, _P, _L, _P, _F, _P, _L, _I]
            lib.ms_rms_norm.restype = None
            lib.ms_rope.argtypes = [_I, _I, _I, _I, _I, _P, _L, _L, _P, _P, _P, _L, _L, _I]
            lib.ms_rope.restype = None
            lib.ms_attention.argtypes = [_I, _I, _I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _L, _I, _I, _P, _F, _F,
                                         _P, _L, _I]
            lib.ms_attention.restype = _I
            lib.ms_route.argtypes = [_I, _I, _P, _I, _P, _I, _I, _I, _I, _F, _F, _P, _P, _I]
            lib.ms_route.restype = _I
            lib.ms_moe_pairs.argtypes = [_I, _I, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _L]
            lib.ms_moe_pairs.restype = _I
            lib.ms_topk_sum.argtypes = [_I, _I, _I, _P, _P, _I]
            lib.ms_topk_sum.restype = None
            lib.ms_attn_block.argtypes = [_I, _I, _I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _P, _F, _I, _I,
                                          _P, _P, _P, _L, _L, _P, _L, _L, _I, _I, _P, _F, _F, _P, _L, _I]
            lib.ms_attn_block.restype = _I
            lib.ms_first_nonfinite.argtypes = [_P, _L]
            lib.ms_first_nonfinite.restype = _L
            lib.ms_residual_norm.argtypes = [_I, _I, _P, _P, _I, _P, _F, _P, _I]
            lib.ms_residual_norm.restype = None
            lib.ms_route_plan.argtypes = [_I, _I, _P, _I, _P, _I, _I, _I, _I, _F, _F, _P, _P, _P, _I, _P, _P, _P, _P,
                                          _P, _P, _P, _L, _I]
            lib.ms_route_plan.restype = _I
            lib.ms_delta_step.argtypes = [_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I]
            lib.ms_delta_step.restype = _I
            lib.ms_dnet_decode.argtypes = [_I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _F, _P,
                                           _I]
            lib.ms_dnet_decode.restype = _I
            lib.ms_dequant_rows.argtypes = [_I, _P, _L, _L, _P, _I, _I, _P]
            lib.ms_dequant_rows.restype = _I
            _L64 = ctypes.c_int64
            lib.ms_io_new.argtypes = [_I, _I, _I, _L64]
            lib.ms_io_new.restype = _P
            lib.ms_io_free.argtypes = [_P]
            lib.ms_io_free.restype = None
            lib.ms_io_submit.argtypes = [_P, _I, _P, _P]
            lib.ms_io_submit.restype = _I
            lib.ms_io_state.argtypes = [_P, _L64]
            lib.ms_io_state.restype = _I
            lib.ms_io_done_prefix.argtypes = [_P, _I, _P]
            lib.ms_io_done_prefix.restype = _I
            lib.ms_io_wait.argtypes = [_P, _I, _P]
            lib.ms_io_wait.restype = None
            lib.ms_io_cancel.argtypes = [_P, _L64]
            lib.ms_io_cancel.restype = _I
            lib.ms_io_result.argtypes = [_P, _L64, _P]
            lib.ms_io_result.restype = None
            lib.ms_io_promote.argtypes = [_P, _L64]
            lib.ms_io_promote.restype = _I
            lib.ms_slot_plan.argtypes = [_I, _I, _P, _P, _P, _P, _L64, _I, _P, _I, _P, _P, _P, _P]
            lib.ms_slot_plan.restype = _I
            lib.ms_io_release.argtypes = [_P, _L64]
            lib.ms_io_release.restype = None
            _set_tables(lib)
            _LIBS[which] = lib
        return lib


_TABLE_KEEP: list[np.ndarray] = []


def _set_tables(lib: ctypes.CDLL) -> None:
    """Hand the i-quant code books (format data of the pinned ``gguf`` package) to the C side."""
    from gguf import quants as q

    def grid_bytes(cls: type) -> np.ndarray:
        cls.init_grid()
        g = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)).astype(np.int8)  # values fit int8
        return g

    tables = [grid_bytes(q.IQ2_XXS), grid_bytes(q.IQ2_XS), grid_bytes(q.IQ2_S), grid_bytes(q.IQ3_XXS),
              grid_bytes(q.IQ3_S), grid_bytes(q.IQ1_S), np.frombuffer(bytes(q.IQ2_XXS.ksigns), dtype=np.uint8)]
    for i, t in enumerate(tables):
        t = np.ascontiguousarray(t)
        _TABLE_KEEP.append(t)
        lib.ms_set_table(i, t.ctypes.data)


def isa() -> str:
    """The build the kernels run (see :func:`best_isa`)."""
    return best_isa()


def set_threads(n: int) -> None:
    """Kernel threads for every later call (``-t``); 0 = torch's intra-op thread count."""
    _THREADS[0] = max(0, int(n))


def threads() -> int:
    return _THREADS[0] or torch.get_num_threads()


def supports(ggml_type: int) -> bool:
    """Whether the kernels compute ggml type ``ggml_type`` (F32, F16, BF16, the legacy and k-quants, ...)."""
    return load().ms_block_size(int(ggml_type)) > 0


def computes(ggml_type: int, n_cols: int) -> bool:
    """Whether the kernels compute a matrix of ggml type ``ggml_type`` with rows of ``n_cols`` elements."""
    n = load().ms_block_size(int(ggml_type))
    return n > 0 and n_cols % n == 0


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n_cols: int, lib: ctypes.CDLL | None = None
           ) -> torch.Tensor:
    """``x @ W.T`` on the ggml blocks of ``W``.

    x: float32 ``[..., n_cols]`` (CPU); raw: uint8 ``[n_rows, row_bytes]`` (CPU, rows contiguous: a mapped
    tensor, a slot, a resident weight). Returns float32 ``[..., n_rows]``. ValueError for a type the kernels
    do not compute or n_cols not a multiple of its block.
    """
    lib = lib or load()
    flat = x.dim() == 2 and x.shape[1] == n_cols  # [tokens, n_cols]: no reshape (1-2 us each at one token)
    xs = x if flat else x.reshape(-1, n_cols)
    if not xs.is_contiguous():
        xs = xs.contiguous()
    n_rows = raw.shape[0]
    y = torch.empty((xs.shape[0], n_rows), dtype=torch.float32)
    if raw.stride(-1) != 1:
        raise ValueError("linear: raw rows must be contiguous")
    rc = lib.ms_linear(int(ggml_type), raw.data_ptr(), raw.stride(0) * raw.element_size(), n_rows, n_cols,
                       xs.data_ptr(), xs.shape[0], y.data_ptr(), threads())
    if rc == -1:
        raise ValueError(f"linear: the kernels do not compute ggml type {int(ggml_type)} with {n_cols} columns")
    if rc == -2:
        raise MemoryError("linear: out of memory for the activation blocks")
    return y if flat else y.view(*x.shape[:-1], n_rows)


def linear_heads(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n_cols: int, n_heads: int,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Per-head linears on the ggml blocks of one tensor: ``y[t, h] = W_h @ x[t, h]`` (a batched per-head matmul;
    MLA's absorbed up-projections, deepseek2's attn_k_b / attn_v_b).

    x: float32 ``[T, n_heads, n_cols]`` (CPU; any non-negative strides on the first two dims, unit stride on the
    last). raw: uint8 ``[n_heads * n_rows, row_bytes]`` (CPU, contiguous: head h's weight W_h is rows
    ``h * n_rows .. (h + 1) * n_rows``; for F32 weights the float32 tensor's bytes, ``w.view(torch.uint8)``).
    Returns float32 ``[T, n_heads, n_rows]`` (contiguous). Each element has the bits :func:`linear` gives for
    ``x[:, h]`` against W_h alone (the activation row quantized per (token, head) as ggml does; independent of
    n_heads, T and the thread count). ValueError for a type the kernels do not compute, n_cols not a multiple of
    its block, or shapes that do not fit.
    """
    lib = lib or load()
    if x.dim() != 3 or x.shape[1] != n_heads or x.shape[2] != n_cols or x.dtype != torch.float32:
        raise ValueError(f"linear_heads: x must be float32 [T, {n_heads}, {n_cols}], got {x.dtype} {list(x.shape)}")
    if x.stride(2) != 1 or x.stride(0) < 0 or x.stride(1) < 0:
        x = x.contiguous()
    if raw.dim() != 2 or not raw.is_contiguous() or raw.dtype != torch.uint8 or raw.shape[0] % n_heads:
        raise ValueError(f"linear_heads: raw must be contiguous uint8 [{n_heads} x rows, row_bytes], got "
                         f"{raw.dtype} {list(raw.shape)}")
    n_rows, row_bytes = raw.shape[0] // n_heads, raw.shape[1]
    y = torch.empty((x.shape[0], n_heads, n_rows), dtype=torch.float32)
    rc = lib.ms_linear_heads(int(ggml_type), raw.data_ptr(), n_rows * row_bytes, row_bytes, n_rows, n_cols, n_heads,
                             x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], y.data_ptr(), y.stride(0),
                             y.stride(1), threads())
    if rc == -1:
        raise ValueError(f"linear_heads: the kernels do not compute ggml type {int(ggml_type)} with {n_cols} "
                         f"columns")
    if rc == -2:
        raise MemoryError("linear_heads: out of memory for the activation blocks")
    return y


def moe(x: torch.Tensor, t_gu: int, t_down: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
        rb_gu: int, rb_down: int, n_ff: int, act: int, pair_start: np.ndarray, pair_tok: np.ndarray,
        pair_w: np.ndarray, pair_out: np.ndarray, y: torch.Tensor, lib: ctypes.CDLL | None = None,
        bias: tuple | None = None, real: np.ndarray | None = None) -> None:
    """The routed experts of one MoE layer, one call (ggml's ``mul_mat_id`` with the FFN fused around it).

    x: float32 [tokens, hidden] (contiguous). gate / up / down: int64 [groups] addresses of each expert's
    matrices (a slot of the pool, or the expert in the memory map; for a merged gate_up, ``up`` is gate +
    n_ff rows). pair_start: int32 [groups + 1]; pairs ``pair_start[g]:pair_start[g+1]`` are group g's
    (token, k) uses: pair_tok int32 (row of x), pair_w float32 (routing weight), pair_out int32 (row of y).
    y: float32 [rows, hidden]; row pair_out[p] = pair_w[p] * down(act(gate(x), up(x))) for its token.
    act: ACT_SILU (SiLU(gate) * up), ACT_GELU_TANH or ACT_SWIGLU_OAI. bias: None, or (gate, up, down) per-expert
    bias rows, each float32 [n_experts, rows] contiguous or None (:func:`bias_ptrs`), added to that matrix's dot
    products (one float32 add per element; the routing weight multiplies the biased down row) and gathered by
    ``real`` int64 [groups], each group's REAL expert id (the addresses may be slots). Raises ValueError for types
    the kernels do not compute.
    """
    lib = lib or load()
    bg, bu, bd = bias_ptrs(bias)
    rc = lib.ms_moe(int(t_gu), int(t_down), gate.ctypes.data, up.ctypes.data, down.ctypes.data, rb_gu, rb_down,
                    x.shape[1], n_ff, act, bg, bu, bd, None if real is None else real.ctypes.data, len(gate),
                    pair_start.ctypes.data, pair_tok.ctypes.data,
                    pair_w.ctypes.data, pair_out.ctypes.data, x.data_ptr(), x.shape[0], y.data_ptr(), threads())
    if rc == -1:
        raise ValueError(f"moe: the kernels do not compute ggml types {t_gu} / {t_down} at these sizes")
    if rc == -2:
        raise MemoryError("moe: out of memory for the expert FFN's buffers")


def bias_ptrs(bias: tuple | None) -> tuple[int | None, int | None, int | None]:
    """The addresses of per-expert bias tables (gate, up, down): each float32 [n_experts, rows] contiguous (CPU) or
    None; ``bias`` None: no biases. ValueError for another dtype, device or layout (the C side reads raw rows)."""
    if bias is None:
        return None, None, None
    for b in bias:
        if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous()):
            raise ValueError("moe: expert biases must be contiguous float32 CPU tensors [n_experts, rows]")
    return tuple(None if b is None else b.data_ptr() for b in bias)  # type: ignore[return-value]


# --- the step kernels (csrc/stepkern.c) ----------------------------------------------------------------------

_STEP = {"on": os.environ.get("MOESTREAM_STEP_KERNELS", "1").strip() != "0", "lib": None, "tried": False}

#: gating of :func:`route`
GATING_SOFTMAX, GATING_SIGMOID, GATING_SCORES = 0, 1, 2


def set_step_ops(on: bool) -> None:
    """Run the CPU step's norms, RoPE, attention and router in C (``True``, the default) or in torch
    (``MOESTREAM_STEP_KERNELS=0`` at start, or ``False`` here)."""
    _STEP["on"] = bool(on)


def io_ops() -> ctypes.CDLL | None:
    """The kernel library for experts/reader.py's C read threads (csrc/iokern.c), or None where the kernels cannot be
    built here or ``MOESTREAM_C_READER=0`` (the reader then uses its Python threads)."""
    if os.environ.get("MOESTREAM_C_READER", "1") == "0":
        return None
    try:
        return load()
    except KernelBuildError:
        return None


def step_ops() -> ctypes.CDLL | None:
    """The kernel library when the step ops run in C, else None (switched off, or the kernels cannot be built
    here: the callers then run torch's ops)."""
    if not _STEP["on"]:
        return None
    if not _STEP["tried"]:
        _STEP["tried"] = True
        try:
            _STEP["lib"] = load()
        except KernelBuildError:
            _STEP["lib"] = None
    return _STEP["lib"]


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x viewed as [rows, n] with unit stride along n (a copy only when no such view exists)."""
    xs = x.reshape(-1, n)
    return xs if xs.stride(-1) == 1 or xs.shape[0] == 0 else xs.contiguous()


def _float32_cpu(name: str, *ts: torch.Tensor | None) -> None:
    for t in ts:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name}: float32 CPU tensors only, got {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, lib: ctypes.CDLL | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dim: x float32 [..., n] -> ``x * (1 / sqrt(mean(x^2) + eps)) * weight``, same shape.

    ggml's arithmetic (ggml_compute_forward_rms_norm_f32, then ggml_mul): each square rounded to float32, summed
    in double in index order; mean and scale in float32; then x * scale, times weight (float32 [n], or None).
    Rows in parallel, each row by one thread."""
    n = x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or (weight is not None and weight.dtype != torch.float32):
        _float32_cpu("rms_norm", x, weight)
    w = None if weight is None else weight.data_ptr() if weight.is_contiguous() else weight.contiguous().data_ptr()
    if x.is_contiguous():  # the common case, without a view
        y = torch.empty_like(x)
        (lib or load()).ms_rms_norm(x.numel() // n, n, x.data_ptr(), n, w, eps, y.data_ptr(), n, threads())
        return y
    xs = _rows(x, n)
    y = torch.empty((xs.shape[0], n), dtype=torch.float32)
    (lib or load()).ms_rms_norm(xs.shape[0], n, xs.data_ptr(), xs.stride(0), w, eps, y.data_ptr(), n, threads())
    return y.view(x.shape)


def _head_strides(x: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) in elements of x [T, heads, d] whose last dim has unit stride."""
    return x.stride(0), x.stride(1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor,
         lib: ctypes.CDLL | None = None) -> None:
    """RoPE from tables, into ``out``: x, out float32 [T, heads, d] (last dims of unit stride; out must not overlap
    x); cos, sin float32 [T, n_rot] (the tables' rows of the T positions, rows contiguous: layers.Rope).

    Per dim i < n_rot: ``x_i * cos_i + p_i * sin_i`` (each product and the sum rounded on their own, as
    layers.Rope's torch ops do, so the same bits), p_i the partner: x_{i + n_rot/2} / x_{i - n_rot/2} (NEOX) or
    x_{i ^ 1} (``interleaved``); dims past n_rot copied."""
    _float32_cpu("rope", x, cos, sin, out)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride(0) != cos.shape[1] or sin.stride() != cos.stride():
        raise ValueError("rope: out and the tables need unit strides along their last dims, table rows contiguous")
    n_tok, heads, d = x.shape
    xt, xh = _head_strides(x)
    ot, oh = _head_strides(out)
    (lib or load()).ms_rope(n_tok, heads, d, cos.shape[1], int(interleaved), x.data_ptr(), xt, xh, cos.data_ptr(),
                       sin.data_ptr(), out.data_ptr(), ot, oh, threads())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Causal GQA attention of T new queries over the KV cache, read in place (layers.attention's semantics).

    q: float32 [T, n_head, d] at positions start..start+T-1; k: [>= start+T, n_kv, d] and v: [>= start+T, n_kv,
    d_v], cache rows from position 0 (views with unit stride along their last dim; v may be a view of k: MLA's
    K = V). window: keys j with pos - window < j <= pos (None: all j <= pos); sinks: float32 [n_head] logits in
    the softmax's denominator; softcap > 0: scores become softcap * tanh(score / softcap). Returns float32
    [T, n_head * d_v]. Arithmetic: llama.cpp's CPU attention (ggml AVX2, F32 cache, no flash attention), bit for
    bit (csrc/stepkern.c spells it out): ggml_vec_dot_f32 scores (fused multiply-adds in 32 lanes) times scale,
    ggml's expf polynomial of score - max, its sum in blocks of 8 keys (float, then double), probabilities times
    (float)(1 / sum), values by ggml_vec_dot_f32 over the keys for one token (T = 1) or by 8 fused lanes for a
    chunk. Each (token, head) by one thread. MemoryError when the score buffer cannot grow."""
    _float32_cpu("attention", q, k, v, sinks)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention: the cache views need unit stride along their last dim")
    n_tok, n_head, d = q.shape
    n_kv, dv = k.shape[1], v.shape[2]
    if n_head % n_kv or k.shape[0] < start + n_tok or v.shape[0] < start + n_tok:
        raise ValueError(f"attention: {n_head} query heads over {n_kv} KV heads, {k.shape[0]} cache rows for "
                         f"positions up to {start + n_tok - 1}")
    s = None if sinks is None else sinks.contiguous()
    out = torch.empty((n_tok, n_head * dv), dtype=torch.float32)
    qt, qh = _head_strides(q)
    rc = (lib or load()).ms_attention(n_tok, n_head, n_kv, d, dv, q.data_ptr(), qt, qh, k.data_ptr(), k.stride(0),
                                 k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), int(start), int(window or 0),
                                 None if s is None else s.data_ptr(), float(scale), float(softcap),
                                 out.data_ptr(), n_head * dv, threads())
    if rc == -2:
        raise MemoryError("attention: out of memory for the score buffer")
    return out


def attn_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int,
               scale: float, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
               cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, interleaved: bool = False,
               window: int | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """One sequence's attention block in one call: q float32 [T, n_head, d], k [T, n_kv, d], v [T, n_kv, d_v] (the
    new tokens' projections at positions start..start+T-1; unit stride along the last dim). q is OVERWRITTEN (it
    ends normed and rotated). Per head, :func:`rms_norm` of q by ``q_norm`` and of k by ``k_norm`` (float32 [d],
    contiguous, or None: no norm) with ``eps``; :func:`rope` by the tables ``cos``, ``sin`` (float32 [n_pos, n_rot],
    rows contiguous: layers.Rope's, covering the positions; None: no rotation); the keys and values written into
    the cache rows start..start+T-1 of kc [n_ctx, n_kv, d] and vc [n_ctx, n_kv, d_v] (unit stride along the last
    dim); then :func:`attention` of q over rows 0..start+T-1. Returns float32 [T, n_head * d_v]. Each operation in
    its own kernel's arithmetic, so the bits of those calls in that order. MemoryError when a buffer cannot grow."""
    n_tok, n_head, d = q.shape
    n_kv, dv = kc.shape[1], vc.shape[2]
    out = torch.empty((n_tok, n_head * dv), dtype=torch.float32)
    qs, ks, vs, kcs, vcs = q.stride(), k.stride(), v.stride(), kc.stride(), vc.stride()
    n_rot, off = (0, 0) if cos is None else (cos.shape[1], start * cos.shape[1] * 4)
    rc = (lib or load()).ms_attn_block(
        n_tok, n_head, n_kv, d, dv, q.data_ptr(), qs[0], qs[1], k.data_ptr(), ks[0], ks[1], v.data_ptr(), vs[0], vs[1],
        None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps, n_rot,
        int(interleaved), None if cos is None else cos.data_ptr() + off, None if sin is None else sin.data_ptr() + off,
        kc.data_ptr(), kcs[0], kcs[1], vc.data_ptr(), vcs[0], vcs[1], int(start), int(window or 0),
        None if sinks is None else sinks.data_ptr(), scale, softcap, out.data_ptr(), n_head * dv, threads())
    if rc == -2:
        raise MemoryError("attention: out of memory for the score buffer")
    return out


def route(logits: torch.Tensor, top_k: int, gating: int = GATING_SOFTMAX, bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, norm: bool = True, floor: float = 0.0,
          scale: float = 1.0, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of one MoE layer: logits float32 [T, n_experts] -> (ids int64 [T, top_k] best first, weights
    float32 [T, top_k]).

    Scores by ``gating``: GATING_SOFTMAX (expf of logit - max, the sum in double, divided), GATING_SIGMOID
    (1 / (1 + expf(-logit))) or GATING_SCORES (the logits are the scores); choice = score + ``bias`` [n_experts]
    (or the score); ``n_group`` > 1: only the experts of the ``topk_group`` groups whose two best choices sum
    highest stay choosable; ids = the top_k best choices (ties: the lower id); weights = their scores, divided by
    max(their sum (double, in top-k order), ``floor``) when ``norm``, times ``scale``. ValueError for sizes that
    do not fit (``n_group`` must divide n_experts, ``top_k`` fit in the kept groups)."""
    _float32_cpu("route", logits, bias)
    logits = logits.contiguous()
    n_tok, n_exp = logits.shape
    b = None if bias is None else bias.contiguous()
    ids = torch.empty((n_tok, top_k), dtype=torch.int64)
    w = torch.empty((n_tok, top_k), dtype=torch.float32)
    rc = (lib or load()).ms_route(n_tok, n_exp, logits.data_ptr(), int(gating), None if b is None else b.data_ptr(),
                             int(n_group), int(topk_group), int(top_k), int(norm), float(floor), float(scale),
                             ids.data_ptr(), w.data_ptr(), threads())
    if rc == -1:
        raise ValueError(f"route: top-{top_k} of {n_exp} experts in {n_group} groups ({topk_group} kept) does not fit")
    if rc == -2:
        raise MemoryError("route: out of memory for the score buffer")
    return ids, w


class MoEPairs:
    """One MoE layer's pair plan, in arrays kept between calls (grown to the largest call seen, never shrunk):
    :meth:`plan` groups a call's (token, k) pairs by expert (ms_moe_pairs), the arrays :func:`moe` takes.

    After ``n = plan(...)``: ``experts[:n]`` int64 (the distinct real ids, ascending), ``start[:n + 1]`` int32,
    ``tok`` / ``w`` / ``dst`` int32 / float32 / int32 [n_pairs] (row of x, routing weight, row of the output viewed
    [tokens * top_k, hidden]) and, with address tables, ``addr[m, :n]`` int64: table m's entry of each expert."""

    def __init__(self, n_exp: int, n_tabs: int = 0, lib: ctypes.CDLL | None = None):
        self.lib = lib or load()
        self.n_exp, self.n_tabs = int(n_exp), int(n_tabs)
        self.count = np.empty(self.n_exp, dtype=np.int32)
        self.cap = 0
        self._grow(16)

    def _grow(self, n_pairs: int) -> None:
        self.cap = max(n_pairs, 2 * self.cap)
        c = self.cap
        self.experts = np.empty(c, dtype=np.int64)
        self.start = np.empty(c + 1, dtype=np.int32)
        self.tok = np.empty(c, dtype=np.int32)
        self.w = np.empty(c, dtype=np.float32)
        self.dst = np.empty(c, dtype=np.int32)
        self.addr = np.empty((max(self.n_tabs, 1), c), dtype=np.int64)
        self.ptrs = tuple(a.ctypes.data for a in (self.count, self.experts, self.start, self.tok, self.w, self.dst,
                                                  self.addr))

    def plan(self, ids: torch.Tensor, weights: torch.Tensor | None, tabs: np.ndarray | None = None) -> int:
        """ids int64 [tokens, top_k] real expert ids, weights float32 [tokens, top_k] (or None: ``w`` not written),
        contiguous CPU tensors; tabs: None or int64 [n_tabs, n_exp] (C-contiguous: an address per expert and
        matrix). Returns the number of distinct experts; ValueError for an id outside [0, n_exp)."""
        n_pairs = ids.numel()
        if n_pairs > self.cap:
            self._grow(n_pairs)
        count, experts, start, tok, w, dst, addr = self.ptrs
        n = self.lib.ms_moe_pairs(n_pairs, ids.shape[-1], ids.data_ptr(), None if weights is None else
                                  weights.data_ptr(), self.n_exp, None if tabs is None else tabs.ctypes.data,
                                  0 if tabs is None else tabs.shape[0], count, experts, start, tok, w, dst, addr,
                                  self.cap)
        if n < 0:
            raise ValueError(f"moe pairs: an expert id outside 0..{self.n_exp - 1}")
        return n


def topk_sum(out: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Each token's top-k rows summed in k order: out float32 [T, top_k, n] (contiguous, CPU) -> [T, n], the bits of
    ``out.sum(dim=1)`` (each element ((0 + row 0) + row 1) + ..., one thread per token)."""
    n_tok, k, n = out.shape
    y = torch.empty((n_tok, n), dtype=torch.float32)
    (lib or load()).ms_topk_sum(n_tok, k, n, out.data_ptr(), y.data_ptr(), threads())
    return y


def moe_planned(x: torch.Tensor, t_gu: int, t_down: int, pairs: MoEPairs, n_groups: int, rb_gu: int, rb_down: int,
                n_ff: int, act: int, y: torch.Tensor, bias: tuple | None = None) -> None:
    """:func:`moe` on the arrays of ``pairs`` after ``pairs.plan(ids, weights, tabs)`` returned ``n_groups``: the
    experts' addresses are ``pairs.addr`` rows 0, 1, 2 (gate, up, down), the pairs its own arrays (no array is
    made or converted here). x float32 [tokens, hidden] contiguous; y float32 [tokens * top_k, hidden]; bias as
    :func:`moe`'s, gathered by ``pairs.experts`` (the real ids)."""
    moe_to((int(t_gu), int(t_down), rb_gu, rb_down, x.shape[1], n_ff, act, bias_ptrs(bias)), pairs, n_groups,
           x.data_ptr(), x.shape[0], y.data_ptr())


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The gated delta rule's recurrent step for one token (Gated DeltaNet decode), ``state`` updated in place.

    q, k float32 [n_k, d_k] (q L2-normalized and scaled, k L2-normalized); v [n_v, d_v]; decay (exp of the log
    decay) and beta [n_v]; state [n_v, d_k, d_v]; value head h reads key head h % n_k (the file's tiled order).
    Per head: S = decay S; S += k (beta (v - S^T k))^T; o = S^T q (transformers' torch_recurrent_gated_delta_rule,
    one token), every sum over d_k in index order from +0 (csrc/stepkern.c), one head per thread. Returns o
    float32 [n_v, d_v]. ValueError for shapes that do not fit."""
    _float32_cpu("delta_step", q, k, v, decay, beta, state)
    n_v, d_k, d_v = state.shape
    n_k = q.shape[0]
    if (q.shape != (n_k, d_k) or k.shape != (n_k, d_k) or v.shape != (n_v, d_v) or decay.shape != (n_v,)
            or beta.shape != (n_v,) or not state.is_contiguous()):
        raise ValueError(f"delta_step: shapes q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} decay "
                         f"{list(decay.shape)} beta {list(beta.shape)} state {list(state.shape)} do not fit")
    q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
    out = torch.empty((n_v, d_v), dtype=torch.float32)
    rc = (lib or load()).ms_delta_step(n_v, n_k, d_k, d_v, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                       decay.data_ptr(), beta.data_ptr(), state.data_ptr(), out.data_ptr(), threads())
    if rc:
        raise ValueError(f"delta_step: {n_v} value heads over {n_k} key heads of {d_v} value dims do not fit")
    return out


def dnet_decode(qkv: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, beta_raw: torch.Tensor,
                alpha_raw: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, state: torch.Tensor, z: torch.Tensor,
                norm_w: torch.Tensor, eps: float, n_k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A Gated DeltaNet layer's decode step between its matmuls, for one token (csrc/stepkern.c ms_dnet_decode:
    the causal conv continuing ``conv_state``, SiLU, the key heads' L2 norms, q scaled by 1/sqrt(d_k), beta =
    sigmoid(beta_raw), decay = exp(a * softplus(alpha_raw + dt)), the delta rule's step on ``state``, then the
    gated RMSNorm: RMSNorm(o_h) * norm_w * silu(z_h) per value head).

    qkv float32 [conv_dim] the projection (overwritten); conv_state [K-1, conv_dim] and state [n_v, d_k, d_v]
    (both updated in place); conv_w [conv_dim, K]; beta_raw, alpha_raw, dt, a [n_v]; z [n_v * d_v]; norm_w [d_v].
    Returns float32 [n_v * d_v], the input of the layer's output projection. ValueError for sizes that do not
    fit (conv_dim must be 2 n_k d_k + n_v d_v)."""
    _float32_cpu("dnet_decode", qkv, conv_state, conv_w, beta_raw, alpha_raw, dt, a, state, z, norm_w)
    n_v, d_k, d_v = state.shape
    conv_dim, k_w = conv_w.shape
    if (qkv.numel() != conv_dim or conv_state.shape != (k_w - 1, conv_dim) or z.numel() != n_v * d_v
            or norm_w.numel() != d_v or not (qkv.is_contiguous() and conv_state.is_contiguous()
                                              and state.is_contiguous())):
        raise ValueError(f"dnet_decode: qkv {list(qkv.shape)}, conv state {list(conv_state.shape)}, conv weight "
                         f"{list(conv_w.shape)}, state {list(state.shape)}, z {list(z.shape)} do not fit")
    conv_w, beta_raw, alpha_raw, dt, a, z, norm_w = (t.contiguous() for t in (conv_w, beta_raw, alpha_raw, dt, a, z,
                                                                              norm_w))
    out = torch.empty(n_v * d_v, dtype=torch.float32)
    rc = (lib or load()).ms_dnet_decode(conv_dim, k_w, n_k, n_v, d_k, d_v, qkv.data_ptr(), conv_state.data_ptr(),
                                        conv_w.data_ptr(), beta_raw.data_ptr(), alpha_raw.data_ptr(), dt.data_ptr(),
                                        a.data_ptr(), state.data_ptr(), z.data_ptr(), norm_w.data_ptr(), eps,
                                        out.data_ptr(), threads())
    if rc:
        raise ValueError(f"dnet_decode: {n_v} value heads over {n_k} key heads (d_k {d_k}, d_v {d_v}) do not fit a "
                         f"conv of {conv_dim} channels")
    return out


def first_nonfinite(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> int:
    """The flat index of the first NaN or +-Inf of x (float32, contiguous, CPU), or -1 when all are finite (one
    pass, one thread)."""
    return (lib or load()).ms_first_nonfinite(x.data_ptr(), x.numel())


def residual_norm(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                  h: torch.Tensor | None, lib: ctypes.CDLL | None = None) -> None:
    """The residual stream between two matmuls, in place: x float32 [rows, n] (contiguous) += r, where r is [rows, n]
    (one add per element), or [rows, K, n] (its K rows summed in k order from +0 first: :func:`topk_sum`'s sum), or
    None (nothing added); then, when h [rows, n] is given, h = :func:`rms_norm` of the new x by ``weight``."""
    k = 0 if r is None or r.dim() == 2 else r.shape[1]
    (lib or load()).ms_residual_norm(x.shape[0], x.shape[1], x.data_ptr(), None if r is None else r.data_ptr(), k,
                                     None if weight is None else weight.data_ptr(), eps,
                                     None if h is None else h.data_ptr(), threads())


def linear_to(spec: tuple, x: int, n_tok: int, y: int, lib: ctypes.CDLL) -> None:
    """:func:`linear` with everything given as addresses (a decode step's kept buffers): spec = (ggml type, first
    byte of W, row bytes, rows, cols); x: float32 [n_tok, cols]; y: float32 [n_tok, rows]."""
    rc = lib.ms_linear(spec[0], spec[1], spec[2], spec[3], spec[4], x, n_tok, y, threads())
    if rc:
        raise ValueError(f"linear: the kernels do not compute ggml type {spec[0]} with {spec[4]} columns (rc {rc})")


def linear_heads_to(spec: tuple, x: int, xs: tuple[int, int], n_tok: int, y: int, ys: tuple[int, int],
                    lib: ctypes.CDLL) -> None:
    """:func:`linear_heads` with everything given as addresses (a decode step's kept buffers): spec = (ggml type,
    first byte of W, bytes per head, row bytes, rows per head, cols, heads); x: float32 with (token, head) strides
    ``xs`` in elements, unit stride along the cols; y: float32 with (token, head) strides ``ys``."""
    rc = lib.ms_linear_heads(spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6], x, xs[0], xs[1], n_tok, y,
                             ys[0], ys[1], threads())
    if rc == -1:
        raise ValueError(f"linear_heads: the kernels do not compute ggml type {spec[0]} with {spec[5]} columns")
    if rc == -2:
        raise MemoryError("linear_heads: out of memory for the activation blocks")


def moe_to(spec: tuple, pairs: MoEPairs, n_groups: int, x: int, n_tok: int, y: int, at: tuple | None = None) -> None:
    """:func:`moe_planned` with addresses: spec = (gate/up type, down type, gate/up row bytes, down row bytes,
    hidden, n_ff, act[, (gate, up, down) bias addresses: :func:`bias_ptrs`]); x float32 [n_tok, hidden]; y float32
    [n_tok * top_k, hidden]. ``at``: the groups' arrays as addresses instead of ``pairs``' own, (gate, up, down,
    start, tok, w, dst[, real]) as :func:`moe` takes them (a streaming decode step's groups in compute order, the
    experts' slot addresses; ``real``: int64 [groups] their real ids, needed with biases); without ``at`` the real
    ids are ``pairs.experts``."""
    if at is None:
        _, experts, start, tok, w, dst, addr = pairs.ptrs
        row = 8 * pairs.cap
        at = (addr, addr + row, addr + 2 * row, start, tok, w, dst, experts)
    gate, up, down, start, tok, w, dst = at[:7]
    real = at[7] if len(at) > 7 else None
    bg, bu, bd = spec[7] if len(spec) > 7 else (None, None, None)
    rc = pairs.lib.ms_moe(spec[0], spec[1], gate, up, down, spec[2], spec[3], spec[4], spec[5], spec[6], bg, bu, bd,
                          real, n_groups, start, tok, w, dst, x, n_tok, y, threads())
    if rc == -1:
        raise ValueError(f"moe: the kernels do not compute ggml types {spec[0]} / {spec[1]} at these sizes")
    if rc == -2:
        raise MemoryError("moe: out of memory for the expert FFN's buffers")


#: ggml types :func:`dequant_rows` decodes: Q8_0, Q4_K, Q6_K, BF16
DEQUANT_ROWS_TYPES = frozenset({8, 12, 14, 30})


def dequant_rows(raw: torch.Tensor, ggml_type: int, n_cols: int, ids: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """Rows ``ids`` (int64 [n], CPU) of a ggml matrix raw uint8 [n_rows, row_bytes] (CPU, rows of unit stride) as
    float32 [n, n_cols], in quant.dequantize's arithmetic (the same bits, the fp16 scales converted as torch converts
    them on this build); None for a type outside :data:`DEQUANT_ROWS_TYPES` or an id out of range (the caller
    decodes those its own way)."""
    if int(ggml_type) not in DEQUANT_ROWS_TYPES or raw.stride(-1) != 1:
        return None
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    out = torch.empty((ids.shape[0], n_cols), dtype=torch.float32)
    rc = (lib or load()).ms_dequant_rows(int(ggml_type), raw.data_ptr(), raw.stride(0), raw.shape[0], ids.data_ptr(),
                                         ids.shape[0], n_cols, out.data_ptr())
    return out if rc == 0 else None
