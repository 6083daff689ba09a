"""Remote listeners: their handlers hand each delivery to a runner connection as a job.

A remote listener is an ordinary pump :class:`~agentserver.core.listener.Listener` whose
handler (:meth:`RunnerHub.handler_for`) sends the delivery over the wire to a runner (a
named client that declared ``serves="NAME"`` and announced core ``<serve>``), waits for
its reply frames and returns them as the handler's :class:`HandlerResponse` list. So the
pump validates, routes and refuses what a runner sends exactly as it does a local
handler's output (docs/wire.md, "Runners").

Each delivery is a *step*; each try at it an *attempt* with its own wire thread (a fresh
uuid4: a late reply of a superseded attempt names a thread that is no longer known, and
is ignored). Attempts follow :data:`agentserver.agents.store.states.STEP_TRANSITIONS`; retries
follow :func:`agentserver.steps.retry.should_retry` with :func:`~agentserver.steps.retry.backoff`.

Reply frames are handled synchronously by :meth:`RunnerHub.frame` (called from the
connection's read loop); nothing here reads a socket.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio
from lxml import etree

from agentserver.core.envelope import MESSAGE, build_envelope, encode, load_envelope_schema
from agentserver.core.errors import DeliveryRefused, HuhReason, InputRefused, SystemErrorCode
from agentserver.core.listener import Handler, HandlerMetadata, HandlerResponse, HandlerResult
from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser, canonicalize, copy_tree
from agentserver.net.limits import Limits
from agentserver.observability.tracing import current_traceparent
from agentserver.primitives.core import huh
from agentserver.steps.log import MemoryStepLog, StepLog, StepRow
from agentserver.steps.retry import StepPolicy, backoff, should_retry
from agentserver.steps.states import STEP_TRANSITIONS, StepEvent, StepStatus, step_transition

log = logging.getLogger("agentserver.runners")

_C = f"{{{CORE_NS}}}"
SERVE = _C + "serve"
STARTED = _C + "started"
DONE = _C + "done"
FAILED = _C + "failed"
CANCEL = _C + "cancel"
#: A runner may not ask for more jobs at once than this (one ``<serve>``).
MAX_RUNNER_CONCURRENCY = 1024
#: Outputs one job may forward before it ends (a runner cannot grow a job without bound).
MAX_JOB_OUTPUTS = 64


#: STEP_TRANSITIONS as (state, event) -> next state: one lookup per move on the job path.
_NEXT = {key: StepStatus(t.target) for key, t in STEP_TRANSITIONS.items()}


@dataclass(slots=True)
class Job:
    """One attempt, as given to one runner link."""

    id: str
    listener: str
    link: RunnerLink
    state: StepStatus = StepStatus.DISPATCHED
    outputs: list[HandlerResponse] = field(default_factory=list)
    #: Set once the attempt has an outcome (answered, ended, or its runner is gone).
    done: trio.Event = field(default_factory=trio.Event)
    lost: bool = False
    #: The runner reported ``<failed/>`` (its handler raised).
    failed: bool = False

    def move(self, event: StepEvent) -> None:
        try:
            self.state = _NEXT[self.state, event]
        except KeyError:
            step_transition(self.state, event)  # raises IllegalTransition
            raise


class _Stopped(Exception):
    """A step was stopped from outside (:meth:`RunnerHub.cancel_caller`)."""


@dataclass(slots=True)
class _StepEntry:
    """A step in progress: whose it is, and the scope of what it waits for now."""

    caller: str
    scope: trio.CancelScope | None = None
    stopped: bool = False

    def open_scope(self, deadline: float = math.inf) -> trio.CancelScope:
        self.scope = trio.CancelScope(deadline=deadline)
        return self.scope


class RunnerLink:
    """One runner connection: what it serves and the jobs it holds. ``push`` queues a
    frame body for it without blocking (False: the connection is gone or full)."""

    def __init__(self, client: str, name: str, push: Callable[[bytes], bool]) -> None:
        self.client = client
        self.name = name
        self.push = push
        #: listener -> jobs at once, from its ``<serve>`` frames.
        self.capacity: dict[str, int] = {}
        self.jobs: dict[str, Job] = {}
        self.busy: collections.Counter[str] = collections.Counter()
        self.closed = False

    def free(self, listener: str) -> int:
        return self.capacity.get(listener, 0) - self.busy[listener]


class RunnerHub:
    """The remote listeners of one server and the runner connections that serve them."""

    def __init__(
        self,
        policies: dict[str, StepPolicy],
        serves: dict[str, frozenset[str]],
        *,
        max_message_bytes: int,
        on_step: Callable[[StepRow], None] | None = None,
    ) -> None:
        self.policies = policies
        #: client name -> the remote listeners it may serve.
        self.serves = serves
        self.on_step = on_step
        self._parser = SafeParser(max_message_bytes)
        self._env_schema = load_envelope_schema()
        self._links: dict[str, list[RunnerLink]] = {name: [] for name in policies}
        self._turn: collections.Counter[str] = collections.Counter()
        #: Woken (and replaced) whenever a listener may have gained a free runner slot.
        self._changed: dict[str, trio.Event] = {name: trio.Event() for name in policies}
        self._jobs: dict[str, Job] = {}
        #: Steps in progress, for stop from outside.
        self._steps: dict[str, _StepEntry] = {}
        #: Where step events are recorded: in memory until :meth:`log_steps_to` gives the
        #: hub the agent store's log (app/root.py), durable from then on
        #: (agents/store/step_log.py). Read it; do not assign it.
        self.step_log: StepLog = MemoryStepLog()
        self.counters = collections.Counter[str]()

    def log_steps_to(self, step_log: StepLog) -> None:
        """Record step events in ``step_log`` from now on (the agents' store exists only
        once the agents run, after the hub was made). Rows already in the memory log
        stay there."""
        self.step_log = step_log

    # -- connections -------------------------------------------------------------------

    def is_runner(self, client: str | None) -> bool:
        return client is not None and bool(self.serves.get(client))

    def attach(self, client: str, name: str, push: Callable[[bytes], bool]) -> RunnerLink:
        """A runner client connected (its hello is done); it serves nothing until it sends
        ``<serve>``."""
        return RunnerLink(client, name, push)

    def detach(self, link: RunnerLink) -> None:
        """The connection ended: its jobs are lost (their steps decide what follows)."""
        if link.closed:
            return
        link.closed = True
        for listener in link.capacity:
            links = self._links.get(listener)
            if links is not None and link in links:
                links.remove(link)
        for job in list(link.jobs.values()):
            job.lost = True
            job.done.set()
        link.jobs.clear()
        self.counters["disconnects"] += 1

    def runners(self, listener: str) -> int:
        """Runner connections serving ``listener`` now."""
        return len(self._links.get(listener, ()))

    async def wait_runners(self, listener: str, n: int = 1) -> None:
        """Wait (cancellably) until ``n`` runner connections serve ``listener``."""
        while self.runners(listener) < n:
            await self._changed[listener].wait()

    # -- frames from runners -----------------------------------------------------------

    def frame(self, link: RunnerLink, data: bytes) -> None:
        """Take one frame from a runner connection. Never blocks, never raises for bad
        input: a bad frame gets a ``<huh>`` (as any client's would), a reply to a job this
        connection does not hold is ignored."""
        try:
            root = self._parser.parse(data)
            if root.tag != MESSAGE or not self._env_schema.validate(root):
                raise InputRefused(HuhReason.INVALID_ENVELOPE)
        except InputRefused as refusal:
            self.counters["refused"] += 1
            link.push(encode("system", link.name, new_thread_id(), huh(refusal.reason, data)))
            return
        meta, payload = root[0], root[1]
        # Text the envelope schema requires (env:Name: one character at least).
        to = (meta[1].text or "").strip() if len(meta) == 3 else None
        thread = (meta[-1].text or "").strip()
        tag = payload.tag
        if tag == SERVE:
            self._serve(link, payload, thread, data)
            return
        job = link.jobs.get(thread)
        if job is None:
            # Another connection's job, a superseded attempt's, or no job at all.
            self.counters["ignored"] += 1
            log.info("runner %s: frame on %s, not a job it holds: ignored", link.name, thread)
            return
        if job.state is StepStatus.DISPATCHED:
            job.move(StepEvent.START)
        if tag == STARTED:
            return
        if tag == DONE:
            self._finish(job)
            return
        if tag == FAILED:
            job.failed = True
            job.done.set()
            return
        if isinstance(tag, str) and tag.startswith(_C):
            self.counters["ignored"] += 1
            log.info("runner %s: core payload %s on a job: ignored", link.name, tag)
            return
        root.remove(payload)
        if to is None:
            job.outputs.append(HandlerResponse.respond(payload))
            self._finish(job)
        elif len(job.outputs) >= MAX_JOB_OUTPUTS:
            self.counters["refused"] += 1
            log.warning("runner %s: job %s forwards too much: ended", link.name, job.id)
            self._finish(job)
        else:
            job.outputs.append(HandlerResponse(payload, to=to))

    def _serve(self, link: RunnerLink, el: etree._Element, thread: str, data: bytes) -> None:
        listener = el.get("listener", "")
        try:
            concurrency = int(el.get("concurrency", "1"))
        except ValueError:
            concurrency = 0
        allowed = self.serves.get(link.client, frozenset())
        if listener not in allowed or not 1 <= concurrency <= MAX_RUNNER_CONCURRENCY:
            self.counters["refused"] += 1
            log.warning("runner %s: refused <serve listener=%r>", link.name, listener)
            link.push(encode("system", link.name, thread, huh(HuhReason.INVALID_PAYLOAD, data)))
            return
        if listener not in link.capacity:
            self._links[listener].append(link)
        link.capacity[listener] = concurrency
        log.info("runner %s serves %s (concurrency %d)", link.name, listener, concurrency)
        self._notify(listener)

    def _finish(self, job: Job) -> None:
        job.move(StepEvent.SUCCEED)
        job.done.set()
        self._release(job)

    def _release(self, job: Job) -> None:
        link = job.link
        if link.jobs.pop(job.id, None) is not None:
            link.busy[job.listener] -= 1
        self._jobs.pop(job.id, None)
        self._notify(job.listener)

    def _notify(self, listener: str) -> None:
        event = self._changed[listener]
        self._changed[listener] = trio.Event()
        event.set()

    # -- the listener side -------------------------------------------------------------

    def _pick(self, listener: str) -> RunnerLink | None:
        """The next runner with a free slot, round robin (so jobs spread)."""
        links = self._links[listener]
        n = len(links)
        start = self._turn[listener]
        for i in range(n):
            link = links[(start + i) % n]
            if link.free(listener) > 0 and not link.closed:
                self._turn[listener] = (start + i + 1) % n
                return link
        return None

    async def _acquire(self, listener: str) -> RunnerLink:
        """Wait (cancellably) for a runner with a free slot."""
        while True:
            link = self._pick(listener)
            if link is not None:
                return link
            await self._changed[listener].wait()

    def handler_for(self, name: str) -> Handler:
        """The pump handler of remote listener ``name`` (it takes raw elements)."""
        policy = self.policies[name]

        async def remote_handler(payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
            return await self.run_step(name, policy, payload, meta)

        remote_handler.__qualname__ = f"remote:{name}"
        return remote_handler

    async def run_step(
        self,
        name: str,
        policy: StepPolicy,
        payload: etree._Element,
        meta: HandlerMetadata,
    ) -> HandlerResult:
        """Attempt until an answer, a final failure, or cancellation. Raises a
        :class:`~agentserver.core.errors.Refusal` for the caller on failure."""
        step = new_thread_id()
        entry = self._steps[step] = _StepEntry(meta.from_id)
        try:
            return await self._run_step(step, name, policy, payload, meta, entry)
        except _Stopped:
            self._log(StepRow(step, name, meta.from_id, 0, "step.cancelled", "stopped"))
            # Reaches the caller's thread only if it still exists (a stopped Turn's tool
            # call is over: the report is skipped as stale).
            raise DeliveryRefused(
                SystemErrorCode.TIMEOUT, retry_allowed=False, detail="cancelled"
            ) from None
        finally:
            del self._steps[step]

    def cancel_caller(self, caller: str) -> int:
        """Cancel every step ``caller`` (e.g. a stopped agent) has in progress: their
        runners get ``<cancel>``, late results are ignored. Returns how many."""
        entries = [entry for entry in self._steps.values() if entry.caller == caller]
        for entry in entries:
            entry.stopped = True
            if entry.scope is not None:
                entry.scope.cancel()
        return len(entries)

    async def _run_step(
        self,
        step: str,
        name: str,
        policy: StepPolicy,
        payload: etree._Element,
        meta: HandlerMetadata,
        entry: _StepEntry,
    ) -> HandlerResult:
        retries = 0
        while True:
            outcome, started, outputs = await self._attempt(
                name, policy, payload, meta, step, entry
            )
            attempt = retries + 1
            if outcome is StepStatus.SUCCEEDED:
                self._log(StepRow(step, name, meta.from_id, attempt, "step.succeeded"))
                return outputs
            detail = "runner lost or failed" if outcome is StepStatus.FAILED else "step-timeout"
            if not should_retry(policy, outcome, started=started, retries_done=retries):
                self._log(StepRow(step, name, meta.from_id, attempt, f"step.{outcome}", detail))
                if outcome is StepStatus.TIMED_OUT:
                    raise DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True)
                raise InputRefused(HuhReason.HANDLER_FAILED, f"{name}: {detail}")
            retries += 1
            self.counters["retried"] += 1
            self._log(StepRow(step, name, meta.from_id, attempt + 1, "step.retried", detail))
            if outcome is StepStatus.TIMED_OUT or started:
                with entry.open_scope():
                    await trio.sleep(backoff(retries))
                if entry.stopped:
                    raise _Stopped

    async def _attempt(
        self,
        name: str,
        policy: StepPolicy,
        payload: etree._Element,
        meta: HandlerMetadata,
        step: str,
        entry: _StepEntry,
    ) -> tuple[StepStatus, bool, list[HandlerResponse]]:
        if entry.stopped:
            raise _Stopped
        job: Job | None = None
        state = StepStatus.PENDING
        # The pump's span of this delivery (the tool's ``handle`` span): the runner
        # continues the trace from it.
        traceparent = current_traceparent()
        # One scope per attempt, for both its step-timeout and a stop from outside (a
        # second scope per step cost as much as the rest of the hub's work on a job).
        scope = entry.open_scope(trio.current_time() + policy.step_timeout)
        try:
            with scope:
                link = await self._acquire(name)
                job = Job(new_thread_id(), name, link)
                link.jobs[job.id] = job
                link.busy[name] += 1
                self._jobs[job.id] = job
                # Not copy.deepcopy: its generic dispatch costs as much again.
                copied = copy_tree(payload, None)
                envelope = build_envelope(meta.from_id, name, job.id, copied)
                if traceparent is not None:
                    envelope.set("traceparent", traceparent)
                # The same on every attempt: the runner's handler dedupes on it.
                envelope.set("idempotency-key", meta.idempotency_key or meta.thread_id)
                body = canonicalize(envelope)
                self._log(StepRow(step, name, meta.from_id, 0, "step.dispatched", link.name))
                if not link.push(body):
                    job.lost = True
                    job.done.set()
                await job.done.wait()
            if entry.stopped and scope.cancelled_caught:
                raise _Stopped  # the job, if any, is cancelled below
            if job is None:
                state = StepStatus(step_transition(state, StepEvent.TIME_OUT).target)
                return state, False, []
            if job.lost or job.failed:
                started = job.state is StepStatus.RUNNING
                job.move(StepEvent.FAIL)
                self._release(job)
                return job.state, started, []
            if job.state is StepStatus.SUCCEEDED:
                return job.state, True, job.outputs
            started = job.state is StepStatus.RUNNING
            job.move(StepEvent.TIME_OUT)
            self._cancel_remote(job)
            return job.state, started, []
        except BaseException:
            # Stopped, or cancelled from outside (shutdown, the pump's backstop timeout).
            if job is not None and job.state not in (StepStatus.SUCCEEDED, StepStatus.FAILED):
                if job.state is not StepStatus.TIMED_OUT:
                    job.move(StepEvent.CANCEL)
                self._cancel_remote(job)
            raise

    def _cancel_remote(self, job: Job) -> None:
        """Tell the runner to abandon the job (best effort); forget it either way, so any
        later frame on its thread is ignored."""
        if job.id in job.link.jobs and not job.link.closed:
            job.link.push(encode("system", job.link.name, job.id, etree.Element(CANCEL)))
            self.counters["cancelled"] += 1
        self._release(job)

    def _log(self, row: StepRow) -> None:
        row.at = time.time()
        try:
            self.step_log.append(row)
        except Exception:
            # The log is a record, not a decision: losing a row must not fail the step.
            log.exception("step log: could not record %s of step %s", row.event, row.step)
        if row.event == "step.retried":
            log.warning(
                "step.retried step=%s listener=%s caller=%s attempt=%d reason=%s",
                row.step,
                row.listener,
                row.caller,
                row.attempt,
                row.detail,
            )
        if self.on_step is not None:
            self.on_step(row)


def pump_timeout(policy: StepPolicy) -> float:
    """The pump's backstop timeout for a remote listener: above any step's whole budget."""
    budget = policy.budget()
    return budget + 1.0 if math.isfinite(budget) else budget


class RemoteSpec(Protocol):
    """What :func:`hub_for` reads of a declared listener (config's ListenerSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def remote(self) -> bool: ...
    @property
    def timeout(self) -> float: ...
    @property
    def step_timeout(self) -> float | None: ...
    @property
    def idempotent(self) -> bool: ...
    @property
    def retries(self) -> int: ...


class RunnerClientSpec(Protocol):
    """What :func:`hub_for` reads of a declared client (config's ClientSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def serves(self) -> tuple[str, ...]: ...


class HubTopology(Protocol):
    """What :func:`hub_for` reads of a topology (config's Topology, a layer above)."""

    @property
    def listeners(self) -> Sequence[RemoteSpec]: ...
    @property
    def clients(self) -> Sequence[RunnerClientSpec]: ...
    @property
    def limits(self) -> Limits: ...


def hub_for(topology: HubTopology) -> RunnerHub | None:
    """The hub of a topology's remote listeners (None: it has none)."""
    policies = {
        spec.name: StepPolicy(
            spec.step_timeout if spec.step_timeout is not None else spec.timeout,
            spec.idempotent,
            spec.retries,
        )
        for spec in topology.listeners
        if spec.remote
    }
    if not policies:
        return None
    serves = {c.name: frozenset(c.serves) for c in topology.clients if c.serves}
    return RunnerHub(policies, serves, max_message_bytes=topology.limits.max_message_bytes)
