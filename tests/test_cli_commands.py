"""The agentserver command: check, run, send, --help, and SIGTERM with work in flight.

``check``, ``schemas``, ``--help`` and usage errors run in this process
(tests/cliutil.py); :func:`test_check_schemas_and_help_in_a_real_process` is their one
smoke test through ``python -m agentserver``."""

from __future__ import annotations

import re
import signal
import socket
import textwrap

import pytest
import trio
from cliutil import cli_in_process
from e2e_handlers import Job, LongJob
from serverproc import DATA, REPO, ServerProcess, cli, subprocess_env

from agentserver.net.client import open_client

PING = b'<ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
CORE = "https://xml-pipeline.org/ns/core/v1"


def connect(server) -> str:
    return f"{server.host}:{server.port}"


# -- check ------------------------------------------------------------------------------


def test_check_bundled_boot_is_ok_with_a_summary():
    result = cli_in_process("check", str(REPO / "boot.xml"), env=subprocess_env(OPENAI_API_KEY="k"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout.decode().strip().splitlines()
    # The agent's version (its digest: no name in the file), then the summary.
    assert re.fullmatch(
        rf"{re.escape(str(REPO / 'boot.xml'))}: agent 'assistant': version [0-9a-f]{{12}} "
        r"\(upgrade\)",
        out[0],
    ), out
    assert out[1:] == [f"{REPO / 'boot.xml'}: OK: organism 'hello', 6 listeners, 0 clients"]


def test_check_warns_about_an_unset_api_key_but_passes():
    env = subprocess_env()
    env.pop("OPENAI_API_KEY", None)
    result = cli_in_process("check", str(REPO / "boot.xml"), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (result.stdout + result.stderr).decode()
    assert "OPENAI_API_KEY" in text and "skipped" in text
    # One: the OpenAI backend is skipped; the bundled assistant's local model stands in.
    assert "1 warning" in text


BAD = textwrap.dedent(
    """\
    <?xml version="1.0"?>
    <organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="bad">
      <listeners>
        <listener name="a" handler="nosuchmodule_xyz:handle">
          <accepts type="echo.ping"/>
        </listener>
        <listener name="b" handler="echo" peers="ghost"/>
        <listener name="b" handler="calculator"/>
        <listener name="c" handler="agentserver.listeners.echo:handle">
          <accepts type="agentserver.listeners.echo:Nope"/>
        </listener>
        <listener name="d" handler="agentserver.listeners.echo:handle">
          <accepts type="echo.ping"/>
        </listener>
        <listener name="e" handler="no-such-builtin"/>
        <listener name="f" handler="agentserver.listeners.echo:Ping">
          <accepts type="nope.type"/>
        </listener>
      </listeners>
      <clients><client name="zed" token-env="AGENTSERVER_TEST_UNSET_VAR"/></clients>
    </organism>
    """
)


def test_check_reports_every_problem_with_its_line(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text(BAD)
    result = cli_in_process("check", str(path))
    assert result.returncode == 1
    # One stream: errors, warnings and the summary all on standard output, in line order.
    assert result.stderr == b""
    *out, warning, summary = result.stdout.decode().splitlines()
    lines = [x for x in out if ": warning: " not in x]
    expect = [
        (4, "cannot import module 'nosuchmodule_xyz'"),
        (7, "unknown peer 'ghost'"),
        (8, "listener name 'b' is already used on line 7"),
        (10, "has no 'Nope'"),
        (12, "root tag {urn:agentserver:echo}ping is accepted by b (line 7), d (line 12)"),
        (15, "unknown built-in handler 'no-such-builtin'"),
        (16, "is not an async function"),
        (17, "unknown payload type 'nope.type'"),
    ]
    for line, fragment in expect:
        assert any(x.startswith(f"{path}:{line}: ") and fragment in x for x in lines), (
            line,
            fragment,
            lines,
        )
    assert len(lines) == len(expect), lines
    assert warning.startswith(
        f"{path}:20: warning: client 'zed': token variable AGENTSERVER_TEST_UNSET_VAR is not set"
    )
    assert summary == f"{path}: 8 errors"


def test_check_reports_schema_errors_and_unknown_sections(tmp_path):
    path = tmp_path / "schema.xml"
    path.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="x">\n'
        '  <listeners><listener name="echo" handler="echo" concurrency="0"/></listeners>\n'
        "  <bogus/>\n"
        "</organism>\n"
    )
    result = cli_in_process("check", str(path))
    assert result.returncode == 1
    out = result.stdout.decode()
    assert re.search(rf"^{re.escape(str(path))}:2: .*concurrency", out, re.M), out
    assert re.search(
        rf"^{re.escape(str(path))}:3: Element 'bogus': This element is not expected", out, re.M
    ), out


def test_check_counts_in_the_singular_on_one_stream(tmp_path):
    path = tmp_path / "one.xml"
    path.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="one">\n'
        '  <clients><client name="alice" token-env="ONE_TOKEN"/></clients>\n'
        '  <listeners><listener name="boot" handler="system-boot"/></listeners>\n'
        "</organism>\n"
    )
    result = cli_in_process("check", str(path), env=subprocess_env(ONE_TOKEN="t"))
    assert result.returncode == 0 and result.stderr == b""
    assert result.stdout.decode().splitlines() == [
        f"{path}: OK: organism 'one', 1 listener, 1 client"
    ]


def test_a_knock_on_error_is_said_once_under_the_error_that_caused_it(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: the A2A card is unreachable
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    path = tmp_path / "knock.xml"
    path.write_text(
        textwrap.dedent(
            f"""\
            <organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="knock">
              <clients>
                <client name="alice" token-env="KNOCK_TOKEN">
                  <budget agent="planner" tokens="1000" period="day"/>
                </client>
              </clients>
              <listeners>
                <a2a name="remote" url="http://127.0.0.1:{closed}/"/>
                <listener name="writer" agent="true" handler="assistant" peers="remote-search"/>
                <listener name="planner" agent="true" handler="nosuchmodule_knock:handle"/>
                <listener name="boss" handler="echo" peers="planner"/>
              </listeners>
              <schedules>
                <schedule name="nightly" agent="planner" cron="0 * * * *"><t xmlns="urn:t"/></schedule>
              </schedules>
            </organism>
            """
        )
    )
    result = cli_in_process("check", str(path), env=subprocess_env(KNOCK_TOKEN="t"))
    assert result.returncode == 1
    out = result.stdout.decode()
    # Two causes, two errors; what names the failed parts is said under each, once.
    assert "unknown peer" not in out and "no agent of that name" not in out, out
    assert "is not an agent listener" not in out, out
    lines = out.splitlines()
    assert lines[-1] == f"{path}: 2 errors"
    a2a = lines.index(next(x for x in lines if x.startswith(f"{path}:8: <a2a name='remote'>")))
    assert lines[a2a + 1] == "    (so listener 'writer', line 9, lacks its peer 'remote-search')"
    planner = lines.index(next(x for x in lines if x.startswith(f"{path}:10: listener 'planner'")))
    assert lines[planner + 1 : planner + 4] == [
        "    (so listener 'boss', line 11, lacks its peer 'planner')",
        "    (so <budget agent='planner'>, line 4, has no agent)",
        "    (so schedule 'nightly', line 14, has no agent)",
    ]


def test_exposing_a_failed_listener_is_said_under_its_error(tmp_path):
    """``<expose-mcp listeners>`` and ``<expose-a2a><agent>`` naming a listener that
    failed are knock-on effects of its error, said under it; a name nobody declared is
    still an error of its own."""
    path = tmp_path / "exposed.xml"
    path.write_text(
        textwrap.dedent(
            """\
            <organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="exposed">
              <http port="0"/>
              <listeners>
                <listener name="counter" handler="nosuchmodule_exposed:count"/>
                <listener name="planner" agent="true" handler="nosuchmodule_exposed:plan"/>
                <listener name="boss" handler="echo"/>
              </listeners>
              <expose-mcp listeners="boss counter ghost"/>
              <expose-a2a>
                <agent name="planner"/>
                <agent name="phantom"/>
              </expose-a2a>
            </organism>
            """
        )
    )
    result = cli_in_process("check", str(path))
    assert result.returncode == 1
    out = result.stdout.decode()
    lines = out.splitlines()
    # One module that failed (two listeners with it) and two names nobody declared:
    # three errors, the knock-on effects said once, under their cause.
    assert lines[-1] == f"{path}: 3 errors", out
    assert "'counter'" not in "".join(x for x in lines if x.startswith(f"{path}:8:")), out
    assert "'planner' is not a declared agent" not in out, out
    counter = lines.index(next(x for x in lines if x.startswith(f"{path}:4: listener 'counter'")))
    assert lines[counter + 1 : counter + 4] == [
        "    (so listener 'planner', line 5, fails too)",
        "    (so <expose-mcp>, line 8, lacks its listener 'counter')",
        "    (so <expose-a2a>, line 10, lacks its agent 'planner')",
    ], out
    assert f"{path}:8: <expose-mcp>: unknown listener 'ghost'" in lines
    assert f"{path}:11: <expose-a2a>: 'phantom' is not a declared agent" in lines


def test_check_not_well_formed_and_missing_file(tmp_path):
    path = tmp_path / "broken.xml"
    path.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="x">\n<listeners>\n</organism>\n'
    )
    result = cli_in_process("check", str(path))
    assert result.returncode == 1
    assert result.stdout.decode().startswith(f"{path}:3: not well-formed XML")
    missing = cli_in_process("check", str(tmp_path / "none.xml"))
    assert missing.returncode == 1 and "cannot read" in missing.stdout.decode()


def test_run_refuses_a_boot_file_with_errors(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text(BAD)
    result = cli_in_process("run", str(path), "--port", "0")  # refused before it listens
    assert result.returncode == 1
    assert b"listening" not in result.stderr
    assert f"{path}:7: listener 'b': unknown peer 'ghost'".encode() in result.stdout
    assert b"not started" in result.stderr


def test_run_refuses_anonymous_access_on_a_public_address():
    result = cli("run", str(REPO / "boot.xml"), "--host", "0.0.0.0", "--port", "0", timeout=30)
    assert result.returncode == 1
    assert b"refusing to listen on non-loopback address 0.0.0.0" in result.stderr
    assert b"--insecure" in result.stderr


async def test_run_without_boot_uses_the_bundled_topology(tmp_path):
    proc = ServerProcess.start(None, cwd=tmp_path)  # no ./boot.xml there
    try:
        async with open_client(proc.host, proc.port) as client:
            reply = await client.request(PING, to="echo", timeout=5)
            assert reply.payload_xml == '<pong xmlns="urn:agentserver:echo"><text>hi</text></pong>'
            total = await client.request(
                b'<add xmlns="urn:agentserver:calculator"><a>1</a><b>2</b></add>',
                to="calculator",
                timeout=5,
            )
            assert "<value>3</value>" in total.payload_xml
    finally:
        assert proc.stop() == 0


# -- --help -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((), ["run", "send", "check", "console"]),
        (("run",), ["BOOT", "--host", "--port", "--insecure", "--console"]),
        (("send",), ["--to", "--thread", "--connect", "FILE", "--timeout"]),
        (("check",), ["BOOT", "FILE:LINE: message"]),
        (("console",), ["--connect", "@NAME"]),
        (("replay",), ["AGENT", "THREAD", "--boot", "--store", "--from", "--live-tools"]),
        (("export",), ["AGENT", "THREAD", "--boot", "--store"]),
        (("fork",), ["AGENT", "THREAD", "--at-step", "--task", "--url", "--wait"]),
        (("schedule",), ["add", "list", "pause", "resume", "trigger", "delete"]),
        (("schedule", "add"), ["NAME", "AGENT", "CRON", "--task", "--overlap", "--timezone"]),
        (("schedule", "add"), ["--catchup-window", "--jitter", "--url"]),
    ],
)
def test_help_is_accurate(command, expected):
    result = cli_in_process(*command, "--help")
    assert result.returncode == 0
    text = result.stdout.decode()
    for word in expected:
        assert word in text, (command, word)


def test_no_command_is_a_usage_error():
    result = cli_in_process()
    assert result.returncode == 2 and b"usage:" in result.stderr


# -- send -------------------------------------------------------------------------------


def test_send_prints_the_reply_and_exits_0(server):
    result = cli("send", "--to", "echo", "--connect", connect(server), "-", input=PING)
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode().strip()
    assert out.endswith('<pong xmlns="urn:agentserver:echo"><text>hi</text></pong></message>')
    assert "<from>echo</from>" in out


def test_send_from_a_file_on_a_given_thread(server, tmp_path):
    payload = tmp_path / "add.xml"
    payload.write_bytes(b'<add xmlns="urn:agentserver:calculator"><a>20</a><b>22</b></add>')
    thread = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
    result = cli(
        "send", "--to", "calculator", "--thread", thread, "--connect", connect(server), str(payload)
    )
    assert result.returncode == 0
    assert f"<thread>{thread}</thread>" in result.stdout.decode()
    assert "<value>42</value>" in result.stdout.decode()


def test_send_exits_1_on_huh_and_on_system_error(server):
    huh = cli("send", "--to", "calculator", "--connect", connect(server), input=PING)
    assert huh.returncode == 1 and b"<huh" in huh.stdout
    late = cli(
        "send",
        "--to",
        "slow",
        "--connect",
        connect(server),
        "--timeout",
        "10",
        input=b'<job xmlns="urn:test:e2e"><text>x</text><seconds>5</seconds></job>',
    )
    assert (
        late.returncode == 1
        and b"<SystemError" in late.stdout
        and b"<code>timeout</code>" in late.stdout
    )


def test_send_divide_by_zero_answers_a_readable_error_and_exits_1(server):
    divide = b'<divide xmlns="urn:agentserver:calculator"><a>7</a><b>0</b></divide>'
    result = cli("send", "--to", "calculator", "--connect", connect(server), input=divide)
    assert result.returncode == 1, result.stderr
    out = result.stdout.decode()
    assert (
        '<error xmlns="urn:agentserver:calculator" status="failed">'
        "<code>division-by-zero</code><message>cannot divide 7 by zero</message></error>"
    ) in out
    big = b'<multiply xmlns="urn:agentserver:calculator"><a>9223372036854775807</a><b>2</b></multiply>'
    overflow = cli("send", "--to", "calculator", "--connect", connect(server), input=big)
    assert overflow.returncode == 1 and b"<code>overflow</code>" in overflow.stdout
    # an answer, not a handler crash: nothing in the server's log
    assert "Traceback" not in server.stderr and "handler raised" not in server.stderr


def test_send_exits_1_for_an_agents_failed_answer(tmp_path):
    env = subprocess_env(
        OPENAI_BASE_URL="http://127.0.0.1:9/v1", OPENAI_API_KEY="k", AGENTSERVER_MODEL="m"
    )
    # The bundled boot.xml, without step retries: an unreachable model (a transport
    # error, retryable) would otherwise be retried for 2 + 4 + 8 s before the failed answer.
    text = (REPO / "boot.xml").read_text()
    assert 'memory="client"/>' in text
    boot_file = tmp_path / "boot.xml"
    boot_file.write_text(text.replace('memory="client"/>', 'memory="client" step-retries="0"/>'))
    proc = ServerProcess.start(boot_file, env=env, cwd=tmp_path)
    try:
        task = b'<task xmlns="urn:agentserver:assistant"><text>hello?</text></task>'
        result = cli("send", "--to", "assistant", "--connect", connect(proc), input=task)
    finally:
        assert proc.stop() == 0
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert b'<answer xmlns="urn:agentserver:assistant" status="failed">' in result.stdout
    assert b"could not be reached" in result.stdout


def test_send_exits_3_on_timeout(server):
    result = cli(
        "send",
        "--to",
        "slower",
        "--connect",
        connect(server),
        "--timeout",
        "0.5",
        input=b'<long-job xmlns="urn:test:e2e"><text>x</text><seconds>3</seconds></long-job>',
    )
    assert result.returncode == 3
    assert b"no reply" in result.stderr


def test_send_exits_4_when_nobody_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli("send", "--to", "echo", "--connect", f"127.0.0.1:{port}", input=PING)
    assert result.returncode == 4


def test_send_exits_2_on_bad_input(server):
    malformed = cli("send", "--to", "echo", "--connect", connect(server), input=b"<oops")
    assert malformed.returncode == 2 and b"not well-formed XML" in malformed.stderr
    big = PING.replace(b"<text>", b"<text>" + b"x" * (1 << 20))
    oversize = cli("send", "--to", "echo", "--connect", connect(server), input=big)
    assert oversize.returncode == 2
    assert b"the payload is too large" in oversize.stderr, oversize.stderr
    assert (
        cli(
            "send", "--to", "echo", "--thread", "nope", "--connect", connect(server), input=PING
        ).returncode
        == 2
    )
    # Without --to the root tag routes (issue 17): not a usage error any more.
    assert cli("send", "--connect", connect(server), input=PING).returncode == 0


def test_send_with_a_client_name_and_token(tmp_path):
    env = subprocess_env(E2E_ALICE_TOKEN="alice-secret", E2E_BOB_TOKEN="bob-secret")
    guarded = ServerProcess.start(DATA / "clients-boot.xml", env=env)
    try:
        addr = connect(guarded)
        good = cli(
            "send",
            "--to",
            "echo",
            "--client",
            "alice",
            "--connect",
            addr,
            input=PING,
            env=subprocess_env(AGENTSERVER_TOKEN="alice-secret"),
        )
        assert good.returncode == 0 and b"<to>alice</to>" in good.stdout
        bad = cli(
            "send",
            "--to",
            "echo",
            "--client",
            "alice",
            "--connect",
            addr,
            input=PING,
            env=subprocess_env(AGENTSERVER_TOKEN="wrong"),
        )
        assert bad.returncode == 4  # refused with a <huh> on the hello, then closed
        anonymous = cli("send", "--to", "echo", "--connect", addr, input=PING)
        assert anonymous.returncode == 4
    finally:
        assert guarded.stop() == 0


# -- shutdown ---------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_work_and_exits_0():
    proc = ServerProcess.start(DATA / "e2e-boot.xml")  # drain-timeout="2"
    replies = []
    try:
        async with open_client(proc.host, proc.port) as client:
            quick = {await client.send(Job(text=f"q{i}", seconds=0.5), to="slow") for i in range(5)}
            stuck = {
                await client.send(LongJob(text=f"l{i}", seconds=20), to="slower") for i in range(2)
            }
            await trio.sleep(0.2)
            proc.proc.send_signal(signal.SIGTERM)
            # A bound, not a measure: what shows the drain bound (2 s) cut the 20 s jobs
            # is their replies (a timeout SystemError, not the note a finished job sends).
            with trio.fail_after(60):
                for _ in range(7):
                    replies.append(await client.receive())
            # New connections are no longer accepted.
            with pytest.raises(OSError):
                async with open_client(proc.host, proc.port, connect_timeout=2) as late:
                    await late.request(
                        b'<ping xmlns="urn:agentserver:echo"><text>x</text></ping>',
                        to="echo",
                        timeout=1,
                    )
    finally:
        try:
            # One SIGTERM must be enough: wait for the process to finish on its own.
            code = proc.wait_exit(10)
        finally:
            if proc.proc.poll() is None:
                proc.proc.kill()
    assert code == 0
    by_thread = {r.thread: r for r in replies}
    assert set(by_thread) == quick | stuck
    for t in quick:
        assert by_thread[t].payload.tag == "{urn:test:e2e}note"
    for t in stuck:
        reply = by_thread[t]
        assert reply.is_system_error and reply.payload.findtext(f"{{{CORE}}}code") == "timeout"
    assert "Traceback" not in proc.stderr


def test_schemas_exports_one_valid_xsd_per_payload_namespace(tmp_path):
    from lxml import etree

    result = cli_in_process("schemas", str(REPO / "boot.xml"), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "core.xsd",
        "envelope.xsd",
        # The console takes <approval-request> (it may be a rule's approver).
        "urn-agentserver-approval.xsd",
        "urn-agentserver-assistant.xsd",
        "urn-agentserver-calculator.xsd",
        "urn-agentserver-console.xsd",
        "urn-agentserver-echo.xsd",
    ]
    calc = etree.XMLSchema(etree.parse(str(tmp_path / "urn-agentserver-calculator.xsd")))
    assert calc.validate(
        etree.fromstring(b'<add xmlns="urn:agentserver:calculator"><a>1</a><b>2</b></add>')
    )
    assert not calc.validate(
        etree.fromstring(b'<add xmlns="urn:agentserver:calculator"><a>x</a></add>')
    )


def test_check_schemas_and_help_in_a_real_process(tmp_path):
    # The smoke test of the commands the tests above run in process: the same results
    # through ``python -m agentserver`` (its start-up, imports, exit status, streams).
    check = cli("check", str(REPO / "boot.xml"), env=subprocess_env(OPENAI_API_KEY="k"))
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.decode().strip().endswith("OK: organism 'hello', 6 listeners, 0 clients")
    schemas = cli("schemas", str(REPO / "boot.xml"), "--out", str(tmp_path))
    assert schemas.returncode == 0 and (tmp_path / "core.xsd").is_file(), schemas.stderr
    help_ = cli("--help")
    assert help_.returncode == 0 and b"check" in help_.stdout
    assert cli().returncode == 2
