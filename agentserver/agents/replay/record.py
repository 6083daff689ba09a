"""A recorded Turn as plain data (``TurnRecord``), and its self-contained JSON Lines form
(``agentserver export``; ``agentserver replay --from``). Pure: no store, no I/O.

The JSON Lines form, one object per line, each with a ``record`` kind:

- ``turn`` (first, once): ``version`` (1), ``agent``, ``thread``, ``turn``, ``task`` (the
  task payload's XML), ``status`` and ``answer`` (the deliverable's, if it ended);
- ``step``: ``step`` (number), ``status``, ``model``, ``prompt_tokens``,
  ``completion_tokens`` (the model input's summary), ``tool_call_ids``, ``output`` (the
  model's text, when the step has one);
- ``card``: ``type``, ``content``, ``metadata``: every card the Turn wrote, in order
  (tool calls, results, refusals, notes, summaries, the deliverable);
- ``decision``: a policy decision (``step_id``, ``target``, ``tag``, ``decision``,
  ``rule``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentserver.agents.store.base import CardType

VERSION = 1


class RecordError(ValueError):
    """A Turn record (a JSON Lines export) that cannot be read."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    agent: str
    thread: str
    turn: str
    task: str
    steps: tuple[Mapping[str, Any], ...] = ()
    cards: tuple[Mapping[str, Any], ...] = ()
    decisions: tuple[Mapping[str, Any], ...] = field(default=())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TurnRecord:
        return cls(
            str(data["agent"]),
            str(data["thread"]),
            str(data["turn"]),
            str(data["task"]),
            tuple(data.get("steps", ())),
            tuple(data.get("cards", ())),
            tuple(data.get("decisions", ())),
        )

    # -- what replay serves ---------------------------------------------------------
    def of_type(self, card_type: str) -> list[Mapping[str, Any]]:
        return [c for c in self.cards if c["type"] == card_type]

    def outputs(self) -> list[str]:
        """The model's outputs, in order (one per step that had one)."""
        return [c["content"] for c in self.of_type(CardType.LLM_MESSAGE)]

    def summaries(self) -> list[str]:
        """The compactions' rolling summaries, in order."""
        return [c["content"] for c in self.of_type(CardType.SUMMARY)]

    def results(self) -> dict[str, Mapping[str, Any]]:
        """Tool call id → its result card."""
        return {
            str(c["metadata"].get("tool_call_id")): c for c in self.of_type(CardType.TOOL_RESULT)
        }

    def deliverable(self) -> Mapping[str, Any] | None:
        done = self.of_type(CardType.DELIVERABLE)
        return done[-1] if done else None

    # -- the JSON Lines form ----------------------------------------------------------
    def to_jsonl(self) -> str:
        done = self.deliverable()
        by_step = {
            c["metadata"].get("step_id"): c["content"] for c in self.of_type(CardType.LLM_MESSAGE)
        }
        lines: list[dict[str, Any]] = [
            {
                "record": "turn",
                "version": VERSION,
                "agent": self.agent,
                "thread": self.thread,
                "turn": self.turn,
                "task": self.task,
                "status": (done["metadata"].get("status") if done else None) or "unfinished",
                "answer": done["content"] if done else None,
            }
        ]
        for step in self.steps:
            line = {"record": "step", **step}
            if step.get("step_id") in by_step:
                line["output"] = by_step[step.get("step_id")]
            lines.append(line)
        lines += ({"record": "card", **card} for card in self.cards)
        lines += ({"record": "decision", **d} for d in self.decisions)
        return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)

    @classmethod
    def from_jsonl(cls, lines: Iterable[str]) -> TurnRecord:
        """Read an export. Raises :class:`RecordError`."""
        head: dict[str, Any] | None = None
        parts: dict[str, list[dict[str, Any]]] = {"step": [], "card": [], "decision": []}
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                kind = item.pop("record")
            except (ValueError, KeyError, AttributeError, TypeError) as exc:
                raise RecordError(f"line {n}: not a record ({exc})") from None
            if kind == "turn":
                if item.get("version") != VERSION:
                    raise RecordError(f"line {n}: version {item.get('version')!r} is not 1")
                head = item
            elif kind in parts:
                item.pop("output", None)
                parts[kind].append(item)
            else:
                raise RecordError(f"line {n}: unknown record {kind!r}")
        if head is None:
            raise RecordError("no turn record")
        for card in parts["card"]:
            if not {"type", "content", "metadata"} <= card.keys():
                raise RecordError("a card record needs type, content and metadata")
        try:
            return cls.from_dict(
                {
                    **head,
                    "steps": parts["step"],
                    "cards": parts["card"],
                    "decisions": parts["decision"],
                }
            )
        except KeyError as exc:
            raise RecordError(f"the turn record has no {exc}") from None
