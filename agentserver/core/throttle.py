"""Failed-hello throttling per source address, sans I/O (the server supplies the time).

An address that fails the hello ``free_failures`` times is slowed: before its next hello
is checked, the server waits until ``base_delay * 2**k`` seconds (k failures past the free
ones; at most ``max_delay``) have passed since its last failure. A success forgets the
address; so does ``forget_after`` seconds without a failure, which ends a *burst* (the
server logs one line when a burst starts to be slowed, not one per attempt). The table
holds at most ``max_addresses`` entries: past that the least recently failed is dropped,
so a flood of addresses costs bounded memory (each dropped one merely starts over).

Nothing here says whether a name or a token was wrong: the server's refusal is the same.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

DEFAULT_FREE_FAILURES = 5
DEFAULT_BASE_DELAY = 0.5
DEFAULT_MAX_DELAY = 30.0
DEFAULT_FORGET_AFTER = 600.0
DEFAULT_MAX_ADDRESSES = 4096


@dataclass(slots=True)
class _Entry:
    failures: int
    last: float


class HelloThrottle:
    """The failure table (see the module docstring). Times are any monotonic clock's."""

    def __init__(
        self,
        *,
        free_failures: int = DEFAULT_FREE_FAILURES,
        base_delay: float = DEFAULT_BASE_DELAY,
        max_delay: float = DEFAULT_MAX_DELAY,
        forget_after: float = DEFAULT_FORGET_AFTER,
        max_addresses: int = DEFAULT_MAX_ADDRESSES,
    ) -> None:
        if free_failures < 0 or base_delay < 0 or max_delay < 0 or max_addresses < 1:
            raise ValueError("throttle settings must be non-negative (max_addresses >= 1)")
        self.free_failures = free_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_addresses = max_addresses
        # Least recently failed first, so eviction pops from the left.
        self._table: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def _entry(self, address: str, now: float) -> _Entry | None:
        entry = self._table.get(address)
        if entry is not None and now - entry.last >= self.forget_after:
            del self._table[address]  # the burst is over
            return None
        return entry

    def penalty(self, failures: int) -> float:
        """Seconds an address with ``failures`` recent failures waits after the last."""
        extra = failures - self.free_failures
        if extra < 0:
            return 0.0
        # min() first: 2**extra for a huge count must not overflow a float.
        return min(self.max_delay, self.base_delay * 2 ** min(extra, 64))

    def delay(self, address: str, now: float) -> float:
        """Seconds to wait before checking a hello from ``address`` (0: at once)."""
        entry = self._entry(address, now)
        if entry is None:
            return 0.0
        return max(0.0, entry.last + self.penalty(entry.failures) - now)

    def failed(self, address: str, now: float) -> bool:
        """Record a failed hello. True when this failure starts slowing the address down
        (log it then, once per burst)."""
        entry = self._entry(address, now)
        if entry is None:
            entry = self._table[address] = _Entry(0, now)
            while len(self._table) > self.max_addresses:
                self._table.popitem(last=False)
        entry.failures += 1
        entry.last = now
        self._table.move_to_end(address)
        return entry.failures == self.free_failures

    def failures(self, address: str, now: float) -> int:
        entry = self._entry(address, now)
        return 0 if entry is None else entry.failures

    def succeeded(self, address: str) -> None:
        """A valid hello: forget the address."""
        self._table.pop(address, None)
