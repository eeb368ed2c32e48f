"""Write a random-weight MoE GGUF of a chosen shape, for benchmarks: ``qwen3moe`` or ``gemma4``.

qwen3moe default shape: Qwen3-30B-A3B's (hidden 2048, 32 heads / 4 KV heads of dim 128, 128 experts, top-8,
expert FFN 768) cut to 8 layers. Weights are N(0, std) floats quantized with the `gguf` package's reference
quantizer (Q8_0 by default; norms and the router stay F32, as llama.cpp's converter writes them).

gemma4 (``--arch gemma4``) default shape: Gemma-4-26B-A4B's published config (hidden 2816; sliding layers 16
heads / 8 KV heads of dim 256, window 1024; global layers 16 heads of dim 512 / 2 KV heads with K = V and
proportional RoPE on a quarter of the dims; dense FFN 2112 beside 128 experts, top-8, expert FFN 704 with a
merged gate-up; final logit softcap 30), cut to 6 layers (five sliding, one global, the real 5:1 pattern).
Its parameter count at 30 layers is 25.2B, 3.8B active: the published figures. Tensor names and metadata
keys are those llama.cpp's converter writes for gemma4 (checked against the ``gemma4-tiny`` test fixture).
Quantized tensors are written as random blocks of the chosen type (``--type`` Q4_0 or Q8_0 for experts,
Q8_0 for the other matrices) with scales that give values of about ``std``: building 4+ GB through a
float quantizer would take far longer, and a benchmark needs the bytes and the arithmetic, not trained
values.

The tokenizer metadata is copied from any GGUF that has one (``--tokenizer-from``). llama.cpp loads the
result (an ordinary GGUF of that architecture); tensors are generated and written one at a time, so memory
stays near the size of the largest tensor.

    python tools/make_bench_model.py -o /tmp/q30b-8l-q8_0.gguf --tokenizer-from TOKENIZER.gguf
    python tools/make_bench_model.py --arch gemma4 --type Q4_0 -o /tmp/g26b-6l.gguf --tokenizer-from GEMMA.gguf
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


#: Gemma-4-26B-A4B (google/gemma-4-26B-A4B config.json), the defaults of ``--arch gemma4``.
GEMMA4_26B_A4B = {
    "hidden": 2816, "heads": 16, "kv_heads": 8, "head_dim": 256, "global_head_dim": 512, "global_kv_heads": 2,
    "experts": 128, "top_k": 8, "expert_ff": 704, "dense_ff": 2112, "sliding_window": 1024, "pattern": 6,
    "rope_base": 1e6, "rope_base_swa": 1e4, "partial_rotary": 0.25, "softcap": 30.0, "layers": 6,
}


def gemma4_is_global(i: int, layers: int, pattern: int) -> bool:
    """Layer i is a global (full-attention) layer: every ``pattern``-th layer, and always the last one."""
    return (i + 1) % pattern == 0 or i == layers - 1


def gemma4_tensor_specs(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, torch-order shape, kind)] of a gemma4 file, kind "expert" | "dense" (quantized) | "f32"."""
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("rope_freqs.weight", (a.global_head_dim // 2,), "f32"),
        ("token_embd.weight", (n_vocab, a.hidden), "dense"),
    ]
    for i in range(a.layers):
        p = f"blk.{i}."
        glob = gemma4_is_global(i, a.layers, a.pattern)
        hd = a.global_head_dim if glob else a.head_dim
        kv = a.global_kv_heads if glob else a.kv_heads
        specs += [
            (p + "attn_norm.weight", (a.hidden,), "f32"),
            (p + "attn_q.weight", (a.heads * hd, a.hidden), "dense"),
            (p + "attn_k.weight", (kv * hd, a.hidden), "dense"),
        ]
        if not glob:  # global layers use K as V (attention_k_eq_v): no attn_v tensor
            specs.append((p + "attn_v.weight", (kv * hd, a.hidden), "dense"))
        specs += [
            (p + "attn_q_norm.weight", (hd,), "f32"),
            (p + "attn_k_norm.weight", (hd,), "f32"),
            (p + "attn_output.weight", (a.hidden, a.heads * hd), "dense"),
            (p + "post_attention_norm.weight", (a.hidden,), "f32"),
            (p + "ffn_norm.weight", (a.hidden,), "f32"),
            (p + "ffn_gate.weight", (a.dense_ff, a.hidden), "dense"),
            (p + "ffn_up.weight", (a.dense_ff, a.hidden), "dense"),
            (p + "ffn_down.weight", (a.hidden, a.dense_ff), "dense"),
            (p + "post_ffw_norm_1.weight", (a.hidden,), "f32"),
            (p + "pre_ffw_norm_2.weight", (a.hidden,), "f32"),
            (p + "ffn_gate_inp.weight", (a.experts, a.hidden), "f32"),
            (p + "ffn_gate_inp.scale", (a.hidden,), "f32"),
            (p + "ffn_gate_up_exps.weight", (a.experts, 2 * a.expert_ff, a.hidden), "expert"),
            (p + "ffn_down_exps.weight", (a.experts, a.hidden, a.expert_ff), "expert"),
            (p + "ffn_down_exps.scale", (a.experts,), "f32"),
            (p + "post_ffw_norm_2.weight", (a.hidden,), "f32"),
            (p + "post_ffw_norm.weight", (a.hidden,), "f32"),
            (p + "layer_output_scale.weight", (1,), "f32"),
        ]
    specs.append(("output_norm.weight", (a.hidden,), "f32"))
    return specs


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n_values: int, std: float) -> np.ndarray:
    """Random ggml blocks (ggml-common.h layouts) of ``n_values`` values of about ``std``: Q8_0 (f16 d, 32 x
    int8) or Q4_0 (f16 d, 16 bytes of 4-bit quants stored with an offset of 8). uint8 array of the bytes."""
    from gguf import GGML_QUANT_SIZES

    blk, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_values // blk
    out = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        d = std / 73.9  # uniform int8 quants: sd 73.9
    elif qtype == GGMLQuantizationType.Q4_0:
        d = std / 4.61  # uniform nibbles minus 8: sd 4.61
    else:
        raise SystemExit(f"random blocks of type {qtype.name} are not supported (Q8_0, Q4_0)")
    out[:, :2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    return out.reshape(-1)


def write_gemma4(a: argparse.Namespace) -> int:
    """Write the gemma4 benchmark file (see the module docstring)."""
    from gguf import GGML_QUANT_SIZES

    for key, value in GEMMA4_26B_A4B.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    expert_type = GGMLQuantizationType[a.type]
    dense_type = GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(a.seed)
    tmp = a.out + ".tmp"
    w = GGUFWriter(tmp, "gemma4")
    n_global = sum(gemma4_is_global(i, a.layers, a.pattern) for i in range(a.layers))
    w.add_name(f"random Gemma-4-26B-A4B shape {a.layers}L ({a.layers - n_global} sliding + {n_global} global) "
               f"h{a.hidden} e{a.experts} top{a.top_k} ff{a.expert_ff} experts {a.type}")
    arch = "gemma4"
    pattern = [not gemma4_is_global(i, a.layers, a.pattern) for i in range(a.layers)]
    w.add_block_count(a.layers)
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_array(f"{arch}.feed_forward_length", [a.dense_ff] * a.layers)
    w.add_head_count(a.heads)
    w.add_array(f"{arch}.attention.head_count_kv",
                [a.kv_heads if swa else a.global_kv_heads for swa in pattern])
    w.add_rope_freq_base(a.rope_base)
    w.add_float32(f"{arch}.rope.freq_base_swa", a.rope_base_swa)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_key_length(a.global_head_dim)
    w.add_value_length(a.global_head_dim)
    w.add_float32(f"{arch}.final_logit_softcapping", a.softcap)
    w.add_uint32(f"{arch}.attention.sliding_window", a.sliding_window)
    w.add_uint32(f"{arch}.attention.shared_kv_layers", 0)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", 0)  # 26B-A4B has no per-layer input embeddings
    w.add_array(f"{arch}.attention.sliding_window_pattern", pattern)
    w.add_uint32(f"{arch}.attention.key_length_swa", a.head_dim)
    w.add_uint32(f"{arch}.attention.value_length_swa", a.head_dim)
    w.add_expert_feed_forward_length(a.expert_ff)
    w.add_uint32(f"{arch}.rope.dimension_count", a.global_head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count_swa", a.head_dim)
    n_vocab = copy_tokenizer(a.tokenizer_from, w)
    specs = gemma4_tensor_specs(a, n_vocab)
    types = {"f32": GGMLQuantizationType.F32, "dense": dense_type, "expert": expert_type}
    for name, shape, kind in specs:
        t = types[kind]
        blk, size = GGML_QUANT_SIZES[t]
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) // blk * size, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    n_rot = int(a.partial_rotary * a.global_head_dim) // 2
    for i, (name, shape, kind) in enumerate(specs, 1):
        n = int(np.prod(shape))
        if name == "rope_freqs.weight":  # proportional RoPE: rotate the first quarter, leave the rest
            data = np.where(np.arange(n) < n_rot, 1.0, 1e30).astype(np.float32)
        elif kind == "f32" and name.endswith("ffn_gate_inp.weight"):
            data = (a.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif kind == "f32":  # norms and scales: positive, near 1
            data = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            data = random_blocks(rng, types[kind], n, a.std)
        w.write_tensor_data(data)
        print(f"[{i}/{len(specs)}] {name} {shape} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    w.close()
    os.replace(tmp, a.out)
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2**30:.2f} GiB)")
    return 0


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
    ap.add_argument("--arch", choices=("qwen3moe", "gemma4"), default="qwen3moe")
    ap.add_argument("--tokenizer-from", required=True, help="GGUF whose tokenizer.* metadata is copied")
    ap.add_argument("--type", default="Q8_0", help="ggml type of the big matrices (gguf can quantize: Q8_0, "
                    "Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16)")
    ap.add_argument("--layers", type=int, default=None, help="default: 8 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--hidden", type=int, default=None, help="default: 2048 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--heads", type=int, default=None, help="default: 32 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: 4 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--head-dim", type=int, default=None, help="default: 128 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--experts", type=int, default=None, help="default: 128 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--top-k", type=int, default=None, help="default: 8 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--expert-ff", type=int, default=None, help="default: 768 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.arch == "gemma4":
        return write_gemma4(a)
    for key, value in {"layers": 8, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128,
                       "top_k": 8, "expert_ff": 768}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
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
