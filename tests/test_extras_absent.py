"""The core installs and runs without its optional extras (``a2a``, ``mcp``, ``otel``,
``agui``).

The development environment has every extra installed, so a module-level import of an
extra's SDK in the core passes every other test and breaks only a user's plain
``pip install agentserver`` (it once did: the boot loader imported ``google.protobuf``
through the A2A skills). Here a child interpreter refuses those imports, loads boot.xml
files, builds the HTTP app and serves one request; a topology that needs an extra gets a
clear error naming the extra to install.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from serverproc import REPO

#: Top-level modules of the optional extras (the ``a2a``, ``mcp``, ``otel`` and ``agui``
#: extras).
OPTIONAL = ("a2a", "google", "mcp", "opentelemetry.sdk", "opentelemetry.exporter", "ag_ui")

BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == m or name.startswith(m + ".") for m in {OPTIONAL!r}):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    """
)

HTTP_BOOT = """<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="plain">
  <listen host="127.0.0.1" port="0"/>
  <http host="127.0.0.1" port="0"/>
  <store path="agents.sqlite3"/>
  <listeners>
    <listener name="echo" handler="echo"/>
  </listeners>
</organism>
"""

EXPOSE_BOOT = """<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="exposed">
  <listen host="127.0.0.1" port="0"/>
  <http host="127.0.0.1" port="0"/>
  <store path="agents.sqlite3"/>
  <expose-a2a><agent name="assistant"/></expose-a2a>
  <listeners>
    <listener name="assistant" handler="assistant" agent="true"/>
  </listeners>
</organism>
"""


def run_child(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_blocker_really_blocks(tmp_path: Path) -> None:
    done = run_child("import google.protobuf\n", tmp_path)
    assert done.returncode != 0
    assert "ModuleNotFoundError" in done.stderr


def test_boot_loads_and_http_app_serves_without_extras(tmp_path: Path) -> None:
    (tmp_path / "boot.xml").write_text(HTTP_BOOT)
    done = run_child(
        f"""
        import sys
        from agentserver.cli.main import main
        # The bundled topology and one with <http> both check clean.
        assert main(["check", {str(REPO / "boot.xml")!r}]) == 0
        assert main(["check", "boot.xml"]) == 0
        import agentserver.app.root, agentserver.http.api  # the server's own modules
        leaked = [
            m for m in sys.modules if m.split(".")[0] in ("a2a", "mcp", "google", "ag_ui")
        ]
        assert not leaked, leaked
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


def test_expose_a2a_without_the_sdk_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "boot.xml").write_text(EXPOSE_BOOT)
    done = run_child(
        """
        import sys
        from agentserver.cli.main import main
        sys.exit(main(["check", "boot.xml"]))
        """,
        tmp_path,
    )
    assert done.returncode != 0
    assert "pip install 'agentserver[a2a]'" in done.stdout + done.stderr


def test_an_agui_run_without_the_package_names_the_extra(tmp_path: Path) -> None:
    """``POST /agui/agents/{name}`` on a server without ag-ui-protocol: 501, saying
    which extra to install (the app itself builds and serves without it)."""
    done = run_child(
        """
        import httpx, trio
        from prometheus_client import CollectorRegistry
        from agentserver.http.agui.agents import AguiAgent
        from agentserver.http.agui.runs import AguiRuns
        from agentserver.http.api import HttpContext, build_app
        from agentserver.http.auth import HttpAuth

        class Gateway:
            max_bytes = 1 << 20

        class View:
            agents = ("assistant",)

        ctx = HttpContext(
            pump=None, gateway=Gateway(), auth=HttpAuth({}), registry=CollectorRegistry(),
            agents=View(),
        )
        ctx.agui = AguiRuns((AguiAgent("assistant", input=None),), Gateway(), View(), None)

        async def main():
            transport = httpx.ASGITransport(app=build_app(ctx))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                run = {"threadId": "t", "runId": "r", "messages": []}
                answer = await client.post("/agui/agents/assistant", json=run)
                print(answer.status_code, answer.json()["title"])

        trio.run(main)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.startswith("501 "), done.stdout
    assert "pip install 'agentserver[agui]'" in done.stdout
