"""The GPU data path's own logic on the CPU: the MoE layer's grouped expert batches (slot offsets and leads,
the pair order, the routing weights gathered by real id, the scatter into the output) run through the Triton
kernels under Triton's interpreter (``TRITON_INTERPRET=1``, numpy), so CI checks what ``--device cuda`` computes
without a GPU. What needs CUDA itself (GPU pools, the staging ring, the copy stream, events) is in
tests/test_cuda.py.

Bars: streaming through 4 slots of 64 (the top-k: every chunk tiles) gives the same bits as the resident
store through the same kernels; and both are within 1e-5 of the largest logit of the float32 dequantize path
(the same float32 products, other summation order).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    pytest.skip("a CUDA device is here: tests/test_cuda.py runs the real thing", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install 'moestream[test]' on Linux x86-64)")

from conftest import DEFAULT_GGUF  # noqa: E402
from helpers import assert_bitwise, logits_of  # noqa: E402
from moestream.engine import Engine  # noqa: E402
from moestream.experts.pool import ResidentStore  # noqa: E402
from moestream.models.base import LoadOptions, load_model  # noqa: E402

IDS = [1, 5, 9, 200, 7, 3]


def _grouped_model(slots: int):  # noqa: ANN202
    """The default model, its MoE layers computing through tkernels.grouped (what a CUDA device runs)."""
    m = load_model(str(DEFAULT_GGUF), LoadOptions(slots=slots, matmul="dequant"))
    moes = [b["moe"] for b in m.blocks if "moe" in b]
    for moe in moes:
        moe.gpu = True
    return m, moes


def test_grouped_path_identity_and_oracle() -> None:
    model, moes = _grouped_model(4)
    calls = []
    real = moes[0]._grouped

    def spy(store, groups, experts, slot_of, x, out):  # noqa: ANN001, ANN202
        calls.append((len(experts), sorted(slot_of[e] for e in experts) != sorted(experts)))
        return real(store, groups, experts, slot_of, x, out)

    moes[0]._grouped = spy
    streamed = logits_of(model, IDS, 2, 3)
    assert calls and any(addr for _, addr in calls), "no batch addressed experts through slot ids != expert ids"
    assert model.store.stats.misses > 0 and model.store.stats.hit_rate < 1.0
    model.set_store(ResidentStore(model.gguf, model.layout))
    resident = logits_of(model, IDS, 2, 3)
    assert_bitwise(streamed, resident)
    ref = load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False, matmul="dequant"))
    want = logits_of(ref, IDS, 2, 3)
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(streamed, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-5 * scale


def _decode_on_device_path(model, ids: list[int], steps: int, eager: bool,  # noqa: ANN001
                           lean: str | None = None) -> list[torch.Tensor]:
    """Prefill ``ids`` through the usual forward, then ``steps`` greedy steps through the CUDA decode body
    (the step runner's ``body``: device position, attention over a fixed row count, and either the store's MoE
    path (``eager``) or ``MoE.resident_step``, what a CUDA graph captures). ``lean``: "body" (``body`` with
    ``lean``: slots planned on the host, experts through ``resident_step`` at the offsets written) or "segments"
    (``Runner._segmented_lean`` with graphs off: each segment run as its graph would be)."""
    from moestream.models.layers import decode_keys

    eng = Engine(model, 8)
    cache = model.new_cache(len(ids) + steps)
    for rope in model.runner.ropes():
        rope.reserve(cache.n_ctx)
    model.runner._kpos = torch.arange(cache.n_ctx, dtype=torch.int64)
    out = [eng.prefill(ids, cache)]
    tok = int(out[0][-1].argmax())
    for i in range(steps):
        pos = len(ids) + i
        with torch.inference_mode():
            plan = getattr(model.store, "plan", None)  # the device-planned step: the runner's hooks around it
            if plan is not None:
                plan.before_step()
            if lean == "segments":
                logits = model.runner._segmented_lean(torch.tensor([tok]), torch.tensor([pos]),
                                                      decode_keys(pos, cache.n_ctx), cache, ())
            else:
                logits = model.runner.body(torch.tensor([tok]), torch.tensor([pos]),
                                           decode_keys(pos, cache.n_ctx), cache, eager=eager, lean=lean == "body")
            if plan is not None:
                plan.after_step()
        out.append(logits)
        tok = int(logits[0].argmax())
    return out


_RESIDENT_STEPS: list = []


def _resident_steps(model) -> list[torch.Tensor]:  # noqa: ANN001
    """The resident store's run of IDS and 4 steps through ``MoE.resident_step`` (what a CUDA graph captures; the
    callers have put tstep's and tmoe's kernels on: the step as on CUDA), made once: the graphed and the lean
    segmented tests both compare with it (109 s under Triton's interpreter on the 2-core machine)."""
    if not _RESIDENT_STEPS:
        model.set_store(ResidentStore(model.gguf, model.layout))
        _RESIDENT_STEPS.extend(_decode_on_device_path(model, IDS, 4, eager=False))
    return _RESIDENT_STEPS


def test_graphed_decode_step_equals_streaming_step(monkeypatch) -> None:  # noqa: ANN001
    """The step a CUDA graph captures (every MoE layer through ``MoE.resident_step``: pairs in top-k order, slot
    = expert id, nothing on the host) gives the same bits as the streaming store's step through 4 slots (host
    top-k, slot plan, misses read, pairs grouped by expert); both within 1e-5 of the largest logit of the usual
    CPU forward (attention over keys 0..pos in blocks by gpu/tstep.py's kernels, as on CUDA: other summation
    order; the SwiGLU activation and the top-k rows' weighted sum by gpu/tmoe.py's launches, as on CUDA: the
    streaming step ends with the same weighted sum as the resident one)."""
    from moestream.gpu import tmoe, tstep

    monkeypatch.setattr(tstep, "ON_CPU", True)  # the attention kernels of a CUDA step, under the interpreter
    monkeypatch.setattr(tmoe, "ON_CPU", True)  # and the MoE layer's activation and weighted sum
    model, _ = _grouped_model(4)
    streamed = _decode_on_device_path(model, IDS, 4, eager=True)
    assert model.store.stats.misses > 0
    graphed = _resident_steps(model)
    assert_bitwise(streamed[1:], graphed[1:])
    ref = load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False, matmul="dequant"))
    want = logits_of(ref, IDS, 4, 8)
    for g, w in zip(graphed[1:], want[1:], strict=True):
        assert int(g.argmax()) == int(w.argmax())
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())


def test_lean_segmented_step_equals_resident_step(monkeypatch) -> None:  # noqa: ANN001
    """The segmented streaming step with its experts inside the segments (issue 24 item 2; Runner._segmented_lean,
    devplan.SegmentOffsets: the host plans each layer's slots in one prepare(), joins the reads and writes the top-k
    pairs' pool offsets; the next segment computes the experts through ``MoE.resident_step`` at them) gives the
    bits of the resident step and of the eager streaming step through 4 slots of 64 (misses every step); the
    store counts every layer's top-k (hits and misses as the eager step's, the same routing trace), writes the
    offsets once per MoE layer and step, and after each write the offsets name the slots that hold the experts."""
    from moestream.gpu import tmoe, tstep

    monkeypatch.setattr(tstep, "ON_CPU", True)
    monkeypatch.setattr(tmoe, "ON_CPU", True)
    model, moes = _grouped_model(4)
    assert model.runner.lean(), "the default"
    monkeypatch.setenv("MOESTREAM_LEAN_SEGMENTS", "0")
    assert not model.runner.lean()
    monkeypatch.setenv("MOESTREAM_LEAN_SEGMENTS", "1")
    assert model.runner.lean()
    runs, counts, traces = {}, {}, {}
    for how in ("eager", "body", "segments"):
        model.set_store(model.make_store(LoadOptions(slots=4, matmul="dequant")))
        model.store.trace = []
        if how == "segments":
            model.runner.graphs.off_reason = "test: every segment eagerly"
        runs[how] = _decode_on_device_path(model, IDS, 4, eager=how == "eager", lean=None if how == "eager" else how)
        st = model.store.stats
        counts[how] = (st.hits, st.misses)
        traces[how] = list(model.store.trace)
        if how != "eager":
            offs = model.store._segment_offsets
            assert offs.writes == 4 * len(moes)
            for la in offs.names:  # the last step's offsets: each pair's expert in the slot they point at
                sm = model.store.slots[la]
                last = [e for t_la, e, _ in traces[how] if t_la == la][-1]
                for k, name in enumerate(offs.names[la]):
                    stride = model.store.pools[la][name].stride(0)
                    got = sorted(int(sm.expert_of[o // stride]) for o in offs.dev[la][k].tolist())
                    assert set(got) == set(last), (la, name)
    assert counts["eager"][1] > 0
    assert counts["body"] == counts["segments"] == counts["eager"]
    assert traces["body"] == traces["segments"] == traces["eager"]
    model.runner.graphs.off_reason = None
    resident = _resident_steps(model)
    for how in ("eager", "body", "segments"):
        assert_bitwise(runs[how][1:], resident[1:])


def test_resident_step_tables_follow_the_store_object(monkeypatch) -> None:  # noqa: ANN001
    """``MoE.resident_step`` keeps its device tables (offsets between one store's pools) for that store object:
    a store made after another was dropped, even at the same address (Python id), gets tables of its own."""
    from moestream.gpu import tmoe

    monkeypatch.setattr(tmoe, "ON_CPU", True)
    model, moes = _grouped_model(4)
    moe = moes[0]
    made = []
    real = moe._device_tables
    monkeypatch.setattr(moe, "_device_tables", lambda store, *a: made.append(id(store)) or real(store, *a))
    x = torch.randn(1, model.n_embd)
    ids = torch.arange(model.top_k, dtype=torch.int64)[None]
    w = torch.full((1, model.top_k), 1.0 / model.top_k)
    outs = []
    for _ in range(3):
        store = ResidentStore(model.gguf, model.layout)
        outs.append(moe.resident_step(store, x, ids, w))
        moe.resident_step(store, x, ids, w)  # the same store again: its tables kept
        del store
    assert len(made) == 3, made
    assert_bitwise(outs[1:], outs[:1] * 2)


@pytest.mark.parametrize("promote", ["copy", "inline"])
def test_device_planned_step_equals_resident_step(monkeypatch, promote: str) -> None:  # noqa: ANN001
    """The device-planned step (experts/devplan.py: the host tier holds every expert; hits found in the device table,
    misses copied from the tier into shared scratch rows by the gather kernel, all inside the step) gives the bits of
    the resident step through 4 slots of 64 (misses every step, and promotions between steps); after the last
    step's bookkeeping the device table equals the store's slot maps, every slot holds the bytes of the expert its
    map names, and the tier served every miss (nothing read from the file after the fill). "inline"
    (MOESTREAM_PROMOTE): the step copies its misses into victim slots itself, no promotion after it, and the host's
    replay of the placement (one step behind) ends with the device's tables; through 6 slots (top-4): a step's
    victims exclude the 4 of the step before, so some steps have fewer usable victims than misses (the rest go to
    the scratch rows), and a victim whose expert the step selects is skipped."""
    from moestream.experts import devplan

    monkeypatch.setattr(devplan, "ON_CPU", True)  # a CPU device: the kernels run under Triton's interpreter
    monkeypatch.setenv("MOESTREAM_PROMOTE", promote)
    model, _ = _grouped_model(4)
    opts = LoadOptions(slots=4 if promote == "copy" else 6, matmul="dequant", host_cache=1 << 30)
    store = model.make_store(opts)
    assert store.plan is not None, "a tier holding every expert makes the store device-planned"
    model.set_store(store)
    plan = store.plan
    assert plan.inline == (promote == "inline")
    planned = _decode_on_device_path(model, IDS, 3, eager=False)
    plan.flush()
    assert plan.steps == 3 and store.stats.misses > 0
    assert (plan.promotions > 0, plan.placed > 0) == ((True, False) if promote == "copy" else (False, True))
    for i, la in enumerate(plan.layers):
        sm = store.slots[la]
        assert (plan.slot_dev[i][:sm.n_experts].numpy() == sm.slot_of).all(), la
        if plan.inline:
            assert (plan.expert_dev[i][:sm.n_slots].numpy() == sm.expert_of).all(), la
        for slot, e in enumerate(sm.expert_of.tolist()):
            for name, pool in store.pools[la].items():
                lead, n = int(store.tier.leads[la][name][e]), model.layout[la][name].bytes_per_expert
                info = model.gguf.tensors[f"blk.{la}.ffn_{name}_exps.weight"]
                want = model.gguf.mapped(info)[e * n:(e + 1) * n]
                assert torch.equal(pool[slot, lead:lead + n], want), (la, slot, e, name)
    assert store.bytes_read == 0
    model.set_store(ResidentStore(model.gguf, model.layout))
    resident = _decode_on_device_path(model, IDS, 3, eager=False)
    assert_bitwise(planned[1:], resident[1:])
    store.close()


@pytest.mark.parametrize("k", [4, 6, 8])
def test_place_misses_kernel_follows_the_host_rule(k: int) -> None:
    """devplan.place_misses (MOESTREAM_PROMOTE=inline, the kernel) against the rule DevicePlan._place_host replays
    on the host, written here once more in plain Python: random tables of 16 experts in 10 slots, random top-k ids
    and victims (some empty slots, some -1, some holding an expert the step selects); newslot and both tables."""
    import numpy as np

    from moestream.experts import devplan

    rng = np.random.default_rng(k)
    for _ in range(12):
        n_exp, n_slots = 16, 10
        held = rng.choice(n_exp, size=rng.integers(0, n_slots + 1), replace=False)
        expert_of = np.full(n_slots, -1, dtype=np.int32)
        expert_of[rng.choice(n_slots, size=len(held), replace=False)] = held
        slot_of = np.full(n_exp, -1, dtype=np.int32)
        for s_, e in enumerate(expert_of):
            if e >= 0:
                slot_of[e] = s_
        ids = rng.choice(n_exp, size=k, replace=False).astype(np.int64)
        victims = rng.choice(n_slots, size=k, replace=False).astype(np.int32)
        victims[rng.random(k) < 0.2] = -1
        want_slot, want_exp, want_new = slot_of.copy(), expert_of.copy(), np.full(k, -2, dtype=np.int32)
        usable = [int(v) for v in victims if v >= 0 and int(expert_of[v]) not in set(ids.tolist())]
        misses = [j for j in range(k) if slot_of[ids[j]] < 0]
        for r, j in enumerate(misses):
            want_new[j] = -1
            if r < len(usable):
                v = usable[r]
                if want_exp[v] >= 0:
                    want_slot[want_exp[v]] = -1
                want_slot[ids[j]], want_exp[v], want_new[j] = v, ids[j], v
        got_slot, got_exp = torch.from_numpy(slot_of.copy()), torch.from_numpy(expert_of.copy())
        got_new = torch.zeros(k, dtype=torch.int32)
        devplan.place_misses(torch.from_numpy(ids), got_slot, got_exp, torch.from_numpy(victims), got_new)
        assert (got_new.numpy() == want_new).all() and (got_slot.numpy() == want_slot).all(), (ids, victims)
        assert (got_exp.numpy() == want_exp).all()


def test_device_plan_host_pool_copy_waits_for_the_step_in_flight(monkeypatch) -> None:  # noqa: ANN001
    """With ``--pool host`` the pools are pinned host memory, which the CPU copies into without any CUDA stream
    ordering it: a promotion's copy into a victim's slot must wait until the step enqueued since (which may still
    read the victim through the slot's mapping) has completed, and the expert enters the device table only after
    its copy. (On the H200 the copy went at once and the planned step's logits differed from the resident step's
    at the sixth step, qwen3moe-tiny Q4_K_M, ``test_cuda.py::test_device_planned_step[...-host]``.) Checked here
    with the CUDA copy stream and events stood in for."""
    from moestream.experts import devplan

    monkeypatch.setattr(devplan, "ON_CPU", True)
    model, _ = _grouped_model(4)
    store = model.make_store(LoadOptions(slots=4, matmul="dequant", host_cache=1 << 30))
    plan = store.plan
    assert plan is not None and all(p.device.type == "cpu" for p in store.pools[plan.layers[0]].values())

    class Event:  # a step in flight, then done
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    class Stream:
        def synchronize(self) -> None:
            pass

    plan._copy = Stream()  # as on a GPU: promotions are asynchronous
    i, la = 0, plan.layers[0]
    sm = store.slots[la]
    e, s = 11, 2
    victim = int(sm.expert_of[s])
    sm.slot_of[e], sm.expert_of[s] = s, e  # what the policy's plan does before the copy
    if victim >= 0:
        sm.slot_of[victim] = -1
    plan.host_table[i, e] = -1
    before = {name: pool[s].clone() for name, pool in store.pools[la].items()}
    in_flight = Event()
    plan._promote(i, la, e, s, after=in_flight)
    assert not plan._publish(block=False)
    for name, pool in store.pools[la].items():
        assert torch.equal(pool[s], before[name]), f"{name}: the slot was written while a step may read it"
    assert plan.host_table[i, e] == -1
    in_flight.done = True
    assert plan._publish(block=False) and plan.host_table[i, e] == s and not plan._pending
    row = int(store.tier.slots[la].slot_of[e])
    for name, pool in store.pools[la].items():
        assert torch.equal(pool[s], store.tier.pools[la][name][row]), name
        assert store._leads[la][name][s] == store.tier.leads[la][name][e]
    plan._copy = None
    store.close()


def test_gpu_memory_plan_counts_the_device_plan_scratch(monkeypatch) -> None:  # noqa: ANN001
    """--gpu-mem's plan counts the device-planned step's scratch rows (the bytes the store then allocates for them)
    exactly when the host tier will hold every expert (the embedded model's experts fit in any tier), and nothing
    with the step off (MOESTREAM_DEVICE_PLAN=0)."""
    from moestream.experts import devplan

    monkeypatch.setattr(devplan, "ON_CPU", True)
    model = load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False))
    plain = model.plan_memory(LoadOptions(gpu_mem=1 << 30), n_ctx=64, gpu=True)
    every = LoadOptions(gpu_mem=1 << 30, host_cache=64 << 20, slots=8)
    planned = model.plan_memory(every, n_ctx=64, gpu=True)
    store = model.make_store(every)
    assert store.plan is not None and store.plan.scratch_bytes > 0
    assert planned.scratch - plain.scratch == store.plan.scratch_bytes
    store.close()
    monkeypatch.setenv("MOESTREAM_DEVICE_PLAN", "0")
    assert model.plan_memory(every, n_ctx=64, gpu=True).scratch == plain.scratch
    assert model.make_store(every).plan is None


def test_grouped_path_adds_expert_biases_by_real_id(fixtures_tool) -> None:
    """GPT-OSS's per-expert biases on the grouped launches (each pair's bias row gathered by its real expert id, one
    float32 add, as the per-expert path adds it), at one MoE layer of the gpt-oss fixture (the whole model is too
    slow under Triton's interpreter: 491 s for this layer-level test with three tokens on the loaded 2-core
    machine, so it takes two): two tokens sharing two of their six experts through 4 slots of 32 (tiles; slot ids !=
    expert ids)
    give the bits of the resident store; one token through ``MoE.resident_step`` (what a CUDA graph captures) gives
    the bits of the same token through the store's path; both within 1e-5 of the largest output of the per-expert
    dequantize path. A bias read by slot id would be another expert's: the first bar would fail."""
    path = str(fixtures_tool.build_fixture("gpt-oss-tiny")["f32"])
    model = load_model(path, LoadOptions(slots=4, matmul="dequant"))
    layer = model.layout.moe_layers[1]
    moe = model.experts(layer)
    assert moe.bias and not moe.gpu
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.n_embd, generator=gen)
    six = torch.randperm(model.n_experts, generator=gen)[:6]
    ids = torch.stack([six[:4], six[2:]])  # [2, top_k 4]: six distinct experts, two of them shared
    w = torch.softmax(torch.randn(2, model.top_k, generator=gen), dim=-1)
    ref = moe(x, ids, w)[0]  # per expert, dequantized, its bias added per expert
    moe.gpu = True
    calls = []
    real = moe._grouped

    def spy(store, groups, experts, slot_of, xx, out):  # noqa: ANN001, ANN202
        calls.append(sorted(slot_of[e] for e in experts) != sorted(experts))
        return real(store, groups, experts, slot_of, xx, out)

    moe._grouped = spy
    streamed = moe(x, ids, w)[0]
    assert any(calls), "no batch addressed experts through slot ids != expert ids"
    model.set_store(ResidentStore(model.gguf, model.layout))
    assert_bitwise([streamed], [moe(x, ids, w)[0]])
    assert float((streamed - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    one = moe(x[:1], ids[:1], w[:1])[0]
    assert_bitwise([one], [moe.resident_step(model.store, x[:1], ids[:1], w[:1])])


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls (CUDA runtime error codes: 0 = success)."""

    def __init__(self, fail: bool = False):
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - the CUDA name
        self.registered.append((ptr, size, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_pools_cost_their_size_and_unregister_after_the_last_view(monkeypatch):
    """--pool host / the host tier: page-locked pools of exactly their size (torch's pin_memory allocator rounds
    each block up to a power of two, which the memory plan did not count), registered with CUDA, and unregistered
    only once no tensor over the memory is left."""
    import gc

    from moestream.experts import pool as pool_mod

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.delenv("MOESTREAM_PIN", raising=False)
    n, stride = 37, 3 * 2**20 + 144  # 111 MiB: torch's allocator would lock 128 MiB
    t = pool_mod._aligned_pool(n, stride, 4096, True)
    assert t.shape == (n, stride) and t.data_ptr() % 4096 == 0
    assert len(fake.registered) == 1
    ptr, size, flags = fake.registered[0]
    assert size == n * stride and ptr == t.data_ptr() and flags == pool_mod._HOST_REGISTER_FLAGS
    t[5, 7] = 9  # writable memory
    row = t[5]  # a view outlives the pool tensor
    del t
    gc.collect()
    assert fake.unregistered == []
    assert int(row[7]) == 9
    del row
    gc.collect()
    assert fake.unregistered == [ptr]


def test_pinned_empty_falls_back_to_torch_when_registration_fails(monkeypatch):
    from moestream.experts import pool as pool_mod

    fake = _FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    calls = []
    real_empty = torch.empty

    def empty(*a, **k):  # torch's pinned allocator needs a GPU: stand in for it, record the request
        calls.append(k.get("pin_memory"))
        return real_empty(*a, **{key: v for key, v in k.items() if key != "pin_memory"})

    monkeypatch.setattr(torch, "empty", empty)
    t = pool_mod.pinned_empty(5000)
    assert t.numel() == 5000 and calls == [True] and len(fake.registered) == 1


def test_pool_host_plan_counts_cuda_on_the_host(monkeypatch, capsys):
    """--pool host's plan (run's and inspect's): pools in pinned host memory under --mem, dense weights, KV cache
    and scratch in VRAM (0 here), and the process part grown by what CUDA adds on the host after the plan is
    measured (budget.CUDA_KERNELS_HOST, and CUDA_CONTEXT_HOST while no context exists): the H200 run of
    benchmarks/host_mem_probe.py went 266 MiB past --mem 5GiB without it."""
    from moestream import budget, cli
    from moestream.models.base import open_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA LoadOptions on this CPU torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # the plan measures this process, which in a test worker may hold GiBs from earlier tests: room above that
    opts = LoadOptions(device="cuda", pool="host", mem=budget.process_rss() + 1200 * 2**20)
    shape = open_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False, metadata_only=True))
    host = shape.plan_memory(opts, 160, loaded=False, gpu=True)
    cpu = shape.plan_memory(opts, 160, loaded=False, gpu=False)
    grow = budget.CUDA_KERNELS_HOST + budget.CUDA_CONTEXT_HOST
    assert abs(host.process - cpu.process - grow) < 32 * 2**20  # two measures of this process, moments apart
    assert host.dense == host.kv == host.scratch == 0 and cpu.dense > 0
    assert any("--pool host" in n for n in host.notes)
    assert host.process + host.pools <= opts.mem
    # inspect --pool host without --device cuda and --mem: one line saying what it needs
    assert cli.main(["inspect", "--pool", "host"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moestream: error: --pool host: inspect prices run --pool host's plan with --device cuda and --mem"]

