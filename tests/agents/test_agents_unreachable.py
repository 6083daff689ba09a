"""A backend that refuses connections (issue 12): the Turn fails at once, or fails over.

The real router over real loopback sockets (a port nobody listens on, and the scripted
OpenAI-compatible fake), under trio's MockClock: before UNREACHABLE existed a refused
connection was a TIMEOUT, retried as a step 2 + 4 + 8 s later, so an unreachable model
answered ``failed`` only ~14 s after the task.
"""

from __future__ import annotations

import random

import trio
from agents_fakes import make_harness, profile, task
from llm_fakes import FakeServer, backend_for, openai_ok, start_fake

from agentserver.agents.edge.llm_adapter import RouterLLM
from agentserver.agents.store.sql import head
from agentserver.llm import BreakerConfig, RetryConfig, Router, RouterConfig, Strategy


async def dead_port() -> int:
    with trio.socket.socket() as sock:  # bound, never listening: connect is refused
        await sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dead_backend(port: int, name: str = "dead", **kw) -> object:
    fake = FakeServer("openai")
    fake.port = port
    return backend_for(fake, name, **kw)


def router(*backends) -> Router:
    cfg = RouterConfig(
        backends=tuple(backends),
        strategy=Strategy.FAILOVER,
        retry=RetryConfig(max_attempts=4, base_delay=1.0, max_delay=8.0),
        breaker=BreakerConfig(failures=3, cooldown=30.0),
        timeout=600.0,
    )
    return Router(cfg, environ={}, rng=random.Random(7))


def pending_retries(h) -> list[tuple]:
    return h.sql(
        "SELECT next_retry_at FROM agent_inbox WHERE message_type = 'resume' AND status = 'pending'"
    )


async def test_only_backend_unreachable_fails_the_turn_at_once(tmp_path, autojump_clock):
    h = make_harness(tmp_path, lambda req: "unused", profiles={"assistant": profile()})
    async with router(dead_backend(await dead_port())) as r:
        h.rt.worker.llm = RouterLLM(r)
        await h.rt.enqueue("assistant", task("x"), "ref")
        t0 = trio.current_time()
        await h.pump()
        elapsed = trio.current_time() - t0
        errors = r.stats().backends["dead"].counters.errors
    # One failed answer now: no step retry waiting, no router backoff slept through.
    [(_, text, failed, _)] = h.replies.sent
    assert failed and "UNREACHABLE" in text
    assert pending_retries(h) == []
    assert elapsed < 0.5
    assert errors == {"UNREACHABLE": 1}
    assert [e.status for e in h.task_events()] == ["failed"]
    assert (await h.rt.store.read(head.read, "assistant")).status == "idle"


async def test_every_turn_fails_at_once_while_the_backend_stays_down(tmp_path, autojump_clock):
    # After three refused connections the breaker opens; the next Turns must not wait
    # for its probe (30 s here) either.
    h = make_harness(tmp_path, lambda req: "unused", profiles={"assistant": profile()})
    async with router(dead_backend(await dead_port())) as r:
        h.rt.worker.llm = RouterLLM(r)
        for i in range(5):
            await h.rt.enqueue("assistant", task(f"x{i}"), f"ref{i}")
            await h.pump()
    assert trio.current_time() < 0.5
    assert [(ref, failed) for ref, _, failed, _ in h.replies.sent] == [
        (f"ref{i}", True) for i in range(5)
    ]
    assert all("UNREACHABLE" in text for _, text, _, _ in h.replies.sent)
    assert pending_retries(h) == []


async def test_unreachable_backend_fails_over_to_a_healthy_one_at_once(
    nursery, tmp_path, autojump_clock
):
    ok = await start_fake(nursery, "openai", openai_ok("done"))
    h = make_harness(tmp_path, lambda req: "unused", profiles={"assistant": profile()})
    async with router(
        dead_backend(await dead_port(), priority=1), backend_for(ok, "ok", priority=2)
    ) as r:
        h.rt.worker.llm = RouterLLM(r)
        await h.rt.enqueue("assistant", task("x"), "ref")
        t0 = trio.current_time()
        await h.pump()
        elapsed = trio.current_time() - t0
        errors = r.stats().backends["dead"].counters.errors
    assert [(text, failed) for _, text, failed, _ in h.replies.sent] == [("done", False)]
    assert len(ok.requests) == 1 and errors == {"UNREACHABLE": 1}
    assert pending_retries(h) == [] and elapsed < 0.5
