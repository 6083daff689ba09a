"""A tool with a side effect, deduped by its idempotency key (issue 26).

Imported by the server and runner subprocesses (tests/ is on their PYTHONPATH) and by the
tests. ``record`` is the pattern docs/guide.md shows: every call notes the key it saw
(``seen``); the effect is written once per key (``effects``: the key is its primary key).
``charge`` is an in-process tool that does that; with a file ``hold`` in its working
directory it then waits (far longer than any test), so a test can kill the server while
the step is in progress.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

NS = "urn:test:idem"


class Charge(BaseXmlModel, tag="charge", nsmap={"": NS}):
    amount: int = element()


class Charged(BaseXmlModel, tag="charged", nsmap={"": NS}):
    amount: int = element()
    effects: int = element()


def record(db: Path, key: str, what: str) -> int:
    """Note that a call with ``key`` was seen, write its effect unless one with that key
    exists; returns how many effects the key has (always 1)."""
    with sqlite3.connect(db, timeout=10) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS seen (key TEXT NOT NULL, pid INTEGER)")
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, what TEXT)")
        conn.execute("INSERT INTO seen VALUES (?, ?)", (key, os.getpid()))
        conn.execute("INSERT OR IGNORE INTO effects VALUES (?, ?)", (key, what))
        return conn.execute("SELECT count(*) FROM effects WHERE key = ?", (key,)).fetchone()[0]


def rows(db: Path, sql: str) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(db, timeout=10) as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:
            return []  # no table yet


async def charge(payload: Charge, meta: HandlerMetadata) -> HandlerResponse:
    n = record(Path("effects.sqlite3"), meta.idempotency_key, f"charge {payload.amount}")
    if await trio.Path("hold").exists():
        await trio.sleep(3600)
    return HandlerResponse.respond(Charged(amount=payload.amount, effects=n))


class Flaky(BaseXmlModel, tag="flaky", nsmap={"": NS}):
    #: What the first attempt of each step does: ``hang`` (past any step-timeout) or ``raise``.
    mode: str = element()


class Done(BaseXmlModel, tag="done", nsmap={"": NS}):
    attempts: int = element()


#: (idempotency key, hop thread) of every call of ``flaky``, for the in-process tests.
FLAKY_CALLS: list[tuple[str, str]] = []
#: ``flaky``'s side effect: one entry per key, written before the attempt hangs or fails.
FLAKY_EFFECTS: dict[str, int] = {}


async def flaky(payload: Flaky, meta: HandlerMetadata) -> HandlerResponse:
    FLAKY_CALLS.append((meta.idempotency_key, meta.thread_id))
    FLAKY_EFFECTS.setdefault(meta.idempotency_key, len(FLAKY_EFFECTS))
    attempts = sum(1 for key, _ in FLAKY_CALLS if key == meta.idempotency_key)
    if attempts == 1:
        if payload.mode == "hang":
            await trio.sleep(3600)
        raise RuntimeError("the first attempt fails")
    return HandlerResponse.respond(Done(attempts=attempts))


class PayV2(BaseXmlModel, tag="pay", nsmap={"": "urn:test:gov"}):
    """The governance tests' ``<pay>`` with one more required field: a schema change
    that the recorded calls no longer pass (tests/test_replay.py)."""

    to: str = element()
    amount: str = element()
    currency: str = element()
