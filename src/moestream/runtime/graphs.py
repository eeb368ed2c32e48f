"""CUDA graphs of one-token decode steps: a whole step replayed with one launch instead of ~1,200.

A decode step dispatched op by op from Python costs far more host time than GPU time (one token of the
Qwen3-30B-A3B-shaped model: ~50 ms of host work for ~9 ms of kernels on an H200). When every expert is resident
where the GPU addresses it (``--moe-stream off`` on CUDA) the step needs nothing from the host: the router's
top-k picks the pool rows on the device (``MoE.resident_step``), the position lives in a device tensor, and
attention reads the keys up to that position on the device (gpu/tstep.py; without it, ``layers.attention_at``
over a fixed number of cache rows with the later ones masked), so the step can be captured once
(``torch.cuda.CUDAGraph``) and replayed at every position up to that row count (``layers.decode_keys``: powers
of two, so a generation captures a handful of graphs).

The graphed step runs the same kernels in the same order as the eager one, so the logits have the same bits as
an eager step of the same code. A streaming step cannot be one graph (each MoE layer's router top-k must reach
the host to plan the slots and start the reads), so it is cut at the MoE layers (``segment``): the attention and
router of each layer (with the dense layers before it) is one graph replay, and the layer's experts run eagerly
through the store between two replays. The segments are the same code as the whole-step graph, so streaming on
and off stay bitwise identical on the GPU.

On by default (``MOESTREAM_CUDA_GRAPHS=0`` at load turns it off), for every family (runtime/runner.py).
Checked on an H200
(tests/test_cuda.py: graphed steps bitwise equal to the same steps run eagerly, streaming segments equal to the
resident graph) and on the CPU (tests/test_gpu_path.py: the captured step's code gives the streaming step's bits
under Triton's interpreter). A capture that fails (an op that cannot be captured) turns graphs off for the model
and keeps the reason in ``DecodeGraphs.off_reason``; the step then runs eagerly.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

#: body(tokens int64 [1], pos int64 [1], n_keys, cache) -> logits float32 [1, vocab]
Body = Callable[["torch.Tensor", "torch.Tensor", int, object], "torch.Tensor"]


def enabled() -> bool:
    """False when ``MOESTREAM_CUDA_GRAPHS`` is ``0``, ``off``, ``false`` or ``no`` (default: on)."""
    return os.environ.get("MOESTREAM_CUDA_GRAPHS", "1").strip().lower() not in ("0", "off", "false", "no")


def _tensors_of(v: object) -> list[torch.Tensor]:
    """The tensors of an attribute: a tensor, or a list, tuple or dict of them (None and others skipped)."""
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
    return [t for t in items if isinstance(t, torch.Tensor)]


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """Every tensor a cache object holds (its attributes: tensors, and lists or dicts of them), in a fixed order."""
    return [t for _, v in sorted(vars(cache).items()) for t in _tensors_of(v)]


def _addresses(cache: object) -> tuple[int, ...]:
    """Where a cache's tensors are: a graph captured on one cache serves any cache at the same addresses (a
    cache made again in the same memory, ``layers.KVArena``), since it reads only the rows below its key count."""
    return tuple(t.data_ptr() for t in cache_tensors(cache))


class DecodeGraphs:
    """The captured decode steps of one model, one per key count, for one KV cache at a time.

    ``step(body, tokens, start, n_keys, cache, store, key, on_replay)``: the logits of ``body`` at ``start``, from
    the graph of ``n_keys`` (captured on first use: a warm-up run on a side stream, then the capture). ``store``:
    the expert store whose pools the graphs address; ``key``: the other addresses they hold (the RoPE table, ...);
    a cache at other addresses, another store or key drops every graph (the store held by a weak reference).
    ``on_replay()`` is called once per step (the host-side counters a replay does not run).
    Returns a new tensor (the graph's output buffer is overwritten by the next replay)."""

    def __init__(self) -> None:
        #: not MOESTREAM_CUDA_GRAPHS=0 at load: the model decodes through ``step``/``segment``
        self.opted_in = enabled()
        self.off_reason: str | None = None if self.opted_in else "MOESTREAM_CUDA_GRAPHS=0"
        self._graphs: dict[int, tuple] = {}
        #: the streaming step's segments (``segment``): (n_keys, segment) -> (graph, static inputs, outputs, keep)
        self._segments: dict[tuple, tuple] = {}
        self._cache: tuple | None = None  # the KV cache's tensor addresses the graphs were captured on
        self._store: weakref.ref | None = None
        self._key: tuple | None = None
        self.captures = 0
        self.replays = 0
        #: replays of streaming segments (``segment``), also counted in ``replays``
        self.segment_replays = 0

    def clear(self) -> None:
        self._graphs.clear()
        self._segments.clear()
        self._cache, self._store, self._key = None, None, None

    def step(self, body: Body, tokens: torch.Tensor, start: int, n_keys: int, cache: object, store: object,
             key: tuple, on_replay: Callable[[], None]) -> torch.Tensor | None:
        """The graphed step's logits, or None when graphs are off (the caller runs the step eagerly)."""
        if self.off_reason is not None:
            return None
        at = _addresses(cache)
        if self._cache != at or self._store is None or self._store() is not store or self._key != key:
            self.clear()
            self._cache, self._store, self._key = at, weakref.ref(store), key
        g = self._graphs.get(n_keys)
        if g is None:
            try:
                g = self._capture(body, tokens, start, n_keys, cache)
            except (RuntimeError, NotImplementedError) as e:  # an op that cannot be captured: eager from now on
                self._off(e)
                return None
            self._graphs[n_keys] = g
        graph, tok_in, pos_in, out, _ = g
        tok_in.copy_(tokens)
        pos_in.fill_(start)
        graph.replay()
        self.replays += 1
        on_replay()
        return out.clone()

    def segment(self, key: tuple, fn: Callable[..., tuple], inputs: tuple, cache: object, store: object,
                addresses: tuple) -> tuple | None:
        """``fn(*inputs)`` (a tuple of tensors, nothing from the host) replayed from a graph captured for ``key`` on
        first use; None when graphs are off. ``inputs``: tensors (or None) copied into the graph's own input
        buffers before each replay; ``cache``, ``store`` and ``addresses`` as in :meth:`step` (another cache,
        store or other addresses drop every graph, the whole-step ones too: the lean segments read the store's
        pools and the MoE layers' device tables, which another store replaces). The returned tensors are the
        graph's output buffers: overwritten by its next replay (the caller uses them before that, or copies them)."""
        if self.off_reason is not None:
            return None
        at = _addresses(cache)
        if self._cache != at or self._store is None or self._store() is not store or self._key != addresses:
            self.clear()
            self._cache, self._store, self._key = at, weakref.ref(store), addresses
        g = self._segments.get(key)
        if g is None:
            dev = cache_tensors(cache)[0].device
            static = tuple(None if t is None else t.to(dev, copy=True) for t in inputs)
            try:
                g = self._segments[key] = (*self._capture_fn(fn, static, cache), static)
            except (RuntimeError, NotImplementedError) as e:
                self._off(e)
                return None
        else:
            for s, t in zip(g[3], inputs, strict=True):
                if s is not None:
                    s.copy_(t)
        graph, out, _, _ = g
        graph.replay()
        self.replays += 1
        self.segment_replays += 1
        return out

    def _off(self, e: BaseException) -> None:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        self.off_reason = f"capture failed: {type(e).__name__}: {first}"
        self.clear()
        torch.cuda.synchronize()

    def _capture_fn(self, fn: Callable[..., object], static: tuple, cache: object) -> tuple:
        """(graph, outputs, keep) of ``fn(*static)``: one warm-up run on a side stream (compiles kernels, fills
        lazily made constants; not captured), then the capture. The warm-up really runs the step: the cache's
        recurrent state (every tensor of it but the ``k``/``v`` rows, which the replay writes again with the same
        values) is put back as it was, or the step the replay runs next would advance it a second time."""
        dev = next(t.device for t in static if t is not None)
        rows = {id(t) for name in ("k", "v") for t in _tensors_of(getattr(cache, name, None))}
        state = [(t, t.clone()) for t in cache_tensors(cache) if id(t) not in rows]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn(*static)
            for t, saved in state:
                t.copy_(saved)
        torch.cuda.current_stream(dev).wait_stream(side)
        from ..gpu import tkernels

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        self.captures += 1
        # the lazily made constants the graph reads (tkernels.linear's tiles, ...) live as long as it does, even if
        # their cache is cleared
        return graph, out, list(tkernels._LINEAR_CONST.values())

    def _capture(self, body: Body, tokens: torch.Tensor, start: int, n_keys: int, cache: object) -> tuple:
        dev = tokens.device
        tok_in = torch.empty(1, dtype=torch.int64, device=dev)
        pos_in = torch.empty(1, dtype=torch.int64, device=dev)
        tok_in.copy_(tokens)
        pos_in.fill_(start)
        graph, out, keep = self._capture_fn(lambda t, p: body(t, p, n_keys, cache), (tok_in, pos_in), cache)
        return graph, tok_in, pos_in, out, keep
