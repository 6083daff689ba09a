"""The reply element sent to a Turn's caller (built with lxml, never with strings)."""

from __future__ import annotations

from lxml import etree

from agentserver.agents.profile import AgentProfile


def build_answer(profile: AgentProfile, text: str) -> etree._Element:
    """``<answer xmlns=ns><text>text</text></answer>`` in the namespace of ``answer_tag``."""
    q = etree.QName(profile.answer_tag)
    nsmap = {None: q.namespace} if q.namespace else None
    root = etree.Element(q.text, nsmap=nsmap)
    etree.SubElement(root, etree.QName(q.namespace, "text").text).text = text
    return root


def answer_bytes(profile: AgentProfile, text: str) -> bytes:
    return etree.tostring(build_answer(profile, text))
