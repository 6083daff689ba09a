"""The thread registry: opaque uuid4 thread ids → call chains. Pure data, no I/O.

Every conversation hop has its own thread. Forwarding from thread ``P`` (chain ``a.b``) to
``c`` opens a child thread with chain ``a.b.c``; responding on that child prunes it (and
everything below it) and routes to the parent, whose tail is the caller. Because each hop
gets a fresh id and a parent link, two concurrent conversations along the same path never
share a thread: each reply finds its own caller.

Bounds: at most ``max_threads`` live threads. When full, idle threads (no activity for
``idle_ttl`` seconds, not pinned) are expired first; if none can go, opening a thread raises
:class:`RegistryFull`. Time is passed in by the caller (``now``), so tests control it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from agentserver.errors import AgentServerError

_UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def is_uuid4(value: str) -> bool:
    """True for a canonical lowercase uuid4 string."""
    return bool(_UUID4.match(value))


class _RandomPool:
    """Random bytes read from the OS in blocks: one syscall per 256 ids instead of per id."""

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0

    def take16(self) -> bytes:
        if self._pos + 16 > len(self._buf):
            self._buf = os.urandom(4096)
            self._pos = 0
        out = self._buf[self._pos : self._pos + 16]
        self._pos += 16
        return out


_pool = _RandomPool()


def new_thread_id() -> str:
    """A random uuid4 string (formatted by hand: ``uuid.uuid4()`` is 3x slower on the hot path)."""
    h = _pool.take16().hex()
    variant = "89ab"[int(h[16], 16) & 3]
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{variant}{h[17:20]}-{h[20:]}"


class RegistryFull(AgentServerError):
    """No room for another thread, even after expiring idle ones."""


@dataclass(slots=True, eq=False)
class ThreadRecord:
    id: str
    chain: tuple[str, ...]
    parent: str | None
    last_active: float
    children: set[str] = field(default_factory=set)
    #: Holds (e.g. an open agent Turn) keep a thread from idle expiry.
    pins: int = 0
    #: Messages queued for the owner on this thread and not yet handled.
    pending: int = 0
    #: Consecutive outputs of the owner that the pump refused (bounded, see the pump).
    strikes: int = 0

    @property
    def owner(self) -> str:
        """The name at the tail of the chain: who works on this thread."""
        return self.chain[-1]

    @property
    def dotted(self) -> str:
        return ".".join(self.chain)


class ThreadRegistry:
    def __init__(self, *, max_threads: int = 100_000, idle_ttl: float = 3600.0) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be positive")
        self.max_threads = max_threads
        self.idle_ttl = idle_ttl
        self._threads: dict[str, ThreadRecord] = {}

    def __len__(self) -> int:
        return len(self._threads)

    def __contains__(self, thread_id: object) -> bool:
        return thread_id in self._threads

    def get(self, thread_id: str) -> ThreadRecord | None:
        return self._threads.get(thread_id)

    def touch(self, record: ThreadRecord, now: float) -> None:
        record.last_active = now

    def open_root(
        self, chain: tuple[str, ...], now: float, thread_id: str | None = None
    ) -> ThreadRecord:
        """Open a thread with no parent (the system root, or an external conversation)."""
        if not chain:
            raise ValueError("a chain needs at least one name")
        tid = thread_id or new_thread_id()
        if tid in self._threads:
            raise ValueError(f"thread {tid} exists")
        self._make_room(now)
        record = ThreadRecord(tid, chain, None, now)
        self._threads[tid] = record
        return record

    def extend(
        self, parent: ThreadRecord, target: str, now: float, thread_id: str | None = None
    ) -> ThreadRecord:
        """Open a child of ``parent`` whose chain ends in ``target``.

        ``thread_id`` is for restoring a known hop after a restart (see
        ``Pump.revive``); normally a fresh uuid4 is drawn.
        """
        if parent.id not in self._threads:
            raise KeyError(parent.id)
        if thread_id is not None and thread_id in self._threads:
            raise ValueError(f"thread {thread_id} exists")
        self._make_room(now)
        record = ThreadRecord(thread_id or new_thread_id(), (*parent.chain, target), parent.id, now)
        self._threads[record.id] = record
        parent.children.add(record.id)
        parent.last_active = now
        return record

    def prune(self, record: ThreadRecord) -> ThreadRecord | None:
        """Remove ``record`` and its whole subtree; return its parent (the caller's thread).

        Returns ``None`` for a thread with no parent (nobody to answer). Idempotent:
        pruning an already-removed thread returns ``None`` and changes nothing.
        """
        if self._threads.get(record.id) is not record:
            return None
        parent = self._threads.get(record.parent) if record.parent else None
        self._remove_subtree(record)
        return parent

    def finish(self, record: ThreadRecord) -> bool:
        """The thread's owner is done with it. Removed now unless it still has live calls.

        A thread that still has children stays until they answer (the owner may be waiting
        for several peers), as does one with messages still queued for its owner (answers
        that arrived together), until those are handled or the thread expires. Returns True
        if removed.
        """
        if self._threads.get(record.id) is not record:
            return False
        if record.children or record.pins or record.pending:
            return False
        self._remove_subtree(record)
        return True

    def pin(self, record: ThreadRecord) -> None:
        record.pins += 1

    def unpin(self, record: ThreadRecord) -> None:
        record.pins = max(0, record.pins - 1)

    def expire(self, now: float) -> list[str]:
        """Remove every unpinned thread idle for longer than ``idle_ttl``, with its subtree.

        A thread is idle only if its whole subtree is: an old parent waiting on a busy child
        stays.
        """
        cutoff = now - self.idle_ttl
        removed: list[str] = []
        for record in list(self._threads.values()):
            if record.id not in self._threads or record.parent is not None:
                continue
            removed.extend(self._expire_tree(record, cutoff))
        return removed

    def remove_owned_by(self, name: str) -> int:
        """Remove every root thread whose chain starts with ``name`` (e.g. a closed client)."""
        roots = [r for r in self._threads.values() if r.parent is None and r.chain[0] == name]
        count = 0
        for r in roots:
            count += self._remove_subtree(r)
        return count

    def _expire_tree(self, record: ThreadRecord, cutoff: float) -> list[str]:
        # Post-order: decide children first, then whether this node has become idle.
        removed: list[str] = []
        for child_id in list(record.children):
            child = self._threads.get(child_id)
            if child is not None:
                removed.extend(self._expire_tree(child, cutoff))
        if (
            not record.children
            and not record.pins
            and not record.pending
            and record.last_active <= cutoff
        ):
            removed.append(record.id)
            self._remove_subtree(record)
        return removed

    def _remove_subtree(self, record: ThreadRecord) -> int:
        threads = self._threads
        if not record.children:  # the common case: a leaf hop answering its caller
            if threads.pop(record.id, None) is None:
                return 0
            if record.parent is not None:
                parent = threads.get(record.parent)
                if parent is not None:
                    parent.children.discard(record.id)
            return 1
        stack = [record]
        count = 0
        while stack:
            node = stack.pop()
            if self._threads.pop(node.id, None) is None:
                continue
            count += 1
            stack.extend(self._threads[c] for c in node.children if c in self._threads)
        if record.parent is not None:
            parent = self._threads.get(record.parent)
            if parent is not None:
                parent.children.discard(record.id)
        return count

    def _make_room(self, now: float) -> None:
        if len(self._threads) < self.max_threads:
            return
        self.expire(now)
        if len(self._threads) >= self.max_threads:
            raise RegistryFull(f"{len(self._threads)} live threads")
