"""tools/make_bench_model.py's random-block types (Q4_K, Q4_K_M, Q6_K, MXFP4): valid blocks of the asked std and mean
about 0, bytes independent of the thread count, llama.cpp's Q4_K_M type mix, and files the engine runs (qwen3moe,
gpt-oss, deepseek2)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from helpers import moestream
from moestream.quant import dequantize

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = ROOT / "src" / "moestream" / "data" / "default.gguf"
sys.path.insert(0, str(ROOT / "tools"))
import make_bench_model as mbm  # noqa: E402


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0])
def test_random_blocks_decode_to_the_std(qtype: T) -> None:
    n_cols = 2048
    raw = mbm.random_blocks(np.random.default_rng(1), qtype, 64 * n_cols, 0.03).reshape(64, -1)
    x = dequantize(torch.from_numpy(raw), qtype, n_cols)
    assert torch.isfinite(x).all()
    assert 0.0285 < float(x.std()) < 0.0315, float(x.std())
    # Q4_0's codes (nibble - 8) average -0.5: a mean of -0.5 d, about -std / 9; the others centre on ~0
    assert abs(float(x.mean()) - (-0.03 / 9.2 if qtype == T.Q4_0 else 0)) < 0.002, float(x.mean())
    assert np.array_equal(x.numpy(), reference_dequantize(raw, qtype))  # gguf's reader decodes the same values


def test_random_mxfp4_blocks() -> None:
    """MXFP4 blocks (gpt-oss's experts): a power-of-two scale, so the std within 2^0.5 of the asked one, mean ~0,
    the values gguf's reader decodes."""
    raw = mbm.random_blocks(np.random.default_rng(2), T.MXFP4, 64 * 2048, 0.03).reshape(64, -1)
    x = dequantize(torch.from_numpy(raw), T.MXFP4, 2048)
    assert 0.03 / 2 ** 0.5 < float(x.std()) < 0.03 * 2 ** 0.5 and abs(float(x.mean())) < 0.002, float(x.std())
    assert np.array_equal(x.numpy(), reference_dequantize(raw, T.MXFP4))


def test_gpt_oss_file_runs(tmp_path: Path) -> None:
    """``--arch gpt-oss`` at small sizes: a file moestream loads as gpt-oss (sliding and full layers, MXFP4
    experts with biases, fused) and runs."""
    path = tmp_path / "g.gguf"
    cmd = [sys.executable, str(ROOT / "tools" / "make_bench_model.py"), "-o", str(path), "--arch", "gpt-oss",
           "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
           "--experts", "8", "--top-k", "2", "--expert-ff", "256", "--tokenizer-from", str(DEFAULT_GGUF)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    from moestream.models.base import LoadOptions, load_model
    m = load_model(str(path), LoadOptions(moe_stream=False))
    try:
        assert type(m).__name__ == "GptOss" and [b["swa"] for b in m.blocks] == [True, False]
        moe = m.blocks[0]["moe"]
        assert moe.fused and moe.mats["gate"].ggml_type == T.MXFP4 and set(moe.bias) == {"gate", "up", "down"}
    finally:
        m.store.close()
    p = moestream("run", "-m", str(path), "-n", "4", "-p", "hi", "--slots", "2", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "decode 3 tok" in p.stderr.strip().splitlines()[-1]


def test_deepseek2_file_runs(tmp_path: Path) -> None:
    """``--arch deepseek2`` (GLM-4.7-Flash's MLA sizes) at a small hidden size and expert count: a file moestream
    loads as deepseek2 (sigmoid routing inferred from the selection bias, attn_k_b Q8_0 and attn_v_b Q4_K on the C
    kernels), whose decode runs the fast step with the eager step's bits, and which the CLI runs."""
    path = tmp_path / "d.gguf"
    cmd = [sys.executable, str(ROOT / "tools" / "make_bench_model.py"), "-o", str(path), "--arch", "deepseek2",
           "--layers", "2", "--hidden", "256", "--heads", "2", "--experts", "8", "--top-k", "2", "--expert-ff", "256",
           "--tokenizer-from", str(DEFAULT_GGUF)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    from moestream.models.base import LoadOptions, load_model
    from moestream.runtime import fastdecode
    from moestream.runtime.step import Seq, Step
    m = load_model(str(path), LoadOptions(moe_stream=False))
    try:
        assert type(m).__name__ == "DeepSeek2" and m.gating == "sigmoid" and (m.kv_rank, m.n_nope, m.head_v) == (
            512, 192, 256)
        assert [m.blocks[1][k][1] for k in ("k_b", "v_b")] == [T.Q8_0, T.Q4_K]
        fast = fastdecode.plan(m)
        assert fast is not None
        caches = [m.new_cache(8), m.new_cache(8)]
        with torch.inference_mode():
            for c in caches:
                m.forward(torch.tensor([1, 2, 3]), 0, c)
            for pos in range(3, 6):
                got = fast.step(torch.tensor([pos]), pos, caches[0])
                want = m.runner.run(Step(torch.tensor([pos]), [Seq(caches[1], pos, 1)]))
                assert torch.equal(got, want)
    finally:
        m.store.close()
    p = moestream("run", "-m", str(path), "-n", "4", "-p", "hi", "--slots", "2", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "decode 3 tok" in p.stderr.strip().splitlines()[-1]


def test_random_tensor_does_not_depend_on_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mbm, "CHUNK_BYTES", 144 * 10)  # several pieces per tensor
    outs = []
    for n in (1, 3):
        with ThreadPoolExecutor(n) as pool:
            out, futures = mbm.random_tensor(pool, (0, 5), T.Q4_K, 256 * 37, 0.02)
            for f in futures:
                f.result()
        outs.append(out)
    assert outs[0].size == 144 * 37 and np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0][:1440], outs[0][1440:2880])  # pieces draw different bytes


def test_q4_k_m_mix_is_llama_cpps() -> None:
    """attn_v and ffn_down_exps Q6_K in use_more_bits layers (llama-quant.cpp): of 32, layers 0-3, 28-31 and
    every third between (6, 9, ..., 27); output Q6_K; everything else Q4_K."""
    more = [i for i in range(32) if mbm.fast_type("Q4_K_M", f"blk.{i}.ffn_down_exps.weight", 32) == T.Q6_K]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert mbm.fast_type("Q4_K_M", "blk.6.attn_v.weight", 32) == T.Q6_K
    assert mbm.fast_type("Q4_K_M", "blk.6.ffn_up_exps.weight", 32) == T.Q4_K
    assert mbm.fast_type("Q4_K_M", "output.weight", 32) == T.Q6_K
    assert mbm.fast_type("Q4_K_M", "token_embd.weight", 32) == T.Q4_K
    assert mbm.fast_type("Q4_K", "blk.0.ffn_down_exps.weight", 32) == T.Q4_K
    assert mbm.fast_type("Q6_K", "blk.7.attn_q.weight", 32) == T.Q6_K


def test_q4_k_file_runs(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    cmd = [sys.executable, str(ROOT / "tools" / "make_bench_model.py"), "-o", str(path), "--type", "Q4_K_M",
           "--layers", "1", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
           "--experts", "8", "--top-k", "2", "--expert-ff", "256", "--threads", "2",
           "--tokenizer-from", str(DEFAULT_GGUF)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = moestream("run", "-m", str(path), "-n", "4", "-p", "hi", "--slots", "4", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "decode 3 tok" in p.stderr.strip().splitlines()[-1]
