"""Write a random-weight MoE GGUF of a chosen shape, for benchmarks: ``qwen3moe``, ``gemma4`` or ``gpt-oss`` (and, of
the qwen3moe shape, ``llama`` (Mixtral), ``olmoe`` and ``qwen2moe``).

qwen3moe default shape: Qwen3-30B-A3B's (hidden 2048, 32 heads / 4 KV heads of dim 128, 128 experts, top-8,
expert FFN 768) cut to 8 layers. Weights are N(0, std) floats quantized with the `gguf` package's reference
quantizer (Q8_0 by default; norms and the router stay F32, as llama.cpp's converter writes them). ``--type Q4_K``,
``Q4_K_M`` or ``Q6_K`` instead writes random blocks of those types directly (``FAST_TYPES``, ``random_blocks``), on
every CPU: a 32-layer file (~11 GiB) in about a minute on 16 cores, where the float quantizer takes far longer.

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

gpt-oss (``--arch gpt-oss``) default shape: gpt-oss-20b's published config (openai/gpt-oss-20b ``config.json``:
hidden 2880, 64 query / 8 KV heads of dim 64 with q/k/v/o biases and per-head sinks, sliding window 128 on every
other layer (layer 0 sliding), RoPE base 150000 with YaRN factor 32 over 4096 (beta 32 / 1), 32 experts, top-4,
expert FFN 2880 with per-expert gate/up/down biases, router with bias, RMS eps 1e-5), cut to 4 layers. Types as
llama.cpp's ``MXFP4_MOE`` writes them (the ``gpt-oss-tiny`` fixture's quantization): the experts MXFP4, the
other matrices (attention, embedding, output) Q8_0, norms, biases, sinks and the router F32; random blocks
(``--type`` is ignored).

The tokenizer metadata is copied from any GGUF that has one (``--tokenizer-from``). llama.cpp loads the
result (an ordinary GGUF of that architecture); tensors are generated and written one at a time, so memory
stays near the size of the largest tensor.

    python tools/make_bench_model.py -o /tmp/q30b-8l-q8_0.gguf --tokenizer-from TOKENIZER.gguf
    python tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q30b-32l-q4_k_m.gguf --tokenizer-from TOK.gguf
    python tools/make_bench_model.py --arch gemma4 --type Q4_0 -o /tmp/g26b-6l.gguf --tokenizer-from GEMMA.gguf

deepseek2 (``--arch deepseek2``) default shape: GLM-4.7-Flash's (transformers' ``Glm4MoeLiteConfig`` defaults,
which llama.cpp's converter writes as deepseek2: hidden 2048, 20 heads, MLA with q LoRA rank 768, KV LoRA rank 512,
qk_nope 192, qk_rope 64, v 256, the split ``attn_k_b`` / ``attn_v_b``; one leading dense layer of FFN 10240; 64
experts, top-4, expert FFN 1536, one shared expert; sigmoid routing with the ``exp_probs_b`` selection bias and no
gating key, renormalised, scaled by 1.8; RoPE base 1e6, no scaling; RMS eps 1e-5), cut to 4 layers. Types: the
Q4_K_M mix of ``fast_type`` as random blocks (ffn_down, ffn_down_exps, ffn_down_shexp Q6_K in use_more_bits's
layers, output Q6_K, the rest Q4_K), but ``attn_k_b`` Q8_0 (its rows of qk_nope = 192 values are no multiple of
Q4_K's 256; llama.cpp's quantizer falls back to another type there too); ``--type`` is ignored. Tensor names and
metadata keys as the converter writes them (checked against the ``deepseek2-glm47flash-tiny`` fixture).

``--arch llama`` / ``olmoe`` / ``qwen2moe`` / ``glm4moe``: the qwen3moe shape and types with that family's tensors
(no q/k norms for llama; q/k norms over the whole projection for olmoe; q/k/v biases and a shared expert of width
``--shared-ff`` with its sigmoid gate for qwen2moe; for glm4moe q/k/v biases, a leading dense layer, sigmoid routing
with a score bias, an ungated shared expert and half of each head rotated), so the families' decode steps can be
compared at one shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize


def tensor_specs(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """[(name, torch-order shape, quantize?)] in file order."""
    hd, arch = a.head_dim, a.arch
    specs = [("token_embd.weight", (n_vocab, a.hidden), True)]
    for i in range(a.layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (a.hidden,), False),
            (p + "attn_q.weight", (a.heads * hd, a.hidden), True),
            (p + "attn_k.weight", (a.kv_heads * hd, a.hidden), True),
            (p + "attn_v.weight", (a.kv_heads * hd, a.hidden), True),
            (p + "attn_output.weight", (a.hidden, a.heads * hd), True),
        ]
        if arch == "qwen3moe":
            specs += [(p + "attn_q_norm.weight", (hd,), False), (p + "attn_k_norm.weight", (hd,), False)]
        elif arch == "olmoe":  # normed over the whole projection
            specs += [(p + "attn_q_norm.weight", (a.heads * hd,), False),
                      (p + "attn_k_norm.weight", (a.kv_heads * hd,), False)]
        elif arch in ("qwen2moe", "glm4moe"):
            specs += [(p + "attn_q.bias", (a.heads * hd,), False), (p + "attn_k.bias", (a.kv_heads * hd,), False),
                      (p + "attn_v.bias", (a.kv_heads * hd,), False)]
        if arch == "glm4moe":
            specs += [(p + "post_attention_norm.weight", (a.hidden,), False)]
            if i < GLM_DENSE:
                specs += [(p + "ffn_gate.weight", (DENSE_FF, a.hidden), True),
                          (p + "ffn_up.weight", (DENSE_FF, a.hidden), True),
                          (p + "ffn_down.weight", (a.hidden, DENSE_FF), True)]
                continue
            specs += [(p + "exp_probs_b.bias", (a.experts,), False)]
        else:
            specs += [(p + "ffn_norm.weight", (a.hidden,), False)]
        specs += [
            (p + "ffn_gate_inp.weight", (a.experts, a.hidden), False),
            (p + "ffn_gate_exps.weight", (a.experts, a.expert_ff, a.hidden), True),
            (p + "ffn_up_exps.weight", (a.experts, a.expert_ff, a.hidden), True),
            (p + "ffn_down_exps.weight", (a.experts, a.hidden, a.expert_ff), True),
        ]
        if arch == "qwen2moe":
            specs += [(p + "ffn_gate_inp_shexp.weight", (1, a.hidden), False)]
        if arch in ("qwen2moe", "glm4moe"):
            specs += [(p + "ffn_gate_shexp.weight", (a.shared_ff, a.hidden), True),
                      (p + "ffn_up_shexp.weight", (a.shared_ff, a.hidden), True),
                      (p + "ffn_down_shexp.weight", (a.hidden, a.shared_ff), True)]
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


#: Standard deviation of the integer codes of random blocks (uniform bytes): int8 (Q8_0), a nibble minus 8
#: (Q4_0), a nibble (Q4_K, before its per-32 offset), a 6-bit code minus 32 (Q6_K).
_SD_INT8, _SD_NIBBLE, _SD_6BIT = 73.9, float(np.sqrt((16**2 - 1) / 12)), float(np.sqrt((64**2 - 1) / 12 + 0.25))
#: Q4_K sub-block scales: even values 32..62, each sub-block's min half its scale, so that with dmin = 15 d
#: every sub-block's offset (dmin * mn = 7.5 d * sc) centres its nibbles on 0.
_Q4K_SCALES = np.arange(32, 63, 2)
#: Q6_K sub-block scales (int8): 32..127.
_Q6K_SCALES = np.arange(32, 128)


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n_values: int, std: float) -> np.ndarray:
    """Random ggml blocks (ggml-common.h layouts) of ``n_values`` values of about ``std`` and mean about 0; uint8
    array of the bytes. Q8_0: f16 d, 32 x int8. Q4_0: f16 d, 16 bytes of 4-bit quants stored with an offset of 8.
    Q4_K: f16 d, f16 dmin = 15 d, 12 bytes of 6-bit (scale, min) pairs (scales from :data:`_Q4K_SCALES`, each min
    half its scale), 128 bytes of nibbles. Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
    scales (:data:`_Q6K_SCALES`), f16 d. MXFP4: an e8m0 exponent byte, 16 bytes of 4-bit codes of ggml's
    kvalues; the scale a power of two, so the std is ``std`` within a factor of 2^0.5. The quants are uniform random
    bytes, d fixed per type and ``std``."""
    from gguf import GGML_QUANT_SIZES

    blk, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_values // blk
    out = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        out[:, :2] = np.frombuffer(np.float16(std / _SD_INT8).tobytes(), dtype=np.uint8)
    elif qtype == GGMLQuantizationType.Q4_0:
        out[:, :2] = np.frombuffer(np.float16(std / 4.61).tobytes(), dtype=np.uint8)
    elif qtype == GGMLQuantizationType.Q4_K:
        d = std / (_SD_NIBBLE * float(np.sqrt(np.mean(_Q4K_SCALES.astype(np.float64) ** 2))))
        out[:, :4] = np.frombuffer(np.array([d, 15 * d], dtype=np.float16).tobytes(), dtype=np.uint8)
        sc = rng.choice(_Q4K_SCALES.astype(np.uint8), size=(n_blocks, 8))
        mn = sc >> 1
        out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)  # get_scale_min_k4's packing
        out[:, 8:12] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
        out[:, 12:16] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    elif qtype == GGMLQuantizationType.MXFP4:  # e8m0 exponent byte: values kvalue * 2^(e - 128) (ggml-common.h)
        sd = float(np.sqrt(np.mean(np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float64) ** 2)))  # |kvalues|
        out[:, 0] = np.uint8(128 + round(float(np.log2(std / sd))))
    elif qtype == GGMLQuantizationType.Q6_K:
        d = std / (_SD_6BIT * float(np.sqrt(np.mean(_Q6K_SCALES.astype(np.float64) ** 2))))
        out[:, 192:208] = rng.choice(_Q6K_SCALES.astype(np.uint8), size=(n_blocks, 16))
        out[:, 208:210] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    else:
        raise SystemExit(f"random blocks of type {qtype.name} are not supported (Q8_0, Q4_0, Q4_K, Q6_K, MXFP4)")
    return out.reshape(-1)


#: Bytes of blocks one worker generates at a time (``random_tensor``).
CHUNK_BYTES = 32 * 2**20


def random_tensor(pool, seed: tuple[int, ...], qtype: GGMLQuantizationType, n_values: int,  # noqa: ANN001
                  std: float) -> tuple[np.ndarray, list]:
    """``random_blocks`` of a whole tensor, generated in CHUNK_BYTES pieces on ``pool`` (a thread pool: numpy's
    generators release the GIL); piece ``j`` draws from ``default_rng((*seed, j))``, so the bytes do not depend on
    the number of threads. Returns the output array and the pieces' futures (the array is complete once they
    are all done)."""
    from gguf import GGML_QUANT_SIZES

    blk, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_values // blk
    out = np.empty(n_blocks * size, dtype=np.uint8)
    per = max(1, CHUNK_BYTES // size)

    def piece(j: int) -> None:
        a, b = j * per, min(n_blocks, (j + 1) * per)
        out[a * size:b * size] = random_blocks(np.random.default_rng((*seed, j)), qtype, (b - a) * blk, std)

    return out, [pool.submit(piece, j) for j in range(-(-n_blocks // per))]


def write_header(w: GGUFWriter, specs: list[tuple[str, tuple[int, ...], str]], types: dict) -> None:
    """The tensor table of ``specs`` ([(name, torch-order shape, kind)], ``types``: kind -> ggml type), then the
    header, metadata and tensor table written to ``w``'s file."""
    from gguf import GGML_QUANT_SIZES

    for name, shape, kind in specs:
        t = types[kind]
        blk, size = GGML_QUANT_SIZES[t]
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) // blk * size, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()


def finish(w: GGUFWriter, tmp: str, out: str) -> int:
    """Close ``w`` (writing to ``tmp``), move the file to ``out`` and say its size; returns 0 (the exit status)."""
    w.close()
    os.replace(tmp, out)
    print(f"wrote {out} ({os.path.getsize(out) / 2**30:.2f} GiB)")
    return 0


def _fill_defaults(a: argparse.Namespace, shape: dict) -> None:
    """The shape's value for each option the command line left unset (None)."""
    for key, value in shape.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)


def write_gemma4(a: argparse.Namespace) -> int:
    """Write the gemma4 benchmark file (see the module docstring)."""
    _fill_defaults(a, GEMMA4_26B_A4B)
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
    write_header(w, specs, types)
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
    return finish(w, tmp, a.out)


#: gpt-oss-20b (openai/gpt-oss-20b config.json), the defaults of ``--arch gpt-oss`` (layers: cut from 24)
GPT_OSS_20B = {
    "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts": 32, "top_k": 4, "expert_ff": 2880,
    "sliding_window": 128, "rope_base": 150000.0, "yarn_factor": 32.0, "yarn_orig_ctx": 4096, "layers": 4,
}


def gpt_oss_tensor_specs(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, torch-order shape, kind)] of a gpt-oss file, kind "expert" (MXFP4) | "dense" (Q8_0) | "f32" (norms,
    biases, sinks, router); the tensors llama.cpp's converter writes for gpt-oss (checked against the
    ``gpt-oss-tiny`` fixture)."""
    hd, e, ff, n = a.head_dim, a.experts, a.expert_ff, a.hidden
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, n), "dense")]
    for i in range(a.layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (n,), "f32"),
            (p + "attn_q.weight", (a.heads * hd, n), "dense"), (p + "attn_q.bias", (a.heads * hd,), "f32"),
            (p + "attn_k.weight", (a.kv_heads * hd, n), "dense"), (p + "attn_k.bias", (a.kv_heads * hd,), "f32"),
            (p + "attn_v.weight", (a.kv_heads * hd, n), "dense"), (p + "attn_v.bias", (a.kv_heads * hd,), "f32"),
            (p + "attn_output.weight", (n, a.heads * hd), "dense"), (p + "attn_output.bias", (n,), "f32"),
            (p + "attn_sinks.weight", (a.heads,), "f32"),
            (p + "post_attention_norm.weight", (n,), "f32"),
            (p + "ffn_gate_inp.weight", (e, n), "f32"), (p + "ffn_gate_inp.bias", (e,), "f32"),
            (p + "ffn_gate_exps.weight", (e, ff, n), "expert"), (p + "ffn_gate_exps.bias", (e, ff), "f32"),
            (p + "ffn_up_exps.weight", (e, ff, n), "expert"), (p + "ffn_up_exps.bias", (e, ff), "f32"),
            (p + "ffn_down_exps.weight", (e, n, ff), "expert"), (p + "ffn_down_exps.bias", (e, n), "f32"),
        ]
    specs += [("output_norm.weight", (n,), "f32"), ("output.weight", (n_vocab, n), "dense")]
    return specs


def write_gpt_oss(a: argparse.Namespace) -> int:
    """Write the gpt-oss benchmark file (see the module docstring)."""
    _fill_defaults(a, GPT_OSS_20B)
    rng = np.random.default_rng(a.seed)
    tmp = a.out + ".tmp"
    arch = "gpt-oss"
    w = GGUFWriter(tmp, arch)
    w.add_name(f"random gpt-oss-20b shape {a.layers}L h{a.hidden} e{a.experts} top{a.top_k} ff{a.expert_ff} "
               f"MXFP4_MOE")
    w.add_block_count(a.layers)
    w.add_context_length(131072)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.expert_ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_freq_base(a.rope_base)
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", a.yarn_factor)
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", a.yarn_orig_ctx)
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_uint32(f"{arch}.attention.sliding_window", a.sliding_window)
    w.add_expert_feed_forward_length(a.expert_ff)
    w.add_file_type(38)  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE, as llama.cpp's quantizer writes it
    n_vocab = copy_tokenizer(a.tokenizer_from, w)
    specs = gpt_oss_tensor_specs(a, n_vocab)
    types = {"f32": GGMLQuantizationType.F32, "dense": GGMLQuantizationType.Q8_0,
             "expert": GGMLQuantizationType.MXFP4}
    write_header(w, specs, types)
    t0 = time.time()
    for i, (name, shape, kind) in enumerate(specs, 1):
        if name.endswith("norm.weight"):  # positive, near 1
            data = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif kind == "f32":  # biases, sinks, the router
            data = (a.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            data = random_blocks(rng, types[kind], int(np.prod(shape)), a.std)
        w.write_tensor_data(data)
        print(f"[{i}/{len(specs)}] {name} {shape} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return finish(w, tmp, a.out)


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


#: GLM-4.7-Flash (transformers' Glm4MoeLiteConfig defaults), the defaults of ``--arch deepseek2``
GLM47_FLASH = {
    "hidden": 2048, "heads": 20, "q_rank": 768, "kv_rank": 512, "nope": 192, "rope": 64, "v_dim": 256, "experts": 64,
    "top_k": 4, "expert_ff": 1536, "dense_ff": 10240, "layers": 4,
}


def deepseek2_tensor_specs(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, torch-order shape, kind)] of a deepseek2 (GLM-4.7-Flash-shaped) file, kind "f32" | "q4k" | "q6k" |
    "q8": the Q4_K_M mix of the module docstring."""
    n, h, r, rot, e, ff = a.hidden, a.heads, a.kv_rank, a.rope, a.experts, a.expert_ff
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, n), "q4k")]
    for i in range(a.layers):
        p, down = f"blk.{i}.", ("q6k" if use_more_bits(i, a.layers) else "q4k")
        specs += [
            (p + "attn_norm.weight", (n,), "f32"),
            (p + "attn_q_a.weight", (a.q_rank, n), "q4k"), (p + "attn_q_a_norm.weight", (a.q_rank,), "f32"),
            (p + "attn_q_b.weight", (h * (a.nope + rot), a.q_rank), "q4k"),
            (p + "attn_kv_a_mqa.weight", (r + rot, n), "q4k"), (p + "attn_kv_a_norm.weight", (r,), "f32"),
            (p + "attn_k_b.weight", (h, r, a.nope), "q8" if a.nope % 256 else "q4k"),
            (p + "attn_v_b.weight", (h, a.v_dim, r), "q8" if r % 256 else "q4k"),
            (p + "attn_output.weight", (n, h * a.v_dim), "q4k"),
            (p + "ffn_norm.weight", (n,), "f32"),
        ]
        if i < 1:  # the leading dense layer
            specs += [(p + "ffn_gate.weight", (a.dense_ff, n), "q4k"), (p + "ffn_up.weight", (a.dense_ff, n), "q4k"),
                      (p + "ffn_down.weight", (n, a.dense_ff), down)]
            continue
        specs += [
            (p + "ffn_gate_inp.weight", (e, n), "f32"), (p + "exp_probs_b.bias", (e,), "f32"),
            (p + "ffn_gate_exps.weight", (e, ff, n), "q4k"), (p + "ffn_up_exps.weight", (e, ff, n), "q4k"),
            (p + "ffn_down_exps.weight", (e, n, ff), down),
            (p + "ffn_gate_shexp.weight", (ff, n), "q4k"), (p + "ffn_up_shexp.weight", (ff, n), "q4k"),
            (p + "ffn_down_shexp.weight", (n, ff), down),
        ]
    specs += [("output_norm.weight", (n,), "f32"), ("output.weight", (n_vocab, n), "q6k")]
    return specs


def write_deepseek2(a: argparse.Namespace) -> int:
    """Write the deepseek2 (GLM-4.7-Flash-shaped) benchmark file (see the module docstring)."""
    _fill_defaults(a, GLM47_FLASH)
    tmp, arch = a.out + ".tmp", "deepseek2"
    w = GGUFWriter(tmp, arch)
    w.add_name(f"random GLM-4.7-Flash shape {a.layers}L h{a.hidden} e{a.experts} top{a.top_k} ff{a.expert_ff} Q4_K_M")
    w.add_block_count(a.layers)
    w.add_context_length(202752)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.dense_ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_uint32(f"{arch}.expert_group_count", 1)
    w.add_uint32(f"{arch}.expert_group_used_count", 1)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_leading_dense_block_count(1)
    w.add_uint32(f"{arch}.attention.q_lora_rank", a.q_rank)
    w.add_uint32(f"{arch}.attention.kv_lora_rank", a.kv_rank)
    w.add_key_length(a.kv_rank + a.rope)
    w.add_value_length(a.kv_rank)
    w.add_uint32(f"{arch}.attention.key_length_mla", a.nope + a.rope)
    w.add_uint32(f"{arch}.attention.value_length_mla", a.v_dim)
    w.add_expert_feed_forward_length(a.expert_ff)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(1.8)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(a.rope)
    n_vocab = copy_tokenizer(a.tokenizer_from, w)
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
    specs = deepseek2_tensor_specs(a, n_vocab)
    T = GGMLQuantizationType
    types = {"f32": T.F32, "q4k": T.Q4_K, "q6k": T.Q6_K, "q8": T.Q8_0}
    write_header(w, specs, types)
    t0 = time.time()
    rng = np.random.default_rng(a.seed)
    for i, (name, shape, kind) in enumerate(specs, 1):
        if name.endswith("norm.weight"):  # positive, near 1
            data = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif kind == "f32":  # the router, the selection bias
            data = (a.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            data = random_blocks(rng, types[kind], int(np.prod(shape)), a.std)
        w.write_tensor_data(data)
        print(f"[{i}/{len(specs)}] {name} {shape} {kind} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return finish(w, tmp, a.out)


#: glm4moe: the leading dense layers (GLM-4.5-Air's first_k_dense_replace) and the dense FFN's width (the
#: ``feed_forward_length`` written for every family)
GLM_DENSE, DENSE_FF = 1, 6144


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--arch", choices=("qwen3moe", "gemma4", "gpt-oss", "llama", "olmoe", "qwen2moe", "glm4moe",
                                       "deepseek2"),
                    default="qwen3moe", help="llama (Mixtral), olmoe, qwen2moe, glm4moe: the qwen3moe shape with that "
                    "family's tensors; deepseek2: GLM-4.7-Flash's shape")
    ap.add_argument("--tokenizer-from", required=True, help="GGUF whose tokenizer.* metadata is copied")
    ap.add_argument("--type", default="Q8_0", help="ggml type of the big matrices: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, "
                    "BF16 through gguf's quantizer (slow); Q4_K, Q4_K_M, Q6_K as random blocks (fast; qwen3moe: see "
                    "FAST_TYPES); gemma4: Q4_0 or Q8_0 experts, random blocks")
    ap.add_argument("--threads", type=int, default=None, help="generator threads of the random-block types "
                    "(default: every CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default: 8 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--hidden", type=int, default=None, help="default: 2048 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--heads", type=int, default=None, help="default: 32 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: 4 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--head-dim", type=int, default=None, help="default: 128 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--experts", type=int, default=None, help="default: 128 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--top-k", type=int, default=None, help="default: 8 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--expert-ff", type=int, default=None, help="default: 768 (qwen3moe); the 26B-A4B value (gemma4)")
    ap.add_argument("--shared-ff", type=int, default=None, help="qwen2moe: the shared expert's width (default: "
                    "Qwen1.5-MoE-A2.7B's 5632); glm4moe: --expert-ff (one shared expert)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.arch == "gemma4":
        return write_gemma4(a)
    if a.arch == "gpt-oss":
        return write_gpt_oss(a)
    if a.arch == "deepseek2":
        return write_deepseek2(a)
    _fill_defaults(a, {"layers": 8, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128,
                       "top_k": 8, "expert_ff": 768})
    if a.shared_ff is None:
        a.shared_ff = a.expert_ff if a.arch == "glm4moe" else 5632
    fast = a.type in FAST_TYPES
    qtype = None if fast else GGMLQuantizationType[a.type]
    tmp = a.out + ".tmp"
    w = GGUFWriter(tmp, a.arch)
    family = "Qwen3-MoE" if a.arch == "qwen3moe" else a.arch
    w.add_name(f"random {family} {a.layers}L h{a.hidden} e{a.experts} top{a.top_k} ff{a.expert_ff} {a.type}")
    w.add_block_count(a.layers)
    w.add_context_length(4096)
    w.add_embedding_length(a.hidden)
    # llama and olmoe: the experts' width (llama.cpp's n_ff for these families)
    w.add_feed_forward_length(a.expert_ff if a.arch in ("llama", "olmoe") else DENSE_FF)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_expert_feed_forward_length(a.expert_ff)
    if a.arch == "llama":
        w.add_rope_dimension_count(a.head_dim)
    if a.arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(a.shared_ff)
    if a.arch == "glm4moe":  # GLM-4.5-Air's routing: sigmoid, renormalised, scaled by 1.0; half of each head rotated
        w.add_rope_dimension_count(a.head_dim // 2)
        w.add_leading_dense_block_count(GLM_DENSE)
        w.add_expert_shared_count(1)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
    if fast and a.type == "Q4_K_M":
        w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M: llama-bench's model column says "Q4_K - Medium"
    n_vocab = copy_tokenizer(a.tokenizer_from, w)
    specs = tensor_specs(a, n_vocab)
    from gguf import GGML_QUANT_SIZES
    types = []
    for name, shape, q in specs:
        t = fast_type(a.type, name, a.layers) if fast and q else (qtype if q else GGMLQuantizationType.F32)
        types.append(t)
        if t == GGMLQuantizationType.F32:
            nbytes = 4 * int(np.prod(shape))
        else:
            blk, size = GGML_QUANT_SIZES[t]
            nbytes = int(np.prod(shape)) // blk * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    if fast:
        write_fast(a, w, specs, types, t0)
    else:
        rng = np.random.default_rng(a.seed)
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
    size = os.path.getsize(a.out)
    print(f"wrote {a.out} ({size / 2**30:.2f} GiB) in {time.time() - t0:.1f}s")
    return 0


#: ``--type`` values written as random blocks directly (qwen3moe), not through the gguf quantizer: seconds per
#: GiB instead of minutes. Q4_K: every matrix Q4_K but output.weight, Q6_K. Q4_K_M: llama.cpp's Q4_K_M mix
#: (src/llama-quant.cpp): Q4_K, with attn_v and ffn_down_exps Q6_K in the layers its use_more_bits picks
#: (the first and last eighth, every third one between) and output.weight Q6_K. Q6_K: every matrix Q6_K.
FAST_TYPES = ("Q4_K", "Q4_K_M", "Q6_K")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers whose attn_v / ffn_down Q4_K_M makes Q6_K."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def fast_type(mix: str, name: str, n_layers: int) -> GGMLQuantizationType:
    """The ggml type of quantized tensor ``name`` under ``--type mix`` (one of FAST_TYPES)."""
    T = GGMLQuantizationType
    if mix == "Q6_K" or name == "output.weight":
        return T.Q6_K
    if mix == "Q4_K_M" and name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down_exps.weight")):
        return T.Q6_K if use_more_bits(int(name.split(".")[1]), n_layers) else T.Q4_K
    return T.Q4_K


def write_fast(a: argparse.Namespace, w: GGUFWriter, specs: list, types: list, t0: float) -> None:
    """Tensor data of a FAST_TYPES file: random blocks (``random_tensor``) on ``a.threads`` threads, the next
    tensor generated while the current one is written; F32 tensors (norms, router) N(0, std) or 1 + N(0, 0.1)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(a.threads or os.cpu_count() or 1) as pool:
        def start(i: int) -> tuple[np.ndarray, list]:
            name, shape, _ = specs[i]
            n = int(np.prod(shape))
            if types[i] != GGMLQuantizationType.F32:
                return random_tensor(pool, (a.seed, i), types[i], n, a.std)
            rng = np.random.default_rng((a.seed, i))
            if name.endswith("norm.weight"):
                return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32), []
            return (a.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32), []

        pending = start(0)
        for i, (name, shape, _) in enumerate(specs):
            data, futures = pending
            for f in futures:
                f.result()
            pending = start(i + 1) if i + 1 < len(specs) else None
            w.write_tensor_data(data)
            print(f"[{i + 1}/{len(specs)}] {name} {shape} {types[i].name} {time.time() - t0:.0f}s", file=sys.stderr,
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
