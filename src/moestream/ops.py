"""Low-level tensor helpers shared by the expert kernels (experts/) and the model layers (models/): nothing here
imports another moestream module."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Values per slice of :func:`elementwise`. torch's CPU kernels for silu, sigmoid and gelu split a tensor of more
#: than 16384 (gelu) or 32767 (the others) values into one range per thread, and each range's last values that
#: do not fill a vector are computed by a scalar loop that rounds differently: the bits would depend on the
#: thread count. A slice of at most this many values is computed by one thread.
ELEMENTWISE_SLICE = 16384


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise float32 function (silu, sigmoid, gelu), computed on the CPU in slices of
    :data:`ELEMENTWISE_SLICE` values: the same bits whatever the thread count (those of ``fn(x)`` on one thread,
    for a contiguous x: the slices are whole vectors). Same shape as x."""
    n = x.numel()
    if n <= ELEMENTWISE_SLICE or x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for s in range(0, n, ELEMENTWISE_SLICE):
        out[s:s + ELEMENTWISE_SLICE] = fn(flat[s:s + ELEMENTWISE_SLICE])
    return out.view(x.shape)
