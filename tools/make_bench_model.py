"""Write a random-weight Qwen3-MoE GGUF of a chosen shape, for benchmarks.

Default shape: Qwen3-30B-A3B's (hidden 2048, 32 heads / 4 KV heads of dim 128, 128 experts, top-8, expert
FFN 768) cut to 8 layers. Weights are N(0, std) floats quantized with the `gguf` package's reference
quantizer (Q8_0 by default; norms and the router stay F32, as llama.cpp's converter writes them). The
tokenizer metadata is copied from any GGUF that has one (``--tokenizer-from``). llama.cpp loads the
result (it is an ordinary qwen3moe GGUF); tensors are generated and written one at a time, so memory
stays near the size of the largest tensor.

    python tools/make_bench_model.py -o /tmp/q30b-8l-q8_0.gguf --tokenizer-from TOKENIZER.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize


def tensor_specs(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """[(name, torch-order shape, quantize?)] in file order."""
    hd = a.head_dim
    specs = [("token_embd.weight", (n_vocab, a.hidden), True)]
    for i in range(a.layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (a.hidden,), False),
            (p + "attn_q.weight", (a.heads * hd, a.hidden), True),
            (p + "attn_k.weight", (a.kv_heads * hd, a.hidden), True),
            (p + "attn_v.weight", (a.kv_heads * hd, a.hidden), True),
            (p + "attn_output.weight", (a.hidden, a.heads * hd), True),
            (p + "attn_q_norm.weight", (hd,), False),
            (p + "attn_k_norm.weight", (hd,), False),
            (p + "ffn_norm.weight", (a.hidden,), False),
            (p + "ffn_gate_inp.weight", (a.experts, a.hidden), False),
            (p + "ffn_gate_exps.weight", (a.experts, a.expert_ff, a.hidden), True),
            (p + "ffn_up_exps.weight", (a.experts, a.expert_ff, a.hidden), True),
            (p + "ffn_down_exps.weight", (a.experts, a.hidden, a.expert_ff), True),
        ]
    specs += [("output_norm.weight", (a.hidden,), False), ("output.weight", (n_vocab, a.hidden), True)]
    return specs


def copy_tokenizer(src: str, w: GGUFWriter) -> int:
    """Copy every tokenizer.* key of ``src`` into ``w``; returns the vocabulary size."""
    r = GGUFReader(src)
    n_vocab = 0
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        val = f.contents()
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=f.types[1])
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(val)
        else:
            w.add_key_value(key, val, vtype)
    if not n_vocab:
        sys.exit(f"{src}: no tokenizer.ggml.tokens in this GGUF")
    return n_vocab


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--tokenizer-from", required=True, help="GGUF whose tokenizer.* metadata is copied")
    ap.add_argument("--type", default="Q8_0", help="ggml type of the big matrices (gguf can quantize: Q8_0, "
                    "Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=768)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    qtype = GGMLQuantizationType[a.type]
    rng = np.random.default_rng(a.seed)
    tmp = a.out + ".tmp"
    w = GGUFWriter(tmp, "qwen3moe")
    w.add_name(f"random Qwen3-MoE {a.layers}L h{a.hidden} e{a.experts} top{a.top_k} ff{a.expert_ff} {a.type}")
    w.add_block_count(a.layers)
    w.add_context_length(4096)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(6144)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_expert_feed_forward_length(a.expert_ff)
    n_vocab = copy_tokenizer(a.tokenizer_from, w)
    specs = tensor_specs(a, n_vocab)
    for name, shape, q in specs:
        t = qtype if q else GGMLQuantizationType.F32
        if t == GGMLQuantizationType.F32:
            nbytes = 4 * int(np.prod(shape))
        else:
            from gguf import GGML_QUANT_SIZES
            blk, size = GGML_QUANT_SIZES[t]
            nbytes = int(np.prod(shape)) // blk * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    for i, (name, shape, q) in enumerate(specs, 1):
        if name.endswith("norm.weight"):
            data = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            data = (a.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        if q and qtype != GGMLQuantizationType.F32:
            data = quantize(data, qtype)
        w.write_tensor_data(data)
        print(f"[{i}/{len(specs)}] {name} {shape} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    w.close()
    os.replace(tmp, a.out)
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
