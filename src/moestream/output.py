"""Output files and stdout, written the way a user expects an output path to be treated: the checks made before a
command runs (a path that cannot be written, or that names an input), the atomic write, and stdout that may be
closed, full or a broken pipe. Low in the import order: bench, the traces and replay all write through it."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile

from .errors import ConfigError, OutputError


def check_json_path(path: str, inputs: list[str] = (), option: str = "--json", what: str = "the results",
                    input_kind: str = "the model file") -> None:
    """ConfigError, before any row runs, when ``--json PATH`` (``option``) cannot be written (see ``write_json``)
    or names one of ``inputs`` (the model's files: a typo must not replace the model with ``what``)."""
    if path == "":
        raise ConfigError(f"{option}: the path is empty")
    real = os.path.realpath(path)
    cannot = f"{option} {path}: cannot write a file there"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"{cannot} ({e.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{cannot} (it is a directory)")
    if path.endswith(os.sep):
        raise ConfigError(f"{cannot} (the path ends with '{os.sep}': a folder, not a file name)")
    for inp in inputs:
        with contextlib.suppress(OSError):
            if st is not None and os.path.samefile(real, inp):
                raise ConfigError(f"{option} {path}: that is {input_kind} {inp}; choose another path for "
                                  f"{what}")
    if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO, /dev/null, a terminal: written into as it is
        if not os.access(real, os.W_OK):
            raise ConfigError(f"{cannot} (not writable)")
        return
    if st is not None and not os.access(real, os.W_OK):  # read-only: not silently replaced by the rename
        raise ConfigError(f"{cannot} (the file is not writable)")
    d = os.path.dirname(real)
    if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"{cannot} (its folder {d} is missing or not writable)")
    try:  # what write_json will do: a temporary file beside the target (some folders refuse, e.g. /proc)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".moestream-probe-")
    except OSError as e:
        raise ConfigError(f"{cannot} (its folder {d} refuses new files: {e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def check_distinct_outputs(outputs: list[tuple[str, str | None]]) -> None:
    """ConfigError when two output options (``(option, path)`` pairs; None = not given) name the same file: each
    would be written over the other and one output silently lost."""
    seen: list[tuple[str, str, str]] = []
    for option, path in outputs:
        if not path:
            continue
        real = os.path.realpath(path)
        for other, other_path, other_real in seen:
            same = real == other_real
            if not same:
                with contextlib.suppress(OSError):
                    same = os.path.samefile(real, other_real)
            if same:
                raise ConfigError(f"{option} {path}: {other} {other_path} names the same file; give each output its "
                                  "own path")
        seen.append((option, path, real))


def write_json(path: str, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` (``--json``), as :func:`write_output` writes."""
    write_output(path, json.dumps(obj, indent=2) + "\n")


def write_output(path: str, text: str, option: str = "--json", what: str = "the results") -> None:
    """Write ``text`` to ``path`` the way a user expects an output path to be treated.

    A symlink is followed: its target gets the text and the link stays a link. An existing file that is not a
    regular file (a FIFO, /dev/null, a terminal) is opened and written into, never replaced. A regular file, new or
    existing, is written to a temporary file in the same folder that is then renamed over it, so a failed write
    never leaves it half-written (an existing file keeps its permissions). OutputError naming ``option`` on failure.
    """
    real = os.path.realpath(path)
    try:
        try:
            st = os.stat(real)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(real, "w") as f:
                f.write(text)
            return
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(real) + ".", suffix=".tmp", dir=os.path.dirname(real))
        try:
            if st is not None:
                mode = stat.S_IMODE(st.st_mode)
            else:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.fchmod(fd, mode)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise OutputError(f"{option} {path}: cannot write {what} ({e.strerror or e})") from None


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout and flush. OutputError when stdout cannot be written (a full disk, /dev/full);
    BrokenPipeError (the reader went away, e.g. ``| head``) passes through: main() exits 0 on it."""
    if sys.stdout is None:  # started with stdout closed (>&-)
        raise OutputError("cannot write to stdout (it is closed)")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write to stdout ({e.strerror or e})") from None
