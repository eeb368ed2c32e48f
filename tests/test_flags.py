"""llama.cpp's flags as users type them from habit: read with llama.cpp's meaning, or refused in one line.

In-process (``moestream.cli.main`` through helpers.cli). References: llama.cpp's own penalties arithmetic (a plain
float32 loop of ``llama_sampler_penalties_apply``) and, where llama-cpp-python is installed, llama.cpp's built-in
chat templates (``llama_chat_apply_template``) for the names --chat-template takes.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cli
from moestream.chat_templates import CHAT_TEMPLATES
from moestream.cli import RUN_FLAGS, build_parser
from moestream.engine import Engine, Sampler, SamplingParams, penalize
from moestream.llamaflags import LOG_REFUSED, REFUSED, RUN_REFUSED, SERVE_REFUSED

DEFAULT_GGUF = Path(__file__).resolve().parents[1] / "src" / "moestream" / "data" / "default.gguf"


def parse(*argv: str):  # noqa: ANN201
    return build_parser().parse_args(list(argv))


# ---------------------------------------------------------------------------------------------- the parser itself
def test_joined_short_options_are_not_misread() -> None:
    """The issue's three: -fa was '-f a: no such file', -ngl 99 '-n gl: invalid int', -no-cnv '-n o-cnv'."""
    p = cli("run", "-fa", "-n", "1")
    assert p.returncode == 2 and "-f a" not in p.stderr and "-fa (llama.cpp's flag)" in p.stderr
    assert parse("run", "-ngl", "99").n_predict is None
    a = parse("run", "-no-cnv", "-n", "3")
    assert a.interactive is False and a.n_predict == 3


@pytest.mark.parametrize("value", ["off", "auto", "OFF", "disabled", "0", "-1"])
def test_flash_attn_off_or_auto_is_taken(value: str) -> None:
    """llama.cpp's -fa on|off|auto: off and auto (and llama.cpp's other spellings of them) ask for what moestream
    does (no flash attention), so they are taken without a word; -fa on, and -fa alone, are refused in one line."""
    p = cli("run", "-n", "1", "--temp", "0", "-fa", value, "-p", "Once")
    assert p.returncode == 0 and p.stdout.startswith("Once"), p.stderr
    assert "flash" not in p.stderr
    assert parse("serve", "--flash-attn", value).port == parse("serve").port


@pytest.mark.parametrize("argv", [("-fa", "on"), ("--flash-attn", "on"), ("-fa", "1"), ("-fa",)])
def test_flash_attn_on_is_refused(argv: tuple[str, ...]) -> None:
    p = cli("run", "-n", "1", *argv)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "no flash attention" in p.stderr and "-fa off" in p.stderr, p.stderr


@pytest.mark.parametrize("cmd", ["run", "serve", "inspect"])
@pytest.mark.parametrize("value", ["-1GiB", "-5", "-0.5G"])
def test_negative_mem_is_one_line_naming_mem(cmd: str, value: str) -> None:
    """--mem -1GiB: argparse took '-1GiB' for an option ("argument --mem: expected one argument", with the usage);
    now the value reaches --mem's own check: one line naming --mem, exit status 1."""
    p = cli(cmd, "--mem", value, *(("--port", "0") if cmd == "serve" else ()))
    assert p.returncode == 1 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("moestream: error: --mem: ") and "positive" in p.stderr, p.stderr


def test_hf_is_not_help() -> None:
    p = cli("run", "-hf", "unsloth/Qwen3-30B-A3B-GGUF")
    assert p.returncode == 2 and "usage" not in p.stdout
    assert p.stderr.count("\n") == 1 and "-hf" in p.stderr and "-m FILE" in p.stderr


@pytest.mark.parametrize("arg", ["-n8", "-t2", "-pHello", "-sys1", "--tem", "--top-", "--mem-", "-cn", "-foo"])
def test_no_abbreviations_and_no_joined_values(arg: str) -> None:
    p = cli("run", arg, "-n", "1")
    assert p.returncode == 2 and f"unrecognized arguments: {arg}" in p.stderr, p.stderr


@pytest.mark.parametrize("arg, hint", [("--tmep", "--temp"), ("--prefech=on", "--prefetch"), ("--slot", "--slots"),
                                       ("--bogus", None)])
def test_a_misspelt_flag_gets_a_suggestion(arg: str, hint: str | None) -> None:
    """A flag close to one of the subcommand's is named in the error (one line, exit 2); a far one is not."""
    p = cli("run", arg, "-n", "1")
    last = p.stderr.splitlines()[-1]
    assert p.returncode == 2 and last.startswith(f"moestream run: error: unrecognized arguments: {arg}"), p.stderr
    assert last.endswith(f"; did you mean {hint}?" if hint else arg), last


def test_equals_form_still_works() -> None:
    a = parse("run", "--top-k=7", "-n=3", "-ub=16")
    assert (a.top_k, a.n_predict, a.ubatch) == (7, 3, 16)


# ------------------------------------------------------------------------------------------ flags that work
@pytest.mark.parametrize("argv, device", [
    (("-ngl", "0"), "cpu"), (("-ngl", "99"), "cuda"), (("--n-gpu-layers", "1"), "cuda"), (("-ngl", "all"), "cuda"),
    (("--gpu-layers", "auto"), "auto"), (("-ngl", "-1"), "auto"), ((), "cpu"),
    (("--device", "cuda", "-ngl", "0"), "cpu"), (("-ngl", "99", "--device", "cpu"), "cpu"),
])
def test_ngl_picks_the_device(argv: tuple[str, ...], device: str) -> None:
    for cmd in ("run", "serve", "verify", "bench", "inspect"):
        assert parse(cmd, *argv).device == device, (cmd, argv)


def test_ngl_bad_value() -> None:
    p = cli("run", "-ngl", "lots")
    assert p.returncode == 2 and "-ngl" in p.stderr and "'lots'" in p.stderr


def test_ngl_0_runs_on_the_cpu_as_without_it() -> None:
    a = cli("run", "-n", "4", "--temp", "0", "-ngl", "0")
    b = cli("run", "-n", "4", "--temp", "0")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_ngl_99_without_a_gpu_is_one_line() -> None:
    """The refusal names the flag the user typed (-ngl 99, not the --device it stands for), and --device's own."""
    p = cli("run", "-n", "1", "-ngl", "99")
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("moestream: error: -ngl 99: ") and "leave -ngl out" in p.stderr, p.stderr
    p = cli("run", "-n", "1", "-ngl", "99", "--device", "cuda")
    assert p.returncode == 1 and p.stderr.startswith("moestream: error: --device cuda: "), p.stderr


def test_aliases_of_llama_cpp_long_names() -> None:
    a = parse("run", "--predict", "5", "--ubatch-size", "32", "--jinja", "-r", "User:", "--reverse-prompt", "###",
              "--stop", "END")
    assert (a.n_predict, a.ubatch, a.jinja) == (5, 32, True)
    assert a.stop == ["User:", "###", "END"]
    assert parse("run", "-cnv", "-no-cnv").interactive is False
    assert parse("run", "--no-conversation").interactive is False
    assert parse("run", "-no-cnv", "-cnv").interactive is True
    s = parse("serve", "-np", "1", "-a", "mymodel", "--jinja")
    assert (s.parallel, s.alias, s.jinja) == (1, "mymodel", True)


def test_reverse_prompt_stops_the_text() -> None:
    full = cli("run", "-n", "24", "--temp", "0", "-p", "Once")
    assert full.returncode == 0, full.stderr
    reply = full.stdout[len("Once"):]
    cut = reply[len(reply) // 2:len(reply) // 2 + 3]
    assert cut.strip(), reply
    p = cli("run", "-n", "24", "--temp", "0", "-p", "Once", "-r", cut)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "Once" + reply[:reply.index(cut)] + "\n"


def test_serve_parallel() -> None:
    """-np N and -cb are llama-server's (continuous batching: tests/test_serve_batch.py); -np 0 is one line."""
    s = parse("serve", "-np", "4", "-cb")
    assert (s.parallel, s.cont_batching) == (4, True)
    p = cli("serve", "-np", "0", "--port", "0")
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "-np must be from 1 to 256" in p.stderr


@pytest.mark.parametrize("how", ["-j", "--json-schema-file"])
def test_run_json_schema(how: str, tmp_path: Path) -> None:
    """run -j SCHEMA / --json-schema-file FILE (llama-cli's): the text after the prompt is JSON that follows the
    schema (jsonschema checks it), and generation ends there although -n leaves room."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    value = json.dumps(schema)
    if how != "-j":
        (tmp_path / "s.json").write_text(value)
        value = str(tmp_path / "s.json")
    p = cli("run", "-n", "80", "--temp", "0", "-p", "Once", how, value)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Once") and p.stdout.endswith("\n")
    jsonschema.validate(json.loads(p.stdout[len("Once"):]), schema)
    assert "before it was complete" not in p.stderr
    if how == "-j":  # -n too small for the JSON: the cut output is said to be cut (a newcomer got it silently)
        p = cli("run", "-n", "3", "--temp", "0", "-p", "Once", how, value)
        assert p.returncode == 0, p.stderr
        assert p.stderr.rstrip().endswith("--json-schema: -n ended the output before it was complete (not valid for "
                                          "the grammar or schema); a larger -n gives it room"), p.stderr[-400:]


#: a schema that says nothing of additionalProperties, at the top and in a nested object
OPEN_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "o": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                      "required": ["x"]}},
               "required": ["a", "o"]}


def _takes(grammar: str, tok, text: str) -> bool:  # noqa: ANN001
    """Whether ``text`` is a whole string of ``grammar``, token by token (moestream's Constraint)."""
    from moestream.structured import Constraint

    c = Constraint(grammar, tok, tok.vocab_size)
    for t in tok.encode(text, add_special=False):
        if not c.allowed()[t]:
            return False
        c.consume(t)
    return c.accepting


def test_json_schema_without_additional_properties_is_closed() -> None:
    """llama.cpp's JSON-schema-to-grammar converter writes only the declared keys of an object schema with
    ``properties`` and no ``additionalProperties`` (examples/json_schema_to_grammar.py, ``_build_object_rule``:
    extra keys only when additionalProperties is given and not false), where JSON Schema (jsonschema here) allows
    any other key: run -j and serve's response_format follow llama.cpp, at every level; ``{"type": "object"}``
    without properties, and ``additionalProperties: true``, still take any key."""
    import json

    import jsonschema

    from moestream.options import run_grammar
    from moestream.server import response_grammar
    from moestream.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(str(DEFAULT_GGUF))
    good, extra, nested = '{"a": 1, "o": {"x": true}}', '{"a": 1, "o": {"x": true}, "b": 2}', \
        '{"a": 1, "o": {"x": true, "y": 2}}'
    for text in (good, extra, nested):
        jsonschema.validate(json.loads(text), OPEN_SCHEMA)  # JSON Schema alone would take all three
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": OPEN_SCHEMA}}
    for grammar in (run_grammar(parse("run", "-j", json.dumps(OPEN_SCHEMA)), tok, tok.vocab_size),
                    response_grammar({"response_format": rf}, tok, tok.vocab_size)):
        assert _takes(grammar, tok, good)
        assert not _takes(grammar, tok, extra) and not _takes(grammar, tok, nested)
    opened = {**OPEN_SCHEMA, "additionalProperties": True}
    grammar = run_grammar(parse("run", "-j", json.dumps(opened)), tok, tok.vocab_size)
    assert _takes(grammar, tok, extra) and not _takes(grammar, tok, nested)
    grammar = run_grammar(parse("run", "-j", '{"type": "object"}'), tok, tok.vocab_size)
    assert _takes(grammar, tok, extra)


def test_run_grammar_and_logit_bias() -> None:
    """--grammar (llama.cpp's GBNF) picks one of its strings; -l ID+100 makes every greedy token that token, as
    the library's Sampler with the same logit_bias; -l ID-inf bans the token greedy would pick."""
    from moestream.tokenizer import GGUFTokenizer

    p = cli("run", "-n", "20", "--temp", "0", "-p", "Once", "--grammar", 'root ::= "yes" | "no" | "maybe"')
    assert p.returncode == 0, p.stderr
    assert p.stdout[len("Once"):-1] in ("yes", "no", "maybe"), p.stdout
    tok = GGUFTokenizer.from_gguf(str(DEFAULT_GGUF))
    the = tok.encode(" the", add_special=False)[0]
    p = cli("run", "-n", "5", "--temp", "0", "-p", "Once", "-l", f"{the}+100")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "Once" + tok.decode([the] * 5) + "\n"
    free = cli("run", "-n", "1", "--temp", "0", "-p", "Once").stdout[len("Once"):-1]
    first = tok.encode(free, add_special=False)[0]
    banned = cli("run", "-n", "1", "--temp", "0", "-p", "Once", "-l", f"{first}-inf").stdout[len("Once"):-1]
    assert banned and tok.encode(banned, add_special=False)[0] != first


@pytest.mark.parametrize("argv, says", [
    (("-l", "abc"), "--logit-bias abc: expected TOKEN_ID+BIAS"),
    (("-l", "999999999+1"), "--logit-bias: token id 999999999 is not in the vocabulary"),
    (("-j", "{not json"), "--json-schema: not JSON"),
    (("-j", '{"type": "nonsense"}'), "--json-schema: "),
    (("--grammar", "root ::= missing"), "--grammar: "),
    (("--grammar", " "), "--grammar: the grammar is empty"),
    (("--grammar-file", "/dev/null"), "--grammar-file /dev/null: the file holds no grammar (it is empty or blank)"),
    (("--json-schema-file", "/dev/null"), "--json-schema-file /dev/null: the file holds no JSON schema"),
    (("--json-schema-file", "/nonexistent/s.json"), "--json-schema-file /nonexistent/s.json: cannot read it"),
    (("-j", "{}", "--grammar", 'root ::= "a"'), "both constrain the output"),
    (("-j", "{}", "-cnv"), "does not apply to -cnv"),
])
def test_run_constraint_refusals_are_one_line(argv: tuple[str, ...], says: str) -> None:
    p = cli("run", "-n", "4", "-p", "Once", *argv)
    assert p.returncode == 1 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert says in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------- refused flags
def _refused_cases() -> list[tuple[str, str]]:
    cases = [(cmd, flags[0]) for flags, _ in REFUSED for cmd in ("run", "serve")
             if not (cmd == "run" and flags[0] in RUN_FLAGS)]
    cases += [(cmd, flags[-1]) for flags, _ in REFUSED for cmd in ("run",) if flags[-1] not in RUN_FLAGS]
    cases += [("serve", flags[0]) for flags, _ in SERVE_REFUSED]
    cases += [("run", f) for flags, _ in RUN_REFUSED for f in flags]
    cases += [(cmd, flags[0]) for flags, _ in LOG_REFUSED for cmd in ("run", "serve", "verify", "bench", "inspect")]
    cases += [("bench", "-fa"), ("bench", "-ot"), ("bench", "-ncmoe"), ("inspect", "-hf"), ("verify", "--cpu-moe")]
    return cases


@pytest.mark.parametrize("cmd, flag", _refused_cases())
def test_refused_in_one_line(cmd: str, flag: str) -> None:
    for argv in ((cmd, flag), (cmd, flag, "value"), (cmd, "-n" if cmd == "run" else "-t", "1", flag)):
        p = cli(*argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert p.stdout == "" and p.stderr.count("\n") == 1, (argv, p.stderr)
        assert p.stderr.startswith(f"moestream {cmd}: error: {flag} (llama.cpp's flag): "), p.stderr


@pytest.mark.parametrize("flag, says", [
    ("-hf", "-m FILE"), ("-fa", "leave it out"), ("-ot", "--mem"), ("--cpu-moe", "--mem"), ("-ncmoe", "--mem"),
    ("--n-cpu-moe", "streamed"), ("-b", "-ub"), ("-tb", "-t"), ("-dev", "--device"), ("-np", "serve -np"),
    ("--log-disable", "2>/dev/null"),
])
def test_refusal_says_what_to_do(flag: str, says: str) -> None:
    p = cli("run", flag, "1")
    assert says in p.stderr, p.stderr


def test_refused_flags_are_not_in_help() -> None:
    p = cli("run", "--help")
    assert p.returncode == 0 and "--hf-repo" not in p.stdout and "-ngl" in p.stdout


# ------------------------------------------------------------------------------------------ chat templates
@pytest.fixture(scope="module")
def no_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model without tokenizer.chat_template."""
    from ggufedit import rewrite

    out = tmp_path_factory.mktemp("flags") / "notemplate.gguf"
    rewrite(DEFAULT_GGUF, out, drop_kv=("tokenizer.chat_template",))
    return out


def test_chat_template_lets_a_file_without_one_chat(no_template: Path, tmp_path: Path) -> None:
    p = cli("run", "-m", str(no_template), "--chat", "-p", "Hi", "-n", "2", "--temp", "0")
    assert p.returncode == 1 and "--chat-template" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    a = cli("run", "-m", str(no_template), "--chat", "-p", "Hi", "-n", "2", "--temp", "0", "--chat-template",
            "chatml")
    assert a.returncode == 0, a.stderr
    f = tmp_path / "t.jinja"
    f.write_text(CHAT_TEMPLATES["chatml"])
    b = cli("run", "-m", str(no_template), "--chat", "-p", "Hi", "-n", "2", "--temp", "0", "--chat-template-file",
            str(f))
    assert b.returncode == 0 and b.stdout == a.stdout, b.stderr
    c = cli("run", "-m", str(no_template), "-cnv", "-n", "2", "--temp", "0", "--chat-template", "chatml",
            stdin="Hi\n")
    assert c.returncode == 0, c.stderr
    # a Jinja template given as the value
    d = cli("run", "-m", str(no_template), "--chat", "-p", "Hi", "-n", "2", "--temp", "0", "--chat-template",
            CHAT_TEMPLATES["chatml"])
    assert d.returncode == 0 and d.stdout == a.stdout, d.stderr


@pytest.mark.parametrize("argv, says", [
    (("--chat-template", "nosuch"), "--chat-template nosuch: not a template name"),
    (("--chat-template-file", "/nonexistent/t.jinja"), "--chat-template-file /nonexistent/t.jinja: no such file"),
    (("--chat-template", "chatml", "--chat-template-file", "x"), "use one of them"),
    (("--chat-template", "{% if %}"), "--chat-template: the chat template does not compile"),
])
def test_chat_template_errors(argv: tuple[str, ...], says: str) -> None:
    p = cli("run", "--chat", "-p", "Hi", "-n", "1", *argv)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


def test_serve_takes_chat_template(no_template: Path) -> None:
    from moestream.cli import serve_loader

    names, load, held = serve_loader(parse("serve", "-m", str(no_template), "--chat-template", "gemma", "-c", "64"))
    loaded = load()
    try:
        assert loaded.tok.chat_template == CHAT_TEMPLATES["gemma"]
    finally:
        for m in held:
            if getattr(m, "store", None) is not None:
                m.store.close()


def _llama_cpp_render(llama_cpp, name: str, messages: list[dict], add_ass: bool) -> str:  # noqa: ANN001
    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages])
    buf = ctypes.create_string_buffer(1 << 16)
    try:
        n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), add_ass, buf, len(buf))
    except ctypes.ArgumentError:  # older bindings take the model first
        n = llama_cpp.llama_chat_apply_template(None, name.encode(), arr, len(messages), add_ass, buf, len(buf))
    assert n > 0, name
    return buf.raw[:n].decode()


@pytest.mark.parametrize("name", list(CHAT_TEMPLATES))
def test_built_in_templates_render_as_llama_cpp(name: str, llama_cpp) -> None:  # noqa: ANN001
    from moestream.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(str(DEFAULT_GGUF))
    tok.chat_template = CHAT_TEMPLATES[name]
    convs = [
        [{"role": "user", "content": " Hello there "}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Two\nlines"}],
    ]
    for msgs in convs:
        for add_ass in (True, False):
            if name == "mistral-v7" and add_ass:
                continue  # llama.cpp's mistral-v7 adds nothing for the generation prompt either
            want = _llama_cpp_render(llama_cpp, name, msgs, add_ass)
            assert tok.apply_chat_template(msgs, add_ass) == want, (name, msgs, add_ass)


# ---------------------------------------------------------------------------------------------- penalties
def _reference_penalties(logits: list[float], window: list[int], rp: float, freq: float, pres: float) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties_apply, element by element in float32."""
    out = np.array(logits, dtype=np.float32)
    for tok, count in Counter(window).items():
        x = out[tok]
        x = x * np.float32(rp) if x <= 0 else x / np.float32(rp)
        x = x - (np.float32(count) * np.float32(freq) + np.float32(count > 0) * np.float32(pres))
        out[tok] = x
    return out


@pytest.mark.parametrize("rp, freq, pres", [(1.1, 0.0, 0.0), (1.5, 0.0, 0.0), (0.7, 0.0, 0.0), (1.3, 0.25, 0.5),
                                            (1.0, 0.1, 0.0), (1.0, 0.0, 1.5)])
def test_penalties_match_llama_cpp_arithmetic(rp: float, freq: float, pres: float) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, generator=g) * 5
    logits[3] = 0.0
    window = torch.randint(0, 1000, (64,), generator=g).tolist() + [3, 3, 7, 7, 7]
    p = SamplingParams(temp=0, repeat_penalty=rp, frequency_penalty=freq, presence_penalty=pres, repeat_last_n=-1)
    got = penalize(logits, window, p).numpy()
    want = _reference_penalties(logits.tolist(), window, rp, freq, pres)
    assert got.tobytes() == want.tobytes()


def test_sampler_window_and_off_switches() -> None:
    s = Sampler(SamplingParams(temp=0, repeat_penalty=2.0, repeat_last_n=3))
    s.accept([1, 2, 3, 4])
    assert list(s.history) == [2, 3, 4]
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0, 1.0, 3.0])
    assert Sampler(SamplingParams(temp=0))(logits) == 1
    s2 = Sampler(SamplingParams(temp=0, repeat_penalty=2.0, repeat_last_n=3))
    s2.accept([1])
    assert s2(logits) == 2  # 5 / 2 < 4
    for off in (SamplingParams(temp=0, repeat_penalty=2.0, repeat_last_n=0), SamplingParams(temp=0)):
        s3 = Sampler(off)
        s3.accept([1])
        assert s3(logits) == 1 and not s3.history


@pytest.mark.parametrize("argv, says", [
    (("--repeat-penalty", "0"), "--repeat-penalty must be above 0"),
    (("--repeat-penalty", "nan"), "--repeat-penalty must be a finite number"),
    (("--repeat-last-n", "-2"), "--repeat-last-n must be -1"),
    (("--presence-penalty", "inf"), "--presence-penalty must be a finite number"),
])
def test_penalty_option_errors(argv: tuple[str, ...], says: str) -> None:
    p = cli("run", "-n", "1", *argv)
    assert p.returncode == 1 and says in p.stderr, p.stderr


def test_greedy_with_repeat_penalty_matches_a_plain_loop() -> None:
    """Generation feeds the sampler the prompt and each token; a hand-written loop over the same logits with the
    reference penalties and argmax picks the same tokens."""
    from moestream.models.base import LoadOptions, load_model
    from moestream.tokenizer import GGUFTokenizer

    model = load_model(str(DEFAULT_GGUF), LoadOptions(moe_stream=False))
    tok = GGUFTokenizer.from_fields(model.gguf.fields, model.gguf.path)
    prompt = tok.encode("The history of the printing press")
    n, last_n, rp = 16, 8, 0.3  # below 1: a token of the window is favoured, so the random model repeats
    engine = Engine(model)
    gen = engine.stream(prompt, n, Sampler(SamplingParams(temp=0, repeat_penalty=rp, repeat_last_n=last_n)))
    got = list(gen)
    cache = model.new_cache(len(prompt) + n)
    logits = engine.forward(torch.tensor(prompt), 0, cache)[-1]
    seq, want = list(prompt), []
    for i in range(n):
        pen = _reference_penalties(logits.float().tolist(), seq[-last_n:], rp, 0.0, 0.0)
        t = int(np.argmax(pen))
        want.append(t)
        seq.append(t)
        if i < n - 1:
            logits = engine.decode_step(t, len(seq) - 1, cache)
            logits = logits.reshape(-1)
    assert got == want
    plain = list(Engine(model).stream(prompt, n, Sampler(SamplingParams(temp=0))))
    assert plain != got  # the penalty changed something on this prompt (else the test shows nothing)


def test_repeat_penalty_on_the_command_line() -> None:
    a = cli("run", "-n", "12", "--temp", "0", "--repeat-penalty", "0.3", "--repeat-last-n", "8")
    b = cli("run", "-n", "12", "--temp", "0")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout != b.stdout
