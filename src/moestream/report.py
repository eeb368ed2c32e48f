"""``moestream inspect``: the model's layout and what a given slot count costs, from the tensor table alone."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from .errors import ConfigError, GGUFError
from .experts.policy import default_slots
from .gguf import GGUFModel
from .models.base import BLOCK_TENSOR as _BLOCK
from .models.base import LoadOptions, MoEModel, architecture_of

if TYPE_CHECKING:
    from .tokenizer import GGUFTokenizer

GiB = 2**30
MiB = 2**20



def _expert_lines(layout) -> list[str]:  # noqa: ANN001 - ExpertLayout
    """The "expert matrices" and "bytes/expert" lines: one pair when every MoE layer stores its experts alike,
    else one pair per group of consecutive layers that do (mixed-type files quantize layers differently)."""
    groups: list[tuple[list[int], str, int]] = []
    for layer in layout.moe_layers:
        desc = ", ".join(f"{m.matrix} {m.type_name} [{m.rows}x{m.cols}] {m.bytes_per_expert} B"
                         for m in layout[layer].values())
        if groups and groups[-1][1] == desc:
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], desc, layout.bytes_per_expert(layer)))
    if len(groups) == 1:
        _, desc, per = groups[0]
        return [f"expert matrices {desc}", f"bytes/expert    {per} ({_fmt(per)}) per layer, all matrices"]
    out = []
    for layers, desc, per in groups:
        name = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
        out += [f"expert matrices {name}: {desc}", f"bytes/expert    {name}: {per} ({_fmt(per)}), all matrices"]
    return out

def _fmt(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB / 4 else f"{n / MiB:.2f} MiB"


def inspect_model(path: str, opts: LoadOptions | None = None,
                  context: int | Callable[[MoEModel, GGUFTokenizer], int] | None = None) -> str:
    """A human-readable report. Raises GGUFError for a bad file, ConfigError for ``opts.slots`` below top-k.

    ``opts`` (cli.py: options.load_options, the LoadOptions run makes of the same flags): ``slots`` prices pools of
    that many slots per layer (default: a quarter of the experts, at least top-k); ``mem`` adds the memory plan
    ``run --mem`` would make for a context of ``context`` tokens (or ``context(model, tokenizer)``'s, from the
    file's hyperparameters and tokenizer: the CLI's gives the context run would have, engine.run_context; None:
    the trained context, at most 4096): the dense weights from the tensor table, this process's own memory (torch,
    the kernels, the tokenizer as run holds it) measured as run measures its own (run's is typically a few tens of
    MiB more: the model's objects); ConfigError naming the smallest size that works when top-k slots per layer do
    not fit. ``gpu_mem``: also the plan of ``run --device cuda --gpu-mem`` (pools in VRAM)."""
    opts = opts or LoadOptions()
    g = GGUFModel(path)
    # the same one-line refusals as run: an architecture moestream cannot compute, metadata that disagrees with
    # the tensors (hyperparameters, shapes, ggml types) -- checked from the tensor table, no weight is read
    shape = architecture_of(g)(g, LoadOptions(moe_stream=False, metadata_only=True, expand_dense=opts.expand_dense))
    shape.check_dense_types()
    plan = None
    host_lines: list[str] = []
    n_ctx = context
    if opts.mem is not None or opts.gpu_mem is not None:
        # this process holds what run's holds besides the model: torch, the kernels, the tokenizer (torch read
        # once: the inspect command's stand-in imports it here, so its memory is measured as run's is)
        import torch

        from . import kernels
        from .tokenizer import GGUFTokenizer
        torch.empty(0)
        with contextlib.suppress(kernels.KernelBuildError):
            kernels.load()
        # a file without a tokenizer (run cannot tokenize a prompt for it): the default context is priced; lazy, as
        # run's: where a helper encodes the prompt (cli._prompt_ids), the backend is not in the process, as in run's
        tok = (GGUFTokenizer.from_fields(g.fields, g.path, g.metadata_digest, lazy=True)
               if "tokenizer.ggml.tokens" in g.fields else None)
        if callable(context):
            n_ctx = context(shape, tok) if tok is not None else None
        if opts.mem is not None and opts.cuda and opts.pool == "device":  # the host side: process + tier
            host_lines = shape.host_side_lines(opts)
        elif opts.mem is not None:  # --pool host on CUDA: the pools in pinned host memory, the rest in VRAM
            plan = shape.plan_memory(opts, n_ctx, loaded=False, gpu=opts.cuda and opts.pool == "host")
        del tok
    gpu_plan = None
    if opts.gpu_mem is not None:  # the plan run --device cuda --gpu-mem SIZE makes (pools in VRAM)
        gpu_plan = shape.plan_memory(opts, n_ctx, loaded=False, gpu=True)
    slots = opts.slots
    layout = shape.layout  # the trunk's: MTP blocks (nextn_predict_layers) are not run and get no pool
    if not layout.moe_layers:
        raise GGUFError(f"{path}: no routed-expert tensors (blk.N.ffn_*_exps) found")
    n_exp = int(g.arch_get("expert_count", required=True))
    top_k = int(g.arch_get("expert_used_count", required=True))
    layout.check_counts(path, n_exp, top_k)
    n_slots = slots if slots is not None else default_slots(n_exp, top_k)
    if n_slots < top_k:
        raise ConfigError(f"--slots {n_slots} is below the experts used per token ({top_k})")
    clamped = f" (--slots {n_slots} clamped to the expert count, as run does)" if n_slots > n_exp else ""
    n_slots = min(n_slots, n_exp)
    expert_names = {f"blk.{layer}.ffn_{m}_exps.weight" for layer, mats in layout.layers.items() for m in mats}
    unrun = {n for n in g.tensors if (m := _BLOCK.match(n)) and int(m.group(1)) >= shape.n_layers}
    dense = [t for n, t in g.tensors.items() if n not in expert_names and n not in unrun]
    dense_bytes = sum(t.n_bytes for t in dense)
    resident = min(shape.dense_estimate(mapped=True), dense_bytes)  # what the memory plan prices on the CPU
    dense_f32 = sum(t.n_bytes if t.ggml_type == GGMLQuantizationType.F32 else 4 * math.prod(t.shape)
                    for t in dense)
    expert_bytes = layout.total_bytes
    pools = layout.pool_bytes(n_slots)
    per_token = sum(layout.bytes_per_expert(layer) * top_k for layer in layout.moe_layers)
    types = Counter(t.type_name for t in g.tensors.values())
    lines = [
        f"file            {path}" + (f" ({len(g.paths)} parts)" if len(g.paths) > 1 else ""),
        f"architecture    {g.arch}",
        f"name            {g.get('general.name', '?')}",
        f"layers          {shape.n_layers} ({len(layout.moe_layers)} with routed experts)"
        + (f"; + {shape.n_mtp} MTP block{'s' * (shape.n_mtp > 1)} ({_fmt(sum(g.tensors[n].n_bytes for n in unrun))}), "
           f"not run" if shape.n_mtp else ""),
        f"experts         {n_exp} per layer, {top_k} used per token (top-k)",
        "tensor types    " + ", ".join(f"{k} x{v}" for k, v in sorted(types.items())),
        *_expert_lines(layout),
        f"file size       {_fmt(g.file_bytes)}",
        f"dense weights   {_fmt(dense_bytes)} (as stored"
        + (f"; {_fmt(resident)} resident on the CPU, the token embeddings' {_fmt(dense_bytes - resident)} read from "
           f"the file's map" if resident < dense_bytes else ", all resident")
        + f"; {_fmt(dense_f32)} with --expand-dense)",
        f"routed experts  {_fmt(expert_bytes)} ({100 * expert_bytes / max(g.file_bytes, 1):.1f}% of the file)",
        f"per token       {_fmt(per_token)} of experts touched (read from disk if nothing is cached)",
        f"--slots {n_slots:<7d} {_fmt(pools)} of slot pools "
        f"({100 * n_slots / n_exp:.1f}% of experts) -> dense + pools = {_fmt(dense_bytes + pools)}{clamped}",
    ]
    if plan is not None:
        lines += plan.lines()
    lines += host_lines
    if gpu_plan is not None:
        lines += gpu_plan.lines()
    return "\n".join(lines)
