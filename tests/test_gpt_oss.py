"""GPT-OSS (``gpt-oss``): the standard bars (tests/family.py) and what is particular to the family.

The fixture ``gpt-oss-tiny`` (tools/fixtures_gpt_oss.py) is a random-weight ``GptOssForCausalLM`` shaped like the
published gpt-oss-20b config with the sizes cut: 4 layers alternating sliding (128) / full attention, 8 query /
2 KV heads of 64 with biases and learned sinks, YaRN (factor 32 over 4096, beta 32 / 1, truncate TRUE: the form a
GGUF describes, see the fixture's docstring), 32 experts top-4 of width 256 with biases, clamped SwiGLU (limit 7,
reached by some activations), router with bias, softmax over the top-k logits. F32 from llama.cpp's converter,
MXFP4_MOE (MXFP4 experts, Q8_0 dense) from llama.cpp's quantizer.

Tolerances. transformers: the project's 1e-4. llama.cpp: 1e-3, because llama.cpp itself differs from transformers
by more than 1e-4 on this file, growing with the position (measured 2026-12-02 over a 280-token prompt: llama.cpp vs
transformers 6.3e-5 at positions 0-31, 1.0e-4 at 32-63, 4.3e-4 at 224-255; moestream vs transformers 3.6e-5 to
5.9e-5 at every position). The likely cause, read in ggml-cpu's ``ggml_rope_cache_init`` and not verified: ggml
computes each pair's angle as ``pos * theta_scale^i`` by repeated float32 multiplication (one rounding per pair
index), where transformers and moestream multiply the position by a precomputed inverse frequency; the angle error
grows with the position. FIELD-NOTES' 9e-5 (gpt-oss with truncate true) was over a shorter prompt.

The 264-token test (test_long_prompt_sliding_window_and_sinks): 2.5e-4 against transformers in float64
(helpers.hf_model), above transformers' own float32 error (below) and moestream's 1.66e-4 on an Intel Xeon with
AVX-512 (clean-clone CI run of 2026-12-04; the figures below are from an AMD EPYC). Measured 2026-12-04 at 264
tokens: transformers' own float32 run is 2.04e-4 from its float64
run; moestream (--matmul dequant) with float32 RoPE tables 1.95e-4 (torch's attention and RMSNorm) / 1.96e-4 (the C
step kernels'), with layers.Rope's float64 tables 1.05e-4 / 0.99e-4 (1.01e-4 in one full-suite run: torch's matmul
rounds by its thread count). Against the float32 run, as before, moestream's float32 tables were 6.0e-5 from it: the
same angle rounding on both sides, not accuracy.

Biases indexed by real expert id: the streaming tests (``test_std_f32_matches_transformers[stream]`` through a
pool of top-k + 2 slots, ``test_std_verify_identical`` at top-k slots, ``test_std_slot_ids_differ_from_expert_ids``
showing slots != ids) would fail if a bias were read by slot id: the expert in slot s is not expert s, so its bias
would be another expert's; :func:`test_expert_bias_by_real_id` checks it at the layer directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from family import PROMPT, Family, standard_tests
from ggufedit import rewrite
from helpers import expert_slots, hf_logits
from moestream.errors import GGUFError
from moestream.experts.moe import ClampedSwiGLU
from moestream.models.base import LoadOptions, load_model
from moestream.tokenizer import GGUFTokenizer

FAM = Family(fixture="gpt-oss-tiny", arch="gpt-oss", hf_class="GptOssForCausalLM", top_k=4, n_experts=32,
             n_layers=4, moe_layers=4, quant="mxfp4_moe", llama_tol=1e-3)
standard_tests(globals(), FAM)

TOL = 1e-4
#: the 264-token test's bound against float64 transformers (module docstring): under 1.5e-4 on an AMD EPYC, 1.66e-4 on
#: an Intel Xeon with AVX-512 (torch's float32 kernels block their sums by the CPU's vector width)
LONG_TOL = 2.5e-4


def _ours(path, ids, **opts) -> torch.Tensor:  # noqa: ANN001
    """Resident, dequantize-then-matmul logits of ``ids`` at every position (float32 [T, vocab])."""
    model = load_model(str(path), LoadOptions(moe_stream=False, matmul="dequant", **opts))
    try:
        return model.forward(torch.tensor(ids), 0, model.new_cache(len(ids)), logits_all=True)
    finally:
        model.store.close()


def _long_prompt(path) -> list[int]:  # noqa: ANN001
    """A prompt of more than 2 x the sliding window (128) tokens (264 with the fixture's tokenizer)."""
    ids = GGUFTokenizer.from_gguf(str(path)).encode(" ".join([PROMPT] * 8))
    assert len(ids) > 260
    return ids[:280]


# ------------------------------------------------------------------------------------------------ semantics
def test_rope_is_transformers_yarn(fam_files, fam_hf):
    """The file's YaRN keys give transformers' inverse frequencies (truncated range) bit for bit and its cos/sin
    magnitude (``attention_scaling``, 0.1 ln 32 + 1)."""
    model = load_model(str(fam_files["f32"]), LoadOptions(moe_stream=False, metadata_only=False))
    try:
        rot = fam_hf.model.rotary_emb
        assert model.scaling is not None and model.scaling.factor == 32.0 and model.scaling.orig_ctx == 4096
        assert torch.equal(model.rope_full.inv_freq, rot.inv_freq.float())
        assert abs(model.rope_full.scale - rot.attention_scaling) < 1e-7
        assert model.is_swa == [True, False, True, False] and model.window == 128
    finally:
        model.store.close()


def test_long_prompt_sliding_window_and_sinks(fam_files, fam_hf):
    """264 tokens (past 2 x the window): logits within LONG_TOL of transformers at every position; the window and
    the sinks each matter on this file (dropping either moves the logits by more than 1e-2)."""
    ids = _long_prompt(fam_files["f32"])
    ref = hf_logits(fam_hf, ids)
    model = load_model(str(fam_files["f32"]), LoadOptions(moe_stream=False, matmul="dequant"))
    try:
        def run() -> torch.Tensor:
            return model.forward(torch.tensor(ids), 0, model.new_cache(len(ids)), logits_all=True)

        got = run()
        diff = (got - ref).abs().max().item()
        print(f"gpt-oss f32 vs transformers, {len(ids)} tokens: max |logit diff| {diff:.3g}")
        assert diff < LONG_TOL
        model.window = 10 ** 9  # every layer full
        no_window = run()
        model.window = 128
        for b in model.blocks:
            b["sinks"] = b["sinks"].new_full(b["sinks"].shape, float("-inf"))
        no_sinks = run()
    finally:
        model.store.close()
    # the window cuts nothing before position 128 (equal up to the rounding of expert matmuls over other row counts)
    assert (no_window[:128] - got[:128]).abs().max().item() < 1e-4
    assert (no_window[128:] - got[128:]).abs().max().item() > 1e-2
    assert (no_sinks - got).abs().max().item() > 1e-2


def test_decode_past_window_equals_prefill(fam_files):
    """Token-by-token decode past the window gives the prefill's logits (the sliding mask of one query)."""
    ids = _long_prompt(fam_files["mxfp4_moe"])[:160]
    model = load_model(str(fam_files["mxfp4_moe"]), LoadOptions(moe_stream=False, matmul="dequant"))
    try:
        full = model.forward(torch.tensor(ids), 0, model.new_cache(len(ids)), logits_all=True)
        cache = model.new_cache(len(ids))
        model.forward(torch.tensor(ids[:120]), 0, cache)
        steps = torch.cat([model.forward(torch.tensor([t]), 120 + j, cache) for j, t in enumerate(ids[120:])])
    finally:
        model.store.close()
    # float32 sums over other shapes (one query vs 160): 1.06e-4 measured; a wrong window moves logits by > 1e-2
    assert (steps - full[120:]).abs().max().item() < 5e-4


def test_clamp_reached(fam_files, monkeypatch):
    """The fixture's experts drive some gate and up values past the SwiGLU limit (7), so the clamp is exercised."""
    seen = {"gate": 0, "up": 0, "n": 0}
    call = ClampedSwiGLU.__call__

    def spy(self, gate, up):  # noqa: ANN001, ANN202
        seen["gate"] += int((gate > self.limit).sum())
        seen["up"] += int((up.abs() > self.limit).sum())
        seen["n"] += gate.numel()
        return call(self, gate, up)

    monkeypatch.setattr(ClampedSwiGLU, "__call__", spy)
    ids = GGUFTokenizer.from_gguf(str(fam_files["f32"])).encode(PROMPT)
    _ours(fam_files["f32"], ids)
    assert seen["gate"] > 0 and seen["up"] > 0, seen


def test_clamped_swiglu_values():
    """The activation by hand: gate clamped above only, up on both sides, ``(up + 1) * g * sigmoid(1.702 g)``."""
    act = ClampedSwiGLU(1.702, 7.0)
    g = torch.tensor([[-9.0, 0.5, 9.0]])
    u = torch.tensor([[-9.0, 0.5, 9.0]])
    got = act(g, u)
    want = torch.tensor([[(-7 + 1) * -9 * torch.sigmoid(torch.tensor(-9 * 1.702)).item(),
                          1.5 * 0.5 * torch.sigmoid(torch.tensor(0.5 * 1.702)).item(),
                          8 * 7 * torch.sigmoid(torch.tensor(7 * 1.702)).item()]])
    assert torch.allclose(got, want, atol=1e-6)


def test_expert_bias_by_real_id(fam_files):
    """Layer 0's routed output through a streaming pool of top-k slots (where experts sit in other slots) equals a
    reference written from the F32 weights by real expert id, and equals the resident result bit for bit."""
    path = str(fam_files["f32"])
    res = load_model(path, LoadOptions(moe_stream=False, matmul="dequant"))
    st = load_model(path, LoadOptions(slots=FAM.top_k, io_threads=2, matmul="dequant"))
    try:
        h = torch.randn(24, res.n_embd, generator=torch.Generator().manual_seed(0))
        b = res.blocks[0]
        ids, w = res.gate(b, h)
        a, _ = b["moe"](h, ids, w)
        c, _ = st.blocks[0]["moe"](h, ids, w)
        assert torch.equal(a, c)
        assert any(e >= 0 and e != s for e, s in expert_slots(st.store)), "every expert sat in its own id's slot"
        g = res.gguf
        mat = {m: g.read(g.tensor_info(f"blk.0.ffn_{m}_exps.weight")).view(torch.float32)
               .view(res.n_experts, -1, res.n_embd if m != "down" else res.n_ff_exp) for m in ("gate", "up", "down")}
        bias = b["moe"].bias
        act = ClampedSwiGLU(1.702, 7.0)
        ref = torch.zeros_like(a)
        for t in range(h.shape[0]):
            for k in range(FAM.top_k):
                e = int(ids[t, k])
                gt = mat["gate"][e] @ h[t] + bias["gate"][e]
                up = mat["up"][e] @ h[t] + bias["up"][e]
                ref[t] += w[t, k] * (mat["down"][e] @ act(gt[None], up[None])[0] + bias["down"][e])
        assert (a - ref).abs().max().item() < 1e-4
    finally:
        res.store.close()
        st.store.close()


# ------------------------------------------------------------------------------------------------ chat format
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a printing city."},
            {"role": "assistant", "content": "Mainz."}, {"role": "user", "content": "Another?"}]


def test_harmony_template_matches_transformers(fam_files):
    """The file's chat template (llama.cpp's harmony template) renders as transformers renders the checkpoint's own
    template (same text, same date), and its markup tokens are single special tokens."""
    from transformers import AutoTokenizer

    tok = GGUFTokenizer.from_gguf(str(fam_files["f32"]))
    hf = AutoTokenizer.from_pretrained(fam_files["ckpt"])
    assert tok.chat_template == hf.chat_template
    for gen in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        ref = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours == ref
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "<|start|>user<|message|>Another?<|end|>" in text
    for t in ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"):
        i = tok.token_to_id(t)
        assert i is not None and tok.encode(t) == [i]


# ------------------------------------------------------------------------------------------------ llama.cpp
@pytest.mark.llamacpp
def test_long_prompt_matches_llama_cpp(llama_cpp, fam_files):
    """llama.cpp (f32 KV, flash attention off) over the 264-token prompt: logits within the family's bound."""
    ids = _long_prompt(fam_files["f32"])
    llm = llama_cpp.Llama(  # helpers.llama_model's settings with a context that holds the prompt
        model_path=str(fam_files["f32"]), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2,
        logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
        seed=0, verbose=False)
    try:
        llm.eval(ids)
        ref = np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()
    diff = float(np.abs(_ours(fam_files["f32"], ids).numpy() - ref).max())
    print(f"gpt-oss f32 vs llama.cpp, {len(ids)} tokens: max |logit diff| {diff:.3g}")
    assert diff < FAM.llama_tol


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("edit,match", [
    ({"drop_kv": ("gpt-oss.attention.sliding_window",)}, r"metadata key gpt-oss\.attention\.sliding_window is missing"),
    ({"drop_kv": ("gpt-oss.expert_feed_forward_length",)},
     r"metadata key gpt-oss\.expert_feed_forward_length is missing"),
    ({"drop_kv": ("gpt-oss.attention.layer_norm_rms_epsilon",)},
     r"metadata key gpt-oss\.attention\.layer_norm_rms_epsilon is missing"),
    ({"set_kv": {"gpt-oss.expert_feed_forward_length": 512}},
     r"ffn_\w+_exps\.weight has experts of width 256 but .*expert_feed_forward_length=512"),
    ({"set_kv": {"gpt-oss.attention.key_length": 32}}, r"differ: partial rotary|tensor blk\.0\.attn_q\.weight"),
    ({"add_kv": {"gpt-oss.rope.dimension_count": (32, GGUFValueType.UINT32)}},
     r"rope\.dimension_count=32.*partial rotary"),
    ({"set_kv": {"gpt-oss.rope.scaling.type": "linear"}}, r"rope\.scaling\.type=linear asks for RoPE scaling"),
    ({"set_kv": {"gpt-oss.attention.head_count": 4}}, r"tensor blk\.0\.attn_q\.weight has shape"),
    ({"drop_tensors": ("blk.1.attn_sinks.weight",)}, r"blk\.1\.attn_sinks\.weight"),
    ({"drop_tensors": ("blk.2.ffn_up_exps.bias",)}, r"blk\.2\.ffn_up_exps\.bias"),
])
def test_bad_file_one_line_error(fam_files, tmp_path, edit, match):
    """A gpt-oss file missing a required key or tensor, or whose keys contradict its tensors: one-line GGUFError
    naming the file and the problem, from the tensor table alone (``inspect``'s path) and from a full load."""
    bad = tmp_path / "bad.gguf"
    rewrite(fam_files[FAM.quant], bad, **edit)
    for opts in (LoadOptions(metadata_only=True), LoadOptions(moe_stream=False)):
        with pytest.raises(GGUFError, match=match) as e:
            load_model(str(bad), opts)
        msg = str(e.value)
        assert msg.startswith(str(bad)) and "\n" not in msg
