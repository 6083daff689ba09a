"""The chaos bench's webhooks (issue 36; docs/webhooks.md): a receiver on loopback that
fails and hangs at random, and the check that every Turn's end produced its webhook
event at least once, each with a stable id and a valid signature.

The receiver (:class:`HookReceiver`, an h11 server in the bench's trio run) answers each
delivery, while the faults are on, with a 500 (15 %), by hanging past the webhook's
timeout (10 %) or by closing the connection unanswered (5 %); else (and always once the
faults stop) with 204. It records every request: its ``webhook-id``, whether the
signature verifies (the maintained ``standardwebhooks`` package when installed, else our
own signer), the payload's type and Turn, and what it answered.

:func:`check_hooks` compares that with the store's Turn ends (the deliverable cards,
read by :func:`ended_turns`): each ended Turn has a delivery answered 2xx whose type is
``task.<its status>``; all requests about one Turn carry one id, and one id is about one
Turn; no request lacks its id or carries a bad signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio

#: The webhook's attempt timeout in the generated boot.xml; a hang outlasts it.
HOOK_TIMEOUT = 2.0
SECRET_ENV = "CHAOS_HOOK_SECRET"


def new_secret(seed: int) -> str:
    raw = hashlib.sha256(f"{seed}:hook-secret".encode()).digest()
    return "whsec_" + base64.b64encode(raw).decode()


def webhooks_xml(url: str) -> str:
    """The ``<webhooks>`` element of the chaos boot.xml (fixed values, the URL ours)."""
    return (
        f'  <webhooks>\n    <webhook name="chaos" url="{url}" events="task.*" '
        f'secret-env="{SECRET_ENV}" first-delay="0.5" max-delay="4" '
        f'timeout="{HOOK_TIMEOUT:g}" concurrency="4"/>\n  </webhooks>\n'
    )


def verifier(secret: str) -> Callable[[bytes, dict[str, str]], bool]:
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError:  # the dev extra absent: the same HMAC, by hand
        key = base64.b64decode(secret.removeprefix("whsec_"))

        def ours(body: bytes, headers: dict[str, str]) -> bool:
            signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
            want = "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
            return want in headers.get("webhook-signature", "").split()

        return ours
    hook = Webhook(secret)

    def theirs(body: bytes, headers: dict[str, str]) -> bool:
        try:
            hook.verify(body, headers)
        except Exception:
            return False
        return True

    return theirs


@dataclass
class Seen:
    id: str
    turn: str
    type: str
    signed: bool
    answered: int  # 0: hung or closed


@dataclass
class HookReceiver:
    seed: int
    secret: str
    faults: bool = True
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:hooks")
        self.verify = verifier(self.secret)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def start(self, nursery: trio.Nursery) -> HookReceiver:
        listeners = await nursery.start(partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]
        return self

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read(stream, conn)
                if request is None:
                    return
                headers = {k.decode().lower(): v.decode() for k, v in request.headers}
                fate = self._fate()
                self._record(headers, body, 204 if fate == "ok" else (500 if fate == "500" else 0))
                if fate == "hang":
                    await trio.sleep(HOOK_TIMEOUT + 3)
                    return
                if fate == "close":
                    return
                status = 204 if fate == "ok" else 500
                out = conn.send(h11.Response(status_code=status, headers=[("content-length", "0")]))
                out += conn.send(h11.EndOfMessage())
                await stream.send_all(out)
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    async def _read(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and request is None:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    def _fate(self) -> str:
        if not self.faults:
            return "ok"
        r = self.rng.random()
        if r < 0.15:
            return "500"
        if r < 0.25:
            return "hang"
        if r < 0.30:
            return "close"
        return "ok"

    def _record(self, headers: dict[str, str], body: bytes, answered: int) -> None:
        msg_id = headers.get("webhook-id", "")
        turn = kind = ""
        try:
            payload = json.loads(body)
            turn = str(payload.get("data", {}).get("turn", ""))
            kind = str(payload.get("type", ""))
        except (ValueError, AttributeError):
            pass
        signed = bool(msg_id) and self.verify(body, headers)
        self.seen.append(Seen(msg_id, turn, kind, signed, answered))

    def delivered_turns(self) -> set[str]:
        return {s.turn for s in self.seen if 200 <= s.answered < 300}


def _ended_blocking(sqlite_path: Any, pg_url: str | None) -> dict[str, str]:
    query = "SELECT agent_turn_id, metadata FROM cards WHERE card_type = 'task.deliverable'"
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url, connect_timeout=10) as conn:
            rows = conn.execute(query).fetchall()
    else:
        if sqlite_path is None or not sqlite_path.exists():
            return {}
        conn = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = conn.execute(query).fetchall()
        finally:
            conn.close()
    return {str(t): str(json.loads(m or "{}").get("status", "")) for t, m in rows}


async def ended_turns(sqlite_path: Any, pg_url: str | None) -> dict[str, str]:
    """Turn → status of every Turn that ended (its deliverable card), from the store."""
    return await trio.to_thread.run_sync(_ended_blocking, sqlite_path, pg_url)


async def await_hooks(receiver: HookReceiver, ended: Callable[[], Any], within: float) -> None:
    """Wait (up to ``within`` s) until every ended Turn's event was delivered."""
    with trio.move_on_after(within):
        while True:
            turns = await ended()
            if set(turns) <= receiver.delivered_turns():
                return
            await trio.sleep(1.0)


def check_hooks(
    receiver: HookReceiver, ended: dict[str, str], max_listed: int = 20
) -> tuple[dict[str, object], list[str]]:
    """The webhook promises over what ``receiver`` saw and the Turns that ``ended``."""
    violations: list[str] = []
    ids_of: dict[str, set[str]] = {}
    turns_of: dict[str, set[str]] = {}
    no_id = bad_sig = 0
    for s in receiver.seen:
        if not s.id:
            no_id += 1
            continue
        if not s.signed:
            bad_sig += 1
        ids_of.setdefault(s.turn, set()).add(s.id)
        turns_of.setdefault(s.id, set()).add(s.turn)
    delivered: dict[str, set[str]] = {}
    for s in receiver.seen:
        if 200 <= s.answered < 300:
            delivered.setdefault(s.turn, set()).add(s.type)
    missing = wrong_type = 0
    for turn, status in ended.items():
        if turn not in delivered:
            missing += 1
            violations.append(f"webhook: no delivery of the end of Turn {turn} ({status})")
        elif f"task.{status}" not in delivered[turn]:
            wrong_type += 1
            violations.append(f"webhook: Turn {turn} ended {status}, delivered {delivered[turn]}")
    unstable = sum(1 for ids in ids_of.values() if len(ids) > 1)
    shared = sum(1 for turns in turns_of.values() if len(turns) > 1)
    if unstable:
        violations.append(f"webhook: {unstable} Turn(s) delivered under more than one id")
    if shared:
        violations.append(f"webhook: {shared} id(s) carried by more than one Turn")
    if no_id:
        violations.append(f"webhook: {no_id} request(s) without a webhook-id")
    if bad_sig:
        violations.append(f"webhook: {bad_sig} request(s) with a bad signature")
    counts: dict[str, object] = {
        "hook_turns_ended": len(ended),
        "hook_requests": len(receiver.seen),
        "hook_failed_attempts": sum(1 for s in receiver.seen if not 200 <= s.answered < 300),
        "hook_delivered_turns": len(delivered),
        "hook_missing": missing,
        "hook_wrong_type": wrong_type,
        "hook_unstable_ids": unstable,
        "hook_shared_ids": shared,
        "hook_without_id": no_id,
        "hook_bad_signature": bad_sig,
    }
    return counts, violations[:max_listed]
