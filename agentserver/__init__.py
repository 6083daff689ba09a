"""agentserver: an XML message-pump agent server."""


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentserver")
    except PackageNotFoundError:
        return "unknown"
