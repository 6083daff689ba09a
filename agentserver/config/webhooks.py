"""``<webhooks>`` and the agent listeners' ``<webhook>`` elements read into
:class:`~agentserver.agents.profile.webhooks.WebhookSpec` (docs/webhooks.md): names
unique, the secret read from ``secret-env`` and checked, the settings checked."""

from __future__ import annotations

from collections.abc import Mapping

from lxml import etree

from agentserver.agents.edge.hooksign import SecretError, secret_bytes
from agentserver.agents.profile.webhooks import (
    DURATIONS,
    WebhookConfigError,
    WebhookSpec,
    check_spec,
    webhook_duration,
)
from agentserver.config.imports import B, flag
from agentserver.config.problems import Report


def read_webhooks(
    report: Report, root: etree._Element, environ: Mapping[str, str]
) -> tuple[WebhookSpec, ...]:
    """Every declared webhook: those of ``<webhooks>`` (every agent's events) and those
    inside agent listeners (that agent's); problems reported by line."""
    found: list[tuple[etree._Element, str | None]] = []
    section = root.find(B + "webhooks")
    if section is not None:
        found.extend((el, None) for el in section.iterfind(B + "webhook"))
    listeners = root.find(B + "listeners")
    if listeners is not None:
        for listener in listeners.iterfind(B + "listener"):
            for el in listener.iterfind(B + "webhook"):
                if not flag(listener, "agent"):
                    report.error(
                        el.sourceline,
                        f'listener {listener.get("name")!r}: <webhook> needs agent="true" '
                        "(or put it in <webhooks> for every agent)",
                    )
                    continue
                found.append((el, listener.get("name")))
    specs: list[WebhookSpec] = []
    names: set[str] = set()
    for el, agent in found:
        spec = _read(report, el, agent, environ)
        if spec is None:
            continue
        if spec.name in names:
            report.error(el.sourceline, f"webhook {spec.name!r} is declared twice")
            continue
        names.add(spec.name)
        specs.append(spec)
    return tuple(specs)


def _read(
    report: Report, el: etree._Element, agent: str | None, environ: Mapping[str, str]
) -> WebhookSpec | None:
    name = el.get("name", "")
    line = el.sourceline or 0
    env = el.get("secret-env", "")
    secret = environ.get(env, "")
    if not secret:
        report.error(line, f"webhook {name!r}: environment variable {env} (secret-env) is not set")
        return None
    try:
        secret_bytes(secret)
    except SecretError as exc:
        report.error(line, f"webhook {name!r}: {env}: {exc}")
        return None
    kw: dict[str, float | int] = {}
    try:
        for attr, field in DURATIONS.items():
            if (value := el.get(attr)) is not None:
                kw[field] = webhook_duration(value, f"webhook {name!r}: {attr}")
        if (value := el.get("concurrency")) is not None:
            kw["concurrency"] = int(value)
        return check_spec(
            WebhookSpec(
                name=name,
                url=el.get("url", ""),
                events=tuple(dict.fromkeys(el.get("events", "").split())),
                secret=secret,
                secret_env=env,
                agent=agent,
                line=line,
                **kw,  # type: ignore[arg-type]
            )
        )
    except WebhookConfigError as exc:
        report.error(line, str(exc))
        return None
