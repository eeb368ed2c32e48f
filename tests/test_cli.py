"""The commands a user types, on the embedded default model and the fixture."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

from helpers import cli, moestream
from moestream.engine import Sampler, SamplingParams

DEFAULT_GGUF = Path(__file__).resolve().parents[1] / "src" / "moestream" / "data" / "default.gguf"


def test_run_default_model_streams_and_reports():
    p = moestream("run", "-n", "16", "--temp", "0", "-p", "Once upon a time")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Once upon a time") and len(p.stdout.strip()) > len("Once upon a time")
    err = p.stderr.strip().splitlines()
    assert "streaming:" in err[0] and "slots/layer" in err[0]
    stats = err[-1]
    for field in ("prompt", "tok/s", "decode", "expert hit rate", "streamed", "GiB", "peak RSS"):
        assert field in stats, stats


def test_run_resident_and_streaming_print_the_same_text():
    args = ("run", "-n", "12", "--temp", "0", "-p", "The printing press")
    a, b = moestream(*args, "--moe-stream", "off"), moestream(*args, "--slots", "4", "--io-threads", "1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    assert "resident" in a.stderr.splitlines()[0]


def test_run_chat_and_sampling_flags(qwen3moe_tiny):
    p = moestream("run", "-m", str(qwen3moe_tiny["q8_0"]), "--chat", "-p", "Hi!", "-n", "8", "--temp", "0.7",
                  "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "-s", "3", "-t", "1", "-c", "256")
    assert p.returncode == 0, p.stderr
    q = moestream("run", "-m", str(qwen3moe_tiny["q8_0"]), "--chat", "-p", "Hi!", "-n", "8", "--temp", "0.7",
                  "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "-s", "3", "-t", "1", "-c", "256")
    assert p.stdout == q.stdout  # same seed, same text


def test_inspect_default():
    p = moestream("inspect", "--slots", "8")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for field in ("architecture    qwen3moe", "experts         64 per layer, 4 used per token",
                  "bytes/expert", "dense weights", "routed experts", "--slots 8"):
        assert field in out, out


def test_inspect_plan_of_a_file_without_tokenizer(tmp_path):
    """A file without a tokenizer (tools/shrink_vocab.py writes such files for the GPU machine) still gets its
    memory plan: the default context is priced, as no prompt can be tokenized for it."""
    import ggufedit
    from conftest import DEFAULT_GGUF
    from helpers import cli

    keys = [k for k in ggufedit.read(DEFAULT_GGUF).fields if k.startswith("tokenizer.")]
    bare = ggufedit.rewrite(DEFAULT_GGUF, tmp_path / "bare.gguf", drop_kv=tuple(keys))[0]
    for flags in (("--mem", "20GiB"), ("--gpu-mem", "1GiB")):
        p = cli("inspect", "-m", str(bare), *flags)
        assert p.returncode == 0 and "memory plan" in p.stdout, p.stdout + p.stderr


def test_streaming_options_noted_as_ignored_when_resident():
    """--slots / --mem / --prefetch with --moe-stream off: the run says they are ignored (found by a newcomer: a
    budget asked for was dropped without a word)."""
    from helpers import cli

    p = cli("run", "--moe-stream", "off", "--slots", "8", "--prefetch", "on", "-n", "2", "-p", "Hi", "--temp", "0")
    assert p.returncode == 0, p.stderr
    assert "note: --slots, --prefetch: streaming options, ignored with --moe-stream off" in p.stderr, p.stderr
    q = cli("run", "--moe-stream", "off", "-n", "2", "-p", "Hi", "--temp", "0")
    assert q.returncode == 0 and "ignored" not in q.stderr, q.stderr


def test_bench_writes_table_and_json(tmp_path):
    out = tmp_path / "b.json"
    p = moestream("bench", "-p", "8", "-n", "4", "-r", "2", "--slots", "4,8", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("| default.gguf |") == 6  # 3 configurations x (pp, tg)
    rows = json.loads(out.read_text())["rows"]
    assert [r["moe_stream"] for r in rows] == [True, True, False]
    for r in rows:
        assert {t["test"] for t in r["tests"]} == {"pp8", "tg4"}
        assert all(t["tok_s_mean"] > 0 for t in r["tests"])
        assert all(t["host_cpu_pct"] > 0 and t["host_ms_per_token"] > 0 for t in r["tests"])  # this process's CPU
    assert rows[0]["tests"][0]["streamed_gib"] > 0 and rows[2]["tests"][0]["streamed_gib"] == 0


def test_sampler_greedy_and_filters():
    import torch

    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert Sampler(SamplingParams(temp=0))(logits) == 1
    # top-k 1 is greedy whatever the temperature
    assert {Sampler(SamplingParams(temp=5.0, top_k=1, seed=s))(logits) for s in range(20)} == {1}
    # probabilities ~ [0.085, 0.63, 0.23, 0.05]; min-p 0.3 keeps p >= 0.19: tokens 1 and 2
    picked = {Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=s))(logits) for s in range(200)}
    assert picked == {1, 2}
    # top-p keeps the smallest prefix reaching p: with p=0.5 only the top token (p~0.63)
    picked = {Sampler(SamplingParams(temp=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=s))(logits) for s in range(200)}
    assert picked == {1}
    # same seed, same draws
    a = [Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9))(logits) for _ in range(5)]
    b = [Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9))(logits) for _ in range(5)]
    assert a == b


# ------------------------------------------------------------------------------------------------ in process
# The fast tier: moestream.cli.main in this process (helpers.cli), on the embedded model (context_length 4096).
def test_version():
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"moestream {importlib.metadata.version('moestream')}"


@pytest.mark.parametrize("argv, said", [
    (["--bogus"], "unrecognized arguments: --bogus"), (["--bogus", "-x"], "unrecognized arguments: --bogus -x"),
    ([], "the following arguments are required: command")])
def test_top_level_unknown_option_is_named(argv, said):
    """``moestream --bogus`` names the option, as ``moestream run --bogus`` does (not a missing command)."""
    p = cli(*argv)
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == f"moestream: error: {said}", p.stderr


def test_prompt_from_file_and_stdin(tmp_path):
    """-f FILE and -f - give the prompt without one trailing newline: the same run as -p with that text."""
    text = "The printing press\nand its history"
    f = tmp_path / "prompt.txt"
    f.write_text(text + "\n")
    args = ("run", "-n", "6", "--temp", "0", "-t", "1")
    a, b, c = cli(*args, "-p", text), cli(*args, "-f", str(f)), cli(*args, "-f", "-", stdin=text + "\n")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert a.stdout.startswith(text) and a.stdout == b.stdout == c.stdout


@pytest.mark.parametrize("case", ["missing", "dir", "not-utf8", "empty", "and-p", "cnv-stdin", "endless"])
def test_prompt_file_errors(tmp_path, case):
    f = tmp_path / "p.txt"
    extra: tuple[str, ...] = ()
    if case == "dir":
        f = tmp_path
    elif case == "not-utf8":
        f.write_bytes(b"caf\xe9\n")
    elif case == "empty":
        f.write_text("\n")
    elif case == "and-p":
        f.write_text("x")
        extra = ("-p", "y")
    elif case == "cnv-stdin":
        f, extra = Path("-"), ("-cnv",)
    elif case == "endless":  # a device that never ends: read up to the bound, then refused
        f = Path("/dev/zero")
    p = cli("run", "-f", str(f), *extra)
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: "), p.stderr
    want = {"missing": "no such file", "dir": "is a directory", "not-utf8": "not valid UTF-8 (bad byte at offset 3)",
            "empty": "the prompt is empty", "and-p": "-p and -f", "cnv-stdin": "-f -: stdin",
            "endless": "-f /dev/zero: more than 256 MiB"}[case]
    assert want in lines[0], lines[0]


def test_system_prompt_needs_chat():
    p = cli("run", "-sys", "Be brief.", "-n", "2")
    assert p.returncode == 1 and "-sys" in p.stderr and "--chat or -cnv" in p.stderr
    q = cli("run", "--chat", "-sys", "Be brief.", "-n", "4", "--temp", "0", "-t", "1")
    r = cli("run", "--chat", "-n", "4", "--temp", "0", "-t", "1")
    assert q.returncode == r.returncode == 0, q.stderr + r.stderr
    from moestream.tokenizer import GGUFTokenizer

    n_sys = len(GGUFTokenizer.from_gguf(str(DEFAULT_GGUF)).encode("Be brief.", add_special=False))
    assert int(stats(q.stderr)["prompt"]) == int(stats(r.stderr)["prompt"]) + n_sys


def stats(err: str) -> dict[str, str]:
    """The stats line (the last stderr line) as {"prompt": n, "decode": n, "stopped": reason}."""
    line = err.strip().splitlines()[-1]
    assert line.startswith("prompt "), err
    out = {"prompt": line.split()[1], "decode": line.split("decode ")[1].split()[0]}
    if "stopped: " in line:
        out["stopped"] = line.split("stopped: ")[1]
    return out


@pytest.mark.parametrize("args", [("run", "-n", "5000"), ("run", "-c", "4097", "-n", "2"),
                                  ("run", "-p", "x", "-n", "4096"), ("verify", "--steps", "5000"),
                                  ("bench", "-p", "5000", "-n", "0")])
def test_past_the_trained_context_is_refused(args):
    """The embedded model was trained for 4096 tokens (qwen3moe.context_length): a context past it is one error
    line naming that length and the override, before anything is printed."""
    p = cli(*args)
    assert p.returncode == 1 and p.stdout == "", p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "past the 4096 tokens default.gguf was trained for (qwen3moe.context_length)" in lines[0]
    assert "--override-ctx" in lines[0]


def test_override_ctx_warns_and_runs():
    p = cli("run", "-c", "4100", "-n", "3", "--temp", "0", "-t", "1", "--override-ctx")
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("moestream: warning: -c 4100: a context of 4100 tokens is past the 4096 tokens")
    assert stats(p.stderr)["decode"] == "2"


def test_fixture_context_is_the_checkpoints_max_position_embeddings(qwen3moe_tiny):
    """A converted file's context_length is its checkpoint's max_position_embeddings; -c one past it is refused."""
    n = qwen3moe_tiny["config"]["max_position_embeddings"]
    p = cli("run", "-m", str(qwen3moe_tiny["q8_0"]), "-c", str(n + 1), "-n", "2")
    assert p.returncode == 1 and f"past the {n} tokens" in p.stderr, p.stderr


def test_n_minus_one_runs_until_the_context_is_full():
    p = cli("run", "-n", "-1", "-c", "20", "--temp", "0", "-t", "1")  # a 6-token prompt
    assert p.returncode == 0, p.stderr
    s = stats(p.stderr)
    assert s["prompt"] == "6" and s["decode"] == "13" and s["stopped"] == "context full"


def test_n_minus_one_stops_at_end_of_generation(monkeypatch):
    """-n -1 without -c: the trained context (4096), ended by an end-of-generation token. The embedded model does
    not pick its EOS soon, so the test makes a greedy token an end-of-generation id: the first from the 5th on that
    the greedy continuation has not produced before."""
    from moestream import tokenizer
    from moestream.engine import Engine
    from moestream.models.base import LoadOptions, load_model

    tok = tokenizer.GGUFTokenizer.from_gguf(str(DEFAULT_GGUF))
    greedy = Engine(load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False))).generate(
        tok.encode("The history of the printing press"), 16, Sampler(SamplingParams(temp=0))).tokens
    k = next(i for i in range(4, len(greedy)) if greedy[i] not in greedy[:i])
    stop = greedy[k]
    real = tokenizer.GGUFTokenizer.from_fields.__func__

    def with_stop(cls, fields, path, *digest, **lazy):
        t = real(cls, fields, path, *digest, **lazy)
        t.eos_ids = {*t.eos_ids, stop}
        return t

    monkeypatch.setattr(tokenizer.GGUFTokenizer, "from_fields", classmethod(with_stop))
    p = cli("run", "-n", "-1", "--temp", "0", "-t", "1")
    assert p.returncode == 0, p.stderr
    s = stats(p.stderr)
    # k tokens, each fed back by a decode step; the k-th step's logits pick the end-of-generation token
    assert s["decode"] == str(k) and "stopped" not in s


def test_n_below_minus_one_is_refused():
    p = cli("run", "-n", "-2")
    assert p.returncode == 1 and "-n must be -1" in p.stderr


def test_default_threads_leave_busy_cpus_alone():
    """The default -t: the usable CPUs (at most torch's count) less the busy ones, at least 1."""
    from moestream.options import choose_threads, default_threads

    assert choose_threads(64, 2, [0, 0, 0], 0.0) == 2  # idle: torch's count
    assert choose_threads(4, 4, [1, 1, 0, 1, 1], 0.1) == 3  # a job that just started: the run queue
    assert choose_threads(4, 4, [0, 0, 0], 1.9) == 3  # a job that keeps a CPU busy on and off: the load average
    assert choose_threads(2, 2, [5, 0, 0], 0.0) == 2  # one read catching a burst is not a busy CPU
    assert choose_threads(2, 2, [3, 3, 3], 9.0) == 1
    assert 1 <= default_threads() <= max(1, len(os.sched_getaffinity(0)))


def test_default_context_is_capped_by_memory(monkeypatch):
    """-n -1 without -c: the trained context (4096) unless its KV cache would take more than half the memory
    available; then the largest context that fits, said on stderr, and generation stops when it is full."""
    import types

    from moestream import budget
    from moestream.models.base import LoadOptions, load_model

    shape = load_model(str(DEFAULT_GGUF), LoadOptions(metadata_only=True))
    avail = 2 * shape.cache_bytes(40) + 1  # half of it holds 40 positions, not 41
    monkeypatch.setattr(budget.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=avail))
    p = cli("run", "-n", "-1", "--temp", "0", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "context 40 tokens: the file's 4096 would need more than half of the memory" in p.stderr.splitlines()[0]
    s = stats(p.stderr)
    assert s["prompt"] == "6" and s["decode"] == "33" and s["stopped"] == "context full"


def test_inspect_imports_no_torch(fixtures_tool):
    """inspect reads the metadata and the tensor table only, so it imports no torch (issue 27's start time: torch
    alone takes ~1.2 s to import here): a real process's report is made without torch._C loaded and is the text
    the same report has in this process, where torch is imported; with --mem, torch is imported at its first use
    and the plan is printed. On the embedded model and Gemma 4 (whose module uses torch.nn.functional)."""
    import subprocess
    import sys

    from conftest import DEFAULT_GGUF
    from helpers import cli

    code = ("import sys; from moestream.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded:', 'torch._C' in sys.modules, file=sys.stderr); sys.exit(rc)")
    gemma = str(fixtures_tool.build_fixture("gemma4-tiny")["f32"])
    for path in (str(DEFAULT_GGUF), gemma):
        p = subprocess.run([sys.executable, "-c", code, "inspect", "-m", path], capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0 and p.stderr.splitlines()[-1] == "torch loaded: False", p.stderr
        assert p.stdout == cli("inspect", "-m", path).stdout
    p = subprocess.run([sys.executable, "-c", code, "inspect", "--mem", "4GiB"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "memory plan" in p.stdout and p.stderr.splitlines()[-1] == "torch loaded: True"


def test_refused_options_import_no_torch():
    """Every option of run, verify and bench is checked before torch is imported (issue 27: a refusal in a fraction
    of a second, not after torch's ~1.2 s): one real process runs each refusal through ``cli.main`` in turn and
    records, per command, its exit code, its message and whether torch._C was loaded. The messages are the ones the
    in-process commands give (the checks did not change, only when torch comes)."""
    import json
    import subprocess
    import sys

    from helpers import cli

    cases = [["run", "-n", "-5"], ["run", "--top-k=-5"], ["run", "--temp", "nan"], ["run", "--slots", "0"],
             ["run", "--io-threads", "0"], ["run", "--policy", "x"], ["run", "--pool", "x"], ["run", "--mem", "abc"],
             ["run", "--mem", "1GiB", "--slots", "4"], ["run", "--repeat-penalty", "0"], ["verify", "--steps", "0"],
             ["bench", "--slots", "abc"], ["bench", "--io-threads", "0"], ["bench", "-r", "0"],
             ["bench", "--overlap", "maybe"]]
    code = ("import contextlib, io, json, sys; from moestream.cli import main; out = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        rc = main(argv)\n"
            "    out.append([rc, err.getvalue().strip(), 'torch._C' in sys.modules])\n"
            "print(json.dumps(out))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for argv, (rc, err, torch_loaded) in zip(cases, json.loads(p.stdout), strict=True):
        want = cli(*argv)
        assert rc == want.returncode == 1 and err == want.stderr.strip() and "moestream: error:" in err, (argv, err)
        assert not torch_loaded, (argv, err)


def test_run_reads_no_tokenizer_backend():
    """run's start (issue 27): the prompt is encoded by a forked helper (tokenizer.EncodeAhead) while torch is
    imported, so the run itself never reads the cached tokenizer of the embedded (byte-level) model, and a run
    without a host tier imports no Triton. A real process runs ``run`` twice through ``cli.main``, the second time
    with no helper (the prompt encoded in the process): the same text, the same as in this process."""
    import json
    import subprocess
    import sys

    from helpers import cli

    argv = ["run", "-n", "8", "-s", "1", "--temp", "0", "-p", "Hello, <|im_start|> wörld 🎉"]
    want = cli(*argv)  # also fills the tokenizer cache
    assert want.returncode == 0, want.stderr
    code = ("import contextlib, io, json, sys; import moestream.tokenizer as t; from moestream.cli import main\n"
            "reads, load = [], t._load_cached\n"
            "t._load_cached = lambda p: reads.append(p) or load(p)\n"
            "out = []\n"
            "for ahead in (True, False):\n"
            "    if not ahead:\n"
            "        t.EncodeAhead.start = staticmethod(lambda *a: None)\n"
            "    text = io.StringIO()\n"
            "    with contextlib.redirect_stdout(text):\n"
            "        rc = main(json.loads(sys.argv[1]))\n"
            "    out.append([rc, text.getvalue(), len(reads), 'triton' in sys.modules])\n"
            "print(json.dumps(out))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (rc, text, reads, triton), (rc2, text2, reads2, _) = json.loads(p.stdout)
    assert rc == rc2 == 0 and text == text2 == want.stdout and text.startswith(argv[-1])
    assert reads == 0 and reads2 == 1 and not triton


def test_ctrl_c_lost_in_a_finalizer_still_ends_with_130():
    """A Ctrl-C whose KeyboardInterrupt Python loses (raised while a finalizer runs: printed as 'Exception ignored',
    then execution goes on) still ends the command with status 130 and 'moestream: interrupted' (a newcomer saw a
    run go on to exit 0 after one). A real process: the command is replaced by one whose finalizer receives the
    SIGINT, and it returns 0."""
    import subprocess
    import sys

    code = ("import os, signal, sys, time\n"
            "import moestream.cli as c\n"
            "class Fin:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        time.sleep(0.05)\n"
            "def cmd(args):\n"
            "    Fin()\n"
            "    return 0\n"
            "c.cmd_inspect = cmd\n"
            "sys.exit(c.main(['inspect']))\n")
    import signal

    # SIGINT as a terminal leaves it: a pytest-xdist worker ignores it, and a child inherits an ignored signal
    # (the child's os.kill then does nothing: exit 0, no output)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "Exception ignored" in p.stderr and "KeyboardInterrupt" in p.stderr, p.stderr  # the loss happened
    assert p.returncode == 130 and p.stderr.rstrip().endswith("moestream: interrupted"), (p.returncode, p.stderr)


def test_sigterm_ends_a_run_like_ctrl_c(tmp_path):
    """SIGTERM (kill, timeout, a service manager) during ``run --trace`` ends it as Ctrl-C does: the generation
    stops between forward passes, the stats line says so, the trace is kept (closed and renamed into place, its end
    record's stop reason 'interrupted': a newcomer saw 'context full' after a SIGTERM), no temporary file is left
    beside it (a newcomer found one per SIGTERM), one line 'moestream: terminated', status 143. A real process."""
    import signal
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "moestream", "run", "-n", "-1", "-p", "Once upon", "--trace",
                          str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        assert p.stdout.read(12), "no text generated"  # generating: the trace is being written
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 143 and err.rstrip().endswith("moestream: terminated"), (p.returncode, err[-500:])
    assert "Traceback" not in err
    assert trace.exists() and trace.read_text().strip(), "the trace was not kept"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["t.jsonl"]
    assert "stopped: interrupted" in err, err[-500:]
    import json
    end = json.loads(trace.read_text().strip().splitlines()[-1])
    assert end["kind"] == "end" and end["stop_reason"] == "interrupted", end
