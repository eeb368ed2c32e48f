"""What the commands (cli.py, bench.py) share between parsed arguments and the library: the model path, the compute
threads, the one LoadOptions and SamplingParams made from the arguments, and the flags of the options' fields (a
library error names a field; the CLI says the flag)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from importlib import resources

from .errors import ConfigError, OptionError
from .params import LoadOptions, SamplingParams, check_pool  # noqa: F401 - the commands take them from here


def max_threads() -> int:
    """Upper bound of -t: 4 x the CPUs."""
    return 4 * (os.cpu_count() or 1)


def default_model_path() -> str:
    """The small Qwen3-MoE GGUF embedded in the package (src/moestream/data/default.gguf)."""
    return str(resources.files("moestream") / "data" / "default.gguf")


def model_path(args: argparse.Namespace) -> str:
    """``-m`` or, when it is not given, the embedded model; ConfigError for an empty ``-m ''`` (which must not
    silently mean the embedded model)."""
    if args.model == "":
        raise ConfigError("-m: the model path is empty (leave -m out to use the embedded model)")
    return args.model if args.model is not None else default_model_path()


def set_compute_threads(threads: int, matmul: str) -> None:
    """``-t``: with ``--matmul blocks`` the C kernels get ``threads`` and torch one (what is left to torch --
    norms, RoPE, attention, sampling -- is small per token, and torch's thread pool collapses when another job
    competes for the CPUs; one thread also keeps those ops' bits independent of -t); with ``dequant`` torch
    gets them all."""
    import torch

    from . import kernels
    kernels.set_threads(threads)
    torch.set_num_threads(1 if matmul == "blocks" else threads)


def choose_threads(cpus: int, torch_threads: int, running: list[int], load1: float) -> int:
    """The default -t from what :func:`default_threads` reads: ``cpus`` usable, at most ``torch_threads`` (torch's
    own default, the physical cores), less the busy ones -- the larger of the median of ``running`` (other
    runnable tasks, sampled) and the 1-minute load average ``load1`` rounded down -- at least 1."""
    busy = max(sorted(running)[len(running) // 2] if running else 0, int(load1))
    return max(1, min(cpus, torch_threads) - busy)


def default_threads() -> int:
    """Compute threads when -t is not given (:func:`choose_threads`): the CPUs this process may use
    (``os.sched_getaffinity``), at most torch's default, less the CPUs other jobs keep busy: the runnable tasks
    other than this one (``/proc/loadavg``'s running count, 5 reads over 20 ms) or the 1-minute load average.

    More compute threads than free CPUs collapses torch's thread pool (each of the thousands of small parallel
    ops per token waits for a thread the scheduler gave to the other job: 3.9 vs 43 tok/s measured), while one
    thread too few costs little; so a busy machine gets fewer threads."""
    import time

    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    running, load = [], 0.0
    try:
        for i in range(5):
            if i:
                time.sleep(0.005)
            with open("/proc/loadavg") as f:
                fields = f.read().split()
            running.append(int(fields[3].split("/")[0]) - 1)  # this process is running while it reads
            load = float(fields[0])
    except (OSError, ValueError, IndexError):
        running, load = [], 0.0
    return choose_threads(cpus, torch.get_num_threads(), running, load)


#: The command-line flag of each option field (LoadOptions, SamplingParams, token counts): what the CLI says where
#: the library names the field (errors.OptionError.render). The text given for a field is read from the parsed
#: arguments under the field's name, or under :data:`DESTS`' where argparse keeps it elsewhere.
FLAGS = {
    "moe_stream": "--moe-stream", "slots": "--slots", "io_threads": "--io-threads", "policy": "--policy",
    "expand_dense": "--expand-dense", "overlap": "--overlap", "device": "--device", "matmul": "--matmul",
    "mem": "--mem", "n_ctx": "-c", "prefetch": "--prefetch", "direct_io": "--direct-io", "pool": "--pool",
    "gpu_mem": "--gpu-mem", "host_cache": "--host-cache",
    "temp": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed",
    "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "logit_bias": "--logit-bias",
    "n_predict": "-n", "steps": "--steps", "n_prompt": "-p", "n_gen": "-n", "ubatch": "--ubatch",
    "override_ctx": "--override-ctx",
}
DESTS = {"n_ctx": "ctx_size"}


def given_texts(args: argparse.Namespace) -> dict[str, object]:
    """field -> the value given on the command line (as typed where argparse keeps the text: ``--mem 1GiB``)."""
    return {f: getattr(args, DESTS.get(f, f)) for f in FLAGS if getattr(args, DESTS.get(f, f), None) is not None}


def flag_message(e: OptionError, args: argparse.Namespace | None) -> str:
    """The message of a library OptionError with its fields named by their flags and the values as given (the
    device by ``-ngl N`` where that flag set it: ``args.device_flag``)."""
    if args is None:
        return e.render(FLAGS)
    names, given = FLAGS, given_texts(args)
    flag = getattr(args, "device_flag", None)
    if flag:
        names, given = {**FLAGS, "device": flag[0]}, {**given, "device": flag[1]}
    return e.render(names, given)


@contextlib.contextmanager
def flag_errors(args: argparse.Namespace) -> Iterator[None]:
    """Inside: an OptionError (a library check naming an option's field) becomes a ConfigError naming the flag and
    the value as given (``io_threads must be at most 256, got 1000`` -> ``--io-threads must be at most 256, got
    1000``)."""
    try:
        yield
    except OptionError as e:
        raise ConfigError(flag_message(e, args)) from None


def parse_sizes(args: argparse.Namespace) -> tuple[int | None, int | None, int | None]:
    """``(mem, gpu_mem, host_cache)`` in bytes from ``--mem``, ``--gpu-mem`` and ``--host-cache`` (None where not
    given), parsed by budget.parse_mem without importing torch (serve checks them before its socket listens).
    ConfigError naming the flag for a size that cannot be read."""
    from .budget import parse_mem

    def size(name: str, flag: str) -> int | None:
        text = getattr(args, name, None)
        return None if text is None else parse_mem(text, flag)

    return size("mem", "--mem"), size("gpu_mem", "--gpu-mem"), size("host_cache", "--host-cache")


def load_options(args: argparse.Namespace, moe_stream: bool | None = None, warn: bool = True,  # noqa: ANN201
                 **fields: object):
    """The one place a LoadOptions is made from parsed arguments (run, chat, serve, verify, inspect; bench's rows
    are ``dataclasses.replace`` of its base): the sizes parsed (``--mem``, ``--gpu-mem``, ``--host-cache``), every
    option a command does not have at its default, ``fields`` (e.g. ``metadata_only``) over the arguments, and every
    value checked by ``LoadOptions.__post_init__`` (OptionError naming the field: see :func:`flag_errors`).
    ``moe_stream`` None: ``args.moe_stream`` (default on). Prints the --mem warning when it is more than the memory
    available now (``warn``: a check before the real call says nothing). ConfigError naming the flag for a size that
    cannot be read."""
    import sys

    from .budget import warn_over_available

    def source(name: str, flag: str) -> str | None:
        text = getattr(args, name, None)
        return None if text is None else f"{flag} {str(text).strip()}"

    stream = getattr(args, "moe_stream", True) if moe_stream is None else moe_stream
    mem, gpu_mem, host_cache = parse_sizes(args)
    defaults = LoadOptions.__dataclass_fields__
    values = {name: getattr(args, name) for name in ("slots", "io_threads", "policy", "expand_dense", "overlap",
                                                      "device", "matmul", "prefetch", "direct_io", "pool")
              if getattr(args, name, None) is not None or name == "direct_io" and hasattr(args, name)}
    opts = LoadOptions(**{**values, "moe_stream": stream, "mem": mem, "mem_source": source("mem", "--mem"),
                          "gpu_mem": gpu_mem, "gpu_mem_source": source("gpu_mem", "--gpu-mem"),
                          "host_cache": host_cache or defaults["host_cache"].default, **fields})
    if mem is not None and warn:
        warning = warn_over_available(mem)
        if warning:
            print(f"moestream: {warning}", file=sys.stderr, flush=True)
    return opts


def sampling_params(args: argparse.Namespace):  # noqa: ANN201
    """SamplingParams of ``--temp``, ``--top-k``, ``--top-p``, ``--min-p``, ``--seed`` and llama.cpp's penalties
    (``--repeat-penalty``, ``--repeat-last-n``, ``--presence-penalty``, ``--frequency-penalty``; checked by
    ``SamplingParams.__post_init__``, the server's check too)."""
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          logit_bias=logit_bias_flags(getattr(args, "logit_bias", None) or []))


def logit_bias_flags(values: list[str]) -> dict[int, float]:
    """``-l/--logit-bias TOKEN_ID(+/-)BIAS`` values (llama.cpp's form: ``15043+1``, ``15043-0.5``, ``15043-inf``)
    as token id -> bias (the last one given for an id wins). ConfigError naming the flag and the value."""
    import math
    import re

    out: dict[int, float] = {}
    for v in values:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*", v)
        if m is None:
            raise ConfigError(f"--logit-bias {v}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1, 15043-inf)")
        bias = math.inf if m.group(3) == "inf" else float(m.group(3))
        out[int(m.group(1))] = -bias if m.group(2) == "-" else bias
    return out


def grammar_flags(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """``(flag, kind, text)`` of run's ``--json-schema`` / ``--json-schema-file`` (kind ``"json_schema"``) or
    ``--grammar`` / ``--grammar-file`` (kind ``"grammar"``: GBNF or Lark), or None. ConfigError when more than one
    is given, a file cannot be read, or the text (the file's) is empty or only white space."""
    given = [(f, k, getattr(args, d)) for f, k, d in (("--json-schema", "json_schema", "json_schema"),
                                                      ("--json-schema-file", "json_schema", "json_schema_file"),
                                                      ("--grammar", "grammar", "grammar"),
                                                      ("--grammar-file", "grammar", "grammar_file"))
             if getattr(args, d, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"{given[0][0]} and {given[1][0]} both constrain the output: give one")
    flag, kind, value = given[0]
    what = "JSON schema" if kind == "json_schema" else "grammar"
    if flag.endswith("-file"):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{flag} {value}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if not text.strip():
            raise ConfigError(f"{flag} {value}: the file holds no {what} (it is empty or blank)")
        return flag, kind, text
    if not value.strip():
        raise ConfigError(f"{flag}: the {what} is empty")
    return flag, kind, value


def run_grammar(args: argparse.Namespace, tok, n_vocab: int,  # noqa: ANN001
                given: tuple[str, str, str] | None = None) -> str | None:
    """The llguidance grammar of run's constraint flags (``given``: :func:`grammar_flags`' answer, when the caller
    has it), checked against the vocabulary; None without one. ConfigError naming the flag: a schema that is not
    JSON, a grammar that does not compile."""
    import json

    got = given or grammar_flags(args)
    if got is None:
        return None
    flag, kind, text = got
    from .structured import GrammarError, check_grammar, json_schema_grammar, text_grammar

    try:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ConfigError(f"{flag}: not JSON ({e})") from None
            grammar = json_schema_grammar(schema)
        else:
            grammar = text_grammar(text)
        check_grammar(grammar, tok, n_vocab)
    except GrammarError as e:
        raise ConfigError(f"{flag}: {e}") from None
    return grammar
