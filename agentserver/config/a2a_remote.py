"""boot.xml's ``<a2a>`` inside ``<listeners>``: a remote A2A agent whose skills become
listeners (docs/a2a.md, "Remote A2A agents as tools").

The remote's card is fetched once when boot.xml is loaded (``check`` and ``run``),
bounded by ``connect-timeout``; each skill it lists is one listener, ``NAME-SKILL``, whose
payload is the task's text plus optional data fields (JSON text) and whose answer is
:class:`agentserver.primitives.a2a.A2aAnswer`. An unreachable card is an error, or with
``required="false"`` a warning after :data:`CARD_ATTEMPTS` attempts (its skills are then
absent until a restart finds it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Mapping

from lxml import etree

from agentserver.config.imports import B, flag
from agentserver.config.problems import Report
from agentserver.config.topology import ListenerSpec
from agentserver.core.durations import parse_duration
from agentserver.core.errors import ConfigurationError
from agentserver.core.jsonschema_xsd import convert, xml_name
from agentserver.core.listener import NAME_RE
from agentserver.core.payloads import PayloadType
from agentserver.core.xsdpayload import schema_model
from agentserver.primitives.a2a import A2aAnswer, skill_namespace
from agentserver.remote.a2a_client import CANCEL_TIMEOUT, CardError, fetch_card_blocking
from agentserver.remote.a2a_spec import SKILL_INPUT, A2aRemoteSpec, A2aSkillRef
from agentserver.remote.mcp_spec import tool_listener_name
from agentserver.steps.retry import DEFAULT_RETRIES

#: Card fetches tried for a ``required="false"`` remote before it is left out.
CARD_ATTEMPTS = 3
DEFAULT_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 30.0
DEFAULT_CONCURRENCY = 8


class A2aRemoteReader:
    """Reads the ``<a2a>`` elements of one boot.xml, reporting to ``report``."""

    def __init__(self, report: Report, base_dir: pathlib.Path, environ: Mapping[str, str]) -> None:
        self.report = report
        self.base_dir = base_dir
        self.environ = environ
        self.remotes: list[A2aRemoteSpec] = []

    def spec(self, el: etree._Element) -> A2aRemoteSpec:
        line = el.sourceline or 0
        name = el.get("name", "")
        headers: dict[str, str] = {}
        for hel in el.iterfind(B + "header"):
            key, value, var = hel.get("name", ""), hel.get("value"), hel.get("value-env")
            if (value is None) == (var is None):
                self.report.error(
                    hel.sourceline, f"<a2a name={name!r}> <header {key!r}>: value or value-env"
                )
            elif var is not None and var not in self.environ:
                self.report.warn(hel.sourceline, f"<a2a name={name!r}> <header>: ${var} is not set")
            elif value is not None:
                headers[key] = value
            elif var is not None:  # one of the two, checked above
                headers[key] = self.environ[var]
        if (var := el.get("token-env")) is not None:
            token = self.environ.get(var)
            if token:
                headers["Authorization"] = f"Bearer {token}"
            else:
                self.report.warn(line, f"<a2a name={name!r}>: ${var} (token-env) is not set")

        def path(attribute: str) -> str | None:
            value = el.get(attribute)
            return str((self.base_dir / value).resolve()) if value else None

        return A2aRemoteSpec(
            name=name,
            url=el.get("url", "").rstrip("/"),
            headers=headers,
            timeout=parse_duration(el.get("timeout", str(DEFAULT_TIMEOUT))),
            step_timeout=parse_duration(v) if (v := el.get("step-timeout")) is not None else None,
            retries=int(el.get("retries", DEFAULT_RETRIES)),
            connect_timeout=parse_duration(el.get("connect-timeout", str(DEFAULT_CONNECT_TIMEOUT))),
            concurrency=int(el.get("concurrency", DEFAULT_CONCURRENCY)),
            required=el.get("required") is None or flag(el, "required"),
            ca=path("ca"),
            cert=path("cert"),
            key=path("key"),
            line=line,
        )

    def read(self, el: etree._Element) -> list[ListenerSpec]:
        """The skill listeners of one ``<a2a>`` (none after reporting a problem)."""
        spec = self.spec(el)
        attempts = 1 if spec.required else CARD_ATTEMPTS
        card = None
        for attempt in range(attempts):
            try:
                card = fetch_card_blocking(spec)
                break
            except CardError as exc:
                problem = f"<a2a name={spec.name!r}> ({spec.url}): {exc}"
                if attempt + 1 < attempts:
                    time.sleep(0.5 * 2**attempt)  # loading boot.xml: no event loop yet
                elif spec.required:
                    self.report.error(spec.line, problem)
                else:
                    self.report.warn(spec.line, problem + "; its skills are absent")
        if card is None:
            return []
        spec = dataclasses.replace(spec, card=card)
        self.remotes.append(spec)
        namespace = skill_namespace(spec.name)
        listeners: list[ListenerSpec] = []
        for skill in card.get("skills", []):
            skill_id = str(skill.get("id", ""))
            name = tool_listener_name(spec.name, skill_id)
            if not NAME_RE.match(name):
                self.report.error(
                    spec.line,
                    f"<a2a name={spec.name!r}>: skill {skill_id!r}: bad listener name {name!r}",
                )
                continue
            description = (
                str(skill.get("description", "")) or f"The skill {skill_id} of {spec.name}."
            )
            shape = convert(SKILL_INPUT, namespace, xml_name(skill_id), description)
            try:
                model = schema_model(
                    shape.schema_doc,
                    f"{{{namespace}}}{xml_name(skill_id)}",
                    f"a2a:{spec.name}/{skill_id}",
                )
                PayloadType.from_model(model)
            except ConfigurationError as exc:
                self.report.error(spec.line, f"<a2a name={spec.name!r}> skill {skill_id!r}: {exc}")
                continue
            listeners.append(
                ListenerSpec(
                    name=name,
                    handler_ref=f"a2a:{spec.name}/{skill_id}",
                    accepts=(model,),
                    responds=(A2aAnswer,),
                    concurrency=spec.concurrency,
                    # The pump's bound: the call's (every attempt), plus the remote cancel's.
                    timeout=spec.timeout + CANCEL_TIMEOUT,
                    # A call a restart interrupted is sent again: it finds the remote task
                    # its first send started (the same message id) and follows it.
                    idempotent=True,
                    retries=spec.retries,
                    raw=True,
                    description=description,
                    line=spec.line,
                    a2a_skill=A2aSkillRef(spec.name, skill_id, shape),
                )
            )
        return listeners


def a2a_mapping_lines(listeners: tuple[ListenerSpec, ...]) -> list[str]:
    """What ``check`` prints about the remote A2A skills: one line per skill listener."""
    return [
        f"a2a {spec.a2a_skill.remote}: skill {spec.a2a_skill.skill!r} -> listener {spec.name}"
        for spec in listeners
        if spec.a2a_skill is not None
    ]
