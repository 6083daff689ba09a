"""Standard Webhooks signatures (https://www.standardwebhooks.com), made with hmac and
hashlib (pure).

A message's headers: ``webhook-id`` (the same on every attempt), ``webhook-timestamp``
(seconds since the epoch, of the attempt) and ``webhook-signature``: ``v1,`` + the base64
HMAC-SHA256 of ``{id}.{timestamp}.{body}`` under the secret, whose text form is
``whsec_`` + base64 of its bytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "whsec_"


class SecretError(ValueError):
    """A signing secret is not ``whsec_`` + base64 of at least 24 bytes."""


def secret_bytes(secret: str) -> bytes:
    """The key of ``secret`` (``whsec_`` + base64), or :class:`SecretError`."""
    if not secret.startswith(PREFIX):
        raise SecretError("a webhook secret starts with 'whsec_' (then base64)")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except ValueError as exc:
        raise SecretError("a webhook secret is 'whsec_' + base64") from exc
    if len(key) < 24:
        raise SecretError("a webhook secret has at least 24 bytes (32 recommended)")
    return key


def new_secret() -> str:
    """A fresh secret: ``whsec_`` + base64 of 32 random bytes."""
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,`` + base64 HMAC-SHA256 of ``{msg_id}.{timestamp}.{body}``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(key: bytes, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, msg_id, timestamp, body),
    }
