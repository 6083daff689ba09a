"""``<backend provider="llama-cpp">``'s configuration (no engine needed): model-path,
unless-env, alias model-env, and the bundled boot.xml's choice of backend."""

from __future__ import annotations

import pathlib

import pytest
from lxml import etree

from agentserver.config import loader
from agentserver.llm.config import LlmConfigError, Provider, check_llm_section, parse_llm_section
from agentserver.llm.router import Router

BOOT_NS = "https://xml-pipeline.org/ns/boot/v1"
REPO = pathlib.Path(__file__).resolve().parents[2]


def section(body: str) -> etree._Element:
    return etree.fromstring(f'<llm xmlns="{BOOT_NS}">{body}</llm>'.encode())


def test_llama_cpp_needs_a_model_path_and_no_base_url():
    with pytest.raises(LlmConfigError, match="needs model-path"):
        parse_llm_section(
            section('<backend name="l" provider="llama-cpp"><model name="m"/></backend>')
        )
    with pytest.raises(LlmConfigError, match="model-path is for provider llama-cpp only"):
        parse_llm_section(
            section(
                '<backend name="o" provider="openai" base-url="http://x/v1" model-path="a.gguf">'
                '<model name="m"/></backend>'
            )
        )
    config = parse_llm_section(
        section(
            '<backend name="l" provider="llama-cpp" model-path="a.gguf" threads="3" '
            'temperature="0" constrain="false"><model name="m"/></backend>'
        )
    )
    (b,) = config.backends
    assert b.provider is Provider.LLAMA_CPP and b.model_path == "a.gguf" and b.threads == 3
    assert b.temperature == 0.0 and b.constrain is False and b.context_window == 4096


def test_unless_env_skips_the_backend_without_a_warning_and_alias_model_env_follows():
    body = (
        '<backend name="o" provider="openai" base-url="http://127.0.0.1:9/v1" api-key-env="K">'
        '<model name="big" name-env="M"/><alias name="a" model="big" model-env="M"/></backend>'
        '<backend name="l" provider="llama-cpp" model-path="/nonexistent.gguf" unless-env="K">'
        '<model name="small"/><alias name="a" model="small"/></backend>'
    )
    report = check_llm_section(section(body), environ={"K": "key", "M": "renamed"})
    assert report.ok and report.warnings == []  # the missing file is not even looked at
    router = Router(report.config, environ={"K": "key", "M": "renamed"})
    assert router.models() == {"renamed": ["o"], "a": ["o"]}
    assert "unless-env" in router.skipped["l"]
    # Without K: the openai backend is skipped (warned) and the local one is checked.
    report = check_llm_section(section(body), environ={})
    assert not report.ok and "no file at" in report.errors[0][1]


def test_the_bundled_assistant_uses_openai_with_a_key_and_the_local_model_without():
    with_key = loader.load(REPO / "boot.xml", environ={"OPENAI_API_KEY": "k"})
    assert with_key.ok and with_key.problems == []
    router = Router(with_key.topology.llm, environ={"OPENAI_API_KEY": "k"})
    assert router.models()["assistant"] == ["openai"]
    agent = with_key.topology.listener("assistant").agent_profile
    assert agent.model == "assistant"
    router = Router(with_key.topology.llm, environ={})
    assert router.models()["assistant"] == ["local"]


async def test_the_bundled_assistant_gets_its_reply_grammar_from_the_pumps_types():
    from agentserver.app.agents import build_profiles
    from agentserver.app.builtins import RunContext, build_listeners
    from agentserver.pump.pump import open_pump

    for environ in ({}, {"OPENAI_API_KEY": "k"}):
        topo = loader.load_or_raise(REPO / "boot.xml", environ=environ)
        async with open_pump(
            build_listeners(topo, RunContext(topo)), config=topo.pump_config()
        ) as pump:
            profile = build_profiles(topo, pump, environ)["assistant"]
        # The model name "assistant" is served by the local backend in the configuration
        # (skipped or not at run time): the grammar is there, the HTTP backend ignores it.
        assert profile.reply_grammar is not None
        assert '<add xmlns=\\"urn:agentserver:calculator\\"' in profile.reply_grammar
        assert '<multiply xmlns=\\"urn:agentserver:calculator\\"' in profile.reply_grammar


async def test_the_router_adapter_passes_the_grammar_on():
    from agentserver.agents.edge.llm_adapter import RouterLLM
    from agentserver.agents.ports import LLMMessage, LLMRequest
    from agentserver.llm.types import Completion, Usage

    seen = []

    class Capture:
        async def complete(self, request):
            seen.append(request)
            return Completion("ok", "m", "b", Usage(1, 1), "stop", 0.0)

        def stream(self, request):  # pragma: no cover - not used here
            raise AssertionError

    llm = RouterLLM(Capture())
    await llm.complete(
        LLMRequest(agent="a", model="m", messages=[LLMMessage("user", "x")], grammar="root ::= [a]")
    )
    assert seen[0].grammar == "root ::= [a]"


def test_check_names_the_construct_the_grammar_cannot_express_and_the_agent(tmp_path):
    boot = tmp_path / "boot.xml"
    boot.write_text(
        f"""<organism xmlns="{BOOT_NS}" name="g">
  <llm>
    <backend name="local" provider="llama-cpp" model-path="/nonexistent.gguf"
             unless-env="SKIP_LOCAL_MODEL_CHECK">
      <model name="small"/>
    </backend>
  </llm>
  <listeners>
    <listener name="lookup" handler="local_grammar_types:lookup">
      <accepts type="local_grammar_types:Lookup"/>
    </listener>
    <listener name="helper" handler="assistant" agent="true" peers="lookup">
      <agent model="small"/>
    </listener>
  </listeners>
</organism>"""
    )
    # The model file is not looked at (the backend stands aside); the grammar still is.
    result = loader.load(boot, environ={"SKIP_LOCAL_MODEL_CHECK": "1"})
    errors = [p for p in result.problems if not p.warning]
    assert len(errors) == 1, result.problems
    assert "agent 'helper'" in errors[0].message
    assert "xs:pattern" in errors[0].message and "{urn:test:lookup}lookup" in errors[0].message
    assert 'constrain="false"' in errors[0].message
    # constrain="false": no grammar, no error.
    boot.write_text(boot.read_text().replace("unless-env=", 'constrain="false" unless-env='))
    assert loader.load(boot, environ={"SKIP_LOCAL_MODEL_CHECK": "1"}).ok
