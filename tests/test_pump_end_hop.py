"""``Pump.end_hop``: a held hop ended as an answer would end it, sending nothing (the
agents' bridge does it for a named client, whose answer is kept in the store)."""

from __future__ import annotations

from conftest import Add, drain, envelope_bytes

from agentserver.core.listener import Listener
from agentserver.pump.pump import open_pump


async def test_end_hop_removes_the_held_hop_and_its_conversation_sending_nothing():
    held: list[str] = []
    pump_ref = []

    async def keep(p, meta):
        held.append(meta.thread_id)
        pump_ref[0].hold(meta.thread_id)
        return None

    async with open_pump([Listener("keep", (Add,), keep)]) as pump:
        pump_ref.append(pump)
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Add(a=1, b=2), to="keep"))
        assert await drain(ep) == []
        assert len(pump.threads) == 3  # the root, the conversation, the held hop
        assert pump.end_hop(held[0]) is True
        assert len(pump.threads) == 1  # the hop and its emptied conversation are gone
        assert await drain(ep) == []  # nothing was sent
        assert pump.end_hop(held[0]) is False  # idempotent
