"""Routing at its edges, on the Qwen3-MoE test fixture (transformers checkpoint -> llama.cpp's converter):

- top-k equal to the expert count (every expert used by every token): the smallest legal pool is then every
  expert, logits against transformers with the same ``num_experts_per_tok``, streaming equal to resident;
- experts the router never selects in a run: the streaming store never reads them (every byte read is a
  selected expert's miss), and streaming equals resident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ggufedit import rewrite
from helpers import hf_logits, hf_model, load, ours_greedy, verify_identical
from moestream.errors import ConfigError
from moestream.models.base import LoadOptions
from moestream.tokenizer import GGUFTokenizer

PROMPT = "Routing edges: every expert at once, or some experts never at all, and the pool must not care."


def _hf(ckpt: Path, **config: Any):  # noqa: ANN202
    """transformers' Qwen3Moe on the checkpoint with ``config``'s attributes changed, in float64 (helpers.hf_model)."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    for k, v in config.items():
        setattr(cfg, k, v)
    return hf_model(ckpt, config=cfg, cls=Qwen3MoeForCausalLM)


@pytest.fixture(scope="module")
def ids(qwen3moe_tiny: dict[str, Any]) -> list[int]:
    return GGUFTokenizer.from_gguf(str(qwen3moe_tiny["f32"])).encode(PROMPT)


def test_top_k_equal_to_the_expert_count(tmp_path: Path, qwen3moe_tiny: dict[str, Any], ids: list[int]) -> None:
    n = qwen3moe_tiny["config"]["num_experts"]
    path = tmp_path / "all-experts.gguf"
    rewrite(qwen3moe_tiny["f32"], path, set_kv={"qwen3moe.expert_used_count": n})
    model = load(path, stream=False, matmul="dequant")
    assert model.top_k == n
    ours, _ = ours_greedy(model, ids, 0)
    want = hf_logits(_hf(qwen3moe_tiny["ckpt"], num_experts_per_tok=n), ids)
    assert float((ours - want).abs().max()) < 1e-4
    res = verify_identical(load(path, stream=False), ids, 6, "all", label="top-k = n_experts: ")
    assert res.hit_rate > 0  # every expert stays in its slot after its first read
    # fewer slots than top-k cannot hold one token's experts
    with pytest.raises(ConfigError, match="below the experts used per token"):
        load_model_slots(path, n - 1)


def load_model_slots(path: Path, slots: int) -> None:
    from moestream.models.base import load_model

    load_model(str(path), LoadOptions(slots=slots))


def test_experts_never_selected_are_never_read(qwen3moe_tiny: dict[str, Any]) -> None:
    """A short run selects only some of each layer's 16 experts, the same ones transformers' router selects on the
    same tokens: the streaming store reads those and no other (bytes read = misses x bytes per expert, every slot
    holds a selected expert), and the logits equal the resident run's."""
    model = load(qwen3moe_tiny["f32"], stream=True, slots=qwen3moe_tiny["config"]["num_experts_per_tok"])
    picked: dict[int, set[int]] = {}
    real_call = type(model.blocks[0]["moe"]).__call__

    def spy(moe, x, ids, w, *a, **k):  # noqa: ANN001, ANN202
        picked.setdefault(moe.layer, set()).update(int(e) for e in ids.reshape(-1))
        return real_call(moe, x, ids, w, *a, **k)

    spy_class = type("SpyMoE", (type(model.blocks[0]["moe"]),), {"__call__": spy})
    for b in model.blocks:
        b["moe"].__class__ = spy_class
    _, toks = ours_greedy(model, [11], 2)
    store, layout = model.store, model.layout
    # transformers' routers on the tokens the run fed ([11], then its first greedy token)
    hf = _hf(qwen3moe_tiny["ckpt"])
    hf_picked: dict[int, set[int]] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _in, out, i=i: hf_picked.setdefault(i, set()).update(out[2].reshape(-1).tolist()))
        for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.inference_mode():
        hf(torch.tensor([[11, toks[0]]]))
    for h in hooks:
        h.remove()
    assert picked == hf_picked
    n_exp = layout.n_experts(layout.moe_layers[0])
    assert any(len(p) < n_exp for p in picked.values()), "every expert was selected: the run is too long"
    for layer, slots in store.slots.items():
        held = {int(e) for e in slots.expert_of if e >= 0}
        assert held <= picked[layer], (layer, held - picked[layer])
    missed = sum(store.layer_counts[la][1] * layout.bytes_per_expert(la) for la in store.slots)
    n_reads = sum(store.layer_counts[la][1] * len(layout[la]) for la in store.slots)  # one read per matrix
    # every byte read is a selected expert's (O_DIRECT reads round each matrix out to the 4 KiB blocks around it)
    assert missed <= store.bytes_read <= missed + n_reads * 2 * 4096, (store.bytes_read, missed)
    verify_identical(load(qwen3moe_tiny["f32"], stream=False), [11], 2, "top_k", label="never-selected: ")
