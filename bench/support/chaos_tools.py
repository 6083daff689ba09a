"""The chaos bench's payloads, tools and proofs (bench/chaos.py; docs/reliability.md).

Imported by the server subprocesses and the runner (bench/ is on their PYTHONPATH), by the
bench's scripted model and by the checker. A tool answers with a *proof*: a keyed digest of
the task's nonce that only the tool computes, so an answer that quotes the right proofs
shows that the model saw its own task's tool results (the model only copies them).

Three agents (``alpha``, ``beta``, ``gamma``) take a ``<task>`` each in their own namespace.
Their tools: ``stamp`` (local: a delay and an exception when the call asks for them),
``relay`` (remote, served by ``agentserver runner``) and ``pay`` (local, behind a
``require-approval`` rule).

Every tool run logs its effect, one line ``tool nonce idempotency-key`` appended to the
file ``$CHAOS_EFFECTS`` (all servers and runners share it), so the checker can tell a
call that had its effect twice (bench/support/chaos_check.py ``repeated_effects``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

import trio
from pydantic_xml import BaseXmlModel, attr, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

TOOLS_NS = "urn:chaos:tools"
AGENTS = ("alpha", "beta", "gamma")
TOOL_KINDS = ("stamp", "relay", "pay")
_KEY = b"agentserver-chaos-proof"
#: What a tool's answer carries, and what the scripted model copies into its answer.
PROOF = re.compile(r"PROOF\[(stamp|relay|pay):([0-9a-f]{16}):([0-9a-f]{12})\]")
NONCE = re.compile(r"NONCE\[([0-9a-f]{16})\]")
#: The environment variable naming the effect log.
EFFECTS_ENV = "CHAOS_EFFECTS"


def log_effect(kind: str, nonce: str, key: str) -> None:
    """Append this run's effect to the shared log. One ``write`` on an ``O_APPEND`` file:
    lines from several processes never interleave, and a SIGKILL leaves no half line.
    Blocking, but a local append of a few bytes (no thread hop for it)."""
    path = os.environ.get(EFFECTS_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {nonce} {key or '-'}\n".encode())
    finally:
        os.close(fd)


def read_effects(path: str) -> list[tuple[str, str, str]]:
    """The effect log: (tool, nonce, key); key "" when the call carried none."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [line.split() for line in f]
    except FileNotFoundError:
        return []
    return [(r[0], r[1], "" if r[2] == "-" else r[2]) for r in rows if len(r) == 3]


def proof(kind: str, nonce: str) -> str:
    """The digest a ``kind`` tool answers for ``nonce``."""
    return hmac.new(_KEY, f"{kind}:{nonce}".encode(), hashlib.sha256).hexdigest()[:12]


def proof_text(kind: str, nonce: str) -> str:
    return f"PROOF[{kind}:{nonce}:{proof(kind, nonce)}]"


def agent_ns(agent: str) -> str:
    return f"urn:chaos:{agent}"


class AlphaTask(BaseXmlModel, tag="task", nsmap={"": agent_ns("alpha")}):
    text: str = element()


class AlphaAnswer(BaseXmlModel, tag="answer", nsmap={"": agent_ns("alpha")}):
    text: str = element()
    #: "failed" on a failed answer (docs/agents.md).
    status: str | None = attr(default=None)


class BetaTask(BaseXmlModel, tag="task", nsmap={"": agent_ns("beta")}):
    text: str = element()


class BetaAnswer(BaseXmlModel, tag="answer", nsmap={"": agent_ns("beta")}):
    text: str = element()
    #: "failed" on a failed answer (docs/agents.md).
    status: str | None = attr(default=None)


class GammaTask(BaseXmlModel, tag="task", nsmap={"": agent_ns("gamma")}):
    text: str = element()


class GammaAnswer(BaseXmlModel, tag="answer", nsmap={"": agent_ns("gamma")}):
    text: str = element()
    #: "failed" on a failed answer (docs/agents.md).
    status: str | None = attr(default=None)


TASK_TYPES = {"alpha": AlphaTask, "beta": BetaTask, "gamma": GammaTask}


class Stamp(BaseXmlModel, tag="stamp", nsmap={"": TOOLS_NS}):
    nonce: str = element()
    delay: float = element(default=0.0)
    fail: bool = element(default=False)


class Relay(BaseXmlModel, tag="relay", nsmap={"": TOOLS_NS}):
    nonce: str = element()
    delay: float = element(default=0.0)


class Pay(BaseXmlModel, tag="pay", nsmap={"": TOOLS_NS}):
    nonce: str = element()


class Stamped(BaseXmlModel, tag="stamped", nsmap={"": TOOLS_NS}):
    text: str = element()


class ToolFailure(RuntimeError):
    """The failure a tool call asked for (the scripted model asks, from the seed)."""


async def agent_placeholder(payload: object, meta: HandlerMetadata) -> None:
    """Never called: an agent listener's handler is replaced by the agent runtime."""
    raise AssertionError("agent listeners are run by the agent runtime")


async def stamp(payload: Stamp, meta: HandlerMetadata) -> HandlerResponse:
    """The local tool: waits ``delay`` s, then fails if asked, else answers the proof."""
    if payload.delay > 0:
        await trio.sleep(payload.delay)
    # The effect is done once the delay is over, whether it then fails or answers.
    log_effect("stamp", payload.nonce, meta.idempotency_key)
    if payload.fail:
        raise ToolFailure(f"stamp failed on purpose for {payload.nonce}")
    return HandlerResponse.respond(Stamped(text=proof_text("stamp", payload.nonce)))


async def relay(payload, meta: HandlerMetadata) -> HandlerResponse:
    """The remote tool (run by ``agentserver runner``, handed the raw element)."""
    nonce = payload.findtext(f"{{{TOOLS_NS}}}nonce") or ""
    delay = float(payload.findtext(f"{{{TOOLS_NS}}}delay") or 0)
    if delay > 0:
        await trio.sleep(delay)
    log_effect("relay", nonce, meta.idempotency_key)
    return HandlerResponse.respond(Stamped(text=proof_text("relay", nonce)))


async def pay(payload: Pay, meta: HandlerMetadata) -> HandlerResponse:
    """The governed tool: runs only once its call was approved."""
    log_effect("pay", payload.nonce, meta.idempotency_key)
    return HandlerResponse.respond(Stamped(text=proof_text("pay", payload.nonce)))
