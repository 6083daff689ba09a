"""Replay of a recorded Turn (docs/agents.md, "Replay and export"): the ports that serve
the record instead of the model and the tools, and the comparison of the replayed Turn's
cards with the recorded ones. The run itself (a scratch store, the pump, the runtime) is
:mod:`agentserver.app.replay`.

- :class:`RecordedLLM` serves the model's recorded outputs in order (a compaction's
  summary request gets the recorded summary) and never calls a model; asked for more
  steps than the record has, it fails the call (not retried), which ends the Turn.
- :class:`RecordedTools` checks each call as the pump would (validation, peers), then
  serves the recorded result of the call at the same place, or, with ``live``, sends it
  to the real tool. A call the record does not have at that place gets a failed result
  saying so, so the Turn still ends (the comparison reports where it diverged).
- :func:`compare` finds the first divergence: cards compared by type, target and
  content; results within one step in their calls' order (tools answer in any order).

Nothing here blocks; the recorded results go out on the channel given (app/replay.py
reports them to the runtime).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from lxml import etree

from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.ports import LLMCompletion, LLMRequest, ReplyRef, ToolPort
from agentserver.agents.replay.record import TurnRecord
from agentserver.agents.store.base import CardType
from agentserver.agents.turn.compaction import SUMMARY_SYSTEM
from agentserver.core.namespaces import CORE_NS

#: Card types compared, in the Turn's order. (Guard verdicts and policy notes follow from
#: these; ids and times differ by nature.)
COMPARED = frozenset(
    {
        CardType.LLM_MESSAGE,
        CardType.TOOL_CALL,
        CardType.TOOL_RESULT,
        CardType.TOOL_REFUSED,
        CardType.SELF_CALL,
        CardType.HUH,
        CardType.NOTE,
        CardType.SUMMARY,
        CardType.DELIVERABLE,
    }
)
#: The failed result a call the record does not have gets.
NO_RESULT = "replay: the record has no result for this call"
#: A non-retryable kind: the worker ends the Turn at once (agents/profile/retry.py).
EXHAUSTED_KIND = "FORMAT_ERROR"


class CallChecker(Protocol):
    """Validates a tool call as the pump would, sending nothing (PumpPorts)."""

    def check_call(self, agent: str, payload: etree._Element, to: str | None) -> None: ...


#: ``(agent, sub_thread, payload, failed)``: a recorded tool result, for the runtime.
RecordedResult = tuple[str, str, bytes, bool]


class RecordedLLM:
    """The LLM port of a replay: the record's outputs, in order; ``asked`` counts them."""

    def __init__(self, record: TurnRecord) -> None:
        self._outputs = record.outputs()
        self._summaries = record.summaries()
        self.asked = 0
        self.summaries_asked = 0

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        if request.messages and request.messages[0].content == SUMMARY_SYSTEM:
            self.summaries_asked += 1
            if not self._summaries:
                raise LLMUnavailable("the record has no compaction here", EXHAUSTED_KIND)
            # Each chunk's call gets the recorded (final) summary: the swap keeps it.
            return LLMCompletion(self._summaries[0], model=request.model, backend="replay")
        if self._summaries and self.summaries_asked:
            # The next compaction (if any) gets the next recorded summary.
            self._summaries = self._summaries[1:]
            self.summaries_asked = 0
        if self.asked >= len(self._outputs):
            self.asked += 1
            raise LLMUnavailable(
                f"the record has {len(self._outputs)} model output(s); the replay asked for "
                f"step {self.asked}",
                EXHAUSTED_KIND,
            )
        self.asked += 1
        return LLMCompletion(self._outputs[self.asked - 1], model=request.model, backend="replay")


class RecordedTools:
    """The tool port of a replay. ``inner`` sends (the pump's ports); without ``live``
    only its ``check_call`` is used and results come from the record: each is sent on
    ``results`` (whoever runs the replay reports them to the runtime, which is built
    after this port: it is the runtime's tools)."""

    def __init__(
        self,
        record: TurnRecord,
        inner: ToolPort,
        checker: CallChecker,
        results: trio.MemorySendChannel[RecordedResult],
        *,
        live: bool = False,
    ) -> None:
        self.inner = inner
        self.checker = checker
        self.results = results
        self.live = live
        self._calls = record.of_type(CardType.TOOL_CALL)
        self._results = record.results()
        self.made = 0

    async def call(
        self,
        agent: str,
        turn_thread: ReplyRef,
        payload: etree._Element,
        to: str | None,
        *,
        key: str | None = None,
        thread: str | None = None,
    ) -> str:
        if self.live:
            self.made += 1
            return await self.inner.call(agent, turn_thread, payload, to, key=key, thread=thread)
        self.checker.check_call(agent, payload, to)  # raises PumpRefused as a send would
        n, self.made = self.made, self.made + 1
        sub = thread or f"replay-{n}"
        text = etree.tostring(payload, encoding="unicode")
        recorded = self._calls[n] if n < len(self._calls) else None
        if recorded is not None and recorded["content"] == text:
            result = self._results.get(str(recorded["metadata"].get("tool_call_id")))
        else:
            result = None
        if result is None:
            huh = etree.Element(f"{{{CORE_NS}}}huh", nsmap={None: CORE_NS})
            etree.SubElement(huh, f"{{{CORE_NS}}}error").text = NO_RESULT
            body = etree.tostring(huh)
            failed = True
        else:
            body, failed = result["content"].encode(), bool(result["metadata"].get("failed"))
        # Unbounded (a record's results are few): reported after this call returns.
        self.results.send_nowait((agent, sub, body, failed))
        return sub

    def check_call(self, agent: str, payload: etree._Element, to: str | None) -> None:
        self.checker.check_call(agent, payload, to)

    def check_task(self, agent: str, payload: etree._Element) -> None:
        self.inner.check_task(agent, payload)

    async def self_iterate(
        self, agent: str, turn_thread: ReplyRef, payload: etree._Element
    ) -> None:
        await self.inner.self_iterate(agent, turn_thread, payload)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a replay first differed from its record."""

    step: int
    recorded: str
    replayed: str

    def __str__(self) -> str:
        return f"step {self.step}: the recorded {self.recorded}; the replay {self.replayed}"


def _items(cards: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """The compared view of a Turn's cards: (type, target, content); each run of results
    in the order of the calls they answer."""
    order: dict[str, int] = {}
    out: list[tuple[str, str, str]] = []
    run: list[tuple[int, tuple[str, str, str]]] = []

    def flush() -> None:
        out.extend(item for _, item in sorted(run, key=lambda r: r[0]))
        run.clear()

    for card in cards:
        kind = card["type"]
        if kind not in COMPARED:
            continue
        meta = card["metadata"]
        to = str(meta.get("to", "") or "")
        if kind == CardType.TOOL_CALL:
            order[str(meta.get("tool_call_id"))] = len(order)
        if kind == CardType.TOOL_RESULT:
            run.append(
                (order.get(str(meta.get("tool_call_id")), len(order)), (kind, to, card["content"]))
            )
            continue
        flush()
        content = card["content"]
        if kind == CardType.DELIVERABLE:
            content = f"{meta.get('status', '')}: {content}"
        out.append((kind, to, content))
    flush()
    return out


_WHAT = {
    CardType.LLM_MESSAGE: "model output",
    CardType.TOOL_CALL: "call",
    CardType.TOOL_RESULT: "result",
    CardType.TOOL_REFUSED: "refused call",
    CardType.DELIVERABLE: "answer",
}


def _recorded(item: tuple[str, str, str] | None) -> str:
    """``the recorded …``: what the record has at this place."""
    if item is None:
        return "Turn had nothing more"
    kind, to, content = item
    return f"{_WHAT.get(kind, kind)} was {_target(to)}{_short(content)}"


def _replayed(item: tuple[str, str, str] | None) -> str:
    """``the replay …``: what the replay did at this place."""
    if item is None:
        return "made nothing more"
    kind, to, content = item
    return f"made {_WHAT.get(kind, kind)} {_target(to)}{_short(content)}"


def _target(to: str) -> str:
    return f"{to} " if to else ""


def _short(text: str) -> str:
    return text if len(text) <= 200 else text[:200] + "…"


def compare(
    recorded: Sequence[Mapping[str, Any]], replayed: Sequence[Mapping[str, Any]]
) -> Divergence | None:
    """The first divergence of ``replayed`` cards from ``recorded`` ones; None: identical."""
    a, b = _items(recorded), _items(replayed)
    step = 0
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        first = x if x is not None else y
        if first is not None and first[0] == CardType.LLM_MESSAGE:
            step += 1
        if x != y:
            if x is not None and y is not None and x[0] == y[0] == CardType.TOOL_RESULT:
                return Divergence(
                    step,
                    f"result of {x[1]} was {_short(x[2])}",
                    f"got {_short(y[2])} (a result differed)",
                )
            return Divergence(max(step, 1), _recorded(x), _replayed(y))
    return None
