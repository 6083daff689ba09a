"""An A2A task removed by the store's retention (issue 43; docs/a2a.md): its record stays
while its tombstone does, and every A2A read of it answers TaskNotFound naming retention,
never an internal error; ``ListTasks`` leaves it out; the same message again is refused
with a clear error. The real server (a subprocess) on SQLite and PostgreSQL, the pruner
running every second with a one-second window, raw JSON-RPC over httpx."""

from __future__ import annotations

import re

import httpx
import trio
from httputil import http_url
from serverproc import DATA
from test_a2a_expose import ALICE, BOB, A2aModel, start, store_env  # noqa: F401 (a fixture)

PATIENCE = 40.0
RETENTION = (
    '<retention finished-tasks="1s" keep-last="0" events="1s" acknowledged-replies="1s" '
    'step-log="1s" interval="1s"/>'
)


def boot_with_retention(tmp_path) -> object:
    """tests/data/a2a-boot.xml with the retention above inside its ``<store>``."""
    text = (DATA / "a2a-boot.xml").read_text()
    text = re.sub(r"(<store [^>]*?)\s*/>", lambda m: f"{m.group(1)}>{RETENTION}</store>", text)
    assert RETENTION in text
    boot = tmp_path / "a2a-retention-boot.xml"
    boot.write_text(text)
    return boot


async def rpc(http: httpx.AsyncClient, method: str, params: dict, token: str = ALICE) -> dict:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    headers = {"Authorization": f"Bearer {token}", "A2A-Version": "1.0"}
    return (await http.post("/a2a", json=body, headers=headers)).json()


def message(message_id: str) -> dict:
    return {
        "message": {
            "messageId": message_id,
            "role": "ROLE_USER",
            "parts": [{"text": "quick one"}],
            "metadata": {"skill": "planner"},
        }
    }


async def test_a_pruned_a2a_task_reads_not_found_never_an_internal_error(tmp_path, store_env):  # noqa: F811
    boot = boot_with_retention(tmp_path)
    async with trio.open_nursery() as nursery:
        model = await A2aModel().start(nursery)
        server = await start(tmp_path, model, store_env, boot=boot)
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=30) as http:
                sent = await rpc(http, "SendMessage", message("m-pruned"))
                task = sent["result"]["task"]
                assert task["status"]["state"] == "TASK_STATE_COMPLETED", sent
                # Bounded wait for the pruner (every second, a one-second window).
                with trio.fail_after(PATIENCE):
                    for _ in range(10_000):
                        got = await rpc(http, "GetTask", {"id": task["id"]})
                        if "result" not in got:
                            break
                        await trio.sleep(0.3)
                assert got["error"]["code"] == -32001, got  # TaskNotFound, not -32603
                assert "pruned by the store's retention" in got["error"]["message"]
                # Another client is not told it was ever there.
                theirs = await rpc(http, "GetTask", {"id": task["id"]}, token=BOB)
                assert theirs["error"]["code"] == -32001, theirs
                assert "pruned" not in theirs["error"]["message"], theirs
                for method in ("SubscribeToTask", "CancelTask"):
                    answer = await rpc(http, method, {"id": task["id"]})
                    assert answer.get("error", {}).get("code") == -32001, (method, answer)
                listed = await rpc(http, "ListTasks", {"pageSize": 10})
                assert "result" in listed, listed
                assert task["id"] not in [t["id"] for t in listed["result"].get("tasks", [])]
                again = await rpc(http, "SendMessage", message("m-pruned"))
                assert again["error"]["code"] == -32001, again
                assert "new messageId" in again["error"]["message"]
        finally:
            log = server.stderr
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    assert "Unhandled exception" not in log
