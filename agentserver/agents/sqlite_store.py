"""The embedded SQLite implementation of :class:`~agentserver.agents.store.AgentStore`.

One file, WAL mode, ``synchronous=NORMAL`` (a commit survives a crash of the process; the
last commits may be lost on power failure). The schema is created and migrated on open,
tracked in ``schema_version``.

Concurrency: SQLite has one writer. Each method is a single ``BEGIN IMMEDIATE`` transaction
executed inline on the trio thread without any ``await`` inside, so transactions never
interleave within the process, and ``BEGIN IMMEDIATE`` plus ``busy_timeout`` serialise them
against another process opening the same file (e.g. ``sqlite3`` inspecting it). This is the
SQLite stand-in for the seeds' ``FOR UPDATE SKIP LOCKED``. Transactions are short (tens of
microseconds); nothing long runs inside one.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentserver.agents import governance_store, step_log
from agentserver.agents.budget import card_tokens
from agentserver.agents.clock import Clock, SystemClock
from agentserver.agents.errors import StaleTurn, StoreError, StoreInUse
from agentserver.agents.governance_store import GovernanceStoreMixin
from agentserver.agents.ports import LLMCompletion, ReplyRef
from agentserver.agents.retry import step_retries_done, step_retry_payload
from agentserver.agents.settings import StoreSettings
from agentserver.agents.states import (
    ACTIVE_HEAD,
    DUE_INBOX,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    head_sources,
    head_transition,
    inbox_sources,
    inbox_transition,
)
from agentserver.agents.step_log import StepLogStoreMixin
from agentserver.agents.store import (
    Card,
    CardType,
    ClientReply,
    EnqueueResult,
    Finished,
    Head,
    InboxRow,
    NewCard,
    PendingReply,
    ReportOutcome,
    ToolCallRecord,
    TurnToken,
)

SCHEMA_VERSION = 5

_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE agent_state_head (
    agent_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    active_agent_turn_id TEXT,
    turn_epoch INTEGER NOT NULL DEFAULT 0,
    turn_inbox_id TEXT,
    context_box_id TEXT,
    output_box_id TEXT,
    step_count INTEGER NOT NULL DEFAULT 0,
    waiting_tool_count INTEGER NOT NULL DEFAULT 0,
    resume_deadline REAL,
    expecting_correlation_id TEXT,
    -- unused: submit_result ends its Turn, so it is used at most once (kept in v1 files)
    submit_used INTEGER NOT NULL DEFAULT 0,
    dispatched_at REAL,
    running_since REAL,
    updated_at REAL NOT NULL
);
CREATE TABLE agent_inbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    inbox_id TEXT NOT NULL UNIQUE,
    agent_id TEXT NOT NULL,
    message_type TEXT NOT NULL,
    status TEXT NOT NULL,
    agent_turn_id TEXT,
    turn_epoch INTEGER,
    correlation_id TEXT,
    payload BLOB NOT NULL,
    reply_ref TEXT,
    failed INTEGER NOT NULL DEFAULT 0,
    retry_count INTEGER NOT NULL DEFAULT 0,
    next_retry_at REAL NOT NULL,
    defer_reason TEXT,
    processing_at REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX agent_inbox_due ON agent_inbox (agent_id, status, next_retry_at, created_at);
CREATE INDEX agent_inbox_status ON agent_inbox (status, next_retry_at);
CREATE INDEX agent_inbox_corr ON agent_inbox (correlation_id);
CREATE TABLE turn_waiting_tools (
    tool_call_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    turn_epoch INTEGER NOT NULL,
    step_id TEXT NOT NULL,
    to_listener TEXT NOT NULL,
    after_execution TEXT NOT NULL,
    status TEXT NOT NULL,
    result_card_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX turn_waiting_turn ON turn_waiting_tools (agent_turn_id, turn_epoch, status);
CREATE TABLE execution_edges (
    edge_id INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT,
    primitive TEXT NOT NULL,
    edge_phase TEXT NOT NULL,
    correlation_id TEXT,
    inbox_id TEXT,
    created_at REAL NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX execution_edges_turn ON execution_edges (agent_turn_id);
CREATE TABLE agent_steps (
    step_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    turn_epoch INTEGER NOT NULL,
    step_no INTEGER NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    model TEXT,
    backend TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    total_tokens INTEGER,
    cost REAL,
    tool_call_ids TEXT NOT NULL DEFAULT '[]',
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX agent_steps_turn ON agent_steps (agent_turn_id, step_no);
CREATE TABLE boxes (
    box_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE cards (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    card_id TEXT NOT NULL UNIQUE,
    box_id TEXT NOT NULL REFERENCES boxes (box_id),
    agent_turn_id TEXT NOT NULL,
    card_type TEXT NOT NULL,
    content TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
);
CREATE INDEX cards_box ON cards (box_id, seq);
CREATE TABLE agent_replies (
    agent_turn_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    reply_ref TEXT NOT NULL,
    payload BLOB NOT NULL,
    failed INTEGER NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sent_at REAL
);
CREATE INDEX agent_replies_status ON agent_replies (status, created_at);
CREATE TABLE client_replies (
    reply_id INTEGER PRIMARY KEY AUTOINCREMENT,
    client TEXT NOT NULL,
    thread_ref TEXT NOT NULL,
    payload BLOB NOT NULL,
    failed INTEGER NOT NULL,
    created_at REAL NOT NULL,
    delivered_at REAL
);
CREATE INDEX client_replies_client ON client_replies (client, delivered_at, reply_id);
""",
    # Issue 12: the context budget. A card's estimated cost as the model is shown it, and
    # the running sum over the head's two boxes (so the budget check is O(1) per step).
    2: """
ALTER TABLE cards ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE agent_state_head ADD COLUMN context_tokens INTEGER NOT NULL DEFAULT 0;
""",
    # Issue 12: memory across tasks. A Turn's conversation (agents/memory.py), and where
    # each conversation's last Turn left its cards.
    3: """
ALTER TABLE agent_inbox ADD COLUMN conversation TEXT;
CREATE TABLE conversations (
    agent_id TEXT NOT NULL,
    conversation TEXT NOT NULL,
    context_box_id TEXT NOT NULL,
    output_box_id TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (agent_id, conversation)
);
""",
    # Issue 14: governance. Policy decisions (rate windows) and approval requests.
    4: governance_store.MIGRATION,
    # Issue 15: the step log of remote listeners (agents/step_log.py).
    5: step_log.MIGRATION,
}

#: Card types the worker never shows the model (``worker._card_message`` returns None):
#: they cost no context tokens.
_UNSHOWN = frozenset({CardType.DELIVERABLE, CardType.TOOL_CALL, CardType.GUARD})

_HEAD_COLS = (
    "agent_id, status, active_agent_turn_id, turn_epoch, turn_inbox_id, context_box_id, "
    "output_box_id, step_count, waiting_tool_count, resume_deadline, "
    "dispatched_at, running_since, updated_at, context_tokens"
)
_INBOX_COLS = (
    "inbox_id, agent_id, message_type, status, agent_turn_id, turn_epoch, correlation_id, "
    "payload, reply_ref, failed, retry_count, next_retry_at, defer_reason, created_at"
)


def _new_id() -> str:
    return uuid.uuid4().hex


def _inbox(row: tuple[Any, ...]) -> InboxRow:
    r = list(row)
    r[7] = bytes(r[7])
    r[9] = bool(r[9])
    return InboxRow(*r)


def _lock(path: Path) -> int:
    """Take the exclusive, non-blocking process lock of the store at ``path``."""
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        finally:
            os.close(fd)
        raise StoreInUse(
            f"agent store {path} is in use by another agentserver process (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class SqliteAgentStore(GovernanceStoreMixin, StepLogStoreMixin):
    """SQLite-backed agent store. Create with :meth:`open`; close with :meth:`aclose`."""

    def __init__(self, conn: sqlite3.Connection, clock: Clock, settings: StoreSettings) -> None:
        self._db = conn
        self._clock = clock
        self.settings = settings
        self._lock_fd: int | None = None
        #: agent id → the most tokens one tool result is shown with (budget.tool_result_cap)
        self.tool_result_caps: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        clock: Clock | None = None,
        settings: StoreSettings | None = None,
    ) -> SqliteAgentStore:
        """Open (creating and migrating) the store file. Synchronous: call once at start.

        The process holds an exclusive lock on ``PATH.lock`` until :meth:`close`; the OS
        drops it if the process dies. Raises :class:`StoreInUse` if another process holds it.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(path)
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except BaseException:
            os.close(lock)
            raise
        try:
            conn.execute("PRAGMA busy_timeout = 5000")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"cannot enable WAL on {path} (got {mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            store = cls(conn, clock or SystemClock(), settings or StoreSettings(path=path))
            store._lock_fd = lock
            store._migrate()
        except BaseException:
            conn.close()
            os.close(lock)
            raise
        return store

    def _migrate(self) -> None:
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT max(version) FROM schema_version").fetchone()
            current = row[0] or 0
            if current > SCHEMA_VERSION:
                raise StoreError(f"store schema {current} is newer than this code")
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the database and release the process lock. Idempotent."""
        self._db.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- helpers (run inside a transaction) ---------------------------------------------
    def _cas(
        self,
        db: sqlite3.Connection,
        token: TurnToken,
        event: HeadEvent,
        sets: Mapping[str, Any],
    ) -> int:
        """Compare-and-set the head; returns the new epoch. Raises StaleTurn on miss."""
        sources = head_sources(event)
        status_now = db.execute(
            "SELECT status FROM agent_state_head WHERE agent_id = ?", (token.agent_id,)
        ).fetchone()
        if status_now is None or status_now[0] not in sources:
            raise StaleTurn(f"{token}: head not in {sources} for {event}")
        t = head_transition(status_now[0], event)
        epoch = token.turn_epoch + 1 if t.bumps_epoch else token.turn_epoch
        cols = {"status": t.target, "turn_epoch": epoch, "updated_at": self._clock.now()}
        cols.update(sets)
        assignments = ", ".join(f"{c} = ?" for c in cols)
        cur = db.execute(
            f"UPDATE agent_state_head SET {assignments} WHERE agent_id = ? "
            "AND active_agent_turn_id = ? AND turn_epoch = ? AND status IN "
            f"({','.join('?' * len(sources))})",
            (*cols.values(), token.agent_id, token.agent_turn_id, token.turn_epoch, *sources),
        )
        if cur.rowcount != 1:
            raise StaleTurn(f"{token}: compare-and-set on {event} matched no row")
        return epoch

    def _inbox_move(
        self, db: sqlite3.Connection, inbox_id: str, event: InboxEvent, **sets: Any
    ) -> bool:
        sources = inbox_sources(event)
        target = inbox_transition(sources[0], event).target
        cols = {"status": target, "updated_at": self._clock.now(), **sets}
        assignments = ", ".join(f"{c} = ?" for c in cols)
        cur = db.execute(
            f"UPDATE agent_inbox SET {assignments} WHERE inbox_id = ? AND status IN "
            f"({','.join('?' * len(sources))})",
            (*cols.values(), inbox_id, *sources),
        )
        return cur.rowcount == 1

    def _edge(
        self,
        db: sqlite3.Connection,
        agent_id: str,
        turn_id: str | None,
        primitive: str,
        phase: str,
        *,
        correlation_id: str | None = None,
        inbox_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        db.execute(
            "INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
            "correlation_id, inbox_id, created_at, metadata) VALUES (?,?,?,?,?,?,?,?)",
            (
                agent_id,
                turn_id,
                primitive,
                phase,
                correlation_id,
                inbox_id,
                self._clock.now(),
                json.dumps(metadata or {}),
            ),
        )

    def _card(
        self,
        db: sqlite3.Connection,
        box_id: str,
        turn_id: str,
        card: NewCard,
    ) -> str:
        card_id = _new_id()
        tokens = self._card_tokens(db, box_id, card)
        db.execute(
            "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, metadata, "
            "created_at, tokens) VALUES (?,?,?,?,?,?,?,?)",
            (
                card_id,
                box_id,
                turn_id,
                card.card_type,
                card.content,
                json.dumps(dict(card.metadata)),
                self._clock.now(),
                tokens,
            ),
        )
        if tokens:
            db.execute(
                "UPDATE agent_state_head SET context_tokens = context_tokens + ? "
                "WHERE active_agent_turn_id = ? AND (output_box_id = ? OR context_box_id = ?)",
                (tokens, turn_id, box_id, box_id),
            )
        return card_id

    # -- context budget (issue 12) ------------------------------------------------------
    def _card_tokens(self, db: sqlite3.Connection, box_id: str, card: NewCard) -> int:
        if card.card_type in _UNSHOWN:
            return 0
        cap = None
        if card.card_type == CardType.TOOL_RESULT and self.tool_result_caps:
            agent = db.execute("SELECT agent_id FROM boxes WHERE box_id = ?", (box_id,)).fetchone()
            cap = self.tool_result_caps.get(agent[0]) if agent else None
        return card_tokens(card.content, cap)

    def _recount(self, db: sqlite3.Connection, agent_id: str) -> int:
        """Set the head's running count to the sum over its two boxes (after a swap)."""
        db.execute(
            "UPDATE agent_state_head SET context_tokens = (SELECT coalesce(sum(c.tokens), 0) "
            "FROM cards c WHERE c.box_id IN (agent_state_head.context_box_id, "
            "agent_state_head.output_box_id)) WHERE agent_id = ?",
            (agent_id,),
        )
        row = db.execute(
            "SELECT context_tokens FROM agent_state_head WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    async def compact(
        self,
        token: TurnToken,
        summary: NewCard,
        keep: Sequence[str],
        *,
        edge: Mapping[str, Any] | None = None,
    ) -> int:
        """Swap the Turn's boxes to [``summary``] + [copies of the ``keep`` cards, in
        order] in one CAS-fenced transaction; the old boxes stay in the store. Returns the
        new running token count."""
        now = self._clock.now()
        with self._tx() as db:
            self._fenced(db, token, HeadStatus.RUNNING, now)
            context_box, output_box = _new_id(), _new_id()
            db.executemany(
                "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) "
                "VALUES (?,?,?,?,?)",
                [
                    (context_box, token.agent_id, token.agent_turn_id, "context", now),
                    (output_box, token.agent_id, token.agent_turn_id, "output", now),
                ],
            )
            self._card(db, context_box, token.agent_turn_id, summary)
            for card_id in keep:
                db.execute(
                    "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
                    "metadata, created_at, tokens) SELECT ?, ?, agent_turn_id, card_type, "
                    "content, metadata, created_at, tokens FROM cards WHERE card_id = ?",
                    (_new_id(), output_box, card_id),
                )
            self._fenced(
                db,
                token,
                HeadStatus.RUNNING,
                now,
                set_sql="context_box_id = ?, output_box_id = ?",
                params=(context_box, output_box),
            )
            total = self._recount(db, token.agent_id)
            self._edge(
                db,
                token.agent_id,
                token.agent_turn_id,
                "compact",
                "response",
                metadata={**(edge or {}), "context_tokens": total},
            )
        return total

    async def add_context_tokens(self, token: TurnToken, delta: int) -> None:
        """The provider counted more than the estimate: correct the running count up."""
        if delta <= 0:
            return
        with self._tx() as db:
            self._fenced(
                db,
                token,
                HeadStatus.RUNNING,
                self._clock.now(),
                set_sql="context_tokens = context_tokens + ?",
                params=(delta,),
            )

    def _output_box(self, db: sqlite3.Connection, agent_id: str) -> str:
        row = db.execute(
            "SELECT output_box_id FROM agent_state_head WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        if not row or not row[0]:
            raise StaleTurn(f"{agent_id}: no output box")
        return str(row[0])

    def _ensure_head(self, db: sqlite3.Connection, agent_id: str) -> None:
        db.execute(
            "INSERT OR IGNORE INTO agent_state_head (agent_id, status, updated_at) "
            "VALUES (?, ?, ?)",
            (agent_id, HeadStatus.IDLE, self._clock.now()),
        )

    def _dispatch_next(self, db: sqlite3.Connection, agent_id: str) -> bool:
        """L0 dispatch_next: lease the oldest queued Turn if the agent is idle."""
        head = db.execute(
            "SELECT status, turn_epoch FROM agent_state_head WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        if head is None or head[0] != HeadStatus.IDLE:
            return False
        row = db.execute(
            "SELECT inbox_id, payload, conversation FROM agent_inbox WHERE agent_id = ? "
            "AND status = ? ORDER BY created_at, seq LIMIT 1",
            (agent_id, InboxStatus.QUEUED),
        ).fetchone()
        if row is None:
            return False
        inbox_id, payload, conversation = row
        now = self._clock.now()
        t = head_transition(head[0], HeadEvent.LEASE)
        epoch = head[1] + 1 if t.bumps_epoch else head[1]
        turn_id = _new_id()
        context_box, output_box = _new_id(), _new_id()
        db.executemany(
            "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) "
            "VALUES (?,?,?,?,?)",
            [
                (context_box, agent_id, turn_id, "context", now),
                (output_box, agent_id, turn_id, "output", now),
            ],
        )
        text = bytes(payload).decode("utf-8", "replace")
        if conversation is not None:
            self._continue_conversation(db, agent_id, conversation, context_box, turn_id)
        self._card(db, context_box, turn_id, NewCard(CardType.TASK_INPUT, text))
        cur = db.execute(
            "UPDATE agent_state_head SET status = ?, active_agent_turn_id = ?, turn_epoch = ?, "
            "turn_inbox_id = ?, context_box_id = ?, output_box_id = ?, step_count = 0, "
            "waiting_tool_count = 0, resume_deadline = NULL, expecting_correlation_id = NULL, "
            "dispatched_at = ?, running_since = NULL, updated_at = ? "
            "WHERE agent_id = ? AND status = ? AND turn_epoch = ?",
            (
                t.target,
                turn_id,
                epoch,
                inbox_id,
                context_box,
                output_box,
                now,
                now,
                agent_id,
                HeadStatus.IDLE,
                head[1],
            ),
        )
        if cur.rowcount != 1:  # cannot happen under the single writer; be safe anyway
            raise StaleTurn(f"{agent_id}: lease lost")
        self._recount(db, agent_id)
        self._inbox_move(
            db,
            inbox_id,
            InboxEvent.DISPATCH,
            agent_turn_id=turn_id,
            turn_epoch=epoch,
            next_retry_at=now,
        )
        self._edge(db, agent_id, turn_id, "lease", "request", inbox_id=inbox_id)
        return True

    def _end_turn(
        self,
        db: sqlite3.Connection,
        token: TurnToken,
        event: HeadEvent,
        status: str,
        text: str,
        metadata: Mapping[str, Any],
        reply_payload: bytes | None,
    ) -> Finished:
        """Deliverable card + head to idle + reply outbox + next lease, in one transaction."""
        head = db.execute(
            "SELECT output_box_id, turn_inbox_id, context_box_id FROM agent_state_head "
            "WHERE agent_id = ?",
            (token.agent_id,),
        ).fetchone()
        output_box, turn_inbox_id, context_box = head
        self._cas(
            db,
            token,
            event,
            {
                "active_agent_turn_id": None,
                "turn_inbox_id": None,
                "waiting_tool_count": 0,
                "resume_deadline": None,
                "dispatched_at": None,
                "running_since": None,
            },
        )
        card_id = self._card(
            db,
            output_box,
            token.agent_turn_id,
            NewCard(CardType.DELIVERABLE, text, {"status": status, **metadata}),
        )
        now = self._clock.now()
        db.execute(
            "UPDATE turn_waiting_tools SET status = 'cancelled', updated_at = ? "
            "WHERE agent_turn_id = ? AND status = 'waiting'",
            (now, token.agent_turn_id),
        )
        reply: PendingReply | None = None
        ref = db.execute(
            "SELECT reply_ref FROM agent_inbox WHERE inbox_id = ?", (turn_inbox_id,)
        ).fetchone()
        if event == HeadEvent.FORCE_END and turn_inbox_id:
            # A Turn ended before its Enqueue row was used: that row is finished too.
            for ev in (InboxEvent.ABANDON, InboxEvent.FAIL):
                if self._inbox_move(db, turn_inbox_id, ev, defer_reason=f"turn {status}"):
                    break
        self._abandon_step_retries(db, token)
        self._save_conversation(db, token.agent_id, turn_inbox_id, context_box, output_box, now)
        if ref and ref[0] is not None and reply_payload is not None:
            db.execute(
                "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, failed, "
                "status, created_at) VALUES (?,?,?,?,?,'pending',?)",
                (
                    token.agent_turn_id,
                    token.agent_id,
                    ref[0],
                    reply_payload,
                    int(status != "succeeded"),
                    now,
                ),
            )
            reply = PendingReply(
                token.agent_turn_id,
                token.agent_id,
                ref[0],
                reply_payload,
                status != "succeeded",
                0,
            )
        self._edge(
            db,
            token.agent_id,
            token.agent_turn_id,
            "deliver",
            "response",
            metadata={"status": status, "deliverable_card_id": card_id},
        )
        leased = self._dispatch_next(db, token.agent_id)
        return Finished(
            token.agent_id, token.agent_turn_id, status, output_box, card_id, reply, leased
        )

    # -- intake -----------------------------------------------------------------------
    async def ensure_agents(self, agent_ids: Sequence[str]) -> None:
        with self._tx() as db:
            for agent_id in agent_ids:
                self._ensure_head(db, agent_id)

    async def enqueue_turn(
        self, agent_id: str, payload: bytes, reply_ref: ReplyRef, *, conversation: str | None = None
    ) -> EnqueueResult:
        """Write the Enqueue as a queued row; lease it at once if the agent is idle.
        ``conversation``: the Turn continues that conversation (``memory="client"``).

        Raises ``TypeError``/``ValueError`` (nothing written) if ``reply_ref`` is not JSON.
        """
        ref_json = json.dumps(reply_ref)
        inbox_id = _new_id()
        now = self._clock.now()
        with self._tx() as db:
            self._ensure_head(db, agent_id)
            db.execute(
                "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, payload, "
                "reply_ref, next_retry_at, created_at, updated_at, conversation) "
                "VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    inbox_id,
                    agent_id,
                    MessageType.TURN,
                    InboxStatus.QUEUED,
                    payload,
                    ref_json,
                    now,
                    now,
                    now,
                    conversation,
                ),
            )
            self._edge(db, agent_id, None, "enqueue", "request", inbox_id=inbox_id)
            leased = self._dispatch_next(db, agent_id)
        return EnqueueResult(inbox_id, leased)

    async def report_tool_result(
        self, agent_id: str, tool_call_id: str, payload: bytes, *, failed: bool
    ) -> str:
        return self._report(agent_id, MessageType.TOOL_RESULT, tool_call_id, payload, failed)

    def _report(
        self, agent_id: str, mtype: MessageType, tool_call_id: str, payload: bytes, failed: bool
    ) -> str:
        inbox_id = _new_id()
        now = self._clock.now()
        with self._tx() as db:
            self._insert_report(db, inbox_id, agent_id, mtype, tool_call_id, payload, failed, now)
        return inbox_id

    def _insert_report(
        self,
        db: sqlite3.Connection,
        inbox_id: str,
        agent_id: str,
        mtype: MessageType,
        tool_call_id: str,
        payload: bytes,
        failed: bool,
        now: float,
    ) -> None:
        waiting = db.execute(
            "SELECT agent_turn_id, turn_epoch FROM turn_waiting_tools WHERE tool_call_id = ?",
            (tool_call_id,),
        ).fetchone()
        # Before the suspend commits there is no waiting row yet: park the report as
        # deferred; the suspend transaction makes it due again.
        status = InboxStatus.PENDING if waiting else InboxStatus.DEFERRED
        db.execute(
            "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, agent_turn_id, "
            "turn_epoch, correlation_id, payload, failed, next_retry_at, defer_reason, "
            "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                inbox_id,
                agent_id,
                mtype,
                status,
                waiting[0] if waiting else None,
                waiting[1] if waiting else None,
                tool_call_id,
                payload,
                int(failed),
                now + (0 if waiting else self.settings.retry_base_s),
                None if waiting else "awaiting suspend",
                now,
                now,
            ),
        )
        self._edge(
            db,
            agent_id,
            waiting[0] if waiting else None,
            "report",
            "response",
            correlation_id=tool_call_id,
            inbox_id=inbox_id,
            metadata={"message_type": str(mtype)},
        )

    # -- worker -----------------------------------------------------------------------
    async def due_agents(self, limit: int) -> list[str]:
        now = self._clock.now()
        rows = self._db.execute(
            "SELECT agent_id FROM agent_inbox WHERE status IN (?, ?) AND next_retry_at <= ? "
            "GROUP BY agent_id ORDER BY min(next_retry_at) LIMIT ?",
            (*sorted(DUE_INBOX), now, limit),
        ).fetchall()
        return [r[0] for r in rows]

    async def claim_due(self, agent_id: str, limit: int) -> list[InboxRow]:
        """Claim due rows of ``agent_id`` (pending/deferred, ``next_retry_at <= now``).

        Ordered by ``next_retry_at, created_at``; each moves to ``processing``.
        """
        now = self._clock.now()
        with self._tx() as db:
            rows = db.execute(
                f"SELECT {_INBOX_COLS} FROM agent_inbox WHERE agent_id = ? AND status IN (?, ?) "
                "AND next_retry_at <= ? ORDER BY next_retry_at, created_at, seq LIMIT ?",
                (agent_id, *sorted(DUE_INBOX), now, limit),
            ).fetchall()
            claimed = []
            for row in rows:
                if self._inbox_move(db, row[0], InboxEvent.CLAIM, processing_at=now):
                    claimed.append(_inbox(row))
        return claimed

    async def head(self, agent_id: str) -> Head:
        row = self._db.execute(
            f"SELECT {_HEAD_COLS} FROM agent_state_head WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        if row is None:
            return Head(
                agent_id,
                HeadStatus.IDLE,
                None,
                0,
                None,
                None,
                None,
                0,
                0,
                None,
                None,
                None,
                self._clock.now(),
                0,
            )
        return Head(*row)

    async def start_turn(self, row: InboxRow) -> TurnToken:
        """dispatched → running for the Turn of ``row``; the Enqueue row is consumed."""
        token = row.token
        if token is None:
            raise StaleTurn(f"inbox {row.inbox_id} carries no Turn")
        with self._tx() as db:
            self._cas(db, token, HeadEvent.START, {"running_since": self._clock.now()})
            if not self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME):
                raise StaleTurn(f"inbox {row.inbox_id} is no longer processing")
            self._edge(
                db, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id
            )
        return token

    async def skip_row(self, row: InboxRow, reason: str) -> None:
        with self._tx() as db:
            self._inbox_move(db, row.inbox_id, InboxEvent.SKIP, defer_reason=reason)

    async def fail_turn_row(
        self, row: InboxRow, reason: str, reply_payload: bytes | None
    ) -> Finished | None:
        """A malformed Enqueue: the row becomes ``error`` and its Turn ends failed."""
        with self._tx() as db:
            self._inbox_move(db, row.inbox_id, InboxEvent.FAIL, defer_reason=reason)
            token = row.token
            if token is None:
                return None
            try:
                return self._end_turn(
                    db,
                    token,
                    HeadEvent.FORCE_END,
                    "failed",
                    reason,
                    {"error": reason},
                    reply_payload,
                )
            except StaleTurn:
                return None  # the Turn was already ended: keep only the row's error mark

    async def begin_step(self, token: TurnToken) -> tuple[str, int]:
        """Record a new step (``started``) and count it; returns ``(step_id, step_no)``."""
        step_id = _new_id()
        now = self._clock.now()
        with self._tx() as db:
            count = db.execute(
                "SELECT step_count FROM agent_state_head WHERE agent_id = ?", (token.agent_id,)
            ).fetchone()[0]
            self._fenced(db, token, HeadStatus.RUNNING, now, set_sql="step_count = step_count + 1")
            db.execute(
                "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
                "status, started_at) VALUES (?,?,?,?,?,'started',?)",
                (step_id, token.agent_id, token.agent_turn_id, token.turn_epoch, count + 1, now),
            )
        return step_id, count + 1

    def _assert_running(self, db: sqlite3.Connection, token: TurnToken) -> None:
        # A CAS that changes nothing but the timestamp: fences the transaction's writes.
        self._fenced(db, token, HeadStatus.RUNNING, self._clock.now())

    @staticmethod
    def _fenced(
        db: sqlite3.Connection,
        token: TurnToken,
        status: HeadStatus,
        now: float,
        *,
        set_sql: str = "",
        params: tuple[object, ...] = (),
        where_sql: str = "",
        stale: str = "not running",
    ) -> None:
        """Update the head (``updated_at``, and ``set_sql`` with ``params``) only while it
        still holds ``token``'s Turn at that epoch, in ``status`` (and ``where_sql``);
        else raise StaleTurn. ``set_sql`` and ``where_sql`` are fixed SQL fragments."""
        cur = db.execute(
            f"UPDATE agent_state_head SET {set_sql + ', ' if set_sql else ''}updated_at = ? "
            "WHERE agent_id = ? AND active_agent_turn_id = ? AND turn_epoch = ? "
            f"AND status = ?{where_sql}",
            (*params, now, token.agent_id, token.agent_turn_id, token.turn_epoch, status),
        )
        if cur.rowcount != 1:
            raise StaleTurn(f"{token}: {stale}")

    async def complete_step(
        self,
        token: TurnToken,
        step_id: str,
        completion: LLMCompletion | None,
        cards: Sequence[NewCard],
    ) -> None:
        """Record the model's reply (usage, cost) and the step's cards; CAS-fenced."""
        now = self._clock.now()
        with self._tx() as db:
            self._assert_running(db, token)
            box = self._output_box(db, token.agent_id)
            for card in cards:
                self._card(db, box, token.agent_turn_id, card)
            self._close_step(db, step_id, completion, now, "completed", ())

    def _close_step(
        self,
        db: sqlite3.Connection,
        step_id: str,
        completion: LLMCompletion | None,
        now: float,
        status: str,
        tool_call_ids: Sequence[str],
    ) -> None:
        if completion is None:
            db.execute(
                "UPDATE agent_steps SET status = ?, ended_at = coalesce(ended_at, ?), "
                "tool_call_ids = ? WHERE step_id = ?",
                (status, now, json.dumps(list(tool_call_ids)), step_id),
            )
            return
        u = completion.usage
        meta = {
            "llm_usage": {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
            },
            "llm_response_cost": completion.cost,
        }
        db.execute(
            "UPDATE agent_steps SET status = ?, ended_at = ?, model = ?, backend = ?, "
            "prompt_tokens = ?, completion_tokens = ?, total_tokens = ?, cost = ?, "
            "tool_call_ids = ?, metadata = ? WHERE step_id = ?",
            (
                status,
                now,
                completion.model,
                completion.backend,
                u.prompt_tokens,
                u.completion_tokens,
                u.total_tokens,
                completion.cost,
                json.dumps(list(tool_call_ids)),
                json.dumps(meta),
                step_id,
            ),
        )

    async def suspend(
        self,
        token: TurnToken,
        step_id: str,
        calls: Sequence[ToolCallRecord],
        cards: Sequence[NewCard],
        resume_deadline: float,
    ) -> None:
        """running → suspended with the waiting set ``calls`` (tool.call cards included).

        Reports for these calls that arrived early (deferred) become due immediately.
        """
        if not calls:
            raise ValueError("suspend needs at least one tool call")
        now = self._clock.now()
        with self._tx() as db:
            box = self._output_box(db, token.agent_id)
            self._cas(
                db,
                token,
                HeadEvent.SUSPEND,
                {
                    "waiting_tool_count": len(calls),
                    "resume_deadline": resume_deadline,
                    "expecting_correlation_id": None,
                },
            )
            for card in cards:
                self._card(db, box, token.agent_turn_id, card)
            for call in calls:
                card_id = self._card(
                    db,
                    box,
                    token.agent_turn_id,
                    NewCard(
                        CardType.TOOL_CALL,
                        call.payload,
                        {**call.metadata, "tool_call_id": call.tool_call_id, "to": call.to},
                    ),
                )
                db.execute(
                    "INSERT INTO turn_waiting_tools (tool_call_id, agent_id, agent_turn_id, "
                    "turn_epoch, step_id, to_listener, after_execution, status, created_at, "
                    "updated_at) VALUES (?,?,?,?,?,?,?,'waiting',?,?)",
                    (
                        call.tool_call_id,
                        token.agent_id,
                        token.agent_turn_id,
                        token.turn_epoch,
                        step_id,
                        call.to,
                        call.after_execution,
                        now,
                        now,
                    ),
                )
                self._edge(
                    db,
                    token.agent_id,
                    token.agent_turn_id,
                    "tool_call",
                    "request",
                    correlation_id=call.tool_call_id,
                    metadata={"to": call.to, "card_id": card_id},
                )
                db.execute(
                    "UPDATE agent_inbox SET next_retry_at = ?, agent_turn_id = ?, "
                    "turn_epoch = ? WHERE correlation_id = ? AND status = ?",
                    (
                        now,
                        token.agent_turn_id,
                        token.turn_epoch,
                        call.tool_call_id,
                        InboxStatus.DEFERRED,
                    ),
                )
            self._close_step(db, step_id, None, now, "completed", [c.tool_call_id for c in calls])

    async def apply_report(self, row: InboxRow) -> ReportOutcome:
        """Apply one claimed tool_result/timeout row to its waiting set (single winner).

        Duplicates and late results are acknowledged (``skipped``) and change nothing.
        A report with no waiting row yet is deferred with backoff until
        ``settings.max_retries`` is exhausted, then marked ``error``.
        """
        now = self._clock.now()
        s = self.settings
        with self._tx() as db:
            waiting = db.execute(
                "SELECT agent_turn_id, turn_epoch, status, to_listener, after_execution "
                "FROM turn_waiting_tools WHERE tool_call_id = ? AND agent_id = ?",
                (row.correlation_id, row.agent_id),
            ).fetchone()
            if waiting is None:
                if row.retry_count >= s.max_retries:
                    self._inbox_move(
                        db,
                        row.inbox_id,
                        InboxEvent.FAIL,
                        defer_reason="retries exhausted: no such tool call",
                    )
                    return ReportOutcome("exhausted")
                self._inbox_move(
                    db,
                    row.inbox_id,
                    InboxEvent.DEFER,
                    retry_count=row.retry_count + 1,
                    next_retry_at=now + s.retry_base_s * (2**row.retry_count),
                    defer_reason="awaiting suspend",
                )
                return ReportOutcome("deferred")
            turn_id, epoch, wstatus, to, after = waiting
            if wstatus != "waiting":
                self._inbox_move(
                    db, row.inbox_id, InboxEvent.SKIP, defer_reason=f"duplicate or late ({wstatus})"
                )
                return ReportOutcome("duplicate")
            token = TurnToken(row.agent_id, turn_id, epoch)
            head = db.execute(
                "SELECT status, active_agent_turn_id, turn_epoch, waiting_tool_count, "
                "output_box_id FROM agent_state_head WHERE agent_id = ?",
                (row.agent_id,),
            ).fetchone()
            if head is None or (head[0], head[1], head[2]) != (
                HeadStatus.SUSPENDED,
                turn_id,
                epoch,
            ):
                self._inbox_move(db, row.inbox_id, InboxEvent.SKIP, defer_reason="stale turn")
                return ReportOutcome("stale")
            is_timeout = row.message_type == MessageType.TIMEOUT
            failed = row.failed or is_timeout
            content = bytes(row.payload).decode("utf-8", "replace")
            card_id = self._card(
                db,
                head[4],
                turn_id,
                NewCard(
                    CardType.TOOL_RESULT,
                    content,
                    {
                        "tool_call_id": row.correlation_id,
                        "to": to,
                        "failed": failed,
                        "timeout": is_timeout,
                        "after_execution": after,
                    },
                ),
            )
            db.execute(
                "UPDATE turn_waiting_tools SET status = ?, result_card_id = ?, updated_at = ? "
                "WHERE tool_call_id = ? AND status = 'waiting'",
                ("timeout" if is_timeout else "received", card_id, now, row.correlation_id),
            )
            self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME)
            remaining = head[3] - 1
            if remaining > 0:
                self._fenced(
                    db,
                    token,
                    HeadStatus.SUSPENDED,
                    now,
                    set_sql="waiting_tool_count = ?",
                    params=(remaining,),
                    stale="suspended head moved",
                )
                return ReportOutcome("applied")
            new_epoch = self._cas(
                db,
                token,
                HeadEvent.RESUME,
                {"waiting_tool_count": 0, "resume_deadline": None, "running_since": now},
            )
            term = db.execute(
                "SELECT result_card_id FROM turn_waiting_tools WHERE agent_turn_id = ? "
                "AND turn_epoch = ? AND status = 'received' AND after_execution = 'terminate' "
                "ORDER BY created_at LIMIT 1",
                (turn_id, epoch),
            ).fetchone()
            self._edge(db, row.agent_id, turn_id, "resume", "request")
            return ReportOutcome(
                "applied", TurnToken(row.agent_id, turn_id, new_epoch), term[0] if term else None
            )

    async def take_resume(self, row: InboxRow) -> TurnToken | None:
        """Consume a ``resume`` row if its Turn is still running at the row's epoch."""
        token = row.token
        if token is None:
            await self.skip_row(row, "resume without a Turn")
            return None
        try:
            with self._tx() as db:
                self._assert_running(db, token)
                self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME)
        except StaleTurn:
            await self.skip_row(row, "stale turn")
            return None
        return token

    async def add_cards(self, token: TurnToken, cards: Sequence[NewCard]) -> None:
        """Append cards to the Turn's output box (CAS-fenced on ``running``)."""
        with self._tx() as db:
            self._assert_running(db, token)
            box = self._output_box(db, token.agent_id)
            for card in cards:
                self._card(db, box, token.agent_turn_id, card)

    async def finish(
        self,
        token: TurnToken,
        status: str,
        text: str,
        metadata: Mapping[str, Any],
        reply_payload: bytes,
    ) -> Finished:
        """running → idle with the deliverable card and the pending reply (one transaction)."""
        with self._tx() as db:
            return self._end_turn(
                db, token, HeadEvent.FINISH, status, text, metadata, reply_payload
            )

    async def force_end(
        self,
        agent_id: str,
        status: str,
        text: str,
        reply_payload: bytes | None,
        *,
        agent_turn_id: str | None = None,
        turn_epoch: int | None = None,
        expect_status: Sequence[str] | None = None,
    ) -> Finished | None:
        """End the active Turn (stop, watchdog): epoch + 1, failed deliverable, reply.

        ``agent_turn_id``/``turn_epoch``/``expect_status`` narrow what is ended; ``None``
        when nothing matched (no active Turn, or it already moved on).
        """
        with self._tx() as db:
            row = db.execute(
                "SELECT status, active_agent_turn_id, turn_epoch FROM agent_state_head "
                "WHERE agent_id = ?",
                (agent_id,),
            ).fetchone()
            if row is None or row[1] is None or row[0] not in ACTIVE_HEAD:
                return None
            if agent_turn_id is not None and row[1] != agent_turn_id:
                return None
            if turn_epoch is not None and row[2] != turn_epoch:
                return None
            if expect_status is not None and row[0] not in expect_status:
                return None
            token = TurnToken(agent_id, row[1], row[2])
            return self._end_turn(
                db, token, HeadEvent.FORCE_END, status, text, {"forced": True}, reply_payload
            )

    async def cards(self, box_id: str) -> list[Card]:
        rows = self._db.execute(
            "SELECT card_id, box_id, card_type, content, metadata, created_at FROM cards "
            "WHERE box_id = ? ORDER BY seq",
            (box_id,),
        ).fetchall()
        return [Card(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]

    async def card(self, card_id: str) -> Card | None:
        r = self._db.execute(
            "SELECT card_id, box_id, card_type, content, metadata, created_at FROM cards "
            "WHERE card_id = ?",
            (card_id,),
        ).fetchone()
        return Card(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) if r else None

    async def turn_reply_ref(self, token: TurnToken) -> str | None:
        row = self._db.execute(
            "SELECT i.reply_ref FROM agent_state_head h JOIN agent_inbox i "
            "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ? AND h.active_agent_turn_id = ?",
            (token.agent_id, token.agent_turn_id),
        ).fetchone()
        return row[0] if row else None

    # -- watchdog ---------------------------------------------------------------------
    async def requeue_stuck(self, older_than_s: float) -> int:
        now = self._clock.now()
        with self._tx() as db:
            return self._requeue(db, now, before=now - older_than_s)

    def _requeue(self, db: sqlite3.Connection, now: float, before: float | None = None) -> int:
        """processing → pending (due now): rows taken before ``before``, or all of them
        (None); how many."""
        if before is None:
            rows = db.execute(
                "SELECT inbox_id FROM agent_inbox WHERE status = ?", (InboxStatus.PROCESSING,)
            ).fetchall()
        else:
            rows = db.execute(
                "SELECT inbox_id FROM agent_inbox WHERE status = ? AND processing_at < ?",
                (InboxStatus.PROCESSING, before),
            ).fetchall()
        n = 0
        for (inbox_id,) in rows:
            n += self._inbox_move(
                db, inbox_id, InboxEvent.REQUEUE, next_retry_at=now, processing_at=None
            )
        return n

    async def expired_suspensions(self) -> list[TurnToken]:
        rows = self._db.execute(
            "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head "
            "WHERE status = ? AND resume_deadline IS NOT NULL AND resume_deadline < ?",
            (HeadStatus.SUSPENDED, self._clock.now()),
        ).fetchall()
        return [TurnToken(*r) for r in rows]

    async def suspended_turns(self) -> list[TurnToken]:
        """Every Turn suspended on tools, whatever its deadline (used after a restart)."""
        rows = self._db.execute(
            "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head "
            "WHERE status = ? AND resume_deadline IS NOT NULL",
            (HeadStatus.SUSPENDED,),
        ).fetchall()
        return [TurnToken(*r) for r in rows]

    async def inject_timeouts(self, token: TurnToken, reason: str = "timed out") -> int:
        """One timeout report per still-waiting tool; clears ``resume_deadline`` (once)."""
        now = self._clock.now()
        with self._tx() as db:
            self._fenced(
                db,
                token,
                HeadStatus.SUSPENDED,
                now,
                set_sql="resume_deadline = NULL",
                where_sql=" AND resume_deadline IS NOT NULL",
                stale="not suspended with a deadline",
            )
            waiting = db.execute(
                "SELECT tool_call_id, to_listener FROM turn_waiting_tools WHERE agent_turn_id = ? "
                "AND turn_epoch = ? AND status = 'waiting' AND after_execution != 'approval'",
                (token.agent_turn_id, token.turn_epoch),
            ).fetchall()
            for tool_call_id, to in waiting:
                text = f"No result from {to}: the tool call {reason}."
                self._insert_report(
                    db,
                    _new_id(),
                    token.agent_id,
                    MessageType.TIMEOUT,
                    tool_call_id,
                    text.encode(),
                    True,
                    now,
                )
        return len(waiting)

    async def stale_dispatched(self, older_than_s: float) -> list[Head]:
        rows = self._db.execute(
            f"SELECT {_HEAD_COLS} FROM agent_state_head WHERE status = ? AND dispatched_at < ?",
            (HeadStatus.DISPATCHED, self._clock.now() - older_than_s),
        ).fetchall()
        return [Head(*r) for r in rows]

    async def overdue_running(self, older_than_s: float) -> list[Head]:
        rows = self._db.execute(
            f"SELECT {_HEAD_COLS} FROM agent_state_head WHERE status = ? AND running_since < ?",
            (HeadStatus.RUNNING, self._clock.now() - older_than_s),
        ).fetchall()
        return [Head(*r) for r in rows]

    async def recover_running(self) -> list[TurnToken]:
        """At start-up: every ``running`` Turn lost its worker. Fence it (epoch + 1), reset
        its in-flight rows, and queue a ``resume`` row so a worker re-runs its next step.

        Call only when no worker of this store is alive (before starting the worker).
        """
        now = self._clock.now()
        out = []
        with self._tx() as db:
            self._requeue(db, now)
            rows = db.execute(
                "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head "
                "WHERE status = ?",
                (HeadStatus.RUNNING,),
            ).fetchall()
            for r in rows:
                token = TurnToken(*r)
                due, payload = self._pending_step_retry(db, token, now)
                epoch = self._cas(db, token, HeadEvent.RECOVER, {"running_since": now})
                db.execute(
                    "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, "
                    "agent_turn_id, turn_epoch, payload, next_retry_at, created_at, updated_at) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (
                        _new_id(),
                        token.agent_id,
                        MessageType.RESUME,
                        InboxStatus.PENDING,
                        token.agent_turn_id,
                        epoch,
                        payload,
                        due,
                        now,
                        now,
                    ),
                )
                self._edge(db, token.agent_id, token.agent_turn_id, "recover", "request")
                out.append(TurnToken(token.agent_id, token.agent_turn_id, epoch))
        return out

    # -- memory across tasks (issue 12) ------------------------------------------------
    def _continue_conversation(
        self,
        db: sqlite3.Connection,
        agent_id: str,
        conversation: str,
        context_box: str,
        turn_id: str,
    ) -> None:
        """Copy the conversation's cards (what its last Turn's model saw, plus that Turn's
        own cards but its deliverable) into a new Turn's context box, in order."""
        row = db.execute(
            "SELECT context_box_id, output_box_id FROM conversations "
            "WHERE agent_id = ? AND conversation = ?",
            (agent_id, conversation),
        ).fetchone()
        if row is None:
            return
        for box in row:
            db.execute(
                "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
                "metadata, created_at, tokens) SELECT lower(hex(randomblob(16))), ?, ?, "
                "card_type, content, metadata, created_at, tokens FROM cards "
                "WHERE box_id = ? AND card_type != ? ORDER BY seq",
                (context_box, turn_id, box, CardType.DELIVERABLE),
            )

    def _save_conversation(
        self,
        db: sqlite3.Connection,
        agent_id: str,
        turn_inbox_id: str | None,
        context_box: str | None,
        output_box: str | None,
        now: float,
    ) -> None:
        if not turn_inbox_id or not context_box or not output_box:
            return
        row = db.execute(
            "SELECT conversation FROM agent_inbox WHERE inbox_id = ?", (turn_inbox_id,)
        ).fetchone()
        if row is None or row[0] is None:
            return
        db.execute(
            "INSERT INTO conversations (agent_id, conversation, context_box_id, output_box_id, "
            "updated_at) VALUES (?,?,?,?,?) ON CONFLICT (agent_id, conversation) DO UPDATE "
            "SET context_box_id = excluded.context_box_id, "
            "output_box_id = excluded.output_box_id, updated_at = excluded.updated_at",
            (agent_id, row[0], context_box, output_box, now),
        )

    async def conversation_cards(self, agent_id: str, conversation: str) -> list[Card]:
        """The cards a new task of ``conversation`` would continue from (read only)."""
        row = self._db.execute(
            "SELECT context_box_id, output_box_id FROM conversations "
            "WHERE agent_id = ? AND conversation = ?",
            (agent_id, conversation),
        ).fetchone()
        if row is None:
            return []
        cards = await self.cards(row[0]) + await self.cards(row[1])
        return [c for c in cards if c.card_type != CardType.DELIVERABLE]

    async def replace_conversation(
        self,
        agent_id: str,
        conversation: str,
        expect_boxes: tuple[str, str],
        summary: NewCard,
        keep: Sequence[str],
    ) -> bool:
        """Manual compaction of an idle conversation: [summary] + copies of ``keep``, if
        the conversation still points at ``expect_boxes`` (else False, nothing written)."""
        now = self._clock.now()
        with self._tx() as db:
            row = db.execute(
                "SELECT context_box_id, output_box_id FROM conversations "
                "WHERE agent_id = ? AND conversation = ?",
                (agent_id, conversation),
            ).fetchone()
            if row is None or tuple(row) != tuple(expect_boxes):
                return False
            turn = f"compaction:{_new_id()}"
            context_box, output_box = _new_id(), _new_id()
            db.executemany(
                "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) "
                "VALUES (?,?,?,?,?)",
                [
                    (context_box, agent_id, turn, "context", now),
                    (output_box, agent_id, turn, "output", now),
                ],
            )
            self._card(db, context_box, turn, summary)
            for card_id in keep:
                db.execute(
                    "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
                    "metadata, created_at, tokens) SELECT ?, ?, ?, card_type, "
                    "content, metadata, created_at, tokens FROM cards WHERE card_id = ?",
                    (_new_id(), output_box, turn, card_id),
                )
            db.execute(
                "UPDATE conversations SET context_box_id = ?, output_box_id = ?, updated_at = ? "
                "WHERE agent_id = ? AND conversation = ?",
                (context_box, output_box, now, agent_id, conversation),
            )
            self._edge(
                db, agent_id, None, "compact", "response", metadata={"conversation": conversation}
            )
        return True

    async def conversation_boxes(self, agent_id: str, conversation: str) -> tuple[str, str] | None:
        row = self._db.execute(
            "SELECT context_box_id, output_box_id FROM conversations "
            "WHERE agent_id = ? AND conversation = ?",
            (agent_id, conversation),
        ).fetchone()
        return (row[0], row[1]) if row else None

    # -- step retry (issue 12) ---------------------------------------------------------
    async def retry_step(
        self,
        token: TurnToken,
        step_id: str,
        *,
        attempt: int,
        kind: str,
        delay_s: float,
        error: str,
    ) -> float:
        """Close the failed step as ``retrying`` and queue a ``resume`` row due after
        ``delay_s``: the durable retry wait. The failed attempt does not count toward the
        step limit and leaves no card. Returns the due time. CAS-fenced on ``running``.
        """
        now = self._clock.now()
        due = now + delay_s
        with self._tx() as db:
            self._fenced(
                db, token, HeadStatus.RUNNING, now, set_sql="step_count = max(step_count - 1, 0)"
            )
            meta = {"attempt": attempt, "kind": kind, "delay_s": delay_s, "error": error}
            db.execute(
                "UPDATE agent_steps SET status = 'retrying', ended_at = ?, metadata = ? "
                "WHERE step_id = ?",
                (now, json.dumps(meta), step_id),
            )
            db.execute(
                "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, "
                "agent_turn_id, turn_epoch, payload, next_retry_at, defer_reason, created_at, "
                "updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    _new_id(),
                    token.agent_id,
                    MessageType.RESUME,
                    InboxStatus.PENDING,
                    token.agent_turn_id,
                    token.turn_epoch,
                    step_retry_payload(attempt),
                    due,
                    f"step retry {attempt} after {kind}",
                    now,
                    now,
                ),
            )
            self._edge(
                db, token.agent_id, token.agent_turn_id, "step_retry", "request", metadata=meta
            )
        return due

    def _abandon_step_retries(self, db: sqlite3.Connection, token: TurnToken) -> None:
        """A Turn that ends (e.g. stopped during a retry wait) drops its retry wait."""
        rows = db.execute(
            "SELECT inbox_id FROM agent_inbox WHERE agent_id = ? AND agent_turn_id = ? "
            "AND message_type = ? AND status = ?",
            (token.agent_id, token.agent_turn_id, MessageType.RESUME, InboxStatus.PENDING),
        ).fetchall()
        for (inbox_id,) in rows:
            self._inbox_move(db, inbox_id, InboxEvent.ABANDON, defer_reason="turn ended")

    def _pending_step_retry(
        self, db: sqlite3.Connection, token: TurnToken, now: float
    ) -> tuple[float, bytes]:
        """A restart keeps a Turn's retry wait: the due time and retry count of its
        not-yet-taken retry row (which the recovery's own resume row replaces)."""
        row = db.execute(
            "SELECT inbox_id, next_retry_at, payload FROM agent_inbox WHERE agent_id = ? "
            "AND agent_turn_id = ? AND message_type = ? AND status = ? "
            "ORDER BY next_retry_at DESC LIMIT 1",
            (token.agent_id, token.agent_turn_id, MessageType.RESUME, InboxStatus.PENDING),
        ).fetchone()
        if row is None or step_retries_done(bytes(row[2])) == 0:
            return now, b""
        self._inbox_move(db, row[0], InboxEvent.ABANDON, defer_reason="replaced at restart")
        return max(now, float(row[1])), bytes(row[2])

    # -- replies ----------------------------------------------------------------------
    async def pending_replies(self, limit: int, older_than_s: float = 0.0) -> list[PendingReply]:
        rows = self._db.execute(
            "SELECT agent_turn_id, agent_id, reply_ref, payload, failed, attempts "
            "FROM agent_replies WHERE status = 'pending' AND created_at <= ? "
            "ORDER BY created_at LIMIT ?",
            (self._clock.now() - older_than_s, limit),
        ).fetchall()
        return [PendingReply(r[0], r[1], r[2], bytes(r[3]), bool(r[4]), r[5]) for r in rows]

    async def mark_reply_sent(self, agent_turn_id: str) -> None:
        with self._tx() as db:
            self._mark_sent(db, agent_turn_id)

    def _mark_sent(self, db: sqlite3.Connection, agent_turn_id: str) -> int:
        """Mark a Turn's outbox reply sent (once); how many rows changed."""
        return db.execute(
            "UPDATE agent_replies SET status = 'sent', sent_at = ?, attempts = attempts + 1 "
            "WHERE agent_turn_id = ? AND status != 'sent'",
            (self._clock.now(), agent_turn_id),
        ).rowcount

    async def mark_reply_attempt(self, agent_turn_id: str, give_up: bool) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE agent_replies SET attempts = attempts + 1, status = ? "
                "WHERE agent_turn_id = ? AND status = 'pending'",
                ("undeliverable" if give_up else "pending", agent_turn_id),
            )

    async def record_client_reply(
        self,
        client: str,
        thread_ref: ReplyRef,
        payload: bytes,
        *,
        failed: bool,
        agent_turn_id: str | None = None,
    ) -> int:
        """Keep a reply for a named client that is away; the oldest beyond the bound go.

        With ``agent_turn_id`` the Turn's outbox reply is marked sent in the same
        transaction, so a crash can neither lose the reply nor keep it twice.
        """
        with self._tx() as db:
            if agent_turn_id is not None:
                if (
                    self._mark_sent(db, agent_turn_id) == 0
                    and db.execute(
                        "SELECT 1 FROM agent_replies WHERE agent_turn_id = ?", (agent_turn_id,)
                    ).fetchone()
                ):
                    return 0  # already handed over: keep nothing twice
            cur = db.execute(
                "INSERT INTO client_replies (client, thread_ref, payload, failed, created_at) "
                "VALUES (?,?,?,?,?)",
                (client, json.dumps(thread_ref), payload, int(failed), self._clock.now()),
            )
            db.execute(
                "DELETE FROM client_replies WHERE client = ? AND delivered_at IS NULL AND "
                "reply_id NOT IN (SELECT reply_id FROM client_replies WHERE client = ? AND "
                "delivered_at IS NULL ORDER BY reply_id DESC LIMIT ?)",
                (client, client, self.settings.client_replies_max),
            )
            db.execute(
                "DELETE FROM client_replies WHERE client = ? AND delivered_at IS NOT NULL",
                (client,),
            )
            return int(cur.lastrowid or 0)

    async def pending_client_replies(
        self, client: str, after_id: int = 0, limit: int = 100
    ) -> list[ClientReply]:
        """The replies kept for ``client`` with an id above ``after_id``, oldest first.
        Reading does not hand them over: they stay until :meth:`ack_client_replies`."""
        rows = self._db.execute(
            "SELECT reply_id, client, thread_ref, payload, failed, created_at "
            "FROM client_replies WHERE client = ? AND delivered_at IS NULL AND reply_id > ? "
            "ORDER BY reply_id LIMIT ?",
            (client, after_id, limit),
        ).fetchall()
        return [ClientReply(r[0], r[1], r[2], bytes(r[3]), bool(r[4]), r[5]) for r in rows]

    async def ack_client_replies(self, client: str, reply_ids: Sequence[int]) -> int:
        """Forget the replies of ``client`` it has received (ids of other clients are
        ignored); how many were still kept."""
        if not reply_ids:
            return 0
        with self._tx() as db:
            return sum(
                db.execute(
                    "DELETE FROM client_replies WHERE client = ? AND reply_id = ?",
                    (client, reply_id),
                ).rowcount
                for reply_id in reply_ids
            )

    # -- stop and cancel from outside (agentserver.operator) -----------------------------

    async def turn_of_thread(self, agent_id: str, caller_thread: str) -> str | None:
        """The active Turn's id if it is the task sent on the caller's ``caller_thread``."""
        row = self._db.execute(
            "SELECT h.active_agent_turn_id FROM agent_state_head h JOIN agent_inbox i "
            "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ? "
            "AND json_extract(i.reply_ref, '$.caller_thread') = ?",
            (agent_id, caller_thread),
        ).fetchone()
        return row[0] if row and row[0] else None

    async def cancel_queued(
        self, agent_id: str, caller_thread: str | None, failed_answer: bytes
    ) -> list[PendingReply]:
        """Cancel the agent's queued tasks (only the one sent on ``caller_thread``, if
        given): ``queued → skipped`` and, in the same transaction, one failed answer per
        task in the reply outbox (keyed ``cancel:INBOX_ID``; sent like a Turn's and resent
        after a crash). Returns the replies to send now."""
        sources = inbox_sources(InboxEvent.CANCEL)
        marks = ",".join("?" * len(sources))
        query = (
            f"SELECT inbox_id, reply_ref FROM agent_inbox WHERE agent_id = ? "
            f"AND message_type = 'turn' AND status IN ({marks})"
        )
        args: list[object] = [agent_id, *sources]
        if caller_thread is not None:
            query += " AND json_extract(reply_ref, '$.caller_thread') = ?"
            args.append(caller_thread)
        target = inbox_transition(InboxStatus.QUEUED, InboxEvent.CANCEL).target
        now = self._clock.now()
        out: list[PendingReply] = []
        with self._tx() as db:
            for inbox_id, ref in db.execute(query, args).fetchall():
                changed = db.execute(
                    f"UPDATE agent_inbox SET status = ?, updated_at = ? WHERE inbox_id = ? "
                    f"AND status IN ({marks})",
                    (str(target), now, inbox_id, *sources),
                ).rowcount
                if not changed or ref is None:
                    continue
                key = f"cancel:{inbox_id}"
                db.execute(
                    "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, "
                    "failed, status, created_at) VALUES (?,?,?,?,1,'pending',?)",
                    (key, agent_id, ref, failed_answer, now),
                )
                out.append(PendingReply(key, agent_id, ref, failed_answer, True, 0))
        return out
