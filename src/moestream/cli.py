"""The ``moestream`` command: run, inspect, verify, bench, trace, serve, replay.

Errors that a user can cause (bad file, bad option, read failure) print one line on stderr and exit 1;
bad command-line syntax exits 2 (argparse), and so does a trace file that ``replay`` cannot read.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import types
from collections.abc import Callable, Iterator

from . import version
from .chat_templates import CHAT_TEMPLATES
from .limits import MAX_IO_THREADS, MAX_TOKENS, check_tokens
from .llamaflags import (
    LOG_REFUSED,
    REFUSED,
    RUN_REFUSED,
    SERVE_REFUSED,
    FlagRefused,
    Parser,
    add_refused,
    gpu_layers_device,
)
from .options import default_threads, max_threads, model_path, set_compute_threads
from .output import write_stdout

GiB = 2**30
DEFAULT_PROMPT = "The history of the printing press"
#: Largest -f prompt read: 256 MiB of text is millions of tokens past any trained context; it also bounds what
#: a device such as /dev/zero makes us read.
MAX_PROMPT_FILE_BYTES = 256 << 20
THREADS_HELP = ("compute threads (default: the free CPUs when the command starts -- the CPUs this process may use, "
                "at most the physical cores, less those other jobs keep busy by the run queue and the 1-minute load "
                "average -- at least 1; at most 4 x the CPUs)")

TRACE_HELP = ("write a per-token trace to FILE (JSON lines: a header, then per token its text, phase, time, expert "
              "hits/misses per layer, bytes read, IO wait, RSS, CPU %%, and on CUDA GPU load, memory and power; see "
              "moestream/runtrace.py); moestream replay FILE plays it")
DIRECT_IO_HELP = ("read experts with O_DIRECT, bypassing the page cache, so that the slot pools are the only cache "
                  "(default: on where the file system allows it; where it refuses, e.g. tmpfs, reads go through "
                  "the page cache, with a note when on was asked for); off: buffered reads")


def _on_off(v: str) -> bool:
    """``on`` / ``off`` (any case) as the docs spell them; anything else (yes, 1, true, ...) is refused."""
    w = v.strip().lower()
    if w == "on":
        return True
    if w == "off":
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


MEM_HELP = ("the memory moestream may use in all, e.g. 4GiB (K/M/G/T = KiB/MiB/GiB/TiB, KB/MB/GB/TB powers of 10, no "
            "unit = bytes): the slot pools get what the process, the dense weights, the KV cache for the context "
            "and scratch leave, as many slots per layer as fit (at least top-k; every expert when all fit); "
            "default: the memory available at start less a 10%% margin (at least 256 MiB)")


#: run's own flags that REFUSED lists for the other commands (constrained sampling)
RUN_FLAGS = ("--grammar", "--grammar-file", "-j", "--json-schema", "--json-schema-file", "-l", "--logit-bias")


def _add_model_args(p: argparse.ArgumentParser, stream_opts: bool = True) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file (or first part of a split model); "
                   "default: the embedded tiny Qwen3-MoE")
    if stream_opts:
        p.add_argument("--mem", default=None, metavar="SIZE", help=MEM_HELP)
        p.add_argument("--slots", type=int, default=None, help="expert slots per MoE layer (instead of --mem: "
                       "at least top-k; default: as many as the memory budget holds)")
        p.add_argument("--io-threads", type=int, default=8, help=f"expert read threads (default 8, at most "
                       f"{MAX_IO_THREADS})")
        p.add_argument("--policy", default="lfu", type=str.lower,
                       help="slot replacement policy: lfu (default) or lru")
        p.add_argument("--overlap", type=_on_off, default=True, metavar="on|off",
                       help="hide expert reads behind the shared/dense FFN, the hits' matmuls and the "
                       "previous prefill tile (default on; off: read, then compute)")
        p.add_argument("--prefetch", type=_on_off, default=False, metavar="on|off",
                       help="router lookahead: start reading the experts the next MoE layer's router predicts "
                       "from the current hidden state (default off: on the random-weight models measured it "
                       "predicted 47%% and cost more IO than it hid; decode steps, and prefill chunks whose "
                       "predicted experts fit in half the pool; ignored with --moe-stream off)")
        p.add_argument("--direct-io", type=_on_off, default=None, metavar="on|off", help=DIRECT_IO_HELP)
    p.add_argument("--device", default="cpu", action=_Device, metavar="cpu|cuda|auto",
                   help="where the model computes (default cpu; auto: CUDA when torch sees a GPU). On CUDA the "
                   "dense weights, KV cache and slot pools live in GPU memory and the matmuls run Triton kernels "
                   "on the file's ggml blocks")
    if stream_opts:
        p.add_argument("--gpu-mem", default=None, metavar="SIZE",
                       help="CUDA: the GPU memory moestream may use in all (dense weights, KV cache, scratch, slot "
                       "pools), sized like --mem; default: the GPU's free memory at start less 10%%")
        p.add_argument("--host-cache", default=None, metavar="SIZE",
                       help="a second-level expert cache of SIZE in host memory (pinned on CUDA) below the slot "
                       "pools: a miss it holds is copied from RAM (PCIe speed on a GPU) instead of read from the "
                       "disk (LFU, as the pools; at least twice the pools' slots per layer; default off)")
        p.add_argument("--pool", default=None, type=str.lower, metavar="device|host",
                       help="CUDA: where the slot pools live: device (default: GPU memory, misses read into a "
                       "small pinned staging ring and copied on a copy stream) or host (pinned host memory that "
                       "the reads land in and the GPU kernels address directly, no copy: the unified-memory mode)")
    _add_gpu_layers(p)
    p.add_argument("-t", "--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--expand-dense", action="store_true",
                   help="dequantize dense weights to float32 at load (more memory: see inspect)")
    p.add_argument("--matmul", default="blocks", type=str.lower, metavar="blocks|dequant",
                   help="blocks (default): moestream's C kernels on the file's ggml blocks, activations quantized "
                   "to 8 bits as llama.cpp does (compiled at first use); dequant: dequantize each weight to "
                   "float32 and multiply with torch (slow; the float32 model of the dequantized weights)")
    p.add_argument("-ub", "--ubatch", "--ubatch-size", type=int, default=128,
                   help="prefill chunk size in tokens (default 128)")
    add_refused(p, REFUSED, keep=RUN_FLAGS if p.prog.endswith(" run") else ())
    add_refused(p, LOG_REFUSED)


class _DeviceFlag(argparse.Action):
    """``-ngl N``: stores the device it means (llamaflags.gpu_layers_device) and, for messages about it, the flag
    as typed (``args.device_flag``, e.g. ``("-ngl", "99")``); ``--device`` (:class:`_Device`) clears it, so the
    last of the two given wins for the message as for the value."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204
        try:
            device = gpu_layers_device(values)
        except argparse.ArgumentTypeError as e:  # one line, as a value another option's type refuses
            raise FlagRefused(f"{parser.prog}: error: {argparse.ArgumentError(self, str(e))}") from None
        setattr(namespace, self.dest, device)
        namespace.device_flag = (option_string, values)


class _Device(argparse.Action):
    """``--device NAME`` (lower-cased); clears what ``-ngl`` recorded (:class:`_DeviceFlag`)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204
        setattr(namespace, self.dest, values.lower())
        namespace.device_flag = None


def _add_gpu_layers(p: argparse.ArgumentParser) -> None:
    """llama.cpp's ``-ngl N``, as a --device (the last of the two given wins)."""
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="device", action=_DeviceFlag,
                   default=argparse.SUPPRESS, metavar="N", help="llama.cpp's flag, as a --device: 0 = cpu, more "
                   "(or all) = cuda (moestream computes the whole model on one device), auto or -1 = auto")


def _add_chat_template(p: argparse.ArgumentParser) -> None:
    """``--chat-template NAME|JINJA``, ``--chat-template-file FILE`` and ``--jinja`` (llama.cpp's)."""
    p.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help=f"use this chat template instead of the file's: one of {', '.join(CHAT_TEMPLATES)} "
                   "(llama.cpp's built-in names), or a Jinja template as text")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="use the Jinja chat template in FILE instead of the file's")
    p.add_argument("--jinja", action="store_true", help="accepted for llama.cpp's sake: chat templates are always "
                   "rendered with Jinja")


def _open(args: argparse.Namespace, moe_stream: bool, streams_later: bool = False,
          before_torch: Callable | None = None):
    """``(shape, opts)``: the file's architecture from its tensor table, no weight read yet (models.base.open_model;
    the context and the memory plan are computed from it before :func:`_load`), and its LoadOptions
    (options.load_options); ``streams_later``: verify, whose resident model is run streaming too (the streaming
    options are used, so no note says they are ignored); ``before_torch``: called with the open file
    (gguf.GGUFModel) before torch is imported."""
    from .options import load_options
    _check_common(args)
    opts = load_options(args, moe_stream)  # every load option checked before torch is imported
    for ignored in _ignored_options(args, opts, moe_stream or streams_later):
        print(f"moestream: note: {ignored}", file=sys.stderr, flush=True)
    path = model_path(args)
    if before_torch is not None:
        from .gguf import GGUFModel
        path = GGUFModel(path)
        before_torch(path)
    from .models.base import open_model
    threads = args.threads if args.threads is not None else default_threads()
    set_compute_threads(threads, getattr(args, "matmul", "blocks"))
    return open_model(path, opts), opts


def _load(args: argparse.Namespace, shape, opts, n_ctx: int, n_seqs: int = 1):  # noqa: ANN001, ANN202
    """The model of :func:`_open`'s ``shape`` with its weights and expert store, for ``n_seqs`` contexts (serve's
    slots) of ``n_ctx`` tokens: with a budget, the memory plan is made (and a budget too small refused) before any
    weight is read (models.base.load_model)."""
    from .models.base import load_model
    return load_model(shape, opts, n_ctx=n_ctx, ubatch=args.ubatch, n_seqs=n_seqs)


def _ignored_options(args: argparse.Namespace, opts, moe_stream: bool) -> list[str]:  # noqa: ANN001
    """Notes for options given that this run does not use (CUDA options on the CPU, streaming ones resident)."""
    notes = []
    if not opts.cuda:
        if getattr(args, "gpu_mem", None) is not None:
            notes.append("--gpu-mem applies to --device cuda only: ignored on the CPU")
        if getattr(args, "pool", None) is not None:
            notes.append("--pool applies to --device cuda only: ignored on the CPU (the pools are host memory)")
    if not moe_stream:
        given = [flag for flag, dest, default in (
            ("--host-cache", "host_cache", None), ("--mem", "mem", None), ("--slots", "slots", None),
            ("--direct-io", "direct_io", None), ("--prefetch", "prefetch", False), ("--io-threads", "io_threads", 8),
            ("--policy", "policy", "lfu")) if getattr(args, dest, default) != default]
        if given:
            notes.append(f"{', '.join(given)}: streaming option{'s' * (len(given) > 1)}, ignored with --moe-stream off "
                         f"(every expert is addressed in the file's memory map)")
    return notes


def _tier_line(store) -> str | None:  # noqa: ANN001
    """``moestream: host tier: ...`` (what the --host-cache tier served), or None without one."""
    tier = getattr(store, "tier", None)
    if tier is None:
        return None
    n = tier.hits + tier.misses
    fill = (f"; filled with every expert at load: {tier.fill_bytes / GiB:.3f} GiB read in {tier.fill_seconds:.1f} s"
            if tier.fill_bytes else "")
    return (f"moestream: host tier: {tier.hits} of {n} pool misses copied from it "
            f"({100 * tier.hits / max(n, 1):.1f}%), {tier.misses} read from the disk into it, "
            f"{tier.bytes_copied / GiB:.3f} GiB copied to the slots{fill}")


def _device_desc(model) -> str:  # noqa: ANN001
    """``"cuda (NVIDIA H200), Triton kernels"`` / ``"cpu, 2 threads"`` (the C kernels' threads: -t, default
    torch's intra-op count) for the first stderr line."""
    dev = model.device
    if dev.type != "cuda":
        from . import kernels
        return f"cpu, {kernels.threads()} thread{'s' * (kernels.threads() != 1)}"
    import torch

    kern = "Triton kernels on the ggml blocks" if model.use_triton else "dequantize + torch matmul"
    return f"{dev} ({torch.cuda.get_device_name(dev)}), {kern}"


def _tokenizer(gguf, template: tuple[str, str] | None = None, lazy: bool = False):  # noqa: ANN001, ANN202
    """The tokenizer of the file ``gguf`` (gguf.GGUFModel); ``template``: (Jinja source, where it came from) of
    --chat-template(-file), which replaces the file's chat template (see :func:`chat_template_option`); ``lazy``:
    its backend read from the cache on first use (GGUFTokenizer.from_fields)."""
    from .tokenizer import GGUFTokenizer
    tok = GGUFTokenizer.from_fields(gguf.fields, gguf.path, gguf.metadata_digest, lazy=lazy)
    if template is not None:
        tok.chat_template, tok.template_origin = template
    return tok


def _prompt_ids(tok, prompt: str, ahead=None) -> list[int]:  # noqa: ANN001
    """``prompt``'s ids (``add_special``) as run has them: from ``ahead`` (a tokenizer.EncodeAhead started before
    torch was imported) or, where ``tok`` has not read its backend (a lazy tokenizer: inspect's), from a helper
    started now, which keeps the backend out of this process as run's does; else encoded here."""
    from .tokenizer import EncodeAhead

    ahead = ahead or EncodeAhead.start(tok, prompt)
    ids = ahead.apply(tok) if ahead is not None else None
    return ids if ids is not None else tok.encode(prompt, add_special=True)


def chat_template_option(args: argparse.Namespace) -> tuple[str, str] | None:
    """(Jinja source, origin for messages) of ``--chat-template NAME|JINJA`` or ``--chat-template-file FILE``, or
    None without either; read before the model loads. ConfigError for both given, an unknown name, or a file that
    cannot be read, is not UTF-8 or is empty."""
    from .chat_templates import chat_template_source
    from .errors import ConfigError

    value, path = getattr(args, "chat_template", None), getattr(args, "chat_template_file", None)
    if value is not None and path is not None:
        raise ConfigError("--chat-template and --chat-template-file both give the chat template: use one of them")
    if value is not None:
        source = chat_template_source(value)
        if source is None:
            names = ", ".join(CHAT_TEMPLATES)
            raise ConfigError(f"--chat-template {value}: not a template name moestream knows ({names}) nor a Jinja "
                              f"template; put a template in a file and pass --chat-template-file FILE")
        name = value.strip().lower()
        return source, (f"--chat-template {name}" if name in CHAT_TEMPLATES else "--chat-template")
    if path is None:
        return None
    source = _read_text_file("--chat-template-file", path)
    if not source.strip():
        raise ConfigError(f"--chat-template-file {path}: the file is empty")
    return source, path


def _describe(model) -> str:  # noqa: ANN001
    store = model.store
    if store.streaming:
        per = store.slots_per_layer().values()
        slots = f"{min(per)}" if min(per) == max(per) else f"{min(per)}-{max(per)}"
        mode = (f"streaming: {slots} slots/layer of {model.n_experts} experts, "
                f"{store.pool_bytes / GiB:.3f} GiB of pools, {store.reader.io_threads} IO threads, "
                f"policy {model.opts.policy}, overlap {'on' if model.opts.overlap else 'off'}, "
                f"prefetch {'on' if model.opts.prefetch else 'off'}, "
                f"{f'direct IO ({store.align}-byte aligned)' if store.direct else 'buffered IO'}")
        if store.tier is not None:
            rows = store.tier.rows.values()
            mode += (f", host tier {store.tier.nbytes / GiB:.3f} GiB ({min(rows)} experts/layer"
                     + (", every expert" if min(rows) == model.n_experts else "") + ")")
        if model.device.type == "cuda":
            mode += (", pools in GPU memory (pinned staging, copy stream)" if store.place == "device" else
                     ", pools in pinned host memory the GPU reads (--pool host)")
    elif model.device.type == "cuda":
        mode = ("resident: every expert copied to " + ("GPU memory" if store.place == "device" else
                "pinned host memory") + " (--moe-stream off)")
    else:
        mode = "resident: experts addressed in a memory map of the file (--moe-stream off)"
    line = (f"moestream: {os.path.basename(model.gguf.path)} | {model.arch}, {len(model.layout.moe_layers)} MoE "
            f"layers, top-{model.top_k} of {model.n_experts} experts | "
            + f"{_device_desc(model)} | " + mode)
    if store.streaming and model.memory_plan is not None:
        line += f"\nmoestream: {model.memory_plan.line()}"
        line += "".join(f"\nmoestream: warning: {n}" for n in model.memory_plan.notes)
    return line


def _check_prompt(prompt: str, option: str = "-p") -> str:
    """The prompt as valid text; ConfigError if it is empty or not UTF-8 (argv bytes arrive surrogate-escaped)."""
    from .errors import ConfigError

    what = "the system prompt" if option == "-sys" else "the prompt"
    if prompt == "":
        raise ConfigError(f"{what} is empty: give a non-empty {option}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid UTF-8 (bad byte at character {e.start})") from None
    return prompt


def _check_common(args: argparse.Namespace) -> None:
    """The options a command checks before the model loads that are not LoadOptions fields (LoadOptions checks its
    own: options.load_options): -m, -ub, -t."""
    from .errors import ConfigError

    model_path(args)
    ub = getattr(args, "ubatch", 1)
    if ub < 1:
        raise ConfigError(f"-ub must be at least 1, got {ub}")
    if ub > MAX_TOKENS:
        raise ConfigError(f"-ub must be at most 2^31, got {ub}")
    t = getattr(args, "threads", None)
    if t is not None and t < 1:
        raise ConfigError(f"-t must be at least 1, got {t}")
    if t is not None and t > max_threads():
        raise ConfigError(f"-t must be at most {max_threads()} (4 x the {os.cpu_count()} CPUs), got {t}")


def read_prompt_file(path: str) -> str:
    """The text of ``-f PATH`` (``-`` reads stdin) without one trailing newline, as llama.cpp's ``-f``. ConfigError
    naming the file when it cannot be read or is not UTF-8."""
    from .errors import ConfigError

    if path == "":
        raise ConfigError("-f: the path is empty (use -f - to read the prompt from stdin)")
    if path == "-" and sys.stdin is None:
        raise ConfigError("-f -: standard input is closed")
    name = "stdin" if path == "-" else path
    text = _read_text_file("-f", path)
    if text.endswith("\n"):
        text = text[:-1]
    if text == "":
        raise ConfigError(f"-f {name}: the prompt is empty")
    return text


def _read_text_file(option: str, path: str) -> str:
    """The UTF-8 text of the file ``path`` given to ``option`` (``-`` reads stdin), at most MAX_PROMPT_FILE_BYTES;
    ConfigError naming the option and the file when it cannot be read, is larger, or is not UTF-8."""
    from .errors import ConfigError

    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_PROMPT_FILE_BYTES + 1)
        else:
            with open(path, "rb") as f:  # a FIFO (-f <(cmd)) is fine; /dev/zero is cut off below
                data = f.read(MAX_PROMPT_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{option} {path}: is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"{option} {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise ConfigError(f"{option} {name}: more than {MAX_PROMPT_FILE_BYTES >> 20} MiB, far past any context; not "
                          f"read further")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{option} {name}: not valid UTF-8 (bad byte at offset {e.start})") from None


#: set by :func:`_on_sigint` (main's SIGINT handler outside :func:`interruptible`): a Ctrl-C was received. Python
#: loses a KeyboardInterrupt raised while a finalizer runs ("Exception ignored in ..."), so the flag, not the
#: exception alone, decides that the command ends with status 130.
_SIGINT_SEEN: list[bool] = []


def _on_sigint(signum: int, frame: object) -> None:
    _SIGINT_SEEN.append(True)
    raise KeyboardInterrupt


#: set by :func:`_on_sigterm`: the command was stopped by SIGTERM (``kill``, ``timeout``, a service manager)
_SIGTERM_SEEN: list[bool] = []


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends a command as Ctrl-C does (the same cleanup: a trace being written is kept, nothing is left
    half-written), with status 143 (128 + SIGTERM) instead of 130. ``serve``'s server installs its own handler
    while it listens (a graceful shutdown)."""
    _SIGTERM_SEEN.append(True)
    raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible() -> Iterator[Callable[[], bool]]:
    """While inside, the first SIGINT (Ctrl-C) only sets a flag -- yields the function that reads it, for a
    Generation to stop between forward passes -- and a second one raises KeyboardInterrupt as usual. SIGTERM, where
    main's handler (:func:`_on_sigterm`) has it, does the same and is recorded, so a ``kill`` or ``timeout`` ends
    the generation as Ctrl-C does (the stats line, the traces closed with ``interrupted``), then main exits 143. A
    Ctrl-C received before (whose KeyboardInterrupt may have been lost in a finalizer) raises KeyboardInterrupt
    here."""
    import signal

    if _SIGINT_SEEN or _SIGTERM_SEEN:
        raise KeyboardInterrupt
    count = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal count
        if signum == signal.SIGTERM:
            _SIGTERM_SEEN.append(True)
        count += 1
        if count > 1:
            raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
        old = None
    old_term = None
    if old is not None and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        old_term = signal.signal(signal.SIGTERM, handler)
    try:
        yield lambda: count > 0
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _run_options(args: argparse.Namespace) -> tuple[str | None, int]:
    """The prompt (None: interactive mode waits for the first line) and -n, checked before the model loads."""
    from .errors import ConfigError

    if args.prompt is not None and args.file is not None:
        raise ConfigError("-p and -f both give the prompt: use one of them")
    if args.interactive and args.file == "-":
        raise ConfigError("-f -: stdin cannot hold both the prompt and the conversation of interactive mode; put "
                          "the prompt in a file")
    if args.system_prompt is not None and not (args.chat or args.interactive):
        raise ConfigError("-sys: a system prompt goes through the chat template: add --chat or -cnv")
    if args.system_prompt is not None:
        _check_prompt(args.system_prompt, "-sys")
    prompt = read_prompt_file(args.file) if args.file is not None else args.prompt
    if prompt is None and not args.interactive:
        prompt = DEFAULT_PROMPT
    if prompt is not None:
        _check_prompt(prompt)
    n = check_tokens(args.n_predict if args.n_predict is not None else (-1 if args.interactive else 128))
    if args.ctx_size is not None and args.ctx_size < 0:
        raise ConfigError(f"-c must be 0 (prompt + -n) or more, got {args.ctx_size}")
    if args.ctx_size is not None and args.ctx_size > MAX_TOKENS:
        raise ConfigError(f"-c must be at most 2^31, got {args.ctx_size}")
    return prompt, n


def _plan_context(args: argparse.Namespace, model, n_prompt: int, n_predict: int,  # noqa: ANN001
                  opts=None, n_seqs: int = 1) -> tuple[int, str, str | None]:  # noqa: ANN001
    """The context of a run (engine.run_context: run's and inspect's alike) after the trained-context check:
    ``(n_ctx, option, warning)`` (``option`` names what set it, for messages; ``warning``: --override-ctx's, to
    print). Prints the memory-cap note on stderr. ``opts``: the LoadOptions whose budget caps a default context
    (default: the model's). ``n_seqs``: KV caches of that context (serve's slots) that share the memory."""
    from .engine import DEFAULT_CTX_MEMORY_SHARE, check_trained_context, run_context

    interactive = getattr(args, "interactive", False)
    unbounded = n_predict < 0 or interactive
    n_ctx, capped_from = run_context(model, n_prompt, -1 if unbounded else n_predict, args.ctx_size, opts,
                                     DEFAULT_CTX_MEMORY_SHARE / n_seqs)
    if args.ctx_size:
        option = f"-c {args.ctx_size}"
    elif unbounded:
        option = "-n -1" if not interactive else "-cnv"
        if capped_from is not None:
            caches = "its KV cache" if n_seqs == 1 else f"{n_seqs} KV caches (-np {n_seqs})"
            print(f"moestream: context {n_ctx} tokens: the file's {capped_from} would need more than half of the "
                  f"memory available for {caches} (-c sets the context)", file=sys.stderr, flush=True)
    else:
        option = f"the {n_prompt}-token prompt + -n {n_predict}"
    return n_ctx, option, check_trained_context(model, n_ctx, option, args.override_ctx)


def _context(args: argparse.Namespace, model, n_prompt: int, n_predict: int, n_seqs: int = 1,  # noqa: ANN001
             hint: str | None = None) -> int:
    """The context size of a run (see the -c help) after the trained-context and memory checks (:func:`_plan_context`)
    on :func:`_open`'s shape, before the load (``n_seqs`` KV caches of it: serve's slots); prints the --override-ctx
    warning on stderr. ``hint``: the flags a KV cache too big for the memory names (default: run's)."""
    from .engine import check_cache_fits

    n_ctx, option, warning = _plan_context(args, model, n_prompt, n_predict, n_seqs=n_seqs)
    # before anything is printed: an absurd -n or -c is refused here, not by torch's allocator
    hint = hint or ("-c or -np" if n_seqs > 1 else "-n or -c")
    check_cache_fits(model, n_ctx, option, hint=hint, n_seqs=n_seqs)
    if warning:
        print(f"moestream: {warning}", file=sys.stderr, flush=True)
    return n_ctx


def _print_reply(events, pending) -> None:  # noqa: ANN001
    """Stream the text of ``events`` (an iterator of :mod:`moestream.textgen` events) to stdout, then end the line;
    on an error the partial line is ended too, with ``pending()`` (the text that was held back; the error itself
    may be that stdout cannot be written)."""
    from .errors import MoestreamError
    from .textgen import DoneEvent

    try:
        for ev in events:
            if isinstance(ev, DoneEvent):
                write_stdout(ev.text + "\n")
                return
            write_stdout(ev.text)
    except BaseException:
        with contextlib.suppress(MoestreamError, OSError):
            write_stdout(pending() + "\n")
        raise


def _open_run_trace(args: argparse.Namespace, model):  # noqa: ANN001, ANN202
    """--trace FILE: a started runtrace.TraceWriter with its header written (None without --trace)."""
    if getattr(args, "trace", None) is None:
        return None
    from .runtrace import TraceWriter
    writer = TraceWriter(args.trace, gpu=str(model.device))
    writer.header(model, args.command, vars(args))
    return writer


def cmd_run(args: argparse.Namespace) -> int:
    from .errors import ConfigError
    from .options import flag_errors, grammar_flags, run_grammar, sampling_params
    from .textgen import StopStrings, TextEvents

    prompt, n_predict = _run_options(args)
    StopStrings(args.stop, "--stop")  # an empty --stop is refused before the model loads
    constraint = grammar_flags(args)  # a grammar or schema file that cannot be read, an empty one: likewise
    grammar_flag = constraint[0] if constraint is not None else None
    if args.interactive and constraint is not None:
        raise ConfigError(f"{constraint[0]} constrains one reply; it does not apply to -cnv")
    template = chat_template_option(args)
    _check_common(args)
    if args.routing_trace is not None:  # before the model runs: a bad path is one line, not a lost run
        from .experts.trace import check_trace_path
        if args.interactive:
            raise ConfigError("--routing-trace records one prompt's prefill and decode; it does not apply to -cnv")
        check_trace_path(args.routing_trace, [model_path(args)])
    if args.trace is not None:
        from .runtrace import check_trace_path as check_run_trace_path
        check_run_trace_path(args.trace, [model_path(args)])
    from .output import check_distinct_outputs
    check_distinct_outputs([("--routing-trace", args.routing_trace), ("--trace", args.trace)])
    params = sampling_params(args)
    early = {}  # a plain prompt: the tokenizer made before torch is imported, and a helper encoding the prompt

    def encode_ahead(gguf) -> None:  # noqa: ANN001
        from .errors import MoestreamError
        from .tokenizer import EncodeAhead, is_cached

        # only a tokenizer converted before (so nothing is converted ahead of the file's other checks)
        if not args.interactive and not args.chat and is_cached(gguf.metadata_digest):
            with contextlib.suppress(MoestreamError):  # raised again below, after the file's other checks
                early["tok"] = _tokenizer(gguf, template, lazy=True)  # its backend maybe never read
                early["ahead"] = EncodeAhead.start(early["tok"], prompt)

    shape, opts = _open(args, args.moe_stream, before_torch=encode_ahead)  # the load options checked before torch
    from .chat import encode_chat
    from .engine import Engine, Sampler

    tok = early["tok"] if "tok" in early else _tokenizer(shape.gguf, template)
    with flag_errors(args):
        params.check_vocab(tok.vocab_size)
    grammar = run_grammar(args, tok, tok.vocab_size, constraint)
    model = None
    trace = None
    run_trace = None  # --trace: moestream/runtrace.py's writer, opened once the store exists
    try:
        if args.interactive:
            _check_chat_template(args, tok)
            n_ctx = _context(args, shape, 0, n_predict)
            model = _load(args, shape, opts, n_ctx)
            return _interactive(args, model, tok, Engine(model, args.ubatch), prompt, n_predict, Sampler(params),
                                n_ctx)
        if args.chat:
            msgs = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else [])
            ids = encode_chat(tok, [*msgs, {"role": "user", "content": prompt}])
        else:
            ids = _prompt_ids(tok, prompt, early.get("ahead"))
        if not ids:
            raise ConfigError("the prompt is empty after tokenization")
        n_ctx = _context(args, shape, len(ids), n_predict)
        if len(ids) >= n_ctx and n_predict != 0 or len(ids) > n_ctx:
            raise ConfigError(f"the prompt has {len(ids)} tokens; the context size -c {n_ctx} leaves no room to "
                              f"generate")
        model = _load(args, shape, opts, n_ctx)
        engine = Engine(model, args.ubatch)
        if args.routing_trace is not None:
            from .experts.trace import RoutingTrace
            trace = RoutingTrace.attach(model)
        run_trace = _open_run_trace(args, model)
        with interruptible() as interrupted:
            constraint = None
            if grammar is not None:
                from .structured import Constraint
                constraint = Constraint(grammar, tok, model.n_vocab)
            gen = engine.stream(ids, n_predict, Sampler(params, constraint), stop_ids=tok.eos_ids, n_ctx=n_ctx,
                                interrupted=interrupted)
            text = TextEvents(gen, tok, args.stop, skip_special=False)
            events = iter(text)
            if run_trace is not None:
                events = run_trace.follow_events(events, gen, tok.decode(ids))
            # The description line and the prompt echo wait for the prefill's logits (the first token): a file
            # whose weights or metadata fail in the first forward pass leaves one error line and nothing on stdout.
            first = next(events)
            if trace is not None:
                trace.mark_decode()  # the prefill's requests are in; decode steps from here on
            print(_describe(model), file=sys.stderr, flush=True)
            if not args.chat and not args.no_display_prompt:
                write_stdout(prompt)
            _print_reply(itertools.chain([first], events), text.pending)
    except BaseException as e:
        if run_trace is not None:  # a failed run leaves no trace file; an interrupted one keeps what it traced
            if isinstance(e, KeyboardInterrupt):
                run_trace.close()
            else:
                run_trace.abort()
        raise
    finally:
        if model is not None and model.store is not None:
            model.store.close()
            line = _tier_line(model.store)
            if line:
                print(line, file=sys.stderr, flush=True)
    if run_trace is not None:
        run_trace.close()
        print(f"moestream: trace of {run_trace.records} records written to {args.trace} (moestream replay "
              f"{args.trace} plays it)", file=sys.stderr, flush=True)
    if trace is not None:
        trace.finish()
        trace.write(args.routing_trace)
        print(f"moestream: routing trace of {len(trace.requests)} slot requests written to {args.routing_trace} "
              f"(moestream trace {args.routing_trace} replays it)", file=sys.stderr, flush=True)
    print(gen.stats.line(), file=sys.stderr, flush=True)
    if constraint is not None and not constraint.accepting and gen.stats.stop_reason in ("n_predict", "context full"):
        limit = "-n" if gen.stats.stop_reason == "n_predict" else "the context"
        print(f"moestream: {grammar_flag}: {limit} ended the output before it was complete (not valid for the "
              f"grammar or schema); a larger -n gives it room", file=sys.stderr, flush=True)
    return 130 if gen.stats.stop_reason == "interrupted" else 0


def _read_turn(tty: bool) -> str:
    """One line of user input without its newline (EOFError at the end of input)."""
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        line = input("> ")
    else:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        line = line.removesuffix("\n").removesuffix("\r")
    try:  # stdin decodes with surrogateescape under a C/UTF-8 locale: bad bytes arrive as lone surrogates
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnicodeDecodeError("utf-8", b"", 0, 1, f"bad byte at character {e.start}") from None
    return line


def _check_chat_template(args: argparse.Namespace, tok) -> None:  # noqa: ANN001
    """-cnv's checks of the chat template, before the load: TokenizerError when the file has none, or when it cannot
    render a plain first turn (so it fails at start, not on every turn)."""
    from .tokenizer import TokenizerError

    if tok.chat_template is None:
        raise TokenizerError(f"{tok.path}: the GGUF has no tokenizer.chat_template, which -cnv needs (--chat-template "
                             f"NAME or --chat-template-file FILE gives one)")
    tok.apply_chat_template([*([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []),
                             {"role": "user", "content": "hi"}], add_generation_prompt=True)


def _interactive(args: argparse.Namespace, model, tok, engine, prompt: str | None, n_predict: int,  # noqa: ANN001
                 sampler, n_ctx: int) -> int:  # noqa: ANN001
    """Interactive chat (-cnv): a prompt loop on one KV cache of ``n_ctx`` tokens (moestream.chat.ChatSession). Each
    reply streams to stdout, its stats line goes to stderr. Ends at EOF or /exit (status 0) or Ctrl-C at the prompt
    (130); Ctrl-C during a reply stops that reply. A turn that does not fit, or that the template cannot take, is
    refused with a line on stderr and the session goes on."""
    from .chat import ChatSession

    session = ChatSession(engine, tok, n_ctx, system=args.system_prompt)
    print(_describe(model), file=sys.stderr, flush=True)
    if sys.stdin is None:
        from .errors import ConfigError
        raise ConfigError("-cnv: standard input is closed (it reads one message per line from it)")
    run_trace = _open_run_trace(args, model)  # --trace: every turn, tagged with its number
    try:
        return _turns(args, tok, session, prompt, n_predict, sampler, run_trace)
    except BaseException as e:
        if run_trace is not None and not isinstance(e, KeyboardInterrupt):
            run_trace.abort()  # a failed session leaves no trace file
            run_trace = None
        raise
    finally:
        if run_trace is not None:
            run_trace.close()
            print(f"moestream: trace of {run_trace.records} records written to {args.trace} (moestream replay "
                  f"{args.trace} plays it)", file=sys.stderr, flush=True)


def _turns(args: argparse.Namespace, tok, session, prompt: str | None, n_predict: int, sampler,  # noqa: ANN001
           run_trace) -> int:  # noqa: ANN001
    """The -cnv prompt loop of :func:`_interactive`."""
    from .chat import ContextFullError
    from .textgen import TextEvents
    from .tokenizer import TokenizerError

    tty = sys.stdin.isatty()
    pending = prompt
    n_turn = 0
    while True:
        if _SIGTERM_SEEN:  # a SIGTERM stopped the last turn: the session ends (main exits 143)
            return 130
        if pending is not None:
            text, pending = pending, None
        else:
            try:
                text = _read_turn(tty)
            except EOFError:
                if tty:
                    write_stdout("\n")
                return 0
            except KeyboardInterrupt:
                write_stdout("\n")
                return 130
            except UnicodeDecodeError:
                print("moestream: that line is not valid UTF-8; type it again", file=sys.stderr, flush=True)
                continue
            if text.strip() == "/exit":
                return 0
            if not text.strip():
                continue
        with interruptible() as interrupted:
            try:
                gen = session.turn(text, n_predict, sampler, interrupted)
            except (ContextFullError, TokenizerError) as e:  # this turn is refused, the cache is untouched
                print(f"moestream: {e}; /exit ends the session", file=sys.stderr, flush=True)
                continue
            text = TextEvents(gen, tok, args.stop, skip_special=False)
            events = iter(text)
            if run_trace is not None:
                n_turn += 1
                events = run_trace.follow_events(events, gen, tok.decode(gen.tokens), turn=n_turn)
            _print_reply(events, text.pending)
        print(gen.stats.line(), file=sys.stderr, flush=True)


def serve_loader(args: argparse.Namespace):  # noqa: ANN201
    """``(names, load, held)`` of ``moestream serve``'s options: the model names it answers to (``--alias``, or the
    file name without and with ``.gguf``), the function that checks the options, loads the model as ``run`` does
    and returns a :class:`moestream.server.Loaded` (run in the server's loader thread), and the list it appends the
    loaded model to (for closing its store). ConfigError (OptionError for a load option) for a bad --port, -c,
    --alias, -ub, -t, size, load option (--slots, --io-threads ...: LoadOptions' checks, the device's left to the
    load: a GPU one imports torch) or -m (missing, unreadable, not a regular file, empty or not GGUF), all before
    the socket listens; so are an explicit -c past the file's trained context or whose KV caches do not fit in
    memory (the file's tensor table read, as run's) and a --mem whose memory plan does not fit: only what needs the
    model read is refused after (the server answers /health meanwhile)."""
    from .errors import ConfigError
    from .server import Loaded

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, got {args.port}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.ctx_size is not None and not 0 <= args.ctx_size <= 2**31:
        raise ConfigError(f"-c must be from 0 (the default context) to 2^31, got {args.ctx_size}")
    if args.alias is not None and not args.alias.strip():
        raise ConfigError("--alias: the model name is empty")
    from .options import parse_sizes
    _check_common(args)  # -m, -ub, -t and the sizes: refused before the socket listens (no torch needed)
    parse_sizes(args)
    from .options import load_options
    load_options(args, args.moe_stream, warn=False, device="cpu")  # the load's own call warns and checks the device
    from .gguf import open_model_file
    os.close(open_model_file(model_path(args)))  # exists, can be read, is GGUF: its magic (4 bytes) read
    if args.parallel is not None and not (args.parallel == -1 or 1 <= args.parallel <= MAX_SLOTS):
        raise ConfigError(f"-np must be from 1 to {MAX_SLOTS} generations at a time (-1: chosen from memory), got "
                          f"{args.parallel}")
    if args.trace is not None and args.parallel not in (None, -1, 1):
        raise ConfigError(f"--trace records one generation at a time: use -np 1 with it (not -np {args.parallel})")
    template = chat_template_option(args)
    if template is not None:  # refused before listening, not on every request (run --chat refuses it upfront too)
        from .tokenizer import compile_chat_template
        compile_chat_template(*template)
    base = os.path.basename(model_path(args))
    names = [args.alias] if args.alias else list(dict.fromkeys([base.removesuffix(".gguf"), base]))
    args.interactive = False
    if args.trace is not None:  # before listening: a bad path is one line, not a server that fails later
        from .runtrace import check_trace_path
        check_trace_path(args.trace, [model_path(args)])
    held: list = []
    from .options import flag_errors

    planned = sized = None
    if args.mem is not None:  # an explicit budget: its memory plan is made (and refused) before the socket listens
        with flag_errors(args):
            planned = _serve_plan(args, template)
    elif args.ctx_size:  # an explicit -c: checked against the trained context and the memory before it listens
        with flag_errors(args):
            sized = _serve_shape(args)

    def load() -> Loaded:
        with flag_errors(args):  # the loader thread: a library error names the flag here too
            return _serve_load(args, names, held, template, planned, sized)

    return names, load, held


def _serve_shape(args: argparse.Namespace) -> tuple:
    """``(shape, opts, n_slots, n_ctx)`` of serve's options: the file's tensor table, the slots and each one's
    context after the trained-context and KV-memory checks (:func:`_context`, as run's: OptionError / ConfigError
    naming -c)."""
    _check_common(args)
    args.threads = args.threads if args.threads is not None else default_threads()
    shape, opts = _open(args, args.moe_stream)
    n_slots = _serve_slots(args, shape)
    return shape, opts, n_slots, _context(args, shape, 0, -1, n_seqs=n_slots, hint="-c" if n_slots == 1 else None)


def _serve_plan(args: argparse.Namespace, template: tuple[str, str] | None = None, sized: tuple | None = None) -> tuple:
    """``(shape, opts, tok, n_slots, n_ctx)`` of serve's options: :func:`_serve_shape`'s (``sized``, when it ran
    before the socket listened), the file's tokenizer (loaded before the plan: it counts what this process holds,
    and a tokenizer is tens of MiB), with the memory plan of a budget made from the tensor table as the load will
    make it (models.base.load_model): ConfigError, naming the smallest --mem that works, when it does not fit (as
    run's)."""
    shape, opts, n_slots, n_ctx = sized or _serve_shape(args)
    tok = _tokenizer(shape.gguf, template)
    if opts.budgeted:
        shape.plan_memory(opts, n_ctx, loaded=False, ubatch=args.ubatch, n_seqs=n_slots)
    return shape, opts, tok, n_slots, n_ctx


def _serve_load(args: argparse.Namespace, names: list[str], held: list,  # noqa: ANN202 - server.Loaded
                template: tuple[str, str] | None = None, planned: tuple | None = None, sized: tuple | None = None):
    """serve_loader's load(): check the options, size the context, load the model (the server's loader thread);
    ``template``: --chat-template(-file)'s (chat_template_option); ``planned``: :func:`_serve_plan`'s, ``sized``:
    :func:`_serve_shape`'s, when they ran before the socket listened."""
    from .engine import Engine
    from .server import Loaded

    shape, opts, tok, n_slots, n_ctx = planned or _serve_plan(args, template, sized)
    threads = args.threads
    model = _load(args, shape, opts, n_ctx, n_seqs=n_slots)
    held.append(model)
    print(_describe(model), file=sys.stderr, flush=True)
    at_once = "one generation at a time" if n_slots == 1 else f"{n_slots} generations decoded together (-np)"
    print(f"moestream: serving {names[0]}: context {n_ctx} tokens per request (prompt and reply), {at_once}"
          + ("" if args.cache_prompt else ", prompt cache off"), file=sys.stderr, flush=True)
    trace = _open_run_trace(args, model)
    if trace is not None:
        held.append(trace)
    return Loaded(model, tok, Engine(model, args.ubatch), n_ctx,
                  lambda: set_compute_threads(threads, args.matmul), trace, n_slots=n_slots,
                  cache_prompt=args.cache_prompt)


#: serve's -np when none is given (llama-server's auto is 4 too), fewer where their KV caches would not fit
DEFAULT_SLOTS = 4
#: the most generations serve decodes together
MAX_SLOTS = 256


def _serve_slots(args: argparse.Namespace, model) -> int:  # noqa: ANN001
    """serve's slots: -np N as given; else 1 with --trace, else :data:`DEFAULT_SLOTS`, fewer when an explicit -c
    would need more than half the memory (the --mem budget's, else the memory available) for their KV caches."""
    from .budget import available_memory
    from .engine import DEFAULT_CTX_MEMORY_SHARE, kv_memory

    if args.parallel is not None and args.parallel > 0:
        return args.parallel
    if args.trace is not None:
        return 1
    if not args.ctx_size:
        return DEFAULT_SLOTS  # each slot's context is capped by its share of memory (_plan_context)
    memory = kv_memory(model.opts)
    memory = available_memory() if memory is None else memory
    fits = int(DEFAULT_CTX_MEMORY_SHARE * memory // max(model.cache_bytes(args.ctx_size), 1))
    return max(1, min(DEFAULT_SLOTS, fits))


#: The most bytes of an --api-key-file read (a key file is a few lines; this bounds what a device file makes us read)
MAX_KEY_FILE_BYTES = 1 << 20


def api_keys(args: argparse.Namespace) -> list[str]:
    """serve's API keys: each ``--api-key KEY``, then each line of ``--api-key-file FILE`` (blank lines skipped;
    spaces around a key are not part of it). A key is printable ASCII without spaces (what an HTTP header carries
    unchanged). ConfigError, naming the flag, the file and the line but never a key, for a missing, unreadable or
    empty file and a bad key; before the socket listens."""
    from .errors import ConfigError

    def check(key: str, where: str) -> str:
        if not key or not all(33 <= ord(c) < 127 for c in key):
            raise ConfigError(f"{where}: an API key must be printable ASCII without spaces, at least one character")
        return key

    keys = [check(k, f"--api-key (key {i + 1} of {len(args.api_key)})") for i, k in enumerate(args.api_key or [])]
    if args.api_key_file is not None:
        path = args.api_key_file
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"--api-key-file {path}: cannot read it ({e.strerror or e})") from None
        if len(data) > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"--api-key-file {path}: more than {MAX_KEY_FILE_BYTES} bytes: not a file of keys")
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise ConfigError(f"--api-key-file {path}: not UTF-8 text (one key per line)") from None
        found = [check(k.strip(), f"--api-key-file {path}: line {n}") for n, k in enumerate(lines, 1) if k.strip()]
        if not found:
            raise ConfigError(f"--api-key-file {path}: holds no key (one key per line)")
        keys += found
    return keys


def cors_origins(args: argparse.Namespace) -> list[str]:
    """serve's ``--cors-origin`` values: ``*`` or an origin, ``scheme://host[:port]`` (what a browser sends in its
    Origin header: no path, no trailing slash). ConfigError naming the flag for another, before the socket listens."""
    import re

    from .errors import ConfigError

    out = []
    for origin in args.cors_origin or []:
        if origin != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+", origin):
            raise ConfigError(f"--cors-origin {origin}: an origin is scheme://host[:port] (no path), or * for any")
        out.append(origin)
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    """``moestream serve``: the OpenAI-compatible server (moestream.server) on one model. The socket listens first
    (GET /health answers 503 at once); the option checks that need torch and the load run in the server's loader
    thread, and a failure there is one line on stderr and exit 1."""
    from .runtrace import TraceWriter
    from .server import serve

    names, load, held = serve_loader(args)
    keys = api_keys(args)
    try:
        return serve(load, names, args.host, args.port, keys, args.timeout, cors_origins(args))
    finally:
        for obj in held:
            if isinstance(obj, TraceWriter):
                obj.close()
                print(f"moestream: trace of {obj.records} records written to {args.trace} (moestream replay "
                      f"{args.trace} plays it)", file=sys.stderr, flush=True)
            elif obj.store is not None:
                obj.store.close()


class _LazyTorch(types.ModuleType):
    """A stand-in for ``torch`` in ``sys.modules`` until something reads one of its attributes: then the real torch
    is imported (replacing the stand-in in ``sys.modules``), its namespace copied in, and the attribute returned.
    importlib.util.LazyLoader cannot do this on Python 3.11: every later ``import torch`` reads ``__spec__``, which
    loads it. Modules that imported the stand-in keep it; what the copy missed is forwarded to the real module."""

    def __getattr__(self, name: str):  # noqa: ANN204 - only for names not in the stand-in's namespace
        real = sys.modules.get("torch")
        if real is None or real is self:
            sys.modules.pop("torch", None)
            import importlib
            real = importlib.import_module("torch")
            self.__dict__.update(real.__dict__)
        return getattr(real, name)


def _lazy_torch() -> None:
    """Put :class:`_LazyTorch` in ``sys.modules`` for inspect alone: its report reads the tensor table and builds
    no tensor, so it need not wait for torch (about 1.2 s of a start on the 2-core machine: docs/start-time.md);
    --mem, --gpu-mem and --device cuda import it at their first use. Nothing when torch is already imported or
    not installed."""
    import importlib.util

    if "torch" in sys.modules:
        return
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return
    stand_in = _LazyTorch("torch")
    stand_in.__spec__ = spec
    sys.modules["torch"] = stand_in


def cmd_inspect(args: argparse.Namespace) -> int:
    """``moestream inspect``: the layout and, with --mem / --gpu-mem / --device cuda, the memory plan run would make
    for the same options and the same context (the prompt + -n, -c, or -n -1's default: :func:`_plan_context`)."""
    from dataclasses import replace

    _lazy_torch()
    from .errors import ConfigError
    from .options import load_options
    from .report import inspect_model

    opts = load_options(args)
    if opts.pool == "host" and not (opts.cuda and opts.mem is not None):
        raise ConfigError("--pool host: inspect prices run --pool host's plan with --device cuda and --mem")
    if opts.cuda and opts.gpu_mem is None and opts.slots is None:  # the plan of the GPU's free memory, as run's
        from .budget import gpu_budget
        gpu_mem, gpu_source = gpu_budget(None, None, opts.device)
        opts = replace(opts, gpu_mem=gpu_mem, gpu_mem_source=gpu_source)
    priced = opts.mem is not None or opts.gpu_mem is not None
    for flag, value in (("-c", args.ctx_size), ("-n", args.n_predict), ("-p", args.prompt), ("-f", args.file)):
        if value is not None and not priced:
            raise ConfigError(f"{flag}: inspect prices a context only with --mem or --gpu-mem (the memory plan's KV "
                              "cache)")
    if args.ctx_size is not None and not 1 <= args.ctx_size <= MAX_TOKENS:
        raise ConfigError(f"-c must be from 1 to 2^31, got {args.ctx_size}")
    if opts.host_cache and opts.mem is None:
        raise ConfigError("--host-cache: inspect prices the host tier in --mem's plan: give --mem too")
    context = None
    if priced:  # the context run would have: its prompt's tokens + -n (default 128), -c, or -n -1's default
        if args.prompt is not None and args.file is not None:
            raise ConfigError("-p and -f both give the prompt: use one of them")
        prompt = _check_prompt(read_prompt_file(args.file) if args.file is not None else args.prompt or DEFAULT_PROMPT)
        n_predict = check_tokens(args.n_predict if args.n_predict is not None else 128)

        def context(shape, tok) -> int:  # noqa: ANN001
            n_prompt = len(_prompt_ids(tok, prompt)) if not args.ctx_size and n_predict >= 0 else 0
            n_ctx, _, warning = _plan_context(args, shape, n_prompt, n_predict, opts)
            if warning:
                print(f"moestream: {warning}", file=sys.stderr, flush=True)
            return n_ctx
    write_stdout(inspect_model(model_path(args), opts, context) + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .errors import ConfigError

    _check_prompt(args.prompt)
    _check_common(args)
    check_tokens(args.steps, "steps", minimum=1)
    from .engine import check_cache_fits, check_trained_context  # torch: after the option checks
    from .verify import verify

    shape, opts = _open(args, moe_stream=False, streams_later=True)
    tok = _tokenizer(shape.gguf)
    ids = tok.encode(args.prompt, add_special=True)
    if not ids:
        raise ConfigError("the prompt is empty after tokenization")
    warning = check_trained_context(shape, len(ids) + args.steps, f"--steps {args.steps}", args.override_ctx)
    check_cache_fits(shape, len(ids) + args.steps, f"--steps {args.steps}", "--steps or prompt")
    if warning:
        print(f"moestream: {warning}", file=sys.stderr, flush=True)
    slots = opts.slots if opts.slots is not None else None
    if slots is not None and slots < shape.top_k:
        raise ConfigError(f"--slots {slots} is below the experts used per token ({shape.top_k}); "
                          f"a step needs at least {shape.top_k} slots per layer")
    model = _load(args, shape, opts, len(ids) + args.steps)  # resident: verify makes the streaming store
    res = verify(model, ids, args.steps, opts, args.ubatch)
    if model.memory_plan is not None:
        print(f"moestream: {model.memory_plan.line()}", file=sys.stderr, flush=True)
    if not res.identical:
        step, pos = res.first_diff
        print(f"moestream verify: DIFFERENT logits at step {step} (token position {pos}); "
              f"streaming on and off disagree", file=sys.stderr)
        return 1
    if opts.cuda:  # which device the identity held on (the streaming store's pools: GPU or pinned host memory)
        import torch
        where = (f"on {model.device} ({torch.cuda.get_device_name(model.device)}, pools in "
                 f"{'GPU' if opts.pool == 'device' else 'pinned host'} memory)")
    else:
        where = "on the CPU"
    write_stdout(f"identical: {res.steps} steps (the prefill of a {len(ids)}-token prompt, every position, then "
                 f"{args.steps} greedy decode steps), {res.n_logits} logits compared bytewise {where}; "
                 f"{res.slots} slots/layer, policy {opts.policy}, overlap {'on' if opts.overlap else 'off'}, prefetch "
                 f"{_prefetch_desc(opts, res.stats)}, {'direct' if res.direct_io else 'buffered'} IO, streamed "
                 f"{res.streamed_bytes / GiB:.4f} GiB, "
                 f"hit rate {100 * res.hit_rate:.1f}%"
                 + (f", host tier {res.tier.hits} of {res.tier.hits + res.tier.misses} pool misses"
                    if res.tier is not None else "") + "\n")
    return 0


def _prefetch_desc(opts, stats) -> str:  # noqa: ANN001
    """``on (recall R%, miss bytes ready M%)`` or ``off`` for verify's line."""
    if not opts.prefetch:
        return "off"
    if stats is None or stats.recall is None:
        return "on"
    ready = "-" if stats.ready_share is None else f"{100 * stats.ready_share:.1f}%"
    return f"on (recall {100 * stats.recall:.1f}%, miss bytes ready {ready})"


def cmd_trace(args: argparse.Namespace) -> int:
    from .bench import _list
    from .errors import ConfigError
    from .experts.trace import RoutingTrace, trace_table

    counts = _list(args.slots, int, "--slots") if args.slots is not None else None
    for n in counts or ():
        if n < 1:
            raise ConfigError(f"--slots must be positive numbers, got {n}")
    trace = RoutingTrace.read(args.file)
    top_k = int(trace.meta["top_k"])
    for n in counts or ():
        if n < top_k:
            raise ConfigError(f"--slots {n} is below the experts used per token ({top_k}) in {args.file}")
    write_stdout(trace_table(trace, counts, args.file) + "\n")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """``moestream replay TRACE``: a trace that cannot be read is one line on stderr and exit status 1 (a bad input
    file, as ``trace``'s; 2 is argparse's, for usage errors)."""
    from .errors import ConfigError
    from .replay import frame_text, make_app, timeline, write_page
    from .runtrace import RunTraceError, read_trace

    try:
        tl = timeline(read_trace(args.file), args.row)
    except RunTraceError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 1
    if args.at is not None and not 1 <= args.at <= len(tl):
        raise ConfigError(f"--at {args.at}: {args.file} has tokens 1 to {len(tl)}")
    if not 0 < args.speed <= 1000:
        raise ConfigError(f"--speed must be above 0 and at most 1000, got {args.speed}")
    at = (args.at or len(tl)) - 1
    if args.html is not None:
        from .output import check_json_path
        check_json_path(args.html, [args.file], option="--html", what="the page", input_kind="the trace")
        write_page(tl, args.html)
        print(f"moestream: page of {len(tl)} tokens written to {args.html}", file=sys.stderr, flush=True)
        return 0
    if sys.stdout is not None and sys.stdout.isatty() and sys.stdin is not None and sys.stdin.isatty():
        make_app(tl, args.speed, 0 if args.at is None else at, autoplay=True).run()
        return 0
    write_stdout(frame_text(tl, at) + "\n")  # no terminal: the frame at --at (default the last token)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    _check_common(args)
    return run_bench(args)


class _TopParser(Parser):
    """The ``moestream`` parser: its command is checked after the parse, so that ``moestream --bogus`` says
    ``unrecognized arguments: --bogus`` (as ``moestream run --bogus`` does) rather than that the command is
    missing (argparse checks required arguments before it reports unknown ones)."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's own signature
        ns, extra = super().parse_known_args(args, namespace)
        if ns.command is None:
            self.error(f"unrecognized arguments: {' '.join(extra)}" if extra else
                       "the following arguments are required: command")
        return ns, extra


class _VersionAction(argparse._VersionAction):
    """``--version``: the installed version, looked up only when asked for (importlib.metadata costs every start
    some 30 ms)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204 - argparse's own
        self.version = f"moestream {version()}"
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    ap = _TopParser(prog="moestream", description="Run MoE GGUF models with routed experts "
                                     "streamed from disk into per-layer slot caches.")
    ap.add_argument("--version", action=_VersionAction)
    sub = ap.add_subparsers(dest="command", parser_class=Parser)  # required: _TopParser checks it

    r = sub.add_parser("run", help="generate text")
    _add_model_args(r)
    r.add_argument("-p", "--prompt", default=None, help=f"prompt text (default {DEFAULT_PROMPT!r}; with -cnv: the "
                   f"first user message, else -cnv waits for one)")
    r.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="read the prompt from FILE (- = stdin), without one trailing newline, as llama.cpp")
    r.add_argument("-n", "--n-predict", "--predict", type=int, default=None,
                   help="tokens to generate (default 128; with -cnv, per reply, default -1); -1 = until an "
                   "end-of-generation token or the context is full")
    r.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens, prompt included; 0 or unset = prompt + -n (with -n -1 or -cnv: the "
                   "file's trained context_length, capped so that the KV cache takes at most half the memory "
                   "available); generation stops when it is full. Past the trained context_length it is refused "
                   "unless --override-ctx")
    r.add_argument("--override-ctx", action="store_true",
                   help="allow a context past the file's trained context_length (warns; the text may degrade)")
    r.add_argument("--moe-stream", type=_on_off, default=True, metavar="on|off",
                   help="stream routed experts (on, default) or address them in a memory map (off)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--no-display-prompt", action="store_true",
                   help="print only the generated text, not the prompt before it (llama-cli's flag)")
    r.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT",
                   help="system message (with --chat or -cnv)")
    r.add_argument("-cnv", "--conversation", "-i", "--interactive", dest="interactive", action="store_true",
                   help="interactive chat: a prompt loop on the chat template, one KV cache across turns (each "
                   "turn prefills only its new tokens); /exit or end of input ends it; Ctrl-C stops a reply")
    r.add_argument("-no-cnv", "--no-conversation", dest="interactive", action="store_false",
                   help="not interactive (the default; llama.cpp's flag)")
    add_refused(r, RUN_REFUSED)
    _add_chat_template(r)
    r.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 = greedy (default 0.8)")
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("--repeat-penalty", type=float, default=1.0, help="divide the positive logits (multiply the "
                   "negative ones) of tokens among the last --repeat-last-n by this, as llama.cpp (default 1.0: off)")
    r.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back on, prompt "
                   "included (default 64; 0: off; -1: all)")
    r.add_argument("--presence-penalty", type=float, default=0.0, help="subtract this from the logit of a token "
                   "among the last --repeat-last-n (default 0.0: off)")
    r.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times its count among the "
                   "last --repeat-last-n from a token's logit (default 0.0: off)")
    r.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed; -1 (default) = random")
    r.add_argument("-l", "--logit-bias", action="append", default=[], metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to token TOKEN_ID's logit (repeatable; llama.cpp's form: 15043+1, 15043-1, "
                   "15043-inf bans it)")
    r.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to JSON that follows this JSON schema ('{}': any JSON value); "
                   "generation ends when it is complete")
    r.add_argument("--json-schema-file", default=None, metavar="FILE", help="--json-schema read from FILE")
    r.add_argument("--grammar", default=None, metavar="GBNF",
                   help="constrain the output to this grammar (llama.cpp's GBNF, or a Lark grammar)")
    r.add_argument("--grammar-file", default=None, metavar="FILE", help="--grammar read from FILE")
    r.add_argument("--trace", default=None, metavar="FILE", help=TRACE_HELP)
    r.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable): the text ends before its first occurrence, which is not "
                   "printed; text that may start one is held until it is known not to")
    r.add_argument("-r", "--reverse-prompt", dest="stop", action="append", metavar="STR",
                   help="llama.cpp's reverse prompt: a --stop string (with -cnv the reply ends there and the next "
                   "prompt follows)")
    r.add_argument("--routing-trace", default=None, metavar="FILE",
                   help="write the run's routing trace (every slot request: layer, experts, pinned; JSON lines with "
                   "a header, see experts/trace.py) to FILE, replaced atomically; moestream trace FILE replays it")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="print the model's layout and memory needs")
    i.add_argument("-m", "--model", default=None)
    add_refused(i, REFUSED)
    add_refused(i, LOG_REFUSED)
    i.add_argument("--slots", type=int, default=None, help="price pools of this many slots per layer")
    i.add_argument("--mem", default=None, metavar="SIZE", help="print the memory plan run --mem SIZE makes: slots "
                   "per layer, pool GiB, what is left")
    i.add_argument("--device", default="cpu", action=_Device, metavar="cpu|cuda|auto", help="cuda (or auto with a "
                   "GPU): also print the GPU memory plan of run --device cuda (sized from the GPU's free memory "
                   "unless --gpu-mem is given)")
    _add_gpu_layers(i)
    i.add_argument("--host-cache", default=None, metavar="SIZE", help="with --mem: price a host tier of SIZE in "
                   "the plan (as run --host-cache)")
    i.add_argument("--pool", default="device", type=str.lower, metavar="device|host",
                   help="with --device cuda --mem: host prices the plan of run --pool host (pools in pinned host "
                   "memory under --mem, with what CUDA adds to the process on the host)")
    i.add_argument("--gpu-mem", default=None, metavar="SIZE", help="print the GPU memory plan run --device cuda "
                   "--gpu-mem SIZE makes (dense weights, KV cache, scratch and slot pools in VRAM)")
    i.add_argument("-c", "--ctx-size", type=int, default=None, help="with --mem: the context whose KV cache the "
                   "plan holds (default: as run's: the prompt's tokens + -n)")
    i.add_argument("-n", "--n-predict", type=int, default=None, help="with --mem: price the context of run -n N "
                   "(default 128, as run; -1: the trained context, capped by memory as run -n -1 caps it)")
    i.add_argument("-p", "--prompt", default=None, help=f"with --mem: the prompt whose tokens the context holds, as "
                   f"run -p (default {DEFAULT_PROMPT!r})")
    i.add_argument("-f", "--file", default=None, metavar="FILE", help="with --mem: read that prompt from FILE, as "
                   "run -f")
    i.add_argument("--expand-dense", action="store_true", help="with --mem: price --expand-dense")
    i.add_argument("--override-ctx", action="store_true", help="with -c: allow a context past the file's trained "
                   "context_length (warns)")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check streaming on == streaming off, bytewise")
    _add_model_args(v)
    v.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    v.add_argument("--steps", type=int, default=32, help="greedy decode steps (default 32)")
    v.add_argument("--override-ctx", action="store_true",
                   help="allow prompt + --steps past the file's trained context_length (warns)")
    # verify always runs streaming off, then on: --moe-stream is refused with verify's own usage (see main)
    v.add_argument("--moe-stream", dest="verify_moe_stream", default=None, help=argparse.SUPPRESS)
    v.set_defaults(func=cmd_verify)

    b = sub.add_parser("bench", help="llama-bench-style throughput table")
    b.add_argument("-m", "--model", default=None)
    b.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (0: skip)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (0: skip)")
    b.add_argument("-r", "--repetitions", type=int, default=3)
    b.add_argument("--slots", default=None, help="comma-separated slot counts (streaming rows; instead of --mem)")
    b.add_argument("--mem", default=None, metavar="SIZE[,SIZE...]", help="comma-separated memory budgets, one row "
                   "each: the pools get what the process, dense weights, KV cache and scratch leave (see run --mem); "
                   "default: the memory available at start less a 10%% margin (at least 256 MiB), with --mem-cap "
                   "the cap less that margin")
    b.add_argument("--io-threads", default="8", help=f"comma-separated IO thread counts (each at most "
                   f"{MAX_IO_THREADS})")
    b.add_argument("--moe-stream", default="on,off", help="on, off or on,off")
    b.add_argument("--overlap", default="on", help="on, off or on,off")
    b.add_argument("--prefetch", default="off", help="router-lookahead prefetch of the streaming rows: off "
                   "(default), on, or off,on (rows in that order)")
    b.add_argument("--direct-io", default=None, help="on, off or on,off: O_DIRECT or buffered expert reads "
                   "(default: O_DIRECT where the file system allows it); the table's reads column says which")
    b.add_argument("-t", "--threads", type=int, default=None, help=THREADS_HELP.replace("the command starts",
                   "bench starts (one count for every row, llama.cpp's included)"))
    b.add_argument("--override-ctx", action="store_true",
                   help="allow -p or -n past the file's trained context_length (warns)")
    b.add_argument("-ub", "--ubatch", "--ubatch-size", type=int, default=128)
    b.add_argument("--expand-dense", action="store_true")
    b.add_argument("--matmul", default="blocks", type=str.lower, metavar="blocks|dequant",
                   help="matmul path of the moestream rows (default blocks: the C kernels)")
    b.add_argument("--cold", action="store_true", help="evict the file from the page cache before each row")
    b.add_argument("--json", default=None, help="write the results as JSON to this file (a symlink is followed; a "
                   "FIFO or device is written into; a regular file is replaced atomically)")
    b.add_argument("--policy", default="lfu", type=str.lower, help="slot replacement policy: lfu or lru")
    b.add_argument("--trace", default=None, metavar="FILE", help="write one per-token trace of the moestream rows' "
                   "timed repetitions to FILE (as run --trace; each record tagged with its row, test and repetition; "
                   "the warm-up is not traced; tracing costs the rows a little speed)")
    b.add_argument("--routing", default="model", metavar="model|calibrated",
                   help="model (default): each row's router picks the experts; calibrated: every moestream row gets "
                   "the same synthetic expert ids with a trained model's popularity skew and reuse, fitted to "
                   "published LRU hit rates (experts/synthetic.py; llama.cpp's rows keep their router)")
    b.add_argument("--vs", default=None, metavar="llama.cpp",
                   help="add llama.cpp's own pp/tg rows on the same file and the ratio moestream / llama.cpp")
    b.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="with --vs llama.cpp: llama.cpp's rows from this llama-bench binary (e.g. a CUDA build of "
                   "tools/llamacpp_cuda.py) instead of the llama-cpp-python bindings: all-GPU and experts-on-CPU "
                   "rows with --device cuda (or auto on a GPU machine), a CPU row otherwise")
    b.add_argument("--gpu-mem", default=None, metavar="SIZE[,SIZE...]", help="CUDA: comma-separated GPU memory "
                   "budgets of the streaming rows (as run --gpu-mem; default: the GPU's free memory less 10%%)")
    b.add_argument("--host-cache", default=None, metavar="SIZE[,SIZE...]", help="comma-separated host-tier sizes of "
                   "the streaming rows (as run --host-cache; off for none), e.g. off,8GiB")
    b.add_argument("--pool", default="device", metavar="device|host", help="CUDA: where the pools live: device, "
                   "host or device,host (the resident rows too: every expert copied there)")
    b.add_argument("--device", default="cpu", action=_Device, metavar="cpu|cuda|auto",
                   help="where the moestream rows compute (default cpu); also picks the --llama-bench rows")
    _add_gpu_layers(b)
    b.add_argument("--mem-cap", default=None, metavar="SIZE",
                   help="run every row in a memory cgroup of SIZE (e.g. 4GiB), page cache included, with the "
                        "file evicted from the page cache before each row (root; cgroup v2, else v1). K/M/G/T and "
                        "KiB/MiB/GiB/TiB are powers of 2 (4G = 4GiB), KB/MB/GB/TB powers of 10, no unit = bytes; "
                        "at least 64MiB")
    add_refused(b, REFUSED)
    add_refused(b, LOG_REFUSED)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, streaming)")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: a free one)")
    sv.add_argument("-c", "--ctx-size", type=int, default=None,
                    help="context per request in tokens, prompt and reply together (default: the file's trained "
                    "context_length, capped so that the KV cache takes at most half the memory available)")
    sv.add_argument("--override-ctx", action="store_true",
                    help="allow a context past the file's trained context_length (warns)")
    sv.add_argument("--moe-stream", type=_on_off, default=True, metavar="on|off",
                    help="stream routed experts (on, default) or address them in a memory map (off)")
    sv.add_argument("-a", "--alias", default=None, metavar="NAME", help="the model's name in /v1/models and the "
                    "'model' requests must give (default: the file name without .gguf; the file name too)")
    sv.add_argument("--trace", default=None, metavar="FILE",
                    help=TRACE_HELP.replace("per-token trace", "per-token trace of every request") +
                    "; the file appears when the server stops")
    sv.add_argument("-np", "--parallel", type=int, default=None, metavar="N",
                    help="generations decoded together, each in a slot with its own KV cache of -c tokens (continuous "
                    "batching: one forward step for all of them, each expert read once per step); requests beyond "
                    "N wait in a queue (llama-server's flag). Default (or -1): 4, fewer if 4 KV caches of an explicit "
                    "-c would take more than half the memory; without -c each slot's context is capped at its "
                    "share, half the memory / N; 1 with --trace")
    sv.add_argument("-cb", "--cont-batching", action="store_true",
                    help="accepted for llama-server's sake: continuous batching is always on (see -np)")
    sv.add_argument("--cache-prompt", type=_on_off, default=True, metavar="on|off",
                    help="a slot keeps its KV cache after a request, and the next request given to it reuses the "
                    "longest common token prefix (on, default; a request's \"cache_prompt\": false opts out)")
    sv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require this key on every route but /health: 'Authorization: Bearer KEY' (OpenAI's "
                    "clients' api_key) or 'X-Api-Key: KEY'; else 401 (repeat for more keys; other users of the "
                    "machine can read a command line: prefer --api-key-file)")
    sv.add_argument("--api-key-file", default=None, metavar="FILE",
                    help="require one of the keys in FILE (one per line) as --api-key does")
    sv.add_argument("-to", "--timeout", type=float, default=600.0, metavar="SECONDS",
                    help="seconds a request's body may take to arrive (llama-server's flag and default: 600); a "
                    "client that sends part of a body and stalls is answered 408 and its connection closed")
    sv.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                    help="let web pages from ORIGIN (e.g. http://localhost:3000; * for any) call the server from a "
                    "browser (CORS; repeat for more). Default: none (llama-server allows any origin)")
    _add_chat_template(sv)
    add_refused(sv, SERVE_REFUSED)
    sv.set_defaults(func=cmd_serve)

    t = sub.add_parser("trace", help="replay a routing trace through LRU, LFU and Belady's optimal replacement")
    t.add_argument("file", metavar="FILE", help="a routing trace written by moestream run --routing-trace FILE")
    t.add_argument("--slots", default=None, metavar="N[,N...]",
                   help="slots per layer to simulate, comma-separated (default: the recorded count; a resident "
                   "trace: a quarter of the experts, at least top-k)")
    t.set_defaults(func=cmd_trace)
    p = sub.add_parser("replay", help="play a per-token trace (run --trace FILE) back in the terminal, or write it "
                       "as one HTML page")
    p.add_argument("file", metavar="TRACE", help="a trace written by moestream run (or bench) --trace FILE")
    p.add_argument("--html", default=None, metavar="OUT.html", help="write a self-contained page (text with "
                   "hoverable tokens, plots of latency, IO wait, hit rate, load and power, a scrubber) instead")
    p.add_argument("--row", type=int, default=None, help="a bench trace: the row to play (default: the first "
                   "traced row)")
    p.add_argument("--speed", type=float, default=1.0, help="playback speed, x the recorded speed (default 1)")
    p.add_argument("--at", type=int, default=None, metavar="N", help="start at token N (1-based); without a "
                   "terminal, print the frame at token N (default: the last)")
    p.set_defaults(func=cmd_replay)
    ap.subcommands = {"run": r, "inspect": i, "verify": v, "bench": b, "trace": t,  # type: ignore[attr-defined]
                      "serve": sv, "replay": p}
    return ap


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that the interpreter's final flush of a broken or full stdout cannot print
    'Exception ignored ...' and change the exit status."""
    if sys.stdout is None:  # stdout was closed at start: nothing to flush
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _did_you_mean(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``"; did you mean --temp?"`` for the first unrecognized flag in ``extra`` that is close to one of
    ``parser``'s (difflib's ratio >= 0.75, the flag's name before any ``=``), else ``""``."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for e in extra:
        if e.startswith("--"):
            close = difflib.get_close_matches(e.split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def main(argv: list[str] | None = None) -> int:
    from .errors import ModelFileChanged, MoestreamError, OutputError

    ap = build_parser()
    try:
        args, extra = ap.parse_known_args(argv)
    except FlagRefused as e:
        print(e, file=sys.stderr)
        return 2
    sub = ap.subcommands[args.command]  # type: ignore[attr-defined]
    if extra:  # the subcommand's usage, not the top-level one
        sub.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(sub, extra)}")
    if getattr(args, "verify_moe_stream", None) is not None:
        sub.error("--moe-stream does not apply to verify: it always runs streaming off, then on, and compares them")
    import signal
    import threading

    from .options import flag_errors

    old_sigint = old_sigterm = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
            signal.default_int_handler:
        _SIGINT_SEEN.clear()
        old_sigint = signal.signal(signal.SIGINT, _on_sigint)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is \
            signal.SIG_DFL:
        _SIGTERM_SEEN.clear()
        old_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with flag_errors(args):  # a library error names an option's field: say the flag
            rc = args.func(args)
        if _SIGTERM_SEEN and rc in (0, 130):  # SIGTERM taken as Ctrl-C (the command may have caught it): 143
            print("moestream: terminated", file=sys.stderr)
            return 143
        if _SIGINT_SEEN and rc == 0:  # a Ctrl-C whose KeyboardInterrupt was lost: still an interrupted command
            print("moestream: interrupted", file=sys.stderr)
            return 130
        return rc
    except MoestreamError as e:
        if isinstance(e, OutputError):
            _silence_stdout()
        print(f"moestream: error: {e}{'; stopping' if isinstance(e, ModelFileChanged) else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if _SIGTERM_SEEN:
            print("moestream: terminated", file=sys.stderr)
            return 143
        print("moestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0
    finally:
        if old_sigint is not None:
            signal.signal(signal.SIGINT, old_sigint)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


if __name__ == "__main__":
    sys.exit(main())
