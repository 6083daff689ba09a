"""Read-only views of the agent store for the HTTP API and ``agentserver status``.

A separate read-only SQLite connection (the store runs in WAL mode, so readers never
block its writer); each query is short and runs inline on the trio thread, as the store's
own transactions do.
"""

from __future__ import annotations

import json
import pathlib
import sqlite3
from typing import Any

_TURN = "turn"
_QUEUED = "queued"
_DELIVERABLE = "task.deliverable"
#: Characters of a failed Turn's deliverable shown as an agent's last error.
ERROR_TEXT_CHARS = 500


class AgentsView:
    def __init__(self, path: str | pathlib.Path, agents: tuple[str, ...]) -> None:
        self.agents = agents
        uri = pathlib.Path(path).resolve().as_uri() + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 1000")

    def close(self) -> None:
        self._db.close()

    def reachable(self) -> bool:
        try:
            self._db.execute("SELECT count(*) FROM agent_state_head").fetchone()
        except sqlite3.Error:
            return False
        return True

    def agent(self, name: str) -> dict[str, Any]:
        """Head state, active Turn, queue length and last error of agent ``name``."""
        db = self._db
        head = db.execute(
            "SELECT status, active_agent_turn_id, step_count, waiting_tool_count, "
            "running_since, updated_at FROM agent_state_head WHERE agent_id = ?",
            (name,),
        ).fetchone()
        queued = db.execute(
            "SELECT count(*) FROM agent_inbox WHERE agent_id = ? AND message_type = ? "
            "AND status = ?",
            (name, _TURN, _QUEUED),
        ).fetchone()[0]
        error = db.execute(
            "SELECT c.agent_turn_id, c.content, json_extract(c.metadata, '$.status'), "
            "c.created_at FROM cards c JOIN boxes b ON b.box_id = c.box_id "
            "WHERE b.agent_id = ? AND c.card_type = ? "
            "AND json_extract(c.metadata, '$.status') != 'succeeded' "
            "ORDER BY c.seq DESC LIMIT 1",
            (name, _DELIVERABLE),
        ).fetchone()
        out: dict[str, Any] = {
            "name": name,
            "state": head[0] if head else "idle",
            "active_turn": None,
            "queue": queued,
            "last_error": None,
        }
        if head and head[1]:
            out["active_turn"] = {
                "id": head[1],
                "steps": head[2],
                "waiting_tools": head[3],
                "running_since": head[4],
            }
        if error:
            out["last_error"] = {
                "turn": error[0],
                "status": error[2],
                "text": error[1][:ERROR_TEXT_CHARS],
                "at": error[3],
            }
        return out

    def task(self, name: str, thread: str) -> dict[str, Any] | None:
        """The latest task of agent ``name`` sent on ``thread`` (the caller's thread, or
        the hop thread the agent was called on): status, steps, usage. None if none."""
        db = self._db
        row = db.execute(
            "SELECT inbox_id, status, agent_turn_id, created_at FROM agent_inbox "
            "WHERE agent_id = ? AND message_type = ? AND "
            "(json_extract(reply_ref, '$.caller_thread') = ? OR "
            "json_extract(reply_ref, '$.hop') = ?) ORDER BY seq DESC LIMIT 1",
            (name, _TURN, thread, thread),
        ).fetchone()
        if row is None:
            return None
        _inbox_id, inbox_status, turn, created = row
        out: dict[str, Any] = {
            "agent": name,
            "thread": thread,
            "turn": turn,
            "status": "queued" if turn is None else "running",
            "created_at": created,
            "steps": [],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0},
        }
        if turn is None:
            if inbox_status not in (_QUEUED, "pending"):
                out["status"] = inbox_status
            return out
        done = db.execute(
            "SELECT json_extract(metadata, '$.status'), content, created_at FROM cards "
            "WHERE agent_turn_id = ? AND card_type = ? ORDER BY seq DESC LIMIT 1",
            (turn, _DELIVERABLE),
        ).fetchone()
        if done is not None:
            out["status"] = done[0] or "finished"
            out["finished_at"] = done[2]
            if done[0] != "succeeded":
                out["error"] = done[1][:ERROR_TEXT_CHARS]
        usage = out["usage"]
        for step in db.execute(
            "SELECT step_no, status, model, backend, prompt_tokens, completion_tokens, "
            "total_tokens, cost, started_at, ended_at, tool_call_ids FROM agent_steps "
            "WHERE agent_turn_id = ? ORDER BY step_no",
            (turn,),
        ):
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
                }
            )
            for key, value in zip(
                ("prompt_tokens", "completion_tokens", "total_tokens", "cost"),
                step[4:8],
                strict=True,
            ):
                usage[key] += value or 0
        return out

    def turn_thread(self, turn: str) -> tuple[str | None, str | None]:
        """(caller thread, hop thread) of the task a Turn runs, for event filtering."""
        row = self._db.execute(
            "SELECT json_extract(reply_ref, '$.caller_thread'), json_extract(reply_ref, '$.hop') "
            "FROM agent_inbox WHERE agent_turn_id = ? AND message_type = ? LIMIT 1",
            (turn, _TURN),
        ).fetchone()
        return (row[0], row[1]) if row else (None, None)
