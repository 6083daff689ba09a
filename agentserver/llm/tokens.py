"""Token estimates: the one place the server guesses how many tokens a text costs.

Used to reserve rate-limit budget before a call, and by the agents to keep a Turn's
context under the model's window (``agentserver.agents.profile.budget``).

Deliberately pessimistic: one token per three UTF-8 bytes (English averages
about four characters per token; CJK about one character, i.e. three bytes),
plus a small per-message overhead for role markers. Over-reserving only delays
a caller until the reported usage is reconciled; under-reserving could overshoot
a provider's limit.
"""

from __future__ import annotations

from collections.abc import Iterable

from .types import Message

__all__ = [
    "PER_MESSAGE",
    "PER_REQUEST",
    "estimate_message_tokens",
    "estimate_prompt_tokens",
    "estimate_text_tokens",
]

PER_MESSAGE = 4
PER_REQUEST = 3
_PER_MESSAGE = PER_MESSAGE
_PER_REQUEST = PER_REQUEST


def estimate_text_tokens(text: str) -> int:
    if text.isascii():  # fast path: no encoding needed to count bytes
        n = len(text)
    else:
        n = len(text.encode("utf-8"))
    return -(-n // 3)


def estimate_message_tokens(content: str) -> int:
    """One chat message: its text plus the role markers."""
    return _PER_MESSAGE + estimate_text_tokens(content)


def estimate_prompt_tokens(messages: Iterable[Message]) -> int:
    return _PER_REQUEST + sum(_PER_MESSAGE + estimate_text_tokens(m.content) for m in messages)
