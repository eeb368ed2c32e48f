"""The values of the options and their one check, for every command and the server: :class:`LoadOptions` (how a
model is loaded), :class:`SamplingParams` (how tokens are drawn), the device and pool names. Imports no torch
(only :func:`resolve_device` does, when a GPU is asked for), so a refused value is answered before torch loads
(docs/start-time.md). Each check raises errors.OptionError naming the field; a command says its own flag for it
(options.flag_errors for the CLI, server.option_error for a request's key)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import OptionError, shown


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """llama.cpp-style sampling. temp <= 0 is greedy. top_k 0 or -1, top_p 1, min_p 0 disable a filter;
    the most likely token always survives the filters. seed None or -1: a random seed.

    Order (as llama.cpp's default chain): ``logit_bias`` (token id -> a number added to its logit; ``-inf`` bans
    it), the penalties (:func:`penalize`, greedy included), a grammar's mask (:class:`Sampler`'s ``constraint``),
    top-k, top-p, min-p, then temperature, then a draw. The penalties look at the last ``repeat_last_n`` tokens
    the sampler was given (:meth:`Sampler.accept`: the prompt, then each sampled token; 0: off, -1: all);
    repeat_penalty 1 and presence/frequency 0 turn them off (the default).
    The one check of these values for every command and the server (:meth:`__post_init__`): OptionError naming
    the field and the value for a temperature or penalty that is not a finite number, a top-k that is not an
    integer >= -1, top-p/min-p not a number in [0, 1], a seed not an integer in [-1, 2^63), a repeat_penalty <= 0
    or a repeat_last_n below -1, a logit_bias that is not a map of token ids >= 0 to finite numbers or -inf
    (:meth:`check_vocab` checks the ids against a vocabulary). Numbers are stored as float/int.
    """

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def penalized(self) -> bool:
        """Whether the penalties change anything (llama.cpp's early return)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    def __post_init__(self) -> None:
        if not (_is_number(self.temp) and math.isfinite(self.temp)):
            raise OptionError(f"{{temp}} must be a finite number (<= 0: greedy), got {shown(self.temp)}",
                              temp=self.temp)
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise OptionError(f"{{top_k}} must be an integer >= -1 (0 or -1: off), got {shown(self.top_k)}",
                              top_k=self.top_k)
        for name in ("top_p", "min_p"):
            v = getattr(self, name)
            if not (_is_number(v) and 0.0 <= v <= 1.0):
                raise OptionError(f"{{{name}}} must be a number in [0, 1], got {shown(v)}", **{name: v})
        if self.seed is not None and not (_is_int(self.seed) and -1 <= self.seed < 2**63):
            raise OptionError(f"{{seed}} must be -1 (random) or in [0, 2^63), got {shown(self.seed)}",
                              seed=self.seed)
        self.temp, self.top_p, self.min_p = float(self.temp), float(self.top_p), float(self.min_p)
        for name in ("repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and math.isfinite(v)):
                raise OptionError(f"{{{name}}} must be a finite number, got {shown(v)}", **{name: v})
        if self.repeat_penalty <= 0:
            raise OptionError(f"{{repeat_penalty}} must be above 0 (1: off), got {shown(self.repeat_penalty)}",
                              repeat_penalty=self.repeat_penalty)
        if not (_is_int(self.repeat_last_n) and self.repeat_last_n >= -1):
            raise OptionError(f"{{repeat_last_n}} must be -1 (all), 0 (off) or more, got {shown(self.repeat_last_n)}",
                              repeat_last_n=self.repeat_last_n)
        self.repeat_penalty = float(self.repeat_penalty)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)
        if not isinstance(self.logit_bias, dict):
            raise OptionError(f"{{logit_bias}} must map token ids to biases, got {shown(self.logit_bias)}",
                              logit_bias=self.logit_bias)
        for k, v in self.logit_bias.items():
            if not (_is_int(k) and k >= 0):
                raise OptionError(f"{{logit_bias}}: a token id must be an integer >= 0, got {shown(k)}",
                                  logit_bias=k)
            if not (_is_number(v) and (math.isfinite(v) or v == -math.inf)):
                raise OptionError(f"{{logit_bias}}: the bias of token {k} must be a finite number or -inf, got "
                                  f"{shown(v)}", logit_bias=v)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def check_vocab(self, n_vocab: int) -> None:
        """OptionError naming ``logit_bias`` when one of its token ids is not below ``n_vocab``."""
        bad = next((k for k in self.logit_bias if k >= n_vocab), None)
        if bad is not None:
            raise OptionError(f"{{logit_bias}}: token id {bad} is not in the vocabulary (0..{n_vocab - 1})",
                              logit_bias=bad)


#: --matmul modes: kernels on the ggml blocks, or dequantize-then-matmul (see LoadOptions)
MATMUL_MODES = ("blocks", "dequant")

#: where a GPU's slot pools live (LoadOptions.pool)
POOL_PLACES = ("device", "host")


def check_pool(pool: object) -> None:
    """OptionError (field ``pool``) unless ``pool`` is one of :data:`POOL_PLACES`."""
    if pool not in POOL_PLACES:
        raise OptionError(f"{{pool}}: unknown place {pool!r}; choose one of {', '.join(POOL_PLACES)}", pool=pool)


@dataclass
class LoadOptions:
    """How to load a model.

    moe_stream: stream routed experts through slot pools (True) or address them in a memory map (False).
    slots: slots per MoE layer; None: sized by a memory budget (moestream/budget.py): ``mem`` bytes in all, or
    when None the memory available at start less a margin. mem_source: how ``mem`` was given, for messages
    (e.g. ``"--mem 4GiB"``). n_ctx: the context (tokens) whose KV cache the budget reserves (None: the file's
    trained context, at most 4096). io_threads: reader threads.
    policy: slot replacement policy name. expand_dense: dequantize dense weights to float32 at load.
    overlap: compute while expert reads are in flight (the shared/dense FFN, the hits, the previous prefill
    tile; see experts/moe.py) instead of reading, then computing. device: torch device string.
    matmul: ``"blocks"`` (default): matmuls run moestream's C kernels on the file's ggml blocks, activations
    quantized to 8-bit blocks as llama.cpp's CPU backend does (moestream/kernels.py; CPU only, a CUDA device
    uses ``"dequant"``); ``"dequant"``: each weight is dequantized to float32 and multiplied by torch (exactly
    the float32 model of the dequantized weights: the oracle path).
    metadata_only: read and check the hyperparameters against the tensor table (shapes, ggml types) and stop:
    no weight is read and no expert store is made (``inspect`` uses it to refuse what ``run`` would refuse).
    prefetch: router lookahead (streaming only; ignored with ``moe_stream`` off): as soon as the residual stream
    entering an MoE layer exists, that layer's router predicts its experts and their reads start
    (:meth:`MoEModel.lookahead`); the real router still decides what is computed.
    direct_io: expert reads bypass the page cache with O_DIRECT (True), go through it (False), or None (auto,
    the default): O_DIRECT where the file system allows it. Where it refuses, reads are buffered (True: with
    a note on stderr). Ignored when ``moe_stream`` is False. See experts/pool.py StreamingStore.
    """

    moe_stream: bool = True
    slots: int | None = None
    io_threads: int = 8
    policy: str = "lfu"
    expand_dense: bool = False
    overlap: bool = True
    device: str = "cpu"
    metadata_only: bool = False
    matmul: str = "blocks"
    mem: int | None = None
    mem_source: str | None = None
    n_ctx: int | None = None
    prefetch: bool = False
    direct_io: bool | None = None
    pool: str = "device"
    gpu_mem: int | None = None
    gpu_mem_source: str | None = None
    host_cache: int = 0

    def __post_init__(self) -> None:
        """Every field checked, once, here: OptionError naming the field and its value (a command renders it in its
        own terms: cli.py with its flags). ``device`` is resolved (``auto`` -> ``cpu`` or ``cuda``)."""
        for name in ("moe_stream", "expand_dense", "overlap", "metadata_only", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{{{name}}}: expected on or off (a bool), got {shown(getattr(self, name))}",
                                  **{name: getattr(self, name)})
        from .experts.policy import check_policy
        from .experts.reader import check_io_threads

        self.device = resolve_device(self.device)
        check_pool(self.pool)
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise OptionError(f"{{direct_io}}: expected on or off, got {self.direct_io!r}", direct_io=self.direct_io)
        if self.matmul not in MATMUL_MODES:
            raise OptionError(f"{{matmul}}: unknown mode {self.matmul!r}; choose one of {', '.join(MATMUL_MODES)}",
                              matmul=self.matmul)
        check_policy(self.policy)
        check_io_threads(self.io_threads)
        for name, least in (("slots", 1), ("n_ctx", 1), ("mem", 1), ("gpu_mem", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise OptionError(f"{{{name}}} must be a positive number, got {shown(v)}", **{name: v})
        if isinstance(self.host_cache, bool) or not isinstance(self.host_cache, int) or self.host_cache < 0:
            raise OptionError(f"{{host_cache}} must be 0 (off) or a size in bytes, got {shown(self.host_cache)}",
                              host_cache=self.host_cache)
        if self.host_cache and self.prefetch:
            raise OptionError("{host_cache} and {prefetch} on cannot be combined yet (a prefetch's reads could take "
                              "host-tier rows still in use); give one of them", host_cache=self.host_cache,
                              prefetch=self.prefetch)
        if self.gpu_mem is not None and self.slots is not None and self.cuda:
            raise OptionError("{gpu_mem=} and {slots=} both size the slot pools: give one of them",
                              gpu_mem=self.gpu_mem, slots=self.slots)
        if self.mem is not None and self.slots is not None:
            raise OptionError("{mem=} and {slots=} both size the slot pools: give one of them", mem=self.mem,
                              slots=self.slots)

    @property
    def cuda(self) -> bool:
        """Computes on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def budgeted(self) -> bool:
        """The pools are sized by a memory budget (streaming, no --slots)."""
        return self.moe_stream and self.slots is None


DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str) -> str:
    """A device name: "cpu", "cuda" (or "cuda:N"), or "auto" (CUDA when torch sees a GPU, else the CPU) -> the
    torch device string. OptionError (field ``device``) for another name, or CUDA asked for where torch sees no GPU
    (a CPU build of torch, no driver, or no device)."""
    name = str(name).strip().lower()
    if name == "cpu":
        return name
    import torch  # only where a GPU is asked for: the CPU's options are checked without it

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
            raise OptionError(f"{{device=}}: {why} (torch {torch.__version__}); leave {{device}} out to compute on "
                              f"the CPU", device=name)
        idx = int(name[5:]) if ":" in name else 0
        if idx >= torch.cuda.device_count():
            raise OptionError(f"{{device=}}: torch sees {torch.cuda.device_count()} CUDA device(s)", device=name)
        return name
    raise OptionError(f"{{device}}: unknown device {name!r}; choose one of {', '.join(DEVICES)} (or cuda:N)",
                      device=name)
