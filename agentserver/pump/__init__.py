"""The message pump: moves validated messages between listeners and endpoints under trio.

``from agentserver.pump import PumpConfig, open_pump`` is part of the public API
(docs/api.md).
"""

from agentserver.pump.pump import Pump, PumpConfig, ThreadRef, open_pump

__all__ = ["Pump", "PumpConfig", "ThreadRef", "open_pump"]
