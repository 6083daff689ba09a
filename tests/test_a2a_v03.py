"""A2A 0.3 clients (issue 47, docs/a2a.md "A2A 0.3"): the official SDK at 0.3
(``a2a-sdk==0.3.26``, in a virtual environment of its own, run as a separate process:
tests/a2a_v03_client.py) against our real server (a subprocess) on SQLite and
PostgreSQL. The 0.3 method names and shapes are served beside 1.0's on the same tasks:
the card a 0.3 client reads, ``message/send`` blocking and not, ``message/stream``,
``tasks/get``, ``tasks/cancel``, ``tasks/resubscribe``, an approval answered on the
task, the push config methods; a task sent over 0.3 read over 1.0 and back; who may see
a task; and what a request gets without ``A2A-Version`` (or with one that does not fit
its method).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import trio
from httputil import http_url
from serverproc import DATA, TESTS, subprocess_env
from test_a2a_expose import ALICE, BOB, A2aModel, Receiver, run_sdk, start

CLIENT = TESTS / "a2a_v03_client.py"
#: The 0.3 SDK the client and the 0.3 remote (tests/a2a_v03_server.py) run on, and the
#: remote's ASGI server.
# One list for this fixture and .ci/run, which makes the venv before the tests (so CI's
# tests need no package index).
V03_REQUIREMENTS = pathlib.Path(__file__).parent / "data" / "a2a-v03-requirements.txt"
V03_PACKAGES = tuple(V03_REQUIREMENTS.read_text().split())
PATIENCE = 40.0


@pytest.fixture(scope="session")
def v03_python(tmp_path_factory) -> str:
    """An interpreter with the 0.3 SDK (and Hypercorn): ``AGENTSERVER_A2A_V03_PYTHON`` if
    set, else a virtual environment made once per session (pip, from the configured
    index; a failure fails the test, naming it)."""
    given = os.environ.get("AGENTSERVER_A2A_V03_PYTHON")
    if given:
        return given
    # One per session at a fixed place: test_a2a_remote.py imports this fixture too.
    venv = tmp_path_factory.getbasetemp() / "a2a-v03-venv"
    python = str(venv / "bin" / "python")
    if (venv / "installed").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", *V03_PACKAGES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"could not install {V03_PACKAGES} for A2A 0.3: {done.stderr}"
    (venv / "installed").write_text("\n".join(V03_PACKAGES))
    return python


def v03(python: str, url: str, token: str | None, *args: str) -> list[dict]:
    """Run the 0.3 client (blocking: call in a thread); its JSON lines."""
    env = subprocess_env()
    env.pop("PYTHONPATH", None)  # the 0.3 SDK's own packages, nothing of ours
    done = subprocess.run(
        [python, str(CLIENT), url, token or "-", *args],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


class Client03:
    def __init__(self, python: str, url: str) -> None:
        self.python = python
        self.url = url

    async def all(self, token: str | None, *args: str) -> list[dict]:
        return await trio.to_thread.run_sync(lambda: v03(self.python, self.url, token, *args))

    async def one(self, token: str | None, *args: str) -> dict:
        (found,) = await self.all(token, *args)
        return found

    async def raw(self, method: str, params: dict, version: str = "-") -> dict:
        answer = await self.one(ALICE, "raw", method, json.dumps(params), version)
        assert answer["status"] == 200, answer
        return answer["body"]

    async def until(self, task_id: str, wanted: str) -> dict:
        with trio.fail_after(PATIENCE):
            while True:
                got = await self.one(ALICE, "get", task_id)
                if got["status"]["state"] == wanted:
                    return got
                await trio.sleep(0.2)


def text_of(task: dict) -> str:
    return task["artifacts"][0]["parts"][0]["text"]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


def push_boot(tmp_path: pathlib.Path) -> pathlib.Path:
    """The A2A tests' boot.xml, push URLs on loopback allowed (the receiver's)."""
    boot = tmp_path / "boot.xml"
    boot.write_text(
        (DATA / "a2a-boot.xml")
        .read_text()
        .replace("<expose-a2a>", '<expose-a2a allow-private-push="true">')
    )
    return boot


async def test_a_0_3_client_on_the_same_tasks(tmp_path, store_env, v03_python):
    receiver = Receiver()
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env, boot=push_boot(tmp_path))
        try:
            url = http_url(server)
            client = Client03(v03_python, url)
            await _card(client, url)
            await _send_get_and_1_0_on_the_same_task(client, url)
            await _stream_resubscribe_cancel(client)
            await _approval(client)
            await _push_configs(client, receiver)
            await _versions_and_refusals(client)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
            receiver.server.shutdown()


async def _card(client: Client03, url: str) -> None:
    # The 0.3 SDK reads our card: its 0.3 fields name the same endpoint.
    card = await client.one(None, "card")
    assert card["url"] == url + "/a2a"
    assert card["protocolVersion"] == "0.3" and card["preferredTransport"] == "JSONRPC"
    assert {s["id"] for s in card["skills"]} == {"assistant", "planner"}
    assert card["capabilities"]["streaming"] is True
    assert card["supportsAuthenticatedExtendedCard"] is True


async def _send_get_and_1_0_on_the_same_task(client: Client03, url: str) -> None:
    # message/send, blocking: the completed task in 0.3's shape.
    task = await client.one(ALICE, "send", "What is up?", "assistant")
    assert task["kind"] == "task" and task["status"]["state"] == "completed", task
    assert text_of(task) == "You asked: What is up?"
    assert [m["role"] for m in task["history"]] == ["user", "agent"]
    # The same task over 1.0 (GetTask), and the 1.0 task over 0.3 (tasks/get).
    got = await run_sdk(url, ALICE, "get", task["id"])
    assert got[0]["status"]["state"] == "TASK_STATE_COMPLETED", got
    (sent,) = await run_sdk(url, ALICE, "send", "From 1.0", "", "planner")
    back = await client.one(ALICE, "get", sent["task"]["id"], "1")
    assert back["status"]["state"] == "completed" and text_of(back) == "You asked: From 1.0"
    assert [m["role"] for m in back["history"]] == ["agent"]
    # Non-blocking (configuration.blocking false): at once, then read back.
    now = await client.one(ALICE, "send-now", "quick one", "planner")
    assert now["status"]["state"] in ("submitted", "working"), now
    done = await client.until(now["id"], "completed")
    assert text_of(done) == "You asked: quick one"
    # Someone else's task is not found (-32001), as an unknown one is.
    assert (await client.one(BOB, "get", now["id"]))["error"] == -32001
    assert (await client.one(ALICE, "get", "nope"))["error"] == -32001
    # A message naming no skill (two exposed): InvalidParams, naming the choices.
    refused = await client.raw(
        "message/send",
        {
            "message": {
                "kind": "message",
                "messageId": "m-none",
                "role": "user",
                "parts": [{"kind": "text", "text": "hello"}],
            }
        },
    )
    assert (
        refused["error"]["code"] == -32602 and "assistant, planner" in refused["error"]["message"]
    ), refused


async def _stream_resubscribe_cancel(client: Client03) -> None:
    # message/stream: the task, working, the answer as an artifact, the final status.
    events = await client.all(BOB, "stream", "What is streaming?", "planner")
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "task" and kinds[-2:] == ["artifact-update", "status-update"], events
    assert events[-2]["artifact"]["parts"][0]["text"] == "You asked: What is streaming?"
    assert events[-1]["status"]["state"] == "completed" and events[-1]["final"] is True
    assert "working" in [e["status"]["state"] for e in events if e["kind"] == "status-update"]
    # tasks/resubscribe of a running task: follows it to its end.
    now = await client.one(ALICE, "send-now", "slow one", "planner")
    events = await client.all(ALICE, "resubscribe", now["id"])
    assert events[0]["kind"] == "task" and events[0]["id"] == now["id"], events
    assert events[-1]["status"]["state"] == "completed" and events[-1]["final"] is True
    # tasks/cancel of a running task: canceled; of an ended one: TaskNotCancelable.
    slow = await client.one(ALICE, "send-now", "slow, cancelled", "planner")
    await client.until(slow["id"], "working")
    cancelled = await client.one(ALICE, "cancel", slow["id"])
    assert cancelled["status"]["state"] == "canceled", cancelled
    assert (await client.one(ALICE, "cancel", slow["id"]))["error"] == -32002


async def _approval(client: Client03) -> None:
    # An approval: input-required, answered on the task by its approver (a data part).
    task = await client.one(ALICE, "send", "please add 2 and 3", "assistant")
    assert task["status"]["state"] == "input-required", task
    assert "calculator" in task["status"]["message"]["parts"][0]["text"]
    answered = await client.one(ALICE, "answer", task["id"], "true")
    assert answered["id"] == task["id"], answered
    done = await client.until(task["id"], "completed")
    assert text_of(done) == "The sum is 5."


def notified(receiver: Receiver, task_id: str, state: str) -> list[dict]:
    """The notifications of ``task_id`` in ``state`` the receiver took (0.3's shape)."""
    return [
        r
        for r in receiver.requests
        if not r["refused"]
        and r["body"].get("id") == task_id
        and r["body"]["status"]["state"] == state
    ]


async def _push_configs(client: Client03, receiver: Receiver) -> None:
    # A push config on the message itself (0.3's configuration.pushNotificationConfig).
    pushed = await client.one(
        ALICE, "send-push", "watched from the start", "planner", receiver.url, "tok-send"
    )
    task = await client.one(ALICE, "send-now", "slow, watched", "planner")
    config = await client.one(ALICE, "push-set", task["id"], receiver.url, "tok-03")
    config_id = config["pushNotificationConfig"]["id"]
    assert config["taskId"] == task["id"] and config["pushNotificationConfig"]["url"] == (
        receiver.url
    )
    got = await client.one(ALICE, "push-get", task["id"], config_id)
    assert got["pushNotificationConfig"]["token"] == "tok-03", got
    listed = await client.raw("tasks/pushNotificationConfig/list", {"id": task["id"]})
    assert [c["pushNotificationConfig"]["id"] for c in listed["result"]] == [config_id], listed
    # The notifications a 0.3 client set up are 0.3 Tasks (kind "task"), with its token.
    with trio.fail_after(60):
        while not (  # noqa: ASYNC110 (the receiver's thread fills it)
            notified(receiver, task["id"], "completed")
            and notified(receiver, pushed["id"], "completed")
        ):
            await trio.sleep(0.1)
    for task_id, token in ((task["id"], "tok-03"), (pushed["id"], "tok-send")):
        (sent, *_) = notified(receiver, task_id, "completed")
        assert sent["body"]["kind"] == "task", sent
        assert sent["headers"]["X-A2A-Notification-Token"] == token
    deleted = await client.raw(
        "tasks/pushNotificationConfig/delete",
        {"id": task["id"], "pushNotificationConfigId": config_id},
    )
    assert deleted.get("result") is None and "error" not in deleted, deleted
    listed = await client.raw("tasks/pushNotificationConfig/list", {"id": task["id"]})
    assert listed["result"] == [], listed
    # Bob's look at Alice's configs: not found, as the task is not his.
    assert (await client.one(BOB, "push-get", task["id"], config_id))["error"] == -32001


async def _versions_and_refusals(client: Client03) -> None:
    send = {
        "message": {
            "kind": "message",
            "messageId": "m-version",
            "role": "user",
            "parts": [{"kind": "text", "text": "versions"}],
            "metadata": {"skill": "planner"},
        },
        "configuration": {"blocking": False},
    }
    # Without A2A-Version a request is 0.3: its method names are served...
    plain = await client.raw("message/send", send)
    assert plain["result"]["kind"] == "task", plain
    # ... as with the header saying so (the same message id: the same task)...
    said = await client.raw("message/send", send, "0.3")
    assert said["result"]["id"] == plain["result"]["id"], said
    # ... and 1.0's are refused: VersionNotSupported (-32009).
    v1 = await client.raw("GetTask", {"id": plain["result"]["id"]})
    assert v1["error"]["code"] == -32009, v1
    # A 0.3 method with A2A-Version 1.0: VersionNotSupported too, naming the 1.0 method.
    mixed = await client.raw("tasks/get", {"id": plain["result"]["id"]}, "1.0")
    assert mixed["error"]["code"] == -32009 and "GetTask" in mixed["error"]["message"], mixed
    # A 1.0 method under A2A-Version 0.3: refused the same way, naming the fix.
    old = await client.raw("GetTask", {"id": plain["result"]["id"]}, "0.3")
    assert old["error"]["code"] == -32009 and "A2A-Version: 1.0" in old["error"]["message"]
    # The extended card over 0.3: in 0.3's shape, the caller's agents.
    extended = await client.raw("agent/getAuthenticatedExtendedCard", {})
    assert extended["result"]["protocolVersion"] == "0.3", extended
    assert {s["id"] for s in extended["result"]["skills"]} == {"assistant", "planner"}
    # A method 0.3 does not have (nor 1.0): not found.
    assert (await client.raw("tasks/list", {}))["error"]["code"] == -32601
    # 0.3's params checked by 0.3's schema: invalid request (-32600).
    bad = await client.raw("tasks/get", {"nope": 1})
    assert bad["error"]["code"] == -32600, bad
    # No token: the HTTP API refuses before any JSON-RPC.
    refused = await client.one(None, "raw", "tasks/get", json.dumps({"id": "x"}))
    assert refused["status"] == 401
