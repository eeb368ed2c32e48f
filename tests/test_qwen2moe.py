"""Qwen2-MoE (``qwen2moe``): the standard bars (tests/family.py) and what is particular to the family.

The fixture ``qwen2moe-tiny`` (tools/fixtures_qwen2moe.py) is a random-weight ``Qwen2MoeForCausalLM`` shaped like
the published config with the sizes cut: 4 layers, 4 query / 2 KV heads of 64, q/k/v biases (noised, not
transformers' zeros), 16 experts top-4 of width 256, top-k weights not renormalized, a sigmoid-gated shared expert
of width 512; converted by llama.cpp's converter to F32 and Q8_0, and Q4_K_M by llama.cpp's quantizer (the
standard tests' quantized file).

Tolerances: the project's 1e-4 against transformers and against llama.cpp (both float32 programs that order
their sums differently; FIELD-NOTES measured llama.cpp vs transformers 5.5e-6 on a tiny qwen2moe). Measured here
(2026-12-02): moestream F32 vs transformers 1.76e-5 over the 33-token prompt (logit range 16.9), resident and
streaming; vs llama.cpp 3.75e-5 over the prompt and 31 decode steps.
"""

from __future__ import annotations

import pytest
import torch

from family import Family, standard_tests
from ggufedit import rewrite
from helpers import assert_bitwise, llama_model, logits_of
from moestream.engine import Engine
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model

FAM = Family(fixture="qwen2moe-tiny", arch="qwen2moe", hf_class="Qwen2MoeForCausalLM", top_k=4, n_experts=16,
             n_layers=4, moe_layers=4, quant="q4_k_m")
standard_tests(globals(), FAM)

IDS = [785, 18484, 3493, 572, 5798, 304, 220, 16, 19, 20, 15, 13]  # any in-vocabulary ids


def test_shared_expert_runs_during_the_reads(fam_files, monkeypatch, tmp_path):
    """The shared expert goes to the MoE layer as ``shared=`` (so it overlaps the expert reads) on every layer,
    and its output is part of the layer's result: the same file with every shared expert's down matrix zeroed
    gives other logits."""
    from moestream.experts import moe as moe_mod

    calls = []
    real = moe_mod.MoE.__call__

    def spy(self, x, ids, w, shared=None, overlap=None, **k):
        calls.append((shared is not None, self.overlap_of() if overlap is None else overlap))
        out = real(self, x, ids, w, shared=shared, overlap=overlap, **k)
        assert out[1] is not None and out[1].shape == x.shape
        return out

    def last_logits(path) -> torch.Tensor:
        model = load_model(str(path), LoadOptions(slots=FAM.top_k, io_threads=2))
        try:
            return Engine(model).prefill(IDS, model.new_cache(len(IDS)))
        finally:
            model.store.close()

    monkeypatch.setattr(moe_mod.MoE, "__call__", spy)
    with_shared = last_logits(fam_files[FAM.quant])
    assert calls == [(True, True)] * FAM.n_layers
    no_shared = tmp_path / "no-shared.gguf"
    rewrite(fam_files[FAM.quant], no_shared,
            convert={f"blk.{i}.ffn_down_shexp.weight": lambda a: a * 0 for i in range(FAM.n_layers)})
    without = last_logits(no_shared)
    assert (with_shared - without).abs().max().item() > 1e-2


def test_router_matches_transformers(fam_files, fam_hf):
    """moestream's routing of layer 0 equals transformers' ``Qwen2MoeTopKRouter`` (softmax, top-k, no
    renormalization) on random inputs: same ids, same weights; the weights do not sum to 1."""
    model = load_model(str(fam_files["f32"]), LoadOptions(moe_stream=False, matmul="dequant"))
    h = torch.randn(32, model.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, w = model.gate(model.blocks[0], h)
        _, ref_w, ref_ids = fam_hf.model.layers[0].mlp.gate(h.double())  # fam_hf is float64
    assert not fam_hf.config.norm_topk_prob
    assert torch.equal(ids, ref_ids)
    assert (w - ref_w).abs().max().item() < 1e-6
    assert (w.sum(-1) < 0.99).all()


def test_widths_from_the_metadata(fam_files):
    """Expert width from ``expert_feed_forward_length`` (256), the shared expert's from
    ``expert_shared_feed_forward_length`` (512): neither derived from ``feed_forward_length`` (1024)."""
    model = load_model(str(fam_files["f32"]), LoadOptions(metadata_only=True))
    assert model.n_ff_exp == [256] * FAM.n_layers and model.n_ff_shexp == 512
    assert model.gguf.arch_get("feed_forward_length") == 1024


def test_no_expert_width_key_as_llama_cpp(fam_files, tmp_path):
    """A file without ``expert_feed_forward_length`` is read as llama.cpp reads it (qwen2moe
    ``load_arch_tensors``): width = feed_forward_length / expert_used_count = 1024 / 4 = 256, this fixture's,
    so it loads and gives the original's logits bit for bit. With feed_forward_length 2048 the derived width
    (512) contradicts the expert tensors: refused, naming the file and the keys; without both keys: refused."""
    src = fam_files["q8_0"]
    key = "qwen2moe.expert_feed_forward_length"
    plain = tmp_path / "no-key.gguf"
    rewrite(src, plain, drop_kv=(key,))
    a = logits_of(load_model(str(src), LoadOptions(moe_stream=False)), IDS, 2, 8)
    b = logits_of(load_model(str(plain), LoadOptions(moe_stream=False)), IDS, 2, 8)
    assert_bitwise(a, b)

    wrong = tmp_path / "no-key-ff2048.gguf"
    rewrite(src, wrong, drop_kv=(key,), set_kv={"qwen2moe.feed_forward_length": 2048})
    with pytest.raises(GGUFError) as e:
        load_model(str(wrong), LoadOptions(moe_stream=False))
    msg = str(e.value)
    assert str(wrong) in msg and key in msg and "feed_forward_length=2048" in msg and "\n" not in msg

    neither = tmp_path / "no-widths.gguf"
    rewrite(src, neither, drop_kv=(key, "qwen2moe.feed_forward_length"))
    with pytest.raises(GGUFError, match=rf"{neither}: metadata key {key} is missing"):
        load_model(str(neither), LoadOptions(metadata_only=True))


@pytest.mark.llamacpp
def test_no_expert_width_key_llama_cpp_agrees(llama_cpp, fam_files, tmp_path):
    """llama.cpp itself on the edited files: it loads the file without the key (and gives the original's
    logits), and refuses the one whose derived width contradicts the tensors, as moestream does."""
    src = fam_files["f32"]
    key = "qwen2moe.expert_feed_forward_length"
    plain, wrong = tmp_path / "no-key.gguf", tmp_path / "no-key-ff2048.gguf"
    rewrite(src, plain, drop_kv=(key,))
    rewrite(src, wrong, drop_kv=(key,), set_kv={"qwen2moe.feed_forward_length": 2048})
    rows = []
    for path in (src, plain):
        llm = llama_model(llama_cpp, path)
        try:
            llm.eval(IDS)
            rows.append(torch.tensor(llm.scores[:len(IDS)]))
        finally:
            llm.close()
    assert torch.equal(rows[0], rows[1])
    with pytest.raises(Exception):  # noqa: B017, PT011 - llama-cpp-python raises ValueError or RuntimeError
        llama_model(llama_cpp, wrong)


def test_wrong_shared_width_key_refused(fam_files, tmp_path):
    """``expert_shared_feed_forward_length`` that contradicts the shared expert's tensors: GGUFError naming the
    file, the tensor and the key."""
    bad = tmp_path / "shexp.gguf"
    rewrite(fam_files["q8_0"], bad, set_kv={"qwen2moe.expert_shared_feed_forward_length": 1024})
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_gate_shexp\.weight .*"
                                        r"qwen2moe\.expert_shared_feed_forward_length=1024"):
        load_model(str(bad), LoadOptions(metadata_only=True))
