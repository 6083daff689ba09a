"""TLS settings and contexts (docs/security.md), with the standard library's ``ssl``.

:class:`TlsSpec` is what boot.xml's ``<tls>`` declares; :func:`server_context` turns it
into the listener's context, :func:`client_context` builds a client's. Who a client
certificate proves is decided here too, without I/O: :func:`subject_of`,
:func:`fingerprint_of` and :func:`match_certificate`.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agentserver.core.errors import ConfigurationError

MIN_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
DEFAULT_MIN_VERSION = "1.2"
#: Forward-secret AEAD suites only, for TLS 1.2 (TLS 1.3 suites are all modern already).
MODERN_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!SHA1:!RSA:!DSS"

#: Short names of subject attributes, as boot.xml ``cert-subject`` writes them.
_SHORT_NAMES = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "emailAddress": "emailAddress",
    "serialNumber": "serialNumber",
    "domainComponent": "DC",
    "userId": "UID",
}


class TlsError(ConfigurationError):
    """A certificate, key or CA file that cannot be used (the message says which and why)."""


@dataclass(frozen=True, slots=True)
class TlsSpec:
    """boot.xml ``<tls>``: the listener's certificate and key (paths already resolved
    against boot.xml's directory, or read from the environment variables ``cert_env`` /
    ``key_env`` when those are set), the CA that signs client certificates (mutual TLS;
    None: no client certificate asked for), and the lowest protocol version accepted."""

    cert: pathlib.Path | None = None
    key: pathlib.Path | None = None
    client_ca: pathlib.Path | None = None
    min_version: str = DEFAULT_MIN_VERSION
    cert_env: str | None = None
    key_env: str | None = None
    base_dir: pathlib.Path = pathlib.Path(".")
    line: int = 0

    def paths(self, environ: Mapping[str, str]) -> tuple[pathlib.Path, pathlib.Path]:
        """The certificate and key files to load. Raises :class:`TlsError` if an
        environment variable named by ``cert-env``/``key-env`` is unset."""
        return self._path("cert", self.cert, self.cert_env, environ), self._path(
            "key", self.key, self.key_env, environ
        )

    def _path(
        self, what: str, path: pathlib.Path | None, env: str | None, environ: Mapping[str, str]
    ) -> pathlib.Path:
        if env is not None:
            value = environ.get(env, "").strip()
            if value:
                return self.base_dir / value
            if path is None:
                raise TlsError(f"<tls>: {what} variable {env} is not set")
        assert path is not None  # the loader requires one of the two
        return path


def _load_error(what: str, path: os.PathLike[str] | str, exc: Exception) -> TlsError:
    if isinstance(exc, ssl.SSLError):
        return TlsError(f"{what} file {path} cannot be loaded: {exc.reason or exc}")
    if isinstance(exc, OSError):
        return TlsError(f"cannot read {what} file {path}: {exc.strerror or exc}")
    return TlsError(f"{what} file {path} cannot be loaded: {exc}")


def _harden(ctx: ssl.SSLContext, min_version: str) -> None:
    ctx.minimum_version = MIN_VERSIONS[min_version]
    ctx.set_ciphers(MODERN_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION
    # Renegotiation would let a peer restart the (CPU-heavy) handshake at will.
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)


def _read(what: str, path: os.PathLike[str] | str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{what} file {path} does not exist") from None
    except OSError as exc:
        raise TlsError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None


def _load_chain(
    ctx: ssl.SSLContext, cert: os.PathLike[str] | str, key: os.PathLike[str] | str
) -> None:
    # OpenSSL's own errors do not say which file is at fault: look first.
    if b"-----BEGIN CERTIFICATE-----" not in _read("certificate", cert):
        raise TlsError(f"certificate file {cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in _read("key", key):
        raise TlsError(f"key file {key} holds no PEM private key")
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "MISMATCH" in f"{exc.reason} {exc}".upper():
            raise TlsError(f"the key in {key} does not match the certificate in {cert}") from None
        raise TlsError(f"certificate {cert} / key {key} cannot be loaded: {exc}") from None
    except OSError as exc:
        raise _load_error("certificate", cert, exc) from None


def _load_ca(ctx: ssl.SSLContext, what: str, path: os.PathLike[str] | str) -> None:
    if b"-----BEGIN CERTIFICATE-----" not in _read(what, path):
        raise TlsError(f"{what} file {path} holds no PEM certificate")
    try:
        ctx.load_verify_locations(cafile=os.fspath(path))
    except (ssl.SSLError, OSError) as exc:
        raise _load_error(what, path, exc) from None


def server_context(spec: TlsSpec, environ: Mapping[str, str]) -> ssl.SSLContext:
    """The listener's context. Raises :class:`TlsError` (with the file at fault)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx, spec.min_version)
    cert, key = spec.paths(environ)
    _load_chain(ctx, cert, key)
    if spec.client_ca is not None:
        _load_ca(ctx, "client CA", spec.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    # One TLS 1.3 ticket per connection (OpenSSL sends two): a client resumes with the
    # last one it got (agentserver.net.connect.TlsSessions), the second costs a ticket's
    # encryption on every handshake for nothing.
    ctx.num_tickets = 1
    return ctx


def client_context(
    *,
    ca: os.PathLike[str] | str | None = None,
    cert: os.PathLike[str] | str | None = None,
    key: os.PathLike[str] | str | None = None,
) -> ssl.SSLContext:
    """A client's context: the server's certificate and name are verified against ``ca``
    (default: the system's trusted CAs); ``cert``/``key`` are presented for mutual TLS."""
    if key is not None and cert is None:
        raise TlsError("a client key needs its certificate (cert=)")
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        # Only the CA given: a private CA must not widen into trusting every public one.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_ca(ctx, "CA", ca)
    if cert is not None:
        # A key in the certificate's own file is fine (key=None).
        _load_chain(ctx, cert, key if key is not None else cert)
    # A server asking to renegotiate (TLS 1.2) is refused too.
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    return ctx


# -- who a client certificate proves (pure) --------------------------------------------


def parse_subject(text: str) -> frozenset[tuple[str, str]]:
    """``"CN=alice, O=acme"`` → its attribute pairs. Raises ValueError if malformed.
    (Commas inside values are not supported: no declared name needs them.)"""
    pairs = []
    for part in text.replace("/", ",").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{part!r} is not NAME=VALUE")
        pairs.append((name.strip(), value.strip()))
    if not pairs:
        raise ValueError("empty subject")
    return frozenset(pairs)


def subject_of(peer: Mapping | None) -> frozenset[tuple[str, str]]:
    """The subject attribute pairs of a certificate as ``SSLObject.getpeercert()``
    returns it (long attribute names shortened: commonName → CN)."""
    if not peer:
        return frozenset()
    pairs = []
    for rdn in peer.get("subject", ()):
        for name, value in rdn:
            pairs.append((_SHORT_NAMES.get(name, name), value))
    return frozenset(pairs)


def normalize_fingerprint(text: str) -> str:
    """``"sha256:AB:CD…"`` or ``"sha256:abcd…"`` → ``"sha256:abcd…"``. Raises ValueError."""
    algo, sep, digest = text.strip().partition(":")
    digest = digest.replace(":", "").lower()
    if algo.lower() != "sha256" or not sep:
        raise ValueError("a fingerprint is sha256:HEX")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("a sha256 fingerprint has 64 hexadecimal digits")
    return f"sha256:{digest}"


def fingerprint_of(der: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate, as boot.xml writes it."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


@dataclass(frozen=True, slots=True)
class CertificateRule:
    """How a declared client is recognised by its certificate: every attribute of
    ``subject`` present with that value (the certificate may carry more), and/or
    exactly this ``fingerprint``."""

    client: str
    subject: frozenset[tuple[str, str]] | None = None
    fingerprint: str | None = None

    def matches(self, subject: frozenset[tuple[str, str]], fingerprint: str) -> bool:
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            return False
        if self.subject is not None and not self.subject <= subject:
            return False
        return self.fingerprint is not None or self.subject is not None


def match_certificate(
    rules: Iterable[CertificateRule], peer: Mapping | None, der: bytes | None
) -> str | None:
    """The client a verified peer certificate proves, or None. Ambiguity (two clients
    match) proves nobody: boot.xml should say which."""
    if not der:
        return None
    subject = subject_of(peer)
    fingerprint = fingerprint_of(der)
    found = {rule.client for rule in rules if rule.matches(subject, fingerprint)}
    return found.pop() if len(found) == 1 else None
