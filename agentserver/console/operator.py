"""Stop and cancel agents' tasks from outside the process (``agentserver stop``/``cancel``).

An operator connection (a client declared ``operator="true"``, or any anonymous loopback
connection when no clients are declared) may send the core commands below on any task;
any other declared client on its own tasks only (the authorization rule,
:mod:`agentserver.core.access`: another's answers ``count="0"``, as a missing task's)

- ``<stop agent="A" [thread="T"]/>``: end A's active Turn (only if it is the task sent on
  thread T, when given) with one failed ("stopped") answer to its sender; its steps in
  progress on remote listeners are cancelled (their runners get ``<cancel>``);
- ``<cancel agent="A" thread="T"/>``: the task sent on T: if queued, it is skipped
  (``queued → skipped``) and its sender gets one failed ("cancelled") answer; if it is the
  active Turn, it is stopped as above.

The server answers each on the command's thread with ``<outcome command= agent= count=/>``
(count 0: nothing matched) or a ``<huh>`` for a bad command (unknown agent, a thread
missing on cancel). The commands never reach the pump.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from lxml import etree

from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.store.sql import replies as sql_replies
from agentserver.agents.store.sql import views
from agentserver.agents.turn.answer import answer_bytes
from agentserver.core.access import AccessRule
from agentserver.core.envelope import MESSAGE, encode
from agentserver.core.errors import HuhReason, InputRefused
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_tree
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.primitives.core import Outcome, huh
from agentserver.remote.hub import RunnerHub

log = logging.getLogger("agentserver.operator")

_C = f"{{{CORE_NS}}}"
STOP = _C + "stop"
CANCEL = _C + "cancel"
_MARK = CORE_NS.encode()


@dataclass(frozen=True, slots=True)
class Command:
    """A parsed operator command."""

    verb: str  # stop | cancel
    agent: str
    thread: str | None
    reply_thread: str


def parse_command(root: etree._Element) -> Command | None:
    """The operator command in a parsed envelope, None if it carries none (then it is an
    ordinary request). Raises :class:`InputRefused` for a malformed command. Pure."""
    if root.tag != MESSAGE or len(root) != 2 or root[1].tag not in (STOP, CANCEL):
        return None
    el = root[1]
    verb = "stop" if el.tag == STOP else "cancel"
    agent = el.get("agent")
    thread = el.get("thread")
    if not agent or len(root[0]) < 2 or (verb == "cancel" and not thread):
        raise InputRefused(HuhReason.INVALID_PAYLOAD, f"{verb} needs agent (and thread)")
    reply_thread = (root[0][-1].text or "").strip() or new_thread_id()
    return Command(verb, agent, thread, reply_thread[:128])


class CallerCalls(Protocol):
    """Calls in flight that a stop of their caller cancels (the remote A2A agents':
    :class:`agentserver.remote.a2a_client.A2aRemotes`)."""

    def cancel_caller(self, caller: str) -> int: ...


class Operator:
    """Carries out operator commands on the agent runtime and the runner hub."""

    def __init__(
        self,
        runtime: AgentRuntime | None,
        hub: RunnerHub | None,
        *,
        max_message_bytes: int,
        remote_calls: CallerCalls | None = None,
        access: AccessRule | None = None,
    ) -> None:
        self.runtime = runtime
        self.hub = hub
        self.remote_calls = remote_calls
        #: The authorization rule for a non-operator client's commands (None: only
        #: operators' commands are carried out).
        self.access = access
        self._parser = SafeParser(max_message_bytes)

    @staticmethod
    def may_be_command(frame: bytes) -> bool:
        """Cheap pre-check, so ordinary requests are not parsed twice."""
        return _MARK in frame and (b"stop" in frame or b"cancel" in frame)

    async def handle(
        self, frame: bytes, sender: str, client: str | None = None, *, operator: bool = True
    ) -> bytes | None:
        """The reply body if ``frame`` is an operator command (carried out now), else
        None (an ordinary request). A non-``operator`` ``client`` stops and cancels only
        its own tasks (the authorization rule): another's, and a ``stop`` naming no
        thread, answer ``count="0"`` exactly as a task that does not exist."""
        try:
            command = parse_command(self._parser.parse(frame))
        except InputRefused as refusal:
            return encode("system", sender, new_thread_id(), huh(refusal.reason, frame))
        if command is None:
            return None
        runtime = self.runtime
        if runtime is None or command.agent not in runtime.profiles:
            log.info("operator %s: %s of unknown agent %r", sender, command.verb, command.agent)
            unknown = huh(HuhReason.INVALID_PAYLOAD, frame)
            return encode("system", sender, command.reply_thread, unknown)
        if not operator and not await self._owns(runtime, command, client):
            count = 0
        elif command.verb == "stop":
            count = await self.stop(runtime, command.agent, command.thread)
        else:
            count = await self.cancel(runtime, command.agent, command.thread or "")
        log.warning(
            "operator %s: %s %s%s: %d task(s)",
            sender,
            command.verb,
            command.agent,
            f" thread {command.thread}" if command.thread else "",
            count,
        )
        outcome = Outcome(command=command.verb, agent=command.agent, count=count)
        return encode("system", sender, command.reply_thread, model_tree(outcome))

    async def _owns(self, runtime: AgentRuntime, command: Command, client: str | None) -> bool:
        """Whether non-operator ``client`` may carry out ``command``: the task on its
        thread exists and is its own. A refusal is counted and logged."""
        rule = self.access
        if rule is None or command.thread is None:
            if rule is not None:
                rule.refuse(client, "socket", command.verb)
            return False
        # The latest task on the thread (what stop and cancel act on) must be the client's.
        found, owner = await runtime.store.read(views.task_sender, command.agent, command.thread)
        return found and rule.allows(client, owner, door="socket", route=command.verb)

    async def stop(self, runtime: AgentRuntime, agent: str, thread: str | None) -> int:
        turn = None
        if thread is not None:
            turn = await runtime.store.read(sql_replies.turn_of_thread, agent, thread)
            if turn is None:
                return 0
        if not await runtime.stop(agent, turn):
            return 0
        if self.hub is not None:
            # One active Turn per agent: every step the agent has in progress is its.
            self.hub.cancel_caller(agent)
        if self.remote_calls is not None:
            self.remote_calls.cancel_caller(agent)
        return 1

    async def cancel(self, runtime: AgentRuntime, agent: str, thread: str) -> int:
        profile = runtime.profiles[agent]
        failed = answer_bytes(profile, "the task was cancelled", failed=True)
        replies = await runtime.store.run(sql_replies.cancel_queued, agent, thread, failed)
        for reply in replies:
            await runtime.ender.resend(reply)
        if replies:
            return len(replies)
        return await self.stop(runtime, agent, thread)
