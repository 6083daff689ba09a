"""Agents wired to the real pump (in process): tool calls, self-iteration, one answer."""

from __future__ import annotations

import trio
import trio.testing
from lxml import etree
from pydantic_xml import BaseXmlModel, element

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.events import TaskEvent
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.store.sql import replies
from agentserver.app.runtime_parts import runtime_parts
from agentserver.core.envelope import build_envelope
from agentserver.core.listener import HandlerResponse, Listener
from agentserver.pump.pump import open_pump

A_NS = "urn:test:assistant"
C_NS = "urn:test:calc"


class Task(BaseXmlModel, tag="task", nsmap={"": A_NS}):
    text: str = element()


class Answer(BaseXmlModel, tag="answer", nsmap={"": A_NS}):
    text: str = element()


class Add(BaseXmlModel, tag="add", nsmap={"": C_NS}):
    a: int = element()
    b: int = element()


class Sum(BaseXmlModel, tag="sum", nsmap={"": C_NS}):
    value: int = element()


async def calculator(p: Add, meta):
    return HandlerResponse.respond(Sum(value=p.a + p.b))


class StepLLM:
    """Step 1: two parallel calculator calls; step 2: self-iterate; step 3: answer."""

    def __init__(self) -> None:
        self.requests: list[LLMRequest] = []

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        self.requests.append(request)
        step = len(self.requests)
        if step == 1:
            text = (
                f'I will add. <add xmlns="{C_NS}"><a>2</a><b>3</b></add> and '
                f'<add xmlns="{C_NS}"><a>10</a><b>20</b></add>'
            )
        elif step == 2:
            text = f'Now let me think again. <task xmlns="{A_NS}"><text>double-check</text></task>'
        else:
            seen = " ".join(m.content for m in request.messages)
            assert "<value>5</value>" in seen and "<value>30</value>" in seen, seen
            text = "The sums are 5 and 30."
        return LLMCompletion(text, LLMUsage(10, 5, 15), model="m", backend="fake")


async def test_task_through_pump_calls_tools_iterates_and_answers_once(tmp_path):
    llm = StepLLM()
    listeners_holder: dict = {}

    def make(pump):
        profile = AgentProfile(
            name="assistant",
            model="m",
            own_roots=(f"{{{A_NS}}}task",),
            peers={f"{{{C_NS}}}add": "calculator"},
            usage_instructions=pump.usage_instructions("assistant"),
        )
        settings = StoreSettings(path=tmp_path / "agents.sqlite3")
        profiles = {"assistant": profile}
        clock = SystemClock()
        store = open_agent_store(settings, profiles, clock=clock)
        ports = PumpPorts(pump, store=store)
        return AgentRuntime(
            runtime_parts(
                store=store,
                profiles=profiles,
                settings=settings,
                clock=clock,
                llm=llm,
                tools=ports,
                replies=ports,
            )
        )

    async def assistant(payload, meta):
        return await listeners_holder["handler"](payload, meta)

    listeners = [
        Listener(
            "assistant",
            (Task,),
            assistant,
            peers=("calculator",),
            responses=(Answer,),
            agent=True,
            raw=True,
        ),
        Listener("calculator", (Add,), calculator, responses=(Sum,)),
    ]
    async with open_pump(listeners) as pump:
        rt = make(pump)
        listeners_holder["handler"] = agent_handler(rt, pump, "assistant")
        events = rt.events.subscribe()
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            ep = pump.open_endpoint("client")
            thread = "44444444-4444-4444-8444-444444444444"
            task = Task(text="add 2+3 and 10+20").to_xml_tree()
            await ep.send(etree.tostring(build_envelope("client", "assistant", thread, task)))
            with trio.fail_after(10):
                reply = etree.fromstring(await ep.receive())
            assert reply[0][-1].text == thread
            assert reply[1].tag == f"{{{A_NS}}}answer"
            assert "5 and 30" in reply[1][0].text
            await trio.testing.wait_all_tasks_blocked()
            assert pump.counters["self_calls"] == 1
            # exactly one reply, one task event
            try:
                extra = ep.receive_nowait()
            except trio.WouldBlock:
                extra = None
            assert extra is None
            tasks = [e for e in events.drain() if isinstance(e, TaskEvent)]
            assert len(tasks) == 1
            # the hop thread was answered: with the finished conversation, it is gone
            assert len(pump.threads) == 1
            nursery.cancel_scope.cancel()
        await rt.aclose()
    assert len(llm.requests) == 3


async def test_named_client_replies_stay_kept_until_received(tmp_path):
    """A kept reply is offered to a live connection of the identity and leaves the store
    only once received; what a connection could not take, or took and never
    acknowledged, goes to the next one, in order."""
    from agentserver.agents.edge.named_clients import REPLY_ID_ATTR
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    class Link:
        identity = "alice"
        acks = True

        def __init__(self, name: str, room: int) -> None:
            self.endpoint_name = name
            self.room = room
            self.input_open = True
            self.got: list[int] = []

        def offer(self, reply_id: int, body: bytes) -> bool:
            if self.room == 0:
                return False
            self.room -= 1
            root = etree.fromstring(body)
            assert root.get(REPLY_ID_ATTR) == str(reply_id)
            self.got.append(int(root[0].text))
            return True

    async with open_pump([Listener("calculator", (Add,), calculator, responses=(Sum,))]) as pump:
        store = SqliteAgentStore.open(
            tmp_path / "s.sqlite3", settings=StoreSettings(path=tmp_path / "s.sqlite3")
        )
        ports = PumpPorts(pump, store=store, named_clients=["alice"])
        clients = ports.clients
        # More than one batch (100) is stored: the ones kept must not overtake the rest.
        ids = []
        for i in range(150):
            body = f"<m><n>{i}</n></m>".encode()
            ids.append(
                await store.run(replies.record_client_reply, "alice", {"i": i}, body, failed=False)
            )
        first, second = Link("alice", room=10), Link("alice-1", room=1000)
        await clients.attach(first)
        await clients.attach(second)
        # the second connection gets what the first did not (the first may still ack)
        assert first.got == list(range(10)) and second.got == list(range(10, 150))
        assert clients.identity_of("alice-1") == "alice"
        await clients.received(second, ids[10:])
        await clients.detach(first)  # never acknowledged: its ten go to the live one
        assert second.got[140:] == list(range(10))
        assert len(await store.read(replies.pending_client_replies, "alice")) == 10
        await clients.received(second, ids[:10])
        assert await store.read(replies.pending_client_replies, "alice") == []
        # an identity cannot acknowledge another's replies
        kept = await store.run(
            replies.record_client_reply, "bob", {}, b"<m><n>0</n></m>", failed=False
        )
        await clients.received(second, [kept])
        assert len(await store.read(replies.pending_client_replies, "bob")) == 1
        # a new reply goes to the newest connection that takes it
        third = Link("alice-2", room=0)
        await clients.attach(third)
        rid = await store.run(
            replies.record_client_reply, "alice", {}, b"<m><n>150</n></m>", failed=False
        )
        assert await clients.deliver("alice", rid, b"<m><n>150</n></m>")
        assert second.got[-1] == 150 and third.got == []
        await clients.detach(third)
        await clients.detach(second)
        assert clients.identity_of("alice-1") is None
        assert not await clients.deliver("alice", rid, b"<m><n>150</n></m>")  # kept
        assert [r.reply_id for r in await store.read(replies.pending_client_replies, "alice")] == [
            rid
        ]
        await store.aclose()


async def test_a_schedule_runs_answer_is_not_a_caller_gone(caplog):
    """Issue 45: each schedule run logged "anonymous caller schedule:… is gone"; no caller
    waits for a run's answer (it goes to the store and the events), so nothing is said.
    An anonymous caller that did go away is still logged."""
    from agentserver.agents.turn.scheduler import run_ref

    caplog.set_level("INFO", logger="agentserver")
    async with open_pump([]) as pump:
        ports = PumpPorts(pump)
        answer = etree.fromstring(b"<answer xmlns='urn:t'>done</answer>")
        await ports.deliver(
            run_ref("nightly", "assistant", 0.0), answer, failed=False, turn_id="t-run"
        )
        assert "is gone" not in caplog.text
        gone = {"hop": "h", "caller_thread": "c", "chain": ["client-1", "assistant"]}
        await ports.deliver(gone, answer, failed=False, turn_id="t-client")
    assert "turn t-client: anonymous caller client-1 is gone" in caplog.text
    assert "schedule:nightly" not in caplog.text
