"""The settings of boot.xml's ``<expose-a2a>`` (read by :mod:`agentserver.config.a2a`),
kept apart so the topology can hold them without importing the reader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class A2aAgent:
    """``<agent name="..." tags="...">`` with its ``<description>`` and ``<example>``s."""

    name: str
    description: str = ""
    examples: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ExposeA2a:
    """``<expose-a2a public-url="...">``: the agents offered, in boot.xml's order."""

    agents: tuple[A2aAgent, ...]
    #: The base URL clients reach the HTTP API at (``https://host:port``), for the card's
    #: absolute endpoint URLs; None: the URL each card request came to.
    public_url: str | None = None
    #: ``allow-private-push``: push notification URLs on loopback or private ranges are
    #: allowed (local deployments, tests); refused by default (SSRF).
    allow_private_push: bool = False
