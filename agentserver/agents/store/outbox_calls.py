"""The store's outbox and webhook calls (agents/store/outbox.py, webhook_rows.py), each
one function in one transaction: a part of :class:`~agentserver.agents.store.sql_store.
SqlAgentStore`, which supplies the backend's ``_run`` and ``_read`` and ``claim_lock``."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ParamSpec, TypeVar

from agentserver.agents.store import outbox, webhook_rows
from agentserver.agents.store.sql.db import StoreFn

T = TypeVar("T")
P = ParamSpec("P")


class OutboxCalls(abc.ABC):
    """The outbox's and webhooks' store calls (mixed into ``SqlAgentStore``)."""

    #: The row-lock clause of a claim (``SqlAgentStore.claim_lock``).
    claim_lock: str = ""

    @abc.abstractmethod
    async def _run(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``fn(tx, env, *args)`` in one transaction (the backend's)."""

    @abc.abstractmethod
    async def _read(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that writes nothing (the backend's)."""

    # -- the outbox (agents/store/outbox.py) ------------------------------------------------
    async def outbox_enqueue(self, items: Sequence[outbox.OutboxItem]) -> int:
        """Insert deliveries in one transaction (deduplicated by key); how many were new."""
        return await self._run(outbox.enqueue, list(items)) if items else 0

    async def outbox_claim(
        self, owner: str, lease_s: float, limit: int, exclude: Sequence[str] = ()
    ) -> list[outbox.OutboxRow]:
        """Lease due deliveries to ``owner`` (``SKIP LOCKED`` where the backend has it)."""
        return await self._run(outbox.claim, owner, lease_s, limit, list(exclude), self.claim_lock)

    async def outbox_release(self, seqs: Sequence[int], owner: str, delay_s: float = 0.0) -> None:
        if seqs:
            await self._run(outbox.release, list(seqs), owner, delay_s)

    async def outbox_delivered(self, done: Sequence[tuple[int, str, int]]) -> None:
        """Record deliveries ``(seq, channel, HTTP status)`` in one transaction."""
        if done:
            await self._run(outbox.delivered, list(done))

    async def outbox_failed(
        self,
        seq: int,
        channel: str,
        error: str,
        status: int | None,
        retry_at: float | None,
        disable_after_s: float | None,
    ) -> bool:
        """Record a failed attempt; True when it disabled the channel (once)."""
        return await self._run(
            outbox.failed, seq, channel, error, status, retry_at, disable_after_s
        )

    async def outbox_enable(self, channel: str) -> int:
        return await self._run(outbox.enable, channel)

    async def outbox_figures(self) -> list[outbox.ChannelFigures]:
        return await self._read(outbox.figures)

    async def outbox_prune(self, keep_s: float) -> int:
        return await self._run(outbox.prune, keep_s)

    async def outbox_deliveries(self, channel: str | None, limit: int) -> list[dict[str, Any]]:
        return await self._read(outbox.deliveries, channel, limit)

    async def put_webhook(self, name: str, spec: str, secret: str) -> bool:
        return await self._run(webhook_rows.put_webhook, name, spec, secret)

    async def get_webhooks(self) -> list[tuple[str, str, str]]:
        return await self._read(webhook_rows.get_webhooks)

    async def delete_webhook(self, name: str, channel: str) -> bool:
        return await self._run(webhook_rows.delete_webhook, name, channel)

    async def recent_task_ends(self, since: float) -> list[tuple[str, str, str, str, str, float]]:
        """The Turns ended since ``since`` (webhooks' start-up sweep)."""
        return await self._read(webhook_rows.recent_task_ends, since)

    async def outbox_present_keys(self, keys: Sequence[str]) -> set[str]:
        """Those of ``keys`` the outbox holds (webhooks' sweep while running)."""
        return await self._read(outbox.present_keys, keys)

    async def turn_conversation(self, agent_turn_id: str) -> tuple[str | None, str | None]:
        """(caller thread, conversation) of the task a Turn runs (for webhook payloads)."""
        return await self._read(webhook_rows.turn_conversation, agent_turn_id)
