"""Errors that the CLI turns into one line on stderr and a non-zero exit.

Every message names the file (or the option) and the problem, with the offending value.
"""

from __future__ import annotations


class MoestreamError(Exception):
    """Base class: a user-facing error with a one-line message."""


class GGUFError(MoestreamError):
    """The model file is missing, not GGUF, truncated, or has something moestream cannot compute."""


class ConfigError(MoestreamError):
    """A bad option value (e.g. --slots below the experts used per token)."""


class ExpertReadError(MoestreamError):
    """Reading an expert from the model file failed (short read or OS error).

    Attributes: path, offset (bytes, absolute in the file), nbytes (bytes requested), cause (str).
    """

    def __init__(self, path: str, offset: int, nbytes: int, cause: str):
        self.path, self.offset, self.nbytes, self.cause = path, offset, nbytes, cause
        super().__init__(f"{path}: reading {nbytes} bytes of expert data at offset {offset} failed: {cause}")


class ModelFileChanged(MoestreamError):
    """The model file was truncated or replaced while the model was in use."""


class NumericError(MoestreamError):
    """A forward pass produced non-finite logits (NaN/Inf): the weights or metadata are bad."""


class ForwardError(MoestreamError):
    """An unexpected torch error inside a forward pass (a last line of defence: metadata that disagrees with the
    tensors in a way the load-time checks did not catch). The message names the file and the original error."""


class OutputError(MoestreamError):
    """Writing the results (stdout, a --json file) failed."""
