"""Tasks sent back to back on one connection reach the agent's inbox in send order.

The bundled topology in a real pump with the real agent store: two tasks sent without a
pause between them used to be taken by two of the agent listener's pump slots, which
trio's scheduler runs in either order, so the second could be enqueued (and answered)
first. Each round below is such a pair; the rounds are many so that old code fails with
certainty (each round had an even chance to invert).
"""

from __future__ import annotations

import trio
import trio.testing
from conftest import store_in
from lxml import etree
from serverproc import REPO

from agentserver.app.agents import start_agents
from agentserver.app.builtins import RunContext, build_listener_set
from agentserver.config import loader as boot
from agentserver.core.envelope import build_envelope
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.pump.pump import open_pump

ROUNDS = 30
#: An OpenAI backend nobody answers (without a key the bundled assistant would run the
#: packaged local model): every Turn fails at once, which is all this test needs.
NO_MODEL = {"OPENAI_API_KEY": "unused", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}


async def test_back_to_back_tasks_are_enqueued_and_answered_in_send_order(tmp_path):
    topo = store_in(boot.load_or_raise(REPO / "boot.xml", environ=NO_MODEL), tmp_path)
    ctx = RunContext(topo)
    sent: list[str] = []
    answered: list[str] = []
    built = build_listener_set(topo, ctx)
    async with (
        ctx.resources,
        open_pump(built.listeners, config=topo.pump_config()) as pump,
    ):
        async with trio.open_nursery() as nursery:
            agents = await start_agents(
                topo, pump, built.agent_handlers, nursery, ctx.resources, environ=NO_MODEL
            )
            assert agents is not None
            ep = pump.open_endpoint("client", buffer=4 * ROUNDS)
            for i in range(ROUNDS):
                for j in range(2):  # a pair, back to back: no checkpoint between them
                    thread = new_thread_id()
                    task = Task(text=f"task {i}.{j}").to_xml_tree()
                    await ep.send(
                        etree.tostring(build_envelope("client", "assistant", thread, task))
                    )
                    sent.append(thread)
                await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(60):
                while len(answered) < len(sent):
                    reply = etree.fromstring(await ep.receive())
                    answered.append(reply[0][-1].text)
            # A started Turn's row gave its payload up to its task.input card (issue 38).
            inbox = agents.runtime.store._db.execute(  # type: ignore[attr-defined]
                "SELECT i.payload, (SELECT c.content FROM cards c WHERE c.agent_turn_id = "
                "i.agent_turn_id AND c.card_type = 'task.input' ORDER BY c.seq LIMIT 1) "
                "FROM agent_inbox i WHERE i.message_type = 'turn' ORDER BY i.seq"
            ).fetchall()
            agents.stop()
            nursery.cancel_scope.cancel()
    texts = [
        etree.fromstring(bytes(row[0]) or row[1].encode()).findtext(
            "{urn:agentserver:assistant}text"
        )
        for row in inbox
    ]
    assert texts == [f"task {i}.{j}" for i in range(ROUNDS) for j in range(2)]
    assert answered == sent  # one Turn at a time, in inbox order
