"""The README and docs/ stay honest: every ``moestream ...`` command line in a fenced code block parses with the
real command-line parser (``moestream.cli.build_parser``, with ``main``'s checks after parsing), and every link
between the pages (``[text](path#anchor)``) reaches an existing file and, with an anchor, one of its headings.

Placeholders (``MODEL.gguf``, ``"..."``) are strings to the parser, so they pass; schematic syntax (``[--x]``,
``A|B``) does not belong in a fenced block: those hold commands one can type.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from moestream import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
#: shell words that end a command's arguments
#: the error line moestream prints (``moestream: error: ...``, argparse's ``moestream run: error: ...``)
ERROR_LINE = r"moestream( \w+)?: error: "
SHELL_OPS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block (``` or ~~~) of a markdown text."""
    blocks: list[list[str]] = []
    cur: list[str] | None = None
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            if cur is None:
                cur = []
            else:
                blocks.append(cur)
                cur = None
        elif cur is not None:
            cur.append(line)
    assert cur is None, "a fenced code block is not closed"
    return blocks


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced code blocks."""
    out, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside:
            out.append(line)
    return out


def logical_lines(block: list[str]) -> list[str]:
    """The block's lines with backslash continuations joined."""
    out: list[str] = []
    cur = ""
    for line in block:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def moestream_commands(block: list[str]) -> list[list[str]]:
    """The argument lists of :func:`moestream_lines`, refused examples included."""
    return [args for args, _ in moestream_lines(block)]


def moestream_lines(block: list[str]) -> list[tuple[list[str], str | None]]:
    """The argument lists of the ``moestream`` command lines of one fenced block: a shell line (``$ `` prompt,
    ``VAR=value`` and ``sudo`` prefixes, ``$VAR`` of an earlier ``VAR="..."`` line in the block expanded) or a
    YAML ``cmd:`` value (llama-swap's ``${PORT}`` given a port), whose first word is ``moestream`` or a path
    ending in ``/moestream``. Each comes with the error line that follows it in the block, if one does (``moestream
    run: error: ...`` after ``$ moestream run ...``: an example of a refused command), else None."""
    found: list[tuple[list[str], str | None]] = []
    variables: dict[str, str] = {}
    lines = logical_lines(block)
    session = any(ln.lstrip().startswith("$ ") for ln in lines)  # a transcript: only the $ lines are commands
    for n, line in enumerate(lines):
        s = line.strip()
        if session and not s.startswith("$ ") or re.match(ERROR_LINE, s):
            continue
        if s.startswith("cmd:"):  # a llama-swap entry: ${PORT} is the port it substitutes
            s = s[4:].replace("${PORT}", "8080")
        s = re.sub(r"^\$ ", "", s)
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(\".*\"|'.*')", s)
        if m:
            variables[m.group(1)] = shlex.split(m.group(2))[0]
            continue
        for name, value in variables.items():
            s = re.sub(rf"^\${name}\b|^\${{{name}}}", value, s)
        try:
            words = shlex.split(s, comments=True)
        except ValueError:
            continue  # not shell (a table, JSON, a Python line)
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] == "sudo"):
            words = words[1:]
        if not words or words[0].rsplit("/", 1)[-1] != "moestream":
            continue
        args = []
        for w in words[1:]:
            if w in SHELL_OPS or w.startswith((">", "2>")):
                break
            args.append(w)
        following = lines[n + 1].strip() if n + 1 < len(lines) else ""
        found.append((args, following if re.match(ERROR_LINE, following) else None))
    return found


def all_commands() -> list[tuple[str, list[str], str | None]]:
    out = []
    for page in PAGES:
        for block in fenced_blocks(page.read_text()):
            out += [(page.relative_to(ROOT).as_posix(), args, error) for args, error in moestream_lines(block)]
    return out


COMMANDS = all_commands()


def parse(args: list[str]) -> str | None:
    """None when ``moestream ARGS`` parses as ``moestream.cli.main`` parses it (no unknown argument, no option a
    subcommand refuses); else what the parser said."""
    ap = cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns, extra = ap.parse_known_args(args)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip() or f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 - a flag the parser refuses in its own way (llamaflags.FlagRefused)
        return str(e)
    if extra:
        return f"unrecognized arguments: {' '.join(extra)}"
    if getattr(ns, "verify_moe_stream", None) is not None:
        return "--moe-stream does not apply to verify"
    return None


def test_commands_found():
    """The extraction sees the README's five commands and the pages' examples (a broken extraction would pass
    every page vacuously)."""
    readme = {args[0] for page, args, _ in COMMANDS if page == "README.md" and args}
    assert {"run", "serve", "bench", "verify", "inspect"} <= readme, readme
    assert len(COMMANDS) >= 20, COMMANDS
    # the extraction itself: continuations, a prompt, an env prefix, a variable, a YAML cmd, a pipe, a comment
    block = ['MOESTREAM_X=1 .venv/bin/moestream run -p "a b" \\', "    -n 4 | head  # c",
             'B="moestream bench -m m.gguf"', "$B --slots 8", "    cmd: moestream serve --port ${PORT}",
             "curl -s localhost:8080/health", "echo moestream run"]
    assert moestream_commands(block) == [["run", "-p", "a b", "-n", "4"], ["bench", "-m", "m.gguf", "--slots", "8"],
                                         ["serve", "--port", "8080"]]
    refused = ["$ moestream run -x", "moestream run: error: -x is not an option", "$ moestream run -n 2", "hello"]
    assert moestream_lines(refused) == [(["run", "-x"], "moestream run: error: -x is not an option"),
                                        (["run", "-n", "2"], None)]


@pytest.mark.parametrize(("page", "args", "error"), COMMANDS, ids=[f"{p}:{' '.join(a)[:60]}" for p, a, _ in COMMANDS])
def test_command_parses(page, args, error):
    """Each command parses; one the page shows refused (its error line after it) is refused with that line."""
    problem = parse(args)
    if error is None:
        assert problem is None, f"{page}: `moestream {shlex.join(args)}` does not parse: {problem}"
    else:
        assert problem is not None and error in problem, \
            f"{page}: `moestream {shlex.join(args)}` should be refused with {error!r}, the parser says {problem!r}"


def test_parse_refuses():
    """The check can fail: an unknown option, a bad value and a schematic line are refused."""
    assert parse(["run", "--no-such-option"]) is not None
    assert parse(["run", "-n", "abc"]) is not None
    assert parse(["run", "[--mem", "SIZE", "|", "--slots", "N]"]) is not None
    assert parse(["verify", "--moe-stream", "on"]) is not None
    assert parse(["run", "-m", "MODEL.gguf", "-p", "..."]) is None


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            a = slug(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(page: Path) -> list[str]:
    # outside fenced blocks and inline code spans
    body = "\n".join(re.sub(r"`[^`]*`", "", ln) for ln in prose_lines(page.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", body)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page):
    """Every relative link of the page reaches a file of the repository (and, with ``#anchor``, a heading of
    it); web links are not fetched."""
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)} (has {sorted(anchors(dest))})")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_readme_links_every_page():
    """Each page of docs/ is reachable from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no docs page {missing}"


def test_readme_is_short():
    """The README is one screen or two: what it is, set-up, the five commands, the architectures, the results."""
    n = len((ROOT / "README.md").read_text().split("\n"))
    assert n <= 200, f"README.md has {n} lines; move the details to docs/"


#: prose that says --mem-cap cannot be used on the machine the docs were written on
NO_CAP_CLAIM = re.compile(r"(no memory cgroup|--mem-cap`? refuses here)", re.I)


def test_no_page_says_mem_cap_refuses_where_it_works():
    """A page said "this machine has no memory cgroup controller (`--mem-cap` refuses here)" on a machine where the
    cap works (cgroup v1's memory controller): on a machine where ``MemCap.check`` finds a usable cgroup, no page may
    say there is none."""
    from moestream.errors import ConfigError
    from moestream.memcap import MemCap

    try:
        MemCap.check()
    except ConfigError as e:
        pytest.skip(f"--mem-cap cannot be used here, so such a line may be true: {e}")
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in PAGES for n, ln in enumerate(p.read_text().split("\n"), 1)
           if NO_CAP_CLAIM.search(ln)]
    assert not bad, f"--mem-cap works here, but these lines say it cannot: {bad}"
