"""Who an HTTP caller is: the socket's rules with a bearer token for the hello.

With clients declared, every request needs ``Authorization: Bearer <token>`` of one of
them (the token names the client). Without, callers are anonymous and served only from a
loopback address (the peer's address is checked, whatever the listening address).
Sans I/O: the app passes the header and the peer address in.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from collections.abc import Mapping

from agentserver.core.handshake import Credential, Identity, Unauthenticated


# Cached: parsing an address costs ~40 us here, as much as Starlette's whole routing, and
# an API's callers come from few addresses. Bounded, and a pure function of the string.
@functools.lru_cache(maxsize=1024)
def is_loopback_peer(peer: str | None) -> bool:
    """A peer address (never a name) on loopback, an IPv4-mapped one included."""
    if not peer:
        return False
    try:
        address = ipaddress.ip_address(peer.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class AnonymousRefused(Unauthenticated):
    """An anonymous caller from a non-loopback address."""


class HttpAuth:
    def __init__(self, clients: Mapping[str, Credential]) -> None:
        # Clients whose token variable is unset cannot authenticate (as on the socket).
        self._tokens = [
            (name, cred.token.encode("utf-8"), cred.allowed)
            for name, cred in clients.items()
            if cred.token
        ]
        self.required = bool(clients)
        self._by_name = {name: (token, allowed) for name, token, allowed in self._tokens}

    def identify(self, authorization: str | None, peer: str | None) -> Identity:
        """The caller's identity. Raises :class:`Unauthenticated` (a missing, malformed or
        unknown token) or :class:`AnonymousRefused`. The reason is for the log only."""
        if not self.required:
            if not is_loopback_peer(peer):
                raise AnonymousRefused(f"anonymous caller from {peer}")
            return Identity(None)
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Unauthenticated("no bearer token")
        token = given.strip().encode("utf-8")
        found: Identity | None = None
        # Every token is compared, so timing does not tell how far the search went.
        for name, expected, _ in self._tokens:
            if hmac.compare_digest(token, expected) and found is None:
                found = self.identity_of(name)
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found

    def session_proof(self, name: str, session: str) -> str | None:
        """What a console session of client ``name`` keeps on the server (issue 44): an
        HMAC of the session id under the client's token. None: no such client with a
        token. The token itself is never stored, and the proof alone (without the session
        id, which is only in the browser's cookie) tells nothing about it."""
        found = self._by_name.get(name)
        if found is None:
            return None
        return hmac.new(found[0], session.encode("utf-8"), hashlib.sha256).hexdigest()

    def session_identity(self, name: str, session: str, proof: str) -> Identity | None:
        """The identity a console session stands for, the same one a bearer token of
        client ``name`` gets; None if the client is gone or its token changed since the
        session was made (``proof`` no longer matches)."""
        expected = self.session_proof(name, session)
        if expected is None or not hmac.compare_digest(expected, proof):
            return None
        return self.identity_of(name)

    def identity_of(self, name: str) -> Identity:
        """The identity of declared client ``name`` (with a token): the one object both its
        bearer token and its console sessions stand for."""
        return Identity(name, self._by_name[name][1])

    def is_token(self, value: str) -> bool:
        """Whether ``value`` is a declared client's token (a query string is checked for
        one: a token in a URL is refused wherever it is)."""
        given = value.strip().encode("utf-8")
        if not given:
            return False
        found = False
        for _, expected, _ in self._tokens:
            found |= hmac.compare_digest(given, expected)
        return found
