"""The bars every architecture meets, as one call: ``standard_tests(globals(), Family(...))`` in a family's test
module defines its fixtures and these tests there (pytest collects them from the module):

- F32 file vs transformers on the source checkpoint run in float64 (helpers.hf_model says why): logits within
  ``hf_tol`` over the prompt, resident and streaming, and 32 greedy tokens equal (transformers: a full forward
  pass per step);
- F32 file vs llama.cpp on the same file (f32 KV cache, flash attention off; FIELD-NOTES): llama.cpp's greedy
  tokens fed back (teacher forcing), logits within ``llama_tol`` (the family states why that bound), the same
  top token at every position;
- ``verify``: streaming vs resident bitwise, at the smallest pool (top-k slots), a pool smaller than the
  prompt's distinct experts (tiled prefill), every expert resident, and a quantized file; and a check that
  slot ids really differ from expert ids;
- ``inspect``, ``run`` (streaming equals resident), ``verify`` and ``bench`` through the CLI (``moestream.cli.main`` in
  this process; bench runs its rows in subprocesses of its own).

A family's own module adds what is particular to it (its routing keys' defaults, its layer pattern, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import numpy as np
import pytest
import torch

from helpers import (
    cli,
    distinct_experts_per_layer,
    expert_slots,
    hf_greedy,
    hf_logits,
    hf_model,
    llama_greedy,
    load,
    ours_forced,
    ours_greedy,
    verify_identical,
)
from moestream.experts.pool import StreamingStore
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.tokenizer import GGUFTokenizer

PROMPT = ("In 1450 Johannes Gutenberg built a printing press with movable metal type; within fifty years "
          "presses in more than two hundred cities had printed millions of books.")
IDENTITY_PROMPT = ("Streaming experts from disk: the router picks the top-k experts of each token, and the slot "
                   "pool keeps the hot ones in memory while misses are read by the IO threads.")
N_GREEDY = 32


@dataclasses.dataclass(frozen=True)
class Family:
    """What the standard tests need to know of one family's fixture.

    fixture: the fixture name (``tools/fixtures_<family>.py``'s FIXTURES key). arch: the GGUF
    ``general.architecture``. hf_class: the transformers class the checkpoint must load as. hf_tol: the bound on
    |logit difference| against transformers. llama_tol: against llama.cpp (say why in the family's module).
    quant: the quantized file used by the identity and CLI tests: a converter outtype of the fixture, or one of
    its ``<fixture>-llamacpp`` quantizations by llama.cpp's quantizer (tools/fixtures.py ``QUANTIZED``). top_k,
    n_experts: the fixture's routing. moe_layers, n_layers: for the ``inspect`` check.
    """

    fixture: str
    arch: str
    hf_class: str
    top_k: int
    n_experts: int
    n_layers: int
    moe_layers: int
    hf_tol: float = 1e-4
    llama_tol: float = 1e-4
    quant: str = "q8_0"
    #: the share of each layer's experts the identity prompt must select (a family of many experts: less)
    distinct_share: float = 0.5


def standard_tests(ns: dict[str, Any], fam: Family) -> None:
    """Define the fixtures ``fam_files``, ``fam_prompt``, ``fam_hf``, ``fam_hf_ref``, ``fam_llama``,
    ``fam_resident_of`` and the standard tests (named ``test_std_*``) in the namespace ``ns`` (a test module's
    ``globals()``)."""
    tag = fam.arch

    @pytest.fixture(scope="module")
    def fam_files(fixtures_tool, request) -> dict[str, Any]:
        files = fixtures_tool.build_fixture(fam.fixture)
        if fam.quant not in files:  # made by llama.cpp's quantizer (fixture "<name>-llamacpp"), with llama_cpp
            request.getfixturevalue("llama_cpp")
            quants = fixtures_tool.build_quantized(f"{fam.fixture}-llamacpp", base=files)
            files = {**files, fam.quant: quants[fam.quant]}
        return files

    @pytest.fixture(scope="module")
    def fam_prompt(fam_files) -> list[int]:
        ids = GGUFTokenizer.from_gguf(str(fam_files["f32"])).encode(PROMPT)
        assert len(ids) >= 16
        return ids

    @pytest.fixture(scope="module")
    def fam_hf(fam_files):
        m = hf_model(fam_files["ckpt"])
        assert type(m).__name__ == fam.hf_class
        return m

    @pytest.fixture(scope="module")
    def fam_hf_ref(fam_hf, fam_prompt) -> tuple[torch.Tensor, list[int]]:
        return hf_logits(fam_hf, fam_prompt), hf_greedy(fam_hf, fam_prompt, N_GREEDY)

    @pytest.fixture(scope="module")
    def fam_llama(llama_cpp, fam_files, fam_prompt):
        return llama_greedy(llama_cpp, fam_files["f32"], fam_prompt, n=N_GREEDY, text=PROMPT)

    @pytest.fixture(scope="module")
    def fam_resident_of(fam_files):
        @functools.cache
        def get(fmt: str) -> tuple[MoEModel, list[int]]:
            model = load_model(str(fam_files[fmt]), LoadOptions(moe_stream=False))
            return model, GGUFTokenizer.from_gguf(str(fam_files[fmt])).encode(IDENTITY_PROMPT)
        return get

    @pytest.mark.slow
    @pytest.mark.parametrize("stream", [False, True], ids=["resident", "stream"])
    def test_std_f32_matches_transformers(fam_files, fam_hf_ref, fam_prompt, stream):
        ref, ref_tokens = fam_hf_ref
        model = load(fam_files["f32"], stream, slots=min(fam.top_k + 2, fam.n_experts))
        try:
            got, toks = ours_greedy(model, fam_prompt, N_GREEDY)
        finally:
            model.store.close()
        diff = (got - ref).abs().max().item()
        print(f"{tag} f32 ({'stream' if stream else 'resident'}) vs transformers: max |logit diff| {diff:.3g} over "
              f"{len(fam_prompt)} positions (logit range {(ref.max() - ref.min()).item():.3g})")
        assert diff < fam.hf_tol, f"max |logit diff| {diff:.3g} over {len(fam_prompt)} positions"
        assert toks == ref_tokens
        assert len(set(toks)) > N_GREEDY // 4, "the fixture's greedy continuation should be varied"

    @pytest.mark.slow
    @pytest.mark.llamacpp
    @pytest.mark.parametrize("stream", [True, False], ids=["stream", "resident"])
    def test_std_f32_matches_llama_cpp(fam_files, fam_prompt, fam_llama, stream):
        ref, tokens = fam_llama.logits, fam_llama.tokens
        model = load(fam_files["f32"], stream, slots=min(fam.top_k + 2, fam.n_experts))
        try:
            got = ours_forced(model, fam_prompt, tokens).logits
        finally:
            model.store.close()
        diff = float(np.abs(got - ref).max())
        print(f"{tag} f32 ({'stream' if stream else 'resident'}) vs llama.cpp: max |logit diff| {diff:.3g} over "
              f"{len(fam_prompt)} prompt positions + {N_GREEDY - 1} decode steps")
        assert diff < fam.llama_tol, f"max |logit diff| {diff:.3g}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert [int(t) for t in got[len(fam_prompt) - 1:].argmax(-1)] == tokens

    @pytest.mark.slow
    @pytest.mark.parametrize("fmt,slots,io_threads,policy,ubatch", [
        ("f32", "top_k", 1, "lfu", 128),  # the smallest legal pool
        ("f32", "half", 8, "lru", 7),  # fewer slots than the prompt's distinct experts, prompt in chunks
        ("f32", "all", 4, "lfu", 128),  # every expert fits
        ("quant", "top_k", 8, "lfu", 7),
        ("quant", "half", 2, "lfu", 128),
    ])
    def test_std_verify_identical(fam_resident_of, fmt, slots, io_threads, policy, ubatch):
        fmt = fam.quant if fmt == "quant" else fmt
        model, ids = fam_resident_of(fmt)
        verify_identical(model, ids, N_GREEDY, slots, ubatch=ubatch, label=f"{tag} {fmt}: ",
                         io_threads=io_threads, policy=policy)

    def test_std_slot_ids_differ_from_expert_ids(fam_files):
        """Streaming through a pool of top-k + 1 slots really puts experts in slots other than their ids (the
        dual addressing is exercised), and the identity prompt selects more than ``distinct_share`` of the
        experts (half by default)."""
        path = str(fam_files[fam.quant])
        model = load_model(path, LoadOptions(slots=min(fam.top_k + 1, fam.n_experts), io_threads=2))
        ids = GGUFTokenizer.from_gguf(path).encode(IDENTITY_PROMPT)
        distinct = distinct_experts_per_layer(model, ids)
        store = model.store
        try:
            assert isinstance(store, StreamingStore)
            assert distinct > model.n_experts * fam.distinct_share, (distinct, model.n_experts)
            moved = [(e, s) for e, s in expert_slots(store) if e != s]
            assert moved, "every expert sat in the slot of its own id"
        finally:
            store.close()

    def test_std_cli_inspect(fam_files):
        p = cli("inspect", "-m", str(fam_files[fam.quant]), "--slots", str(fam.top_k))
        assert p.returncode == 0, p.stderr
        for field in (f"architecture    {fam.arch}",
                      f"experts         {fam.n_experts} per layer, {fam.top_k} used per token",
                      f"layers          {fam.n_layers} ({fam.moe_layers} with routed experts)"):
            assert field in p.stdout, p.stdout

    @pytest.mark.slow
    def test_std_cli_run_streaming_equals_resident(fam_files):
        args = ("run", "-m", str(fam_files[fam.quant]), "-n", "8", "--temp", "0", "-p", "The printing press")
        a = cli(*args, "--moe-stream", "off")
        b = cli(*args, "--slots", str(fam.top_k), "--io-threads", "2")
        assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
        assert a.stdout == b.stdout and len(a.stdout) > len("The printing press")
        assert fam.arch in b.stderr.splitlines()[0] and "streaming:" in b.stderr.splitlines()[0]
        assert "expert hit rate" in b.stderr.strip().splitlines()[-1]

    @pytest.mark.slow
    def test_std_cli_verify(fam_files):
        p = cli("verify", "-m", str(fam_files[fam.quant]), "--steps", "8", "--slots", str(fam.top_k),
                      "--io-threads", "4", "-p", IDENTITY_PROMPT)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("identical: 9 steps"), p.stdout

    @pytest.mark.slow
    def test_std_cli_bench(fam_files, tmp_path):
        out = tmp_path / "b.json"
        p = cli("bench", "-m", str(fam_files[fam.quant]), "-p", "8", "-n", "4", "-r", "1", "--slots",
                      str(fam.top_k), "--json", str(out))
        assert p.returncode == 0, p.stderr
        rows = json.loads(out.read_text())["rows"]
        assert [r["moe_stream"] for r in rows] == [True, False]
        for r in rows:
            assert {t["test"] for t in r["tests"]} == {"pp8", "tg4"}
            assert all(t["tok_s_mean"] > 0 for t in r["tests"])

    for name, obj in list(locals().items()):
        if name.startswith(("fam_", "test_std_")):
            ns[name] = obj
