"""``agentserver check`` and ``agentserver schemas``: what a boot.xml declares, checked
and exported, without running it."""

from __future__ import annotations

import argparse
import pathlib
from typing import TYPE_CHECKING

from agentserver.cli.common import (
    BOOT_ENV,
    EXIT_FAILED,
    EXIT_OK,
    Subcommands,
    plural,
    print_problems,
)
from agentserver.config.topology import Topology

if TYPE_CHECKING:
    from agentserver.config.problems import LoadResult


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``check`` and ``schemas`` subcommands."""
    check = sub.add_parser(
        "check",
        parents=[common],
        help="validate a boot.xml",
        description="Validate BOOT against schemas/boot.xsd and check every reference in it "
        "(imports resolve, peers and payload types exist, names are unique, ...). Prints "
        "each problem as FILE:LINE: message (a knock-on effect indented under the error that "
        "caused it) and exits 1 on errors; prints a one-line summary and exits 0 when the "
        "file is good (warnings do not fail it). Everything goes to standard output.",
    )
    check.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help=f"the boot.xml to check (default: ${BOOT_ENV}, else ./boot.xml)",
    )
    check.add_argument(
        "--connect",
        action="store_true",
        help="also connect to the agents' store when it is PostgreSQL (<store url>) and say "
        "whether it is reachable (an unreachable store fails the check)",
    )

    schemas = sub.add_parser(
        "schemas",
        parents=[common],
        help="export the payload XSDs of a topology",
        description="Write one XSD per payload namespace of BOOT (derived from the payload "
        "models, as the server validates them), plus envelope.xsd and core.xsd, into DIR, so "
        "clients can validate what they send. Prints each file written.",
    )
    schemas.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help=f"the boot.xml whose payloads to export (default: ${BOOT_ENV}, else ./boot.xml)",
    )
    schemas.add_argument(
        "--out",
        metavar="DIR",
        default="schemas-export",
        help="target directory (default: ./schemas-export)",
    )


def cmd_check(args: argparse.Namespace) -> int:
    from agentserver.config import loader as boot  # not at import: other commands skip it

    result = boot.load(args.boot)
    # One stream, standard output: errors, warnings and the summary in the order a reader
    # needs them (the exit status says whether the file is good).
    for problem in result.problems:
        print(problem)
    if result.topology is None:
        print(f"{args.boot}: {plural(len(result.errors), 'error')}")
        return EXIT_FAILED
    # Each agent's version before the summary, which stays the last line of a good file's.
    connect = getattr(args, "connect", False)
    for line in version_lines(args.boot, result.topology, connect=connect):
        print(line)
    print(summary(args.boot, result))
    from agentserver.config.a2a_remote import a2a_mapping_lines
    from agentserver.config.mcp import mapping_lines

    listeners = result.topology.listeners
    for line in [*mapping_lines(listeners), *a2a_mapping_lines(listeners)]:
        print(f"{args.boot}: {line}")
    if getattr(args, "connect", False):
        return _check_store_reachable(args.boot, result.topology)
    return EXIT_OK


def version_lines(name: str, topology: Topology, *, connect: bool = False) -> list[str]:
    """Each agent's version (docs/deploy.md), and a warning for a named version whose
    definition is not the one the store saw served under that name (when the store can
    be read: a SQLite file that exists; a PostgreSQL database with ``connect``)."""
    from agentserver.agents.errors import AgentError
    from agentserver.agents.store.sql.versions import Redefined
    from agentserver.app.store_admin import recorded_versions
    from agentserver.cli.common import trio_run
    from agentserver.config.versions import agent_versions

    versions = agent_versions(topology)
    lines = [
        f"{name}: agent {v.agent!r}: version {v.version} ({v.versioning})"
        for v in versions.values()
    ]
    if not any(v.named for v in versions.values()):
        return lines
    try:
        seen = trio_run(lambda: recorded_versions(topology, connect=connect))
    except (AgentError, OSError) as exc:
        return [*lines, f"{name}: note: the store was not read, versions not compared: {exc}"]
    if seen is None:
        return [
            *lines,
            f"{name}: note: named versions are compared with the store's with --connect",
        ]
    for v in versions.values():
        was = seen.get((v.agent, v.version))
        if v.named and was is not None and was != v.digest:
            lines.append(f"{name}: warning: {Redefined(v.agent, v.version, was, v.digest).text()}")
    return lines


def _check_store_reachable(name: str, topology: Topology) -> int:
    """``check --connect``: one line saying whether the PostgreSQL store answers."""
    from agentserver.agents.profile.store_url import probe

    settings = topology.store
    if settings.url is None:
        print(f"{name}: store: SQLite file {settings.path} (nothing to connect to)")
        return EXIT_OK
    ok, detail = probe(settings.url)
    if ok:
        print(f"{name}: store {settings.where}: reachable ({detail})")
        return EXIT_OK
    print(f"{name}: store {settings.where}: NOT reachable: {detail}")
    return EXIT_FAILED


def cmd_schemas(args: argparse.Namespace) -> int:
    import shutil

    from lxml import etree

    from agentserver.config import loader as boot  # not at import: other commands skip it
    from agentserver.core.payloads import PayloadRegistry
    from agentserver.core.schemas_export import schema_path
    from agentserver.primitives.core import CORE_MODELS

    result = boot.load(args.boot)
    if result.topology is None:
        print_problems(result)
        return EXIT_FAILED
    registry = PayloadRegistry()
    for spec in result.topology.listeners:
        for model in (*spec.accepts, *spec.responds):
            registry.add(model)
    core = set(CORE_MODELS)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("envelope.xsd", "core.xsd"):
        shutil.copyfile(schema_path(name), out / name)
        print(out / name)
    for namespace, doc in sorted(registry.namespace_schemas().items()):
        if all(p.model in core for p in registry if p.namespace == namespace):
            continue  # the core primitives are core.xsd
        stem = "".join(c if c.isalnum() else "-" for c in namespace).strip("-")
        path = out / f"{stem}.xsd"
        path.write_bytes(
            etree.tostring(doc, pretty_print=True, xml_declaration=True, encoding="UTF-8")
        )
        print(path)
    return EXIT_OK


def summary(name: str, result: LoadResult) -> str:
    topo = result.topology
    assert topo is not None
    warnings = len(result.warnings)
    extra = f", {plural(warnings, 'warning')}" if warnings else ""
    return (
        f"{name}: OK: organism {topo.organism!r}, {plural(len(topo.listeners), 'listener')}, "
        f"{plural(len(topo.clients), 'client')}{extra}"
    )
