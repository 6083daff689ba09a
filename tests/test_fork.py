"""Fork a conversation (issue 26): ``POST /v1/agents/{name}/tasks/{thread}/fork`` and
``agentserver fork`` against a real server (a subprocess) on SQLite and PostgreSQL.

The recorded Turn uses two tools: step 1 adds 2 and 3, step 2 multiplies the sum by 4,
step 3 answers 20. Forked at step 1 with the original task re-run, the new conversation
runs only the second half (one multiply, no add) and answers 20; forked at step 1 with a
new task ("times 10"), it answers 50. The original's view is unchanged; each fork's view
names its origin (thread and step). The model is a scripted OpenAI-compatible server in
this test's trio run that decides from the conversation, like a model would.
"""

from __future__ import annotations

import re

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, cli, subprocess_env

BOOT = DATA / "agents-fork-boot.xml"
CALC_NS = "urn:agentserver:calculator"
TASK_NS = "urn:agentserver:assistant"
PATIENCE = 30.0


def task(text: str) -> str:
    return f'<task xmlns="{TASK_NS}"><text>{text}</text></task>'


class CalcModel(FakeServer):
    """Add 2 and 3; multiply the sum by the last factor asked for; answer the product."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.actions: list[str] = []

    def default(self, seen: Seen) -> Script:
        text = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        products = re.findall(r"<product [^>]*><value>(-?\d+)</value>", text)
        sums = re.findall(r"<sum [^>]*><value>(-?\d+)</value>", text)
        factor = re.findall(r"times (\d+)", text)[-1]
        # The latest task decides: a product made after it answers it.
        last_task = text.rfind("times ")
        if products and text.rfind("<product") > last_task:
            self.actions.append("answer")
            return openai_ok(f"The result is {products[-1]}.", model="m")
        if sums:
            self.actions.append("multiply")
            mul = f'<multiply xmlns="{CALC_NS}"><a>{sums[-1]}</a><b>{factor}</b></multiply>'
            return openai_ok(f"Now the product. {mul}", model="m")
        self.actions.append("add")
        return openai_ok(f'First the sum. <add xmlns="{CALC_NS}"><a>2</a><b>3</b></add>', model="m")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


async def answer_of(client: httpx.AsyncClient, thread: str) -> str:
    with trio.fail_after(PATIENCE):
        while True:
            kept = await client.get(f"/v1/threads/{thread}")
            if kept.status_code == 200 and kept.json()["replies"]:
                return kept.json()["replies"][-1]
            await trio.sleep(0.05)


async def test_fork_at_step_one_runs_only_the_second_half(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await CalcModel().start(nursery)
        env = subprocess_env(FORK_LLM_BASE_URL=model.base_url, FORK_LLM_KEY="k", **store_env)
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, "--http-port", "0", env=env, cwd=tmp_path)
        )
        try:
            url = http_url(server)
            async with httpx.AsyncClient(base_url=url, timeout=PATIENCE) as client:
                sent = await client.post(
                    "/v1/messages",
                    params={"to": "assistant"},
                    content=task("Add 2 and 3, then times 4."),
                )
                assert sent.status_code == 200, sent.text
                assert "The result is 20." in sent.text
                original = sent.headers["Agentserver-Thread"]
                assert model.actions == ["add", "multiply", "answer"]
                before = (await client.get(f"/v1/agents/assistant/tasks/{original}")).json()
                assert len(before["steps"]) == 3 and "forked_from" not in before

                # The original task re-run from step 1: only the second half runs.
                forked = await client.post(
                    f"/v1/agents/assistant/tasks/{original}/fork", json={"at_step": 1}
                )
                assert forked.status_code == 202, forked.text
                fork = forked.json()
                assert fork["forked_from"]["thread"] == original
                assert fork["forked_from"]["step"] == 1
                assert "The result is 20." in await answer_of(client, fork["thread"])
                assert model.actions[3:] == ["multiply", "answer"]
                view = (await client.get(f"/v1/agents/assistant/tasks/{fork['thread']}")).json()
                assert view["status"] == "succeeded" and len(view["steps"]) == 2
                assert view["forked_from"] == {
                    "thread": original,
                    "turn": before["turn"],
                    "step": 1,
                }

                # A step the Turn does not have, a Turn that does not exist.
                bad = await client.post(
                    f"/v1/agents/assistant/tasks/{original}/fork", json={"at_step": 9}
                )
                assert bad.status_code == 404 and "no step 9" in bad.text
                bad = await client.post(
                    f"/v1/agents/assistant/tasks/{fork['thread']}x/fork", json={"at_step": 1}
                )
                assert bad.status_code == 404
                bad = await client.post(
                    f"/v1/agents/assistant/tasks/{original}/fork", json={"step": 1}
                )
                assert bad.status_code == 400

                # A new task from step 1, with the command: the sum kept, times 10.
                (tmp_path / "task.xml").write_text(task("Now times 10 instead."))
                done = await trio.to_thread.run_sync(
                    lambda: cli(
                        "fork", "assistant", original, "--at-step", "1", "--url", url,
                        "--task", str(tmp_path / "task.xml"), "--wait", env=env,
                    )
                )  # fmt: skip
                assert done.returncode == 0, done.stderr
                first, answer = done.stdout.decode().splitlines()[:2]
                assert '"step": 1' in first and "The result is 50." in answer
                assert model.actions[5:] == ["multiply", "answer"]

                # The original is untouched.
                after = (await client.get(f"/v1/agents/assistant/tasks/{original}")).json()
                assert after == before
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
