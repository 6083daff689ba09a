"""Token estimates used to reserve rate-limit budget before a call.

Deliberately pessimistic: one token per three UTF-8 bytes (English averages
about four characters per token; CJK about one character, i.e. three bytes),
plus a small per-message overhead for role markers. Over-reserving only delays
a caller until the reported usage is reconciled; under-reserving could overshoot
a provider's limit.
"""

from __future__ import annotations

from collections.abc import Iterable

from .types import Message

__all__ = ["estimate_prompt_tokens", "estimate_text_tokens"]

_PER_MESSAGE = 4
_PER_REQUEST = 3


def estimate_text_tokens(text: str) -> int:
    if text.isascii():  # fast path: no encoding needed to count bytes
        n = len(text)
    else:
        n = len(text.encode("utf-8"))
    return -(-n // 3)


def estimate_prompt_tokens(messages: Iterable[Message]) -> int:
    return _PER_REQUEST + sum(_PER_MESSAGE + estimate_text_tokens(m.content) for m in messages)
