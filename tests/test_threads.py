"""Thread registry: chain extend/prune invariants, bounds and expiry."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentserver.core.threads import (
    QuotaExceeded,
    RegistryFull,
    ThreadQuota,
    ThreadRegistry,
    is_uuid4,
    new_thread_id,
)


def test_extend_and_prune_follow_the_chain():
    reg = ThreadRegistry()
    root = reg.open_root(("client",), 0.0)
    a = reg.extend(root, "a", 1.0)
    b = reg.extend(a, "b", 2.0)
    c = reg.extend(b, "c", 3.0)
    assert c.dotted == "client.a.b.c"
    assert reg.prune(c) is b  # respond: back to the caller
    assert reg.get(c.id) is None and reg.get(b.id) is b
    assert reg.prune(a) is root  # subtree b goes too
    assert reg.get(b.id) is None and len(reg) == 1


def test_same_path_conversations_get_distinct_threads():
    reg = ThreadRegistry()
    root = reg.open_root(("client",), 0.0)
    x = reg.extend(root, "echo", 0.0)
    y = reg.extend(root, "echo", 0.0)
    assert x.id != y.id and x.chain == y.chain
    assert reg.prune(x) is root and reg.get(y.id) is y


def test_finish_waits_for_children_and_pending():
    reg = ThreadRegistry()
    root = reg.open_root(("c",), 0.0)
    a = reg.extend(root, "a", 0.0)
    child = reg.extend(a, "b", 0.0)
    assert not reg.finish(a)
    reg.prune(child)
    a.pending = 1
    assert not reg.finish(a)
    a.pending = 0
    assert reg.finish(a) and reg.get(a.id) is None


def test_a_transient_root_ends_with_its_last_hop():
    reg = ThreadRegistry()
    conv = reg.open_root(("client",), 0.0, transient=True)
    a = reg.extend(conv, "a", 0.0)
    b = reg.extend(conv, "b", 0.0)
    assert reg.prune(a) is conv and conv.id in reg  # b is still in flight
    assert reg.prune(b) is conv  # answered: the caller's thread is returned...
    assert conv.id not in reg and len(reg) == 0  # ...and the finished conversation is gone
    # Its id can be used again (a follow-up on the same thread).
    again = reg.open_root(("client",), 1.0, thread_id=conv.id, transient=True)
    assert reg.get(conv.id) is again
    # A transient root that never got a hop is ended by finish.
    assert reg.finish(again) is again and len(reg) == 0


def test_finish_ends_the_callers_that_wait_for_nothing_any_more():
    reg = ThreadRegistry()
    system = reg.open_root(("system", "org"), 0.0)
    reg.pin(system)
    conv = reg.open_root(("client",), 0.0, transient=True)
    a = reg.extend(conv, "a", 0.0)  # a forwarded to b and returned
    b = reg.extend(a, "b", 0.0)
    c = reg.extend(b, "c", 0.0)
    # c ends its chain: b and a get no answer and have nothing left to wait for.
    assert reg.finish(c) is a
    assert len(reg) == 1 and system.id in reg


def test_finish_stops_at_a_caller_that_still_waits_or_works():
    reg = ThreadRegistry()
    conv = reg.open_root(("client",), 0.0, transient=True)
    a = reg.extend(conv, "a", 0.0)
    b1 = reg.extend(a, "b", 0.0)
    b2 = reg.extend(a, "b", 0.0)
    assert reg.finish(b1) is b1 and a.id in reg  # a still waits for b2
    a.pending = 1  # an answer for a is queued, or a's handler is running
    assert reg.finish(b2) is b2 and a.id in reg and conv.id in reg
    a.pending = 0
    reg.pin(a)  # held (an agent answers later)
    assert reg.finish(a) is None and a.id in reg
    reg.unpin(a)
    assert reg.finish(a) is a and len(reg) == 0


def test_a_quota_counts_every_thread_of_its_trees():
    reg = ThreadRegistry(max_threads=100)
    quota = ThreadQuota(4)
    conv = reg.open_root(("client",), 0.0, quota=quota, transient=True)
    a = reg.extend(conv, "a", 0.0)
    b = reg.extend(a, "b", 0.0)
    other = reg.open_root(("client",), 0.0, quota=quota, transient=True)
    assert quota.used == 4
    with pytest.raises(QuotaExceeded):
        reg.extend(a, "c", 0.0)  # a listener's forward counts against its caller's share
    with pytest.raises(RegistryFull):  # what the pump catches
        reg.open_root(("client",), 0.0, quota=quota)
    assert len(reg) == 4
    reg.open_root(("someone-else",), 0.0)  # other parties are not affected
    reg.prune(b)
    assert quota.used == 3
    reg.extend(other, "a", 0.0)
    reg.prune(a)  # a's conversation ends with it
    assert quota.used == 2 and conv.id not in reg
    assert reg.remove_owned_by("client") == 2 and quota.used == 0


def test_expiry_spares_busy_and_pinned_trees():
    reg = ThreadRegistry(idle_ttl=10)
    old = reg.open_root(("c",), 0.0)
    busy_parent = reg.open_root(("d",), 0.0)
    reg.extend(busy_parent, "x", 50.0)  # recent activity below
    pinned = reg.open_root(("system", "org"), 0.0)
    reg.pin(pinned)
    removed = reg.expire(20.0)
    assert removed == [old.id]
    assert busy_parent.id in reg and pinned.id in reg


def test_expiry_walks_a_chain_deeper_than_the_recursion_limit():
    # Two listeners forwarding to each other build one level per hop.
    reg = ThreadRegistry(idle_ttl=10)
    root = reg.open_root(("c",), 0.0)
    record = root
    for i in range(3000):
        record = reg.extend(record, "ping" if i % 2 else "pong", 0.0)
    assert reg.expire(5.0) == []  # not idle long enough: all kept
    assert len(reg) == 3001
    removed = reg.expire(20.0)
    assert len(removed) == 3001 and removed[-1] == root.id and len(reg) == 0


def test_bounded_registry_expires_then_refuses():
    reg = ThreadRegistry(max_threads=2, idle_ttl=10)
    reg.open_root(("a",), 0.0)
    reg.open_root(("b",), 5.0)
    reg.open_root(("c",), 11.0)  # a expired to make room
    assert len(reg) == 2
    with pytest.raises(RegistryFull):
        reg.open_root(("d",), 12.0)


def test_uuid4_format():
    # Ids are made in batches of 256: draw across several batch boundaries.
    ids = [new_thread_id() for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    for tid in ids:
        assert is_uuid4(tid)
        parsed = uuid.UUID(tid)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == tid
    # Every random nibble varies (a slicing mistake would pin some of them).
    for pos in range(36):
        if pos not in (8, 13, 14, 18, 19, 23):  # dashes, version, variant
            assert len({tid[pos] for tid in ids}) > 8, pos
    assert {tid[19] for tid in ids} == set("89ab")
    assert not is_uuid4("not-a-uuid")
    assert not is_uuid4("0b6d2f4e-8c51-1b7a-9d3e-2f1a6c5b4e3d")  # version 1


class RegistryMachine(RuleBasedStateMachine):
    """Random forwards, responds, finishes and expiries keep the tree consistent."""

    def __init__(self):
        super().__init__()
        self.reg = ThreadRegistry(max_threads=10_000, idle_ttl=100)
        self.now = 0.0
        self.live: list = []
        self.quota = ThreadQuota(12)

    @rule(name=st.sampled_from(["c1", "c2"]), transient=st.booleans(), charged=st.booleans())
    def open_root(self, name, transient, charged):
        try:
            root = self.reg.open_root(
                (name,), self.now, quota=self.quota if charged else None, transient=transient
            )
        except QuotaExceeded:
            assert charged and self.quota.used == self.quota.limit
            return
        self.live.append(root)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000), name=st.sampled_from(["a", "b", "c"]))
    def forward(self, i, name):
        parent = self.live[i % len(self.live)]
        if parent.id in self.reg:
            try:
                child = self.reg.extend(parent, name, self.now)
            except QuotaExceeded:
                assert parent.quota is self.quota and self.quota.used == self.quota.limit
                return
            assert child.chain == (*parent.chain, name)
            self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000))
    def respond(self, i):
        rec = self.live[i % len(self.live)]
        was_live = rec.id in self.reg
        parent = self.reg.prune(rec)
        assert rec.id not in self.reg
        if was_live and rec.parent is not None:
            assert parent is not None and parent.chain == rec.chain[:-1]
            assert rec.id not in parent.children

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000))
    def finish(self, i):
        rec = self.live[i % len(self.live)]
        had_children = bool(rec.children)
        top = self.reg.finish(rec)
        if top is not None:
            assert not had_children and rec.id not in self.reg
            # what was removed is rec and callers of it, up to top
            assert top.chain == rec.chain[: len(top.chain)]
            assert top.id not in self.reg

    @rule(dt=st.floats(0, 200))
    def tick_and_expire(self, dt):
        self.now += dt
        self.reg.expire(self.now)

    @invariant()
    def tree_is_consistent(self):
        threads = self.reg._threads
        for rec in threads.values():
            if rec.parent is not None:
                # a live thread's parent is live and knows it
                assert rec.parent in threads
                assert rec.id in threads[rec.parent].children
                assert threads[rec.parent].chain == rec.chain[:-1]
            for child in rec.children:
                assert child in threads
            # a transient root lives only for its hops (or until finished, if it got none)
            if rec.transient and not rec.children:
                assert rec.id in self.fresh_roots()
        assert self.quota.used == sum(1 for r in threads.values() if r.quota is self.quota)
        assert self.quota.used <= self.quota.limit

    def fresh_roots(self):
        # transient roots that never had a child (opened, not yet used)
        return {
            r.id
            for r in self.live
            if r.parent is None and not any(c.parent == r.id for c in self.live)
        }


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_closed_clients_held_hop_keeps_its_calls_out():
    """Found by bench/chaos.py: a client left while her agent's Turn had a tool call out;
    removing her threads removed the held hop's call too, so the tool's answer found no
    thread and the Turn waited for its resume deadline."""
    reg = ThreadRegistry()
    root = reg.open_root(("c1",), 0.0)
    hop = reg.extend(root, "beta", 0.0)
    reg.pin(hop)  # the agent holds it: answered later
    call = reg.extend(hop, "stamp", 0.0)  # a tool call out
    plain = reg.open_root(("c1",), 0.0)
    echo = reg.extend(plain, "echo", 0.0)
    other = reg.extend(root, "echo", 0.0)  # a plain hop of the same conversation
    reg.remove_owned_by("c1")
    assert reg.get(plain.id) is None and reg.get(echo.id) is None and reg.get(other.id) is None
    assert reg.get(call.id) is call
    assert reg.prune(call) is hop  # the tool's answer reaches the agent's hop
    assert reg.prune(hop) is root  # the agent answers; the conversation goes with it
    assert reg.get(root.id) is None
