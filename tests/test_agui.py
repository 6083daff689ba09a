"""AG-UI 1.0 runs on our agents (docs/ag-ui.md), end to end: the real server (a
subprocess) on SQLite and PostgreSQL, a scripted model on loopback, and every event of
every stream parsed with the ``ag-ui-protocol`` package's own models.

- A run streams its Turn: ``RUN_STARTED``, a state snapshot and deltas, the model's text
  chunk by chunk, the tool call (name, arguments) and its result, the next message, and
  ``RUN_FINISHED`` with the answer.
- A client that reconnects (the same run posted again, mid-run or after) gets the rest
  of the run: a snapshot of the messages so far, then what follows; no second task.
- A pending approval ends the run with an interrupt; a run resuming with the answer
  decides it (the tool runs once) and streams the rest of the Turn. Another client's
  interrupt answers exactly as a missing one.
- A failed Turn ends its run with ``RUN_ERROR``; a cancelled one with a ``cancelled``
  outcome.
- Two processes on one PostgreSQL store follow each other's runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

import ag_ui.core as ag_ui_core
import httpx
import pytest
import trio
from ag_ui.core import EventType
from httputil import http_url
from llm_fakes import FakeServer, Seen, openai_error, openai_stream
from lxml import etree
from pydantic import TypeAdapter
from serverproc import ServerProcess, subprocess_env

from agentserver.core.namespaces import CORE_NS
from agentserver.net.client import open_client

PATIENCE = 40.0
TOKENS = {"alice": "alice-agui-token", "bob": "bob-agui-token", "ops": "ops-agui-token"}
GOV = "urn:test:gov"
EVENTS = TypeAdapter(ag_ui_core.Event)

BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="agui">
  <limits hello-timeout="2" read-timeout="10" drain-timeout="1" write-timeout="2"/>
  <http wait-timeout="30"/>
  <clients>
    <client name="alice" token-env="AGUI_ALICE"/>
    <client name="bob" token-env="AGUI_BOB"/>
    <client name="ops" token-env="AGUI_OPS" operator="true"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="AGUI_LLM_BASE_URL" api-key-env="AGUI_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"
         url-env="AGENTS_TEST_STORE_URL" lease="1" heartbeat="0.25"/>
  <listeners>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="ledger">
      <agent model="m" max-steps="6" memory="client"/>
    </listener>
    <listener name="guarded" handler="agents_crash_support:agent_placeholder" agent="true"
              peers="ledger">
      <accepts type="agents_crash_support:PlanTask"/>
      <responds type="agents_crash_support:PlanAnswer"/>
      <agent model="m" max-steps="6" memory="client"/>
      <policy default="allow">
        <rule priority="1" id="payments" decision="require-approval" target="ledger"
              approver="alice" timeout="10m"/>
      </policy>
    </listener>
  </listeners>
</organism>
"""

PAYING = ["Paying", " erin", ". ", f'<pay xmlns="{GOV}"><to>erin</to><amount>3</amount></pay>']
DONE = ["Paid", " erin", " 3", "."]
DENIED = ["Not", " paid", "."]


class Model(FakeServer):
    """Streams: a payment asked for (``please pay``), then "Paid erin 3." once the ledger
    answered (or "Not paid." when the call failed); anything else is echoed word by
    word. ``slow``: the echo's words come ``slow`` seconds apart."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.slow = 0.0

    def default(self, seen: Seen) -> Any:
        question = str(seen.body["messages"][-1]["content"])
        if "Result from ledger" in question:
            return openai_stream(DONE, model="m", chunk_delay=0.02)
        if "failed" in question:
            return openai_stream(DENIED, model="m")
        if "please fail" in question:
            return openai_error(400, "the model refuses this")
        if "please pay" in question:
            return openai_stream(PAYING, model="m", chunk_delay=0.02)
        words = ("echo: " + re.sub(r"<[^>]+>", "", question).strip()).split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        return openai_stream(pieces, model="m", chunk_delay=self.slow)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


async def start(tmp_path, model: Model, store_env: dict[str, str], name: str = "") -> ServerProcess:
    ledger = tmp_path / "ledger.txt"
    if not ledger.exists():
        ledger.write_text("")
    cwd = tmp_path / name if name else tmp_path
    cwd.mkdir(exist_ok=True)
    env = subprocess_env(
        AGUI_LLM_BASE_URL=model.base_url,
        AGUI_LLM_KEY="k",
        AGUI_ALICE=TOKENS["alice"],
        AGUI_BOB=TOKENS["bob"],
        AGUI_OPS=TOKENS["ops"],
        GOV_LEDGER=str(ledger),
        **store_env,
    )
    (cwd / "boot.xml").write_text(BOOT)
    return await trio.to_thread.run_sync(
        lambda: ServerProcess.start(
            cwd / "boot.xml", "--http-port", "0", env=env, cwd=cwd, timeout=40
        )
    )


def client(url: str, who: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        timeout=PATIENCE,
        headers={"Authorization": f"Bearer {TOKENS[who]}", "Accept": "text/event-stream"},
    )


def run_input(thread: str, run: str, text: str | None = None, **more: Any) -> dict[str, Any]:
    messages = [] if text is None else [{"id": f"u-{run}", "role": "user", "content": text}]
    return {
        "threadId": thread,
        "runId": run,
        "messages": messages,
        "state": {},
        "tools": [],
        "context": [],
        "forwardedProps": {},
        **more,
    }


async def run(
    http: httpx.AsyncClient, agent: str, body: dict[str, Any], *, until: EventType | None = None
) -> list[Any]:
    """POST a run and parse every event of its stream with ag-ui-protocol's models; with
    ``until``, leave (close the connection) right after the first event of that type."""
    events: list[Any] = []
    with trio.fail_after(PATIENCE):
        async with http.stream("POST", f"/agui/agents/{agent}", json=body) as response:
            assert response.status_code == 200, (await response.aread()).decode()
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    assert line == "" or line.startswith(":"), line
                    continue
                event = EVENTS.validate_json(line[len("data: ") :])
                events.append(event)
                if until is not None and event.type == until:
                    return events
    return events


def kinds(events: list[Any]) -> list[str]:
    return [e.type.value for e in events]


def texts(events: list[Any]) -> dict[str, list[str]]:
    """Each streamed message's content deltas, by message id, checking each delta lies
    between its message's start and end."""
    out: dict[str, list[str]] = {}
    open_: set[str] = set()
    for e in events:
        if e.type == EventType.TEXT_MESSAGE_START:
            assert e.message_id not in open_ and e.role == "assistant"
            open_.add(e.message_id)
            out[e.message_id] = []
        elif e.type == EventType.TEXT_MESSAGE_CONTENT:
            assert e.message_id in open_
            out[e.message_id].append(e.delta)
        elif e.type == EventType.TEXT_MESSAGE_END:
            open_.remove(e.message_id)
    assert not open_, open_
    return out


def state_of(events: list[Any]) -> dict[str, Any]:
    """The state the snapshot and deltas make, applied in order (JSON Patch replace)."""
    state: dict[str, Any] = {}
    for e in events:
        if e.type == EventType.STATE_SNAPSHOT:
            state = dict(e.snapshot)
        elif e.type == EventType.STATE_DELTA:
            for op in e.delta:
                op = op if isinstance(op, dict) else op.model_dump(by_alias=True)
                assert op["op"] == "replace" and op["path"][1:] in state
                state[op["path"][1:]] = op["value"]
    return state


async def store_task(http: httpx.AsyncClient, agent: str, thread: str) -> dict[str, Any]:
    response = await http.get(f"/v1/agents/{agent}/tasks/{thread}")
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_run_streams_its_turn_and_a_reconnection_gets_the_rest(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        server = await start(tmp_path, model, store_env)
        alice, bob = client(http_url(server), "alice"), client(http_url(server), "bob")
        try:
            body = run_input("t-1", "r-1", "please pay erin 3")
            events = await run(alice, "assistant", body)
            order = kinds(events)
            assert order[:2] == ["RUN_STARTED", "STATE_SNAPSHOT"], order
            assert events[0].thread_id == "t-1" and events[0].run_id == "r-1"
            assert events[0].protocol_version == "1.0"
            assert order[-1] == "RUN_FINISHED" and events[-1].outcome is None, events[-1]
            assert events[-1].result["answer"] == "".join(DONE)
            # the model's text as it streamed: one content event per chunk, in order
            messages = texts(events)
            assert list(messages.values()) == [PAYING, DONE], messages
            first, second = messages
            # the tool call, its arguments and its result, between the two messages
            (call,) = [e for e in events if e.type == EventType.TOOL_CALL_START]
            assert call.tool_call_name == "ledger" and call.parent_message_id == first
            args = "".join(
                e.delta
                for e in events
                if e.type == EventType.TOOL_CALL_ARGS and e.tool_call_id == call.tool_call_id
            )
            assert "<to>erin</to>" in json.loads(args)["payload"]
            (result,) = [e for e in events if e.type == EventType.TOOL_CALL_RESULT]
            assert result.tool_call_id == call.tool_call_id and "paid 3 to erin" in result.content
            at = {k: order.index(k) for k in ("TOOL_CALL_START", "TOOL_CALL_END")}
            assert at["TOOL_CALL_START"] < at["TOOL_CALL_END"] < order.index("TOOL_CALL_RESULT")
            ends = [i for i, e in enumerate(events) if e.type == EventType.TEXT_MESSAGE_END]
            assert ends[0] < at["TOOL_CALL_START"] and order.index("TOOL_CALL_RESULT") < ends[1]
            # steps, and the state: running, two steps, then succeeded
            assert order.count("STEP_STARTED") == 2 and order.count("STEP_FINISHED") == 2
            final = state_of(events)
            assert final["status"] == "succeeded" and final["steps"] == 2, final
            assert final["agent"] == "assistant"
            usage = events[-1].usage
            assert usage and usage[0].model == "m" and usage[0].input_tokens == 20
            thread = final["thread"]
            task = await store_task(alice, "assistant", thread)
            assert task["status"] == "succeeded" and len(task["steps"]) == 2
            calls = len(model.requests)

            # posted again after the end: a snapshot of the run, then its end; no new task
            again = await run(alice, "assistant", body)
            assert kinds(again) == [
                "RUN_STARTED",
                "STATE_SNAPSHOT",
                "MESSAGES_SNAPSHOT",
                "STATE_DELTA",
                "RUN_FINISHED",
            ], kinds(again)
            snap = again[2].messages
            assert [m.role for m in snap] == ["user", "assistant", "tool", "assistant"]
            assert snap[0].content == "please pay erin 3"
            assert snap[1].id == first and snap[1].tool_calls[0].function.name == "ledger"
            assert snap[2].tool_call_id == call.tool_call_id
            assert snap[3].id == second and snap[3].content == "".join(DONE)
            assert again[-1].result == events[-1].result
            assert len(model.requests) == calls
            assert (await store_task(alice, "assistant", thread))["turn"] == task["turn"]

            # bob posting alice's run ids runs his own (he never sees hers)
            bobs = await run(bob, "assistant", run_input("t-1", "r-1", "hi from bob"))
            assert "MESSAGES_SNAPSHOT" not in kinds(bobs)
            assert bobs[-1].result["answer"] == "echo: hi from bob"
            assert state_of(bobs)["thread"] != thread

            # a reconnection mid-run gets the rest: the text whole, then the end
            model.slow = 0.3
            live = run_input("t-2", "r-1", "one two three four five six")
            cut = await run(alice, "assistant", live, until=EventType.TEXT_MESSAGE_CONTENT)
            seen = cut[-1].delta
            assert seen == "echo:"
            rest = await run(alice, "assistant", live)
            assert rest[-1].type == EventType.RUN_FINISHED, kinds(rest)
            answer = "echo: one two three four five six"
            assert rest[-1].result["answer"] == answer
            shown = "".join(m.content or "" for m in _snapshots(rest)) + "".join(
                "".join(v) for v in texts(rest).values()
            )
            assert answer in shown, kinds(rest)
            assert state_of(rest)["status"] == "succeeded"
            assert sum("one two" in str(r.body) for r in model.requests) == 1

            # the conversation goes on in the same AG-UI thread: the agent remembers it
            model.slow = 0.0
            more = await run(alice, "assistant", run_input("t-2", "r-2", "seven"))
            assert more[-1].result["answer"] == "echo: seven"
            asked = model.requests[-1].body["messages"]
            assert any("one two three" in str(m["content"]) for m in asked), asked

            # two first POSTs of one new run at once (a double click): one task, both
            # streams follow it to its end
            twice = run_input("t-3", "r-1", "only once please")
            streams: list[list[Any]] = []

            async def post() -> None:
                streams.append(await run(alice, "assistant", twice))

            async with trio.open_nursery() as both:
                both.start_soon(post)
                both.start_soon(post)
            for got in streams:
                assert got[-1].result["answer"] == "echo: only once please", kinds(got)
            assert sum("only once please" in str(r.body) for r in model.requests) == 1

            # bad input: told what is wrong, nothing sent
            refused = await alice.post("/agui/agents/assistant", json={"threadId": "x"})
            assert refused.status_code == 422, refused.text
            assert "runId" in refused.json()["title"] and "messages" in refused.json()["title"]
            empty = await alice.post("/agui/agents/assistant", json=run_input("x", "y"))
            assert empty.status_code == 422 and "user message" in empty.json()["title"]
            missing = await alice.post("/agui/agents/nobody", json=body)
            assert missing.status_code == 404
            ledger_call = await alice.post("/agui/agents/ledger", json=body)
            assert ledger_call.status_code == 404  # not an agent
            anon = await httpx.AsyncClient(base_url=http_url(server)).post(
                "/agui/agents/assistant", json=body
            )
            assert anon.status_code == 401
        finally:
            await alice.aclose()
            await bob.aclose()
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr


def _snapshots(events: list[Any]) -> list[Any]:
    return [
        m
        for e in events
        if e.type == EventType.MESSAGES_SNAPSHOT
        for m in e.messages
        if m.role == "assistant"
    ]


async def test_an_approval_is_an_interrupt_answered_by_resuming(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        server = await start(tmp_path, model, store_env)
        url = http_url(server)
        alice, bob, ops = client(url, "alice"), client(url, "bob"), client(url, "ops")
        ledger = tmp_path / "ledger.txt"
        try:
            events = await run(alice, "guarded", run_input("t-1", "r-1", "please pay erin 3"))
            last = events[-1]
            assert last.type == EventType.RUN_FINISHED, kinds(events)
            assert last.outcome.type == "interrupt"
            (interrupt,) = last.outcome.interrupts
            assert interrupt.reason == "approval" and "ledger" in interrupt.message
            assert interrupt.response_schema["required"] == ["grant"]
            assert interrupt.metadata["approver"] == "alice"
            # the interrupt names the tool call it holds, as the stream showed it
            (asked,) = [e for e in events if e.type == EventType.TOOL_CALL_START]
            assert interrupt.tool_call_id == asked.tool_call_id and asked.tool_call_name == "ledger"
            assert state_of(events)["status"] == "waiting for approval"
            # the tool call was asked for (its text streamed), not run
            assert list(texts(events).values()) == [PAYING]
            assert ledger.read_text() == ""

            # posted again: the same interrupt
            again = await run(alice, "guarded", run_input("t-1", "r-1", "please pay erin 3"))
            assert again[-1].outcome.interrupts[0].id == interrupt.id

            # another client's interrupt answers as a missing one, byte for byte
            thread, request = interrupt.id.split("/")
            missing_id = f"{thread[:-4]}beef/{request[:-4]}beef"

            def resume(target: str, grant: bool, run_id: str = "r-2") -> dict[str, Any]:
                entry = {"interruptId": target, "status": "resolved", "payload": {"grant": grant}}
                return run_input("t-1", run_id, resume=[entry])

            for who in (bob, ops):
                theirs = await who.post("/agui/agents/guarded", json=resume(interrupt.id, True))
                none = await who.post("/agui/agents/guarded", json=resume(missing_id, True))
                if who is bob:
                    assert theirs.status_code == none.status_code == 404
                    assert theirs.text.replace(interrupt.id, missing_id) == none.text
            # the operator sees the run, but alice is its approver
            assert theirs.status_code == 409 and "approver" in theirs.json()["title"]
            bad = await alice.post(
                "/agui/agents/guarded",
                json=run_input(
                    "t-1",
                    "r-2",
                    resume=[
                        {"interruptId": interrupt.id, "status": "resolved", "payload": {"ok": 1}}
                    ],
                ),
            )
            assert bad.status_code == 422 and "grant" in bad.json()["title"]
            assert ledger.read_text() == ""

            # alice approves by resuming: the call runs once, the rest of the Turn streams
            resumed = await run(alice, "guarded", resume(interrupt.id, True))
            order = kinds(resumed)
            assert resumed[0].run_id == "r-2" and order[-1] == "RUN_FINISHED", order
            assert resumed[-1].result["answer"] == "".join(DONE)
            results = [e for e in resumed if e.type == EventType.TOOL_CALL_RESULT]
            snapped = [
                m
                for e in resumed
                if e.type == EventType.MESSAGES_SNAPSHOT
                for m in e.messages
                if m.role == "tool"
            ]
            assert [r.content for r in results] + [m.content for m in snapped] == [
                r.content for r in results + snapped
            ]
            assert any("paid 3 to erin" in str(r.content) for r in results + snapped), order
            # the same call, by the same id, before the approval and after it
            assert {r.tool_call_id for r in results + snapped} == {asked.tool_call_id}
            assert ledger.read_text() == "erin 3\n"
            # resuming again (a reconnection of the resumed run): the end, nothing run twice
            twice = await run(alice, "guarded", resume(interrupt.id, True))
            assert twice[-1].result["answer"] == "".join(DONE)
            assert ledger.read_text() == "erin 3\n"

            # a denial: the resume's "cancelled" status; the model is told, the run ends
            denied = await run(alice, "guarded", run_input("t-3", "r-1", "please pay erin 3"))
            (second,) = denied[-1].outcome.interrupts
            cancel = run_input(
                "t-3", "r-2", resume=[{"interruptId": second.id, "status": "cancelled"}]
            )
            after = await run(alice, "guarded", cancel)
            assert after[-1].result["answer"] == "".join(DENIED), kinds(after)
            assert ledger.read_text() == "erin 3\n"
        finally:
            for c in (alice, bob, ops):
                await c.aclose()
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr


async def test_a_failed_run_errors_and_a_cancelled_one_ends_cancelled(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        server = await start(tmp_path, model, store_env)
        alice = client(http_url(server), "alice")
        try:
            failed = await run(alice, "assistant", run_input("t-1", "r-1", "please fail"))
            assert kinds(failed)[-1] == "RUN_ERROR", kinds(failed)
            assert failed[-1].code == "failed" and failed[-1].message
            assert state_of(failed)["status"] == "failed"

            # A run cancelled while it streams (the socket's <cancel>, by its sender):
            # the stream ends with a cancelled outcome, and so does posting it again.
            model.slow = 0.5
            body = run_input("t-2", "r-1", "a long answer of many many words")
            cut = await run(alice, "assistant", body, until=EventType.TEXT_MESSAGE_CONTENT)
            thread = state_of(cut)["thread"]
            command = etree.Element(f"{{{CORE_NS}}}cancel", nsmap={None: CORE_NS})
            command.set("agent", "assistant")
            command.set("thread", thread)
            async with open_client(
                server.host, server.port, client="alice", token=TOKENS["alice"]
            ) as socket:
                reply = await socket.request(command, timeout=PATIENCE)
            assert reply.payload.get("count") == "1", etree.tostring(reply.payload)
            after = await run(alice, "assistant", body)
            assert after[-1].type == EventType.RUN_FINISHED, kinds(after)
            assert after[-1].outcome.type == "cancelled", after[-1]
            assert state_of(after)["status"] == "stopped"
        finally:
            await alice.aclose()
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr


@pytest.mark.postgresql
async def test_two_processes_on_postgresql_follow_each_others_runs(tmp_path, pg_url):
    """A run started on one process is reconnected to through the other (which reads
    the Turn from the store if the first runs it), and an interrupt raised on one is
    answered through the other."""
    store = {"AGENTS_TEST_STORE_URL": pg_url}
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        first = await start(tmp_path, model, store, "one")
        second = await start(tmp_path, model, store, "two")
        one, two = client(http_url(first), "alice"), client(http_url(second), "alice")
        try:
            model.slow = 0.3
            body = run_input("t-1", "r-1", "eight nine ten eleven twelve")
            cut = await run(one, "assistant", body, until=EventType.TEXT_MESSAGE_CONTENT)
            # Either process's worker may run the Turn: on this one its text streams chunk
            # by chunk; on the other, this one reads it from the store, whole.
            assert cut[-1].delta in ("echo:", "echo: eight nine ten eleven twelve"), cut[-1]
            rest = await run(two, "assistant", body)
            assert rest[-1].type == EventType.RUN_FINISHED, kinds(rest)
            assert rest[-1].result["answer"] == "echo: eight nine ten eleven twelve"
            assert state_of(rest)["status"] == "succeeded"
            assert sum("eight nine" in str(r.body) for r in model.requests) == 1
            model.slow = 0.0
            asked = await run(one, "guarded", run_input("t-2", "r-1", "please pay erin 3"))
            (interrupt,) = asked[-1].outcome.interrupts
            entry = {"interruptId": interrupt.id, "status": "resolved", "payload": True}
            resumed = await run(two, "guarded", run_input("t-2", "r-2", resume=[entry]))
            assert resumed[-1].result["answer"] == "".join(DONE), kinds(resumed)
            assert (tmp_path / "ledger.txt").read_text() == "erin 3\n"
        finally:
            await one.aclose()
            await two.aclose()
            await trio.to_thread.run_sync(first.stop)
            await trio.to_thread.run_sync(second.stop)
            nursery.cancel_scope.cancel()
