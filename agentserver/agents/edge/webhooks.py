"""Webhooks: the agents' events (agents/events.py) as signed HTTP deliveries, through
the durable outbox (agents/edge/outbox.py; docs/webhooks.md).

:class:`WebhookDirectory` holds the webhooks declared in boot.xml and those made at run
time (durable in the store's ``webhooks`` table), and answers the outbox for them;
:class:`Webhooks`, built with it and the outbox, makes and deletes them and feeds them.
While there is none it costs nothing: no observer on the event bus, no task. Once there
is one, an observer maps each event to
its webhook event type (:func:`event_type`), keeps those some webhook wants, and hands
them to a writer task through a bounded buffer (the bus's observers must never block);
the writer turns them into outbox items (one per webhook, keyed so an event is enqueued
once per webhook) and writes each batch in one store transaction. The outbox's sender
delivers them, each attempt signed the Standard Webhooks way (agents/edge/hooksign.py).

An event is durable once its batch is written (milliseconds after it was published): a
crash in between loses it, except a ``task.*`` (offered again at start, and by any
running process on the same store within :data:`RESWEEP_EVERY_S` when the outbox lacks
it: :meth:`Webhooks._sweep`) and a ``webhook.disabled`` (offered again at start,
:meth:`WebhookDirectory.announce_disabled`) and an event
its publisher wrote in its own transaction (:meth:`render_durable`, then published
``written=True``; docs/runs.md has the table). A full buffer (the store failing
for :data:`BUFFER_EVENTS` events) drops new events, counted and logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import trio

from agentserver.agents.edge.hooksign import new_secret, secret_bytes
from agentserver.agents.edge.outbox import Channel, Outbox
from agentserver.agents.edge.webhook_events import (
    CHANNEL_PREFIX,
    channel_name,
    describe,
    event_type,
    iso_time,
    items_of,
    outbox_key,
    render_signed,
    task_end_key,
)
from agentserver.agents.events import (
    Event,
    EventBus,
    NoticeEvent,
    TaskEvent,
)
from agentserver.agents.profile.webhooks import (
    WebhookConfigError,
    WebhookSpec,
    check_spec,
    event_matches,
)
from agentserver.agents.store import outbox as store_outbox
from agentserver.agents.store import webhook_rows
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.outbox import ChannelFigures, OutboxItem
from agentserver.agents.store.sql import memory

log = logging.getLogger(__name__)

#: The Turns ended this long before a start have their ``task.*`` events offered again.
SWEEP_S = 900.0
#: While running, this often, the ``task.*`` events of the Turns ended since the last
#: sweep (at least :data:`RESWEEP_GRACE_S` ago: the writer of their own process has
#: written them by then) that the outbox does not hold are offered again: those of
#: another process killed before it wrote them, and perhaps never started again.
RESWEEP_EVERY_S = 30.0
RESWEEP_GRACE_S = 10.0
_ENDS = ("succeeded", "failed", "stopped", "timed_out")
#: Events waiting for the writer at most (beyond: counted drops).
BUFFER_EVENTS = 16384
#: Events one write takes at most.
BATCH_EVENTS = 256
#: The longest answer text a ``task.*`` payload carries (longer: cut, ``answer_truncated``).
ANSWER_CHARS = 65536


class WebhookExists(Exception):
    """A webhook of that name exists already."""


class WebhookNotFound(Exception):
    """No webhook of that name (or it is declared in boot.xml, not made at run time)."""


def spec_from_row(name: str, spec_json: str, secret: str) -> WebhookSpec:
    """A webhook made at run time, as the store's ``webhooks`` table keeps it."""
    d = json.loads(spec_json)
    return check_spec(
        WebhookSpec(
            name=name,
            url=d["url"],
            events=tuple(d["events"]),
            secret=secret,
            agent=d.get("agent"),
            first_delay_s=float(d["first_delay"]),
            max_delay_s=float(d["max_delay"]),
            retry_for_s=float(d["retry_for"]),
            timeout_s=float(d["timeout"]),
            concurrency=int(d["concurrency"]),
            disable_after_s=float(d["disable_after"]),
            runtime=True,
        )
    )


class WebhookDirectory:
    """The webhooks this process knows (declared, and made at run time here or by another
    process) and the outbox's :class:`~agentserver.agents.edge.outbox.ChannelDirectory`
    for them: a channel another process made is loaded from the store
    (:meth:`resolve`), and a disabled one is announced on the bus (:meth:`disabled`).

    Built first, from the store and the bus alone; the outbox is given it, and
    :class:`Webhooks` is given both (no callback is set on the outbox afterwards)."""

    def __init__(self, store: StoreCalls, bus: EventBus) -> None:
        self._store = store
        self._bus = bus
        self._specs: dict[str, WebhookSpec] = {}
        #: (event type, agent) → whether some webhook wants it (cleared on any change).
        self._wanted: dict[tuple[str, str], bool] = {}

    def install(self, spec: WebhookSpec) -> Channel:
        """Know ``spec`` (replacing one of its name); its outbox channel. Raises
        ValueError for a secret that is not a webhook secret."""
        key = secret_bytes(spec.secret)
        self._specs[spec.name] = spec
        self._wanted.clear()
        return Channel(
            channel_name(spec.name),
            concurrency=spec.concurrency,
            timeout_s=spec.timeout_s,
            disable_after_s=spec.disable_after_s,
            render=render_signed(key),
        )

    def forget(self, name: str) -> None:
        self._specs.pop(name, None)
        self._wanted.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def specs(self) -> list[WebhookSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    def spec(self, name: str) -> WebhookSpec | None:
        return self._specs.get(name)

    def current(self) -> tuple[WebhookSpec, ...]:
        """The webhooks there are now (a snapshot)."""
        return tuple(self._specs.values())

    def wanting(self, etype: str, agent: str) -> list[WebhookSpec]:
        """The webhooks that want an ``etype`` event of ``agent``."""
        return [s for s in self._specs.values() if s.wants(etype, agent)]

    def wants(self, etype: str, agent: str) -> bool:
        """Some webhook wants an ``etype`` event of ``agent`` (cached: the bus's observer
        asks it for every event)."""
        key = (etype, agent)
        got = self._wanted.get(key)
        if got is None:
            got = any(s.wants(etype, agent) for s in self._specs.values())
            if len(self._wanted) > 4096:
                self._wanted.clear()
            self._wanted[key] = got
        return got

    def wants_any(self, etype: str) -> bool:
        """Some webhook, of any agent, wants ``etype``."""
        return any(any(event_matches(p, etype) for p in s.events) for s in self._specs.values())

    async def resolve(self, name: str) -> Channel | None:
        """A channel another process made at run time: its webhook loaded from the store."""
        if not name.startswith(CHANNEL_PREFIX):
            return None
        webhook = name[len(CHANNEL_PREFIX) :]
        for row_name, spec_json, secret in await self._store.read(webhook_rows.get_webhooks):
            if row_name == webhook:
                return self.install(spec_from_row(row_name, spec_json, secret))
        return None

    async def disabled(self, name: str) -> None:
        """The outbox disabled channel ``name``: a ``webhook.disabled`` event (to the
        others), announced from the store's record of the disable."""
        if name.startswith(CHANNEL_PREFIX):
            await self.announce_disabled(name, 0.0)

    async def announce_disabled(self, channel: str | None, since: float) -> None:
        """Publish ``webhook.disabled`` for ``channel`` (None: every webhook channel
        disabled at or after ``since``), keyed by the disable's time in the store: the
        start-up sweep's offer of an event already written adds nothing, and one a
        process killed before writing it is written then."""
        try:
            figures = await self._store.read(store_outbox.figures)
        except Exception as exc:  # the store failing: the disable itself is durable
            log.warning("webhooks: webhook.disabled not announced: %s", exc)
            return
        for f in figures:
            at = f.disabled_at
            if at is None or at < since or not f.channel.startswith(CHANNEL_PREFIX):
                continue
            if channel is not None and f.channel != channel:
                continue
            name = f.channel[len(CHANNEL_PREFIX) :]
            self._bus.publish(
                NoticeEvent(
                    "webhook.disabled",
                    data={"webhook": name, "at": iso_time(at)},
                    dedupe_key=f"webhook.disabled:{name}:{at!r}",
                )
            )


class Webhooks:
    """The webhooks of one server process (see the module docstring). ``directory``
    holds them and is the one ``outbox`` was built with (``app/root.py`` builds the
    three in that order)."""

    def __init__(
        self,
        store: StoreCalls,
        directory: WebhookDirectory,
        outbox: Outbox,
        bus: EventBus,
        clock: Callable[[], float],
        declared: tuple[WebhookSpec, ...] = (),
        resweep_every_s: float = RESWEEP_EVERY_S,
        resweep_grace_s: float = RESWEEP_GRACE_S,
    ) -> None:
        self._store = store
        self._resweep_every_s = resweep_every_s
        self._resweep_grace_s = resweep_grace_s
        self._directory = directory
        self._outbox = outbox
        self._bus = bus
        self._clock = clock
        #: The bus's observer asks this for every event: the directory's, unwrapped.
        self._wants = directory.wants
        self._send, self._receive = trio.open_memory_channel[tuple[str, Event, float]](
            BUFFER_EVENTS
        )
        self._observing = False
        self._nursery: trio.Nursery | None = None
        self._started = False
        self._sending = False
        self._batch: list[tuple[str, Event, float]] = []
        self.dropped = 0
        self.written = 0
        #: Turn ends the periodic sweep found with no event in the outbox, and offered.
        self.swept = 0
        for spec in declared:
            self._install(spec)

    # -- life -------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the webhooks made at run time; run the writer and the outbox's sender
        while there is any webhook (from when the first is made), until cancelled (then
        :meth:`drain` writes what the buffer still holds)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name, spec_json, secret in await self._store.read(webhook_rows.get_webhooks):
                try:
                    self._install(spec_from_row(name, spec_json, secret))
                except (WebhookConfigError, ValueError, TypeError, KeyError) as exc:
                    log.error("webhook %s in the store is not valid, ignored: %s", name, exc)
            await self._activate()
            task_status.started()
            swept_to = self._clock()
            if self._directory.current():
                await self._sweep(swept_to - SWEEP_S)
                if self._directory.wants_any("webhook.disabled"):
                    await self._directory.announce_disabled(None, self._clock() - SWEEP_S)
            while True:
                await trio.sleep(self._resweep_every_s)
                if not self._directory.current():
                    continue
                until = self._clock() - self._resweep_grace_s
                # From a grace before the last sweep's end: a Turn ended just before it
                # may have been written only after it read the store.
                await self._sweep(min(swept_to, until) - self._resweep_grace_s, until, True)
                swept_to = until

    async def _sweep(
        self, since: float, until: float | None = None, missing_only: bool = False
    ) -> None:
        """Offer again the ``task.*`` events of the Turns ended from ``since`` (to
        ``until``): those a process killed between a Turn's end and the write of its
        event lost. The others are in the outbox already: their keys add nothing, and
        with ``missing_only`` they are left out before they are described (the periodic
        sweep, which would otherwise read two rows per Turn ended)."""
        if not any(self._directory.wants_any("task." + s) for s in _ENDS):
            return
        try:
            ended = [
                end
                for end in await self._store.read(webhook_rows.recent_task_ends, since)
                if until is None or end[5] <= until
            ]
            present: set[str] = set()
            if missing_only and ended:
                present = await self._store.read(
                    store_outbox.present_keys,
                    [key for end in ended for key in self._task_keys(end[0], end[1], end[2])],
                )
        except Exception as exc:
            log.warning("webhooks: sweep of the Turns ended failed: %s", exc)
            return
        for agent, turn, status, box, card, at in ended:
            keys = self._task_keys(agent, turn, status)
            if not keys or (missing_only and all(k in present for k in keys)):
                continue
            if missing_only:
                self.swept += 1
            with contextlib.suppress(trio.WouldBlock):
                self._send.send_nowait(
                    ("task." + status, TaskEvent(agent, turn, status, box, card), at)
                )

    def _task_keys(self, agent: str, turn: str, status: str) -> list[str]:
        """The outbox keys of a Turn's end, one per webhook that wants it (as
        :meth:`_describe_task` and ``items_of`` make them)."""
        etype = "task." + status
        key = task_end_key(etype, turn)
        return [outbox_key(s.name, key) for s in self._directory.wanting(etype, agent)]

    async def _activate(self) -> None:
        if not self._directory.current() or self._nursery is None:
            return
        if not self._observing:
            self._observing = True
            self._bus.observe_durably(self._observe, self.render_durable)
        await self.start_sender()
        if not self._started:
            self._started = True
            await self._nursery.start(self._write_loop)

    async def start_sender(self) -> None:
        """Run the outbox's sender from now on (once; after :meth:`run` started): for
        the webhooks, or for another feature's deliveries (A2A push notifications)."""
        if not self._sending and self._nursery is not None:
            self._sending = True
            await self._nursery.start(self._outbox.run)

    @property
    def outbox(self) -> Outbox:
        """The outbox these webhooks deliver through (shared with A2A push)."""
        return self._outbox

    async def drain(self) -> None:
        """At shutdown (the writer and the sender cancelled): record the deliveries done,
        write the events still buffered."""
        await self._outbox.drain()
        try:
            while self._batch or self._take():
                await self._write()
        except Exception as exc:
            log.error("webhooks: %d event(s) not written at shutdown: %s", len(self._batch), exc)

    @property
    def observing(self) -> bool:
        """Whether the bus's events are looked at (only once a webhook exists)."""
        return self._observing

    # -- the webhooks -----------------------------------------------------------------------
    def specs(self) -> list[WebhookSpec]:
        return self._directory.specs()

    def spec(self, name: str) -> WebhookSpec | None:
        return self._directory.spec(name)

    async def create(self, spec: WebhookSpec) -> WebhookSpec:
        """Make a webhook at run time (durable); a secret is generated unless given.
        Raises :class:`WebhookExists`, :class:`WebhookConfigError`."""
        if not spec.secret:
            spec = dataclasses.replace(spec, secret=new_secret())
        spec = check_spec(dataclasses.replace(spec, runtime=True, secret_env=None))
        secret_bytes(spec.secret)
        if spec.name in self._directory:
            raise WebhookExists(spec.name)
        stored = json.dumps({k: v for k, v in spec.public().items() if k != "name"})
        if not await self._store.run(webhook_rows.put_webhook, spec.name, stored, spec.secret):
            raise WebhookExists(spec.name)
        self._install(spec)
        await self._activate()
        return spec

    async def delete(self, name: str) -> None:
        """Delete a webhook made at run time; its undelivered events are withdrawn."""
        spec = self._directory.spec(name)
        if spec is not None and not spec.runtime:
            raise WebhookNotFound(f"{name} is declared in boot.xml")
        if not await self._store.run(webhook_rows.delete_webhook, name, channel_name(name)):
            raise WebhookNotFound(name)
        self._directory.forget(name)
        self._outbox.remove(channel_name(name))

    async def enable(self, name: str) -> int:
        """Enable a disabled webhook again (its parked events pending); how many."""
        if name not in self._directory:
            raise WebhookNotFound(name)
        n = await self._store.run(store_outbox.enable, channel_name(name))
        self._outbox.wake()
        return n

    async def status(self) -> list[dict[str, Any]]:
        """Each webhook with its delivery figures (``failing``, ``disabled_at``, ...)."""
        figures = {f.channel: f for f in await self._store.read(store_outbox.figures)}
        out = []
        for spec in self.specs():
            f = figures.get(channel_name(spec.name), ChannelFigures(channel_name(spec.name)))
            out.append({**spec.public(), **f.as_dict(), "disabled": f.disabled_at is not None})
        return out

    async def deliveries(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        if name not in self._directory:
            raise WebhookNotFound(name)
        return await self._store.read(store_outbox.deliveries, channel_name(name), limit)

    def _install(self, spec: WebhookSpec) -> None:
        self._outbox.add(self._directory.install(spec))

    # -- events into the outbox ---------------------------------------------------------------
    def _observe(self, event: Event) -> None:
        """The bus's observer: quick, never blocks, never raises."""
        etype = event_type(event)
        if etype is None or not self._wants(etype, getattr(event, "agent_id", "") or ""):
            return
        try:
            self._send.send_nowait((etype, event, self._clock()))
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("webhooks: buffer full, %d event(s) dropped", self.dropped)

    async def _write_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        pause = 0.5
        while True:
            if not self._batch:
                self._batch.append(await self._receive.receive())
            self._take()
            try:
                await self._write()
                pause = 0.5
            except Exception as exc:
                log.warning(
                    "webhooks: could not write %d event(s), retrying: %s", len(self._batch), exc
                )
                await trio.sleep(pause)
                pause = min(pause * 2, 30.0)

    def _take(self) -> int:
        took = 0
        while len(self._batch) < BATCH_EVENTS:
            try:
                self._batch.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
            took += 1
        return took

    async def _write(self) -> None:
        items: list[OutboxItem] = []
        for etype, event, at in self._batch:
            items.extend(await self._items(etype, event, at))
        await self._outbox.enqueue(items)
        self.written += len(self._batch)
        self._batch = []

    async def _items(self, etype: str, event: Event, at: float) -> list[OutboxItem]:
        agent = getattr(event, "agent_id", "") or ""
        specs = self._directory.wanting(etype, agent)
        if not specs:
            return []
        if isinstance(event, TaskEvent):
            described = await self._describe_task(etype, event)
        else:
            described = describe(etype, event)
        return items_of(specs, etype, at, *described)

    def render_durable(self) -> Callable[[Event], list[OutboxItem]]:
        """The outbox rows of an event for the webhooks there are now (a snapshot: pure,
        so a store transaction may call it off trio; :meth:`EventBus.outbox_render`). A
        ``task.*`` event has none here: it is described from the store (and recovered
        at start by :meth:`_sweep` instead)."""
        specs = self._directory.current()
        clock = self._clock

        def render(event: Event) -> list[OutboxItem]:
            etype = event_type(event)
            if etype is None or isinstance(event, TaskEvent):
                return []
            agent = getattr(event, "agent_id", "") or ""
            wanted = [s for s in specs if s.wants(etype, agent)]
            if not wanted:
                return []
            return items_of(wanted, etype, clock(), *describe(etype, event))

        return render

    async def _describe_task(self, etype: str, event: TaskEvent) -> tuple[dict[str, Any], str, str]:
        """(payload data, conversation (the order key's), dedupe key) of a Turn's end."""
        thread, conversation = await self._store.read(
            webhook_rows.turn_conversation, event.agent_turn_id
        )
        data: dict[str, Any] = {
            "agent": event.agent_id,
            "turn": event.agent_turn_id,
            "thread": thread,
            "conversation": conversation,
            "status": event.status,
        }
        card = (
            await self._store.read(memory.card, event.deliverable_card_id)
            if event.deliverable_card_id
            else None
        )
        if card is not None:
            text = str(card.content)
            data["answer"] = text[:ANSWER_CHARS]
            if len(text) > ANSWER_CHARS:
                data["answer_truncated"] = True
        conv = f"{event.agent_id}/{conversation or thread or event.agent_turn_id}"
        return data, conv, task_end_key(etype, event.agent_turn_id)
