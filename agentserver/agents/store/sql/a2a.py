"""A2A tasks (docs/a2a.md): which of our tasks an A2A client sent, under which context,
with which message, and what became of them, read from the durable state.

An A2A task is one of our tasks: its id is the thread its task was sent on, so every
fact about it (queued, running, waiting for an approval, ended and how) is read from the
agent's own rows (:func:`agentserver.agents.store.sql.views.task`); the table
``a2a_tasks`` adds only what A2A knows and we do not: the context, the client's message
and its id (a message sent twice is one task), and a refusal at intake. Every function is
one backend-neutral transaction (the same SQL on SQLite and PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentserver.agents.errors import TurnPruned
from agentserver.agents.ports import ReplyRef
from agentserver.agents.store.sql import views
from agentserver.agents.store.sql.db import StoreEnv, Tx, locking
from agentserver.agents.store.states import ApprovalStatus, MessageType

MIGRATION = """
CREATE TABLE a2a_tasks (
    task_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    context_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    message_id TEXT NOT NULL,
    message TEXT NOT NULL,
    refusal TEXT,
    created_at REAL NOT NULL,
    UNIQUE (owner, message_id)
);
CREATE INDEX a2a_tasks_owner ON a2a_tasks (owner, created_at);
"""

_COLUMNS = "task_id, agent_id, context_id, owner, message_id, message, refusal, created_at"
_DELIVERABLE = "task.deliverable"
#: Characters of a deliverable or a refusal an A2A task carries.
TEXT_CHARS = 100_000


def record(
    tx: Tx,
    env: StoreEnv,
    task_id: str,
    agent_id: str,
    context_id: str,
    owner: str,
    message_id: str,
    message: str,
) -> tuple[str, bool]:
    """Record a new task, unless ``owner`` sent ``message_id`` before. Returns the task's
    id and whether it is new (False: the earlier task's id; nothing written)."""
    tx.execute(
        f"INSERT INTO a2a_tasks ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, NULL, ?) "
        "ON CONFLICT (owner, message_id) DO NOTHING",
        (task_id, agent_id, context_id, owner, message_id, message, env.clock.now()),
    )
    row = tx.one(
        "SELECT task_id FROM a2a_tasks WHERE owner = ? AND message_id = ?", (owner, message_id)
    )
    assert row is not None  # inserted, or there before
    return str(row[0]), row[0] == task_id


def reject(tx: Tx, env: StoreEnv, task_id: str, text: str) -> None:
    """The task never reached its agent: ``text`` says why (the task is ``rejected``).
    Nothing is written once it did reach it: a send again of a task already in its
    agent's inbox (:func:`earlier_send`) may be refused where the first was not."""
    row = tx.one(f"SELECT agent_id FROM a2a_tasks WHERE task_id = ?{locking(tx)}", (task_id,))
    if row is None or _reached(tx, str(row[0]), task_id) is not None:
        return
    tx.execute(
        "UPDATE a2a_tasks SET refusal = ? WHERE task_id = ? AND refusal IS NULL",
        (text[:TEXT_CHARS], task_id),
    )


def _reached(tx: Tx, agent_id: str, thread: str) -> str | None:
    """The inbox id of the task of ``agent_id`` on ``thread`` (its inbox row's, or its
    tombstone's once retention pruned it); None if no task of it was ever enqueued."""
    caller, hop = (
        views.json_text(tx, "reply_ref", "caller_thread"),
        views.json_text(tx, "reply_ref", "hop"),
    )
    row = tx.one(
        "SELECT inbox_id FROM agent_inbox WHERE agent_id = ? AND message_type = ? "
        f"AND ({caller} = ? OR {hop} = ?) ORDER BY seq LIMIT 1",
        (agent_id, MessageType.TURN.value, thread, thread),
    )
    if row is None:
        row = tx.one(
            "SELECT inbox_id FROM pruned_turns WHERE agent_id = ? "
            "AND (caller_thread = ? OR hop = ?) LIMIT 1",
            (agent_id, thread, thread),
        )
    return None if row is None else str(row[0] or thread)


def earlier_send(tx: Tx, env: StoreEnv, agent_id: str, reply_ref: ReplyRef) -> str | None:
    """The inbox id of the task this Enqueue repeats, if it is an A2A task's (its thread
    is a task id of ``a2a_tasks`` for ``agent_id``) already enqueued; None: enqueue it.

    An A2A task is recorded, then sent through the pump (docs/a2a.md): a process killed
    between the two leaves it recorded and never sent, and the resend of its message
    sends it again. Its first send may still be in flight in a live process: whichever
    Enqueue comes second is this one, and is dropped, so a task reaches its agent once.
    The ``a2a_tasks`` row is locked first (PostgreSQL; SQLite has one writer), so of two
    concurrent Enqueues of one task the second reads the first's inbox row."""
    if not isinstance(reply_ref, dict):
        return None
    threads = [
        t for t in (reply_ref.get("caller_thread"), reply_ref.get("hop")) if isinstance(t, str)
    ]
    if not threads:
        return None
    found = tx.one(
        f"SELECT task_id FROM a2a_tasks WHERE agent_id = ? AND task_id IN "
        f"({', '.join('?' * len(threads))}) LIMIT 1{locking(tx)}",
        (agent_id, *threads),
    )
    if found is None:
        return None
    return _reached(tx, agent_id, str(found[0]))


def _row(row: Any) -> dict[str, Any]:
    keys = ("task_id", "agent", "context_id", "owner", "message_id", "message", "refusal")
    out = dict(zip(keys, row[:7], strict=True))
    out["created_at"] = row[7]
    return out


def _state(tx: Tx, env: StoreEnv, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with what our rows say: ``view`` (the task's view, None before it reached
    the inbox), ``answer`` (the deliverable's text) and ``asks`` (a pending approval)."""
    view = views.task(tx, env, out["agent"], out["task_id"])
    out["view"] = view
    out["answer"] = None
    out["asks"] = None
    turn = view.get("turn") if view else None
    if turn is None:
        return out
    done = tx.one(
        "SELECT content FROM cards WHERE agent_turn_id = ? AND card_type = ? "
        "ORDER BY seq DESC LIMIT 1",
        (turn, _DELIVERABLE),
    )
    if done is not None:
        out["answer"] = str(done[0])[:TEXT_CHARS]
        return out
    asks = tx.one(
        "SELECT request_id, target, payload, rule, approver, deadline FROM approvals "
        "WHERE agent_turn_id = ? AND status = ? ORDER BY created_at LIMIT 1",
        (turn, ApprovalStatus.PENDING.value),
    )
    if asks is not None:
        keys = ("request", "target", "payload", "rule", "approver", "deadline")
        out["asks"] = dict(zip(keys, asks, strict=True))
    return out


def task(tx: Tx, env: StoreEnv, task_id: str) -> dict[str, Any] | None:
    """The task ``task_id`` with its state (see :func:`_state`); None if unknown."""
    row = tx.one(f"SELECT {_COLUMNS} FROM a2a_tasks WHERE task_id = ?", (task_id,))
    if row is None:
        return None
    out = _row(row)
    try:
        return _state(tx, env, out)
    except TurnPruned as exc:
        # Its record outlives it while its tombstone lasts: "pruned", for its sender only.
        raise TurnPruned(exc.agent, exc.thread, owner=out["owner"]) from None


def tasks(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    context_id: str | None,
    agents: list[str],
    limit: int,
    after: tuple[float, str] | None = None,
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> tuple[list[dict[str, Any]], int, bool]:
    """``owner``'s tasks (None: every owner's, for an operator) of ``agents`` (in
    ``context_id`` if given) that ``keep`` accepts
    (a filter on the state: None, every one), newest first, after the cursor ``after``
    (the ``created_at`` and id of the previous page's last), at most ``limit``, with their
    states; how many match in all; and whether more follow this page.

    The filters apply before the page is cut, so a page is full while matches remain:
    with ``keep``, every candidate's state is read (in this one transaction)."""
    if not agents:
        return [], 0, False
    # A task pruned by retention is not listed (its record stays while its tombstone
    # does, as its message's idempotency key; reading its state would raise TurnPruned).
    # (Two NOT EXISTS, each on an index of pruned_turns: (agent_id, caller_thread), hop.)
    where = f"agent_id IN ({', '.join('?' * len(agents))})" + "".join(
        " AND NOT EXISTS (SELECT 1 FROM pruned_turns p WHERE "
        f"p.agent_id = a2a_tasks.agent_id AND p.{column} = a2a_tasks.task_id)"
        for column in ("caller_thread", "hop")
    )
    params: tuple[Any, ...] = tuple(agents)
    if owner is not None:
        where += " AND owner = ?"
        params += (owner,)
    if context_id:
        where += " AND context_id = ?"
        params += (context_id,)
    order = "ORDER BY created_at DESC, task_id"
    if keep is None:
        total = tx.one(f"SELECT count(*) FROM a2a_tasks WHERE {where}", params)
        if after is not None:
            where += " AND (created_at < ? OR (created_at = ? AND task_id > ?))"
            params += (after[0], after[0], after[1])
        rows = tx.all(
            f"SELECT {_COLUMNS} FROM a2a_tasks WHERE {where} {order} LIMIT ?",
            (*params, limit + 1),
        )
        page = [_state(tx, env, _row(r)) for r in rows[:limit]]
        return page, int(total[0]) if total else 0, len(rows) > limit
    page, count, more = [], 0, False
    for row in tx.all(f"SELECT {_COLUMNS} FROM a2a_tasks WHERE {where} {order}", params):
        out = _state(tx, env, _row(row))
        if not keep(out):
            continue
        count += 1
        if after is not None and not _follows(out, after):
            continue
        if len(page) < limit:
            page.append(out)
        else:
            more = True
    return page, count, more


def _follows(out: dict[str, Any], after: tuple[float, str]) -> bool:
    """``out`` comes after the cursor ``after`` in the order newest first, then by id."""
    stamp = float(out["created_at"])
    return stamp < after[0] or (stamp == after[0] and out["task_id"] > after[1])
