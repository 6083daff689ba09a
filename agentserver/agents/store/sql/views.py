"""Read-only views of the store: the agents and tasks the HTTP API shows (``/v1/agents``,
``/v1/agents/{name}/tasks/{thread}``, ``agentserver status``), a task's answer by its
thread (``agentserver result``), the figures ``/metrics`` exports, and a reachability
probe. Nothing here writes.

Each function is one backend-neutral read (``store.read(views.fn, ...)``, :meth:`SqlAgentStore.read`): on SQLite inline
on the store's connection, on PostgreSQL one thread hop of the executor. JSON columns are
read with :func:`json_text`, the one place the two dialects differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentserver.agents.errors import TurnPruned
from agentserver.agents.store.base import CardType
from agentserver.agents.store.rows import SPEAKS_FOR
from agentserver.agents.store.sql import versions
from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, marks
from agentserver.agents.store.sql.memory import turn_memory
from agentserver.agents.store.sql.tombstones import pruned_sender
from agentserver.agents.store.states import (
    ACTIVE_HEAD,
    ApprovalStatus,
    InboxStatus,
    MessageType,
)
from agentserver.core.access import SENDER_KEYS, sender_of

#: Bound on the characters of a failed Turn's deliverable shown as an agent's last error
#: and a task's error: generous, so that ``agentserver status`` shows a whole error (issue
#: 45); the bound only keeps a runaway deliverable out of every status document.
ERROR_TEXT_CHARS = 8192
#: A cut at a sentence's end is preferred when it keeps at least this share of the bound.
_SENTENCE_SHARE = 0.75
_DELIVERABLE = "task.deliverable"
#: A Turn row still waiting for the worker: queued behind a running Turn, or leased and
#: not yet taken (a busy worker, or a retry after a failed claim).
_WAITING = (InboxStatus.QUEUED.value, InboxStatus.PENDING.value)
#: Head states with a Turn under way (counted by version in the agents' view).
ACTIVE = frozenset(str(s) for s in ACTIVE_HEAD)


def _turn_counts() -> dict[str, int]:
    return {"active": 0, "queued": 0}


_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens", "cost")


def error_text(text: str, limit: int = ERROR_TEXT_CHARS) -> str:
    """``text`` whole if it fits in ``limit`` characters, else cut at the end of a sentence
    (or, failing one near the bound, of a word) with an explicit "… (N more characters)"
    marker, so that no reader takes a cut error for the whole one. Only a single word
    longer than ``limit`` is cut inside it, at the bound."""
    if len(text) <= limit:
        return text
    # text[limit] may itself be the space that ends the last word that fits.
    window = text[: limit + 1]
    sentence = max(window.rfind(f".{gap}") for gap in (" ", "\n", "\t"))
    if sentence >= 0 and sentence + 1 >= limit * _SENTENCE_SHARE:
        kept = window[: sentence + 1]
    else:
        word = max(window.rfind(gap) for gap in (" ", "\n", "\t"))
        kept = window[:word].rstrip() if word > 0 else text[:limit]
        kept = kept or text[:limit]
    return f"{kept} … ({len(text) - len(kept)} more characters)"


def json_text(tx: Tx, column: str, key: str) -> str:
    """The SQL expression for the text of ``column``'s JSON member ``key`` (both fixed
    identifiers of ours, never input)."""
    if tx.dialect == POSTGRESQL:
        return f"({column}::jsonb ->> '{key}')"
    return f"json_extract({column}, '$.{key}')"


def ping(tx: Tx, env: StoreEnv) -> int:
    """One query on the head table (raises if the store cannot answer)."""
    row = tx.one("SELECT count(*) FROM agent_state_head")
    return int(row[0]) if row else 0


def agents(tx: Tx, env: StoreEnv, names: Sequence[str]) -> list[dict[str, Any]]:
    """Head state, active Turn, queue length and last error of each agent of ``names``,
    in that order (an agent the store has no head for is ``idle``)."""
    if not names:
        return []
    heads = {
        r[0]: r[1:]
        for r in tx.all(
            "SELECT agent_id, status, active_agent_turn_id, step_count, waiting_tool_count, "
            "running_since, turn_version, turn_pin FROM agent_state_head "
            f"WHERE agent_id IN ({marks(len(names))})",
            tuple(names),
        )
    }
    by_version: dict[str, dict[str, dict[str, int]]] = {}
    for agent_id, version, n in tx.all(
        "SELECT agent_id, version, count(*) FROM agent_inbox WHERE agent_id IN "
        f"({marks(len(names))}) AND message_type = ? AND status = ? GROUP BY agent_id, version",
        (*names, MessageType.TURN.value, InboxStatus.QUEUED.value),
    ):
        if version is not None:  # (an unversioned process's tasks are not counted)
            slot = by_version.setdefault(agent_id, {}).setdefault(version, _turn_counts())
            slot["queued"] += int(n)
    live = versions.live_served(tx, env)
    queued: dict[str, int] = dict(
        tx.all(
            "SELECT agent_id, count(*) FROM agent_inbox WHERE agent_id IN "
            f"({marks(len(names))}) AND message_type = ? AND status = ? GROUP BY agent_id",
            (*names, MessageType.TURN.value, InboxStatus.QUEUED.value),
        )
    )
    status = json_text(tx, "c.metadata", "status")
    out = []
    for name in names:
        head = heads.get(name)
        # Per agent: the newest failed deliverable is an indexed walk back from its end.
        error = tx.one(
            f"SELECT c.agent_turn_id, c.content, {status}, c.created_at FROM cards c "
            "JOIN boxes b ON b.box_id = c.box_id WHERE b.agent_id = ? AND c.card_type = ? "
            f"AND {status} != 'succeeded' ORDER BY c.seq DESC LIMIT 1",
            (name, _DELIVERABLE),
        )
        item: dict[str, Any] = {
            "name": name,
            "state": head[0] if head else "idle",
            "version": env.served.version(name),
            "active_turn": None,
            "queue": int(queued.get(name, 0)),
            "last_error": None,
            "versions": by_version.get(name, {}),
        }
        if head and head[1]:
            pin = head[6]
            item["active_turn"] = {
                "id": head[1],
                "steps": head[2],
                "waiting_tools": head[3],
                "running_since": head[4],
                "version": head[5],
                "pinned": pin is not None,
                # A pinned Turn whose version no live process serves (docs/deploy.md).
                "waiting_for_version": pin if pin is not None and (name, pin) not in live else None,
            }
            if head[0] in ACTIVE and head[5] is not None:
                slot = item["versions"].setdefault(head[5], _turn_counts())
                slot["active"] += 1
        if error:
            item["last_error"] = {
                "turn": error[0],
                "status": error[2],
                "text": error_text(error[1]),
                "at": error[3],
            }
        out.append(item)
    return out


def _latest_task(
    tx: Tx, columns: str, name: str, thread: str, sender: str | None
) -> Sequence[Any] | None:
    """``columns`` of the latest task of agent ``name`` sent on ``thread`` (the caller's
    thread or the hop thread), of client ``sender`` if given (the authorization rule's
    scope): the one read :func:`task` and :func:`task_reading` share."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    where = ""
    params: tuple[str, ...] = (name, MessageType.TURN.value, thread, thread)
    if sender is not None:
        where, params = f" AND {sender_sql(tx)} = ?", (*params, sender)
    return tx.one(
        f"SELECT {columns} FROM agent_inbox "
        f"WHERE agent_id = ? AND message_type = ? AND ({caller} = ? OR {hop} = ?){where} "
        "ORDER BY seq DESC LIMIT 1",
        params,
    )


def task(
    tx: Tx, env: StoreEnv, name: str, thread: str, sender: str | None = None
) -> dict[str, Any] | None:
    """The latest task of agent ``name`` sent on ``thread`` (the caller's thread, or the
    hop thread the agent was called on), of client ``sender`` if given (the authorization
    rule's scope: another client may have sent on the same thread id): status, steps,
    usage, and the answer its caller was sent once there is one. None if none."""
    row = _latest_task(
        tx,
        "inbox_id, status, agent_turn_id, created_at, conversation, version",
        name,
        thread,
        sender,
    )
    if row is None:
        # "pruned" for ``sender``'s own pruned task only (any, unscoped); the exception
        # names the task's sender, as an A2A task's does (sql/a2a.py).
        pruned, owner = pruned_sender(tx, name, thread, sender)
        if pruned and (sender is None or owner == sender):
            raise TurnPruned(name, thread, owner=owner)
        return None
    inbox_id, inbox_status, turn, created, conversation, version = row
    out: dict[str, Any] = {
        "agent": name,
        "thread": thread,
        "turn": turn,
        "status": "queued" if turn is None else "running",
        # Queued: the version it was queued on; then the version its last step ran.
        "version": version,
        "created_at": created,
        "steps": [],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0},
    }
    origin = fork_origin(tx, name, conversation)
    if origin is not None:
        out["forked_from"] = origin
    _answer(tx, out, inbox_id, turn)
    if turn is None:
        if inbox_status not in _WAITING:
            out["status"] = inbox_status
        return out
    done = tx.one(
        f"SELECT {json_text(tx, 'metadata', 'status')}, content, created_at FROM cards "
        "WHERE agent_turn_id = ? AND card_type = ? ORDER BY seq DESC LIMIT 1",
        (turn, _DELIVERABLE),
    )
    if done is not None:
        out["status"] = done[0] or "finished"
        out["finished_at"] = done[2]
        if done[0] != "succeeded":
            out["error"] = error_text(done[1])
    else:
        pin = tx.one(
            "SELECT turn_pin FROM agent_state_head WHERE agent_id = ? AND active_agent_turn_id = ?",
            (name, turn),
        )
        if (
            pin is not None
            and pin[0] is not None
            and (name, pin[0]) not in versions.live_served(tx, env)
        ):
            # Pinned to a version no live process serves: it waits (docs/deploy.md).
            out["waiting_for_version"] = pin[0]
    usage = out["usage"]
    for step in tx.all(
        "SELECT step_no, status, model, backend, prompt_tokens, completion_tokens, "
        "total_tokens, cost, started_at, ended_at, tool_call_ids, version FROM agent_steps "
        "WHERE agent_turn_id = ? ORDER BY step_no",
        (turn,),
    ):
        out["version"] = step[11] or out["version"]
        out["steps"].append(
            {
                "step": step[0],
                "status": step[1],
                "model": step[2],
                "backend": step[3],
                "prompt_tokens": step[4],
                "completion_tokens": step[5],
                "total_tokens": step[6],
                "cost": step[7],
                "started_at": step[8],
                "ended_at": step[9],
                "tool_calls": len(json.loads(step[10] or "[]")),
                "version": step[11],
            }
        )
        for key, value in zip(_USAGE, step[4:8], strict=True):
            usage[key] += value or 0
    return out


def _answer(tx: Tx, out: dict[str, Any], inbox_id: str, turn: str | None) -> None:
    """``answer`` (the answer payload the task's caller was sent, XML text) and
    ``answer_failed`` into a task's view, once there is one: its Turn's, or the refusal
    of a task cancelled before it ran."""
    keys = [f"cancel:{inbox_id}"] + ([turn] if turn is not None else [])
    reply = tx.one(
        f"SELECT payload, failed FROM agent_replies WHERE agent_turn_id IN ({marks(len(keys))}) "
        "ORDER BY created_at DESC LIMIT 1",
        keys,
    )
    if reply is not None:
        out["answer"] = bytes(reply[0]).decode("utf-8", "replace")
        out["answer_failed"] = bool(reply[1])


def task_answer(tx: Tx, env: StoreEnv, thread: str) -> dict[str, Any] | None:
    """The latest task sent on the caller's thread ``thread``, whichever agent has it
    (``agentserver result``): :func:`task`'s view with ``sender`` (the named client that
    sent it, None for an anonymous caller). None if there is none;
    ``{"agent", "thread", "pruned": True, "sender"}`` if retention removed it."""
    caller = json_text(tx, "reply_ref", "caller_thread")
    row = tx.one(
        "SELECT agent_id, inbox_id, agent_turn_id, reply_ref FROM agent_inbox "
        f"WHERE message_type = ? AND {caller} = ? ORDER BY seq DESC LIMIT 1",
        (MessageType.TURN.value, thread),
    )
    if row is None:
        stone = tx.one(
            "SELECT agent_id, sender FROM pruned_turns WHERE caller_thread = ? "
            "ORDER BY pruned_at DESC LIMIT 1",
            (thread,),
        )
        if stone is None:
            return None
        # The tombstone's sender (schema migration 17; None on older ones): with clients
        # declared, only that client is told "pruned" (agentserver/cli/result.py).
        return {"agent": stone[0], "thread": thread, "pruned": True, "sender": stone[1]}
    agent, _inbox_id, _turn, ref_json = row
    try:
        ref = json.loads(ref_json) if ref_json else {}
    except ValueError:
        ref = {}
    sender = None
    if isinstance(ref, dict):
        named = ref.get("client") or ref.get(SPEAKS_FOR)
        sender = named if isinstance(named, str) and named else None
    view = task(tx, env, agent, thread)
    if view is None:
        return None
    view["sender"] = sender
    return view


#: Characters of one card's content the web console's Turn log carries.
CARD_TEXT_CHARS = 4000
#: Cards of one Turn the web console's log carries (the newest ones).
TURN_LOG_CARDS = 200


#: Characters of a task's text (its payload as sent) and of its answer that the web
#: console's task page carries; a list carries :data:`LIST_TEXT_CHARS` of each.
READING_CHARS = 20000
LIST_TEXT_CHARS = 400


def recent_tasks(
    tx: Tx, env: StoreEnv, name: str, limit: int, sender: str | None = None
) -> list[dict[str, Any]]:
    """The newest ``limit`` tasks of agent ``name``, newest first: the caller's thread, the
    hop thread, the inbox status, the Turn and when it came (the web console's agent
    page), each with its :func:`reading` (its text and outcome, cut at
    :data:`LIST_TEXT_CHARS`); with ``sender``, only the tasks that client sent (the
    authorization rule's scope: :mod:`agentserver.core.access`). One indexed read
    (``agent_inbox`` by agent), then two per started task (its Turn's boxes, and its
    approvals while it runs)."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    where = "agent_id = ? AND message_type = ?"
    params: tuple[str, ...] = (name, MessageType.TURN.value)
    if sender is not None:
        where += f" AND {sender_sql(tx)} = ?"
        params += (sender,)
    rows = tx.all(
        f"SELECT {caller}, {hop}, status, agent_turn_id, created_at, payload, defer_reason "
        f"FROM agent_inbox WHERE {where} ORDER BY seq DESC LIMIT ?",
        (*params, limit),
    )
    return [
        {
            "thread": r[0] or r[1],
            "hop": r[1],
            "status": r[2],
            "turn": r[3],
            "created_at": r[4],
            **reading(tx, r[2], r[5], r[6], r[3], LIST_TEXT_CHARS),
        }
        for r in rows
    ]


def task_reading(
    tx: Tx, env: StoreEnv, name: str, thread: str, sender: str | None = None
) -> dict[str, Any] | None:
    """The :func:`reading` of the latest task of agent ``name`` sent on ``thread`` (found
    as :func:`task` finds it, of client ``sender`` if given), its text and answer cut at
    :data:`READING_CHARS`; None if there is none (a pruned one included: :func:`task`
    says which)."""
    row = _latest_task(tx, "status, payload, defer_reason, agent_turn_id", name, thread, sender)
    if row is None:
        return None
    return reading(tx, row[0], row[1], row[2], row[3], READING_CHARS)


def reading(
    tx: Tx,
    inbox_status: str,
    payload: bytes | memoryview | None,
    reason: str | None,
    turn: str | None,
    chars: int,
) -> dict[str, Any]:
    """What a person reads of one task, as the store holds it (the web console words it,
    agentserver/http/ui/wording.py): its inbox row's status and reason, its ``text`` (the
    payload as sent: the row's until its Turn starts, then the Turn's ``task.input``
    card, as ``common.CONSUMED_PAYLOAD`` says), its ``outcome`` (the deliverable's status,
    None before the end), its ``answer`` (the deliverable's text), when it finished, and
    whether an approval of its Turn is ``asking`` (pending). Text and answer are cut at
    ``chars`` (``text_cut``/``answer_cut`` say so)."""
    text = bytes(payload or b"").decode("utf-8", "replace")
    out: dict[str, Any] = {
        "inbox_status": inbox_status,
        "reason": reason,
        "outcome": None,
        "answer": None,
        "answer_cut": False,
        "finished_at": None,
        "asking": False,
    }
    if turn is not None:
        # The Turn's own boxes (indexed by Turn), their cards by box: the task is the
        # context box's first task.input card, the end the output box's last deliverable.
        cards = tx.all(
            "SELECT c.card_type, c.content, c.metadata, c.created_at FROM boxes b "
            "JOIN cards c ON c.box_id = b.box_id WHERE b.agent_turn_id = ? "
            "AND c.agent_turn_id = ? AND c.card_type IN (?, ?) ORDER BY c.seq",
            (turn, turn, CardType.TASK_INPUT, CardType.DELIVERABLE),
        )
        inputs = [c for c in cards if c[0] == CardType.TASK_INPUT]
        if not text and inputs:
            text = str(inputs[0][1])
        ends = [c for c in cards if c[0] == CardType.DELIVERABLE]
        if ends:
            _type, answer, metadata, at = ends[-1]
            out["outcome"] = json.loads(metadata or "{}").get("status") or "finished"
            out["answer"] = str(answer)[:chars]
            out["answer_cut"] = len(answer) > chars
            out["finished_at"] = at
        else:
            asking = tx.one(
                "SELECT count(*) FROM approvals WHERE agent_turn_id = ? AND status = ?",
                (turn, ApprovalStatus.PENDING.value),
            )
            out["asking"] = bool(asking and asking[0])
    out["text"] = text[:chars]
    out["text_cut"] = len(text) > chars
    return out


def turn_log(tx: Tx, env: StoreEnv, turn: str) -> dict[str, Any]:
    """A Turn's conversation (its newest :data:`TURN_LOG_CARDS` cards, oldest first, each
    content cut at :data:`CARD_TEXT_CHARS`) and its governance decisions: what the web
    console's task page shows. The text is as the model, tools and clients wrote it: the
    reader escapes it."""
    cards = tx.all(
        "SELECT seq, card_type, content, metadata, created_at FROM cards "
        "WHERE agent_turn_id = ? ORDER BY seq DESC LIMIT ?",
        (turn, TURN_LOG_CARDS),
    )
    if len(cards) < TURN_LOG_CARDS:
        # Room left: the newest of the memory its context box named (sql/memory.py).
        memory = [(m[6], m[2], m[3], m[4], m[5]) for m in turn_memory(tx, turn)]
        cards += list(reversed(memory))[: TURN_LOG_CARDS - len(cards)]
    decisions = tx.all(
        "SELECT target, payload_tag, decision, rule, reason, at FROM policy_decisions "
        "WHERE agent_turn_id = ? ORDER BY seq",
        (turn,),
    )
    approvals = tx.all(
        "SELECT request_id, target, rule, approver, status, decided_by, reason FROM approvals "
        "WHERE agent_turn_id = ? ORDER BY created_at",
        (turn,),
    )
    return {
        "cards": [
            {
                "seq": r[0],
                "type": r[1],
                "text": r[2][:CARD_TEXT_CHARS],
                "cut": len(r[2]) > CARD_TEXT_CHARS,
                "metadata": json.loads(r[3] or "{}"),
                "at": r[4],
            }
            for r in reversed(cards)
        ],
        "decisions": [
            dict(zip(("target", "payload", "decision", "rule", "reason", "at"), r, strict=True))
            for r in decisions
        ],
        "approvals": [
            dict(
                zip(
                    ("request", "target", "rule", "approver", "status", "decided_by", "reason"),
                    r,
                    strict=True,
                )
            )
            for r in approvals
        ],
    }


def sender_sql(tx: Tx) -> str:
    """The SQL expression for the client that sent an ``agent_inbox`` row's task (its
    reply reference's ``client`` or ``speaks_for``: :data:`agentserver.core.access.SENDER_KEYS`;
    NULL when it names none)."""
    client, speaks = (json_text(tx, "reply_ref", key) for key in SENDER_KEYS)
    return f"COALESCE({client}, {speaks})"


def task_sender(
    tx: Tx, env: StoreEnv, name: str, thread: str, sender: str | None = None
) -> tuple[bool, str | None]:
    """Whether agent ``name`` has a task sent on ``thread`` (a pruned one counts), and the
    client that sent it (None: no declared client): ``sender``'s own if it sent one there
    (pruned or not), else the latest one's (the row :func:`task` reads; without one, the
    latest pruned one's tombstone's: None if it is older than schema migration 17)."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    base = (
        f"SELECT reply_ref FROM agent_inbox WHERE agent_id = ? AND message_type = ? "
        f"AND ({caller} = ? OR {hop} = ?)"
    )
    params = (name, MessageType.TURN.value, thread, thread)
    if sender is not None and tx.one(f"{base} AND {sender_sql(tx)} = ? LIMIT 1", (*params, sender)):
        return True, sender
    pruned, owner = pruned_sender(tx, name, thread, sender)
    if pruned and sender is not None and owner == sender:
        return True, sender  # its own pruned task: it is told "pruned"
    row = tx.one(f"{base} ORDER BY seq DESC LIMIT 1", params)
    if row is None:
        return pruned, owner
    return True, sender_of(_decoded(row[0]))


def turn_task(tx: Tx, env: StoreEnv, turn: str) -> tuple[str | None, str | None, str | None]:
    """(caller thread, hop thread, sender) of the task a Turn runs: what the event streams
    filter by."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    row = tx.one(
        f"SELECT {caller}, {hop}, reply_ref FROM agent_inbox WHERE agent_turn_id = ? "
        "AND message_type = ? LIMIT 1",
        (turn, MessageType.TURN.value),
    )
    return (row[0], row[1], sender_of(_decoded(row[2]))) if row else (None, None, None)


def _decoded(reply_ref: Any) -> Any:
    if reply_ref is None:
        return None
    try:
        return json.loads(reply_ref)
    except (TypeError, ValueError):
        return None


def turn_thread(tx: Tx, env: StoreEnv, turn: str) -> tuple[str | None, str | None]:
    """(caller thread, hop thread) of the task a Turn runs, for event filtering."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    row = tx.one(
        f"SELECT {caller}, {hop} FROM agent_inbox WHERE agent_turn_id = ? "
        "AND message_type = ? LIMIT 1",
        (turn, MessageType.TURN.value),
    )
    return (row[0], row[1]) if row else (None, None)


@dataclass(frozen=True, slots=True)
class FigureRows:
    """What ``/metrics`` exports of the store, as read at one moment."""

    #: agent → ``created_at`` of its oldest task not yet started (agents with none absent)
    oldest_waiting: dict[str, float]
    #: agent → approval requests waiting for a decision (agents with none absent)
    approvals_pending: dict[str, int]


def figures(tx: Tx, env: StoreEnv) -> FigureRows:
    """Two grouped, indexed reads (the inbox's status index; approvals by status)."""
    lag = tx.all(
        f"SELECT agent_id, min(created_at) FROM agent_inbox WHERE status IN ({marks(2)}) "
        "AND message_type = ? GROUP BY agent_id",
        (*_WAITING, MessageType.TURN.value),
    )
    pending = tx.all(
        "SELECT agent_id, count(*) FROM approvals WHERE status = ? GROUP BY agent_id",
        (ApprovalStatus.PENDING.value,),
    )
    return FigureRows(
        {a: float(t) for a, t in lag},
        {a: int(n) for a, n in pending},
    )


def fork_origin(tx: Tx, agent: str, conversation: str | None) -> dict[str, Any] | None:
    """The origin of a forked conversation (None: not a fork)."""
    if not conversation or not conversation.startswith("fork:"):
        return None
    row = tx.one(
        "SELECT origin_thread, origin_turn, at_step FROM forks WHERE agent_id = ? "
        "AND conversation = ?",
        (agent, conversation),
    )
    return {"thread": row[0], "turn": row[1], "step": int(row[2])} if row else None
