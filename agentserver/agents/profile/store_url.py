"""``<store url>``: the PostgreSQL URL's form, how it is shown, and whether it answers.

Pure except :func:`probe` (which connects). The URL is libpq's (``postgresql://`` or
``postgres://``, with libpq's query parameters); a password belongs in ``url-env``'s
variable or libpq's ``PGPASSWORD``/``.pgpass``, and never in a log line.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("postgresql", "postgres")


class StoreUrlError(ValueError):
    """A ``<store url>`` that is not a PostgreSQL URL libpq accepts."""


def check_url(url: str) -> str:
    """``url`` unchanged if it is a PostgreSQL URL libpq parses; else StoreUrlError
    (whose text never shows the password)."""
    import psycopg

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise StoreUrlError(f"store url is not a URL ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise StoreUrlError(
            f"store url {redact(url)!r} must start with postgresql:// (or postgres://)"
        )
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        why = redact_text(exc, url)
        raise StoreUrlError(f"store url {redact(url)!r} is invalid: {why}") from None
    return url


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable url>"
    if not password:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def redact_text(exc: BaseException, url: str) -> str:
    """The text of ``exc`` without the password of ``url``."""
    text = str(exc).strip()
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def probe(url: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    """Connect once: (True, server version) or (False, why not). Blocking."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=max(1, round(timeout_s))) as conn:
            version = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as exc:
        return False, redact_text(exc, url) or type(exc).__name__
    return True, f"PostgreSQL {version[0] if version else '?'}"
