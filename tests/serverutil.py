"""The server run in a test's own trio run (``run_server``, no subprocess): the start-up
the in-process end-to-end tests share. Tests that need a real process use serverproc.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from agentserver.app.builtins import RunContext
from agentserver.app.root import Running, ServeOptions, run_server
from agentserver.config.topology import Topology
from agentserver.remote.hub import RunnerHub


@dataclass
class InProcess:
    """A server started by :func:`start_in_process`; set ``shutdown`` to stop it."""

    port: int
    #: the HTTP API's base URLs (none when boot.xml declares no ``<http>``)
    urls: list[str]
    shutdown: trio.Event
    #: what run_server made (its runner hub, its agents)
    running: Running

    @property
    def runner_hub(self) -> RunnerHub:
        """The runner hub (the test's topology has remote listeners)."""
        assert self.running.runner_hub is not None
        return self.running.runner_hub


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
    running: list[Running] = []
    urls: list[str] = []
    ready = trio.Event()

    def started(parts: Running) -> None:
        running.append(parts)
        ready.set()

    nursery.start_soon(
        partial(
            run_server,
            topology,
            ServeOptions(port=0),
            ctx,
            shutdown,
            environ=environ,
            on_running=started,
            on_http=urls.extend,
            **options,
        )
    )
    with trio.fail_after(timeout_s):
        await ready.wait()
    port = int(running[0].addresses[0].rsplit(":", 1)[1])
    return InProcess(port, urls, shutdown, running[0])
