"""An agent's version: a digest of what defines its behaviour (docs/deploy.md, "Deploying
with Turns in flight").

The digest covers the agent's ``<listener>`` element as written (its ``<agent>`` settings:
prompt, model, limits, memory, budget, retention; its policy and guardrails), its peers with their payload schemas, and the source of its listener modules (its handler's
and its payload types'). Comments and the file's layout around the element are not part of
it: they change no behaviour. ``<agent version="NAME">`` names the version; the name is
then its id, and the digest is what ``check`` compares under that name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from copy import deepcopy as copy_element
from dataclasses import dataclass

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.config.topology import ListenerSpec, Topology
from agentserver.core.xsdgen import derive_schema
from agentserver.core.xsdpayload import schema_doc_of

#: How many hex digits of the digest name an unnamed version.
SHORT = 12


@dataclass(frozen=True, slots=True)
class AgentVersion:
    """One agent's version as this topology defines it."""

    agent: str
    #: The version's id: ``<agent version>``, else the digest's first :data:`SHORT` digits.
    version: str
    #: The full digest (sha256, hex).
    digest: str
    #: ``upgrade`` or ``pinned`` (``<agent versioning>``).
    versioning: str
    #: Whether ``version`` was named in boot.xml.
    named: bool


def agent_versions(topology: Topology) -> dict[str, AgentVersion]:
    """The version of every agent of ``topology``, by agent name. Pure but for reading
    the listener modules' source files."""
    out = {}
    for spec in topology.listeners:
        if not spec.agent:
            continue
        digest = agent_digest(topology, spec)
        settings = spec.agent_profile
        name = settings.version if settings is not None else None
        out[spec.name] = AgentVersion(
            agent=spec.name,
            version=name or digest[:SHORT],
            digest=digest,
            versioning=settings.versioning if settings is not None else "upgrade",
            named=bool(name),
        )
    return out


def agent_digest(topology: Topology, spec: ListenerSpec) -> str:
    """The sha256 (hex) of what defines agent ``spec``'s behaviour (module docstring)."""
    h = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        # Length-prefixed, so no two different sequences of parts hash alike.
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    part("listener", spec.definition)
    for model in (*spec.accepts, *spec.responds):
        part("payload", payload_schema(model))
    for peer_name in sorted(spec.peers):
        part("peer", peer_name.encode())
        # (A loaded topology's peers are all declared: the loader refuses an unknown one.)
        for model in topology.listener(peer_name).accepts:
            part("peer-payload", payload_schema(model))
    for module in _modules(spec):
        part("module", module.encode())
        part("source", module_source(module))
    return h.hexdigest()


def definition(el: etree._Element) -> bytes:
    """A ``<listener>`` element as its version's digest reads it: canonical (C14N), without
    comments and without whitespace-only text, so that re-indenting the file or
    commenting it makes no new version."""
    copy = copy_element(el)
    for node in copy.iter():
        if node.text is not None and not node.text.strip():
            node.text = None
        if node.tail is not None and not node.tail.strip():
            node.tail = None
    copy.tail = None
    return etree.tostring(copy, method="c14n", with_comments=False)


def payload_schema(model: type[BaseXmlModel]) -> bytes:
    """A payload type's schema, canonical (C14N): a file-declared type's document, or the
    one derived from a Python model."""
    doc = schema_doc_of(model)
    if doc is None:
        try:
            doc = derive_schema(model)
        except Exception:  # a model the generator cannot express: its name stands in
            return f"{model.__module__}.{model.__qualname__}".encode()
    return etree.tostring(doc, method="c14n", with_comments=False)


def module_source(module: str) -> bytes:
    """The source file of ``module`` (empty when it has none: a built-in or a zip)."""
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None)
    if path is None:
        found = importlib.util.find_spec(module)
        path = found.origin if found is not None else None
    if not path or not path.endswith(".py"):
        return b""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _modules(spec: ListenerSpec) -> list[str]:
    """The modules that define listener ``spec``: its handler's and its payload types'."""
    names = {m.__module__ for m in (*spec.accepts, *spec.responds)}
    if spec.handler is not None:
        module = getattr(spec.handler, "__module__", None)
        if module:
            names.add(module)
    return sorted(names)
