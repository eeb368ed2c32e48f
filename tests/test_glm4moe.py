"""GLM-4.5 MoE (``glm4moe``): the standard bars (tests/family.py) and what is particular to the family.

The fixture ``glm4moe-tiny`` (tools/fixtures_glm4moe.py) is a random-weight ``Glm4MoeForCausalLM`` shaped like the
published GLM-4.5-Air config with the sizes cut: 4 trunk layers (the first dense) + 1 MTP layer, 4 query / 2 KV
heads of 128 with q/k/v biases (noised), partial rotary 0.5, 16 experts top-4 of width 256, sigmoid routing with
a noised score-correction bias, top-k weights renormalized, scale 1.0, one shared expert; and, unlike the
published 1 / 1, 4 expert groups of which 2 are eligible. Converted by the llama.cpp converter vendored in the
pinned sdist to F32 and Q8_0, and Q4_K_M by llama.cpp's quantizer (the standard tests' quantized file).
``glm4moe-qknorm-tiny`` is shaped after GLM-4.5 (355B): q/k norm, routed scale 2.5,
three dense layers, no group limit (F32).

Tolerances: the project's 1e-4 against transformers and against llama.cpp (float32 programs that order their sums
differently; FIELD-NOTES measured llama.cpp vs transformers at 2.5e-5 on a tiny DeepSeek-V3, the same sigmoid /
bias / group routing). Measured here (2026-12-02, the printed lines): ``glm4moe-tiny`` F32 vs transformers 8.11e-6
over the 33-token prompt (logit range 15.9), resident and streaming; vs llama.cpp 2.79e-5 over the prompt and 31
decode steps; without the group keys 2.46e-5 and without the norm key 2.71e-5 vs llama.cpp (16 positions);
``glm4moe-qknorm-tiny`` 4.29e-6 vs transformers, 2.4e-5 vs llama.cpp (33 positions). The whole file: 41 tests,
7 min 2 s on this 2-core machine shared with another job (fixtures cached).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family import Family, standard_tests
from ggufedit import rewrite
from helpers import assert_bitwise, hf_model, llama_model, logits_of
from moestream.errors import GGUFError
from moestream.experts.pool import StreamingStore
from moestream.models.base import LoadOptions, load_model
from moestream.models.routing import sigmoid_group_topk

# n_layers: the trunk, as run: 4 layers (the first dense) + 1 MTP block, not run
FAM = Family(fixture="glm4moe-tiny", arch="glm4moe", hf_class="Glm4MoeForCausalLM", top_k=4, n_experts=16,
             n_layers=4, moe_layers=3, quant="q4_k_m")
standard_tests(globals(), FAM)

IDS = [785, 18484, 3493, 572, 5798, 304, 220, 16, 19, 20, 15, 13, 100, 2000, 30000, 151000]  # in-vocabulary
TOL = 1e-4


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


# ------------------------------------------------------------------------------------------------ routing
def _reference_route(logits, bias, top_k, n_group, topk_group, norm, scale):  # noqa: ANN001, ANN202
    """The routing written out token by token in plain Python (the semantics, not the tensor code)."""
    ids_out, w_out = [], []
    for row in logits.tolist():
        scores = [1 / (1 + np.exp(-z)) for z in row]
        choice = [s + b for s, b in zip(scores, bias, strict=True)]
        n = len(row) // n_group
        group_score = [sum(sorted(choice[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [e for e in range(len(row)) if e // n in groups]
        ids = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in ids]
        if norm:
            w = [x / sum(w) for x in w]
        ids_out.append(ids)
        w_out.append([x * scale for x in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float32)


def test_group_routing_by_hand():
    """8 experts in 4 groups of 2, 2 groups eligible, top-2. Expert 0 has the best single score, but its group
    (0, 1) sums to less than groups (2, 3) and (6, 7), so neither 0 nor 1 may be chosen; the bias moves expert 6
    ahead of expert 2 for the choice, while the weights stay the unbiased sigmoid scores, renormalized, scaled."""
    logit = torch.logit
    p = torch.tensor([[0.95, 0.05, 0.80, 0.70, 0.10, 0.10, 0.60, 0.68]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0])
    ids, w = sigmoid_group_topk(logit(p), 2, bias=bias, n_group=4, topk_group=2, norm=True, scale=2.5)
    assert ids.tolist() == [[6, 2]]  # choice scores 0.85, 0.80 (group sums: 1.0, 1.5, 0.2, 1.53)
    want = torch.tensor([0.60, 0.80]) / 1.40 * 2.5
    assert torch.allclose(w[0], want, atol=1e-6)
    # without the group limit expert 0 wins; without the bias expert 3 takes 6's place
    assert sigmoid_group_topk(logit(p), 2, bias=bias, norm=True)[0].tolist() == [[0, 6]]
    assert sigmoid_group_topk(logit(p), 2, n_group=4, topk_group=2, norm=True)[0].tolist() == [[2, 3]]
    # not renormalized, no scale: the raw sigmoid scores
    _, raw = sigmoid_group_topk(logit(p), 2, bias=bias, n_group=4, topk_group=2, norm=False)
    assert torch.allclose(raw[0], torch.tensor([0.60, 0.80]), atol=1e-6)


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (8, 3), (1, 1)])
def test_group_routing_matches_reference(n_group, topk_group):
    """Random logits and bias, 16 experts top-4: the tensor code equals the token-by-token reference."""
    gen = torch.Generator().manual_seed(n_group)
    logits = 2 * torch.randn(64, 16, generator=gen)
    bias = 0.3 * torch.randn(16, generator=gen)
    ids, w = sigmoid_group_topk(logits, 4, bias=bias, n_group=n_group, topk_group=topk_group, norm=True, scale=2.5)
    ref_ids, ref_w = _reference_route(logits, bias.tolist(), 4, n_group, topk_group, True, 2.5)
    assert torch.equal(ids, ref_ids)
    assert (w - ref_w).abs().max().item() < 1e-6


def test_router_matches_transformers(fam_files, fam_hf):
    """Every MoE layer's routing equals transformers' ``Glm4MoeTopkRouter`` on random inputs (same expert sets,
    same weights); the group limit and the correction bias each change the choice of some tokens, and the chosen
    experts of a token lie in at most ``topk_group`` groups."""
    model = load_model(str(fam_files["f32"]), LoadOptions(moe_stream=False, matmul="dequant"))
    h = torch.randn(256, model.n_embd, generator=torch.Generator().manual_seed(0))
    assert (model.n_group, model.topk_group, model.norm_topk, model.routed_scale) == (4, 2, True, 1.0)
    assert model.layout.moe_layers == [1, 2, 3]
    for i in model.layout.moe_layers:
        b = model.blocks[i]
        with torch.no_grad():
            ids, w = model.gate(b, h)
            _, ref_w, ref_ids = fam_hf.model.layers[i].mlp.gate(h)
        o, ref_o = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, o), ref_ids.gather(1, ref_o))
        assert (w.gather(1, o) - ref_w.gather(1, ref_o)).abs().max().item() < 1e-6
        assert ((ids // 4).sort(-1).values.diff(dim=-1) != 0).sum(-1).max().item() + 1 <= 2
        logits = b["router"].linear(h)
        no_groups = sigmoid_group_topk(logits, 4, bias=b["score_bias"], norm=True)[0]
        no_bias = sigmoid_group_topk(logits, 4, n_group=4, topk_group=2, norm=True)[0]
        for other in (no_groups, no_bias):
            assert (other.sort(-1).values != ids.sort(-1).values).any(-1).sum().item() > 10


# ------------------------------------------------------------------------------------------------ MTP
def test_inspect_reports_the_trunk_and_the_mtp_block(fam_files):
    """inspect counts what run runs (the trunk's layers and experts) and names the MTP block apart; the MTP
    block's bytes are counted neither as dense weights nor as routed experts."""
    from helpers import cli
    from moestream.report import _fmt

    p = cli("inspect", "-m", str(fam_files["f32"]))
    assert p.returncode == 0, p.stderr
    m = load_model(str(fam_files["f32"]), LoadOptions(metadata_only=True))
    tensors = m.gguf.tensors
    mtp = sum(t.n_bytes for n, t in tensors.items() if n.startswith("blk.4."))
    trunk_exps = sum(t.n_bytes for n, t in tensors.items() if "_exps." in n and not n.startswith("blk.4."))
    dense = sum(t.n_bytes for n, t in tensors.items() if "_exps." not in n and not n.startswith("blk.4."))
    assert mtp > 0 and m.layout.total_bytes == trunk_exps
    assert f"layers          4 (3 with routed experts); + 1 MTP block ({_fmt(mtp)}), not run" in p.stdout
    assert f"dense weights   {_fmt(dense)} (as stored" in p.stdout
    assert f"dense weights   {_fmt(dense)} (as stored, all resident;" in p.stdout  # an F32 table is copied
    # quantized, with an untied output matrix: run reads the token embeddings' rows from the file's map
    q = fam_files[FAM.quant]
    g = load_model(str(q), LoadOptions(metadata_only=True)).gguf.tensors
    emb = g["token_embd.weight"]
    assert "output.weight" in g and emb.ggml_type != 0
    dense_q = sum(t.n_bytes for n, t in g.items() if "_exps." not in n and not n.startswith("blk.4."))
    pq = cli("inspect", "-m", str(q))
    assert (f"dense weights   {_fmt(dense_q)} (as stored; {_fmt(dense_q - emb.n_bytes)} resident on the CPU, the "
            f"token embeddings' {_fmt(emb.n_bytes)} read from the file's map;") in pq.stdout, pq.stdout
    assert f"routed experts  {_fmt(trunk_exps)} (" in p.stdout


def test_mtp_block_not_run_nor_streamed(fam_files):
    """The file has 5 blocks, the last one the MTP block (``nextn_predict_layers`` 1, with routed experts and
    ``nextn.*`` tensors): moestream runs 4, reads none of block 4's tensors and makes no slot pool for it."""
    path = fam_files["q8_0"]
    model = load_model(str(path), LoadOptions(slots=FAM.top_k, io_threads=2))
    try:
        assert model.gguf.arch_get("block_count") == 5 and model.gguf.arch_get("nextn_predict_layers") == 1
        assert model.has("blk.4.nextn.eh_proj.weight") and model.has("blk.4.ffn_gate_exps.weight")
        assert model.n_layers == 4 and len(model.blocks) == 4
        assert isinstance(model.store, StreamingStore)
        assert sorted(model.store.pools) == [1, 2, 3]
        trunk = sum(info.n_bytes for name, info in model.gguf.tensors.items()
                    if not name.startswith("blk.4.") and "_exps." not in name and name != "token_embd.weight")
        assert model.dense_bytes == trunk  # token_embd stays in the file map (Q8_0); nothing of block 4
    finally:
        model.store.close()


# ------------------------------------------------------------------------------------------------ key defaults
def test_routing_key_defaults_as_llama_cpp(fam_files, fam_hf, tmp_path):
    """Routing keys dropped from the file take llama.cpp's defaults: no ``expert_group_count`` /
    ``expert_group_used_count``: no group limit (what the published n_group = topk_group = 1 means), equal to
    transformers with ``n_group`` 1; no ``expert_weights_norm``: not renormalized, equal to transformers with
    ``norm_topk_prob`` false; no ``expert_weights_scale`` or ``expert_gating_func``: scale 1, sigmoid (this
    file's own values: the same bits)."""
    src = fam_files["f32"]
    base = _ours(src)
    ref = fam_hf.eval()
    assert (base - _hf(ref)).abs().max().item() < TOL

    no_groups = tmp_path / "no-groups.gguf"
    rewrite(src, no_groups, drop_kv=("glm4moe.expert_group_count", "glm4moe.expert_group_used_count"))
    got = _ours(no_groups)
    assert (got - base).abs().max().item() > 1e-3  # the group limit matters on this file
    assert (got - _hf(ref, num_group=1, topk_group=1)).abs().max().item() < TOL

    no_norm = tmp_path / "no-norm.gguf"
    rewrite(src, no_norm, drop_kv=("glm4moe.expert_weights_norm",))
    got = _ours(no_norm)
    assert (got - base).abs().max().item() > 1e-3
    assert (got - _hf(ref, norm_topk_prob=False)).abs().max().item() < TOL

    same = tmp_path / "no-scale-no-gating.gguf"
    rewrite(src, same, drop_kv=("glm4moe.expert_weights_scale", "glm4moe.expert_gating_func"))
    assert torch.equal(_ours(same), base)


def test_routed_scale_applied(fam_files, fam_hf, tmp_path):
    """``expert_weights_scale`` 2.5 (GLM-4.5's routed_scaling_factor): equal to transformers with that factor."""
    scaled = tmp_path / "scale.gguf"
    rewrite(fam_files["f32"], scaled, set_kv={"glm4moe.expert_weights_scale": 2.5})
    got = _ours(scaled)
    assert (got - _hf(fam_hf, routed_scaling_factor=2.5)).abs().max().item() < TOL
    assert (got - _hf(fam_hf)).abs().max().item() > 1e-2


@pytest.mark.llamacpp
def test_routing_key_defaults_llama_cpp_agrees(llama_cpp, fam_files, tmp_path):
    """llama.cpp itself on the files without the group keys and without the norm key: moestream's logits
    within 1e-4 of llama.cpp's on each (the defaults are llama.cpp's), as on the original."""
    src = fam_files["f32"]
    no_groups, no_norm = tmp_path / "no-groups.gguf", tmp_path / "no-norm.gguf"
    rewrite(src, no_groups, drop_kv=("glm4moe.expert_group_count", "glm4moe.expert_group_used_count"))
    rewrite(src, no_norm, drop_kv=("glm4moe.expert_weights_norm",))
    for path in (src, no_groups, no_norm):
        diff = float(np.abs(_ours(path).numpy() - _llama_logits(llama_cpp, path)).max())
        print(f"glm4moe {path.name} vs llama.cpp: max |logit diff| {diff:.3g} over {len(IDS)} positions")
        assert diff < TOL, path.name


def test_mtp_key_absent_refused(fam_files, tmp_path):
    """Without ``nextn_predict_layers`` every block counts as a trunk layer (llama.cpp's default 0), and block 4,
    with its ``nextn.*`` tensors, would run as a fifth layer: refused in one line naming the tensor and the keys."""
    plain = tmp_path / "no-nextn.gguf"
    rewrite(fam_files[FAM.quant], plain, drop_kv=("glm4moe.nextn_predict_layers",))
    with pytest.raises(GGUFError) as e:
        load_model(str(plain), LoadOptions(metadata_only=True))
    msg = str(e.value)
    assert msg.startswith(f"{plain}: tensor blk.4.nextn.") and "block_count=5, glm4moe.nextn_predict_layers=0" in msg
    assert "\n" not in msg


@pytest.mark.llamacpp
def test_mtp_key_absent_llama_cpp_refuses(llama_cpp, fam_files, tmp_path):
    """llama.cpp refuses the same file (the MTP block's tensors are left over: "wrong number of tensors")."""
    plain = tmp_path / "no-nextn.gguf"
    rewrite(fam_files["f32"], plain, drop_kv=("glm4moe.nextn_predict_layers",))
    with pytest.raises(Exception):  # noqa: B017, PT011 - llama-cpp-python raises ValueError or RuntimeError
        llama_model(llama_cpp, plain)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("edit,match", [
    ({"drop_kv": ("glm4moe.expert_shared_count",)}, r"metadata key glm4moe\.expert_shared_count is missing"),
    ({"drop_kv": ("glm4moe.expert_feed_forward_length",)},
     r"metadata key glm4moe\.expert_feed_forward_length is missing"),
    ({"drop_kv": ("glm4moe.attention.layer_norm_rms_epsilon",)},
     r"metadata key glm4moe\.attention\.layer_norm_rms_epsilon is missing"),
    ({"drop_kv": ("glm4moe.leading_dense_block_count",)}, r"layer 0 has no routed experts"),
    ({"set_kv": {"glm4moe.expert_feed_forward_length": 512}},
     r"ffn_\w+_exps\.weight has experts of width 256 but .*expert_feed_forward_length=512"),
    ({"set_kv": {"glm4moe.attention.key_length": 64}}, r"tensor blk\.0\.attn_q\.weight has shape"),
    ({"set_kv": {"glm4moe.rope.dimension_count": 256}}, r"rope\.dimension_count=256 must be even and at most"),
    ({"set_kv": {"glm4moe.expert_group_used_count": 4}}, r"expert_group_used_count=4 must be at least 1 and less"),
    ({"set_kv": {"glm4moe.expert_group_count": 3}}, r"expert_group_count=3 does not divide"),
    ({"set_kv": {"glm4moe.expert_gating_func": 1}}, r"expert_gating_func=1 is not sigmoid"),
    ({"set_kv": {"glm4moe.nextn_predict_layers": 5}}, r"nextn_predict_layers=5 leaves no trunk layers"),
    ({"set_kv": {"glm4moe.leading_dense_block_count": 2}}, r"layer 1 has routed experts but the metadata"),
])
def test_bad_file_one_line_error(fam_files, tmp_path, edit, match):
    """A glm4moe file missing a required key or whose keys contradict its tensors: one-line GGUFError naming the
    file and the problem, from the tensor table alone (``inspect``'s path) and from a full load."""
    bad = tmp_path / "bad.gguf"
    rewrite(fam_files[FAM.quant], bad, **edit)
    for opts in (LoadOptions(metadata_only=True), LoadOptions(moe_stream=False)):
        with pytest.raises(GGUFError, match=match) as e:
            load_model(str(bad), opts)
        msg = str(e.value)
        assert msg.startswith(str(bad)) and "\n" not in msg


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_streaming_equals_resident_quick(fam_files, prefetch):
    """Q8_0, C kernels: a pool of top-k slots streaming gives the resident logits bit for bit, with and without
    the router lookahead (``predict``; the dense layer 0 has none)."""
    path = str(fam_files["q8_0"])
    a = logits_of(load_model(path, LoadOptions(moe_stream=False)), IDS, 4, 5)
    model = load_model(path, LoadOptions(slots=FAM.top_k, io_threads=2, prefetch=prefetch))
    try:
        b = logits_of(model, IDS, 4, 5)
    finally:
        model.store.close()
    assert_bitwise(a, b)


# ------------------------------------------------------------------------------------------------ q/k norm
@pytest.fixture(scope="module")
def qk_files(fixtures_tool):
    return fixtures_tool.build_fixture("glm4moe-qknorm-tiny")


@pytest.mark.slow
def test_qknorm_variant_matches_transformers(qk_files, fam_prompt):
    """GLM-4.5-shaped file (per-head q/k RMSNorm, routed scale 2.5, three dense layers, no group limit): F32
    logits within 1e-4 of transformers over the prompt."""
    hf = hf_model(qk_files["ckpt"])
    model = load_model(str(qk_files["f32"]), LoadOptions(moe_stream=False, matmul="dequant"))
    assert model.has("blk.0.attn_q_norm.weight") and model.n_dense == 3 and model.routed_scale == 2.5
    assert model.n_group == 1 and model.layout.moe_layers == [3, 4]
    got = _ours(qk_files["f32"], fam_prompt)
    diff = (got - _hf(hf, fam_prompt)).abs().max().item()
    print(f"glm4moe-qknorm f32 vs transformers: max |logit diff| {diff:.3g} over {len(fam_prompt)} positions")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_qknorm_variant_matches_llama_cpp(llama_cpp, qk_files, fam_prompt):
    """The same file in llama.cpp: logits within 1e-4 over the prompt."""
    diff = float(np.abs(_ours(qk_files["f32"], fam_prompt).numpy()
                        - _llama_logits(llama_cpp, qk_files["f32"], fam_prompt)).max())
    print(f"glm4moe-qknorm f32 vs llama.cpp: max |logit diff| {diff:.3g} over {len(fam_prompt)} positions")
    assert diff < TOL
