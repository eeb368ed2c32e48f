"""Prefill, decode, sampling and generation statistics."""

from __future__ import annotations

import collections
import math
import os
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import psutil
import torch

from . import kernels
from .budget import available_memory
from .errors import ConfigError, ForwardError, NumericError, OptionError
from .experts.pool import StoreStats
from .gpu import build_seconds
from .limits import MAX_TOKENS
from .models.base import MoEModel
from .params import SamplingParams  # the one check of sampling values, torch-free (refused before torch loads)

GiB, MiB = 2**30, 2**20


def check_cache_fits(model: MoEModel, n_ctx: int, option: str = "-c", hint: str = "-n or -c", n_seqs: int = 1) -> None:
    """ConfigError (naming ``option``) unless ``n_seqs`` caches ``model.new_cache(n_ctx)`` fit in the memory
    available now.

    Computed from the cache's shapes without allocating, so an absurd -n or -c is refused before anything is
    printed instead of failing in torch's allocator.
    """
    if n_ctx > MAX_TOKENS:
        raise ConfigError(f"{option}: a context of {n_ctx} tokens is more than moestream supports (2^31)")
    need = n_seqs * model.cache_bytes(n_ctx)
    avail = available_memory()
    if need > avail:
        each = "" if n_seqs == 1 else f" in each of {n_seqs} slots"
        raise ConfigError(f"{option}: a context of {n_ctx} tokens{each} needs {need / GiB:.1f} GiB of KV cache for "
                          f"{os.path.basename(model.gguf.path)}, but {avail / GiB:.1f} GiB of memory is available; "
                          f"use a smaller {hint}")


def trained_context(model: MoEModel) -> int:
    """The context the file was trained for: ``{arch}.context_length`` (4096 when the file has none, as
    ``MoEModel.n_ctx_train``)."""
    return model.n_ctx_train


def check_trained_context(model: MoEModel, n_ctx: int, option: str, override: bool) -> str | None:
    """ConfigError (naming ``option`` and the file's context length) when ``n_ctx`` is past the trained context
    and ``override`` is false; with ``override``, the warning to print instead; None when it is within."""
    train = trained_context(model)
    if n_ctx <= train:
        return None
    key = f"{model.gguf.arch}.context_length"
    where = f"the {train} tokens {os.path.basename(model.gguf.path)} was trained for ({key})"
    if not override:
        raise OptionError(f"{option}: a context of {n_ctx} tokens is past {where}; stay within {train}, or pass "
                          "{override_ctx} to go past it", override_ctx=False)
    return (f"warning: {option}: a context of {n_ctx} tokens is past {where} (--override-ctx); the text may "
            f"degrade past {train} tokens")


#: Share of the memory available now that a context sized by default (-n -1, interactive mode) may take for its
#: KV cache; the rest is left to the expert pools, activations and everything else on the machine.
DEFAULT_CTX_MEMORY_SHARE = 0.5


def default_context(model: MoEModel, share: float = DEFAULT_CTX_MEMORY_SHARE,
                    memory: int | None = None) -> tuple[int, int | None]:
    """The context to use when none is asked for and generation has no length (-n -1, interactive mode): the
    trained context, capped so that its KV cache takes at most ``share`` of the memory available now (or of
    ``memory`` bytes: what --mem leaves besides this process).

    Returns ``(n_ctx, capped_from)``: ``capped_from`` is the trained context when the cap applied, else None.
    ConfigError when not even a context of 16 tokens fits."""
    train = trained_context(model)
    budget = share * (available_memory() if memory is None else memory)
    if model.cache_bytes(train) <= budget:
        return train, None
    lo, hi = 0, train  # largest n with cache_bytes(n) <= budget (cache_bytes grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.cache_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo < 16:
        where = "memory available" if memory is None else "memory that --mem leaves besides this process"
        fix = ("free memory, or give the context with -c N" if memory is None else
               "give a larger --mem, or the context with -c N (moestream inspect --mem SIZE -c N prints the plan)")
        need = (f" (a 16-token cache takes {model.cache_bytes(16) / MiB:.2f} MiB, the trained {train} tokens "
                f"{model.cache_bytes(train) / MiB:.1f} MiB)")
        raise ConfigError(f"{model.gguf.path}: not even a 16-token KV cache fits in {share:.0%} of the "
                          f"{budget / share / GiB:.2f} GiB of {where}{need}; {fix}")
    return lo, train


def run_context(model: MoEModel, n_prompt: int, n_predict: int, ctx_size: int | None = None,
                opts: object = None, share: float = DEFAULT_CTX_MEMORY_SHARE) -> tuple[int, int | None]:
    """The context (tokens) of a run, ``run``'s and ``inspect --mem``'s alike: ``ctx_size`` when given (> 0); with
    no length to generate (``n_predict`` < 0: -n -1, interactive chat, the server) the trained context capped by
    memory (:func:`default_context`; under a ``mem`` budget, of what it leaves besides this process); else the
    prompt's ``n_prompt`` tokens + ``n_predict``. ``opts``: the LoadOptions the budget comes from (default: the
    model's). ``share``: of that memory, what the KV cache may take (serve -np N: each slot's). Returns
    ``(n_ctx, capped_from)`` as :func:`default_context`."""
    if ctx_size:
        return ctx_size, None
    if n_predict >= 0:
        return n_prompt + n_predict, None
    o = opts or model.opts
    try:
        return default_context(model, share, memory=kv_memory(o))
    except ConfigError:
        if o.mem is not None and o.budgeted:  # --mem below what even a 16-token context needs: the budget's own
            # error names the smallest --mem that works (a newcomer got only "0.00 GiB ... leaves" from serve)
            model.plan_memory(o, 16, loaded=False, n_seqs=max(1, round(DEFAULT_CTX_MEMORY_SHARE / share)))
        raise


def kv_memory(opts: object) -> int | None:
    """The memory (bytes) that KV caches are sized against under LoadOptions ``opts``: with a ``mem`` budget,
    what it leaves besides this process (its RSS now); else None (the memory available, :func:`default_context`).
    The one place of this arithmetic for run's context and serve's slot count."""
    if opts.mem is not None and opts.budgeted:  # the KV share comes out of --mem
        from .budget import process_rss
        return max(opts.mem - process_rss(), 0)
    return None


def penalize(logits: torch.Tensor, window: Iterable[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties sampler (``llama_sampler_penalties_apply``) on float32 logits [n_vocab]: for each
    token that occurs ``count`` > 0 times in ``window`` (token ids), a logit <= 0 is multiplied by
    ``p.repeat_penalty`` and a positive one divided by it, then ``count * frequency_penalty + presence_penalty`` is
    subtracted; float32 arithmetic, as llama.cpp. Returns a new tensor on the logits' device."""
    ids = torch.tensor(list(window), dtype=torch.int64, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]]
    seen = counts > 0
    x = logits.float()
    rp = torch.full_like(x, p.repeat_penalty)  # a tensor: the division is IEEE's, not a multiply by 1/rp
    out = torch.where(seen, torch.where(x <= 0, x * rp, x / rp), x)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        sub = counts.float() * p.frequency_penalty + seen.float() * p.presence_penalty
        out = torch.where(seen, out - sub, out)
    return out


def best_first(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of float32 logits [n_vocab] and their token ids, largest first, equal logits in token
    id order: ``torch.sort(logits, descending=True, stable=True)`` cut to ``k``. For k < n_vocab it is found
    with ``torch.topk``, without sorting the vocabulary (plus one pass over it when logits equal to the k-th
    largest lie outside the top k)."""
    n = logits.shape[-1]
    if k < n:
        top, idx = torch.topk(logits, k + 1)  # largest first
        if bool(top[k] < top[k - 1]):  # nothing outside the top k equals its smallest: the k are these
            idx = torch.sort(idx[:k]).values
        elif not bool(torch.isnan(top[k - 1])):  # the cut falls among equal logits: the lowest ids of them
            above = (~(logits <= top[k - 1])).nonzero().flatten()  # larger, or NaN (sorted first, as by sort)
            idx = torch.cat((above, (logits == top[k - 1]).nonzero().flatten()[: k - above.numel()]))
        else:
            idx = None
        if idx is not None:
            vals = logits[idx]  # idx in id order; a stable sort keeps it among equal logits
            order = torch.sort(vals, descending=True, stable=True).indices
            return vals[order], idx[order]
    vals, idx = torch.sort(logits, descending=True, stable=True)
    return vals[:k], idx[:k]


def bias_logits(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """float32 logits [n_vocab] + ``bias`` (token id -> number, as llama.cpp's logit-bias sampler: added, -inf
    bans); a new tensor."""
    out = logits.float().clone()
    ids = torch.tensor(list(bias), dtype=torch.int64, device=out.device)
    out[ids] += torch.tensor(list(bias.values()), dtype=torch.float32, device=out.device)
    return out


class Sampler:
    """Picks the next token from float32 logits [n_vocab]. Greedy is the argmax (the lowest id of equal
    maxima); otherwise the candidates are the top-k (all with top_k <= 0) largest first, equal logits in id
    order (:func:`best_first`), then filtered and drawn as :class:`SamplingParams` says.

    ``constraint``: a grammar the output must follow (:class:`moestream.structured.Constraint`, or anything with
    ``mask(logits) -> logits`` and ``consume(token)``), applied after the penalties; it is this sequence's own (a
    batch's sequences never share one).

    ``logprobs`` (None: off): per token picked, :attr:`records` gets ``(token, logprob, top)``: its
    log-probability and the ``logprobs`` most likely tokens' ``[(id, logprob), ...]`` (0: none), by the float32
    log-softmax of the logits it was given, the model's own: before logit bias, penalties, grammar, temperature and
    the top-k/top-p/min-p cut (OpenAI's and llama-server's ``logprobs``)."""

    def __init__(self, params: SamplingParams, constraint: object = None, logprobs: int | None = None):
        self.p = params
        self.constraint = constraint
        self.logprobs = logprobs
        self.records: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.gen = torch.Generator()
        seed = params.seed if params.seed is not None and params.seed >= 0 else time.time_ns() % 2**63
        self.gen.manual_seed(seed)
        #: the last repeat_last_n tokens given to accept() (only kept when the penalties are on)
        self.history: collections.deque[int] = collections.deque(
            maxlen=None if params.repeat_last_n < 0 else params.repeat_last_n)

    def accept(self, ids: Iterable[int]) -> None:
        """Tokens of the sequence, in order (the prompt, then each sampled one), for the penalties' window."""
        if self.p.penalized:
            self.history.extend(ids)

    def __call__(self, logits: torch.Tensor) -> int:
        tok = self._pick(logits)
        if self.logprobs is not None:
            lp = torch.log_softmax(logits.double().cpu(), dim=-1)  # float64: a float32 sum over 150k entries drifts
            vals, idx = best_first(lp, self.logprobs) if self.logprobs else (lp[:0], lp[:0])
            self.records.append((tok, float(lp[tok]), list(zip(idx.tolist(), vals.tolist(), strict=True))))
        if self.constraint is not None:
            self.constraint.consume(tok)
        return tok

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.p
        if p.logit_bias:
            logits = bias_logits(logits, p.logit_bias)
        if p.penalized and self.history:
            logits = penalize(logits, self.history, p)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if p.temp <= 0:
            return int(torch.argmax(logits))  # the first of equal maxima, on the logits' own device
        logits = logits.float().cpu()
        vals, idx = best_first(logits, p.top_k if p.top_k > 0 else logits.shape[-1])
        probs = torch.softmax(vals, dim=-1)
        if p.top_p < 1.0:
            keep = torch.cumsum(probs, 0) - probs < p.top_p  # keep the token that crosses top_p
            keep[0] = True
            vals, idx, probs = vals[keep], idx[keep], probs[keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            vals, idx = vals[keep], idx[keep]
        probs = torch.softmax(vals / p.temp, dim=-1)
        return int(idx[torch.multinomial(probs, 1, generator=self.gen)])


def _built() -> float:
    """Seconds this process has spent building kernels so far: the C kernels' compile and Triton's builds."""
    return kernels.build_seconds() + build_seconds()


@dataclass
class GenStats:
    """Timings in seconds, bytes in bytes. hits / misses: the store's (see StoreStats: an expert a prefetch
    brought counts as a hit). store: every counter of the store over this generation (prefetch recall, miss
    bytes ready, prefetches issued / wasted)."""

    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_decode: int = 0
    decode_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    streamed_bytes: int = 0
    disk_bytes: int = 0
    peak_rss: int = 0
    #: seconds of kernel builds inside the prompt and decode times: Triton's (a kernel's first use in the process:
    #: compiled on a machine's first run, else loaded from Triton's cache; gpu.build_seconds) and the C kernels'
    #: (their first use on a machine; kernels.build_seconds)
    build_seconds: float = 0.0
    stop_reason: str = ""
    tokens: list[int] = field(default_factory=list)
    store: StoreStats = field(default_factory=StoreStats)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_decode / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def line(self) -> str:
        return (f"prompt {self.n_prompt} tok, {self.prompt_tps:.1f} tok/s | decode {self.n_decode} tok, "
                f"{self.decode_tps:.2f} tok/s | expert hit rate {100 * self.hit_rate:.1f}% | "
                + self.prefetch_summary()
                + f"streamed {self.streamed_bytes / GiB:.3f} GiB, disk read {self.disk_bytes / GiB:.3f} GiB | "
                f"peak RSS {self.peak_rss / GiB:.2f} GiB"
                + (f" | kernels built at first use: {self.build_seconds:.1f} s of the times above"
                   if self.build_seconds >= 0.05 else "")
                + {"context full": " | stopped: context full",
                   "interrupted": " | stopped: interrupted"}.get(self.stop_reason, ""))

    def prefetch_summary(self) -> str:
        """``"prefetch recall R%, miss bytes ready M%, N prefetched, W wasted | "``, or "" when no prediction
        was made (prefetch off, or streaming off). R: share of the experts the steps used that the router
        lookahead predicted; M: share of the bytes of the experts that were not in the pool before the prediction
        already read when the step needed them (see StoreStats)."""
        s = self.store
        if s.recall is None:
            return ""
        ready = "-" if s.ready_share is None else f"{100 * s.ready_share:.1f}%"
        return (f"prefetch recall {100 * s.recall:.1f}%, miss bytes ready {ready}, {s.prefetch_issued} prefetched, "
                f"{s.prefetch_wasted} wasted | ")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def disk_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes; page-cache hits excluded)."""
    try:
        return psutil.Process().io_counters().read_bytes
    except (psutil.Error, AttributeError):
        return 0


class Engine:
    """Runs a model: chunked prefill, one-token decode steps, sampling and statistics.

    ubatch: prefill chunk size in tokens (a chunk's experts go through the slot pool together).
    """

    def __init__(self, model: MoEModel, ubatch: int = 128):
        if ubatch < 1:
            raise OptionError("{ubatch} " f"must be at least 1, got {ubatch}", ubatch=ubatch)
        self.model, self.ubatch = model, ubatch

    @torch.inference_mode()
    def prefill(self, tokens: list[int], cache: object, start: int = 0, logits_all: bool = False) -> torch.Tensor:
        """Run ``tokens`` from position ``start`` in chunks of ``ubatch``. Returns logits [T, vocab] when
        ``logits_all`` else [1, vocab] for the last token (float32)."""
        outs = []
        t = torch.tensor(tokens, dtype=torch.int64, device=self.model.device)
        for s in range(0, len(tokens), self.ubatch):
            self.model.gguf.check_unchanged()
            last = s + self.ubatch >= len(tokens)
            logits = self.forward(t[s:s + self.ubatch], start + s, cache, logits_all=logits_all)
            if logits_all or last:
                outs.append(logits)
        return torch.cat(outs, dim=0)

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int, cache: object) -> torch.Tensor:
        """One token at ``pos``; returns logits [vocab] float32."""
        self.model.gguf.check_unchanged()
        t = torch.tensor([token], dtype=torch.int64, device=self.model.device)
        return self.forward(t, pos, cache)[0]

    def forward(self, tokens: torch.Tensor, start: int, cache: object, logits_all: bool = False) -> torch.Tensor:
        """``model.forward`` with two guards, so bad weights or metadata never pass silently:

        - logits that are not all finite raise NumericError naming the file and the first bad position (a NaN
          norm weight, scale or epsilon would otherwise decode as token 0 forever, and compare equal bytewise);
        - an unexpected torch RuntimeError (metadata that disagrees with the tensors in a way the load-time
          checks missed) becomes ForwardError naming the file and the positions, not a traceback.
        """
        n_tok = tokens.shape[0]
        path = self.model.gguf.path
        try:
            logits = self.model.forward(tokens, start, cache, logits_all=logits_all)
        except RuntimeError as e:
            if isinstance(e, (NotImplementedError, RecursionError)):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise ForwardError(f"{path}: the forward pass at positions {start}..{start + n_tok - 1} failed "
                               f"(internal error: {type(e).__name__}: {first})") from e
        self.check_finite(logits, start, n_tok, logits_all)
        return logits

    def check_finite(self, logits: torch.Tensor, start: int, n_tok: int, logits_all: bool = False) -> None:
        """NumericError naming the file and the first position whose logits (float32 [rows, vocab]: every
        position's when ``logits_all``, else the last one's of ``n_tok`` tokens at ``start``) are not all
        finite."""
        if logits.device.type == "cpu":
            if logits.dtype == torch.float32 and logits.is_contiguous() and (lib := kernels.step_ops()) is not None:
                finite = kernels.first_nonfinite(logits, lib=lib) < 0  # one pass in C
            else:  # numpy's single-threaded min/max: torch's parallel reduction over one row costs more than a tiny
                a = logits.detach().numpy()  # model's step when the cores are busy
                finite = math.isfinite(a.min()) and math.isfinite(a.max())  # NaN in either if any logit is NaN
        else:
            lo, hi = torch.aminmax(logits)  # one pass, no [T, vocab] mask
            finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
        if not finite:
            finite = torch.isfinite(logits).all(dim=-1)
            row = int((~finite).nonzero()[0])
            pos = start + row if logits_all else start + n_tok - 1
            raise NumericError(f"{self.model.gguf.path}: non-finite logits at position {pos} (the weights or "
                               f"metadata produce NaN/Inf)")

    def stream(self, tokens: list[int], n_predict: int, sampler: Callable[[torch.Tensor], int], *,
               stop_ids: Iterable[int] = (), cache: object | None = None, start: int = 0, n_ctx: int | None = None,
               interrupted: Callable[[], bool] | None = None,
               on_finish: Callable[[Generation], None] | None = None) -> Generation:
        """A :class:`Generation`: iterate it for the generated token ids (see there).

        ``tokens`` are prefilled into ``cache`` at positions ``start``.. (``cache`` None: a new cache of ``n_ctx``
        positions, default ``len(tokens) + n_predict``; ConfigError when it does not fit in memory).
        ``n_predict`` < 0: until an end-of-generation token or the cache is full. ConfigError, before anything
        runs, when ``tokens`` is empty or does not fit in the cache.
        """
        if not tokens:
            raise ConfigError("the prompt is empty: give a non-empty -p")
        if cache is None:
            if n_ctx is None and n_predict < 0:
                raise ConfigError("n_predict -1 (until end of generation) needs a context size")
            n_ctx = n_ctx or start + len(tokens) + n_predict
            if start + len(tokens) >= n_ctx and n_predict != 0 or start + len(tokens) > n_ctx:
                raise ConfigError(f"the prompt has {len(tokens)} tokens; the context size -c {n_ctx} leaves no "
                                  f"room to generate")
            check_cache_fits(self.model, n_ctx)
            cache = self.model.new_cache(n_ctx)
        elif start + len(tokens) > cache.n_ctx:  # type: ignore[attr-defined]
            raise ConfigError(f"{len(tokens)} more tokens at position {start} do not fit in the context of "
                              f"{cache.n_ctx} tokens")  # type: ignore[attr-defined]
        return Generation(self, list(tokens), n_predict, sampler, set(stop_ids), cache, start, interrupted, on_finish)

    def generate(self, prompt: list[int], n_predict: int, sampler: Callable[[torch.Tensor], int],
                 stop_ids: Iterable[int] = (), n_ctx: int | None = None,
                 on_token: Callable[[int], None] | None = None) -> GenStats:
        """Prefill ``prompt`` then sample up to ``n_predict`` tokens, stopping at any of ``stop_ids``
        (not emitted). ``on_token`` is called with each new token as it is produced. (:meth:`stream`, consumed.)"""
        gen = self.stream(prompt, n_predict, sampler, stop_ids=stop_ids, n_ctx=n_ctx)
        for tok in gen:
            if on_token:
                on_token(tok)
        return gen.stats


class Generation:
    """One generation as an iterator of token ids (mlx-lm's ``stream_generate``, at the token level); made by
    :meth:`Engine.stream`.

    Iterating prefills the tokens (in chunks of the engine's ``ubatch``), then yields sampled tokens one by one:
    the first from the prefill's logits, each next one after a decode step of the previous. It stops

    - at a token of ``stop_ids`` (not yielded: it is :attr:`eog`), ``stats.stop_reason`` ``"eos"``;
    - after ``n_predict`` tokens (``"n_predict"``; ``n_predict`` < 0: no limit);
    - when the cache is full (``"context full"``: the last token yielded fills position ``cache.n_ctx``);
    - when ``interrupted()`` returns true (``"interrupted"``). It is asked between forward passes only, never
      inside one, so the cache stays consistent (a recurrent state is never half-updated) and can take the
      next turn.

    After the iteration (also when the consumer stops early or an error is raised) :attr:`stats` is complete,
    :attr:`pos` is the number of positions the cache holds, and :attr:`unfed` lists the tokens that belong to the
    sequence but are not in the cache yet (the rest of the prompt after an interrupted prefill, or the last
    yielded token): a later :meth:`Engine.stream` on the same cache must start with them at ``pos``.
    ``on_finish(self)`` is called then.
    """

    def __init__(self, engine: Engine, tokens: list[int], n_predict: int, sampler: Callable[[torch.Tensor], int],
                 stop_ids: set[int], cache: object, start: int, interrupted: Callable[[], bool] | None,
                 on_finish: Callable[[Generation], None] | None):
        self.engine, self.tokens, self.n_predict, self.sampler = engine, tokens, n_predict, sampler
        self.stop_ids, self.cache, self.start = stop_ids, cache, start
        self.interrupted = interrupted or (lambda: False)
        self.on_finish = on_finish
        #: called with this Generation when the prefill has run (before the first token is sampled), e.g. by a
        #: per-token trace (moestream/runtrace.py) to close the prompt's record; None: nothing is called
        self.on_prefill: Callable[[Generation], None] | None = None
        self.stats = GenStats(n_prompt=0)
        self.eog: int | None = None
        self.pos = start
        self.unfed: list[int] = list(tokens)
        self._started = False

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise RuntimeError("a Generation can be iterated once")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[int]:
        engine, model, st = self.engine, self.engine.model, self.stats
        store = model.store
        n_ctx = self.cache.n_ctx  # type: ignore[attr-defined]
        s0, b0, d0, k0 = store.stats.copy(), store.bytes_read, disk_read_bytes(), _built()
        t0 = time.perf_counter()
        t1 = None
        try:
            dev = model.device
            toks = torch.tensor(self.tokens, dtype=torch.int64, device=dev)
            logits = None
            for s in range(0, len(self.tokens), engine.ubatch):
                if s and self.interrupted():
                    st.stop_reason = "interrupted"
                    return
                model.gguf.check_unchanged()
                chunk = toks[s:s + engine.ubatch]
                logits = engine.forward(chunk, self.pos, self.cache)
                self.pos += chunk.shape[0]
                st.n_prompt += chunk.shape[0]
                self.unfed = self.tokens[s + chunk.shape[0]:]
            st.prompt_seconds = time.perf_counter() - t0
            accept = getattr(self.sampler, "accept", None)  # the penalties' window (Sampler.accept)
            if accept is not None:
                accept(self.tokens)
            if self.on_prefill is not None:
                self.on_prefill(self)
            t1 = time.perf_counter()
            room = n_ctx - self.pos  # tokens that can still be generated: the last one fills position n_ctx
            limit = room if self.n_predict < 0 else min(self.n_predict, room)
            st.stop_reason = "context full" if self.n_predict < 0 or self.n_predict > room else "n_predict"
            logits = logits[-1]
            for i in range(limit):
                if self.interrupted():
                    st.stop_reason = "interrupted"
                    return
                tok = self.sampler(logits)
                if tok in self.stop_ids:
                    self.eog = tok
                    st.stop_reason = "eos"
                    return
                st.tokens.append(tok)
                self.unfed = [tok]
                if accept is not None:
                    accept((tok,))
                yield tok
                if i == limit - 1:
                    return
                if self.interrupted():  # the consumer may have been interrupted while handling the token
                    st.stop_reason = "interrupted"
                    return
                logits = engine.decode_step(tok, self.pos, self.cache)
                self.unfed = []
                self.pos += 1
                st.n_decode += 1
        finally:
            now = time.perf_counter()
            if t1 is None:
                st.prompt_seconds = now - t0
            else:
                st.decode_seconds = now - t1
            st.store = store.stats - s0
            st.hits, st.misses = st.store.hits, st.store.misses
            st.streamed_bytes = store.bytes_read - b0
            st.disk_bytes = disk_read_bytes() - d0
            st.peak_rss = peak_rss_bytes()
            st.build_seconds = _built() - k0
            if self.on_finish:
                self.on_finish(self)
