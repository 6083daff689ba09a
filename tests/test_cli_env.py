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


def test_check_takes_its_boot_file_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "b.xml"
    path.write_text(
        f'<organism xmlns="{NS}" name="x"><listeners>'
        '<listener name="echo" handler="echo"/></listeners></organism>'
    )
    result = cli_in_process("check", env=subprocess_env(AGENTSERVER_BOOT=str(path)))
    assert result.returncode == 0 and b"OK: organism 'x'" in result.stdout
    # Neither BOOT nor the variable: ./boot.xml, and none here is a usage error.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    missing = cli_in_process("check", env=subprocess_env())
    assert missing.returncode == 2 and b"no boot.xml here" in missing.stderr
    monkeypatch.chdir(tmp_path)
    path.rename(tmp_path / "boot.xml")
    local = cli_in_process("check", env=subprocess_env())
    assert local.returncode == 0 and b"boot.xml: OK: organism 'x'" in local.stdout


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


async def test_a_command_given_boot_connects_where_boot_listens(tmp_path):
    """``agentserver mcp BOOT`` reaches the server at BOOT's <listen> address (not the
    default 7340); the environment variables and --connect still win over it."""
    import trio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from serverproc import ServerProcess

    port = free_port()
    assert port != 7340
    path = tmp_path / "boot.xml"
    path.write_text(
        f'<organism xmlns="{NS}" name="elsewhere">'
        f'<listen host="127.0.0.1" port="{port}"/>'
        '<listeners><listener name="calculator" handler="calculator"/></listeners>'
        '<expose-mcp listeners="calculator"/></organism>'
    )
    env = subprocess_env()
    for name in ("AGENTSERVER_HOST", "AGENTSERVER_PORT", "AGENTSERVER_BOOT"):
        env.pop(name, None)
    # (ServerProcess passes --port 0; the later --port wins: the server listens as BOOT says)
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, "--port", str(port), env=env, cwd=tmp_path)
    )
    try:
        assert server.port == port
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "agentserver", "mcp", str(path)],
            env={"PYTHONPATH": env["PYTHONPATH"]},
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            with trio.fail_after(60):
                await session.initialize()
                added = await session.call_tool("calculator-add", {"a": 2, "b": 40})
        assert not added.is_error, added
        assert "<value>42</value>" in added.content[0].text

        # The variables win over BOOT, and --connect over both: each names a closed port.
        closed = free_port()
        by_env = await trio.to_thread.run_sync(
            lambda: cli("mcp", str(path), input=b"", env={**env, "AGENTSERVER_PORT": str(closed)})
        )
        assert by_env.returncode == 4, by_env.stderr
        assert f"127.0.0.1:{closed}".encode() in by_env.stderr
        by_option = await trio.to_thread.run_sync(
            lambda: cli(
                "mcp",
                str(path),
                "--connect",
                f"127.0.0.1:{closed}",
                input=b"",
                env={**env, "AGENTSERVER_PORT": str(port)},
            )
        )
        assert by_option.returncode == 4, by_option.stderr
        assert f"127.0.0.1:{closed}".encode() in by_option.stderr
    finally:
        await trio.to_thread.run_sync(server.stop)


def test_the_connect_address_by_precedence(monkeypatch):
    import argparse

    import pytest

    from agentserver.cli.common import connect_address

    for name in ("AGENTSERVER_HOST", "AGENTSERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    unset = argparse.Namespace(connect=None)
    assert connect_address(unset) == ("127.0.0.1", 7340)
    assert connect_address(unset, ("10.0.0.5", 8000)) == ("10.0.0.5", 8000)
    # A wildcard listening address is reached on loopback.
    assert connect_address(unset, ("0.0.0.0", 8000)) == ("127.0.0.1", 8000)
    assert connect_address(unset, ("::", 8000)) == ("::1", 8000)
    with pytest.raises(argparse.ArgumentTypeError, match="port 0"):
        connect_address(unset, ("127.0.0.1", 0))
    monkeypatch.setenv("AGENTSERVER_PORT", "9001")
    assert connect_address(unset, ("10.0.0.5", 8000)) == ("10.0.0.5", 9001)
    assert connect_address(unset, ("127.0.0.1", 0)) == ("127.0.0.1", 9001)
    monkeypatch.setenv("AGENTSERVER_HOST", "db.example")
    assert connect_address(unset, ("10.0.0.5", 8000)) == ("db.example", 9001)
    given = argparse.Namespace(connect=("h", 1))
    assert connect_address(given, ("10.0.0.5", 8000)) == ("h", 1)
