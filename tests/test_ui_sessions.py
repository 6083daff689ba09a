"""The web console's sign-in sessions end to end (issue 44), against the real server (a
subprocess): signing in exchanges the token for a server-side session whose random id is
all the cookie holds (``HttpOnly``, ``SameSite=Strict``, ``Path=/ui``, ``Max-Age`` from
``<http ui-session-ttl>``); the session is its client, and only that client; signing
out revokes it (the old cookie is refused everywhere: the sign-in page for pages, 401
problem+json for the console's data and events, as for an unknown id); a session outlives
a restart (the agents' store keeps it) but not a change of its client's token; two
processes on one PostgreSQL store share it; a topology without agents keeps sessions in
memory. A token in a query string is refused at every door, and no token reaches the log.
"""

from __future__ import annotations

import re
import secrets
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from httputil import http_url
from serverproc import ServerProcess, subprocess_env

from agentserver.core.namespaces import BOOT_NS

COOKIE = "agentserver_ui_session"
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210"}
TTL = 600

BOOT = f"""<organism xmlns="{BOOT_NS}" name="sessions">
  <limits hello-timeout="2" read-timeout="5" drain-timeout="1" write-timeout="2"/>
  <http ui-session-ttl="{TTL}"/>
  <clients>
    <client name="alice" token-env="S_ALICE_TOKEN" operator="true"/>
    <client name="bob" token-env="S_BOB_TOKEN" may-address="echo"/>
  </clients>
  <llm max-attempts="1" timeout="5">
    <backend name="never" provider="openai" base-url="http://127.0.0.1:9/v1"
             api-key-env="S_LLM_KEY"><model name="m"/></backend>
  </llm>
  STORE
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="assistant" handler="assistant" agent="true">
      <agent model="m" max-steps="2"/>
    </listener>
  </listeners>
</organism>
"""
SQLITE = '<store path="state/agents.sqlite3" watchdog-interval="0.2"/>'
POSTGRES = '<store url-env="S_STORE_URL" watchdog-interval="0.2" lease="1" heartbeat="0.25"/>'
PING = '<ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'


def start(directory, store: str = SQLITE, log_level: str = "warning", **env: str):
    directory.mkdir(exist_ok=True)
    boot = directory / "boot.xml"
    boot.write_text(BOOT.replace("STORE", store))
    variables = {"S_ALICE_TOKEN": TOKENS["alice"], "S_BOB_TOKEN": TOKENS["bob"]}
    variables.update(S_LLM_KEY="k", **env)
    return ServerProcess.start(
        boot,
        "--http-port",
        "0",
        env=subprocess_env(**variables),
        cwd=directory,
        timeout=30,
        log_level=log_level,
    )


def csrf_of(html: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', html)
    assert match, html[:500]
    return match.group(1)


def sign_in(client: httpx.Client, token: str) -> httpx.Response:
    csrf = csrf_of(client.get("/ui/login").text)
    return client.post("/ui/login", data={"csrf": csrf, "token": token, "next": "/ui"})


def session_cookie(response: httpx.Response) -> str:
    """The ``Set-Cookie`` of the session (the one cookie a sign-in sets besides clearing
    the pre-session token cookie)."""
    (cookie,) = [c for c in response.headers.get_list("set-cookie") if c.startswith(COOKIE)]
    return cookie


def with_cookie(url: str, session: str, timeout: float = 10) -> httpx.Client:
    """A new browser holding only ``session`` (a copied cookie)."""
    return httpx.Client(base_url=url, timeout=timeout, cookies={COOKIE: session})


def signed_in_as(client: httpx.Client) -> str | None:
    page = client.get("/ui")
    if page.status_code != 200:
        return None
    match = re.search(r"signed in as <strong>(\w+)</strong>", page.text)
    return match.group(1) if match else None


def refused_everywhere(url: str, session: str) -> None:
    """``session`` stands for no one: pages send to the sign-in, data and events 401."""
    with with_cookie(url, session) as client:
        page = client.get("/ui/agents/assistant")
        assert page.status_code == 303
        assert page.headers["location"] == "/ui/login?next=/ui/agents/assistant"
        for path in ("/ui/api/overview", "/ui/events"):
            got = client.get(path)
            assert got.status_code == 401, (path, got.text)
            assert got.headers["content-type"] == "application/problem+json"
            assert got.json()["type"].endswith("/ui-session") and "Sign in" in got.json()["title"]
        posted = client.post("/ui/send", data={"csrf": "x" * 64, "to": "echo", "xml": PING})
        assert posted.status_code == 401


def test_a_sign_in_is_a_session_not_the_token_and_signing_out_revokes_it(tmp_path):
    server = start(tmp_path, log_level="debug")
    try:
        url = http_url(server)
        with (
            httpx.Client(base_url=url, timeout=10) as alice,
            httpx.Client(base_url=url, timeout=10) as bob,
        ):
            signed = sign_in(alice, TOKENS["alice"])
            assert signed.status_code == 303 and signed.headers["location"] == "/ui"
            cookie = session_cookie(signed)
            for flag in ("HttpOnly", "SameSite=strict", "Path=/ui", f"Max-Age={TTL}"):
                assert flag in cookie, cookie
            assert "Secure" not in cookie  # plain HTTP (under <tls>: test_ui_http.py)
            for header in signed.headers.get_list("set-cookie"):
                assert TOKENS["alice"] not in header
            # The cookie that held the raw token before sessions is cleared.
            assert any(
                c.startswith('agentserver_ui_token=""') and "Max-Age=0" in c
                for c in signed.headers.get_list("set-cookie")
            )
            session = alice.cookies[COOKIE]
            assert len(session) >= 43 and session != TOKENS["alice"]
            assert signed_in_as(alice) == "alice"
            assert sign_in(bob, TOKENS["bob"]).status_code == 303
            assert signed_in_as(bob) == "bob"
            # The session is its client, and only that client: bob's shows echo only.
            overview = bob.get("/ui/api/overview").json()
            assert overview["caller"] == "bob" and overview["agents"] == []
            assert [item["name"] for item in overview["listeners"]] == ["echo"]
            # The cookie is the credential: a copy of it is alice (it is HttpOnly, and
            # SameSite=Strict keeps it off other sites' requests).
            with with_cookie(url, session) as copy:
                assert signed_in_as(copy) == "alice"
            # Pages never show a token (nor the session id).
            page = alice.get("/ui").text
            assert TOKENS["alice"] not in page and session not in page

            # Signing out revokes the session: the old cookie works nowhere, and an event
            # stream it opened (another tab) ends too (its session is checked every 5 s;
            # the bound here is the stream's 15 s keep-alives, not a clock).
            # (Reads wait up to 30 s: longer than a keep-alive's 15.)
            tab = with_cookie(url, session, timeout=30)
            with tab, tab.stream("GET", "/ui/events") as stream:
                assert stream.status_code == 200
                chunks = stream.iter_text()
                assert next(chunks).startswith(": agentserver events")
                out = alice.post("/ui/logout", data={"csrf": csrf_of(page)})
                seen = ""
                for chunk in chunks:
                    seen += chunk
                    assert seen.count(": keep-alive") < 4, "the stream outlived its session"
            assert out.status_code == 303 and out.headers["location"] == "/ui/login"
            assert any(c.startswith(f'{COOKIE}=""') for c in out.headers.get_list("set-cookie"))
            refused_everywhere(url, session)
            # An id never issued reads the same.
            refused_everywhere(url, secrets.token_urlsafe(32))
            assert signed_in_as(bob) == "bob"  # bob's own session is untouched

            # A token in a URL is refused at every door, authenticated or not, with the
            # fix; the message is not sent.
            headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
            for method, path in (
                ("GET", f"/v1/status?token={TOKENS['alice']}"),
                ("GET", "/healthz?access_token=anything"),
                ("GET", "/v1/agents?Authorization=Bearer+x"),
                ("GET", f"/ui/login?next=/ui&t={TOKENS['bob']}"),
                ("GET", f"/ui/events?api_key={TOKENS['bob']}"),
                ("POST", f"/v1/messages?to=echo&wait=false&apikey={TOKENS['alice']}"),
                ("POST", f"/a2a?{TOKENS['alice']}"),
                ("GET", "/.well-known/agent-card.json?bearer=x"),
            ):
                got = alice.request(method, path, headers=headers, content=PING)
                assert got.status_code == 401, (path, got.status_code)
                assert got.headers["content-type"] == "application/problem+json"
                body = got.json()
                assert body["type"].endswith("/token-in-query"), body
                assert "Authorization header" in body["title"]
            assert alice.get("/v1/status", headers=headers).status_code == 200
            assert alice.get("/healthz?verbose=1").status_code == 200
            status = alice.get("/v1/status", headers=headers).json()
            assert status["http"]["query_tokens"] == 8
            thread = alice.post("/v1/messages?to=echo&wait=false", headers=headers, content=PING)
            assert thread.status_code in (200, 202), thread.text
    finally:
        assert server.stop() == 0, server.stderr
    log = server.all_stderr()
    assert "web console: alice signed in" in log and "a session signed out" in log
    assert "a credential in its URL (token)" in log
    for secret in (*TOKENS.values(), session):
        assert secret not in log


def test_a_session_outlives_a_restart_but_not_its_clients_token(tmp_path):
    server = start(tmp_path)
    try:
        url = http_url(server)
        with httpx.Client(base_url=url, timeout=10) as alice:
            sign_in(alice, TOKENS["alice"])
            session = alice.cookies[COOKIE]
            csrf = csrf_of(alice.get("/ui").text)
    finally:
        assert server.stop() == 0, server.stderr

    server = start(tmp_path)
    try:
        url = http_url(server)
        with with_cookie(url, session) as again:
            assert signed_in_as(again) == "alice"
            # The form of the page served before the restart is still good: a signed-in
            # form's CSRF token comes from the session, not from the process's key.
            sent = again.post("/ui/send", data={"csrf": csrf, "to": "echo", "xml": PING})
            assert sent.status_code == 303, sent.text
            assert sent.headers["location"].startswith("/ui/threads/")
    finally:
        assert server.stop() == 0, server.stderr

    # alice's token changed in the environment: her sessions end with it.
    server = start(tmp_path, S_ALICE_TOKEN="alice-new-token-000000")
    try:
        refused_everywhere(http_url(server), session)
    finally:
        assert server.stop() == 0, server.stderr


@pytest.mark.postgresql
def test_two_processes_on_postgresql_share_a_session(tmp_path, pg_url):
    one = start(tmp_path / "one", POSTGRES, S_STORE_URL=pg_url)
    two = None
    try:
        two = start(tmp_path / "two", POSTGRES, S_STORE_URL=pg_url)
        url_one, url_two = http_url(one), http_url(two)
        with httpx.Client(base_url=url_one, timeout=10) as alice:
            sign_in(alice, TOKENS["alice"])
            session = alice.cookies[COOKIE]
            csrf = csrf_of(alice.get("/ui").text)
        with with_cookie(url_two, session) as there:
            assert signed_in_as(there) == "alice"
            # A form served by one process is posted to the other (a load balancer).
            sent = there.post("/ui/send", data={"csrf": csrf, "to": "echo", "xml": PING})
            assert sent.status_code == 303 and "/ui/threads/" in sent.headers["location"]
            out = there.post("/ui/logout", data={"csrf": csrf})
            assert out.status_code == 303
        # Signed out on the second: the first refuses the cookie too.
        refused_everywhere(url_one, session)
        refused_everywhere(url_two, session)
    finally:
        codes = [one.stop(), two.stop() if two is not None else 0]
        assert codes == [0, 0], one.stderr + (two.stderr if two else "")


def test_without_agents_sessions_are_this_processes_memory(tmp_path):
    boot = tmp_path / "boot.xml"
    boot.write_text(
        f"""<organism xmlns="{BOOT_NS}" name="plain">
  <http/>
  <clients><client name="alice" token-env="S_ALICE_TOKEN"/></clients>
  <listeners><listener name="echo" handler="echo"/></listeners>
</organism>"""
    )
    env = subprocess_env(S_ALICE_TOKEN=TOKENS["alice"])
    server = ServerProcess.start(boot, "--http-port", "0", env=env, cwd=tmp_path)
    try:
        url = http_url(server)
        with httpx.Client(base_url=url, timeout=10) as alice:
            signed = sign_in(alice, TOKENS["alice"])
            assert f"Max-Age={12 * 3600}" in session_cookie(signed)  # the default lifetime
            session = alice.cookies[COOKIE]
            assert signed_in_as(alice) == "alice"
            alice.post("/ui/logout", data={"csrf": csrf_of(alice.get("/ui").text)})
            refused_everywhere(url, session)
            sign_in(alice, TOKENS["alice"])
            kept = alice.cookies[COOKIE]
    finally:
        assert server.stop() == 0, server.stderr
    server = ServerProcess.start(boot, "--http-port", "0", env=env, cwd=tmp_path)
    try:
        # No store: a restart forgets the sessions (docs/operations.md, "Signing in").
        with with_cookie(http_url(server), kept) as again:
            location = again.get("/ui").headers["location"]
            assert parse_qs(urlsplit(location).query)["next"] == ["/ui"]
    finally:
        assert server.stop() == 0, server.stderr
