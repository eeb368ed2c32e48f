"""512 experts, 10 per token (the routing of the published Qwen3.5-397B-A17B) on a tiny Qwen 3.5 MoE
(``qwen35moe-512`` in tools/fixtures_qwen35moe.py: transformers checkpoint -> llama.cpp's converter): the
standard bars (tests/family.py) against transformers and llama.cpp, streaming equal to resident at 10 slots (a
pool of 2% of the experts, so the prefill is tiled), and with every expert resident; plus: every expert index of
every layer selected and computed (against transformers' router and experts), and with a slot for every expert,
each expert the prompt selects is read once and the others never."""

from __future__ import annotations

import torch

from family import IDENTITY_PROMPT, Family, standard_tests
from helpers import load, ours_greedy
from moestream.tokenizer import GGUFTokenizer

FAM = Family(fixture="qwen35moe-512", arch="qwen35moe", hf_class="Qwen3_5MoeForCausalLM", top_k=10,
             n_experts=512, n_layers=4, moe_layers=4, distinct_share=0.4)  # 35 tokens x 10: 231 distinct
standard_tests(globals(), FAM)


def test_a_pool_of_every_expert_reads_each_selected_one_once(fam_files) -> None:  # noqa: ANN001
    """With a slot for every expert, each expert a short run selects is read exactly once and the others never: in
    every layer, misses = the distinct experts the router selected there (the store's routing trace: each call's
    distinct experts as the eager step's MoE.__call__ and the fast decode step hand them to the store), fewer than
    512."""
    path = fam_files["q8_0"]
    ids = GGUFTokenizer.from_gguf(str(path)).encode(IDENTITY_PROMPT)
    selected: dict[int, set[int]] = {}
    model = load(path, stream=True, slots=FAM.n_experts)
    model.store.trace = []
    try:
        ours_greedy(model, ids, 4)
        misses = {la: model.store.layer_counts[la][1] for la in model.layout.moe_layers}
    finally:
        model.store.close()
    for layer, experts, _ in model.store.trace:
        selected.setdefault(layer, set()).update(experts)
    assert misses == {la: len(selected[la]) for la in model.layout.moe_layers}
    assert all(len(s) < FAM.n_experts for s in selected.values()), {la: len(s) for la, s in selected.items()}


def test_every_expert_index_is_reachable(fam_files, fam_hf) -> None:  # noqa: ANN001
    """Every one of the 512 expert ids of every MoE layer can be selected and is computed from its own bytes: 512
    inputs per layer, input e along router row e, make our router and transformers' ``Qwen3_5MoeTopKRouter`` choose
    the same ids (as sets per token; weights within 1e-6) and together every id 0..511; routed through a pool of 10
    slots (ids far above the slot count, every expert read into some slot), the layer's output equals transformers'
    ``Qwen3_5MoeExperts`` on those ids and weights within 1e-5 of its largest value."""
    model = load(fam_files["f32"], stream=True, slots=FAM.top_k)
    try:
        for layer in model.layout.moe_layers:
            b, hf_moe = model.blocks[layer], fam_hf.model.layers[layer].mlp
            rows = hf_moe.gate.weight.detach()  # [512, hidden]
            x = (2.0 * rows / rows.norm(dim=1, keepdim=True)).float()  # [512, hidden]: input e along router row e
            ids, w = model.gate(b, x)
            with torch.inference_mode():  # fam_hf is float64 (helpers.hf_model)
                _, hf_w, hf_ids = hf_moe.gate(x.double())
                want = hf_moe.experts(x.double(), hf_ids, hf_w)
            # each token's experts and their weights, in id order: the order within the top-k among scores equal to
            # float32 rounding follows the summation order of the router's matmul (here one token's 6th and 7th of
            # 10 swap against float64 transformers), and the layer's output does not depend on it
            (ids_s, order), (hf_s, hf_order) = ids.sort(dim=1), hf_ids.sort(dim=1)
            assert torch.equal(ids_s, hf_s), f"layer {layer}: router ids differ from transformers'"
            assert float((w.gather(1, order) - hf_w.gather(1, hf_order)).abs().max()) < 1e-6
            assert set(ids.reshape(-1).tolist()) == set(range(FAM.n_experts)), f"layer {layer}: ids unreached"
            misses_before = model.store.layer_counts[layer][1]
            got, _ = b["moe"](x, ids, w)
            assert model.store.layer_counts[layer][1] - misses_before >= FAM.n_experts  # each read into a slot
            err = float((got - want).abs().max())
            assert err <= 1e-5 * float(want.abs().max()), f"layer {layer}: {err:.3g}"
    finally:
        model.store.close()
