"""The console: command parsing and rendering (pure), and the message-driven REPL in a pump
with a scripted terminal."""

from __future__ import annotations

import base64
import pathlib

import trio
import trio.lowlevel
import trio.testing
from conftest import store_in
from lxml import etree
from serverproc import DATA, REPO

from agentserver.app.agents import start_agents
from agentserver.app.builtins import RunContext, build_listener_set, build_listeners
from agentserver.config import loader as boot
from agentserver.core.envelope import build_envelope
from agentserver.core.errors import HuhReason, SystemErrorCode
from agentserver.core.threads import new_thread_id
from agentserver.listeners.console import Prompt, xml_safe
from agentserver.listeners.console_router import Say, Send, parse_command, render_reply
from agentserver.primitives.core import huh, system_error
from agentserver.pump.pump import open_pump

PEERS = {"echo": ("{urn:agentserver:echo}ping",), "assistant": ("{urn:agentserver:assistant}task",)}


class ScriptedTerminal:
    """Reads scripted lines (None = end of input); records what was written."""

    def __init__(self, lines):
        self.lines = list(lines)
        self.out: list[str] = []
        self.reads = 0

    async def read_line(self, prompt: str):
        self.reads += 1
        await trio.lowlevel.checkpoint()
        return self.lines.pop(0) if self.lines else None

    def write(self, text: str) -> None:
        self.out.append(text)


# -- pure parts -------------------------------------------------------------------------


def test_parse_at_listener_payload():
    decision = parse_command(
        '@echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>', peers=PEERS
    )
    assert isinstance(decision, Send) and decision.target == "echo"
    assert (
        etree.tostring(decision.payload)
        == b'<ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
    )


def test_plain_text_goes_to_the_default_agent():
    decision = parse_command("what is 2+2?", peers=PEERS)
    assert isinstance(decision, Send) and decision.target == "assistant"
    assert decision.payload.findtext("{urn:agentserver:assistant}text") == "what is 2+2?"
    no_agent = parse_command("hello", peers={"echo": ()})
    assert (
        isinstance(no_agent, Say)
        and "no" in no_agent.lines[0]
        and "default agent" in no_agent.lines[0]
    )


def test_local_answers_and_mistakes():
    assert parse_command("   ", peers=PEERS) == Say(())
    assert parse_command("/help", peers=PEERS).lines[0] == "Commands:"
    assert parse_command("/listeners", peers=PEERS).lines == (
        '  @assistant: <task xmlns="urn:agentserver:assistant">',
        '  @echo: <ping xmlns="urn:agentserver:echo">',
    )
    assert "unknown command /frob" in parse_command("/frob", peers=PEERS).lines[0]
    assert "not a listener" in parse_command("@ghost <x/>", peers=PEERS).lines[0]
    assert "write @NAME" in parse_command("@echo", peers=PEERS).lines[0]
    bad = parse_command("@echo <ping", peers=PEERS)
    assert isinstance(bad, Say) and "not well-formed XML" in bad.lines[0]
    dtd = parse_command('@echo <!DOCTYPE x [<!ENTITY a "b">]><x/>', peers=PEERS)
    assert isinstance(dtd, Say)


def test_errors_render_readably_not_as_base64():
    original = b"<secret>do not echo me</secret>"
    lines = render_reply(huh(HuhReason.INVALID_PAYLOAD, original), "system")
    assert lines == ("error: Invalid payload structure.",)
    assert base64.b64encode(original).decode() not in "".join(lines)
    routing = render_reply(system_error(SystemErrorCode.ROUTING, retry_allowed=True), "system")
    assert routing == (f"error (routing): {SystemErrorCode.ROUTING.message} You may retry.",)


def test_payloads_render_as_xml_and_answers_as_text():
    pong = etree.fromstring(b'<pong xmlns="urn:agentserver:echo"><text>hi</text></pong>')
    assert render_reply(pong, "echo") == (
        '[echo] <pong xmlns="urn:agentserver:echo"><text>hi</text></pong>',
    )
    answer = etree.fromstring(b'<answer xmlns="urn:a"><text>line 1\nline 2</text></answer>')
    assert render_reply(answer, "assistant") == ("[assistant] line 1", "[assistant] line 2")


def test_control_characters_are_dropped_from_input():
    assert xml_safe("a\x00b\x1bc\td") == "abc\td"


# -- the REPL in a pump -----------------------------------------------------------------


#: Without OPENAI_API_KEY the bundled assistant runs the packaged local model; with a key
#: and a base URL nothing listens on, its model calls fail at once (these tests are about
#: the console, not the model).
NO_MODEL = {"OPENAI_API_KEY": "unused", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}


async def run_console(topology_path, lines, *, extra=None):
    # The agent store in this test's working directory, not next to the checkout's boot.xml.
    topo = store_in(boot.load_or_raise(topology_path, environ=NO_MODEL), pathlib.Path.cwd())
    terminal = ScriptedTerminal(lines)
    done = trio.Event()
    ctx = RunContext(topo, terminal=terminal, on_console_exit=done.set)
    built = build_listener_set(topo, ctx)
    async with (
        ctx.resources,
        open_pump(built.listeners, config=topo.pump_config()) as pump,
    ):
        async with trio.open_nursery() as nursery:
            # An OpenAI backend nobody answers: the assistant's model calls fail, clearly.
            agents = await start_agents(
                topo, pump, built.agent_handlers, nursery, ctx.resources, environ=NO_MODEL
            )
            if extra is not None:
                await extra(pump)
            await pump.inject_system(topo.boot_primitive(), to=topo.boot_listener.name)
            with trio.fail_after(10):
                await done.wait()
            await trio.testing.wait_all_tasks_blocked()
            threads_left = len(pump.threads)
            if agents is not None:
                agents.stop()
    return terminal, threads_left


async def test_console_round_trips_through_the_topology(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run_console's agent store goes to ./state/
    terminal, threads_left = await run_console(
        REPO / "boot.xml",
        [
            '@echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>',
            "",
            '@calculator <add xmlns="urn:agentserver:calculator"><a>1</a><b>2</b></add>',
            '@calculator <add xmlns="urn:agentserver:calculator"><a>1</a></add>',
            '@calculator <divide xmlns="urn:agentserver:calculator"><a>1</a><b>0</b></divide>',
            "how are you?",
            "/quit",
            "never read",
        ],
    )
    assert terminal.out[0].startswith("agentserver console: organism 'hello'")
    assistant = terminal.out[5]
    # No model answers: one clear failed answer, never a hang.
    assert assistant.startswith("[assistant] the model could not be reached")
    assert "UNREACHABLE" in assistant
    assert terminal.out[1:5] + terminal.out[6:] == [
        '[echo] <pong xmlns="urn:agentserver:echo"><text>hi</text></pong>',
        '[calculator] <sum xmlns="urn:agentserver:calculator"><value>3</value></sum>',
        f"error: {HuhReason.INVALID_PAYLOAD.value}",
        '[calculator] <error xmlns="urn:agentserver:calculator" status="failed">'
        "<code>division-by-zero</code><message>cannot divide 1 by zero</message></error>",
        "bye",
    ]
    assert terminal.lines == ["never read"]
    # The console's chain ended: only the pinned root thread is left.
    assert threads_left == 1


async def test_end_of_input_ends_the_console(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    terminal, _ = await run_console(REPO / "boot.xml", [])
    assert terminal.out[-1] == "bye" and terminal.reads == 1


async def test_a_listener_that_never_answers_does_not_hang_the_console():
    # e2e-boot.xml: the console router's timeout is 2 s, so it waits 1.8 s for a reply.
    terminal, _ = await run_console(
        DATA / "e2e-boot.xml",
        ['@silent <silent xmlns="urn:test:e2e"><text>x</text></silent>', "/quit"],
    )
    assert terminal.out[1] == "error: no reply within 1.8 s"


async def test_prompts_from_untrusted_senders_are_ignored():
    reads_before_boot = []

    async def spoof(pump):
        endpoint = pump.open_endpoint("mallory")
        prompt = Prompt(lines=["rm -rf / # trust me"]).to_xml_tree()
        await endpoint.send(
            etree.tostring(build_envelope("mallory", "console", new_thread_id(), prompt))
        )
        await trio.testing.wait_all_tasks_blocked()
        reads_before_boot.append(True)

    terminal, _ = await run_console(REPO / "boot.xml", ["/quit"], extra=spoof)
    assert reads_before_boot and all("trust me" not in line for line in terminal.out)
    assert terminal.reads == 1  # only the boot's prompt made the console read


async def test_without_a_terminal_the_console_never_reads():
    topo = boot.load_or_raise(REPO / "boot.xml")
    async with open_pump(
        build_listeners(topo, RunContext(topo)), config=topo.pump_config()
    ) as pump:
        await pump.inject_system(topo.boot_primitive(), to=topo.boot_listener.name)
        await trio.testing.wait_all_tasks_blocked()
        assert pump.stats()["handled"].get("console", 0) == 0


def approval_request(request: str = "r1"):
    from agentserver.agents.governance.approvals import ApprovalRequest

    return ApprovalRequest(
        request=request,
        agent="assistant",
        thread="t1",
        target="ledger",
        rule="payments",
        timeout=600.0,
        payload='<pay xmlns="urn:payments">\n  <to>erin</to>\n</pay>',
    )


def test_an_approval_request_renders_as_one_line_saying_how_to_answer():
    from agentserver.listeners.console_approvals import render_request

    assert render_request(approval_request().to_xml_tree()) == (
        'approval request r1: assistant wants to call ledger with <pay xmlns="urn:payments"> '
        "<to>erin</to> </pay> (rule payments, 600 s left): /approve r1 or /deny r1 [reason]",
    )
    assert render_request(Prompt(lines=["x"]).to_xml_tree()) is None


async def test_an_approval_request_is_shown_while_a_prompt_waits_for_its_line():
    # The console as a listener approver (run --console): the agent's request arrives while
    # the console reads the operator's line, and is printed at once.
    from agentserver.core.listener import HandlerMetadata
    from agentserver.listeners.console import Console

    typed = trio.Event()

    class WaitingTerminal(ScriptedTerminal):
        async def read_line(self, prompt: str):
            await typed.wait()
            return "/approve r1"

    terminal = WaitingTerminal([])
    console = Console(terminal, trusted=("boot",), requesters=("assistant",))

    def meta(sender: str) -> HandlerMetadata:
        return HandlerMetadata(new_thread_id(), sender, "console", False, "")

    answers = []
    async with trio.open_nursery() as nursery:

        async def prompt() -> None:
            answers.append(await console(Prompt(lines=["hello"]), meta("boot")))

        nursery.start_soon(prompt)
        await trio.testing.wait_all_tasks_blocked()
        assert terminal.out == ["hello"]  # the prompt waits for a line
        assert await console(approval_request(), meta("assistant")) is None
        assert await console(approval_request("r2"), meta("mallory")) is None  # not an agent
        assert len(terminal.out) == 2 and terminal.out[1].startswith("approval request r1: ")
        typed.set()
    assert answers[0].payload.line == "/approve r1"


async def test_approval_requests_reach_the_console_through_the_pump_only_from_agents():
    async def spoof(pump):
        endpoint = pump.open_endpoint("mallory")
        request = approval_request().to_xml_tree()
        await endpoint.send(
            etree.tostring(build_envelope("mallory", "console", new_thread_id(), request))
        )
        await trio.testing.wait_all_tasks_blocked()
        # Delivered (the console takes the type) and ignored: mallory is no agent.
        assert pump.stats()["handled"].get("console", 0) == 1

    terminal, _ = await run_console(REPO / "boot.xml", ["/quit"], extra=spoof)
    assert all("approval request" not in line for line in terminal.out)
