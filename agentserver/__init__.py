"""agentserver: an XML message-pump agent server.

The packages are layers (docs/architecture.md): ``core`` (sans-IO), ``observability``,
``pump``, ``net``, ``llm``, ``agents``, ``remote``, ``http``, ``config``, ``console``,
``app`` (the composition root) and ``cli``. The public API is listed in docs/api.md.
"""

from agentserver import _moved

_moved.install()


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentserver")
    except PackageNotFoundError:
        return "unknown"
