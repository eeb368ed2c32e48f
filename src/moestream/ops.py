"""Low-level tensor helpers shared by the expert kernels (experts/) and the model layers (models/): nothing here
imports another moestream module."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

#: Values per slice of :func:`elementwise`. torch's CPU kernels for silu, sigmoid and gelu split a tensor of more
#: than 16384 (gelu) or 32767 (the others) values into one range per thread, and each range's last values that
#: do not fill a vector are computed by a scalar loop that rounds differently: the bits would depend on the
#: thread count. A slice of at most this many values is computed by one thread.
ELEMENTWISE_SLICE = 16384


_SEQ_ROWS = threading.local()


@contextlib.contextmanager
def sequence_rows(counts: list[int]) -> Iterator[None]:
    """Within it (on this thread), a CPU op that :func:`per_sequence` wraps runs once per sequence of the step on
    that sequence's rows (``counts``: each sequence's row count, in order; the head of a step: one row each) when
    its input has ``sum(counts)`` rows, and the results are concatenated.

    Why: torch's float32 matmul changes the last bits of a row with the number of rows it is called with, and its
    vectorized elementwise functions (sigmoid, silu, tanh, ...) compute the values past the last whole vector of a
    tensor with a scalar loop that rounds differently; so rows computed together with another sequence's would not
    have the bits they have when their sequence runs alone. Split by sequence, each call has the very shape it has
    alone (runtime/runner.py sets this for a step of several sequences; the C kernels compute every row on their
    own and need no split)."""
    prev = getattr(_SEQ_ROWS, "counts", None)
    _SEQ_ROWS.counts = list(counts) if len(counts) > 1 else None
    try:
        yield
    finally:
        _SEQ_ROWS.counts = prev


def decode_batch() -> bool:
    """Whether this thread is inside :func:`sequence_rows` of a step whose every sequence has one row: a batch of
    decode tokens of several sequences (``serve -np N``), not a prompt chunk."""
    counts = getattr(_SEQ_ROWS, "counts", None)
    return counts is not None and all(c == 1 for c in counts)


def per_sequence(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, or, inside :func:`sequence_rows`, on the CPU, for an input of its total row count, ``fn`` of each
    sequence's rows, concatenated (dim 0)."""
    counts = getattr(_SEQ_ROWS, "counts", None)
    if counts is None or x.device.type != "cpu" or x.dim() < 1 or x.shape[0] != sum(counts):
        return fn(x)
    return torch.cat([fn(part) for part in x.split(counts)])


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise float32 function (silu, sigmoid, gelu), computed on the CPU in slices of
    :data:`ELEMENTWISE_SLICE` values: the same bits whatever the thread count (those of ``fn(x)`` on one thread,
    for a contiguous x: the slices are whole vectors), and, within :func:`sequence_rows`, per sequence (the same
    bits whatever else shares the step). Same shape as x."""
    return per_sequence(lambda v: _sliced(fn, v), x)


def _sliced(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    if n <= ELEMENTWISE_SLICE or x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for s in range(0, n, ELEMENTWISE_SLICE):
        out[s:s + ELEMENTWISE_SLICE] = fn(flat[s:s + ELEMENTWISE_SLICE])
    return out.view(x.shape)
