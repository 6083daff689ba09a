from pathlib import Path

import pytest
from lxml import etree

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.config import (
    profile_from_element,
    schema_file,
    store_settings_from_element,
)
from agentserver.core.namespaces import BOOT_NS

WRAPPER = """<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema"
  xmlns:boot="https://xml-pipeline.org/ns/boot/v1"
  targetNamespace="https://xml-pipeline.org/ns/boot/v1" elementFormDefault="qualified">
  <xs:include schemaLocation="{loc}"/>
  <xs:element name="store" type="boot:StoreSectionType"/>
  <xs:element name="agent" type="boot:AgentProfileType"/>
</xs:schema>"""

STORE = f'<store xmlns="{BOOT_NS}" path="db/a.sqlite3" worker-concurrency="2" max-retries="3"/>'
AGENT = f"""<agent xmlns="{BOOT_NS}" model="gpt-x" max-steps="5" resume-deadline="12.5">
  <system-prompt>  Be brief. </system-prompt>
  <must-end-with>submit_result</must-end-with>
  <result-field name="total">the sum</result-field>
  <result-field name="note" required="false"/>
  <terminate-tool>calculator</terminate-tool>
</agent>"""


@pytest.fixture
def schema(tmp_path):
    with schema_file().open("rb") as f:
        (tmp_path / "boot-agents.xsd").write_bytes(f.read())
    (tmp_path / "w.xsd").write_text(WRAPPER.format(loc="boot-agents.xsd"))
    return etree.XMLSchema(etree.parse(str(tmp_path / "w.xsd")))


def test_examples_validate_and_parse(schema, tmp_path):
    store_el, agent_el = etree.fromstring(STORE), etree.fromstring(AGENT)
    schema.assertValid(store_el)
    schema.assertValid(agent_el)
    s = store_settings_from_element(store_el, base_dir=tmp_path)
    assert s.path == tmp_path / "db/a.sqlite3"
    assert (s.worker_concurrency, s.max_retries, s.watchdog_interval_s) == (2, 3, 1.0)
    p = profile_from_element(
        agent_el,
        name="assistant",
        own_roots=("{urn:agentserver:assistant}task",),
        peers={"{urn:calc}add": "calculator"},
        usage_instructions="use calculator",
        environ={},
    )
    assert (p.model, p.max_steps, p.resume_deadline_s) == ("gpt-x", 5, 12.5)
    assert p.system_prompt == "Be brief." and p.must_end_with == ("submit_result",)
    assert [(f.name, f.required) for f in p.result_fields] == [("total", True), ("note", False)]
    assert p.terminate_tools == ("calculator",)
    assert p.answer_tag == "{urn:agentserver:assistant}answer"


def test_invalid_values_are_refused(schema):
    bad = etree.fromstring(f'<agent xmlns="{BOOT_NS}" max-steps="0"/>')
    assert not schema.validate(bad)
    with pytest.raises(AgentConfigError):
        profile_from_element(
            bad, name="a", own_roots=(), peers={}, environ={"AGENTSERVER_MODEL": "m"}
        )


def test_defaults_and_model_from_environment():
    s = store_settings_from_element(None)
    assert s.path == Path("state/agents.sqlite3")
    p = profile_from_element(
        None, name="a", own_roots=(), peers={}, environ={"AGENTSERVER_MODEL": "m"}
    )
    assert p.model == "m" and p.max_steps == 12
    with pytest.raises(AgentConfigError):
        profile_from_element(None, name="a", own_roots=(), peers={}, environ={})


async def test_the_bundled_assistants_profile_marks_failures_and_may_quote_results():
    from serverproc import REPO

    from agentserver.app.agents import build_profiles
    from agentserver.app.builtins import RunContext, build_listeners
    from agentserver.config import loader as boot
    from agentserver.primitives.core import HUH_TAG
    from agentserver.pump.pump import open_pump

    topo = boot.load_or_raise(REPO / "boot.xml")
    ctx = RunContext(topo)
    async with ctx.resources, open_pump(build_listeners(topo, ctx)) as pump:
        profile = build_profiles(topo, pump, {})["assistant"]
    calc = "{urn:agentserver:calculator}"
    assert profile.failure_status  # its <answer> declares status
    assert {calc + "sum", calc + "quotient", calc + "error", HUH_TAG} <= set(profile.quotable)
    assert calc + "add" in profile.peers and calc + "add" not in profile.quotable


async def test_an_agent_whose_reply_type_has_no_status_does_not_mark_failures(tmp_path, caplog):
    from agentserver.app.agents import build_profiles
    from agentserver.app.builtins import RunContext, build_listeners
    from agentserver.config import loader as boot
    from agentserver.pump.pump import open_pump

    path = tmp_path / "boot.xml"
    path.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="t">'
        "<listeners>"
        '<listener name="scribe" handler="e2e_handlers:record" agent="true">'
        '<accepts type="e2e_handlers:Record"/><responds type="e2e_handlers:Note"/>'
        '<agent model="m"/>'
        "</listener></listeners></organism>"
    )
    topo = boot.load_or_raise(path)
    ctx = RunContext(topo)
    async with ctx.resources, open_pump(build_listeners(topo, ctx)) as pump:
        profile = build_profiles(topo, pump, {})["scribe"]
    # <note> declares no status: marking a failure would make the pump refuse the answer
    assert profile.answer_tag == "{urn:test:e2e}note" and not profile.failure_status
    assert 'cannot say status="failed"' in caplog.text
