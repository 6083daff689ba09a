"""The chaos bench's oracle: what the store shows of the clients' tasks (bench/chaos.py).

Read from the store itself (blocking queries run in a thread): which tasks the server
took (an inbox row whose reply reference names the thread, or the tombstone of a pruned
one), and, for double texting, which of them were ever given a Turn.
"""

from __future__ import annotations

import pathlib
import re
import sqlite3

import trio
from chaos_check import StoredAnswers, TaskRow
from chaos_retention import PRUNED_QUERY
from lxml import etree

_TAKEN = "SELECT reply_ref FROM agent_inbox WHERE message_type = 'turn'"
#: Per task: its place, when it was written, its Turn (named once the head leased it; a
#: rejected or superseded task's row never does, agents/store/sql/multitask.py) and when
#: its answer was written: the reply row of its Turn, or of the answer it got without one
#: (keyed ``busy:``, ``superseded:`` or ``cancel:`` and its inbox id).
_ROWS = (
    "SELECT i.reply_ref, i.seq, i.created_at, i.agent_turn_id, "
    "(SELECT min(r.created_at) FROM agent_replies r WHERE r.agent_turn_id IN "
    "(i.agent_turn_id, 'busy:' || i.inbox_id, 'superseded:' || i.inbox_id, "
    "'cancel:' || i.inbox_id)) "
    "FROM agent_inbox i WHERE i.message_type = 'turn'"
)
#: Every task's reply reference and its payload: the inbox row's until its Turn consumed
#: it (the store then empties it), the Turn's ``task.input`` card after (the doors'
#: clients find their tasks by nonce).
_PAYLOADS = (
    "SELECT i.reply_ref, i.payload, (SELECT min(c.content) FROM cards c WHERE "
    "c.agent_turn_id = i.agent_turn_id AND c.card_type = 'task.input') "
    "FROM agent_inbox i WHERE i.message_type = 'turn'"
)
#: Every reply row's reference (a Turn answered twice has two naming its thread).
_REPLIES = "SELECT reply_ref, failed FROM agent_replies"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


class Oracle:
    """Which tasks the server took, and which ran: read from the store."""

    def __init__(
        self,
        sqlite_path: pathlib.Path | None,
        pg_url: str | None,
        tombstones: dict[str, str] | None = None,
    ) -> None:
        self.sqlite_path = sqlite_path
        self.pg_url = pg_url
        #: Tombstones seen during the run (SizeWatch's): the store prunes its own.
        self.tombstones: dict[str, str] = {} if tombstones is None else tombstones

    def _rows(self, *queries: str) -> list[tuple]:
        rows: list[tuple] = []
        if self.pg_url is not None:
            import psycopg

            with psycopg.connect(self.pg_url, connect_timeout=10) as conn:
                for query in queries:
                    rows += conn.execute(query).fetchall()
            return rows
        if self.sqlite_path is None or not self.sqlite_path.exists():
            return rows
        conn = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=30)
        try:
            for query in queries:
                rows += conn.execute(query).fetchall()
        finally:
            conn.close()
        return rows

    async def refs(self) -> str:
        """Every task's reply reference (pruned tasks were taken too), one string."""
        rows = await trio.to_thread.run_sync(self._rows, _TAKEN, PRUNED_QUERY)
        return "\n".join([*(str(r[0]) for r in rows), *self.tombstones.values()])

    def _answers(self, thread: str) -> tuple[list[tuple], bool]:
        like = f"%{thread}%"
        replies = "SELECT payload, failed FROM agent_replies WHERE reply_ref LIKE {}"
        pruned = "SELECT count(*) FROM pruned_turns WHERE caller_thread = {} OR hop = {}"
        if self.pg_url is not None:
            import psycopg

            with psycopg.connect(self.pg_url, connect_timeout=10) as conn:
                rows = conn.execute(replies.format("%s"), (like,)).fetchall()
                gone = conn.execute(pruned.format("%s", "%s"), (thread, thread)).fetchone()[0]
            return rows, bool(gone)
        if self.sqlite_path is None or not self.sqlite_path.exists():
            return [], False
        conn = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = conn.execute(replies.format("?"), (like,)).fetchall()
            gone = conn.execute(pruned.format("?", "?"), (thread, thread)).fetchone()[0]
        finally:
            conn.close()
        return rows, bool(gone)

    async def stored_answers(self, thread: str) -> StoredAnswers:
        """The reply rows the store wrote for the task on ``thread`` (its text and
        whether it failed), and whether retention pruned the task."""
        rows, gone = await trio.to_thread.run_sync(self._answers, thread)
        answers = []
        for payload, failed in rows:
            raw = bytes(payload) if not isinstance(payload, str) else payload.encode()
            try:
                text = "".join(etree.fromstring(raw).itertext())
            except etree.XMLSyntaxError:
                text = raw.decode("utf-8", "replace")
            answers.append((text, bool(failed)))
        pruned = gone or any(thread in ref for ref in self.tombstones.values())
        return StoredAnswers(answers, pruned)

    async def taken(self, thread: str) -> bool:
        return thread in await self.refs()

    async def pruned(self) -> str:
        """Every pruned task's tombstone (the store's and those seen during the run)."""
        rows = await trio.to_thread.run_sync(self._rows, PRUNED_QUERY)
        return "\n".join([*(str(r[0]) for r in rows), *self.tombstones.values()])

    async def turn_payloads(self) -> list[tuple[str, str]]:
        """(reply reference, payload text) of every task row still in the inbox."""
        rows = await trio.to_thread.run_sync(self._rows, _PAYLOADS)
        out = []
        for ref, payload, card in rows:
            raw = payload if isinstance(payload, str) else bytes(payload).decode("utf-8", "replace")
            out.append((str(ref), raw + "\n" + (card or "")))
        return out

    async def reply_rows(self) -> dict[str, list[bool]]:
        """Per thread named by a reply row's reference: each reply row naming it (whether
        it is a failed answer)."""
        found: dict[str, list[bool]] = {}
        for ref, failed in await trio.to_thread.run_sync(self._rows, _REPLIES):
            for thread in set(_UUID.findall(str(ref))):
                found.setdefault(thread, []).append(bool(failed))
        return found

    async def rows(self) -> dict[str, TaskRow]:
        """Per thread named by a task's reply reference still in the inbox: what the
        store shows of it (a pruned task is not here: unknown)."""
        rows = await trio.to_thread.run_sync(self._rows, _ROWS)
        return {
            thread: TaskRow(
                int(seq), float(created), turn is not None, None if ended is None else float(ended)
            )
            for ref, seq, created, turn, ended in rows
            for thread in _UUID.findall(str(ref))
        }
