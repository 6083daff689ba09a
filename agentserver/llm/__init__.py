"""The LLM router: several backends, token buckets, failover and an error taxonomy.

Typical use::

    config = parse_llm_section(llm_element)       # boot.xml's <llm>
    async with Router(config) as router:
        completion = await router.complete(
            Request([Message.user("hi")], model="fast", agent="greeter")
        )

See docs/llm-router.md.
"""

from .accounting import AgentStats, BackendStats, Counters, RouterStats
from .classify import DECISIONS, Action, Decision, ErrorKind, classify
from .config import (
    BackendConfig,
    BreakerConfig,
    LlmCheck,
    LlmConfigError,
    Price,
    Provider,
    RetryConfig,
    RouterConfig,
    Strategy,
    check_llm_section,
    parse_llm_section,
)
from .router import CompletionStream, Router
from .types import Attempt, Completion, LLMError, Message, Request, Role, Usage

__all__ = [
    "DECISIONS",
    "Action",
    "AgentStats",
    "Attempt",
    "BackendConfig",
    "BackendStats",
    "BreakerConfig",
    "Completion",
    "CompletionStream",
    "Counters",
    "Decision",
    "ErrorKind",
    "LLMError",
    "LlmCheck",
    "LlmConfigError",
    "Message",
    "Price",
    "Provider",
    "Request",
    "RetryConfig",
    "Role",
    "Router",
    "RouterConfig",
    "RouterStats",
    "Strategy",
    "Usage",
    "check_llm_section",
    "classify",
    "parse_llm_section",
]
