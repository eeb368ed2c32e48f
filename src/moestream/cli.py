"""The ``moestream`` command: run, inspect, verify, bench.

Errors that a user can cause (bad file, bad option, read failure) print one line on stderr and exit 1;
bad command-line syntax exits 2 (argparse).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources

GiB = 2**30
DEFAULT_PROMPT = "The history of the printing press"
#: Upper bounds of thread options: more IO threads than this only adds contention; more compute threads than
#: 4 per CPU only oversubscribes the cores.
MAX_IO_THREADS = 256


def max_threads() -> int:
    """Upper bound of -t: 4 x the CPUs."""
    return 4 * (os.cpu_count() or 1)


def default_model_path() -> str:
    """The small Qwen3-MoE GGUF embedded in the package (src/moestream/data/default.gguf)."""
    return str(resources.files("moestream") / "data" / "default.gguf")


def model_path(args: argparse.Namespace) -> str:
    """``-m`` or, when it is not given, the embedded model; ConfigError for an empty ``-m ''`` (which must not
    silently mean the embedded model)."""
    from .errors import ConfigError

    if args.model == "":
        raise ConfigError("-m: the model path is empty (leave -m out to use the embedded model)")
    return args.model if args.model is not None else default_model_path()


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout and flush. OutputError when stdout cannot be written (a full disk, /dev/full);
    BrokenPipeError (the reader went away, e.g. ``| head``) passes through: main() exits 0 on it."""
    from .errors import OutputError

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write to stdout ({e.strerror or e})") from None


def _on_off(v: str) -> bool:
    v = v.strip().lower()
    if v in ("on", "1", "true", "yes"):
        return True
    if v in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


def _add_model_args(p: argparse.ArgumentParser, stream_opts: bool = True) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file (or first part of a split model); "
                   "default: the embedded tiny Qwen3-MoE")
    if stream_opts:
        p.add_argument("--slots", type=int, default=None, help="expert slots per MoE layer "
                       "(default: a quarter of the experts, at least top-k)")
        p.add_argument("--io-threads", type=int, default=8, help=f"expert read threads (default 8, at most "
                       f"{MAX_IO_THREADS})")
        p.add_argument("--policy", default="lfu", type=str.lower,
                       help="slot replacement policy: lfu (default) or lru")
        p.add_argument("--overlap", type=_on_off, default=True, metavar="on|off",
                       help="hide expert reads behind the shared/dense FFN, the hits' matmuls and the "
                       "previous prefill tile (default on; off: read, then compute)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: torch's; at most 4 "
                   "x the CPUs; on a busy machine -t 1 can be much faster)")
    p.add_argument("--expand-dense", action="store_true",
                   help="dequantize dense weights to float32 at load (faster, more memory: see inspect)")
    p.add_argument("-ub", "--ubatch", type=int, default=128, help="prefill chunk size in tokens (default 128)")


def _load(args: argparse.Namespace, moe_stream: bool):
    import torch

    from .models.base import LoadOptions, load_model
    _check_common(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    opts = LoadOptions(moe_stream=moe_stream, slots=getattr(args, "slots", None),
                       io_threads=getattr(args, "io_threads", 8), policy=getattr(args, "policy", "lfu"),
                       overlap=getattr(args, "overlap", True), expand_dense=args.expand_dense)
    return load_model(model_path(args), opts), opts


def _tokenizer(model):  # noqa: ANN001, ANN202
    from .tokenizer import GGUFTokenizer
    return GGUFTokenizer.from_fields(model.gguf.fields, model.gguf.path)


def _describe(model) -> str:  # noqa: ANN001
    store = model.store
    if store.streaming:
        slots = min(store.n_slots, model.n_experts)
        mode = (f"streaming: {slots} slots/layer of {model.n_experts} experts, "
                f"{store.pool_bytes / GiB:.3f} GiB of pools, {store.reader.io_threads} IO threads, "
                f"policy {model.opts.policy}, overlap {'on' if model.opts.overlap else 'off'}")
    else:
        mode = "resident: experts addressed in a memory map of the file (--moe-stream off)"
    return (f"moestream: {os.path.basename(model.gguf.path)} | {model.arch}, {len(model.layout.moe_layers)} MoE "
            f"layers, top-{model.top_k} of {model.n_experts} experts | {mode}")


def _check_prompt(prompt: str) -> str:
    """The prompt as valid text; ConfigError if it is empty or not UTF-8 (argv bytes arrive surrogate-escaped)."""
    from .errors import ConfigError

    if prompt == "":
        raise ConfigError("the prompt is empty: give a non-empty -p")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"the prompt is not valid UTF-8 (bad byte at character {e.start})") from None
    return prompt


def _check_common(args: argparse.Namespace) -> None:
    from .engine import MAX_TOKENS
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
    if getattr(args, "slots", None) is not None and isinstance(args.slots, int) and args.slots < 1:
        raise ConfigError(f"--slots must be a positive number, got {args.slots}")
    io = getattr(args, "io_threads", 1)
    if isinstance(io, int) and io < 1:
        raise ConfigError(f"--io-threads must be at least 1, got {io}")
    if isinstance(io, int) and io > MAX_IO_THREADS:
        raise ConfigError(f"--io-threads must be at most {MAX_IO_THREADS}, got {io}")


def cmd_run(args: argparse.Namespace) -> int:
    import contextlib

    from .engine import MAX_TOKENS, Engine, Sampler, SamplingParams, check_cache_fits
    from .errors import ConfigError, MoestreamError

    _check_prompt(args.prompt)
    _check_common(args)
    if args.n_predict < 0:
        raise ConfigError(f"-n must be 0 or more, got {args.n_predict}")
    if args.n_predict > MAX_TOKENS:
        raise ConfigError(f"-n must be at most 2^31, got {args.n_predict}")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise ConfigError(f"-c must be 0 (prompt + -n) or more, got {args.ctx_size}")
    if args.ctx_size is not None and args.ctx_size > MAX_TOKENS:
        raise ConfigError(f"-c must be at most 2^31, got {args.ctx_size}")
    params = SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    model, _ = _load(args, args.moe_stream)
    try:
        tok = _tokenizer(model)
        text = args.prompt
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = tok.encode(text, add_special=True)
        if not ids:
            raise ConfigError("the prompt is empty after tokenization")
        n_ctx = args.ctx_size or len(ids) + args.n_predict
        if len(ids) >= n_ctx and args.n_predict > 0 or len(ids) > n_ctx:
            raise ConfigError(f"the prompt has {len(ids)} tokens; the context size -c {n_ctx} leaves no room to "
                              f"generate")
        # before anything is printed: an absurd -n or -c is refused here, not by torch's allocator
        check_cache_fits(model, n_ctx, f"-c {args.ctx_size}" if args.ctx_size else f"-n {args.n_predict}")
        dec = tok.stream_decoder()
        started = False

        def start() -> None:
            # The description line and the prompt echo wait for the prefill's logits: a file whose weights or
            # metadata fail in the first forward pass leaves one error line and nothing on stdout.
            nonlocal started
            if not started:
                started = True
                print(_describe(model), file=sys.stderr, flush=True)
                if not args.chat:
                    write_stdout(args.prompt)

        def emit(t: int) -> None:
            start()
            write_stdout(dec.push(t))

        engine = Engine(model, args.ubatch)
        try:
            st = engine.generate(ids, args.n_predict, Sampler(params), stop_ids=tok.eos_ids, n_ctx=n_ctx,
                                 on_token=emit)
        except BaseException:
            if started:  # end the partial line; the error itself may be that stdout cannot be written
                with contextlib.suppress(MoestreamError, OSError):
                    write_stdout(dec.flush() + "\n")
            raise
        start()
        write_stdout(dec.flush() + "\n")
    finally:
        model.store.close()
    print(st.line(), file=sys.stderr, flush=True)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .report import inspect_model
    write_stdout(inspect_model(model_path(args), args.slots) + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .engine import MAX_TOKENS, check_cache_fits
    from .errors import ConfigError
    from .verify import verify

    _check_prompt(args.prompt)
    _check_common(args)
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.steps > MAX_TOKENS:
        raise ConfigError(f"--steps must be at most 2^31, got {args.steps}")
    model, opts = _load(args, moe_stream=False)
    tok = _tokenizer(model)
    ids = tok.encode(args.prompt, add_special=True)
    if not ids:
        raise ConfigError("the prompt is empty after tokenization")
    check_cache_fits(model, len(ids) + args.steps, f"--steps {args.steps}", "--steps or prompt")
    slots = opts.slots if opts.slots is not None else None
    if slots is not None and slots < model.top_k:
        raise ConfigError(f"--slots {slots} is below the experts used per token ({model.top_k}); "
                          f"a step needs at least {model.top_k} slots per layer")
    res = verify(model, ids, args.steps, opts, args.ubatch)
    if not res.identical:
        step, pos = res.first_diff
        print(f"moestream verify: DIFFERENT logits at step {step} (token position {pos}); "
              f"streaming on and off disagree", file=sys.stderr)
        return 1
    write_stdout(f"identical: {res.steps} steps (the prefill of a {len(ids)}-token prompt, every position, then "
                 f"{args.steps} greedy decode steps), {res.n_logits} logits compared bytewise; "
                 f"overlap {'on' if opts.overlap else 'off'}, streamed {res.streamed_bytes / GiB:.4f} GiB, "
                 f"hit rate {100 * res.hit_rate:.1f}%\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    _check_common(args)
    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream", description="Run MoE GGUF models with routed experts "
                                 "streamed from disk into per-layer slot caches.")
    sub = ap.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text")
    _add_model_args(r)
    r.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text")
    r.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    r.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens; 0 or unset = prompt + -n (generation stops when it is full)")
    r.add_argument("--moe-stream", type=_on_off, default=True, metavar="on|off",
                   help="stream routed experts (on, default) or address them in a memory map (off)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 = greedy (default 0.8)")
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed; -1 (default) = random")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="print the model's layout and memory needs")
    i.add_argument("-m", "--model", default=None)
    i.add_argument("--slots", type=int, default=None, help="price pools of this many slots per layer")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check streaming on == streaming off, bytewise")
    _add_model_args(v)
    v.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    v.add_argument("--steps", type=int, default=32, help="greedy decode steps (default 32)")
    # verify always runs streaming off, then on: --moe-stream is refused with verify's own usage (see main)
    v.add_argument("--moe-stream", dest="verify_moe_stream", default=None, help=argparse.SUPPRESS)
    v.set_defaults(func=cmd_verify)

    b = sub.add_parser("bench", help="llama-bench-style throughput table")
    b.add_argument("-m", "--model", default=None)
    b.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (0: skip)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (0: skip)")
    b.add_argument("-r", "--repetitions", type=int, default=3)
    b.add_argument("--slots", default=None, help="comma-separated slot counts (streaming rows)")
    b.add_argument("--io-threads", default="8", help=f"comma-separated IO thread counts (each at most "
                   f"{MAX_IO_THREADS})")
    b.add_argument("--moe-stream", default="on,off", help="on, off or on,off")
    b.add_argument("--overlap", default="on", help="on, off or on,off")
    b.add_argument("-t", "--threads", type=int, default=None)
    b.add_argument("-ub", "--ubatch", type=int, default=128)
    b.add_argument("--expand-dense", action="store_true")
    b.add_argument("--cold", action="store_true", help="evict the file from the page cache before each row")
    b.add_argument("--json", default=None, help="write the results as JSON to this file (a symlink is followed; a "
                   "FIFO or device is written into; a regular file is replaced atomically)")
    b.add_argument("--policy", default="lfu", type=str.lower, help="slot replacement policy: lfu or lru")
    b.add_argument("--vs", default=None, metavar="llama.cpp",
                   help="add llama.cpp's own pp/tg rows on the same file and the ratio moestream / llama.cpp")
    b.add_argument("--mem-cap", default=None, metavar="SIZE",
                   help="run every row in a memory cgroup of SIZE (e.g. 4GiB), page cache included, with the "
                        "file evicted from the page cache before each row (root, cgroup v1). K/M/G/T and "
                        "KiB/MiB/GiB/TiB are powers of 2 (4G = 4GiB), KB/MB/GB/TB powers of 10, no unit = bytes; "
                        "at least 64MiB")
    b.set_defaults(func=cmd_bench)
    ap.subcommands = {"run": r, "inspect": i, "verify": v, "bench": b}  # type: ignore[attr-defined]
    return ap


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that the interpreter's final flush of a broken or full stdout cannot print
    'Exception ignored ...' and change the exit status."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    from .errors import MoestreamError, OutputError

    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    sub = ap.subcommands[args.command]  # type: ignore[attr-defined]
    if extra:  # the subcommand's usage, not the top-level one
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "verify_moe_stream", None) is not None:
        sub.error("--moe-stream does not apply to verify: it always runs streaming off, then on, and compares them")
    try:
        return args.func(args)
    except MoestreamError as e:
        if isinstance(e, OutputError):
            _silence_stdout()
        print(f"moestream: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
