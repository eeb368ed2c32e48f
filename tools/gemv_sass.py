"""Static SASS of the GEMV kernels (gpu/tkernels.py) for sm_90, without a GPU: instructions per weight.

    PYTHONPATH=src python3 tools/gemv_sass.py [--lpb 8] [--lpb32 1] [--m 1] [--only Q4_0]

Triton compiles each kernel for ``GPUTarget("cuda", 90, 32)`` with its bundled ptxas and nvdisasm (no device
needed), for the configuration ``tkernels._config`` picks for a matrix (type, rows, cols, linear or grouped, the
tokens ``m``). Printed per case: the instructions in the K loop's body (from its label to its backward branch),
the weights one thread multiplies per iteration (from the configuration), their ratio, the registers per thread,
and the shared-memory instructions inside the loop (0: no layout shuffle in the loop). A decode GEMV that is
issue-bound (the kernel before _gemv2_kernel was: ~1e12 weights/s on every shape of an H200) gets faster about as
its instructions per weight drop; this is the number to watch between GPU runs, not a timing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from moestream.gpu import tkernels as tk

#: (name, ggml type, rows, cols, grouped)
CASES = [
    ("lm head Q6_K", 14, 151936, 2048, False),
    ("attn q Q4_K", 12, 4096, 2048, False),
    ("attn o Q4_K", 12, 2048, 4096, False),
    ("expert gate/up Q4_K", 12, 768, 2048, True),
    ("expert down Q4_K", 12, 2048, 768, True),
    ("expert down Q6_K", 14, 2048, 768, True),
    ("g expert g/u Q4_0", 2, 704, 2816, True),  # Gemma-4 26B-A4B shapes (benchmarks/gemv_ab.py)
    ("g expert down Q4_0", 2, 2816, 704, True),
    ("g attn Q8_0", 8, 2816, 2816, False),
    ("g expert g/u Q8_0", 8, 704, 2816, True),
]
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
COMMON = dict(x_ptr="*fp32", w_ptr="*u8", off_ptr="*i64", tiles_ptr="*i32", src_ptr="*i32", out_ptr="*fp32",
              n_rows="i32", row_units="i32", sel_ptr="*i64", n_sel="i32", sel_stride="i32")


def compile_case(qtype: int, rows: int, cols: int, grouped: bool, m: int, new: bool):
    """(compiled kernel, its configuration, weights per thread and loop iteration)."""
    tk.GEMV2 = "all" if new else "0"
    tk.GEMV32 = new
    cfg = tk._config(qtype, rows, cols, m, grouped=grouped)
    consts = dict(n_cols=cols, QTYPE=qtype, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SELECT=grouped)
    if cfg.get("G32"):
        fn, sig = tk._gemv32_kernel, dict(COMMON, magic0="i32")
        consts.update(VW=cfg["VW"], U=cfg["U"], ALIGN=cfg["WA"])
        # weights per thread and loop iteration: U K steps of VW quant bytes (2 VW weights of Q4_0, VW of Q8_0) in
        # each of the thread's rows
        per_iter = cfg["U"] * cfg["VW"] * (2 if qtype == 2 else 1) * max(1, cfg["BLOCK_N"] // cfg["num_warps"])
    elif cfg.get("K2"):
        fn, sig = tk._gemv2_kernel, dict(COMMON, magic0="i32")
        consts.update(LANES=cfg["NSUB"], LPB=cfg["LPB"], VW=4, LOG2_LANES=(cfg["NSUB"] * 4).bit_length() - 1,
                      ALIGN=cfg["WA"])
        per_iter = (256 if qtype in (12, 14) else 32) // cfg["LPB"]
    else:
        fn, sig = tk._gemv_kernel, dict(COMMON)
        vw = cfg["VW"]
        unroll = max(1, min(-(-cols // (cfg["NSUB"] * cfg["SUB"])), 32 * vw // cfg["SUB"]))
        consts.update(NSUB=cfg["NSUB"], SUB=cfg["SUB"], VW=vw, LOG2_LANES=(cfg["NSUB"] * vw).bit_length() - 1,
                      ALIGN=vw, UNROLL=unroll)
        per_iter = unroll * cfg["SUB"]
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    src = ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], enable_fp_fusion=False))
    return k, cfg, per_iter


def sass(k) -> tuple[str, str]:  # noqa: ANN001 - a triton CompiledKernel
    """(nvdisasm text, cuobjdump resource usage) of the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    return text, res


def loop_body(text: str) -> list[str]:
    """The instructions from the first label that a later backward branch targets to that branch."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L_x_\d+):", line)
        if not m:
            continue
        for j in range(i + 1, len(lines)):
            if re.search(r"BRA `\(" + re.escape(m.group(1)) + r"\)", lines[j]):
                body = [s for s in lines[i + 1:j + 1] if re.match(r"\s*/\*[0-9a-f]+\*/", s)]
                if len(body) > 2:  # not the trap loop at the end (BRA to itself)
                    return body
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lpb", type=int, default=tk.GEMV2_LPB, help="_gemv2_kernel's lanes per super-block (8, 4)")
    ap.add_argument("--lpb32", type=int, default=tk.GEMV2_LPB32, help="lanes per block of Q4_0/Q8_0 (1, 2, 4)")
    ap.add_argument("--m", type=int, default=1, help="tokens (m_hint), 1..8")
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    a = ap.parse_args()
    tk.GEMV2_LPB = a.lpb
    tk.GEMV2_LPB32 = a.lpb32
    print(f"{'matrix':22} {'kernel':7} {'KS/LANES':>8} {'BN':>3} {'loop instr':>10} {'w/thread':>8} {'instr/w':>7} "
          f"{'regs':>4} {'smem in loop':>12}")
    for name, qtype, rows, cols, grouped in CASES:
        if a.only not in name:
            continue
        for new in (False, True):
            k, cfg, per_iter = compile_case(qtype, rows, cols, grouped, a.m, new)
            text, res = sass(k)
            body = loop_body(text)
            regs = re.findall(r"REG:(\d+)", res)
            smem = sum(1 for s in body if re.search(r"\b(STS|LDS|LDSM|BAR)\b", s))
            mark = ""
            if not body:  # the K loop fully unrolled: the whole kernel over a thread's weights
                body = [s for s in text.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", s)]
                per_iter, mark = cfg["BLOCK_N"] * cols // (32 * cfg["num_warps"]), "*"
            n = len(body)
            kname = "gemv32" if cfg.get("G32") else "gemv2" if cfg.get("K2") else "gemv"
            print(f"{name:22} {kname:7} {cfg['NSUB']:>8} {cfg['BLOCK_N']:>3} {n:>9}{mark:1} "
                  f"{per_iter:>8} {n / per_iter:>7.2f} {regs[0] if regs else '?':>4} {smem:>12}")
    print("*: no K loop (fully unrolled): the whole kernel's instructions over the weights of one thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
