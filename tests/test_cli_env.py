"""AGENTSERVER_HOST, AGENTSERVER_PORT, AGENTSERVER_BOOT and AGENTSERVER_LOG_LEVEL give
the commands their defaults; an option on the command line wins."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from cliutil import cli_in_process
from serverproc import LISTENING, cli, scratch_dir, subprocess_env

NS = "https://xml-pipeline.org/ns/boot/v1"
PING = b'<ping xmlns="urn:agentserver:echo"><text>env</text></ping>'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_and_send_take_their_defaults_from_the_environment(tmp_path):
    path = tmp_path / "envboot.xml"
    path.write_text(
        textwrap.dedent(
            f"""\
            <organism xmlns="{NS}" name="from-env">
              <listen host="192.0.2.1" port="1"/>
              <listeners><listener name="echo" handler="echo"/></listeners>
            </organism>
            """
        )
    )
    port = free_port()
    env = subprocess_env(
        AGENTSERVER_BOOT=str(path),
        AGENTSERVER_HOST="127.0.0.1",
        AGENTSERVER_PORT=str(port),
        AGENTSERVER_LOG_LEVEL="debug",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentserver", "run"],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=scratch_dir(),
    )
    lines: list[str] = []
    try:
        for raw in proc.stderr:
            lines.append(raw.decode())
            if LISTENING.search(lines[-1]):
                break
        assert f"agentserver listening on 127.0.0.1:{port}" in "".join(lines)
        assert "topology 'from-env'" in "".join(lines)
        # AGENTSERVER_LOG_LEVEL=debug took effect (JSON logs: stderr is not a terminal).
        assert any('"level": "debug"' in line for line in lines), "".join(lines)
        result = cli("send", "--to", "echo", "--payload-only", input=PING, env=env)
        assert result.returncode == 0, result.stderr
        assert b"<text>env</text>" in result.stdout
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
        proc.stderr.close()


def test_check_takes_its_boot_file_from_the_environment(tmp_path):
    path = tmp_path / "b.xml"
    path.write_text(
        f'<organism xmlns="{NS}" name="x"><listeners>'
        '<listener name="echo" handler="echo"/></listeners></organism>'
    )
    result = cli_in_process("check", env=subprocess_env(AGENTSERVER_BOOT=str(path)))
    assert result.returncode == 0 and b"OK: organism 'x'" in result.stdout
    assert cli_in_process("check", env=subprocess_env()).returncode == 2


def test_bad_values_are_usage_errors():
    level = subprocess_env(AGENTSERVER_LOG_LEVEL="loud")
    bad_level = cli_in_process("check", "x.xml", env=level)
    assert bad_level.returncode == 2 and b"AGENTSERVER_LOG_LEVEL" in bad_level.stderr
    # (refused before it connects: the usage error comes first)
    port = subprocess_env(AGENTSERVER_PORT="http")
    bad_port = cli_in_process("send", "--to", "echo", input=PING, env=port)
    assert bad_port.returncode == 2 and b"AGENTSERVER_PORT" in bad_port.stderr


def test_an_option_wins_over_the_environment():
    # --connect names a closed port: the variable's (bogus) host is not used.
    port = free_port()
    result = cli(
        "send",
        "--to",
        "echo",
        "--connect",
        f"127.0.0.1:{port}",
        input=PING,
        env=subprocess_env(AGENTSERVER_HOST="192.0.2.1", AGENTSERVER_PORT="9"),
    )
    assert result.returncode == 4 and f"127.0.0.1:{port}".encode() in result.stderr
