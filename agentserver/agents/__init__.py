"""Durable agents: the inbox-backed AgentTurn protocol on an embedded store.

Entry point for the pump: :class:`agentserver.agents.runtime.AgentRuntime`. The protocol
is described in ``docs/agents.md``.
"""
