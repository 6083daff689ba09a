"""Where a command finds the project: the boot.xml it uses (BOOT if given, else
``$AGENTSERVER_BOOT``, else ``./boot.xml``) and, for the commands that talk to a running
server, the addresses that file declares (``<listen>``, ``<http>``).

The addresses are read from the file alone (parsed with the hardened parser, nothing
imported, no schema, no environment), so a client command stays fast and works in a
project whose listeners need variables only the server has. The server checks the file
itself when it runs it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from lxml import etree

from agentserver.cli.common import (
    BOOT_ENV,
    DEFAULT_HTTP_URL,
    HOST_ENV,
    HTTP_URL_ENV,
    PORT_ENV,
    WILDCARDS,
    connect_address,
)
from agentserver.config.imports import B
from agentserver.config.topology import DEFAULT_HOST, DEFAULT_HTTP_PORT, DEFAULT_PORT
from agentserver.core.xmlsafe import make_parser

#: The file a command looks for in the working directory when given none.
LOCAL_BOOT = "boot.xml"
#: The most of a boot.xml read for its addresses (the loader's own bound).
MAX_BOOT_BYTES = 4 * 1024 * 1024


class ProjectError(Exception):
    """A boot.xml that was named (BOOT, ``--boot`` or ``$AGENTSERVER_BOOT``) cannot be
    read, or declares an address that is not one. The text names the file and the fix."""


@dataclass(frozen=True, slots=True)
class Addresses:
    """What a client needs of a boot.xml: where its server listens."""

    #: The file read.
    boot: str
    #: ``<listen host port>`` (the defaults when the element is absent).
    listen: tuple[str, int]
    #: ``<http host port>``; None: the file declares no HTTP API.
    http: tuple[str, int] | None
    #: ``<tls>`` is declared: the socket and the HTTP API speak TLS.
    tls: bool
    #: ``<clients>`` declares at least one client: connections must say who they are.
    clients: bool


def find_boot(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The boot.xml a command uses: ``given``, else ``$AGENTSERVER_BOOT``, else
    ``./boot.xml`` if there is one; None when there is none."""
    if given:
        return given
    env = os.environ if environ is None else environ
    named = env.get(BOOT_ENV, "").strip()
    if named:
        return named
    return LOCAL_BOOT if pathlib.Path(LOCAL_BOOT).is_file() else None


def no_boot_message(command: str) -> str:
    """What a command that needs a topology says when it finds none."""
    return (
        f"{command}: no boot.xml here: give BOOT, set ${BOOT_ENV}, or run it from the "
        "project's folder"
    )


def read_addresses(path: str | os.PathLike[str]) -> Addresses:
    """The addresses ``path`` declares. Raises :class:`ProjectError`."""
    shown = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BOOT_BYTES + 1)
    except OSError as exc:
        raise ProjectError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_BOOT_BYTES:
        raise ProjectError(f"{shown}: larger than {MAX_BOOT_BYTES} bytes")
    try:
        root = etree.fromstring(data, make_parser())
    except etree.XMLSyntaxError as exc:
        raise ProjectError(
            f"{shown}:{exc.lineno}: not well-formed XML: {exc.msg} "
            f"('agentserver check {shown}' says more)"
        ) from None
    if root.tag != f"{B}organism":
        raise ProjectError(
            f"{shown}: not a boot.xml (its root is not <organism> in {B[1:-1]}): "
            f"'agentserver check {shown}' says more"
        )
    listen = root.find(f"{B}listen")
    http = root.find(f"{B}http")
    clients = root.find(f"{B}clients")
    return Addresses(
        boot=shown,
        listen=_address(shown, listen, DEFAULT_PORT),
        http=_address(shown, http, DEFAULT_HTTP_PORT) if http is not None else None,
        tls=root.find(f"{B}tls") is not None,
        clients=clients is not None and len(clients.findall(f"{B}client")) > 0,
    )


def _address(shown: str, el: etree._Element | None, default_port: int) -> tuple[str, int]:
    if el is None:
        return DEFAULT_HOST, default_port
    host = (el.get("host") or DEFAULT_HOST).strip()
    raw = (el.get("port") or str(default_port)).strip()
    if not raw.isdigit() or int(raw) > 65535:
        tag = etree.QName(el).localname
        raise ProjectError(
            f"{shown}:{el.sourceline}: <{tag} port={raw!r}> is not a port number (0-65535)"
        )
    return host, int(raw)


def http_url(http: tuple[str, int], tls: bool) -> str:
    """The URL of an ``<http host port>`` as a client on this machine reaches it."""
    host, port = http
    host = WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def apply_project(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Fill a client command's address options left unset from the project: ``--connect``
    (``$AGENTSERVER_HOST``/``$AGENTSERVER_PORT`` each win over the project's ``<listen>``)
    and ``--url`` (``$AGENTSERVER_HTTP_URL`` wins over its ``<http>``); without a project,
    today's defaults. A project declaring ``<tls>`` implies ``--tls`` for the address it
    gave. ``args.project`` is then the :class:`Addresses` read, or None. Raises
    ArgumentTypeError (a usage error) for a named boot.xml that cannot be read, or an
    address that cannot be used."""
    env = os.environ if environ is None else environ
    path = find_boot(getattr(args, "boot", None), env)
    project = None
    if path is not None:
        try:
            project = read_addresses(path)
        except ProjectError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    args.project = project
    if hasattr(args, "connect") and args.connect is None:
        listen = project.listen if project is not None else None
        args.connect = connect_address(args, listen)
        from_project = (
            project is not None
            and not env.get(HOST_ENV, "").strip()
            and not env.get(PORT_ENV, "").strip()
        )
        if from_project and project is not None and project.tls and hasattr(args, "tls"):
            args.tls = True
    if hasattr(args, "url"):
        # Where the URL came from: ``result`` reads the project's store unless told a URL.
        args.url_from = "option"
        if args.url is None:
            named = env.get(HTTP_URL_ENV, "").strip()
            if named:
                args.url, args.url_from = named, "environment"
            elif project is not None and project.http is not None:
                args.url, args.url_from = http_url(project.http, project.tls), "project"
            else:
                args.url, args.url_from = DEFAULT_HTTP_URL, "default"
