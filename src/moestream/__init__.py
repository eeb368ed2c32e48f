"""moestream: Mixture-of-Experts GGUF models with routed experts streamed from disk."""


def version() -> str:
    """The installed package's version (``pyproject.toml``), or a note that it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("moestream")
    except PackageNotFoundError:
        return "unknown (not installed)"
