"""Our agents as A2A agents (issue 35, docs/a2a.md), proven with the official SDK's own
client (``a2a-sdk``, asyncio) in a separate process (tests/a2a_sdk_client.py) against our
real server (a subprocess) on SQLite and PostgreSQL: the card, SendMessage blocking and
not, a stream, GetTask, ListTasks, CancelTask, a stream resumed with SubscribeToTask
after its client was killed, input-required (an approval) answered over A2A, each
context its own conversation, the version header checked, a caller without a token
refused; and on PostgreSQL a task sent to one process read and followed on another.

The model is a scripted OpenAI-compatible server in this test's trio run that answers
from the conversation (module doc of :class:`A2aModel`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, TESTS, ServerProcess, subprocess_env
from test_agents_crash import Store

BOOT = DATA / "a2a-boot.xml"
CLIENT = TESTS / "a2a_sdk_client.py"
ASSISTANT = "urn:agentserver:assistant"
CALC = "urn:agentserver:calculator"
ALICE, BOB = "alice-token", "bob-token"
PATIENCE = 40.0


class A2aModel(FakeServer):
    """``slow``: answers after 4 s. ``add``: asks the calculator (an approval first),
    then answers the sum. ``fail``: never answers (the Turn fails at max-steps).
    ``remember X``: "Noted."; ``what did I say``: the words remembered earlier in the
    conversation. Anything else: "You asked: ..."."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        question = str(messages[-1]["content"])
        everything = "\n".join(str(m.get("content", "")) for m in messages[1:])
        if "slow" in question:
            return openai_ok("slow done", model="m", delay=4.0)
        if "fail" in everything:
            return openai_ok(f'<task xmlns="{ASSISTANT}"><text>fail again</text></task>', model="m")
        if "add" in everything:
            sums = re.findall(r"<value>(-?\d+)</value>", everything)
            if sums:
                return openai_ok(f"The sum is {sums[-1]}.", model="m")
            return openai_ok(f'<add xmlns="{CALC}"><a>2</a><b>3</b></add>', model="m")
        if "what did I say" in question:
            said = re.findall(r"remember (\w+)", everything)
            return openai_ok("You said: " + (" ".join(said) or "nothing"), model="m")
        if "remember" in question:
            return openai_ok("Noted.", model="m")
        text = re.sub(r"<[^>]+>", "", question).strip()
        return openai_ok(f"You asked: {text}", model="m")


def sdk(url: str, token: str | None, *args: str, timeout: float = PATIENCE) -> list[dict]:
    """Run the SDK's client (blocking: call in a thread); its JSON lines."""
    done = subprocess.run(
        [sys.executable, str(CLIENT), url, token or "-", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


async def run_sdk(url: str, token: str | None, *args: str) -> list[dict]:
    return await trio.to_thread.run_sync(lambda: sdk(url, token, *args))


async def one(url: str, token: str | None, *args: str) -> dict:
    (found,) = await run_sdk(url, token, *args)
    return found


def state(task: dict) -> str:
    return task["status"]["state"]


async def until(url: str, token: str, task_id: str, wanted: str) -> dict:
    """GetTask until the task is in state ``wanted``; the task."""
    with trio.fail_after(PATIENCE):
        for _ in range(10_000):
            got = await one(url, token, "get", task_id)
            if state(got) == wanted:
                return got
            await trio.sleep(0.2)
    raise AssertionError(f"{task_id} never {wanted}")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


async def start(tmp_path, model: A2aModel, store_env: dict[str, str], name: str = "a", boot=BOOT):
    env = subprocess_env(
        A2A_LLM_BASE_URL=model.base_url,
        A2A_LLM_KEY="k",
        A2A_ALICE=ALICE,
        A2A_BOB=BOB,
        **store_env,
    )
    cwd = tmp_path / name
    cwd.mkdir(exist_ok=True)
    return await trio.to_thread.run_sync(
        lambda: ServerProcess.start(boot, "--http-port", "0", env=env, cwd=cwd, timeout=40)
    )


async def test_card_send_get_list_over_the_sdk_client(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env)
        try:
            url = http_url(server)
            card = await one(url, None, "card")
            assert card["name"] == "a2a-test"
            assert card["description"] == "Agents of the A2A tests."
            # 1.0 first (the SDK's client takes it), then 0.3 at the same endpoint.
            assert card["supportedInterfaces"] == [
                {"url": url + "/a2a", "protocolBinding": "JSONRPC", "protocolVersion": v}
                for v in ("1.0", "0.3")
            ]
            assert card["capabilities"]["streaming"] is True
            assert card["capabilities"]["pushNotifications"] is True
            assert card["capabilities"]["extendedAgentCard"] is True
            assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
            skills = {s["id"]: s for s in card["skills"]}
            assert set(skills) == {"assistant", "planner"}
            assert skills["assistant"]["examples"] == [
                "What is the capital of France?",
                "Add 2 and 3.",
            ]
            assert skills["assistant"]["tags"] == ["qa", "sums"]
            assert skills["planner"]["description"] == "Plans things."
            (ext,) = card["capabilities"]["extensions"]
            assert ext["params"]["agentCards"]["planner"] == (
                url + "/a2a/agents/planner/agent-card.json"
            )

            # Blocking send: the answer as the task's artifact, completed.
            (sent,) = await run_sdk(url, ALICE, "send", "What is up?", "", "assistant")
            task = sent["task"]
            assert state(task) == "TASK_STATE_COMPLETED", task
            assert task["artifacts"][0]["parts"][0]["text"] == "You asked: What is up?"
            assert [m["role"] for m in task["history"]] == ["ROLE_USER", "ROLE_AGENT"]
            # Two skills: a message that names none is refused, naming the choices.
            (unnamed,) = await run_sdk(url, ALICE, "send", "hello")
            assert unnamed["error"] == "InvalidParamsError", unnamed
            assert "assistant, planner" in unnamed["message"]

            # Non-blocking: at once, then read back by GetTask until completed.
            (now,) = await run_sdk(url, ALICE, "send-now", "quick one", "", "planner")
            task_id = now["task"]["id"]
            assert state(now["task"]) in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
            got = await until(url, ALICE, task_id, "TASK_STATE_COMPLETED")
            assert got["artifacts"][0]["parts"][0]["text"] == "You asked: quick one"
            assert (await one(url, ALICE, "get", task_id, "1"))["history"][0]["role"] == (
                "ROLE_AGENT"
            )
            # Someone else's task is not found; so is an unknown one.
            assert (await one(url, BOB, "get", task_id))["error"] == "TaskNotFoundError"
            assert (await one(url, ALICE, "get", "nope"))["error"] == "TaskNotFoundError"
            # Bob may address the planner only: his card shows only it.
            extended = await one(url, BOB, "extended")
            assert [s["id"] for s in extended["skills"]] == ["planner"]
            listed = await one(url, ALICE, "list")
            assert {t["id"] for t in listed["tasks"]} >= {task_id, task["id"]}
            # A push URL on loopback: refused (SSRF), unless boot.xml allows it.
            refused = await one(url, ALICE, "push-set", task_id, "http://127.0.0.1:9/hook", "t")
            assert refused["error"] == "InvalidParamsError", refused
            assert "loopback or private" in refused["message"]
            # A cancel of an ended task: not cancelable.
            assert (await one(url, ALICE, "cancel", task_id))["error"] == ("TaskNotCancelableError")
            # The planner's own card addresses it alone (no skill needed).
            mine = await run_sdk(url, ALICE, "agent-card", "planner", "direct")
            assert mine[0]["supportedInterfaces"][0]["url"] == url + "/a2a/agents/planner"
            assert state(mine[1]["task"]) == "TASK_STATE_COMPLETED"
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()


async def test_stream_cancel_resubscribe_approval_and_contexts(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env)
        try:
            url = http_url(server)
            await _stream_and_resubscribe(url)
            await _cancel(url)
            await _input_required_then_approved(url)
            await _contexts(url)
            await _list_filters_before_paging(url)
            await _refusals(url)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()


async def _stream_and_resubscribe(url: str) -> None:
    # A whole stream: the task, working, the answer as an artifact, the final status.
    events = await run_sdk(url, BOB, "stream", "What is streaming?")
    kinds = [next(iter(e)) for e in events]
    assert kinds[0] == "task" and kinds[-2:] == ["artifactUpdate", "statusUpdate"], events
    assert events[-2]["artifactUpdate"]["artifact"]["parts"][0]["text"] == (
        "You asked: What is streaming?"
    )
    assert state(events[-1]["statusUpdate"]) == "TASK_STATE_COMPLETED"
    assert "TASK_STATE_WORKING" in [state(e["statusUpdate"]) for e in events if "statusUpdate" in e]

    # The client killed mid-stream: the task runs on; SubscribeToTask follows it to its end.
    proc = await trio.to_thread.run_sync(
        lambda: subprocess.Popen(
            [sys.executable, str(CLIENT), url, BOB, "stream", "slow stream"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=subprocess_env(),
        )
    )
    first = json.loads(await trio.to_thread.run_sync(proc.stdout.readline))
    task_id = first["task"]["id"]
    proc.kill()
    await trio.to_thread.run_sync(proc.wait)
    events = await run_sdk(url, BOB, "subscribe", task_id)
    assert events[0]["task"]["id"] == task_id
    assert state(events[-1]["statusUpdate"]) == "TASK_STATE_COMPLETED", events
    assert events[-2]["artifactUpdate"]["artifact"]["parts"][0]["text"] == "slow done"
    # Ended: no more subscription (GetTask reads it).
    (ended,) = await run_sdk(url, BOB, "subscribe", task_id)
    assert ended["error"] == "UnsupportedOperationError"


async def _cancel(url: str) -> None:
    (now,) = await run_sdk(url, ALICE, "send-now", "slow, to be cancelled", "", "assistant")
    task_id = now["task"]["id"]
    await until(url, ALICE, task_id, "TASK_STATE_WORKING")
    cancelled = await one(url, ALICE, "cancel", task_id)
    assert state(cancelled) == "TASK_STATE_CANCELED", cancelled
    assert state(await one(url, ALICE, "get", task_id)) == "TASK_STATE_CANCELED"
    # A failed Turn is failed, with our failure text.
    (failed,) = await run_sdk(url, ALICE, "send", "fail please", "", "assistant")
    assert state(failed["task"]) == "TASK_STATE_FAILED", failed
    assert failed["task"]["status"]["message"]["parts"][0]["text"]


async def _input_required_then_approved(url: str) -> None:
    # The sum needs alice's approval: input-required, saying what is asked.
    (sent,) = await run_sdk(url, ALICE, "send", "please add 2 and 3", "", "assistant")
    task = sent["task"]
    assert state(task) == "TASK_STATE_INPUT_REQUIRED", task
    asked = task["status"]["message"]["parts"][0]["text"]
    assert "alice" in asked and "calculator" in asked and "<add" in asked
    # Bob is not the approver (and may not address the assistant): not his task.
    assert (await one(url, BOB, "answer", task["id"], "true"))["error"] == "TaskNotFoundError"
    # Alice, the approver, answers on the task: granted, the Turn completes.
    (answered,) = await run_sdk(url, ALICE, "answer", task["id"], "true")
    assert "task" in answered, answered
    done = await until(url, ALICE, task["id"], "TASK_STATE_COMPLETED")
    assert done["artifacts"][0]["parts"][0]["text"] == "The sum is 5."


async def _contexts(url: str) -> None:
    # memory="client": each context is its own conversation.
    for context, word in (("ctx-one", "banana"), ("ctx-two", "apple")):
        (sent,) = await run_sdk(url, ALICE, "send", f"remember {word}", context, "assistant")
        assert state(sent["task"]) == "TASK_STATE_COMPLETED"
        assert sent["task"]["contextId"] == context
    (asked,) = await run_sdk(url, ALICE, "send", "what did I say", "ctx-one", "assistant")
    assert asked["task"]["artifacts"][0]["parts"][0]["text"] == "You said: banana"
    listed = await one(url, ALICE, "list", "ctx-one")
    assert len(listed["tasks"]) == 2 and {t["contextId"] for t in listed["tasks"]} == {"ctx-one"}


async def _list_filters_before_paging(url: str) -> None:
    """Alice's tasks, newest first: four completed (ctx-one, ctx-two, ctx-one, the sum),
    one failed, one canceled. The filters apply before a page is cut: a page is full
    while matches remain, and the next-page token follows the last match."""

    async def pages(*args: str) -> list[list[dict]]:
        found, token = [], ""
        while True:
            listed = await one(url, ALICE, "list", *args, token)
            found.append(listed.get("tasks", []))
            token = listed.get("nextPageToken", "")
            if not token:
                return found

    (failed,) = await pages("", "TASK_STATE_FAILED", "1")
    assert [state(t) for t in failed] == ["TASK_STATE_FAILED"]
    done = await pages("", "TASK_STATE_COMPLETED", "3")
    assert [len(p) for p in done] == [3, 1]
    assert {state(t) for p in done for t in p} == {"TASK_STATE_COMPLETED"}
    assert len({t["id"] for p in done for t in p}) == 4
    listed = await one(url, ALICE, "list", "", "TASK_STATE_COMPLETED", "3")
    assert listed["totalSize"] == 4 and listed["pageSize"] == 3
    # With a context too; and without filters, every task once over pages of two.
    one_ctx = await pages("ctx-one", "TASK_STATE_COMPLETED", "1")
    assert [len(p) for p in one_ctx] == [1, 1]
    everything = await pages("", "", "2")
    assert [len(p) for p in everything] == [2, 2, 2]
    assert len({t["id"] for p in everything for t in p}) == 6
    assert (await one(url, ALICE, "list", "", "", "2", "bogus"))["error"] == "InvalidParamsError"


async def _refusals(url: str) -> None:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "GetTask",
        "params": {"id": "x"},
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        # No token: the HTTP API's authentication refuses, before any JSON-RPC.
        refused = await http.post("/a2a", json=body, headers={"A2A-Version": "1.0"})
        assert refused.status_code == 401
        auth = {"Authorization": f"Bearer {ALICE}"}
        # No A2A-Version: taken as 0.3, refused as the spec says, naming the fix.
        old = await http.post("/a2a", json=body, headers=auth)
        assert old.json()["error"]["code"] == -32009, old.text
        assert "A2A-Version: 1.0" in old.json()["error"]["message"]
        assert "0.3 calls it tasks/get" in old.json()["error"]["message"]
        newer = await http.post("/a2a", json=body, headers={**auth, "A2A-Version": "2.0"})
        assert newer.json()["error"]["code"] == -32009
        missing = await http.post("/a2a", json=body, headers={**auth, "A2A-Version": "1.0"})
        assert missing.json()["error"]["code"] == -32001
        # A file part: content type not supported; push configs: not supported.
        file_part = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": "m-file",
                    "role": "ROLE_USER",
                    "parts": [{"url": "https://example.com/x.pdf"}],
                    "metadata": {"skill": "assistant"},
                }
            },
        }
        v1 = {**auth, "A2A-Version": "1.0"}
        assert (await http.post("/a2a", json=file_part, headers=v1)).json()["error"][
            "code"
        ] == -32005
        # Data alone, without the task's required text: refused before anything is sent.
        no_text = {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": "m-data",
                    "role": "ROLE_USER",
                    "parts": [{"data": {"note": "x"}}],
                    "metadata": {"skill": "planner"},
                }
            },
        }
        refused = (await http.post("/a2a", json=no_text, headers=v1)).json()["error"]
        assert refused["code"] == -32602 and "does not fit" in refused["message"], refused
        push = {**body, "method": "GetTaskPushNotificationConfig", "params": {"taskId": "x"}}
        assert (await http.post("/a2a", json=push, headers=v1)).json()["error"]["code"] == -32001
    # The SDK's client without a token: the card is public, the call is refused.
    (sent,) = await run_sdk(url, None, "send", "hi", "", "planner")
    assert "error" in sent, sent


@pytest.mark.postgresql
async def test_two_processes_on_postgresql_answer_for_each_others_tasks(tmp_path, pg_url):
    """A task sent to one process is read (GetTask, ListTasks), followed
    (SubscribeToTask) and cancelled through the other."""
    store = {"AGENTS_TEST_STORE_URL": pg_url}
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        first = await start(tmp_path, model, store, "one")
        second = await start(tmp_path, model, store, "two")
        try:
            one_url, two_url = http_url(first), http_url(second)
            (now,) = await run_sdk(one_url, BOB, "send-now", "slow on two processes")
            task_id = now["task"]["id"]
            events = await run_sdk(two_url, BOB, "subscribe", task_id)
            assert events[0]["task"]["id"] == task_id
            assert state(events[-1]["statusUpdate"]) == "TASK_STATE_COMPLETED", events
            got = await one(two_url, BOB, "get", task_id)
            assert got["artifacts"][0]["parts"][0]["text"] == "slow done"
            assert task_id in {t["id"] for t in (await one(two_url, BOB, "list"))["tasks"]}
            # Sent to the second, cancelled through the first.
            (other,) = await run_sdk(two_url, BOB, "send-now", "slow, cancelled elsewhere")
            await until(one_url, BOB, other["task"]["id"], "TASK_STATE_WORKING")
            cancelled = await one(one_url, BOB, "cancel", other["task"]["id"])
            assert state(cancelled) == "TASK_STATE_CANCELED", cancelled
        finally:
            await trio.to_thread.run_sync(first.stop)
            await trio.to_thread.run_sync(second.stop)
            nursery.cancel_scope.cancel()


class Receiver:
    """A client's push notification receiver on loopback (a thread): keeps every
    request (headers, body); answers 500 to the first and, while ``failing``, to all."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[dict] = []
        self.failing = False
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                refuse = receiver.failing or not receiver.requests
                receiver.requests.append(
                    {"headers": dict(self.headers), "body": json.loads(body), "refused": refuse}
                )
                self.send_response(500 if refuse else 204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self, task_id: str, wanted: str, refused: bool = False) -> list[dict]:
        return [
            r
            for r in self.requests
            if r["refused"] == refused
            and r["body"]["task"]["id"] == task_id
            and r["body"]["task"]["status"]["state"] == wanted
        ]

    async def wait_for(self, task_id: str, wanted: str, refused: bool = False) -> dict:
        with trio.fail_after(60):
            for _ in range(100_000):
                found = self.delivered(task_id, wanted, refused)
                if found:
                    return found[0]
                await trio.sleep(0.1)
        raise AssertionError("never delivered")


async def test_push_notifications_at_least_once_and_across_a_restart(tmp_path, store_env):
    receiver = Receiver()
    boot = tmp_path / "boot.xml"
    boot.write_text(
        BOOT.read_text().replace("<expose-a2a>", '<expose-a2a allow-private-push="true">')
    )
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env, boot=boot)
        try:
            url = http_url(server)
            (sent,) = await run_sdk(url, ALICE, "send-push", "What is pushed?", receiver.url, "tk")
            task_id = sent["task"]["id"]
            assert state(sent["task"]) == "TASK_STATE_COMPLETED"
            done = await receiver.wait_for(task_id, "TASK_STATE_COMPLETED")
            assert done["headers"]["X-A2A-Notification-Token"] == "tk"
            assert done["body"]["task"]["artifacts"][0]["parts"][0]["text"] == (
                "You asked: What is pushed?"
            )
            # The first POST was refused (500): the same notification came again.
            first = receiver.requests[0]
            assert first["refused"]

            def ids() -> list[str]:
                return [r["headers"]["X-A2A-Notification-Id"] for r in receiver.requests]

            # The retry comes after its backoff: another notification of the task (its
            # completion) may be delivered first (the payload's state says which is newer).
            with trio.fail_after(30):
                for _ in range(100_000):  # a thread fills receiver.requests: polled
                    if ids().count(ids()[0]) >= 2:
                        break
                    await trio.sleep(0.05)
            # Delivered from the webhooks' outbox, on the receiver's own channel.
            store = Store(tmp_path / "state" / "agents.sqlite3")  # beside boot.xml
            store.url = store_env.get("AGENTS_TEST_STORE_URL")
            origin = receiver.url.removesuffix("/hook")
            rows = store.rows("SELECT channel, delivery_id, attempts FROM outbox")
            assert (f"a2a-push:{origin}", ids()[0]) in {(r[0], r[1]) for r in rows}, rows
            # The four config methods.
            made = await one(url, ALICE, "push-set", task_id, receiver.url, "second")
            assert made["taskId"] == task_id and made["id"]
            listed = await one(url, ALICE, "push-list", task_id)
            assert {c["token"] for c in listed["configs"]} == {"tk", "second"}
            got = await one(url, ALICE, "push-get", task_id, made["id"])
            assert got["url"] == receiver.url
            await one(url, ALICE, "push-delete", task_id, made["id"])
            assert len((await one(url, ALICE, "push-list", task_id))["configs"]) == 1
            assert (await one(url, BOB, "push-list", task_id))["error"] == "TaskNotFoundError"

            # Owed while the receiver fails; the server restarts; delivered by the next.
            receiver.failing = True
            (slow,) = await run_sdk(url, ALICE, "send-push", "slow push", receiver.url, "tk2")
            slow_id = slow["task"]["id"]
            assert state(slow["task"]) == "TASK_STATE_COMPLETED"
            # Tried (and refused) before the restart: owed, not delivered.
            await receiver.wait_for(slow_id, "TASK_STATE_COMPLETED", refused=True)
        finally:
            await trio.to_thread.run_sync(server.stop)
        receiver.failing = False
        again = await start(tmp_path, model, store_env, boot=boot)
        try:
            done = await receiver.wait_for(slow_id, "TASK_STATE_COMPLETED")
            assert done["headers"]["X-A2A-Notification-Token"] == "tk2"
        finally:
            await trio.to_thread.run_sync(again.stop)
            receiver.server.shutdown()
            nursery.cancel_scope.cancel()
