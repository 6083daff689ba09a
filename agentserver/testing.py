"""Testing with a boot.xml: its listeners in the test's own trio run, no socket
(docs/guide.md, "Testing a listener"), and recorded Turns replayed offline (docs/agents.md,
"Replay and export").

    from agentserver.testing import in_process

    async with in_process("boot.xml") as organism:
        reply = await organism.request(Reverse(text="abc"), to="reverse")

One of the package's face modules (docs/api.md): the names in ``__all__`` are public and
keep their meaning across releases; the modules they come from are internal and may move.
"""

from agentserver.agents.replay.record import RecordError, TurnRecord
from agentserver.app.replay import ReplayError, ReplayReport, replay
from agentserver.app.testing import InProcess, in_process
from agentserver.config.problems import BootError
from agentserver.net.reply import Reply

__all__ = [
    "BootError",
    "InProcess",
    "RecordError",
    "ReplayError",
    "ReplayReport",
    "Reply",
    "TurnRecord",
    "in_process",
    "replay",
]
