"""The CPU time of a local PostgreSQL server, from /proc (for the benches).

A server's processes are its postmaster and the postmaster's children (one backend per
connection, the WAL writer, the checkpointer, …). A child that exits has its times added
to the postmaster's ``cutime``/``cstime`` once reaped, so the postmaster's own and
children's times plus those of its living children count every process, including
backends that came and went during a run. Needs the server on this machine and /proc
readable for its processes; else :func:`server_cpu_s` returns None.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces
    return raw[raw.rindex(")") + 2 :].split()


def postmaster_pid(url: str) -> int | None:
    """The postmaster of the server at ``url`` if it runs on this machine."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        (backend,) = conn.execute("SELECT pg_backend_pid()").fetchone()
        fields = _stat(backend)  # while the backend lives
    if fields is None:
        return None
    return int(fields[1])  # ppid (field 4; fields[0] is field 3)


def server_cpu_s(postmaster: int | None) -> float | None:
    """All CPU seconds the server has used so far (user + system, every process)."""
    if postmaster is None:
        return None
    own = _stat(postmaster)
    if own is None:
        return None
    # fields 14-17: utime, stime, cutime, cstime (fields[0] is field 3)
    ticks = sum(int(x) for x in own[11:15])
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None and fields[1] == str(postmaster):
            ticks += int(fields[11]) + int(fields[12])
    return ticks / _TICK
