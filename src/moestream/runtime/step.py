"""One forward step over a batch of sequences: what a family's layer code asks of positions and KV caches.

A family's layers (models/*.py) never index a cache or a position themselves: they call the :class:`Step` they
are handed (``step.rope``, ``step.rope_into``, ``step.store``, ``step.attend``, ``step.cached_attention``,
``step.per_seq``). A step is either

- **eager**: host positions, one or more sequences (each its own KV cache and first position; their tokens are
  the rows of one tensor, sequence after sequence), attention over exactly the keys each token sees; a batch of
  one runs the very ops the model files ran before the runner existed, so the logits keep their bits; or
- **on the device** (``pos`` given): one sequence, one token, its position held in a device tensor and attention
  over a fixed number of cache rows with the later ones masked (layers.attention_at), so the step has no
  host-dependent value and a CUDA graph can capture it (runtime/graphs.py). Its results equal an eager step's
  within float rounding (other reduction length), and are the same bits whether captured or not. On CUDA the
  norms, RoPE, cache writes and attention of such a step are Triton kernels (gpu/tstep.py: two launches per
  attention layer, where :func:`~moestream.gpu.tstep.applies`), else the torch ops of layers.rope_at and
  layers.attention_at.

The projections, norms, routers and experts of a step run once over all its rows; only what is per sequence
(RoPE angles, cache rows, attention, recurrent state) is split by sequence here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import kernels
from ..models import layers
from ..models.layers import Rope, attention, attention_at, rms_norm, rope_at


@dataclass
class Seq:
    """One sequence of a step: its KV cache (a family's cache object), its first position and token count."""

    cache: Any
    start: int
    n_tok: int

    @property
    def end(self) -> int:
        return self.start + self.n_tok


def _tensor(cache: Any, kind: str, layer: int) -> torch.Tensor:
    """``cache.<kind>[layer]``: one layer's cache tensor [n_ctx, ...] (a list or a dict keyed by layer)."""
    return getattr(cache, kind)[layer]


def _block_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    """The step kernels' library when kernels.attn_block computes this attention block as the separate ops would
    (the norms and attention in C: layers.C_RMS_NORM, C_ATTENTION; float32 with unit stride along the head dims),
    else None."""
    lib = kernels.step_ops() if layers.C_ATTENTION and layers.C_RMS_NORM else None
    if lib is None or q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        return None
    return lib if q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 else None


def _tstep(x: torch.Tensor) -> Any:
    """The gpu.tstep module when a device step computes on ``x`` with its Triton kernels (tstep.applies: CUDA, or
    its tests' interpreter), else None (the torch ops). Only device steps call it (CUDA, or tests), so the CPU
    engine never imports triton."""
    from ..gpu import tstep

    return tstep if tstep.applies(x) else None


@dataclass
class Step:
    """A forward step: tokens int64 [T] (the rows of every sequence, in ``seqs`` order) and the sequences.

    Device steps (``pos`` not None): one sequence of one token; ``pos`` int64 [1] on the device, ``n_keys`` the
    cache rows attended over (layers.decode_keys) and ``kpos`` int64 [n_keys] (0..n_keys-1).
    ``data``: tensors a family computes once per step and its layers read (Gemma 4's per-layer inputs).
    """

    tokens: torch.Tensor
    seqs: list[Seq]
    pos: torch.Tensor | None = None
    n_keys: int = 0
    kpos: torch.Tensor | None = None
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_tok(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def single(self) -> bool:
        return len(self.seqs) == 1

    def _rows(self, x: torch.Tensor) -> list[tuple[Seq, torch.Tensor]]:
        """(sequence, its rows of x) for each sequence (x itself for a batch of one)."""
        if self.single:
            return [(self.seqs[0], x)]
        out, r = [], 0
        for s in self.seqs:
            out.append((s, x[r:r + s.n_tok]))
            r += s.n_tok
        return out

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rope(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        """x float32 [T, heads, d] rotated at each row's position (layers.Rope), same shape."""
        if self.pos is not None:
            if (ts := _tstep(x)) is not None:
                return ts.norm_rope_store(rope, self.pos, q=x)
            return rope_at(rope, x, self.pos)
        return self._cat([rope(xs, s.start) for s, xs in self._rows(x)])

    def rope_into(self, rope: Rope, x: torch.Tensor, kind: str, layer: int) -> None:
        """Rotate x float32 [T, heads, d] and write it into ``cache.<kind>[layer]`` at each row's position
        (eager: straight into the cache rows, ``Rope(out=)``)."""
        if self.pos is not None:
            cache = _tensor(self.seqs[0].cache, kind, layer)
            if (ts := _tstep(x)) is not None:
                ts.norm_rope_store(rope, self.pos, k=x, k_cache=cache)
                return
            cache.index_copy_(0, self.pos, rope_at(rope, x, self.pos))
            return
        for s, xs in self._rows(x):
            rope(xs, s.start, out=_tensor(s.cache, kind, layer)[s.start:s.end])

    def store(self, kind: str, layer: int, rows: torch.Tensor) -> None:
        """Write rows float32 [T, ...] into ``cache.<kind>[layer]`` at each row's position."""
        if self.pos is not None:
            _tensor(self.seqs[0].cache, kind, layer).index_copy_(0, self.pos, rows)
            return
        for s, rs in self._rows(rows):
            _tensor(s.cache, kind, layer)[s.start:s.end] = rs

    def attend(self, q: torch.Tensor, layer: int, scale: float, window: int | None = None,
               sinks: torch.Tensor | None = None, v_dim: int | None = None) -> torch.Tensor:
        """Causal attention of q float32 [T, n_head, d] (rotated) over layer ``layer``'s cached keys and values
        up to each token (layers.attention: GQA, sliding ``window``, ``sinks``). ``v_dim``: the values are the
        first ``v_dim`` dims of the keys (MLA's absorbed form: K = V, no ``v`` cache). Returns float32
        [T, n_head * d_v]."""
        def kv(cache: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = _tensor(cache, "k", layer)[:n]
            return k, (k[..., :v_dim] if v_dim is not None else _tensor(cache, "v", layer)[:n])

        if self.pos is not None:
            k, v = kv(self.seqs[0].cache, self.n_keys)
            if (ts := _tstep(q)) is not None:
                return ts.decode_attention(q, k, None if v_dim is not None else v, self.pos, self.n_keys, scale,
                                           window, sinks, v_dim)
            return attention_at(q, k, v, self.pos, self.kpos, scale, window, sinks)
        out = []
        for s, qs in self._rows(q):
            k, v = kv(s.cache, s.end)
            out.append(attention(qs, k, v, s.start, scale, window, sinks))
        return self._cat(out)

    def cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, layer: int,
                         scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                         eps: float = 0.0) -> torch.Tensor:
        """The usual attention block: q [T, n_head, d], k [T, n_kv, d], v [T, n_kv, d_v] of the new tokens
        (projected, not yet rotated) -> RMSNorm of each head of q by ``q_norm`` and of k by ``k_norm`` (float32 [d],
        or None: q, k come normed or have no norm; epsilon ``eps``), rotate q, rotate k into the cache, write v,
        :meth:`attend`. q is scratch (it may be overwritten).

        One sequence on the CPU with the step kernels: all of it in one C call (kernels.attn_block, the same bits
        as the separate ops). A device step on CUDA: two Triton launches (gpu/tstep.py: norms, RoPE and the
        cache rows in one, attention in the other; a third where the keys are split)."""
        if self.pos is None and self.single and q.device.type == "cpu" and (lib := _block_ops(q, k, v)) is not None:
            s = self.seqs[0]
            rope.reserve(s.end)
            cache = s.cache
            return kernels.attn_block(q, k, v, _tensor(cache, "k", layer), _tensor(cache, "v", layer), s.start, scale,
                                      q_norm, k_norm, eps, rope.cos, rope.sin, rope.interleaved, window, sinks,
                                      lib=lib)
        if self.pos is not None and (ts := _tstep(q)) is not None:
            cache = self.seqs[0].cache
            kc, vc = _tensor(cache, "k", layer), _tensor(cache, "v", layer)
            q = ts.norm_rope_store(rope, self.pos, q, k, v, kc, vc, q_norm, k_norm, eps)
            return ts.decode_attention(q, kc[:self.n_keys], vc[:self.n_keys], self.pos, self.n_keys, scale, window,
                                       sinks)
        if q_norm is not None:
            q = rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = rms_norm(k, k_norm, eps)
        q = self.rope(rope, q)
        self.rope_into(rope, k, "k", layer)
        self.store("v", layer, v)
        return self.attend(q, layer, scale, window, sinks)

    def per_seq(self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """``fn(cache, *rows)`` for each sequence's rows of ``xs`` (recurrent layers: their state is per
        sequence), the results concatenated in row order."""
        if self.single:
            return fn(self.seqs[0].cache, *xs)
        out, r = [], 0
        for s in self.seqs:
            out.append(fn(s.cache, *(x[r:r + s.n_tok] for x in xs)))
            r += s.n_tok
        return torch.cat(out)

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each sequence's last row of x [T, ...] -> [len(seqs), ...]."""
        if self.single:
            return x[-1:]
        ends = torch.tensor([0] + [s.n_tok for s in self.seqs]).cumsum(0)[1:] - 1
        return x[ends.to(x.device)]
