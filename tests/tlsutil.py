"""Certificates for TLS tests (made by trustme, written under a pytest tmp dir) and
boot.xml copies with a ``<tls>`` section (helpers, not tests)."""

from __future__ import annotations

import pathlib
import ssl
from dataclasses import dataclass

import trustme
from lxml import etree

from agentserver.core.namespaces import BOOT_NS

_B = f"{{{BOOT_NS}}}"


@dataclass(frozen=True)
class Pki:
    """A CA, the server's certificate for 127.0.0.1/localhost, and files for each."""

    ca: trustme.CA
    dir: pathlib.Path
    ca_file: pathlib.Path
    cert_file: pathlib.Path
    key_file: pathlib.Path

    def client_files(
        self, name: str, common_name: str | None = None
    ) -> tuple[pathlib.Path, pathlib.Path]:
        """A client certificate (CN=``common_name`` or ``name``) and its key, as files."""
        issued = self.ca.issue_cert(f"{name}@clients.test", common_name=common_name or name)
        cert = self.dir / f"{name}.pem"
        key = self.dir / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return cert, key

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        self.ca.configure_trust(ctx)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def make_pki(directory: pathlib.Path, prefix: str = "") -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = directory / f"{prefix}ca.pem"
    cert_file = directory / f"{prefix}server.pem"
    key_file = directory / f"{prefix}server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    server.cert_chain_pems[0].write_to_path(str(cert_file))
    server.private_key_pem.write_to_path(str(key_file))
    return Pki(ca, directory, ca_file, cert_file, key_file)


def with_tls(source: pathlib.Path, target: pathlib.Path, **attributes: str) -> pathlib.Path:
    """A copy of boot.xml ``source`` at ``target`` with ``<tls ATTRIBUTES/>`` added."""
    tree = etree.parse(str(source))
    root = tree.getroot()
    tls = etree.Element(_B + "tls", {k.replace("_", "-"): v for k, v in attributes.items()})
    root.insert(0, tls)
    tree.write(str(target), xml_declaration=True, encoding="UTF-8")
    return target
