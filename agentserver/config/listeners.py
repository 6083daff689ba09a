"""boot.xml's ``<listeners>``: each ``<listener>`` read into a :class:`ListenerSpec` with
every reference resolved (handler, payload types, schema files relative to boot.xml's
folder, built-in names), and the listeners checked as a whole (unique names, shared root
tags, peers, the boot listener, console wiring)."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.config import agent_settings_from_element
from agentserver.config.a2a_remote import A2aRemoteReader
from agentserver.config.builtins import BUILTIN_HANDLERS, BUILTIN_PAYLOADS, Tuning
from agentserver.config.governance import read_governance
from agentserver.config.imports import B, Resolver, Unresolved, flag, resolve_import
from agentserver.config.mcp import McpReader
from agentserver.config.problems import Problem, Report, pretty
from agentserver.config.topology import ListenerSpec
from agentserver.config.versions import definition
from agentserver.core.durations import parse_duration
from agentserver.core.errors import ConfigurationError
from agentserver.core.listener import RESERVED_NAMES, Listener
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import PayloadType
from agentserver.core.xsdgen import model_root_tag, split_tag
from agentserver.core.xsdpayload import read_schema, schema_model
from agentserver.primitives.approval import ApprovalAck, ApprovalDecision
from agentserver.primitives.core import Boot

IMPLICIT_BOOT_NAME = "system-boot"


class SpecTuning(Tuning, total=False):
    """A built-in's :class:`Tuning` with what boot.xml sets over it, as keywords of
    :class:`ListenerSpec` (left out: the spec's default)."""

    remote: bool
    idempotent: bool
    step_timeout: float
    retries: int


def builtin_models(refs: tuple[str, ...]) -> tuple[type[BaseXmlModel], ...]:
    """A built-in's payload types (references this package ships: they resolve)."""
    return tuple(resolve_import(ref) for ref in refs)


async def _placeholder(payload: object, meta: object) -> None:
    """Stands in for a handler while the pump's listener checks run."""
    return None


class ListenerReader:
    """Reads the listeners of one boot.xml, reporting to ``report``. ``base_dir`` is
    boot.xml's folder (absolute): schema files are relative to it."""

    def __init__(
        self,
        report: Report,
        resolver: Resolver,
        base_dir: pathlib.Path,
        mcp: McpReader | None = None,
        a2a: A2aRemoteReader | None = None,
    ) -> None:
        self.report = report
        #: Reads the ``<mcp>`` elements into tool listeners (None: they are refused).
        self.mcp = mcp
        #: Reads the ``<a2a>`` elements into skill listeners (None: they are refused).
        self.a2a = a2a
        self.resolver = resolver
        self.base_dir = base_dir
        #: Listeners declared but broken (already reported): naming one as a peer, in
        #: may-address or serves is not a second error.
        self.broken: set[str] = set()
        #: The error that made a declared listener fail (by its name), or an ``<a2a>`` or
        #: ``<mcp>`` give none of its listeners (by their names' prefix ``NAME-``): what
        #: names one of them is a knock-on effect, said under that error (:meth:`cause_of`).
        self.causes: dict[str, Problem] = {}
        self.group_causes: dict[str, Problem] = {}
        #: The error of each module that failed to import (its later references are
        #: knock-on effects of it).
        self.module_causes: dict[str, Problem] = {}
        #: Payload schema files read so far, and the type of each (file, root) pair.
        self.schema_docs: dict[str, etree._Element | ConfigurationError] = {}
        self.schema_models: dict[tuple[str, str], type[BaseXmlModel]] = {}

    def error(self, line: int | None, message: str) -> None:
        self.report.error(line, message)

    def warn(self, line: int | None, message: str) -> None:
        self.report.warn(line, message)

    def unresolved(self, line: int | None, listener: str, exc: Unresolved) -> None:
        if str(exc):
            problem = self.report.error(line, f"listener {listener!r}: {exc}")
            if exc.module is not None:
                self.module_causes.setdefault(exc.module, problem)
            return
        # Empty: the same module's import failure, reported for an earlier listener. This
        # listener fails with it: a knock-on effect said under that error, and what names
        # this listener (a peer, a budget, <expose-a2a>) under it too.
        cause = self.module_causes.get(exc.module or "")
        if cause is not None and listener not in self.causes:
            self.report.note(cause, f"(so listener {listener!r}, line {line}, fails too)")
            self.causes[listener] = cause
            self.broken.add(listener)

    def read(self, el: etree._Element) -> list[ListenerSpec]:
        """The listeners of ``<listeners>`` that have no error (plus the implicit boot
        listener when none takes the boot primitive), checked as a whole."""
        specs: list[ListenerSpec] = []
        first_line: dict[str, int] = {}
        read: list[ListenerSpec | None] = []
        for lel in el.iterchildren(B + "listener", B + "mcp", B + "a2a"):
            before = len(self.report.problems)
            name = lel.get("name", "")
            if lel.tag == B + "listener":
                spec = self.listener(lel)
                read.append(spec)
                if spec is None and (cause := self.report.first_error_since(before)):
                    self.causes.setdefault(name, cause)
                    self.broken.add(name)  # a client naming it: no second error either
                continue
            if lel.tag == B + "a2a":
                if self.a2a is not None:
                    group = self.a2a.read(lel)
                else:
                    group = []
                    self.error(lel.sourceline, "<a2a> is not read here")
            elif self.mcp is not None:
                group = self.mcp.read(lel)
            else:
                group = []
                self.error(lel.sourceline, "<mcp> is not read here")
            read.extend(group)
            if not group and (cause := self.report.first_error_since(before)):
                self.group_causes.setdefault(f"{name}-", cause)
        for spec in read:
            if spec is None:
                continue
            if spec.name in first_line:
                what = f"listener name {spec.name!r}"
                if spec.mcp_tool is not None:
                    what = (
                        f"MCP server {spec.mcp_tool.server!r}: tool {spec.mcp_tool.tool!r} maps "
                        f"to the listener name {spec.name!r}, which"
                    )
                self.error(spec.line, f"{what} is already used on line {first_line[spec.name]}")
                self.broken.add(spec.name)
                continue
            first_line[spec.name] = spec.line
            specs.append(spec)
        if not any(s.is_boot for s in specs):
            if IMPLICIT_BOOT_NAME in first_line:
                self.error(
                    first_line[IMPLICIT_BOOT_NAME],
                    f"no listener takes the boot primitive and {IMPLICIT_BOOT_NAME!r} is taken: "
                    'declare one with handler="system-boot"',
                )
            else:
                consoles = tuple(s.name for s in specs if s.builtin == "console")
                specs.append(self.implicit_boot(consoles))
        specs = claim_decisions(specs)
        self.check_topology(specs)
        return specs

    def implicit_boot(self, consoles: tuple[str, ...]) -> ListenerSpec:
        builtin = BUILTIN_HANDLERS["system-boot"]
        return ListenerSpec(
            name=IMPLICIT_BOOT_NAME,
            handler_ref="system-boot",
            accepts=builtin_models(builtin.accepts),
            peers=consoles,
            builtin="system-boot",
            concurrency=1,
            description="system boot listener (implicit)",
        )

    def listener(self, el: etree._Element) -> ListenerSpec | None:
        line = el.sourceline or 0
        name = el.get("name", "")
        ok = True
        if name in RESERVED_NAMES:
            self.error(line, f"listener name {name!r} is reserved")
            ok = False
        ref = el.get("handler", "")
        builtin_name: str | None = None
        handler = None
        defaults = Tuning()
        accepts: list[type[BaseXmlModel]] = []
        responds: list[type[BaseXmlModel]] = []
        remote = flag(el, "remote")
        if remote:
            if ref:
                self.error(line, f"listener {name!r}: a remote listener has no handler")
                ok = False
        elif not ref:
            self.error(line, f'listener {name!r} needs a handler (or remote="true")')
            return None
        if remote:
            pass
        elif ":" in ref:
            try:
                handler = self.resolver.resolve(ref)
                if not callable(handler):
                    raise Unresolved(f"handler {ref!r} is not callable")
                if not (
                    inspect.iscoroutinefunction(handler)
                    or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004
                ):
                    raise Unresolved(f"handler {ref!r} is not an async function")
            except Unresolved as exc:
                self.unresolved(line, name, exc)
                ok = False
        elif ref in BUILTIN_HANDLERS:
            builtin = BUILTIN_HANDLERS[ref]
            builtin_name = ref
            defaults = builtin.defaults
        else:
            self.error(
                line,
                f"listener {name!r}: unknown built-in handler {ref!r} (built-ins: "
                f"{', '.join(sorted(BUILTIN_HANDLERS))}; or use module:function)",
            )
            ok = False
        for tag, target in (("accepts", accepts), ("responds", responds)):
            for tel in el.iterfind(B + tag):
                model = self.payload_model(tel, name)
                if model is None:
                    ok = False
                elif model not in target:
                    target.append(model)
        governance = read_governance(self.report, el, name, flag(el, "agent"))
        if governance is None:
            ok = False
        if builtin_name is not None:
            if not accepts:
                accepts.extend(builtin_models(builtin.accepts))
            responds.extend(m for m in builtin_models(builtin.responds) if m not in responds)
        elif ok and not accepts:
            self.error(line, f"listener {name!r} accepts no payload type (add <accepts type=.../>)")
            ok = False
        policy = governance[0] if governance else None
        addressed_only: tuple[type[BaseXmlModel], ...] = ()
        if policy is not None and any(r.approver for r in policy.rules):
            # The approvers' decisions are addressed to the agent, which acknowledges them.
            # Every governed agent takes them by name, so any number of them share an
            # organism; claim_decisions gives the root tag to one of them.
            if ApprovalDecision not in accepts:
                accepts.append(ApprovalDecision)
                addressed_only = (ApprovalDecision,)
            if ApprovalAck not in responds:
                responds.append(ApprovalAck)
        for model in accepts:
            if model is not Boot and split_tag(model_root_tag(model))[0] == CORE_NS:
                self.error(line, f"listener {name!r}: core primitives cannot be accepted")
                ok = False
        profile_el = el.find(B + "agent")
        agent = flag(el, "agent")
        profile = None
        if profile_el is not None and not agent:
            self.error(
                profile_el.sourceline, f'listener {name!r}: <agent> settings need agent="true"'
            )
            ok = False
        elif agent:
            try:
                profile = agent_settings_from_element(profile_el, name=name)
            except AgentConfigError as exc:
                self.error(profile_el.sourceline if profile_el is not None else line, str(exc))
                ok = False
        if not ok:
            self.broken.add(name)
            return None
        if handler is not None and not agent and not responds and not flag(el, "ends-chains"):
            self.warn(
                line,
                f"listener {name!r} declares no <responds>: an answer from its handler will "
                'be refused (add <responds type="module:Class"/>, or ends-chains="true" if it '
                "never answers its caller)",
            )
        # The built-in's tuning, then what the file sets; ListenerSpec has the defaults.
        tuning = SpecTuning(**defaults)
        if (value := el.get("concurrency")) is not None:
            tuning["concurrency"] = int(value)
        if (value := el.get("timeout")) is not None:
            tuning["timeout"] = parse_duration(value)
        if (value := el.get("queue-size")) is not None:
            tuning["queue_size"] = int(value)
        if el.get("raw") is not None:
            tuning["raw"] = flag(el, "raw")
        for attr in ("step-timeout", "idempotent", "retries"):
            if el.get(attr) is not None and agent:
                self.error(line, f"listener {name!r}: {attr} applies to tool listeners only")
                return None
        if remote:
            tuning["remote"] = True
        if not agent:
            tuning["idempotent"] = flag(el, "idempotent")
            if (value := el.get("step-timeout")) is not None:
                tuning["step_timeout"] = parse_duration(value)
            if (value := el.get("retries")) is not None:
                tuning["retries"] = int(value)
        spec = ListenerSpec(
            name=name,
            handler_ref=ref,
            accepts=tuple(accepts),
            responds=tuple(responds),
            peers=tuple(dict.fromkeys((el.get("peers") or "").split())),
            builtin=builtin_name,
            handler=handler,
            agent=agent,
            broadcast=flag(el, "broadcast"),
            description=(el.findtext(B + "description") or "").strip(),
            agent_profile=profile,
            definition=definition(el) if agent else b"",
            line=line,
            agent_policy=governance[0] if governance else None,
            agent_guardrails=governance[1] if governance else (),
            addressed_only=addressed_only,
            **tuning,
        )
        try:
            # The pump's own checks, so 'check' and 'run' can never disagree.
            Listener(
                spec.name,
                spec.accepts,
                _placeholder,
                peers=spec.peers,
                addressed_only=spec.addressed_only,
            )
        except ConfigurationError as exc:
            self.error(line, str(exc))
            self.broken.add(name)
            return None
        return spec

    def payload_model(self, el: etree._Element, listener: str) -> type[BaseXmlModel] | None:
        ref = el.get("type", "")
        line = el.sourceline
        if el.get("schema") is not None or el.get("root") is not None:
            return self.schema_payload(el, listener)
        if not ref:
            self.error(
                line,
                f'listener {listener!r}: <{etree.QName(el).localname}> needs type="..." or schema="..." root="{{ns}}name"',
            )
            return None
        if ":" in ref:
            try:
                model = self.resolver.resolve(ref)
            except Unresolved as exc:
                self.unresolved(line, listener, exc)
                return None
        elif ref in BUILTIN_PAYLOADS:
            model = resolve_import(BUILTIN_PAYLOADS[ref])
        else:
            self.error(
                line,
                f"listener {listener!r}: unknown payload type {ref!r} (use module:Class or a "
                f"built-in: {', '.join(sorted(BUILTIN_PAYLOADS))})",
            )
            return None
        if not (isinstance(model, type) and issubclass(model, BaseXmlModel)):
            self.error(line, f"listener {listener!r}: {ref!r} is not a pydantic-xml model")
            return None
        try:
            PayloadType.from_model(model)
        except ConfigurationError as exc:
            self.error(line, f"listener {listener!r}: payload type {ref!r}: {exc}")
            return None
        return model

    def schema_payload(self, el: etree._Element, listener: str) -> type[BaseXmlModel] | None:
        """``<accepts schema="file.xsd" root="{ns}name"/>``: a payload type from an XSD
        file (relative to boot.xml's directory), one type per (file, root)."""
        line = el.sourceline
        what = etree.QName(el).localname
        file, root = el.get("schema"), el.get("root")
        if el.get("type") is not None or not file or not root:
            self.error(
                line,
                f'listener {listener!r}: <{what}> takes type="..." or both schema="..." and '
                'root="{ns}name", not a mix',
            )
            return None
        path = (self.base_dir / file).resolve()
        key = (str(path), root)
        if key in self.schema_models:
            return self.schema_models[key]
        try:
            doc = self.schema_docs.get(str(path))
            if doc is None:
                try:
                    doc = self.schema_docs[str(path)] = read_schema(path)
                except ConfigurationError as exc:
                    # Reported once per file, not once per root named in it.
                    self.schema_docs[str(path)] = exc
                    raise
            elif isinstance(doc, ConfigurationError):
                return None
            model = schema_model(doc, root, file)
            if split_tag(root)[0] == CORE_NS:
                raise ConfigurationError("core primitives cannot be declared by a schema file")
            PayloadType.from_model(model)
        except ConfigurationError as exc:
            self.error(line, f"listener {listener!r}: <{what} schema={file!r}>: {exc}")
            return None
        self.schema_models[key] = model
        return model

    def cause_of(self, name: str) -> Problem | None:
        """The error that made the listener ``name`` fail (None: not a declared one that
        failed): naming it is a knock-on effect of that error, not an error of its own."""
        if name in self.causes:
            return self.causes[name]
        return next((c for p, c in self.group_causes.items() if name.startswith(p)), None)

    def check_topology(self, specs: list[ListenerSpec]) -> None:
        names = {s.name for s in specs}
        by_tag: dict[str, list[ListenerSpec]] = {}
        model_of: dict[str, type[BaseXmlModel]] = {}
        for spec in specs:
            for peer in spec.peers:
                if peer in names:
                    continue
                if (cause := self.cause_of(peer)) is not None:
                    self.report.note(
                        cause,
                        f"(so listener {spec.name!r}, line {spec.line}, lacks its peer {peer!r})",
                    )
                elif peer not in self.broken:
                    self.error(spec.line, f"listener {spec.name!r}: unknown peer {peer!r}")
            for model in (*spec.accepts, *spec.responds):
                tag = model_root_tag(model)
                other = model_of.setdefault(tag, model)
                if other is not model:
                    self.error(
                        spec.line,
                        f"listener {spec.name!r}: root tag {pretty(tag)} is declared by "
                        f"both {other.__module__}:{other.__qualname__} and "
                        f"{model.__module__}:{model.__qualname__}",
                    )
            for model in spec.accepts:
                if model not in spec.addressed_only:  # taken by name only: not claimed
                    by_tag.setdefault(model_root_tag(model), []).append(spec)
        for tag, sharing in by_tag.items():
            if len(sharing) > 1 and not all(s.broadcast for s in sharing):
                listed = ", ".join(f"{s.name} (line {s.line})" for s in sharing)
                self.error(
                    sharing[-1].line,
                    f"root tag {pretty(tag)} is accepted by {listed}: several listeners may "
                    'share a root tag only if all of them are broadcast="true"',
                )
        self.check_agent_peers(specs)
        boots = [s for s in specs if s.is_boot]
        if len(boots) > 1:
            self.error(boots[1].line, "more than one listener takes the core boot primitive")
        consoles = {s.name for s in specs if s.builtin == "console"}
        input_tag = model_root_tag(resolve_import(BUILTIN_PAYLOADS["console.input"]))
        accepts_input = {s.name for s in by_tag.get(input_tag, [])}
        for spec in specs:
            if spec.builtin == "console" and not accepts_input & set(spec.peers):
                self.error(
                    spec.line,
                    f"console {spec.name!r} needs a peer that takes console input "
                    "(add the console-router to its peers)",
                )
        for boot in boots:
            if consoles and not consoles & set(boot.peers):
                self.warn(
                    boot.line,
                    f"boot listener {boot.name!r} has no console among its peers: "
                    "'run --console' cannot start one",
                )

    def check_agent_peers(self, specs: list[ListenerSpec]) -> None:
        """Warn about an agent's peer it can never reach: the agent addresses a peer by
        a payload's root tag, and the same mapping as the agent runtime's
        (agentserver.app.agents.build_profiles: its own tags first, the last peer wins a shared
        tag, core primitives never) leaves that peer no tag."""
        by_name = {s.name: s for s in specs}
        for spec in specs:
            if not spec.agent:
                continue
            own = {model_root_tag(m) for m in spec.accepts}
            owner: dict[str, str] = {}
            for peer in spec.peers:
                if peer in by_name:
                    for model in by_name[peer].accepts:
                        owner[model_root_tag(model)] = peer
            reachable = {
                peer
                for tag, peer in owner.items()
                if tag not in own and split_tag(tag)[0] != CORE_NS
            }
            for peer in spec.peers:
                if peer in by_name and peer not in reachable:
                    self.warn(
                        spec.line,
                        f"agent {spec.name!r}: peer {peer!r} accepts nothing the agent could "
                        "send (its root tags are the agent's own, a core primitive, or taken "
                        "by a later peer)",
                    )


def claim_decisions(specs: list[ListenerSpec]) -> list[ListenerSpec]:
    """``specs`` with the root tag of ``<approval-decision>`` claimed by the first governed
    agent, unless a listener claims it already.

    Every governed agent takes decisions by name (``ListenerSpec.addressed_only``): an
    approver addresses the agent the request names. A decision that names no listener
    goes to the claimant, which settles it as the agent it names would: a decision is
    applied by its request id in the one agent store, to the agent that asked."""
    if any(
        ApprovalDecision in s.accepts and ApprovalDecision not in s.addressed_only for s in specs
    ):
        return specs
    for i, spec in enumerate(specs):
        if ApprovalDecision in spec.addressed_only:
            kept = tuple(m for m in spec.addressed_only if m is not ApprovalDecision)
            return [*specs[:i], dataclasses.replace(spec, addressed_only=kept), *specs[i + 1 :]]
    return specs
