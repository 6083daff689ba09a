"""Which A2A version a JSON-RPC request speaks (docs/a2a.md, "Versions"): 1.0's method
names (``SendMessage``, ...) with ``A2A-Version: 1.x``, 0.3's (``message/send``, ...)
with ``A2A-Version: 0.3`` or no header at all (the spec: a request without it is 0.3).
Both are served on the same tasks by the SDK's dispatcher and its 0.3 adapter; what
does not fit is refused here, before them, with VersionNotSupported naming the method
that would fit (the SDK's adapter would answer a 0.3 name under ``1.0`` with an
InternalError, 0.3 having no VersionNotSupported code). Sans I/O; imports nothing of the
SDK, so the HTTP API loads without the ``a2a`` extra."""

from __future__ import annotations

#: The JSON-RPC code of VersionNotSupported (A2A 1.0).
VERSION_NOT_SUPPORTED = -32009
#: The header, and the version a request without it speaks.
HEADER = "A2A-Version"
V03 = "0.3"
V10 = "1.0"
#: 0.3's method names and 1.0's for the same method.
V03_METHODS = {
    "message/send": "SendMessage",
    "message/stream": "SendStreamingMessage",
    "tasks/get": "GetTask",
    "tasks/cancel": "CancelTask",
    "tasks/resubscribe": "SubscribeToTask",
    "tasks/pushNotificationConfig/set": "CreateTaskPushNotificationConfig",
    "tasks/pushNotificationConfig/get": "GetTaskPushNotificationConfig",
    "tasks/pushNotificationConfig/list": "ListTaskPushNotificationConfigs",
    "tasks/pushNotificationConfig/delete": "DeleteTaskPushNotificationConfig",
    "agent/getAuthenticatedExtendedCard": "GetExtendedAgentCard",
}
_V10_METHODS = {v: k for k, v in V03_METHODS.items()} | {"ListTasks": ""}


def protocol_of(method: object) -> str:
    """``0.3`` for a 0.3 method name, else ``1.0``."""
    return V03 if method in V03_METHODS else V10


def _major(version: str) -> int | None:
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def refusal(method: object, header: str | None) -> str | None:
    """Why a request calling ``method`` with ``A2A-Version`` ``header`` (None: absent) is
    refused, naming what fits; None when the SDK's dispatcher is to answer it (a method
    and version that fit; an unknown method; a 1.0 method under another version, which
    the SDK refuses with its own VersionNotSupported)."""
    if not isinstance(method, str):
        return None
    given = (header or "").strip()
    if method in V03_METHODS and given and _major(given) != 0:
        return (
            f"{method} is the A2A 0.3 name; under A2A-Version {given!r} call "
            f"{V03_METHODS[method]} (or send A2A-Version 0.3, or no A2A-Version, for 0.3)"
        )
    if method in _V10_METHODS and (not given or _major(given) == 0):
        old = _V10_METHODS[method]
        named = f"0.3 calls it {old}" if old else "0.3 has no such method"
        return (
            f"{method} is an A2A 1.0 method: send the header A2A-Version: 1.0 (a request "
            f"without A2A-Version is taken as 0.3, as the spec says; {named})"
        )
    return None
