"""Helpers for the HTTP API tests (not tests): the URL a server printed, a client."""

from __future__ import annotations

import re

from serverproc import ServerProcess

HTTP_LISTENING = re.compile(r"agentserver http listening on (\S+)")


def http_url(server: ServerProcess) -> str:
    """The HTTP API's URL, from the line ``run`` prints before the socket's."""
    match = HTTP_LISTENING.search(server.stderr)
    assert match, server.stderr
    return match.group(1).rstrip(",")
