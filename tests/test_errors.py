"""Bad input gets one line naming the file and the problem, a non-zero exit, and no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from ggufedit import rewrite
from helpers import cli
from moestream.engine import Engine, Sampler, SamplingParams
from moestream.errors import ExpertReadError, ModelFileChanged
from moestream.models.base import LoadOptions, load_model


def moestream(*args: str) -> subprocess.CompletedProcess:
    """The command line in this process (``helpers.cli``; tests/test_bad_input.py checks that a real process prints
    the same one line)."""
    return cli(*(str(a) for a in args))


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert lines[0].startswith("moestream: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def model_path(qwen3moe_tiny):
    return qwen3moe_tiny["q8_0"]


def test_missing_path(tmp_path):
    path = str(tmp_path / "nope.gguf")
    assert_one_line_error(moestream("run", "-m", path, "-n", "2"), path, "no such file")


def test_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model\n")
    assert_one_line_error(moestream("inspect", "-m", str(path)), str(path), "not a GGUF file")


def test_directory(tmp_path):
    assert_one_line_error(moestream("run", "-m", str(tmp_path), "-n", "2"), str(tmp_path), "directory")


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated(tmp_path, model_path, keep):
    path = tmp_path / "cut.gguf"
    data = open(model_path, "rb").read()
    path.write_bytes(data[: int(len(data) * keep)])
    assert_one_line_error(moestream("run", "-m", str(path), "-n", "2"), str(path), "truncated GGUF")


def test_unsupported_architecture(tmp_path, model_path):
    path = tmp_path / "other.gguf"
    rewrite(model_path, path, arch="bert")
    p = moestream("run", "-m", str(path), "-n", "2")
    assert_one_line_error(p, str(path), "architecture 'bert' is not supported", "supported: ",
                         "deepseek2", "gemma4", "gpt-oss", "qwen3moe")


def test_unsupported_ggml_type(tmp_path, model_path):
    path = tmp_path / "f64.gguf"
    rewrite(model_path, path, convert={"blk.1.ffn_down_exps.weight": lambda a: a.astype(np.float64)})
    assert_one_line_error(moestream("run", "-m", str(path), "-n", "2"), str(path),
                          "blk.1.ffn_down_exps.weight is ggml type", "F64", "cannot compute")


def test_split_model_and_missing_part(tmp_path, model_path):
    parts = rewrite(model_path, tmp_path / "split.gguf", split_max_tensors=12)
    assert len(parts) >= 3
    # complete split model: same logits as the single file, bytewise
    import torch
    one = load_model(model_path, LoadOptions(moe_stream=False))
    many = load_model(str(parts[0]), LoadOptions(slots=one.top_k))
    ids = list(range(1000, 1020))
    a = Engine(one).prefill(ids, one.new_cache(len(ids)), logits_all=True)
    b = Engine(many).prefill(ids, many.new_cache(len(ids)), logits_all=True)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert {os.path.dirname(p) for p in many.gguf.paths} == {str(tmp_path)} and len(many.gguf.paths) == len(parts)
    many.store.close()
    os.remove(parts[1])
    assert_one_line_error(moestream("run", "-m", str(parts[0]), "-n", "2"), str(parts[1]), "is missing")


def test_slots_below_top_k(model_path):
    assert_one_line_error(moestream("run", "-m", model_path, "--slots", "1", "-n", "2"),
                          "--slots 1 is below the experts used per token")
    assert_one_line_error(moestream("verify", "-m", model_path, "--slots", "1"),
                          "--slots 1 is below the experts used per token")


def test_io_threads_zero(model_path):
    assert_one_line_error(moestream("run", "-m", model_path, "--io-threads", "0", "-n", "2"),
                          "--io-threads must be at least 1, got 0")


def test_empty_prompt(model_path):
    assert_one_line_error(moestream("run", "-m", model_path, "-p", "", "-n", "2"), "prompt is empty")


def first_expert_byte(model) -> int:
    """Offset of the first routed-expert byte: truncating there cuts every expert."""
    return min(m.offset for mats in model.layout.layers.values() for m in mats.values())


@pytest.mark.parametrize("stream", [True, False])
def test_file_truncated_during_decoding(tmp_path, model_path, stream):
    """Truncating the file underneath a running generation stops it with a clear error, in both modes."""
    path = tmp_path / "victim.gguf"
    shutil.copy(model_path, path)
    model = load_model(str(path), LoadOptions(moe_stream=stream, slots=4))
    produced = []

    def truncate_after_first(tok: int) -> None:
        produced.append(tok)
        if len(produced) == 1:
            with open(path, "r+b") as f:
                f.truncate(first_expert_byte(model) + 1)

    with pytest.raises((ModelFileChanged, ExpertReadError)) as ei:
        Engine(model).generate(list(range(100, 110)), 8, Sampler(SamplingParams(temp=0)),
                               on_token=truncate_after_first)
    assert str(path) in str(ei.value)
    assert len(produced) == 1
    model.store.close()


def test_short_read_in_streaming_mode_names_file(tmp_path, model_path):
    """The streaming path's own guard: with the identity check bypassed, the reader's short read fires."""
    path = tmp_path / "victim.gguf"
    shutil.copy(model_path, path)
    model = load_model(str(path), LoadOptions(moe_stream=True, slots=4))
    model.gguf.check_unchanged = lambda: None  # the reader must catch it on its own
    with open(path, "r+b") as f:
        f.truncate(first_expert_byte(model) + 1)
    with pytest.raises(ExpertReadError, match="short read"):
        Engine(model).generate(list(range(100, 110)), 4, Sampler(SamplingParams(temp=0)))
    model.store.close()


@pytest.mark.parametrize("key,value,needle", [
    ("qwen3moe.expert_used_count", 100, "expert_used_count=100, which must be in [1, expert_count=16]"),
    ("qwen3moe.expert_used_count", 0, "expert_used_count=0"),
    ("qwen3moe.expert_count", 0, "expert_count=0 but layer 0's expert tensors hold 16 experts"),
])
def test_expert_counts_disagreeing_with_tensors(tmp_path, model_path, key, value, needle):
    path = tmp_path / "meta.gguf"
    rewrite(model_path, path, set_kv={key: value})
    for cmd in ("run", "inspect"):
        assert_one_line_error(moestream(cmd, "-m", str(path)), str(path), needle)


@pytest.mark.parametrize("args,needle", [
    (("--temp", "nan"), "--temp must be a finite number"),
    (("-s", "99999999999999999999999"), "--seed must be -1 (random) or in [0, 2^63)"),
    (("-p", "abc\udcff"), "the prompt is not valid UTF-8"),
    (("-c", "3"), "the context size -c 3 leaves no room"),
    (("-c", "-5"), "-c must be 0 (prompt + -n) or more"),
    (("-ub", "0"), "-ub must be at least 1"),
])
def test_bad_run_options(model_path, args, needle):
    assert_one_line_error(moestream("run", "-m", model_path, "-n", "2", *args), needle)


def test_top_p_zero_keeps_the_top_token(model_path):
    greedy = moestream("run", "-m", model_path, "-n", "4", "--temp", "0", "-p", "Hello")
    top_p0 = moestream("run", "-m", model_path, "-n", "4", "--temp", "1", "--top-p", "0", "-p", "Hello")
    assert greedy.returncode == 0 and top_p0.returncode == 0, top_p0.stderr
    assert greedy.stdout == top_p0.stdout


@pytest.mark.parametrize("args,needle", [
    (("--slots", ","), "--slots: expected a comma-separated list with no empty items"),
    (("--moe-stream", ","), "--moe-stream: expected a comma-separated list with no empty items"),
    (("--json", "/"), "--json /: cannot write a file there"),
    (("--json", "/nonexistent-dir/x.json"), "cannot write a file there"),
])
def test_bad_bench_options(model_path, args, needle):
    assert_one_line_error(moestream("bench", "-m", model_path, "-p", "4", "-n", "2", "-r", "1", *args), needle)


def test_rope_scaling_refused_where_not_computed(tmp_path, model_path):
    """A family that computes no RoPE scaling refuses a file that asks for it (YaRN here) instead of rotating
    with the unscaled angles; a factor of 1 (any kind) is no scaling and loads."""
    from gguf import GGUFValueType
    path = tmp_path / "yarn.gguf"
    rewrite(model_path, path, add_kv={"qwen3moe.rope.scaling.type": ("yarn", GGUFValueType.STRING),
                                      "qwen3moe.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
                                      "qwen3moe.rope.scaling.original_context_length": (256, GGUFValueType.UINT32)})
    p = moestream("inspect", "-m", str(path))
    assert_one_line_error(p, str(path), "qwen3moe.rope.scaling.type=yarn", "does not compute for qwen3moe")
    one = tmp_path / "yarn1.gguf"
    rewrite(model_path, one, add_kv={"qwen3moe.rope.scaling.type": ("yarn", GGUFValueType.STRING),
                                     "qwen3moe.rope.scaling.factor": (1.0, GGUFValueType.FLOAT32)})
    load_model(str(one), LoadOptions(metadata_only=True))
