"""The routing keys a file may lack, across the softmax-routed families, against transformers.

llama.cpp's converter writes none of ``expert_gating_func`` / ``expert_weights_norm`` / ``expert_weights_scale`` for
Qwen3-MoE, Qwen2-MoE, Qwen 3.5, Gemma 4, Mixtral, OLMoE or GPT-OSS, and llama.cpp's graphs fix their routing
(softmax; top-k renormalized for all but Qwen2-MoE and OLMoE; GPT-OSS softmaxes the top-k logits; no scale).
moestream gives absent keys that routing (each family's oracle tests check it against transformers on files that
lack them; the first test here checks that they do lack them) and, where the transformers class has the switch
(``norm_topk_prob``: Qwen3-MoE, Qwen2-MoE, OLMoE), follows a file that sets ``expert_weights_norm``, checked here
against transformers with the switch flipped (OLMoE's in tests/test_olmoe.py). What a family cannot compute is
refused in one line: another gating function, a weight scale, or (where transformers has no switch) a
renormalization setting that contradicts the architecture. GLM-4.5's sigmoid routing keys are tested in
tests/test_glm4moe.py, DeepSeek's in tests/test_deepseek2.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFValueType

from ggufedit import read as GGUFReader
from ggufedit import rewrite
from helpers import cli, hf_logits, hf_model
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model
from moestream.tokenizer import GGUFTokenizer

PROMPT = "Routing keys a file may lack: the gating function, the renormalization and the scale of the weights."
KEYS = ("expert_gating_func", "expert_weights_norm", "expert_weights_scale")
# fixture -> (GGUF arch, renormalized by default, transformers has norm_topk_prob, llama.cpp's gating function)
FAMILIES = {
    "qwen3moe-tiny": ("qwen3moe", True, True, 1),
    "qwen2moe-tiny": ("qwen2moe", False, True, 1),
    "qwen35moe-tiny": ("qwen35moe", True, False, 1),
    "gemma4-tiny": ("gemma4", True, False, 1),
    "mixtral-tiny": ("llama", True, False, 1),
    "olmoe-tiny": ("olmoe", False, True, 1),
    "gpt-oss-tiny": ("gpt-oss", True, False, 3),  # softmax among the top-k logits: the weights sum to 1
}
#: OLMoE's expert_weights_norm against transformers' norm_topk_prob: tests/test_olmoe.py
FLIP_TESTED_ELSEWHERE = {"olmoe-tiny"}


def _files(fixtures_tool: Any, name: str) -> dict[str, Any]:
    return fixtures_tool.build_fixture(name)


def _variant(src: Path, dst: Path, arch: str, **kv: tuple[object, GGUFValueType]) -> Path:
    rewrite(src, dst, add_kv={f"{arch}.{k}": v for k, v in kv.items()})
    return dst


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    m = load_model(str(path), LoadOptions(moe_stream=False, matmul="dequant"))
    with torch.inference_mode():
        return m.forward(torch.tensor(ids), 0, m.new_cache(len(ids)), logits_all=True)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_converter_writes_no_routing_keys_and_absent_is_the_architectures_routing(fixtures_tool, name, tmp_path):
    arch, norm, switchable, gating = FAMILIES[name]
    files = _files(fixtures_tool, name)
    fields = GGUFReader(str(files["f32"])).fields
    assert not [k for k in KEYS if f"{arch}.{k}" in fields]
    m = load_model(str(files["f32"]), LoadOptions(metadata_only=True))
    if switchable:
        assert m.norm_topk is norm
        assert json.loads((files["ckpt"] / "config.json").read_text())["norm_topk_prob"] is norm
    # the keys set to what absent means: accepted, the same bits
    same = _variant(files["f32"], tmp_path / "explicit.gguf", arch, expert_gating_func=(gating, GGUFValueType.UINT32),
                    expert_weights_norm=(norm, GGUFValueType.BOOL), expert_weights_scale=(1.0, GGUFValueType.FLOAT32))
    ids = GGUFTokenizer.from_gguf(str(files["f32"])).encode(PROMPT)[:12]
    assert torch.equal(_logits(same, ids), _logits(files["f32"], ids))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_what_the_family_cannot_compute_is_refused(fixtures_tool, name, tmp_path):
    arch, norm, switchable, _ = FAMILIES[name]
    f32 = _files(fixtures_tool, name)["f32"]
    bad = {"sigmoid": dict(expert_gating_func=(2, GGUFValueType.UINT32)),
           "scale": dict(expert_weights_scale=(2.5, GGUFValueType.FLOAT32))}
    if not switchable:
        bad["norm"] = dict(expert_weights_norm=(not norm, GGUFValueType.BOOL))
    want = {"sigmoid": "is not softmax", "scale": "does not do", "norm": "contradicts the architecture"}
    for what, kv in bad.items():
        path = _variant(f32, tmp_path / f"{what}.gguf", arch, **kv)
        with pytest.raises(GGUFError, match=want[what]) as e:
            load_model(str(path), LoadOptions(metadata_only=True))
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    p = cli("inspect", "-m", str(tmp_path / "sigmoid.gguf"))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and f"{arch}.expert_gating_func=2" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, f in sorted(FAMILIES.items()) if f[2] and n not in FLIP_TESTED_ELSEWHERE])
def test_norm_key_flipped_against_transformers(fixtures_tool, name, tmp_path):
    """A file that sets ``expert_weights_norm`` against the published value computes what transformers computes
    with ``norm_topk_prob`` flipped (transformers in float64: helpers.hf_model); the two settings differ far beyond
    the tolerance."""
    arch, norm, _, _ = FAMILIES[name]
    files = _files(fixtures_tool, name)
    flipped = _variant(files["f32"], tmp_path / "flipped.gguf", arch,
                       expert_weights_norm=(not norm, GGUFValueType.BOOL))
    ids = GGUFTokenizer.from_gguf(str(files["f32"])).encode(PROMPT)
    hf = hf_model(files["ckpt"])
    ref_default = hf_logits(hf, ids)
    n_set = 0
    for mod in hf.modules():
        if hasattr(mod, "norm_topk_prob"):
            mod.norm_topk_prob, n_set = not norm, n_set + 1
    assert n_set
    ref_flipped = hf_logits(hf, ids)
    ours_default, ours_flipped = _logits(files["f32"], ids), _logits(flipped, ids)
    assert float((ours_default - ref_default).abs().max()) < 1e-4
    assert float((ours_flipped - ref_flipped).abs().max()) < 1e-4
    assert float((ref_flipped - ref_default).abs().max()) > 1e-2
