"""Upper bounds of option values and the one check of a token count, in a module that imports no heavy one (the
CLI's help and early checks read them before torch is imported)."""

from __future__ import annotations

from .errors import OptionError, shown

#: Largest token count (-n, -c, --steps, bench -p/-n, the server's max_tokens) accepted; far beyond any context a
#: cache could hold.
MAX_TOKENS = 2**31
#: Most IO threads an expert reader takes: more only adds contention.
MAX_IO_THREADS = 256


def check_tokens(n: object, field: str = "n_predict", minimum: int = -1) -> int:
    """A token count (tokens to generate, decode steps, a bench test's tokens) as an int from ``minimum`` to
    :data:`MAX_TOKENS`: the one check of ``-n`` (minimum -1: until end of generation or a full context), bench's
    ``-p``/``-n`` (0), verify's ``--steps`` and the server's ``max_tokens`` (1). OptionError naming ``field``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise OptionError(f"{{{field}}} must be an integer, got {shown(n)}", **{field: n})
    if n < minimum:
        need = ("-1 (until end of generation or a full context) or 0 or more" if minimum == -1 else
                "0 or more" if minimum == 0 else f"at least {minimum}")
        raise OptionError(f"{{{field}}} must be {need}, got {n}", **{field: n})
    if n > MAX_TOKENS:
        raise OptionError(f"{{{field}}} must be at most 2^31, got {n}", **{field: n})
    return n
