"""Remote listeners whose payload types come from an XSD file (<accepts schema= root=>)."""

from __future__ import annotations

import os
import pathlib
import sys
from functools import partial

import trio
from lxml import etree
from serverutil import start_in_process

from agentserver.app.builtins import RunContext, build_listeners
from agentserver.config import loader as boot
from agentserver.core.namespaces import CORE_NS
from agentserver.net.client import open_client
from agentserver.pump.pump import Pump

NS = "urn:test:xsdsearch"
XSD = f"""<?xml version="1.0"?>
<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:s="{NS}"
           targetNamespace="{NS}" elementFormDefault="qualified">
  <xs:complexType name="query">
    <xs:sequence>
      <xs:element name="text" type="xs:string"/>
      <xs:element name="limit" type="xs:integer" minOccurs="0"/>
    </xs:sequence>
  </xs:complexType>
  <xs:element name="query" type="s:query"/>
  <xs:element name="result">
    <xs:complexType>
      <xs:sequence>
        <xs:element name="text" type="xs:string"/>
        <xs:element name="runner" type="xs:string"/>
      </xs:sequence>
    </xs:complexType>
  </xs:element>
</xs:schema>
"""
ENV = {"RT_ALICE": "alice-token", "RT_RUNNER": "runner-token"}


def boot_xml(accepts: str = "", responds: str = "") -> bytes:
    accepts = accepts or f'<accepts schema="schemas/search.xsd" root="{{{NS}}}query"/>'
    responds = responds or f'<responds schema="schemas/search.xsd" root="{{{NS}}}result"/>'
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="xsd">
  <limits drain-timeout="1" hello-timeout="2"/>
  <clients>
    <client name="alice" token-env="RT_ALICE"/>
    <client name="search-runner" token-env="RT_RUNNER" serves="search"/>
  </clients>
  <listeners>
    <listener name="search" remote="true" timeout="5">{accepts}{responds}</listener>
  </listeners>
</organism>""".encode()


def write_boot(tmp_path: pathlib.Path, xml: bytes, xsd: str = XSD) -> pathlib.Path:
    (tmp_path / "schemas").mkdir(exist_ok=True)
    (tmp_path / "schemas" / "search.xsd").write_text(xsd)
    path = tmp_path / "boot.xml"
    path.write_bytes(xml)
    return path


def problems(tmp_path: pathlib.Path, xml: bytes, xsd: str = XSD) -> list[str]:
    result = boot.load(write_boot(tmp_path, xml, xsd), environ=ENV)
    return [p.message for p in result.problems if not p.warning]


def query(text: str, extra: str = "") -> etree._Element:
    el = etree.Element(f"{{{NS}}}query", nsmap={None: NS})
    etree.SubElement(el, f"{{{NS}}}text").text = text
    if extra:
        etree.SubElement(el, f"{{{NS}}}{extra}").text = "x"
    return el


def test_a_listener_declared_by_xsd_loads_and_its_types_are_the_files(tmp_path):
    result = boot.load(write_boot(tmp_path, boot_xml()), environ=ENV)
    assert [p.message for p in result.problems] == []
    [spec] = [s for s in result.topology.listeners if s.name == "search"]
    [accepts], [responds] = spec.accepts, spec.responds
    pump = Pump(build_listeners(result.topology, RunContext(result.topology)))
    ptype = pump.payloads.get(f"{{{NS}}}query")
    assert ptype is not None and ptype.model is accepts
    assert pump.payloads.get(f"{{{NS}}}result").model is responds
    # The pump validates with the file's schema: an unknown child or a bad integer fails.
    assert ptype.is_valid(query("ok"))
    assert not ptype.is_valid(query("ok", extra="bogus"))
    bad = query("ok")
    etree.SubElement(bad, f"{{{NS}}}limit").text = "many"
    assert not ptype.is_valid(bad)


def test_check_reports_a_missing_file_an_undeclared_root_and_a_mix(tmp_path):
    missing = boot_xml(accepts=f'<accepts schema="schemas/nope.xsd" root="{{{NS}}}query"/>')
    [msg] = problems(tmp_path, missing)
    assert "nope.xsd" in msg and "No such file" in msg
    undeclared = boot_xml(accepts=f'<accepts schema="schemas/search.xsd" root="{{{NS}}}ask"/>')
    [msg] = problems(tmp_path, undeclared)
    assert f"declares no global element {{{NS}}}ask" in msg and f"{{{NS}}}query" in msg
    wrong_ns = boot_xml(accepts='<accepts schema="schemas/search.xsd" root="{urn:other}query"/>')
    assert any("declares no global element" in m for m in problems(tmp_path, wrong_ns))
    no_ns = boot_xml(accepts='<accepts schema="schemas/search.xsd" root="query"/>')
    assert any("{namespace}name" in m for m in problems(tmp_path, no_ns))
    mixed = boot_xml(
        accepts=f'<accepts type="echo.ping" schema="schemas/search.xsd" root="{{{NS}}}query"/>'
    )
    assert any("not a mix" in m for m in problems(tmp_path, mixed))
    assert any(
        "not a valid XSD" in m
        for m in problems(
            tmp_path, boot_xml(), XSD.replace("</xs:schema>", "<xs:element/></xs:schema>")
        )
    )


def test_hostile_schema_files_are_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    hostile = {
        "DOCTYPE": f'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY e SYSTEM "{secret.as_uri()}">]>'
        + XSD.split("?>", 1)[1].replace("<xs:complexType", "<!-- &e; --><xs:complexType", 1),
        "include": XSD.replace(
            "<xs:complexType", f'<xs:include schemaLocation="{secret.as_uri()}"/><xs:complexType', 1
        ),
        "import": XSD.replace(
            "<xs:complexType",
            '<xs:import namespace="urn:x" schemaLocation="http://127.0.0.1:9/x.xsd"/>'
            "<xs:complexType",
            1,
        ),
        "too large": XSD.replace(
            "<xs:complexType", "<!--" + "x" * (1 << 20) + "--><xs:complexType", 1
        ),
        "not a schema": "<html/>",
    }
    for what, text in hostile.items():
        msgs = problems(tmp_path, boot_xml(), text)
        assert msgs, what
        assert all("s3cret" not in m for m in msgs)
        assert any("schema file" in m for m in msgs), (what, msgs)


def test_agent_usage_instructions_describe_an_xsd_peer(tmp_path):
    xml = boot_xml().replace(
        b"</listeners>",
        b'<listener name="helper" handler="echo" peers="search"/></listeners>',
    )
    result = boot.load(write_boot(tmp_path, xml), environ=ENV)
    assert [p.message for p in result.problems if not p.warning] == []
    pump = Pump(build_listeners(result.topology, RunContext(result.topology)))
    pump.roster.freeze()
    usage = pump.usage_instructions("helper")
    assert "peer 'search' accepts:" in usage
    assert f'<query xmlns="{NS}">' in usage
    assert "<text>: string" in usage and "<limit>: integer (optional)" in usage


async def test_a_raw_socket_runner_serves_a_listener_declared_only_by_xsd(tmp_path):
    topology = boot.load(write_boot(tmp_path, boot_xml()), environ=ENV).topology
    ctx = RunContext(topology)
    script = pathlib.Path(__file__).with_name("raw_runner.py")
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, ctx, environ=ENV)
        port = server.port
        hub = server.runner_hub
        env = {**os.environ, "RAW_RUNNER_TOKEN": ENV["RT_RUNNER"]}
        cmd = [sys.executable, "-I", str(script), "127.0.0.1", str(port), "search-runner"]
        proc = await nursery.start(
            partial(trio.run_process, [*cmd, "search"], env=env, check=False)
        )
        with trio.fail_after(5):
            await hub.wait_runners("search", 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            reply = await c.request(query("hello"), to="search", timeout=5)
            assert reply.payload.tag == f"{{{NS}}}result"
            assert reply.payload.findtext(f"{{{NS}}}text") == "HELLO"
            assert reply.payload.findtext(f"{{{NS}}}runner") == "raw"
            # What the schema refuses never reaches the runner.
            refused = await c.request(query("x", extra="bogus"), to="search", timeout=5)
            assert refused.payload.tag == f"{{{CORE_NS}}}huh"
        proc.kill()
        server.shutdown.set()


def test_agentserver_check_names_the_line_of_a_bad_schema_reference(tmp_path):
    from cliutil import cli_in_process

    xml = boot_xml(responds=f'<responds schema="schemas/gone.xsd" root="{{{NS}}}result"/>')
    path = write_boot(tmp_path, xml)
    result = cli_in_process("check", str(path), env={**os.environ, **ENV})
    assert result.returncode == 1
    [line, summary] = result.stdout.decode().splitlines()
    assert summary == f"{path}: 1 error"
    # boot_xml writes <responds> on the <listener> line, the 9th.
    assert line.startswith(f"{path}:9: ") and "gone.xsd" in line, line
