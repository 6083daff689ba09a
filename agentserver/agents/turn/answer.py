"""The reply element sent to a Turn's caller (built with lxml, never with strings).

A Turn that did not succeed (no model, timeout, step limit, stop, ...) answers with
``status="failed"`` on the reply's root, when the reply type's schema declares that
attribute (the bundled assistant's ``<answer>`` does; see ``docs/agents.md``). A success
carries no ``status``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lxml import etree

from agentserver.agents.profile.agent import AgentProfile

#: The unqualified attribute on a reply's root that marks a request that failed.
STATUS_ATTR = "status"
FAILED = "failed"


def build_answer(profile: AgentProfile, text: str, *, failed: bool = False) -> etree._Element:
    """``<answer xmlns=ns><text>text</text></answer>`` in the namespace of ``answer_tag``,
    with ``status="failed"`` when ``failed`` and the profile's reply type takes it."""
    q = etree.QName(profile.answer_tag)
    nsmap = {None: q.namespace} if q.namespace else None
    root = etree.Element(q.text, nsmap=nsmap)
    if failed and profile.failure_status:
        root.set(STATUS_ATTR, FAILED)
    etree.SubElement(root, etree.QName(q.namespace, "text").text).text = text
    return root


def answer_bytes(profile: AgentProfile, text: str, *, failed: bool = False) -> bytes:
    return etree.tostring(build_answer(profile, text, failed=failed))


def takes_failure_status(profile: AgentProfile, is_valid: Callable[[etree._Element], bool]) -> bool:
    """Whether a failed answer of ``profile`` passes ``is_valid`` (the reply type's schema),
    so the agent may mark its failures. Checked once, when the agents start."""
    probe = dataclasses.replace(profile, failure_status=True)
    return is_valid(build_answer(probe, "probe", failed=True))
