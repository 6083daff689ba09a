"""agentserver send: --payload-only, --pretty, the payload as an argument, routing by root
tag without --to, error text on standard error; exit statuses unchanged."""

from __future__ import annotations

import pytest
from serverproc import REPO, ServerProcess, cli

PING = '<ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
BAD_ADD = '<add xmlns="urn:agentserver:calculator"><a>2</a></add>'


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess.start(REPO / "boot.xml")
    yield proc
    assert proc.stop() == 0


def send(server, *args: str, input: bytes | None = None):
    result = cli("send", "--connect", f"{server.host}:{server.port}", *args, input=input)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def test_payload_only_prints_the_payload_pretty_printed(server):
    code, out, err = send(server, "--to", "echo", "--payload-only", PING)
    assert code == 0, err
    assert out == ('<pong xmlns="urn:agentserver:echo">\n  <text>hi</text>\n</pong>\n')
    assert err == ""


def test_without_to_the_root_tag_picks_the_listener(server):
    code, out, err = send(
        server,
        "--payload-only",
        input=b'<add xmlns="urn:agentserver:calculator"><a>2</a><b>40</b></add>',
    )
    assert code == 0, err
    assert "<sum" in out and "<value>42</value>" in out


def test_pretty_prints_the_whole_envelope(server):
    code, out, err = send(server, "--to", "echo", "--pretty", PING)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("<message ") and lines[-1] == "</message>"
    assert "    <from>echo</from>" in lines
    assert '  <pong xmlns="urn:agentserver:echo">' in lines


def test_default_output_is_unchanged_one_envelope_per_line(server):
    code, out, _ = send(server, "--to", "echo", input=PING.encode())
    assert code == 0
    assert out.count("\n") == 1 and out.strip().endswith("</pong></message>")


def test_a_huh_prints_its_text_on_stderr_and_exits_1(server):
    code, out, err = send(server, "--to", "calculator", BAD_ADD)
    assert code == 1
    assert "<huh" in out  # the envelope, as before
    assert err.strip() == "huh from system: Invalid payload structure."
    code, out, err = send(server, "--to", "calculator", "--payload-only", BAD_ADD)
    assert code == 1 and out == ""
    assert err.strip() == "huh from system: Invalid payload structure."


def test_an_unknown_root_tag_without_to_is_a_huh(server):
    code, _, err = send(server, '<nothing xmlns="urn:nobody"/>')
    assert code == 1 and "Invalid payload structure." in err


def test_a_bad_argument_is_a_usage_error(server):
    code, _, err = send(server, "<ping")
    assert code == 2 and "not well-formed" in err
