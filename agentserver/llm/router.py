"""The router: picks a backend, limits, retries, fails over, streams, accounts.

One request goes through this loop until it succeeds, a STOP decision ends it,
its attempt budget is spent or its deadline passes::

    choose a backend  (strategy; only backends serving the model, not excluded
                       for this request, breaker permitting, not cooling down
                       after a Retry-After (capped by max_retry_after, then
                       one probe); if all are cooling, wait for the first to
                       return if that fits the deadline)
    admit             (concurrency slot, then requests + tokens buckets at once)
    call              (one HTTP attempt, bounded by the backend timeout and the
                       request deadline; counts against the attempt budget)
    on failure        (classify -> decision table: retry same backend after
                       Retry-After/backoff, fail over, or stop)

Retries and failovers draw from the same budget (``max_attempts`` HTTP calls)
and the same deadline, so they never multiply. Waiting (rate limits, backoff,
cooling) costs deadline, not attempts.

Cancellation: every wait is a trio checkpoint. A request cancelled while
waiting takes nothing from any bucket; one cancelled after its call was sent
keeps its token reservation (the provider may bill it) and gives the breaker
no verdict.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import httpx
import trio

from .accounting import AgentStats, BackendStats, Counters, RouterStats
from .backend_state import BackendRuntime, DeadlineReached, Lease, Route, in_trio, verdict
from .backends import LlamaCppBackend, ReplyStream, make_backend
from .breaker import BreakerState, Permit
from .bucket import ExceedsCapacity, QueueFull
from .classify import DECISIONS, Action, ErrorKind, backoff_delay
from .config import BackendConfig, LlmConfigError, RouterConfig, missing_key_reason
from .local_models import LocalModelError
from .selection import BackendSelector
from .stream import CompletionStream
from .tokens import estimate_prompt_tokens
from .types import Attempt, Completion, LLMError, Reply, Request

__all__ = ["CompletionStream", "Router"]


class Router:
    """Routes chat completions over the configured backends.

    Construct it with a :class:`RouterConfig` (see
    :func:`~agentserver.llm.config.parse_llm_section`) and use it as an async
    context manager, or call :meth:`aclose` when done. ``environ`` is where API
    keys are looked up (default ``os.environ``); a backend whose key variable is
    unset is skipped, with the reason in :attr:`skipped` and :meth:`stats`.
    ``client`` lets the caller supply the ``httpx.AsyncClient`` (e.g. with a
    mock transport); otherwise the router owns one. ``rng`` seeds the backoff
    jitter.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        environ: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        rng: random.Random | None = None,
        telemetry: Any = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.config = config
        #: Reports each call (a ``chat`` span, the GenAI metrics): an
        #: :class:`~agentserver.observability.LLMTelemetry`, or None.
        self.telemetry = telemetry
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100)
        )
        self._rng = rng or random.Random()
        self._runtimes: dict[str, BackendRuntime] = {}
        self.skipped: dict[str, str] = {}
        self._skipped_cfg: dict[str, BackendConfig] = {}
        ordered = sorted(enumerate(config.backends), key=lambda ib: (ib[1].priority, ib[0]))
        for rank, (_, bc) in enumerate(ordered):
            reason = missing_key_reason(bc, env)
            if reason:
                self.skipped[bc.name] = reason
                self._skipped_cfg[bc.name] = bc
                continue
            api_key = env.get(bc.api_key_env) if bc.api_key_env else None
            backend = make_backend(bc, self._client, api_key)
            self._runtimes[bc.name] = BackendRuntime(bc, backend, rank, config)
        # Exact names and aliases only, resolved once: the hot path is a dict lookup.
        self._routes: dict[str, tuple[Route, ...]] = {}
        for rt in self._runtimes.values():
            for name in (*rt.config.models, *rt.config.aliases):
                provider_model = rt.config.resolve(name)
                assert provider_model is not None
                self._routes[name] = (*self._routes.get(name, ()), Route(rt, provider_model))
        self._agents: dict[str, Counters] = {}
        self._selector = BackendSelector(config.strategy)

    # -- lifecycle -----------------------------------------------------------

    async def aclose(self) -> None:
        for rt in self._runtimes.values():
            if isinstance(rt.backend, LlamaCppBackend):
                await rt.backend.aclose()
        if self._owns_client:
            await self._client.aclose()

    async def start(self) -> None:
        """Load the local backends' models (in worker threads). A model that cannot load
        raises :class:`~agentserver.llm.config.LlmConfigError` naming the backend and the
        fix: the server does not start with a backend it cannot run."""
        for rt in self._runtimes.values():
            if isinstance(rt.backend, LlamaCppBackend):
                try:
                    await rt.backend.start()
                except LocalModelError as exc:
                    raise LlmConfigError(rt.config.line, f"backend {rt.name!r}: {exc}") from None

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- public API ----------------------------------------------------------

    async def complete(self, request: Request) -> Completion:
        """Run ``request`` to a :class:`Completion` or raise :class:`LLMError`."""
        started = trio.current_time()
        call = self.telemetry.start(request) if self.telemetry is not None else None
        try:
            result = await self.route(request, started, streaming=False)
        except BaseException as exc:
            if call is not None:
                call.failed(exc)
            raise
        assert isinstance(result, Completion)
        if call is not None:
            call.succeeded(result)
        return result

    def stream(self, request: Request) -> CompletionStream:
        """An async iterator of text chunks, ending with the :class:`Completion`.

        Use it as ``async with router.stream(req) as s: async for item in s``
        (or iterate to the end) so the connection is released if you stop
        early. Failover happens only before the first chunk is delivered; a
        failure after that raises :class:`LLMError` and no chunk is repeated.
        """
        return CompletionStream(self, request)

    def config_of(self, backend: str) -> BackendConfig:
        """The configuration of ``backend`` (running or skipped)."""
        rt = self._runtimes.get(backend)
        return rt.config if rt is not None else self._skipped_cfg[backend]

    def models(self) -> dict[str, list[str]]:
        """Each servable model name or alias -> the backends serving it, in priority order."""
        return {m: [r.runtime.name for r in routes] for m, routes in self._routes.items()}

    def stats(self) -> RouterStats:
        """A snapshot of the accounting, per backend and per agent."""
        now = trio.current_time() if in_trio() else None
        backends: dict[str, BackendStats] = {}
        for rt in sorted(self._runtimes.values(), key=lambda r: r.rank):
            backends[rt.name] = rt.stats(now)
        for name, reason in self.skipped.items():
            backends[name] = BackendStats(
                name=name,
                provider=self._skipped_cfg[name].provider.value,
                skipped=reason,
                counters=Counters(),
                breaker=BreakerState.CLOSED.value,
                consecutive_failures=0,
                breaker_opens=0,
                active=0,
                cooling_for=0.0,
                requests_bucket_fill=None,
                tokens_bucket_fill=None,
            )
        agents = {n: AgentStats(n, c.copy()) for n, c in self._agents.items()}
        return RouterStats(backends, agents)

    # -- the loop -------------------------------------------------------------

    def _agent(self, name: str) -> Counters:
        counters = self._agents.get(name)
        if counters is None:
            counters = self._agents[name] = Counters()
        return counters

    def _no_route(self, model: str) -> LLMError:
        skipped = [
            f"{name} ({reason})"
            for name, reason in self.skipped.items()
            if self._skipped_cfg[name].resolve(model) is not None
        ]
        if skipped:
            return LLMError(
                ErrorKind.AUTH, f"every backend serving {model!r} is skipped: " + "; ".join(skipped)
            )
        return LLMError(ErrorKind.MODEL_NOT_FOUND, f"no backend serves model {model!r}")

    async def route(
        self, request: Request, started: float, *, streaming: bool
    ) -> Completion | tuple[Lease, ReplyStream, str | Reply, float, int]:
        """Run the loop above for ``request``: its :class:`Completion`, or, ``streaming``,
        the open stream's lease, stream, first item, deadline and attempts (for
        :class:`~agentserver.llm.stream.CompletionStream`). Raises :class:`LLMError`."""
        agent = self._agent(request.agent)
        agent.requests += 1
        try:
            return await self._route_inner(request, started, streaming)
        except LLMError as err:
            agent.error(err.kind)
            raise

    async def _route_inner(
        self, request: Request, started: float, streaming: bool
    ) -> Completion | tuple[Lease, ReplyStream, str | Reply, float, int]:
        routes = self._routes.get(request.model)
        if not routes:
            raise self._no_route(request.model)
        deadline = started + self.config.timeout if request.deadline is None else request.deadline
        need = estimate_prompt_tokens(request.messages) + request.max_tokens

        excluded: set[BackendRuntime] = set()
        too_big = [r for r in routes if need > r.runtime.token_capacity()]
        if too_big:
            excluded.update(r.runtime for r in too_big)
            if len(too_big) == len(routes):
                largest = max(r.runtime.token_capacity() for r in routes)
                raise LLMError(
                    ErrorKind.CONTEXT_OVERFLOW,
                    f"request needs about {need} tokens (prompt estimate + max_tokens) but the "
                    f"largest tokens-per-minute bucket for {request.model!r} holds {largest:g}; "
                    "it could never be admitted",
                )

        retry = self.config.retry
        failures: list[Attempt] = []
        last: LLMError | None = None
        attempts = 0
        backoffs = 0
        window_floor: float = -1  # after CONTEXT_OVERFLOW: only strictly larger windows
        pinned: Route | None = None
        not_before = 0.0

        while True:
            if attempts >= retry.max_attempts and last is not None:
                raise last.with_attempts(tuple(failures))
            if trio.current_time() >= deadline:
                raise self._deadline_error(last, failures)

            route: Route | None = None
            permit: Permit | None = None
            if pinned is not None:
                if not_before > trio.current_time():
                    await trio.sleep_until(not_before)
                permit = pinned.runtime.try_permit(trio.current_time())
                if permit is not None:
                    route = pinned
                pinned = None
            if route is None:
                route, permit = await self._selector.choose(
                    routes, excluded, window_floor, deadline, last, failures
                )
            assert permit is not None
            rt = route.runtime

            lease = await self._admit(rt, permit, need, deadline, request.agent)
            attempts += 1
            rt.counters.requests += 1
            try:
                result = await self._attempt(request, route, lease, deadline, streaming)
            except LLMError as err:
                now = trio.current_time()
                decision = DECISIONS[err.kind]
                cut = isinstance(err, DeadlineReached)
                self.settle(lease, healthy=verdict(err), reply=None)
                rt.counters.error(err.kind)
                rt.down = err.kind is ErrorKind.UNREACHABLE
                failures.append(Attempt(rt.name, err.kind, err.status))
                last = err
                if cut or decision.action is Action.STOP:
                    raise err.with_attempts(tuple(failures)) from None
                if err.kind is ErrorKind.RATE_LIMIT and err.retry_after is not None:
                    # Capped like a retry's wait: a provider asking for an hour must not
                    # take the backend out for an hour; a single probe follows the cap.
                    rt.cooling.cool(now, min(err.retry_after, retry.max_retry_after))
                if decision.action is Action.FAILOVER:
                    excluded.add(rt)
                    if err.kind is ErrorKind.CONTEXT_OVERFLOW:
                        window = rt.config.context_window
                        window_floor = max(window_floor, math.inf if window is None else window)
                    continue
                # RETRY: same backend after the provider's wait or our backoff ...
                if err.retry_after is not None:
                    wait = err.retry_after
                    if wait > retry.max_retry_after:
                        excluded.add(rt)  # ... unless that is longer than we honour
                        continue
                else:
                    wait = backoff_delay(backoffs, retry.base_delay, retry.max_delay, self._rng)
                    backoffs += 1
                if now + wait >= deadline:
                    excluded.add(rt)  # ... or would not fit the deadline
                    continue
                if rt.breaker.state(now) is BreakerState.CLOSED:
                    pinned, not_before = route, now + wait
                # else the breaker just opened: choose again (other backend, or wait it out)
                continue
            except BaseException:
                self.settle(lease, healthy=None, reply=None)
                raise

            if streaming:
                bstream, first = result  # type: ignore[misc]
                return lease, bstream, first, deadline, attempts
            assert isinstance(result, Reply)
            return self.succeed(request, route.runtime, lease, result, started, attempts)

    async def _admit(
        self, rt: BackendRuntime, permit: Permit, need: int, deadline: float, agent: str | None
    ) -> Lease:
        """Concurrency slot first, then both buckets at once: the instant the
        buckets grant is the instant the call goes out, so the provider sees
        what the buckets allowed. Waiting on the buckets, agents take turns (``agent``
        is the caller's lane: one hot agent cannot take the whole bucket)."""
        lease = Lease(rt, permit)
        rt.active += 1
        amounts = rt.amounts(need) if rt.limiter is not None else None
        try:
            # Fast path, no scheduling round trip: a free slot (a Semaphore with
            # value > 0 has no waiters, so this is fair) and nobody queued on the
            # limiter. The HTTP call that follows is the checkpoint.
            if rt.slots is not None:
                try:
                    rt.slots.acquire_nowait()
                    lease.slot = True
                except trio.WouldBlock:
                    pass
            if (rt.slots is None or lease.slot) and (
                amounts is None or rt.limiter.try_acquire(amounts)  # type: ignore[union-attr]
            ):
                lease.reserved = need if amounts is not None and rt.tok_index is not None else 0
                return lease
            if (
                rt.slots is not None
                and not lease.slot
                and rt.slots.statistics().tasks_waiting >= self.config.queue_limit
            ):
                raise QueueFull(f"{self.config.queue_limit} callers already wait for a slot")
            with trio.move_on_at(deadline) as scope:
                if rt.slots is not None and not lease.slot:
                    await rt.slots.acquire()
                    lease.slot = True
                if amounts is not None:
                    await rt.limiter.acquire(amounts, agent)  # type: ignore[union-attr]
                    lease.reserved = need if rt.tok_index is not None else 0
            if scope.cancelled_caught:
                raise LLMError(
                    ErrorKind.RATE_LIMIT,
                    f"backend {rt.name!r}: its local limits did not admit the request "
                    "before the request's deadline",
                    backend=rt.name,
                )
        except QueueFull as exc:
            self.settle(lease, healthy=None, reply=None)
            raise LLMError(ErrorKind.RATE_LIMIT, f"queue full: {exc}", backend=rt.name) from None
        except ExceedsCapacity as exc:  # pragma: no cover - filtered out before choosing
            self.settle(lease, healthy=None, reply=None)
            raise LLMError(ErrorKind.CONTEXT_OVERFLOW, str(exc), backend=rt.name) from None
        except BaseException:
            self.settle(lease, healthy=None, reply=None)
            raise
        return lease

    async def _attempt(
        self, request: Request, route: Route, lease: Lease, deadline: float, streaming: bool
    ) -> Reply | tuple[ReplyStream, str | Reply]:
        rt = route.runtime
        timeout = rt.config.timeout
        now = trio.current_time()
        cut_by_deadline = deadline < now + timeout
        with trio.move_on_at(min(now + timeout, deadline)) as scope:
            if not streaming:
                return await rt.backend.complete(request, route.model, timeout)
            bstream = await rt.backend.open_stream(request, route.model, timeout)
            try:
                first = await bstream.next()
            except BaseException:
                with trio.CancelScope(shield=True):
                    await bstream.aclose()
                raise
            return bstream, first
        assert scope.cancelled_caught
        if cut_by_deadline:
            raise DeadlineReached(
                ErrorKind.TIMEOUT,
                "the request's deadline passed during the attempt",
                backend=rt.name,
            )
        raise LLMError(ErrorKind.TIMEOUT, f"no answer within {timeout:g}s", backend=rt.name)

    def settle(self, lease: Lease, *, healthy: bool | None, reply: Reply | None) -> None:
        """Release what ``lease`` holds. ``healthy`` None = no verdict (cancelled
        or never sent). With a reply, reconcile reserved tokens with the usage
        reported; after an answered failure, return them all."""
        if lease.settled:
            return
        lease.settled = True
        rt = lease.runtime
        rt.active -= 1
        now = trio.current_time()
        if healthy is None:
            rt.breaker.release(lease.permit)
        else:
            rt.breaker.record(lease.permit, healthy, now)
        if lease.permit.cooling_probe:
            # Any answer ends the cooling (a new 429 cools again, after this); a probe with
            # no verdict passes the turn to the next caller.
            if healthy is None:
                rt.cooling.release()
            else:
                rt.cooling.probe_done()
        if lease.reserved and rt.limiter is not None and rt.tok_index is not None:
            if reply is not None:
                back = lease.reserved - reply.usage.total_tokens
            elif healthy is not None:
                back = lease.reserved
            else:
                back = 0
            if back:
                amounts = [0.0] * len(rt.limiter.buckets)
                amounts[rt.tok_index] = float(back)
                rt.limiter.give_back(amounts)
        if lease.slot and rt.slots is not None:
            rt.slots.release()
        self._selector.wake()

    def succeed(
        self,
        request: Request,
        rt: BackendRuntime,
        lease: Lease,
        reply: Reply,
        started: float,
        attempts: int,
    ) -> Completion:
        self.settle(lease, healthy=True, reply=reply)
        rt.down = False
        price = rt.config.price
        cost = price.cost(reply.usage) if price is not None else None
        rt.counters.success(reply.usage, cost)
        self._agent(request.agent).success(reply.usage, cost)
        return Completion(
            content=reply.content,
            model=reply.model,
            backend=rt.name,
            usage=reply.usage,
            finish_reason=reply.finish_reason,
            latency=trio.current_time() - started,
            cost=cost,
            attempts=attempts,
        )

    def stream_failed(self, request: Request, lease: Lease, err: LLMError) -> None:
        """A streamed completion failed after its first chunk: settle its lease and count
        the error (the backend answered before failing, so it is not down)."""
        rt = lease.runtime
        self.settle(lease, healthy=verdict(err), reply=None)
        rt.counters.error(err.kind)
        rt.down = False
        self._agent(request.agent).error(err.kind)

    def _deadline_error(self, last: LLMError | None, failures: list[Attempt]) -> LLMError:
        if last is not None:
            return last.with_attempts(tuple(failures))
        return LLMError(ErrorKind.TIMEOUT, "the request's deadline passed before any attempt")
