"""Decisions on a tool call, pure: the policy's rules as data, compiled for matching, parsed from boot.xml, evaluated; guardrails."""

from agentserver import _moved


def __getattr__(name: str) -> object:
    # ``agentserver.agents.policy`` was a module before the floors, and docs/api.md
    # published its names: they still resolve, with a DeprecationWarning (_moved.py).
    return _moved.moved_attribute(__name__, name)
