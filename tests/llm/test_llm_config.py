"""boot.xml's <llm>: schema, parsing, and what `agentserver check` reports."""

from __future__ import annotations

import re
from importlib.resources import as_file, files
from pathlib import Path

import pytest
from lxml import etree

from agentserver.llm import (
    LlmConfigError,
    Provider,
    Router,
    Strategy,
    check_llm_section,
    parse_llm_section,
)
from agentserver.llm.config import BOOT_NS, Price, llm_schema

DOC = Path(__file__).parents[2] / "docs" / "llm-router.md"


def doc_example() -> str:
    text = DOC.read_text()
    block = text[text.index("<!-- llm-example:start -->") : text.index("<!-- llm-example:end -->")]
    return re.search(r"```xml\n(.*?)```", block, re.S).group(1)


def llm(xml: str) -> etree._Element:
    return etree.fromstring(xml.encode())


def section(body: str, attrs: str = "") -> etree._Element:
    return llm(f'<llm xmlns="{BOOT_NS}" {attrs}>\n{body}\n</llm>')


ONE = """<backend name="a" provider="openai" base-url="http://127.0.0.1:1/v1">
  <model name="m"/>
</backend>"""


def test_doc_example_is_valid_and_parses():
    el = llm(doc_example())
    assert llm_schema().validate(el), llm_schema().error_log
    cfg = parse_llm_section(el)
    assert cfg.strategy is Strategy.FAILOVER
    assert cfg.retry.max_attempts == 4 and cfg.retry.max_retry_after == 30
    assert cfg.breaker.failures == 3 and cfg.breaker.cooldown == 30
    assert [b.name for b in cfg.backends] == ["openai", "claude", "local"]
    openai, claude, local = cfg.backends
    assert openai.provider is Provider.OPENAI and openai.api_key_env == "OPENAI_API_KEY"
    assert openai.models == ("gpt-4o-mini", "gpt-4o")
    assert openai.resolve("fast") == "gpt-4o-mini"
    assert openai.resolve("gpt-4") is None  # no substring or prefix matching
    assert openai.requests_per_minute == 500 and openai.tokens_per_minute == 200000
    assert openai.max_concurrent == 16 and openai.context_window == 128000
    assert openai.price == Price(0.15, 0.60)
    assert claude.provider is Provider.ANTHROPIC and claude.priority == 2
    assert local.provider is Provider.OLLAMA and local.api_key_env is None
    assert local.timeout == 300 and local.requests_per_minute is None


def test_schema_is_includable_by_a_boot_schema_as_the_lead_will():
    resource = files("agentserver.schemas").joinpath("boot-llm.xsd")
    with as_file(resource) as path:
        wrapper = f"""<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema"
            xmlns:boot="{BOOT_NS}" targetNamespace="{BOOT_NS}" elementFormDefault="qualified">
          <xs:include schemaLocation="boot-llm.xsd"/>
          <xs:element name="organism"><xs:complexType><xs:sequence>
            <xs:element name="llm" type="boot:LlmSectionType" minOccurs="0"/>
          </xs:sequence></xs:complexType></xs:element>
        </xs:schema>"""
        base = path.with_name("boot-test.xsd").as_uri()
        schema = etree.XMLSchema(etree.fromstring(wrapper.encode(), base_url=base))
    doc = etree.fromstring(f'<organism xmlns="{BOOT_NS}">{doc_example()}</organism>'.encode())
    assert schema.validate(doc), schema.error_log


def test_defaults():
    cfg = parse_llm_section(section(ONE))
    (b,) = cfg.backends
    assert cfg.strategy is Strategy.FAILOVER and cfg.timeout == 120 and cfg.queue_limit == 1000
    assert b.priority == 100 and b.timeout == 60 and b.price is None and b.aliases == {}


@pytest.mark.parametrize(
    ("body", "attrs", "needle"),
    [
        (ONE.replace('base-url="', 'api-key-env="sk-live-123" base-url="'), "", "api-key-env"),
        (ONE.replace("openai", "bedrock", 1), "", "provider"),
        (ONE, 'strategy="random"', "strategy"),
        (ONE.replace('<model name="m"/>', '<model name="m"/><alias name="f" model="x"/>'), "", ""),
        (ONE.replace('<model name="m"/>', '<model name="m"/><model name="m"/>'), "", ""),
        (ONE.replace('<model name="m"/>', ""), "", ""),
        (ONE.replace('name="a"', 'name="a" timeout="0"'), "", "timeout"),
        (ONE + "<limits/>", "", ""),
    ],
    ids=[
        "inline-secret",
        "provider",
        "strategy",
        "alias-target",
        "duplicate-model",
        "no-model",
        "zero-timeout",
        "stray-element",
    ],
)
def test_schema_rejects(body, attrs, needle):
    check = check_llm_section(section(body, attrs), environ={})
    assert not check.ok
    line, message = check.errors[0]
    assert line >= 1
    assert needle in message


def test_duplicate_backend_names_are_an_error_with_the_line():
    el = section(ONE + "\n" + ONE)
    check = check_llm_section(el, environ={})
    assert check.errors == [(5, "backend name 'a' already used on line 2")]
    with pytest.raises(LlmConfigError) as info:
        parse_llm_section(el)
    assert info.value.line == 5


def test_unset_key_is_a_warning_and_the_backend_is_skipped_at_run_time():
    el = section(
        ONE.replace('name="a"', 'name="a" api-key-env="A_KEY"')
        + "\n"
        + ONE.replace('name="a"', 'name="b" api-key-env="B_KEY"')
    )
    check = check_llm_section(el, environ={"B_KEY": "x"})
    assert check.ok
    assert (
        2,
        "environment variable A_KEY (API key of backend 'a') is not set; "
        "the backend will be skipped",
    ) in check.warnings
    assert not any("B_KEY" in m for _, m in check.warnings)
    router = Router(parse_llm_section(el), environ={"B_KEY": "x"})
    assert router.skipped == {"a": "environment variable A_KEY (API key of backend 'a') is not set"}
    assert router.models() == {"m": ["b"]}
    stats = router.stats()
    assert stats.backends["a"].skipped == router.skipped["a"]
    assert stats.backends["b"].skipped is None


def test_other_warnings():
    el = section(
        """<backend name="a" provider="anthropic" base-url="http://127.0.0.1:1">
  <model name="claude"/>
  <alias name="gpt" model="claude"/>
</backend>
<backend name="b" provider="openai" base-url="http://127.0.0.1:1/v1" context-window="1000">
  <model name="gpt"/>
  <model name="claude"/>
</backend>"""
    )
    messages = [m for _, m in check_llm_section(el, environ={}).warnings]
    assert any("Anthropic needs an API key" in m for m in messages)
    assert any("alias 'gpt'" in m and "'b'" in m for m in messages)
    assert any("context-window unknown on a" in m for m in messages)


def test_parse_refuses_wrong_element():
    with pytest.raises(LlmConfigError):
        parse_llm_section(llm("<llm/>"))
