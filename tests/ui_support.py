"""The web console's end-to-end tests' server (helpers, not tests): one boot.xml with
two clients (alice, the approver and an operator; bob, neither), the tests' ``ledger``
tool behind a ``require-approval`` rule, and the assistant agent thinking with the
scripted OpenAI-compatible model on loopback."""

from __future__ import annotations

import pathlib

import trio
from governance_support import NS as GOV_NS
from httputil import http_url
from llm_fakes import FakeServer
from serverproc import ServerProcess, subprocess_env

BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="console-demo">
  <limits hello-timeout="2" read-timeout="10" drain-timeout="1" write-timeout="2"/>
  <clients>
    <client name="alice" token-env="UI_ALICE_TOKEN" operator="true"/>
    <client name="bob" token-env="UI_BOB_TOKEN"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="UI_LLM_BASE_URL" api-key-env="UI_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"/>
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="ledger" handler="governance_support:ledger">
      <accepts type="governance_support:Pay"/>
      <responds type="governance_support:Paid"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="ledger">
      <agent model="m" max-steps="6"/>
      <policy default="allow">
        <rule priority="1" id="payments" decision="require-approval" target="ledger"
              approver="alice" timeout="10m"/>
      </policy>
    </listener>
  </listeners>
</organism>
"""

TOKENS = {"alice": "alice-token", "bob": "bob-token"}


def pay(to: str, amount: str) -> str:
    return f'<pay xmlns="{GOV_NS}"><to>{to}</to><amount>{amount}</amount></pay>'


class ConsoleServer:
    """The real server (a subprocess) with its HTTP API, and the scripted model."""

    def __init__(self, directory: pathlib.Path, boot: str = BOOT) -> None:
        self.dir = directory
        self.boot = directory / "boot.xml"
        self.boot.write_text(boot)
        self.ledger = directory / "ledger.txt"
        self.model = FakeServer("openai")
        self.server: ServerProcess | None = None
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> None:
        await self.model.start(nursery)
        env = subprocess_env(
            UI_LLM_BASE_URL=self.model.base_url,
            UI_LLM_KEY="k",
            UI_ALICE_TOKEN=TOKENS["alice"],
            UI_BOB_TOKEN=TOKENS["bob"],
            GOV_LEDGER=str(self.ledger),
        )
        self.server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                self.boot, "--http-port", "0", env=env, cwd=self.dir, timeout=30
            )
        )
        self.url = http_url(self.server)

    def stop(self) -> int | None:
        return self.server.stop() if self.server is not None else None

    def paid(self) -> list[str]:
        return self.ledger.read_text().splitlines() if self.ledger.exists() else []

    def seen(self, request: int) -> str:
        """The user-side text of the model's ``request``-th call (0-based)."""
        body = self.model.requests[request].body
        return "\n".join(str(m["content"]) for m in body["messages"] if m["role"] == "user")
