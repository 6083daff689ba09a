"""Two governed agents in one organism (issue 25, item 3).

Both ``assistant`` and ``planner`` have a ``require-approval`` rule on ``ledger`` with
``alice`` as approver. The boot.xml passes the loader's checks (before the fix: "root tag
... approval-decision is accepted by assistant, planner"), and each agent's decision
(the planner's denied, the assistant's granted) settles its own call however it is
addressed: to the agent the request names, by root tag alone (that goes to the first
governed agent, also for the planner's request: the request id names the agent that
asked), or with the console's ``/deny`` and ``/approve``. Run in process (``run_server``) on each store; on PostgreSQL also with the approver connected
to a second server on the same store.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from agents_crash_support import PLANNER_NS, PlanTask
from cliutil import cli_in_process
from governance_support import NS as GOV_NS
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverutil import InProcess, start_in_process

from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.config.topology import Topology
from agentserver.core.errors import ConfigurationError, DeliveryRefused, InputRefused
from agentserver.core.routing import RoutingTable, SelfCall
from agentserver.listeners.assistant import NS as ASSISTANT_NS
from agentserver.listeners.assistant import Task
from agentserver.listeners.console import NS as CONSOLE_NS
from agentserver.listeners.console import Input
from agentserver.net.client import Client, approval_ack_status, approval_request, open_client
from agentserver.primitives.approval import DECISION_TAG, ApprovalDecision

PATIENCE = 30.0
ENV = {"TG_ALICE": "alice-token", "TG_BOB": "bob-token", "TG_LLM_KEY": "k"}
RULE = """
      <policy default="allow">
        <rule priority="1" id="payments" decision="require-approval" target="ledger"
              approver="alice" timeout="10m"/>
      </policy>"""


def boot_xml(store: str, base_url: str) -> bytes:
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="governed-pair">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <clients>
    <client name="alice" token-env="TG_ALICE"/>
    <client name="bob" token-env="TG_BOB"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="{base_url}" api-key-env="TG_LLM_KEY"
             timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  {store}
  <listeners>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="console-router" handler="console-router" peers="assistant planner"/>
    <listener name="assistant" handler="assistant" agent="true" peers="ledger">
      <agent model="m" max-steps="6"/>{RULE}
    </listener>
    <listener name="planner" handler="agents_crash_support:agent_placeholder" agent="true"
              peers="ledger">
      <accepts type="agents_crash_support:PlanTask"/>
      <responds type="agents_crash_support:PlanAnswer"/>
      <agent model="m" max-steps="6"/>{RULE}
    </listener>
  </listeners>
</organism>""".encode()


class PayingModel(FakeServer):
    """Pays the payee its task names; once it has seen the ledger's receipt (or the
    denial), says so."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        said = "\n".join(
            str(m.get("content", "")) for m in seen.body["messages"] if m["role"] == "user"
        )
        found = re.search(r"please pay (\w+) (\d+) now", said)
        assert found is not None, said
        payee, amount = found.groups()
        if f"paid {amount} to {payee}" in said:
            return openai_ok(f"Paid {payee}.", model="m")
        if "was denied by" in said:
            return openai_ok(f"Not paid {payee}.", model="m")
        pay = f'<pay xmlns="{GOV_NS}"><to>{payee}</to><amount>{amount}</amount></pay>'
        return openai_ok(f"Paying. {pay}", model="m")


def load(xml: bytes) -> Topology:
    result = boot.load_bytes(xml, environ=ENV)
    assert result.errors == [], [str(p) for p in result.errors]
    assert result.topology is not None
    return result.topology


def test_two_governed_agents_pass_check_and_take_decisions_by_name(tmp_path):
    xml = boot_xml('<store path="state/agents.sqlite3"/>', "http://127.0.0.1:9/v1")
    (tmp_path / "boot.xml").write_bytes(xml)
    checked = cli_in_process("check", str(tmp_path / "boot.xml"), env={**os.environ, **ENV})
    assert checked.returncode == 0, checked.stderr.decode()
    assert b"approval-decision" not in checked.stderr
    topology = load(xml)
    assistant, planner = topology.listener("assistant"), topology.listener("planner")
    assert ApprovalDecision in assistant.accepts and ApprovalDecision in planner.accepts
    # The first governed agent claims the root tag; the other takes decisions by name.
    assert ApprovalDecision not in assistant.addressed_only
    assert planner.addressed_only == (ApprovalDecision,)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f'<store path="{tmp_path / "agents.sqlite3"}" watchdog-interval="0.2"/>'
    url = request.getfixturevalue("pg_url")
    return f'<store url="{url}" watchdog-interval="0.2"/>'


@contextlib.asynccontextmanager
async def serving(topology: Topology, count: int) -> AsyncIterator[list[InProcess]]:
    """``count`` servers on ``topology`` (one store); leaving shuts them down and waits
    until they have stopped."""
    servers: list[InProcess] = []
    async with trio.open_nursery() as nursery:
        try:
            for _ in range(count):
                ctx = RunContext(topology)
                servers.append(await start_in_process(nursery, topology, ctx, environ=ENV))
            yield servers
        finally:
            for server in servers:
                server.shutdown.set()


def connect(server: InProcess, name: str):
    return open_client("127.0.0.1", server.port, client=name, token=f"{name}-token")


async def decide(how: str, alice: Client, request: dict[str, str], grant: bool) -> str:
    """Grant or deny ``request`` as ``how`` says; the status its acknowledgement gives."""
    if how == "console":
        word = "/approve" if grant else "/deny"
        reply = await alice.request(
            Input(line=f"{word} {request['request']}"), to="console-router", timeout=PATIENCE
        )
        (line,) = [e.text or "" for e in reply.payload.iter(f"{{{CONSOLE_NS}}}line")]
        return line.removeprefix(f"approval {request['request']}: ")
    decision = ApprovalDecision(request=request["request"], grant=grant, reason="ok")
    to = request["agent"] if how == "to-agent" else None
    reply = await alice.request(decision, to=to, timeout=PATIENCE)
    assert reply.payload.tag != DECISION_TAG
    return approval_ack_status(reply) or reply.raw.decode()


@pytest.mark.parametrize("how", ["to-agent", "root-tag", "console"])
@pytest.mark.parametrize("servers", [1, 2])
async def test_each_governed_agent_gets_its_own_decision(
    store, how, servers, tmp_path: Path, monkeypatch
):
    if servers == 2 and "url=" not in store:
        pytest.skip("two servers share a PostgreSQL store only")
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("GOV_LEDGER", str(ledger))  # the ledger tool runs in this process
    async with trio.open_nursery() as nursery:
        model = await PayingModel().start(nursery)
        topology = load(boot_xml(store, model.base_url))
        async with serving(topology, servers) as running:
            async with connect(running[0], "bob") as bob, connect(running[-1], "alice") as alice:
                sent = {
                    "assistant": await bob.send(Task(text="please pay bob 5 now"), to="assistant"),
                    "planner": await bob.send(
                        PlanTask(text="please pay carol 7 now"), to="planner"
                    ),
                }
                requests: dict[str, dict[str, str]] = {}
                with trio.fail_after(PATIENCE):
                    while len(requests) < 2:
                        request = approval_request(await alice.receive())
                        if request is not None:
                            requests[request["agent"]] = request
                assert "<to>bob</to>" in requests["assistant"]["payload"]
                assert "<to>carol</to>" in requests["planner"]["payload"]
                # The planner's is denied, first: by root tag it reaches the assistant
                # listener, and still settles the planner's call; the assistant's is granted.
                statuses = [
                    await decide(how, alice, requests["planner"], grant=False),
                    await decide(how, alice, requests["assistant"], grant=True),
                ]
                applied = "decision applied" if how == "console" else "applied"
                assert statuses == [applied, applied]
                answers = {}
                with trio.fail_after(PATIENCE):
                    while len(answers) < 2:
                        reply = await bob.receive()
                        text = "".join(reply.payload.itertext()).strip()
                        answers[reply.thread] = (reply.payload.tag, text)
        nursery.cancel_scope.cancel()
    assert answers == {
        sent["assistant"]: (f"{{{ASSISTANT_NS}}}answer", "Paid bob."),
        sent["planner"]: (f"{{{PLANNER_NS}}}answer", "Not paid carol."),
    }
    assert ledger.read_text().splitlines() == ["bob 5"]  # once, and only the granted call


def test_a_tag_taken_by_name_only_is_not_claimed():
    """The routing of ``addressed_only`` (the pump's table, pure)."""
    from agentserver.core.listener import Listener
    from agentserver.core.payloads import PayloadType

    async def nothing(payload, meta):
        return None

    tag_of = {m: PayloadType.from_model(m) for m in (Task, PlanTask, ApprovalDecision)}
    by_name = (ApprovalDecision,)
    listeners = [
        Listener("a", (Task, ApprovalDecision), nothing, addressed_only=by_name),
        Listener("b", (PlanTask, ApprovalDecision), nothing, addressed_only=by_name),
    ]
    table = RoutingTable(listeners, tag_of)  # no "accepted by a, b" error
    assert table.inbound(DECISION_TAG, "a") == ("a",)
    assert table.inbound(DECISION_TAG, "b") == ("b",)
    with pytest.raises(InputRefused):
        table.inbound(DECISION_TAG, None)  # nobody claims it
    # By name, its own tag is a self-call; with no name, it is routed like any other.
    assert isinstance(table.outbound("a", DECISION_TAG, "a"), SelfCall)
    with pytest.raises(InputRefused):
        table.outbound("a", DECISION_TAG, None)  # nobody claims it
    claimant = Listener("c", (ApprovalDecision,), nothing)
    table = RoutingTable([*listeners, claimant], tag_of)
    assert table.inbound(DECISION_TAG, None) == ("c",)
    with pytest.raises(DeliveryRefused):
        table.outbound("a", DECISION_TAG, None)  # c is not among a's peers
    with pytest.raises(ConfigurationError, match="addressed_only"):
        Listener("d", (Task,), nothing, addressed_only=by_name)
