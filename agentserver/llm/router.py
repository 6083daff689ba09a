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
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx
import trio

from .accounting import AgentStats, BackendStats, Counters, RouterStats
from .backends import Backend, BackendStream, make_backend
from .breaker import Breaker, BreakerState, Cooling, Permit
from .bucket import ExceedsCapacity, Limiter, QueueFull, TokenBucket
from .classify import DECISIONS, Action, ErrorKind, backoff_delay
from .config import BackendConfig, RouterConfig, Strategy, missing_key_reason
from .tokens import estimate_prompt_tokens
from .types import Attempt, Completion, LLMError, Reply, Request

__all__ = ["CompletionStream", "Router"]


class _Runtime:
    """Mutable state of one backend inside one router."""

    __slots__ = (
        "active",
        "backend",
        "breaker",
        "config",
        "cooling",
        "counters",
        "down",
        "limiter",
        "name",
        "rank",
        "req_index",
        "slots",
        "tok_index",
    )

    def __init__(
        self, config: BackendConfig, backend: Backend, rank: int, router_cfg: RouterConfig
    ):
        self.config = config
        self.name = config.name
        self.backend = backend
        self.rank = rank
        self.breaker = Breaker(router_cfg.breaker.failures, router_cfg.breaker.cooldown)
        self.cooling = Cooling()
        self.counters = Counters()
        self.active = 0
        #: Its last attempt could not connect (UNREACHABLE): while its breaker is open,
        #: a request fails at once instead of waiting for the probe (see Router._choose).
        self.down = False
        now = trio.current_time() if _in_trio() else 0.0
        buckets: list[TokenBucket] = []
        self.req_index: int | None = None
        self.tok_index: int | None = None
        if config.requests_per_minute:
            self.req_index = len(buckets)
            buckets.append(TokenBucket.per_minute(config.requests_per_minute, now))
        if config.tokens_per_minute:
            self.tok_index = len(buckets)
            buckets.append(TokenBucket.per_minute(config.tokens_per_minute, now))
        self.limiter = Limiter(buckets, max_waiters=router_cfg.queue_limit) if buckets else None
        self.slots = trio.Semaphore(config.max_concurrent) if config.max_concurrent else None

    def amounts(self, tokens: int) -> list[float]:
        out = [0.0] * len(self.limiter.buckets) if self.limiter else []
        if self.req_index is not None:
            out[self.req_index] = 1.0
        if self.tok_index is not None:
            out[self.tok_index] = float(tokens)
        return out

    def try_permit(self, now: float) -> Permit | None:
        """A breaker permit, unless a Retry-After still cools this backend down. The
        first call after the cooling ends is its probe (``cooling_probe``)."""
        if not self.cooling.ready(now):
            return None
        permit = self.breaker.try_acquire(now)
        if permit is None:
            return None
        if self.cooling.try_acquire(now):
            return Permit(permit.probe, permit.generation, cooling_probe=True)
        return permit

    def token_capacity(self) -> float:
        if self.limiter is None or self.tok_index is None:
            return math.inf
        return self.limiter.buckets[self.tok_index].capacity


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class _Route:
    runtime: _Runtime
    model: str  # the provider's name for the requested model or alias


class _Lease:
    """What one attempt holds; settled exactly once by :meth:`Router._settle`."""

    __slots__ = ("permit", "reserved", "runtime", "settled", "slot")

    def __init__(self, runtime: _Runtime, permit: Permit) -> None:
        self.runtime = runtime
        self.permit = permit
        self.reserved = 0
        self.slot = False
        self.settled = False


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
        self._runtimes: dict[str, _Runtime] = {}
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
            self._runtimes[bc.name] = _Runtime(bc, backend, rank, config)
        # Exact names and aliases only, resolved once: the hot path is a dict lookup.
        self._routes: dict[str, tuple[_Route, ...]] = {}
        for rt in self._runtimes.values():
            for name in (*rt.config.models, *rt.config.aliases):
                provider_model = rt.config.resolve(name)
                assert provider_model is not None
                self._routes[name] = (*self._routes.get(name, ()), _Route(rt, provider_model))
        self._agents: dict[str, Counters] = {}
        self._rr = 0
        self._changed = trio.Event()
        self._cooling_waiters = 0  # tasks in _choose waiting on _changed

    # -- lifecycle -----------------------------------------------------------

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
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
            result = await self._route(request, started, streaming=False)
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

    def models(self) -> dict[str, list[str]]:
        """Each servable model name or alias -> the backends serving it, in priority order."""
        return {m: [r.runtime.name for r in routes] for m, routes in self._routes.items()}

    def stats(self) -> RouterStats:
        """A snapshot of the accounting, per backend and per agent."""
        now = trio.current_time() if _in_trio() else None
        backends: dict[str, BackendStats] = {}
        for rt in sorted(self._runtimes.values(), key=lambda r: r.rank):
            fill: tuple[float, ...] = ()
            if rt.limiter is not None and now is not None:
                fill = rt.limiter.fill(now)
            backends[rt.name] = BackendStats(
                name=rt.name,
                provider=rt.config.provider.value,
                skipped=None,
                counters=rt.counters.copy(),
                breaker=rt.breaker.state(now if now is not None else math.inf).value,
                consecutive_failures=rt.breaker.consecutive_failures,
                breaker_opens=rt.breaker.opens,
                active=rt.active,
                cooling_for=rt.cooling.remaining(now) if now is not None else 0.0,
                requests_bucket_fill=fill[rt.req_index]
                if fill and rt.req_index is not None
                else None,
                tokens_bucket_fill=fill[rt.tok_index]
                if fill and rt.tok_index is not None
                else None,
            )
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

    async def _route(
        self, request: Request, started: float, *, streaming: bool
    ) -> Completion | tuple[_Lease, BackendStream, str | Reply, float, int]:
        agent = self._agent(request.agent)
        agent.requests += 1
        try:
            return await self._route_inner(request, started, streaming)
        except LLMError as err:
            agent.error(err.kind)
            raise

    async def _route_inner(
        self, request: Request, started: float, streaming: bool
    ) -> Completion | tuple[_Lease, BackendStream, str | Reply, float, int]:
        routes = self._routes.get(request.model)
        if not routes:
            raise self._no_route(request.model)
        deadline = started + self.config.timeout if request.deadline is None else request.deadline
        need = estimate_prompt_tokens(request.messages) + request.max_tokens

        excluded: set[_Runtime] = set()
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
        window_floor = -1  # after CONTEXT_OVERFLOW: only strictly larger windows
        pinned: _Route | None = None
        not_before = 0.0

        while True:
            if attempts >= retry.max_attempts and last is not None:
                raise last.with_attempts(tuple(failures))
            if trio.current_time() >= deadline:
                raise self._deadline_error(last, failures)

            route: _Route | None = None
            permit: Permit | None = None
            if pinned is not None:
                if not_before > trio.current_time():
                    await trio.sleep_until(not_before)
                permit = pinned.runtime.try_permit(trio.current_time())
                if permit is not None:
                    route = pinned
                pinned = None
            if route is None:
                route, permit = await self._choose(
                    routes, excluded, window_floor, deadline, last, failures
                )
            assert permit is not None
            rt = route.runtime

            lease = await self._admit(rt, permit, need, deadline)
            attempts += 1
            rt.counters.requests += 1
            try:
                result = await self._attempt(request, route, lease, deadline, streaming)
            except LLMError as err:
                now = trio.current_time()
                decision = DECISIONS[err.kind]
                cut = isinstance(err, _DeadlineReached)
                self._settle(lease, healthy=_verdict(err), reply=None)
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
                self._settle(lease, healthy=None, reply=None)
                raise

            if streaming:
                bstream, first = result  # type: ignore[misc]
                return lease, bstream, first, deadline, attempts
            assert isinstance(result, Reply)
            return self._succeed(request, route.runtime, lease, result, started, attempts)

    async def _choose(
        self,
        routes: tuple[_Route, ...],
        excluded: set[_Runtime],
        window_floor: float,
        deadline: float,
        last: LLMError | None,
        failures: list[Attempt],
    ) -> tuple[_Route, Permit]:
        """The next backend by strategy, waiting if all are cooling down."""
        while True:
            candidates = [
                r
                for r in routes
                if r.runtime not in excluded
                and (window_floor < 0 or (r.runtime.config.context_window or -1) > window_floor)
            ]
            if not candidates:
                if last is not None:
                    raise last.with_attempts(tuple(failures))
                raise LLMError(ErrorKind.UNKNOWN, "no usable backend")  # pragma: no cover
            now = trio.current_time()
            for r in self._order(candidates):
                permit = r.runtime.try_permit(now)
                if permit is not None:
                    return r, permit
            # Every candidate is cooling down: find the first to come back, and
            # whether a Retry-After (RATE_LIMIT) or a breaker (OVERLOADED) holds it.
            earliest = math.inf
            kind: ErrorKind | None = None
            probing = False  # a probe is out: its outcome, not the clock, decides
            for r in candidates:
                rt = r.runtime
                back = rt.breaker.available_at(now)
                cool = rt.cooling.available_at(now)
                probing = probing or back is None or cool is None
                breaker_at = math.inf if back is None else back
                cooling_at = math.inf if cool is None else cool
                at = max(cooling_at, breaker_at)
                if kind is None or at < earliest:
                    earliest = at
                    limited = cooling_at >= breaker_at
                    kind = ErrorKind.RATE_LIMIT if limited else ErrorKind.OVERLOADED
            assert kind is not None  # candidates is not empty
            if all(r.runtime.down for r in candidates):
                # Every backend refused the connection last time: waiting for a breaker's
                # probe would only delay the failure (a backend that is down is not busy).
                names = ", ".join(r.runtime.name for r in candidates)
                raise LLMError(
                    ErrorKind.UNREACHABLE,
                    f"every backend for this model is unreachable ({names}); "
                    "it is tried again when its breaker lets a probe through",
                    retry_after=earliest - now if math.isfinite(earliest) else None,
                    attempts=tuple(failures),
                )
            if earliest > deadline and (not probing or now >= deadline):
                wait = earliest - now if math.isfinite(earliest) else None
                names = ", ".join(r.runtime.name for r in candidates)
                needed = (
                    f"the first returns in {wait:.3g}s"
                    if wait is not None
                    else "a probe is still out"
                )
                raise LLMError(
                    kind,
                    f"every backend for this model is cooling down ({names}); {needed}, "
                    "after the request's deadline",
                    retry_after=wait,
                    attempts=tuple(failures),
                )
            changed = self._changed
            self._cooling_waiters += 1
            try:
                with trio.move_on_at(min(earliest, deadline)):
                    await changed.wait()
            finally:
                self._cooling_waiters -= 1

    def _order(self, candidates: list[_Route]) -> list[_Route]:
        strategy = self.config.strategy
        if strategy is Strategy.FAILOVER or len(candidates) < 2:
            return candidates
        if strategy is Strategy.ROUND_ROBIN:
            start = self._rr % len(candidates)
            self._rr += 1
            return candidates[start:] + candidates[:start]
        return sorted(candidates, key=lambda r: (r.runtime.active, r.runtime.rank))

    async def _admit(self, rt: _Runtime, permit: Permit, need: int, deadline: float) -> _Lease:
        """Concurrency slot first, then both buckets at once: the instant the
        buckets grant is the instant the call goes out, so the provider sees
        what the buckets allowed."""
        lease = _Lease(rt, permit)
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
                    await rt.limiter.acquire(amounts)  # type: ignore[union-attr]
                    lease.reserved = need if rt.tok_index is not None else 0
            if scope.cancelled_caught:
                raise LLMError(
                    ErrorKind.RATE_LIMIT,
                    f"backend {rt.name!r}: its local limits did not admit the request "
                    "before the request's deadline",
                    backend=rt.name,
                )
        except QueueFull as exc:
            self._settle(lease, healthy=None, reply=None)
            raise LLMError(ErrorKind.RATE_LIMIT, f"queue full: {exc}", backend=rt.name) from None
        except ExceedsCapacity as exc:  # pragma: no cover - filtered out before choosing
            self._settle(lease, healthy=None, reply=None)
            raise LLMError(ErrorKind.CONTEXT_OVERFLOW, str(exc), backend=rt.name) from None
        except BaseException:
            self._settle(lease, healthy=None, reply=None)
            raise
        return lease

    async def _attempt(
        self, request: Request, route: _Route, lease: _Lease, deadline: float, streaming: bool
    ) -> Reply | tuple[BackendStream, str | Reply]:
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
            raise _DeadlineReached(
                ErrorKind.TIMEOUT,
                "the request's deadline passed during the attempt",
                backend=rt.name,
            )
        raise LLMError(ErrorKind.TIMEOUT, f"no answer within {timeout:g}s", backend=rt.name)

    def _settle(self, lease: _Lease, *, healthy: bool | None, reply: Reply | None) -> None:
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
        if self._cooling_waiters:
            # Wake requests waiting for a cooling backend: a probe may have resolved.
            changed, self._changed = self._changed, trio.Event()
            changed.set()

    def _succeed(
        self,
        request: Request,
        rt: _Runtime,
        lease: _Lease,
        reply: Reply,
        started: float,
        attempts: int,
    ) -> Completion:
        self._settle(lease, healthy=True, reply=reply)
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

    def _deadline_error(self, last: LLMError | None, failures: list[Attempt]) -> LLMError:
        if last is not None:
            return last.with_attempts(tuple(failures))
        return LLMError(ErrorKind.TIMEOUT, "the request's deadline passed before any attempt")


class _DeadlineReached(LLMError):
    """An attempt cut short by the request's own deadline: it ends the request
    (no time left to fail over) and is no verdict on the backend."""


def _verdict(err: LLMError) -> bool | None:
    """What a failed attempt tells the breaker: healthy, unhealthy, or nothing (the
    request's own deadline cut it short, before or after the first chunk alike)."""
    if isinstance(err, _DeadlineReached):
        return None
    return not DECISIONS[err.kind].breaker


class CompletionStream:
    """Text chunks of one streamed completion, then the :class:`Completion`.

    Not restartable. Each ``__anext__`` is cancellable; cancelling one, or
    :meth:`aclose`, abandons the stream (no verdict on the backend, the token
    reservation is kept). An error after the first chunk is raised as
    :class:`LLMError`; nothing is retried from there, so no chunk repeats.
    """

    def __init__(self, router: Router, request: Request) -> None:
        self._router = router
        self._request = request
        self._state = "new"
        self._lease: _Lease | None = None
        self._stream: BackendStream | None = None
        self._started = 0.0
        self._deadline = math.inf
        self._attempts = 0
        self._call: Any = None

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def __anext__(self) -> str | Completion:
        if self._state == "done":
            raise StopAsyncIteration
        router = self._router
        if self._state == "new":
            self._state = "opening"
            self._started = trio.current_time()
            if router.telemetry is not None:
                self._call = router.telemetry.start(self._request)
            try:
                result = await router._route(self._request, self._started, streaming=True)
            except BaseException as exc:
                self._state = "done"
                self._report(exc)
                raise
            assert isinstance(result, tuple)
            self._lease, self._stream, item, self._deadline, self._attempts = result
            self._state = "streaming"
        else:
            assert self._stream is not None and self._lease is not None
            try:
                with trio.move_on_at(self._deadline) as scope:
                    item = await self._stream.next()
                if scope.cancelled_caught:
                    raise _DeadlineReached(
                        ErrorKind.TIMEOUT,
                        "the request's deadline passed mid-stream",
                        backend=self._lease.runtime.name,
                    )
            except LLMError as err:
                rt = self._lease.runtime
                router._settle(self._lease, healthy=_verdict(err), reply=None)
                rt.counters.error(err.kind)
                rt.down = False  # it answered before failing
                router._agent(self._request.agent).error(err.kind)
                self._report(err)
                await self._close_stream()
                raise
            except BaseException:
                await self.aclose()
                raise
        if isinstance(item, Reply):
            assert self._lease is not None
            completion = router._succeed(
                self._request, self._lease.runtime, self._lease, item, self._started, self._attempts
            )
            self._report(None, completion)
            await self._close_stream()
            return completion
        return item

    def _report(self, exc: BaseException | None, completion: Completion | None = None) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        if completion is not None:
            call.succeeded(completion)
        else:
            call.failed(exc)  # None: abandoned before its end

    async def _close_stream(self) -> None:
        self._state = "done"
        stream, self._stream = self._stream, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def aclose(self) -> None:
        """Abandon the stream if unfinished; idempotent."""
        if self._lease is not None and not self._lease.settled:
            self._router._settle(self._lease, healthy=None, reply=None)
        self._report(None)
        await self._close_stream()

    def __del__(self) -> None:
        # Dropped without aclose(): at least give back the concurrency slot and
        # breaker permit, which are plain bookkeeping and need no await.
        lease = self._lease
        if lease is not None and not lease.settled:
            try:
                self._router._settle(lease, healthy=None, reply=None)
            except RuntimeError:  # outside trio (interpreter shutdown)
                pass
