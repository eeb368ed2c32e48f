"""Prefill, decode, sampling and generation statistics."""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
import torch

from .errors import ConfigError, ForwardError, NumericError
from .models.base import MoEModel

GiB = 2**30
#: Largest token count (-n, -c, --steps, bench -p/-n) accepted; far beyond any context a cache could hold.
MAX_TOKENS = 2**31


def check_cache_fits(model: MoEModel, n_ctx: int, option: str = "-c", hint: str = "-n or -c") -> None:
    """ConfigError (naming ``option``) unless ``model.new_cache(n_ctx)`` fits in the memory available now.

    Computed from the cache's shapes without allocating, so an absurd -n or -c is refused before anything is
    printed instead of failing in torch's allocator.
    """
    if n_ctx > MAX_TOKENS:
        raise ConfigError(f"{option}: a context of {n_ctx} tokens is more than moestream supports (2^31)")
    need = model.cache_bytes(n_ctx)
    avail = psutil.virtual_memory().available
    if need > avail:
        raise ConfigError(f"{option}: a context of {n_ctx} tokens needs {need / GiB:.1f} GiB of KV cache for "
                          f"{os.path.basename(model.gguf.path)}, but {avail / GiB:.1f} GiB of memory is available; "
                          f"use a smaller {hint}")


@dataclass
class SamplingParams:
    """llama.cpp-style sampling. temp <= 0 is greedy. top_k <= 0, top_p >= 1, min_p <= 0 disable a filter;
    the most likely token always survives the filters. seed None or -1: a random seed.

    Order (as llama.cpp's default chain): top-k, top-p, min-p, then temperature, then a draw.
    Raises ConfigError for a non-finite temperature, top-p/min-p outside [0, 1], or a seed outside [-1, 2^63).
    """

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temp):
            raise ConfigError(f"--temp must be a finite number, got {self.temp}")
        if self.seed is not None and not -1 <= self.seed < 2**63:
            raise ConfigError(f"--seed must be -1 (random) or in [0, 2^63), got {self.seed}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"--min-p must be in [0, 1], got {self.min_p}")


class Sampler:
    """Picks the next token from float32 logits [n_vocab]."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        seed = params.seed if params.seed is not None and params.seed >= 0 else time.time_ns() % 2**63
        self.gen.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.p
        logits = logits.float().cpu()
        if p.temp <= 0:
            return int(torch.argmax(logits))
        vals, idx = torch.sort(logits, descending=True)
        if p.top_k > 0:
            vals, idx = vals[: p.top_k], idx[: p.top_k]
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


@dataclass
class GenStats:
    """Timings in seconds, bytes in bytes."""

    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_decode: int = 0
    decode_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    streamed_bytes: int = 0
    disk_bytes: int = 0
    peak_rss: int = 0
    stop_reason: str = ""
    tokens: list[int] = field(default_factory=list)

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
                f"streamed {self.streamed_bytes / GiB:.3f} GiB, disk read {self.disk_bytes / GiB:.3f} GiB | "
                f"peak RSS {self.peak_rss / GiB:.2f} GiB"
                + (" | stopped: context full (-c)" if self.stop_reason == "context full" else ""))


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
            raise ConfigError(f"--ubatch must be at least 1, got {ubatch}")
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
        finite = torch.isfinite(logits).all(dim=-1)
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0])
            pos = start + row if logits_all else start + n_tok - 1
            raise NumericError(f"{path}: non-finite logits at position {pos} (the weights or metadata produce "
                               f"NaN/Inf)")
        return logits

    def generate(self, prompt: list[int], n_predict: int, sampler: Callable[[torch.Tensor], int],
                 stop_ids: Iterable[int] = (), n_ctx: int | None = None,
                 on_token: Callable[[int], None] | None = None) -> GenStats:
        """Prefill ``prompt`` then sample up to ``n_predict`` tokens, stopping at any of ``stop_ids``
        (not emitted). ``on_token`` is called with each new token as it is produced."""
        if not prompt:
            raise ConfigError("the prompt is empty: give a non-empty -p")
        n_ctx = n_ctx or len(prompt) + n_predict
        if len(prompt) >= n_ctx and n_predict > 0 or len(prompt) > n_ctx:
            raise ConfigError(f"the prompt has {len(prompt)} tokens; the context size -c {n_ctx} leaves no room "
                              f"to generate")
        check_cache_fits(self.model, n_ctx)
        ctx_limited = len(prompt) + n_predict > n_ctx
        n_predict = min(n_predict, n_ctx - len(prompt))
        stop = set(stop_ids)
        store = self.model.store
        st = GenStats(n_prompt=len(prompt))
        h0, m0, b0, d0 = store.stats.hits, store.stats.misses, store.bytes_read, disk_read_bytes()
        cache = self.model.new_cache(n_ctx)
        t0 = time.perf_counter()
        logits = self.prefill(prompt, cache)[-1]
        st.prompt_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        pos = len(prompt)
        st.stop_reason = "context full" if ctx_limited else "n_predict"
        for i in range(n_predict):
            tok = sampler(logits)
            if tok in stop:
                st.stop_reason = "eos"
                break
            st.tokens.append(tok)
            if on_token:
                on_token(tok)
            if i == n_predict - 1:
                break
            logits = self.decode_step(tok, pos, cache)
            st.n_decode += 1
            pos += 1
        st.decode_seconds = time.perf_counter() - t1
        st.hits, st.misses = store.stats.hits - h0, store.stats.misses - m0
        st.streamed_bytes = store.bytes_read - b0
        st.disk_bytes = disk_read_bytes() - d0
        st.peak_rss = peak_rss_bytes()
        return st
