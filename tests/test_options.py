"""One options path, one validation: LoadOptions and SamplingParams check their fields once (``__post_init__``) in
the options' own terms; the CLI says its flags and the server its request keys, with the same bounds and the same
words; bench's rows are checked before any runs; inspect --mem prices the context run would have."""

from __future__ import annotations

import re

import pytest

from helpers import cli
from moestream.engine import SamplingParams
from moestream.errors import ConfigError, OptionError
from moestream.experts.reader import ExpertReader
from moestream.models.base import LoadOptions
from moestream.server import APIError, sampling_params


@pytest.mark.parametrize("kwargs,message", [
    ({"io_threads": 0}, "io_threads must be at least 1, got 0"),
    ({"io_threads": 1000}, "io_threads must be at most 256, got 1000"),
    ({"slots": 0}, "slots must be a positive number, got 0"),
    ({"pool": "gpu"}, "pool: unknown place 'gpu'; choose one of device, host"),
    ({"matmul": "fast"}, "matmul: unknown mode 'fast'; choose one of blocks, dequant"),
    ({"policy": "fifo"}, "policy: unknown cache policy 'fifo'; choose one of lfu, lru"),
    ({"device": "tpu"}, "device: unknown device 'tpu'; choose one of cpu, cuda, auto (or cuda:N)"),
    ({"mem": 2**30, "slots": 8}, "mem=1073741824 and slots=8 both size the slot pools: give one of them"),
])
def test_library_messages_name_the_field_and_the_value(kwargs, message):
    """A library caller gets the field's own name, never a command-line flag."""
    with pytest.raises(OptionError) as e:
        LoadOptions(**kwargs)
    assert str(e.value) == message and "--" not in str(e.value)


def test_the_reader_and_the_options_share_one_check():
    with pytest.raises(OptionError) as a:
        ExpertReader(0)
    with pytest.raises(OptionError) as b:
        LoadOptions(io_threads=0)
    assert str(a.value) == str(b.value)


def test_render_names_flags_and_values_as_given():
    e = OptionError("{mem=} and {slots=} both size the slot pools", mem=2**30, slots=8)
    assert e.render({"mem": "--mem", "slots": "--slots"}, {"mem": " 1GiB", "slots": 8}) == \
        "--mem 1GiB and --slots 8 both size the slot pools"
    assert e.field == "mem" and isinstance(e, ConfigError)


#: (run's flag, its value, the server's key, the same value in JSON, the words after the name)
SAMPLING = [
    ("--top-k", "-5", "top_k", -5, "must be an integer >= -1 (0 or -1: off), got -5"),
    ("--top-p", "2", "top_p", 2.0, "must be a number in [0, 1], got 2.0"),
    ("--min-p", "-0.5", "min_p", -0.5, "must be a number in [0, 1], got -0.5"),
    ("--temp", "inf", "temperature", float("inf"), "must be a finite number (<= 0: greedy), got inf"),
    ("--seed", "-2", "seed", -2, "must be -1 (random) or in [0, 2^63), got -2"),
]


@pytest.mark.parametrize("flag,text,key,value,words", SAMPLING)
def test_cli_and_server_refuse_sampling_values_alike(flag, text, key, value, words):
    """The same check (SamplingParams) with the same bounds and words: run names the flag, the server the key
    (issue 27: run --top-k=-5 ran while the server refused top_k -5)."""
    p = cli("run", "-n", "1", f"{flag}={text}")
    assert p.returncode == 1 and p.stderr.strip() == f"moestream: error: {flag} {words}", p.stderr
    with pytest.raises(APIError) as e:
        sampling_params({key: value})
    assert e.value.status == 400 and e.value.param == key and e.value.message == f"'{key}' {words}"


def test_server_and_cli_accept_the_same_edges():
    """-1 / 0 top-k (off), top-p 1, a negative temperature (greedy, as llama.cpp), seed -1: taken by both."""
    body = {"top_k": -1, "top_p": 1, "min_p": 0, "temperature": -1, "seed": -1}
    assert sampling_params(body) == SamplingParams(temp=-1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=-1)
    p = cli("run", "-n", "1", "--top-k=-1", "--top-p", "1", "--min-p", "0", "--temp=-1", "-s", "-1")
    assert p.returncode == 0, p.stderr


def test_server_type_errors_name_the_key():
    with pytest.raises(APIError) as e:
        sampling_params({"temperature": "hot"})
    assert e.value.code == "invalid_type" and e.value.message.startswith("'temperature' must be a finite number")


@pytest.mark.parametrize("args,message", [
    (("bench", "--mem", "1GiB,2GiB", "--slots", "4"), "--mem 1GiB,2GiB and --slots 4 both size the slot pools"),
    (("bench", "--io-threads", "4,0"), "--io-threads must be at least 1, got 0"),
    (("bench", "--pool", "device,gpu"), "--pool: unknown place 'gpu'"),
    (("bench", "--host-cache", "64MiB", "--prefetch", "on"), "--host-cache and --prefetch on cannot be combined"),
    (("bench", "--policy", "fifo"), "--policy: unknown cache policy 'fifo'"),
])
def test_bench_rows_are_checked_before_any_runs(args, message):
    """Each row's LoadOptions (dataclasses.replace of bench's base) is made before the first row starts: one line
    naming the flags, no row printed."""
    p = cli(*args, "-p", "4", "-n", "2", "-r", "1")
    assert p.returncode == 1 and p.stdout == "", p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: ") and message in lines[0], p.stderr


def _kv_tokens(text: str) -> int:
    m = re.search(r"KV (?:cache +)?[0-9.]+(?: GiB)? \((\d+) tokens\)", text)
    assert m, text
    return int(m.group(1))


@pytest.mark.parametrize("extra", [(), ("-n", "8"), ("-n", "8", "-p", "Hello there, how are you today?")])
def test_inspect_prices_the_context_run_has(extra):
    """inspect --mem and run --mem with the same -p/-n plan the KV cache of the same context (engine.run_context):
    the prompt's tokens + -n, not the trained context (issue 27)."""
    i = cli("inspect", "--mem", "20GiB", *extra)  # in-process: the worker's RSS is the process (2.7 GiB in CI)
    assert i.returncode == 0, i.stderr
    r = cli("run", "--mem", "20GiB", "--temp", "0", *extra)
    assert r.returncode == 0, r.stderr
    assert _kv_tokens(i.stdout) == _kv_tokens(r.stderr)
