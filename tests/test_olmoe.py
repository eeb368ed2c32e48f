"""OLMoE (``olmoe``): the standard bars of tests/family.py, and OLMoE's routing-weight default.

The fixture ``olmoe-tiny`` (tools/fixtures_olmoe.py) is a random-weight ``OlmoeForCausalLM`` shaped like
allenai/OLMoE-1B-7B-0924 with sizes cut: 2 layers, 4 query and 4 key/value heads of 64, q/k RMSNorm over the
whole projections, 16 experts top-4, softmax router with ``norm_topk_prob`` false, converted by llama.cpp's
converter to F32 and Q8_0, and Q4_K_M by llama.cpp's quantizer (the standard tests' quantized file).

Routing weights. transformers renormalizes the top-k probabilities only when ``norm_topk_prob`` (published:
false). llama.cpp's olmoe graph (src/models/olmoe.cpp) calls build_moe_ffn with ``norm_w = false`` fixed and
reads no key for it, and the converter writes no ``olmoe.expert_weights_norm``. moestream defaults to false
when the key is absent and renormalizes when a file sets it true; tests below check both against
transformers, and that llama.cpp ignores the key (measured: bitwise the same logits with it set).

Tolerances: 1e-4 against both references (the project's oracle bar). Measured on the prompt of family.py
(2026-12-02): moestream vs transformers 7.2e-6 over its 33 positions (logit range 15.8), resident and
streaming; vs llama.cpp (f32 KV cache, flash attention off) 1.9e-5 over the prompt and 31 decode steps; with
``expert_weights_norm`` true, vs transformers with norm_topk_prob true, 7.2e-6; the two settings are 3.4 apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from family import PROMPT, Family, standard_tests
from ggufedit import rewrite
from helpers import hf_logits, llama_greedy
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model

FAM = Family(fixture="olmoe-tiny", arch="olmoe", hf_class="OlmoeForCausalLM", top_k=4, n_experts=16,
             n_layers=2, moe_layers=2, quant="q4_k_m")
standard_tests(globals(), FAM)
TOL = 1e-4
KEY = "olmoe.expert_weights_norm"


def ours(path, ids: list[int]) -> torch.Tensor:
    """moestream's resident logits [len(ids), vocab] over ``ids``."""
    m = load_model(str(path), LoadOptions(moe_stream=False))
    with torch.inference_mode():
        return m.forward(torch.tensor(ids), 0, m.new_cache(len(ids)), logits_all=True)


@pytest.fixture(scope="module")
def norm_true_file(fam_files, tmp_path_factory):
    """The F32 fixture with ``olmoe.expert_weights_norm = true`` added (the converter writes no such key)."""
    out = tmp_path_factory.mktemp("olmoe") / "olmoe-norm-true.gguf"
    rewrite(fam_files["f32"], out, add_kv={KEY: (True, GGUFValueType.BOOL)})
    return out


def test_converter_writes_no_norm_key_and_default_is_unnormalized(fam_files):
    """The file lacks the key, the checkpoint says norm_topk_prob false, moestream does not renormalize."""
    import json

    from ggufedit import read as GGUFReader

    assert KEY not in GGUFReader(str(fam_files["f32"])).fields
    assert json.loads((fam_files["ckpt"] / "config.json").read_text())["norm_topk_prob"] is False
    m = load_model(str(fam_files["f32"]), LoadOptions(metadata_only=True))
    assert m.norm_topk is False
    ids, w = m.route(torch.randn(5, 16))
    assert ids.shape == w.shape == (5, 4) and (w.sum(-1) < 1).all()


@pytest.mark.slow
def test_norm_key_default_and_set_against_transformers(fam_files, fam_hf, fam_prompt, norm_true_file):
    """Absent key: transformers with norm_topk_prob false (the published value). Key true: transformers with
    norm_topk_prob true. The two settings differ far beyond the tolerance, so each match means something."""
    ids = fam_prompt
    ref_false = hf_logits(fam_hf, ids)
    for mod in fam_hf.modules():
        if hasattr(mod, "norm_topk_prob"):
            mod.norm_topk_prob = True
    try:
        ref_true = hf_logits(fam_hf, ids)
    finally:
        for mod in fam_hf.modules():
            if hasattr(mod, "norm_topk_prob"):
                mod.norm_topk_prob = False
    got_false, got_true = ours(fam_files["f32"], ids), ours(norm_true_file, ids)
    d_false = (got_false - ref_false).abs().max().item()
    d_true = (got_true - ref_true).abs().max().item()
    apart = (ref_true - ref_false).abs().max().item()
    print(f"olmoe routing: absent key vs transformers(norm false) {d_false:.3g}; key true vs "
          f"transformers(norm true) {d_true:.3g}; the two settings differ by {apart:.3g}")
    assert d_false < TOL and d_true < TOL
    assert apart > 100 * TOL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_cpp_ignores_the_norm_key(llama_cpp, fam_files, fam_prompt, norm_true_file):
    """llama.cpp's olmoe graph never renormalizes: the same logits with the key set true as without it (and
    so the same as moestream's default)."""
    a = llama_greedy(llama_cpp, fam_files["f32"], fam_prompt, n=2, text=PROMPT)
    b = llama_greedy(llama_cpp, norm_true_file, fam_prompt, n=2, text=PROMPT)
    assert np.array_equal(a.logits, b.logits)


def test_bad_norm_key_type(fam_files, tmp_path):
    out = tmp_path / "bad.gguf"
    rewrite(fam_files["q8_0"], out, add_kv={KEY: (1, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=f"bad.gguf.*{KEY}"):
        load_model(str(out), LoadOptions(metadata_only=True))
