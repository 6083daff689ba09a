"""Load and check boot.xml: the one way configuration enters the server.

:func:`load` parses the file with the hardened parser, validates it against
``schemas/boot.xsd`` (which includes the LLM and agent-store grammars), resolves every
reference (handler and payload import paths, built-in names, peers), reads every section
into its typed settings once (no subsystem sees boot.xml's elements) and checks the
topology as a whole. It never raises for a problem in the file: every problem becomes a
:class:`Problem` with a line number, and the :class:`Topology` is returned only when there
is no error.

Relative paths in the file (``<store path>``, ``<tls>`` files, ``<accepts schema>``
files, and the folder handler modules are imported from) are all relative to boot.xml's
folder, resolved here to absolute paths: the working directory changes nothing.

One module per part of the file: :mod:`~agentserver.config.listeners` (with
:mod:`~agentserver.config.governance`), :mod:`~agentserver.config.clients` (clients and
TLS), :mod:`~agentserver.config.sections` (limits, http, llm, store). Pure apart from
importing the modules the file names (which is what running it would do), reading the
environment (token variables are set or not; ``*-env`` overrides), reading the TLS
and schema files it names, and reaching each ``<mcp>`` server once to list its tools
(:mod:`~agentserver.config.mcp`: a stdio server's command is started, bounded by its
``connect-timeout``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence

from lxml import etree

from agentserver.config.a2a import check_exposed_a2a
from agentserver.config.a2a_remote import A2aRemoteReader
from agentserver.config.budgets import fair_weights, read_budgets
from agentserver.config.clients import ClientReader, is_loopback
from agentserver.config.durations import check_durations, schema_message
from agentserver.config.governance import check_approvers
from agentserver.config.imports import B, Resolver, add_import_dir, flag, resolve_import
from agentserver.config.listeners import IMPLICIT_BOOT_NAME, ListenerReader
from agentserver.config.mcp import McpReader, check_exposed
from agentserver.config.problems import BootError, LoadResult, Problem, Report, pretty
from agentserver.config.schedules import read_schedules
from agentserver.config.sections import SectionReader
from agentserver.config.topology import DEFAULT_HOST, DEFAULT_PORT, ListenerSpec, Topology
from agentserver.core.schemas_export import schema_path
from agentserver.core.xmlsafe import make_parser
from agentserver.llm.config import RouterConfig

__all__ = [
    "IMPLICIT_BOOT_NAME",
    "MAX_BOOT_BYTES",
    "BootError",
    "LoadResult",
    "Problem",
    "add_import_dir",
    "boot_schema",
    "is_loopback",
    "load",
    "load_bytes",
    "load_or_raise",
    "resolve_import",
]

#: boot.xml files are small; refuse anything absurd before parsing it.
MAX_BOOT_BYTES = 4 * 1024 * 1024


def boot_schema() -> etree.XMLSchema:
    """``boot.xsd`` compiled (it includes boot-llm.xsd and boot-agents.xsd by path)."""
    return etree.XMLSchema(etree.parse(str(schema_path("boot.xsd"))))


def load(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> LoadResult:
    """Load and check ``path``. Never raises for problems in the file (see module doc)."""
    path = pathlib.Path(path)
    loader = _Loader(path, str(path), os.environ if environ is None else environ)
    add_import_dir(path.parent)
    return loader.run(loader.read_file())


def load_bytes(
    data: bytes, *, name: str = "<boot.xml>", environ: Mapping[str, str] | None = None
) -> LoadResult:
    """Like :func:`load` for a document in memory; problems are reported under ``name``.
    It has no folder of its own: its relative paths resolve against the working
    directory (the bundled boot.xml's ``./state/`` store)."""
    loader = _Loader(
        pathlib.Path.cwd() / "boot.xml", name, os.environ if environ is None else environ
    )
    return loader.run(data)


def load_or_raise(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Topology:
    """Like :func:`load`, raising :class:`BootError` on any error."""
    result = load(path, environ=environ)
    if result.topology is None:
        raise BootError(result.errors)
    return result.topology


class _Loader:
    """One load of one document: ``path`` is where it is (its folder is the base of
    relative paths), ``shown`` how problems name it."""

    def __init__(self, path: pathlib.Path, shown: str, environ: Mapping[str, str]) -> None:
        self.path = path
        self.base_dir = path.parent.resolve()
        self.environ = environ
        self.report = Report(shown)

    def read_file(self) -> bytes | None:
        try:
            with self.path.open("rb") as f:
                return f.read(MAX_BOOT_BYTES + 1)
        except OSError as exc:
            self.report.error(0, f"cannot read: {exc.strerror or exc}")
            return None

    def run(self, data: bytes | None) -> LoadResult:
        root = self.parse(data) if data is not None else None
        if root is None:
            return self.report.result(None)
        schema = boot_schema()
        if not schema.validate(root):
            for entry in schema.error_log:
                # A bad duration's message names the forms, not the schema's pattern.
                duration = schema_message(entry.message)
                self.report.error(entry.line, duration or pretty(entry.message))
            return self.report.result(None)
        check_durations(self.report, root)
        return self.report.result(self.topology(root))

    def parse(self, data: bytes) -> etree._Element | None:
        if len(data) > MAX_BOOT_BYTES:
            self.report.error(0, f"larger than {MAX_BOOT_BYTES} bytes")
            return None
        try:
            root = etree.fromstring(data, make_parser(), base_url=self.path.resolve().as_uri())
        except etree.XMLSyntaxError as exc:
            self.report.error(exc.lineno, f"not well-formed XML: {exc.msg}")
            return None
        docinfo = root.getroottree().docinfo
        if docinfo.doctype or docinfo.internalDTD is not None:
            self.report.error(1, "a DOCTYPE is not allowed in boot.xml")
            return None
        return root

    def check_grammars(self, listeners: Sequence[ListenerSpec], llm: RouterConfig) -> None:
        """An agent on a constraining local backend: its peers' XSDs must make a reply
        grammar (agentserver/llm/grammars.py); what cannot is an error naming it."""
        from agentserver.agents.governance.approvals import DECISION_TAG, REQUEST_TAG
        from agentserver.agents.profile.config import MODEL_ENV
        from agentserver.core.xsdgen import model_root_tag
        from agentserver.llm.grammars import constrained_models, grammar_problems

        if not constrained_models(llm):
            return
        by_name = {s.name: s for s in listeners}
        agents = []
        for spec in listeners:
            settings = spec.agent_profile
            if not spec.agent or settings is None:
                continue
            env = self.environ
            model = (
                (env.get(settings.model_env) if settings.model_env else None)
                or settings.model
                or env.get(MODEL_ENV, "")
            )
            peer_models = [
                m
                for peer in spec.peers
                if peer in by_name
                for m in by_name[peer].accepts
                if model_root_tag(m) not in (REQUEST_TAG, DECISION_TAG)
            ]
            agents.append((spec.name, spec.line or 0, model, peer_models))
        for line, message in grammar_problems(agents, llm):
            self.report.error(line, message)

    def topology(self, root: etree._Element) -> Topology:
        report = self.report
        sections = SectionReader(report, self.base_dir, self.environ)
        mcp = McpReader(report, self.base_dir, self.environ)
        remotes = A2aRemoteReader(report, self.base_dir, self.environ)
        readers = ListenerReader(report, Resolver(), self.base_dir, mcp, remotes)
        access = ClientReader(report, self.base_dir, self.environ)
        listen = root.find(B + "listen")
        host = listen.get("host", DEFAULT_HOST) if listen is not None else DEFAULT_HOST
        port = int(listen.get("port", DEFAULT_PORT)) if listen is not None else DEFAULT_PORT
        limits = sections.limits(root.find(B + "limits"))
        listeners_el = root.find(B + "listeners")
        assert listeners_el is not None  # boot.xsd requires it; load() validated root
        listeners = readers.read(listeners_el)
        tls_el = root.find(B + "tls")
        tls = access.tls(tls_el) if tls_el is not None else None
        clients = access.clients(
            root.find(B + "clients"),
            {s.name for s in listeners},
            {s.name for s in listeners if s.remote},
            readers.broken,
        )
        served = {name for c in clients for name in c.serves}
        for spec in listeners:
            if spec.remote and spec.name not in served:
                report.warn(
                    spec.line,
                    f"remote listener {spec.name!r}: no client serves it (add "
                    f'serves="{spec.name}" to a <client>); its messages will time out',
                )
        access.check_client_certificates(clients, tls, tls_el)
        check_approvers(report, listeners, clients)
        insecure_plaintext = listen is not None and flag(listen, "insecure-plaintext")
        if not clients and not is_loopback(host) and listen is not None:
            report.warn(
                listen.sourceline,
                f"no clients are declared, so connections are anonymous: 'run' refuses to "
                f"listen on non-loopback {host} unless started with --insecure",
            )
        elif clients and tls_el is None and not is_loopback(host):
            if insecure_plaintext:
                report.warn(
                    listen.sourceline if listen is not None else 0,
                    f'insecure-plaintext="true": tokens and messages cross the network to '
                    f"{host} in clear (add <tls>)",
                )
            else:
                report.error(
                    listen.sourceline if listen is not None else 0,
                    f"clients are declared but {host} is not loopback and there is no <tls>: "
                    "tokens would cross the network in clear (add <tls>, or "
                    'insecure-plaintext="true" on <listen> to accept that)',
                )
        http = sections.http(root.find(B + "http"), bool(clients))
        llm = sections.llm(root.find(B + "llm"))
        if llm is not None:
            self.check_grammars(listeners, llm)
        store = sections.store(root.find(B + "store"))
        weights = fair_weights(root)
        if weights is not None:
            store = dataclasses.replace(store, fair_weights=weights)
        description = (root.findtext(B + "description") or "").strip()
        from agentserver.config.webhooks import read_webhooks

        webhooks = read_webhooks(report, root, self.environ)
        budgets = read_budgets(
            report, root, {s.name for s in listeners if s.agent}, readers.cause_of
        )
        return Topology(
            path=self.path,
            organism=root.get("name", ""),
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
            mcp=tuple(mcp.servers),
            a2a=tuple(remotes.remotes),
            expose_mcp=check_exposed(
                report, root.find(B + "expose-mcp"), {s.name for s in listeners}, readers.cause_of
            ),
            webhooks=webhooks,
            budgets=budgets,
            schedules=read_schedules(
                report,
                root.find(B + "schedules"),
                {s.name for s in listeners if s.agent},
                readers.cause_of,
            ),
            expose_a2a=check_exposed_a2a(
                report, root.find(B + "expose-a2a"), tuple(listeners), readers.cause_of
            ),
        )
