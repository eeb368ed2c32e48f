"""Streaming on vs off: every logit of every step must be bitwise identical (the project's correctness bar)."""

from __future__ import annotations

import pytest

from helpers import distinct_experts_per_layer, expert_slots, moestream, streaming_prefill, verify_identical
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model
from moestream.tokenizer import GGUFTokenizer
from moestream.verify import verify

PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot pool "
          "keeps the hot ones in memory while misses are read by the IO threads.")


@pytest.fixture(scope="module")
def resident(qwen3moe_tiny):
    model = load_model(qwen3moe_tiny["q8_0"], LoadOptions(moe_stream=False))
    ids = GGUFTokenizer.from_gguf(qwen3moe_tiny["q8_0"]).encode(PROMPT)
    return model, ids


@pytest.mark.parametrize("slots,io_threads,policy,ubatch", [
    ("top_k", 1, "lfu", 128),      # the smallest legal pool
    ("top_k", 8, "lfu", 7),        # smallest pool, prompt in several chunks
    ("half", 8, "lfu", 128),       # fewer slots than the prompt's distinct experts: tiled prefill
    ("half", 1, "lru", 128),
    ("all", 8, "lfu", 128),        # every expert fits
])
def test_verify_identical(resident, slots, io_threads, policy, ubatch):
    model, ids = resident
    verify_identical(model, ids, 32, slots, ubatch=ubatch, io_threads=io_threads, policy=policy)


def test_pool_smaller_than_prompt_experts_really_tiles(resident):
    model, ids = resident
    distinct = distinct_experts_per_layer(model, ids)
    assert distinct > model.n_experts // 2, "prompt must select more experts than the 'half' pool holds"


def test_slot_ids_differ_from_expert_ids(resident):
    """The streaming run must actually address experts through slots that are not their ids."""
    model, ids = resident
    with streaming_prefill(model, ids, LoadOptions(slots=model.top_k + 1, io_threads=2)) as store:
        moved = [(e, s) for e, s in expert_slots(store) if e != s]
        assert moved, "every expert sat in the slot of its own id: the test would not catch slot/expert mixups"


def test_stream_tokens_equal_resident_tokens(resident):
    """Same greedy tokens through Engine.generate with both stores (the run path, not only verify)."""
    model, ids = resident
    from moestream.engine import Sampler, SamplingParams
    from moestream.experts.pool import ResidentStore
    out = []
    for store in (ResidentStore(model.gguf, model.layout),
                  model.make_store(LoadOptions(slots=model.top_k, io_threads=4))):
        model.set_store(store)
        st = Engine(model).generate(ids, 16, Sampler(SamplingParams(temp=0)))
        out.append(st.tokens)
        store.close()
    assert out[0] == out[1] and len(out[0]) == 16


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_verify_cli(qwen3moe_tiny, fmt):
    """The command itself, on the other formats, with the smallest pool."""
    p = moestream("verify", "-m", qwen3moe_tiny[fmt], "--steps", "32", "--slots", "4", "--io-threads", "8",
                  "-p", PROMPT, timeout=None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("identical: 33 steps"), p.stdout
    assert "logits compared bytewise" in p.stdout


def test_verify_detects_a_difference(resident, monkeypatch):
    """The harness must be able to fail: corrupt one slot read and expect a reported difference."""
    model, ids = resident
    from moestream.experts import reader as reader_mod
    real = reader_mod.ExpertReader._read

    def corrupt(self, job):
        n = real(self, job)
        job.dest[0] = (job.dest[0] + 1) % 256
        return n
    monkeypatch.setattr(reader_mod.ExpertReader, "_read", corrupt)
    res = verify(model, ids, 4, LoadOptions(slots=model.top_k, io_threads=2))
    assert not res.identical and res.first_diff[0] == 0
