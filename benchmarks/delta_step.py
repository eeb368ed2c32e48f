"""The gated delta rule's decode step over Qwen3.5-35B-A3B's 30 DeltaNet layers (32 value heads, 16 key heads,
d_k = d_v = 128: a 2 MiB state per layer, 60 MiB in all, each touched once per token as a decode step does, 64 MiB
streamed between tokens as the matmuls do): torch's recurrence (models/qwen35moe.gated_delta_rule, the key heads
repeated: the step before the C kernel) vs kernels.delta_step (csrc/stepkern.c ms_delta_step), 1 and 2 threads.

    PYTHONPATH=src python benchmarks/delta_step.py

Prints the median and minimum of 20 tokens, ms per token over the 30 layers.
"""
import time

import torch

from moestream import kernels
from moestream.models.qwen35moe import gated_delta_rule, l2_norm

H, NK, D, L = 32, 16, 128, 30
g = torch.Generator().manual_seed(0)
q = l2_norm(torch.randn(NK, D, generator=g)) * D ** -0.5
k = l2_norm(torch.randn(NK, D, generator=g))
v = torch.randn(H, D, generator=g)
lg = -torch.rand(H, generator=g)
beta = torch.rand(H, generator=g)
states = [torch.randn(H, D, D, generator=g) * 0.1 for _ in range(L)]
junk = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB streamed between tokens, as a step's matmuls do
qr, kr = q.repeat(2, 1)[None], k.repeat(2, 1)[None]


def tok_torch():
    for s in states:
        gated_delta_rule(qr, kr, v[None], lg[None], beta[None], s)


def tok_c():
    d = lg.exp()
    for s in states:
        kernels.delta_step(q, k, v, d, beta, s)


for t in (1, 2):
    kernels.set_threads(t)
    torch.set_num_threads(t)
    for name, fn in (("torch", tok_torch), ("C", tok_c)):
        fn()
        ts = []
        for _ in range(20):
            junk.add_(1)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"{t} thread(s) {name:5s}: median {ts[10] * 1e3:.2f} ms per token (30 layers), min {ts[0] * 1e3:.2f}")
