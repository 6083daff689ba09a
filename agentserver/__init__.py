"""agentserver: an XML message-pump agent server.

The packages are layers (docs/architecture.md): ``core`` (sans-IO), ``observability``,
``pump``, ``net``, ``llm``, ``agents``, ``remote``, ``http``, ``config``, ``console``,
``app`` (the composition root) and ``cli``. Users import the face above them
(``agentserver.listener``, ``agentserver.client``, ``agentserver.testing``) and the few
deep names docs/api.md lists; everything else is internal.
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
