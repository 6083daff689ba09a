"""The store's part of governance: the policy decisions of each step (the rate windows
are counted from them) and the refusal cards written with them.

A mixin of :class:`agentserver.agents.sqlite_store.SqliteAgentStore` (its tables are
created by schema migration 2), kept apart so the Turn protocol's store stays as it was.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentserver.agents.approvals import APPROVAL_PREFIX, PendingApproval
from agentserver.agents.states import HeadStatus, InboxEvent, InboxStatus, MessageType
from agentserver.agents.store import InboxRow, NewCard, TurnToken

MIGRATION = """
CREATE TABLE policy_decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    step_id TEXT NOT NULL,
    target TEXT NOT NULL,
    payload_tag TEXT NOT NULL,
    decision TEXT NOT NULL,
    rule TEXT NOT NULL,
    reason TEXT NOT NULL,
    rate_key TEXT,
    at REAL NOT NULL
);
CREATE INDEX policy_decisions_rate ON policy_decisions (rate_key, at);
CREATE INDEX policy_decisions_turn ON policy_decisions (agent_turn_id, seq);
CREATE TABLE approvals (
    request_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    step_id TEXT NOT NULL,
    target TEXT NOT NULL,
    payload TEXT NOT NULL,
    rule TEXT NOT NULL,
    approver TEXT NOT NULL,
    thread TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    deadline REAL NOT NULL,
    created_at REAL NOT NULL,
    sent_at REAL,
    decided_at REAL,
    decided_by TEXT,
    tool_call_id TEXT
);
CREATE INDEX approvals_status ON approvals (status, deadline);
"""


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One tool call's governance decision, as the step log keeps it.

    ``decision``: allow, deny, require-approval, or blocked/halted by a guardrail (the
    loop detector is ``loop-block``). ``rate_key`` is set on an allowed call that counts
    against a rate window.
    """

    target: str
    payload_tag: str
    decision: str
    rule: str
    reason: str
    rate_key: str | None = None
    step_id: str = ""
    at: float = 0.0


class GovernanceStore(Protocol):
    async def rate_window(self, rate_key: str, since: float) -> list[float]:
        """Times (ascending) of the allowed calls counted under ``rate_key`` after ``since``."""
        ...

    async def record_decisions(
        self,
        token: TurnToken,
        step_id: str,
        decisions: Sequence[DecisionRecord],
        cards: Sequence[NewCard],
    ) -> None:
        """Log the step's decisions and add ``cards`` (refusals), CAS-fenced on running."""
        ...

    async def turn_decisions(self, agent_turn_id: str) -> list[DecisionRecord]: ...


class GovernanceStoreMixin:
    """SQLite implementation of :class:`GovernanceStore` (uses the store's helpers)."""

    _clock: Any
    _db: Any

    async def rate_window(self, rate_key: str, since: float) -> list[float]:
        rows = self._db.execute(
            "SELECT at FROM policy_decisions WHERE rate_key = ? AND at > ? ORDER BY at",
            (rate_key, since),
        ).fetchall()
        return [r[0] for r in rows]

    async def record_decisions(
        self,
        token: TurnToken,
        step_id: str,
        decisions: Sequence[DecisionRecord],
        cards: Sequence[NewCard],
        approvals: Sequence[PendingApproval] = (),
    ) -> None:
        now = self._clock.now()
        with self._tx() as db:  # type: ignore[attr-defined]
            self._assert_running(db, token)  # type: ignore[attr-defined]
            box = self._output_box(db, token.agent_id)  # type: ignore[attr-defined]
            for a in approvals:
                # Not sent before its waiting row exists (the suspend that follows).
                db.execute(
                    "INSERT INTO approvals (request_id, agent_id, agent_turn_id, step_id, "
                    "target, payload, rule, approver, thread, status, deadline, created_at) "
                    "VALUES (?,?,?,?,?,?,?,?,?,'pending',?,?)",
                    (
                        a.request_id,
                        a.agent_id,
                        a.agent_turn_id,
                        step_id,
                        a.target,
                        a.payload,
                        a.rule,
                        a.approver,
                        a.thread,
                        a.deadline,
                        now,
                    ),
                )
            for d in decisions:
                db.execute(
                    "INSERT INTO policy_decisions (agent_id, agent_turn_id, step_id, target, "
                    "payload_tag, decision, rule, reason, rate_key, at) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (
                        token.agent_id,
                        token.agent_turn_id,
                        step_id,
                        d.target,
                        d.payload_tag,
                        d.decision,
                        d.rule,
                        d.reason,
                        d.rate_key,
                        now,
                    ),
                )
            for card in cards:
                self._card(db, box, token.agent_turn_id, card)  # type: ignore[attr-defined]
            if decisions:
                # The step log names what governance decided for this step's calls.
                row = db.execute(
                    "SELECT metadata FROM agent_steps WHERE step_id = ?", (step_id,)
                ).fetchone()
                meta = json.loads(row[0]) if row and row[0] else {}
                meta.setdefault("policy", []).extend(
                    {"target": d.target, "decision": d.decision, "rule": d.rule} for d in decisions
                )
                db.execute(
                    "UPDATE agent_steps SET metadata = ? WHERE step_id = ?",
                    (json.dumps(meta), step_id),
                )

    async def turn_decisions(self, agent_turn_id: str) -> list[DecisionRecord]:
        rows = self._db.execute(
            "SELECT target, payload_tag, decision, rule, reason, rate_key, step_id, at "
            "FROM policy_decisions WHERE agent_turn_id = ? ORDER BY seq",
            (agent_turn_id,),
        ).fetchall()
        return [DecisionRecord(*r) for r in rows]

    # -- approvals (agentserver.agents.approvals) -----------------------------------------

    _APPROVAL_COLS = (
        "a.request_id, a.agent_id, a.agent_turn_id, a.target, a.payload, a.rule, a.approver, "
        "a.deadline, a.thread"
    )

    async def unsent_approvals(self) -> list[PendingApproval]:
        """Pending requests not sent yet whose call is suspended waiting for them."""
        rows = self._db.execute(
            f"SELECT {self._APPROVAL_COLS} FROM approvals a JOIN turn_waiting_tools w "
            "ON w.tool_call_id = ? || a.request_id WHERE a.status = 'pending' "
            "AND a.sent_at IS NULL AND w.status = 'waiting' ORDER BY a.created_at",
            (APPROVAL_PREFIX,),
        ).fetchall()
        return [PendingApproval(*r) for r in rows]

    async def pending_approvals(self, approver: str | None = None) -> list[PendingApproval]:
        rows = self._db.execute(
            f"SELECT {self._APPROVAL_COLS} FROM approvals a WHERE a.status = 'pending' "
            "AND (? IS NULL OR a.approver = ?) ORDER BY a.created_at",
            (approver, approver),
        ).fetchall()
        return [PendingApproval(*r) for r in rows]

    async def approval_status(self, request_id: str) -> str | None:
        row = self._db.execute(
            "SELECT status FROM approvals WHERE request_id = ?", (request_id,)
        ).fetchone()
        return row[0] if row else None

    async def mark_approval_sent(self, request_id: str) -> None:
        with self._tx() as db:  # type: ignore[attr-defined]
            db.execute(
                "UPDATE approvals SET sent_at = ? WHERE request_id = ?",
                (self._clock.now(), request_id),
            )

    async def unsend_approvals(self, approvers: Sequence[str]) -> None:
        """Pending requests to these approvers are to be sent again (listener approvers
        after a restart: the pump's threads did not survive it)."""
        if not approvers:
            return
        with self._tx() as db:  # type: ignore[attr-defined]
            db.execute(
                "UPDATE approvals SET sent_at = NULL WHERE status = 'pending' AND approver IN "
                f"({','.join('?' * len(approvers))})",
                tuple(approvers),
            )

    def _settle(
        self, db: Any, request_id: str, agent_id: str, status: str, failed_text: str | None
    ) -> None:
        """Mark the request ``status`` and queue what its call becomes: the ``approval``
        row that forwards it, or (``failed_text``) a failed result of the call."""
        now = self._clock.now()
        db.execute(
            "UPDATE approvals SET status = ?, decided_at = ? WHERE request_id = ?",
            (status, now, request_id),
        )
        mtype = MessageType.APPROVAL if failed_text is None else MessageType.TOOL_RESULT
        self._insert_report(  # type: ignore[attr-defined]
            db,
            _new_id(),
            agent_id,
            mtype,
            APPROVAL_PREFIX + request_id,
            (failed_text or "").encode(),
            failed_text is not None,
            now,
        )

    async def decide_approval(
        self, request_id: str, grant: bool, reason: str, by: str | None
    ) -> str:
        """The first decision wins: ``applied``; else ``duplicate``, ``unknown`` or
        ``not-yours`` (``by`` is not the approver), and nothing changes."""
        with self._tx() as db:  # type: ignore[attr-defined]
            row = db.execute(
                "SELECT status, approver, agent_id, target FROM approvals WHERE request_id = ?",
                (request_id,),
            ).fetchone()
            if row is None:
                return "unknown"
            status, approver, agent_id, target = row
            if by is not None and by != approver:
                return "not-yours"
            if status != "pending":
                return "duplicate"
            db.execute(
                "UPDATE approvals SET reason = ?, decided_by = ? WHERE request_id = ?",
                (reason, by, request_id),
            )
            if grant:
                self._settle(db, request_id, agent_id, "granted", None)
            else:
                why = f": {reason}" if reason else ""
                who = by or "the operator"
                text = f"the call to {target} was denied by {who}{why}; it was not sent"
                self._settle(db, request_id, agent_id, "denied", text)
            return "applied"

    async def expire_approvals(self, now: float) -> int:
        with self._tx() as db:  # type: ignore[attr-defined]
            rows = db.execute(
                "SELECT request_id, agent_id, target, approver, deadline - created_at "
                "FROM approvals WHERE status = 'pending' AND deadline <= ?",
                (now,),
            ).fetchall()
            for request_id, agent_id, target, approver, waited in rows:
                text = (
                    f"the call to {target} got no decision from {approver} within "
                    f"{round(waited, 1):g} s; it was not sent"
                )
                self._settle(db, request_id, agent_id, "timed_out", text)
        return len(rows)

    async def begin_forward(self, row: InboxRow) -> tuple[str, TurnToken, str, str] | None:
        """Claim a granted request for forwarding (committed before the call is sent, so a
        crash can never send it twice). None: nothing to send (the row is settled)."""
        request_id = (row.correlation_id or "")[len(APPROVAL_PREFIX) :]
        with self._tx() as db:  # type: ignore[attr-defined]
            found = db.execute(
                "SELECT a.status, a.target, a.payload, w.agent_turn_id, w.turn_epoch, w.status "
                "FROM approvals a LEFT JOIN turn_waiting_tools w ON w.tool_call_id = ? "
                "WHERE a.request_id = ?",
                (row.correlation_id, request_id),
            ).fetchone()
            if found is None or found[0] not in ("granted", "forwarding") or found[5] != "waiting":
                self._inbox_move(  # type: ignore[attr-defined]
                    db, row.inbox_id, InboxEvent.SKIP, defer_reason="approval settled"
                )
                return None
            status, target, payload, turn_id, epoch, _ = found
            if status == "forwarding":
                # A crash between claiming and recording the forward: whether it left is
                # unknown, so it is reported lost rather than risked twice.
                db.execute(
                    "UPDATE approvals SET status = 'lost' WHERE request_id = ?", (request_id,)
                )
                self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME)  # type: ignore[attr-defined]
                self._insert_report(  # type: ignore[attr-defined]
                    db,
                    _new_id(),
                    row.agent_id,
                    MessageType.TOOL_RESULT,
                    row.correlation_id or "",
                    f"the approved call to {target} was interrupted by a restart; "
                    "it may or may not have been sent".encode(),
                    True,
                    self._clock.now(),
                )
                return None
            db.execute(
                "UPDATE approvals SET status = 'forwarding' WHERE request_id = ?", (request_id,)
            )
            return request_id, TurnToken(row.agent_id, turn_id, epoch), target, payload

    async def finish_forward(
        self, request_id: str, row: InboxRow, sub_thread: str, after: str, deadline: float
    ) -> None:
        """The granted call was sent as ``sub_thread``: its waiting row now waits for that
        sub-thread's result like any tool call."""
        now = self._clock.now()
        with self._tx() as db:  # type: ignore[attr-defined]
            db.execute(
                "UPDATE approvals SET status = 'forwarded', tool_call_id = ? WHERE request_id = ?",
                (sub_thread, request_id),
            )
            waiting = db.execute(
                "SELECT agent_turn_id, turn_epoch FROM turn_waiting_tools WHERE tool_call_id = ? "
                "AND status = 'waiting'",
                (row.correlation_id,),
            ).fetchone()
            self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME)  # type: ignore[attr-defined]
            if waiting is None:
                return
            db.execute(
                "UPDATE turn_waiting_tools SET tool_call_id = ?, after_execution = ?, "
                "updated_at = ? WHERE tool_call_id = ? AND status = 'waiting'",
                (sub_thread, after, now, row.correlation_id),
            )
            db.execute(
                "UPDATE agent_state_head SET resume_deadline = max(coalesce(resume_deadline, 0), ?) "
                "WHERE agent_id = ? AND active_agent_turn_id = ? AND turn_epoch = ? AND status = ?",
                (deadline, row.agent_id, waiting[0], waiting[1], HeadStatus.SUSPENDED),
            )
            # The call's card now names its sub-thread, so what governance noted for the
            # call (warnings) reaches its result.
            db.execute(
                "UPDATE cards SET metadata = json_set(metadata, '$.tool_call_id', ?) "
                "WHERE agent_turn_id = ? AND card_type = 'tool.call' "
                "AND json_extract(metadata, '$.tool_call_id') = ?",
                (sub_thread, waiting[0], row.correlation_id),
            )
            # A result that beat this transaction waits deferred: due now.
            db.execute(
                "UPDATE agent_inbox SET next_retry_at = ?, agent_turn_id = ?, turn_epoch = ? "
                "WHERE correlation_id = ? AND status = ?",
                (now, waiting[0], waiting[1], sub_thread, InboxStatus.DEFERRED),
            )

    async def fail_forward(self, request_id: str, row: InboxRow, text: str) -> None:
        with self._tx() as db:  # type: ignore[attr-defined]
            db.execute(
                "UPDATE approvals SET status = 'refused' WHERE request_id = ?", (request_id,)
            )
            self._inbox_move(db, row.inbox_id, InboxEvent.CONSUME)  # type: ignore[attr-defined]
            self._insert_report(  # type: ignore[attr-defined]
                db,
                _new_id(),
                row.agent_id,
                MessageType.TOOL_RESULT,
                row.correlation_id or "",
                text.encode(),
                True,
                self._clock.now(),
            )


def _new_id() -> str:
    return uuid.uuid4().hex
