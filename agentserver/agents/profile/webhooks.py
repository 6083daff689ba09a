"""Webhooks as declared: ``<webhook>`` (globally, or inside an agent listener) and those
made at run time through ``POST /v1/webhooks``, as plain data (pure; docs/webhooks.md).

Event names are dotted: ``task.succeeded``, ``task.failed``, ``task.stopped``,
``task.timed_out``, ``step.started`` / ``step.completed`` / ``step.retrying``,
``state.<status>``, ``approval.requested``, ``webhook.disabled``, and any ``event_type``
another feature publishes on the agents' event bus (``budget.soft``, ``schedule.failed``,
...). A pattern ending in ``.*`` takes every name with that prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentserver.core.durations import DurationError, parse_duration

#: The event names the server itself publishes (others come from features that publish
#: typed events with an ``event_type``).
KNOWN_EVENTS = (
    "task.succeeded",
    "task.failed",
    "task.stopped",
    "task.timed_out",
    "step.started",
    "step.completed",
    "step.retrying",
    "approval.requested",
    "webhook.disabled",
)

DEFAULT_FIRST_DELAY_S = 5.0
DEFAULT_MAX_DELAY_S = 3600.0
DEFAULT_RETRY_FOR_S = 24 * 3600.0
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CONCURRENCY = 4
DEFAULT_DISABLE_AFTER_S = 5 * 24 * 3600.0

_EVENT = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z0-9_-]+)*(\.\*)?$|^\*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class WebhookConfigError(ValueError):
    """A webhook's settings are not valid (the message says which and why)."""


#: A webhook's durations: boot.xml's attribute -> the spec's field (the JSON field of
#: ``POST /v1/webhooks`` is the attribute with ``_`` for ``-``).
DURATIONS = {
    "first-delay": "first_delay_s",
    "max-delay": "max_delay_s",
    "retry-for": "retry_for_s",
    "timeout": "timeout_s",
    "disable-after": "disable_after_s",
}


def webhook_duration(value: object, label: str) -> float:
    """Seconds of a webhook duration: a number of seconds (JSON), or text in boot.xml's
    duration syntax (``90``, ``30s``, ``5m``, ``24h``, ``7d``, ``250ms``: the
    one parser of every duration in boot.xml). ``none`` is no webhook duration
    (each has a bound). Raises :class:`WebhookConfigError` naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise WebhookConfigError(f"{label}: a duration (e.g. 30s, 5m, 24h, 7d) or seconds")
    if not isinstance(value, str):
        seconds = float(value)
    else:
        try:
            seconds = parse_duration(value)
        except DurationError as exc:
            raise WebhookConfigError(f"{label}: {exc}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise WebhookConfigError(f"{label}: {value!r} must be a duration longer than 0")
    return seconds


@dataclass(frozen=True, slots=True)
class WebhookSpec:
    """One webhook: where, which events, how to sign and how long to retry.

    ``secret_env`` names the environment variable holding the signing secret
    (``whsec_`` + base64) of a declared webhook; ``secret`` is the secret itself (read
    from it at load, or generated for one made at run time). ``agent``: only this agent's
    events (None: every agent's)."""

    name: str
    url: str
    events: tuple[str, ...]
    secret: str = ""
    secret_env: str | None = None
    agent: str | None = None
    first_delay_s: float = DEFAULT_FIRST_DELAY_S
    max_delay_s: float = DEFAULT_MAX_DELAY_S
    retry_for_s: float = DEFAULT_RETRY_FOR_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = DEFAULT_CONCURRENCY
    disable_after_s: float = DEFAULT_DISABLE_AFTER_S
    #: Made at run time (durable in the store) rather than declared in boot.xml.
    runtime: bool = False
    line: int = 0

    def wants(self, event_type: str, agent: str | None) -> bool:
        """Whether an event of ``event_type`` about ``agent`` goes to this webhook."""
        if self.agent is not None and agent != self.agent:
            return False
        return any(event_matches(p, event_type) for p in self.events)

    def public(self) -> dict[str, object]:
        """The spec as the API shows it (never the secret)."""
        return {
            "name": self.name,
            "url": self.url,
            "events": list(self.events),
            "agent": self.agent,
            "first_delay": self.first_delay_s,
            "max_delay": self.max_delay_s,
            "retry_for": self.retry_for_s,
            "timeout": self.timeout_s,
            "concurrency": self.concurrency,
            "disable_after": self.disable_after_s,
            "runtime": self.runtime,
        }


def event_matches(pattern: str, event_type: str) -> bool:
    """``pattern`` (a name, ``prefix.*`` or ``*``) takes ``event_type``."""
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return event_type.startswith(pattern[:-1])
    return pattern == event_type


def check_spec(spec: WebhookSpec) -> WebhookSpec:
    """``spec`` if valid, else :class:`WebhookConfigError` naming what is wrong."""
    if not _NAME.match(spec.name):
        raise WebhookConfigError(
            f"webhook name {spec.name!r}: letters, digits, '_', '.', '-' (at most 64)"
        )
    if not spec.url.startswith(("http://", "https://")):
        raise WebhookConfigError(f"webhook {spec.name!r}: url must be http:// or https://")
    if not spec.events:
        raise WebhookConfigError(f"webhook {spec.name!r}: no events")
    for pattern in spec.events:
        if not _EVENT.match(pattern):
            raise WebhookConfigError(f"webhook {spec.name!r}: bad event name {pattern!r}")
    if not spec.secret:
        raise WebhookConfigError(f"webhook {spec.name!r}: no signing secret")
    for label, value in (
        ("first-delay", spec.first_delay_s),
        ("max-delay", spec.max_delay_s),
        ("retry-for", spec.retry_for_s),
        ("timeout", spec.timeout_s),
        ("disable-after", spec.disable_after_s),
    ):
        if not value > 0:
            raise WebhookConfigError(f"webhook {spec.name!r}: {label} must be > 0")
    if spec.max_delay_s < spec.first_delay_s:
        raise WebhookConfigError(f"webhook {spec.name!r}: max-delay is below first-delay")
    if spec.concurrency < 1:
        raise WebhookConfigError(f"webhook {spec.name!r}: concurrency must be >= 1")
    return spec
