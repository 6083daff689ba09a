"""Decisions on a tool call, pure: the policy's rules as data, compiled for matching, parsed from boot.xml, evaluated; guardrails."""
