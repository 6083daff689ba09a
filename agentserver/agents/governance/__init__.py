"""Governance as applied to a step's tool calls: the governor (policy, loops, guardrails) and human approvals (needs the store)."""
