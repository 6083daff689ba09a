"""The outbox's sender: delivers the store's outbox rows (agents/store/outbox.py) over
HTTP, at least once, with exponential backoff and jitter, many receivers at once.

:class:`Outbox` is the typed API producers use: :meth:`Outbox.enqueue` (deliveries keyed
for dedupe, written in one store transaction, the sender woken) and :meth:`Outbox.add`
(a channel: one receiver's concurrency, timeout, how its rows are rendered and signed at
each attempt, when it is disabled). :meth:`Outbox.run` is the sender task:

- it claims due rows with a lease (``SKIP LOCKED`` on PostgreSQL: two processes never
  deliver a row at once; a process that died mid-delivery leaves a lease that runs out,
  and the row is delivered again with the same id);
- each channel has its own bound of deliveries in flight (its ``concurrency``) and its
  own timeout: a slow or dead receiver fills only its own slots, and the claim skips a
  channel whose slots are full, so it holds back no other;
- an attempt is a POST (any 2xx is success); a failure is retried after
  ``min(max_delay, first_delay * 2**(n-1))``, half of it random (jitter), until the row's
  ``expires_at`` (then ``expired``); a channel failing without a success for its
  ``disable_after_s`` is disabled (its rows parked) and its :class:`ChannelDirectory`
  is told.

Bounded: at most :data:`CLAIM_LIMIT` rows claimed per round, each channel's slots. On
cancel the deliveries in flight are abandoned: their leases run out and they are sent
again (at least once).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import trio

from agentserver.agents.store import outbox
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.outbox import ChannelFigures, OutboxItem, OutboxRow

log = logging.getLogger(__name__)

#: Rows one claim takes at most.
CLAIM_LIMIT = 64
#: The longest the sender sleeps without looking at the store (rows other processes
#: enqueued, retries come due).
POLL_S = 1.0
#: Seconds a lease lasts beyond the channel's timeout.
LEASE_MARGIN_S = 5.0
#: Seconds an unknown channel's rows wait before they are looked at again.
UNKNOWN_DELAY_S = 30.0
#: Seconds the sender lets finishing deliveries gather before it claims or records.
COALESCE_S = 0.005
#: Seconds between two reads of the channels' figures (for the metrics).
FIGURES_S = 5.0
#: Rows of receivers not met yet that one claim may take, per family of channels.
FAMILY_SLOTS = 8
#: Done rows are kept this long, then pruned (once a minute), when no ``<retention>`` says.
KEEP_DONE_S = 24 * 3600.0


#: Renders one attempt of a row: (headers, body), given the attempt's time (seconds).
Render = Callable[[OutboxRow, float], tuple[dict[str, str], bytes]]


def plain(row: OutboxRow, now: float) -> tuple[dict[str, str], bytes]:
    """A row sent as stored (its headers and body), no signature."""
    return dict(row.headers), row.body


@dataclass(frozen=True, slots=True)
class Channel:
    """One receiver: its bounds and how its rows are sent."""

    name: str
    concurrency: int = 4
    timeout_s: float = 10.0
    #: None: never disabled.
    disable_after_s: float | None = None
    render: Render = plain
    #: Run before each attempt (e.g. the URL checked against SSRF again: a name may
    #: resolve elsewhere now); raising fails the attempt with its text (retried).
    check: Callable[[OutboxRow], Awaitable[None]] | None = None


class ChannelDirectory(Protocol):
    """Who owns the channels the sender is not given up front (the webhooks,
    agents/edge/webhooks.py). Given to the :class:`Outbox` when it is built: it is made
    first and needs nothing of the outbox."""

    async def resolve(self, name: str) -> Channel | None:
        """The channel ``name`` this process does not know yet (e.g. a webhook another
        process made at run time); None: its rows wait."""
        ...

    async def disabled(self, name: str) -> None:
        """The sender disabled channel ``name`` (run in the sender's nursery)."""
        ...


@dataclass(slots=True)
class SenderFigures:
    """What the sender counted in this process (for the metrics)."""

    attempts: int = 0
    delivered: int = 0
    failed: int = 0
    expired: int = 0
    disabled: int = 0
    enqueued: int = 0
    #: channel → failed attempts
    failures: dict[str, int] = field(default_factory=dict)


def backoff(attempt: int, first_s: float, max_s: float, rand: Callable[[], float]) -> float:
    """The pause after failed attempt ``attempt`` (1, 2, ...): exponential from
    ``first_s``, capped at ``max_s``, its second half random (equal jitter)."""
    full = min(max_s, first_s * 2.0 ** min(attempt - 1, 62))
    return full / 2 + rand() * full / 2


class Outbox:
    """The outbox's API and its sender (see the module docstring)."""

    def __init__(
        self,
        store: StoreCalls,
        clock: Callable[[], float],
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        directory: ChannelDirectory | None = None,
        rand: Callable[[], float] = random.random,
        keep_done_s: float | None = KEEP_DONE_S,
    ) -> None:
        self._store = store
        #: How long done rows are kept before the sender prunes them; None: it never does
        #: (with ``<retention>`` the pruner does, agents/store/sql/prune_records.py).
        self._keep_done_s = keep_done_s
        self._clock = clock
        self._transport = transport
        #: Asked for the channels not known here, told of those disabled; None: unknown
        #: channels' rows wait, and a disable is only logged.
        self._directory = directory
        self._rand = rand
        self.owner = "outbox-" + uuid.uuid4().hex[:12]
        self._channels: dict[str, Channel] = {}
        self._inflight: dict[str, int] = {}
        self._wake = trio.Event()
        self._done: list[tuple[int, str, int]] = []
        self._done_ready = trio.Event()
        self.figures = SenderFigures()
        #: The store's figures per channel, refreshed every :data:`FIGURES_S` while the
        #: sender runs (what the metrics export; a scrape never waits on the store).
        self.channel_figures: list[ChannelFigures] = []
        #: Channels made on demand by name prefix (one per receiver of a feature whose
        #: receivers are not declared: A2A push notifications).
        self._families: dict[str, Callable[[str], Channel]] = {}

    # -- the API ----------------------------------------------------------------------------
    def add(self, channel: Channel) -> None:
        """Deliver ``channel``'s rows (replacing its previous settings)."""
        self._channels[channel.name] = channel
        self._wake.set()

    def add_family(self, prefix: str, make: Callable[[str], Channel]) -> None:
        """Deliver the rows of every channel named ``prefix...``, each channel made by
        ``make(name)`` when first met (its own slots: one receiver each)."""
        self._families[prefix] = make
        self._wake.set()

    def remove(self, name: str) -> None:
        self._channels.pop(name, None)

    def channel(self, name: str) -> Channel | None:
        return self._channels.get(name)

    async def enqueue(self, items: Sequence[OutboxItem]) -> int:
        """Write ``items`` to the outbox in one store transaction (deduplicated by their
        keys) and wake the sender; how many were new. Atomic: all or none."""
        n = await self._store.run(outbox.enqueue, items) if items else 0
        self.figures.enqueued += n
        if n:
            self._wake.set()
        return n

    def wake(self) -> None:
        """Look at the store now (e.g. a channel was enabled again)."""
        self._wake.set()

    def inflight(self, channel: str) -> int:
        return self._inflight.get(channel, 0)

    # -- the sender -------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver until cancelled (see the module docstring)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with (
            httpx.AsyncClient(transport=self._transport, limits=limits, trust_env=False) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(self._record)
            task_status.started()
            next_prune = next_figures = 0.0
            probe = True
            while True:
                self._wake = trio.Event()
                if not probe and self._free() == 0:
                    # Every known channel's slots are full: nothing to claim but rows of
                    # channels not known yet, looked for once per quiet POLL_S.
                    with trio.move_on_after(POLL_S) as quiet:
                        await self._wake.wait()
                    probe = quiet.cancelled_caught
                    continue
                try:
                    took = await self._claim_round(client, nursery)
                    probe = False
                    now = self._clock()
                    if now >= next_figures:
                        next_figures = now + FIGURES_S
                        self.channel_figures = await self._store.read(outbox.figures)
                    if now >= next_prune and self._keep_done_s is not None:
                        next_prune = now + 60.0
                        await self._store.run(outbox.prune, self._keep_done_s)
                except Exception as exc:  # the store failing: try again, never die
                    log.warning("outbox: store call failed (retrying): %s", exc)
                    took = 0
                    await trio.sleep(POLL_S)
                if took == 0:
                    with trio.move_on_after(POLL_S) as quiet:
                        await self._wake.wait()
                    probe = quiet.cancelled_caught
                # Let deliveries finishing together free their slots before the next
                # claim: one claim for several rows, not one per row.
                await trio.sleep(COALESCE_S)

    async def drain(self) -> None:
        """At shutdown (the sender cancelled): record the deliveries done and not yet
        written, so a restart does not send them again. A failure is logged."""
        done, self._done = self._done, []
        if not done:
            return
        try:
            await self._store.run(outbox.delivered, done)
        except Exception as exc:
            log.warning(
                "outbox: %d deliveries not recorded (they will be sent again): %s", len(done), exc
            )

    async def _record(self) -> None:
        """Write the deliveries done, in batches (one transaction each), until cancelled;
        a failed write keeps them for the next (their leases may run out first: then
        they are sent again, at least once)."""
        while True:
            await self._done_ready.wait()
            await trio.sleep(COALESCE_S)  # the deliveries finishing together: one write
            self._done_ready = trio.Event()
            done, self._done = self._done, []
            if not done:
                continue
            try:
                await self._store.run(outbox.delivered, done)
            except Exception as exc:
                log.warning("outbox: recording %d deliveries failed (retrying): %s", len(done), exc)
                self._done[:0] = done
                self._done_ready.set()
                await trio.sleep(POLL_S)

    async def _claim_round(self, client: httpx.AsyncClient, nursery: trio.Nursery) -> int:
        full = sorted(name for name, n in self._inflight.items() if n >= self._capacity(name))
        lease = max((c.timeout_s for c in self._channels.values()), default=10.0)
        # Claim no more than the known channels have free slots for (at least one, for
        # a channel not known yet): rows claimed beyond would only be given back.
        limit = min(CLAIM_LIMIT, max(1, self._free()))
        rows = await self._store.run(outbox.claim, self.owner, lease + LEASE_MARGIN_S, limit, full)
        excess: list[int] = []
        unknown: list[int] = []
        for row in rows:
            channel = self._channels.get(row.channel) or self._of_family(row.channel)
            if channel is None and self._directory is not None:
                channel = await self._directory.resolve(row.channel)
                if channel is not None:
                    self.add(channel)
            if channel is None:
                unknown.append(row.seq)
            elif self._inflight.get(channel.name, 0) >= channel.concurrency:
                excess.append(row.seq)
            else:
                self._inflight[channel.name] = self._inflight.get(channel.name, 0) + 1
                nursery.start_soon(self._deliver, client, channel, row, nursery)
        if excess:
            await self._store.run(outbox.release, excess, self.owner)
        if unknown:
            await self._store.run(outbox.release, unknown, self.owner, UNKNOWN_DELAY_S)
        return len(rows) - len(excess) - len(unknown)

    def _of_family(self, name: str) -> Channel | None:
        for prefix, make in self._families.items():
            if name.startswith(prefix):
                channel = self._channels[name] = make(name)
                return channel
        return None

    def _free(self) -> int:
        """Free slots of the known channels (and some for receivers of a family not met
        yet: a family's next receiver is always possible)."""
        known = sum(
            max(0, c.concurrency - self._inflight.get(c.name, 0)) for c in self._channels.values()
        )
        return known + (len(self._families) * FAMILY_SLOTS)

    def _capacity(self, name: str) -> int:
        channel = self._channels.get(name)
        return channel.concurrency if channel is not None else 1

    async def _deliver(
        self, client: httpx.AsyncClient, channel: Channel, row: OutboxRow, nursery: trio.Nursery
    ) -> None:
        """One attempt at ``row``, its outcome recorded (a store failure leaves the lease
        to run out: the row is attempted again). A disable is told to the directory in
        ``nursery`` (the sender's): this delivery's slot is not held for it."""
        try:
            status, error = await self._attempt(client, channel, row)
            if error is None:
                self.figures.delivered += 1
                # Recorded in batches by the recorder: one transaction for many
                # deliveries. A crash before it leaves the lease: sent again, same id.
                self._done.append((row.seq, row.channel, status or 0))
                self._done_ready.set()
                return
            self.figures.failed += 1
            self.figures.failures[channel.name] = self.figures.failures.get(channel.name, 0) + 1
            attempt = row.attempts + 1
            now = self._clock()
            retry_at: float | None = now + backoff(
                attempt, row.first_delay_s, row.max_delay_s, self._rand
            )
            if retry_at is not None and retry_at > row.expires_at:
                retry_at = None
                self.figures.expired += 1
                log.warning(
                    "outbox: %s to %s expired after %d attempt(s): %s",
                    row.delivery_id,
                    channel.name,
                    attempt,
                    error,
                )
            disabled = await self._store.run(
                outbox.failed,
                row.seq,
                row.channel,
                error,
                status,
                retry_at,
                channel.disable_after_s,
            )
            if disabled:
                self.figures.disabled += 1
                log.error("outbox: channel %s disabled (failing too long): %s", channel.name, error)
                if self._directory is not None:
                    nursery.start_soon(self._directory.disabled, channel.name)
        except Exception as exc:
            log.warning("outbox: recording %s failed (its lease will run out): %s", row.seq, exc)
        finally:
            self._inflight[channel.name] -= 1
            if self._inflight[channel.name] <= 0:
                del self._inflight[channel.name]
            self._wake.set()

    async def _attempt(
        self, client: httpx.AsyncClient, channel: Channel, row: OutboxRow
    ) -> tuple[int | None, str | None]:
        """POST one attempt; (HTTP status, None) on success, (status or None, error)."""
        self.figures.attempts += 1
        if channel.check is not None:
            try:
                await channel.check(row)
            except Exception as exc:
                return None, f"refused: {exc}"[:500]
        now = self._clock()
        try:
            headers, body = channel.render(row, now)
        except Exception as exc:  # a row that cannot be rendered will not get better
            return None, f"cannot render: {exc}"
        headers.setdefault("content-type", "application/json")
        status: int | None = None
        # The hard bound: httpx's timeouts are per read; a receiver trickling bytes
        # must not hold a slot longer than the channel's timeout.
        with trio.move_on_after(channel.timeout_s) as scope:
            try:
                response = await client.post(
                    row.url, content=body, headers=headers, timeout=channel.timeout_s
                )
                status = response.status_code
            except httpx.HTTPError as exc:
                return None, f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
        if scope.cancelled_caught:
            return None, f"timed out after {channel.timeout_s:g}s"
        assert status is not None
        if 200 <= status < 300:
            return status, None
        return status, f"HTTP {status}"
