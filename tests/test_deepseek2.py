"""DeepSeek-V2/V3 (``deepseek2``): the standard bars (tests/family.py) and what is particular to the family.

The fixture ``deepseek2-tiny`` (tools/fixtures_deepseek2.py) is a random-weight ``DeepseekV3ForCausalLM`` shaped
like the published DeepSeek-V3 config with the sizes cut: 4 layers (the first dense), 4 heads of MLA with q LoRA
512 and kv LoRA 256, qk_nope 128 / qk_rope 64 / v 128 (published), interleaved RoPE with the published YaRN
(factor 40, original context 4096, mscale_all_dim 1), 16 experts top-4 in 4 groups of which 2 are eligible,
sigmoid routing with a noised correction bias, renormalized, scale 2.5, one shared expert. Converted by the
llama.cpp converter vendored in the pinned sdist to F32 and Q8_0, and quantized by llama.cpp to Q4_K_M.

Tolerances: the project's 1e-4 against transformers and against llama.cpp. These are float32 programs that order
their sums differently, and the YaRN attention scale (m^2 = 1.87 times 1/sqrt(192)) sharpens every softmax, so
the rounding differences are larger than on the other families (measured before the test was written, 16-token
prompt: absorbed MLA 6.6e-5 vs transformers; the unabsorbed form, transformers' own order, 3.6e-5; vs llama.cpp
4.7e-5; without rope scaling 2.7e-5 vs transformers). Measured numbers of the test run are in the printed lines
and in the commit message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family import Family, standard_tests
from ggufedit import rewrite
from helpers import assert_bitwise, llama_model, logits_of
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model
from moestream.models.layers import Rope, rope_inv_freq
from moestream.models.routing import group_topk, sigmoid_group_topk

FAM = Family(fixture="deepseek2-tiny", arch="deepseek2", hf_class="DeepseekV3ForCausalLM", top_k=4, n_experts=16,
             n_layers=4, moe_layers=3, quant="q4_k_m")
standard_tests(globals(), FAM)

IDS = [785, 18484, 3493, 572, 5798, 304, 220, 16, 19, 20, 15, 13, 100, 2000, 30000, 151000]  # in-vocabulary
TOL = 1e-4
A = "deepseek2."


def _ours(path, ids=IDS) -> torch.Tensor:  # noqa: ANN001
    """Resident, dequantize-then-matmul logits of ``ids`` at every position (float32 [T, vocab])."""
    model = load_model(str(path), LoadOptions(moe_stream=False, matmul="dequant"))
    try:
        return model.forward(torch.tensor(ids), 0, model.new_cache(len(ids)), logits_all=True)
    finally:
        model.store.close()


def _hf(hf, ids=IDS, **router) -> torch.Tensor:  # noqa: ANN001
    """transformers' logits of ``ids`` with the routers' attributes ``router`` changed for the call."""
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    saved = [{k: getattr(g, k) for k in router} for g in gates]
    try:
        for g in gates:
            for k, v in router.items():
                setattr(g, k, v)
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        for g, s in zip(gates, saved, strict=True):
            for k, v in s.items():
                setattr(g, k, v)


def _llama_logits(llama_cpp, path, ids=IDS) -> np.ndarray:  # noqa: ANN001
    llm = llama_model(llama_cpp, path)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------ unit
def test_interleaved_rope_equals_transformers_form():
    """Interleaved RoPE (pairs 2i, 2i+1) gives transformers' ``apply_rotary_pos_emb_interleave`` values, which
    that function writes de-interleaved (evens' results, then odds'): the same numbers up to that permutation, bit
    for bit; and the NEOX default is unchanged by the option."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen)
    inv = rope_inv_freq(10000.0, 64)
    ours = Rope(inv, interleaved=True)(x, 5)
    ang = torch.arange(5, 12).float()[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    xt = x.transpose(0, 1)[None]  # [1, H, T, 64]
    q, _ = apply_rotary_pos_emb_interleave(xt, xt, emb.cos()[None], emb.sin()[None])
    theirs = q[0].transpose(0, 1)  # [T, H, 64]: [rotated evens | rotated odds]
    assert torch.equal(torch.cat((ours[..., 0::2], ours[..., 1::2]), dim=-1), theirs)
    neox = Rope(inv)(x, 5)
    assert torch.equal(neox, Rope(inv, interleaved=False)(x, 5))
    assert not torch.equal(neox, ours)


def test_group_topk_softmax_and_sigmoid():
    """group_topk on sigmoid scores is sigmoid_group_topk (the same bits); on softmax scores it applies the same
    bias, group limit, renormalization and scale (llama.cpp's build_moe_ffn)."""
    gen = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(32, 16, generator=gen)
    bias = 0.3 * torch.randn(16, generator=gen)
    kw = dict(bias=bias, n_group=4, topk_group=2, norm=True, scale=2.5)
    a, b = sigmoid_group_topk(logits, 4, **kw), group_topk(torch.sigmoid(logits), 4, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ids, w = group_topk(torch.softmax(logits, -1), 4)
    want_w, want_ids = torch.softmax(logits, -1).topk(4, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w / want_w.sum(-1, keepdim=True))


def test_metadata(fam_files):
    model = load_model(str(fam_files["f32"]), LoadOptions(metadata_only=True))
    assert (model.gating, model.norm_topk, model.routed_scale, model.n_group, model.topk_group) == (
        "sigmoid", True, 2.5, 4, 2)
    assert (model.q_rank, model.kv_rank, model.head_k, model.head_v, model.n_rot, model.split_kv_b) == (
        512, 256, 192, 128, 64, True)
    assert model.yarn is not None and model.yarn.factor == 40.0 and model.rope_scale == 1.0
    assert model.n_dense == 1 and model.layout.moe_layers == [1, 2, 3]


def test_q4_k_m_has_k_quants(fam_files):
    """The quantized fixture holds real K-quant blocks (FIELD-NOTES: row lengths of 256)."""
    assert {"Q4_K", "Q6_K"} <= set(fam_files["types"]["q4_k_m"]), fam_files["types"]


# ------------------------------------------------------------------------------------------------ routing keys
@pytest.mark.slow
@pytest.mark.parametrize("drop,router", [
    # absent: sigmoid inferred from the exp_probs_b selection bias (llama.cpp would pick softmax, see below)
    ((A + "expert_gating_func",), {}),
    # absent: no scaling (llama.cpp's 0.0), never zero weights
    ((A + "expert_weights_scale",), {"routed_scaling_factor": 1.0}),
    # absent: no renormalization
    ((A + "expert_weights_norm",), {"norm_topk_prob": False}),
], ids=["gating_func", "weights_scale", "weights_norm"])
def test_missing_routing_key_matches_transformers(fam_files, fam_hf, tmp_path, drop, router):
    """The F32 file with a routing key dropped: within 1e-4 of transformers with the router set to what moestream
    takes the missing key to mean (the module docstring of models/deepseek2.py)."""
    path = tmp_path / "dropped.gguf"
    rewrite(fam_files["f32"], path, drop_kv=drop)
    ref = _hf(fam_hf, **router)
    diff = (_ours(path) - ref).abs().max().item()
    print(f"deepseek2 without {drop[0]} vs transformers ({router or 'unchanged'}): max |logit diff| {diff:.3g}")
    assert diff < TOL
    if router:  # the key matters: the file's own value gives other logits
        assert (_hf(fam_hf) - ref).abs().max().item() > 1e-2


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("drop", [A + "expert_weights_scale", A + "expert_weights_norm"])
def test_missing_routing_key_matches_llama_cpp(llama_cpp, fam_files, tmp_path, drop):
    """llama.cpp takes those two absent keys as moestream does: within 1e-4 on the same file."""
    path = tmp_path / "dropped.gguf"
    rewrite(fam_files["f32"], path, drop_kv=(drop,))
    diff = float(np.abs(_ours(path).numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2 without {drop} vs llama.cpp: max |logit diff| {diff:.3g}")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_missing_gating_func_where_llama_cpp_differs(llama_cpp, fam_files, tmp_path):
    """The one documented divergence: without ``expert_gating_func`` llama.cpp picks softmax for this shape (not
    GLM-4.7-Flash's 47/48 layers x 154,880 tokens) and adds the sigmoid model's correction bias to softmax
    probabilities; moestream infers sigmoid from the bias and keeps transformers' logits (the test above). Without
    the bias too (a DeepSeek-V2-style file), both pick softmax and agree."""
    path = tmp_path / "no-gating.gguf"
    rewrite(fam_files["f32"], path, drop_kv=(A + "expert_gating_func",))
    diff = float(np.abs(_ours(path).numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2 without expert_gating_func, bias kept: moestream (sigmoid) vs llama.cpp (softmax) {diff:.3g}")
    assert diff > 1e-2
    no_bias = tmp_path / "no-gating-no-bias.gguf"
    rewrite(fam_files["f32"], no_bias, drop_kv=(A + "expert_gating_func",),
            drop_tensors=tuple(f"blk.{i}.exp_probs_b.bias" for i in (1, 2, 3)))
    assert load_model(str(no_bias), LoadOptions(metadata_only=True)).gating == "softmax"
    diff = float(np.abs(_ours(no_bias).numpy() - _llama_logits(llama_cpp, no_bias)).max())
    print(f"deepseek2 without expert_gating_func nor bias: moestream vs llama.cpp (both softmax) {diff:.3g}")
    assert diff < TOL


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("edit,match", [
    ({"drop_kv": (A + "attention.kv_lora_rank",)}, r"metadata key deepseek2\.attention\.kv_lora_rank is missing"),
    ({"drop_kv": (A + "expert_shared_count",)}, r"metadata key deepseek2\.expert_shared_count is missing"),
    ({"drop_kv": (A + "attention.q_lora_rank",)}, r"tensor blk\.0\.attn_q_a\.weight exists but metadata key"),
    ({"drop_kv": (A + "rope.scaling.yarn_log_multiplier",)}, r"yarn rope scaling without metadata key"),
    ({"set_kv": {A + "expert_gating_func": 3}}, r"expert_gating_func=3 is neither softmax"),
    ({"set_kv": {A + "attention.key_length_mla": 160}}, r"tensor blk\.0\.attn_q_b\.weight has shape"),
    ({"set_kv": {A + "attention.kv_lora_rank": 128}}, r"but MLA needs kv_lora_rank \+ rope"),
    ({"set_kv": {A + "rope.scaling.type": "linear"}}, r"rope\.scaling\.type=linear asks for RoPE scaling"),
    ({"set_kv": {A + "expert_group_used_count": 4}}, r"expert_group_used_count=4 must be at least 1 and less"),
    ({"set_kv": {A + "expert_group_count": 3}}, r"expert_group_count=3 does not divide"),
    ({"set_kv": {A + "leading_dense_block_count": 2}}, r"layer 1 has routed experts but the metadata"),
    ({"set_kv": {A + "expert_feed_forward_length": 512}}, r"has experts of width 256 but"),
])
def test_bad_file_one_line_error(fam_files, tmp_path, edit, match):
    """A deepseek2 file missing a required key or whose keys contradict its tensors: one-line GGUFError naming
    the file and the problem, from the tensor table alone (``inspect``'s path) and from a full load."""
    bad = tmp_path / "bad.gguf"
    rewrite(fam_files["q4_k_m"], bad, **edit)
    for opts in (LoadOptions(metadata_only=True), LoadOptions(moe_stream=False)):
        with pytest.raises(GGUFError, match=match) as e:
            load_model(str(bad), opts)
        msg = str(e.value)
        assert msg.startswith(str(bad)) and "\n" not in msg


def test_streaming_equals_resident_quick(fam_files):
    """Q4_K_M, C kernels: a pool of top-k slots streaming gives the resident logits bit for bit."""
    path = str(fam_files[FAM.quant])
    a = logits_of(load_model(path, LoadOptions(moe_stream=False)), IDS, 4, 5)
    model = load_model(path, LoadOptions(slots=FAM.top_k, io_threads=2, prefetch=True))
    try:
        b = logits_of(model, IDS, 4, 5)
    finally:
        model.store.close()
    assert_bitwise(a, b)
