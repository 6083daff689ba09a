"""The A2A vocabulary on the wire: what a listener made of a remote A2A agent's skill
answers (docs/a2a.md, "Remote A2A agents as tools").

One type for every skill of every remote agent: the remote task's final message and
artifacts as text, one ``<text>`` each; ``state`` the remote task's state
(``completed``, ``input-required``: the text is the remote's question, which a call on
the same context answers; ``failed``, ``canceled``, ``rejected``: an agent reads it as a
failed tool result); ``task`` and ``context`` the remote's ids.
"""

from __future__ import annotations

from pydantic_xml import BaseXmlModel, attr, element

A2A_NS = "urn:agentserver:a2a"
ANSWER_TAG = f"{{{A2A_NS}}}answer"


def skill_namespace(remote: str) -> str:
    """The namespace of the payloads of remote agent ``remote``'s skills."""
    return f"{A2A_NS}:{remote}"


class A2aAnswer(BaseXmlModel, tag="answer", nsmap={"": A2A_NS}):
    """A remote skill's answer."""

    state: str = attr(default="completed")
    status: str = attr(default="ok")
    skill: str = attr()
    task: str = attr(default="")
    context: str = attr(default="")
    text: list[str] = element(tag="text", default_factory=list)
