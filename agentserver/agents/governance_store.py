"""The store's part of governance: the policy decisions of each step (the rate windows
are counted from them) and the refusal cards written with them.

A mixin of :class:`agentserver.agents.sqlite_store.SqliteAgentStore` (its tables are
created by schema migration 2), kept apart so the Turn protocol's store stays as it was.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentserver.agents.store import NewCard, TurnToken

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
    ) -> None:
        now = self._clock.now()
        with self._tx() as db:  # type: ignore[attr-defined]
            self._assert_running(db, token)  # type: ignore[attr-defined]
            box = self._output_box(db, token.agent_id)  # type: ignore[attr-defined]
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
