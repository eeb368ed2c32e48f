"""Helpers shared by the test modules (imported as ``helpers``; ``conftest.py`` registers it for pytest's
assertion rewriting).

* :func:`moestream` -- the command line in a subprocess; :func:`cli` -- the same in this process (the fast tier).
* :func:`llama_cpp_template` -- a chat template from llama.cpp's own collection.
* :func:`load` -- a model resident or streaming through a small pool; :func:`ours_greedy` -- its logits over a
  prompt and its greedy continuation.
* transformers reference runs: :func:`hf_model` (the checkpoint in float64, the oracle), :func:`hf_logits`,
  :func:`hf_greedy`.
* llama.cpp reference runs (llama-cpp-python, f32 KV cache, flash attention off; see tests/test_llamacpp.py):
  :func:`llama_model`, :func:`llama_tokenize`, :func:`llama_greedy`; and moestream teacher-forced on a run's
  tokens, :func:`ours_forced`. Both give a :class:`Run`.
* streaming checks: :func:`verify_identical` (streaming on vs off bitwise, ``moestream.verify``),
  :func:`distinct_experts_per_layer`, :func:`streaming_prefill`, :func:`expert_slots`.
* expert reads (tests/test_direct_io.py, tests/test_read_faults.py): :func:`logits_of` (prefill + greedy decode
  logits), :func:`assert_bitwise`, :func:`assert_slots_hold_their_experts` (the pool holds no half-read slot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moestream.engine import Engine, Sampler, SamplingParams
from moestream.experts.pool import StreamingStore
from moestream.models.base import LoadOptions, MoEModel, load_model
from moestream.verify import VerifyResult, verify

#: Greedy tokens of the reference runs; context of llama.cpp's runs.
N_GREEDY = 32
N_CTX = 128


# ------------------------------------------------------------------------------------------------ command line
def moestream(*args: str, timeout: float | None = 600) -> subprocess.CompletedProcess:
    """``python -m moestream ARGS`` with its output captured (killed after ``timeout`` seconds)."""
    return subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True,
                          timeout=timeout)


def cli(*args: str, stdin: str | bytes = "") -> subprocess.CompletedProcess:
    """``moestream ARGS`` run in this process by ``moestream.cli.main``, with ``stdin`` as its standard input (a
    text stream over those bytes, not a terminal) and its stdout / stderr captured; the return value looks like
    :func:`moestream`'s (``returncode``, ``stdout``, ``stderr``; argparse's exits give their status)."""
    import io

    from moestream import cli as cli_mod

    data = stdin.encode() if isinstance(stdin, str) else stdin
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_mod.main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdin = saved
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def llama_cpp_template(name: str) -> str:
    """Chat template ``NAME.jinja`` of llama.cpp's collection of real models' templates
    (``vendor/llama.cpp/models/templates`` in the pinned llama-cpp-python sdist, ``tools/llamacpp.py``'s
    ``sdist()``: fetched once into ``$MOESTREAM_CACHE/wheels`` and hash-checked)."""
    from conftest import load_tool

    return load_tool("llamacpp").sdist_member(f"models/templates/{name}.jinja").decode("utf-8")


# ------------------------------------------------------------------------------------------------ models
def load(path: Path | str, stream: bool, slots: int | None = None, matmul: str = "blocks") -> MoEModel:
    """The model at ``path``, resident (``stream`` false: ``slots`` unused) or streaming through ``slots`` slots
    per layer; 4 IO threads; ``matmul`` as LoadOptions (``"dequant"``: the float32 model of the dequantized
    weights, what the F32-twin checks need)."""
    return load_model(str(path), LoadOptions(moe_stream=stream, slots=slots if stream else None, io_threads=4,
                                             matmul=matmul))


def ours_greedy(model: MoEModel, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """moestream's logits at every position of ``ids`` (one prefill) and its ``n`` greedy tokens after them
    (``Engine.generate``, temperature 0)."""
    eng = Engine(model)
    logits = eng.prefill(ids, model.new_cache(len(ids)), logits_all=True)
    return logits, eng.generate(ids, n, Sampler(SamplingParams(temp=0))).tokens


# ------------------------------------------------------------------------------------------------ transformers
def hf_model(ckpt: Path | str, config: Any = None, cls: Any = None) -> Any:  # noqa: ANN401
    """transformers' model of the checkpoint directory ``ckpt``, in float64: the oracle of the logit tests.

    Why float64. moestream and transformers run float32 in different orders of summation, so their distance is
    the sum of two rounding errors, and transformers' own can be as large as the bar: on the deepseek2 fixture
    (YaRN's sharpened softmax amplifies rounding) transformers' float32 run is 1.1e-4 from this model, past the
    project's 1e-4, and a change that brought moestream closer to the exact model could fail the float32
    comparison. Against float64 the distance is moestream's error alone (the weights are float32 numbers, exact
    in float64; every operation then rounds 2^-29 times finer).

    transformers keeps some operations in float32 whatever the model's dtype (RMSNorm's variance, the attention
    softmax, routers, ``x.float()`` in RoPE and elsewhere: ``torch.float32`` written in the modeling code). The
    forward of the returned model runs them in float64 too: while it runs, the modeling modules of the model's
    classes see a ``torch`` whose ``float32`` and ``float`` are ``torch.float64``, and ``Tensor.float`` leaves a
    float64 tensor as it is. (RoPE's inverse frequencies are computed in float32 when the model is built, by
    moestream the same way: part of the model's definition.) Experts run transformers' eager loop
    (``grouped_mm`` has no float64), attention its eager path. ``config``: a transformers config to use
    instead of the checkpoint's; ``cls``: the class (default ``AutoModelForCausalLM``). Eval mode."""
    if cls is None:
        from transformers import AutoModelForCausalLM as cls
    kw = {} if config is None else {"config": config}
    model = cls.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="eager",
                                experts_implementation="eager", **kw).eval()
    mods = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__.startswith("transformers.")}
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        with float64_inside(mods):
            return inner(*args, **kwargs)

    model.forward = forward
    return model


@contextlib.contextmanager
def float64_inside(modules: set[types.ModuleType]) -> Iterator[None]:
    """While in the block, the Python ``modules`` (modeling code that imported ``torch``) see a ``torch`` whose
    ``float32`` and ``float`` are ``torch.float64``, and ``Tensor.float`` (everywhere) leaves a float64 tensor as
    it is: their explicit float32 operations run in float64 (see :func:`hf_model`)."""
    torch64 = types.ModuleType("torch")
    torch64.__dict__.update(torch.__dict__)
    torch64.float32 = torch64.float = torch.float64
    to_float = torch.Tensor.float

    def float_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ANN401
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    patched = [m for m in modules if getattr(m, "torch", None) is torch]
    try:
        for m in patched:
            m.torch = torch64
        torch.Tensor.float = float_
        yield
    finally:
        torch.Tensor.float = to_float
        for m in patched:
            m.torch = torch


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] over ``ids``, in the model's dtype (float64 from :func:`hf_model`)."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids`` (a full forward per step)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


# ------------------------------------------------------------------------------------------------ llama.cpp
@dataclasses.dataclass
class Run:
    """Logits of a greedy run: rows 0..P-1 are the prompt's positions, row P-1+i (i >= 1) the logits after
    feeding greedy token i-1, so row P-1+i predicts token i. ``tokens`` are the argmax tokens of rows
    P-1..end (for a teacher-forced run: the run's own argmax, which may differ from what was fed)."""

    logits: np.ndarray  # [P + N_GREEDY - 1, n_vocab] float32
    tokens: list[int]
    seconds: float = 0.0


def llama_model(llama_cpp: Any, path: Path | str) -> Any:
    """llama.cpp on ``path``: f32 KV cache, flash attention off, logits at every position, 2 threads."""
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2, n_threads_batch=2,
        logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
        seed=0, verbose=False,
    )


def llama_tokenize(llm: Any, text: str) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=True, special=True))


def llama_greedy(llama_cpp: Any, path: Path | str, prompt: list[int], *, n: int = N_GREEDY,
                 text: str | None = None) -> Run:
    """llama.cpp's own greedy run of ``n`` tokens after ``prompt``. With ``text``, llama.cpp must first tokenize
    it to ``prompt`` (the prompt's ids as moestream tokenizes them)."""
    t0 = time.perf_counter()
    llm = llama_model(llama_cpp, path)
    try:
        if text is not None:
            assert llama_tokenize(llm, text) == prompt
        llm.eval(prompt)
        rows = [np.array(llm.scores[: len(prompt)], dtype=np.float32)]
        tokens = [int(rows[0][-1].argmax())]
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            rows.append(row[None])
            tokens.append(int(row.argmax()))
    finally:
        llm.close()
    return Run(np.concatenate(rows), tokens, time.perf_counter() - t0)


def ours_forced(model: MoEModel, prompt: list[int], fed: list[int]) -> Run:
    """moestream: prefill ``prompt`` (logits at every position), then one ``decode_step`` per token of
    ``fed[:-1]`` (teacher forcing with the other side's greedy tokens; where moestream's own argmax equals
    the fed token at every step, this *is* moestream's greedy run)."""
    t0 = time.perf_counter()
    eng = Engine(model)
    cache = model.new_cache(len(prompt) + len(fed))
    prefill = eng.prefill(prompt, cache, logits_all=True)
    rows = [prefill.numpy().astype(np.float32, copy=False)]
    tokens = [int(prefill[-1].argmax())]
    for i, tok in enumerate(fed[:-1]):
        step = eng.decode_step(tok, len(prompt) + i, cache)
        rows.append(step.numpy()[None].astype(np.float32, copy=False))
        tokens.append(int(step.argmax()))
    return Run(np.concatenate(rows), tokens, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------ streaming
def pool_slots(model: MoEModel, pool: str) -> int:
    """Slots per layer of a named pool: ``top_k`` (the smallest legal pool), ``half`` or ``all`` the experts."""
    return {"top_k": model.top_k, "half": model.n_experts // 2, "all": model.n_experts}[pool]


def verify_identical(model: MoEModel, ids: list[int], steps: int, pool: str, *, ubatch: int = 128,
                     label: str = "", **opts: Any) -> VerifyResult:
    """``moestream.verify`` of ``ids`` + ``steps`` greedy tokens, streaming through the named ``pool`` (see
    :func:`pool_slots`; other :class:`LoadOptions` in ``opts``): every logit bitwise equal to the resident run,
    experts really streamed, and (unless every expert fits) some slot misses. ``label`` prefixes the message."""
    res = verify(model, ids, steps, LoadOptions(slots=pool_slots(model, pool), **opts), ubatch=ubatch)
    assert res.identical, f"{label}first difference at step/position {res.first_diff}"
    assert res.steps == steps + 1
    assert res.n_logits == (len(ids) + steps) * model.n_vocab
    assert res.streamed_bytes > 0
    if pool != "all":
        assert res.hit_rate < 1.0
    return res


def distinct_experts_per_layer(model: MoEModel, ids: list[int]) -> int:
    """Fewest distinct experts that any MoE layer selects over the prompt run as one chunk (with the model's
    current store)."""
    from moestream.experts import moe as moe_mod

    seen: dict[int, set[int]] = {}
    real = moe_mod.MoE.__call__

    def spy(self, x, eids, w, *a, **k):
        seen.setdefault(self.layer, set()).update(eids.flatten().tolist())
        return real(self, x, eids, w, *a, **k)

    moe_mod.MoE.__call__ = spy
    try:
        Engine(model, ubatch=len(ids)).prefill(ids, model.new_cache(len(ids)))
    finally:
        moe_mod.MoE.__call__ = real
    return min(len(s) for s in seen.values())


@contextlib.contextmanager
def streaming_prefill(model: MoEModel, ids: list[int], opts: LoadOptions) -> Iterator[StreamingStore]:
    """Put a streaming store made with ``opts`` into ``model``, prefill ``ids`` through it and yield it; the
    store is closed afterwards."""
    store = model.make_store(opts)
    model.set_store(store)
    try:
        Engine(model).prefill(ids, model.new_cache(len(ids)))
        assert isinstance(store, StreamingStore)
        yield store
    finally:
        store.close()


def expert_slots(store: StreamingStore) -> list[tuple[int, int]]:
    """``(expert id, slot)`` of every slot of every layer of ``store`` (expert -1: the slot is empty)."""
    return [(e, s) for sm in store.slots.values() for s, e in enumerate(sm.expert_of.tolist())]


# ------------------------------------------------------------------------------------------------ expert reads
def logits_of(model: MoEModel, ids: list[int], steps: int, ubatch: int) -> list[torch.Tensor]:
    """The prefill's logits at every position of ``ids`` (chunks of ``ubatch``), then ``steps`` greedy decode
    steps' logits, with the model's current store."""
    eng = Engine(model, ubatch)
    cache = model.new_cache(len(ids) + steps)
    out = [eng.prefill(ids, cache, logits_all=True)]
    tok = int(out[0][-1].argmax())
    for i in range(steps):
        out.append(eng.decode_step(tok, len(ids) + i, cache)[None])
        tok = int(out[-1][0].argmax())
    return out


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Two :func:`logits_of` results are equal in raw bytes, step by step."""
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32)), f"step {step}"


def assert_slots_hold_their_experts(model: MoEModel, store: StreamingStore) -> int:
    """Every occupied slot holds its expert's exact bytes at its lead; returns how many matrices were checked."""
    checked = 0
    for layer, sm in store.slots.items():
        for slot, expert in enumerate(sm.expert_of.tolist()):
            if expert < 0:
                continue
            assert sm.slot_of[expert] == slot
            for name, m in model.layout[layer].items():
                lead = int(store.lead(layer, name)[slot])
                with open(m.path, "rb") as f:
                    f.seek(m.expert_offset(expert))
                    want = f.read(m.bytes_per_expert)
                got = store.matrix(layer, name)[slot, lead:lead + m.bytes_per_expert].cpu().numpy().tobytes()
                assert got == want, (layer, expert, name)
                checked += 1
    return checked
