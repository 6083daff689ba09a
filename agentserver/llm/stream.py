"""CompletionStream: one streamed completion, as the router hands it out.

It talks to its router through :class:`StreamRouter` (the Router satisfies it), so this
module does not import the router, which imports it.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any, Protocol, Self

import trio

from .backend_state import BackendRuntime, DeadlineReached, Lease
from .backends import ReplyStream
from .classify import ErrorKind
from .types import Completion, LLMError, Reply, Request


class StreamRouter(Protocol):
    """What a :class:`CompletionStream` needs of its router."""

    #: Reports each call, or None (see ``Router.telemetry``).
    telemetry: Any

    async def route(
        self, request: Request, started: float, *, streaming: bool
    ) -> Completion | tuple[Lease, ReplyStream, str | Reply, float, int]:
        """Choose, admit and open: the lease, stream, first item, deadline, attempts."""
        ...

    def settle(self, lease: Lease, *, healthy: bool | None, reply: Reply | None) -> None:
        """Release what ``lease`` holds (idempotent); ``healthy`` None: no verdict."""
        ...

    def succeed(
        self,
        request: Request,
        rt: BackendRuntime,
        lease: Lease,
        reply: Reply,
        started: float,
        attempts: int,
    ) -> Completion:
        """Settle ``lease`` as healthy and account the reply."""
        ...

    def stream_failed(self, request: Request, lease: Lease, err: LLMError) -> None:
        """Settle ``lease`` after a failure past the first chunk and count it."""
        ...


class CompletionStream:
    """Text chunks of one streamed completion, then the :class:`Completion`.

    Not restartable. Each ``__anext__`` is cancellable; cancelling one, or
    :meth:`aclose`, abandons the stream (no verdict on the backend, the token
    reservation is kept). An error after the first chunk is raised as
    :class:`LLMError`; nothing is retried from there, so no chunk repeats.
    """

    def __init__(self, router: StreamRouter, request: Request) -> None:
        self._router = router
        self._request = request
        self._state = "new"
        self._lease: Lease | None = None
        self._stream: ReplyStream | None = None
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
                result = await router.route(self._request, self._started, streaming=True)
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
                    raise DeadlineReached(
                        ErrorKind.TIMEOUT,
                        "the request's deadline passed mid-stream",
                        backend=self._lease.runtime.name,
                    )
            except LLMError as err:
                router.stream_failed(self._request, self._lease, err)
                self._report(err)
                await self._close_stream()
                raise
            except BaseException:
                await self.aclose()
                raise
        if isinstance(item, Reply):
            assert self._lease is not None
            completion = router.succeed(
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
            self._router.settle(self._lease, healthy=None, reply=None)
        self._report(None)
        await self._close_stream()

    def __del__(self) -> None:
        # Dropped without aclose(): at least give back the concurrency slot and
        # breaker permit, which are plain bookkeeping and need no await.
        lease = self._lease
        if lease is not None and not lease.settled:
            try:
                self._router.settle(lease, healthy=None, reply=None)
            except RuntimeError:  # outside trio (interpreter shutdown)
                pass
