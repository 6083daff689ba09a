"""``<retention>`` in boot.xml (issue 38): the grammar (boot-agents.xsd), the typed
settings (agents/profile/retention.py), defaults, ``none``, per-agent overrides, and a
clear error for a value that cannot be used."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.config import (
    agent_settings_from_element,
    schema_file,
    store_settings_from_element,
)
from agentserver.agents.profile.retention import (
    AgentRetention,
    parse_duration,
    retention_from_element,
)
from agentserver.core.namespaces import BOOT_NS

WRAPPER = """<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema"
  xmlns:boot="https://xml-pipeline.org/ns/boot/v1"
  targetNamespace="https://xml-pipeline.org/ns/boot/v1" elementFormDefault="qualified">
  <xs:include schemaLocation="{loc}"/>
  <xs:element name="store" type="boot:StoreSectionType"/>
  <xs:element name="agent" type="boot:AgentProfileType"/>
</xs:schema>"""


@pytest.fixture
def schema(tmp_path):
    with schema_file().open("rb") as f:
        (tmp_path / "boot-agents.xsd").write_bytes(f.read())
    (tmp_path / "w.xsd").write_text(WRAPPER.format(loc="boot-agents.xsd"))
    return etree.XMLSchema(etree.parse(str(tmp_path / "w.xsd")))


def test_no_element_keeps_everything(schema):
    el = etree.fromstring(f'<store xmlns="{BOOT_NS}"/>')
    schema.assertValid(el)
    assert store_settings_from_element(el).retention is None


def test_the_defaults_and_what_is_written(schema):
    el = etree.fromstring(
        f'<store xmlns="{BOOT_NS}"><retention step-log="none" keep-last="5" '
        'interval="30s"/></store>'
    )
    schema.assertValid(el)
    r = store_settings_from_element(el).retention
    assert r is not None
    assert r.defaults == AgentRetention(30 * 86400.0, 5, 86400.0)
    assert r.step_log_s is None  # none: kept forever
    assert r.acknowledged_replies_s == 3600.0 and r.interval_s == 30.0
    assert r.tombstones_s == 30 * 86400.0 and r.deliveries_s == 86400.0


def test_deliveries_are_kept_as_written(schema):
    el = etree.fromstring(f'<store xmlns="{BOOT_NS}"><retention deliveries="2h"/></store>')
    schema.assertValid(el)
    r = store_settings_from_element(el).retention
    assert r is not None and r.deliveries_s == 7200.0
    none = etree.fromstring(f'<store xmlns="{BOOT_NS}"><retention deliveries="none"/></store>')
    r = store_settings_from_element(none).retention
    assert r is not None and r.deliveries_s is None


def test_tombstones_are_kept_as_written(schema):
    el = etree.fromstring(f'<store xmlns="{BOOT_NS}"><retention tombstones="90d"/></store>')
    schema.assertValid(el)
    r = store_settings_from_element(el).retention
    assert r is not None and r.tombstones_s == 90 * 86400.0
    none = etree.fromstring(f'<store xmlns="{BOOT_NS}"><retention tombstones="none"/></store>')
    r = store_settings_from_element(none).retention
    assert r is not None and r.tombstones_s is None


def test_an_agent_overrides_what_it_writes(schema):
    store = etree.fromstring(
        f'<store xmlns="{BOOT_NS}"><retention finished-tasks="7d" events="2h"/></store>'
    )
    agent = etree.fromstring(
        f'<agent xmlns="{BOOT_NS}" model="m"><retention finished-tasks="1h" keep-last="none"/>'
        "</agent>"
    )
    schema.assertValid(store)
    schema.assertValid(agent)
    global_ = store_settings_from_element(store).retention
    own = agent_settings_from_element(agent, name="a").retention
    assert global_ is not None and own is not None
    merged = global_.with_overrides({"a": own})
    assert merged.for_agent("a") == AgentRetention(3600.0, None, 7200.0)  # events inherited
    assert merged.for_agent("b") == AgentRetention(7 * 86400.0, 50, 7200.0)


@pytest.mark.parametrize("bad", ["30 days", "-1d", "1w", ""])
def test_a_bad_duration_is_refused_clearly(schema, bad):
    el = etree.fromstring(f'<store xmlns="{BOOT_NS}"><retention finished-tasks="{bad}"/></store>')
    assert not schema.validate(el)
    with pytest.raises(AgentConfigError, match="finished-tasks"):
        store_settings_from_element(el)


def test_a_zero_interval_is_refused():
    el = etree.fromstring(f'<retention xmlns="{BOOT_NS}" interval="0s"/>')
    with pytest.raises(ValueError, match="interval"):
        retention_from_element(el)


@given(st.integers(1, 10**6), st.sampled_from(["", "ms", "s", "m", "h", "d"]))
def test_durations_parse_to_seconds(n, unit):
    scale = {"": 1, "ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    assert parse_duration(f"{n}{unit}", "x") == pytest.approx(n * scale)


def test_without_retention_no_pruner_is_made():
    from agentserver.agents.profile.settings import StoreSettings
    from agentserver.agents.service import retention_pruner

    assert retention_pruner(StoreSettings(), {}, object()) is None


def test_an_agents_retention_alone_prunes_only_that_agent():
    from dataclasses import replace

    from agentserver.agents.profile.agent import AgentProfile
    from agentserver.agents.profile.retention import RetentionOverride
    from agentserver.agents.profile.settings import StoreSettings
    from agentserver.agents.service import effective_retention

    own = RetentionOverride((("finished-tasks", 60.0),))
    profiles = {
        "a": replace(AgentProfile(name="a", model="m"), retention=own),
        "b": AgentProfile(name="b", model="m"),
    }
    r = effective_retention(StoreSettings(), profiles)
    assert r is not None
    assert r.for_agent("a") == AgentRetention(60.0, None, None)
    assert r.for_agent("b") == AgentRetention(None, None, None)
    assert r.step_log_s is None and r.acknowledged_replies_s is None
    assert r.tombstones_s is None and r.deliveries_s is None


async def test_store_prune_applies_an_agents_retention_alone(tmp_path):
    """`agentserver store prune` prunes what the server's pruner would: an agent's own
    ``<retention>`` without the store's is retention too (the store's kinds: none)."""
    from agentserver.app import store_admin

    boot = tmp_path / "boot.xml"
    boot.write_text(
        f"""<organism xmlns="{BOOT_NS}" name="r">
  <llm><backend name="b" provider="openai" base-url="http://127.0.0.1:9/v1" api-key-env="K">
    <model name="m"/></backend></llm>
  <store path="state/agents.sqlite3"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator">
      <agent model="m"><retention finished-tasks="1h"/></agent>
    </listener>
  </listeners>
</organism>"""
    )
    from agentserver.agents.clock import SystemClock
    from agentserver.agents.profile.settings import StoreSettings
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    (tmp_path / "state").mkdir()
    path = tmp_path / "state" / "agents.sqlite3"
    made = SqliteAgentStore.open(path, clock=SystemClock(), settings=StoreSettings(path=path))
    await made.aclose()
    report = await store_admin.prune(boot, dry_run=True, environ={"K": "k"})
    assert report["dry_run"] and report["tasks"] == 0
    shown = (await store_admin.stats(boot, environ={"K": "k"}))["retention"]
    assert shown["agents"]["assistant"]["finished_tasks_s"] == 3600.0
    assert shown["step_log_s"] is None and shown["deliveries_s"] is None
