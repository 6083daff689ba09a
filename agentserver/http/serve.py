"""Hypercorn's trio worker serving the HTTP API inside the server's nursery."""

from __future__ import annotations

import logging
import ssl
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework
from starlette.applications import Starlette

log = logging.getLogger("agentserver.http")


class _Config(Config):
    """Hypercorn's config with our TLS context (the socket's certificate, key and
    client-CA rules, built by agentserver.net.tls) instead of its certfile/keyfile."""

    def __init__(self, ssl_context: ssl.SSLContext | None) -> None:
        super().__init__()
        self._ssl_context = ssl_context

    @property
    def ssl_enabled(self) -> bool:
        return self._ssl_context is not None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if self._ssl_context is not None:
            # HTTP/1.1 only: h2's flow control is not worth it for this API.
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        return self._ssl_context


def http_config(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    read_timeout: float,
    graceful_timeout: float | None = None,
) -> Config:
    """Hypercorn's configuration for the API on ``host``:``port``. ``graceful_timeout``:
    how long requests in progress may finish at shutdown (None: hypercorn's default)."""
    config = _Config(ssl_context)
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    # Hypercorn's own messages ("Running on ...") go to our log, at its level.
    config.errorlog = logging.getLogger("agentserver.http.hypercorn")
    config.ssl_handshake_timeout = read_timeout
    # A small fixed header budget: headers are not where payloads go.
    config.h11_max_incomplete_size = 16 * 1024
    if graceful_timeout is not None:
        config.graceful_timeout = graceful_timeout
    return config


async def serve_http(
    app: Starlette,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set; ``task_status`` gets the bound URLs."""
    # Starlette and Hypercorn each annotate ASGI in their own types: the same protocol.
    await serve(
        cast(ASGIFramework, app),
        config,
        shutdown_trigger=shutdown.wait,
        task_status=task_status,
    )
