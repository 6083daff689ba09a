"""Crash test of the agents (issue 5): SIGKILL with Turns open, restart on the same store.

The real server runs tests/data/agents-crash-boot.xml in a scratch directory; its model is
a scripted OpenAI-compatible server in this test's trio run (it survives the kill). As the
named client ``alice`` the test sends seven tasks to three agents (an agent runs one Turn
at a time, so open Turns at the same time need several agents):

* ``job0-quick`` (assistant) is answered before the kill;
* ``job1-slow`` (assistant) is suspended on a call to ``waiter``, which never answers in time;
* ``job2-hang`` (planner) has its model call in flight (the model never answers it);
* ``job3-mixed`` (mixer) is suspended with one of its two tool calls answered (calculator)
  and one pending (waiter);
* ``job4-plain``, ``job5-calc``, ``job6-plain`` are queued behind them, one per agent.

Then the server is killed with SIGKILL and restarted on the same store, and the model now
answers. The resume deadlines are far longer than the test, so only the restart path can end
the waits. Checked afterwards: alice gets exactly one reply per task (the six open ones once
more, never ``job0`` again), each an ``<answer>`` on the task's thread; in the store every
accepted task has exactly one deliverable card, one ``deliver`` edge and one sent reply, and
every head is idle.

Task events are in-process only (not exposed by the server); their durable equivalent is
checked instead: the ``deliver`` execution edge and the deliverable card that the store
writes in the transaction whose commit makes the worker publish the Turn's one TaskEvent.

Two variants: alice reconnects only once every Turn has ended (the replies are kept for her
in ``client_replies`` and handed over at her hello), or at once, before any Turn can end
(the model holds its answers until she is back, so every reply reaches her live).
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from agents_crash_support import MIXER_NS, PLANNER_NS, TOOL_NS, MixTask, PlanTask
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import NS as ASSISTANT_NS
from agentserver.listeners.assistant import Task
from agentserver.net.client import Client, Reply, open_client

BOOT = DATA / "agents-crash-boot.xml"
CALC_NS = "urn:agentserver:calculator"
TOKEN = "alice-secret-token"
JOB_RE = re.compile(r"\bjob\d-(?:quick|slow|hang|mixed|plain|calc)\b")
#: Long enough never to end during the test: only the restart may end these waits.
FOREVER = 3600
#: Bound on every wait of the test (the whole test takes a few seconds).
PATIENCE = 20.0


@dataclass(frozen=True)
class Job:
    name: str
    agent: str

    @property
    def kind(self) -> str:
        return self.name.split("-", 1)[1]

    def payload(self):
        model = {"assistant": Task, "planner": PlanTask, "mixer": MixTask}[self.agent]
        return model(text=f"Please handle {self.name}.")

    @property
    def answer_tag(self) -> str:
        ns = {"assistant": ASSISTANT_NS, "planner": PLANNER_NS, "mixer": MIXER_NS}[self.agent]
        return f"{{{ns}}}answer"


QUICK = Job("job0-quick", "assistant")
OPEN = (Job("job1-slow", "assistant"), Job("job2-hang", "planner"), Job("job3-mixed", "mixer"))
QUEUED = (Job("job4-plain", "assistant"), Job("job5-calc", "planner"), Job("job6-plain", "mixer"))
AFTER_KILL = OPEN + QUEUED
ALL = (QUICK, *AFTER_KILL)
BY_NAME = {j.name: j for j in ALL}


def final_text(job: str, sums: list[str]) -> str:
    return f"Done with {job}" + (f", the sum is {sums[-1]}." if sums else ".")


class CrashModel(FakeServer):
    """Decides each step from the conversation, like a model would; before the restart
    it parks Turns on the never-answering tool or never answers at all."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.restarted = False
        #: Set to let the answers after the restart out (the "back at once" variant holds
        #: them until alice is connected again).
        self.release = trio.Event()
        #: (job, action, after the restart) per request, in arrival order.
        self.steps: list[tuple[str, str, bool]] = []

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        task = next(m["content"] for m in messages if m["role"] == "user")
        job = JOB_RE.search(task).group(0)
        kind = job.split("-", 1)[1]
        seen_text = "\n".join(str(m["content"]) for m in messages[1:])
        tool_results = seen_text.count("Result from ") + seen_text.count("Tool call to ")
        sums = re.findall(r"<sum [^>]*><value>(-?\d+)</value>", seen_text)
        if not self.restarted and kind == "hang":
            action, script = "hang", Script(body=openai_ok("too late").body, delay=FOREVER)
        elif not self.restarted and kind == "slow" and not tool_results:
            action, script = "wait", self._ok(self._wait(job))
        elif not self.restarted and kind == "mixed" and not tool_results:
            action, script = "mixed", self._ok(f"Both at once. {self._add(2)} {self._wait(job)}")
        elif self.restarted and kind in ("hang", "calc") and not sums:
            action, script = "calc", self._ok(f"Let me add. {self._add(int(job[3]))}")
        else:
            action, script = "answer", self._ok(final_text(job, sums))
        self.steps.append((job, action, self.restarted))
        return script

    @staticmethod
    def _ok(content: str) -> Script:
        return openai_ok(content, model="m")

    @staticmethod
    def _wait(job: str) -> str:
        return f'<wait xmlns="{TOOL_NS}"><text>{job}</text><seconds>{FOREVER}</seconds></wait>'

    @staticmethod
    def _add(a: int) -> str:
        return f'<add xmlns="{CALC_NS}"><a>{a}</a><b>1</b></add>'

    async def _respond(self, stream, conn, s: Script) -> bool:
        if self.restarted:
            await self.release.wait()
        return await super()._respond(stream, conn, s)

    def requests_for(self, job: str, *, restarted: bool) -> list[str]:
        return [a for j, a, r in self.steps if j == job and r == restarted]


# -- the store, read-only ------------------------------------------------------------------


class Store:
    """Read-only queries on the server's SQLite file (safe while it runs: WAL); with
    ``url``, on its PostgreSQL database instead."""

    url: str | None = None

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self.url is not None:
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as pg:
                try:
                    return pg.execute(sql.replace("?", "%s"), args).fetchall()
                except psycopg.errors.UndefinedTable:
                    return []  # the server has not created the schema yet
        if not self.path.exists():
            return []
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def heads(self) -> dict[str, tuple]:
        rows = self.rows(
            "SELECT agent_id, status, active_agent_turn_id, waiting_tool_count "
            "FROM agent_state_head"
        )
        return {r[0]: r[1:] for r in rows}

    def tasks(self) -> dict[str, tuple[str | None, str]]:
        """Accepted tasks (Enqueue rows) by job name: (agent_turn_id, row status)."""
        out: dict[str, tuple[str | None, str]] = {}
        # A started Turn's row gave its payload up to its task.input card (issue 38).
        for payload, turn_id, status, card in self.rows(
            "SELECT i.payload, i.agent_turn_id, i.status, (SELECT c.content FROM cards c "
            "WHERE c.agent_turn_id = i.agent_turn_id AND c.card_type = 'task.input' "
            "ORDER BY c.seq LIMIT 1) FROM agent_inbox i WHERE i.message_type = 'turn'"
        ):
            text = bytes(payload).decode() or (card or "")
            job = JOB_RE.search(text).group(0)
            assert job not in out, f"{job} was accepted twice"
            out[job] = (turn_id, status)
        return out

    def waiting_tools(self, turn_id: str) -> list[tuple[str, str]]:
        return sorted(
            self.rows(
                "SELECT to_listener, status FROM turn_waiting_tools WHERE agent_turn_id = ?",
                (turn_id,),
            )
        )

    def unfinished_rows(self) -> int:
        return self.rows(
            "SELECT count(*) FROM agent_inbox "
            "WHERE status IN ('queued', 'pending', 'processing', 'deferred')"
        )[0][0]

    def deliverables(self) -> list[tuple[str, str, dict]]:
        return [
            (turn_id, content, json.loads(meta))
            for turn_id, content, meta in self.rows(
                "SELECT agent_turn_id, content, metadata FROM cards "
                "WHERE card_type = 'task.deliverable'"
            )
        ]

    def dump(self) -> str:
        lines = [f"heads: {self.heads()}"]
        for table, cols in (
            ("agent_inbox", "agent_id, message_type, status, agent_turn_id, defer_reason"),
            ("turn_waiting_tools", "agent_turn_id, to_listener, status"),
            ("agent_replies", "agent_turn_id, status, attempts"),
            ("client_replies", "reply_id, client, delivered_at"),
        ):
            lines.append(f"{table}:")
            lines += [f"  {r}" for r in self.rows(f"SELECT {cols} FROM {table}")]
        return "\n".join(lines)


async def until(predicate, what: str, store: Store, servers: list[ServerProcess]) -> None:
    """Poll ``predicate`` (bounded by PATIENCE); on timeout fail with the store's state."""
    # Another process writes the store: there is no event to wait on, so poll it.
    with trio.move_on_after(PATIENCE):
        while True:
            if predicate():
                return
            await trio.sleep(0.05)
    stderr = "\n".join(s.stderr for s in servers)
    raise AssertionError(f"timed out waiting until {what}\n{store.dump()}\n{stderr}")


async def start_server(env: dict[str, str], cwd: Path) -> ServerProcess:
    return await trio.to_thread.run_sync(lambda: ServerProcess.start(BOOT, env=env, cwd=cwd))


def alice(server: ServerProcess):
    return open_client(server.host, server.port, client="alice", token=TOKEN)


async def send(client: Client, job: Job) -> str:
    return await client.send(job.payload(), to=job.agent, thread=new_thread_id())


def check_reply(reply: Reply, job: Job, thread: str) -> None:
    assert reply.thread == thread, (job, reply.raw)
    assert reply.from_id == job.agent, (job, reply.raw)
    assert reply.payload.tag == job.answer_tag, (job, reply.raw)
    text = reply.payload.findtext(job.answer_tag.replace("answer", "text"))
    assert text is not None and text.startswith(f"Done with {job.name}"), (job, reply.raw)


async def receive_exactly(client: Client, count: int) -> list[Reply]:
    """``count`` replies, then a quiet second in which nothing more arrives."""
    replies = []
    with trio.fail_after(PATIENCE):
        while len(replies) < count:
            replies.append(await client.receive())
    with trio.move_on_after(1.0) as quiet:
        extra = await client.receive()
    assert quiet.cancelled_caught, f"an extra reply arrived: {extra.raw!r}"
    return replies


# -- the test ------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def backend(request, tmp_path) -> tuple[Store, dict[str, str]]:
    """The store the servers use (the boot file's ``<store url-env>``), and its reader."""
    store = Store(tmp_path / "state" / "agents.sqlite3")
    if request.param == "sqlite":
        return store, {}
    store.url = request.getfixturevalue("pg_url")
    return store, {"AGENTS_TEST_STORE_URL": store.url}


@pytest.mark.parametrize("reconnect", ["after-turns-ended", "at-once"])
async def test_sigkill_with_turns_open_every_task_ends_once(tmp_path, reconnect, backend):
    store, store_env = backend
    servers: list[ServerProcess] = []
    threads: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        model = await CrashModel().start(nursery)
        env = subprocess_env(
            CRASH_LLM_BASE_URL=model.base_url,
            CRASH_LLM_KEY="test-key",
            CRASH_ALICE_TOKEN=TOKEN,
            **store_env,
        )
        try:
            # -- first life: open Turns in every state, then SIGKILL -----------------------
            first = await start_server(env, tmp_path)
            servers.append(first)
            async with alice(first) as client:
                threads[QUICK.name] = await send(client, QUICK)
                with trio.fail_after(PATIENCE):
                    check_reply(await client.receive(), QUICK, threads[QUICK.name])
                for job in OPEN:
                    threads[job.name] = await send(client, job)

                def parked() -> bool:
                    heads, tasks = store.heads(), store.tasks()
                    if not all(j.name in tasks for j in OPEN) or model.in_flight < 1:
                        return False
                    mixed = store.waiting_tools(tasks["job3-mixed"][0])
                    replies = store.rows("SELECT status FROM agent_replies")
                    return (
                        replies == [("sent",)]  # job0's, so the restart has none to resend
                        and heads["assistant"][0] == "suspended"
                        and heads["assistant"][2] == 1
                        and heads["planner"][0] == "running"
                        and model.requests_for("job2-hang", restarted=False) == ["hang"]
                        and heads["mixer"][0] == "suspended"
                        and mixed == [("calculator", "received"), ("waiter", "waiting")]
                    )

                await until(
                    parked, "two Turns are suspended and one is in a model call", store, servers
                )
                for job in QUEUED:
                    threads[job.name] = await send(client, job)

                def queued() -> bool:
                    tasks = store.tasks()
                    return all(tasks.get(j.name, (None, ""))[1] == "queued" for j in QUEUED)

                await until(queued, "three more tasks are queued", store, servers)
                await trio.to_thread.run_sync(first.proc.kill)
                assert await trio.to_thread.run_sync(first.wait_exit, 10) < 0
                with trio.fail_after(PATIENCE):
                    await client.wait_closed()
                # nothing but job0's answer reached alice before the kill
                assert [r async for r in client] == []
            assert set(store.tasks()) == set(BY_NAME)
            assert model.in_flight == 1  # the hung model call, never answered

            # -- second life: the same store; the model answers now ------------------------
            model.restarted = True
            if reconnect == "after-turns-ended":
                model.release.set()
            second = await start_server(env, tmp_path)
            servers.append(second)

            def all_ended() -> bool:
                heads = store.heads()
                return (
                    all(h[0] == "idle" and h[1] is None for h in heads.values())
                    and store.unfinished_rows() == 0
                    and len(store.deliverables()) == len(ALL)
                )

            if reconnect == "after-turns-ended":
                await until(all_ended, "every Turn has ended (alice away)", store, servers)
                kept = store.rows("SELECT count(*) FROM client_replies WHERE delivered_at IS NULL")
                assert kept == [(len(AFTER_KILL),)], store.dump()
                async with alice(second) as client:
                    replies = await receive_exactly(client, len(AFTER_KILL))
            else:
                async with alice(second) as client:
                    # a round trip proves alice's endpoint is attached before any Turn can end
                    done = await client.request(
                        f'<add xmlns="{CALC_NS}"><a>40</a><b>2</b></add>', to="calculator"
                    )
                    assert done.payload.findtext(f"{{{CALC_NS}}}value") == "42", done.raw
                    model.release.set()
                    replies = await receive_exactly(client, len(AFTER_KILL))
                await until(all_ended, "every Turn has ended", store, servers)
                # every reply went to her live: none was kept for later
                assert store.rows("SELECT count(*) FROM client_replies") == [(0,)]
            code = await trio.to_thread.run_sync(second.stop)
            assert code == 0, second.stderr
        finally:
            for server in servers:
                if server.proc.poll() is None:
                    await trio.to_thread.run_sync(server.proc.kill)
                    await trio.to_thread.run_sync(server.proc.wait)
            nursery.cancel_scope.cancel()

    # -- alice: exactly one reply per task, on its thread ----------------------------------
    by_thread = {threads[j.name]: j for j in AFTER_KILL}
    got = [r.thread for r in replies]
    assert sorted(got) == sorted(by_thread), got  # each once: none lost, none duplicated
    for reply in replies:
        check_reply(reply, by_thread[reply.thread], reply.thread)

    # -- the store: one deliverable, one deliver edge, one sent reply per accepted task ----
    tasks = store.tasks()
    assert set(tasks) == set(BY_NAME)
    turn_of = {job: turn for job, (turn, _) in tasks.items()}
    assert len(set(turn_of.values())) == len(ALL) and None not in turn_of.values()
    assert all(status == "consumed" for _, status in tasks.values()), tasks
    deliverables = store.deliverables()
    assert sorted(t for t, _, _ in deliverables) == sorted(turn_of.values())
    for turn_id, content, meta in deliverables:
        job = next(j for j, t in turn_of.items() if t == turn_id)
        assert meta["status"] == "succeeded" and content.startswith(f"Done with {job}"), (
            job,
            content,
            meta,
        )
    edges = store.rows(
        "SELECT agent_turn_id FROM execution_edges WHERE primitive = 'deliver' ORDER BY 1"
    )
    assert [e[0] for e in edges] == sorted(turn_of.values())
    sent = store.rows("SELECT agent_turn_id, status, attempts FROM agent_replies ORDER BY 1")
    assert sent == [(t, "sent", 1) for t in sorted(turn_of.values())]
    assert store.unfinished_rows() == 0
    assert all(h[:2] == ("idle", None) for h in store.heads().values()), store.heads()
    assert store.rows("SELECT count(*) FROM client_replies WHERE delivered_at IS NULL") == [(0,)]

    # -- the restart path, not a deadline, ended the waits --------------------------------
    for job in ("job1-slow", "job3-mixed"):
        tools = store.waiting_tools(turn_of[job])
        assert ("waiter", "timeout") in tools and ("waiter", "waiting") not in tools, tools
        lost = [
            content
            for content, meta in store.rows(
                "SELECT content, metadata FROM cards WHERE agent_turn_id = ? "
                "AND card_type = 'tool.result'",
                (turn_of[job],),
            )
            if json.loads(meta).get("timeout")
        ]
        # (on PostgreSQL the new process took over from the dead one: same path, own words)
        why = "was lost with the process that sent it" if store.url else "interrupted by a restart"
        assert len(lost) == 1 and why in lost[0], lost
    # the in-flight model call was re-run after the restart, and its Turn went on with a tool
    assert model.requests_for("job2-hang", restarted=True) == ["calc", "answer"]
    for job in OPEN:
        assert model.requests_for(job.name, restarted=True)[-1] == "answer", model.steps
    for job in QUEUED:
        assert model.requests_for(job.name, restarted=False) == [], model.steps
    assert model.requests_for("job0-quick", restarted=True) == []
