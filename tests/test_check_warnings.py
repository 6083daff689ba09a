"""check's warnings for the mistakes a newcomer makes: a listener with no <responds>
(its answers would be refused), an agent's peer it can never reach."""

from __future__ import annotations

import textwrap

from agentserver.config import loader as boot

NS = "https://xml-pipeline.org/ns/boot/v1"

MODULE = """\
from pydantic_xml import BaseXmlModel, element

NSMAP = {"": "urn:test:warn"}


class Shout(BaseXmlModel, tag="shout", nsmap=NSMAP):
    text: str = element()


class Echoed(BaseXmlModel, tag="echoed", nsmap=NSMAP):
    text: str = element()


async def handle(payload, meta):
    return None
"""


def load(tmp_path, module: str, listeners: str) -> list[str]:
    (tmp_path / f"{module}.py").write_text(MODULE)
    path = tmp_path / "boot.xml"
    path.write_text(
        f'<organism xmlns="{NS}" name="t"><listeners>\n'
        + textwrap.dedent(listeners).replace("MOD", module)
        + "</listeners></organism>\n"
    )
    result = boot.load(path, environ={})
    assert result.ok, [str(p) for p in result.errors]
    return [p.message for p in result.warnings]


def test_a_listener_without_responds_is_warned_about(tmp_path):
    warnings = load(
        tmp_path,
        "warn_mod_a",
        """\
        <listener name="shouter" handler="MOD:handle"><accepts type="MOD:Shout"/></listener>
        """,
    )
    assert warnings == [
        "listener 'shouter' declares no <responds>: an answer from its handler will be "
        'refused (add <responds type="module:Class"/>, or ends-chains="true" if it never '
        "answers its caller)"
    ]


def test_responds_or_ends_chains_silences_it(tmp_path):
    warnings = load(
        tmp_path,
        "warn_mod_b",
        """\
        <listener name="a" handler="MOD:handle"><accepts type="MOD:Shout"/>
          <responds type="MOD:Echoed"/></listener>
        <listener name="b" handler="MOD:handle" ends-chains="true">
          <accepts type="MOD:Echoed"/></listener>
        <listener name="c" handler="echo"/>
        """,
    )
    assert warnings == []


def test_an_agent_peer_it_cannot_reach_is_warned_about(tmp_path):
    warnings = load(
        tmp_path,
        "warn_mod_c",
        """\
        <listener name="helper" handler="assistant" agent="true"
                  peers="boot shout-a shout-b calculator"/>
        <listener name="boot" handler="system-boot"/>
        <listener name="shout-a" handler="MOD:handle" broadcast="true" ends-chains="true">
          <accepts type="MOD:Shout"/></listener>
        <listener name="shout-b" handler="MOD:handle" broadcast="true" ends-chains="true">
          <accepts type="MOD:Shout"/></listener>
        <listener name="calculator" handler="calculator"/>
        """,
    )
    assert sorted(warnings) == [
        "agent 'helper': peer 'boot' accepts nothing the agent could send (its root tags "
        "are the agent's own, a core primitive, or taken by a later peer)",
        "agent 'helper': peer 'shout-a' accepts nothing the agent could send (its root tags "
        "are the agent's own, a core primitive, or taken by a later peer)",
    ]


def test_the_bundled_boot_xml_has_no_new_warnings():
    from serverproc import REPO

    assert boot.load(REPO / "boot.xml", environ={"OPENAI_API_KEY": "k"}).problems == []
