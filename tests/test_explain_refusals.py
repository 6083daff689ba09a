"""run --explain-refusals: each <huh> carries the logged reason (development, loopback
only); without it the canned text stays the rule."""

from __future__ import annotations

import subprocess
import sys

from conftest import Ping, Pong, envelope_bytes, huh_text, receive
from lxml import etree
from serverproc import REPO, ServerProcess, cli, scratch_dir, subprocess_env

from agentserver.core.errors import HuhReason
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.listeners.calculator import Add, Sum, handle
from agentserver.pump.pump import PumpConfig, open_pump

BAD_ADD = b'<add xmlns="urn:agentserver:calculator"><a>2</a></add>'
DETAIL = "{https://xml-pipeline.org/ns/core/v1}detail"


def calculator() -> Listener:
    return Listener("calculator", (Add,), handle, responses=(Sum,))


async def test_without_the_option_a_huh_has_only_the_canned_text():
    async with open_pump([calculator()]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(etree.fromstring(BAD_ADD), to="calculator"))
        _, payload = await receive(ep)
        assert huh_text(payload) == HuhReason.INVALID_PAYLOAD.value
        assert payload.find(DETAIL) is None


async def test_with_it_a_huh_says_what_is_missing():
    async with open_pump([calculator()], config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(etree.fromstring(BAD_ADD), to="calculator"))
        _, payload = await receive(ep)
        assert huh_text(payload) == HuhReason.INVALID_PAYLOAD.value  # still the canned text
        assert payload.findtext(DETAIL).endswith(
            "<add>: Missing child element(s). Expected is ( <b> )."
        )


async def test_a_forgotten_responds_is_explained_to_the_caller():
    async def forgetful(payload: Ping, meta: HandlerMetadata) -> HandlerResponse:
        return HandlerResponse.respond(Pong(text=payload.text))

    listeners = [Listener("fg", (Ping,), forgetful)]
    async with open_pump(listeners, config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="fg"))
        _, payload = await receive(ep)
        assert huh_text(payload) == HuhReason.HANDLER_FAILED.value
        detail = payload.findtext(DETAIL)
        assert "fg: its output was refused and its handler does not take <huh>" in detail
        assert "unknown root tag {urn:test:pump}pong" in detail


async def test_a_handler_exception_is_explained():
    async def broken(payload: Ping, meta: HandlerMetadata) -> None:
        raise KeyError("missing-key")

    listeners = [Listener("br", (Ping,), broken)]
    async with open_pump(listeners, config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="br"))
        _, payload = await receive(ep)
        assert payload.findtext(DETAIL) == "br: handler raised KeyError: 'missing-key'"


NO_NAMESPACE = (
    b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>x</from>'
    b"<thread>t1</thread></meta><add><a>1</a><b>2</b></add></message>"
)
ADD = "{urn:agentserver:calculator}add"


async def test_a_payload_without_a_namespace_is_explained_with_what_the_listener_accepts(
    caplog,
):
    caplog.set_level("INFO", logger="agentserver.pump")
    async with open_pump([calculator()], config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(NO_NAMESPACE)
        _, payload = await receive(ep)
    assert huh_text(payload) == HuhReason.INVALID_ENVELOPE.value  # still the canned text
    expected = f"payload `add` has no namespace; listener `calculator` accepts `{ADD}`"
    assert payload.findtext(DETAIL) == expected
    assert expected in caplog.text  # the server's log says it too


async def test_a_namespace_no_listener_accepts_is_explained(caplog):
    wrong = etree.fromstring(b'<add xmlns="urn:me:calc"><a>1</a><b>2</b></add>')
    async with open_pump([calculator()], config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(wrong, to="calculator"))
        _, payload = await receive(ep)
        await ep.send(envelope_bytes(etree.fromstring(b'<sub xmlns="urn:me:calc"/>')))
        _, other = await receive(ep)
    assert huh_text(payload) == HuhReason.INVALID_PAYLOAD.value
    assert payload.findtext(DETAIL) == (
        "payload `add` has namespace `urn:me:calc`, which no listener accepts; "
        f"listener `calculator` accepts `{ADD}`"
    )
    assert other.findtext(DETAIL) == (
        "payload `sub` has namespace `urn:me:calc`, which no listener accepts; "
        "no listener accepts a payload named `sub`"
    )


async def test_a_registered_tag_nobody_takes_names_what_the_listeners_take():
    # <sum> is calculator's answer type: registered, but no listener accepts it.
    answer = etree.fromstring(b'<sum xmlns="urn:agentserver:calculator"><value>1</value></sum>')
    async with open_pump([calculator()], config=PumpConfig(explain_refusals=True)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(answer))
        _, payload = await receive(ep)
    assert huh_text(payload) == HuhReason.INVALID_PAYLOAD.value
    assert payload.findtext(DETAIL) == (
        "nobody takes {urn:agentserver:calculator}sum; no listener accepts a payload named `sum`"
    )


async def test_without_the_option_the_namespace_slip_is_logged_not_sent(caplog):
    caplog.set_level("INFO", logger="agentserver.pump")
    async with open_pump([calculator()]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(NO_NAMESPACE)
        _, payload = await receive(ep)
    # The sender learns nothing of the topology (no probing) ...
    assert huh_text(payload) == HuhReason.INVALID_ENVELOPE.value
    assert payload.find(DETAIL) is None
    assert b"calculator" not in etree.tostring(payload)
    # ... the operator's log says which case it is and what the listener accepts.
    assert f"payload `add` has no namespace; listener `calculator` accepts `{ADD}`" in caplog.text


def test_run_explains_a_payload_without_a_namespace_end_to_end():
    server = ServerProcess.start(REPO / "boot.xml", "--explain-refusals")
    try:
        result = cli(
            "send",
            "--connect",
            f"{server.host}:{server.port}",
            input=b"<add><a>2</a><b>3</b></add>",
        )
        assert result.returncode == 1
        err = result.stderr.decode().strip()
        assert err.startswith("huh from system: Envelope is not valid. ("), err
        assert f"payload `add` has no namespace; listener `calculator` accepts `{ADD}`" in err
    finally:
        assert server.stop() == 0


def test_run_with_explain_refusals_end_to_end():
    server = ServerProcess.start(REPO / "boot.xml", "--explain-refusals")
    try:
        result = cli(
            "send", "--connect", f"{server.host}:{server.port}", "--to", "calculator", input=BAD_ADD
        )
        assert result.returncode == 1
        err = result.stderr.decode().strip()
        assert err.startswith("huh from system: Invalid payload structure. (")
        assert "Expected is ( <b> )" in err
    finally:
        assert server.stop() == 0
    assert "--explain-refusals: every <huh> carries the reason" in server.stderr


def test_explain_refusals_is_refused_off_loopback():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentserver",
            "run",
            str(REPO / "boot.xml"),
            "--host",
            "0.0.0.0",
            "--insecure",
            "--port",
            "0",
            "--explain-refusals",
        ],
        capture_output=True,
        env=subprocess_env(),
        cwd=scratch_dir(),
        timeout=30,
    )
    assert result.returncode == 1
    assert b"--explain-refusals is for development on a loopback address" in result.stderr
