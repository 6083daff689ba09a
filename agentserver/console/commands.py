"""The console's ``/stop AGENT`` and ``/cancel THREAD``: operator commands over the
console's own connection (docs/agents.md, "Stop and cancel from outside").

Kept apart from the console router so the console itself stays unchanged: the remote
console's bridge (:mod:`agentserver.console.remote`) asks :func:`parse_line` first and
relays every other line as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import is_uuid4
from agentserver.net.client import Client, ClientError, RequestTimeout

HELP = (
    "  /stop AGENT            end AGENT's active task (operators only)",
    "  /cancel THREAD         cancel the default agent's task sent on THREAD (operators only)",
)


@dataclass(frozen=True, slots=True)
class OperatorLine:
    verb: str  # stop | cancel
    agent: str
    thread: str | None = None


def parse_line(line: str, *, default_agent: str) -> OperatorLine | str | None:
    """An operator command, an error text for a malformed one, or None (not one). Pure."""
    words = line.split()
    if not words or words[0] not in ("/stop", "/cancel"):
        return None
    if len(words) != 2:
        return f"error: write {words[0]} {'AGENT' if words[0] == '/stop' else 'THREAD'}"
    if words[0] == "/stop":
        return OperatorLine("stop", words[1])
    if not is_uuid4(words[1]):
        return "error: THREAD is the uuid4 the task was sent on"
    return OperatorLine("cancel", default_agent, words[1])


async def carry_out(client: Client, command: OperatorLine, *, reply_timeout: float) -> list[str]:
    """Send the command on the console's connection; its outcome as console lines."""
    el = etree.Element(f"{{{CORE_NS}}}{command.verb}", nsmap={None: CORE_NS})
    el.set("agent", command.agent)
    if command.thread is not None:
        el.set("thread", command.thread)
    try:
        reply = await client.request(el, timeout=reply_timeout)
    except RequestTimeout:
        return [f"error: the server did not answer within {reply_timeout:g} s"]
    except ClientError as exc:
        return [f"error: {exc}"]
    if reply.is_error:
        return [f"error: {command.verb} refused ({reply.error_text}); is this an operator?"]
    count = reply.payload.get("count", "0")
    if count == "0":
        return [f"{command.verb}: nothing to {command.verb} for {command.agent}"]
    return [f"{command.verb}: {count} task(s) of {command.agent} ended"]
