"""Tools and guardrails of the governance tests (tests/test_agents_governance.py).

Imported by the server subprocess (tests/ is on its PYTHONPATH) and by the tests. The
``ledger`` tool appends one line per invocation to the file named by ``GOV_LEDGER``, so a
test can see whether the server's handler ran at all (it runs in another process).
"""

from __future__ import annotations

import os

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.agents.policy.guardrails import Block, GuardCall, Halt, Warn
from agentserver.core.listener import HandlerMetadata, HandlerResponse

NS = "urn:test:gov"


class Pay(BaseXmlModel, tag="pay", nsmap={"": NS}):
    to: str = element()
    amount: str = element()


class Paid(BaseXmlModel, tag="paid", nsmap={"": NS}):
    text: str = element()


async def ledger(payload: Pay, meta: HandlerMetadata) -> HandlerResponse:
    path = os.environ.get("GOV_LEDGER")
    if path:
        async with await trio.open_file(path, "a", encoding="utf-8") as f:
            await f.write(f"{payload.to} {payload.amount}\n")
    return HandlerResponse.respond(Paid(text=f"paid {payload.amount} to {payload.to}"))


def halt_on_mallory(call: GuardCall) -> object:
    """Before: halts the Turn on a payment to mallory, blocks one to eve."""
    if "<to>mallory</to>" in call.payload:
        return Halt("payments to mallory are forbidden")
    if "<to>eve</to>" in call.payload:
        return Block("eve is not a payee")
    return None


async def note_big_results(call: GuardCall) -> object:
    """After (async): warns on a result mentioning 1000, blocks one mentioning 666."""
    if call.result and "666" in call.result:
        return Block("that result is not to be shown")
    if call.result and "1000" in call.result:
        return Warn("Note: that was a large payment.")
    return None


def broken(call: GuardCall) -> object:
    raise RuntimeError("this guardrail is broken")
