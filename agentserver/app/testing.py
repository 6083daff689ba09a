"""Run a boot.xml's listeners in this process, with no socket: for testing listeners
with pytest-trio (docs/guide.md, "Testing a listener"). Users import it from the face,
:mod:`agentserver.testing`.

    async with in_process("boot.xml") as organism:
        reply = await organism.request(Reverse(text="abc"), to="reverse")
        assert reply.payload_xml == ...

The same loader, pump and validation as ``agentserver run``: a payload the server would
refuse is refused here too (``reply.is_huh``). Agent listeners need the agent runtime and
an LLM: test those against a running server (see examples/).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.app.builtins import RunContext, build_listener_set
from agentserver.config import loader as boot
from agentserver.core.envelope import build_envelope
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.net.client import Reply, parse_reply, payload_element
from agentserver.pump.pump import Pump, open_pump

__all__ = ["InProcess", "in_process"]


class InProcess:
    """A running topology and one client endpoint on it."""

    def __init__(self, pump: Pump, name: str) -> None:
        self.pump = pump
        self.endpoint = pump.open_endpoint(name)
        self.name = name
        self._parser = SafeParser()

    async def request(
        self,
        payload: BaseXmlModel | etree._Element | bytes | str,
        *,
        to: str | None = None,
        timeout: float = 5.0,  # noqa: ASYNC109 - a per-request deadline is the point
    ) -> Reply:
        """Send ``payload`` (to listener ``to``, else by its root tag) on a new thread and
        return the first reply. Raises ``trio.TooSlowError`` after ``timeout`` seconds."""
        thread = new_thread_id()
        envelope = build_envelope(self.name, to, thread, payload_element(payload))
        await self.endpoint.send(etree.tostring(envelope))
        with trio.fail_after(timeout):
            while True:
                reply = parse_reply(await self.endpoint.receive(), self._parser)
                if reply.thread == thread:
                    return reply


@asynccontextmanager
async def in_process(
    path: str | os.PathLike[str],
    *,
    name: str = "tester",
    environ: Mapping[str, str] | None = None,
) -> AsyncIterator[InProcess]:
    """Load ``path`` (raising :class:`agentserver.config.loader.BootError` on errors, as ``run``
    refuses to start), run its pump for the block and hand back a client on it."""
    topology = boot.load_or_raise(path, environ=environ)
    built = build_listener_set(topology, RunContext(topology))
    async with contextlib.AsyncExitStack() as stack:
        if built.mcp_hub is not None:
            # <mcp> servers' tools: connected for the block, as run_server does.
            await stack.enter_async_context(built.mcp_hub.running())
        pump = await stack.enter_async_context(
            open_pump(built.listeners, config=topology.pump_config())
        )
        await pump.inject_system(topology.boot_primitive(), to=topology.boot_listener.name)
        yield InProcess(pump, name)
