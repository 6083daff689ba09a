"""``agentserver console``: the console listener in this process, talking to a server.

The same message-driven console as in the server runs here in a small local pump: a
local boot listener prompts the console, the console's ``<input>`` goes to a local bridge
named ``console-router``, which relays it over the socket to the server's console router
and returns the server's answer (a ``<prompt>``) to the console, and so on. Errors from
the server (``<huh>``, ``<SystemError>``) are shown readably.

With ``--client NAME``, messages the server sends unasked (an ``<approval-request>`` for
an approver ``NAME``, kept for her until received) are shown as they arrive.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import trio
from lxml import etree

from agentserver.config.builtins import BUILTIN_HANDLERS
from agentserver.console.commands import HELP, carry_out, parse_line
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.core.payloads import model_from_tree
from agentserver.listeners.console import NS as CONSOLE_NS
from agentserver.listeners.console import Console, Input, Prompt, Terminal
from agentserver.listeners.console_approvals import render_request
from agentserver.listeners.console_router import DEFAULT_AGENT, listener_names, render_reply
from agentserver.listeners.system_boot import SystemBoot
from agentserver.net.client import (
    AuthenticationRefused,
    Client,
    ClientError,
    RequestTimeout,
    open_client,
)
from agentserver.primitives.core import Boot, boot_primitive
from agentserver.pump.pump import PumpConfig, open_pump

log = logging.getLogger("agentserver.console")
PROMPT_TAG = etree.QName(CONSOLE_NS, "prompt").text


class Bridge:
    """The local ``console-router``: relays ``<input>`` to the server, answers with the
    server's ``<prompt>`` (or a readable error). Without a router on the server
    (``router`` False) a line that would be relayed is answered with :data:`NO_ROUTER`
    instead of the server's bare refusal."""

    def __init__(self, client: Client, *, timeout: float, router: bool = True) -> None:
        self._client = client
        self._timeout = timeout
        self._router = router

    async def __call__(self, payload: etree._Element, meta: HandlerMetadata) -> HandlerResponse:
        line = payload.findtext(f"{{{CONSOLE_NS}}}line") or ""
        command = parse_line(line, default_agent=DEFAULT_AGENT)
        if isinstance(command, str):
            return HandlerResponse.respond(Prompt(lines=[command]))
        if command is not None:
            lines = await carry_out(self._client, command, reply_timeout=self._timeout)
            return HandlerResponse.respond(Prompt(lines=lines))
        prompt = await self._relay(payload)
        if line.strip() == "/help":
            prompt.lines.extend(HELP)
        return HandlerResponse.respond(prompt)

    async def _relay(self, payload: etree._Element) -> Prompt:
        """The prompt that answers ``payload``: the server's, or a readable error."""
        if not self._router:
            return Prompt(lines=[f"error: {NO_ROUTER}"])
        try:
            # Relayed by root tag: whichever server listener takes console <input>.
            reply = await self._client.request(copy.deepcopy(payload), timeout=self._timeout)
        except RequestTimeout:
            return Prompt(lines=[f"error: the server did not answer within {self._timeout:g} s"])
        except ClientError as exc:
            return Prompt(lines=[f"error: {exc}"])
        if reply.payload.tag == PROMPT_TAG:
            return model_from_tree(Prompt, reply.payload)
        return Prompt(lines=list(render_reply(reply.payload, reply.from_id)))


async def show_unasked(conn: Client, terminal: Terminal) -> None:
    """Print what the server sends without being asked, until the connection ends: an
    approval request as its line, anything else (a late answer) as :func:`render_reply`
    renders it."""
    while True:
        try:
            reply = await conn.receive()
        except ClientError:
            return
        lines = render_request(reply.payload)
        if lines is None:
            lines = render_reply(reply.payload, reply.from_id)
        for line in lines:
            terminal.write(line)


#: What the console says when the server has no console router it may address.
NO_ROUTER = (
    "this server has no console-router this console may address, so plain text, @NAME "
    "lines and /listeners get no answer here (/stop, /cancel and /quit still work). Add "
    'a <listener name="console-router" handler="console-router" peers="..."/> to its '
    "boot.xml, or send payloads with 'agentserver send'."
)


async def _probe_router(conn: Client, wait: float) -> tuple[bool, list[str]]:
    """Whether the server's console router answers this connection, and the listeners
    it can address (its ``/listeners``, for completion). A ``<huh>`` means there is no
    router this connection may address; no answer in time is taken as a router (lines
    are relayed as before). Raises :class:`AuthenticationRefused` (the server refused
    the connection: the caller says what to pass)."""
    try:
        reply = await conn.request(Input(line="/listeners"), timeout=wait)
    except AuthenticationRefused:
        raise
    except (RequestTimeout, ClientError):
        return True, []
    if reply.is_huh:
        return False, []
    if reply.payload.tag != PROMPT_TAG:
        return True, []
    return True, listener_names(model_from_tree(Prompt, reply.payload).lines)


async def run_remote_console(
    host: str,
    port: int,
    terminal: Terminal,
    *,
    client: str | None = None,
    token: str | None = None,
    reply_timeout: float = 120.0,
    **tls: Any,
) -> int:
    """Run until the user quits (0) or the server goes away (1). ``tls``: the TLS
    arguments of :func:`agentserver.net.client.open_client` (``tls``, ``ca``, ``cert``, ``key``)."""
    async with open_client(host, port, client=client, token=token, **tls) as conn:
        router, names = await _probe_router(conn, reply_timeout)
        if hasattr(terminal, "set_listeners"):
            terminal.set_listeners(names)
        banner = [
            f"agentserver console: connected to {host}:{port}. /help for commands, /quit to leave."
        ]
        if not router:
            banner.append(NO_ROUTER)
        done = trio.Event()
        lost = False
        listeners = [
            Listener(
                "boot",
                (Boot,),
                SystemBoot(
                    start_console=True,
                    banner=banner,
                ),
                peers=("console",),
                **BUILTIN_HANDLERS["system-boot"].defaults,
            ),
            Listener(
                "console",
                (Prompt,),
                Console(terminal, trusted=("boot", "console-router"), on_exit=done.set),
                peers=("console-router",),
                responses=(Input,),
                **BUILTIN_HANDLERS["console"].defaults,
            ),
            Listener(
                "console-router",
                (Input,),
                Bridge(conn, timeout=reply_timeout, router=router),
                responses=(Prompt,),
                raw=True,
                concurrency=1,
                timeout=reply_timeout + 10,
            ),
        ]
        async with (
            open_pump(listeners, config=PumpConfig(organism="console", drain_timeout=0.2)) as pump,
            trio.open_nursery() as nursery,
        ):

            async def watch() -> None:
                nonlocal lost
                await conn.wait_closed()
                lost = True
                done.set()

            nursery.start_soon(watch)
            nursery.start_soon(show_unasked, conn, terminal)
            await pump.inject_system(boot_primitive("console", 3), to="boot")
            await done.wait()
            nursery.cancel_scope.cancel()
        if lost:
            terminal.write("error: the server closed the connection")
            return 1
        return 0
