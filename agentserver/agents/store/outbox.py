"""The durable outbox: HTTP deliveries the store keeps until a receiver takes them
(webhooks, and any other feature that must tell a URL something at least once).

An item (:class:`OutboxItem`) is a POST to a URL with headers and a body, on a
*channel* (one receiver: its concurrency, failures and disabling are counted per
channel), keyed for dedupe (``dedupe_key``: enqueueing the same key again adds nothing,
so a producer that is not sure it enqueued may enqueue again). Each item gets at insert
its ``delivery_id`` (derived from the key, so the same on every attempt and after any
restart) and its ``order_seq``: 1, 2, 3, ... per ``order_key`` (a counter row,
``outbox_sequences``, so the numbers never go back even after delivered rows are pruned).

A row is ``pending`` until delivered (``delivered``), out of time (``expired``: its
``expires_at`` passed), its channel disabled (``disabled``) or its producer withdrew it
(``cancelled``). A sender claims due pending rows with a lease (``lease_until``,
``lease_owner``; on PostgreSQL ``FOR UPDATE SKIP LOCKED`` so two processes never take
the same row at once); a lease that runs out makes the row claimable again (a sender that
died mid-delivery: the row is delivered again, with the same id).

Every function here is one store transaction's work (the store's ``_run``), atomic.
Schema migration 7 (both dialects; :data:`MIGRATION`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentserver.agents.store.sql.db import (
    INSERT_CHUNK,
    StoreEnv,
    Tx,
    insert_rows,
    marks,
    skip_locked,
)

MIGRATION = """
CREATE TABLE outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    delivery_id TEXT NOT NULL UNIQUE,
    dedupe_key TEXT NOT NULL UNIQUE,
    channel TEXT NOT NULL,
    url TEXT NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    order_key TEXT NOT NULL,
    order_seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    lease_until REAL NOT NULL DEFAULT 0,
    lease_owner TEXT,
    expires_at REAL NOT NULL,
    first_delay REAL NOT NULL,
    max_delay REAL NOT NULL,
    last_error TEXT,
    last_status INTEGER,
    created_at REAL NOT NULL,
    done_at REAL
);
CREATE INDEX outbox_due ON outbox (status, next_at);
CREATE INDEX outbox_channel ON outbox (channel, status);
CREATE TABLE outbox_sequences (
    order_key TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL
);
CREATE TABLE outbox_channels (
    channel TEXT PRIMARY KEY,
    failing_since REAL,
    last_ok_at REAL,
    last_error TEXT,
    failures INTEGER NOT NULL DEFAULT 0,
    delivered INTEGER NOT NULL DEFAULT 0,
    disabled_at REAL,
    updated_at REAL NOT NULL
);
CREATE TABLE webhooks (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    secret TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""

PENDING = "pending"
DELIVERED = "delivered"
EXPIRED = "expired"
DISABLED = "disabled"
CANCELLED = "cancelled"

#: The most characters of a receiver's error kept on a row.
ERROR_CHARS = 500

_COLS = (
    "seq, delivery_id, dedupe_key, channel, url, headers, body, order_key, order_seq, "
    "status, attempts, next_at, expires_at, first_delay, max_delay, created_at"
)


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One delivery to enqueue: POST ``body`` to ``url`` with ``headers``.

    ``retry_for_s``: how long after enqueueing it is retried (then ``expired``);
    ``first_delay_s``/``max_delay_s``: the backoff's first pause and its cap."""

    channel: str
    url: str
    body: bytes
    dedupe_key: str
    headers: dict[str, str] = field(default_factory=dict)
    order_key: str = ""
    retry_for_s: float = 24 * 3600.0
    first_delay_s: float = 5.0
    max_delay_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A claimed delivery, as the sender sees it."""

    seq: int
    delivery_id: str
    dedupe_key: str
    channel: str
    url: str
    headers: dict[str, str]
    body: bytes
    order_key: str
    order_seq: int
    status: str
    attempts: int
    next_at: float
    expires_at: float
    first_delay_s: float
    max_delay_s: float
    created_at: float


@dataclass(frozen=True, slots=True)
class ChannelFigures:
    """One channel's state for ``/v1/status``, ``/ui`` and the metrics."""

    channel: str
    pending: int = 0
    delivered: int = 0
    expired: int = 0
    disabled_rows: int = 0
    failures: int = 0
    failing_since: float | None = None
    last_ok_at: float | None = None
    last_error: str | None = None
    disabled_at: float | None = None
    oldest_pending_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "pending": self.pending,
            "delivered": self.delivered,
            "expired": self.expired,
            "disabled_rows": self.disabled_rows,
            "failures": self.failures,
            "failing_since": self.failing_since,
            "last_ok_at": self.last_ok_at,
            "last_error": self.last_error,
            "disabled_at": self.disabled_at,
            "oldest_pending_at": self.oldest_pending_at,
            "failing": self.failing_since is not None,
        }


def delivery_id(dedupe_key: str) -> str:
    """The id every attempt of the item keyed ``dedupe_key`` carries (``msg_`` + 26
    hex digits of its SHA-256): derived, so a producer enqueueing again gets the same."""
    return "msg_" + hashlib.sha256(dedupe_key.encode()).hexdigest()[:26]


def _row(r: Sequence[Any]) -> OutboxRow:
    return OutboxRow(
        int(r[0]),
        r[1],
        r[2],
        r[3],
        r[4],
        json.loads(r[5]),
        bytes(r[6]),
        r[7],
        int(r[8]),
        r[9],
        int(r[10]),
        float(r[11]),
        float(r[12]),
        float(r[13]),
        float(r[14]),
        float(r[15]),
    )


# -- the SQL (plain functions over one transaction, both backends) ------------------------


def present_keys(tx: Tx, env: StoreEnv, keys: Sequence[str]) -> set[str]:
    """Those of ``keys`` the outbox holds (pending, delivered or given up: kept until
    pruned). Read only; one statement per :data:`INSERT_CHUNK` keys."""
    unique = list(dict.fromkeys(keys))
    there: set[str] = set()
    for i in range(0, len(unique), INSERT_CHUNK):
        part = unique[i : i + INSERT_CHUNK]
        there.update(
            r[0]
            for r in tx.all(
                f"SELECT dedupe_key FROM outbox WHERE dedupe_key IN ({marks(len(part))})", part
            )
        )
    return there


def enqueue(tx: Tx, env: StoreEnv, items: Sequence[OutboxItem]) -> int:
    """Insert ``items`` (those whose key is already there, or earlier in ``items``, add
    nothing; those of a disabled channel are stored ``disabled``); returns how many were
    new. Atomic. Round trips: one read of the keys (per :data:`INSERT_CHUNK`), one
    sequence update per order key, the inserts (pipelined on PostgreSQL). A concurrent
    insert of the same key by another process fails the transaction (unique key): the
    caller's retry then finds it there."""
    if not items:
        return 0
    now = env.clock.now()
    there = present_keys(tx, env, [i.dedupe_key for i in items])
    new: list[OutboxItem] = []
    for item in items:
        if item.dedupe_key not in there:
            there.add(item.dedupe_key)
            new.append(item)
    if not new:
        return 0
    channels = sorted({i.channel for i in new})
    disabled = {
        r[0]
        for r in tx.all(
            f"SELECT channel FROM outbox_channels WHERE channel IN ({marks(len(channels))}) "
            "AND disabled_at IS NOT NULL",
            channels,
        )
    }
    counts: dict[str, int] = {}
    for item in new:
        key = item.order_key or item.channel
        counts[key] = counts.get(key, 0) + 1
    next_seq: dict[str, int] = {}
    for key, n in sorted(counts.items()):  # sorted: two writers lock keys in one order
        got = tx.one(
            "INSERT INTO outbox_sequences (order_key, last_seq) VALUES (?, ?) "
            "ON CONFLICT (order_key) DO UPDATE SET "
            "last_seq = outbox_sequences.last_seq + excluded.last_seq RETURNING last_seq",
            (key, n),
        )
        assert got is not None
        next_seq[key] = int(got[0]) - n + 1
    rows = []
    for item in new:
        key = item.order_key or item.channel
        seq, next_seq[key] = next_seq[key], next_seq[key] + 1
        rows.append(
            (
                delivery_id(item.dedupe_key),
                item.dedupe_key,
                item.channel,
                item.url,
                json.dumps(item.headers, sort_keys=True),
                item.body,
                key,
                seq,
                DISABLED if item.channel in disabled else PENDING,
                now,
                now + item.retry_for_s,
                item.first_delay_s,
                item.max_delay_s,
                now,
            )
        )
    insert_rows(
        tx,
        "INSERT INTO outbox (delivery_id, dedupe_key, channel, url, headers, body, order_key, "
        "order_seq, status, next_at, expires_at, first_delay, max_delay, created_at)",
        rows,
    )
    return len(new)


def claim(
    tx: Tx,
    env: StoreEnv,
    owner: str,
    lease_s: float,
    limit: int,
    exclude: Sequence[str] = (),
) -> list[OutboxRow]:
    """Lease up to ``limit`` due pending rows (not of the channels in ``exclude``) to
    ``owner`` for ``lease_s`` seconds, oldest due first; PostgreSQL's skips the rows other
    processes hold (:func:`~.sql.db.skip_locked`). Atomic."""
    lock = skip_locked(tx)
    now = env.clock.now()
    skip = f" AND channel NOT IN ({marks(len(exclude))})" if exclude else ""
    rows = tx.all(
        "UPDATE outbox SET lease_until = ?, lease_owner = ? WHERE seq IN ("
        "SELECT seq FROM outbox WHERE status = ? AND next_at <= ? AND lease_until <= ?"
        f"{skip} ORDER BY next_at, seq LIMIT ?{lock}) RETURNING {_COLS}",
        (now + lease_s, owner, PENDING, now, now, *exclude, limit),
    )
    return sorted((_row(r) for r in rows), key=lambda r: (r.next_at, r.seq))


def release(tx: Tx, env: StoreEnv, seqs: Sequence[int], owner: str, delay_s: float = 0.0) -> None:
    """Give claimed rows back (claimable again after ``delay_s``), attempts unchanged."""
    if seqs:
        tx.execute(
            f"UPDATE outbox SET lease_until = 0, next_at = ? WHERE seq IN ({marks(len(seqs))}) "
            "AND lease_owner = ? AND status = ?",
            (env.clock.now() + delay_s, *seqs, owner, PENDING),
        )


def delivered(tx: Tx, env: StoreEnv, done: Sequence[tuple[int, str, int]]) -> None:
    """Rows taken by their receivers: ``(seq, channel, HTTP status)`` each; their
    channels are healthy. One transaction for the batch (atomic)."""
    now = env.clock.now()
    per_channel: dict[str, int] = {}
    for seq, channel, status in done:
        tx.execute(
            "UPDATE outbox SET status = ?, attempts = attempts + 1, done_at = ?, "
            "lease_until = 0, last_status = ? WHERE seq = ? AND status = ?",
            (DELIVERED, now, status, seq, PENDING),
        )
        per_channel[channel] = per_channel.get(channel, 0) + 1
    for channel, n in sorted(per_channel.items()):
        tx.execute(
            "INSERT INTO outbox_channels (channel, last_ok_at, delivered, updated_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (channel) DO UPDATE SET failing_since = NULL, "
            "last_ok_at = excluded.last_ok_at, "
            "delivered = outbox_channels.delivered + excluded.delivered, "
            "updated_at = excluded.updated_at",
            (channel, now, n, now),
        )


def failed(
    tx: Tx,
    env: StoreEnv,
    seq: int,
    channel: str,
    error: str,
    status: int | None,
    retry_at: float | None,
    disable_after_s: float | None,
) -> bool:
    """An attempt at row ``seq`` failed: retried at ``retry_at`` (None: out of time,
    ``expired``); the channel's failure counted. When the channel has been failing (no
    delivery since) for ``disable_after_s`` it is disabled and its pending rows with it:
    returns True then, once. Atomic."""
    now = env.clock.now()
    error = error[:ERROR_CHARS]
    if retry_at is None:
        tx.execute(
            "UPDATE outbox SET status = ?, attempts = attempts + 1, done_at = ?, "
            "lease_until = 0, last_error = ?, last_status = ? WHERE seq = ? AND status = ?",
            (EXPIRED, now, error, status, seq, PENDING),
        )
    else:
        tx.execute(
            "UPDATE outbox SET attempts = attempts + 1, next_at = ?, lease_until = 0, "
            "last_error = ?, last_status = ? WHERE seq = ? AND status = ?",
            (retry_at, error, status, seq, PENDING),
        )
    got = tx.one(
        "INSERT INTO outbox_channels (channel, failing_since, last_error, failures, updated_at) "
        "VALUES (?, ?, ?, 1, ?) ON CONFLICT (channel) DO UPDATE SET "
        "failing_since = COALESCE(outbox_channels.failing_since, excluded.failing_since), "
        "last_error = excluded.last_error, failures = outbox_channels.failures + 1, "
        "updated_at = excluded.updated_at RETURNING failing_since, disabled_at",
        (channel, now, error, now),
    )
    assert got is not None
    if disable_after_s is None or got[1] is not None or now - float(got[0]) < disable_after_s:
        return False
    tx.execute("UPDATE outbox_channels SET disabled_at = ? WHERE channel = ?", (now, channel))
    tx.execute(
        "UPDATE outbox SET status = ?, lease_until = 0 WHERE channel = ? AND status = ?",
        (DISABLED, channel, PENDING),
    )
    return True


def enable(tx: Tx, env: StoreEnv, channel: str) -> int:
    """Enable ``channel`` again: its disabled rows pending, due now; how many."""
    now = env.clock.now()
    tx.execute(
        "UPDATE outbox_channels SET disabled_at = NULL, failing_since = NULL, updated_at = ? "
        "WHERE channel = ?",
        (now, channel),
    )
    tx.execute(
        "UPDATE outbox SET status = ?, next_at = ?, lease_until = 0 "
        "WHERE channel = ? AND status = ?",
        (PENDING, now, channel, DISABLED),
    )
    return tx.rowcount


def cancel_channel(tx: Tx, env: StoreEnv, channel: str) -> int:
    """Withdraw ``channel``'s undelivered rows (its webhook was deleted); how many."""
    tx.execute(
        "UPDATE outbox SET status = ?, done_at = ?, lease_until = 0 "
        "WHERE channel = ? AND status IN (?, ?)",
        (CANCELLED, env.clock.now(), channel, PENDING, DISABLED),
    )
    n = tx.rowcount
    tx.execute("DELETE FROM outbox_channels WHERE channel = ?", (channel,))
    return n


def figures(tx: Tx, env: StoreEnv) -> list[ChannelFigures]:
    """Every channel's counts and state (two grouped reads). Read only."""
    counts: dict[str, dict[str, Any]] = {}
    for channel, status, n, oldest in tx.all(
        "SELECT channel, status, COUNT(*), MIN(created_at) FROM outbox GROUP BY channel, status"
    ):
        c = counts.setdefault(channel, {})
        c[status] = int(n)
        if status == PENDING:
            c["oldest"] = float(oldest)
    states = {
        r[0]: r[1:]
        for r in tx.all(
            "SELECT channel, failures, failing_since, last_ok_at, last_error, disabled_at "
            "FROM outbox_channels"
        )
    }
    out = []
    for channel in sorted(set(counts) | set(states)):
        c = counts.get(channel, {})
        s = states.get(channel, (0, None, None, None, None))
        out.append(
            ChannelFigures(
                channel,
                pending=c.get(PENDING, 0),
                delivered=c.get(DELIVERED, 0),
                expired=c.get(EXPIRED, 0),
                disabled_rows=c.get(DISABLED, 0),
                failures=int(s[0] or 0),
                failing_since=s[1],
                last_ok_at=s[2],
                last_error=s[3],
                disabled_at=s[4],
                oldest_pending_at=c.get("oldest"),
            )
        )
    return out


def prune(tx: Tx, env: StoreEnv, keep_s: float) -> int:
    """Delete rows done (delivered, expired, cancelled) more than ``keep_s`` ago."""
    tx.execute(
        "DELETE FROM outbox WHERE status IN (?, ?, ?) AND done_at < ?",
        (DELIVERED, EXPIRED, CANCELLED, env.clock.now() - keep_s),
    )
    return tx.rowcount


def deliveries(tx: Tx, env: StoreEnv, channel: str | None, limit: int) -> list[dict[str, Any]]:
    """The latest rows (of ``channel``), newest first, for the API. Read only."""
    where, args = ("WHERE channel = ?", [channel]) if channel else ("", [])
    rows = tx.all(
        "SELECT delivery_id, channel, order_key, order_seq, status, attempts, next_at, "
        f"created_at, done_at, last_status, last_error FROM outbox {where} "
        "ORDER BY seq DESC LIMIT ?",
        (*args, max(1, min(limit, 1000))),
    )
    keys = (
        "id channel order_key sequence status attempts next_at created_at done_at "
        "last_status last_error"
    ).split()
    return [dict(zip(keys, r, strict=True)) for r in rows]
