"""Webhooks end to end (issue 36): a real server (a subprocess) on SQLite and
PostgreSQL, its agent answering through a fake model on loopback, real receivers on
loopback (tests/hookrecv.py): one failing its first five deliveries, one that hangs, one
killed and restarted. Every task's end reaches every receiver at least once, each
delivery with its id and a signature the maintained ``standardwebhooks`` package
verifies; a server SIGKILLed mid-delivery delivers again after its restart with the
same id; webhooks made at run time through ``POST /v1/webhooks``; failing webhooks in
``/v1/status`` and ``/metrics``."""

from __future__ import annotations

import pathlib
import re
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from hookrecv import Got, Receiver
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok, openai_stream
from lxml import etree
from serverproc import DATA, ServerProcess, cli, subprocess_env
from standardwebhooks.webhooks import Webhook

from agentserver.agents.edge.hooksign import new_secret

pytestmark = [pytest.mark.socket, pytest.mark.subprocess, pytest.mark.slow]

BOOT = DATA / "agents-webhooks-boot.xml"
NS = "https://xml-pipeline.org/ns/boot/v1"
TASK_NS = "urn:agentserver:assistant"
SECRET = new_secret()
PATIENCE = 40.0


def task(text: str) -> str:
    return f'<task xmlns="{TASK_NS}"><text>{text}</text></task>'


class TaskEcho(FakeServer):
    """The fake model answering each task with that task's own text ("hello N", found
    in the request), so a delivery's answer can be matched to its task."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        found = re.search(r"hello \d+", str(seen.body))
        text = f"echo: {found.group(0) if found else 'no task text'}"
        stream = isinstance(seen.body, dict) and seen.body.get("stream")
        return openai_stream([text]) if stream else openai_ok(text)


def boot_with(tmp: pathlib.Path, hooks: dict[str, tuple[str, dict[str, str]]]) -> pathlib.Path:
    """The test's boot.xml with ``<webhooks>``: name → (url, extra attributes)."""
    tree = etree.parse(str(BOOT))
    section = etree.SubElement(tree.getroot(), f"{{{NS}}}webhooks")
    for name, (url, extra) in hooks.items():
        attrs = {
            "name": name,
            "url": url,
            "events": "task.*",
            "secret-env": "HOOK_SECRET",
            "first-delay": "0.05",
            "max-delay": "0.5",
            **extra,
        }
        etree.SubElement(section, f"{{{NS}}}webhook", attrs)
    path = tmp / "boot.xml"
    tree.write(str(path), xml_declaration=True, encoding="UTF-8")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request: pytest.FixtureRequest) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


def verified(got: Got, secret: str = SECRET) -> dict[str, Any]:
    """The payload, its signature checked by the maintained implementation."""
    assert got.id.startswith("msg_")
    return Webhook(secret).verify(got.body, got.headers)


async def wait_for(cond: Callable[[], bool], within: float = PATIENCE) -> None:
    with trio.fail_after(within):
        while True:
            if cond():
                return
            await trio.sleep(0.05)


async def start_server(boot: pathlib.Path, env: dict[str, str], cwd: pathlib.Path) -> ServerProcess:
    return await trio.to_thread.run_sync(
        lambda: ServerProcess.start(boot, "--http-port", "0", env=env, cwd=cwd)
    )


async def test_every_task_end_reaches_every_receiver_with_its_id(tmp_path, store_env) -> None:
    flaky = Receiver(fail_first=5).start()
    hung = Receiver(hang=True, hang_s=3.0).start()
    good = Receiver().start()
    restarted = Receiver().start()
    receivers = {"flaky": flaky, "good": good, "restarted": restarted}
    boot = boot_with(
        tmp_path,
        {
            "flaky": (flaky.url, {}),
            "hung": (hung.url, {"timeout": "1s", "first-delay": "1000ms", "max-delay": "2s"}),
            "good": (good.url, {}),
            "restarted": (restarted.url, {}),
        },
    )
    try:
        async with trio.open_nursery() as nursery:
            model = await TaskEcho().start(nursery)
            env = subprocess_env(
                HOOKS_LLM_BASE_URL=model.base_url,
                HOOKS_LLM_KEY="k",
                HOOK_SECRET=SECRET,
                **store_env,
            )
            server = await start_server(boot, env, tmp_path)
            try:
                async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                    threads = []
                    for n in range(3):
                        sent = await client.post(
                            "/v1/messages", params={"to": "assistant"}, content=task(f"hello {n}")
                        )
                        assert sent.status_code == 200, sent.text
                        threads.append(sent.headers["Agentserver-Thread"])
                    await wait_for(lambda: len(good.ok()) >= 3)
                    restarted.stop()  # killed: refused from now on
                    for n in range(3, 6):
                        sent = await client.post(
                            "/v1/messages", params={"to": "assistant"}, content=task(f"hello {n}")
                        )
                        assert sent.status_code == 200, sent.text
                        threads.append(sent.headers["Agentserver-Thread"])
                    await trio.sleep(1.0)
                    restarted.start()  # the same port
                    for recv in receivers.values():
                        await wait_for(lambda r=recv: len(r.ids()) >= 6)

                    # The hanging receiver holds back no other, and shows as failing.
                    await wait_for(lambda: len(hung.got) >= 2)
                    status = (await client.get("/v1/status")).json()
                    hooks = {w["name"]: w for w in status["webhooks"]}
                    assert hooks["hung"]["failing"] and "timed out" in hooks["hung"]["last_error"]
                    assert hooks["good"]["failing"] is False
                    assert hooks["good"]["delivered"] >= 6
                    url = http_url(server)
                    shown = await trio.to_thread.run_sync(
                        lambda: cli("status", "--url", url, env=env)
                    )
                    assert shown.returncode == 0, shown.stderr
                    assert "hung" in shown.stdout.decode() and "FAILING" in shown.stdout.decode()
                    page = await client.get("/ui")
                    assert page.status_code == 200, page.text
                    assert '<tr data-webhook="hung" class="bad">' in page.text
                    metrics = (await client.get("/metrics")).text
                    assert (
                        'agentserver_outbox_channel_failures_total{channel="webhook:hung"}'
                        in metrics
                    )
                    listed = (await client.get("/v1/webhooks")).json()["webhooks"]
                    assert {w["name"] for w in listed} == {"flaky", "hung", "good", "restarted"}
                    assert all("secret" not in w for w in listed)
            finally:
                server.stop()
            nursery.cancel_scope.cancel()
        for name, recv in receivers.items():
            ok = recv.ok()
            payloads = [verified(g) for g in ok]
            assert {p["type"] for p in payloads} == {"task.succeeded"}, name
            assert sorted(p["data"]["thread"] for p in payloads if p["data"]["thread"]) == sorted(
                set(threads)
            ) or {p["data"]["thread"] for p in payloads} == set(threads), name
            # Each task end carries that task's answer: the model echoes the task's text.
            asked = {thread: f"hello {n}" for n, thread in enumerate(threads)}
            for p in payloads:
                assert p["data"]["answer"] == f"echo: {asked[p['data']['thread']]}", (name, p)
            # One id per task end, the same on every attempt of it.
            by_turn: dict[str, set[str]] = {}
            for g, p in zip(ok, payloads, strict=True):
                by_turn.setdefault(p["data"]["turn"], set()).add(g.id)
            assert len(by_turn) == 6 and all(len(ids) == 1 for ids in by_turn.values()), name
            for g in recv.got:  # failed attempts too: each carried its id and signature
                verified(g)
        assert len(flaky.got) >= 6 + 5
    finally:
        for recv in (flaky, hung, good, restarted):
            recv.stop()


async def test_sigkill_mid_delivery_delivers_again_with_the_same_id(tmp_path, store_env) -> None:
    recv = Receiver(hang=True, hang_s=60.0).start()
    boot = boot_with(tmp_path, {"slow": (recv.url, {"timeout": "2", "first-delay": "0.2"})})
    try:
        async with trio.open_nursery() as nursery:
            model = await FakeServer("openai").start(nursery)
            env = subprocess_env(
                HOOKS_LLM_BASE_URL=model.base_url,
                HOOKS_LLM_KEY="k",
                HOOK_SECRET=SECRET,
                **store_env,
            )
            server = await start_server(boot, env, tmp_path)
            try:
                async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                    sent = await client.post(
                        "/v1/messages", params={"to": "assistant"}, content=task("kill me")
                    )
                    assert sent.status_code == 200, sent.text
                await wait_for(lambda: len(recv.got) >= 1)  # an attempt in flight
            finally:
                server.stop(signal.SIGKILL)
            first = recv.got[0].id
            recv.hang = False
            server = await start_server(boot, env, tmp_path)
            try:
                await wait_for(lambda: len(recv.ok()) >= 1)
            finally:
                server.stop()
            nursery.cancel_scope.cancel()
        assert recv.ok()[0].id == first
        payload = verified(recv.ok()[0])
        assert payload["type"] == "task.succeeded" and payload["sequence"] == 1
    finally:
        recv.stop()


async def test_webhooks_made_at_run_time(tmp_path) -> None:
    declared = Receiver().start()
    made = Receiver().start()
    boot = boot_with(tmp_path, {"declared": (declared.url, {})})
    try:
        async with trio.open_nursery() as nursery:
            model = await FakeServer("openai").start(nursery)
            env = subprocess_env(
                HOOKS_LLM_BASE_URL=model.base_url, HOOKS_LLM_KEY="k", HOOK_SECRET=SECRET
            )
            server = await start_server(boot, env, tmp_path)
            try:
                async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                    bad = await client.post("/v1/webhooks", json={"name": "x", "url": "ftp://a"})
                    assert bad.status_code == 400
                    created = await client.post(
                        "/v1/webhooks",
                        json={
                            "name": "made",
                            "url": made.url,
                            "events": ["task.succeeded"],
                            "first_delay": 0.1,
                            # boot.xml's duration syntax, or seconds (shown in seconds)
                            "retry_for": "36h",
                            "disable_after": "7d",
                        },
                    )
                    assert created.status_code == 201, created.text
                    assert created.json()["retry_for"] == 36 * 3600.0
                    assert created.json()["disable_after"] == 7 * 86400.0
                    badly = await client.post(
                        "/v1/webhooks",
                        json={"name": "y", "url": made.url, "events": "x", "max_delay": "5w"},
                    )
                    assert badly.status_code == 400 and "max_delay" in badly.text, badly.text
                    secret = created.json()["secret"]
                    assert secret.startswith("whsec_")
                    again = await client.post(
                        "/v1/webhooks",
                        json={"name": "made", "url": made.url, "events": ["task.succeeded"]},
                    )
                    assert again.status_code == 409
                    sent = await client.post(
                        "/v1/messages", params={"to": "assistant"}, content=task("hi")
                    )
                    assert sent.status_code == 200
                    await wait_for(lambda: len(made.ok()) == 1 and len(declared.ok()) == 1)
                    assert verified(made.ok()[0], secret)["type"] == "task.succeeded"
                    one = (await client.get("/v1/webhooks/made")).json()
                    assert one["deliveries"][0]["status"] == "delivered"
                    assert (await client.delete("/v1/webhooks/declared")).status_code == 409
                    assert (await client.delete("/v1/webhooks/made")).status_code == 204
                    assert (await client.get("/v1/webhooks/made")).status_code == 404
            finally:
                server.stop()
            # Durable: made again, it survives a restart.
            server = await start_server(boot, env, tmp_path)
            try:
                async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                    created = await client.post(
                        "/v1/webhooks",
                        json={"name": "kept", "url": made.url, "events": "task.*"},
                    )
                    assert created.status_code == 201
            finally:
                server.stop()
            server = await start_server(boot, env, tmp_path)
            try:
                async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                    names = {
                        w["name"] for w in (await client.get("/v1/webhooks")).json()["webhooks"]
                    }
                    assert names == {"declared", "kept"}
            finally:
                server.stop()
            nursery.cancel_scope.cancel()
    finally:
        declared.stop()
        made.stop()


@pytest.mark.postgresql
async def test_two_processes_on_postgresql_deliver_each_event_once(tmp_path, pg_url) -> None:
    """Two servers on one database, both sending; every task's end is delivered, each by
    one of them (a claim is one process's), none twice once taken."""
    recv = Receiver(fail_first=3).start()
    boot = boot_with(tmp_path, {"both": (recv.url, {"concurrency": "2"})})
    try:
        async with trio.open_nursery() as nursery:
            model = await FakeServer("openai").start(nursery)
            env = subprocess_env(
                HOOKS_LLM_BASE_URL=model.base_url,
                HOOKS_LLM_KEY="k",
                HOOK_SECRET=SECRET,
                AGENTS_TEST_STORE_URL=pg_url,
            )
            servers = [await start_server(boot, env, tmp_path) for _ in range(2)]
            try:
                clients = [
                    httpx.AsyncClient(base_url=http_url(s), timeout=PATIENCE) for s in servers
                ]
                turns = 20
                for n in range(turns):
                    sent = await clients[n % 2].post(
                        "/v1/messages", params={"to": "assistant"}, content=task(f"t{n}")
                    )
                    assert sent.status_code == 200, sent.text
                await wait_for(lambda: len(recv.ids()) >= turns)
                await trio.sleep(1.0)  # anything delivered twice would arrive by now
                for client in clients:
                    await client.aclose()
            finally:
                for server in servers:
                    server.stop()
            nursery.cancel_scope.cancel()
        ok = recv.ok()
        assert len(ok) == turns, [g.id for g in ok]  # each once
        turns_seen = {verified(g)["data"]["turn"] for g in ok}
        assert len(turns_seen) == turns
    finally:
        recv.stop()


async def test_only_operators_see_and_change_webhooks(tmp_path) -> None:
    recv = Receiver().start()
    boot = boot_with(tmp_path, {"declared": (recv.url, {})})
    tree = etree.parse(str(boot))
    clients = etree.SubElement(tree.getroot(), f"{{{NS}}}clients")
    etree.SubElement(
        clients, f"{{{NS}}}client", name="alice", **{"token-env": "ALICE_TOKEN", "operator": "true"}
    )
    etree.SubElement(clients, f"{{{NS}}}client", name="bob", **{"token-env": "BOB_TOKEN"})
    tree.write(str(boot), xml_declaration=True, encoding="UTF-8")
    env = subprocess_env(
        HOOKS_LLM_KEY="k", HOOK_SECRET=SECRET, ALICE_TOKEN="alice-t", BOB_TOKEN="bob-t"
    )
    try:
        server = await start_server(boot, env, tmp_path)
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                assert (await client.get("/v1/webhooks")).status_code == 401
                bob = {"Authorization": "Bearer bob-t"}
                alice = {"Authorization": "Bearer alice-t"}
                assert (await client.get("/v1/webhooks", headers=bob)).status_code == 403
                made = await client.post(
                    "/v1/webhooks",
                    headers=bob,
                    json={"name": "x", "url": recv.url, "events": ["task.failed"]},
                )
                assert made.status_code == 403
                listed = await client.get("/v1/webhooks", headers=alice)
                assert [w["name"] for w in listed.json()["webhooks"]] == ["declared"]
                # /v1/status shows any caller the state, not the URL or settings.
                status = (await client.get("/v1/status", headers=bob)).json()
                [hook] = status["webhooks"]
                assert hook["name"] == "declared" and "url" not in hook
        finally:
            server.stop()
    finally:
        recv.stop()
