"""One duration syntax in boot.xml (issue 45): every duration attribute takes a number of
seconds or a number with a unit (ms, s, m, h, d); one parser reads them all, the schemas
hold the same grammar, and a bad one gets an error naming the element, the attribute and
the accepted forms, never a schema's internal type."""

from __future__ import annotations

import re
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.config import loader as boot
from agentserver.config.durations import DURATIONS, Bound
from agentserver.core.durations import (
    FORMS,
    UNITS,
    XSD_PATTERN,
    DurationError,
    is_duration,
    parse_duration,
)
from agentserver.core.schemas_export import schema_path
from agentserver.llm.config import check_llm_section

NS = "https://xml-pipeline.org/ns/boot/v1"
XS = "{http://www.w3.org/2001/XMLSchema}"
SCHEMA_FILES = ("boot.xsd", "boot-llm.xsd", "boot-agents.xsd")
#: Every schema type whose values are durations (RetentionDuration adds ``none``).
DURATION_TYPES = {"BootDuration", "LlmDuration", "AgentsDuration", "RetentionDuration"}


def write(tmp_path, body: str):
    path = tmp_path / "boot.xml"
    path.write_text(f'<organism xmlns="{NS}" name="t">\n' + textwrap.dedent(body) + "</organism>\n")
    return path


# -- the parser ------------------------------------------------------------------------

_PATTERN_SCHEMA = etree.XMLSchema(
    etree.fromstring(
        f"""<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema">
          <xs:element name="d"><xs:complexType>
            <xs:attribute name="v"><xs:simpleType><xs:restriction base="xs:string">
              <xs:pattern value="{XSD_PATTERN}"/>
            </xs:restriction></xs:simpleType></xs:attribute>
          </xs:complexType></xs:element>
        </xs:schema>"""
    )
)


def _schema_accepts(text: str) -> bool:
    el = etree.Element("d")
    el.set("v", text)
    return _PATTERN_SCHEMA.validate(el)


numbers = st.one_of(
    st.integers(min_value=0, max_value=10**9).map(str),
    st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False).map(str),
)


@given(
    number=numbers,
    unit=st.sampled_from(["", "ms", "s", "m", "h", "d"]),
    pad=st.text(" \t", max_size=2),
)
def test_a_number_with_an_optional_unit_is_that_many_seconds(number, unit, pad):
    text = f"{pad}{number}{pad}{unit}{pad}"
    assert parse_duration(text) == pytest.approx(float(number) * UNITS[unit or None])
    assert is_duration(text) and _schema_accepts(text)


@given(st.text(alphabet="0123456789.msdhx-+e ,:\t\n\xa0\u2003\u3000", max_size=8))
def test_the_parser_accepts_exactly_what_the_schemas_pattern_accepts(text):
    # The schema's verdict and the parser's agree on any text: nothing the schema lets
    # through can fail on load, and nothing it refuses is read some other way.
    assert is_duration(text) == _schema_accepts(text)
    if not is_duration(text):
        with pytest.raises(DurationError, match="not a duration: write a number of seconds"):
            parse_duration(text)


@pytest.mark.parametrize(
    "text", ["", "s", "5x", "-1", "1e3", "5 sec", "1h30m", "5S", "∞", "1" * 400]
)
def test_what_is_not_a_duration_is_refused_with_the_forms(text):
    with pytest.raises(DurationError) as info:
        parse_duration(text)
    assert FORMS in str(info.value)


def test_each_schema_duration_type_is_the_parsers_grammar():
    for name in SCHEMA_FILES:
        doc = etree.parse(str(schema_path(name)))
        for simple in doc.getroot().iter(XS + "simpleType"):
            if simple.get("name") in DURATION_TYPES:
                (pattern,) = simple.iter(XS + "pattern")
                assert pattern.get("value").removeprefix("none|") == XSD_PATTERN, name


def _duration_attributes() -> set[tuple[str, str]]:
    """(element, attribute) of every attribute of a duration type in the boot schemas."""
    docs = [etree.parse(str(schema_path(n))).getroot() for n in SCHEMA_FILES]
    types = {
        ct.get("name"): ct for d in docs for ct in d.iter(XS + "complexType") if ct.get("name")
    }
    found = set()
    for doc in docs:
        for element in doc.iter(XS + "element"):
            complex_type = types.get((element.get("type") or "").partition(":")[2])
            if complex_type is None:
                complex_type = element.find(XS + "complexType")
            if complex_type is None:
                continue
            for attr in complex_type.iter(XS + "attribute"):
                if (attr.get("type") or "").partition(":")[2] in DURATION_TYPES:
                    found.add((element.get("name"), attr.get("name")))
    return found


def test_the_table_of_durations_is_every_duration_attribute_of_the_schemas():
    table = {(el, attr) for el, attrs in DURATIONS.items() for attr in attrs}
    assert table == _duration_attributes()
    # Nothing left as a bare decimal that means seconds.
    for name in SCHEMA_FILES:
        text = schema_path(name).read_text()
        assert not re.search(
            r'name="[a-z-]*(timeout|delay|ttl|window|jitter)" type="xs:decimal"', text
        )


# -- boot.xml --------------------------------------------------------------------------


def test_every_section_takes_units(tmp_path):
    path = write(
        tmp_path,
        """\
        <limits read-timeout="10s" idle-timeout="0" drain-timeout="1.5m" thread-ttl="1h"/>
        <http port="0" reply-ttl="5m" wait-timeout="90"/>
        <listeners>
          <listener name="echo" handler="echo" timeout="5s"/>
        </listeners>
        <llm timeout="2m">
          <retry base-delay="500ms" max-delay="0"/>
          <breaker cooldown="1m"/>
          <backend name="local" provider="ollama" base-url="http://127.0.0.1:11434" timeout="250ms">
            <model name="m"/>
          </backend>
        </llm>
        <store processing-timeout="30s" lease="10s" heartbeat="3000ms">
          <retention finished-tasks="7d" interval="1m"/>
        </store>
        """,
    )
    result = boot.load(path, environ={})
    assert result.ok, [str(p) for p in result.problems]
    topo = result.topology
    assert topo.limits.read_timeout == 10 and topo.limits.idle_timeout == 0
    assert topo.limits.drain_timeout == 90 and topo.limits.thread_ttl == 3600
    assert topo.http.reply_ttl == 300 and topo.http.wait_timeout == 90
    assert topo.listener("echo").timeout == 5
    assert topo.llm.timeout == 120 and topo.llm.backends[0].timeout == 0.25
    assert topo.llm.retry.base_delay == 0.5 and topo.llm.breaker.cooldown == 60
    assert topo.store.processing_timeout_s == 30 and topo.store.heartbeat_s == 3
    assert topo.store.retention.interval_s == 60


def test_a_bad_duration_names_the_element_the_attribute_and_the_forms(tmp_path):
    path = write(
        tmp_path,
        """\
        <limits read-timeout="10 seconds"/>
        <listeners>
          <listener name="echo" handler="echo" timeout="5x"/>
        </listeners>
        """,
    )
    result = boot.load(path, environ={})
    assert not result.ok
    assert [(p.line, p.message) for p in result.errors] == [
        (2, f'<limits read-timeout="10 seconds">: not a duration: write {FORMS}'),
        (4, f'<listener timeout="5x">: not a duration: write {FORMS}'),
    ]
    for problem in result.problems:
        assert "Duration" not in problem.message and "atomic type" not in problem.message


def test_a_bad_retention_duration_says_none_is_allowed_too(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners><listener name="echo" handler="echo"/></listeners>
        <store><retention events="forever"/></store>
        """,
    )
    (error,) = boot.load(path, environ={}).errors
    assert error.message == f'<retention events="forever">: not a duration: write {FORMS} or none'


def test_bounds_are_checked_and_named(tmp_path):
    path = write(
        tmp_path,
        """\
        <limits write-timeout="0" idle-timeout="0"/>
        <http port="0" reply-ttl="2d"/>
        <listeners>
          <listener name="echo" handler="echo" timeout="0ms"/>
        </listeners>
        """,
    )
    result = boot.load(path, environ={})
    assert [(p.line, p.message) for p in result.errors] == [
        (2, '<limits write-timeout="0">: the duration must be longer than 0'),
        (3, f'<http reply-ttl="2d">: the duration must be {Bound.UP_TO_A_DAY.value}'),
        (5, '<listener timeout="0ms">: the duration must be longer than 0'),
    ]


def test_a_schedule_and_a_webhook_take_the_same_syntax(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners>
          <listener name="a" handler="assistant" agent="true"/>
        </listeners>
        <webhooks>
          <webhook name="h" url="http://127.0.0.1:9/x" events="task.failed"
                   secret-env="HOOK_SECRET" timeout="2.5s" retry-for="1d"/>
        </webhooks>
        <schedules>
          <schedule name="s" agent="a" cron="0 * * * *" catchup-window="5m" jitter="250ms">
            <task xmlns="urn:t"/>
          </schedule>
        </schedules>
        """,
    )
    result = boot.load(path, environ={"HOOK_SECRET": "whsec_" + "A" * 44})
    assert result.ok, [str(p) for p in result.problems]
    (schedule,) = result.topology.schedules
    assert schedule.catchup_window_s == 300 and schedule.jitter_s == 0.25
    (hook,) = result.topology.webhooks
    assert hook.timeout_s == 2.5 and hook.retry_for_s == 86400


def test_the_llm_section_alone_takes_units_too():
    el = etree.fromstring(
        f'<llm xmlns="{NS}" timeout="2m"><retry max-retry-after="1m"/>'
        '<backend name="b" provider="ollama" base-url="http://127.0.0.1:1" timeout="30s">'
        '<model name="m"/></backend></llm>'
    )
    report = check_llm_section(el, environ={})
    assert report.errors == [] and report.config is not None
    assert report.config.timeout == 120 and report.config.retry.max_retry_after == 60


def test_a_policy_rules_durations_are_the_same_syntax(tmp_path):
    path = write(
        tmp_path,
        """\
        <clients><client name="alice" token-env="A_TOKEN"/></clients>
        <listeners>
          <listener name="calculator" handler="calculator"/>
          <listener name="assistant" handler="assistant" agent="true" peers="calculator">
            <agent model="m"/>
            <policy default="deny">
              <rule priority="10" decision="allow" target="calc*" rate="3/1d"/>
              <rule priority="20" decision="require-approval" target="calculator"
                    approver="alice" timeout="5x"/>
            </policy>
          </listener>
        </listeners>
        """,
    )
    (error,) = boot.load(path, environ={"A_TOKEN": "t"}).errors
    assert (
        error.message
        == f"listener 'assistant': <rule>: timeout: '5x' is not a duration: write {FORMS}"
    )
