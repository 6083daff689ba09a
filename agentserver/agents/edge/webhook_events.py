"""Webhook events as data (docs/webhooks.md): a bus event's webhook type, and its
payload, order key and dedupe key as outbox items, and the signed render of a stored
item. No I/O and no clock (the caller passes the time)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from collections.abc import Callable
from typing import Any

from agentserver.agents.edge.hooksign import signed_headers
from agentserver.agents.events import ChunkEvent, Event, StateEvent, StepEvent, TaskEvent
from agentserver.agents.profile.webhooks import WebhookSpec
from agentserver.agents.store.outbox import OutboxItem, OutboxRow

CHANNEL_PREFIX = "webhook:"


def event_type(event: Event | object) -> str | None:
    """The webhook event type of a bus event (None: never a webhook event): ``task.*``
    from a :class:`TaskEvent`, ``step.*`` from a :class:`StepEvent`, ``state.*`` from a
    :class:`StateEvent`, any object's string ``event_type`` (:class:`NoticeEvent`)."""
    if isinstance(event, TaskEvent):
        return "task." + event.status
    if isinstance(event, ChunkEvent):
        return None
    if isinstance(event, StepEvent):
        return "step." + event.phase
    if isinstance(event, StateEvent):
        return "state." + event.status
    kind = getattr(event, "event_type", None)
    return kind if isinstance(kind, str) and kind else None


def channel_name(webhook: str) -> str:
    return CHANNEL_PREFIX + webhook


def iso_time(at: float) -> str:
    return (
        datetime.datetime.fromtimestamp(at, datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def render_signed(key: bytes) -> Callable[[OutboxRow, float], tuple[dict[str, str], bytes]]:
    """A channel's render: the stored payload with its ``sequence`` (the same bytes on
    every attempt), signed for the attempt's time."""

    def render(row: OutboxRow, now: float) -> tuple[dict[str, str], bytes]:
        payload = json.loads(row.body)
        payload["sequence"] = row.order_seq
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        headers = dict(row.headers)
        headers.update(signed_headers(key, row.delivery_id, int(now), body))
        headers["content-type"] = "application/json"
        return headers, body

    return render


def describe(etype: str, event: Event) -> tuple[dict[str, Any], str, str]:
    """(payload data, conversation (the order key's), dedupe key) of an event other than
    a Turn's end: from the event alone (pure)."""
    if isinstance(event, StepEvent):
        data = dataclasses.asdict(event)
        key = f"{etype}:{event.step_id}:{event.attempt}"
        return data, f"{event.agent_id}/{event.agent_turn_id}", key
    if isinstance(event, StateEvent):
        data = dataclasses.asdict(event)
        return data, f"{event.agent_id}", f"{etype}:{uuid.uuid4().hex}"
    raw = getattr(event, "data", None)
    data = dict(raw) if isinstance(raw, dict) else fields_of(event)
    agent = getattr(event, "agent_id", "") or ""
    turn = getattr(event, "agent_turn_id", None)
    if agent and "agent" not in data:
        data["agent"] = agent
    dedupe = getattr(event, "dedupe_key", "") or f"{etype}:{uuid.uuid4().hex}"
    return data, f"{agent}/{turn}" if turn else agent or etype, dedupe


def outbox_key(webhook: str, key: str) -> str:
    """The outbox's dedupe key of an event's item for ``webhook`` (``key``: the event's
    own, the same for every webhook)."""
    return f"{webhook}:{key}"


def task_end_key(etype: str, agent_turn_id: str) -> str:
    """The event key of a Turn's end (``task.*``): one per Turn, however often offered."""
    return f"{etype}:{agent_turn_id}"


def items_of(
    specs: list[WebhookSpec],
    etype: str,
    at: float,
    data: dict[str, Any],
    conversation: str,
    key: str,
) -> list[OutboxItem]:
    """One event's outbox item per webhook in ``specs``."""
    payload = {"type": etype, "timestamp": iso_time(at), "data": data}
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return [
        OutboxItem(
            channel=channel_name(s.name),
            url=s.url,
            body=body,
            dedupe_key=outbox_key(s.name, key),
            order_key=f"{s.name}|{conversation}",
            retry_for_s=s.retry_for_s,
            first_delay_s=s.first_delay_s,
            max_delay_s=s.max_delay_s,
        )
        for s in specs
    ]


def fields_of(event: object) -> dict[str, Any]:
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        return {k: v for k, v in dataclasses.asdict(event).items() if k != "event_type"}
    return {}
