"""The server run in a test's own trio run (``run_server``, no subprocess): the start-up
the in-process end-to-end tests share. Tests that need a real process use serverproc.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from agentserver.app.builtins import RunContext
from agentserver.app.root import ServeOptions, run_server
from agentserver.config.topology import Topology


@dataclass
class InProcess:
    """A server started by :func:`start_in_process`; set ``shutdown`` to stop it."""

    port: int
    #: the HTTP API's base URLs (none when boot.xml declares no ``<http>``)
    urls: list[str]
    shutdown: trio.Event


async def start_in_process(
    nursery: trio.Nursery,
    topology: Topology,
    ctx: RunContext,
    *,
    environ: dict[str, str],
    timeout_s: float = 20.0,
    **options: Any,
) -> InProcess:
    """Start ``run_server`` for ``topology`` in ``nursery`` on a free port; return once
    it listens (``trio.TooSlowError`` after ``timeout_s``). ``options`` go to
    ``run_server`` (e.g. ``tracing``, ``registry``)."""
    shutdown = trio.Event()
    ports: list[int] = []
    urls: list[str] = []
    ready = trio.Event()

    def listening(addresses: list[str]) -> None:
        ports.append(int(addresses[0].rsplit(":", 1)[1]))
        ready.set()

    nursery.start_soon(
        partial(
            run_server,
            topology,
            ServeOptions(port=0),
            ctx,
            shutdown,
            environ=environ,
            on_listening=listening,
            on_http=urls.extend,
            **options,
        )
    )
    with trio.fail_after(timeout_s):
        await ready.wait()
    return InProcess(ports[0], urls, shutdown)
