"""Helpers for the HTTP API tests (not tests): the URL a server printed, a client."""

from __future__ import annotations

import re

from serverproc import ServerProcess

# The first URL, in a plain line or in the event of a JSON one (up to its closing quote).
HTTP_LISTENING = re.compile(r"agentserver http listening on ([^\s\",]+)")


def http_url(server: ServerProcess) -> str:
    """The HTTP API's URL, from the line ``run`` prints before the socket's."""
    match = HTTP_LISTENING.search(server.stderr)
    assert match, server.stderr
    return match.group(1)
