"""The interactive console on prompt_toolkit, driven through a pseudo-terminal: history
recall (kept in a file), completion of @listener names and /commands, /describe, the
working indicator, and Ctrl-C stopping the server at once (not after drain-timeout)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pexpect
import pytest
from serverproc import REPO, ServerProcess, outside_checkout

from agentserver.console.terminal import COMMANDS, completions, history_path

#: prompt_toolkit turns bracketed paste on each time a prompt starts: the prompt is up.
READY = "\x1b[?2004h"
PING = '@echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
NS = "https://xml-pipeline.org/ns/boot/v1"


def test_completions():
    names = ["echo", "calculator", "assistant"]
    assert completions("@ec", names) == [("@echo ", -3)]
    assert completions("@", names) == [("@assistant ", -1), ("@calculator ", -1), ("@echo ", -1)]
    assert completions("/d", names) == [("/describe", -2)]
    assert [c for c, _ in completions("/", names)] == list(COMMANDS)
    assert completions("/describe ca", names) == [("calculator", -2)]
    assert completions("/describe @ca", names) == [("calculator", -3)]
    assert completions("@echo <ping", names) == []
    assert completions("hello", names) == []


def test_history_path():
    assert history_path({"AGENTSERVER_HISTORY": "/x/h"}).as_posix() == "/x/h"
    assert history_path({"AGENTSERVER_HISTORY": ""}) is None
    assert history_path({"HOME": "/home/u"}).as_posix() == (
        "/home/u/.local/state/agentserver/console_history"
    )
    assert history_path({"XDG_STATE_HOME": "/s"}).as_posix() == "/s/agentserver/console_history"


def spawn(args: list[str], home, **kw) -> pexpect.spawn:
    env = dict(os.environ, HOME=str(home), TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
    env.pop("AGENTSERVER_HISTORY", None)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "agentserver", *args],
        env=env,
        cwd=str(home),
        encoding="utf-8",
        timeout=20,
        dimensions=(40, 200),
        **kw,
    )
    return child


def expect_then_prompt(child: pexpect.spawn, *texts: str) -> None:
    """``texts`` in order, and the prompt back (READY). The prompt returns as the command
    ends, which may reach the terminal before or after the command's output: it is
    looked for in everything since the first text's wait began."""
    since = ""
    for text in texts:
        child.expect_exact(text)
        since += child.before + child.after
    if READY not in since:
        child.expect_exact(READY)


def type_and_complete(child: pexpect.spawn, text: str) -> None:
    # As a person would: the completer runs after the keys have arrived.
    child.send(text)
    time.sleep(0.3)
    child.send("\t")


@pytest.mark.slow
def test_run_console_history_completion_describe_and_ctrl_c(tmp_path):
    boot = outside_checkout(REPO / "boot.xml", tmp_path)  # its agent store goes next to it
    child = spawn(["run", str(boot), "--port", "0", "--console"], tmp_path)
    try:
        child.expect_exact(READY)
        child.send(PING + "\r")
        expect_then_prompt(child, "working…", "[echo] <pong")
        child.send("\x1b[A")  # Up: the last line comes back
        child.expect_exact("<text>hi</text>")
        child.send("\x15")  # Ctrl-U: erase it
        type_and_complete(child, "@ec")
        child.expect_exact("@echo ")
        child.send("\x15")
        type_and_complete(child, "/describe calc")
        child.expect_exact("calculator")
        time.sleep(0.3)
        child.send("\r")
        expect_then_prompt(child, "@calculator: Integer arithmetic.", "<multiply xmlns=")
        child.send("\x03")  # Ctrl-C at the prompt: leave, and the server stops
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    history = (tmp_path / ".local/state/agentserver/console_history").read_text()
    assert PING in history and "/describe calculator" in history


@pytest.mark.slow
def test_ctrl_c_while_waiting_stops_without_draining_for_drain_timeout(tmp_path):
    (tmp_path / "sleepy.py").write_text(
        textwrap.dedent(
            """\
            import trio
            from pydantic_xml import BaseXmlModel, element

            class Nap(BaseXmlModel, tag="nap", nsmap={"": "urn:test:sleepy"}):
                seconds: int = element()

            async def nap(payload: Nap, meta) -> None:
                await trio.sleep(payload.seconds)
            """
        )
    )
    boot = tmp_path / "boot.xml"
    boot.write_text(
        f"""<organism xmlns="{NS}" name="sleepy">
  <limits drain-timeout="600"/>
  <listeners>
    <listener name="boot" handler="system-boot" peers="console"/>
    <listener name="sleepy" handler="sleepy:nap" timeout="1200" ends-chains="true">
      <accepts type="sleepy:Nap"/>
    </listener>
    <listener name="console" handler="console" peers="console-router"/>
    <listener name="console-router" handler="console-router" peers="sleepy" timeout="1000"/>
  </listeners>
</organism>
"""
    )
    child = spawn(["run", str(boot), "--port", "0", "--console"], tmp_path)
    try:
        child.expect_exact(READY)
        child.send('@sleepy <nap xmlns="urn:test:sleepy"><seconds>1000</seconds></nap>\r')
        child.expect_exact("working…")
        child.send("\x03")  # no prompt is up: the terminal sends SIGINT
        # The console's grace (0.5 s), not the 600 s of drain-timeout nor the nap's
        # 1000 s: a bound far from both, so a loaded machine cannot confuse them.
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.slow
def test_remote_console_completes_names_it_asks_the_server_for(tmp_path):
    server = ServerProcess.start(REPO / "boot.xml")
    try:
        child = spawn(["console", "--connect", f"{server.host}:{server.port}"], tmp_path)
        try:
            child.expect_exact(READY)
            type_and_complete(child, "/describe ec")
            child.expect_exact("echo")
            time.sleep(0.3)
            child.send("\r")
            expect_then_prompt(child, "<text>: string")
            child.send("\x04")  # Ctrl-D: leave
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        assert child.exitstatus == 0
    finally:
        assert server.stop() == 0


def test_describe_is_answered_by_the_router():
    from agentserver.listeners.console_router import Say, listener_names, parse_command

    peers = {"echo": ("{urn:agentserver:echo}ping",)}

    def describe(name: str) -> tuple[str, ...]:
        return (f"@{name}: described",)

    assert parse_command("/describe echo", peers=peers, describe=describe) == Say(
        ("@echo: described",)
    )
    assert parse_command("/describe @echo", peers=peers, describe=describe) == Say(
        ("@echo: described",)
    )
    assert "not a listener" in parse_command("/describe x", peers=peers).lines[0]
    assert parse_command("/describe", peers=peers).lines[0].startswith("error: write /describe")
    assert parse_command("/describe echo", peers=peers) == Say(
        ('  <ping xmlns="urn:agentserver:echo">',)
    )
    assert listener_names(["  @echo: <ping …>", "  @calculator: <add …>"]) == [
        "echo",
        "calculator",
    ]


@pytest.mark.slow
def test_run_console_shows_an_agent_s_streamed_text_then_its_answer(tmp_path):
    import shutil
    import subprocess

    example = REPO / "examples" / "agent-tool"
    for name in ("glossary.py", "scripted_model.py"):
        shutil.copy(example / name, tmp_path / name)
    model = subprocess.Popen(
        [sys.executable, "scripted_model.py", "--port", "0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = model.stdout.readline().split()[-1]
        (tmp_path / "boot.xml").write_text(
            f"""<organism xmlns="{NS}" name="streaming">
  <llm>
    <backend name="scripted" provider="openai" base-url="{url}"><model name="scripted"/></backend>
  </llm>
  <store path="state/agents.sqlite3"/>
  <listeners>
    <listener name="boot" handler="system-boot" peers="console"/>
    <listener name="glossary" handler="glossary:lookup">
      <accepts type="glossary:Lookup"/><responds type="glossary:Definition"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="glossary">
      <agent model="scripted" max-steps="4"/>
    </listener>
    <listener name="console" handler="console" peers="console-router"/>
    <listener name="console-router" handler="console-router" peers="assistant glossary"/>
  </listeners>
</organism>
"""
        )
        child = spawn(["run", "boot.xml", "--port", "0", "--console"], tmp_path)
        try:
            child.expect_exact(READY)
            child.send('What is a "pump"?\r')
            child.expect_exact("working…")
            # The model's first reply, streamed as it comes (in two writes): the tool call.
            child.expect_exact("<lookup xmlns=")
            child.expect_exact("</term></lookup>")
            # Its second, streamed, then the agent's answer as the console renders it.
            expect_then_prompt(
                child,
                "pump: the router that validates",
                "[assistant] pump: the router that validates",
            )
            child.send("/quit\r")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        assert child.exitstatus == 0
    finally:
        model.terminate()
        model.wait(10)
        model.stdout.close()
