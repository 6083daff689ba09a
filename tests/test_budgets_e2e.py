"""Spend budgets black-box (issue 37): real servers, real sockets, a scripted model with
usage on loopback HTTP.

The reservation race: 100 concurrent tasks from 4 named clients to three agents, all
paying into one organism budget worth about 10 calls (a call's worst case is its counted
prompt plus ``max-tokens``; the model reports exactly that as its usage). The spend never
exceeds the budget by more than one call's worst case; every task is answered once, and
exactly the refused tasks are answered ``failed`` with the budget's reason, with no
model call made for them. On SQLite with one server; on PostgreSQL with two servers
sharing the store. Then a SIGKILL while reservations are held: the holds are released
when the next server resumes their Turns, never leaked; issue 43's reproduction (a
``total`` budget, a restart, and on PostgreSQL another process's takeover) checks that
``reserved`` comes back to what the resumed calls hold. And fair share is on by default.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from agents_crash_support import MixTask, PlanTask
from llm_fakes import FakeServer, Script, Seen, openai_ok, openai_stream
from serverproc import ServerProcess, subprocess_env

from agentserver.core.namespaces import BOOT_NS
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.llm.tokens import PER_MESSAGE, PER_REQUEST, estimate_text_tokens
from agentserver.net.client import Client, ConnectionClosed, open_client

TASKS = 100
CLIENTS = ("alice", "bob", "carol", "dave")
TOKENS = {name: f"{name}-budget-token" for name in CLIENTS}
AGENTS = (("assistant", Task), ("planner", PlanTask), ("mixer", MixTask))
MAX_TOKENS = 1000
#: About ten calls' worst case (a prompt here is a few hundred tokens).
LIMIT = 10 * 1500
PATIENCE = 60.0
#: Spent, or (issue 45) room left but less than the call's worst case.
REASON = re.compile(
    r"^budget exhausted: (organism \(day\) is spent"
    r"|this call needs up to [\d,]+ tokens; [\d,]+ remain of organism \(day\));"
    r" it resets at \d{4}-\d\d-\d\dT00:00:00Z$"
)


def boot(
    store: str, *, limit: int = LIMIT, llm_timeout: int = 60, max_tokens: int = MAX_TOKENS
) -> str:
    agent = (
        f'<agent model="m" max-steps="4" max-tokens="{max_tokens}" llm-timeout="{llm_timeout}"/>'
    )
    clients = "\n".join(f'<client name="{c}" token-env="B_{c.upper()}_TOKEN"/>' for c in CLIENTS)
    return f"""<organism xmlns="{BOOT_NS}" name="budgets">
  <limits hello-timeout="2" read-timeout="5" drain-timeout="1" write-timeout="2"/>
  <budget tokens="{limit}" period="day"/>
  <clients>
{clients}
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="B_LLM_BASE_URL" api-key-env="B_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  {store}
  <listeners>
    <listener name="assistant" handler="assistant" agent="true">{agent}</listener>
    <listener name="planner" handler="agents_crash_support:agent_placeholder" agent="true">
      <accepts type="agents_crash_support:PlanTask"/>
      <responds type="agents_crash_support:PlanAnswer"/>
      {agent}
    </listener>
    <listener name="mixer" handler="agents_crash_support:agent_placeholder" agent="true">
      <accepts type="agents_crash_support:MixTask"/>
      <responds type="agents_crash_support:MixAnswer"/>
      {agent}
    </listener>
  </listeners>
</organism>
"""


def worst_case(body: dict[str, Any]) -> int:
    """The worst case the server reserved for this request (same estimate)."""
    prompt = PER_REQUEST + sum(
        PER_MESSAGE + estimate_text_tokens(str(m.get("content", ""))) for m in body["messages"]
    )
    return prompt + int(body["max_tokens"])


class UsageModel(FakeServer):
    """Answers each task at once, reporting its worst case as its usage (so that each
    call spends what it reserved); ``hold_s`` keeps calls in flight together."""

    def __init__(self, hold_s: float = 0.05, usage: bool = True) -> None:
        super().__init__("openai")
        self.worst: list[int] = []
        self.hold_s = hold_s
        #: False: streams end without a usage chunk (settled at the worst case)
        self.usage = usage

    def default(self, seen: Seen) -> Script:
        w = worst_case(seen.body)
        self.worst.append(w)
        prompt = w - int(seen.body["max_tokens"])
        done = int(seen.body["max_tokens"])
        if seen.body.get("stream"):
            return openai_stream(
                ["done"],
                prompt_tokens=prompt,
                completion_tokens=done,
                chunk_delay=self.hold_s,
                include_usage=self.usage,
            )
        return openai_ok("done", prompt_tokens=prompt, completion_tokens=done, delay=self.hold_s)


def store_rows(sqlite_path: Path | None, pg_url: str | None, sql: str) -> list[tuple]:
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url) as db:
            return db.execute(sql).fetchall()
    assert sqlite_path is not None
    db = sqlite3.connect(sqlite_path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


async def test_a_stream_without_usage_is_settled_at_its_worst_case(tmp_path):
    store = '<store path="state/agents.sqlite3" worker-concurrency="4" watchdog-interval="0.2"/>'
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(boot(store))
    async with trio.open_nursery() as nursery:
        model = await UsageModel(hold_s=0, usage=False).start(nursery)
        [server] = await start_servers(boot_file, env_for(model, None), tmp_path, 1)
        try:
            async with open_client(
                server.host, server.port, client="alice", token=TOKENS["alice"]
            ) as client:
                reply = await client.request(Task(text="hi"), to="assistant", timeout=20)
                assert "".join(reply.payload.itertext()) == "done"
        finally:
            assert await trio.to_thread.run_sync(server.stop) == 0, server.stderr
            nursery.cancel_scope.cancel()
    assert all(r.body.get("stream") for r in model.requests)
    [(spent, reserved)] = store_rows(
        tmp_path / "state" / "agents.sqlite3",
        None,
        "SELECT spent_tokens, reserved_tokens FROM budget_spend WHERE budget = 'organism'",
    )
    assert (spent, reserved) == (model.worst[0], 0)  # the worst case, never zero


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def backend(request) -> tuple[str | None, str]:
    if request.param == "sqlite":
        return (
            None,
            '<store path="state/agents.sqlite3" worker-concurrency="4" watchdog-interval="0.2"/>',
        )
    url = request.getfixturevalue("pg_url")
    return url, (
        '<store url-env="B_STORE_URL" worker-concurrency="4" watchdog-interval="0.2"'
        ' lease="1" heartbeat="0.25"/>'
    )


def env_for(model: FakeServer, pg_url: str | None) -> dict[str, str]:
    extra = {f"B_{c.upper()}_TOKEN": TOKENS[c] for c in CLIENTS}
    if pg_url is not None:
        extra["B_STORE_URL"] = pg_url
    return subprocess_env(B_LLM_BASE_URL=model.base_url, B_LLM_KEY="k", **extra)


async def start_servers(
    boot_file: Path, env: dict[str, str], root: Path, n: int, first_index: int = 0
):
    servers = []
    for i in range(first_index, first_index + n):
        cwd = root / f"s{i}"
        cwd.mkdir()
        servers.append(
            await trio.to_thread.run_sync(
                lambda cwd=cwd: ServerProcess.start(boot_file, env=env, cwd=cwd)
            )
        )
    return servers


async def test_the_reservation_race_never_overspends(tmp_path, backend):
    pg_url, store = backend
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(boot(store))
    answers: dict[str, list[tuple[str | None, str]]] = {}
    sent: set[str] = set()
    done = trio.Event()

    async with trio.open_nursery() as nursery:
        model = await UsageModel().start(nursery)
        servers = await start_servers(
            boot_file, env_for(model, pg_url), tmp_path, 1 if pg_url is None else 2
        )
        try:

            async def receive_all(client: Client) -> None:
                try:
                    while True:
                        reply = await client.receive()
                        assert reply.thread in sent, reply.raw
                        text = "".join(reply.payload.itertext())
                        answers.setdefault(reply.thread, []).append(
                            (reply.payload.get("status"), text)
                        )
                        if len(answers) == TASKS:
                            done.set()
                except ConnectionClosed:
                    return

            async def run_client(k: int, name: str) -> None:
                server = servers[k % len(servers)]
                async with open_client(
                    server.host, server.port, client=name, token=TOKENS[name]
                ) as client:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(receive_all, client)
                        for i in range(k, TASKS, len(CLIENTS)):
                            agent, payload = AGENTS[i % len(AGENTS)]
                            thread = new_thread_id()
                            sent.add(thread)
                            await client.send(payload(text=f"task {i}"), to=agent, thread=thread)
                        await done.wait()
                        await trio.sleep(0.5)  # nothing more may arrive
                        inner.cancel_scope.cancel()

            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as clients:
                    for k, name in enumerate(CLIENTS):
                        clients.start_soon(run_client, k, name)
        finally:
            for s in servers:
                assert await trio.to_thread.run_sync(s.stop) == 0, s.stderr
            nursery.cancel_scope.cancel()

    assert len(answers) == TASKS and all(len(a) == 1 for a in answers.values()), answers
    # (only the assistant's reply type takes status="failed"; the others carry the text)
    succeeded = [a[0] for a in answers.values() if a[0][1] == "done"]
    refused = [a[0] for a in answers.values() if a[0][1] != "done"]
    assert all(REASON.match(text) for _, text in refused), refused[:3]
    assert all(status is None for status, _ in succeeded)
    # one model call per admitted task, none for a refused one
    assert len(succeeded) == len(model.worst)
    assert 5 <= len(succeeded) <= 20 and len(refused) == TASKS - len(succeeded)
    sqlite_path = tmp_path / "state" / "agents.sqlite3" if pg_url is None else None
    [(spent, reserved, refusals, limit)] = store_rows(
        sqlite_path,
        pg_url,
        "SELECT spent_tokens, reserved_tokens, refusals, limit_tokens FROM budget_spend"
        " WHERE budget = 'organism'",
    )
    assert spent == sum(model.worst) and reserved == 0
    assert spent <= limit + max(model.worst)
    assert refusals == len(refused)
    print(f"admitted {len(succeeded)}, refused {len(refused)}, spent {spent} of {limit}")


class SlowModel(FakeServer):
    """Never answers within the test until ``fast``: its calls hold their reservations."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.calls = 0
        self.fast = False
        self.all_holding = trio.Event()

    def default(self, seen: Seen) -> Script:
        self.calls += 1
        if self.calls == len(AGENTS):
            self.all_holding.set()
        if self.fast:
            return openai_ok("done", prompt_tokens=10, completion_tokens=5)
        return openai_ok("late", delay=600)


async def test_a_killed_servers_reservations_are_released_by_the_watchdog(tmp_path, backend):
    pg_url, store = backend
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(boot(store, llm_timeout=2))
    sqlite_path = tmp_path / "state" / "agents.sqlite3" if pg_url is None else None
    query = "SELECT reserved_tokens, spent_tokens FROM budget_spend WHERE budget = 'organism'"
    async with trio.open_nursery() as nursery:
        model = await SlowModel().start(nursery)
        env = env_for(model, pg_url)
        [server] = await start_servers(boot_file, env, tmp_path, 1)
        try:
            async with open_client(
                server.host, server.port, client="alice", token=TOKENS["alice"]
            ) as client:
                for agent, payload in AGENTS:
                    await client.send(payload(text="hold"), to=agent, thread=new_thread_id())
                with trio.fail_after(20):
                    await model.all_holding.wait()
            [(reserved, spent)] = store_rows(sqlite_path, pg_url, query)
            assert reserved > 0 and spent == 0
            await trio.to_thread.run_sync(server.proc.kill)
            assert await trio.to_thread.run_sync(server.wait_exit, 10) < 0
            # the dead server's holds are still there
            [(reserved, spent)] = store_rows(sqlite_path, pg_url, query)
            assert reserved > 0
            # the Turns resumed after the restart call the model again: answered at once
            model.fast = True
            again = await trio.to_thread.run_sync(
                lambda: ServerProcess.start(boot_file, env=env, cwd=tmp_path / "s0")
            )
            try:
                # released as the restart resumes the Turns (issue 43; before, only at
                # the expiry: the call's bound, llm-timeout 2 s, + 10 s), and the resumed
                # Turns' calls settled: wait for both (reserved is 0 for a moment between
                # the release and the resumed reservations)
                done = (0, 15 * len(AGENTS))
                for _ in range(60):  # another process's store: poll
                    if store_rows(sqlite_path, pg_url, query)[0] == done:
                        break
                    await trio.sleep(0.5)
                [(reserved, spent)] = store_rows(sqlite_path, pg_url, query)
                assert reserved == 0
                assert store_rows(sqlite_path, pg_url, "SELECT count(*) FROM budget_holds") == [
                    (0,)
                ]
                # the resumed Turns' calls were settled (spent), the dead ones' not
                assert spent == 15 * len(AGENTS)
            finally:
                await trio.to_thread.run_sync(again.stop)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()


async def until(check: Callable[[], bool], what: str, polls: int = 600) -> None:
    """Wait (bounded: ``polls`` reads 0.1 s apart) until ``check()`` holds."""
    for _ in range(polls):
        if check():
            return
        await trio.sleep(0.1)
    raise AssertionError(f"never: {what}")


class HangThenGate(FakeServer):
    """Issue 43's reproduction: the first life's calls hang (they hold their reservations
    when the server is killed); after ``restarted``, calls wait for ``gate``, then
    answer with ``USAGE`` tokens. Records each call's worst case by life."""

    USAGE = (100, 83)

    def __init__(self) -> None:
        super().__init__("openai")
        self.restarted = False
        self.gate = trio.Event()
        self.worst: dict[bool, list[int]] = {False: [], True: []}
        self.waiting: dict[bool, trio.Event] = {False: trio.Event(), True: trio.Event()}

    def default(self, seen: Seen) -> Script:
        life = self.restarted
        self.worst[life].append(worst_case(seen.body))
        if len(self.worst[life]) == 2:
            self.waiting[life].set()
        if not life:
            return openai_ok("late", delay=600)
        prompt, done = self.USAGE
        if seen.body.get("stream"):
            script = openai_stream(["done"], prompt_tokens=prompt, completion_tokens=done)
        else:
            script = openai_ok("done", prompt_tokens=prompt, completion_tokens=done)
        script.wait = self.gate
        return script


@pytest.fixture(
    params=[
        "sqlite-restart",
        pytest.param("postgresql-restart", marks=pytest.mark.postgresql),
        pytest.param("postgresql-takeover", marks=pytest.mark.postgresql),
    ]
)
def holds_case(request) -> tuple[str | None, str, bool]:
    """(store URL or None, ``<store>``, whether another process takes over instead of a
    restart)."""
    kind, how = request.param.split("-")
    if kind == "sqlite":
        store = (
            '<store path="state/agents.sqlite3" worker-concurrency="4" watchdog-interval="0.2"/>'
        )
        return None, store, False
    url = request.getfixturevalue("pg_url")
    store = (
        '<store url-env="B_STORE_URL" worker-concurrency="4" watchdog-interval="0.2"'
        ' lease="1" heartbeat="0.25"/>'
    )
    return url, store, how == "takeover"


async def test_a_killed_servers_holds_go_with_its_turns_not_its_process(tmp_path, holds_case):
    """Issue 43: alice's ``<budget tokens="1339" period="total">``; two tasks whose model
    calls hang hold two worst cases; the server is SIGKILLed. Restarted on the same store
    (or, on PostgreSQL, with another process taking its Turns over), the Turns resume,
    and as they do the dead run's holds are released: ``reserved`` is then exactly what
    the resumed, running calls hold, both tasks are answered (none refused for the
    tokens the dead process held), and at the end nothing is reserved. ``llm-timeout`` is
    an hour: the holds' expiry cannot be what frees them."""
    pg_url, store, takeover = holds_case
    text = boot(store, limit=10**9, llm_timeout=3600, max_tokens=300).replace(
        '<client name="alice" token-env="B_ALICE_TOKEN"/>',
        '<client name="alice" token-env="B_ALICE_TOKEN">'
        '<budget tokens="1339" period="total"/></client>',
    )
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(text)
    sqlite_path = tmp_path / "state" / "agents.sqlite3" if pg_url is None else None
    query = (
        "SELECT reserved_tokens, spent_tokens, refusals FROM budget_spend"
        " WHERE budget = 'client:alice'"
    )

    def alice_row() -> tuple[int, int, int]:
        [row] = store_rows(sqlite_path, pg_url, query)
        return row

    async with trio.open_nursery() as nursery:
        model = await HangThenGate().start(nursery)
        env = env_for(model, pg_url)
        [first] = await start_servers(boot_file, env, tmp_path, 1)
        servers = [first]
        try:
            async with open_client(
                first.host, first.port, client="alice", token=TOKENS["alice"]
            ) as client:
                threads = [new_thread_id() for _ in range(2)]
                # two agents (an agent runs one Turn at a time)
                for thread, (agent, payload) in zip(threads, AGENTS, strict=False):
                    await client.send(payload(text="hold"), to=agent, thread=thread)
                with trio.fail_after(PATIENCE):
                    await model.waiting[False].wait()
            dead = model.worst[False]
            # the reproduction's shape: two holds fit, four do not
            assert 2 * max(dead) <= 1339 < 4 * min(dead), dead
            assert alice_row() == (sum(dead), 0, 0)
            if takeover:  # the other process is up before the kill: its watchdog acts
                servers += await start_servers(boot_file, env, tmp_path, 1, first_index=1)
            await trio.to_thread.run_sync(first.proc.kill)
            assert await trio.to_thread.run_sync(first.wait_exit, 10) < 0
            assert alice_row()[0] == sum(dead)  # the dead process's holds are still there
            model.restarted = True
            if not takeover:
                again = await trio.to_thread.run_sync(
                    lambda: ServerProcess.start(boot_file, env=env, cwd=tmp_path / "s0")
                )
                servers.append(again)
            survivor = servers[-1]
            # the Turns resumed: both calls made again (none refused), and held now
            with trio.fail_after(PATIENCE):
                await model.waiting[True].wait()
            running = model.worst[True]
            assert len(running) == 2
            # reserved comes back to what the running calls hold (another process's
            # store: a bounded poll)
            await until(lambda: alice_row()[0] == sum(running), "reserved is what runs")
            assert alice_row() == (sum(running), 0, 0)
            async with open_client(
                survivor.host, survivor.port, client="alice", token=TOKENS["alice"]
            ) as client:
                model.gate.set()
                answers = {}
                with trio.fail_after(PATIENCE):
                    while len(answers) < 2:
                        reply = await client.receive()
                        answers[reply.thread] = "".join(reply.payload.itertext())
            assert answers == {t: "done" for t in threads}, answers
            await until(lambda: alice_row()[0] == 0, "nothing reserved")
            assert alice_row() == (0, 2 * sum(HangThenGate.USAGE), 0)
            assert store_rows(sqlite_path, pg_url, "SELECT count(*) FROM budget_holds") == [(0,)]
        finally:
            for s in servers:
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()


class FirstCallWaits(FakeServer):
    """The first call waits for ``gate`` (its Turn runs while the others queue); every
    call answers ``done``. ``order``: each call's task text, in the order made."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.gate = trio.Event()
        self.first = trio.Event()
        self.order: list[str] = []

    def default(self, seen: Seen) -> Script:
        said = str(seen.body["messages"][-1]["content"])
        self.order.append(said.split("<text>")[1].split("</text>")[0])
        if seen.body.get("stream"):
            script = openai_stream(["done"], prompt_tokens=10, completion_tokens=5)
        else:
            script = openai_ok("done", prompt_tokens=10, completion_tokens=5)
        if len(self.order) == 1:
            self.first.set()
            script.wait = self.gate
        return script


async def test_fair_share_is_on_by_default(tmp_path, backend):
    """Issue 43: without ``fair-share`` on ``<store>``, a client flooding an agent with
    20 tasks delays another client's task by at most the Turn running when it arrives
    (first come, first served it would be the 21st)."""
    pg_url, store = backend
    assert "fair-share" not in store
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(boot(store, limit=10**9))
    sqlite_path = tmp_path / "state" / "agents.sqlite3" if pg_url is None else None
    queued = "SELECT count(*) FROM agent_inbox WHERE agent_id = 'assistant' AND status = 'queued'"
    flood = [f"flood {i}" for i in range(20)]
    async with trio.open_nursery() as nursery:
        model = await FirstCallWaits().start(nursery)
        [server] = await start_servers(boot_file, env_for(model, pg_url), tmp_path, 1)
        try:
            async with (
                open_client(server.host, server.port, client="alice", token=TOKENS["alice"]) as a,
                open_client(server.host, server.port, client="bob", token=TOKENS["bob"]) as b,
            ):
                for text in flood:
                    await a.send(Task(text=text), to="assistant", thread=new_thread_id())
                with trio.fail_after(PATIENCE):
                    await model.first.wait()
                await until(
                    lambda: store_rows(sqlite_path, pg_url, queued) == [(len(flood) - 1,)],
                    "the flood is queued behind its first task",
                )
                await b.send(Task(text="quiet"), to="assistant", thread=new_thread_id())
                await until(
                    lambda: store_rows(sqlite_path, pg_url, queued) == [(len(flood),)],
                    "bob's task is queued",
                )
                model.gate.set()
                with trio.fail_after(PATIENCE):
                    reply = await b.receive()
                    assert "".join(reply.payload.itertext()) == "done"
                    for _ in flood:
                        await a.receive()
        finally:
            assert await trio.to_thread.run_sync(server.stop) == 0, server.stderr
            nursery.cancel_scope.cancel()
    # the Turn running when bob's task arrived, then bob's
    assert model.order[:2] == ["flood 0", "quiet"], model.order
    assert [t for t in model.order if t != "quiet"] == flood  # FIFO within alice
