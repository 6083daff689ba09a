"""After a restart: a suspended Turn's tool calls to listeners whose steps may be retried
(``idempotent``) are sent again with their recorded idempotency keys, instead of being
reported lost.

Each re-send is checked by the pump, then one store transaction (the waiting row and the
call's card renamed to a new sub-thread, drawn here), then one forward through the pump on
that sub-thread: its result never comes before its waiting row names it. A crash between
the two leaves the row waiting on a call that never went out: the next start sends it
again, with the same key (the handler dedupes on it). Cancellation propagates between
calls; what was rebound stays rebound.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from agentserver.agents.errors import PumpRefused, StaleTurn
from agentserver.agents.ports import ToolPort, reply_ref_from_json
from agentserver.agents.store.base import TurnToken, WatchdogStore
from agentserver.agents.store.sql import tools as sql_tools
from agentserver.agents.store.sql import turns
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.steps.retry import KEY_FIELD

log = logging.getLogger(__name__)


async def resend_waiting(
    store: WatchdogStore,
    tools: ToolPort,
    token: TurnToken,
    retryable: Collection[str],
    deadline: float,
) -> tuple[int, list[str]]:
    """Send again each waiting call of ``token`` whose listener is in ``retryable``; the
    Turn then waits for them until ``deadline`` at least. Returns how many were sent and
    the ids of the waiting calls left alone (to be reported lost). Raises StaleTurn when the
    Turn moved on."""
    calls = await store.read(sql_tools.waiting_calls, token)
    lost = [c.tool_call_id for c in calls if c.to not in retryable]
    again = [c for c in calls if c.to in retryable]
    if not again:
        return 0, lost
    ref_json = await store.read(turns.turn_reply_ref, token)
    if ref_json is None:  # the Turn is no longer the agent's active one
        raise StaleTurn(f"{token}: not the active Turn")
    ref = reply_ref_from_json(ref_json)
    parser = SafeParser()
    sent = 0
    for call in again:
        key = str(call.metadata.get(KEY_FIELD) or call.tool_call_id)
        element = parser.parse(call.payload.encode())
        try:
            tools.check_call(token.agent_id, element, call.to)
        except PumpRefused:
            log.warning("turn %s: re-sending %s was refused", token.agent_turn_id, call.to)
            lost.append(call.tool_call_id)
            continue
        sub = new_thread_id()
        await store.run(sql_tools.rebind_call, token, call.tool_call_id, sub, deadline)
        try:
            await tools.call(token.agent_id, ref, element, call.to, key=key, thread=sub)
        except PumpRefused:
            log.warning("turn %s: re-sending %s was refused", token.agent_turn_id, call.to)
            lost.append(sub)  # its waiting row names the new sub-thread now
            continue
        sent += 1
    return sent, lost
