"""Which agents' replies the router constrains, and their grammars.

A model name (or alias) served by a ``llama-cpp`` backend with ``constrain`` on (the
default) gets each agent's reply grammar (:func:`agentserver.core.xsd_gbnf.reply_grammar`)
built from the payload types of the agent's peers: the schemas the pump validates with.
Built once, at ``check`` and at start; an XSD construct the grammar cannot express is a
configuration error then, naming the construct, the payload type and the agent.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_gbnf import GrammarUnsupported, reply_grammar

from .config import Provider, RouterConfig

__all__ = ["GrammarUnsupported", "agent_grammar", "constrained_models", "grammar_problems"]


def constrained_models(config: RouterConfig | None) -> frozenset[str]:
    """The model names and aliases that some constraining local backend serves."""
    if config is None:
        return frozenset()
    names: set[str] = set()
    for backend in config.backends:
        if backend.provider is Provider.LLAMA_CPP and backend.constrain:
            names.update(backend.models)
            names.update(backend.aliases)
    return frozenset(names)


def agent_grammar(
    agent: str, model: str, peers: Iterable[PayloadType], config: RouterConfig | None
) -> str | None:
    """The reply grammar of ``agent`` when ``model`` is constrained by ``config``, else
    None. Raises :class:`GrammarUnsupported`."""
    if model not in constrained_models(config):
        return None
    return reply_grammar(peers, agent=agent)


def grammar_problems(
    agents: Iterable[tuple[str, int, str, Iterable[type]]], config: RouterConfig | None
) -> list[tuple[int, str]]:
    """What ``check`` reports: ``(line, message)`` for each agent (given as its name, line,
    model and its peers' payload models) whose reply grammar cannot be built."""
    constrained = constrained_models(config)
    problems: list[tuple[int, str]] = []
    for name, line, model, peer_models in agents:
        if model not in constrained:
            continue
        try:
            reply_grammar((PayloadType.from_model(m) for m in peer_models), agent=name)
        except GrammarUnsupported as exc:
            problems.append((line, f"agent {name!r}: {exc}"))
    return problems
