"""The chaos bench's double texts (docs/runs.md; issue 36): which task a client sends next.

One agent, :data:`MEMORY_AGENT`, keeps a conversation per client (``memory="client"``), so
two tasks of one client to it are one conversation. While a client's earlier task to it
has no answer yet (queued behind another client's Turn, or its own Turn running: a model
call, a tool call out, an approval waited for), she sometimes sends it another task with
a ``multitask`` override on the envelope: a real double text, racing the server kills,
the model's faults, the operator's stops and her own disconnections. Other tasks now and
then carry a mode too, to any agent: to one without memory it must change nothing, and
to the memory agent with nothing open it is not a double text (unless her earlier task
is still queued in a way she cannot see: the checker allows it as long as the answers
fit the modes). The checker: bench/support/chaos_check.py ``double_text_violations``.

Pure: the choice is drawn from the client's seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: The agent keeping a conversation per client: ``alpha``, the one no schedule feeds
#: (a schedule's runs would repeat its fixed nonce in one conversation).
MEMORY_AGENT = "alpha"
#: The modes a double text asks for (``enqueue`` too: the default, said out loud).
MODES = ("reject", "interrupt", "rollback", "enqueue")
#: Per turn of a client's loop with a task to :data:`MEMORY_AGENT` open: a double text.
DOUBLE_TEXT_CHANCE = 0.3
#: After a task to :data:`MEMORY_AGENT`: the client's loop turns again at once, so the
#: next may double-text it within milliseconds (while it is still queued, or being leased).
HURRY_CHANCE = 0.25
#: Per new task otherwise: a ``multitask`` override anyway.
STRAY_MODE_CHANCE = 0.08


@dataclass(frozen=True, slots=True)
class NextTask:
    agent: str
    #: The envelope's ``multitask`` (None: the agent's own mode).
    multitask: str | None
    #: An earlier task of this client to ``agent`` has no answer yet.
    racing: bool


def next_task(
    rng: random.Random, open_agents: Sequence[str], max_open: int, agents: Sequence[str]
) -> NextTask | None:
    """The next task of a client whose unanswered tasks went to ``open_agents`` (None:
    none now). A double text may go one over ``max_open``, so that it is sent while
    her earlier task still runs rather than after it ended."""
    if MEMORY_AGENT in open_agents and len(open_agents) <= max_open:
        if rng.random() < DOUBLE_TEXT_CHANCE:
            return NextTask(MEMORY_AGENT, rng.choice(MODES), True)
    if len(open_agents) >= max_open:
        return None
    agent = rng.choice(agents)
    mode = rng.choice(MODES) if rng.random() < STRAY_MODE_CHANCE else None
    return NextTask(agent, mode, agent in open_agents)


def hurry(rng: random.Random, sent: NextTask | None) -> bool:
    """Whether the client's loop turns again at once after sending ``sent``."""
    return sent is not None and sent.agent == MEMORY_AGENT and rng.random() < HURRY_CHANCE
