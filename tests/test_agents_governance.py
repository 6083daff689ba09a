"""Governing what agents do (issue 14), end to end: the real server as a subprocess, the
scripted OpenAI-compatible model on loopback, and the tests' own tool (``ledger``,
tests/governance_support.py) whose every invocation is written to a file.

Each test writes its boot.xml (the agent's ``<policy>`` and ``<guardrail>``s), scripts the
model's replies in order, sends one task and checks the answer, what the model saw, what
the tool did and what the store's step log recorded.
"""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import trio
from governance_support import NS as GOV_NS
from llm_fakes import FakeServer, openai_ok
from serverproc import ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import NS as ASSISTANT_NS
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

CALC = "urn:agentserver:calculator"
PATIENCE = 30.0

BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="gov">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="GOV_LLM_BASE_URL" api-key-env="GOV_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator ledger">
      <agent model="m" {agent_attrs}/>
{governance}
    </listener>
  </listeners>
</organism>
"""


def pay(to: str, amount: str) -> str:
    return f'<pay xmlns="{GOV_NS}"><to>{to}</to><amount>{amount}</amount></pay>'


def calc(op: str, a: str, b: str) -> str:
    return f'<{op} xmlns="{CALC}"><a>{a}</a><b>{b}</b></{op}>'


class Run:
    """One server with one boot.xml, its model script, and what happened."""

    def __init__(self, tmp_path: Path, governance: str, agent_attrs: str = 'max-steps="8"'):
        self.dir = tmp_path
        self.boot = tmp_path / "boot.xml"
        self.boot.write_text(
            BOOT.format(governance=textwrap.indent(governance, "      "), agent_attrs=agent_attrs)
        )
        self.ledger = tmp_path / "ledger.txt"
        self.model = FakeServer("openai")
        self.server: ServerProcess | None = None

    def script(self, *contents: str) -> None:
        self.model.push(*(openai_ok(c, model="m") for c in contents))

    async def start(self, nursery: trio.Nursery) -> None:
        await self.model.start(nursery)
        env = subprocess_env(
            GOV_LLM_BASE_URL=self.model.base_url, GOV_LLM_KEY="k", GOV_LEDGER=str(self.ledger)
        )
        self.server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(self.boot, env=env, cwd=self.dir)
        )

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    async def ask(self, text: str = "do the task") -> tuple[str, bool]:
        """Send one task; return the answer's text and whether it is marked failed."""
        assert self.server is not None
        async with open_client(self.server.host, self.server.port) as client:
            await client.send(Task(text=text), to="assistant", thread=new_thread_id())
            with trio.fail_after(PATIENCE):
                reply = await client.receive()
        assert reply.payload.tag == f"{{{ASSISTANT_NS}}}answer", reply.raw
        answer = reply.payload.findtext(f"{{{ASSISTANT_NS}}}text") or ""
        return answer, reply.payload.get("status") == "failed"

    def seen(self, request: int) -> list[str]:
        """The user-side messages of the model's ``request``-th call (0-based)."""
        body = self.model.requests[request].body
        return [m["content"] for m in body["messages"] if m["role"] == "user"]

    def paid(self) -> list[str]:
        return self.ledger.read_text().splitlines() if self.ledger.exists() else []

    def rows(self, sql: str) -> list[tuple]:
        conn = sqlite3.connect(f"file:{self.dir / 'state' / 'agents.sqlite3'}?mode=ro", uri=True)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()

    def decisions(self) -> list[tuple[str, str, str]]:
        return self.rows("SELECT target, decision, rule FROM policy_decisions ORDER BY seq")


async def run(tmp_path, governance, *script, agent_attrs='max-steps="8"', text="do the task"):
    r = Run(tmp_path, governance, agent_attrs)
    r.script(*script)
    async with trio.open_nursery() as nursery:
        try:
            await r.start(nursery)
            answer = await r.ask(text)
        finally:
            r.stop()
            nursery.cancel_scope.cancel()
    return r, answer


async def test_default_deny_refuses_a_call_no_rule_allows_and_the_turn_goes_on(tmp_path):
    policy = """\
<policy default="deny">
  <rule priority="10" id="calc-ok" decision="allow" target="calculator"/>
</policy>"""
    r, (answer, failed) = await run(
        tmp_path, policy, f"Paying. {pay('bob', '5')}", "I could not pay bob."
    )
    assert (answer, failed) == ("I could not pay bob.", False)
    assert r.paid() == []  # the ledger's handler never ran
    refusal = r.seen(1)[-1]
    assert refusal.startswith("Tool call to ledger failed:") and "default" in refusal
    assert r.decisions() == [("ledger", "deny", "default")]
    steps = r.rows("SELECT metadata FROM agent_steps ORDER BY step_no")
    assert json.loads(steps[0][0])["policy"] == [
        {"target": "ledger", "decision": "deny", "rule": "default"}
    ]


async def test_divide_by_zero_is_denied_while_other_calculator_calls_go_through(tmp_path):
    policy = """\
<policy default="allow">
  <rule priority="1" id="no-div-zero" decision="deny" payload="divide">
    <arg path="b" equals="0"/>
  </rule>
</policy>"""
    r, (answer, failed) = await run(
        tmp_path,
        policy,
        f"Two at once. {calc('divide', '6', '0')} {calc('add', '6', '1')}",
        f"Then {calc('divide', '6', '3')}",
        "Done: 7 and 2.",
    )
    assert (answer, failed) == ("Done: 7 and 2.", False)
    second = "\n".join(r.seen(1))
    assert "refused by the policy (rule no-div-zero: deny)" in second
    assert "<value>7</value>" in second
    assert "<value>2</value>" in "\n".join(r.seen(2))
    assert r.decisions() == [
        ("calculator", "deny", "no-div-zero"),
        ("calculator", "allow", "default"),
        ("calculator", "allow", "default"),
    ]


async def test_priority_decides_between_overlapping_rules_both_ways(tmp_path):
    for first, second, paid in (("allow", "deny", ["bob 5"]), ("deny", "allow", [])):
        where = tmp_path / first
        where.mkdir()
        policy = f"""\
<policy default="deny">
  <rule priority="20" id="late" decision="{second}" target="ledger"/>
  <rule priority="10" id="early" decision="{first}" payload="pay"/>
</policy>"""
        r, (answer, _) = await run(where, policy, pay("bob", "5"), "over")
        assert answer == "over"
        assert r.paid() == paid, first
        assert r.decisions() == [("ledger", first, "early")]


async def test_a_rate_limit_refuses_the_call_past_the_window(tmp_path):
    policy = """\
<policy default="deny">
  <rule priority="1" id="three-a-minute" decision="allow" target="ledger" rate="3/60s"/>
</policy>"""
    r, (answer, _) = await run(
        tmp_path,
        policy,
        f"{pay('a', '1')} {pay('b', '2')} {pay('c', '3')} {pay('d', '4')}",
        "three paid",
    )
    assert answer == "three paid"
    assert sorted(r.paid()) == ["a 1", "b 2", "c 3"]  # the tool runs them concurrently
    assert "rate limit of 3 per 60 s (turn) reached" in "\n".join(r.seen(1))
    assert [d[1] for d in r.decisions()] == ["allow", "allow", "allow", "deny"]


async def test_six_identical_calls_warn_from_the_second_and_block_from_the_fifth(tmp_path):
    same = calc("add", "2", "2")
    r, (answer, _) = await run(tmp_path, "", *([same] * 6), "4", agent_attrs='max-steps="10"')
    assert answer == "4"
    results = [r.seen(i)[-1] for i in range(1, 7)]
    assert "Warning" not in results[0] and "<value>4</value>" in results[0]
    for n in (2, 3, 4):
        assert f"this is call {n} to calculator with the same payload" in results[n - 1]
        assert "<value>4</value>" in results[n - 1]
    for n in (5, 6):
        assert results[n - 1].startswith("Tool call to calculator failed:")
        assert f"loop detected: this is call {n}" in results[n - 1]
    assert [d[1:] for d in r.decisions()][4:] == [("blocked", "loop-block")] * 2


async def test_a_halting_guardrail_ends_the_turn_with_one_failed_answer(tmp_path):
    guards = '<guardrail when="before" handler="governance_support:halt_on_mallory"/>'
    r, (answer, failed) = await run(
        tmp_path, guards, f"{pay('bob', '1')} {pay('mallory', '2')}", "never asked"
    )
    assert failed and answer == "halted: payments to mallory are forbidden"
    assert r.paid() == []  # nothing of the halted step was sent
    assert len(r.model.requests) == 1
    assert r.rows("SELECT count(*) FROM cards WHERE card_type = 'task.deliverable'") == [(1,)]
    assert r.rows("SELECT count(*) FROM execution_edges WHERE primitive = 'deliver'") == [(1,)]


async def test_guardrails_block_warn_and_a_raising_one_counts_as_allow(tmp_path):
    guards = "\n".join(
        [
            '<guardrail when="before" handler="governance_support:halt_on_mallory"/>',
            '<guardrail when="before" handler="governance_support:broken"/>',
            '<guardrail when="after" handler="governance_support:note_big_results"/>',
        ]
    )
    r, (answer, failed) = await run(
        tmp_path,
        guards,
        f"{pay('eve', '1')} {pay('bob', '1000')} {pay('carol', '666')}",
        "done",
    )
    assert (answer, failed) == ("done", False)
    assert sorted(r.paid()) == ["bob 1000", "carol 666"]
    seen = r.seen(1)
    assert any(m == "Tool call to ledger failed:\nblocked: eve is not a payee" for m in seen)
    bob = next(m for m in seen if "paid 1000 to bob" in m)
    assert bob.endswith("Note: that was a large payment.")
    assert "Tool call to ledger failed:\nblocked: that result is not to be shown" in seen
    assert not any("paid 666" in m for m in seen)
    assert r.server is not None
    assert r.server.stderr.count("guardrail governance_support:broken raised RuntimeError") == 1


async def test_the_last_step_asks_for_an_answer_and_the_limit_keeps_the_last_words(tmp_path):
    r, (answer, failed) = await run(
        tmp_path,
        "",
        calc("add", "1", "1"),
        f"Almost there, the sum so far is 2. {calc('add', '2', '1')}",
        agent_attrs='max-steps="2"',
    )
    assert failed
    assert answer.startswith("step limit reached (2 steps) without an answer")
    assert "Almost there, the sum so far is 2." in answer
    assert "This is your last step" not in "\n".join(r.seen(0))
    assert r.seen(1)[-1].startswith("This is your last step")


# -- human approval ------------------------------------------------------------------------

APPROVAL_BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="gov">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <clients>
    <client name="alice" token-env="GOV_ALICE_TOKEN"/>
    <client name="bob" token-env="GOV_BOB_TOKEN"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="GOV_LLM_BASE_URL" api-key-env="GOV_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"/>
  <listeners>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="console-router" handler="console-router" peers="assistant"/>
    <listener name="assistant" handler="assistant" agent="true" peers="ledger">
      <agent model="m" max-steps="6"/>
      <policy default="allow">
        <rule priority="1" id="quick" decision="require-approval" target="ledger"
              approver="alice" timeout="1s"><arg path="to" equals="carol"/></rule>
        <rule priority="2" id="payments" decision="require-approval" target="ledger"
              approver="alice" timeout="10m"/>
      </policy>
    </listener>
  </listeners>
</organism>
"""


class ApprovalRun(Run):
    def __init__(self, tmp_path: Path):
        super().__init__(tmp_path, "")
        self.boot.write_text(APPROVAL_BOOT)
        self.env: dict[str, str] = {}

    async def start(self, nursery: trio.Nursery) -> None:
        if self.model.port is None:
            await self.model.start(nursery)
        self.env = subprocess_env(
            GOV_LLM_BASE_URL=self.model.base_url,
            GOV_LLM_KEY="k",
            GOV_LEDGER=str(self.ledger),
            GOV_ALICE_TOKEN="alice-token",
            GOV_BOB_TOKEN="bob-token",
        )
        self.server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(self.boot, env=self.env, cwd=self.dir)
        )

    def client(self, name: str):
        assert self.server is not None
        return open_client(self.server.host, self.server.port, client=name, token=f"{name}-token")

    async def until(self, predicate, what: str) -> None:
        # Another process writes the store: poll it (bounded).
        with trio.move_on_after(PATIENCE):
            while True:
                if predicate():
                    return
                await trio.sleep(0.05)
        raise AssertionError(f"timed out waiting until {what}")

    def approvals(self) -> list[tuple[str, str]]:
        return self.rows("SELECT target, status FROM approvals ORDER BY created_at")


async def test_approval_survives_sigkill_reaches_the_approver_on_reconnect_and_forwards_once(
    tmp_path,
):
    from agentserver.net.client import approval_ack_status, approval_request

    r = ApprovalRun(tmp_path)
    r.script(f"Paying. {pay('bob', '5')}", "Paid bob.")
    async with trio.open_nursery() as nursery:
        try:
            await r.start(nursery)
            async with r.client("bob") as bob:
                thread = await bob.send(Task(text="pay bob 5"), to="assistant")
                # alice (the approver) is away: the call waits, durably.
                await r.until(lambda: r.approvals() == [("ledger", "pending")], "pending")
                # SIGKILL with the request pending.
                await trio.to_thread.run_sync(r.server.proc.kill)
                await trio.to_thread.run_sync(r.server.wait_exit, 10)
            await r.start(nursery)
            assert r.approvals() == [("ledger", "pending")]
            assert r.paid() == []
            async with r.client("alice") as alice:
                with trio.fail_after(PATIENCE):
                    request = approval_request(await alice.receive())
                assert request is not None and request["target"] == "ledger"
                assert request["rule"] == "payments" and "<to>bob</to>" in request["payload"]
                assert request["agent"] == "assistant"
                ack = await alice.decide_approval("assistant", request["request"], True, "ok")
                with trio.fail_after(PATIENCE):
                    reply = await alice.receive()
                assert reply.thread == ack and approval_ack_status(reply) == "applied"
                # A second decision is acknowledged and changes nothing.
                await alice.decide_approval("assistant", request["request"], False, "oops")
                with trio.fail_after(PATIENCE):
                    assert approval_ack_status(await alice.receive()) == "duplicate"
            async with r.client("bob") as bob:
                with trio.fail_after(PATIENCE):
                    answer = await bob.receive()
            assert answer.thread == thread
            assert answer.payload.findtext(f"{{{ASSISTANT_NS}}}text") == "Paid bob."
            assert r.paid() == ["bob 5"]  # forwarded exactly once
            assert r.approvals() == [("ledger", "forwarded")]
            assert "Result from ledger:" in "\n".join(r.seen(1))
        finally:
            r.stop()
            nursery.cancel_scope.cancel()


async def test_a_denied_and_a_timed_out_approval_become_refusals(tmp_path):
    from agentserver.net.client import approval_request

    r = ApprovalRun(tmp_path)
    r.script(f"{pay('carol', '1')} {pay('dave', '2')}", "Neither was paid.")
    async with trio.open_nursery() as nursery:
        try:
            await r.start(nursery)
            async with r.client("alice") as alice, r.client("bob") as bob:
                await bob.send(Task(text="pay carol and dave"), to="assistant")
                requests = []
                with trio.fail_after(PATIENCE):
                    while len(requests) < 2:
                        requests.append(approval_request(await alice.receive()))
                dave = next(q for q in requests if "<to>dave</to>" in q["payload"])
                # carol's request (timeout 1 s) is left to time out; dave's is denied.
                await alice.decide_approval("assistant", dave["request"], False, "not today")
                with trio.fail_after(PATIENCE):
                    answer = await bob.receive()
                    while answer.payload.tag != f"{{{ASSISTANT_NS}}}answer":
                        answer = await bob.receive()
            assert answer.payload.findtext(f"{{{ASSISTANT_NS}}}text") == "Neither was paid."
            assert r.paid() == []
            seen = "\n".join(r.seen(1))
            assert "denied by alice: not today; it was not sent" in seen
            assert "got no decision from alice within 1 s" in seen
            assert sorted(r.approvals()) == [("ledger", "denied"), ("ledger", "timed_out")]
        finally:
            r.stop()
            nursery.cancel_scope.cancel()


async def test_the_operator_decides_at_the_console_with_approve_and_deny(tmp_path):
    from agentserver.listeners.console import NS as CONSOLE_NS
    from agentserver.listeners.console import Input

    r = ApprovalRun(tmp_path)
    r.script(f"Paying. {pay('erin', '3')}", "Erin was not paid.")

    async def console(client, line: str) -> list[str]:
        reply = await client.request(Input(line=line), to="console-router", timeout=PATIENCE)
        return [e.text or "" for e in reply.payload.iter(f"{{{CONSOLE_NS}}}line")]

    async with trio.open_nursery() as nursery:
        try:
            await r.start(nursery)
            async with r.client("bob") as bob:
                await bob.send(Task(text="pay erin"), to="assistant")
                await r.until(lambda: r.approvals() == [("ledger", "pending")], "pending")
                (request_id,) = r.rows("SELECT request_id FROM approvals")[0]
                assert "/approve ID" in "\n".join(await console(bob, "/help"))
                assert await console(bob, "/deny") == ["error: write /deny ID [REASON]"]
                assert await console(bob, "/approve nope") == ["approval nope: no such request"]
                assert await console(bob, f"/deny {request_id} not erin") == [
                    f"approval {request_id}: decision applied"
                ]
                assert await console(bob, f"/approve {request_id}") == [
                    f"approval {request_id}: already decided (or timed out); nothing changed"
                ]
                with trio.fail_after(PATIENCE):
                    answer = await bob.receive()
                    while answer.payload.tag != f"{{{ASSISTANT_NS}}}answer":
                        answer = await bob.receive()
            assert answer.payload.findtext(f"{{{ASSISTANT_NS}}}text") == "Erin was not paid."
            assert r.paid() == []
            assert "denied by the operator: not erin" in "\n".join(r.seen(1))
        finally:
            r.stop()
            nursery.cancel_scope.cancel()


class ApproverTerminal:
    """The approver at ``agentserver console``: waits until an approval request is shown,
    types ``/approve ID`` from that line, then leaves."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.shown = trio.Event()
        self.typed: list[str] = []

    async def read_line(self, prompt: str):
        if self.typed:
            return None
        with trio.fail_after(PATIENCE):
            await self.shown.wait()
        line = next(line for line in self.out if line.startswith("approval request "))
        self.typed.append(line.split(": ", 1)[0].replace("approval request", "/approve"))
        return self.typed[-1]

    def write(self, text: str) -> None:
        self.out.append(text)
        if text.startswith("approval request "):
            self.shown.set()


async def test_the_console_shows_a_request_as_it_arrives_and_approve_settles_it(tmp_path):
    from agentserver.console.remote import run_remote_console

    r = ApprovalRun(tmp_path)
    r.script(f"Paying. {pay('erin', '3')}", "Erin is paid.")
    async with trio.open_nursery() as nursery:
        try:
            await r.start(nursery)
            async with r.client("bob") as bob:
                await bob.send(Task(text="pay erin"), to="assistant")
                await r.until(lambda: r.approvals() == [("ledger", "pending")], "pending")
                (request_id,) = r.rows("SELECT request_id FROM approvals")[0]
                # alice, the rule's approver, opens the console: the request is shown.
                terminal = ApproverTerminal()
                with trio.fail_after(PATIENCE):
                    code = await run_remote_console(
                        r.server.host,
                        r.server.port,
                        terminal,
                        client="alice",
                        token="alice-token",
                        reply_timeout=PATIENCE,
                    )
                assert code == 0
                (shown,) = [line for line in terminal.out if line.startswith("approval request")]
                assert shown.startswith(
                    f"approval request {request_id}: assistant wants to call ledger with <pay"
                )
                assert "erin" in shown and "(rule payments, " in shown
                assert shown.endswith(f"/approve {request_id} or /deny {request_id} [reason]")
                assert terminal.typed == [f"/approve {request_id}"]
                assert f"approval {request_id}: decision applied" in terminal.out
                with trio.fail_after(PATIENCE):
                    answer = await bob.receive()
                    while answer.payload.tag != f"{{{ASSISTANT_NS}}}answer":
                        answer = await bob.receive()
            assert answer.payload.findtext(f"{{{ASSISTANT_NS}}}text") == "Erin is paid."
            assert r.approvals() == [("ledger", "forwarded")]
            assert len(r.paid()) == 1
        finally:
            r.stop()
            nursery.cancel_scope.cancel()
