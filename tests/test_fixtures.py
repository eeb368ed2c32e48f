"""The real-tool fixtures are what they claim to be.

``qwen3moe-tiny`` (built by tools/fixtures.py with transformers + llama.cpp's converter) and the embedded
default model (src/moestream/data/default.gguf, built by tools/make_default_model.py) are read back with
the ``gguf`` package: architecture, hyper-parameters, tensor names/types/shapes, tokenizer metadata, and
the converted weights against the checkpoint they came from.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

OUTTYPE_QTYPE = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
}
N_TOKENS = 152064


@functools.cache
def read(path: Path) -> GGUFReader:
    """A (memory-mapped) reader per file, shared by the tests: parsing 152k tokens takes ~10 s."""
    return GGUFReader(path)


def field(reader: GGUFReader, key: str) -> Any:
    assert key in reader.fields, f"missing GGUF key {key}"
    return reader.fields[key].contents()


def tensors(reader: GGUFReader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def always_f32(name: str) -> bool:
    """Tensors the converter keeps in F32 whatever the outtype: 1-D norms and the router."""
    return name.endswith("_norm.weight") or name.endswith("ffn_gate_inp.weight")


def check_model(reader: GGUFReader, cfg: dict[str, Any], qtype: GGMLQuantizationType) -> None:
    """Hyper-parameters, tensor set, shapes (GGML order: fastest dim first) and types against ``cfg``."""
    h, ff, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    hd, nh, nkv, n_layer = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg[
        "num_hidden_layers"]
    assert field(reader, "general.architecture") == "qwen3moe"
    expect_kv = {
        "qwen3moe.block_count": n_layer,
        "qwen3moe.embedding_length": h,
        "qwen3moe.expert_count": n_exp,
        "qwen3moe.expert_used_count": cfg["num_experts_per_tok"],
        "qwen3moe.expert_feed_forward_length": ff,
        "qwen3moe.attention.head_count": nh,
        "qwen3moe.attention.head_count_kv": nkv,
        "qwen3moe.attention.key_length": hd,
        "qwen3moe.attention.value_length": hd,
        "qwen3moe.context_length": cfg["max_position_embeddings"],
    }
    assert {k: field(reader, k) for k in expect_kv} == expect_kv
    assert field(reader, "qwen3moe.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert field(reader, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])

    shapes = {
        "token_embd.weight": [h, N_TOKENS],
        "output_norm.weight": [h],
    }
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = [h, N_TOKENS]
    for i in range(n_layer):
        shapes |= {
            f"blk.{i}.attn_norm.weight": [h],
            f"blk.{i}.attn_q.weight": [h, nh * hd],
            f"blk.{i}.attn_k.weight": [h, nkv * hd],
            f"blk.{i}.attn_v.weight": [h, nkv * hd],
            f"blk.{i}.attn_output.weight": [nh * hd, h],
            f"blk.{i}.attn_q_norm.weight": [hd],
            f"blk.{i}.attn_k_norm.weight": [hd],
            f"blk.{i}.ffn_norm.weight": [h],
            f"blk.{i}.ffn_gate_inp.weight": [h, n_exp],
            f"blk.{i}.ffn_gate_exps.weight": [h, ff, n_exp],
            f"blk.{i}.ffn_up_exps.weight": [h, ff, n_exp],
            f"blk.{i}.ffn_down_exps.weight": [ff, h, n_exp],
        }
    got = tensors(reader)
    assert sorted(got) == sorted(shapes)
    for name, shape in shapes.items():
        assert [int(n) for n in got[name].shape] == shape, name
        want = GGMLQuantizationType.F32 if always_f32(name) else qtype
        assert got[name].tensor_type == want, f"{name}: {got[name].tensor_type.name}, expected {want.name}"


def check_tokenizer(reader: GGUFReader) -> None:
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(field(reader, "tokenizer.ggml.tokens")) == N_TOKENS
    assert len(field(reader, "tokenizer.ggml.merges")) == 151387
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    template = field(reader, "tokenizer.chat_template")
    assert "add_generation_prompt" in template and "<｜Assistant｜>" in template
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[field(reader, "tokenizer.ggml.eos_token_id")] == "<｜end▁of▁sentence｜>"
    assert tokens[field(reader, "tokenizer.ggml.bos_token_id")] == "<｜begin▁of▁sentence｜>"


def type_counts(reader: GGUFReader) -> dict[str, int]:
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors))


# ---------------------------------------------------------------------------------------------------------
# qwen3moe-tiny
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_tiny_gguf_structure(qwen3moe_tiny: dict[str, Any], outtype: str) -> None:
    reader = read(qwen3moe_tiny[outtype])
    print(f"{outtype}: {type_counts(reader)}")
    for t in reader.tensors:
        if t.name.startswith("blk.0.") or not t.name.startswith("blk."):
            print(f"  {t.name:28s} {t.tensor_type.name:5s} {[int(n) for n in t.shape]}")
    check_model(reader, qwen3moe_tiny["config"], OUTTYPE_QTYPE[outtype])
    check_tokenizer(reader)
    assert field(reader, "general.name") == "qwen3moe-tiny"


@pytest.mark.slow
def test_tiny_tokenizer_metadata_round_trips(qwen3moe_tiny: dict[str, Any]) -> None:
    """Tokens, token types, merges, special ids and template equal the GGUF header they were cut from."""
    src = read(qwen3moe_tiny["source_header"])
    out = read(qwen3moe_tiny["q8_0"])
    assert field(src, "tokenizer.ggml.pre") == "deepseek-r1-qwen"
    for key in ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "padding_token_id"):
        assert field(out, f"tokenizer.ggml.{key}") == field(src, f"tokenizer.ggml.{key}"), key
    assert field(out, "tokenizer.chat_template") == field(src, "tokenizer.chat_template")


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_tiny_weights_match_checkpoint(qwen3moe_tiny: dict[str, Any], outtype: str) -> None:
    """Dequantized GGUF tensors equal the checkpoint's (exactly for F32, within the format's error)."""
    from safetensors.numpy import load_file

    cfg = qwen3moe_tiny["config"]
    ff = cfg["moe_intermediate_size"]
    ckpt: dict[str, np.ndarray] = {}
    for f in sorted(Path(qwen3moe_tiny["ckpt"]).glob("*.safetensors")):
        ckpt |= load_file(f)
    layer = cfg["num_hidden_layers"] - 1
    pre = f"model.layers.{layer}"

    def experts(proj: str) -> np.ndarray:
        # transformers saves the per-expert layout of the real Qwen3-MoE checkpoints (it fuses on load)
        return np.stack([ckpt[f"{pre}.mlp.experts.{e}.{proj}.weight"] for e in range(cfg["num_experts"])])

    pairs = {  # GGUF name -> checkpoint array, numpy order (slowest dim first)
        "token_embd.weight": ckpt["model.embed_tokens.weight"],
        "output.weight": ckpt["lm_head.weight"],
        f"blk.{layer}.ffn_gate_exps.weight": experts("gate_proj"),  # (experts, ff, hidden)
        f"blk.{layer}.ffn_up_exps.weight": experts("up_proj"),
        f"blk.{layer}.ffn_down_exps.weight": experts("down_proj"),  # (experts, hidden, ff)
        f"blk.{layer}.ffn_gate_inp.weight": ckpt[f"{pre}.mlp.gate.weight"],
        f"blk.{layer}.attn_q.weight": ckpt[f"{pre}.self_attn.q_proj.weight"],
    }
    assert pairs[f"blk.{layer}.ffn_gate_exps.weight"].shape == (cfg["num_experts"], ff, cfg["hidden_size"])
    got = tensors(read(qwen3moe_tiny[outtype]))
    for name, want in pairs.items():
        t = got[name]
        have = dequantize(t.data, t.tensor_type).reshape(want.shape)
        if t.tensor_type == GGMLQuantizationType.F32:
            np.testing.assert_array_equal(have, want, err_msg=name)
        elif t.tensor_type == GGMLQuantizationType.BF16:
            np.testing.assert_allclose(have, want, rtol=2**-8, atol=0, err_msg=name)
        else:  # Q8_0: 32-wide blocks, step d = amax/127 stored as f16: error <= d/2 + 127*d*2^-11
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(have.reshape(-1, 32) - blocks) <= 0.57 * step + 1e-7), name


@pytest.mark.slow
def test_tiny_checkpoint_greedy_is_not_degenerate(qwen3moe_tiny: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    ckpt = qwen3moe_tiny["ckpt"]
    config = json.loads((Path(ckpt) / "config.json").read_text())
    assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == []
    assert config["tie_word_embeddings"] is False
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.bos_token == "<｜begin▁of▁sentence｜>" and tok.chat_template
    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id  # from the template, not from add_bos_token
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    print("greedy:", new, repr(tok.decode(new)))
    assert len(new) == 16
    assert len(set(new)) >= 8, f"degenerate greedy continuation {new}"
    assert max(new) < len(tok), "predicted a [PAD…] filler token"


@pytest.mark.slow
def test_fixture_cache_hit_rebuilds_nothing(qwen3moe_tiny: dict[str, Any], fixtures_tool: Any) -> None:
    """A second build of a cached fixture is a hit: the same paths, and no file of it written again (their
    modification times unchanged; speed itself lives in benchmarks, not in timed tests)."""
    files = [Path(v) for v in qwen3moe_tiny.values() if isinstance(v, (str, Path)) and Path(v).is_file()]
    before = {f: f.stat().st_mtime_ns for f in files}
    again = fixtures_tool.build_fixture("qwen3moe-tiny")
    assert {f: f.stat().st_mtime_ns for f in files} == before
    assert again == qwen3moe_tiny
    assert all(Path(again[k]).is_file() for k in ("f32", "bf16", "q8_0", "source_header"))


def test_gguf_header_cut(fixtures_tool: Any, default_gguf: Path) -> None:
    """cut_gguf_header keeps the key/values of a real (converter-written) GGUF and drops its tensors."""
    import io

    original = default_gguf.read_bytes()
    with open(default_gguf, "rb") as f:
        header = fixtures_tool.cut_gguf_header(f)
    assert len(header) < 7_000_000 and len(header) % 32 == 0
    # the same bytes up to the end of the key/values, but with a tensor count of 0
    assert int.from_bytes(original[8:16], "little") > 0 and int.from_bytes(header[8:16], "little") == 0
    kv_end = len(header.rstrip(b"\0"))
    assert header[:8] == original[:8] and header[16:kv_end] == original[16:kv_end]
    # (that GGUFReader parses a cut header is covered by test_tiny_tokenizer_metadata_round_trips)
    with pytest.raises(fixtures_tool.FixtureError, match="bad magic"):
        fixtures_tool.cut_gguf_header(io.BytesIO(b"GGML" + header[4:]))
    with pytest.raises(fixtures_tool.FixtureError, match="truncated"):
        fixtures_tool.cut_gguf_header(io.BytesIO(header[:1000]))


# ---------------------------------------------------------------------------------------------------------
# Embedded default model
# ---------------------------------------------------------------------------------------------------------


def test_default_model(default_gguf: Path, make_default_model_tool: Any) -> None:
    spec = make_default_model_tool.DEFAULT_SPEC
    size = default_gguf.stat().st_size
    assert size <= 30_000_000
    reader = read(default_gguf)
    print(f"default.gguf: {size:,} bytes, {type_counts(reader)}")
    check_model(reader, spec.to_json(), GGMLQuantizationType.Q8_0)
    assert "output.weight" not in tensors(reader)  # tied embeddings
    check_tokenizer(reader)
    assert field(reader, "general.name") == "moestream-default"


#: Plain English of the kind the embedded model was trained on (Shakespeare, Milton); neither line is in its texts.
ENGLISH = ("The old man sat by the fire and told his son of the war, and of the friends he had lost in it.",
           "The king is gone to bed, and all his lords are come to see the queen.")


def mean_nll(path: Path, text: str) -> float:
    """moestream's mean next-token negative log-likelihood (nats) of ``text`` under the model at ``path``."""
    import torch

    from helpers import load
    from moestream.engine import Engine
    from moestream.tokenizer import GGUFTokenizer

    ids = GGUFTokenizer.from_gguf(str(path)).encode(text, add_special=False)
    model = load(path, stream=False)
    logits = Engine(model).prefill(ids, model.new_cache(len(ids)), logits_all=True)
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])))


def test_default_model_is_trained(default_gguf: Path, random_default_gguf: Path) -> None:
    """The embedded model predicts English: the random-weight model of its shape is near ln(152,064) = 11.9 nats
    per token or worse, the trained one far below (its held-out loss in training was 4.40; these lines measured
    4.73 and 4.02 when it was made)."""
    for text in ENGLISH:
        random_nll, trained_nll = mean_nll(random_default_gguf, text), mean_nll(default_gguf, text)
        print(f"mean NLL (nats/token): random {random_nll:.2f}, trained {trained_nll:.2f}: {text}")
        assert random_nll > 10.0
        assert trained_nll < 6.0
