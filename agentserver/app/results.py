"""``agentserver result``'s store side: a task's answer read by its thread from the store
of a boot file, with the server stopped or beside it running (as ``store stats`` reads
it: :func:`~agentserver.app.replay.open_beside`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentserver.agents.store.sql import views
from agentserver.app.replay import open_beside, store_settings
from agentserver.config import loader as boot


@dataclass(frozen=True, slots=True)
class Found:
    """What the store holds for a thread: the task's view (None: no task), and whether
    the boot file declares clients (then a task is found only for the client that sent
    it)."""

    task: dict[str, Any] | None
    clients_declared: bool


async def task_answer(
    boot_path: str | os.PathLike[str],
    thread: str,
    *,
    store: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Found:
    """The latest task sent on the caller's ``thread`` in the store of ``boot_path`` (or
    ``store``), with its status, sender and answer (``views.task_answer``).
    Raises ``BootError``, ``AgentError``."""
    topology = boot.load_or_raise(boot_path, environ=environ)
    opened, _beside = await open_beside(store_settings(topology, store))
    try:
        return Found(await opened.read(views.task_answer, thread), bool(topology.clients))
    finally:
        await opened.aclose()
