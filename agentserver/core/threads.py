"""The thread registry: opaque uuid4 thread ids → call chains. Pure data, no I/O.

Every conversation hop has its own thread. Forwarding from thread ``P`` (chain ``a.b``) to
``c`` opens a child thread with chain ``a.b.c``; responding on that child prunes it (and
everything below it) and routes to the parent, whose tail is the caller. Because each hop
gets a fresh id and a parent link, two concurrent conversations along the same path never
share a thread: each reply finds its own caller.

A thread is *finished* when nothing can reach it any more: its owner's handler is done
with it (nothing ``pending``), it has no calls out (no children) and nobody holds it (no
``pins``). :meth:`ThreadRegistry.finish` removes such a thread and then every caller hop
that its removal finishes in turn (a listener that forwarded and returned waits for nothing
once its last call ended without an answer). A *transient* root (an external party's
conversation) exists only for its hops: it is removed with its last one, whether that hop
answered or ended silently, so finished conversations hold no capacity. Reusing its id
later simply opens it again.

Bounds: at most ``max_threads`` live threads. When full, idle threads (no activity for
``idle_ttl`` seconds, not pinned) are expired first; if none can go, opening a thread raises
:class:`RegistryFull`. A tree may also be charged to a :class:`ThreadQuota` (one external
party's share): every thread of the tree counts against it, and past its limit opening
one more in that tree raises :class:`QuotaExceeded`, so one party cannot fill the registry
for everyone. Time is passed in by the caller (``now``), so tests control it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from agentserver.core.errors import AgentServerError

_UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def is_uuid4(value: str) -> bool:
    """True for a canonical lowercase uuid4 string."""
    return bool(_UUID4.match(value))


# uuid4 = 122 random bits with the version nibble 4 and the variant bits 10.
_VERSION_BYTE = bytes((b & 0x0F) | 0x40 for b in range(256))
_VARIANT_BYTE = bytes((b & 0x3F) | 0x80 for b in range(256))
_BATCH = 256
#: Where each of an id's 32 hex digits goes among its 36 characters (after the dashes).
_HEX_AT = tuple(i + (i >= 8) + (i >= 12) + (i >= 16) + (i >= 20) for i in range(32))
_DASHES = b"-" * (36 * _BATCH)


class _IdPool:
    """uuid4 strings made 256 at a time from one ``os.urandom`` read: a thread id is drawn
    for every hop, and one id at a time costs three times as much."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: list[str] = []

    def take(self) -> str:
        try:
            return self._ids.pop()
        except IndexError:
            self._ids = self._batch()
            return self._ids.pop()

    @staticmethod
    def _batch() -> list[str]:
        raw = bytearray(os.urandom(16 * _BATCH))
        raw[6::16] = raw[6::16].translate(_VERSION_BYTE)
        raw[8::16] = raw[8::16].translate(_VARIANT_BYTE)
        digits = raw.hex().encode()
        # Digit i of every id is placed by one strided copy: 32 copies for the whole batch
        # instead of five slices and a format per id (callgrind: a third of the cost).
        out = bytearray(_DASHES)
        for i, at in enumerate(_HEX_AT):
            out[at::36] = digits[i::32]
        text = out.decode("ascii")
        return [text[i : i + 36] for i in range(0, 36 * _BATCH, 36)]

    def clear(self) -> None:
        self._ids = []


_ids = _IdPool()
# A forked child must not hand out the ids its parent has already drawn.
os.register_at_fork(after_in_child=_ids.clear)


#: ``new_thread_id() -> str``: a random uuid4 string (``uuid.uuid4()`` is several times
#: slower on the hot path). The pool's own method: one Python call less per id.
new_thread_id = _ids.take


class RegistryFull(AgentServerError):
    """No room for another thread, even after expiring idle ones."""


class QuotaExceeded(RegistryFull):
    """No room for another thread in a tree charged to a full :class:`ThreadQuota`."""


@dataclass(slots=True, eq=False)
class ThreadQuota:
    """One party's share of the registry: the threads of the trees charged to it."""

    limit: int
    used: int = 0


@dataclass(slots=True, eq=False)
class ThreadRecord:
    id: str
    chain: tuple[str, ...]
    parent: str | None
    last_active: float
    children: set[str] = field(default_factory=set)
    #: Holds (e.g. an open agent Turn) keep a thread from idle expiry.
    pins: int = 0
    #: Messages for the owner on this thread, queued or being handled (until the
    #: handler's outputs are out).
    pending: int = 0
    #: Consecutive outputs of the owner that the pump refused (bounded, see the pump).
    strikes: int = 0
    #: The share this thread is charged to (shared by its whole tree), if any.
    quota: ThreadQuota | None = None
    #: A root that is removed with its last child (see the module docstring).
    transient: bool = False

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
        #: ``lookup(thread_id) -> ThreadRecord | None``: :meth:`get` without a Python call
        #: (for the pump's hot path).
        self.lookup = self._threads.get

    def __len__(self) -> int:
        return len(self._threads)

    def __contains__(self, thread_id: object) -> bool:
        return thread_id in self._threads

    def get(self, thread_id: str) -> ThreadRecord | None:
        return self._threads.get(thread_id)

    def open_root(
        self,
        chain: tuple[str, ...],
        now: float,
        thread_id: str | None = None,
        *,
        quota: ThreadQuota | None = None,
        transient: bool = False,
    ) -> ThreadRecord:
        """Open a thread with no parent (the system root, or an external conversation).

        ``quota``: charge this tree to it. ``transient``: remove the root with its last
        child (an external conversation); such a root that never gets a child is removed
        by :meth:`finish`.
        """
        if not chain:
            raise ValueError("a chain needs at least one name")
        tid = thread_id or new_thread_id()
        if tid in self._threads:
            raise ValueError(f"thread {tid} exists")
        self._make_room(now)
        if quota is not None:
            if quota.used >= quota.limit:
                raise QuotaExceeded(f"{quota.used} threads in this party's share")
            quota.used += 1
        record = ThreadRecord(tid, chain, None, now, quota=quota, transient=transient)
        self._threads[tid] = record
        return record

    def extend(
        self, parent: ThreadRecord, target: str, now: float, thread_id: str | None = None
    ) -> ThreadRecord:
        """Open a child of ``parent`` whose chain ends in ``target``.

        ``thread_id`` is for restoring a known hop after a restart (see
        ``Pump.revive``); normally a fresh uuid4 is drawn.
        """
        threads = self._threads
        if parent.id not in threads:
            raise KeyError(parent.id)
        if thread_id is None:
            thread_id = new_thread_id()
        elif thread_id in threads:
            raise ValueError(f"thread {thread_id} exists")
        self._make_room(now)
        quota = parent.quota
        if quota is not None:
            if quota.used >= quota.limit:
                raise QuotaExceeded(f"{quota.used} threads in this party's share")
            quota.used += 1
        record = ThreadRecord(thread_id, (*parent.chain, target), parent.id, now, quota=quota)
        threads[thread_id] = record
        parent.children.add(thread_id)
        parent.last_active = now
        return record

    def prune(self, record: ThreadRecord) -> ThreadRecord | None:
        """Remove ``record`` and its whole subtree; return its parent (the caller's thread).

        Returns ``None`` for a thread with no parent (nobody to answer). Idempotent:
        pruning an already-removed thread returns ``None`` and changes nothing. A transient
        parent left without children is removed too (it is returned all the same: its
        owner, an external party, only needs its id to be answered).
        """
        threads = self._threads
        if threads.get(record.id) is not record:
            return None
        parent = threads.get(record.parent) if record.parent is not None else None
        self._remove_subtree(record)
        return parent

    def finish(self, record: ThreadRecord) -> ThreadRecord | None:
        """The thread's owner is done with it. Removed now if finished (see the module
        docstring), with every caller hop its removal finishes.

        A thread that still has children stays until they answer (the owner may be waiting
        for several peers), as does one with messages pending for its owner, or a pinned
        one. Returns the topmost thread removed, whose caller (its parent's owner) will
        get no answer on it, or None if nothing was removed.
        """
        threads = self._threads
        if threads.get(record.id) is not record:
            return None
        if record.children or record.pins or record.pending:
            return None
        top = record
        while True:
            self._remove_subtree(top)  # a leaf: detaches it, collapses a transient parent
            parent = threads.get(top.parent) if top.parent is not None else None
            if (
                parent is None
                or parent.parent is None
                or parent.children
                or parent.pins
                or parent.pending
            ):
                return top
            top = parent

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
        """Remove every root thread whose chain starts with ``name`` (e.g. a closed client),
        except the hops below it that someone holds (``pins``: an agent's task, answered
        later) with the calls they have out: their answers must still find them. Such a
        root stays, transient, until its last held hop ends. Bounded by the trees removed."""
        threads = self._threads
        roots = [r for r in threads.values() if r.parent is None and r.chain[0] == name]
        count = 0
        for r in roots:
            held = [c for c in r.children if c in threads and self._holds_pin(threads[c])]
            if not held:
                count += self._remove_subtree(r)
                continue
            for child in list(r.children):
                if child in threads and child not in held:
                    count += self._remove_subtree(threads[child])
            r.transient = True
        return count

    def _holds_pin(self, record: ThreadRecord) -> bool:
        """``record`` or a thread below it is pinned."""
        threads = self._threads
        stack = [record]
        while stack:
            node = stack.pop()
            if node.pins:
                return True
            stack.extend(threads[c] for c in node.children if c in threads)
        return False

    def _expire_tree(self, root: ThreadRecord, cutoff: float) -> list[str]:
        # Post-order, children first, then whether the node has become idle; with a stack,
        # not recursion: two listeners forwarding to each other can build a chain deeper
        # than Python's recursion limit.
        threads = self._threads
        removed: list[str] = []
        stack = [(root, False)]
        while stack:
            record, children_decided = stack.pop()
            if threads.get(record.id) is not record:
                continue
            if not children_decided:
                stack.append((record, True))
                stack.extend((threads[c], False) for c in record.children if c in threads)
                continue
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
            count = 1
            if record.quota is not None:
                record.quota.used -= 1
        else:
            stack = [record]
            count = 0
            while stack:
                node = stack.pop()
                if threads.pop(node.id, None) is None:
                    continue
                count += 1
                if node.quota is not None:
                    node.quota.used -= 1
                stack.extend(threads[c] for c in node.children if c in threads)
        if record.parent is not None:
            parent = threads.get(record.parent)
            if parent is not None:
                parent.children.discard(record.id)
                if (
                    parent.transient
                    and not parent.children
                    and not parent.pins
                    and not parent.pending
                ):
                    # The conversation's last hop ended: the root holds nothing any more.
                    del threads[parent.id]
                    if parent.quota is not None:
                        parent.quota.used -= 1
                    count += 1
        return count

    def _make_room(self, now: float) -> None:
        if len(self._threads) < self.max_threads:
            return
        self.expire(now)
        if len(self._threads) >= self.max_threads:
            raise RegistryFull(f"{len(self._threads)} live threads")
