"""Serve a remote listener from another process: ``agentserver runner`` from Python.

::

    await run_runner("gpu-box", 7340, client="search-runner", token=token,
                     listener="search", handler=handle, concurrency=4)

``handle(payload, meta)`` is an in-process handler's signature: ``payload`` is the
validated lxml element of the job (the runner needs none of the server's Python types),
``meta`` a :class:`~agentserver.core.listener.HandlerMetadata` (its ``idempotency_key``
is the job's ``idempotency-key``: the same on every attempt of one step). What it
returns is sent back as an in-process handler's result would be used: ``HandlerResponse.respond(p)`` answers the
caller, ``HandlerResponse(p, to="peer")`` forwards to a peer, ``None`` ends the job; an
exception reports ``<failed/>``. The wire contract (docs/wire.md, "Runners") is all this
module relies on: a runner in another language does the same.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from lxml import etree
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from agentserver.core.envelope import MESSAGE, encode
from agentserver.core.errors import AgentServerError, InputRefused
from agentserver.core.framing import FrameDecoder, encode_frame, encode_frames
from agentserver.core.listener import Handler, HandlerMetadata, HandlerResponse, to_element
from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES, SafeParser
from agentserver.net.client import TlsSessions, connect_stream, tls_context
from agentserver.net.tlsstream import TlsStream
from agentserver.observability.tracing import context_of, record_error

log = logging.getLogger("agentserver.runner")

_C = f"{{{CORE_NS}}}"
#: Frames waiting to be written (the server sends at most ``concurrency`` jobs, each
#: answered by a few frames, so this never fills in practice; when it does, jobs wait).
OUTGOING = 256
READ_SIZE = 65536


class RunnerRefused(AgentServerError):
    """The server refused this runner (its hello, or its ``<serve>``)."""


def _core(tag: str, **attrs: str) -> etree._Element:
    el = etree.Element(_C + tag, nsmap={None: CORE_NS})
    for key, value in attrs.items():
        el.set(key, value)
    return el


def hello_frame(client: str, token: str) -> bytes:
    hello = _core("hello")
    etree.SubElement(hello, _C + "client").text = client
    etree.SubElement(hello, _C + "token").text = token
    return encode_frame(encode(client, None, new_thread_id(), hello))


def result_frames(client: str, job: str, result: object) -> list[bytes]:
    """The reply frame bodies of one job, from what its handler returned (docs/wire.md):
    its forwards, then its answer or ``<done/>``."""
    if result is None:
        items: Sequence[HandlerResponse] = ()
    elif isinstance(result, HandlerResponse):
        items = (result,)
    else:
        items = tuple(result)  # type: ignore[arg-type]
    bodies = []
    answered = False
    for item in items:
        if not isinstance(item, HandlerResponse) or answered:
            raise TypeError("a runner handler returns HandlerResponse(s) or None")
        if not item.is_response and item.to is None:
            raise TypeError("a runner forwards with HandlerResponse(payload, to=peer)")
        element = to_element(item.payload)
        bodies.append(encode(client, None if item.is_response else item.to, job, element))
        answered = item.is_response
    if not answered:
        bodies.append(encode(client, None, job, _core("done")))
    return bodies


async def run_runner(
    host: str,
    port: int,
    *,
    client: str,
    token: str,
    listener: str,
    handler: Handler,
    concurrency: int = 4,
    tls: bool = False,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    connect_timeout: float = 10.0,
    tracer_provider: Any | None = None,
    sessions: TlsSessions | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Connect, say hello, announce ``<serve>``, then run jobs until the server closes
    the connection (returns) or the caller cancels. Raises :class:`RunnerRefused` if the
    server refuses the hello or the ``<serve>``.

    A job that carries a ``traceparent`` (docs/wire.md) runs in a ``handle {listener}``
    span continuing that trace, recorded by ``tracer_provider`` (default: OpenTelemetry's
    global provider; without an SDK configured, nothing is recorded). With
    ``tracer_provider`` given, jobs without one get a span too (a new trace).

    TLS: ``tls``/``ca``/``cert``/``key`` as for :func:`~agentserver.net.client.open_client`
    (with ``cert``, a client declared with ``cert-subject``/``cert-fingerprint`` needs no
    token: pass ``""``); ``sessions``, given to every call of a runner that reconnects,
    resumes the last connection's TLS session."""
    tracer = trace.get_tracer("agentserver.runner", tracer_provider=tracer_provider)
    context = tls_context(tls, ca=ca, cert=cert, key=key, sessions=sessions)
    with trio.fail_after(connect_timeout):
        stream = await connect_stream(host, port, context, None, sessions=sessions)
    async with stream:
        serve = _core("serve", listener=listener, concurrency=str(concurrency))
        await stream.send_all(
            hello_frame(client, token) + encode_frame(encode(client, None, new_thread_id(), serve))
        )
        # (job, frame body, final?); a None body is the job's <started/>, encoded only if
        # it is still worth sending when written.
        send, receive = trio.open_memory_channel[tuple[str, bytes | None, bool]](OUTGOING)
        parser = SafeParser(max_message_bytes)
        jobs: dict[str, trio.CancelScope] = {}
        traced = tracer_provider is not None

        async def writer() -> None:
            async with receive:
                async for item in receive:
                    batch = [item]
                    while len(batch) < 64:
                        try:
                            batch.append(receive.receive_nowait())
                        except trio.WouldBlock:
                            break
                    # A job whose last reply is in this write needs no <started/>: any
                    # reply counts as started, and they reach the server together.
                    ended = {job for job, _, final in batch if final}
                    bodies = [
                        body if body is not None else encode(client, None, job, _core("started"))
                        for job, body, _ in batch
                        if body is not None or job not in ended
                    ]
                    await stream.send_all(encode_frames(bodies))

        async def call(
            job: str, payload: etree._Element, meta: HandlerMetadata, span: Any
        ) -> list[bytes]:
            try:
                return result_frames(client, job, await handler(payload, meta))
            except Exception as exc:
                log.exception("%s: handler failed on job %s", listener, job)
                if span is not None:
                    record_error(span, type(exc).__name__)
                return [encode(client, None, job, _core("failed"))]

        async def run_job(
            job: str,
            sender: str,
            payload: etree._Element,
            scope: trio.CancelScope,
            traceparent: str | None,
            step_key: str | None,
        ) -> None:
            try:
                with scope:
                    try:
                        # Queued without a checkpoint, so a quick answer joins it in the
                        # writer's batch (which then drops it).
                        send.send_nowait((job, None, False))
                    except trio.WouldBlock:
                        await send.send((job, None, False))
                    # The step's idempotency key (the same on every attempt), else the job's.
                    meta = HandlerMetadata(
                        job, sender, listener, False, "", None, (), step_key or job
                    )
                    if traceparent is None and not traced:
                        bodies = await call(job, payload, meta, None)
                    else:
                        with tracer.start_as_current_span(
                            f"handle {listener}",
                            context=context_of(traceparent),
                            kind=SpanKind.CONSUMER,
                            attributes={
                                "agentserver.listener": listener,
                                "agentserver.sender": sender,
                                "agentserver.thread.id": job,
                                "agentserver.runner": client,
                            },
                            record_exception=False,
                            set_status_on_exception=False,
                        ) as span:
                            bodies = await call(job, payload, meta, span)
                    last = len(bodies) - 1
                    for i, body in enumerate(bodies):
                        try:
                            send.send_nowait((job, body, i == last))
                        except trio.WouldBlock:
                            await send.send((job, body, i == last))
            finally:
                jobs.pop(job, None)

        refused: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                task_status.started()
                await _read_jobs(
                    stream, parser, max_message_bytes, jobs, refused, nursery, run_job, listener
                )
                nursery.cancel_scope.cancel()
        finally:
            if sessions is not None and isinstance(stream, TlsStream):
                assert context is not None
                # However the connection ended: the next one resumes its session.
                sessions.remember(host, port, context, stream)
        if refused:
            raise RunnerRefused(refused[0])


async def _read_jobs(
    stream: trio.abc.Stream,
    parser: SafeParser,
    max_message_bytes: int,
    jobs: dict[str, trio.CancelScope],
    refused: list[str],
    nursery: trio.Nursery,
    run_job: Callable[
        [str, str, etree._Element, trio.CancelScope, str | None, str | None], Awaitable[None]
    ],
    listener: str,
) -> None:
    """Read frames until the connection ends or the server refuses us (then ``refused``
    holds why); start a task per job, cancel jobs on ``<cancel>``."""
    decoder = FrameDecoder(max_message_bytes)
    while True:
        try:
            data = await stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            return
        decoder.feed(data)
        for frame in decoder.frames():
            try:
                root = parser.parse(frame)
            except InputRefused:
                log.warning("unreadable frame from the server: ignored")
                continue
            if root.tag != MESSAGE or len(root) != 2:
                continue
            meta, payload = root[0], root[1]
            sender = (meta[0].text or "").strip()
            thread = (meta[-1].text or "").strip()
            if payload.tag == _C + "cancel":
                scope = jobs.get(thread)
                if scope is not None:
                    scope.cancel()
                continue
            to = (meta[1].text or "").strip() if len(meta) == 3 else None
            if to != listener:
                # Addressed to this runner, not a job: a refusal of its hello or <serve>.
                if payload.tag in (_C + "huh", _C + "SystemError"):
                    refused.append(etree.tostring(payload, encoding="unicode"))
                    return
                continue
            root.remove(payload)
            # Registered now, so a <cancel> read before the job starts finds it.
            scope = jobs[thread] = trio.CancelScope()
            nursery.start_soon(
                run_job,
                thread,
                sender,
                payload,
                scope,
                root.get("traceparent"),
                root.get("idempotency-key"),
            )
