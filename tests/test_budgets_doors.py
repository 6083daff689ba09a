"""A client's budget holds at every door (issue 43, found by the chaos bench): a task a
named client sends over the HTTP API (``POST /v1/messages``) pays into her budget as one
sent on her socket does. Her budget here is smaller than any call's worst case, so every
model call of hers is refused: over the socket and over HTTP alike the task is answered
failed, "budget exhausted: client:alice", and the model is never called for it; bob,
without a budget, is answered. A real server (SQLite), real HTTP and socket on loopback,
a scripted model with usage."""

from __future__ import annotations

import httpx
import trio
from httputil import http_url
from serverproc import ServerProcess, subprocess_env
from test_budgets_e2e import TOKENS, UsageModel, boot

from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

#: Alice's 10 tokens never cover a call's worst case: the refusal says what it needs and
#: what remains of her budget (issue 45's wording).
REFUSED = "tokens; 10 remain of client:alice (total)"


async def test_a_clients_budget_holds_over_http_as_on_her_socket(tmp_path):
    text = boot('<store path="state/agents.sqlite3" watchdog-interval="0.2"/>')
    text = text.replace(
        '<client name="alice" token-env="B_ALICE_TOKEN"/>',
        '<client name="alice" token-env="B_ALICE_TOKEN"><budget tokens="10" period="total"/>'
        "</client>",
    )
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(text)
    async with trio.open_nursery() as nursery:
        model = await UsageModel(hold_s=0).start(nursery)
        env = subprocess_env(
            B_LLM_BASE_URL=model.base_url,
            B_LLM_KEY="k",
            **{f"B_{c.upper()}_TOKEN": token for c, token in TOKENS.items()},
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(boot_file, "--http-port", "0", env=env, cwd=tmp_path)
        )
        try:
            async with open_client(
                server.host, server.port, client="alice", token=TOKENS["alice"]
            ) as alice:
                await alice.send(Task(text="over the socket"), to="assistant")
                with trio.fail_after(30):
                    answer = await alice.receive()
                assert REFUSED in "".join(answer.payload.itertext()), answer.raw
            async with httpx.AsyncClient(base_url=http_url(server), timeout=30) as http:
                for client, refused in (("alice", True), ("bob", False)):
                    got = await http.post(
                        "/v1/messages",
                        params={"to": "assistant"},
                        headers={"Authorization": f"Bearer {TOKENS[client]}"},
                        content=Task(text=f"over HTTP from {client}").to_xml(),
                    )
                    assert got.status_code == 200, got.text
                    assert (REFUSED in got.text) is refused, (client, got.text)
                    assert ('status="failed"' in got.text) is refused, (client, got.text)
            # The model saw bob's task only.
            prompts = [str(s.body["messages"][-1]["content"]) for s in model.requests]
            assert not any("alice" in p or "socket" in p for p in prompts), prompts
            assert any("from bob" in p for p in prompts), prompts
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
