"""moestream on the converted GGUF vs transformers on the source checkpoint (the architecture's reference)."""

from __future__ import annotations

import pytest
import torch
from moestream.tokenizer import GGUFTokenizer

from moestream.engine import Engine, Sampler, SamplingParams
from moestream.models.base import LoadOptions, load_model

PROMPT = ("In 1450 Johannes Gutenberg built a printing press with movable metal type; within fifty years "
          "presses in more than two hundred cities had printed millions of books.")
N_GREEDY = 32


@pytest.fixture(scope="module")
def hf(qwen3moe_tiny):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(qwen3moe_tiny["ckpt"], dtype=torch.float32,
                                             attn_implementation="eager")
    m.eval()
    return m


@pytest.fixture(scope="module")
def prompt_ids(qwen3moe_tiny):
    ids = GGUFTokenizer.from_gguf(qwen3moe_tiny["f32"]).encode(PROMPT)
    assert len(ids) >= 16
    return ids


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def ours(path: str, ids: list[int], stream: bool) -> tuple[torch.Tensor, list[int]]:
    model = load_model(path, LoadOptions(moe_stream=stream, slots=6 if stream else None, io_threads=4))
    eng = Engine(model)
    logits = eng.prefill(ids, model.new_cache(len(ids)), logits_all=True)
    toks = eng.generate(ids, N_GREEDY, Sampler(SamplingParams(temp=0))).tokens
    model.store.close()
    return logits, toks


@pytest.mark.parametrize("stream", [False, True])
def test_f32_matches_transformers(qwen3moe_tiny, hf, prompt_ids, stream):
    ref = hf_logits(hf, prompt_ids)
    got, toks = ours(qwen3moe_tiny["f32"], prompt_ids, stream)
    diff = (got - ref).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.3g} over {len(prompt_ids)} positions"
    assert toks == hf_greedy(hf, prompt_ids, N_GREEDY)


# Tolerances for the lossy conversions, against transformers in float32 on the original weights.
# BF16 keeps 8 significant bits: each weight moves by up to 2^-9 relative (~0.2%); Q8_0 keeps an int8 per
# weight with one scale per 32, a relative step of up to 1/127 of the block's largest weight (~0.4%
# worst case, ~0.1% rms). Those errors are random across the many weights that feed one logit, so the
# logit error grows like sqrt(#terms) x the per-weight error, not linearly. The bound below is 2% of the
# logit range; it leaves a margin over what the test measures (printed on failure) while still catching a
# wrong dequantization, a mixed-up expert or a skipped layer, which move logits by the range's order.
RELATIVE_TOL = {"bf16": 0.02, "q8_0": 0.02}


@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
def test_lossy_formats_close_to_transformers(qwen3moe_tiny, hf, prompt_ids, fmt):
    ref = hf_logits(hf, prompt_ids)
    got, _ = ours(qwen3moe_tiny[fmt], prompt_ids, stream=True)
    span = (ref.max() - ref.min()).item()
    diff = (got - ref).abs().max().item()
    assert diff < RELATIVE_TOL[fmt] * span, f"{fmt}: max |diff| {diff:.4g}, logit range {span:.4g}"
    # where transformers' top token leads its runner-up by more than the tolerance, we pick it too
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * RELATIVE_TOL[fmt] * span
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
