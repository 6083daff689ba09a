"""RFC 9457 problem details (``application/problem+json``) for every HTTP error.

A refused message gets the socket's canned text as its ``title`` (the ``<huh>`` or
``<SystemError>`` text, docs/wire.md), never validator output: an unknown listener, a
payload failing its XSD and a listener the client may not address read the same, so the
API cannot be used to probe the topology either.
"""

from __future__ import annotations

import json
from typing import Any

from lxml import etree
from starlette.responses import Response

from agentserver.core.envelope import MESSAGE
from agentserver.core.errors import (
    DeliveryRefused,
    HuhReason,
    InputRefused,
    Refusal,
    SystemErrorCode,
)
from agentserver.core.namespaces import CORE_NS

PROBLEM_TYPE = "https://xml-pipeline.org/problems/"
MEDIA_TYPE = "application/problem+json"
_CORE_BYTES = CORE_NS.encode("ascii")
_HUH = f"{{{CORE_NS}}}huh"
_SYSTEM_ERROR = f"{{{CORE_NS}}}SystemError"

#: HTTP status of each canned ``<huh>``.
HUH_STATUS = {
    HuhReason.MALFORMED: 400,
    HuhReason.TOO_LARGE: 413,
    HuhReason.INVALID_ENVELOPE: 422,
    HuhReason.INVALID_PAYLOAD: 422,
    HuhReason.RESERVED_NAMESPACE: 422,
    HuhReason.HANDLER_FAILED: 502,
    HuhReason.UNAUTHENTICATED: 401,
    HuhReason.INVALID_MULTITASK: 422,
}
#: HTTP status of each ``<SystemError>`` code.
SYSTEM_ERROR_STATUS = {SystemErrorCode.ROUTING: 503, SystemErrorCode.TIMEOUT: 504}
_HUH_BY_TEXT = {r.value: r for r in HuhReason}


def unread(response: Response) -> Response:
    """A response sent before the request's body was read: the connection is closed after
    it (the unread rest of the body cannot be told from a next request)."""
    response.headers["Connection"] = "close"
    return response


def problem(
    status: int, kind: str, title: str, headers: dict[str, str] | None = None, **extra: Any
) -> Response:
    body = {"type": PROBLEM_TYPE + kind, "title": title, "status": status, **extra}
    return Response(json.dumps(body), status, headers=headers, media_type=MEDIA_TYPE)


def pruned_problem(exc: Exception) -> Response:
    """404 ``pruned``: the Turn asked for was removed by the store's retention
    (``agentserver.agents.errors.TurnPruned``); never a partial record."""
    return problem(404, "pruned", "The task was removed by the store's retention.", detail=str(exc))


def huh_problem(reason: HuhReason, **extra: Any) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if reason is HuhReason.UNAUTHENTICATED else None
    kind = "huh/" + reason.name.lower().replace("_", "-")
    return problem(HUH_STATUS[reason], kind, reason.value, headers, **extra)


def system_error_problem(code: SystemErrorCode, retry_allowed: bool, **extra: Any) -> Response:
    headers = {"Retry-After": "1"} if retry_allowed else None
    return problem(
        SYSTEM_ERROR_STATUS[code],
        "system-error/" + code.value,
        code.message,
        headers,
        retry_allowed=retry_allowed,
        **extra,
    )


def refusal_problem(refusal: Refusal, **extra: Any) -> Response:
    if isinstance(refusal, InputRefused):
        return huh_problem(refusal.reason, **extra)
    if isinstance(refusal, DeliveryRefused):
        return system_error_problem(refusal.code, refusal.retry_allowed, **extra)
    raise TypeError(type(refusal).__name__)


def reply_problem(reply: bytes, **extra: Any) -> Response | None:
    """The problem for a reply that is a core ``<huh>`` or ``<SystemError>`` (a refusal
    or a failure, as the socket would have delivered it); None for any other reply."""
    if _CORE_BYTES not in reply:
        return None
    # Our own canonical envelope (the pump built it): no hardened parse needed.
    root = etree.fromstring(reply)
    if root.tag != MESSAGE or len(root) < 2:
        return None
    payload = root[1]
    if payload.tag == _HUH:
        reason = _HUH_BY_TEXT.get((payload.findtext(f"{{{CORE_NS}}}error") or "").strip())
        if reason is not None:
            return huh_problem(reason, **extra)
    elif payload.tag == _SYSTEM_ERROR:
        code = (payload.findtext(f"{{{CORE_NS}}}code") or "").strip()
        retry = (payload.findtext(f"{{{CORE_NS}}}retry-allowed") or "").strip() == "true"
        try:
            return system_error_problem(SystemErrorCode(code), retry, **extra)
        except ValueError:
            return None
    return None
