"""What every architecture shares: options, dense-weight loading, expert store wiring, the registry."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import GGUFError
from ..experts.layout import _EXPS_RE as EXPERT_TENSOR
from ..experts.layout import ExpertLayout
from ..experts.moe import MoE
from ..experts.pool import ExpertStore, ResidentStore, StreamingStore
from ..gguf import GGUFModel
from ..params import LoadOptions  # checked there, torch-free: a refused option is answered before torch loads
from ..runtime.runner import Runner
from .layers import KVArena, KVCache, Weight, check_computable, rms_norm, swiglu_ffn

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")

BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")

ARCHITECTURES: dict[str, type[MoEModel]] = {}


def register(arch: str) -> Callable[[type[MoEModel]], type[MoEModel]]:
    """Class decorator: register a model class under its GGUF ``general.architecture`` name."""
    def deco(cls: type[MoEModel]) -> type[MoEModel]:
        ARCHITECTURES[arch] = cls
        cls.arch = arch
        return cls
    return deco


@dataclass(frozen=True)
class RopeScaling:
    """A file's RoPE scaling (:meth:`MoEModel.rope_scaling`): ``kind`` (e.g. ``"yarn"``), ``factor`` (context
    extension, >= 1), ``orig_ctx`` (the pre-training context, tokens), YaRN's ``beta_fast``/``beta_slow``
    (rotations bounding the ramp), ``log_multiplier`` (llama.cpp's ``yarn_log_multiplier``: 0.1 x DeepSeek's
    ``mscale_all_dim``) and ``attn_factor`` (``rope.scaling.attn_factor``)."""

    kind: str
    factor: float
    orig_ctx: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_multiplier: float = 0.0
    attn_factor: float = 1.0


class Route(NamedTuple):
    """What an MoE layer's router hands the routed experts (:meth:`MoEModel.route_layer`): h float32 [T, hidden],
    the experts' input; ids int64 [T, top_k], real expert ids; w float32 [T, top_k], their weights."""

    h: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor


class Declared:
    """A tensor declared with :meth:`MoEModel.tensor`: its shape checked against the metadata, its data not read
    yet. :meth:`load` reads it once (later calls return the same value: a tensor declared in two places, such as
    tied embeddings, is one object)."""

    __slots__ = ("name", "_read", "_value")

    def __init__(self, name: str, read: Callable[[], Any]):
        self.name, self._read, self._value = name, read, None

    def load(self) -> Any:
        if self._read is not None:
            self._value, self._read = self._read(), None
        return self._value

    def then(self, fn: Callable[[Any], Any]) -> Declared:
        """The declaration of ``fn(value)`` (e.g. a reshape or a slice): reading it reads this one (once)."""
        return Declared(self.name, lambda: fn(self.load()))

    def __repr__(self) -> str:
        return f"Declared({self.name!r})"


class DeviceName(NamedTuple):
    """A device as a torch.device names it (``type`` "cpu" / "cuda", ``index`` or None), made without torch."""

    type: str
    index: int | None

    @classmethod
    def of(cls, name: str) -> DeviceName:
        kind, _, index = str(name).partition(":")
        return cls(kind, int(index) if index else None)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class MoEModel:
    """Base of the architectures. Subclasses read their hyper-parameters in ``__init__``, declare each tensor their
    forward pass reads once (:meth:`tensor`: checked at once, read by :meth:`load_declared` unless
    ``opts.metadata_only``) and implement ``forward``.

    Attributes: gguf, opts, device, layout (ExpertLayout), store (the current ExpertStore), n_vocab,
    n_experts, top_k, n_ctx_train.
    """

    arch = "?"

    def __init__(self, gguf: GGUFModel, opts: LoadOptions):
        self.gguf, self.opts = gguf, opts
        #: the torch.device computed on; a shape opened for its metadata (open_model: no tensor is made) holds a
        #: :class:`DeviceName` (the same ``type`` and ``index``) and imports no torch for it
        self.device = DeviceName.of(opts.device) if opts.metadata_only else torch.device(opts.device)
        #: matmuls through moestream's C kernels (``--matmul blocks`` on a CPU device)
        self.use_blocks = opts.matmul == "blocks" and self.device.type == "cpu"
        #: matmuls through the Triton kernels on the ggml blocks (``--matmul blocks`` on a CUDA device)
        self.use_triton = opts.matmul == "blocks" and self.device.type == "cuda" and _triton_available()
        self.layout = ExpertLayout(gguf)
        #: the file's blocks (block_count), the trailing next-token-prediction (MTP / NextN) blocks among them
        #: (nextn_predict_layers, absent = 0), and the trunk layers that are run: the MTP blocks are not run (as in
        #: llama.cpp's graphs), and their routed experts get no slot pool
        self.n_blocks = self.meta_int("block_count", required=True)
        self.n_mtp = self.meta_int("nextn_predict_layers", 0, minimum=0)
        if self.n_mtp >= self.n_blocks:
            raise GGUFError(f"{gguf.path}: metadata {self.meta_desc(nextn_predict_layers=self.n_mtp)} leaves no "
                            f"trunk layers of {self.meta_desc(block_count=self.n_blocks)}")
        self.n_layers = self.n_blocks - self.n_mtp
        self.layout.layers = {la: m for la, m in self.layout.layers.items() if la < self.n_layers}
        if not self.layout.moe_layers:
            raise GGUFError(f"{gguf.path}: no routed-expert tensors (blk.N.ffn_*_exps) found")
        self.n_experts = int(gguf.arch_get("expert_count", required=True))
        self.top_k = int(gguf.arch_get("expert_used_count", required=True))
        self.layout.check_counts(gguf.path, self.n_experts, self.top_k)
        self.n_ctx_train = self.meta_int("context_length", 4096)
        #: the hidden size (llama.cpp's n_embd): every declared shape (:meth:`tensor`) is checked against it
        self.n_embd = self.meta_int("embedding_length", required=True)
        self.dense_bytes = 0
        #: the memory plan that sized the pools (None: --slots, or resident)
        self.memory_plan = None
        self.store: ExpertStore = None  # type: ignore[assignment]
        #: None, or a callable ``(layer, ids) -> ids`` that replaces every MoE layer's router ids (set_routing)
        self.routing: Callable | None = None
        self.check_expert_width()
        #: runs the forward steps (runtime/runner.py): eager, CUDA graphs, batches of sequences
        self.runner = Runner(self)
        if opts.metadata_only:
            self.check_expert_types()
        elif not opts.budgeted:  # a budget's pools: load_model, once the plan is made and the weights are in
            self.store = self.make_store(opts)

    # --- checked metadata -----------------------------------------------------------------------
    #: the metadata key giving the routed experts' width (llama.cpp's n_ff_exp; llama and olmoe use the dense
    #: ``feed_forward_length``): checked against the expert matrices where a file sets it (> 0)
    expert_width_key: str | None = "expert_feed_forward_length"

    def check_expert_width(self) -> None:
        """GGUFError naming the file when :attr:`expert_width_key` (one value, or one per layer) disagrees with a
        layer's expert matrices (the columns of ``ffn_down_exps``); llama.cpp refuses such a file by the tensor's
        shape. A family that checks the width itself (deriving it when the key is 0 or absent) sets the key None."""
        if self.expert_width_key is None:
            return
        width = self.gguf.arch_get(self.expert_width_key)
        for layer, mats in self.layout.layers.items():
            w = (width[layer] if layer < len(width) else None) if isinstance(width, list) else width
            down = mats.get("down")
            if isinstance(w, int) and w > 0 and down is not None and down.cols != w:
                raise GGUFError(f"{self.gguf.path}: metadata {self._key(self.expert_width_key)}={w} but "
                                f"blk.{layer}.ffn_down_exps.weight is {down.cols} wide (its experts' width)")

    def _key(self, suffix: str) -> str:
        return f"{self.gguf.arch}.{suffix}"

    def meta_float(self, suffix: str, default: float | None = None, required: bool = False,
                   allow_zero: bool = False) -> float:
        """``{arch}.{suffix}`` as a finite number > 0 (>= 0 when ``allow_zero``): epsilons, RoPE bases, caps.

        Raises GGUFError naming the key and the value otherwise (NaN, Inf, negative, not a number): a NaN
        epsilon or RoPE base would silently turn every logit into NaN.
        """
        v = self.gguf.arch_get(suffix, default, required=required)
        key = self._key(suffix)
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise GGUFError(f"{self.gguf.path}: metadata key {key} must be a number, got {v!r}") from None
        if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
            need = "0 or a positive finite number" if allow_zero else "a positive finite number"
            raise GGUFError(f"{self.gguf.path}: metadata key {key} is {f}, which must be {need}")
        return f

    def meta_int(self, suffix: str, default: int | None = None, required: bool = False, minimum: int = 1) -> int:
        """``{arch}.{suffix}`` as an integer >= ``minimum``; GGUFError naming the key otherwise."""
        return self._as_int(suffix, self.gguf.arch_get(suffix, default, required=required), minimum)

    def meta_ints(self, suffix: str, n: int, default: Any = None, required: bool = False,
                  minimum: int = 1) -> list[int]:
        """``{arch}.{suffix}`` that is either one integer or one per layer, as ``n`` integers >= ``minimum``."""
        v = self.gguf.arch_get(suffix, default, required=required)
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise GGUFError(f"{self.gguf.path}: metadata key {self._key(suffix)} lists {len(v)} values, "
                                f"expected one per layer ({n})")
            return [self._as_int(suffix, x, minimum) for x in v]
        return [self._as_int(suffix, v, minimum)] * n

    def _as_int(self, suffix: str, v: Any, minimum: int) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            raise GGUFError(f"{self.gguf.path}: metadata key {self._key(suffix)} must be an integer, got {v!r}")
        if int(v) < minimum:
            raise GGUFError(f"{self.gguf.path}: metadata key {self._key(suffix)} is {int(v)}, which must be at "
                            f"least {minimum}")
        return int(v)

    def rope_scaling(self, supported: Sequence[str] = ("none",)) -> RopeScaling | None:
        """The file's RoPE scaling keys (``{arch}.rope.scaling.*``), with llama.cpp's defaults for absent ones
        (``llama_model_loader`` / ``llama_hparams``): type ``none`` when absent; ``factor`` absent or 0 = 1;
        ``original_context_length`` absent = ``context_length``; ``yarn_beta_fast`` 32, ``yarn_beta_slow`` 1,
        ``yarn_log_multiplier`` 0 and ``attn_factor`` 1 when absent.

        Returns None for type ``none`` or a factor of 1 (no scaling), else a :class:`RopeScaling`. GGUFError
        naming the key for a type not in ``supported`` (a family computes only what it lists: anything else
        would silently rotate with the wrong angles) or a value out of range."""
        kind = self.gguf.arch_get("rope.scaling.type", "none")
        if not isinstance(kind, str):
            raise GGUFError(f"{self.gguf.path}: metadata key {self._key('rope.scaling.type')} must be a string, "
                            f"got {kind!r}")
        if kind == "none":
            return None
        factor = self.meta_float("rope.scaling.factor", 0.0, allow_zero=True) or 1.0
        if factor == 1.0:  # every kind of scaling leaves the angles (and YaRN's magnitude) as they are
            return None
        if kind not in supported:
            known = ", ".join(supported)
            raise GGUFError(f"{self.gguf.path}: metadata {self.meta_desc(rope__scaling__type=kind)} asks for RoPE "
                            f"scaling that moestream does not compute for {self.gguf.arch} (it computes: {known})")
        if factor < 1.0:
            raise GGUFError(f"{self.gguf.path}: metadata {self.meta_desc(rope__scaling__factor=factor)} is below 1 "
                            f"(a context shrink, which moestream does not compute)")
        return RopeScaling(
            kind=kind, factor=factor,
            orig_ctx=self.meta_int("rope.scaling.original_context_length", self.meta_int("context_length", 4096)),
            beta_fast=self.meta_float("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=self.meta_float("rope.scaling.yarn_beta_slow", 1.0),
            log_multiplier=self.meta_float("rope.scaling.yarn_log_multiplier", 0.0, allow_zero=True),
            attn_factor=self.meta_float("rope.scaling.attn_factor", 1.0))

    def softmax_routing(self, norm: bool, switchable: bool, gating: int = 1) -> bool:
        """The routing keys of a softmax-routed family, checked; returns whether the top-k weights are renormalized.
        ``gating``: the family's gating function in llama.cpp's numbering (``llama_expert_gating_func_type``): 1 softmax
        over all experts, then top-k; 3 (GPT-OSS) the top-k router logits softmaxed among themselves.

        The converter writes none of them for these families, and llama.cpp's graphs fix the routing per
        architecture (softmax gating, renormalization on or off, no scale), reading no key. Absent keys give that
        fixed routing. A file that sets them:

        - ``expert_gating_func``: ``gating`` or 0 (none: llama.cpp's "unset") is accepted; another function is
          refused (these families' checkpoints have no such option).
        - ``expert_weights_norm``: with ``switchable`` (the transformers class has ``norm_topk_prob``: Qwen3-MoE,
          Qwen2-MoE, OLMoE) the file's value is used, as transformers would with that ``norm_topk_prob``;
          otherwise a value other than ``norm`` is refused (the architecture always does ``norm``).
        - ``expert_weights_scale``: absent, 0 (llama.cpp's "unset") or 1 is accepted; another value is refused.

        GGUFError naming the key and value for what is refused or mistyped."""
        g, path, d = self.gguf.arch_get, self.gguf.path, self.meta_desc
        name = {1: "softmax", 3: "softmax over the top-k"}[gating]
        given_gating = g("expert_gating_func", 0)
        if isinstance(given_gating, bool) or given_gating not in (0, gating):
            raise GGUFError(f"{path}: metadata {d(expert_gating_func=given_gating)} is not {name} ({gating}); "
                            f"{self.gguf.arch} routes with {name} only")
        given = g("expert_weights_norm")
        if given is not None:
            if not isinstance(given, bool):
                raise GGUFError(f"{path}: metadata key {self._key('expert_weights_norm')} must be a bool, "
                                f"got {given!r}")
            if not switchable and given != norm:
                how = "renormalizes" if norm else "never renormalizes"
                raise GGUFError(f"{path}: metadata {d(expert_weights_norm=str(given).lower())} contradicts the "
                                f"architecture: {self.gguf.arch} always {how} its top-k weights")
            norm = given
        scale = self.meta_float("expert_weights_scale", 0.0, allow_zero=True)
        if scale not in (0.0, 1.0):
            raise GGUFError(f"{path}: metadata {d(expert_weights_scale=scale)} asks to scale the routed experts' "
                            f"weights, which {self.gguf.arch} does not do")
        return norm

    def meta_desc(self, **values: Any) -> str:
        """``"qwen3moe.attention.head_count=4, ..."`` for error messages; keyword ``a__b`` is key ``a.b``."""
        return ", ".join(f"{self._key(k.replace('__', '.'))}={v}" for k, v in values.items())

    def expect_shape(self, name: str, expected: Sequence[int], because: str) -> None:
        """GGUFError unless tensor ``name`` has shape ``expected`` (torch order, last dim = row length).

        ``because`` names the metadata that implies ``expected``, e.g. ``"head_count=4 x key_length=32"``.
        Checked at load, so metadata that disagrees with the tensors fails before anything is printed instead
        of in the middle of a forward pass.
        """
        shape = tuple(self.gguf.tensor_info(name).shape)
        if shape != tuple(expected):
            raise GGUFError(f"{self.gguf.path}: tensor {name} has shape {list(shape)} but the metadata "
                            f"({because}) implies {list(expected)}")

    # --- declared tensors -------------------------------------------------------------------------
    # A family declares each tensor its forward pass reads once, with the shape its metadata implies (llama.cpp's
    # ``create_tensor(name, dims)``): :meth:`tensor` checks the shape at once and defers the read, so every check
    # of a file is made before any weight is read, and ``opts.metadata_only`` (inspect) refuses what a load would;
    # :meth:`load_declared` then reads them all.
    def tensor(self, name: str, shape: Sequence[int], keys: str, kind: str = "weight",
               optional: bool = False) -> Declared | None:
        """Declare tensor ``name``: GGUFError now unless it has ``shape`` (torch order, last dim = row length), the
        shape the metadata ``keys`` imply (for the message, e.g. ``self.meta_desc(attention__head_count=4)``); its
        data is read by :meth:`load_declared` (never with ``opts.metadata_only``).

        kind: what the data becomes: ``"weight"`` a :class:`Weight` (matmuls), ``"norm"`` float32 [n] (a vector:
        norms, biases, scales), ``"float"`` float32 [shape], ``"table"`` a row-lookup table (:meth:`lookup_table`).
        optional: an absent tensor gives None (a present one is checked); otherwise GGUFError names it missing.
        Returns a :class:`Declared` (:meth:`Declared.then` transforms its value once read)."""
        if optional and not self.has(name):
            return None
        self.expect_shape(name, shape, keys)
        read = {"weight": self.weight, "norm": self.norm, "table": self.lookup_table, "float": self.dense_float}[kind]
        return Declared(name, lambda: read(name))

    def load_declared(self, ends: dict[str, Any], blocks: list[dict[str, Any]]) -> None:
        """Read what was declared: each value of ``ends`` becomes the model's attribute of its key (e.g. ``embd``),
        ``blocks`` becomes :attr:`blocks` (one dict per layer, the same keys), every :class:`Declared` in them (at
        any depth of dicts, lists and tuples) replaced by its value; other values are kept as they are."""
        for key, value in ends.items():
            setattr(self, key, self.loaded(value))
        self.blocks = self.loaded(blocks)

    @classmethod
    def loaded(cls, obj: Any) -> Any:
        """``obj`` with every :class:`Declared` in it read (dicts, lists and tuples are rebuilt)."""
        if isinstance(obj, Declared):
            return obj.load()
        if isinstance(obj, dict):
            return {k: cls.loaded(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(cls.loaded(v) for v in obj)
        return obj

    def declare_ends(self) -> dict[str, Declared | None]:
        """What every family checks first and the two ends every family shares, declared: the routed experts against
        ``embedding_length`` and each other (:meth:`check_expert_shapes`), no block past ``block_count``, then
        ``embd`` (token_embd, a row-lookup table), ``out_norm`` (output_norm) and ``output`` (output; the embedding
        where the file ties them). Sets ``n_vocab`` (token_embd's rows). For :meth:`load_declared`'s ``ends``."""
        n_embd = self.n_embd
        self.check_expert_shapes(n_embd)
        # layers past block_count would be silently left out (llama.cpp refuses them)
        past = sorted({int(m.group(1)) for name in self.gguf.tensors
                       if (m := _BLOCK_RE.match(name)) and int(m.group(1)) >= self.n_blocks})
        if past:
            first = next(n for n in sorted(self.gguf.tensors) if n.startswith(f"blk.{past[0]}."))
            raise GGUFError(f"{self.gguf.path}: metadata key {self._key('block_count')}={self.n_blocks} but the file "
                            f"has tensors of {len(past)} more layer(s) (e.g. {first})")
        emb = self.meta_desc(embedding_length=n_embd)
        self.n_vocab = vocab = self.gguf.tensor_info("token_embd.weight").shape[0]
        embd = self.tensor("token_embd.weight", (vocab, n_embd), emb, kind="table")
        out_norm = self.tensor("output_norm.weight", (n_embd,), emb, kind="norm")
        output = self.tensor("output.weight", (vocab, n_embd), emb + " and token_embd's vocabulary", optional=True)
        return {"embd": embd, "out_norm": out_norm, "output": output or embd}

    def attention_tensors(self, p: str, n_head: int, n_kv: int, head_dim: int,
                          head_dim_v: int | None = None) -> dict[str, Declared | None]:
        """GQA attention's projections in block ``p`` (e.g. ``"blk.3."``), declared: ``q`` [n_head x head_dim,
        hidden], ``k`` [n_kv x head_dim, hidden], ``v`` [n_kv x head_dim_v, hidden], ``o`` [hidden, n_head x
        head_dim_v]. head_dim_v None: the family has no ``attention.value_length`` key (values are head_dim wide)."""
        d, n_embd = self.meta_desc, self.n_embd
        hdv = head_dim if head_dim_v is None else head_dim_v
        v_key = {"attention__key_length": hdv} if head_dim_v is None else {"attention__value_length": hdv}
        return {
            "q": self.tensor(p + "attn_q.weight", (n_head * head_dim, n_embd),
                             d(attention__head_count=n_head, attention__key_length=head_dim, embedding_length=n_embd)),
            "k": self.tensor(p + "attn_k.weight", (n_kv * head_dim, n_embd),
                             d(attention__head_count_kv=n_kv, attention__key_length=head_dim, embedding_length=n_embd)),
            "v": self.tensor(p + "attn_v.weight", (n_kv * hdv, n_embd),
                             d(attention__head_count_kv=n_kv, **v_key, embedding_length=n_embd)),
            "o": self.tensor(p + "attn_output.weight", (n_embd, n_head * hdv),
                             d(attention__head_count=n_head, **v_key, embedding_length=n_embd)),
        }

    def qkv_biases(self, p: str, n_head: int, n_kv: int, head_dim: int,
                   optional: bool = False) -> dict[str, Declared | None]:
        """The q/k/v projections' biases in block ``p``, declared as float32 vectors, keyed by tensor name
        (``attn_q.bias`` [n_head x head_dim], ``attn_k.bias`` and ``attn_v.bias`` [n_kv x head_dim])."""
        d, n_embd = self.meta_desc, self.n_embd
        q = d(attention__head_count=n_head, attention__key_length=head_dim, embedding_length=n_embd)
        kv = d(attention__head_count_kv=n_kv, attention__key_length=head_dim, embedding_length=n_embd)
        return {name: self.tensor(p + name, (n,), keys, kind="norm", optional=optional)
                for name, n, keys in (("attn_q.bias", n_head * head_dim, q), ("attn_k.bias", n_kv * head_dim, kv),
                                      ("attn_v.bias", n_kv * head_dim, kv))}

    def ffn_tensors(self, p: str, suffix: str = "", n_ff: int | None = None, keys: str | None = None,
                    names: Sequence[str] = ("gate", "up", "down")) -> dict[str, Declared | None]:
        """A gated FFN's matrices in block ``p`` (``ffn_gate{suffix}``, ``ffn_up{suffix}`` [n_ff, hidden],
        ``ffn_down{suffix}`` [hidden, n_ff]), declared under ``names``. n_ff: the width ``keys`` imply; None: the
        gate's rows (the width no key gives)."""
        n_embd, gate = self.n_embd, f"{p}ffn_gate{suffix}.weight"
        emb = self.meta_desc(embedding_length=n_embd)
        if n_ff is None:
            n_ff = self.gguf.tensor_info(gate).shape[0]
            gate_keys, keys = emb, emb + f" and ffn_gate{suffix}'s {n_ff} rows"
        else:
            gate_keys = keys = keys or emb
        return {names[0]: self.tensor(gate, (n_ff, n_embd), gate_keys),
                names[1]: self.tensor(f"{p}ffn_up{suffix}.weight", (n_ff, n_embd), keys),
                names[2]: self.tensor(f"{p}ffn_down{suffix}.weight", (n_embd, n_ff), keys)}

    def router_tensor(self, p: str) -> Declared | None:
        """The router of MoE block ``p`` (``ffn_gate_inp``, [n_experts, hidden]), declared."""
        return self.tensor(p + "ffn_gate_inp.weight", (self.n_experts, self.n_embd),
                           self.meta_desc(expert_count=self.n_experts, embedding_length=self.n_embd))

    def shared_gate_tensor(self, p: str) -> Declared | None:
        """The shared expert's scalar gate of block ``p`` (``ffn_gate_inp_shexp``), declared: [1, hidden] as the
        converter writes it, or [hidden] as llama-quantize does (ggml_n_dims drops the 1)."""
        name, n_embd = p + "ffn_gate_inp_shexp.weight", self.n_embd
        flat = self.has(name) and tuple(self.gguf.tensor_info(name).shape) == (n_embd,)
        return self.tensor(name, (n_embd,) if flat else (1, n_embd), self.meta_desc(embedding_length=n_embd))

    def check_expert_widths(self, layer: int, n_ff: int, keys: str) -> None:
        """GGUFError naming the tensor unless every routed-expert matrix of ``layer`` is ``n_ff`` wide (gate/up rows,
        down columns), the width the metadata ``keys`` imply."""
        for name, m in self.layout[layer].items():
            rows = m.cols if name == "down" else (m.rows // 2 if name == "gate_up" else m.rows)
            if rows != n_ff:
                raise GGUFError(f"{self.gguf.path}: tensor blk.{layer}.ffn_{name}_exps.weight has experts of width "
                                f"{rows} but the metadata ({keys}) implies {n_ff}")

    def read_heads(self, value_length: bool = False) -> tuple[int, int, int]:
        """GQA attention's hyperparameters, set on the model and returned as (n_head, n_kv, head_dim): ``n_head``
        (``attention.head_count``, required), ``n_kv`` (``head_count_kv``; absent = n_head), ``head_dim``
        (``key_length``; absent = hidden / n_head) and, with ``value_length``, ``head_dim_v`` (``value_length``;
        absent = head_dim). GGUFError naming a key that is not a positive integer."""
        self.n_head = self.meta_int("attention.head_count", required=True)
        self.n_kv = self.meta_int("attention.head_count_kv", self.n_head)
        self.head_dim = self.meta_int("attention.key_length", max(self.n_embd // self.n_head, 1))
        if value_length:
            self.head_dim_v = self.meta_int("attention.value_length", self.head_dim)
        return self.n_head, self.n_kv, self.head_dim

    def check_rope_pairs(self, head_dim: int) -> None:
        """GGUFError unless ``attention.key_length`` (``head_dim``) is even: RoPE rotates pairs of dimensions."""
        if head_dim % 2:
            raise GGUFError(f"{self.gguf.path}: metadata {self.meta_desc(attention__key_length=head_dim)} must be even "
                            f"(RoPE rotates pairs of dimensions)")

    def check_heads_grouped(self, n_head: int, n_kv: int) -> None:
        """GGUFError unless ``n_head`` query heads share ``n_kv`` key/value heads evenly. Families call it after
        declaring their tensors: a wrong head count is best reported with the tensor it contradicts."""
        if n_head % n_kv:
            raise GGUFError(f"{self.gguf.path}: metadata {self.meta_desc(attention__head_count=n_head)} is not a "
                            f"multiple of {self.meta_desc(attention__head_count_kv=n_kv)}")

    def is_dense_layer(self, layer: int, n_dense: int) -> bool:
        """Whether ``layer`` is one of the first ``n_dense`` (``leading_dense_block_count``) layers, which have a dense
        FFN; GGUFError where the layer's routed experts (or their absence) contradict it."""
        dense, has = layer < n_dense, layer in self.layout
        if dense == has:
            raise GGUFError(f"{self.gguf.path}: layer {layer} "
                            + ("has routed experts" if has else f"has no routed experts (blk.{layer}.ffn_*_exps)")
                            + f" but the metadata ({self.meta_desc(leading_dense_block_count=n_dense)}) makes it "
                            + ("a dense layer" if dense else "an MoE layer"))
        return dense

    def require_moe(self, layer: int) -> None:
        """GGUFError unless ``layer`` has routed experts (families whose every layer is an MoE layer)."""
        if layer not in self.layout:
            raise GGUFError(f"{self.gguf.path}: layer {layer} has no routed experts (blk.{layer}.ffn_*_exps); every "
                            f"{self.gguf.arch} layer is an MoE layer")

    def check_expert_shapes(self, n_embd: int) -> None:
        """Each layer's routed-expert matrices against ``embedding_length`` and each other."""
        key = self._key("embedding_length")
        for layer, mats in self.layout.layers.items():
            for name, m in mats.items():
                want_rows, want_cols = (n_embd, None) if name == "down" else (None, n_embd)
                if want_cols is not None and m.cols != want_cols or want_rows is not None and m.rows != want_rows:
                    exp = [m.n_experts, want_rows or m.rows, want_cols or m.cols]
                    raise GGUFError(f"{self.gguf.path}: tensor blk.{layer}.ffn_{name}_exps.weight has shape "
                                    f"{[m.n_experts, m.rows, m.cols]} but the metadata ({key}={n_embd}) "
                                    f"implies {exp}")
            gate = mats.get("gate") or mats.get("up")
            n_ff = gate.rows if gate is not None else (mats["gate_up"].rows // 2 if "gate_up" in mats else None)
            down = mats.get("down")
            if down is not None and n_ff is not None and down.cols != n_ff:
                raise GGUFError(f"{self.gguf.path}: tensor blk.{layer}.ffn_down_exps.weight has rows of "
                                f"{down.cols} but the layer's gate/up experts have {n_ff} outputs")

    # --- weights ------------------------------------------------------------------------------
    def weight(self, name: str) -> Weight:
        w = Weight(self.gguf, self.gguf.tensor_info(name), self.device, self.opts.expand_dense,
                   blocks=self.use_blocks, gpu=self.use_triton)
        self.dense_bytes += w.nbytes
        return w

    def lookup_table(self, name: str) -> Weight:
        """An embedding table read by rows (``rows_of``) only: on a CPU device, in its file format and not
        expanded, it stays in a memory map of the file, so only the rows of the tokens seen become resident
        (page cache, which a memory cap can reclaim); otherwise as :meth:`weight`. A table that is also the output
        matrix (tied embeddings) is read whole every token: load it with :meth:`weight`."""
        info = self.gguf.tensor_info(name)
        if self.device.type != "cpu" or self.opts.expand_dense or name not in self.mapped_tables():
            return self.weight(name)
        w = Weight(self.gguf, info, self.device, False, blocks=self.use_blocks, mapped=True)
        if w.dense is not None:  # F32: dequantized, a private copy
            self.dense_bytes += w.nbytes
        else:
            self.gguf.advise_random(info)  # a row's fault reads its page, not a readahead window of other rows
        return w

    def dense_estimate(self, mapped: bool = True) -> int:
        """Bytes the dense weights will hold once loaded, from the tensor table alone (``inspect --mem``): every
        tensor the forward pass reads but the routed experts, float32 where expanded or F32, less the embedding
        tables :meth:`lookup_table` leaves in the file map (not an F32 table: that one is copied)."""
        total = 0
        mapped = (set(self.mapped_tables()) if mapped and self.device.type == "cpu" and not self.opts.expand_dense
                  else set())
        for name, info in self.gguf.tensors.items():
            block = BLOCK_TENSOR.match(name)
            if (EXPERT_TENSOR.match(name) or (block and int(block.group(1)) >= self.n_layers)
                    or (name in mapped and info.ggml_type != 0)):
                continue
            total += 4 * math.prod(info.shape) if self.opts.expand_dense or info.ggml_type == 0 else info.n_bytes
        return total

    def mapped_tables(self) -> list[str]:
        """Tensors loaded with :meth:`lookup_table` (subclasses list their row-lookup tables)."""
        return ["token_embd.weight"] if self.has("output.weight") else []

    @staticmethod
    def check_room(cache: Any, start: int, n_tok: int) -> int:
        """The end position ``start + n_tok``; ValueError when the cache's ``n_ctx`` cannot hold it."""
        end = start + n_tok
        if end > cache.n_ctx:
            raise ValueError(f"context full: {end} tokens > n_ctx {cache.n_ctx}")
        return end

    def norm(self, name: str) -> torch.Tensor:
        """A norm vector as float32 [n] on the device."""
        return self.weight(name).float().reshape(-1)

    def dense_float(self, name: str) -> torch.Tensor:
        """A whole tensor as float32 [shape] on the device, counted in ``dense_bytes`` at 4 bytes a value."""
        w = self.weight(name)
        t = w.float()
        self.dense_bytes += t.numel() * 4 - w.nbytes
        return t

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def check_expert_types(self) -> None:
        """GGUFError naming the file and tensor for the first routed-expert tensor of a type moestream cannot
        compute (every MoE layer of the file, as the expert store is made for all of them)."""
        for name, info in self.gguf.tensors.items():
            if EXPERT_TENSOR.match(name):
                check_computable(info)

    def check_dense_types(self) -> None:
        """What loading the weights refuses, from the tensor table alone (``inspect``): GGUFError for the first
        dense tensor the forward pass reads (every tensor but the routed experts and the blocks at or past
        ``self.n_layers``, such as MTP blocks, which are not run) whose ggml type moestream cannot compute."""
        for name, info in self.gguf.tensors.items():
            block = BLOCK_TENSOR.match(name)
            if EXPERT_TENSOR.match(name) or (block and int(block.group(1)) >= self.n_layers):
                continue
            check_computable(info)

    # --- expert store ---------------------------------------------------------------------------
    def default_ctx(self) -> int:
        """The context a budget reserves KV for when none is given: the trained context, at most 4096."""
        return min(self.n_ctx_train, 4096)

    def scratch_estimate(self, n_ctx: int, ubatch: int = 128, logits_rows: int = 1) -> int:
        """budget.scratch_bytes for this model's shapes."""
        from ..budget import scratch_bytes

        n_embd = int(self.gguf.arch_get("embedding_length", required=True))
        heads = self.gguf.arch_get("attention.head_count", 1)
        n_head = max(heads) if isinstance(heads, (list, tuple)) else int(heads)
        m = self.layout[self.layout.moe_layers[0]]
        n_ff = m["gate_up"].rows // 2 if "gate_up" in m else m["down"].cols
        vocab = self.gguf.tensor_info("token_embd.weight").shape[0]
        return scratch_bytes(n_ctx=n_ctx, ubatch=ubatch, n_embd=n_embd, n_vocab=vocab, n_head=n_head,
                             top_k=self.top_k, n_ff=n_ff, logits_rows=logits_rows)

    def plan_memory(self, opts: LoadOptions, n_ctx: int | None = None, logits_rows: int = 1,
                    loaded: bool = True, ubatch: int = 128, gpu: bool | None = None,
                    n_seqs: int = 1):  # noqa: ANN201 - MemoryPlan
        """The memory plan for ``opts`` (its ``mem`` or the auto budget) at a context of ``n_ctx`` tokens (None:
        ``opts.n_ctx``, else :meth:`default_ctx`) for each of ``n_seqs`` KV caches (serve -np N: one per slot).
        ``loaded``: the dense weights are loaded (their bytes are known and in this process's resident memory);
        else they are estimated from the tensor table.
        ConfigError naming the file and the smallest budget that works when top-k slots per layer do not fit."""
        from ..budget import cuda_host_growth, gpu_budget, plan_pools, process_rss, resolve_budget

        n_ctx = n_ctx or opts.n_ctx or self.default_ctx()
        cuda = self.device.type == "cuda" if gpu is None else gpu
        dense = self.dense_bytes if loaded else self.dense_estimate(mapped=not cuda)
        kv, scratch = n_seqs * self.cache_bytes(n_ctx), self.scratch_estimate(n_ctx, ubatch + n_seqs - 1, logits_rows)
        layers = self.layout.moe_layers
        direct, align = StreamingStore.read_mode(self.layout, opts.direct_io)  # O_DIRECT slots are padded
        extra: dict[str, Any] = {}
        if cuda and opts.pool == "device":  # the pools, dense weights, KV cache and activations live in VRAM
            budget, source = gpu_budget(opts.gpu_mem, opts.gpu_mem_source, str(self.device) if gpu is None else "cuda")
            process = 0
            strict = opts.gpu_mem is not None
            extra = {"option": "--gpu-mem", "kind": "GPU memory"}
            scratch += self._device_plan_scratch(opts, direct, align)
        else:
            budget, source = resolve_budget(opts.mem, opts.mem_source)
            process = max(process_rss(self.gguf.paths) - (dense if loaded and not cuda else 0), 0)
            strict = opts.mem is not None
            if cuda:  # --pool host: pinned host pools; dense weights, KV cache and activations are in VRAM
                dense, kv, scratch = 0, 0, 0
                process += cuda_host_growth()
            extra = {"tier": self.host_tier_bytes(opts)}  # the host tier is host memory too
        plan = plan_pools(budget, source, process=process, dense=dense, kv=kv, n_ctx=n_ctx, scratch=scratch,
                          slot_bytes={la: StreamingStore.slot_bytes(self.layout, la, direct, align) for la in layers},
                          n_experts={la: self.layout.n_experts(la) for la in layers}, top_k=self.top_k,
                          what=self.gguf.path, strict=strict, n_seqs=n_seqs, **extra)
        if not cuda:  # resident mode addresses the experts in the file's map: no pools, no reads, no slot tables
            plan.resident_hint = "--moe-stream off reads them in place"
        if cuda and opts.pool == "host":
            plan.notes.append("--pool host: the process part counts what CUDA will add on the host (its context, "
                              "the kernels' modules); dense weights, KV cache and scratch are in GPU memory")
        return plan

    def host_tier_bytes(self, opts: LoadOptions) -> int:
        """Bytes of host memory the ``--host-cache`` tier of ``opts`` will hold: at most every expert of every MoE
        layer (HostTier's rows, O_DIRECT padding included), 0 without a tier."""
        if not opts.host_cache:
            return 0
        direct, align = StreamingStore.read_mode(self.layout, opts.direct_io)
        every = sum(self.layout.n_experts(la) * StreamingStore.slot_bytes(self.layout, la, direct, align)
                    for la in self.layout.moe_layers)
        return min(opts.host_cache, every)

    def host_side_lines(self, opts: LoadOptions) -> list[str]:
        """``inspect --device cuda --mem SIZE``'s host lines when the pools are in GPU memory (``--pool device``,
        the default): the process (measured here, plus what CUDA will add on the host: budget.cuda_host_growth) and
        the host tier (:meth:`host_tier_bytes`) against ``opts.mem``; the pools, dense weights, KV cache and scratch
        are in GPU memory (the ``--gpu-mem`` plan). ``run`` with these options does not size anything from
        ``--mem``: this says whether the host side fits in it."""
        from ..budget import GiB, _size_text, cuda_host_growth, process_rss

        process = process_rss(self.gguf.paths) + cuda_host_growth()
        tier = self.host_tier_bytes(opts)
        used = process + tier
        left = opts.mem - used
        return [
            f"{'host memory':<15} --mem: {opts.mem / GiB:.3f} GiB (--pool device: the pools, dense weights, KV cache "
            f"and scratch are in GPU memory, the plan below)",
            f"  process       {process / GiB:.3f} GiB (interpreter, torch, kernels, tokenizer measured here, and what "
            f"CUDA adds on the host)",
            *([f"  host tier     {tier / GiB:.3f} GiB (--host-cache, pinned)"] if tier else []),
            f"  left          {left / GiB:.3f} GiB" if left >= 0 else
            f"  over          {-left / GiB:.3f} GiB: process + host tier need {used / GiB:.3f} GiB (a smaller "
            f"--host-cache, or --mem {_size_text(used)} or more)",
        ]

    def _device_plan_scratch(self, opts: LoadOptions, direct: bool, align: int) -> int:
        """Bytes of the device-planned step's scratch rows (experts/devplan.py: top-k experts' matrices per
        (matrix, stride) group of the pools) and of the prompt chunks' scratch (devplan.PrefillScratch) when
        ``opts``' host tier will hold every expert, else 0. The same test as ``StreamingStore._plannable`` on the
        tier's size."""
        if not opts.host_cache:  # before importing devplan (and Triton)
            return 0
        from ..experts import devplan
        from ..experts.pool import slot_stride

        if not devplan.enabled():
            return 0
        strides = {la: {name: -(-slot_stride(m, align if direct else 1) // 64) * 64 for name, m in mats.items()}
                   for la, mats in self.layout.layers.items()}
        per_slot = sum(st for sts in strides.values() for st in sts.values())
        if opts.host_cache // max(per_slot, 1) < max(self.layout.n_experts(la) for la in strides):
            return 0
        groups = {(name, st) for sts in strides.values() for name, st in sts.items()}
        n_exp = max(self.layout.n_experts(la) for la in strides)
        return self.top_k * sum(st for _, st in groups) + devplan.prefill_scratch_bytes(strides, n_exp)

    def make_store(self, opts: LoadOptions, n_ctx: int | None = None, logits_rows: int = 1,
                   ubatch: int = 128, plan: Any = None, n_seqs: int = 1) -> ExpertStore:
        """A new expert store for ``opts``, not set on the model (:func:`load_model` sets the first; verify makes a
        second). With a budget its pools have ``plan``'s slots (a budget.MemoryPlan, kept in ``memory_plan``), or
        those of :meth:`plan_memory` for ``n_seqs`` KV caches of ``n_ctx`` made now when ``plan`` is None."""
        self.check_expert_types()
        if not opts.moe_stream:
            return ResidentStore(self.gguf, self.layout, device=self.device, pool=opts.pool)
        if opts.slots is not None:
            slots: int | dict[int, int] = opts.slots
        else:
            self.memory_plan = plan or self.plan_memory(opts, n_ctx, logits_rows, ubatch=ubatch, n_seqs=n_seqs)
            slots = self.memory_plan.slots
        return StreamingStore(self.gguf, self.layout, slots, self.top_k, opts.io_threads, opts.policy,
                              direct_io=opts.direct_io, device=self.device, pool=opts.pool,
                              host_cache=opts.host_cache)

    def set_routing(self, routing: Callable | None) -> None:
        """Route every MoE layer through ``routing(layer, ids [tokens, top_k] int64) -> ids`` of the same shape
        instead of the router's top-k ids (the router's weights are kept; e.g. experts/synthetic.py); None: the
        router's own."""
        self.routing = routing
        for b in getattr(self, "blocks", ()):
            if isinstance(b, dict) and "moe" in b:
                b["moe"].routing = routing
    def moe(self, layer: int, **kw: Any) -> MoE:
        """The shared MoE layer for routed-expert ``layer`` of this model: experts addressed through the model's
        current store (resident or streaming, swapped by :meth:`set_store`), computed by the kernels the options
        chose, reads overlapped with compute as ``opts.overlap`` says. ``kw``: what the architecture adds
        (``act``, ``bias``; see :class:`MoE`)."""
        return MoE(layer, self.layout, lambda: self.store, blocks=self.use_blocks, gpu=self.use_triton,
                   overlap_of=lambda: self.opts.overlap, **kw)

    def begin_layer(self, layer: int, x: torch.Tensor) -> None:
        """A model file calls this at the start of every layer with x [T, hidden] float32, the residual stream
        entering it (the previous layer's output, or the embeddings). It runs the router lookahead: when
        ``opts.prefetch`` is on, the store streams and ``layer`` is an MoE layer, its router predicts the experts
        (:meth:`predict`: the arch's own routing code, one [T, hidden] x [hidden, n_experts] matmul) and
        ``store.prefetch`` starts reading those not in a slot while the layer's attention runs. Reads are issued for
        a decode step (T = 1) and for a prefill chunk whose predicted distinct experts fit in half the layer's pool
        (more would evict each other, or the tiles' experts, before use); otherwise only the prediction is recorded
        (for the recall statistic). Never changes a value the forward pass computes."""
        store = self.store
        if not (self.opts.prefetch and store.streaming and layer in self.layout):
            return
        one = x.shape[0] == 1  # a decode step: its reads gated by what such reads were worth (prefetch's gate)
        if one and not store.look_wanted(1, self.top_k, layer):
            return
        experts = list(dict.fromkeys(self.predict(layer, x).reshape(-1).tolist()))  # first use first: top-k order
        read = one or len(experts) <= store.capacity(layer) // 2
        store.prefetch(layer, experts, read=read, gate=one)

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids [T, top_k] int64 that MoE ``layer``'s router picks for x [T, hidden] float32 taken
        as that layer's input residual stream (the real routing's code on x: :meth:`route_layer`)."""
        return self.route_layer(layer, x).ids

    def set_store(self, store: ExpertStore) -> None:
        """Swap the expert store (e.g. resident -> streaming for the identity check)."""
        self.store = store

    # --- what a family provides to the step runner (runtime/runner.py) ---------------------------
    n_vocab: int

    def new_cache(self, n_ctx: int) -> object:
        """A cache for ``n_ctx`` positions (:meth:`make_cache`); on CUDA at the last cache's addresses where that one
        is no longer used (layers.KVArena), so the decode graphs captured on it serve the new one."""
        if self.device.type != "cuda":
            return self.make_cache(n_ctx)
        if getattr(self, "_kv_arena", None) is None:
            self._kv_arena = KVArena()
        return self._kv_arena.get(n_ctx, self.make_cache)

    def make_cache(self, n_ctx: int) -> object:
        """The family's cache for ``n_ctx`` positions: an object with ``n_ctx`` and per-layer tensors (``k``, ``v``
        [n_ctx, ...] rows; any recurrent state), read and written through the runner's Step. Default: GQA's
        :class:`KVCache`, float32 [n_ctx, n_kv, head_dim] keys and [n_ctx, n_kv, head_dim_v] values per layer
        (head_dim_v: ``read_heads(value_length=True)``'s, else head_dim)."""
        return KVCache(self.n_layers, n_ctx, self.n_kv, self.head_dim, getattr(self, "head_dim_v", self.head_dim),
                       self.device)

    def cache_bytes(self, n_ctx: int) -> int:
        """Bytes ``new_cache(n_ctx)`` allocates, computed without allocating (checked before a run); default: the
        default :meth:`make_cache`'s."""
        return 4 * self.n_layers * n_ctx * self.n_kv * (self.head_dim + getattr(self, "head_dim_v", self.head_dim))

    def forward(self, tokens: torch.Tensor, start: int, cache: object, logits_all: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start..start+T-1. Returns float32 logits [T, n_vocab] when
        ``logits_all`` else [1, n_vocab] for the last token (the step runner: ``self.runner.forward``)."""
        return self.runner.forward(tokens, start, cache, logits_all)

    def embed(self, step: Any) -> torch.Tensor:
        """The step's tokens (``step.tokens`` int64 [T]) -> the residual stream entering layer 0, float32
        [T, hidden]. Default: rows of ``embd``."""
        return self.embd.rows_of(step.tokens)

    def mix(self, i: int, x: torch.Tensor, step: Any) -> torch.Tensor:
        """Layer i's attention (or recurrent mixer) on x float32 [T, hidden], its residual added -> [T, hidden].
        Positions and caches only through ``step`` (runtime/step.py)."""
        raise NotImplementedError

    def route_layer(self, i: int, x: torch.Tensor) -> Route:
        """MoE layer i's router on x float32 [T, hidden] (the mixer's output) -> :class:`Route`. Default: h =
        RMSNorm of x with the block's ``ffn_norm``, ids and weights from ``self.gate(block, h)``."""
        b = self.blocks[i]
        h = rms_norm(x, b["ffn_norm"], self.eps)
        ids, w = self.gate(b, h)
        return Route(h, ids, w)

    def gate(self, b: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``b``'s router on its FFN input h float32 [T, hidden] -> (ids int64 [T, top_k] real expert ids,
        weights float32 [T, top_k])."""
        raise NotImplementedError

    def has_shared(self, i: int) -> bool:
        """Whether MoE layer i has a shared expert (or dense FFN) beside its routed ones (:meth:`shared`)."""
        return False

    def shared(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """MoE layer i's shared expert: x the layer's residual stream, h its routed experts' input (float32
        [T, hidden]) -> float32 [T, hidden]; run while the routed experts' reads are in flight."""
        return None

    def combine(self, i: int, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None,
                step: Any) -> torch.Tensor:
        """MoE layer i's output from its residual stream x, the routed experts' sum and the shared expert's output
        (None without one), float32 [T, hidden]. Default: x + routed (+ shared)."""
        return x + routed if shared is None else x + routed + shared

    def dense(self, i: int, x: torch.Tensor, step: Any) -> torch.Tensor:
        """Layer i without routed experts: its FFN on x float32 [T, hidden], residual added. Default: SwiGLU of
        the block's ``gate``/``up``/``down`` on the ``ffn_norm``-normed x."""
        b = self.blocks[i]
        return x + swiglu_ffn(b["gate"], b["up"], b["down"], rms_norm(x, b["ffn_norm"], self.eps))

    def head(self, x: torch.Tensor, step: Any) -> torch.Tensor:
        """x float32 [R, hidden], the rows whose logits are wanted -> logits float32 [R, vocab]: RMSNorm with
        ``out_norm`` (epsilon ``self.eps``), then ``output``."""
        return self.output.linear(rms_norm(x, self.out_norm, self.eps))

    def fast_layer(self, i: int) -> Any:
        """How MoE layer i's ``mix`` and routed/shared experts compute a CPU decode step, as a
        runtime/fastdecode.FastLayer, for the fast decode step (a few C calls per layer, the eager step's bits); None
        (the default): the eager step. Only a family class that defines it itself is asked (a subclass that changes
        the layers must define it again)."""
        return None

    def experts(self, i: int) -> MoE:
        """MoE layer i's routed-expert block (experts/moe.py)."""
        return self.blocks[i]["moe"]

    def begin_step(self, step: Any) -> None:
        """Called before a step's layers run (a family whose cache has host-side state checks it here)."""

    def end_step(self, step: Any) -> None:
        """Called after a step's layers ran."""


def _triton_available() -> bool:
    try:
        from ..gpu import tkernels
    except ImportError:
        return False
    return tkernels.available()


def open_model(path: str | GGUFModel, opts: LoadOptions | None = None) -> MoEModel:
    """The architecture of ``path`` (a GGUF file, any part of a split model, or an open :class:`GGUFModel`) built
    from its metadata and tensor table alone: hyperparameters, shapes and ggml types checked as a load checks them,
    no weight read (``opts`` with ``metadata_only``). What the context and the memory plan are computed from before
    :func:`load_model` reads anything. GGUFError / ConfigError as :func:`load_model`."""
    opts = opts or LoadOptions()
    gguf = path if isinstance(path, GGUFModel) else GGUFModel(path)
    return architecture_of(gguf)(gguf, dataclasses.replace(opts, metadata_only=True))


def load_model(path: str | GGUFModel | MoEModel, opts: LoadOptions | None = None, n_ctx: int | None = None,
               ubatch: int = 128, logits_rows: int = 1, n_seqs: int = 1) -> MoEModel:
    """Open ``path`` (a GGUF file, any part of a split model, an open :class:`GGUFModel`, or the shape
    :func:`open_model` made of one) and build its architecture with its weights and its expert store.

    One lifecycle for every way the pools are sized: ``opts.slots`` (or resident) makes the store at once; with a
    memory budget (streaming without ``slots``: ``--mem``, ``--gpu-mem`` or the auto budget) the memory plan for a
    context of ``n_ctx`` tokens (None: ``opts.n_ctx``, else the model's default) is made from the tensor table
    FIRST, so a budget that cannot hold top-k slots per layer is refused before any weight is read; the store is
    then made with that plan's slots (``model.memory_plan``): the numbers ``inspect --mem`` prints for the same
    options and context. The plan's ``process`` term is this process measured before the load and its ``dense``
    term the tensor table's bytes (the load itself adds a few MiB: 5.8 MiB measured on the embedded model).
    ``ubatch`` / ``logits_rows``: the prefill chunk and the logits rows the scratch estimate is for; ``n_seqs``: the
    KV caches of ``n_ctx`` the plan counts (serve -np N: one per slot).
    Raises GGUFError for bad files and unsupported architectures, ConfigError for bad options or a budget too
    small (naming the smallest that works).
    """
    opts = opts or LoadOptions()
    if isinstance(path, MoEModel):
        shape, gguf = (path if path.opts.metadata_only else None), path.gguf
    else:
        gguf, shape = (path if isinstance(path, GGUFModel) else GGUFModel(path)), None
    if opts.metadata_only:
        return shape or architecture_of(gguf)(gguf, opts)
    plan = None
    if opts.budgeted:  # the plan before the load: refused here, before a weight is read
        plan = (shape or open_model(gguf, opts)).plan_memory(opts, n_ctx, logits_rows, loaded=False, ubatch=ubatch,
                                                             n_seqs=n_seqs)
    model = architecture_of(gguf)(gguf, opts)
    if model.store is None:
        model.store = model.make_store(opts, plan=plan)
    return model


def architecture_of(gguf: GGUFModel) -> type[MoEModel]:
    """The model class of ``gguf.arch``; GGUFError naming the file and listing the supported ones otherwise.

    Every module of the ``moestream.models`` package is imported once (each registers its architectures with
    :func:`register`), so adding an architecture is adding one module."""
    _import_architectures()
    cls = ARCHITECTURES.get(gguf.arch)
    if cls is None:
        raise GGUFError(f"{gguf.path}: architecture {gguf.arch!r} is not supported; supported: "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return cls


#: modules of moestream.models that hold no architecture
_NOT_ARCHITECTURES = frozenset({"base", "layers", "routing"})


def _import_architectures() -> None:
    import importlib
    import pkgutil

    from .. import models

    for info in pkgutil.iter_modules(models.__path__):
        if info.name not in _NOT_ARCHITECTURES and not info.name.startswith("_"):
            importlib.import_module(f"{models.__name__}.{info.name}")
