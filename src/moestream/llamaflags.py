"""llama.cpp's command-line flags on moestream's parser: read as llama.cpp means them, or refused in one line.

Users type llama-cli / llama-server / llama-bench flags by habit. argparse's defaults misread them: ``-ngl 99``
became ``-n gl``, ``-fa`` became ``-f a``, ``-hf REPO`` became ``-h`` (help, exit 0). :class:`Parser` turns off
both argparse shortcuts -- abbreviated long options and short options joined to their value or to each other --
so that an option is only ever the exact string it was declared as (``--name=value`` still works). Then:

* flags with a moestream meaning work (``-ngl``, ``-np N``, ``-cb``, ``-r``, ``--jinja``, ``-no-cnv`` ..., declared in
  cli.py next to the options they map onto);
* flags moestream has no use for are declared with :func:`add_refused`: given, they stop the parse with one line
  naming the flag and what to do instead, exit status 2 (:class:`FlagRefused`, printed by ``cli.main``).

docs/llama-cpp-flags.md is the table of both. This module imports nothing heavy: it runs before the parse.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["LOG_REFUSED", "REFUSED", "RUN_REFUSED", "SERVE_REFUSED", "FlagRefused", "Parser", "add_refused",
           "gpu_layers_device"]


class FlagRefused(Exception):
    """A llama.cpp flag moestream does not take, or a value an option's type refuses; ``str(e)`` is the one line to
    print (the flag, what to do), exit status 2 (argparse's)."""


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations and without joined short options: ``-ngl`` is ``-ngl`` or unknown, never
    ``-n gl``; ``--mem-`` is not ``--mem``. Sub-parsers made by ``add_subparsers().add_parser`` are Parsers too."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's own signature
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # a value that starts with '-' and a digit is a value, not an option: '--mem -1GiB' reaches --mem's own check
        # (argparse's matcher takes only '-1' and '-1.5': '-1GiB' was "expected one argument"); no option of
        # moestream's starts with a digit
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        # a value its type refuses (--port abc): one line, as a refused flag, not argparse's usage block
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            raise FlagRefused(f"{self.prog}: error: {e}") from None

    def _check_value(self, action: argparse.Action, value: object) -> None:
        try:  # a value not among the choices: one line too
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            if isinstance(action, argparse._SubParsersAction):  # an unknown command: the usage lists them
                raise
            raise FlagRefused(f"{self.prog}: error: {e}") from None

    def _get_option_tuples(self, option_string: str) -> list:
        # argparse calls this for an argument that starts with '-' and is not an exact option string (nor
        # "exact=value"): the candidates it would read it as (a prefix of a long option; a short option with the
        # rest of the string as its value, "-ngl" -> "-n gl"). None: the argument is an unknown option.
        return []


class _Refuse(argparse.Action):
    """Raises FlagRefused as soon as the flag is met (it takes an optional value, so ``-hf REPO`` and ``-fa`` both
    reach it), unless its value is one of ``allowed`` (what asks for what moestream does anyway: ``-fa off``)."""

    def __init__(self, option_strings: list[str], dest: str, why: str = "",  # noqa: ANN003
                 allowed: frozenset[str] = frozenset(), **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why, self.allowed = why, allowed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if isinstance(values, str) and values.lower() in self.allowed:
            return
        raise FlagRefused(f"{parser.prog}: error: {option_string} (llama.cpp's flag): {self.why}")


_MEM = "size the slot pools with --mem (and --gpu-mem with --device cuda); moestream inspect --mem SIZE prints the plan"
_SAMPLERS = ("that sampler is not in moestream: it has --temp, --top-k, --top-p, --min-p, --repeat-penalty, "
             "--presence-penalty and --frequency-penalty")

#: (llama.cpp flags, what moestream says) for every command that loads a model (run, serve, verify, bench, inspect)
REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("-hf", "-hfr", "--hf-repo"), "moestream does not download models: download the .gguf file (e.g. hf download "
     "REPO FILE.gguf --local-dir .) and pass -m FILE"),
    (("-hff", "--hf-file"), "moestream does not download models: pass the downloaded file with -m FILE"),
    (("-hft", "--hf-token"), "moestream does not download models: pass the downloaded file with -m FILE"),
    (("-mu", "--model-url"), "moestream does not download models: download the file and pass -m FILE"),
    (("-dr", "--docker-repo"), "moestream does not download models: download the file and pass -m FILE"),
    (("-fa", "--flash-attn"), "moestream has no flash attention (attention is computed one way per device): "
     "-fa off or -fa auto is taken (that is what it does), -fa on is not; leave it out"),
    (("-ot", "--override-tensor"), "moestream places tensors itself: routed experts are streamed from the file into "
     f"per-layer slot pools, everything else stays resident; {_MEM}"),
    (("-cmoe", "--cpu-moe"), f"experts are streamed from disk into per-layer slot pools; {_MEM}"),
    (("-ncmoe", "--n-cpu-moe"), f"experts are streamed from disk into per-layer slot pools; {_MEM}"),
    (("--no-mmap",), "moestream reads routed experts with pread into its slot pools (with --moe-stream off it maps "
     "the file); leave it out"),
    (("--mlock",), f"the slot pools are moestream's own memory, not a map of the file; {_MEM}"),
    (("-b", "--batch-size"), "moestream has no separate logical batch: it prefills in chunks of -ub N tokens "
     "(--ubatch); use -ub"),
    (("-ctk", "--cache-type-k"), "moestream's KV cache has one type (not quantized); leave it out"),
    (("-ctv", "--cache-type-v"), "moestream's KV cache has one type (not quantized); leave it out"),
    (("-sm", "--split-mode"), "moestream computes on one device: --device cuda uses the first GPU "
     "(CUDA_VISIBLE_DEVICES picks it)"),
    (("-ts", "--tensor-split"), "moestream computes on one device: --device cuda uses the first GPU "
     "(CUDA_VISIBLE_DEVICES picks it)"),
    (("-mg", "--main-gpu"), "moestream computes on one device: --device cuda uses the first GPU "
     "(CUDA_VISIBLE_DEVICES picks it)"),
    (("-dev",), "use --device cpu|cuda|auto"),
    (("-tb", "--threads-batch"), "moestream uses -t threads for prefill and decode alike: use -t"),
    (("--numa",), "moestream does no NUMA placement: leave it out (numactl can bind the process)"),
    (("-mm", "--mmproj"), "moestream runs text models only (no multimodal projector)"),
    (("--lora", "--lora-scaled"), "moestream does not apply LoRA adapters: merge the adapter into the GGUF first"),
    (("-md", "--model-draft"), "moestream has no speculative decoding: leave the draft model out"),
    (("--mirostat",), _SAMPLERS),
    (("--typical",), _SAMPLERS),
    (("--xtc-probability",), _SAMPLERS),
    (("--dry-multiplier",), _SAMPLERS),
    (("--samplers", "--sampling-seq", "--sampler-seq"), "moestream applies its samplers in llama.cpp's default "
     "order (penalties, top-k, top-p, min-p, temperature; docs/usage.md): leave it out"),
    (("--rope-freq-base", "--rope-freq-scale", "--rope-scaling", "--rope-scale"), "moestream takes RoPE's settings "
     "from the GGUF's metadata (as the model was trained): leave it out"),
    (("--keep",), "moestream does not shift the context: a generation stops at the end of the context (-c)"),
    (("--prompt-cache", "--prompt-cache-all", "--prompt-cache-ro"), "moestream keeps no prompt cache file (serve "
     "reuses a request's common prompt prefix, cache_prompt): leave it out"),
    (("--grammar", "--grammar-file"), "only moestream run takes a grammar (serve: a request's response_format)"),
    (("-j", "--json-schema", "--json-schema-file"), "only moestream run takes a JSON schema (serve: a request's "
     "response_format)"),
]

#: serve only (llama-server's)
SERVE_REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("--no-slots",), "moestream serve's /slots endpoint is always on (it shows token counts and request ids, no "
     "prompt text; --api-key guards it); moestream's --slots N is the expert slots per MoE layer"),
]


#: run only (llama-cli's habits that have no place in a one-prompt run)
RUN_REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("-np", "--parallel"), "moestream run generates for one prompt; to decode several requests together use "
     "moestream serve -np N"),
    (("-st", "--single-turn"), "moestream run without -cnv answers one prompt and exits (add --chat to wrap it in "
     "the chat template)"),
    (("--ignore-eos",), "moestream run stops at the model's end-of-generation token; moestream bench -n N times "
     "exactly N generated tokens"),
    (("--in-prefix", "--in-suffix"), "moestream -cnv wraps each turn in the model's chat template (--chat-template, "
     "--chat-template-file); leave it out"),
    (("-e", "--escape"), "moestream takes -p as typed (no escape processing): let the shell write the characters, "
     "e.g. -p $'line one\\nline two', or use -f FILE"),
]

#: every command that loads a model: cosmetic or logging switches of llama.cpp's
LOG_REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("--color", "-co"), "moestream prints plain text (the generated text on stdout, status lines on stderr); "
     "leave it out"),
    (("--log-disable",), "moestream's status lines go to stderr: redirect it (2>/dev/null) to hide them"),
    (("--no-warmup",), "moestream runs no warm-up pass: leave it out"),
    (("-v", "--verbose", "--log-verbose"), "moestream's status lines on stderr are all it logs (serve: one line per "
     "request); leave it out"),
    (("--log-file",), "moestream's status lines go to stderr: redirect it (2>FILE) to keep them"),
]


#: values a refused flag takes without a word, because they ask for what moestream does anyway: llama.cpp's -fa
#: off (and auto, which picks; its off spellings "off", "disabled", "false", "0": llama-bench's -fa 0 too)
ALLOWED_VALUES: dict[str, frozenset[str]] = {"--flash-attn": frozenset({"off", "disabled", "false", "0", "auto", "-1"})}


def add_refused(p: argparse.ArgumentParser, table: list[tuple[tuple[str, ...], str]],
                keep: tuple[str, ...] = ()) -> None:
    """Declare each flag of ``table`` on ``p`` as refused (hidden from --help), skipping any ``p`` already has
    (bench's own ``-p``, ``-r`` ...) and those of ``keep`` (flags the command declares later)."""
    have = set(p._option_string_actions) | set(keep)  # noqa: SLF001 - the option strings argparse already knows
    for flags, why in table:
        free = [f for f in flags if f not in have]
        if free:
            p.add_argument(*free, action=_Refuse, why=why, dest="llama_" + free[-1].lstrip("-").replace("-", "_"),
                           allowed=ALLOWED_VALUES.get(flags[-1], frozenset()))


def gpu_layers_device(value: str) -> str:
    """``-ngl N`` as a ``--device``: 0 -> ``cpu``, N > 0 or ``all`` -> ``cuda``, ``auto`` or -1 -> ``auto``
    (llama.cpp offloads N layers to the GPU; moestream computes the whole model on one device, so any layer on the
    GPU means the GPU). argparse.ArgumentTypeError for anything else."""
    v = value.strip().lower()
    if v == "all":
        return "cuda"
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count, all or auto, got {value!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"expected a layer count (0: the CPU; more: the GPU), got {n}")
    return "auto" if n == -1 else "cuda" if n > 0 else "cpu"
