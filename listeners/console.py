"""The console: a listener that turns terminal lines into messages.

The console is not a loop of its own. The pump sends it a ``<prompt>``; the handler prints
the prompt's lines, reads one line from its terminal and emits an ``<input>`` that the
topology routes (by root tag, to the console's peer that takes ``<input>``: normally the
``console-router``). The answer comes back to the console on its thread as the next
``<prompt>``, and so on. ``/quit`` or end of input makes the handler return ``None``,
which ends the chain.

The console also takes ``<approval-request>`` (when it is a rule's approver): it prints
the request as one line at once, even while a prompt waits for the user's line, and
answers nothing; the operator decides with ``/approve ID`` or ``/deny ID``.

Only prompts from trusted senders (the boot listener and the console's peers) are
shown: anybody else who sends the console a ``<prompt>`` is ignored, so a client cannot
write to the operator's terminal or make the server read its standard input.

Payloads live in ``urn:agentserver:console`` (never the core namespace: only the pump
emits core primitives).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable
from typing import Protocol, TextIO

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel, element

from agentserver.agents.governance.approvals import ApprovalRequest
from agentserver.core.listener import HandlerMetadata, HandlerResponse
from agentserver.listeners.console_approvals import render_request

NS = "urn:agentserver:console"
_NSMAP = {"": NS}
QUIT = "/quit"
#: Longest line read from a terminal; longer input is cut (the payload limit applies anyway).
MAX_LINE_CHARS = 256 * 1024

log = logging.getLogger("agentserver.console")

# Characters XML 1.0 cannot carry: a typed control character must not crash the chain.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class Prompt(BaseXmlModel, tag="prompt", nsmap=_NSMAP):
    """Ask the console for its next line, after showing ``lines``."""

    lines: list[str] = element(tag="line", default_factory=list)


class Input(BaseXmlModel, tag="input", nsmap=_NSMAP):
    """One line the user typed."""

    line: str = element()


class Pending(BaseXmlModel, tag="pending", nsmap=_NSMAP):
    """The console router's own reminder that it waits for a reply (see console_router)."""


def xml_safe(text: str) -> str:
    """``text`` without the characters XML 1.0 cannot represent."""
    return _NOT_XML.sub("", text)


class Terminal(Protocol):
    """Where a console reads and writes. ``read_line`` returns None at end of input."""

    async def read_line(self, prompt: str) -> str | None: ...

    def write(self, text: str) -> None: ...


class StdioTerminal:
    """Standard input and output. Blocking reads run in a worker thread that trio abandons
    on cancellation, so shutting down never waits for the user to press Enter."""

    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self._stdin = stdin or sys.stdin
        self._stdout = stdout or sys.stdout
        # A visible "> " only helps a human at a terminal; piped input gets clean output.
        self._interactive = self._stdin.isatty()

    def _read(self, prompt: str) -> str | None:
        if self._interactive and prompt:
            self._stdout.write(prompt)
            self._stdout.flush()
        line = self._stdin.readline(MAX_LINE_CHARS)
        if not line:
            return None
        return line.rstrip("\r\n")

    async def read_line(self, prompt: str) -> str | None:
        return await trio.to_thread.run_sync(self._read, prompt, abandon_on_cancel=True)

    def write(self, text: str) -> None:
        self._stdout.write(text + "\n")
        self._stdout.flush()


class Console:
    """The console listener's handler (accepts :class:`Prompt` and
    :class:`~agentserver.agents.governance.approvals.ApprovalRequest`).

    ``requesters``: the listeners whose approval requests are shown (a client cannot write
    to the operator's terminal this way either). Prompts are taken one at a time (a lock,
    not the listener's concurrency, so that a request is shown while a prompt waits)."""

    def __init__(
        self,
        terminal: Terminal | None,
        *,
        trusted: Iterable[str],
        on_exit: Callable[[], None] | None = None,
        prompt: str = "> ",
        requesters: Iterable[str] = (),
    ) -> None:
        self._terminal = terminal
        self._trusted = frozenset(trusted)
        self._requesters = frozenset(requesters)
        self._on_exit = on_exit
        self._prompt = prompt
        self._reading = trio.Lock()

    async def __call__(
        self, payload: Prompt | ApprovalRequest, meta: HandlerMetadata
    ) -> HandlerResponse | None:
        terminal = self._terminal
        if terminal is None:
            # No terminal attached (the server runs without --console): nothing to show.
            log.info("console: message from %s ignored (no terminal)", meta.from_id)
            return None
        if isinstance(payload, ApprovalRequest):
            if meta.from_id not in self._requesters:
                log.warning("console: approval request from %s ignored", meta.from_id)
                return None
            for line in render_request(etree.fromstring(payload.to_xml())) or ():
                terminal.write(line)
            return None  # the decision comes from /approve or /deny, through the router
        if meta.from_id not in self._trusted:
            log.warning("console: prompt from untrusted sender %s ignored", meta.from_id)
            return None
        async with self._reading:
            return await self._read(payload, terminal)

    async def _read(self, payload: Prompt, terminal: Terminal) -> HandlerResponse | None:
        for shown in payload.lines:
            terminal.write(shown)
        while True:
            line = await terminal.read_line(self._prompt)
            if line is None or line.strip() == QUIT:
                terminal.write("bye")
                if self._on_exit is not None:
                    self._on_exit()
                return None
            line = xml_safe(line).strip()
            if line:
                working = getattr(terminal, "working", None)
                if working is not None:  # an interactive terminal shows it waits
                    working()
                return HandlerResponse(Input(line=line))
