"""GPU code of moestream: Triton kernels that compute on ggml blocks as stored (:mod:`moestream.gpu.tkernels`)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


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


#: Seconds Triton spent building (or loading from its cache under ~/.triton/cache) kernels in this process, and
#: how many, counted by :func:`count_compiles`' hooks.
_BUILT = {"seconds": 0.0, "kernels": 0}
_STARTED = threading.local()
_LOCK = threading.Lock()


def count_compiles(triton: Any) -> None:
    """Install (once) Triton's ``jit_cache_hook`` and ``jit_post_compile_hook`` (triton.knobs.runtime, Triton 3.4+)
    so that :func:`build_seconds` counts the time of each kernel build: a kernel's first launch in a process with a
    new configuration compiles it (seconds; a first run on a machine) or loads it from Triton's cache (milliseconds).
    Hooks already installed by someone else are called first, their result kept. No-op on an older Triton."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None or not hasattr(rt, "jit_post_compile_hook") or getattr(rt, "_moestream_counted", False):
        return
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

    def start(**kw: Any) -> Any:
        _STARTED.t0 = time.perf_counter()
        return before(**kw) if before else None  # truthy: that hook skips the build

    def done(**kw: Any) -> Any:
        t0 = getattr(_STARTED, "t0", None)
        if t0 is not None:
            with _LOCK:
                _BUILT["seconds"] += time.perf_counter() - t0
                _BUILT["kernels"] += 1
            _STARTED.t0 = None
        return after(**kw) if after else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = start, done
    rt._moestream_counted = True


def build_seconds() -> float:
    """Seconds of Triton kernel builds in this process so far (see :func:`count_compiles`)."""
    return _BUILT["seconds"]
