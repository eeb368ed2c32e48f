"""Identity check: greedy decoding with streaming off, then on, comparing every logit bytewise."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .engine import Engine
from .experts.pool import ResidentStore, StoreStats
from .models.base import LoadOptions, MoEModel


@dataclass
class VerifyResult:
    """identical: every compared logit equal in raw bytes. steps: forward passes compared (prefill chunks'
    positions count one step each). n_logits: float32 values compared. first_diff: (step, position) of the
    first difference or None. streamed_bytes: bytes read into slots in the streaming run (the alignment padding of
    direct reads included). stats: the streaming store's counters (hits, prefetch recall, ...; see StoreStats)."""

    identical: bool
    steps: int
    n_logits: int
    first_diff: tuple[int, int] | None
    streamed_bytes: int
    hit_rate: float
    tokens: list[int]
    slots: str = ""  # slots per layer of the streaming run, e.g. "16" or "15-16"
    stats: StoreStats | None = None
    #: the streaming run's reads were O_DIRECT (to the end; False if they fell back to buffered)
    direct_io: bool = False
    #: the streaming run's host tier (--host-cache), None without one
    tier: object = None


def _run(engine: Engine, prompt: list[int], steps: int,
         reference: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], tuple[int, int] | None, list[int]]:
    """Greedy-decode; returns per-step logits (step 0 = every prompt position) and the first difference
    from ``reference`` as (step, position)."""
    model = engine.model
    cache = model.new_cache(len(prompt) + steps)
    out: list[torch.Tensor] = []
    tokens: list[int] = []

    def check(step: int, logits: torch.Tensor) -> tuple[int, int] | None:
        logits = logits.contiguous().cpu()
        out.append(logits)
        if reference is None:
            return None
        ref = reference[step]
        a, b = logits.view(torch.int32), ref.view(torch.int32)  # raw bytes: memcmp semantics
        if a.shape != b.shape:
            return (step, 0)
        rows = (a != b).any(dim=-1).nonzero()
        if len(rows):
            row = int(rows[0])
            return (step, row if step == 0 else len(prompt) + step - 1)
        return None

    diff = check(0, engine.prefill(prompt, cache, logits_all=True))
    if diff:
        return out, diff, tokens
    tok = int(torch.argmax(out[0][-1]))
    for step in range(1, steps + 1):
        tokens.append(tok)
        logits = engine.decode_step(tok, len(prompt) + step - 1, cache)
        diff = check(step, logits[None])
        if diff:
            return out, diff, tokens
        tok = int(torch.argmax(logits))
    return out, None, tokens


def verify(model: MoEModel, prompt: list[int], steps: int, opts: LoadOptions, ubatch: int = 128) -> VerifyResult:
    """Run ``prompt`` + ``steps`` greedy tokens resident, then streaming with ``opts`` (slots, io_threads,
    policy, overlap, prefetch: ``opts.overlap`` and ``opts.prefetch`` apply to the streaming run whatever
    ``model`` was loaded with),
    comparing logits bytewise at every step and prompt position."""
    engine = Engine(model, ubatch)
    resident = ResidentStore(model.gguf, model.layout, device=model.device, pool=opts.pool)
    model.set_store(resident)
    ref, _, ref_tokens = _run(engine, prompt, steps, None)
    stream_opts = replace(opts, moe_stream=True)
    n = len(prompt) + steps  # the budget (no --slots) holds the KV cache and every kept logit row of this run
    store = model.make_store(stream_opts, n_ctx=n, logits_rows=n, ubatch=ubatch)
    model.set_store(store)
    saved = model.opts
    model.opts = replace(saved, overlap=opts.overlap, prefetch=opts.prefetch)  # as asked for here
    try:
        got, diff, tokens = _run(engine, prompt, steps, ref)
    finally:
        model.opts = saved
        store.close()
        model.set_store(resident)  # never leave the model with a closed store
    n_logits = sum(t.numel() for t in got[: len(got) - (1 if diff else 0)])
    return VerifyResult(identical=diff is None, steps=len(got) if diff is None else diff[0],
                        n_logits=n_logits, first_diff=diff, streamed_bytes=store.bytes_read,
                        hit_rate=store.stats.hit_rate, tokens=tokens if diff else ref_tokens,
                        slots=_slots_text(store), stats=store.stats.copy(),
                        direct_io=getattr(store, "direct_io", False), tier=getattr(store, "tier", None))


def _slots_text(store) -> str:  # noqa: ANN001 - StreamingStore
    per = list(store.slots_per_layer().values())
    return f"{min(per)}" if min(per) == max(per) else f"{min(per)}-{max(per)}"
