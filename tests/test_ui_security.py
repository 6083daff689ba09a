"""The web console's defences, sans I/O (agentserver/http/ui/security.py): CSRF tokens
bound to one session and checked with the Origin, redirect targets kept inside the
console, and the headers every page carries."""

from __future__ import annotations

from urllib.parse import urlencode

from hypothesis import given
from hypothesis import strategies as st

from agentserver.http.ui.security import CSP, CsrfGuard, page_headers, safe_next
from agentserver.http.ui.session import MAX_FIELDS, read_form

ORIGIN = "http://127.0.0.1:8080"


def test_a_token_is_good_for_its_own_session_only():
    guard = CsrfGuard()
    mine, theirs = guard.new_session(), guard.new_session()
    token = guard.token(mine)
    assert guard.check(mine, token, {}, ORIGIN)
    assert not guard.check(theirs, token, {}, ORIGIN)
    assert not guard.check(mine, None, {}, ORIGIN)
    assert not guard.check(None, token, {}, ORIGIN)
    assert not guard.check(mine, token.upper(), {}, ORIGIN)
    # Another app (another key, as after a restart) does not accept it.
    assert not CsrfGuard().check(mine, token, {}, ORIGIN)


def test_the_origin_or_else_the_referer_must_be_this_server():
    guard = CsrfGuard()
    session = guard.new_session()
    token = guard.token(session)
    assert guard.check(session, token, {"origin": ORIGIN}, ORIGIN)
    assert not guard.check(session, token, {"origin": "http://evil.example"}, ORIGIN)
    assert not guard.check(session, token, {"origin": "null"}, ORIGIN)
    assert guard.check(session, token, {"referer": ORIGIN + "/ui/agents/a"}, ORIGIN)
    assert not guard.check(session, token, {"referer": "http://evil.example/ui"}, ORIGIN)


@given(st.text(max_size=60))
def test_a_redirect_target_never_leaves_the_console(target):
    got = safe_next(target)
    assert got.startswith("/ui") and not got.startswith("//")
    assert "\r" not in got and "\n" not in got and "\\" not in got
    assert got in (target, "/ui")


def test_redirect_targets():
    assert safe_next("/ui/agents/a") == "/ui/agents/a"
    for bad in ("//evil.example", "https://evil.example/ui", "/ui\r\nSet-Cookie: x", None, ""):
        assert safe_next(bad) == "/ui"


def test_every_page_forbids_inline_scripts_framing_and_sniffing():
    headers = page_headers()
    assert headers["Content-Security-Policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe" not in CSP
    assert "frame-ancestors 'none'" in CSP
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"


def form_request(body: bytes, content_type: str = "application/x-www-form-urlencoded"):
    from starlette.requests import Request

    chunks = [body[i : i + 7] for i in range(0, len(body), 7)] or [b""]
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive():
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/ui/send",
        "headers": [(b"content-type", content_type.encode())],
        "query_string": b"",
    }
    return Request(scope, receive)


@given(st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=40), max_size=MAX_FIELDS))
async def test_a_form_reads_back_what_the_browser_encoded(fields):
    body = urlencode(fields).encode()
    assert await read_form(form_request(body), 10_000) == fields


async def test_forms_that_are_not_the_consoles_are_refused():
    assert await read_form(form_request(b"a=1", "multipart/form-data; boundary=x"), 100) is None
    assert await read_form(form_request(b"a=" + b"x" * 200), 100) is None
    assert await read_form(form_request(b"a=%ff"), 100) is None
    too_many = "&".join(f"f{i}=1" for i in range(MAX_FIELDS + 1)).encode()
    assert await read_form(form_request(too_many), 10_000) is None
    assert await read_form(form_request(b"a=1&a=2"), 100) == {"a": "1"}
