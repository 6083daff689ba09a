"""The authorization rule at every door (issue 44, docs/security.md "Who may see and act
on what"): a client sees and acts on its own, an operator on all, and another client's
object answers exactly what a missing one answers.

Two parts:

- The route table (fast): every route of the HTTP app (mounted ones included) is declared
  with its access kind (:class:`~agentserver.http.access.GuardedRoute`) and listed in
  :data:`DOORS` below with that kind; a route added without either fails.
- The doors crossed with identities (the real server, a subprocess, on SQLite and
  PostgreSQL): objects owned by alice (client A): a finished task, a task waiting for an
  approval, kept replies, a schedule, a budget, an A2A task. Bob (client B), a wrong token
  and no token must get, for each of them, byte for byte what they get for a missing
  object (the id substituted); alice and the operator (``ops``) get the object. The same
  for the A2A methods, the MCP tools, approval decisions, the event streams and the
  socket's ``<cancel>``; and every refusal is counted in ``/metrics``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from lxml import etree
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from serverproc import ServerProcess, subprocess_env

from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.http.access import KINDS, GuardedMount, GuardedRoute
from agentserver.net.client import open_client
from agentserver.primitives.approval import ApprovalDecision

PATIENCE = 40.0
ASSISTANT = "urn:agentserver:assistant"
GOV = "urn:test:gov"
TOKENS = {"alice": "alice-doors-token", "bob": "bob-doors-token", "ops": "ops-doors-token"}

BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="doors">
  <limits hello-timeout="2" read-timeout="10" drain-timeout="1" write-timeout="2"/>
  <http wait-timeout="30"/>
  <clients>
    <client name="alice" token-env="DOORS_ALICE"><budget tokens="100000" period="day"/></client>
    <client name="bob" token-env="DOORS_BOB"/>
    <client name="ops" token-env="DOORS_OPS" operator="true"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="DOORS_LLM_BASE_URL" api-key-env="DOORS_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"
         url-env="AGENTS_TEST_STORE_URL" lease="1" heartbeat="0.25"/>
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="ledger">
      <agent model="m" max-steps="6" memory="client"/>
      <policy default="allow">
        <rule priority="1" id="payments" decision="require-approval" target="ledger"
              approver="alice" timeout="10m"/>
      </policy>
    </listener>
  </listeners>
  <expose-a2a>
    <agent name="assistant"/>
  </expose-a2a>
  <expose-mcp listeners="echo"/>
</organism>
"""


# -- the table of doors -----------------------------------------------------------------

#: What a probe names: ``name`` (an agent), ``thread`` (a task's), ``kept`` (a thread the
#: gateway keeps replies for), ``schedule``, ``budget``, ``request`` (an approval's),
#: ``webhook``; the test fills them with alice's objects and with missing ones.
Ids = dict[str, str]


@dataclass(frozen=True)
class Door:
    """One route and method: its access kind, and (when it names an object) the request
    that names one: ``(path, options)`` for httpx (``json``, ``params``, ``data``)."""

    access: str
    probe: Callable[[Ids], tuple[str, dict[str, Any]]] | None = None
    #: The statuses alice (and the operator) get for alice's object.
    ok: tuple[int, ...] = (200,)
    #: It changes something: alice's and the operator's own calls are made elsewhere.
    mutates: bool = False
    #: A console page or action: signed in through the form (a cookie), not a bearer token.
    page: bool = False
    #: An owner door without a probe says which part of the test checks it instead
    #: (a listing, a stream, the A2A methods, a creation).
    checked: str = ""


def _p(path: str, **options: Any) -> Callable[[Ids], tuple[str, dict[str, Any]]]:
    return lambda ids: (path.format(**ids), dict(options))


def _form(path: str, **fields: str) -> Callable[[Ids], tuple[str, dict[str, Any]]]:
    return lambda ids: (
        path.format(**ids),
        {"data": {k: v.format(**ids) for k, v in fields.items()}},
    )


OPEN, CALLER, OWNER, OPERATOR = KINDS

#: Every route of the app, by (method, pattern). A route added to the app without an
#: entry here (with the access kind it is declared with) fails test_every_route_...
DOORS: dict[tuple[str, str], Door] = {
    ("GET", "/healthz"): Door(OPEN),
    ("GET", "/readyz"): Door(OPEN),
    ("GET", "/metrics"): Door(CALLER),
    ("POST", "/v1/messages"): Door(CALLER),
    ("GET", "/v1/threads/{thread}"): Door(OWNER, _p("/v1/threads/{kept}")),
    ("GET", "/v1/listeners"): Door(CALLER),
    ("GET", "/v1/agents"): Door(CALLER),
    ("GET", "/v1/agents/{name}/tasks/{thread}"): Door(
        OWNER, _p("/v1/agents/{name}/tasks/{thread}")
    ),
    ("POST", "/v1/agents/{name}/tasks/{thread}/fork"): Door(
        OWNER, _p("/v1/agents/{name}/tasks/{thread}/fork", json={"at_step": 1}), mutates=True
    ),
    ("GET", "/v1/events"): Door(
        OWNER, checked="events_are_the_senders"
    ),  # streams: test_... checks them below
    ("GET", "/v1/schedules"): Door(OWNER, checked="listings"),  # a listing: checked below
    ("POST", "/v1/schedules"): Door(
        OWNER, checked="alice makes her schedule"
    ),  # makes the caller's own
    ("GET", "/v1/schedules/{name}"): Door(OWNER, _p("/v1/schedules/{schedule}")),
    ("DELETE", "/v1/schedules/{name}"): Door(
        OWNER, _p("/v1/schedules/{schedule}"), ok=(204,), mutates=True
    ),
    ("POST", "/v1/schedules/{name}/{action}"): Door(
        OWNER, _p("/v1/schedules/{schedule}/pause"), mutates=True
    ),
    ("GET", "/v1/status"): Door(CALLER),
    ("GET", "/v1/steps"): Door(CALLER),
    ("POST", "/v1/drain"): Door(OPERATOR, mutates=True),
    ("GET", "/v1/drain"): Door(OPERATOR),
    ("GET", "/v1/webhooks"): Door(OPERATOR),
    ("POST", "/v1/webhooks"): Door(OPERATOR),
    ("GET", "/v1/webhooks/{name}"): Door(OPERATOR, _p("/v1/webhooks/{webhook}"), ok=(404,)),
    ("DELETE", "/v1/webhooks/{name}"): Door(OPERATOR, _p("/v1/webhooks/{webhook}"), mutates=True),
    ("POST", "/v1/webhooks/{name}/enable"): Door(
        OPERATOR, _p("/v1/webhooks/{webhook}/enable"), mutates=True
    ),
    ("GET", "/v1/budgets"): Door(OWNER, checked="listings"),  # a listing: checked below
    ("GET", "/v1/budgets/{name}"): Door(OWNER, _p("/v1/budgets/{budget}")),
    ("PUT", "/v1/budgets/{name}"): Door(
        OPERATOR, _p("/v1/budgets/{budget}", json={"tokens": 5}), mutates=True
    ),
    ("POST", "/v1/budgets/{name}/reset"): Door(
        OPERATOR, _p("/v1/budgets/{budget}/reset"), mutates=True
    ),
    ("GET", "/mcp"): Door(CALLER),
    ("POST", "/mcp"): Door(CALLER),  # the tools send as the caller: checked below
    ("DELETE", "/mcp"): Door(CALLER),
    ("GET", "/.well-known/agent-card.json"): Door(OPEN),
    ("POST", "/a2a"): Door(OWNER, checked="A2A"),  # the A2A methods: checked below
    ("POST", "/a2a/agents/{name}"): Door(OWNER, checked="A2A"),
    ("GET", "/a2a/agents/{name}/agent-card.json"): Door(OPEN),
    ("POST", "/agui/agents/{name}"): Door(OWNER, checked="AG-UI"),  # runs: checked below
    # The web console.
    ("GET", "/ui"): Door(CALLER),  # its lists: checked below
    ("GET", "/ui/login"): Door(OPEN),
    ("POST", "/ui/login"): Door(OPEN),
    ("POST", "/ui/logout"): Door(CALLER),
    ("GET", "/ui/agents/{name}"): Door(OWNER, checked="listings"),  # a listing: checked below
    ("GET", "/ui/agents/{name}/tasks/{thread}"): Door(
        OWNER, _p("/ui/agents/{name}/tasks/{thread}"), page=True
    ),
    ("GET", "/ui/threads/{thread}"): Door(OWNER, _p("/ui/threads/{kept}"), page=True),
    ("GET", "/ui/events"): Door(OWNER, checked="events_are_the_senders"),  # streams: checked below
    ("GET", "/ui/api/overview"): Door(CALLER),  # its lists: checked below
    ("GET", "/ui/api/agents/{name}"): Door(OWNER, checked="listings"),  # a listing: below
    ("GET", "/ui/api/agents/{name}/tasks/{thread}"): Door(
        OWNER, _p("/ui/api/agents/{name}/tasks/{thread}")
    ),
    ("GET", "/ui/api/threads/{thread}"): Door(OWNER, _p("/ui/api/threads/{kept}")),
    ("POST", "/ui/send"): Door(CALLER),
    ("POST", "/ui/approvals/{request}/decide"): Door(
        OWNER,
        _form("/ui/approvals/{request}/decide", agent="{name}", grant="false", next="/ui"),
        ok=(303,),
        mutates=True,
        page=True,
    ),
    ("POST", "/ui/agents/{name}/{verb:str}"): Door(
        OPERATOR,
        _form("/ui/agents/{name}/cancel", thread="{thread}", next="/ui"),
        ok=(303,),
        mutates=True,
        page=True,
    ),
    ("GET", "/ui/static"): Door(OPEN),
}


def _app_routes() -> dict[tuple[str, str], str]:
    """(method, pattern) -> access kind of every route of the app as built."""
    from agentserver.http.api import HttpContext, build_app
    from agentserver.http.auth import HttpAuth

    class _Gateway:
        max_bytes = 1 << 20

    ctx = HttpContext(
        pump=None, gateway=_Gateway(), auth=HttpAuth({}), registry=CollectorRegistry()
    )  # type: ignore[arg-type]
    found: dict[tuple[str, str], str] = {}

    def walk(routes: list[Any], prefix: str = "") -> None:
        for route in routes:
            assert isinstance(route, GuardedRoute | GuardedMount), (
                f"{prefix}{route.path} is not declared with its access kind "
                "(agentserver/http/access.py)"
            )
            if isinstance(route, GuardedMount):
                found[("GET", prefix + route.path)] = route.access
                continue
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    found[(method, prefix + route.path)] = route.access

    walk(build_app(ctx).routes)
    return found


def test_every_route_is_declared_with_its_rule_and_listed_here():
    routes = _app_routes()
    unlisted = sorted(set(routes) - set(DOORS))
    assert not unlisted, f"routes without an entry in DOORS (and its expected answers): {unlisted}"
    gone = sorted(set(DOORS) - set(routes))
    assert not gone, f"DOORS lists routes the app no longer has: {gone}"
    for key, access in routes.items():
        assert DOORS[key].access == access, (key, access)
    # Every route reaching owned objects is crossed with the identities below: by a probe
    # naming alice's object, or in the part of the test its entry names.
    for key, door in DOORS.items():
        if door.access == OWNER:
            assert door.probe is not None or door.checked, f"{key}: give it a probe"


# -- the server -----------------------------------------------------------------------------


class Model(FakeServer):
    """``pay``: asks the ledger (an approval of alice's first); anything else echoed."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        question = str(messages[-1]["content"])
        if "please pay" in question:
            return openai_ok(
                f'Paying. <pay xmlns="{GOV}"><to>erin</to><amount>3</amount></pay>', model="m"
            )
        return openai_ok("echo: " + re.sub(r"<[^>]+>", "", question).strip()[:80], model="m")


def task(text: str) -> bytes:
    return f'<task xmlns="{ASSISTANT}"><text>{text}</text></task>'.encode()


def bearer(who: str) -> dict[str, str]:
    token = TOKENS.get(who, "wrong-token")
    return {} if who == "anon" else {"Authorization": f"Bearer {token}"}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


async def until(predicate: Callable[[], Any], what: str) -> Any:
    with trio.move_on_after(PATIENCE):
        while True:
            found = await predicate()
            if found:
                return found
            await trio.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def csrf_of(html: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', html)
    assert match, html[:300]
    return match.group(1)


class Callers:
    """One HTTP client per identity (the console's signed in through its form)."""

    def __init__(self, url: str) -> None:
        self.url = url
        # A connection per request: an idle kept-alive one may be closed by the server
        # (read-timeout) just as the next request is sent on it.
        fresh = httpx.Limits(max_keepalive_connections=0)
        self.http = {
            who: httpx.AsyncClient(
                base_url=url, timeout=PATIENCE, headers=bearer(who), limits=fresh
            )
            for who in ("alice", "bob", "ops", "wrong", "anon")
        }
        #: Browsers: alice, bob and ops signed in; wrong and anon not.
        self.browser = {
            who: httpx.AsyncClient(base_url=url, timeout=PATIENCE, limits=fresh)
            for who in ("alice", "bob", "ops", "wrong", "anon")
        }
        self.csrf: dict[str, str] = {}

    async def sign_in(self) -> None:
        for who, client in self.browser.items():
            csrf = csrf_of((await client.get("/ui/login")).text)
            if who in TOKENS:
                done = await client.post(
                    "/ui/login", data={"csrf": csrf, "token": TOKENS[who], "next": "/ui"}
                )
                assert done.status_code == 303, done.text
                csrf = csrf_of((await client.get("/ui")).text)
            self.csrf[who] = csrf

    async def request(self, who: str, method: str, door: Door, ids: Ids) -> httpx.Response:
        path, options = door.probe(ids)  # type: ignore[misc]
        if door.page:
            client = self.browser[who]
            if "data" in options:
                options = {"data": {**options["data"], "csrf": self.csrf[who]}}
        else:
            client = self.http[who]
        response = await client.request(method, path, **options)
        if who in ("wrong", "anon"):
            # A success forgets this address's failed authentications (else the next
            # ones would be slowed down, as failed hellos are).
            await self.http["ops"].get("/healthz")
            assert (await self.http["ops"].get("/v1/listeners")).status_code == 200
        return response

    async def aclose(self) -> None:
        for client in (*self.http.values(), *self.browser.values()):
            await client.aclose()


def substituted(response: httpx.Response, own: Ids, missing: Ids) -> tuple[int, str, str, str]:
    """Status, content type, body and Location of ``response`` to a request for ``own``
    objects, with each id replaced by the missing one's (what a missing object answers
    names the id asked for)."""
    body = response.text
    location = response.headers.get("location", "")
    for key, value in own.items():
        if value != missing[key]:
            body = body.replace(value, missing[key])
            location = location.replace(value, missing[key])
    return response.status_code, response.headers.get("content-type", ""), body, location


def as_is(response: httpx.Response) -> tuple[int, str, str, str]:
    return (
        response.status_code,
        response.headers.get("content-type", ""),
        response.text,
        response.headers.get("location", ""),
    )


async def rpc(client: httpx.AsyncClient, method: str, params: dict, path: str = "/a2a") -> dict:
    response = await client.post(
        path,
        json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
        headers={"A2A-Version": "1.0"},
    )
    if response.status_code != 200:
        return {"http": response.status_code, "body": response.text}
    return response.json()


# -- the test -------------------------------------------------------------------------------


async def test_another_clients_objects_answer_as_missing_ones_at_every_door(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(
            DOORS_LLM_BASE_URL=model.base_url,
            DOORS_LLM_KEY="k",
            DOORS_ALICE=TOKENS["alice"],
            DOORS_BOB=TOKENS["bob"],
            DOORS_OPS=TOKENS["ops"],
            **store_env,
        )
        (tmp_path / "boot.xml").write_text(BOOT)
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                tmp_path / "boot.xml", "--http-port", "0", env=env, cwd=tmp_path, timeout=40
            )
        )
        callers = Callers(http_url(server))
        try:
            alices = await exercise(server, callers)
        finally:
            await callers.aclose()
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr
        # Refusals are logged with the client and the route, never an object's id.
        lines = [line for line in server.stderr.splitlines() if "access refused" in line]
        assert any("bob" in line for line in lines), server.stderr[-3000:]
        named = [line for line in lines if any(i in line for i in alices)]
        assert not named, named


async def exercise(server: ServerProcess, callers: Callers) -> list[str]:
    """Everything; returns the ids of alice's objects (no log line may name them)."""
    alice, bob, ops = callers.http["alice"], callers.http["bob"], callers.http["ops"]
    await callers.sign_in()

    # -- alice's objects --------------------------------------------------------------------
    thread = new_thread_id()
    done = await alice.post(
        "/v1/messages", params={"to": "assistant", "thread": thread}, content=task("hello")
    )
    assert done.status_code == 200, done.text
    kept = (
        await alice.post(
            "/v1/messages",
            params={"to": "echo", "wait": "false"},
            content=(b'<ping xmlns="urn:agentserver:echo"><text>kept</text></ping>'),
        )
    ).json()["thread"]
    paying = new_thread_id()
    sent = await alice.post(
        "/v1/messages",
        params={"to": "assistant", "thread": paying, "wait": "false"},
        content=task("please pay"),
    )
    assert sent.status_code == 202, sent.text

    async def alices_request() -> str | None:
        found = (await alice.get("/ui/api/overview")).json()["approvals"]
        return found[0]["request_id"] if found else None

    request_id = await until(alices_request, "alice's approval request is pending")
    made = await alice.post(
        "/v1/schedules",
        json={
            "name": "alice-s",
            "agent": "assistant",
            "cron": "0 0 1 1 *",
            "task": task("s").decode(),
        },
    )
    assert made.status_code == 201, made.text
    assert made.json()["owner"] == "alice"
    own: Ids = {
        "name": "assistant",
        "thread": thread,
        "kept": kept,
        "schedule": "alice-s",
        "budget": "client:alice",
        "request": request_id,
        "webhook": "alice-hook",
    }
    missing: Ids = {
        "name": "assistant",
        "thread": new_thread_id(),
        "kept": new_thread_id(),
        "schedule": "nobody-s",
        "budget": "client:nobody",
        "request": new_thread_id(),
        "webhook": "nobody-hook",
    }

    # -- every door naming an object, crossed with the identities ----------------------------
    crossed = 0
    for (method, pattern), door in DOORS.items():
        if door.probe is None:
            continue
        for who in ("bob", "wrong", "anon"):
            theirs = await callers.request(who, method, door, own)
            none = await callers.request(who, method, door, missing)
            assert substituted(theirs, own, missing) == as_is(none), (who, method, pattern)
            crossed += 1
        if door.mutates:
            continue
        for who in ("alice", "ops"):
            got = await callers.request(who, method, door, own)
            if door.access == OPERATOR and who == "alice":
                assert got.status_code == 403, (who, method, pattern, got.text[:300])
                continue
            assert got.status_code in door.ok, (who, method, pattern, got.text[:300])
            if door.access == OWNER:
                none = await callers.request(who, method, door, missing)
                # not vacuous: alice's object is there for its owner and the operator
                assert substituted(got, own, missing) != as_is(none), (who, pattern)
    assert crossed >= 3 * 15

    # What bob's refused mutations left: alice's schedule, unpaused; her budget unchanged.
    view = (await alice.get("/v1/schedules/alice-s")).json()
    assert view["paused"] is False
    assert (await alice.get("/v1/budgets/client:alice")).json()["limit"]["tokens"] == 100000
    # The approval is still alice's to decide, and pending.
    assert await alices_request() == request_id

    # -- listings: bob sees none of alice's, alice and the operator do -----------------------
    def names(doc: dict, key: str, field: str) -> set[str]:
        return {item[field] for item in doc[key]}

    assert "alice-s" not in names((await bob.get("/v1/schedules")).json(), "schedules", "name")
    for who in (alice, ops):
        assert "alice-s" in names((await who.get("/v1/schedules")).json(), "schedules", "name")
    assert "client:alice" not in names((await bob.get("/v1/budgets")).json(), "budgets", "budget")
    assert "client:alice" in names((await ops.get("/v1/budgets")).json(), "budgets", "budget")
    assert (await bob.get("/ui/api/overview")).json()["approvals"] == []
    assert request_id in json.dumps((await ops.get("/ui/api/overview")).json()["approvals"])
    for page in ("/ui", "/ui/agents/assistant"):
        bobs = (await callers.browser["bob"].get(page)).text
        assert thread not in bobs and paying not in bobs and request_id not in bobs, page
    alices = (await callers.browser["alice"].get("/ui/agents/assistant")).text
    assert thread in alices and paying in alices
    assert thread in (await callers.browser["ops"].get("/ui/agents/assistant")).text
    # The agent page's live list (JSON) is the same listing.
    bobs_list = json.dumps((await bob.get("/ui/api/agents/assistant")).json())
    assert thread not in bobs_list and paying not in bobs_list
    assert thread in json.dumps((await alice.get("/ui/api/agents/assistant")).json())
    assert thread in json.dumps((await ops.get("/ui/api/agents/assistant")).json())

    # -- approval decisions: another's request answers as an unknown one ---------------------
    async def ack(client: httpx.AsyncClient, request: str) -> str | None:
        decision = ApprovalDecision(request=request, grant=False, reason="no")
        reply = await client.post(
            "/v1/messages", params={"to": "assistant"}, content=decision.to_xml()
        )
        assert reply.status_code == 200, reply.text
        return etree.fromstring(reply.content)[1].get("status")

    assert await ack(bob, request_id) == await ack(bob, missing["request"]) == "unknown"
    assert await alices_request() == request_id

    # -- A2A: bob's methods on alice's task answer as on a missing one; ops sees it ----------
    sent_a2a = await rpc(
        alice,
        "SendMessage",
        {
            "message": {
                "messageId": "doors-1",
                "role": "ROLE_USER",
                "parts": [{"text": "hello over a2a"}],
            },
            "configuration": {"returnImmediately": True},
        },
    )
    a2a_task = sent_a2a["result"]["task"]["id"]
    a2a_missing = new_thread_id()
    probes = [
        ("GetTask", lambda t: {"id": t}),
        ("CancelTask", lambda t: {"id": t}),
        ("SubscribeToTask", lambda t: {"id": t}),
        ("ListTaskPushNotificationConfigs", lambda t: {"taskId": t}),
        ("GetTaskPushNotificationConfig", lambda t: {"taskId": t, "id": "c"}),
        ("DeleteTaskPushNotificationConfig", lambda t: {"taskId": t, "id": "c"}),
        (
            "CreateTaskPushNotificationConfig",
            lambda t: {"taskId": t, "url": "https://example.com/push"},
        ),
    ]
    for method, params in probes:
        for path in ("/a2a", "/a2a/agents/assistant"):
            for who in ("bob", "wrong", "anon"):
                theirs = await rpc(callers.http[who], method, params(a2a_task), path)
                none = await rpc(callers.http[who], method, params(a2a_missing), path)
                text = json.dumps(theirs).replace(a2a_task, a2a_missing)
                assert text == json.dumps(none), (who, method, path, theirs)
                if who != "bob":
                    await ops.get("/healthz")
                    assert (await ops.get("/v1/listeners")).status_code == 200
    got = await rpc(ops, "GetTask", {"id": a2a_task})
    assert got["result"]["id"] == a2a_task, got  # an operator sees every task
    listed = await rpc(ops, "ListTasks", {})
    assert a2a_task in json.dumps(listed)
    assert a2a_task not in json.dumps(await rpc(bob, "ListTasks", {}))
    assert (await rpc(alice, "GetTask", {"id": a2a_task}))["result"]["id"] == a2a_task

    # -- AG-UI: bob answering alice's approval (an interrupt) answers as a missing one -----
    def resume(target: str) -> dict:
        entry = {"interruptId": target, "status": "resolved", "payload": {"grant": False}}
        return {"threadId": "t", "runId": "r", "messages": [], "resume": [entry]}

    theirs_id = f"{paying}/{request_id}"
    none_id = f"{missing['thread']}/{missing['request']}"
    for who in ("bob", "wrong", "anon"):
        client = callers.http[who]
        theirs = await client.post("/agui/agents/assistant", json=resume(theirs_id))
        none = await client.post("/agui/agents/assistant", json=resume(none_id))
        assert as_is(theirs)[0] in (401, 404), (who, theirs.text)
        swapped = (*as_is(theirs)[:2], theirs.text.replace(theirs_id, none_id))
        assert swapped == as_is(none)[:3], (who, theirs.text)
        if who != "bob":
            await ops.get("/healthz")
            assert (await ops.get("/v1/listeners")).status_code == 200
    assert await alices_request() == request_id  # still pending: bob decided nothing

    # -- the socket's <cancel>: another's task answers as a missing one ---------------------
    async def cancel(client: str, target: str) -> tuple[str | None, str | None]:
        command = etree.Element(f"{{{CORE_NS}}}cancel", nsmap={None: CORE_NS})
        command.set("agent", "assistant")
        command.set("thread", target)
        async with open_client(server.host, server.port, client=client, token=TOKENS[client]) as c:
            reply = await c.request(command, timeout=PATIENCE)
        return reply.payload.tag, reply.payload.get("count")

    assert await cancel("bob", paying) == await cancel("bob", missing["thread"])
    assert (await cancel("bob", paying))[1] == "0"
    assert await alices_request() == request_id  # still pending: not cancelled
    # alice cancels her own task (a client acts on its own)
    assert (await cancel("alice", paying))[1] == "1"

    # bob's own task shows on his page, and only it
    bobs_thread = new_thread_id()
    mine = await bob.post(
        "/v1/messages", params={"to": "assistant", "thread": bobs_thread}, content=task("bob")
    )
    assert mine.status_code == 200, mine.text
    bobs = (await callers.browser["bob"].get("/ui/agents/assistant")).text
    assert bobs_thread in bobs and thread not in bobs
    assert (await bob.get(f"/v1/agents/assistant/tasks/{bobs_thread}")).status_code == 200
    # bob sends on alice's thread id: he sees his own task there, alice still hers
    alices_view = (await alice.get(f"/v1/agents/assistant/tasks/{thread}")).json()
    reused = await bob.post(
        "/v1/messages", params={"to": "assistant", "thread": thread}, content=task("same id")
    )
    assert reused.status_code == 200, reused.text
    bobs_view = (await bob.get(f"/v1/agents/assistant/tasks/{thread}")).json()
    assert bobs_view["turn"] != alices_view["turn"]
    assert (await alice.get(f"/v1/agents/assistant/tasks/{thread}")).json() == alices_view
    assert (await ops.get(f"/v1/agents/assistant/tasks/{thread}")).json()["turn"] == (
        bobs_view["turn"]
    )  # the operator reads the latest on the thread, whoever sent it
    # A fork takes the thread's latest Turn: bob's now, so alice may not fork it.
    fork = f"/v1/agents/assistant/tasks/{thread}/fork"
    assert (await alice.post(fork, json={"at_step": 1})).status_code == 404
    forked = await bob.post(fork, json={"at_step": 1})
    assert forked.status_code == 202, forked.text

    # -- MCP: the tools send as the caller; no token, no tools ------------------------------
    mcp_call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "mine"}},
    }
    mcp_headers = {
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-06-18",
    }
    for who in ("wrong", "anon"):
        refused = await callers.http[who].post("/mcp", json=mcp_call, headers=mcp_headers)
        assert refused.status_code == 401, refused.text
        await ops.get("/healthz")
        assert (await ops.get("/v1/listeners")).status_code == 200
    answered = await bob.post("/mcp", json=mcp_call, headers=mcp_headers)
    assert answered.status_code == 200 and "mine" in answered.text, answered.text

    # -- the event streams: bob receives only his own tasks' events -------------------------
    await events_are_the_senders(callers, thread)

    # -- the refusals are counted in /metrics, by door and route ----------------------------
    metrics = (await ops.get("/metrics")).text
    counted = [
        sample.labels
        for family in text_string_to_metric_families(metrics)
        if family.name == "agentserver_access_refusals"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value > 0
    ]
    assert {"http", "ui", "a2a", "socket", "approval"} <= {c["door"] for c in counted}, counted
    assert {
        "door": "http",
        "route": "POST /agui/agents/{name}",
        "client": "bob",
    } in counted, counted
    assert {
        "door": "http",
        "route": "GET /v1/agents/{name}/tasks/{thread}",
        "client": "bob",
    } in counted, counted
    return [thread, paying, kept, request_id, a2a_task]


async def read_events(
    client: httpx.AsyncClient, path: str, params: dict, out: list, opened: trio.Event
) -> None:
    async with client.stream("GET", path, params=params) as response:
        assert response.status_code == 200
        opened.set()
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event is not None:
                out.append((event, json.loads(line[6:])))


async def events_are_the_senders(callers: Callers, alices_thread: str) -> None:
    alice, bob = callers.http["alice"], callers.http["bob"]
    streams: dict[str, list] = {}
    async with trio.open_nursery() as readers:
        specs = {
            "bob-all": (callers.http["bob"], "/v1/events", {}),
            "bob-thread": (callers.http["bob"], "/v1/events", {"thread": alices_thread}),
            "bob-agent": (callers.http["bob"], "/v1/events", {"agent": "assistant"}),
            "bob-ui": (callers.browser["bob"], "/ui/events", {}),
            "ops-all": (callers.http["ops"], "/v1/events", {}),
        }
        for key, (client, path, params) in specs.items():
            streams[key] = []
            opened = trio.Event()
            readers.start_soon(read_events, client, path, params, streams[key], opened)
            with trio.fail_after(PATIENCE):
                await opened.wait()
        # alice continues her conversation; then bob sends one of his own
        again = await alice.post(
            "/v1/messages",
            params={"to": "assistant", "thread": alices_thread},
            content=task("more"),
        )
        assert again.status_code == 200, again.text
        alices_turn = (await alice.get(f"/v1/agents/assistant/tasks/{alices_thread}")).json()[
            "turn"
        ]
        bobs = new_thread_id()
        assert (
            await bob.post(
                "/v1/messages", params={"to": "assistant", "thread": bobs}, content=task("b")
            )
        ).status_code == 200
        bobs_turn = (await bob.get(f"/v1/agents/assistant/tasks/{bobs}")).json()["turn"]

        def turns(key: str) -> set[str]:
            return {d.get("agent_turn_id") for _, d in streams[key]}

        async def seen() -> bool:
            return (
                bobs_turn in turns("bob-all")
                and bobs_turn in turns("bob-agent")
                and bobs_turn in turns("bob-ui")
                and {alices_turn, bobs_turn} <= turns("ops-all")
            )

        await until(seen, "the streams carried bob's task (and the operator's both)")
        readers.cancel_scope.cancel()
    # Events are published in order: bob's streams had alice's task's events before his.
    for key in ("bob-all", "bob-thread", "bob-agent", "bob-ui"):
        assert alices_turn not in turns(key), key
        assert all(d.get("agent_turn_id") in (bobs_turn,) for _, d in streams[key]), key
    assert streams["bob-thread"] == []


def test_the_rule_itself():
    """The decision table of docs/security.md, pure: a client its own, an operator all,
    anonymous callers all only without clients; refusals reach the sink with the route."""
    from agentserver.core.access import AccessRule, sender_of
    from agentserver.http.routes.budgets import budget_owner

    told: list[tuple[str | None, str, str]] = []

    class Sink:
        def refused(self, client: str | None, door: str, route: str) -> None:
            told.append((client, door, route))

    rule = AccessRule(frozenset({"ops"}), anonymous_sees_all=False, sink=Sink())
    assert rule.decide("alice", "alice") and rule.decide("ops", "alice")
    assert not rule.decide("bob", "alice") and not rule.decide("bob", None)
    assert not rule.decide(None, "alice") and not rule.decide(None, None)
    assert rule.scope("alice") == "alice" and rule.scope("ops") is None
    assert not rule.allows("bob", "alice", door="http", route="GET /x/{id}")
    assert rule.allows("alice", "alice", door="http", route="GET /x/{id}")
    assert told == [("bob", "http", "GET /x/{id}")]
    open_rule = AccessRule()  # no <clients>: anonymous callers see all
    assert open_rule.decide(None, None) and open_rule.decide(None, "x")
    assert sender_of({"client": "alice"}) == "alice"
    assert sender_of({"speaks_for": "bob", "chain": ["bob-1a2b3c4d", "assistant"]}) == "bob"
    assert sender_of({"chain": ["client-1", "assistant"]}) is None and sender_of("x") is None
    assert budget_owner("client:alice@agent:helper") == "alice"
    assert budget_owner("client:alice") == "alice"
    assert budget_owner("agent:helper") is None and budget_owner("organism") is None
