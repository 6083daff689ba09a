"""The chaos bench's processes: servers (``agentserver run``) and runners
(``agentserver runner``), started, killed with SIGKILL and restarted (bench/chaos.py);
a server also drained (``agentserver drain``) or sent SIGTERM and started on another
boot file (the deploy fault, bench/support/chaos_deploy.py).

Each process's standard error goes to a log file in the run's directory, read by a thread
that also finds the server's address in its start line. Blocking waits run in
``trio.to_thread``.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import trio

LISTENING = re.compile(r"agentserver listening on (\S+?):(\d+)")
#: ``run`` prints the HTTP API's URL(s) before the socket's line (docs/operations.md).
HTTP_LISTENING = re.compile(r"agentserver http listening on (https?://[^\s,\"]+)")


def child_env(tools: pathlib.Path, **extra: str) -> dict[str, str]:
    """The environment of a server or runner: ``tools`` (chaos_tools.py's folder) importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tools), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class ServerSlot:
    """One server process of the run (restarted in place: the same folder, and the same
    boot.xml unless a deploy changes ``boot``)."""

    def __init__(self, index: int, boot: pathlib.Path, env: dict[str, str], logs: pathlib.Path):
        self.index = index
        self.boot = boot
        self.env = env
        self.logs = logs
        self.proc: subprocess.Popen | None = None
        self.host = "127.0.0.1"
        self.port = 0
        #: The HTTP API's base URL (the A2A clients' and the HTTP double texts' door).
        self.http_url = ""
        #: Bumped at every start: a connection made to an older generation is dead.
        self.generation = 0
        self.changed = trio.Event()
        self.starts = 0
        self.drains = 0
        #: Being stopped on purpose (drained, SIGTERM): its shutdown ends open streams
        #: (an AG-UI run's, docs/ag-ui.md) without their end. Cleared by :meth:`start`.
        self.stopping = False
        #: Held by whoever stops and restarts the process (a kill, a deploy), so two
        #: never start one slot twice.
        self.lock = trio.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.port != 0

    def _start_blocking(self, timeout: float = 60.0) -> None:
        self.starts += 1
        log = open(self.logs / f"server{self.index}-{self.starts}.log", "wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentserver",
                "--log-level",
                "warning",
                "run",
                str(self.boot),
                "--port",
                "0",
                "--http-port",
                "0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.boot.parent,
        )
        found = threading.Event()
        address: list[tuple[str, int]] = []
        http: list[str] = []

        def pump() -> None:
            with log:
                for raw in proc.stderr:
                    log.write(raw)
                    if not http:
                        found_http = HTTP_LISTENING.search(raw.decode("utf-8", "replace"))
                        if found_http:
                            http.append(found_http.group(1))
                    if not address:
                        match = LISTENING.search(raw.decode("utf-8", "replace"))
                        if match:
                            address.append((match.group(1), int(match.group(2))))
                            log.flush()
                            found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout) or not address:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"server {self.index} did not start (see {self.logs})")
        self.proc = proc
        self.http_url = http[0] if http else ""
        self.host, self.port = address[0]

    async def start(self) -> None:
        await trio.to_thread.run_sync(self._start_blocking)
        self.generation += 1
        self.stopping = False
        self._signal()

    def _signal(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        proc = self.proc
        self.port = 0
        self._signal()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            await trio.to_thread.run_sync(proc.wait)

    async def terminate(self) -> int | None:
        """SIGTERM (SIGKILL after 20 s); the exit status (None: no process)."""
        proc = self.proc
        self.stopping = True
        self.port = 0
        self._signal()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await trio.to_thread.run_sync(lambda: proc.wait(20))
            except subprocess.TimeoutExpired:
                proc.kill()
                await trio.to_thread.run_sync(proc.wait)
        return None if proc is None else proc.returncode

    async def drain(self, env: dict[str, str], wait_s: float) -> tuple[str, int | None]:
        """``agentserver drain BOOT --url HTTP --wait --timeout WAIT_S`` (``env``'s
        ``AGENTSERVER_TOKEN``: an operator's), then the process's exit. Returns
        ("drained", its exit status) once it exited, else (why not, None) with the process
        still up (draining, or refusing): "gone", "refused", "timeout" or "stuck"."""
        proc = self.proc
        if proc is None or proc.poll() is not None or not self.http_url:
            return "gone", None
        self.drains += 1
        self.stopping = True
        args = [str(self.boot), "--url", self.http_url, "--wait", "--timeout", f"{wait_s:g}"]
        path = self.logs / f"drain{self.index}-{self.drains}.log"
        with open(path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once
            with trio.move_on_after(wait_s + 30):
                done = await trio.run_process(
                    [sys.executable, "-m", "agentserver", "drain", *args],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    check=False,
                )
                if done.returncode == 3:
                    return "timeout", None
                if done.returncode != 0:
                    return "refused", None
        try:
            await trio.to_thread.run_sync(lambda: proc.wait(20))
        except subprocess.TimeoutExpired:
            return "stuck", None
        self.port = 0
        self._signal()
        return "drained", proc.returncode


class RunnerSlot:
    """``agentserver runner`` serving ``relay`` for one server slot."""

    def __init__(self, server: ServerSlot, env: dict[str, str], logs: pathlib.Path):
        self.server = server
        self.env = env
        self.logs = logs
        self.proc: trio.Process | None = None
        self.starts = 0
        self.kills = 0

    async def run_once(self) -> None:
        """Run one runner until it exits (or is killed)."""
        self.starts += 1
        path = self.logs / f"runner{self.server.index}-{self.starts}.log"
        with open(path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once
            self.proc = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "agentserver",
                    "--log-level",
                    "warning",
                    "runner",
                    "--listener",
                    "relay",
                    "--handler",
                    "chaos_tools:relay",
                    "--concurrency",
                    "8",
                    "--connect",
                    f"{self.server.host}:{self.server.port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.env,
            )
            try:
                await self.proc.wait()
            finally:
                if self.proc.returncode is None:
                    self.proc.kill()
                    with trio.CancelScope(shield=True):
                        await self.proc.wait()

    def kill(self) -> bool:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            self.kills += 1
            return True
        return False
