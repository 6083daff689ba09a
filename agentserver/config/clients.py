"""boot.xml's ``<clients>`` and ``<tls>``: who may connect and how, read and checked.

TLS file paths are resolved against boot.xml's folder, and the files are loaded at once
(so ``check`` reports a bad file or a key that is not the certificate's).
"""

from __future__ import annotations

import ipaddress
import pathlib
from collections.abc import Mapping

from lxml import etree

from agentserver.config.imports import B, flag
from agentserver.config.problems import Report
from agentserver.config.topology import ClientSpec
from agentserver.core.listener import RESERVED_NAMES
from agentserver.net.tls import (
    DEFAULT_MIN_VERSION,
    TlsError,
    TlsSpec,
    normalize_fingerprint,
    parse_subject,
    server_context,
)


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost`` (no name resolution)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientReader:
    """Reads ``<clients>`` and ``<tls>`` of one boot.xml, reporting to ``report``.
    ``base_dir`` is boot.xml's folder (absolute); ``environ`` is where token variables
    and TLS ``*-env`` variables are looked up."""

    def __init__(self, report: Report, base_dir: pathlib.Path, environ: Mapping[str, str]) -> None:
        self.report = report
        self.base_dir = base_dir
        self.environ = environ

    def error(self, line: int | None, message: str) -> None:
        self.report.error(line, message)

    def warn(self, line: int | None, message: str) -> None:
        self.report.warn(line, message)

    def clients(
        self,
        el: etree._Element | None,
        listener_names: set[str],
        remote_names: set[str],
        broken: set[str],
    ) -> list[ClientSpec]:
        """The declared clients; ``broken`` listeners were reported already, so naming
        one is no second error."""
        if el is None:
            return []
        specs: list[ClientSpec] = []
        seen: dict[str, int] = {}
        for cel in el.iterfind(B + "client"):
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
                if target not in listener_names and target not in broken:
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
                if target not in remote_names and target not in broken:
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
                    operator=flag(cel, "operator"),
                )
            )
        return specs

    def tls(self, el: etree._Element) -> TlsSpec | None:
        """``<tls>``: paths resolved against boot.xml's directory, and the files loaded
        now (so ``check`` reports a bad file or a key that is not the certificate's)."""
        line = el.sourceline or 0
        base = self.base_dir

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
