"""A2A push notifications (docs/a2a.md, "Push notifications"): a client's URL checked
against SSRF, and :class:`PushNotifier`, which owes a notification each time a watched
task's state changes and delivers what is owed.

Both halves work on the store (:mod:`agentserver.agents.store.sql.a2a_push`), so any
process sharing it notices a change (once: the owed row is written under a compare-and-
set of the last state notified) and delivers (a due row is leased to one process at a
time). A notification is POSTed to the config's URL with its token
(``X-A2A-Notification-Token``), its ``authentication`` as ``Authorization``, and its id
(``X-A2A-Notification-Id``); the body is the SDK's ``StreamResponse`` holding the task.
A failed POST (an error, a non-2xx answer) is tried again after :data:`BACKOFF_FIRST`
seconds doubling up to :data:`BACKOFF_MAX`, :data:`MAX_ATTEMPTS` times in all; the
notification stays owed across restarts until then: at least once.

The delivery half is one small interface, :class:`PushDelivery` (the store's outbox
here); the webhooks' durable HTTP outbox (issue 36) is meant to take its place.
"""

from __future__ import annotations

import ipaddress
import logging
import urllib.parse
from typing import Any, Protocol

import trio
from a2a.types import StreamResponse, TaskPushNotificationConfig, TaskState
from google.protobuf.json_format import MessageToJson, Parse

from agentserver.agents.store.base import A2aStore
from agentserver.core.threads import new_thread_id
from agentserver.http.a2a.tasks import TERMINAL, state_of, to_task

log = logging.getLogger("agentserver.a2a")

#: Seconds between two looks at the watched tasks and the owed notifications.
POLL = 0.5
#: Seconds one process holds a notification it is trying.
LEASE = 30.0
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 300.0
MAX_ATTEMPTS = 12
#: Seconds one POST may take.
POST_TIMEOUT = 10.0
#: Configs looked at and notifications tried per tick, at most.
BATCH = 64


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
    if not found or any(_blocked(info[4][0]) for info in found):
        raise PushRefused(
            f"the push URL's host {parsed.hostname!r} is loopback or private: refused "
            '(<expose-a2a allow-private-push="true"> allows it)'
        )


class PushDelivery(Protocol):
    """Delivers one owed notification, or raises (it is tried again later)."""

    async def __call__(
        self, config: TaskPushNotificationConfig, push_id: str, body: str
    ) -> None: ...


class HttpPushDelivery:
    """POSTs a notification with httpx (which runs under trio), the URL checked again
    first (a name may resolve elsewhere now)."""

    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private
        self._http: Any = None

    async def __call__(self, config: TaskPushNotificationConfig, push_id: str, body: str) -> None:
        import httpx

        await check_push_url(config.url, allow_private=self.allow_private)
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=POST_TIMEOUT, follow_redirects=False)
        headers = {"content-type": "application/json", "X-A2A-Notification-Id": push_id}
        if config.token:
            headers["X-A2A-Notification-Token"] = config.token
        if config.HasField("authentication") and config.authentication.credentials:
            auth = config.authentication
            headers["Authorization"] = f"{auth.scheme or 'Bearer'} {auth.credentials}"
        response = await self._http.post(config.url, content=body.encode(), headers=headers)
        if not 200 <= response.status_code < 300:
            raise PushRefused(f"HTTP {response.status_code}")

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


class PushNotifier:
    """Watches the tasks that have push configs and delivers what is owed (see the
    module doc), every :data:`POLL` seconds until cancelled."""

    def __init__(self, store: A2aStore, delivery: PushDelivery) -> None:
        self.store = store
        self.delivery = delivery

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.tick()
            except Exception as exc:  # the store unreachable a moment: try again
                log.warning("a2a push notifications: %s", exc)
            await trio.sleep(POLL)

    async def tick(self) -> None:
        """One look: owe what changed, try what is due."""
        for task_id, config_id, seen in await self.store.a2a_push_watched(BATCH):
            row = await self.store.a2a_task(task_id)
            if row is None:
                continue
            state, _ = state_of(row)
            name = TaskState.Name(state)
            if name == seen:
                continue
            body = MessageToJson(StreamResponse(task=to_task(row, 0)), indent=None)
            await self.store.a2a_push_owe(
                task_id, config_id, seen, name, state in TERMINAL, new_thread_id(), body
            )
        for due in await self.store.a2a_push_due(LEASE, BATCH):
            config = Parse(due["config"], TaskPushNotificationConfig())
            try:
                await self.delivery(config, due["push_id"], due["body"])
            except Exception as exc:
                attempts = due["attempts"] + 1
                delay = (
                    None
                    if attempts >= MAX_ATTEMPTS
                    else min(BACKOFF_FIRST * 2 ** (attempts - 1), BACKOFF_MAX)
                )
                log.info("a2a push %s to %s failed: %s", due["push_id"], config.url, exc)
                await self.store.a2a_push_failed(due["push_id"], delay, str(exc))
            else:
                await self.store.a2a_push_delivered(due["push_id"])
