"""ThreadRef: a durable (JSON-able) reference to a held hop, for answering later."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThreadRef:
    """A durable reference to a hop thread and its caller's thread (JSON-able)."""

    hop: str
    caller_thread: str
    chain: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"hop": self.hop, "caller_thread": self.caller_thread, "chain": list(self.chain)}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ThreadRef:
        """Raises ValueError when ``data`` is no hop reference."""
        found = data["chain"]
        if not isinstance(found, list | tuple):
            raise ValueError("a hop chain is a list of endpoints")
        chain = tuple(str(n) for n in found)
        if len(chain) < 2:
            raise ValueError("a hop chain has a caller and an owner")
        return cls(str(data["hop"]), str(data["caller_thread"]), chain)

    @property
    def caller(self) -> str:
        return self.chain[-2]
