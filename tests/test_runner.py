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

import dataclasses
from typing import Any

import numpy as np
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


#: the families whose decode step runs as runtime/fastdecode.py's (their ``fast_layer``), each by a Q8_0 fixture
#: (gpt-oss: llama.cpp's MXFP4_MOE, Q8_0 dense)
FAST_FAMILIES = ["qwen3moe-tiny", "mixtral-tiny", "olmoe-tiny", "qwen2moe-tiny", "glm4moe-tiny", "gpt-oss-tiny",
                 "gemma4-tiny", "qwen35moe-tiny", "deepseek2-tiny"]


def _fast_file(which: str, fixtures_tool: Any) -> str:
    """The file of ``which`` (a FAST_FAMILIES fixture, or "default") whose matmuls all run on the C kernels."""
    if which == "default":
        return str(DEFAULT_GGUF)
    files = fixtures_tool.build_fixture(which)
    return str(files["q8_0"] if "q8_0" in files else files["mxfp4_moe"])


def _cache_state(cache: Any, pos: int) -> list[torch.Tensor | None]:
    """What a decode step through position ``pos`` wrote in ``cache``: each layer's K and V rows 0..pos (None for a
    layer that owns no cache: gemma4's shared-KV layers) and, in qwen35moe's HybridCache (dicts keyed by layer),
    each Gated DeltaNet layer's whole conv and recurrent state."""
    out: list[torch.Tensor | None] = []
    for kind in ("k", "v", "conv", "ssm"):
        ts = getattr(cache, kind, None)
        for t in (ts.values() if isinstance(ts, dict) else ts or ()):
            out.append(t[:pos + 1] if t is not None and kind in ("k", "v") else t)
    return out


def _assert_same_cache(got: Any, want: Any, pos: int) -> None:
    """:func:`_cache_state` of two caches, bit for bit."""
    a, b = _cache_state(got, pos), _cache_state(want, pos)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert_bitwise([x], [y])


@pytest.mark.parametrize("which", ["default", *FAST_FAMILIES, "qwen35moe-tiny/mixer", "deepseek2-tiny/q4_k_m"])
def test_fast_decode_step_is_the_eager_step(which: str, fixtures_tool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU decode step of runtime/fastdecode.py (a few C calls per layer) gives the eager step's bits
    (Runner.run over the same cache contents) at every position of a decode, counts the same expert hits, and writes
    the same KV cache rows; it runs for the files of the families it fits (per-head q/k norms or none or over the
    whole projection, llama's de-interleaved heads, q/k/v biases, a shared expert; gpt-oss's o bias, per-layer RoPE,
    sinks, its own router and biased experts; gemma4's per-layer head dims, KV heads, RoPE and sliding window, V = K,
    shared-KV layers, per-expert scales, post norms, PLE and output scales; qwen35moe's Gated DeltaNet layers by the
    step's own ms_dnet_decode call between kernels writing into its buffers, or (``/mixer``: FastLayer.dnet taken
    away) by the family's own code, gated attention with partial RoPE, its conv and recurrent states and cache
    position; deepseek2's MLA (q LoRA, the latent's norm and RoPE into the cache row, the absorbed up-projections,
    K = V attention), its torch router scores with the C router's bias and groups, leading dense layer and shared
    experts; ``/q4_k_m``: llama.cpp's Q4_K_M of it, attn_k_b in Q5_0 and attn_v_b in Q4_K), resident (streaming:
    below). The fast step runs its kernels on 1 thread at odd positions, 2 at even ones; the eager step on 2."""
    from moestream import kernels
    from moestream.runtime import fastdecode

    monkeypatch.setattr(kernels, "_THREADS", list(kernels._THREADS))  # the thread count restored after the test
    which, _, variant = which.partition("/")
    p = fixtures_tool.build_fixture(which)[variant] if variant == "q4_k_m" else _fast_file(which, fixtures_tool)
    model = load_model(p, LoadOptions(moe_stream=False))
    if variant == "mixer":  # the DeltaNet layers by the family's own code (FastLayer.mixer)
        own = type(model).fast_layer
        monkeypatch.setattr(type(model), "fast_layer", lambda m, i: dataclasses.replace(own(m, i), dnet=None))
    fast = fastdecode.plan(model)
    assert fast is not None
    if which == "qwen35moe-tiny":  # which path the DeltaNet layers take: the step's own calls or the family's mixer
        dnets = [hooks[2] is not None for *_, hooks in fast.layers]
        mixers = [hooks[0] is not None for *_, hooks in fast.layers]
        assert dnets == ([False] * len(dnets) if variant else mixers) and any(mixers)
    if which == "deepseek2-tiny":  # every layer's attention by the step's MLA calls
        assert all(hooks[3] is not None for *_, hooks in fast.layers)
    caches = [model.new_cache(24), model.new_cache(24)]
    ids = _ids(model, 9, 5)
    with torch.inference_mode():
        for c in caches:
            model.forward(ids, 0, c)
        tok = 7
        for pos in range(9, 20):
            hits = model.store.stats.hits
            kernels.set_threads(1 + pos % 2)
            got = fast.step(torch.tensor([tok]), pos, caches[0])
            kernels.set_threads(2)
            fast_hits = model.store.stats.hits - hits
            want = model.runner.run(Step(torch.tensor([tok]), [Seq(caches[1], pos, 1)]))
            assert_bitwise(got, want)
            assert fast_hits == model.store.stats.hits - hits - fast_hits == model.top_k * len(model.layout.moe_layers)
            _assert_same_cache(caches[0], caches[1], pos)
            tok = int(got[0].argmax())
    model.store.close()


def test_fast_decode_scalar_products_are_torchs() -> None:
    """The fast step multiplies in numpy where the eager step multiplies a float32 tensor by a Python float (Gemma 4's
    router input times 1/sqrt(hidden)) or by a float32 [1] tensor (its layer output scale): torch rounds the Python
    float to float32 first, so the float32 products are the same bits (the gemma4-tiny fixture's 1/sqrt(256) is a
    power of two, exact either way; 2816 is Gemma-4-26B-A4B's hidden size). A product in double, then rounded, would
    differ in some of these values."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3)) * 3
    for n in (2816, 704, 3):
        s = n ** -0.5
        want = (x * s).numpy()
        assert_bitwise([torch.from_numpy(x.numpy() * np.float32(s))], [torch.from_numpy(want)])
        assert not np.array_equal((x.double() * s).float().numpy(), want)  # (the check can tell them apart)
        t = torch.tensor([s], dtype=torch.float32)
        assert_bitwise([torch.from_numpy(x.numpy() * np.float32(t.item()))], [x * t])


def test_fast_decode_qwen35moe_cache_position(fixtures_tool: Any) -> None:
    """qwen35moe's recurrent state cannot be rewound: the fast step, as the eager one (the family's ``begin_step``),
    refuses its cache at any other position than the cache's ``pos`` (ValueError, before anything runs: the states,
    the store's counters and ``pos`` unchanged), and each step it runs advances ``pos`` by one (``end_step``)."""
    from moestream.runtime import fastdecode

    model = load_model(_fast_file("qwen35moe-tiny", fixtures_tool), LoadOptions(moe_stream=False))
    fast = fastdecode.plan(model)
    assert fast is not None
    cache = model.new_cache(24)
    with torch.inference_mode():
        model.forward(_ids(model, 9, 5), 0, cache)
        assert cache.pos == 9
        before = [t.clone() for t in _cache_state(cache, 23)]
        hits = model.store.stats.hits
        for pos in (8, 10, 0):
            with pytest.raises(ValueError, match="cannot be rewound"):
                fast.step(torch.tensor([7]), pos, cache)
        assert cache.pos == 9 and model.store.stats.hits == hits
        assert_bitwise(_cache_state(cache, 23), before)
        for pos in (9, 10):
            fast.step(torch.tensor([7]), pos, cache)
            assert cache.pos == pos + 1
        assert model.store.stats.hits > hits


def _qwen3_q8(fixtures_tool: Any) -> str:
    return str(fixtures_tool.build_fixture("qwen3moe-tiny")["q8_0"])


@pytest.mark.parametrize(("which", "direct", "prefetch", "overlap"), [
    ("qwen3moe-tiny", False, False, True), ("qwen3moe-tiny", True, False, True), ("qwen3moe-tiny", False, True, True),
    ("qwen3moe-tiny", True, True, True), ("qwen3moe-tiny", True, False, False), ("default", True, False, True),
    ("mixtral-tiny", False, False, True), ("olmoe-tiny", False, True, True), ("qwen2moe-tiny", False, False, True),
    ("qwen2moe-tiny", True, False, False), ("glm4moe-tiny", False, False, True), ("gpt-oss-tiny", False, False, True),
    ("gpt-oss-tiny", True, False, False), ("gemma4-tiny", False, False, True), ("gemma4-tiny", True, True, True),
    ("gemma4-tiny", False, False, False), ("qwen35moe-tiny", False, False, True), ("qwen35moe-tiny", True, True, True),
    ("qwen35moe-tiny", True, False, False), ("deepseek2-tiny", False, False, True),
    ("deepseek2-tiny", True, True, True), ("deepseek2-tiny", True, False, False)])
def test_fast_decode_streaming_is_the_eager_step(which: str, direct: bool, prefetch: bool, overlap: bool,
                                                 fixtures_tool: Any) -> None:
    """Streaming through top-k slots (nearly every step misses in every layer), buffered or O_DIRECT, with or without
    the router lookahead and the overlap: the fast step gives, at every position of a decode, the bits of the eager
    streaming step (Runner.run on a second model with its own store) and of the resident step, writes the same KV
    cache rows and, without the lookahead (whose counters depend on when reads finish), leaves the store's counters
    and routing trace as the eager step does."""
    from moestream.runtime import fastdecode

    p = _fast_file(which, fixtures_tool)
    top_k = load_model(p, LoadOptions(metadata_only=True)).top_k
    opts = LoadOptions(slots=top_k, direct_io=direct, prefetch=prefetch, overlap=overlap, io_threads=4)
    fast_model, eager_model = load_model(p, opts), load_model(p, opts)
    resident = load_model(p, LoadOptions(moe_stream=False))
    if direct and not fast_model.store.direct:
        pytest.skip("the file system here refuses O_DIRECT")
    fast = fastdecode.plan(fast_model)
    assert fast is not None and fast.streaming
    for m in (fast_model, eager_model):
        m.store.trace = []
    models = (fast_model, eager_model, resident)
    caches = [m.new_cache(24) for m in models]
    ids = _ids(resident, 9, 5)
    with torch.inference_mode():
        for m, c in zip(models, caches, strict=True):
            m.runner.run(Step(ids, [Seq(c, 0, 9)]))
        tok = 7
        for pos in range(9, 20):
            misses = fast_model.store.stats.misses
            got = fast.step(torch.tensor([tok]), pos, caches[0])
            assert fast_model.store.stats.misses > misses or prefetch
            want = eager_model.runner.run(Step(torch.tensor([tok]), [Seq(caches[1], pos, 1)]))
            assert_bitwise([got], [want])
            assert_bitwise([got], [resident.runner.run(Step(torch.tensor([tok]), [Seq(caches[2], pos, 1)]))])
            _assert_same_cache(caches[0], caches[1], pos)
            tok = int(got[0].argmax())
    fs, es = fast_model.store, eager_model.store
    if not prefetch:
        assert (fs.stats.hits, fs.stats.misses, fs.layer_counts, fs.trace) == \
            (es.stats.hits, es.stats.misses, es.layer_counts, es.trace)
    else:
        assert fs.stats.prefetch_issued > 0
    for m in models:
        m.store.close()


@pytest.mark.parametrize(("which", "mode", "least"), [
    ("qwen3moe-tiny", "early", "0"), ("qwen3moe-tiny", "input", "0.5"), ("qwen3moe-tiny", "both", "0.5"),
    ("qwen3moe-tiny", "both", "1.1"), ("gemma4-tiny", "both", "0.5"), ("gpt-oss-tiny", "both", "0")])
def test_fast_decode_lookahead_modes_keep_the_bits(which: str, mode: str, least: str, fixtures_tool: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast step's router lookahead, predicted early (from the layer before, after its attention), from the
    layer's input, or both (the second cancelling what the first queued and it drops), gated by what its reads
    were worth (MOESTREAM_LOOKAHEAD_MIN 1.1: no rank ever pays after its warm-up, the predictions then mostly
    skipped): the logits are the resident step's bits at every position; the early prediction issues reads (kind
    0 counted) and the store stays consistent."""
    from moestream.runtime import fastdecode

    monkeypatch.setenv("MOESTREAM_LOOKAHEAD", mode)
    monkeypatch.setenv("MOESTREAM_LOOKAHEAD_MIN", least)
    p = _fast_file(which, fixtures_tool)
    top_k = load_model(p, LoadOptions(metadata_only=True)).top_k
    model = load_model(p, LoadOptions(slots=top_k + 2, direct_io=True, prefetch=True, io_threads=4))
    resident = load_model(p, LoadOptions(moe_stream=False))
    fast = fastdecode.plan(model)
    assert fast is not None and fast.streaming and fast.c_predict
    caches = [m.new_cache(40) for m in (model, resident)]
    ids = _ids(resident, 5, 3)
    with torch.inference_mode():
        for m, c in zip((model, resident), caches, strict=True):
            m.runner.run(Step(ids, [Seq(c, 0, 5)]))
        tok = 3
        for pos in range(5, 37):
            got = fast.step(torch.tensor([tok]), pos, caches[0])
            assert_bitwise([got], [resident.runner.run(Step(torch.tensor([tok]), [Seq(caches[1], pos, 1)]))])
            tok = int(got[0].argmax())
    st = model.store
    assert st.stats.prefetch_issued > 0
    assert (st.look_stats[0, :, 0].sum() > 0) == (mode != "input")
    for sm in st.slots.values():  # every mapped expert's slot maps back to it
        mapped = sm.expert_of[sm.expert_of >= 0]
        assert (sm.slot_of[mapped] == np.flatnonzero(sm.expert_of >= 0)).all()
    for m in (model, resident):
        m.store.close()


@pytest.mark.parametrize("stream", [False, True])
def test_fast_decode_gpt_oss_past_the_window(stream: bool, fixtures_tool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss past its sliding window (128 positions in the fixture): the fast step's sliding layers see the last 128
    keys only, as the eager step's, with their own RoPE and the sinks: the eager step's bits (logits and KV rows) at
    positions 124..135, resident or streaming through top-k slots, on 1 and 2 threads."""
    from moestream import kernels
    from moestream.runtime import fastdecode

    monkeypatch.setattr(kernels, "_THREADS", list(kernels._THREADS))
    p = _fast_file("gpt-oss-tiny", fixtures_tool)
    opts = LoadOptions(slots=4, io_threads=2) if stream else LoadOptions(moe_stream=False)
    models = (load_model(p, opts), load_model(p, opts))
    fast = fastdecode.plan(models[0])
    assert fast is not None and fast.streaming == stream and models[0].window == 128
    assert any(b["swa"] for b in models[0].blocks) and not all(b["swa"] for b in models[0].blocks)
    caches = [m.new_cache(140) for m in models]
    ids = _ids(models[0], 124, 3)
    with torch.inference_mode():
        for m, c in zip(models, caches, strict=True):
            m.runner.run(Step(ids, [Seq(c, 0, 124)]))
        tok = 7
        for pos in range(124, 136):
            kernels.set_threads(1 + pos % 2)
            got = fast.step(torch.tensor([tok]), pos, caches[0])
            kernels.set_threads(2)
            want = models[1].runner.run(Step(torch.tensor([tok]), [Seq(caches[1], pos, 1)]))
            assert_bitwise([got], [want])
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
                assert_bitwise([a[:pos + 1]], [b[:pos + 1]])
            tok = int(got[0].argmax())
    for m in models:
        m.store.close()


@pytest.mark.parametrize("direct", [False, True])
def test_fast_decode_streaming_read_error(direct: bool, fixtures_tool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EIO on an expert read during a fast streaming step stops that step with the reader's one error naming the
    file, the expert's own offset and size; the failed expert is in no slot, every slot holds its expert's bytes
    (nothing half-written is mapped), and the model then decodes the resident model's bits again."""
    import os

    from helpers import assert_slots_hold_their_experts
    from moestream.errors import ExpertReadError
    from moestream.runtime import fastdecode
    from test_read_faults import Fault, eio, expert_at, last_layer_range

    p = _qwen3_q8(fixtures_tool)
    top_k = load_model(p, LoadOptions(metadata_only=True)).top_k
    model = load_model(p, LoadOptions(slots=top_k, direct_io=direct, io_threads=2))
    if direct and not model.store.direct:
        pytest.skip("the file system here refuses O_DIRECT")
    resident = load_model(p, LoadOptions(moe_stream=False))
    fast = fastdecode.plan(model)
    assert fast is not None and fast.streaming
    ids = _ids(model, 9, 5)
    fault = Fault(model.gguf.path, *last_layer_range(model), eio)
    monkeypatch.setattr(os, "preadv", fault)
    with torch.inference_mode():
        cache = model.new_cache(64)
        model.runner.run(Step(ids, [Seq(cache, 0, 9)]))
        fault.armed = True
        tok = 7
        with pytest.raises(ExpertReadError) as info:
            for pos in range(9, 64):
                tok = int(fast.step(torch.tensor([tok]), pos, cache)[0].argmax())
        fault.armed = False
    err = info.value
    assert fault.fired == 1
    layer, expert = expert_at(model, err.offset)
    assert layer == max(model.layout.layers) and err.path == model.gguf.path
    assert err.nbytes == model.layout[layer]["up"].bytes_per_expert
    assert str(err) == (f"{model.gguf.path}: reading {err.nbytes} bytes of expert data at offset {err.offset} "
                        f"failed: Input/output error")
    assert model.store.slots[layer].slot_of[expert] == -1
    assert assert_slots_hold_their_experts(model, model.store) > 0
    with torch.inference_mode():
        got, want = [], []
        for m, out in ((model, got), (resident, want)):
            c = m.new_cache(24)
            m.runner.run(Step(ids, [Seq(c, 0, 9)]))
            tok = 7
            for pos in range(9, 20):
                out.append(m.forward(torch.tensor([tok]), pos, c))
                tok = int(out[-1][0].argmax())
    assert_bitwise(got, want)
    model.store.close()
    resident.store.close()
