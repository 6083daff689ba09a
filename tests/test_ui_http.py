"""The web console's protections and actions over plain HTTP, against the real server (a
subprocess) and the scripted model: the login, the CSRF and Origin checks, the CSP and
the escaping in the HTML as sent, approval decisions settled as ``/approve`` and
``/deny`` are (the first wins, a second is told; only the approver), stop for operators
only, and an approval decided through ``POST /v1/messages`` by its approver."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import httpx
import trio
from httputil import http_url
from llm_fakes import openai_ok
from serverproc import DATA, REPO, ServerProcess, subprocess_env
from tlsutil import make_pki, with_tls
from ui_support import BOOT, TOKENS, ConsoleServer, pay

from agentserver.primitives.approval import ApprovalDecision

PATIENCE = 30


def csrf_of(html: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', html)
    assert match, html[:500]
    return match.group(1)


def notice(response: httpx.Response) -> str:
    assert response.status_code == 303, response.text
    return parse_qs(urlsplit(response.headers["location"]).query).get("notice", [""])[0]


async def signed_in(client: httpx.AsyncClient, who: str) -> str:
    """Sign ``client`` in as ``who`` through the login form; its CSRF token."""
    page = await client.get("/ui/login")
    csrf = csrf_of(page.text)
    response = await client.post(
        "/ui/login", data={"csrf": csrf, "token": TOKENS[who], "next": "/ui"}
    )
    assert response.status_code == 303 and response.headers["location"] == "/ui"
    return csrf_of((await client.get("/ui")).text)


async def until(predicate, what: str):
    with trio.move_on_after(PATIENCE):
        while True:
            found = await predicate()
            if found:
                return found
            await trio.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


async def pending(client: httpx.AsyncClient) -> list[dict]:
    return (await client.get("/ui/api/overview")).json()["approvals"]


async def test_the_console_refuses_strangers_forged_posts_and_inline_scripts(tmp_path):
    console = ConsoleServer(tmp_path)
    async with trio.open_nursery() as nursery:
        try:
            await console.start(nursery)
            async with httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as anon:
                # Not signed in: pages send to the login, data and events are refused.
                page = await anon.get("/ui/agents/assistant")
                assert page.status_code == 303
                assert page.headers["location"] == "/ui/login?next=/ui/agents/assistant"
                assert (await anon.get("/ui/api/overview")).status_code == 401
                assert (await anon.get("/ui/events")).status_code == 401
                login = await anon.get("/ui/login")
                csrf = csrf_of(login.text)
                wrong = await anon.post(
                    "/ui/login", data={"csrf": csrf, "token": "nope", "next": "/ui"}
                )
                assert wrong.headers["location"].startswith("/ui/login?failed=1")
                # A token is also no way in without the form's CSRF token.
                forged = await anon.post("/ui/login", data={"token": TOKENS["alice"]})
                assert forged.status_code == 403
                assert "agentserver_ui_session=" not in forged.headers.get("set-cookie", "")

            async with httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as alice:
                csrf = await signed_in(alice, "alice")
                page = await alice.get("/ui")
                assert page.status_code == 200
                csp = page.headers["content-security-policy"]
                assert "script-src 'self'" in csp and "unsafe-inline" not in csp
                assert page.headers["x-frame-options"] == "DENY"
                # No inline script: every script element is an empty one with a src.
                scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
                assert scripts and all("src=" in a and body == "" for a, body in scripts)
                # The browser holds a session id, never the token (issue 44).
                jar = {c.name: c.value for c in alice.cookies.jar}
                assert "agentserver_ui_session" in jar and "agentserver_ui_token" not in jar
                assert TOKENS["alice"] not in "".join(jar.values())
                # The script and stylesheet come from the package.
                js = await alice.get("/ui/static/ui.js")
                assert js.status_code == 200 and "EventSource" in js.text
                assert "innerHTML" not in js.text
                assert (await alice.get("/ui/static/ui.css")).status_code == 200

                task = {"to": "assistant", "text": "hello", "next": "/ui"}
                # Without the token, with another session's, or from another origin: refused.
                assert (await alice.post("/ui/send", data=task)).status_code == 403
                other = httpx.AsyncClient(base_url=console.url, timeout=PATIENCE)
                async with other:
                    other_csrf = csrf_of((await other.get("/ui/login")).text)
                assert other_csrf != csrf
                refused = await alice.post("/ui/send", data={**task, "csrf": other_csrf})
                assert refused.status_code == 403
                cross = await alice.post(
                    "/ui/send",
                    data={**task, "csrf": csrf},
                    headers={"Origin": "http://evil.example"},
                )
                assert cross.status_code == 403
                assert console.model.requests == []  # nothing of it reached the agent

                # A client's text is escaped in the HTML as sent.
                console.model.push(openai_ok("a <b>bold & <i>risky answer", model="m"))
                sent = await alice.post(
                    "/ui/send",
                    data={**task, "csrf": csrf, "text": '<img src=x onerror="alert(1)">'},
                    headers={"Origin": console.url},
                )
                assert sent.status_code == 303
                location = sent.headers["location"]
                assert location.startswith("/ui/agents/assistant/tasks/")
                api = location.replace("/ui/agents/", "/ui/api/agents/")

                async def finished():
                    doc = (await alice.get(api)).json()
                    return doc if doc["task"] and doc["task"]["status"] == "succeeded" else None

                await until(finished, "the task succeeded")
                html = (await alice.get(location)).text
                assert "<img" not in html and "<b>" not in html and "<i>" not in html
                # The answer's text, and the task's XML (its text escaped once in it).
                assert "a &lt;b&gt;bold &amp; &lt;i&gt;risky answer" in html
                assert "&amp;lt;img src=x onerror=&#34;alert(1)&#34;&amp;gt;" in html
                # A finished task reads as one: its text, its state, its answer; no live
                # badge, no Stop or Cancel (alice is an operator).
                assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;</blockquote>" in html
                assert re.search(r'id="task-status"[^>]*>succeeded<', html)
                assert re.search(r'<pre id="answer" class="answer">a &lt;b&gt;bold', html)
                assert 'id="live"' not in html and 'id="controls"' not in html
                assert "/stop" not in html and "/cancel" not in html
                assert 'data-finished="true"' in html
                # The agent's list: the task's text and outcome, not its inbox status.
                listed = (await alice.get("/ui/agents/assistant")).text
                assert re.search(r'title="thread [^"]+">&lt;img src=x onerror=', listed)
                assert 'class="badge succeeded">succeeded<' in listed
                assert "consumed" not in listed
                # The same list as JSON, for the page's script (and only for the signed-in).
                tasks = (await alice.get("/ui/api/agents/assistant")).json()["tasks"]
                assert [(t["summary"], t["state"]) for t in tasks][-1] == (
                    '<img src=x onerror="alert(1)">',
                    "succeeded",
                )
                async with httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as anon:
                    assert (await anon.get("/ui/api/agents/assistant")).status_code == 401
                assert (await alice.get("/ui/api/agents/nobody")).status_code == 404
                # The backends' counters in words, no Python reprs.
                calls = re.search(r'<td class="calls">([^<]*)</td>', (await alice.get("/ui")).text)
                assert calls and "1 request, 1 succeeded, 0 failed" in calls.group(1), calls
                assert "no errors" in calls.group(1) and "{" not in calls.group(1)
                # A redirect never leaves the console.
                away = await alice.post(
                    "/ui/send", data={**task, "csrf": csrf, "to": "", "next": "//evil.example/"}
                )
                assert away.headers["location"].startswith("/ui?notice=")
        finally:
            code = await trio.to_thread.run_sync(console.stop)
            nursery.cancel_scope.cancel()
    assert code == 0, console.server.stderr if console.server else ""


async def test_approvals_settle_once_only_by_the_approver_and_stop_is_for_operators(tmp_path):
    console = ConsoleServer(tmp_path)
    console.model.push(
        openai_ok(f"Paying. {pay('bob', '5')}", model="m"),
        openai_ok("Paid bob.", model="m"),
        openai_ok(f"Paying. {pay('dave', '9')}", model="m"),
        openai_ok("Dave is paid.", model="m"),
    )
    async with trio.open_nursery() as nursery:
        try:
            await console.start(nursery)
            async with (
                httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as alice,
                httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as bob,
            ):
                alice_csrf = await signed_in(alice, "alice")
                bob_csrf = await signed_in(bob, "bob")
                sent = await bob.post(
                    "/ui/send",
                    data={"csrf": bob_csrf, "to": "assistant", "text": "pay bob 5"},
                )
                task_page = sent.headers["location"]
                (request,) = await until(lambda: pending(alice), "the approval request")
                assert request["target"] == "ledger" and request["approver"] == "alice"
                assert "<to>bob</to>" in request["payload"]
                decide = f"/ui/approvals/{request['request_id']}/decide"
                form = {"agent": "assistant", "next": task_page}

                # bob sees it but is not its approver: told so, nothing changes.
                assert "Only alice may decide this one." in (await bob.get(task_page)).text
                assert "may decide this one" not in (await alice.get(task_page)).text
                told = await bob.post(decide, data={**form, "csrf": bob_csrf, "grant": "true"})
                assert notice(told).startswith("Only the request's approver")
                assert len(await pending(alice)) == 1
                # alice approves; a second decision (her deny) is told it came too late.
                first = await alice.post(decide, data={**form, "csrf": alice_csrf, "grant": "true"})
                assert notice(first) == f"Approved: request {request['request_id']}."
                second = await alice.post(
                    decide,
                    data={**form, "csrf": alice_csrf, "grant": "false", "reason": "no"},
                )
                assert "already decided" in notice(second)
                api = task_page.replace("/ui/agents/", "/ui/api/agents/")

                async def answered():
                    doc = (await bob.get(api)).json()
                    return doc if doc["replies"] else None

                doc = await until(answered, "the answer")
                assert doc["replies"][0]["text"] == "Paid bob."
                assert console.paid() == ["bob 5"]  # the tool ran once
                (approval,) = doc["log"]["approvals"]
                assert approval["status"] == "forwarded" and approval["decided_by"] == "alice"

                # The API: alice's decision over POST /v1/messages is hers, as on her socket.
                sent = await bob.post(
                    "/ui/send", data={"csrf": bob_csrf, "to": "assistant", "text": "pay dave"}
                )
                (request,) = await until(lambda: pending(alice), "the second request")
                decision = ApprovalDecision(request=request["request_id"], grant=True)
                acked = await alice.post(
                    "/v1/messages",
                    params={"to": "assistant"},
                    content=decision.to_xml(),
                    headers={"Authorization": f"Bearer {TOKENS['alice']}"},
                )
                assert acked.status_code == 200, acked.text
                assert b'status="applied"' in acked.content
                await until(lambda: _paid(console, "dave 9"), "dave paid")

                # Stop and cancel: alice is an operator, bob is not.
                stop = "/ui/agents/assistant/stop"
                refused = await bob.post(stop, data={"csrf": bob_csrf, "next": "/ui"})
                assert notice(refused) == "Only an operator may stop."
                done = await alice.post(stop, data={"csrf": alice_csrf, "next": "/ui"})
                assert notice(done) == "stop: nothing to stop for assistant."
                console.model.push(openai_ok(f"Paying. {pay('erin', '3')}", model="m"))
                sent = await bob.post(
                    "/ui/send", data={"csrf": bob_csrf, "to": "assistant", "text": "pay erin"}
                )
                thread = sent.headers["location"].rsplit("/", 1)[1]
                await until(lambda: pending(alice), "erin's request")
                cancel = "/ui/agents/assistant/cancel"
                form = {"thread": thread, "next": "/ui"}
                refused = await bob.post(cancel, data={**form, "csrf": bob_csrf})
                assert notice(refused) == "Only an operator may cancel."
                done = await alice.post(cancel, data={**form, "csrf": alice_csrf})
                assert notice(done) == "cancel: 1 task(s) of assistant ended."
                api = f"/ui/api/agents/assistant/tasks/{thread}"
                await until(lambda: _task_status(bob, api, "stopped"), "the task stopped")
                assert "erin 3" not in console.paid()
                # Stopped by an operator: cancelled, saying how, and over.
                page = (await alice.get(f"/ui/agents/assistant/tasks/{thread}")).text
                assert re.search(r'id="task-status"[^>]*>cancelled<', page)
                assert '<span id="task-detail" class="detail">stopped</span>' in page
                assert "pay erin" in page and "/cancel" not in page
        finally:
            code = await trio.to_thread.run_sync(console.stop)
            nursery.cancel_scope.cancel()
    assert code == 0, console.server.stderr if console.server else ""


async def _paid(console: ConsoleServer, line: str) -> bool:
    return line in console.paid()


async def _task_status(client: httpx.AsyncClient, api: str, status: str) -> dict | None:
    doc = (await client.get(api)).json()
    return doc if doc["task"] and doc["task"]["status"] == status else None


async def test_without_clients_loopback_callers_need_no_sign_in_and_may_stop(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                REPO / "boot.xml", "--http-port", "0", env=subprocess_env(), cwd=tmp_path
            )
        )
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as anon:
                page = await anon.get("/ui")
                assert page.status_code == 200 and "Sign out" not in page.text
                assert 'href="/ui/agents/assistant"' in page.text
                csrf = csrf_of(page.text)
                stop = await anon.post(
                    "/ui/agents/assistant/stop", data={"csrf": csrf, "next": "/ui"}
                )
                assert notice(stop) == "stop: nothing to stop for assistant."
                ping = '<ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
                echo = await anon.post("/ui/send", data={"csrf": csrf, "to": "echo", "xml": ping})
                location = echo.headers["location"]
                assert location.startswith("/ui/threads/") and location.endswith("?to=echo")
                api = location.split("?")[0].replace("/ui/threads/", "/ui/api/threads/")
                replies = await until(lambda: _replies(anon, api), "the echo's reply")
                assert replies[0]["from"] == "echo" and replies[0]["text"] == "hi"
        finally:
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    assert code == 0, server.stderr


async def _replies(client: httpx.AsyncClient, api: str) -> list | None:
    return (await client.get(api)).json()["replies"] or None


def test_under_tls_the_console_is_https_and_its_cookies_are_secure(tmp_path):
    pki = make_pki(tmp_path / "pki")
    boot = with_tls(
        DATA / "clients-boot.xml",
        tmp_path / "boot.xml",
        cert=str(pki.cert_file),
        key=str(pki.key_file),
    )
    proc = ServerProcess.start(
        boot, "--http-port", "0", env=subprocess_env(E2E_ALICE_TOKEN="alice-token")
    )
    try:
        url = http_url(proc)
        assert url.startswith("https://")
        with httpx.Client(base_url=url, verify=pki.client_context(), timeout=10) as client:
            login = client.get("/ui/login")
            assert "Secure" in login.headers["set-cookie"]
            signed = client.post(
                "/ui/login",
                data={"csrf": csrf_of(login.text), "token": "alice-token", "next": "/ui"},
                headers={"Origin": url},
            )
            assert signed.status_code == 303
            cookies = signed.headers.get_list("set-cookie")
            assert not any("alice-token" in c for c in cookies)
            (cookie,) = [c for c in cookies if c.startswith("agentserver_ui_session=")]
            for flag in ("HttpOnly", "Secure", "SameSite=strict", "Path=/ui"):
                assert flag in cookie
            page = client.get("/ui")
            assert page.status_code == 200 and "signed in as <strong>alice</strong>" in page.text
    finally:
        assert proc.stop() == 0, proc.stderr


# Two agents with task payloads of their own: <record><text> (one text field) and the
# calculator's <add> (two integers).
OWN_TASKS = BOOT.replace(
    "  </listeners>",
    """    <listener name="scribe" handler="agents_crash_support:agent_placeholder" agent="true">
      <accepts type="e2e_handlers:Record"/>
      <responds type="e2e_handlers:Note"/>
      <agent model="m" max-steps="2"/>
    </listener>
    <listener name="adder" handler="agents_crash_support:agent_placeholder" agent="true">
      <accepts type="calculator.add"/>
      <responds type="calculator.sum"/>
      <agent model="m" max-steps="2"/>
    </listener>
  </listeners>""",
)


async def test_an_agents_page_sends_the_agents_own_task_type(tmp_path):
    console = ConsoleServer(tmp_path, OWN_TASKS)
    async with trio.open_nursery() as nursery:
        try:
            await console.start(nursery)
            async with httpx.AsyncClient(base_url=console.url, timeout=PATIENCE) as alice:
                csrf = await signed_in(alice, "alice")
                origin = {"Origin": console.url}

                async def sent(to: str, **fields: str) -> httpx.Response:
                    data = {"csrf": csrf, "to": to, "next": f"/ui/agents/{to}", **fields}
                    return await alice.post("/ui/send", data=data, headers=origin)

                async def task_of(location: str) -> dict:
                    api = location.replace("/ui/agents/", "/ui/api/agents/")

                    async def stored():
                        return (await alice.get(api)).json()["task"]

                    return await until(stored, f"the task of {location} is stored")

                # <record> has one text field: the page asks for text, which fills it.
                page = (await alice.get("/ui/agents/scribe")).text
                assert 'id="task-text" name="text"' in page and "task-xml" not in page
                response = await sent("scribe", text="note this")
                location = response.headers["location"]
                assert location.startswith("/ui/agents/scribe/tasks/"), notice(response)
                await task_of(location)  # the agent took it: no <huh> for the wrong type

                # <add> has two fields: the page asks for XML, prefilled with an example.
                page = (await alice.get("/ui/agents/adder")).text
                assert 'id="task-xml" name="xml"' in page and "task-text" not in page
                example = (
                    "&lt;add xmlns=&#34;urn:agentserver:calculator&#34;&gt;&lt;a&gt;...&lt;/a&gt;"
                )
                assert example in page, page
                refused = await sent("adder", text="two and two")
                assert notice(refused) == "A task for adder is XML: write it as a payload."
                add = '<add xmlns="urn:agentserver:calculator"><a>2</a><b>2</b></add>'
                response = await sent("adder", xml=add)
                location = response.headers["location"]
                assert location.startswith("/ui/agents/adder/tasks/"), notice(response)
                await task_of(location)

                # The bundled assistant's page is as it was: text into <task><text>.
                page = (await alice.get("/ui/agents/assistant")).text
                assert 'id="task-text" name="text"' in page
        finally:
            code = await trio.to_thread.run_sync(console.stop)
            nursery.cancel_scope.cancel()
    assert code == 0, console.server.stderr if console.server else ""
