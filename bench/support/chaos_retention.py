"""The chaos bench's retention part (``bench/chaos.py --retention``; issue 38).

With ``--retention`` the organism's store prunes with short windows while the faults run
(:data:`RETENTION`: finished tasks go after 20 s, the pruner runs every 2 s), so pruning
races every fault: server kills (an interrupted batch), clients away with replies kept,
approvals waiting for the approver, suspended Turns, resends. The checker's rules are
unchanged and are what retention must not break: every task the server took gets
exactly one answer (no reply lost to pruning, none twice), every paid call its approval's
outcome. What changes is the oracle of "taken": a pruned task's inbox row is gone, so
the tombstones (``pruned_turns``) count as taken too (:data:`PRUNED_QUERY`). Tombstones
are pruned as well (after a minute), so the store's size can be flat: :class:`SizeWatch`
reads them every few seconds and keeps every one it saw (:attr:`SizeWatch.tombstones`),
which the oracle and the schedules' checker read with the store's own; and the
schedules' run records likewise (old ones go once their task did, :attr:`SizeWatch.runs`).

:class:`SizeWatch` samples the store's size (SQLite: file plus WAL; PostgreSQL:
``pg_database_size``) every ``period`` seconds, for the flatness figure: after the first
window the size should stay within 10%: ``file_trend_after_window`` compares the file's
mean over the first and the last quarter of the samples after it (``size_growth_after_window``
and ``file_growth_after_window``, the largest sample against the first, show the swing).
"""

from __future__ import annotations

import pathlib
import re

import trio

#: The store's retention under ``--retention``: short windows, so a 30-minute run prunes
#: every task many times over.
RETENTION = (
    '<retention finished-tasks="20s" keep-last="1" step-log="20s" events="10s" '
    'acknowledged-replies="10s" tombstones="60s" deliveries="20s" interval="2s"/>'
)
#: The window after which the store's size should be flat (the longest one above).
WINDOW_S = 60.0
#: Threads of pruned tasks (caller thread and hop), read with the inbox's reply refs.
PRUNED_QUERY = "SELECT coalesce(caller_thread, '') || ' ' || coalesce(hop, '') FROM pruned_turns"
#: Every schedule run record (the store prunes old ones whose task went).
RUNS_QUERY = "SELECT schedule, tick, outcome, inbox_id FROM schedule_runs"
#: Every tombstone: its task's inbox id and its threads (as :data:`PRUNED_QUERY`).
TOMBSTONES_QUERY = (
    "SELECT coalesce(inbox_id, agent_turn_id), "
    "coalesce(caller_thread, '') || ' ' || coalesce(hop, '') FROM pruned_turns"
)


def with_retention(store_xml: str) -> str:
    """``<store .../>`` with :data:`RETENTION` inside it."""
    return re.sub(r"\s*/>\s*$", f">{RETENTION}</store>", store_xml.strip())


class SizeWatch:
    """The store's size over the run (a task samples it; :meth:`figures` sums it up)."""

    def __init__(self, sqlite_path: pathlib.Path | None, pg_url: str | None) -> None:
        self.sqlite_path = sqlite_path
        self.pg_url = pg_url
        #: (seconds since start, store bytes, database file bytes, WAL bytes)
        self.samples: list[tuple[float, int, int, int]] = []
        #: Every tombstone seen so far: a pruned task's inbox id → its threads. The store
        #: prunes them after a minute; a sample every few seconds sees each one.
        self.tombstones: dict[str, str] = {}
        #: Every schedule run record seen so far: (schedule, tick) → (outcome, inbox id).
        self.runs: dict[tuple[str, float], tuple[str, str | None]] = {}

    @property
    def pruned(self) -> int:
        """Tasks pruned so far (tombstones seen)."""
        return len(self.tombstones)

    def _read_records(self) -> tuple[list[tuple], list[tuple]]:
        """(tombstones, schedule runs) as the store has them now."""
        if self.pg_url is not None:
            import psycopg

            with psycopg.connect(self.pg_url, connect_timeout=10) as conn:
                return (
                    conn.execute(TOMBSTONES_QUERY).fetchall(),
                    conn.execute(RUNS_QUERY).fetchall(),
                )
        import sqlite3

        assert self.sqlite_path is not None
        conn = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=30)
        try:
            return (
                conn.execute(TOMBSTONES_QUERY).fetchall(),
                conn.execute(RUNS_QUERY).fetchall(),
            )
        finally:
            conn.close()

    def _size(self) -> tuple[int, int, int] | None:
        """(store bytes, database file bytes, WAL bytes); PostgreSQL: the database's size
        three times (it has no WAL of its own to count)."""
        if self.pg_url is not None:
            import psycopg

            with psycopg.connect(self.pg_url, connect_timeout=10) as conn:
                row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
                return (int(row[0]),) * 2 + (0,) if row else None
        path = self.sqlite_path
        if path is None or not path.exists():
            return None
        wal = path.with_name(path.name + "-wal")
        file_bytes = path.stat().st_size
        wal_bytes = wal.stat().st_size if wal.exists() else 0
        return file_bytes + wal_bytes, file_bytes, wal_bytes

    async def run(self, period: float = 5.0) -> None:
        start = trio.current_time()
        while True:
            try:
                size = await trio.to_thread.run_sync(self._size)
            except Exception:  # a sample lost is not a fault
                size = None
            if size is not None:
                self.samples.append((trio.current_time() - start, *size))
            try:
                tombstones, runs = await trio.to_thread.run_sync(self._read_records)
            except Exception:  # the tables are made by the server's first start
                tombstones, runs = [], []
            self.tombstones.update((str(key), str(threads)) for key, threads in tombstones)
            self.runs.update(((r[0], float(r[1])), (r[2], r[3])) for r in runs)
            await trio.sleep(period)

    def figures(self) -> dict[str, object]:
        """The size at the end of the first window and at the end, and the growth after
        the first window (relative to its maximum so far): of the store (file and WAL),
        and of the database file alone. On SQLite the WAL swings between nothing and its
        limit (a checkpoint lets it start over, ``journal_size_limit`` cuts it back), so a
        store sample taken with a short WAL makes the store look grown; the file holds
        the data. ``wal_bytes_max`` shows the WAL bounded."""
        after = [(b, f, w) for t, b, f, w in self.samples if t >= 2 * WINDOW_S]
        if not after:
            return {"store_bytes_samples": len(self.samples), "pruned_tasks": self.pruned}
        first, first_file = after[0][0], after[0][1]
        files = [f for _, f, _ in after]
        return {
            "pruned_tasks": self.pruned,
            "store_bytes_samples": len(self.samples),
            "store_bytes_after_window": first,
            "store_bytes_max": max(b for b, _, _ in after),
            "store_bytes_end": after[-1][0],
            "size_growth_after_window": round(
                (max(b for b, _, _ in after) - first) / max(first, 1), 3
            ),
            "file_bytes_after_window": first_file,
            "file_bytes_max": max(files),
            "file_bytes_end": files[-1],
            "file_growth_after_window": round((max(files) - first_file) / max(first_file, 1), 3),
            **trend(files),
            "wal_bytes_max": max(w for _, _, w in after),
        }


def trend(sizes: list[int]) -> dict[str, object]:
    """The file's mean over the first and the last quarter of the samples after the first
    window, and the change between them: a store of a megabyte swings by a few hundred
    KiB with the Turns in flight and the pages not yet given back, so one sample against
    another measures the swing; the quarters' means measure whether it grows."""
    q = max(1, len(sizes) // 4)
    first, last = sum(sizes[:q]) / q, sum(sizes[-q:]) / q
    return {
        "file_bytes_mean_first_quarter": round(first),
        "file_bytes_mean_last_quarter": round(last),
        "file_trend_after_window": round((last - first) / max(first, 1), 3),
    }
