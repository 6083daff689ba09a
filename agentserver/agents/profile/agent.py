"""The agent profile: everything the worker needs to know about one agent (immutable)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lxml import etree

from agentserver.agents.policy.evaluate import Policy
from agentserver.agents.policy.guardrails import GuardrailSpec
from agentserver.agents.profile.budget import DEFAULT_CONTEXT_WINDOW, Budget
from agentserver.agents.profile.retention import RetentionOverride
from agentserver.agents.profile.retry import RetryPolicy
from agentserver.core.envelope import MULTITASK_MODES

#: The output allowance of a request when the agent sets no max-tokens (the LLM
#: adapter's default).
DEFAULT_MAX_OUTPUT = 1024

SUBMIT_RESULT = "submit_result"


@dataclass(frozen=True, slots=True)
class ResultField:
    """A field the caller expects in the deliverable (``submit_result``)."""

    name: str
    required: bool = True
    description: str = ""


@dataclass(frozen=True, slots=True)
class AgentProfile:
    """Per-agent settings (boot.xml ``<agent>`` settings plus what the pump derives).

    ``own_roots`` are the agent's own payload root tags in Clark notation
    (``{ns}local``): a payload with one of them is self-iteration. ``peers`` maps each
    peer payload root tag (Clark) to the peer listener's name: such a payload is a tool
    call. ``answer_tag`` is the root tag of the reply sent to the caller; its ``<text>``
    child carries the deliverable text. ``terminate_tools`` name peers whose result ends
    the Turn (the seed's ``after_execution=terminate``); other tools suspend and resume.
    ``quotable`` are root tags (Clark) of what the agent reads but does not send: its
    peers' answers (the server adds the core primitives): such an element written in a
    reply quotes a tool's result, and is prose. ``failure_status`` puts ``status="failed"`` on the answer of a Turn that did not
    succeed; set it only when the reply type's schema declares that attribute (the server
    checks, see :func:`agentserver.agents.turn.answer.takes_failure_status`).
    """

    name: str
    model: str
    system_prompt: str = "You are a helpful agent."
    max_steps: int = 12
    resume_deadline_s: float = 60.0
    must_end_with: tuple[str, ...] = ()
    result_fields: tuple[ResultField, ...] = ()
    usage_instructions: str = ""
    own_roots: tuple[str, ...] = ()
    peers: Mapping[str, str] = field(default_factory=dict)
    answer_tag: str = ""
    max_tokens: int | None = None
    llm_timeout_s: float = 300.0
    terminate_tools: tuple[str, ...] = ()
    failure_status: bool = False
    quotable: tuple[str, ...] = ()
    step_retries: int = 3
    step_retry_base_s: float = 2.0
    max_retry_after_s: float = 60.0
    #: None: the model's declared window (``<model context-window>``), else 128k.
    context_window: int | None = None
    context_reserve: int = 8192
    keep_recent: int = 16384
    tool_result_share: float = 0.25
    memory: str = "none"  # or "client": one durable conversation per client
    #: Double texting (docs/runs.md): enqueue, reject, interrupt or rollback.
    multitask: str = "enqueue"
    #: Tool-call policy (None: peers only), guardrails and the built-in loop detector's
    #: thresholds (0: off).
    policy: Policy | None = None
    guardrails: tuple[GuardrailSpec, ...] = ()
    loop_warn: int = 2
    loop_block: int = 5
    #: ``<agent><retention>``: this agent's overrides of the store's retention (None: the
    #: store's values).
    retention: RetentionOverride | None = None
    #: The reply's GBNF grammar (free text, then at most one call a peer's XSD accepts)
    #: when the agent's model is served by a constraining local backend; None otherwise.
    reply_grammar: str | None = None
    #: The agent's version (config/versions.py): its id (``<agent version>``, else the
    #: digest's first 12 hex digits; empty: unversioned, as in tests), the full digest,
    #: and what its Turns do on a process serving another version (docs/deploy.md).
    version: str = ""
    digest: str = ""
    versioning: str = "upgrade"  # or "pinned"

    def has_tool(self, listener: str) -> bool:
        """Whether ``listener`` is one of this version's tools (peers)."""
        return listener in self.peers.values()

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.resume_deadline_s <= 0:
            raise ValueError("resume_deadline_s must be > 0")
        RetryPolicy(self.step_retries, self.step_retry_base_s, self.max_retry_after_s)
        self.budget  # noqa: B018 - validates the context settings
        if self.memory not in ("none", "client"):
            raise ValueError(f"memory must be none or client, not {self.memory!r}")
        if self.multitask not in MULTITASK_MODES:
            raise ValueError(f"multitask must be one of {', '.join(MULTITASK_MODES)}")
        if not self.answer_tag:
            ns = etree.QName(self.own_roots[0]).namespace if self.own_roots else None
            object.__setattr__(self, "answer_tag", etree.QName(ns, "answer").text)

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.step_retries, self.step_retry_base_s, self.max_retry_after_s)

    @property
    def budget(self) -> Budget:
        return Budget(
            self.context_window or DEFAULT_CONTEXT_WINDOW,
            self.context_reserve,
            self.keep_recent,
            self.tool_result_share,
            self.max_tokens or DEFAULT_MAX_OUTPUT,
        )

    @property
    def resume_step_limit(self) -> int | None:
        """The step limit a resume opens the Turn's next step with, in the transaction
        that resumes it; None when ``after`` guardrails judge the results first (the run
        opens the step once they have)."""
        return None if self.guardrails else self.max_steps

    @property
    def known_roots(self) -> tuple[str, ...]:
        """Every root tag the worker recognises in model text (Clark notation)."""
        return (*self.own_roots, *self.peers, self.answer_tag)


def not_in_version(tool: str, profile: AgentProfile) -> str:
    """What a call to ``tool`` is answered when the version of ``profile`` that resumed
    its Turn has no such tool (docs/deploy.md): the change, named."""
    return f"tool `{tool}` is not in version {profile.version} of agent {profile.name}"
