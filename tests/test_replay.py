"""Replay and export of a recorded Turn (issue 26).

A real Turn is recorded first: the server runs in process on a SQLite file, its model a
scripted OpenAI-compatible server on loopback that answers 503 once (a step retry), then
asks for a sum and two payments (policy refuses the one to mallory), then, its context
window small, has the Turn compacted (a summary request) before it answers. Then,
with the server stopped, the Turn is replayed: identical, with no request to the model;
with a policy that now refuses every payment, or a ``<pay>`` schema that now needs a
currency, the replay reports the divergence at step 2; an export read back replays the
same without the store.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio
from governance_support import NS as GOV_NS
from llm_fakes import FakeServer, Script, Seen, openai_error, openai_ok
from serverproc import cli, subprocess_env
from serverutil import start_in_process

from agentserver.agents.replay.record import RecordError, TurnRecord
from agentserver.agents.turn.compaction import SUMMARY_SYSTEM
from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client
from agentserver.testing import ReplayError, replay

CALC_NS = "urn:agentserver:calculator"
PADDING = "Let me think this through carefully. " * 100
ENV = {"RP_ALICE": "alice-token", "RP_LLM_KEY": "k"}
PATIENCE = 30.0
WINDOW = 3000
POLICY = """
      <policy default="allow">
        <rule priority="1" id="no-mallory" decision="deny" target="ledger">
          <arg path="to" equals="mallory"/>
        </rule>
      </policy>"""
NO_PAYMENTS = """
      <policy default="allow">
        <rule priority="1" id="no-mallory" decision="deny" target="ledger">
          <arg path="to" equals="mallory"/>
        </rule>
        <rule priority="2" id="no-payments" decision="deny" target="ledger"/>
      </policy>"""


def boot_xml(base_url: str, policy: str = POLICY, pay: str = "governance_support:Pay") -> str:
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="replayed">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <clients><client name="alice" token-env="RP_ALICE"/></clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="{base_url}" api-key-env="RP_LLM_KEY"
             timeout="60"><model name="m"/></backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="{pay}"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator ledger">
      <agent model="m" max-steps="6" step-retries="2" step-retry-base="0.01"
             context-window="{WINDOW}" context-reserve="0" keep-recent="50"/>{policy}
    </listener>
  </listeners>
</organism>"""


def pay(to: str) -> str:
    return f'<pay xmlns="{GOV_NS}"><to>{to}</to><amount>5</amount></pay>'


class Model(FakeServer):
    """503 once, then: a sum and a payment to mallory; a payment to bob; the answer."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.push(lambda seen: openai_error(503, "busy", type="server_error"))

    def default(self, seen: Seen) -> Script:
        if seen.body["messages"][0]["content"] == SUMMARY_SYSTEM:
            self.summaries += 1
            # The facts the folded cards held, as the next steps look for them.
            folded = seen.body["messages"][1]["content"]
            facts = re.findall(r"<sum [^>]*>.*?</sum>|<paid [^>]*>.*?</paid>", folded, re.S)
            return openai_ok(" ".join(["Summary:", *facts]), model="m")
        text = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        if "<sum" not in text:
            add = f'<add xmlns="{CALC_NS}"><a>2</a><b>3</b></add>'
            return openai_ok(f"First things first. {add} {pay('mallory')}", model="m")
        if "<paid" not in text:
            # Long enough that the next step's request needs a compaction.
            return openai_ok(f"Now bob. {PADDING} {pay('bob')}", model="m")
        total = re.findall(r"<value>(\d+)</value>", text)[-1]
        return openai_ok(f"Done: the sum is {total}, bob is paid.", model="m")

    #: Summary requests (compactions) answered.
    summaries = 0


async def record_a_turn(tmp_path: Path, model: Model) -> tuple[Path, str]:
    """Run the Turn on a real server (in process) and stop it; (boot file, thread)."""
    path = tmp_path / "boot.xml"
    path.write_text(boot_xml(model.base_url))
    topology = boot.load_or_raise(path, environ=ENV)
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, RunContext(topology), environ=ENV)
        async with open_client("127.0.0.1", server.port, client="alice", token="alice-token") as c:
            thread = await c.send(Task(text="add 2 and 3, pay mallory and bob"), to="assistant")
            with trio.fail_after(PATIENCE):
                reply = await c.receive_on(thread)
        assert "".join(reply.payload.itertext()) == "Done: the sum is 5, bob is paid."
        server.shutdown.set()
    assert model.summaries >= 1, "the recorded Turn has a compaction"
    return path, thread


async def test_replay_is_identical_and_calls_no_model_and_reports_divergences(
    tmp_path, monkeypatch
):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        path, thread = await record_a_turn(tmp_path, model)
        asked = len(model.requests)
        assert asked == 4 + model.summaries  # the 503, three steps, the compaction

        report = await replay(path, "assistant", thread, environ=ENV)
        assert str(report) == "identical", report
        assert report.model_calls == 3 and report.tool_calls == 2
        assert report.answer == "Done: the sum is 5, bob is paid."
        # The real tools (in-process: calculator, ledger) give the same results.
        ledger = tmp_path / "ledger.txt"
        monkeypatch.setenv("GOV_LEDGER", str(ledger))  # the ledger tool writes there
        live = await replay(path, "assistant", thread, live_tools=True, environ=ENV)
        monkeypatch.delenv("GOV_LEDGER")
        assert live.identical, live
        assert ledger.read_text() == "bob 5\n"  # really called, once

        # Policy changed: the payment to bob is refused now, at step 2.
        (tmp_path / "no-payments.xml").write_text(boot_xml(model.base_url, NO_PAYMENTS))
        changed = await replay(tmp_path / "no-payments.xml", "assistant", thread, environ=ENV)
        assert not changed.identical
        assert changed.divergence.step == 2
        assert "the recorded call was ledger" in str(changed) and "refused" in str(changed)

        # The tool's schema changed: the recorded call is refused by validation at step 2.
        (tmp_path / "v2.xml").write_text(boot_xml(model.base_url, pay="idem_support:PayV2"))
        schema = await replay(tmp_path / "v2.xml", "assistant", thread, environ=ENV)
        assert schema.divergence is not None and schema.divergence.step == 2, schema
        assert "sys.huh" in str(schema)

        # The commands, as a user runs them (real processes).
        env = subprocess_env(**ENV)

        def command(*args: str):
            return trio.to_thread.run_sync(lambda: cli(*args, env=env, timeout=60))

        done = await command("replay", "assistant", thread, "--boot", str(path))
        assert (done.returncode, done.stdout.decode()) == (0, "identical\n"), done.stderr
        done = await command("export", "assistant", thread, "--boot", str(path))
        assert done.returncode == 0, done.stderr
        (tmp_path / "turn.jsonl").write_bytes(done.stdout)
        kinds = [json.loads(line).get("type") for line in done.stdout.decode().splitlines()]
        assert {"sys.summary", "tool.refused", "tool.call", "tool.result"} <= set(kinds)
        done = await command(
            "replay",
            "--from",
            str(tmp_path / "turn.jsonl"),
            "--boot",
            str(tmp_path / "no-payments.xml"),
        )
        assert done.returncode == 1, done.stderr
        assert done.stdout.decode().startswith("diverged: step 2: the recorded call was ledger")
        done = await command("replay", "assistant", "no-such-thread", "--boot", str(path))
        assert done.returncode == 2 and b"no Turn of 'assistant'" in done.stderr

        # Exported, then replayed from the file alone (no store).
        from agentserver.app.replay import read_record

        exported = (await read_record(path, "assistant", thread, environ=ENV)).to_jsonl()
        (tmp_path / "state" / "agents.sqlite3").unlink()
        again = await replay(path, record=TurnRecord.from_jsonl(exported.splitlines()), environ=ENV)
        assert again.identical, again
        with pytest.raises(ReplayError):
            await replay(path, "assistant", thread, environ=ENV)

        assert len(model.requests) == asked  # no replay asked the model anything
        nursery.cancel_scope.cancel()


def test_an_export_that_is_not_a_record_is_refused():
    with pytest.raises(RecordError):
        TurnRecord.from_jsonl(["{}"])
    with pytest.raises(RecordError):
        TurnRecord.from_jsonl(['{"record": "card", "type": "x"}'])


def card(kind: str, content: str, **meta: object) -> dict:
    return {"type": kind, "content": content, "metadata": meta}


def test_compare_finds_the_first_divergence_by_step():
    from agentserver.agents.replay.recorded import compare

    recorded = [
        card("task.input", "<task/>"),
        card("llm.message", "one", step_id="s1"),
        card("tool.call", "<a/>", tool_call_id="c1", to="calc"),
        card("tool.call", "<b/>", tool_call_id="c2", to="calc"),
        card("tool.result", "A", tool_call_id="c1", to="calc"),
        card("tool.result", "B", tool_call_id="c2", to="calc"),
        card("llm.message", "two", step_id="s2"),
        card("task.deliverable", "done", status="succeeded"),
    ]
    # Other ids, and the results of one step in another order: identical.
    replayed = [dict(c, metadata=dict(c["metadata"])) for c in recorded]
    for c in replayed:
        if "tool_call_id" in c["metadata"]:
            c["metadata"]["tool_call_id"] = "r" + c["metadata"]["tool_call_id"]
    replayed[4], replayed[5] = replayed[5], replayed[4]
    assert compare(recorded, replayed) is None
    # Another call at step 1.
    other = [*replayed[:3], card("tool.call", "<c/>", tool_call_id="x", to="calc"), *replayed[4:]]
    found = compare(recorded, other)
    assert found.step == 1 and str(found) == (
        "step 1: the recorded call was calc <b/>; the replay made call calc <c/>"
    )
    # A result that differs (live tools), at step 1; a Turn that stops early, at step 2.
    changed = [dict(c) for c in replayed]
    changed[5] = card("tool.result", "A2", tool_call_id="rc1", to="calc")
    assert "a result differed" in str(compare(recorded, changed))
    short = compare(recorded, replayed[:7])
    assert short.step == 2 and str(short).endswith("the replay made nothing more")
