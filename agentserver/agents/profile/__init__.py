"""Declared settings, pure: an agent's profile, the store's and worker's tunables, boot.xml's <store> and <agent> read into them, the context budget, retry tables."""

from agentserver import _moved


def __getattr__(name: str) -> object:
    # ``agentserver.agents.profile`` was a module before the floors, and docs/api.md
    # published ``AgentProfile``: its names still resolve, with a DeprecationWarning.
    return _moved.moved_attribute(__name__, name)
