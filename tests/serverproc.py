"""Run the real server as a subprocess for end-to-end tests (helpers, not tests).

``ServerProcess.start(boot)`` runs ``python -m agentserver run BOOT --port 0`` and reads
the bound address from the line it prints to standard error.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import trio

from agentserver.core.framing import FrameDecoder, encode_frame

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"
LISTENING = re.compile(r"agentserver listening on (\S+?):(\d+)")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a server or CLI subprocess: tests/ importable (e2e handlers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class ScratchRoot:
    """Where :func:`scratch_dir` makes its directories: pytest's temporary directory of the
    running session, set by ``conftest.py``. Nothing may land in the checkout (a server's
    ``./state/``) nor be left in ``/tmp`` (pytest prunes its own old session directories;
    the OS does not prune ``/tmp``)."""

    path: pathlib.Path | None = None


def scratch_dir() -> pathlib.Path:
    """A new empty working directory for a subprocess, inside the session's temporary
    directory."""
    if ScratchRoot.path is None:
        raise RuntimeError("scratch_dir() needs the pytest session (tests/conftest.py)")
    return pathlib.Path(tempfile.mkdtemp(prefix="agentserver-test-", dir=ScratchRoot.path))


def outside_checkout(boot: pathlib.Path | str, directory: pathlib.Path) -> pathlib.Path:
    """``boot`` itself, or, when it lies in the checkout, a copy of it in ``directory``:
    relative paths in boot.xml (the agents' ``<store path>``) are relative to its folder,
    and nothing may land in the checkout. (Its handler modules import from tests/, on
    PYTHONPATH, or from the package.)"""
    path = pathlib.Path(boot).resolve()
    if not path.is_relative_to(REPO):
        return pathlib.Path(boot)
    copy = directory / path.name
    if not copy.exists():
        shutil.copyfile(path, copy)
    return copy


def cli(
    *args: str, input: bytes | None = None, env: dict[str, str] | None = None, timeout: float = 30
):
    """Run ``python -m agentserver ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "agentserver", *args],
        input=input,
        capture_output=True,
        env=env or subprocess_env(),
        timeout=timeout,
        cwd=scratch_dir(),
    )


class ServerProcess:
    """A running ``agentserver run``. Standard error is collected by a thread."""

    def __init__(
        self,
        proc: subprocess.Popen,
        host: str,
        port: int,
        lines: list[str],
        stderr_closed: threading.Event | None = None,
    ) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self._lines = lines
        self._stderr_closed = stderr_closed or threading.Event()
        #: For a TLS server: the client context that trusts its CA (None: plaintext).
        self.ssl_context = None

    @property
    def client_options(self) -> dict:
        """Keyword arguments for ``open_client`` to reach this server."""
        return {} if self.ssl_context is None else {"tls": self.ssl_context}

    @classmethod
    def start(
        cls,
        boot: pathlib.Path | str | None,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: pathlib.Path | None = None,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        timeout: float = 20.0,
        log_level: str = "warning",
    ) -> ServerProcess:
        cwd = cwd or scratch_dir()
        if boot is not None:
            boot = outside_checkout(boot, cwd)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentserver",
                "--log-level",
                log_level,
                "run",
                *([str(boot)] if boot is not None else []),
                "--port",
                "0",
                *args,
            ],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.PIPE,
            env=env or subprocess_env(),
            # A scratch directory, where a checkout's boot.xml is copied to (its agent
            # store, state/ next to it, must not land in the checkout).
            cwd=cwd,
        )
        lines: list[str] = []
        found = threading.Event()
        closed = threading.Event()
        address: list[tuple[str, int]] = []

        def pump_stderr() -> None:
            for raw in proc.stderr:
                line = raw.decode("utf-8", "replace")
                lines.append(line)
                match = LISTENING.search(line)
                if match and not address:
                    address.append((match.group(1), int(match.group(2))))
                    found.set()
            closed.set()
            found.set()

        threading.Thread(target=pump_stderr, daemon=True).start()
        if not found.wait(timeout) or not address:
            proc.kill()
            proc.wait()
            raise RuntimeError("server did not start:\n" + "".join(lines))
        return cls(proc, *address[0], lines, closed)

    @property
    def stderr(self) -> str:
        return "".join(self._lines)

    def all_stderr(self, timeout: float = 15.0) -> str:
        """Standard error to its end, once the process has closed it (after it exited)."""
        if not self._stderr_closed.wait(timeout):
            raise RuntimeError("standard error still open:\n" + self.stderr)
        return self.stderr

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)


async def open_stream(server: ServerProcess) -> trio.abc.Stream:
    """A bare stream to ``server``: TCP, or TLS (handshake done) for a TLS server."""
    tcp = await trio.open_tcp_stream(server.host, server.port)
    if server.ssl_context is None:
        return tcp
    stream = trio.SSLStream(tcp, server.ssl_context, server_hostname=server.host)
    await stream.do_handshake()
    return stream


class RawConnection:
    """A bare framed socket, for hostile input and protocol tests."""

    def __init__(self, stream: trio.abc.Stream, max_frame: int = 4 * 1024 * 1024) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(max_frame)

    @classmethod
    async def open(cls, server: ServerProcess) -> RawConnection:
        return cls(await open_stream(server))

    async def send_frame(self, body: bytes) -> None:
        await self.stream.send_all(encode_frame(body))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_frame(self) -> bytes | None:
        """The next frame, or None when the server closed the connection."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not data:
                return None
            self.decoder.feed(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
