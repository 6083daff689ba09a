"""Run the code blocks of a Markdown file, in order, in a scratch folder (helpers, not
tests): docs/guide.md and every examples/*/README.md are executed this way, so they
cannot drift from the code.

Each fenced block must follow a marker comment saying what to do with it:
``<!-- guide: file NAME -->`` writes it, ``<!-- guide: append NAME -->`` appends it
(after two blank lines), ``<!-- guide: run -->`` runs it with bash (it must exit 0),
``<!-- guide: output -->`` is what the previous run printed (standard output and error),
exactly, and ``<!-- guide: server -->`` starts it in the background (until the end) and
waits for its "listening on" / "scripted model on" line. Commands find the venv's
``agentserver`` and ``python`` first on PATH; there is no PYTHONPATH;
``AGENTSERVER_PORT`` and ``SCRIPTED_MODEL_PORT`` are free ports (``OPENAI_BASE_URL``
points at the latter).
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

BLOCK = re.compile(
    r"^<!-- guide: (?P<action>[a-z]+)(?: (?P<arg>\S+))? -->\n```[a-z]*\n(?P<body>.*?)^```$",
    re.M | re.S,
)
FENCE = re.compile(r"^```[a-z]*$", re.M)
READY = re.compile(r"agentserver listening on |scripted model on ")


def blocks(text: str) -> list[tuple[str, str | None, str]]:
    found = [(m["action"], m["arg"], m["body"]) for m in BLOCK.finditer(text)]
    # Every opening fence belongs to a marked block (closing fences are bare ```).
    opening = [m for m in FENCE.finditer(text) if m.group() != "```"]
    assert len(found) == len(opening), "a code block has no guide marker"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(work: pathlib.Path) -> dict[str, str]:
    drop = ("PYTHONPATH", "OPENAI_API_KEY", "OPENAI_BASE_URL", "AGENTSERVER_MODEL")
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AGENTSERVER_")
    }
    env["PATH"] = os.pathsep.join((str(pathlib.Path(sys.executable).parent), env["PATH"]))
    env["AGENTSERVER_PORT"] = str(free_port())
    model_port = free_port()
    env["SCRIPTED_MODEL_PORT"] = str(model_port)
    env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{model_port}/v1"
    env["HOME"] = str(work)
    return env


class Background:
    """A block run in the background, in its own process group."""

    def __init__(self, script: str, cwd: pathlib.Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for raw in self.proc.stdout:
                self.lines.append(raw.decode("utf-8", "replace"))
                if READY.search(self.lines[-1]):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError(f"{script!r} did not start:\n" + "".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def run_markdown(path: pathlib.Path, work: pathlib.Path) -> int:
    """Run ``path``'s blocks in ``work``; returns how many background processes ran.
    Raises AssertionError at the first block that fails."""
    env = environment(work)
    background: list[Background] = []
    output: str | None = None
    try:
        for action, arg, body in blocks(path.read_text()):
            if action == "file":
                (work / arg).write_text(body)
            elif action == "append":
                with (work / arg).open("a") as f:
                    f.write("\n\n" + body)  # the blank lines PEP 8 wants
            elif action == "run":
                result = subprocess.run(
                    ["bash", "-e", "-c", body],
                    cwd=work,
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
                background.append(Background(body, work, env))
            else:
                raise AssertionError(f"unknown guide action {action!r}")
    finally:
        for process in background:
            # SIGTERM is how a server is stopped: it must drain and exit 0.
            assert process.stop() == 0, "".join(process.lines)
    return len(background)
