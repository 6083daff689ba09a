"""Load and check boot.xml: the one way configuration enters the server.

:func:`load` parses the file with the hardened parser, validates it against
``schemas/boot.xsd`` (which includes the LLM and agent-store grammars), resolves every
reference (handler and payload import paths, built-in names, peers) and checks the
topology as a whole (unique names, no shared root tag without broadcast, one boot
listener, console wiring, client token variables, the ``<llm>`` and ``<store>`` sections).
It never raises for a problem in the file: every problem becomes a :class:`Problem` with
a line number, and the :class:`Topology` is returned only when there is no error.

Pure apart from importing the modules the file names (which is what running it would
do) and reading the environment (only whether token variables are set).
"""

from __future__ import annotations

import importlib
import inspect
import ipaddress
import os
import pathlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.app.builtins import BUILTIN_HANDLERS, BUILTIN_PAYLOADS
from agentserver.config.topology import (
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_PORT,
    ClientSpec,
    HttpSpec,
    Limits,
    ListenerSpec,
    Topology,
)
from agentserver.core.errors import ConfigurationError
from agentserver.core.listener import RESERVED_NAMES, Listener
from agentserver.core.namespaces import BOOT_NS, CORE_NS
from agentserver.core.payloads import PayloadType
from agentserver.core.schemas_export import schema_path
from agentserver.core.xmlsafe import make_parser
from agentserver.core.xsdgen import model_root_tag, split_tag
from agentserver.core.xsdpayload import read_schema, schema_model
from agentserver.net.tls import (
    DEFAULT_MIN_VERSION,
    TlsError,
    TlsSpec,
    normalize_fingerprint,
    parse_subject,
    server_context,
)
from agentserver.primitives.core import Boot

#: boot.xml files are small; refuse anything absurd before parsing it.
MAX_BOOT_BYTES = 4 * 1024 * 1024
IMPLICIT_BOOT_NAME = "system-boot"
_B = f"{{{BOOT_NS}}}"


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding, printed as ``FILE:LINE: message`` (warnings say so)."""

    path: str
    line: int
    message: str
    warning: bool = False

    def __str__(self) -> str:
        kind = "warning: " if self.warning else ""
        return f"{self.path}:{self.line}: {kind}{self.message}"


@dataclass(slots=True)
class LoadResult:
    """The topology (None if any error was found) and every problem, in file order."""

    topology: Topology | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if not p.warning]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.warning]

    @property
    def ok(self) -> bool:
        return self.topology is not None


class BootError(ConfigurationError):
    """boot.xml has errors; ``problems`` lists them all."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


class _Unresolved(Exception):
    """A reference in boot.xml that does not resolve (message is user-facing).

    ``module`` is set when the module itself failed to import: later references to it
    would only repeat that error."""

    def __init__(self, message: str, module: str | None = None) -> None:
        super().__init__(message)
        self.module = module


def boot_schema() -> etree.XMLSchema:
    """``boot.xsd`` compiled (it includes boot-llm.xsd and boot-agents.xsd by path)."""
    return etree.XMLSchema(etree.parse(str(schema_path("boot.xsd"))))


def load(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> LoadResult:
    """Load and check ``path``. Never raises for problems in the file (see module doc)."""
    return _Loader(pathlib.Path(path), os.environ if environ is None else environ).run()


def load_bytes(
    data: bytes, *, name: str = "<boot.xml>", environ: Mapping[str, str] | None = None
) -> LoadResult:
    """Like :func:`load` for a document in memory; problems are reported under ``name``.
    Relative paths in it (e.g. the store's) resolve against the working directory."""
    loader = _Loader(pathlib.Path.cwd() / "boot.xml", os.environ if environ is None else environ)
    loader.shown = name
    loader.data = data
    return loader.run()


def load_or_raise(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Topology:
    """Like :func:`load`, raising :class:`BootError` on any error."""
    result = load(path, environ=environ)
    if result.topology is None:
        raise BootError(result.errors)
    return result.topology


def add_import_dir(directory: pathlib.Path) -> None:
    """Put ``directory`` (boot.xml's) first on the import path, as Python does for a
    script's directory, so a module written next to boot.xml imports with no
    ``PYTHONPATH``. It stays there: a handler may import more of its siblings later."""
    entry = str(directory.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()


def resolve_import(ref: str) -> Any:
    """``package.module:attr.sub`` → the object. Raises ``_Unresolved`` with the reason."""
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise _Unresolved(f"{ref!r} is not module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure of user code at import time is a config error
        raise _Unresolved(f"cannot import module {module_name!r}: {exc}", module_name) from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _Unresolved(f"module {module_name!r} has no {attr_path!r}") from None
    return obj


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost`` (no name resolution)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _pretty(message: str) -> str:
    # Schema messages name elements in Clark notation; the boot namespace is implied.
    return message.replace(_B, "").replace(f"{{{CORE_NS}}}", "core:")


def _bool(el: etree._Element, attr: str, default: bool = False) -> bool:
    value = el.get(attr)
    return default if value is None else value.strip() in ("true", "1")


class _Loader:
    def __init__(self, path: pathlib.Path, environ: Mapping[str, str]) -> None:
        self.path = path
        self.shown = str(path)
        self.environ = environ
        self.problems: list[Problem] = []
        self.data: bytes | None = None
        #: Modules that failed to import, reported once each.
        self.failed_modules: set[str] = set()
        #: Listeners declared but broken (already reported): naming one as a peer or in
        #: may-address is not a second error.
        self.broken: set[str] = set()
        self.remote_names: set[str] = set()
        #: Payload schema files read so far, and the type of each (file, root) pair.
        self.schema_docs: dict[str, etree._Element | ConfigurationError] = {}
        self.schema_models: dict[tuple[str, str], type[BaseXmlModel]] = {}

    def error(self, line: int | None, message: str) -> None:
        self.problems.append(Problem(self.shown, line or 0, message))

    def warn(self, line: int | None, message: str) -> None:
        self.problems.append(Problem(self.shown, line or 0, message, warning=True))

    def result(self, topology: Topology | None) -> LoadResult:
        self.problems.sort(key=lambda p: p.line)
        failed = any(not p.warning for p in self.problems)
        return LoadResult(None if failed else topology, self.problems)

    # -- phases --------------------------------------------------------------------------

    def run(self) -> LoadResult:
        if self.data is None:
            add_import_dir(self.path.parent)
        root = self.parse()
        if root is None:
            return self.result(None)
        schema = boot_schema()
        if not schema.validate(root):
            for entry in schema.error_log:
                self.error(entry.line, _pretty(entry.message))
            return self.result(None)
        return self.result(self.topology(root))

    def parse(self) -> etree._Element | None:
        data = self.data
        if data is None:
            try:
                with self.path.open("rb") as f:
                    data = f.read(MAX_BOOT_BYTES + 1)
            except OSError as exc:
                self.error(0, f"cannot read: {exc.strerror or exc}")
                return None
        if len(data) > MAX_BOOT_BYTES:
            self.error(0, f"larger than {MAX_BOOT_BYTES} bytes")
            return None
        try:
            root = etree.fromstring(data, make_parser(), base_url=self.path.resolve().as_uri())
        except etree.XMLSyntaxError as exc:
            self.error(exc.lineno, f"not well-formed XML: {exc.msg}")
            return None
        docinfo = root.getroottree().docinfo
        if docinfo.doctype or docinfo.internalDTD is not None:
            self.error(1, "a DOCTYPE is not allowed in boot.xml")
            return None
        return root

    def topology(self, root: etree._Element) -> Topology | None:
        organism = root.get("name", "")
        listen = root.find(_B + "listen")
        host = listen.get("host", DEFAULT_HOST) if listen is not None else DEFAULT_HOST
        port = int(listen.get("port", DEFAULT_PORT)) if listen is not None else DEFAULT_PORT
        limits = self.limits(root.find(_B + "limits"))
        listeners = self.listeners(root.find(_B + "listeners"))
        tls_el = root.find(_B + "tls")
        tls = self.tls(tls_el) if tls_el is not None else None
        self.remote_names = {s.name for s in listeners if s.remote}
        clients = self.clients(root.find(_B + "clients"), {s.name for s in listeners})
        served = {name for c in clients for name in c.serves}
        for spec in listeners:
            if spec.remote and spec.name not in served:
                self.warn(
                    spec.line,
                    f"remote listener {spec.name!r}: no client serves it (add "
                    f'serves="{spec.name}" to a <client>); its messages will time out',
                )
        self.check_client_certificates(clients, tls, tls_el)
        self.check_approvers(listeners, clients)
        insecure_plaintext = listen is not None and _bool(listen, "insecure-plaintext")
        if not clients and not is_loopback(host) and listen is not None:
            self.warn(
                listen.sourceline,
                f"no clients are declared, so connections are anonymous: 'run' refuses to "
                f"listen on non-loopback {host} unless started with --insecure",
            )
        elif clients and tls_el is None and not is_loopback(host):
            if insecure_plaintext:
                self.warn(
                    listen.sourceline,
                    f'insecure-plaintext="true": tokens and messages cross the network to '
                    f"{host} in clear (add <tls>)",
                )
            else:
                self.error(
                    listen.sourceline if listen is not None else 0,
                    f"clients are declared but {host} is not loopback and there is no <tls>: "
                    "tokens would cross the network in clear (add <tls>, or "
                    'insecure-plaintext="true" on <listen> to accept that)',
                )
        http = self.http(root.find(_B + "http"), bool(clients))
        llm = root.find(_B + "llm")
        store = root.find(_B + "store")
        if llm is not None:
            self.check_llm(llm)
        if store is not None:
            self.check_store(store)
        description = (root.findtext(_B + "description") or "").strip()
        return Topology(
            path=self.path,
            organism=organism,
            listeners=tuple(listeners),
            host=host,
            port=port,
            limits=limits,
            clients=tuple(clients),
            description=description,
            llm=llm,
            store=store,
            tls=tls,
            insecure_plaintext=insecure_plaintext,
            http=http,
        )

    def http(self, el: etree._Element | None, clients: bool) -> HttpSpec | None:
        """``<http>``; the same address rules as ``<listen>`` (checked again by ``run``)."""
        if el is None:
            return None
        default = HttpSpec()
        spec = HttpSpec(
            host=el.get("host", DEFAULT_HOST),
            port=int(el.get("port", DEFAULT_HTTP_PORT)),
            max_pending=int(el.get("max-pending", default.max_pending)),
            reply_ttl=float(el.get("reply-ttl", default.reply_ttl)),
            max_replies=int(el.get("max-replies", default.max_replies)),
            wait_timeout=float(el.get("wait-timeout", default.wait_timeout)),
            line=el.sourceline or 0,
        )
        if not is_loopback(spec.host):
            if not clients:
                self.warn(
                    el.sourceline,
                    f"<http> on non-loopback {spec.host} without declared clients: 'run' "
                    "refuses it unless started with --insecure, and anonymous HTTP callers "
                    "are served only from loopback addresses",
                )
        return spec

    def limits(self, el: etree._Element | None) -> Limits:
        if el is None:
            return Limits()
        values: dict[str, Any] = {}
        defaults = Limits()
        for name in Limits.__slots__:
            raw = el.get(name.replace("_", "-"))
            if raw is not None:
                kind = type(getattr(defaults, name))
                # The schema made it an integer or a decimal: int() keeps every digit.
                values[name] = int(raw) if kind is int else float(raw)
        limits = Limits(**values)
        if limits.outgoing_buffer < limits.max_inflight:
            self.warn(
                el.sourceline,
                f"outgoing-buffer ({limits.outgoing_buffer}) is smaller than max-inflight "
                f"({limits.max_inflight}): a client with many requests in flight may be "
                "disconnected for reading too slowly",
            )
        if limits.max_threads_per_connection >= limits.max_threads:
            self.warn(
                el.sourceline,
                f"max-threads-per-connection ({limits.max_threads_per_connection}) is not below "
                f"max-threads ({limits.max_threads}): one client can fill the thread registry "
                "and have every other refused",
            )
        return limits

    # -- listeners -----------------------------------------------------------------------

    def listeners(self, el: etree._Element) -> list[ListenerSpec]:
        specs: list[ListenerSpec] = []
        first_line: dict[str, int] = {}
        for lel in el.iterfind(_B + "listener"):
            spec = self.listener(lel)
            if spec is None:
                continue
            if spec.name in first_line:
                self.error(
                    spec.line,
                    f"listener name {spec.name!r} is already used on line {first_line[spec.name]}",
                )
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
        self.check_topology(specs)
        return specs

    def implicit_boot(self, consoles: tuple[str, ...]) -> ListenerSpec:
        builtin = BUILTIN_HANDLERS["system-boot"]
        return ListenerSpec(
            name=IMPLICIT_BOOT_NAME,
            handler_ref="system-boot",
            accepts=builtin.accepts,
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
        defaults: Mapping[str, Any] = {}
        accepts: list[type[BaseXmlModel]] = []
        responds: list[type[BaseXmlModel]] = []
        remote = _bool(el, "remote")
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
                handler = self.resolve(ref)
                if not callable(handler):
                    raise _Unresolved(f"handler {ref!r} is not callable")
                if not (
                    inspect.iscoroutinefunction(handler)
                    or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004
                ):
                    raise _Unresolved(f"handler {ref!r} is not an async function")
            except _Unresolved as exc:
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
            for tel in el.iterfind(_B + tag):
                model = self.payload_model(tel, name)
                if model is None:
                    ok = False
                elif model not in target:
                    target.append(model)
        governance = self.governance(el, name, _bool(el, "agent"))
        if governance is None:
            ok = False
        if builtin_name is not None:
            if not accepts:
                accepts.extend(builtin.accepts)
            responds.extend(m for m in builtin.responds if m not in responds)
        elif ok and not accepts:
            self.error(line, f"listener {name!r} accepts no payload type (add <accepts type=.../>)")
            ok = False
        policy = governance[0] if governance else None
        if policy is not None and any(r.approver for r in policy.rules):
            from agentserver.agents.approvals import ApprovalAck, ApprovalDecision

            # The approvers' decisions are addressed to the agent, which acknowledges them.
            if ApprovalDecision not in accepts:
                accepts.append(ApprovalDecision)
            if ApprovalAck not in responds:
                responds.append(ApprovalAck)
        for model in accepts:
            if model is not Boot and split_tag(model_root_tag(model))[0] == CORE_NS:
                self.error(line, f"listener {name!r}: core primitives cannot be accepted")
                ok = False
        profile = el.find(_B + "agent")
        agent = _bool(el, "agent")
        if profile is not None and not agent:
            self.error(profile.sourceline, f'listener {name!r}: <agent> settings need agent="true"')
            ok = False
        if not ok:
            self.broken.add(name)
            return None
        if handler is not None and not agent and not responds and not _bool(el, "ends-chains"):
            self.warn(
                line,
                f"listener {name!r} declares no <responds>: an answer from its handler will "
                'be refused (add <responds type="module:Class"/>, or ends-chains="true" if it '
                "never answers its caller)",
            )
        # The built-in's tuning, then what the file sets; ListenerSpec has the defaults.
        tuning = dict(defaults)
        if (value := el.get("concurrency")) is not None:
            tuning["concurrency"] = int(value)
        if (value := el.get("timeout")) is not None:
            tuning["timeout"] = float(value)
        if (value := el.get("queue-size")) is not None:
            tuning["queue_size"] = int(value)
        if el.get("raw") is not None:
            tuning["raw"] = _bool(el, "raw")
        for attr in ("step-timeout", "idempotent", "retries"):
            if el.get(attr) is not None and not remote:
                self.error(line, f"listener {name!r}: {attr} applies to remote listeners only")
                return None
        if remote:
            tuning["remote"] = True
            tuning["idempotent"] = _bool(el, "idempotent")
            if (value := el.get("step-timeout")) is not None:
                tuning["step_timeout"] = float(value)
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
            broadcast=_bool(el, "broadcast"),
            description=(el.findtext(_B + "description") or "").strip(),
            agent_profile=profile,
            line=line,
            agent_policy=governance[0] if governance else None,
            agent_guardrails=governance[1] if governance else (),
            **tuning,
        )
        try:
            # The pump's own checks, so 'check' and 'run' can never disagree.
            Listener(spec.name, spec.accepts, _placeholder, peers=spec.peers)
        except ConfigurationError as exc:
            self.error(line, str(exc))
            self.broken.add(name)
            return None
        return spec

    def resolve(self, ref: str) -> Any:
        module = ref.partition(":")[0]
        if module in self.failed_modules:
            raise _Unresolved("", module)  # reported already; see unresolved()
        try:
            return resolve_import(ref)
        except _Unresolved as exc:
            if exc.module is not None:
                self.failed_modules.add(exc.module)
            raise

    def unresolved(self, line: int | None, listener: str, exc: _Unresolved) -> None:
        if str(exc):  # empty: the same module's import failure is already reported
            self.error(line, f"listener {listener!r}: {exc}")

    def governance(
        self, el: etree._Element, name: str, agent: bool
    ) -> tuple[Any, tuple[Any, ...]] | None:
        """The listener's ``<policy>`` and ``<guardrail>``s (None: errors were reported)."""
        from agentserver.agents.guardrails import GuardrailSpec
        from agentserver.agents.policy import parse_policy, policy_problems

        policy_el = el.find(_B + "policy")
        guard_els = list(el.iterfind(_B + "guardrail"))
        ok = True
        for extra in (policy_el, *guard_els):
            if extra is not None and not agent:
                self.error(
                    extra.sourceline,
                    f'listener {name!r}: <{etree.QName(extra).localname}> needs agent="true"',
                )
                ok = False
        policy = None
        if policy_el is not None:
            problems = policy_problems(policy_el)
            for problem in problems:
                self.error(problem.line, f"listener {name!r}: {problem}")
            if problems:
                ok = False
            else:
                policy = parse_policy(policy_el)
        guards = []
        for gel in guard_els:
            ref = gel.get("handler", "")
            try:
                if ":" not in ref:
                    raise _Unresolved(f"guardrail handler {ref!r} is not module:function")
                handler = resolve_import(ref)
                if not callable(handler):
                    raise _Unresolved(f"guardrail handler {ref!r} is not callable")
            except _Unresolved as exc:
                self.error(gel.sourceline, f"listener {name!r}: {exc}")
                ok = False
                continue
            guards.append(GuardrailSpec(gel.get("when", "before"), ref, handler))
        return (policy, tuple(guards)) if ok else None

    def check_approvers(self, specs: list[ListenerSpec], clients: list[ClientSpec]) -> None:
        known = {s.name for s in specs} | {c.name for c in clients}
        for spec in specs:
            if spec.agent_policy is None:
                continue
            clients_ = {c.name for c in clients}
            for rule in spec.agent_policy.rules:
                if rule.approver and rule.approver not in known:
                    self.error(
                        rule.line,
                        f"listener {spec.name!r}: <rule> approver {rule.approver!r} is "
                        "neither a declared client nor a listener",
                    )
                elif (
                    rule.approver
                    and rule.approver not in clients_
                    and rule.approver not in spec.peers
                ):
                    self.error(
                        rule.line,
                        f"listener {spec.name!r}: <rule> approver {rule.approver!r} is a "
                        "listener, so it must be among the agent's peers",
                    )

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
                model = self.resolve(ref)
            except _Unresolved as exc:
                self.unresolved(line, listener, exc)
                return None
        elif ref in BUILTIN_PAYLOADS:
            model = BUILTIN_PAYLOADS[ref]
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
        path = (self.path.parent / file).resolve()
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

    def check_topology(self, specs: list[ListenerSpec]) -> None:
        names = {s.name for s in specs}
        by_tag: dict[str, list[ListenerSpec]] = {}
        model_of: dict[str, type[BaseXmlModel]] = {}
        for spec in specs:
            for peer in spec.peers:
                if peer not in names and peer not in self.broken:
                    self.error(spec.line, f"listener {spec.name!r}: unknown peer {peer!r}")
            for model in (*spec.accepts, *spec.responds):
                tag = model_root_tag(model)
                other = model_of.setdefault(tag, model)
                if other is not model:
                    self.error(
                        spec.line,
                        f"listener {spec.name!r}: root tag {_pretty(tag)} is declared by "
                        f"both {other.__module__}:{other.__qualname__} and "
                        f"{model.__module__}:{model.__qualname__}",
                    )
            for model in spec.accepts:
                by_tag.setdefault(model_root_tag(model), []).append(spec)
        for tag, sharing in by_tag.items():
            if len(sharing) > 1 and not all(s.broadcast for s in sharing):
                listed = ", ".join(f"{s.name} (line {s.line})" for s in sharing)
                self.error(
                    sharing[-1].line,
                    f"root tag {_pretty(tag)} is accepted by {listed}: several listeners may "
                    'share a root tag only if all of them are broadcast="true"',
                )
        self.check_agent_peers(specs)
        boots = [s for s in specs if s.is_boot]
        if len(boots) > 1:
            self.error(boots[1].line, "more than one listener takes the core boot primitive")
        consoles = {s.name for s in specs if s.builtin == "console"}
        input_tag = model_root_tag(BUILTIN_PAYLOADS["console.input"])
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
        (agents.service.build_profiles: its own tags first, the last peer wins a shared
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

    # -- clients and sections ------------------------------------------------------------

    def clients(self, el: etree._Element | None, listener_names: set[str]) -> list[ClientSpec]:
        if el is None:
            return []
        specs: list[ClientSpec] = []
        seen: dict[str, int] = {}
        for cel in el.iterfind(_B + "client"):
            line = cel.sourceline or 0
            name = cel.get("name", "")
            env = cel.get("token-env", "")
            if name in seen:
                self.error(line, f"client name {name!r} is already used on line {seen[name]}")
                continue
            if name in listener_names or name in RESERVED_NAMES:
                self.error(line, f"client name {name!r} is a listener's name")
                continue
            seen[name] = line
            subject = cel.get("cert-subject")
            fingerprint = cel.get("cert-fingerprint")
            if subject is not None:
                try:
                    parse_subject(subject)
                except ValueError as exc:
                    self.error(line, f"client {name!r}: cert-subject: {exc}")
            if fingerprint is not None:
                fingerprint = normalize_fingerprint(fingerprint)  # the schema checked it
            may = cel.get("may-address")
            allowed = tuple(may.split()) if may is not None else None
            for target in allowed or ():
                if target not in listener_names and target not in self.broken:
                    self.error(
                        line, f"client {name!r}: may-address names unknown listener {target!r}"
                    )
            by_cert = subject is not None or fingerprint is not None
            if not env and not by_cert:
                self.error(
                    line, f"client {name!r} needs token-env, cert-subject or cert-fingerprint"
                )
            value = self.environ.get(env) if env else ""
            # A client with a certificate may have no token: only a token alone must work.
            if env and value is None and not by_cert:
                self.warn(
                    line, f"client {name!r}: token variable {env} is not set (it cannot connect)"
                )
            elif env and value is not None and not value.strip() and not by_cert:
                self.warn(
                    line, f"client {name!r}: token variable {env} is empty (it cannot connect)"
                )
            serves = tuple(dict.fromkeys((cel.get("serves") or "").split()))
            for target in serves:
                if target not in self.remote_names and target not in self.broken:
                    self.error(
                        line, f"client {name!r}: serves {target!r}, which is not a remote listener"
                    )
            specs.append(
                ClientSpec(
                    name,
                    env or None,
                    allowed,
                    line,
                    subject,
                    fingerprint,
                    serves=serves,
                    operator=_bool(cel, "operator"),
                )
            )
        return specs

    def tls(self, el: etree._Element) -> TlsSpec | None:
        """``<tls>``: paths resolved against boot.xml's directory, and the files loaded
        now (so ``check`` reports a bad file or a key that is not the certificate's)."""
        line = el.sourceline or 0
        base = self.path.parent

        def path(attr: str) -> pathlib.Path | None:
            value = el.get(attr)
            return base / value if value is not None else None

        spec = TlsSpec(
            cert=path("cert"),
            key=path("key"),
            client_ca=path("client-ca"),
            min_version=el.get("min-version", DEFAULT_MIN_VERSION),
            cert_env=el.get("cert-env"),
            key_env=el.get("key-env"),
            base_dir=base,
            line=line,
        )
        ok = True
        for what in ("cert", "key"):
            if el.get(what) is None and el.get(f"{what}-env") is None:
                self.error(line, f"<tls> needs {what}= or {what}-env=")
                ok = False
        if not ok:
            return None
        try:
            server_context(spec, self.environ)
        except TlsError as exc:
            self.error(line, f"<tls>: {exc}")
            return None
        return spec

    def check_client_certificates(
        self, clients: list[ClientSpec], tls: TlsSpec | None, el: etree._Element | None
    ) -> None:
        by_cert = [c for c in clients if c.cert_subject or c.cert_fingerprint]
        mutual = el is not None and el.get("client-ca") is not None
        for client in by_cert:
            if not mutual:
                self.error(
                    client.line,
                    f"client {client.name!r}: cert-subject/cert-fingerprint need mutual TLS "
                    "(<tls client-ca=...>)",
                )
        if mutual:
            for client in clients:
                if client not in by_cert:
                    self.warn(
                        client.line,
                        f"client {client.name!r} has no cert-subject or cert-fingerprint: "
                        "with mutual TLS (<tls client-ca>) it cannot connect",
                    )

    def check_llm(self, el: etree._Element) -> None:
        try:
            from agentserver.llm.config import check_llm_section
        except Exception as exc:  # the router package is optional at this layer
            self.warn(el.sourceline, f"<llm> not checked: the LLM router is unavailable ({exc})")
            return
        try:
            report = check_llm_section(el, environ=self.environ, validate=False)
        except Exception as exc:
            self.error(el.sourceline, f"<llm>: {exc}")
            return
        for line, message in report.errors:
            self.error(line or el.sourceline, message)
        for line, message in report.warnings:
            self.warn(line or el.sourceline, message)

    def check_store(self, el: etree._Element) -> None:
        try:
            from agentserver.agents.config import store_settings_from_element
        except Exception as exc:  # the agent package is optional at this layer
            self.warn(el.sourceline, f"<store> not checked: the agent store is unavailable ({exc})")
            return
        try:
            settings = store_settings_from_element(
                el, base_dir=self.path.parent, environ=self.environ
            )
        except Exception as exc:
            self.error(el.sourceline, f"<store>: {exc}")
            return
        var = el.get("url-env")
        if var and not self.environ.get(var) and settings.url is None:
            self.warn(
                el.sourceline,
                f"<store url-env>: ${var} is not set and there is no url: the agents' store "
                f"is the SQLite file {settings.path}",
            )


async def _placeholder(payload: object, meta: object) -> None:
    """Stands in for a handler while the pump's listener checks run."""
    return None
