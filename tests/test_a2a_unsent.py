"""An A2A task recorded and never sent (docs/a2a.md, "A task recorded, never sent"): the
process that recorded it was killed before it sent it (found by the chaos soak,
``--seed=4301``). The same message again sends it, once: the task reaches its agent and
ends; more resends, concurrent ones included (on PostgreSQL through two processes), never
queue it twice. The real server (a subprocess) on SQLite and PostgreSQL, raw JSON-RPC over
httpx; the killed process's leftover is written into the stopped server's store as
``a2a_record`` writes it (its row, no inbox row on its thread)."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid

import httpx
import trio
from httputil import http_url
from serverproc import DATA
from test_a2a_expose import ALICE, A2aModel, start, store_env  # noqa: F401 (a fixture)
from test_a2a_pruned import rpc
from test_agents_crash import Store
from test_store_views import opener  # noqa: F401 (a fixture)

from agentserver.agents.store.rows import MultitaskAnswers
from agentserver.agents.store.sql import a2a, inbox, multitask

PATIENCE = 40.0


def message(message_id: str, text: str) -> dict:
    return {
        "message": {
            "messageId": message_id,
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            "metadata": {"skill": "planner"},
        }
    }


def leave_unsent(store: Store, owner: str, message_id: str, text: str) -> str:
    """Write what a process killed between ``a2a_record`` and its send leaves: the task's
    row, nothing else. Its id."""
    task_id, context_id = str(uuid.uuid4()), str(uuid.uuid4())
    kept = message(message_id, text)["message"] | {"taskId": task_id, "contextId": context_id}
    row = (task_id, "planner", context_id, owner, message_id, json.dumps(kept), time.time())
    sql = (
        "INSERT INTO a2a_tasks (task_id, agent_id, context_id, owner, message_id, message, "
        "refusal, created_at) VALUES (?, ?, ?, ?, ?, ?, NULL, ?)"
    )
    if store.url is not None:
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as pg:
            pg.execute(sql.replace("?", "%s"), row)
    else:
        conn = sqlite3.connect(store.path)
        try:
            with conn:
                conn.execute(sql, row)
        finally:
            conn.close()
    return task_id


def enqueued(store: Store, task_id: str) -> int:
    """Inbox rows (Enqueues) of the planner on the task's thread."""
    rows = store.rows("SELECT reply_ref FROM agent_inbox WHERE agent_id = 'planner'")
    return sum(1 for (ref,) in rows if ref and json.loads(ref).get("caller_thread") == task_id)


async def test_a_task_recorded_and_never_sent_is_sent_once_by_its_resend(tmp_path, store_env):  # noqa: F811
    boot = tmp_path / "boot.xml"
    boot.write_text((DATA / "a2a-boot.xml").read_text())
    store = Store(tmp_path / "state" / "agents.sqlite3")  # beside boot.xml
    store.url = store_env.get("AGENTS_TEST_STORE_URL")
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env, boot=boot)
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=30) as http:
                sent = await rpc(http, "SendMessage", message("m-first", "first one"))
                assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", sent
        finally:
            await trio.to_thread.run_sync(server.stop)
        ((owner,),) = store.rows("SELECT owner FROM a2a_tasks WHERE message_id = 'm-first'")
        lost = leave_unsent(store, owner, "m-lost", "lost one")
        raced = leave_unsent(store, owner, "m-raced", "raced one")
        servers = [await start(tmp_path, model, store_env, boot=boot)]
        if store.url is not None:  # a second process on the shared store
            servers.append(await start(tmp_path, model, store_env, "b", boot=boot))
        try:
            urls = [http_url(s) for s in servers]
            async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
                # Recorded, never sent: submitted, and nothing would ever move it.
                got = await rpc(http, "GetTask", {"id": lost})
                assert got["result"]["status"]["state"] == "TASK_STATE_SUBMITTED", got
                assert enqueued(store, lost) == 0
                # Its resend sends it: it ends, answered from the recorded message.
                again = await rpc(http, "SendMessage", message("m-lost", "lost one"))
                task = again["result"]["task"]
                assert task["id"] == lost, again
                assert task["status"]["state"] == "TASK_STATE_COMPLETED", again
                assert task["artifacts"][0]["parts"][0]["text"] == "You asked: lost one"
                once = await rpc(http, "SendMessage", message("m-lost", "lost one"))
                assert once["result"]["task"]["id"] == lost, once
                assert enqueued(store, lost) == 1

            # Many resends at once (through every process): the task is queued once.
            async def resend(url: str) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    body = message("m-raced", "raced one") | {
                        "configuration": {"returnImmediately": True}
                    }
                    answer = await rpc(client, "SendMessage", body)
                    assert answer["result"]["task"]["id"] == raced, answer

            async with trio.open_nursery() as resends:
                for i in range(16):
                    resends.start_soon(resend, urls[i % len(urls)])
            async with httpx.AsyncClient(base_url=urls[-1], timeout=30) as http:
                with trio.fail_after(PATIENCE):
                    while True:
                        got = await rpc(http, "GetTask", {"id": raced})
                        if got["result"]["status"]["state"] == "TASK_STATE_COMPLETED":
                            break
                        await trio.sleep(0.2)
                assert got["result"]["artifacts"][0]["parts"][0]["text"] == "You asked: raced one"
            assert enqueued(store, raced) == 1
            # And no resend became a task of its own (a second send on the task's thread
            # in one process is given a new thread by the pump: http/sendonce.py).
            planner = store.rows("SELECT count(*) FROM agent_inbox WHERE agent_id = 'planner'")
            assert planner == [(3,)], planner
        finally:
            logs = "".join(s.stderr for s in servers)
            for s in servers:
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()
    assert "Unhandled exception" not in logs


async def test_an_a2a_tasks_enqueue_again_is_dropped_in_the_store(opener, request, tmp_path):  # noqa: F811
    """The agent's side: an Enqueue of an A2A task already enqueued (its first send was
    still in flight when its resend came) queues nothing, whichever way in (plain,
    double-texting), concurrent ones through two stores (processes) included; a refusal
    of the second send leaves the task as the first made it. Other threads: unchanged."""
    store = await opener()
    check = Store(tmp_path / "agents.sqlite3")
    shared = request.node.callspec.params["opener"] == "postgresql"
    if shared:
        check.url = request.getfixturevalue("pg_url")
    task, _ = await store.run(a2a.record, "t-1", "planner", "c-1", "alice", "m-1", "{}")
    first = await store.run(
        inbox.enqueue_turn, "planner", b"<task/>", {"caller_thread": task, "hop": "h1"}
    )
    again = await store.run(
        inbox.enqueue_turn, "planner", b"<task/>", {"caller_thread": task, "hop": "h2"}
    )
    answers = MultitaskAnswers(busy=b"<busy/>", ended=b"<ended/>", superseded=b"<s/>")
    texted = await store.run(
        multitask.enqueue_multitask,
        "planner",
        b"<task/>",
        {"caller_thread": task, "hop": "h3"},
        conversation="c-1",
        mode="interrupt",
        answers=answers,
    )
    assert again.inbox_id == first.inbox_id == texted.inbox_id
    assert enqueued(check, task) == 1
    await store.run1(a2a.reject, task, "refused: a second send refused")
    row = await store.read(a2a.task, task)
    assert row is not None and row["refusal"] is None and row["view"] is not None
    # Two processes' Enqueues of one task at once (SQLite: one process's): one row.
    other = await opener() if shared else store
    raced, _ = await store.run(a2a.record, "t-2", "planner", "c-2", "alice", "m-2", "{}")
    got: list[str] = []

    async def enqueue(on, hop: str) -> None:
        done = await on.run(
            inbox.enqueue_turn, "planner", b"<task/>", {"caller_thread": raced, "hop": hop}
        )
        got.append(done.inbox_id)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(enqueue, (store, other)[i % 2], f"r{i}")
    assert len(set(got)) == 1 and enqueued(check, raced) == 1
    # Not an A2A task's thread: every Enqueue is queued.
    plain = [
        await store.run(inbox.enqueue_turn, "planner", b"<task/>", {"caller_thread": "t-x"})
        for _ in "ab"
    ]
    assert plain[0].inbox_id != plain[1].inbox_id and enqueued(check, "t-x") == 2
