"""The console end to end: inside the server (run --console) and over the socket."""

from __future__ import annotations

import subprocess
import sys

from serverproc import DATA, REPO, ServerProcess, cli, outside_checkout, scratch_dir

from agentserver.console.commands import HELP

SCRIPT = (
    b'@echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>\n'
    b'@calculator <add xmlns="urn:agentserver:calculator"><a>20</a><b>22</b></add>\n'
    b'@calculator <add xmlns="urn:agentserver:calculator"><a>1</a></add>\n'
    b"@ghost <x/>\n"
    b"/quit\n"
)
#: What the console prints for SCRIPT, after its banner (in-process and over the socket).
TRANSCRIPT = [
    '[echo] <pong xmlns="urn:agentserver:echo"><text>hi</text></pong>',
    '[calculator] <sum xmlns="urn:agentserver:calculator"><value>42</value></sum>',
    "error: Invalid payload structure.",
    "error: 'ghost' is not a listener this console can address (try /listeners)",
    "bye",
]


def test_run_with_console_in_the_server_process():
    proc = cli(
        "--log-level",
        "warning",
        "run",
        str(outside_checkout(REPO / "boot.xml", scratch_dir())),
        "--port",
        "0",
        "--console",
        input=SCRIPT + b"hello\n",
    )
    out = proc.stdout.decode().splitlines()
    assert proc.returncode == 0, proc.stderr.decode()
    assert out[0].startswith("agentserver console: organism 'hello', 6 listeners")
    assert out[1:] == TRANSCRIPT
    assert b"agentserver listening on 127.0.0.1:" in proc.stderr


def test_console_over_the_socket():
    server = ServerProcess.start(DATA / "e2e-boot.xml")
    try:
        result = cli(
            "console", "--connect", f"{server.host}:{server.port}", input=SCRIPT + b"not read\n"
        )
        out = result.stdout.decode().splitlines()
        assert result.returncode == 0, result.stderr.decode()
        assert (
            out[0]
            == f"agentserver console: connected to {server.host}:{server.port}. /help for commands, /quit to leave."
        )
        assert out[1:] == TRANSCRIPT
        # The server is still fine and the console's end did not stop it.
        again = cli(
            "console", "--connect", f"{server.host}:{server.port}", input=b"/listeners\n/help\n"
        )
        assert again.returncode == 0 and "@echo:" in again.stdout.decode()
        # /help: the server's commands, then those this console carries out itself.
        lines = again.stdout.decode().splitlines()
        assert "Commands:" in lines and lines[-len(HELP) - 1 :] == [*HELP, "bye"]
    finally:
        assert server.stop() == 0


def test_console_reports_a_server_that_goes_away():
    server = ServerProcess.start(DATA / "e2e-boot.xml")
    console = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentserver",
            "console",
            "--connect",
            f"{server.host}:{server.port}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=scratch_dir(),
    )
    try:
        banner = console.stdout.readline()  # connected and prompting
        assert banner.startswith(b"agentserver console: connected")
        assert server.stop() == 0
        out, _ = console.communicate(timeout=15)  # stdin stays open: only the close ends it
    finally:
        if console.poll() is None:
            console.kill()
    assert console.returncode == 4
    assert b"the server closed the connection" in out


def test_console_cannot_connect():
    result = cli("console", "--connect", "127.0.0.1:1", input=b"/quit\n")
    assert result.returncode == 4
