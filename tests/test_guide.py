"""docs/guide.md is executed: every code block in it runs, in order, in a scratch folder
with no PYTHONPATH, so the guide cannot drift from the code.

Each fenced block must follow a marker comment saying what to do with it:
``<!-- guide: file NAME -->`` writes it, ``<!-- guide: append NAME -->`` appends it
(after two blank lines),
``<!-- guide: run -->`` runs it with bash (it must exit 0), ``<!-- guide: output -->``
is what the previous run printed (standard output and error), exactly, and
``<!-- guide: server -->`` starts it in the background until the guide's end
(``AGENTSERVER_PORT`` points it and every later ``send`` at a free port).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
from serverproc import LISTENING, REPO

GUIDE = REPO / "docs" / "guide.md"
BLOCK = re.compile(
    r"^<!-- guide: (?P<action>[a-z]+)(?: (?P<arg>\S+))? -->\n```[a-z]*\n(?P<body>.*?)^```$",
    re.M | re.S,
)
FENCE = re.compile(r"^```[a-z]*$", re.M)


def blocks(text: str) -> list[tuple[str, str | None, str]]:
    found = [(m["action"], m["arg"], m["body"]) for m in BLOCK.finditer(text)]
    # Every opening fence belongs to a marked block (closing fences are bare ```).
    opening = [m for m in FENCE.finditer(text) if m.group() != "```"]
    assert len(found) == len(opening), "a code block in docs/guide.md has no guide marker"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(work: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPENAI_API_KEY")}
    env["PATH"] = os.pathsep.join((str(pathlib.Path(sys.executable).parent), env["PATH"]))
    env["AGENTSERVER_PORT"] = str(free_port())
    env["HOME"] = str(work)
    return env


class Background:
    def __init__(self, script: str, cwd: pathlib.Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for raw in self.proc.stderr:
                self.lines.append(raw.decode("utf-8", "replace"))
                if LISTENING.search(self.lines[-1]):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("the guide's server did not start:\n" + "".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def test_every_block_of_the_guide_is_marked():
    assert len(blocks(GUIDE.read_text())) >= 10


@pytest.mark.slow
def test_the_guide_runs(tmp_path):
    env = environment(tmp_path)
    servers: list[Background] = []
    output: str | None = None
    try:
        for action, arg, body in blocks(GUIDE.read_text()):
            if action == "file":
                (tmp_path / arg).write_text(body)
            elif action == "append":
                with (tmp_path / arg).open("a") as f:
                    f.write("\n\n" + body)  # the blank lines PEP 8 wants
            elif action == "run":
                result = subprocess.run(
                    ["bash", "-e", "-c", body],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    timeout=120,
                )
                output = result.stdout.decode()
                assert result.returncode == 0, f"{body}\n---\n{output}"
            elif action == "output":
                assert output == body, f"expected:\n{body}\ngot:\n{output}"
            elif action == "server":
                servers.append(Background(body, tmp_path, env))
            else:
                raise AssertionError(f"unknown guide action {action!r}")
    finally:
        for server in servers:
            assert server.stop() == 0, "".join(server.lines)
    assert servers, "the guide runs a server"
