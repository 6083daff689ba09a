"""A2A push notifications (docs/a2a.md, "Push notifications"): a client's URL checked
against SSRF, and :class:`PushNotifier`, which owes a notification each time a watched
task's state changes, on the webhooks' durable outbox (agents/edge/outbox.py), which
delivers it.

The watching works on the store (:mod:`agentserver.agents.store.sql.a2a_push`), so any
process sharing it notices a change, once: the outbox row is written in the transaction
that compare-and-sets the config's last notified state. The outbox then does what it does
for webhooks: a lease per attempt (one process at a time), retries with exponential
backoff and jitter from :data:`FIRST_DELAY` up to :data:`MAX_DELAY` for
:data:`RETRY_FOR` seconds, the same id on every attempt, at least once across restarts;
one channel per receiver (``a2a-push:`` and the URL's origin), so a slow or dead receiver
fills only its own slots. Only the wire format is A2A's, not the webhooks' (no Standard
Webhooks signature): the body is the SDK's ``StreamResponse`` holding the task, with the
config's token (``X-A2A-Notification-Token``), its ``authentication`` as
``Authorization``, and the delivery's id (``X-A2A-Notification-Id``). Each attempt
checks the URL against SSRF again first (a name may resolve elsewhere now).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import urllib.parse

import trio
from a2a.types import StreamResponse, Task, TaskPushNotificationConfig, TaskState
from google.protobuf.json_format import MessageToJson, ParseDict

from agentserver.agents.edge.outbox import Channel, Outbox
from agentserver.agents.errors import TurnPruned
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.outbox import OutboxItem, OutboxRow
from agentserver.agents.store.sql import a2a, a2a_push
from agentserver.core.threads import new_thread_id
from agentserver.http.a2a.tasks import TERMINAL, state_of, to_task
from agentserver.http.a2a.versions import V03, V10

log = logging.getLogger("agentserver.a2a")

#: Seconds between two looks at the watched tasks.
POLL = 0.5
#: The outbox's backoff for a notification: its first pause, its cap, and how long a
#: notification is tried before it expires.
FIRST_DELAY = 1.0
MAX_DELAY = 300.0
RETRY_FOR = 24 * 3600.0
#: Seconds one POST may take.
POST_TIMEOUT = 10.0
#: Notifications in flight at once, per receiver (the URL's origin).
CONCURRENCY = 4
#: Configs looked at per tick, at most.
BATCH = 64
#: The outbox channels of push notifications: this, then the receiver's origin.
CHANNEL_PREFIX = "a2a-push:"
ID_HEADER = "X-A2A-Notification-Id"


class PushRefused(Exception):
    """A push URL refused (the text says why)."""


def _blocked(address: str) -> bool:
    """Not a public unicast destination (loopback, private, link-local, shared,
    reserved, multicast, unspecified; an IPv4-mapped IPv6 judged as its IPv4)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return (
        not ip.is_global
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


async def check_push_url(url: str, *, allow_private: bool) -> None:
    """Raise :class:`PushRefused` unless ``url`` is http(s) with a host that resolves,
    and (unless ``allow_private``) only to public addresses: the spec's advice against
    SSRF (cloud metadata, internal services). Resolving is bounded by POST_TIMEOUT."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PushRefused("a push URL is http:// or https:// with a host")
    if allow_private:
        return
    try:
        with trio.fail_after(POST_TIMEOUT):
            found = await trio.socket.getaddrinfo(parsed.hostname, parsed.port or 443)
    except (OSError, trio.TooSlowError):
        raise PushRefused(f"the push URL's host {parsed.hostname!r} does not resolve") from None
    if not found or any(_blocked(str(info[4][0])) for info in found):
        raise PushRefused(
            f"the push URL's host {parsed.hostname!r} is loopback or private: refused "
            '(<expose-a2a allow-private-push="true"> allows it)'
        )


#: The key of a stored config's JSON saying which version's shape its notifications take.
PROTOCOL_KEY = "agentserverProtocol"


def stored_config(config: TaskPushNotificationConfig, protocol: str) -> str:
    """``config`` as the store keeps it: its JSON, with the version of the request that
    set it (a 0.3 client is sent 0.3's notification shape)."""
    data = json.loads(MessageToJson(config))
    if protocol != V10:
        data[PROTOCOL_KEY] = protocol
    return json.dumps(data)


def read_config(text: str) -> tuple[TaskPushNotificationConfig, str]:
    """A stored config and the version its notifications speak."""
    data = json.loads(text)
    protocol = str(data.pop(PROTOCOL_KEY, V10))
    return ParseDict(data, TaskPushNotificationConfig()), protocol


def notification_body(task: Task, protocol: str) -> str:
    """A notification's body: 1.0's ``StreamResponse`` holding the task; 0.3's is the
    task itself (``kind: task``), as the 0.3 SDK's sender posts it."""
    if protocol == V03:
        from a2a.compat.v0_3.conversions import to_compat_task

        return to_compat_task(task).model_dump_json(by_alias=True, exclude_none=True)
    return MessageToJson(StreamResponse(task=task), indent=None)


def channel_of(url: str) -> str:
    """The outbox channel of push URL ``url``: one per receiver (scheme, host, port)."""
    parsed = urllib.parse.urlparse(url)
    return f"{CHANNEL_PREFIX}{parsed.scheme}://{parsed.netloc.rpartition('@')[2]}"


def push_item(
    config: TaskPushNotificationConfig, task_id: str, config_id: str, body: str
) -> OutboxItem:
    """One notification of ``task_id`` to ``config``, as an outbox item (its id header is
    added at each attempt: the row's delivery id, the same on every one)."""
    headers = {"content-type": "application/json"}
    if config.token:
        headers["X-A2A-Notification-Token"] = config.token
    if config.HasField("authentication") and config.authentication.credentials:
        auth = config.authentication
        headers["Authorization"] = f"{auth.scheme or 'Bearer'} {auth.credentials}"
    return OutboxItem(
        channel=channel_of(config.url),
        url=config.url,
        body=body.encode(),
        # Unique: the compare-and-set of the owing transaction owes each state once.
        dedupe_key=f"a2a-push:{task_id}:{config_id}:{new_thread_id()}",
        headers=headers,
        order_key=f"a2a-push:{task_id}",
        retry_for_s=RETRY_FOR,
        first_delay_s=FIRST_DELAY,
        max_delay_s=MAX_DELAY,
    )


def push_channels(outbox: Outbox, *, allow_private: bool) -> None:
    """Deliver A2A push notifications from ``outbox``: a channel per receiver, made when
    first met, sending the A2A wire format after the SSRF check."""

    async def check(row: OutboxRow) -> None:
        await check_push_url(row.url, allow_private=allow_private)

    def render(row: OutboxRow, now: float) -> tuple[dict[str, str], bytes]:
        headers = dict(row.headers)
        headers[ID_HEADER] = row.delivery_id
        return headers, row.body

    def make(name: str) -> Channel:
        return Channel(
            name, concurrency=CONCURRENCY, timeout_s=POST_TIMEOUT, render=render, check=check
        )

    outbox.add_family(CHANNEL_PREFIX, make)


class PushNotifier:
    """Watches the tasks that have push configs and owes a notification on the outbox
    for each change (see the module doc), every :data:`POLL` seconds until cancelled."""

    def __init__(self, store: StoreCalls, outbox: Outbox | None = None) -> None:
        self.store = store
        #: Woken when a notification is owed (else its sender finds it within a second).
        self.outbox = outbox

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.tick()
            except Exception as exc:  # the store unreachable a moment: try again
                log.warning("a2a push notifications: %s", exc)
            await trio.sleep(POLL)

    async def tick(self) -> int:
        """One look: owe what changed. Returns how many notifications were owed."""
        owed = 0
        for task_id, config_id, seen in await self.store.read(a2a_push.watched, BATCH):
            try:
                row = await self.store.read(a2a.task, task_id)
            except TurnPruned:
                continue  # ended (its last state was owed before) and pruned since
            if row is None:
                continue
            state, _ = state_of(row)
            name = TaskState.Name(state)
            if name == seen:
                continue
            found = await self._config(task_id, config_id)
            if found is None:
                continue
            config, protocol = found
            body = notification_body(to_task(row, 0), protocol)
            item = push_item(config, task_id, config_id, body)
            if await self.store.run(
                a2a_push.owe, task_id, config_id, seen, name, state in TERMINAL, item
            ):
                owed += 1
        if owed and self.outbox is not None:
            self.outbox.wake()
        return owed

    async def _config(
        self, task_id: str, config_id: str
    ) -> tuple[TaskPushNotificationConfig, str] | None:
        for cid, config_json in await self.store.read(a2a_push.configs, task_id):
            if cid == config_id:
                return read_config(config_json)
        return None
