"""GPU code of moestream: Triton kernels that compute on ggml blocks as stored (:mod:`moestream.gpu.tkernels`)."""

from __future__ import annotations

import os


def env_on(name: str) -> bool:
    """Whether the switch ``name`` in the environment is on: unset or anything but 0/off/false/no (the A/B
    switches of the step kernels: ``MOESTREAM_MOE_FUSED``, ``MOESTREAM_TDENSE``, ...)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def runs_on(t: object, enabled: bool, on_cpu: bool, have_triton: bool) -> bool:
    """Whether a module's Triton kernels run for tensor ``t`` (a torch.Tensor): ``enabled``, triton importable,
    float32, and a CUDA tensor, or a CPU one when ``on_cpu`` (tests) under ``TRITON_INTERPRET=1``."""
    import torch

    if not enabled or not have_triton or t.dtype != torch.float32:
        return False
    if t.device.type == "cuda":
        return True
    return on_cpu and t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
