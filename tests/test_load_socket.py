"""Load over loopback: 200 concurrent connections x 100 requests each (x 20 over TLS);
every request gets exactly its own reply, none lost or duplicated. Bounded in count and
time."""

from __future__ import annotations

import collections
import time

import pytest
import trio
from serverproc import REPO, ServerProcess
from tlsutil import make_pki, with_tls

from agentserver.listeners.calculator import Add
from agentserver.listeners.echo import Ping
from agentserver.net.client import open_client

CONNECTIONS = 200
REQUESTS = 100
TLS_REQUESTS = 20


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess.start(REPO / "boot.xml")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("tls"))
    boot = with_tls(REPO / "boot.xml", pki.dir / "boot.xml", cert="server.pem", key="server.key")
    proc = ServerProcess.start(boot)
    proc.ssl_context = pki.client_context()
    yield proc
    assert proc.stop() == 0


async def test_200_connections_x_100_requests_each_get_exactly_their_replies(server):
    await run_load(server, REQUESTS)


async def test_200_tls_connections_x_20_requests_each_get_exactly_their_replies(tls_server):
    await run_load(tls_server, TLS_REQUESTS)


async def run_load(server: ServerProcess, requests: int) -> None:
    problems: list[str] = []
    answered = collections.Counter()

    async def one_connection(c: int) -> None:
        async with open_client(server.host, server.port, **server.client_options) as client:
            expected: dict[str, str] = {}
            for i in range(requests):
                # Alternate listeners so two queues and two handlers are exercised.
                if i % 2:
                    thread = await client.send(Ping(text=f"{c}:{i}"), to="echo")
                    expected[thread] = f"pong {c}:{i}"
                else:
                    thread = await client.send(Add(a=c, b=i), to="calculator")
                    expected[thread] = f"sum {c + i}"
            for _ in range(requests):
                reply = await client.receive()
                want = expected.pop(reply.thread, None)
                got = f"{reply.payload.tag.split('}')[1]} {reply.payload[0].text}"
                if want != got:
                    problems.append(f"connection {c}: expected {want!r}, got {got!r}")
                answered[c] += 1
            # Nothing more may arrive: no duplicates.
            with trio.move_on_after(0.2):
                extra = await client.receive()
                problems.append(f"connection {c}: unexpected extra reply {extra.raw[:80]!r}")

    start = time.monotonic()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for c in range(CONNECTIONS):
                nursery.start_soon(one_connection, c)
    elapsed = time.monotonic() - start
    assert not problems, problems[:5]
    assert sum(answered.values()) == CONNECTIONS * requests
    assert all(answered[c] == requests for c in range(CONNECTIONS))
    print(f"{CONNECTIONS * requests} requests in {elapsed:.1f} s")
