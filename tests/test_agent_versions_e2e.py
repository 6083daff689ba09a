"""Agent versions end to end (issue 49, docs/deploy.md "Deploying with Turns in flight"):
real servers on tests/data/versions-v1.xml and versions-v2.xml, one store (SQLite, or
PostgreSQL when a server is reachable), a scripted OpenAI-compatible model on loopback
that names, in each answer, the version whose prompt it was given.

- A restart onto v2: an ``upgrade`` Turn continues on the new prompt; its call to a tool
  v2 removed is answered as a failed result naming the change; a task queued on v1 whose
  type v2 no longer accepts is answered ``failed`` with the reason; a pinned Turn does not
  run on v2, is shown waiting for its version, and ``turns migrate`` moves it to v2.
- A rollback to v1: the pinned Turn begun on v1 finishes there, the one begun on v2 waits
  (shown waiting), the ``upgrade`` Turn begun on v2 continues on v1.
- A drain: the server takes no new task, finishes the Turn it runs, exits 0; the task it
  did not take runs on the next server.
- PostgreSQL, a rolling deploy: v1 and v2 processes on one store; new tasks sent to the v1
  process run on v2, its pinned Turn finishes on v1, and the v1 process drains and exits.

Every task is answered exactly once.
"""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, subprocess_env
from versions_support import (
    KEEPER_NS,
    PAYER_NS,
    PINNER2_NS,
    PINNER_NS,
    TOOL_NS,
    TYPER_NS,
    KeeperTask,
    PayerTask,
    Pinner2Task,
    PinnerTask,
    TypedTask,
    TypedTaskV2,
)

from agentserver.core.threads import new_thread_id
from agentserver.net.client import (
    Client,
    DeliveredIds,
    Reply,
    approval_ack_status,
    approval_request,
    open_client,
)
from agentserver.net.reply import ConnectionClosed
from agentserver.primitives.approval import ApprovalDecision

V1 = DATA / "versions-v1.xml"
V2 = DATA / "versions-v2.xml"
ALICE = "alice-secret-token"
OPS = "ops-secret-token"
PATIENCE = 30.0
FOREVER = 3600
JOB_RE = re.compile(r"\bjob-[a-z0-9-]+\b")
PROMPT_RE = re.compile(r"\b(Keeper|Pinner2|Pinner|Typer|Payer), version (one|two)\.")
ANSWER_NS = {
    "keeper": KEEPER_NS,
    "pinner": PINNER_NS,
    "pinner2": PINNER2_NS,
    "typer": TYPER_NS,
    "payer": PAYER_NS,
}


class VersionModel(FakeServer):
    """Answers each step from the conversation: a ``wait`` job calls the waiter first
    (for ``seconds`` of the job's name: ``job-wait3-...`` waits 3 s, else for ever), a
    ``retry`` job the idempotent ``retrier`` (4 s), a ``slow`` job answers after two
    seconds, any other at once. Every answer says the
    version of the prompt it was given and what the tool reported."""

    def __init__(self) -> None:
        super().__init__("openai")
        #: (job, prompt's agent and version, the tool reports it was shown) per request.
        self.seen: list[tuple[str, str, str]] = []

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        system = "\n".join(str(m["content"]) for m in messages if m["role"] == "system")
        prompt = PROMPT_RE.search(system)
        version = f"{prompt.group(1)} {prompt.group(2)}" if prompt else "?"
        task = next(str(m["content"]) for m in messages if m["role"] == "user")
        job = JOB_RE.search(task).group(0)
        reports = "\n".join(
            str(m["content"])
            for m in messages[1:]
            if str(m["content"]).startswith(("Result from ", "Tool call to "))
        )
        self.seen.append((job, version, reports))
        if "wait" in job and not reports:
            seconds = 3 if "wait3" in job else FOREVER
            call = f'<wait xmlns="{TOOL_NS}"><text>{job}</text><seconds>{seconds}</seconds></wait>'
            return openai_ok(f"Waiting. {call}", model="m")
        if "retry" in job and not reports:  # the idempotent tool, answering in 4 s
            call = f'<retry xmlns="{TOOL_NS}"><text>{job}</text><seconds>4</seconds></retry>'
            return openai_ok(f"Waiting. {call}", model="m")
        delay = 2.0 if "slow" in job else 0.0
        return openai_ok(f"Done {job} on {version}.", model="m", delay=delay)

    def versions_of(self, job: str) -> list[str]:
        return [v for j, v, _ in self.seen if j == job]

    def reports_of(self, job: str) -> str:
        return "\n".join(r for j, _, r in self.seen if j == job)


class Store:
    """Read-only queries on the servers' store (SQLite's file, or PostgreSQL's database)."""

    def __init__(self, path: Path, url: str | None) -> None:
        self.path = path
        self.url = url

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self.url is not None:
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as pg:
                try:
                    return pg.execute(sql.replace("?", "%s"), args).fetchall()
                except psycopg.errors.UndefinedTable:
                    return []
        if not self.path.exists():
            return []
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            conn.close()

    def head(self, agent: str) -> tuple | None:
        rows = self.rows(
            "SELECT status, turn_version, turn_pin, active_agent_turn_id FROM agent_state_head "
            "WHERE agent_id = ?",
            (agent,),
        )
        return rows[0] if rows else None

    def step_versions(self, agent: str) -> dict[str, list[str]]:
        """Each Turn of ``agent``: the versions its steps ran on, in order."""
        out: dict[str, list[str]] = {}
        for turn, version in self.rows(
            "SELECT agent_turn_id, version FROM agent_steps WHERE agent_id = ? "
            "ORDER BY agent_turn_id, step_no",
            (agent,),
        ):
            out.setdefault(turn, []).append(version)
        return out

    def queued(self, agent: str) -> int:
        return self.rows(
            "SELECT count(*) FROM agent_inbox WHERE agent_id = ? AND message_type = 'turn' "
            "AND status = 'queued'",
            (agent,),
        )[0][0]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def backend(request, tmp_path) -> tuple[Store, dict[str, str]]:
    store = Store(tmp_path / "state" / "agents.sqlite3", None)
    if request.param == "sqlite":
        return store, {}
    store.url = request.getfixturevalue("pg_url")
    return store, {"AGENTS_TEST_STORE_URL": store.url}


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """The servers a test starts; any still running when it ends (it failed before
    stopping them) is killed."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


class Deploy:
    """The servers of one test, on one store, with one model."""

    def __init__(
        self,
        tmp_path: Path,
        model: VersionModel,
        store: Store,
        env: dict[str, str],
        servers: list[ServerProcess],
    ):
        self.tmp_path = tmp_path
        self.model = model
        self.store = store
        self.env = subprocess_env(
            VERSIONS_LLM_BASE_URL=model.base_url,
            VERSIONS_LLM_KEY="test-key",
            VERSIONS_ALICE_TOKEN=ALICE,
            VERSIONS_OPS_TOKEN=OPS,
            **env,
        )
        #: Every server started (the ``servers`` fixture kills those left running).
        self.servers = servers

    async def start(self, boot: Path) -> ServerProcess:
        # Both boot files in one folder: their <store path> is the same file.
        copy = trio.Path(self.tmp_path / boot.name)
        await copy.write_bytes(await trio.Path(boot).read_bytes())
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                Path(copy), "--http-port", "0", env=self.env, cwd=self.tmp_path, timeout=40
            )
        )
        self.servers.append(server)
        return server

    async def stop(self, server: ServerProcess) -> int:
        return await trio.to_thread.run_sync(lambda: server.stop(signal.SIGTERM))

    def cli(self, *args: str, token: str = OPS, timeout: float = 60) -> subprocess.CompletedProcess:
        env = dict(self.env, AGENTSERVER_TOKEN=token)
        return subprocess.run(
            [sys.executable, "-m", "agentserver", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=self.tmp_path,
            timeout=timeout,
        )

    async def drain(self, server: ServerProcess, into: list[subprocess.CompletedProcess]) -> None:
        """``agentserver drain --wait`` of ``server`` (the CLI, in a thread); its result
        goes into ``into``."""
        into.append(
            await trio.to_thread.run_sync(
                lambda: self.cli("drain", "--url", http_url(server), "--wait")
            )
        )

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        # Other processes write the store: there is no event to wait on, so poll it.
        with trio.move_on_after(PATIENCE):
            while True:
                if predicate():
                    return
                await trio.sleep(0.05)
        logs = "\n".join(s.stderr for s in self.servers)
        raise AssertionError(f"timed out waiting until {what}\nmodel: {self.model.seen}\n{logs}")

    async def get(self, server: ServerProcess, path: str, token: str = OPS) -> dict:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(
                http_url(server) + path, headers={"Authorization": f"Bearer {token}"}
            )
        assert response.status_code == 200, response.text
        return response.json()

    async def agent(self, server: ServerProcess, name: str) -> dict:
        doc = await self.get(server, "/v1/agents")
        return next(a for a in doc["agents"] if a["name"] == name)


def alice(server: ServerProcess, delivered: DeliveredIds | None = None):
    return open_client(server.host, server.port, client="alice", token=ALICE, delivered=delivered)


async def send(client: Client, agent: str, payload) -> str:
    return await client.send(payload, to=agent, thread=new_thread_id())


async def replies(client: Client, count: int) -> dict[str, Reply]:
    """``count`` replies by thread, then a quiet second in which nothing more arrives."""
    got: dict[str, Reply] = {}
    with trio.fail_after(PATIENCE):
        while len(got) < count:
            reply = await client.receive()
            assert reply.thread not in got, f"a second answer on {reply.thread}: {reply.raw!r}"
            got[reply.thread] = reply
    with trio.move_on_after(1.0) as quiet:
        extra = await client.receive()
    assert quiet.cancelled_caught, f"an extra reply arrived: {extra.raw!r}"
    return got


def text_of(reply: Reply, agent: str) -> str:
    return reply.payload.findtext(f"{{{ANSWER_NS[agent]}}}text") or ""


async def test_a_restart_onto_v2_upgrades_fails_and_pins(tmp_path, backend, servers):
    store, store_env = backend
    async with trio.open_nursery() as nursery:
        model = await VersionModel().start(nursery)
        deploy = Deploy(tmp_path, model, store, store_env, servers)
        first = await deploy.start(V1)
        threads: dict[str, str] = {}
        async with alice(first) as client:
            threads["keep"] = await send(client, "keeper", KeeperTask(text="job-wait-keep"))
            threads["pin"] = await send(client, "pinner", PinnerTask(text="job-wait-pin"))
            threads["type"] = await send(client, "typer", TypedTask(text="job-wait-type"))
            threads["queued"] = await send(client, "typer", TypedTask(text="job-queued"))
            # A pinned Turn whose call a restart sends again (an idempotent tool): its
            # result must not resume it on v2.
            threads["retry"] = await send(client, "pinner2", Pinner2Task(text="job-retry-pin2"))
            await deploy.until(
                lambda: (
                    all(
                        (store.head(a) or ("",))[0] == "suspended"
                        for a in ("keeper", "pinner", "typer", "pinner2")
                    )
                    and store.queued("typer") == 1
                ),
                "three Turns wait for the waiter and one task is queued",
            )
        assert store.head("keeper")[1:3] == ("k1", None)
        assert store.head("pinner")[1:3] == ("p1", "p1")
        assert await deploy.stop(first) == 0

        second = await deploy.start(V2)
        restarted = trio.current_time()
        async with alice(second) as client:
            got = await replies(client, 3)
            keep, typed, queued = (got[threads[k]] for k in ("keep", "type", "queued"))
            # The upgrade Turn went on with v2's prompt; the call to the tool v2 removed
            # was answered naming the change.
            assert text_of(keep, "keeper") == "Done job-wait-keep on Keeper two."
            assert model.versions_of("job-wait-keep") == ["Keeper one", "Keeper two"]
            assert "tool `waiter` is not in version k2 of agent keeper" in model.reports_of(
                "job-wait-keep"
            )
            assert text_of(typed, "typer") == "Done job-wait-type on Typer two."
            # (SQLite: "interrupted by a restart"; PostgreSQL: "lost with the process".)
            assert "No result from waiter: the tool call " in model.reports_of("job-wait-type")
            # The task queued on v1 no longer validates on v2: failed, with the reason.
            assert "version t2 of typer does not take this task (queued on version t1)" in (
                text_of(queued, "typer")
            ), queued.raw
            assert "job-queued" not in {j for j, _, _ in model.seen}
            # The pinned Turn did not run on v2: it waits for p1, and says so.
            assert model.versions_of("job-wait-pin") == ["Pinner one"]
            pinner = await deploy.agent(second, "pinner")
            assert pinner["active_turn"]["waiting_for_version"] == "p1", pinner
            assert pinner["version"] == "p2" and pinner["active_turn"]["pinned"] is True
            status = deploy.cli("status", "--url", http_url(second))
            assert "WAITING for version p1" in status.stdout, status.stdout + status.stderr
            view = await deploy.get(second, f"/v1/agents/keeper/tasks/{threads['keep']}", ALICE)
            assert [s["version"] for s in view["steps"]] == ["k1", "k2"], view
            assert view["version"] == "k2"
            # turns migrate moves it to v2, where it goes on.
            moved = deploy.cli(
                "turns", "migrate", "pinner", str(tmp_path / V2.name), "--from", "p1"
            )
            assert moved.returncode == 0, moved.stderr
            assert re.search(r"pinner: turn \w+: version p1 -> p2", moved.stdout), moved.stdout
            got = await replies(client, 1)
            assert text_of(got[threads["pin"]], "pinner") == "Done job-wait-pin on Pinner two."
            # Well past when a call sent again would have been answered: pinner2's Turn
            # did not run on v2; it waits for q1, its calls reported lost for then.
            await trio.sleep_until(restarted + 6)
            assert model.versions_of("job-retry-pin2") == ["Pinner2 one"]
            pinner2 = await deploy.agent(second, "pinner2")
            assert pinner2["active_turn"]["waiting_for_version"] == "q1", pinner2
        [pin_steps] = store.step_versions("pinner").values()
        assert pin_steps == ["p1", "p2"]
        upgrades = sorted(
            (agent, json.loads(meta)["from"], json.loads(meta)["to"])
            for agent, meta in store.rows(
                "SELECT agent_id, metadata FROM execution_edges WHERE primitive = 'upgrade'"
            )
        )
        assert upgrades == [("keeper", "k1", "k2"), ("typer", "t1", "t2")]
        assert await deploy.stop(second) == 0
        nursery.cancel_scope.cancel()


async def test_a_rollback_serves_each_pinned_turn_on_its_version(tmp_path, backend, servers):
    store, store_env = backend
    async with trio.open_nursery() as nursery:
        model = await VersionModel().start(nursery)
        deploy = Deploy(tmp_path, model, store, store_env, servers)
        threads: dict[str, str] = {}
        first = await deploy.start(V1)
        async with alice(first) as client:
            threads["pin"] = await send(client, "pinner", PinnerTask(text="job-wait-pin"))
            await deploy.until(lambda: store.head("pinner")[0] == "suspended", "pin waits")
        assert await deploy.stop(first) == 0

        second = await deploy.start(V2)
        async with alice(second) as client:
            threads["pin2"] = await send(client, "pinner2", Pinner2Task(text="job-wait-pin2"))
            threads["type"] = await send(
                client, "typer", TypedTaskV2(text="job-wait-type2", priority=1)
            )
            await deploy.until(
                lambda: (
                    store.head("pinner2")[0] == "suspended"
                    and store.head("typer")[0] == "suspended"
                ),
                "the Turns begun on v2 wait",
            )
        assert model.versions_of("job-wait-pin") == ["Pinner one"]  # not run on v2
        assert await deploy.stop(second) == 0

        third = await deploy.start(V1)  # the rollback
        async with alice(third) as client:
            got = await replies(client, 2)
            # Its own version serves the pinned Turn begun on it ...
            assert text_of(got[threads["pin"]], "pinner") == "Done job-wait-pin on Pinner one."
            # ... and the upgrade Turn begun on v2 continues on v1.
            assert text_of(got[threads["type"]], "typer") == "Done job-wait-type2 on Typer one."
            # The pinned Turn begun on v2 waits for it, and is shown waiting.
            pinner2 = await deploy.agent(third, "pinner2")
            assert pinner2["active_turn"]["waiting_for_version"] == "q2", pinner2
            assert model.versions_of("job-wait-pin2") == ["Pinner2 two"]
        assert store.step_versions("pinner") and all(
            v == ["p1", "p1"] for v in store.step_versions("pinner").values()
        )
        assert [v for v in store.step_versions("typer").values()] == [["t2", "t1"]]
        assert await deploy.stop(third) == 0
        nursery.cancel_scope.cancel()


async def test_a_call_granted_on_a_version_without_its_tool_fails_naming_the_change(
    tmp_path, backend, servers
):
    store, store_env = backend
    async with trio.open_nursery() as nursery:
        model = await VersionModel().start(nursery)
        deploy = Deploy(tmp_path, model, store, store_env, servers)
        first = await deploy.start(V1)
        delivered = DeliveredIds()  # the request may come again: she dropped it as a copy
        async with alice(first, delivered) as client:
            thread = await send(client, "payer", PayerTask(text="job-wait-pay"))
            with trio.fail_after(PATIENCE):
                request = approval_request(await client.receive())
            assert request is not None and request["agent"] == "payer"
        assert await deploy.stop(first) == 0
        second = await deploy.start(V2)  # payer's v2 has no waiter
        async with alice(second, delivered) as client:
            decision = ApprovalDecision(request=request["request"], grant=True, reason="ok")
            ack = await client.request(decision, to="payer", timeout=PATIENCE)
            assert approval_ack_status(ack) == "applied", ack.raw
            got = await replies(client, 1)
        assert text_of(got[thread], "payer") == "Done job-wait-pay on Payer two."
        reports = model.reports_of("job-wait-pay")
        assert "tool `waiter` is not in version y2 of agent payer" in reports, reports
        assert await deploy.stop(second) == 0
        nursery.cancel_scope.cancel()


async def test_a_drained_server_finishes_hands_over_takes_nothing_new_and_exits_0(
    tmp_path, backend, servers
):
    store, store_env = backend
    async with trio.open_nursery() as nursery:
        model = await VersionModel().start(nursery)
        deploy = Deploy(tmp_path, model, store, store_env, servers)
        first = await deploy.start(V1)
        threads: dict[str, str] = {}
        # A reply sent as the server exits may come again (unacknowledged): her client
        # drops the copy, as every client of hers should (docs/wire.md).
        delivered = DeliveredIds()
        got: dict[str, Reply] = {}
        async with alice(first, delivered) as client:
            # An upgrade Turn whose tool answers in three seconds, and a slow model call.
            threads["wait3"] = await send(client, "typer", TypedTask(text="job-wait3-type"))
            await deploy.until(lambda: store.head("typer")[0] == "suspended", "typer waits")
            threads["slow"] = await send(client, "keeper", KeeperTask(text="job-slow-keep"))
            await deploy.until(lambda: model.in_flight == 1, "the slow model call is out")
            drained: list[subprocess.CompletedProcess] = []
            nursery.start_soon(deploy.drain, first, drained)
            await deploy.until(lambda: "draining" in first.stderr, "the server drains")
            threads["late"] = await send(client, "pinner", PinnerTask(text="job-late-pin"))
            # (The server exits right after its last answer: no quiet second here; the
            # next server's replies show nothing came twice.)
            with trio.move_on_after(PATIENCE):
                while True:
                    try:
                        reply = await client.receive()
                    except ConnectionClosed:
                        break
                    got[reply.thread] = reply
        assert await trio.to_thread.run_sync(lambda: first.wait_exit(PATIENCE)) == 0
        await deploy.until(lambda: bool(drained), "drain --wait returns")
        assert drained[0].returncode == 0, drained[0].stdout + drained[0].stderr
        assert "drained" in drained[0].stdout
        # It finished the Turn it was running ...
        assert list(got) == [threads["slow"]], [r.raw for r in got.values()]
        assert text_of(got[threads["slow"]], "keeper") == "Done job-slow-keep on Keeper one."
        # ... handed the upgrade Turn over at its next step, and took no new task: the
        # next server (v2) runs both.
        assert model.versions_of("job-wait3-type") == ["Typer one"]
        assert model.versions_of("job-late-pin") == []
        second = await deploy.start(V2)
        async with alice(second, delivered) as client:
            got = await replies(client, 2)
            assert text_of(got[threads["late"]], "pinner") == "Done job-late-pin on Pinner two."
            assert text_of(got[threads["wait3"]], "typer") == "Done job-wait3-type on Typer two."
        assert "Result from waiter" in model.reports_of("job-wait3-type")  # its own result
        assert await deploy.stop(second) == 0
        nursery.cancel_scope.cancel()


@pytest.mark.postgresql
async def test_a_rolling_deploy_on_postgresql(tmp_path, pg_url, servers):
    store = Store(tmp_path / "unused.sqlite3", pg_url)
    async with trio.open_nursery() as nursery:
        model = await VersionModel().start(nursery)
        deploy = Deploy(tmp_path, model, store, {"AGENTS_TEST_STORE_URL": pg_url}, servers)
        old = await deploy.start(V1)
        threads: dict[str, str] = {}
        delivered = DeliveredIds()
        got: dict[str, Reply] = {}
        drained: list[subprocess.CompletedProcess] = []
        async with alice(old, delivered) as client:
            # A pinned Turn and an upgrade Turn on v1 whose tools answer in three seconds.
            threads["pin"] = await send(client, "pinner", PinnerTask(text="job-wait3-pin"))
            threads["type"] = await send(client, "typer", TypedTask(text="job-wait3-type"))
            await deploy.until(
                lambda: (
                    store.head("pinner")[0] == "suspended" and store.head("typer")[0] == "suspended"
                ),
                "both wait",
            )
            new = await deploy.start(V2)

            def both_live() -> bool:
                rows = store.rows(
                    "SELECT versions FROM agentserver_processes WHERE lease_until >= "
                    "extract(epoch from clock_timestamp())"
                )
                served = [json.loads(r[0] or "{}").get("keeper") for r in rows]
                return sorted(v for v in served if v) == ["k1", "k2"]

            await deploy.until(both_live, "both versions are live")
            await trio.sleep(0.6)  # a heartbeat or two: the v1 process knows it is older
            # New tasks sent to the v1 process run on v2 ...
            for i in range(4):
                threads[f"new{i}"] = await send(client, "keeper", KeeperTask(text=f"job-new{i}"))
            # ... and the v1 process drains while its pinned Turn's call is out.
            nursery.start_soon(deploy.drain, old, drained)
            with trio.move_on_after(PATIENCE):
                while len(got) < 6:
                    try:
                        reply = await client.receive()
                    except ConnectionClosed:
                        break  # it exited: the rest is kept for her
                    got[reply.thread] = reply
        assert await trio.to_thread.run_sync(lambda: old.wait_exit(PATIENCE)) == 0
        await deploy.until(lambda: bool(drained), "drain --wait returns")
        assert drained[0].returncode == 0, drained[0].stdout + drained[0].stderr
        async with alice(new, delivered) as client:
            rest = await replies(client, 6 - len(got))
            assert not set(rest) & set(got)
            got.update(rest)
        for i in range(4):
            assert text_of(got[threads[f"new{i}"]], "keeper") == f"Done job-new{i} on Keeper two."
        # The pinned Turn finished on v1, in the draining v1 process.
        assert text_of(got[threads["pin"]], "pinner") == "Done job-wait3-pin on Pinner one."
        assert all(v == ["p1", "p1"] for v in store.step_versions("pinner").values())
        # The upgrade Turn was handed over at its next step, to the v2 process.
        assert text_of(got[threads["type"]], "typer") == "Done job-wait3-type on Typer two."
        assert list(store.step_versions("typer").values()) == [["t1", "t2"]]
        assert all(set(v) == {"k2"} for v in store.step_versions("keeper").values())
        status = await deploy.get(new, "/v1/status")
        keeper = next(a for a in status["agents"] if a["name"] == "keeper")
        assert keeper["version"] == "k2"
        assert await deploy.stop(new) == 0
        nursery.cancel_scope.cancel()
