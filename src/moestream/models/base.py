"""What every architecture shares: options, dense-weight loading, expert store wiring, the registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError, GGUFError
from ..experts.layout import ExpertLayout
from ..experts.pool import ExpertStore, ResidentStore, StreamingStore
from ..gguf import GGUFModel
from .layers import Weight

ARCHITECTURES: dict[str, type[MoEModel]] = {}


def register(arch: str) -> Callable[[type[MoEModel]], type[MoEModel]]:
    """Class decorator: register a model class under its GGUF ``general.architecture`` name."""
    def deco(cls: type[MoEModel]) -> type[MoEModel]:
        ARCHITECTURES[arch] = cls
        cls.arch = arch
        return cls
    return deco


@dataclass
class LoadOptions:
    """How to load a model.

    moe_stream: stream routed experts through slot pools (True) or address them in a memory map (False).
    slots: slots per MoE layer (None: a quarter of the experts, at least top-k). io_threads: reader threads.
    policy: slot replacement policy name. expand_dense: dequantize dense weights to float32 at load.
    overlap: run the shared/dense FFN while expert reads are in flight. device: torch device string.
    """

    moe_stream: bool = True
    slots: int | None = None
    io_threads: int = 8
    policy: str = "lfu"
    expand_dense: bool = False
    overlap: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots < 1:
            raise ConfigError(f"--slots must be a positive number, got {self.slots}")
        if self.io_threads < 1:
            raise ConfigError(f"--io-threads must be at least 1, got {self.io_threads}")


def default_slots(n_experts: int, top_k: int) -> int:
    """Default pool size: a quarter of the experts, at least top-k."""
    return max(top_k, n_experts // 4)


class MoEModel:
    """Base of the architectures. Subclasses read their hyper-parameters and weights in ``__init__`` via
    ``self.weight``/``self.norm`` and implement ``forward``.

    Attributes: gguf, opts, device, layout (ExpertLayout), store (the current ExpertStore), n_vocab,
    n_experts, top_k, n_ctx_train.
    """

    arch = "?"

    def __init__(self, gguf: GGUFModel, opts: LoadOptions):
        self.gguf, self.opts = gguf, opts
        self.device = torch.device(opts.device)
        self.layout = ExpertLayout(gguf)
        if not self.layout.moe_layers:
            raise GGUFError(f"{gguf.path}: no routed-expert tensors (blk.N.ffn_*_exps) found")
        self.n_experts = int(gguf.arch_get("expert_count", required=True))
        self.top_k = int(gguf.arch_get("expert_used_count", required=True))
        self.layout.check_counts(gguf.path, self.n_experts, self.top_k)
        self.n_ctx_train = int(gguf.arch_get("context_length", 4096))
        self.dense_bytes = 0
        self.store: ExpertStore = self.make_store(opts)

    # --- weights ------------------------------------------------------------------------------
    def weight(self, name: str) -> Weight:
        w = Weight(self.gguf, self.gguf.tensor_info(name), self.device, self.opts.expand_dense)
        self.dense_bytes += w.nbytes
        return w

    def norm(self, name: str) -> torch.Tensor:
        """A norm vector as float32 [n] on the device."""
        return self.weight(name).float().reshape(-1)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def check_expert_types(self) -> None:
        from .. import quant
        for mats in self.layout.layers.values():
            for m in mats.values():
                if not quant.is_supported(m.ggml_type):
                    raise GGUFError(f"{m.path}: tensor blk.{m.layer}.ffn_{m.matrix}_exps.weight is ggml type "
                                    f"{m.ggml_type} ({m.type_name}), which moestream cannot compute")

    # --- expert store ---------------------------------------------------------------------------
    def make_store(self, opts: LoadOptions) -> ExpertStore:
        self.check_expert_types()
        if not opts.moe_stream:
            return ResidentStore(self.gguf, self.layout)
        slots = opts.slots if opts.slots is not None else default_slots(self.n_experts, self.top_k)
        return StreamingStore(self.gguf, self.layout, slots, self.top_k, opts.io_threads, opts.policy,
                              pin_memory=self.device.type == "cuda")

    def set_store(self, store: ExpertStore) -> None:
        """Swap the expert store (e.g. resident -> streaming for the identity check)."""
        self.store = store

    # --- interface ------------------------------------------------------------------------------
    n_vocab: int

    def new_cache(self, n_ctx: int) -> object:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, start: int, cache: object, logits_all: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start..start+T-1. Returns float32 logits [T, n_vocab] when
        ``logits_all`` else [1, n_vocab] for the last token."""
        raise NotImplementedError


def load_model(path: str, opts: LoadOptions | None = None) -> MoEModel:
    """Open ``path`` (a GGUF file or the first/any part of a split model) and build its architecture.

    Raises GGUFError for bad files and unsupported architectures, ConfigError for bad options.
    """
    from . import (
        gemma4,  # noqa: F401 - registers
        qwen3moe,  # noqa: F401 - registers
        qwen35moe,  # noqa: F401 - registers
    )

    opts = opts or LoadOptions()
    gguf = GGUFModel(path)
    cls = ARCHITECTURES.get(gguf.arch)
    if cls is None:
        raise GGUFError(f"{path}: architecture {gguf.arch!r} is not supported; supported: "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return cls(gguf, opts)
