"""The console router: turns a console's ``<input>`` line into a message and the answer
back into the console's next ``<prompt>``.

The console emits ``<input>``; the router (a listener, reachable in-process and by socket
clients) parses the line:

- ``@NAME <payload .../>`` forwards the payload to peer ``NAME``;
- plain text goes to the default agent as ``<task xmlns="urn:agentserver:assistant">``;
- ``/help``, ``/listeners`` and ``/describe NAME`` (the payloads NAME accepts, with their
  fields and an example) are answered by the router itself.

Whatever comes back on the router's thread (the peer's reply, or a ``<huh>`` /
``<SystemError>`` from the pump) is rendered as readable lines and returned to the console
in a ``<prompt>``. Errors show their canned text, never base64.

A peer may end a chain without answering; so that the console never waits forever, the
router also sends itself a ``<pending>`` reminder with each forward, which answers the
console after ``reply_wait`` seconds if the reply has not come.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio
from lxml import etree

from agentserver.core.errors import InputRefused
from agentserver.core.listener import HandlerMetadata, HandlerResponse, HandlerResult
from agentserver.core.namespaces import CORE_NS, clark
from agentserver.core.payloads import model_from_tree, model_tree
from agentserver.core.xmlsafe import SafeParser
from agentserver.listeners.assistant import Task
from agentserver.listeners.console import NS as CONSOLE_NS
from agentserver.listeners.console import Input, Pending, Prompt
from agentserver.listeners.console_approvals import HELP as APPROVAL_HELP
from agentserver.listeners.console_approvals import parse_approval, render_ack
from agentserver.primitives.core import HUH_TAG, SYSTEM_ERROR_TAG

log = logging.getLogger("agentserver.console")

DEFAULT_AGENT = "assistant"
INPUT_TAG = clark(CONSOLE_NS, "input")
PENDING_TAG = clark(CONSOLE_NS, "pending")
ANSWER_LOCAL = "answer"

HELP = (
    "Commands:",
    '  @NAME <payload .../>   send a payload to listener NAME, e.g. @echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>',
    "  TEXT                   send plain text to the default agent (assistant)",
    "  /listeners             list the listeners this console can address",
    "  /describe NAME         the payloads NAME accepts: their fields and an example",
    *APPROVAL_HELP,
    "  /help                  this help",
    "  /quit                  leave the console (end of input does the same)",
)


@dataclass(frozen=True, slots=True)
class Send:
    """Forward ``payload`` to listener ``target``."""

    target: str
    payload: etree._Element


@dataclass(frozen=True, slots=True)
class Say:
    """Answer the console directly with ``lines``."""

    lines: tuple[str, ...]


#: ``/describe NAME``'s source: a listener name → readable lines about what it accepts.
Describe = Callable[[str], tuple[str, ...]]


def parse_command(
    line: str,
    *,
    peers: Mapping[str, tuple[str, ...]],
    default_agent: str | None = DEFAULT_AGENT,
    parser: SafeParser | None = None,
    describe: Describe | None = None,
) -> Send | Say:
    """Decide what one console line means. Pure (no I/O) but for ``describe``, which
    renders the payload types of a listener. ``peers`` maps each addressable listener to
    the root tags it takes (Clark notation), for ``/listeners``."""
    text = line.strip()
    if not text:
        return Say(())
    if text == "/help":
        return Say(HELP)
    if text.split()[0] == "/describe":
        name = text[len("/describe") :].strip().removeprefix("@")
        if not name:
            return Say(("error: write /describe NAME (try /listeners)",))
        if name not in peers:
            return Say(
                (f"error: {name!r} is not a listener this console can address (try /listeners)",)
            )
        if describe is None:
            return Say(("  " + ", ".join(_readable_tag(tag) for tag in peers[name]),))
        return Say(describe(name))
    if text == "/listeners":
        if not peers:
            return Say(("this console cannot address any listener",))
        return Say(
            tuple(
                f"  @{name}: " + ", ".join(_readable_tag(tag) for tag in tags)
                for name, tags in sorted(peers.items())
            )
        )
    approval = parse_approval(text, peers)
    if isinstance(approval, str):
        return Say((approval,))
    if approval is not None:
        return Send(*approval)
    if text.startswith("/"):
        return Say((f"error: unknown command {text.split()[0]} (try /help)",))
    if text.startswith("@"):
        name, _, xml = text[1:].partition(" ")
        xml = xml.strip()
        if not name or not xml:
            return Say(("error: write @NAME <payload .../>",))
        if name not in peers:
            return Say(
                (f"error: {name!r} is not a listener this console can address (try /listeners)",)
            )
        try:
            payload = (parser or SafeParser()).parse(xml.encode("utf-8"))
        except InputRefused as exc:
            return Say((f"error: the payload is not well-formed XML ({exc.detail or exc})",))
        return Send(name, payload)
    if default_agent is None or default_agent not in peers:
        return Say(
            (
                "error: plain text goes to the default agent, and this console has none; "
                "use @NAME <payload .../> (try /listeners)",
            )
        )
    return Send(default_agent, model_tree(Task(text=text)))


def listener_names(lines: list[str] | tuple[str, ...]) -> list[str]:
    """The names in ``/listeners``' answer (lines ``  @NAME: <tag …>``)."""
    return [line.strip()[1:].partition(":")[0] for line in lines if line.strip().startswith("@")]


def _readable_tag(tag: str) -> str:
    qname = etree.QName(tag)
    return f'<{qname.localname} xmlns="{qname.namespace}">' if qname.namespace else f"<{tag}>"


def render_reply(payload: etree._Element, from_id: str) -> tuple[str, ...]:
    """A reply as readable lines: errors by their canned text, payloads as XML."""
    ack = render_ack(payload)
    if ack is not None:
        return ack
    if payload.tag == HUH_TAG:
        return (f"error: {payload.findtext(clark(CORE_NS, 'error'), '').strip()}",)
    if payload.tag == SYSTEM_ERROR_TAG:
        code = payload.findtext(clark(CORE_NS, "code"), "").strip()
        message = payload.findtext(clark(CORE_NS, "message"), "").strip()
        retry = payload.findtext(clark(CORE_NS, "retry-allowed"), "").strip() == "true"
        return (f"error ({code}): {message}" + (" You may retry." if retry else ""),)
    qname = etree.QName(payload)
    if qname.localname == ANSWER_LOCAL and len(payload) == 1 and not len(payload[0]):
        # An agent's <answer><text>…</text></answer> reads best as its text.
        return tuple(f"[{from_id}] {line}" for line in (payload[0].text or "").splitlines() or [""])
    return (f"[{from_id}] " + etree.tostring(payload, encoding="unicode"),)


class ConsoleRouter:
    """Handler of the console router (raw: it takes and relays any payload element)."""

    def __init__(
        self,
        *,
        peers: Mapping[str, tuple[str, ...]],
        reply_wait: float,
        default_agent: str | None = DEFAULT_AGENT,
        max_bytes: int = 1024 * 1024,
        max_pending: int = 1024,
        describe: Describe | None = None,
    ) -> None:
        self._peers = dict(peers)
        self._describe = describe
        self._reply_wait = reply_wait
        self._default_agent = default_agent
        self._parser = SafeParser(max_bytes)
        self._max_pending = max_pending
        # Router thread id → set when that thread's answer has been sent to the console.
        self._pending: dict[str, trio.Event] = {}

    async def __call__(self, payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
        if payload.tag == INPUT_TAG:
            return self._on_input(payload, meta)
        if payload.tag == PENDING_TAG:
            return await self._on_pending(meta)
        return self._on_reply(payload, meta)

    def _on_input(self, payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
        line = model_from_tree(Input, payload).line
        decision = parse_command(
            line,
            peers=self._peers,
            default_agent=self._default_agent,
            parser=self._parser,
            describe=self._describe,
        )
        if isinstance(decision, Say):
            return HandlerResponse.respond(Prompt(lines=list(decision.lines)))
        if len(self._pending) >= self._max_pending:
            return HandlerResponse.respond(
                Prompt(lines=["error: too many console requests waiting; try again later"])
            )
        self._pending[meta.thread_id] = trio.Event()
        return [
            HandlerResponse(decision.payload, to=decision.target),
            HandlerResponse(Pending()),
        ]

    async def _on_pending(self, meta: HandlerMetadata) -> HandlerResult:
        answered = self._pending.get(meta.thread_id)
        if answered is None or not meta.is_self_call:
            return None
        with trio.move_on_after(self._reply_wait):
            await answered.wait()
            return None
        self._pending.pop(meta.thread_id, None)
        return HandlerResponse.respond(
            Prompt(lines=[f"error: no reply within {self._reply_wait:g} s"])
        )

    def _on_reply(self, payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
        answered = self._pending.pop(meta.thread_id, None)
        if answered is None:
            log.info(
                "console router: late or unexpected %s from %s dropped", payload.tag, meta.from_id
            )
            return None
        answered.set()
        return HandlerResponse.respond(Prompt(lines=list(render_reply(payload, meta.from_id))))
