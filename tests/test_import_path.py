"""A module written next to boot.xml imports with no PYTHONPATH (docs/boot.md), and a
listener that fails to import is reported once, without follow-on errors."""

from __future__ import annotations

import os
import textwrap

from serverproc import ServerProcess

from agentserver.config import loader as boot
from agentserver.net.client import open_client

NS = "https://xml-pipeline.org/ns/boot/v1"

REVERSE_PY = """\
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerResponse

NSMAP = {"": "urn:example:reverse"}


class Reverse(BaseXmlModel, tag="reverse", nsmap=NSMAP):
    text: str = element()


class Reversed(BaseXmlModel, tag="reversed", nsmap=NSMAP):
    text: str = element()


async def handle(payload: Reverse, meta) -> HandlerResponse:
    return HandlerResponse.respond(Reversed(text=payload.text[::-1]))
"""


def boot_xml(module: str) -> str:
    return textwrap.dedent(
        f"""\
        <organism xmlns="{NS}" name="t">
          <listeners>
            <listener name="{module}" handler="{module}:handle">
              <accepts type="{module}:Reverse"/>
              <responds type="{module}:Reversed"/>
            </listener>
            <listener name="caller" handler="echo" peers="{module}"/>
          </listeners>
        </organism>
        """
    )


def test_a_module_next_to_boot_xml_imports(tmp_path):
    # A unique module name: this process keeps what it imported.
    (tmp_path / "reverse_unit.py").write_text(REVERSE_PY)
    path = tmp_path / "boot.xml"
    path.write_text(boot_xml("reverse_unit"))
    result = boot.load(path, environ={})
    assert result.ok, [str(p) for p in result.problems]
    assert result.topology.listener("reverse_unit").handler.__module__ == "reverse_unit"


def test_a_broken_module_is_one_error_without_follow_ons(tmp_path):
    (tmp_path / "broken_unit.py").write_text("raise RuntimeError('boom at import')\n")
    path = tmp_path / "boot.xml"
    path.write_text(boot_xml("broken_unit"))
    result = boot.load(path, environ={})
    assert not result.ok
    # One error; what fails because of it is said under it, as knock-on notes (issue 45).
    (problem,) = [str(p) for p in result.problems]
    first, *notes = problem.splitlines()
    assert first == (
        f"{path}:3: listener 'broken_unit': cannot import module 'broken_unit': boom at import"
    )
    assert notes and all(n.startswith("    (so ") for n in notes), notes


def test_a_missing_module_is_one_error(tmp_path):
    path = tmp_path / "boot.xml"
    path.write_text(boot_xml("no_such_module_here"))
    messages = [str(p) for p in boot.load(path, environ={}).problems]
    assert len(messages) == 1 and "cannot import module 'no_such_module_here'" in messages[0]


async def test_run_imports_a_listener_next_to_its_boot_xml_without_pythonpath(tmp_path):
    (tmp_path / "reverse.py").write_text(REVERSE_PY)
    path = tmp_path / "boot.xml"
    path.write_text(boot_xml("reverse"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "elsewhere"  # not the boot file's directory
    work.mkdir()
    server = ServerProcess.start(path, env=env, cwd=work)
    try:
        async with open_client(server.host, server.port) as client:
            reply = await client.request(
                '<reverse xmlns="urn:example:reverse"><text>abc</text></reverse>',
                to="reverse",
                timeout=10,
            )
        assert reply.from_id == "reverse"
        assert "<text>cba</text>" in reply.payload_xml
    finally:
        assert server.stop() == 0, server.stderr
