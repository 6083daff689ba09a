"""The context budget of a Turn (pure: no I/O).

Every estimate comes from :mod:`agentserver.llm.tokens`. A card's cost is estimated once,
when it is written (``cards.tokens``), as the model will be shown it: a tool result is
capped at ``tool_result_share`` of the window, with a marker saying how much was cut (the
store keeps the full text). The head keeps the running sum of its boxes' cards
(``agent_state_head.context_tokens``), so checking the budget before a step costs O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.llm.tokens import PER_MESSAGE, PER_REQUEST, estimate_text_tokens

#: The window assumed when neither the agent nor the model declares one.
DEFAULT_CONTEXT_WINDOW = 128_000
#: Tokens of the header a card gets when rendered ("Result from calculator:", ...).
CARD_OVERHEAD = PER_MESSAGE + 12
#: Characters per token when cutting text to a token cap (the estimate's own ratio).
_CHARS_PER_TOKEN = 3


@dataclass(frozen=True, slots=True)
class Budget:
    """``window - reserve - max_output`` is what one request may use."""

    window: int = DEFAULT_CONTEXT_WINDOW
    reserve: int = 8192
    keep_recent: int = 16384
    tool_result_share: float = 0.25
    max_output: int = 1024

    def __post_init__(self) -> None:
        if self.window < 1 or self.reserve < 0 or self.keep_recent < 0 or self.max_output < 0:
            raise ValueError("context budget settings must be positive")
        if not 0 < self.tool_result_share <= 1:
            raise ValueError("tool-result-share must be in (0, 1]")

    @property
    def prompt_limit(self) -> int:
        """The most tokens a request's messages may use (at least a small floor, so a
        window smaller than the reserve still admits a short prompt)."""
        return max(self.window - self.reserve - self.max_output, self.window // 4)

    @property
    def tool_result_cap(self) -> int:
        return max(1, int(self.window * self.tool_result_share))

    def over(self, system_tokens: int, context_tokens: int) -> bool:
        return PER_REQUEST + system_tokens + context_tokens > self.prompt_limit


def cut_marker(cut_chars: int, total_chars: int) -> str:
    return (
        f"\n[... {cut_chars} of {total_chars} characters cut to fit the context window; "
        "the full result is kept in the store]"
    )


def shown_text(content: str, cap_tokens: int | None) -> str:
    """``content`` cut to ``cap_tokens`` (estimated), with a marker saying how much."""
    if cap_tokens is None or estimate_text_tokens(content) <= cap_tokens:
        return content
    keep = max(0, cap_tokens * _CHARS_PER_TOKEN - 120)  # room for the marker
    # Cut by characters, then make sure non-ASCII text (3 bytes a char) fits too.
    head = content[:keep]
    while head and estimate_text_tokens(head) > cap_tokens - 40:
        head = head[: len(head) * 3 // 4]
    return head + cut_marker(len(content) - len(head), len(content))


def card_tokens(content: str, cap_tokens: int | None = None) -> int:
    """The estimated cost of one card as shown to the model (header included)."""
    return CARD_OVERHEAD + estimate_text_tokens(shown_text(content, cap_tokens))
