"""One step's model call: the context compacted first when over budget, the call itself
(streamed when the port can, each chunk published as it arrives), a provider's context
overflow compacted once more, and a retryable failure recorded as a durable retry wait.

Bounded by ``profile.llm_timeout_s`` as a whole (compaction included). Cancellation
propagates; a :class:`StaleTurn` (fenced out) propagates with nothing more written. While
another process shares the store (which may end the Turn: its stop, its watchdog), the
model call also watches the Turn's head and is abandoned (StaleTurn) once it has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import trio

from agentserver.agents.errors import LLMUnavailable, StaleTurn, StoreError
from agentserver.agents.events import ChunkEvent, EventBus, StepEvent
from agentserver.agents.governance.budgets import Budgets, BudgetSpent, HoldOwner, Spend
from agentserver.agents.ports import LLMCompletion, LLMPort, LLMRequest, reply_ref_from_json
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retry import RetryStep, decide_retry
from agentserver.agents.store.base import (
    AgentStore,
    BoxSwap,
    Card,
    Head,
    HoldFor,
    StepStart,
    TurnToken,
)
from agentserver.agents.store.rows import client_of
from agentserver.agents.store.sql import turns
from agentserver.agents.store.sql.budgets import HoldRequest
from agentserver.agents.turn.compactor import PendingSwap, compact_turn
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.machine import (
    BudgetRefused,
    ModelFailed,
    RetryScheduled,
    StepTimedOut,
)
from agentserver.agents.turn.model_context import model_messages, system_text
from agentserver.llm.tokens import PER_REQUEST, estimate_message_tokens

log = logging.getLogger("agentserver.agents.turn.worker")


@dataclass(frozen=True, slots=True)
class Completed:
    """The model answered: its completion, the compaction to commit with the step, and
    the step's calls' spends, to settle with the step (budgets: ``spends=``)."""

    completion: LLMCompletion
    swap: BoxSwap | None
    spends: tuple[Spend, ...] = ()


#: What a step's model call came to (each but :class:`Completed` is the Turn machine's
#: event as it is; the worker makes a :class:`~.machine.ModelReplied` of a completion).
ModelOutcome = Completed | ModelFailed | StepTimedOut | BudgetRefused | RetryScheduled


def step_request(
    agent_id: str, profile: AgentProfile, system: str, cards: Sequence[Card], step_no: int
) -> LLMRequest:
    """The model request of step ``step_no`` on ``cards`` (pure)."""
    return LLMRequest(
        agent=agent_id,
        model=profile.model,
        messages=model_messages(profile, system, cards, step_no == profile.max_steps),
        max_tokens=profile.max_tokens,
        grammar=profile.reply_grammar,
    )


class ModelStep:
    """Makes a step's model call for the worker. Holds only infrastructure."""

    def __init__(
        self,
        *,
        store: AgentStore,
        events: EventBus,
        hold: TurnHold,
        poll_s: float = 1.0,
        budgets: Budgets | None = None,
    ) -> None:
        self.store = store
        #: The spend budgets (None: none declared, and a call pays nothing for them).
        self.budgets = budgets
        self.events = events
        #: Fences the Turn (its running head, or StaleTurn) after a compaction and while
        #: the model call runs.
        self.hold = hold
        #: How often a model call reads the head while other processes share the store.
        self.poll_s = poll_s
        #: :meth:`hold_for` of each agent, with the profile it was made for (one per
        #: agent: bounded by the agents).
        self._holds: dict[str, tuple[AgentProfile, HoldFor]] = {}

    def hold_for(self, profile: AgentProfile) -> HoldFor | None:
        """How the transaction that opens a step of ``profile``'s agent reserves the
        step's first model call with it (None: no spend budget is declared): the worst
        case of the request the step will make on the cards it opened with, in the
        budgets of the agent and the Turn's client. Pure, no I/O."""
        budgets = self.budgets
        if budgets is None:
            return None
        made = self._holds.get(profile.name)
        if made is not None and made[0] is profile:
            return made[1]
        system = system_text(profile)

        def hold_for(ref_json: str | None, step: StepStart) -> HoldRequest | None:
            token = step.head.token
            if token is None or step.step_id is None:
                return None
            client = client_of(reply_ref_from_json(ref_json)) if ref_json else None
            cards = [*step.context, *step.output]
            need = budgets.need(step_request(token.agent_id, profile, system, cards, step.step_no))
            owner = HoldOwner(token.agent_id, token.agent_turn_id, token.turn_epoch, step.step_id)
            return budgets.hold_request(token.agent_id, client, need, profile.llm_timeout_s, owner)

        self._holds[profile.name] = (profile, hold_for)
        return hold_for

    async def complete(
        self,
        llm: LLMPort,
        token: TurnToken,
        head: Head,
        profile: AgentProfile,
        step_id: str,
        retries_done: int,
        step: StepStart,
        client: str | None = None,
        *,
        reserve: bool = True,
    ) -> ModelOutcome:
        """One call of ``llm`` on the cards ``step`` read: :class:`Completed` (with the
        compaction to commit with the step, or None). :class:`RetryScheduled` when it
        failed with a retryable kind (see :mod:`agentserver.agents.profile.retry`): the
        step waits to be retried, recorded durably. :class:`ModelFailed` (or
        :class:`StepTimedOut` past ``llm-timeout``) when it failed for good, and
        :class:`BudgetRefused` when a budget had no room: the caller ends the Turn failed.

        With a streaming port, each text chunk is published as a :class:`ChunkEvent` as it
        arrives; otherwise the whole text is published as one chunk.

        Before the call, a context over budget is compacted (``agents/turn/compaction.py``); a
        provider's CONTEXT_OVERFLOW compacts once more, keeping only the task, and retries
        at once; a second overflow ends the Turn. The model is shown the compacted cards
        at once, but the box swap is committed only with the step's results.

        With spend budgets (and ``reserve``: the Turn machine's :class:`~.machine.CallModel`
        says so), every call (compaction's too) reserves its worst case in the budgets of
        the agent and ``client`` first (``agents/governance/budgets.py``); a budget without
        room is :class:`BudgetRefused` with its stable reason, before any call is made.
        The calls that returned are settled with the step's results (``Completed.spends``:
        the caller writes them in the step's transaction); when the step ends otherwise
        (a failure, a retry, a fence, a cancel), here, each in a transaction of its own.
        """
        spends: list[Spend] = []

        async def attempt() -> ModelOutcome:
            # The call and its outcome; the spends of the calls that returned go to
            # ``spends`` (BudgetedLLM's ``defer``).
            nonlocal llm, head
            if self.budgets is not None and reserve:
                # The holds belong to this run of the step: whichever process fences the run
                # out (a restart, a takeover) releases them (agents/store/sql/budgets.py).
                owner = HoldOwner(token.agent_id, token.agent_turn_id, token.turn_epoch, step_id)
                llm = self.budgets.port(
                    llm,
                    token.agent_id,
                    client,
                    token.agent_turn_id,
                    profile.llm_timeout_s,
                    owner,
                    defer=spends,
                    first=step.hold,
                )
            budget = profile.budget
            system = system_text(profile)
            system_tokens = estimate_message_tokens(system)
            overflowed = False
            pending: PendingSwap | None = None
            problem: str
            try:
                with trio.fail_after(profile.llm_timeout_s):
                    while True:
                        shown = pending.tokens if pending else head.context_tokens
                        if overflowed or budget.over(system_tokens, shown):
                            pending = (
                                await compact_turn(
                                    self.store, llm, token, profile, keep_nothing=overflowed
                                )
                                or pending
                            )
                            head = await self.hold.fence(token)
                            shown = pending.tokens if pending else head.context_tokens
                        try:
                            completion = await self._watched_call(
                                llm, token, profile, step_id, system, pending or step, step.step_no
                            )
                        except LLMUnavailable as exc:
                            if exc.kind.upper() == "CONTEXT_OVERFLOW" and not overflowed:
                                overflowed = True
                                continue
                            raise
                        # The provider's count corrects the running estimate (upwards only:
                        # the estimate is kept pessimistic).
                        over = completion.usage.prompt_tokens - (
                            PER_REQUEST + system_tokens + shown
                        )
                        if pending is not None:
                            return Completed(
                                completion, replace(pending.swap, correction=max(over, 0))
                            )
                        if over > 0:
                            await self.store.run1(turns.add_context_tokens, token, over)
                        return Completed(completion, None)
            except StaleTurn:
                raise
            except BudgetSpent as exc:
                return BudgetRefused(exc.reason)
            except LLMUnavailable as exc:
                if exc.kind.upper() == "CONTEXT_OVERFLOW":
                    problem = (
                        "the conversation does not fit the model's context window, even after "
                        f"compaction: {exc}"
                    )
                    return ModelFailed(problem)
                decision = decide_retry(
                    exc.kind, exc.retry_after, retries_done, profile.retry_policy
                )
                if isinstance(decision, RetryStep):
                    await self._wait_to_retry(token, step_id, decision, exc)
                    return RetryScheduled()
                problem = f"the model could not be reached: {exc}"
            except trio.TooSlowError:
                return StepTimedOut(f"the model did not answer within {profile.llm_timeout_s:g} s")
            except Exception as exc:  # a port bug must not leave the Turn hanging
                log.exception("LLM port failed")
                problem = f"the model call failed: {type(exc).__name__}"
            return ModelFailed(problem)

        try:
            outcome = await attempt()
        except BaseException:
            if spends and self.budgets is not None:
                await self.budgets.settle_spends(spends)  # (shielded)
            raise
        if isinstance(outcome, Completed):
            return Completed(outcome.completion, outcome.swap, tuple(spends))
        if spends and self.budgets is not None:
            await self.budgets.settle_spends(spends)
        return outcome

    async def _watched_call(
        self,
        llm: LLMPort,
        token: TurnToken,
        profile: AgentProfile,
        step_id: str,
        system: str,
        shown: PendingSwap | StepStart,
        step_no: int,
    ) -> LLMCompletion:
        """:meth:`_call`; while another process may share the store, the Turn's head is
        read every ``poll_s`` meanwhile and the call cancelled, raising StaleTurn, once
        the Turn has ended there (a stop taken by that process cancels only its own
        runs). One head read per poll per call in flight: bounded by the runners. A
        failed read is skipped (the call goes on, the next poll tries again). Nothing of
        the worker writes during the call, so any change of the head is someone else's."""
        if not self.store.others_alive:
            return await self._call(llm, token, profile, step_id, system, shown, step_no)
        fenced = False
        outcome: LLMCompletion | Exception | None = None

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal fenced
            while True:
                await trio.sleep(self.poll_s)
                try:
                    await self.hold.fence(token)
                except StaleTurn:
                    fenced = True
                    scope.cancel()
                    return
                except StoreError as exc:
                    log.info("turn %s: head not read during the call: %s", token, exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:
                outcome = await self._call(llm, token, profile, step_id, system, shown, step_no)
            except Exception as exc:
                # Raised outside the nursery, so that it is not wrapped in a group.
                outcome = exc
            nursery.cancel_scope.cancel()
        if fenced:
            raise StaleTurn(f"{token} ended during its model call")
        if isinstance(outcome, Exception):
            raise outcome
        assert outcome is not None
        return outcome

    async def _call(
        self,
        llm: LLMPort,
        token: TurnToken,
        profile: AgentProfile,
        step_id: str,
        system: str,
        shown: PendingSwap | StepStart,
        step_no: int,
    ) -> LLMCompletion:
        """One model call for the step (streamed when the port can) on the cards of
        ``shown``: a compaction's, or the Turn's as the step read them (nothing else
        writes a running Turn's cards meanwhile). Errors propagate."""
        cards = shown.cards if isinstance(shown, PendingSwap) else [*shown.context, *shown.output]
        request = step_request(token.agent_id, profile, system, cards, step_no)

        def chunk(text: str) -> None:
            self.events.publish(ChunkEvent(token.agent_id, token.agent_turn_id, step_id, text))

        stream = getattr(llm, "stream", None)
        if stream is None:
            completion = await llm.complete(request)
            chunk(completion.content)
            return completion
        final: LLMCompletion | None = None
        async with stream(request) as items:
            async for item in items:
                if isinstance(item, str):
                    chunk(item)
                else:
                    final = item
        if final is None:
            raise LLMUnavailable("the model's stream ended without a result", kind="stream")
        return final

    async def _wait_to_retry(
        self, token: TurnToken, step_id: str, retry: RetryStep, exc: LLMUnavailable
    ) -> None:
        """Record the retry wait durably and let go of the Turn: the dispatcher takes the
        ``resume`` row when it is due (after a restart too); a stop ends the Turn."""
        await self.store.run(
            turns.retry_step,
            token,
            step_id,
            attempt=retry.attempt,
            kind=exc.kind,
            delay_s=retry.delay_s,
            error=str(exc),
        )
        log.info(
            "turn %s of %s: step retry %d in %g s after %s",
            token.agent_turn_id,
            token.agent_id,
            retry.attempt,
            retry.delay_s,
            exc.kind,
        )
        self.events.publish(
            StepEvent(
                token.agent_id,
                token.agent_turn_id,
                step_id,
                "retrying",
                retry.attempt,
                exc.kind,
                retry.delay_s,
            )
        )
