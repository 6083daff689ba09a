"""Writing a listener: what a handler's module imports (docs/guide.md).

    from agentserver.listener import HandlerMetadata, HandlerResponse

    async def handle(payload: Order, meta: HandlerMetadata) -> HandlerResponse: ...

One of the package's face modules (docs/api.md): the names in ``__all__`` are public and
keep their meaning across releases; the modules they come from are internal and may move.
"""

from agentserver.core.errors import HuhReason, SystemErrorCode
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.primitives.core import Huh, SystemErrorPayload

__all__ = [
    "HandlerMetadata",
    "HandlerResponse",
    "Huh",
    "HuhReason",
    "Listener",
    "SystemErrorCode",
    "SystemErrorPayload",
]
