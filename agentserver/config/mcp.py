"""boot.xml's ``<mcp>`` (an MCP server whose tools become listeners) and ``<expose-mcp>``
(the listeners offered to MCP clients): read into :class:`McpServerSpec`, the server
reached and its tools listed, one :class:`ListenerSpec` per tool (docs/mcp.md).

Loading a boot.xml with ``<mcp>`` starts each stdio server (or calls each URL) once to
list its tools, bounded by the server's ``timeout``; the running server connects again
(:mod:`agentserver.remote.mcp_client`). Problems are reported with their line: neither
or both of ``command`` and ``url``, an unreachable server, a tool named in the
allow-list that the server does not offer, two tools mapped to one listener name.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shlex
from collections.abc import Callable, Mapping

from lxml import etree

from agentserver.config.imports import B, flag
from agentserver.config.problems import Problem, Report
from agentserver.config.topology import ListenerSpec, Topology
from agentserver.core.durations import parse_duration
from agentserver.core.errors import ConfigurationError
from agentserver.core.jsonschema_xsd import convert, xml_name
from agentserver.core.listener import NAME_RE
from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_jsonschema import tool_input
from agentserver.core.xsdpayload import schema_model
from agentserver.http.mcp_expose import ExposedTool
from agentserver.primitives.approval import ApprovalDecision
from agentserver.primitives.core import Boot
from agentserver.primitives.mcp import McpResult, tool_namespace
from agentserver.remote.mcp_client import McpConnectError, discover_blocking
from agentserver.remote.mcp_spec import McpServerSpec, McpToolRef, ToolInfo, tool_listener_name
from agentserver.steps.retry import DEFAULT_RETRIES, StepPolicy

#: ``<mcp timeout>`` when absent (seconds).
DEFAULT_TIMEOUT = 30.0
DEFAULT_CONCURRENCY = 8


class McpReader:
    """Reads the ``<mcp>`` elements of one boot.xml, reporting to ``report``."""

    def __init__(self, report: Report, base_dir: pathlib.Path, environ: Mapping[str, str]) -> None:
        self.report = report
        self.base_dir = base_dir
        self.environ = environ
        self.servers: list[McpServerSpec] = []

    def server(self, el: etree._Element) -> McpServerSpec | None:
        """One ``<mcp>``, its ``*-env`` values read now; None after reporting an error."""
        line = el.sourceline or 0
        name = el.get("name", "")
        command, url = el.get("command"), el.get("url")
        if (command is None) == (url is None):
            self.report.error(
                line, f'<mcp name="{name}"> needs command="..." or url="...", one of them'
            )
            return None
        if url is not None and (el.get("args") or el.get("cwd") or el.find(B + "env") is not None):
            self.report.error(line, f"<mcp name={name!r}>: args, cwd and <env> are for a command")
            return None
        if command is not None and (el.get("token-env") or el.find(B + "header") is not None):
            self.report.error(line, f"<mcp name={name!r}>: token-env and <header> are for a url")
            return None
        env = self.values(el, "env", name)
        headers = self.values(el, "header", name)
        if (var := el.get("token-env")) is not None:
            token = self.environ.get(var)
            if token:
                headers["Authorization"] = f"Bearer {token}"
            else:
                self.report.warn(line, f"<mcp name={name!r}>: ${var} (token-env) is not set")
        allow = tuple(t.get("name", "") for t in el.iterfind(B + "tool")) or None
        try:
            args = tuple(shlex.split(el.get("args", "")))
        except ValueError as exc:
            self.report.error(line, f"<mcp name={name!r}> args: {exc}")
            return None
        cwd = str((self.base_dir / el.get("cwd", ".")).resolve()) if command is not None else None
        return McpServerSpec(
            name=name,
            command=command,
            args=args,
            cwd=cwd,
            env=env,
            url=url,
            headers=headers,
            allow=allow,
            timeout=parse_duration(el.get("timeout", str(DEFAULT_TIMEOUT))),
            connect_timeout=parse_duration(el.get("connect-timeout", str(DEFAULT_TIMEOUT))),
            concurrency=int(el.get("concurrency", DEFAULT_CONCURRENCY)),
            idempotent=flag(el, "idempotent"),
            retries=int(el.get("retries", DEFAULT_RETRIES)),
            line=line,
        )

    def values(self, el: etree._Element, tag: str, server: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for vel in el.iterfind(B + tag):
            key, value, var = vel.get("name", ""), vel.get("value"), vel.get("value-env")
            if (value is None) == (var is None):
                self.report.error(
                    vel.sourceline,
                    f'<mcp name={server!r}> <{tag} name="{key}">: value or value-env, one of them',
                )
            elif var is not None and var not in self.environ:
                self.report.warn(
                    vel.sourceline, f"<mcp name={server!r}> <{tag} name={key!r}>: ${var} is not set"
                )
            elif value is not None:
                out[key] = value
            elif var is not None:  # one of the two, checked above
                out[key] = self.environ[var]
        return out

    def read(self, el: etree._Element) -> list[ListenerSpec]:
        """The tool listeners of one ``<mcp>`` (none after reporting a problem)."""
        spec = self.server(el)
        if spec is None:
            return []
        try:
            tools = discover_blocking(spec)
        except McpConnectError as exc:
            self.report.error(spec.line, f"<mcp name={spec.name!r}> ({spec.where}): {exc}")
            return []
        if spec.allow is not None:
            offered = {t.name for t in tools}
            for missing in (n for n in spec.allow if n not in offered):
                self.report.error(
                    spec.line,
                    f"<mcp name={spec.name!r}>: <tool name={missing!r}/> is not among the tools "
                    f"it offers ({', '.join(sorted(offered)) or 'none'})",
                )
            tools = tuple(t for t in tools if t.name in spec.allow)
        spec = _with_tools(spec, tools)
        self.servers.append(spec)
        listeners: list[ListenerSpec] = []
        taken: dict[str, str] = {}
        namespace = tool_namespace(spec.name)
        for tool in tools:
            name = tool_listener_name(spec.name, tool.name)
            if name in taken:
                self.report.error(
                    spec.line,
                    f"<mcp name={spec.name!r}>: tools {taken[name]!r} and {tool.name!r} both map "
                    f"to the listener name {name!r} (leave one out with <tool name=.../>)",
                )
                continue
            taken[name] = tool.name
            if not NAME_RE.match(name):
                self.report.error(
                    spec.line,
                    f"<mcp name={spec.name!r}>: tool {tool.name!r}: bad listener name {name!r}",
                )
                continue
            local = xml_name(tool.name)
            shape = convert(tool.input_schema, namespace, local, tool.description)
            try:
                model = schema_model(
                    shape.schema_doc, f"{{{namespace}}}{local}", f"mcp:{spec.name}/{tool.name}"
                )
                PayloadType.from_model(model)
            except ConfigurationError as exc:
                self.report.error(spec.line, f"<mcp name={spec.name!r}> tool {tool.name!r}: {exc}")
                continue
            listeners.append(
                ListenerSpec(
                    name=name,
                    handler_ref=f"mcp:{spec.name}/{tool.name}",
                    accepts=(model,),
                    responds=(McpResult,),
                    concurrency=spec.concurrency,
                    timeout=call_budget(spec),
                    raw=True,
                    description=tool.description,
                    line=spec.line,
                    mcp_tool=McpToolRef(spec.name, tool.name, shape),
                )
            )
        return listeners


def call_budget(spec: McpServerSpec) -> float:
    """The pump's bound on one call of ``spec``'s tools: the timeout, or with
    ``idempotent`` every attempt and backoff plus a second (as a remote listener's)."""
    if not spec.idempotent:
        return spec.timeout
    return StepPolicy(spec.timeout, True, spec.retries).budget() + 1.0


def _with_tools(spec: McpServerSpec, tools: tuple[ToolInfo, ...]) -> McpServerSpec:
    return dataclasses.replace(spec, tools=tools)


def check_exposed(
    report: Report,
    el: etree._Element | None,
    names: set[str],
    cause_of: Callable[[str], Problem | None] = lambda name: None,
) -> tuple[str, ...]:
    """``<expose-mcp listeners="...">``: the names, each a declared listener.
    ``cause_of(name)``: the error that made a declared listener fail (naming it is said
    under that error, not as one of its own)."""
    if el is None:
        return ()
    exposed = tuple(dict.fromkeys(el.get("listeners", "").split()))
    for name in exposed:
        if name in names:
            continue
        if (cause := cause_of(name)) is not None:
            report.note(
                cause, f"(so <expose-mcp>, line {el.sourceline}, lacks its listener {name!r})"
            )
        else:
            report.error(el.sourceline, f"<expose-mcp>: unknown listener {name!r}")
    return tuple(n for n in exposed if n in names)


def mapping_lines(listeners: tuple[ListenerSpec, ...]) -> list[str]:
    """What ``check`` prints about the MCP tools: one line per tool listener, naming the
    arguments carried as JSON text (the fallback)."""
    lines = []
    for spec in listeners:
        ref = spec.mcp_tool
        if ref is None:
            continue
        line = f"mcp {ref.server}: tool {ref.tool!r} -> listener {spec.name}"
        if ref.fallbacks:
            line += f" (as JSON text: {', '.join(ref.fallbacks)})"
        lines.append(line)
    return lines


def exposed_tools(topology: Topology) -> list[ExposedTool]:
    """The MCP tools ``<expose-mcp>`` offers: one per payload type each listener takes
    (named as the listener, or ``listener-payload`` when it takes several; approval
    decisions and the boot primitive are not tools)."""
    tools: list[ExposedTool] = []
    for name in topology.expose_mcp:
        spec = topology.listener(name)
        # An agent under a policy takes approval decisions too: they are answers (through
        # input_required, or the approvals API), never a tool.
        models = [
            m
            for m in spec.accepts
            if m not in spec.addressed_only and m is not Boot and m is not ApprovalDecision
        ]
        for model in models:
            ptype = PayloadType.from_model(model)
            tool = name if len(models) == 1 else f"{name}-{ptype.local}"
            what = spec.description or (
                f"Ask the agent {name}." if spec.agent else f"Send <{ptype.local}> to {name}."
            )
            tools.append(
                ExposedTool(
                    name=tool,
                    listener=name,
                    description=what,
                    input=tool_input(ptype),
                    agent=spec.agent,
                )
            )
    return tools
