"""The trio client against a real server on loopback."""

from __future__ import annotations

import trio
import trio.testing
from test_server_direct_write import serving

from agentserver.config.topology import Limits
from agentserver.core.listener import Listener
from agentserver.listeners.echo import Ping, Pong, handle
from agentserver.net.client import open_client


async def test_concurrent_receivers_are_each_woken_by_a_reply():
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with (
        serving(echo, Limits()) as (_, port),
        open_client("127.0.0.1", port) as client,
    ):
        got: list[str] = []

        async def receiver() -> None:
            got.append((await client.receive()).payload[0].text)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                await client.send(Ping(text="one"), to="echo")
                await client.send(Ping(text="two"), to="echo")
        assert sorted(got) == ["one", "two"]
