"""512 experts, 10 per token (the routing of the published Qwen3.5-397B-A17B) on a tiny Qwen 3.5 MoE
(``qwen35moe-512`` in tools/fixtures_qwen35moe.py: transformers checkpoint -> llama.cpp's converter): the
standard bars (tests/family.py) against transformers and llama.cpp, streaming equal to resident at 10 slots (a
pool of 2% of the experts, so the prefill is tiled), and with every expert resident; plus: with a slot for
every expert, each expert the prompt selects is read once and the others never."""

from __future__ import annotations

from family import IDENTITY_PROMPT, Family, standard_tests
from helpers import load, ours_greedy
from moestream.tokenizer import GGUFTokenizer

FAM = Family(fixture="qwen35moe-512", arch="qwen35moe", hf_class="Qwen3_5MoeForCausalLM", top_k=10,
             n_experts=512, n_layers=4, moe_layers=4, distinct_share=0.4)  # 35 tokens x 10: 231 distinct
standard_tests(globals(), FAM)


def test_a_pool_of_every_expert_reads_each_selected_one_once(fam_files) -> None:  # noqa: ANN001
    """With a slot for every expert, each expert a short run selects is read exactly once and the others never:
    misses per layer = distinct experts selected there < 512."""
    from helpers import distinct_experts_per_layer

    path = fam_files["q8_0"]
    ids = GGUFTokenizer.from_gguf(str(path)).encode(IDENTITY_PROMPT)
    model = load(path, stream=True, slots=FAM.n_experts)
    ours_greedy(model, ids, 0)
    store = model.store
    selected = load(path, stream=True, slots=FAM.n_experts)
    distinct = distinct_experts_per_layer(selected, ids)  # the fewest over the layers
    misses = [store.layer_counts[la][1] for la in model.layout.moe_layers]
    assert min(misses) == distinct and max(misses) < FAM.n_experts, (misses, distinct)
