"""Errors that the CLI turns into one line on stderr and a non-zero exit.

Every message names the file (or the option) and the problem, with the offending value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class MoestreamError(Exception):
    """Base class: a user-facing error with a one-line message."""


class GGUFError(MoestreamError):
    """The model file is missing, not GGUF, truncated, or has something moestream cannot compute."""


class ConfigError(MoestreamError):
    """A bad option value (e.g. --slots below the experts used per token)."""


class OptionError(ConfigError):
    """A bad option value, said in the options' own terms: the fields of LoadOptions and SamplingParams
    (``io_threads``, ``top_k``, ...), never a command-line flag. ``template`` names a field as ``{field}`` (its name)
    or ``{field=}`` (its name and value); ``values`` holds the fields' values. ``str(e)`` is the library's wording
    (``io_threads must be at least 1, got 0``; ``mem=1073741824 and slots=8 both size ...``); a command renders
    the same template in its own terms with :meth:`render` (the CLI's flags and the text given; the server's
    JSON keys). ``field``: the first field named (the server's ``param``)."""

    _PLACE = re.compile(r"\{(\w+)(=?)\}")

    def __init__(self, template: str, **values: object):
        self.template, self.values = template, values
        self.field = self._PLACE.search(template).group(1) if self._PLACE.search(template) else None
        super().__init__(self.render())

    def render(self, names: Mapping[str, str] | None = None, given: Mapping[str, object] | None = None) -> str:
        """The message with each field named by ``names`` (field -> e.g. ``"--io-threads"``; absent: the field's
        own name) and each ``{field=}`` followed by its value as ``given`` holds it (the text typed), else as
        :func:`shown` writes :attr:`values`' (``=`` joins a field's own name to its value)."""
        names, given = names or {}, given or {}

        def sub(m: re.Match) -> str:
            field, with_value = m.group(1), m.group(2)
            name = names.get(field, field)
            if not with_value:
                return name
            value = given.get(field)
            text = str(value).strip() if value is not None else shown(self.values.get(field))
            return f"{name} {text}" if field in names else f"{name}={text}"

        return self._PLACE.sub(sub, self.template)


def shown(value: object) -> str:
    """A value as an option message writes it: numbers as Python prints them, anything else (a string from a JSON
    request, say) as its repr, cut to 80 characters."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ExpertReadError(MoestreamError):
    """Reading an expert from the model file failed (short read or OS error).

    Attributes: path, offset (bytes, absolute in the file), nbytes (bytes requested), cause (str).
    """

    def __init__(self, path: str, offset: int, nbytes: int, cause: str):
        self.path, self.offset, self.nbytes, self.cause = path, offset, nbytes, cause
        super().__init__(f"{path}: reading {nbytes} bytes of expert data at offset {offset} failed: {cause}")


class ModelFileChanged(MoestreamError):
    """The model file was truncated or replaced while the model was in use. The message names the file and the
    change, not what follows (the CLI stops; the server goes on answering 503): each caller says its own."""


class NumericError(MoestreamError):
    """A forward pass produced non-finite logits (NaN/Inf): the weights or metadata are bad."""


class ForwardError(MoestreamError):
    """An unexpected torch error inside a forward pass (a last line of defence: metadata that disagrees with the
    tensors in a way the load-time checks did not catch). The message names the file and the original error."""


class OutputError(MoestreamError):
    """Writing the results (stdout, a --json file) failed."""
