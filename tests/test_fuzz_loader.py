"""Fuzz the loader: seeded mutations of real GGUF files' headers, metadata and tensor tables, each run through
``moestream inspect`` and ``moestream run -n 2`` in this process (``moestream.cli.main``, stderr captured).

Every case must end in a normal run (exit 0) or a one-line error (exit 1, the last stderr line
``moestream: error: ...``, no other line but moestream's own ``moestream: ...`` lines, no Traceback); never an
exception out of ``main``, a case past :data:`CASE_SECONDS`, or a peak resident memory more than the file's size
above what the unmutated file takes (its own run, or the loader's fallback parse of it, whichever is more).

The files (all made from the embedded model, ``src/moestream/data/default.gguf``):

* ``small``: the embedded model with its vocabulary cut to its first 400 tokens and its control tokens (rows of
  ``token_embd`` kept byte for byte, merges among the kept tokens): every metadata key, tensor and the chat template
  as in the embedded model, 7 MB, and a header that parses in milliseconds instead of seconds (152k tokens), so a
  few hundred cases fit the CI budget. It runs and chats (``test_bases_run``).
* ``split``: ``small`` written as gguf-split parts (``tests/ggufedit.py``), each part's header mutated.
* ``default.gguf`` itself, for a few cases (its 152k-token header takes seconds to parse).

The mutations (:func:`mutate`): bit flips in any header field, key, tensor name or string value; truncation at every
region boundary (after the magic, version, counts, each key-value pair, each tensor-table entry, at the data start
and at each tensor's data, the last byte); the tensor and key-value counts; tensor data offsets (zero, misaligned,
another tensor's, past the end, huge); ggml types and metadata value types (known, unknown, huge); string lengths
(keys, values, tensor names, array items); array lengths and item types; tensor ranks and dimensions; numeric
metadata values (0, -1, huge, NaN, inf); keys and tensor names (another's: a duplicate; a byte changed). Case
``NAME:i`` is ``mutate(layout, data, "NAME:i")``, seeded by that string: deterministic, so a failure reproduces.
"""

from __future__ import annotations

import dataclasses
import random
import re
import signal
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from helpers import cli
from moestream.options import default_model_path

#: seeded cases per file (truncations at the boundaries come on top)
N_SMALL = 220
N_SPLIT = 40
#: wall-clock limit of one command of one case (a normal case takes well under a second)
CASE_SECONDS = 15.0
#: the vocabulary of the small base: the first tokens of the embedded model's (plus its control tokens)
SMALL_VOCAB = 400

# GGUF value types (gguf.GGUFValueType) and the byte size of the scalar ones
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
          I64: "<q", F64: "<d"}


# ---------------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a GGUF header: ``kind`` (magic, version, n_tensors, n_kv, key_len, key, vtype, value, str_len,
    str, arr_type, arr_count, item_len, name_len, name, n_dims, dim, ggml_type, offset), its byte ``pos`` and
    ``size``, its value as read (an int, a float for float values; 0 for the bytes of a key, name or string) and
    ``fmt``, the struct format it is written with ("" for bytes)."""

    kind: str
    pos: int
    size: int
    value: int | float
    fmt: str


@dataclasses.dataclass
class Layout:
    """The fields of a GGUF file's header and its region boundaries (byte offsets where a region ends: the fixed
    header's parts, each key-value pair, each tensor-table entry, the data start, each tensor's data)."""

    size: int
    alignment: int
    data_start: int
    fields: list[Field]
    boundaries: list[int]
    tensor_offsets: list[int]

    def of(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


def parse_layout(data: bytes) -> Layout:
    """Walk a GGUF v2/v3 (little-endian) header with ``struct``: every field's position, for the mutations."""
    fields: list[Field] = []
    pos = 0

    def take(kind: str, fmt: str) -> int | float:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        fields.append(Field(kind, pos, struct.calcsize(fmt), v, fmt))
        pos += struct.calcsize(fmt)
        return v

    def string(kind: str, text: str | None = None) -> bytes:
        nonlocal pos
        n = take(kind, "<Q")
        s = data[pos:pos + n]
        if text and n:  # the bytes themselves, as a field of their own (a key, a tensor name, a string value)
            fields.append(Field(text, pos, n, 0, ""))
        pos += n
        return s

    fields.append(Field("magic", 0, 4, 0, "<I"))
    pos = 4
    take("version", "<I")
    boundaries = [4, 8]
    n_tensors = take("n_tensors", "<Q")
    boundaries.append(pos)
    n_kv = take("n_kv", "<Q")
    boundaries.append(pos)
    alignment = 32
    for _ in range(n_kv):
        key = string("key_len", "key")
        vtype = take("vtype", "<I")
        if vtype == STRING:
            string("str_len", "str")
        elif vtype == ARRAY:
            itype = take("arr_type", "<I")
            count = take("arr_count", "<Q")
            if itype == STRING:
                for _ in range(count):
                    string("item_len")
            else:
                pos += count * struct.calcsize(SCALAR[itype])
        else:
            v = take("value", SCALAR[vtype])
            if key == b"general.alignment":
                alignment = int(v)
        boundaries.append(pos)
    offsets = []
    for _ in range(n_tensors):
        string("name_len", "name")
        n_dims = take("n_dims", "<I")
        for _ in range(n_dims):
            take("dim", "<Q")
        take("ggml_type", "<I")
        offsets.append(int(take("offset", "<Q")))
        boundaries.append(pos)
    data_start = -(-pos // alignment) * alignment
    boundaries += [data_start, *(data_start + o for o in offsets[1:]), len(data) - 1]
    return Layout(len(data), alignment, data_start, fields, sorted(set(boundaries)), offsets)


# ------------------------------------------------------------------------------------------------- mutations
HUGE = [2**31, 2**32 + 7, 2**62, 2**64 - 1]


def _put(buf: bytearray, f: Field, value: int | float) -> str:
    """Write ``value`` into field ``f`` (wrapped to its width for ints); returns a description."""
    if f.fmt in ("<f", "<d"):
        struct.pack_into(f.fmt, buf, f.pos, float(value))
    else:
        bits = f.size * 8
        v = int(value) % (1 << bits)
        struct.pack_into(f.fmt.upper() if f.fmt[-1] in "bhiq" else f.fmt, buf, f.pos, v)
    return f"{f.kind}@{f.pos} {f.value!r} -> {value!r}"


def mutate(layout: Layout, data: bytes, case: str) -> tuple[bytes, str]:
    """Case ``case`` (a seed string) applied to ``data``: the mutated bytes and what was done."""
    rng = random.Random(case)
    buf = bytearray(data)
    needs = {"offset": ("offset",), "type": ("ggml_type", "vtype", "arr_type"),
             "str_len": ("key_len", "str_len", "name_len", "item_len"), "arr": ("arr_count", "arr_type"),
             "dims": ("n_dims", "dim"), "value": ("value",)}
    kinds = ["flip", "flip", "count", "offset", "type", "str_len", "arr", "dims", "value", "cut", "rename"]
    kind = rng.choice([k for k in kinds if k not in needs or layout.of(*needs[k])])
    if kind == "flip":  # one bit of any header field
        f = rng.choice(layout.fields)
        byte = f.pos + rng.randrange(f.size)
        bit = rng.randrange(8)
        buf[byte] ^= 1 << bit
        return bytes(buf), f"flip bit {bit} of byte {byte} ({f.kind}@{f.pos})"
    if kind == "count":
        f = rng.choice(layout.of("n_tensors", "n_kv"))
        what = _put(buf, f, rng.choice([0, 1, f.value - 1, f.value + 1, 2 * f.value, *HUGE]))
        return bytes(buf), what
    if kind == "offset":
        f = rng.choice(layout.of("offset"))
        others = [o for o in layout.tensor_offsets if o != f.value] or [0]
        v = rng.choice([0, f.value + 1, f.value - layout.alignment, f.value + layout.alignment, rng.choice(others),
                        layout.size - layout.data_start, layout.size, *HUGE])
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "type":
        f = rng.choice(layout.of("ggml_type", "vtype", "arr_type"))
        v = rng.choice([rng.randrange(0, 42), rng.randrange(0, 14), 99, 255, 2**31, 2**32 - 1])
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "str_len":
        f = rng.choice(layout.of("key_len", "str_len", "name_len", "item_len"))
        v = rng.choice([0, f.value - 1, f.value + 1, f.value + 8, layout.size, *HUGE])
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "arr":
        f = rng.choice(layout.of("arr_count", "arr_type"))
        v = (rng.choice([0, 1, f.value - 1, f.value + 1, *HUGE]) if f.kind == "arr_count"
             else rng.choice([U8, I32, F32, BOOL, STRING, ARRAY, U64, F64, 13, 2**31]))
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "dims":
        f = rng.choice(layout.of("n_dims", "dim"))
        v = (rng.choice([0, 1, 3, 4, 5, 64, 2**31]) if f.kind == "n_dims"
             else rng.choice([0, 1, f.value - 1, f.value + 1, 2 * f.value, *HUGE]))
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "value":
        f = rng.choice(layout.of("value"))
        if f.fmt in ("<f", "<d"):
            v = rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 1e-30])
        else:
            v = rng.choice([0, 1, -1, f.value + 1, 2 * f.value + 1, 2**15, *HUGE])
        what = _put(buf, f, v)
        return bytes(buf), what
    if kind == "rename":  # a key or tensor name made another's of the same length: a duplicate, or a byte changed
        f = rng.choice(layout.of("key", "name"))
        same = [g for g in layout.of(f.kind) if g.size == f.size and g.pos != f.pos]
        if same:
            g = rng.choice(same)
            buf[f.pos:f.pos + f.size] = data[g.pos:g.pos + g.size]
            return bytes(buf), f"{f.kind}@{f.pos} {data[f.pos:f.pos + f.size]!r} -> {data[g.pos:g.pos + g.size]!r}"
        byte = f.pos + rng.randrange(f.size)
        buf[byte] = rng.choice([0x00, 0x2E, 0x80, 0xFF])
        return bytes(buf), f"{f.kind}@{f.pos}: byte {byte} -> {buf[byte]:#x}"
    # cut: truncation at a random byte of the header
    at = rng.randrange(1, layout.data_start)
    return bytes(buf[:at]), f"truncate at {at} (header ends at {layout.data_start})"


# ---------------------------------------------------------------------------------------------------- running
class CaseTimeout(BaseException):  # noqa: N818 - a BaseException so that no handler of the code under test eats it
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in this thread after ``seconds``; a hang in C code (no Python frame to interrupt) ends the
    process with a dump of every thread's stack after 4 x ``seconds`` instead (faulthandler)."""
    import faulthandler

    def alarm(signum: int, frame: object) -> None:
        raise CaseTimeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(4 * seconds, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{name}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass
class Outcome:
    problem: str | None  # None: a normal run or a one-line error
    rc: int | None
    seconds: float
    growth_bytes: int  # peak RSS during the command above the RSS before it (0 where the peak cannot be reset)


def run_case(args: list[str], seconds: float) -> Outcome:
    """``moestream ARGS`` in this process under :func:`time_limit` (``seconds``); what is wrong with how it ended,
    if anything. A Python warning that the default filters show counts as a line on stderr (it is one in a real run;
    here pytest would catch it)."""
    rss0 = _status_kib("VmRSS")
    peak_ok = _reset_peak()
    t0 = time.monotonic()
    try:
        with time_limit(seconds), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)  # ignored by Python's default filters
            p = cli(*args)
    except CaseTimeout:
        return Outcome(f"still running after {seconds:.0f} s", None, time.monotonic() - t0, 0)
    except BaseException as e:  # noqa: BLE001 - the point: nothing may escape main
        return Outcome(f"{type(e).__name__} escaped main: {e}"[:300], None, time.monotonic() - t0, 0)
    took = time.monotonic() - t0
    growth = (_status_kib("VmHWM") - rss0) * 1024 if peak_ok else 0
    err = p.stderr.strip().splitlines()

    def bad(problem: str) -> Outcome:
        return Outcome(problem, p.returncode, took, growth)

    if caught:
        return bad(f"a warning on stderr: {caught[0].category.__name__}: {caught[0].message} ({caught[0].filename}:"
                   f"{caught[0].lineno}); exit {p.returncode}, {err[-1:]}")
    if p.returncode == 0:
        return Outcome(None, 0, took, growth)
    if p.returncode != 1:
        return bad(f"exit status {p.returncode}: {p.stderr.strip()[-300:]}")
    if "Traceback" in p.stderr:
        return bad(f"a traceback: {p.stderr[-500:]}")
    if not err or not err[-1].startswith("moestream: error: "):
        return bad(f"exit 1 without a final 'moestream: error:' line: {p.stderr.strip()[-300:]!r}")
    if any(not ln.startswith("moestream: ") or ln.startswith("moestream: error") for ln in err[:-1]):
        return bad(f"more than one error line: {err[-4:]}")
    return Outcome(None, 1, took, growth)


def commands(path: Path) -> list[list[str]]:
    return [["inspect", "-m", str(path)], ["run", "-m", str(path), "-n", "2", "-t", "1"]]


class Fuzzer:
    """Runs the cases of one file (a split model: its first part) and collects what went wrong.

    The memory bound of a case is what the unmutated file takes (:meth:`baseline`) plus the file's size; that
    baseline is measured only when a case grows by more than the file's size."""

    def __init__(self, name: str, paths: list[Path], seconds: float):
        self.name, self.paths, self.seconds = name, paths, seconds
        self.size = sum(p.stat().st_size for p in paths)
        self._baseline: dict[str, int] | None = None
        self.problems: list[str] = []
        self.counts = {"cases": 0, "ran": 0, "refused": 0}
        self.slowest = (0.0, "")
        self.unmutated_seconds = 0.0
        self.most_growth = 0

    def baseline(self, command: str) -> int:
        """What ``command`` takes on the unmutated file: its peak RSS growth, or what the loader's other parser
        takes on the same file if that is more (a well-formed header is read by moestream's own parser; one it does
        not take, as a corrupt one, by the ``gguf`` package's reader, ``gguf.open_reader``, holding a numpy view per
        string)."""
        if self._baseline is None:
            from moestream.gguf import open_reader

            rss0 = _status_kib("VmRSS")
            _reset_peak()
            readers = [open_reader(p) for p in self.paths]
            fallback = (_status_kib("VmHWM") - rss0) * 1024
            del readers
            self._baseline = {}
            for args in commands(self.paths[0]):
                o = run_case(args, self.seconds)
                assert o.problem is None and o.rc == 0, (args, o)
                self._baseline[args[0]] = max(o.growth_bytes, fallback)
                self.unmutated_seconds = max(self.unmutated_seconds, o.seconds)
        return self._baseline[command]

    def check(self, case: str, what: str, path: Path) -> None:
        self.counts["cases"] += 1
        for args in commands(path):
            out = run_case(args, self.seconds)
            self.slowest = max(self.slowest, (out.seconds, f"{case} {args[0]}"))
            self.most_growth = max(self.most_growth, out.growth_bytes)
            if out.problem is None and out.growth_bytes > self.size and \
                    out.growth_bytes > self.baseline(args[0]) + self.size:
                out.problem = (f"peak RSS grew by {out.growth_bytes / 2**20:.0f} MiB, more than the unmutated file's "
                               f"{self.baseline(args[0]) / 2**20:.0f} MiB + the file's {self.size / 2**20:.0f}")
            if out.problem:
                self.problems.append(f"{case} ({what}): moestream {args[0]}: {out.problem}")
            elif args[0] == "run":
                self.counts["ran" if out.rc == 0 else "refused"] += 1

    def report(self) -> None:
        print(f"{self.name}: {self.counts}; slowest {self.slowest[0]:.2f} s ({self.slowest[1]}); peak RSS growth at "
              f"most {self.most_growth / 2**20:.1f} MiB (file {self.size / 2**20:.1f} MiB"
              + (f", unmutated {self._baseline}, {self.unmutated_seconds:.1f} s" if self._baseline is not None else "")
              + f"); limit {self.seconds:.0f} s")
        assert not self.problems, f"{len(self.problems)} problem(s):\n" + "\n".join(self.problems[:30])


# ----------------------------------------------------------------------------------------------------- files
def small_vocab(src: str, dst: Path, n_normal: int) -> None:
    """``src`` with its vocabulary cut to its first ``n_normal`` tokens and its control / user-defined tokens (ids
    renumbered in order; the ``*_token_id`` keys and the rows of ``token_embd`` / ``output`` follow; merges kept
    where both parts and the result are kept); every other key and tensor as it is."""
    from gguf import GGUFValueType, GGUFWriter

    from moestream.gguf import open_reader

    r = open_reader(src)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    keep = list(range(n_normal)) + [i for i, t in enumerate(types) if i >= n_normal and t in (3, 4)]
    new_id = {old: new for new, old in enumerate(keep)}
    kept = {tokens[i] for i in keep}
    merges = [m for m in r.fields["tokenizer.ggml.merges"].contents()
              if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        val = f.contents()
        if key == "tokenizer.ggml.tokens":
            val = [tokens[i] for i in keep]
        elif key == "tokenizer.ggml.token_type":
            val = [types[i] for i in keep]
        elif key == "tokenizer.ggml.merges":
            val = merges
        elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            val = new_id[val]
        w.add_key_value(key, val, f.types[0], sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        rows = np.asarray(t.data).reshape(*shape[:-1], -1)
        if t.name in ("token_embd.weight", "output.weight") and shape[0] == len(tokens):
            rows = rows[keep]
        w.add_tensor(t.name, np.ascontiguousarray(rows), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    small_vocab(default_model_path(), path, SMALL_VOCAB)
    return path


@pytest.fixture(scope="module")
def warm(small: Path) -> None:
    """Each command run once on the small file before any case is measured: the first run's one-time costs (the
    tokenizer's and the kernels' imports, torch's thread pools) are not a case's memory."""
    for args in commands(small):
        assert run_case(args, 4 * CASE_SECONDS).problem is None


@pytest.fixture(scope="module")
def split(small: Path) -> list[Path]:
    from ggufedit import rewrite

    return rewrite(small, small.parent / "split.gguf", split_max_tensors=20)


def test_bases_run(small: Path, split: list[Path]) -> None:
    """The unmutated files run, and the small one chats: the mutations start from working files."""
    assert len(split) == 3
    for path in (small, split[0]):
        p = cli("run", "-m", str(path), "-n", "4", "--temp", "0")
        assert p.returncode == 0, p.stderr
    p = cli("run", "-m", str(small), "--chat", "-p", "Hello there", "-n", "4", "--temp", "0")
    assert p.returncode == 0 and "decode" in p.stderr, p.stderr


def _fuzz(name: str, paths: list[Path], cases: Callable[[list[Layout], list[bytes]], Iterator[tuple]],
          tmp: Path, seconds: float | None = CASE_SECONDS) -> Fuzzer:
    """Run ``cases(layouts, datas)`` -- (case, what, part index, mutated bytes) -- on copies of the file ``paths``
    (a split model: the mutated part replaced, the others as they are), each command within ``seconds`` (None: 4 x
    the unmutated file's slower command, at least 4 x CASE_SECONDS, measured first)."""
    datas = [p.read_bytes() for p in paths]
    layouts = [parse_layout(d) for d in datas]
    fz = Fuzzer(name, paths, seconds or 10 * CASE_SECONDS)
    if seconds is None:
        fz.baseline("run")
        fz.seconds = max(4 * CASE_SECONDS, 4 * fz.unmutated_seconds)
    work = tmp / name
    work.mkdir()
    for n, (case, what, part, mutated) in enumerate(cases(layouts, datas)):
        # a fresh name per case (nothing cached by path); split parts keep their gguf-split names
        d = work / f"c{n}"
        d.mkdir()
        for i, p in enumerate(paths):
            (d / p.name).write_bytes(mutated if i == part else datas[i])
        fz.check(case, what, d / paths[0].name)
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    return fz


def boundary_cuts(layouts: list[Layout], datas: list[bytes]) -> Iterator[tuple]:
    for part, (lay, data) in enumerate(zip(layouts, datas, strict=True)):
        for at in lay.boundaries:
            yield f"cut{part}:{at}", f"part {part + 1} truncated at the region boundary {at}", part, data[:at]


def seeded(name: str, n: int) -> Callable[[list[Layout], list[bytes]], Iterator[tuple]]:
    def cases(layouts: list[Layout], datas: list[bytes]) -> Iterator[tuple]:
        for i in range(n):
            case = f"{name}:{i}"
            part = random.Random(case + ":part").randrange(len(datas))
            mutated, what = mutate(layouts[part], datas[part], case)
            yield case, f"part {part + 1}: {what}" if len(datas) > 1 else what, part, mutated
    return cases


def test_truncated_at_every_boundary(small: Path, tmp_path: Path, warm: None) -> None:
    """The small file cut at every region boundary of its header, tensor table and data."""
    _fuzz("small-cut", [small], boundary_cuts, tmp_path).report()


def test_seeded_mutations(small: Path, tmp_path: Path, warm: None) -> None:
    """N_SMALL seeded mutations of the small file's header, metadata and tensor table."""
    _fuzz("small", [small], seeded("small", N_SMALL), tmp_path).report()


def test_split_parts(split: list[Path], tmp_path: Path, warm: None) -> None:
    """A gguf-split model: each part cut at its boundaries (a sample) and N_SPLIT seeded mutations of its parts."""
    def cases(layouts: list[Layout], datas: list[bytes]) -> Iterator[tuple]:
        cuts = list(boundary_cuts(layouts, datas))
        yield from random.Random("split-cuts").sample(cuts, min(len(cuts), 30))
        yield from seeded("split", N_SPLIT)(layouts, datas)
    _fuzz("split", split, cases, tmp_path).report()


def test_embedded_model(tmp_path: Path, warm: None) -> None:
    """Three cases on the embedded model itself (its 152k-token header takes seconds to parse: the limit is 4 x its
    unmutated run's time, at least a minute): a cut inside the vocabulary, an unknown tensor type, an array one item
    longer."""
    path = Path(default_model_path())

    def cases(layouts: list[Layout], datas: list[bytes]) -> Iterator[tuple]:
        lay, data = layouts[0], datas[0]
        items = lay.of("item_len")
        cut = items[len(items) // 3].pos + 3
        yield "default:cut", f"truncate at {cut}, inside tokenizer.ggml.tokens", 0, data[:cut]
        for case, kind, value in (("default:type", "ggml_type", lambda v: 2**31), ("default:arr", "arr_count",
                                                                                    lambda v: v + 1)):
            f = random.Random(case).choice(lay.of(kind))
            buf = bytearray(data)
            what = _put(buf, f, value(f.value))
            yield case, what, 0, bytes(buf)
    _fuzz("default", [path], cases, tmp_path, seconds=None).report()
