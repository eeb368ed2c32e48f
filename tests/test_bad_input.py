"""Bad input found by a newcomer's review: each gets one line ``moestream: error: FILE-or-OPTION: problem`` on
stderr and a non-zero exit (argparse syntax errors: 2), no traceback, nothing half-written, never wrong output.

All on the embedded default model (``default_gguf``) and bad copies of it made with ``ggufedit.rewrite``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ggufedit import rewrite
from helpers import cli as run_cli
from moestream import bench, options
from moestream.engine import Engine, check_cache_fits
from moestream.errors import ConfigError, ForwardError, GGUFError, OutputError
from moestream.memcap import parse_cap, parse_size
from moestream.models import base
from moestream.models.base import LoadOptions, load_model


# ------------------------------------------------------------------------------------------------ helpers
def moestream(*args: str, prefix: tuple[str, ...] = (), **kw) -> subprocess.CompletedProcess:
    """``moestream ARGS``: in this process (``helpers.cli``, imported as ``run_cli``) when only the output is
    wanted; in a subprocess, ``python -m moestream ARGS``, behind ``prefix`` (e.g. setpriv) or with
    ``stdout``/``stderr`` given (a real process's file descriptors). ``test_a_real_process_prints_one_line``
    checks that the two agree."""
    if not prefix and not kw:
        return run_cli(*(str(a) for a in args))
    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    return subprocess.run([*prefix, sys.executable, "-m", "moestream", *args], text=True, timeout=300, **kw)


@pytest.mark.parametrize("args", [
    ("run", "-n", "2", "--slots", "1"),  # below top-k: a config error
    ("inspect", "-m", "/dev/zero"),  # not a GGUF file
    ("bench", "-p", "4", "-n", "2", "--mem-cap", "1k"),  # a bench option
])
def test_a_real_process_prints_one_line(args):
    """The same bad input gives the same one line and exit status in a real process as in this one (the rest of
    this file runs the command line in this process)."""
    real = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True, timeout=300)
    here = run_cli(*args)
    assert_one_line_error(real)
    assert (real.returncode, real.stdout, real.stderr) == (here.returncode, here.stdout, here.stderr)


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str, stdout_empty: bool = True) -> str:
    """Exit 1, exactly one non-empty stderr line ``moestream: error: ...`` holding every needle, no traceback,
    and (by default) nothing on stdout. Returns the line."""
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("moestream: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    if stdout_empty:
        assert p.stdout == "", p.stdout
    return lines[0]


@pytest.fixture(scope="module")
def model(default_gguf):
    """The default model, resident, loaded once in this process (for the in-process checks)."""
    m = load_model(str(default_gguf), LoadOptions(moe_stream=False))
    yield m
    m.store.close()


# ------------------------------------------------------------------------------------------------ 1. bench --json
def test_write_json_follows_a_symlink(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    bench.write_json(str(link), {"a": 1})
    assert link.is_symlink() and os.readlink(link) == target.name  # the link stays a link
    assert target.read_text().strip().replace(" ", "").replace("\n", "") == '{"a":1}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # an existing file keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temporary file left


def test_write_json_writes_into_a_fifo_and_a_device(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    bench.write_json(str(fifo), {"rows": []})
    reader.join(timeout=30)
    assert got and '"rows": []' in got[0]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a FIFO, not replaced by a regular file
    bench.write_json("/dev/null", {"rows": []})
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if os.path.exists("/dev/full"):
        with pytest.raises(OutputError, match="--json /dev/full: cannot write the results"):
            bench.write_json("/dev/full", {"rows": []})
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_bench_json_through_a_symlink_and_slots_deduplicated(tmp_path):
    """End to end: the link stays a link, its target gets the JSON; ``--slots 4,4`` is one row, not two."""
    target = tmp_path / "results.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    p = moestream("bench", "-p", "4", "-n", "2", "-r", "1", "--moe-stream", "on", "--slots", "4,4",
                  "--json", str(link))
    assert p.returncode == 0, p.stderr
    assert link.is_symlink() and target.is_file()
    rows = json.loads(target.read_text())["rows"]
    assert [(r["moe_stream"], r["slots"]) for r in rows] == [(True, 4)]
    assert p.stdout.count("| default.gguf |") == 2  # one row: pp4 and tg2


def test_bench_json_never_replaces_the_model(tmp_path, default_gguf):
    """A typo (``--json`` naming the model) is refused before any row runs; the model is left as it was."""
    model = tmp_path / "m.gguf"
    shutil.copyfile(default_gguf, model)
    before = model.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(model)
    for target in (model, link):
        assert_one_line_error(moestream("bench", "-m", str(model), "-p", "4", "-n", "2", "-r", "1", "--json",
                                        str(target)), "that is the model file")
    assert model.read_bytes() == before


@pytest.mark.parametrize("target,needle", [
    ("new.json/", "the path ends with '/'"),
    ("/proc/moestream-results.json", "cannot write a file there"),
])
def test_bench_json_paths_checked_before_any_row(tmp_path, target, needle):
    path = target if target.startswith("/") else f"{tmp_path}/{target}"  # (pathlib would drop the '/')
    assert_one_line_error(moestream("bench", "-p", "4", "-n", "2", "-r", "1", "--json", path), needle)
    assert not (tmp_path / "new.json").exists()


def test_on_off_values_take_any_case():
    """run/verify and bench read on|off alike (case and surrounding spaces do not matter)."""
    p = moestream("bench", "-p", "4", "-n", "2", "-r", "1", "--moe-stream", "ON", "--slots", "4",
                  "--overlap", "Off, off")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("| off |") == 2 and "| on |" not in p.stdout
    p = moestream("verify", "--steps", "2", "--overlap", " OFF")
    assert p.returncode == 0, p.stderr
    assert "overlap off" in p.stdout


@pytest.mark.parametrize("args,needle", [
    (("run", "--policy", "bogus", "-n", "2"), "--policy: unknown cache policy 'bogus'"),
    (("bench", "--policy", "bogus", "-p", "4", "-n", "2"), "--policy: unknown cache policy 'bogus'"),
    (("bench", "--slots", "abc", "-p", "4", "-n", "2"), "--slots: expected a comma-separated list of integers"),
])
def test_option_named_in_the_message(args, needle):
    assert_one_line_error(moestream(*args), needle)


# ------------------------------------------------------------------------------------------------ 2. permissions
def _no_dac_prefix() -> tuple[str, ...]:
    """A command prefix under which file permissions apply: nothing for a normal user; for root, setpriv dropping
    the capabilities that override them (skip when setpriv is missing)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE to test permissions")
    caps = "-dac_override,-dac_read_search"
    return (setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}")


@pytest.mark.parametrize("command", ["inspect", "run", "verify", "bench"])
def test_unreadable_model_file(tmp_path, default_gguf, command):
    prefix = _no_dac_prefix()
    path = tmp_path / "secret.gguf"
    shutil.copy(default_gguf, path)
    path.chmod(0)
    assert_one_line_error(moestream(command, "-m", str(path), prefix=prefix), str(path), "permission denied")


def test_model_in_an_unsearchable_directory(tmp_path, default_gguf):
    prefix = _no_dac_prefix()
    locked = tmp_path / "locked"
    locked.mkdir()
    path = locked / "m.gguf"
    shutil.copy(default_gguf, path)
    locked.chmod(0)
    try:
        line = assert_one_line_error(moestream("run", "-m", str(path), "-n", "2", prefix=prefix), str(path),
                                     "permission denied")
        assert "no such file" not in line
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------------------------------------ 3. non-finite numbers
@pytest.mark.parametrize("key,value", [
    ("qwen3moe.attention.layer_norm_rms_epsilon", float("nan")),
    ("qwen3moe.rope.freq_base", -1.0),
])
def test_non_finite_or_negative_hyperparameters(tmp_path, default_gguf, key, value):
    """Before: ``run --temp 0`` printed token 0 repeated, ``verify`` said identical."""
    path = tmp_path / "bad.gguf"
    rewrite(default_gguf, path, set_kv={key: value})
    for cmd in (("run", "-n", "2", "--temp", "0"), ("verify", "--steps", "2")):
        assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path),
                              f"metadata key {key} is {value}, which must be a positive finite number")


def _qwen3moe_with(default_gguf: Path, **fields: object) -> None:
    """Build the default model's class on its metadata with ``fields`` replaced (no weight is read)."""
    from moestream.gguf import GGUFModel
    from moestream.models.qwen3moe import Qwen3MoE

    g = GGUFModel(default_gguf)
    g.fields.update({k.replace("__", "."): v for k, v in fields.items()})
    Qwen3MoE(g, LoadOptions(moe_stream=False, metadata_only=True))


@pytest.mark.parametrize("key,value,needle", [
    ("attention.layer_norm_rms_epsilon", 0.0, "is 0.0, which must be a positive finite number"),
    ("attention.layer_norm_rms_epsilon", float("inf"), "is inf, which must be a positive finite number"),
    ("attention.layer_norm_rms_epsilon", "x", "must be a number, got 'x'"),
    ("rope.freq_base", float("nan"), "is nan, which must be a positive finite number"),
    ("rope.freq_base", float("-inf"), "is -inf, which must be a positive finite number"),
    ("attention.head_count", 0, "is 0, which must be at least 1"),
    ("attention.key_length", 2.5, "must be an integer, got 2.5"),
    ("context_length", 0, "is 0, which must be at least 1"),
])
def test_hyperparameters_checked_at_load(default_gguf, key, value, needle):
    with pytest.raises(GGUFError, match=re.escape(f"metadata key qwen3moe.{key} {needle}")):
        _qwen3moe_with(default_gguf, **{f"qwen3moe__{key.replace('.', '__')}": value})
    _qwen3moe_with(default_gguf)  # the unchanged metadata passes


def test_checked_getters(model):
    """The getters every architecture reads its hyperparameters through (models/base.py)."""
    fields = model.gguf.fields
    saved = dict(fields)
    try:
        fields["qwen3moe.x"] = float("nan")
        with pytest.raises(GGUFError, match=r"qwen3moe.x is nan, which must be 0 or a positive finite number"):
            model.meta_float("x", allow_zero=True)
        fields["qwen3moe.x"] = "abc"
        with pytest.raises(GGUFError, match="qwen3moe.x must be a number, got 'abc'"):
            model.meta_float("x")
        fields["qwen3moe.x"] = 0
        assert model.meta_float("x", allow_zero=True) == 0.0
        with pytest.raises(GGUFError, match="qwen3moe.x is 0, which must be at least 1"):
            model.meta_int("x")
        fields["qwen3moe.x"] = [4, 4, 0]
        with pytest.raises(GGUFError, match="lists 3 values, expected one per layer"):
            model.meta_ints("x", 4)
        with pytest.raises(GGUFError, match="qwen3moe.x is 0"):
            model.meta_ints("x", 3)
    finally:
        fields.clear()
        fields.update(saved)


def _nan_first(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flat[0] = np.nan
    return a


@pytest.fixture(scope="module")
def nan_models(default_gguf, tmp_path_factory) -> dict[str, Path]:
    """A NaN in a norm weight (F32), and a NaN quantization scale (the first Q8_0 block of attn_q)."""
    d = tmp_path_factory.mktemp("nan")
    norm = d / "nan-norm.gguf"
    rewrite(default_gguf, norm, convert={"blk.0.attn_norm.weight": _nan_first})
    scale = d / "nan-q8-scale.gguf"
    shutil.copy(default_gguf, scale)
    from gguf import GGMLQuantizationType

    from ggufedit import read as GGUFReader
    t = next(t for t in GGUFReader(str(default_gguf)).tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type == GGMLQuantizationType.Q8_0
    with open(scale, "r+b") as f:  # a Q8_0 block starts with its float16 scale
        f.seek(int(t.data_offset))
        f.write(np.array([np.nan], dtype=np.float16).tobytes())
    return {"norm": norm, "scale": scale}


@pytest.mark.parametrize("kind,args", [
    ("norm", ("run", "-n", "4", "--temp", "0")),
    ("norm", ("run", "-n", "4", "--temp", "0.8")),
    ("norm", ("verify", "--steps", "2")),
    ("scale", ("run", "-n", "4", "--temp", "0")),
    ("scale", ("verify", "--steps", "2")),
])
def test_nan_weights_are_reported_not_decoded(nan_models, kind, args):
    """Before: greedy printed token 0 forever, sampling crashed in torch, verify said "identical" (NaN bytes
    compare equal). Now: one line naming the file and the first bad position, exit 1, nothing on stdout."""
    path = str(nan_models[kind])
    line = assert_one_line_error(moestream(*args[:1], "-m", path, *args[1:]), path, "non-finite logits at position",
                                 "(the weights or metadata produce NaN/Inf)")
    assert "identical" not in line


# ------------------------------------------------------------------------------------------------ 4. shapes
def test_head_count_disagreeing_with_attn_q(tmp_path, default_gguf):
    path = tmp_path / "heads.gguf"
    rewrite(default_gguf, path, set_kv={"qwen3moe.attention.head_count": 3})
    for cmd in (("run", "-n", "4", "-p", "Hi"), ("inspect",)):
        assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path), "tensor blk.0.attn_q.weight",
                              "qwen3moe.attention.head_count=3", "implies [96, 64]")


@pytest.mark.parametrize("fields,needle", [
    ({"qwen3moe__attention__head_count_kv": 4}, "tensor blk.0.attn_k.weight has shape [64, 64] but the metadata "
     "(qwen3moe.attention.head_count_kv=4, qwen3moe.attention.key_length=32, qwen3moe.embedding_length=64) "
     "implies [128, 64]"),
    ({"qwen3moe__attention__value_length": 16}, "tensor blk.0.attn_v.weight"),
    ({"qwen3moe__attention__key_length": 16}, "tensor blk.0.attn_q.weight"),
    ({"qwen3moe__embedding_length": 128}, "tensor blk.0.ffn_down_exps.weight has shape [64, 64, 128] but the "
     "metadata (qwen3moe.embedding_length=128) implies [64, 128, 128]"),
    ({"qwen3moe__attention__head_count": 8, "qwen3moe__attention__head_count_kv": 4,
      "qwen3moe__attention__key_length": 16, "qwen3moe__attention__value_length": 16},
     "tensor blk.0.attn_q_norm.weight has shape [32] but the metadata (qwen3moe.attention.key_length=16)"),
    ({"qwen3moe__attention__head_count_kv": 3, "qwen3moe__attention__head_count": 3,
      "qwen3moe__attention__key_length": 42}, "tensor blk.0.attn_q.weight"),
])
def test_shape_bearing_metadata(default_gguf, fields, needle):
    with pytest.raises(GGUFError, match=re.escape(needle)):
        _qwen3moe_with(default_gguf, **fields)


def test_torch_error_in_a_forward_pass_is_one_line(default_gguf):
    """The last line of defence: a torch RuntimeError inside forward -> one line naming the file, exit 1."""
    code = ("import sys\n"
            "from moestream.models import qwen3moe\n"
            "def boom(*a, **k):\n"
            "    raise RuntimeError('shape [1, 3, 32] is invalid for input of size 128\\nmore detail')\n"
            "qwen3moe.Qwen3MoE.forward = boom\n"
            "from moestream.cli import main\n"
            f"sys.exit(main(['run', '-m', {str(default_gguf)!r}, '-n', '2']))\n")
    assert_one_line_error(python(code), str(default_gguf), "the forward pass at positions 0..",
                          "(internal error: RuntimeError: shape [1, 3, 32] is invalid for input of size 128)")


def test_only_torch_runtime_errors_are_wrapped(model, monkeypatch):
    def raising(exc: BaseException):
        def forward(*args, **kwargs):
            raise exc
        return forward

    eng = Engine(model)
    cache = model.new_cache(4)
    monkeypatch.setattr(model, "forward", raising(RuntimeError("bad shape")))
    with pytest.raises(ForwardError, match="internal error: RuntimeError: bad shape"):
        eng.prefill([1, 2], cache)
    for exc in (NotImplementedError("todo"), KeyError("k"), ValueError("context full")):
        monkeypatch.setattr(model, "forward", raising(exc))
        with pytest.raises(type(exc)):
            eng.prefill([1, 2], cache)


# ------------------------------------------------------------------------------------------------ 5. huge sizes
def test_cache_bytes_matches_the_cache(model):
    for n in (1, 37, 300):
        assert model.cache_bytes(n) == model.new_cache(n).nbytes
    with pytest.raises(ConfigError, match=r"-n 9: a context of 100000000000 tokens is more than"):
        check_cache_fits(model, 10**11, "-n 9")


@pytest.mark.parametrize("args,needles", [
    # past the file's trained context (4096) is refused first; --override-ctx reaches the memory check
    (("run", "-n", "100000000"),
     ("the 6-token prompt + -n 100000000: a context of 100000006 tokens is past the 4096 tokens",)),
    (("run", "-n", "100000000", "--override-ctx"),
     ("the 6-token prompt + -n 100000000: a context of 100000006 tokens needs", "GiB of KV cache",
      "GiB of memory is available")),
    (("run", "-c", "2000000000", "-n", "4", "--override-ctx"),
     ("-c 2000000000: a context of 2000000000 tokens needs",)),
    (("run", "-c", "99999999999"), ("-c must be at most 2^31, got 99999999999",)),
    (("run", "-n", "99999999999999999999"), ("-n must be at most 2^31, got 99999999999999999999",)),
    (("verify", "--steps", "100000000", "--override-ctx"), ("--steps 100000000: a context of", "GiB of KV cache",
                                                            "use a smaller --steps or prompt")),
    (("bench", "-p", "99999999999", "-n", "1"), ("-p must be at most 2^31, got 99999999999",)),
    # refused before the table's header is printed (one line, empty stdout), not as a failed row per config
    (("bench", "-p", "100000000", "-n", "1", "--override-ctx"), ("-p/-n: a context of 100000000 tokens needs",
                                                                 "use a smaller -p or -n")),
])
def test_absurd_sizes(args, needles):
    assert_one_line_error(moestream(*args), *needles)


# ------------------------------------------------------------------------------------------------ 6. stdout
def test_stdout_that_cannot_be_written():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = moestream("inspect", stdout=full, stderr=subprocess.PIPE)
        assert_one_line_error(p, "cannot write to stdout (No space left on device)", stdout_empty=False)
        p = moestream("run", "-n", "5", "--temp", "0", stdout=full, stderr=subprocess.PIPE)
    # run prints its description line first; the error is the one error line, and the last
    assert p.returncode == 1 and "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1] == "moestream: error: cannot write to stdout (No space left on device)", p.stderr
    assert sum(ln.startswith("moestream: error:") for ln in lines) == 1


def test_closed_pipe_is_quiet():
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "run", "-n", "64", "--temp", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(5)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err


# ------------------------------------------------------------------------------------------------ 7. empty values
@pytest.mark.parametrize("args,needle", [
    (("run", "-m", ""), "-m: the model path is empty"),
    (("inspect", "-m", ""), "-m: the model path is empty"),
    (("bench", "-m", ""), "-m: the model path is empty"),
    (("bench", "--mem-cap", ""), "--mem-cap: the value is empty"),
    (("bench", "--json", ""), "--json: the value is empty"),
    (("bench", "--vs", ""), "--vs: the value is empty"),
])
def test_empty_values_are_not_unset(args, needle):
    """Before: ``--mem-cap ''`` ran uncapped with exit 0, ``-m ''`` ran the embedded model."""
    assert_one_line_error(moestream(*args), needle)


# ------------------------------------------------------------------------------------------------ 8. --mem-cap
def test_mem_cap_units():
    assert parse_size("1TiB") == parse_size("1T") == parse_size("1t") == 2**40
    assert parse_size("4G") == parse_size("4GiB") == 4 * 2**30  # binary, as documented
    assert parse_size("100000GiB") == 100000 * 2**30
    assert parse_size("2TB") == 2 * 10**12 and parse_size("512K") == 512 * 2**10 and parse_size("7B") == 7
    assert parse_cap("64MiB") == 64 * 2**20
    for zero in ("0", "0GiB", "-1G"):
        with pytest.raises(ConfigError, match="must be positive"):
            parse_size(zero)
    for small in ("100", "1k", "63MiB"):
        with pytest.raises(ConfigError, match="below the 64 MiB minimum"):
            parse_cap(small)
    for bad in ("1e400G", "1e3G", "1_000M", "+1G", "0x10G", "4XB", "GiB", "nan", "inf", "1.5.G"):
        with pytest.raises(ConfigError, match="--mem-cap: cannot read"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="unknown unit 'XB'"):  # as typed, not lower-cased
        parse_size("4 XB")


@pytest.mark.parametrize("cap,needle", [("0GiB", "must be positive"), ("1k", "below the 64 MiB minimum")])
def test_mem_cap_cli(cap, needle):
    assert_one_line_error(moestream("bench", "-p", "4", "-n", "2", "--mem-cap", cap), "--mem-cap", needle)


# ------------------------------------------------------------------------------------------------ 9. minor
def test_inspect_clamps_slots_like_run():
    p = moestream("inspect", "--slots", "1000")
    assert p.returncode == 0, p.stderr
    assert "--slots 64 " in p.stdout and "(100.0% of experts)" in p.stdout and "clamped" in p.stdout


def test_inspect_unknown_architecture_like_run(tmp_path, default_gguf):
    path = tmp_path / "other.gguf"
    rewrite(default_gguf, path, arch="bert")
    lines = {assert_one_line_error(moestream(cmd, "-m", str(path))) for cmd in ("inspect", "run")}
    assert lines == {f"moestream: error: {path}: architecture 'bert' is not supported; supported: "
                     f"{supported_architectures()}"}


def supported_architectures() -> str:
    """The registered architectures as the error lists them (every model module imported)."""
    base._import_architectures()
    names = sorted(base.ARCHITECTURES)
    assert {"gemma4", "qwen35moe", "qwen3moe"} <= set(names)
    return ", ".join(names)


def test_device_is_not_a_model():
    assert_one_line_error(moestream("inspect", "-m", "/dev/zero"), "/dev/zero: is a character device",
                          "not a regular file")


@pytest.mark.parametrize("args,needle", [
    (("run", "--io-threads", "257"), "--io-threads must be at most 256, got 257"),
    (("bench", "--io-threads", "8,1000"), "--io-threads must be at most 256, got 1000"),
    (("run", "-t", str(4 * (os.cpu_count() or 1) + 1)), f"-t must be at most {options.max_threads()} (4 x the"),
    (("verify", "-t", "100000"), "-t must be at most "),
])
def test_thread_bounds(args, needle):
    assert_one_line_error(moestream(*args), needle)


def test_verify_refuses_moe_stream_with_its_own_usage():
    p = moestream("verify", "--moe-stream", "off")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("usage: moestream verify"), p.stderr
    assert "moestream verify: error: --moe-stream does not apply to verify" in p.stderr
    p = moestream("verify", "--bogus")
    assert p.returncode == 2 and p.stderr.startswith("usage: moestream verify"), p.stderr


# ------------------------------------------------------------------------------------------------ 10. --vs message
def test_vs_llamacpp_missing_points_at_the_installer(default_gguf):
    code = ("import sys\n"
            "sys.modules['llama_cpp'] = None  # import llama_cpp -> ImportError, as when it is not installed\n"
            "from moestream.cli import main\n"
            f"sys.exit(main(['bench', '-m', {str(default_gguf)!r}, '-p', '4', '-n', '2', '--vs', 'llama.cpp']))\n")
    line = assert_one_line_error(python(code), "--vs llama.cpp needs llama-cpp-python",
                                 "tools/llamacpp.py install", "about 5 minutes")
    assert "pip install" not in line


# ------------------------------------------------------------------------------------------------ 10. ggml types
def _set_type_id(src: Path, dst: Path, tensor: str, type_id: int) -> None:
    """Copy ``src`` to ``dst`` with the ggml type id of ``tensor`` in the tensor table overwritten (bad input
    only: nothing else changes, so the data no longer matches the type)."""
    from ggufedit import read as GGUFReader

    t = next(t for t in GGUFReader(str(src)).tensors if t.name == tensor)
    name_len, name, n_dims, dims = t.field.parts[:4]
    offset = t.field.offset + name_len.nbytes + name.nbytes + n_dims.nbytes + dims.nbytes
    data = bytearray(src.read_bytes())
    assert int.from_bytes(data[offset:offset + 4], "little") == int(t.tensor_type)
    data[offset:offset + 4] = type_id.to_bytes(4, "little")
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize(("tensor", "shift"), [("blk.0.attn_norm.weight", 4), ("blk.1.ffn_down_exps.weight", 32),
                                               ("blk.1.ffn_down_exps.weight", -32)])
def test_a_moved_tensor_offset_is_refused(tmp_path, default_gguf, tensor, shift):
    """A tensor whose data offset is not where llama.cpp's loader expects it (right after the previous tensor's
    data, padded to the alignment) is refused at load by name, as llama.cpp refuses it; it used to run and print
    other text (a norm moved by 4 bytes) or fail later as NaN logits (an expert matrix moved by 32)."""
    from ggufedit import read as GGUFReader

    reader = GGUFReader(str(default_gguf))
    t = next(t for t in reader.tensors if t.name == tensor)
    off_field = t.field.parts[-1]  # the tensor table entry's uint64 offset, relative to the data section
    pos = t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])
    rel = int(t.data_offset) - int(reader.data_offset)
    data = bytearray(default_gguf.read_bytes())
    assert off_field.nbytes == 8 and int.from_bytes(data[pos:pos + 8], "little") == rel
    data[pos:pos + 8] = (rel + shift).to_bytes(8, "little")
    path = tmp_path / "moved.gguf"
    path.write_bytes(bytes(data))
    lines = {assert_one_line_error(moestream(cmd, "-m", str(path), *args))
             for cmd, args in (("inspect", ()), ("run", ("-n", "2")))}
    assert lines == {f"moestream: error: {path}: tensor {tensor} has data offset {rel + shift}, expected {rel} "
                     f"(tensors follow each other in table order, each padded to 32 bytes)"}


@pytest.mark.parametrize("tensor", ["blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight"])
def test_unknown_type_id_names_the_file_and_tensor(tmp_path, default_gguf, tensor):
    path = tmp_path / "type99.gguf"
    _set_type_id(default_gguf, path, tensor, 99)
    lines = {assert_one_line_error(moestream(cmd, "-m", str(path), *args))
             for cmd, args in (("inspect", ()), ("run", ("-n", "2")))}
    assert lines == {f"moestream: error: {path}: tensor {tensor} has ggml type 99, which is not a known ggml type "
                     "(a newer llama.cpp, or a corrupt tensor table)"}


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "output_norm.weight", "blk.2.ffn_up_exps.weight"])
def test_inspect_refuses_a_type_run_refuses(tmp_path, default_gguf, tensor):
    """A dense or expert tensor in a type moestream cannot compute (F64): ``inspect`` gives run's line."""
    path = tmp_path / "f64.gguf"
    rewrite(default_gguf, path, convert={tensor: lambda a: a.astype(np.float64)})
    lines = {assert_one_line_error(moestream(cmd, "-m", str(path), *args))
             for cmd, args in (("inspect", ()), ("run", ("-n", "2")))}
    assert lines == {f"moestream: error: {path}: tensor {tensor} is ggml type 28 (F64), which moestream cannot "
                     "compute"}


def test_inspect_checks_the_tensors_loading_reads(default_gguf, monkeypatch):
    """``check_dense_types`` + the expert check (inspect) cover exactly the tensors a full load checks (run)."""
    from moestream.models import base, layers

    seen: list[str] = []
    real = layers.check_computable

    def spy(info):  # noqa: ANN001
        seen.append(info.name)
        return real(info)

    monkeypatch.setattr(layers, "check_computable", spy)
    monkeypatch.setattr(base, "check_computable", spy)
    m = load_model(str(default_gguf), LoadOptions(moe_stream=False))
    m.store.close()
    loaded, seen[:] = set(seen), []
    base.architecture_of(m.gguf)(m.gguf, LoadOptions(moe_stream=False, metadata_only=True)).check_dense_types()
    assert set(seen) == loaded == set(m.gguf.tensors)


def test_no_c_compiler_is_one_line_naming_what_to_install(tmp_path):
    """The C kernels are compiled at first use; on a machine without a compiler (no $CC, cc, gcc or clang on
    PATH, nothing cached) ``run`` stops with one line saying what to install, exit 1, nothing on stdout; and
    ``--matmul dequant`` still runs there."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(tmp_path / "empty-bin"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    (tmp_path / "empty-bin").mkdir()
    p = subprocess.run([sys.executable, "-m", "moestream", "run", "-n", "2"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert_one_line_error(p, "no C compiler found", "apt install gcc", "--matmul dequant")
    assert not list((tmp_path / "cache").rglob("*.so")), "nothing half-built is left in the cache"
    ok = subprocess.run([sys.executable, "-m", "moestream", "run", "-n", "2", "--matmul", "dequant"],
                        capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()


@pytest.mark.parametrize("args,closed,needle", [
    (("run", "-n", "2"), 1, "cannot write to stdout (it is closed)"),
    (("inspect",), 1, "cannot write to stdout (it is closed)"),
    (("run", "-cnv"), 0, "-cnv: standard input is closed"),
    (("run", "-f", "-"), 0, "-f -: standard input is closed"),
])
def test_closed_stdout_or_stdin_is_one_line(args, closed, needle):
    """Started with stdout (``>&-``) or stdin (``<&-``) closed, Python has no sys.stdout / sys.stdin: one line,
    exit 1, no traceback (newcomer review: AttributeError tracebacks)."""
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "moestream", *args], stderr=subprocess.PIPE, text=True, timeout=600,
                       stdout=subprocess.DEVNULL if closed != 1 else None, preexec_fn=lambda: os.close(closed))
    p.stdout = ""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith(("moestream: default.gguf",
                                                                          "moestream: memory plan:"))]
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert lines == [f"moestream: error: {lines[0][len('moestream: error: '):]}"] and needle in lines[0], p.stderr


# ------------------------------------------------------------------------------------------------ layers and experts
@pytest.mark.parametrize("matrix", ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"])
def test_a_missing_expert_matrix_is_named(tmp_path, default_gguf, matrix):
    """Before: run and verify died with a traceback (KeyError: 'up'), inspect listed the layer without it."""
    path = tmp_path / "bad.gguf"
    rewrite(default_gguf, path, drop_tensors=(f"blk.2.{matrix}.weight",))
    for cmd in (("inspect",), ("run", "-n", "2"), ("verify", "--steps", "2")):
        assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path),
                              f"layer 2's routed experts are incomplete: tensor blk.2.{matrix}.weight is missing")


def test_layers_past_block_count_are_refused(tmp_path, default_gguf):
    """Before: block_count 3 on a 4-layer file ran the first 3 layers (other text, verify 'identical')."""
    path = tmp_path / "bad.gguf"
    rewrite(default_gguf, path, set_kv={"qwen3moe.block_count": 3})
    for cmd in (("inspect",), ("run", "-n", "2")):
        assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path),
                              "metadata key qwen3moe.block_count=3 but the file has tensors of 1 more layer(s)")


@pytest.mark.parametrize("width", [64, 256])
def test_expert_width_key_contradicting_the_tensors_is_refused(tmp_path, default_gguf, width):
    """expert_feed_forward_length disagreeing with the expert matrices (128 wide here): refused as llama.cpp refuses
    it by the tensors' shapes (it used to run, the key unused)."""
    path = tmp_path / "bad.gguf"
    rewrite(default_gguf, path, set_kv={"qwen3moe.expert_feed_forward_length": width})
    for cmd in (("inspect",), ("run", "-n", "2"), ("verify", "--steps", "2")):
        assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path),
                              f"metadata qwen3moe.expert_feed_forward_length={width} but "
                              "blk.0.ffn_down_exps.weight is 128 wide (its experts' width)")


def test_an_unknown_metadata_value_type_is_one_plain_line(tmp_path, default_gguf):
    """A metadata value type id the GGUF spec does not define: one line naming the file, the key and the number (it
    printed numpy's repr, np.uint32(77); then 'invalid GGUF: 77 is not a valid GGUFValueType', no key)."""
    from ggufedit import read as GGUFReader

    field = GGUFReader(str(default_gguf)).fields["general.architecture"]
    pos = field.offset + field.parts[0].nbytes + field.parts[1].nbytes  # after the key's length and bytes
    data = bytearray(default_gguf.read_bytes())
    assert int.from_bytes(data[pos:pos + 4], "little") == 8  # GGUF_TYPE_STRING
    data[pos:pos + 4] = (77).to_bytes(4, "little")
    path = tmp_path / "type77.gguf"
    path.write_bytes(bytes(data))
    line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
    assert line == (f"moestream: error: {path}: corrupt GGUF header (metadata general.architecture: value type 77 is "
                    "not one of GGUF's 0-12)")


def _corrupt_byte(src: Path, dst: Path, pos: int) -> None:
    data = bytearray(src.read_bytes())
    data[pos] = 0xFF  # never part of UTF-8 text
    dst.write_bytes(bytes(data))


def test_a_metadata_key_name_that_is_not_utf8_is_named_by_index_and_byte(tmp_path, default_gguf):
    """A key's name that is not UTF-8: its index, its byte offset, the key before it and the bad byte (it printed
    Python's "'utf-8' codec can't decode byte 0xff in position 4: invalid start byte")."""
    from ggufedit import read as GGUFReader

    fields = [f for k, f in GGUFReader(str(default_gguf)).fields.items() if not k.startswith("GGUF.")]
    key, before = fields[3], fields[2]
    path = tmp_path / "key.gguf"
    _corrupt_byte(default_gguf, path, key.offset + 8 + 4)  # the 5th byte of its name, after its uint64 length
    for cmd in (("inspect",), ("run", "-n", "2")):
        line = assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path))
        assert line == (f"moestream: error: {path}: invalid GGUF: metadata key 3 at byte {key.offset} (after "
                        f"{before.name}): its name is not UTF-8 text (byte 0xff at byte {key.offset + 12})")


def test_a_tensor_name_that_is_not_utf8_is_named_by_index_and_byte(tmp_path, default_gguf):
    from ggufedit import read as GGUFReader

    field = GGUFReader(str(default_gguf)).tensors[1].field
    path = tmp_path / "tensor.gguf"
    _corrupt_byte(default_gguf, path, field.offset + 8)
    line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
    assert line == (f"moestream: error: {path}: invalid GGUF: tensor 1 at byte {field.offset}: its name is not "
                    f"UTF-8 text (byte 0xff at byte {field.offset + 8})")


def test_an_architecture_that_is_not_utf8_is_not_called_missing(tmp_path, default_gguf):
    """general.architecture's value not UTF-8: said so (it said the metadata had no general.architecture)."""
    from ggufedit import read as GGUFReader

    field = GGUFReader(str(default_gguf)).fields["general.architecture"]
    path = tmp_path / "arch.gguf"
    _corrupt_byte(default_gguf, path, int(field.offset) + sum(part.nbytes for part in field.parts[:4]))
    line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
    assert line == f"moestream: error: {path}: metadata general.architecture is not UTF-8 text"


@pytest.mark.parametrize("keep", [1000, 100_000, 11_000_000])
def test_a_file_cut_short_is_truncated_not_corrupt(tmp_path, default_gguf, keep):
    """A file cut inside its metadata (1000 bytes: its vocabulary array alone needs a megabyte) or inside its tensor
    data (11 MB: the tensor table points past the end) is truncated, with the sizes: it was called a corrupt header
    (a length field far past the end) or a corrupt tensor table."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(default_gguf.read_bytes()[:keep])
    for cmd in (("inspect",), ("run", "-n", "2")):
        line = assert_one_line_error(moestream(cmd[0], "-m", str(path), *cmd[1:]), str(path))
        assert re.fullmatch(rf"moestream: error: {re.escape(str(path))}: truncated GGUF: the file ends at byte "
                            rf"{keep}, a read at byte \d+ needs at least \d+ bytes", line), line


def test_a_length_past_any_file_is_corrupt_not_truncated(tmp_path, default_gguf):
    """An array count that no file could hold (2**50 tokens) is a corrupt header, not a cut file."""
    from ggufedit import read as GGUFReader

    field = GGUFReader(str(default_gguf)).fields["tokenizer.ggml.tokens"]
    pos = int(field.offset) + sum(part.nbytes for part in field.parts[:4])  # key length, key, type, item type
    data = bytearray(default_gguf.read_bytes())
    assert int.from_bytes(data[pos:pos + 8], "little") == len(field.data)
    data[pos:pos + 8] = (2**50).to_bytes(8, "little")
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
    assert line == (f"moestream: error: {path}: corrupt GGUF header (metadata tokenizer.ggml.tokens: a length field "
                    f"asks for at least {8 * 2**50} bytes from byte {pos + 8}, the file has {len(data)})"), line


def test_a_corrupt_length_field_is_a_corrupt_header_naming_the_key(tmp_path):
    """A GGUF written by the `gguf` package (a string, a string array, a tensor), a length field then set to more
    than any header field takes (over 16 MiB: gguf._FIELD_PLAUSIBLE) though under 1 TiB: 'corrupt GGUF header'
    naming the file and the key (it said 'truncated GGUF'). The file cut inside the array is truncated; so is a
    length under that bound that runs past the end (a file cut inside its metadata looks the same)."""
    from gguf import GGUFReader, GGUFWriter

    written = tmp_path / "written.gguf"
    w = GGUFWriter(str(written), "qwen3moe")
    w.add_string("general.name", "written by the gguf package")
    w.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(300)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = written.read_bytes()
    fields = GGUFReader(written).fields  # the package's own reader places the length fields

    def after_type(key: str) -> int:  # the byte after the key's length, name and value type
        return int(fields[key].offset) + sum(int(p.nbytes) for p in fields[key].parts[:3])

    name_len, count = after_type("general.name"), after_type("tokenizer.ggml.tokens") + 4  # + the item type
    assert int.from_bytes(data[name_len:name_len + 8], "little") == len("written by the gguf package")
    assert int.from_bytes(data[count:count + 8], "little") == 300
    path = tmp_path / "bad.gguf"
    for key, pos, value, asks in (("general.name", name_len, 10**9, 10**9),
                                  ("tokenizer.ggml.tokens", count, 2**32, 8 * 2**32)):
        path.write_bytes(data[:pos] + value.to_bytes(8, "little") + data[pos + 8:])
        line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
        assert line == (f"moestream: error: {path}: corrupt GGUF header (metadata {key}: a length field asks for at "
                        f"least {asks} bytes from byte {pos + 8}, the file has {len(data)})"), line
    for bad in (data[:count + 8 + 40],  # cut inside the array
                data[:name_len] + (len(data) + 100).to_bytes(8, "little") + data[name_len + 8:]):
        path.write_bytes(bad)
        line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
        assert line.startswith(f"moestream: error: {path}: truncated GGUF: the file ends at byte {len(bad)}, "), line


# ------------------------------------------------------------------------------------------------ two outputs, one file
@pytest.mark.parametrize("cmd", ["run", "bench"])
def test_two_outputs_naming_one_file_are_refused(tmp_path, default_gguf, cmd):
    """Two output options naming the same file (directly or through a symlink) are refused before the model runs:
    one output would be written over the other (it used to report both as written, one of them lost)."""
    out = tmp_path / "out.jsonl"
    link = tmp_path / "link.jsonl"
    out.write_text("keep\n")
    link.symlink_to(out)
    first, second = ("--routing-trace", "--trace") if cmd == "run" else ("--json", "--trace")
    extra = ("-n", "2") if cmd == "run" else ("-p", "4", "-n", "2", "-r", "1")
    for other in (out, link):
        line = assert_one_line_error(moestream(cmd, "-m", str(default_gguf), *extra, first, str(out), second,
                                               str(other)))
        assert line == (f"moestream: error: {second} {other}: {first} {out} names the same file; give each output "
                        "its own path")
    assert out.read_text() == "keep\n"



def test_a_corrupt_key_name_length_names_the_key_by_its_place(tmp_path, default_gguf):
    """The embedded model's first key's name length (at byte 24) set to 255: the name runs into the bytes after it,
    and the value type read after that is garbage: 'corrupt GGUF header' naming the key by its index, byte and
    name length (a newcomer saw 'invalid GGUF: 1832087141 is not a valid GGUFValueType'; printing the garbage name
    would spill control bytes over lines)."""
    from ggufedit import read as GGUFReader

    assert GGUFReader(str(default_gguf)).fields["general.architecture"].offset == 24
    data = default_gguf.read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(data[:24] + b"\xff" + data[25:])
    line = assert_one_line_error(moestream("inspect", "-m", str(path)), str(path))
    assert line == (f"moestream: error: {path}: corrupt GGUF header (metadata key 0 at byte 24 (a name of 255 bytes): "
                    "value type 1832087141 is not one of GGUF's 0-12)"), line
