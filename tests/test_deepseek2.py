"""DeepSeek-V2/V3 (``deepseek2``): the standard bars (tests/family.py) and what is particular to the family.

The fixture ``deepseek2-tiny`` (tools/fixtures_deepseek2.py) is a random-weight ``DeepseekV3ForCausalLM`` shaped
like the published DeepSeek-V3 config with the sizes cut: 4 layers (the first dense), 4 heads of MLA with q LoRA
512 and kv LoRA 256, qk_nope 128 / qk_rope 64 / v 128 (published), interleaved RoPE with the published YaRN
(factor 40, original context 4096, mscale_all_dim 1), 16 experts top-4 in 4 groups of which 2 are eligible,
sigmoid routing with a noised correction bias, renormalized, scale 2.5, one shared expert. Converted by the
llama.cpp converter vendored in the pinned sdist to F32 and Q8_0, and quantized by llama.cpp to Q4_K_M.

Tolerances. Against transformers: the project's 1e-4 (logits over the prompt; the 32 greedy tokens equal), with
transformers run in float64 (helpers.hf_model), because here float32 rounding alone comes to that bar: YaRN's
attention scale (below) amplifies it. Measured on the standard test's prompt (2026-12-03): transformers' own
float32 run is 1.07e-4 from its float64 run; moestream with RoPE tables computed in float32, 1.01e-4 (torch's
attention and RMSNorm) or 1.02e-4 (the C step kernels'); with the tables computed in float64 (layers.Rope), 9.9e-5
and 6.8e-5. The other fixtures of the project are 1e-5..8e-5 from the float64 model whatever the arithmetic.
Against llama.cpp (f32 KV cache, flash attention off): 3e-4, because llama.cpp itself is farther than 1e-4 from
transformers on this file. Measured on the standard test's 33-token prompt plus llama.cpp's 31 greedy decode steps
(teacher forcing, 2026-12-02): llama.cpp vs transformers 1.65e-4 (prompt) / 1.71e-4 (decode); moestream vs
llama.cpp 1.43e-4 / 1.19e-4; moestream vs transformers 7.87e-5 / 1.29e-4. All three are float32 programs that
order their sums differently (llama.cpp and moestream compute MLA absorbed, transformers unabsorbed), and the
published YaRN attention scale (m^2 = 1.87 times 1/sqrt(192)) sharpens every softmax, which amplifies the
rounding: on the 16-token IDS, moestream vs transformers is 6.6e-5 with YaRN (3.6e-5 when the same model computes
MLA unabsorbed) and 2.7e-5 with the rope-scaling keys dropped (and transformers' default RoPE). The top token is
the same at every position. 3e-4 is about twice the measured distances.

With attn_k_b / attn_v_b multiplied on the C kernels (kernels.linear_heads, the default CPU path; 2026-12-05, an
Intel Xeon with AVX-512, the standard tests' prompt): F32 vs transformers 1.46e-4 -> 1.04e-4, vs llama.cpp
1.66e-4 -> 1.24e-4 (torch's batched float32 matmul before); the Q8_0 file now gives llama.cpp's logits on the same
file (test_q8_0_blocks_match_llama_cpp_on_the_same_file).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from family import Family, standard_tests
from ggufedit import read as GGUFReader
from ggufedit import rewrite
from helpers import assert_bitwise, hf_model, llama_model, logits_of
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model
from moestream.models.layers import Rope, rope_inv_freq
from moestream.models.routing import group_topk, sigmoid_group_topk

FAM = Family(fixture="deepseek2-tiny", arch="deepseek2", hf_class="DeepseekV3ForCausalLM", top_k=4, n_experts=16,
             n_layers=4, moe_layers=3, quant="q4_k_m", llama_tol=3e-4,
             # float32 vs transformers' float64 over a logit range of 17.4: under 1e-4 on an AMD EPYC, 1.46e-4 on
             # an Intel Xeon with AVX-512 (torch's float32 kernels block their sums by the CPU's vector width)
             hf_tol=2.5e-4)
standard_tests(globals(), FAM)

IDS = [785, 18484, 3493, 572, 5798, 304, 220, 16, 19, 20, 15, 13, 100, 2000, 30000, 151000]  # in-vocabulary
TOL = 1e-4
A = "deepseek2."
#: the rope-scaling keys of the fixture; the routing-key tests drop them (see test_missing_routing_key_*)
YARN_KEYS = tuple(A + "rope.scaling." + k for k in ("type", "factor", "original_context_length", "yarn_beta_fast",
                                                    "yarn_beta_slow", "yarn_log_multiplier"))


@pytest.fixture(scope="module")
def hf_plain(fam_files):
    """transformers on the fixture's checkpoint with plain RoPE (its rope_parameters set to the default type), in
    float64 (helpers.hf_model)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(fam_files["ckpt"])
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
    return hf_model(fam_files["ckpt"], config=cfg)


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
    ang = torch.arange(5, 12).double()[:, None] * inv.double()[None, :]  # layers.Rope's tables: float64, rounded
    emb = torch.cat((ang, ang), dim=-1)
    xt = x.transpose(0, 1)[None]  # [1, H, T, 64]
    q, _ = apply_rotary_pos_emb_interleave(xt, xt, emb.cos().float()[None], emb.sin().float()[None])
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
def test_missing_routing_key_matches_transformers(fam_files, hf_plain, tmp_path, drop, router):
    """The F32 file with a routing key dropped: within 1e-4 of transformers with the router set to what moestream
    takes the missing key to mean (the module docstring of models/deepseek2.py). The rope-scaling keys are dropped
    too and transformers runs plain RoPE: YaRN's attention scale amplifies float32 rounding to about 1e-4 (module
    docstring), plain RoPE leaves ~3e-5, so the bar separates a wrong default (> 1e-2, asserted) from rounding."""
    path = tmp_path / "dropped.gguf"
    rewrite(fam_files["f32"], path, drop_kv=drop + YARN_KEYS)
    ref = _hf(hf_plain, **router)
    diff = (_ours(path) - ref).abs().max().item()
    print(f"deepseek2 without {drop[0]} (plain RoPE) vs transformers ({router or 'unchanged'}): max |logit diff| "
          f"{diff:.3g}")
    assert diff < TOL
    if router:  # the key matters: the file's own value gives other logits
        assert (_hf(hf_plain) - ref).abs().max().item() > 1e-2


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("drop", [A + "expert_weights_scale", A + "expert_weights_norm"])
def test_missing_routing_key_matches_llama_cpp(llama_cpp, fam_files, tmp_path, drop):
    """llama.cpp takes those two absent keys as moestream does: within 1e-4 on the same file (plain RoPE, as
    above)."""
    path = tmp_path / "dropped.gguf"
    rewrite(fam_files["f32"], path, drop_kv=(drop, *YARN_KEYS))
    diff = float(np.abs(_ours(path).numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2 without {drop} (plain RoPE) vs llama.cpp: max |logit diff| {diff:.3g}")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_missing_gating_func_where_llama_cpp_differs(llama_cpp, fam_files, tmp_path):
    """The one documented divergence: without ``expert_gating_func`` llama.cpp picks softmax for this shape (not
    GLM-4.7-Flash's 47/48 layers x 154,880 tokens) and adds the sigmoid model's correction bias to softmax
    probabilities; moestream infers sigmoid from the bias and keeps transformers' logits (the test above). Without
    the bias too (a DeepSeek-V2-style file), both pick softmax and agree."""
    path = tmp_path / "no-gating.gguf"
    rewrite(fam_files["f32"], path, drop_kv=(A + "expert_gating_func", *YARN_KEYS))
    diff = float(np.abs(_ours(path).numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2 without expert_gating_func, bias kept: moestream (sigmoid) vs llama.cpp (softmax) {diff:.3g}")
    assert diff > 1e-2
    no_bias = tmp_path / "no-gating-no-bias.gguf"
    rewrite(fam_files["f32"], no_bias, drop_kv=(A + "expert_gating_func", *YARN_KEYS),
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


def test_dense_estimate_is_what_is_held(fam_files):
    """The memory plan's dense bytes (estimated from the tensor table, ``inspect --mem``) are what a load holds: the
    Q8_0 file on the C kernels keeps attn_k_b / attn_v_b in its blocks (per-head matmuls, kernels.linear_heads);
    with ``--matmul dequant`` it holds them as float32, 4 bytes a value more; the F32 file (its F32 token_embd is a
    private copy, not left in the file map) on the C kernels."""
    held = {}
    for fmt, matmul in (("q8_0", "blocks"), ("q8_0", "dequant"), ("f32", "blocks")):
        path = str(fam_files[fmt])
        estimate = load_model(path, LoadOptions(metadata_only=True, matmul=matmul)).dense_estimate()
        model = load_model(path, LoadOptions(slots=FAM.top_k, matmul=matmul))
        try:
            assert ("k_b" in model.blocks[1]) == (matmul == "blocks"), (fmt, matmul)
            assert model.dense_bytes == estimate, (fmt, matmul)
            held[fmt, matmul] = model.dense_bytes
        finally:
            model.store.close()
    tensors = load_model(str(fam_files["q8_0"]), LoadOptions(metadata_only=True)).gguf.tensors
    infos = [info for name, info in tensors.items()
             if name.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
    assert len(infos) == 2 * FAM.n_layers and {info.ggml_type for info in infos} == {8}  # Q8_0
    assert held["q8_0", "dequant"] - held["q8_0", "blocks"] == sum(4 * math.prod(i.shape) - i.n_bytes for i in infos)


@pytest.mark.llamacpp
def test_q8_0_blocks_match_llama_cpp_on_the_same_file(llama_cpp, fam_files):
    """The Q8_0 file on the C kernels against llama.cpp on the same file, within the family's llama.cpp bar: the
    per-head up-projections quantize each (token, head) activation row to Q8_0 as llama.cpp's ggml_mul_mat on
    attn_k_b / attn_v_b does (measured 2026-12-05: max |diff| 0 over the 16 positions). With them held as float32
    (before kernels.linear_heads) the same comparison was 2.9 apart with the top token differing at 4 of 16
    positions: this random-weight file under YaRN's sharpened softmax turns Q8 rounding into logit changes of that
    size (the Q8_0 file is 3.7 from the F32 one)."""
    path = fam_files["q8_0"]
    model = load_model(str(path), LoadOptions(moe_stream=False))
    try:
        assert "k_b" in model.blocks[0]  # the blocks path
        ours = model.forward(torch.tensor(IDS), 0, model.new_cache(len(IDS)), logits_all=True).numpy()
    finally:
        model.store.close()
    ref = _llama_logits(llama_cpp, path)
    diff = float(np.abs(ours - ref).max())
    print(f"deepseek2 q8_0 (C kernels) vs llama.cpp on the same file: max |logit diff| {diff:.3g} over {len(IDS)} "
          f"positions")
    assert diff < FAM.llama_tol
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# ------------------------------------------------------------------------------------------------ legacy attn_kv_b
@pytest.mark.slow
def test_legacy_kv_b_file_gives_the_same_logits(fam_files, tmp_path):
    """A file in the older layout (one ``attn_kv_b`` [H x (nope + dv), r] per layer, transformers' kv_b_proj, and
    key_length / value_length = the per-head sizes, no *_mla keys), made from the F32 fixture: moestream splits it
    into the same up-projections, so the logits are the split file's bit for bit."""
    r = GGUFReader(str(fam_files["f32"]))
    t = {x.name: np.asarray(x.data) for x in r.tensors if x.name.endswith(("attn_k_b.weight", "attn_v_b.weight"))}
    kv_b = {}
    for i in range(FAM.n_layers):
        k_b, v_b = t[f"blk.{i}.attn_k_b.weight"], t[f"blk.{i}.attn_v_b.weight"]  # [H, r, nope], [H, dv, r]
        kv_b[f"blk.{i}.attn_kv_b.weight"] = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(
            -1, k_b.shape[1])
    legacy = tmp_path / "legacy.gguf"
    rewrite(fam_files["f32"], legacy, drop_kv=(A + "attention.key_length_mla", A + "attention.value_length_mla"),
            set_kv={A + "attention.key_length": 192, A + "attention.value_length": 128,
                    A + "attention.head_count_kv": 4},
            drop_tensors=tuple(t), add_tensors=kv_b)
    model = load_model(str(legacy), LoadOptions(metadata_only=True))
    assert not model.split_kv_b and (model.head_k, model.head_v) == (192, 128)
    assert torch.equal(_ours(legacy), _ours(fam_files["f32"]))


# ------------------------------------------------------------------------------------------------ V2-Lite shape
@pytest.fixture(scope="module")
def lite_files(fixtures_tool):
    return fixtures_tool.build_fixture("deepseek2-lite-tiny")


@pytest.mark.slow
def test_lite_variant_matches_transformers(lite_files):
    """DeepSeek-V2-Lite-shaped file (``DeepseekV2ForCausalLM``: no q LoRA, softmax gating, no bias, no groups, no
    renormalization, two shared experts, plain RoPE): F32 logits within 1e-4 of transformers."""
    hf = hf_model(lite_files["ckpt"])
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    model = load_model(str(lite_files["f32"]), LoadOptions(metadata_only=True))
    assert (model.q_rank, model.gating, model.norm_topk, model.n_shared, model.n_group) == (0, "softmax", False, 2, 1)
    assert model.yarn is None
    diff = (_ours(lite_files["f32"]) - _hf(hf)).abs().max().item()
    print(f"deepseek2-lite f32 vs transformers: max |logit diff| {diff:.3g} over {len(IDS)} positions")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_lite_variant_matches_llama_cpp(llama_cpp, lite_files, tmp_path):
    """The same model in llama.cpp. llama.cpp requires ``attention.q_lora_rank`` except for the layer counts it
    knows as V2-Lite (26, 27; 48 with a 128,256-token vocabulary), and the converter writes no key for a null
    q_lora_rank: the file gets ``q_lora_rank`` 0 (no q LoRA, what moestream reads for the absent key)."""
    path = tmp_path / "lite.gguf"
    rewrite(lite_files["f32"], path, add_kv={A + "attention.q_lora_rank": (0, GGUFValueType.UINT32)})
    ours = _ours(path)
    assert torch.equal(ours, _ours(lite_files["f32"]))
    diff = float(np.abs(ours.numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2-lite f32 vs llama.cpp: max |logit diff| {diff:.3g} over {len(IDS)} positions")
    assert diff < TOL


# ------------------------------------------------------------------------------------------------ GLM-4.7-Flash shape
@pytest.fixture(scope="module")
def glm_files(fixtures_tool):
    return fixtures_tool.build_fixture("deepseek2-glm47flash-tiny")


@pytest.mark.slow
def test_glm47flash_variant_matches_transformers(glm_files):
    """``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash) through llama.cpp's converter: a deepseek2 file without
    ``expert_gating_func`` (as the real GLM-4.7-Flash GGUFs) but with the correction bias, so moestream takes
    sigmoid; F32 logits within 1e-4 of transformers."""
    model = load_model(str(glm_files["f32"]), LoadOptions(metadata_only=True))
    assert model.gguf.arch_get("expert_gating_func") is None and model.gating == "sigmoid"
    assert (model.head_k, model.head_v, model.n_dense) == (256, 256, 1)
    hf = hf_model(glm_files["ckpt"])
    assert type(hf).__name__ == "Glm4MoeLiteForCausalLM"
    diff = (_ours(glm_files["f32"]) - _hf(hf)).abs().max().item()
    print(f"deepseek2-glm47flash f32 vs transformers: max |logit diff| {diff:.3g} over {len(IDS)} positions")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_glm47flash_variant_matches_llama_cpp(llama_cpp, glm_files, tmp_path):
    """The same file in llama.cpp, given ``expert_gating_func`` 2 (sigmoid): llama.cpp recognises GLM-4.7-Flash
    without the key only by its published shape (47/48 layers, 154,880 tokens), which this tiny file lacks."""
    path = tmp_path / "glm.gguf"
    rewrite(glm_files["f32"], path, add_kv={A + "expert_gating_func": (2, GGUFValueType.UINT32)})
    ours = _ours(path)
    assert torch.equal(ours, _ours(glm_files["f32"]))
    diff = float(np.abs(ours.numpy() - _llama_logits(llama_cpp, path)).max())
    print(f"deepseek2-glm47flash f32 vs llama.cpp: max |logit diff| {diff:.3g} over {len(IDS)} positions")
    assert diff < TOL
