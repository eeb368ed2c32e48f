"""The step runner (runtime/runner.py) over every family: batches of sequences and the device-position decode step.

- A batch of sequences (each its own KV cache and positions; one prefilling while another decodes, of different
  lengths, one joining late and one leaving early) gives every sequence the very bits it gets alone, on every
  family: the projections, routers and experts see all the rows together, and every CPU matmul computes each row on
  its own in a fixed order (the C kernels, F32 weights included: models/layers.Weight), while what is per sequence
  (attention, recurrent state, DeepSeek's per-head MLA matmuls) runs per sequence.
- The decode step that CUDA graphs capture (position in a tensor, attention over a fixed number of cache rows
  with the later ones masked: ``Runner.body``) runs on the CPU for every family: its logits stay within 1e-5 of
  the largest logit of the usual eager step (the same float32 products, reductions over more, masked, keys) with
  the same greedy tokens, and streaming through top-k slots gives the same bits as every expert resident there
  too. What the GPU adds (graph capture and replay) is in tests/test_cuda.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import DEFAULT_GGUF
from helpers import assert_bitwise
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model
from moestream.models.layers import decode_keys
from moestream.runtime.step import Seq, Step

#: (fixture, file) of every family: a file of each architecture's real converter output
FAMILIES = [
    ("qwen3moe-tiny", "q8_0"),
    ("gemma4-tiny", "f32"),
    ("qwen35moe-tiny", "f32"),
    ("qwen2moe-tiny", "f32"),
    ("mixtral-tiny", "f32"),
    ("olmoe-tiny", "f32"),
    ("glm4moe-tiny", "f32"),
    ("deepseek2-tiny", "f32"),
    ("gpt-oss-tiny", "f32"),
]


@pytest.fixture(scope="module", params=[None, *FAMILIES], ids=lambda p: "default" if p is None else p[0])
def path(request: pytest.FixtureRequest, fixtures_tool: Any) -> str:
    if request.param is None:
        return str(DEFAULT_GGUF)
    name, kind = request.param
    return str(fixtures_tool.build_fixture(name)[kind])


def _ids(model: Any, n: int, seed: int) -> torch.Tensor:
    return torch.tensor([(31 * i + seed) % model.n_vocab for i in range(n)])


def test_batch_equals_alone(path: str) -> None:
    """Three sequences of 7, 5 and 4 tokens prefilled in one step (once with every row's logits, once with each
    sequence's last row's), then a step in which the third joins late (its
    prompt's other 5 tokens prefilled beside the others' decode tokens), a step of three decodes, and a step that
    the second has left: every row has the bits of its sequence run alone, streaming through top-k slots (one read
    serves every sequence of the step)."""
    model = load_model(path, LoadOptions(slots=load_model(path, LoadOptions(metadata_only=True)).top_k))
    prompts = [_ids(model, 7, 3), _ids(model, 5, 11), _ids(model, 9, 17)]
    firsts = [prompts[0], prompts[1], prompts[2][:4]]  # the third prefills its last 5 tokens in the next step
    with torch.inference_mode():
        caches = [model.new_cache(16) for _ in prompts]
        alone = [[model.forward(p, 0, c, logits_all=True)] for p, c in zip(firsts, caches, strict=True)]
        alone[2].append(model.forward(prompts[2][4:], 4, caches[2], logits_all=True))
        alone[0].append(model.forward(torch.tensor([5]), 7, caches[0]))
        alone[1].append(model.forward(torch.tensor([6]), 5, caches[1]))
        last = [model.forward(torch.tensor([8]), 8, caches[0]), model.forward(torch.tensor([9]), 6, caches[1]),
                model.forward(torch.tensor([10]), 9, caches[2])]
        left = [model.forward(torch.tensor([11]), 9, caches[0]), model.forward(torch.tensor([12]), 10, caches[2])]

        # each sequence's last row only (the head on those rows), alone and together
        alone_lasts = torch.cat([model.forward(p, 0, model.new_cache(16)) for p in firsts])
        lasts = model.runner.step([(p, 0, model.new_cache(16)) for p in firsts])
        bc = [model.new_cache(16) for _ in prompts]
        first = model.runner.step([(p, 0, c) for p, c in zip(firsts, bc, strict=True)], logits_all=True)
        mid = model.runner.step([(torch.tensor([5]), 7, bc[0]), (torch.tensor([6]), 5, bc[1]),
                                 (prompts[2][4:], 4, bc[2])], logits_all=True)
        end = model.runner.step([(torch.tensor([8]), 8, bc[0]), (torch.tensor([9]), 6, bc[1]),
                                 (torch.tensor([10]), 9, bc[2])])
        after = model.runner.step([(torch.tensor([11]), 9, bc[0]), (torch.tensor([12]), 10, bc[2])])
    got = [lasts, first, mid, end, after]
    want = [alone_lasts, torch.cat([a[0] for a in alone]), torch.cat([alone[0][1], alone[1][1], alone[2][1]]),
            torch.cat(last),
            torch.cat(left)]
    assert_bitwise(got, want)
    assert model.store.stats.misses > 0


def _device_decode(model: Any, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill ``ids`` eagerly, then ``steps`` greedy steps through the device-position step (``Runner.body``,
    experts through the store)."""
    runner = model.runner
    cache = model.new_cache(len(ids) + steps)
    for rope in runner.ropes():
        rope.reserve(cache.n_ctx)
    runner._kpos = torch.arange(cache.n_ctx, dtype=torch.int64)
    out = [Engine(model, 8).prefill(ids, cache)]
    tok = int(out[0][-1].argmax())
    for i in range(steps):
        pos = len(ids) + i
        host = Step(torch.tensor([tok]), [Seq(cache, pos, 1)])  # the host side: recurrent state's position
        with torch.inference_mode():
            model.begin_step(host)
            logits = runner.body(torch.tensor([tok]), torch.tensor([pos]), decode_keys(pos, cache.n_ctx), cache,
                                 eager=True)
            model.end_step(host)
        out.append(logits)
        tok = int(logits[0].argmax())
    return out


def test_device_step_every_family(path: str) -> None:
    model = load_model(path, LoadOptions(moe_stream=False))
    ids = [int(t) for t in _ids(model, 10, 5)]
    device = _device_decode(model, ids, 4)
    eng = Engine(model, 8)
    cache = model.new_cache(len(ids) + 4)
    want = [eng.prefill(ids, cache)]
    for i in range(4):
        want.append(eng.decode_step(int(want[-1][-1].argmax()), len(ids) + i, cache)[None])
    for step, (g, w) in enumerate(zip(device[1:], want[1:], strict=True)):
        assert int(g.argmax()) == int(w.argmax()), step
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max()), step
    model.set_store(model.make_store(LoadOptions(slots=model.top_k)))
    streamed = _device_decode(model, ids, 4)
    assert model.store.stats.misses > 0
    assert_bitwise(streamed[1:], device[1:])


@pytest.mark.parametrize("which", ["default", "qwen3moe-tiny"])
def test_fast_decode_step_is_the_eager_step(which: str, fixtures_tool: Any) -> None:
    """The CPU decode step of runtime/fastdecode.py (a few C calls per layer) gives the eager step's bits
    (Runner.run over the same cache contents) at every position of a decode, counts the same expert hits, and writes
    the same KV cache rows; it runs for the qwen3moe files it fits, resident, and the streaming store runs the eager
    step."""
    from moestream.runtime import fastdecode

    p = str(DEFAULT_GGUF) if which == "default" else str(fixtures_tool.build_fixture(which)["q8_0"])
    model = load_model(p, LoadOptions(moe_stream=False))
    fast = fastdecode.plan(model)
    assert fast is not None
    caches = [model.new_cache(24), model.new_cache(24)]
    ids = _ids(model, 9, 5)
    with torch.inference_mode():
        for c in caches:
            model.forward(ids, 0, c)
        tok = 7
        for pos in range(9, 20):
            hits = model.store.stats.hits
            got = fast.step(torch.tensor([tok]), pos, caches[0])
            fast_hits = model.store.stats.hits - hits
            want = model.runner.run(Step(torch.tensor([tok]), [Seq(caches[1], pos, 1)]))
            assert_bitwise(got, want)
            assert fast_hits == model.store.stats.hits - hits - fast_hits == model.top_k * len(model.layout.moe_layers)
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
                assert_bitwise(a[:pos + 1], b[:pos + 1])
            tok = int(got[0].argmax())
    model.store.close()
    streaming = load_model(p, LoadOptions(slots=model.top_k))
    assert fastdecode.plan(streaming) is None
    streaming.store.close()
