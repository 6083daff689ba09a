"""Remote A2A agents' skills served as listeners (docs/a2a.md, "Remote A2A agents as
tools"): the card's fetch at load, and the pump handler of each skill listener, calling
the remote with the official SDK's client (httpx, which runs under trio).

A call (:mod:`agentserver.remote.a2a_call`) sends one message, its id our idempotency
key, with the skill named in its metadata, then follows the remote task to a terminal
state or ``input-required``: by its stream when the card offers streaming, else (and
after a lost stream) by ``GetTask``. Each attempt is bounded by ``<a2a step-timeout>``;
one that times out or loses its transport is tried again (``retries``), and every
attempt, like the resend after a restart, first looks for the remote task the call
already started and continues it: a call never starts two remote tasks while the remote
keeps the first. The whole call is bounded by ``<a2a timeout>``; on that timeout, on the
last attempt's, or when the call is cancelled (the pump's timeout, our stop),
``CancelTask`` is sent to the remote, shielded and bounded by :data:`CANCEL_TIMEOUT`. A
remote that answers VersionNotSupported has its card fetched again and the call made
once more.

A remote whose card offers only A2A 0.3 is called with the SDK's 0.3 transport (its
JSON-RPC method names), chosen by the SDK's client from the card; 0.3 has no
``ListTasks``, so its calls find the task they started by the record
:class:`~agentserver.remote.a2a_call.RemoteTasks` keeps (the step log).

A remote task that asks for input (``input-required``) is answered to the caller as its
question; the next call of the same caller chain to the same skill continues that task
(same context and task ids) with its text as the answer.
"""

from __future__ import annotations

import copy
import json
import logging
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import trio
from lxml import etree

from agentserver.core.jsonschema_xsd import ArgumentError, ToolShape
from agentserver.core.listener import HandlerMetadata, HandlerResponse, HandlerResult
from agentserver.primitives.a2a import A2aAnswer
from agentserver.remote.a2a_call import (
    WAITING,
    Attempt,
    DirectAnswer,
    RemoteCall,
    RemoteTasks,
    state_name,
)
from agentserver.remote.a2a_spec import A2aRemoteSpec
from agentserver.steps.log import StepLog
from agentserver.steps.retry import backoff

log = logging.getLogger("agentserver.a2a")

CARD_PATH = "/.well-known/agent-card.json"
#: Seconds the CancelTask of an abandoned call may take.
CANCEL_TIMEOUT = 10.0
#: Input-required remote tasks remembered (per caller chain and skill) at most.
MAX_PENDING = 1024


class CallFailed(Exception):
    """A call's final failure: its text is the answer's."""


class CardError(Exception):
    """A remote agent's card could not be fetched or read."""


def _tls(spec: A2aRemoteSpec) -> ssl.SSLContext | bool:
    if spec.ca is None and spec.cert is None:
        return True
    context = ssl.create_default_context(cafile=spec.ca)
    if spec.cert is not None:
        context.load_cert_chain(spec.cert, spec.key)
    return context


def _http_options(spec: A2aRemoteSpec, timeout: float) -> dict[str, Any]:
    return {"headers": dict(spec.headers), "verify": _tls(spec), "timeout": timeout}


def _parse_card(data: Any) -> Any:
    """The SDK's ``AgentCard`` of a card's JSON. Raises CardError."""
    try:
        from a2a.client.card_resolver import parse_agent_card
    except ImportError:
        raise CardError("the A2A SDK is not installed (pip install 'agentserver[a2a]')") from None
    try:
        # A copy: the parser moves a 0.3 card's fields into 1.0's in place.
        return parse_agent_card(copy.deepcopy(data))
    except Exception as exc:
        raise CardError(f"not an agent card: {exc}") from None


def fetch_card_blocking(spec: A2aRemoteSpec) -> dict[str, Any]:
    """``spec``'s card as JSON (checked by the SDK's parser), within its connect-timeout.
    Blocking: boot.xml is loaded before any event loop runs. Raises CardError."""
    import httpx

    try:
        with httpx.Client(**_http_options(spec, spec.connect_timeout)) as http:
            response = http.get(spec.url + CARD_PATH)
    except (httpx.HTTPError, OSError, ssl.SSLError) as exc:
        raise CardError(f"card unreachable: {exc}") from None
    if response.status_code != 200:
        raise CardError(f"card: HTTP {response.status_code}")
    try:
        data = response.json()
    except ValueError:
        raise CardError("the card is not JSON") from None
    _parse_card(data)
    return data


def speaks_v03(card: Any) -> bool:
    """The SDK's client calls this card's remote at A2A 0.3: its JSON-RPC interfaces
    include a 0.x one and no 1.x or later (the SDK prefers 1.0, then newer, then 0.3)."""
    from a2a.compat.v0_3.versions import is_legacy_version

    versions = [
        i.protocol_version for i in card.supported_interfaces if i.protocol_binding == "JSONRPC"
    ]
    if any(v and not is_legacy_version(v) and _major(v) >= 1 for v in versions):
        return False
    return any(is_legacy_version(v) for v in versions)


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def task_texts(task: Any) -> list[str]:
    """The remote task's final message and artifacts as text (data parts as JSON)."""
    from google.protobuf.json_format import MessageToDict

    def texts(parts: Sequence[Any]) -> list[str]:
        out = []
        for part in parts:
            kind = part.WhichOneof("content")
            if kind == "text" and part.text:
                out.append(part.text)
            elif kind == "data":
                out.append(json.dumps(MessageToDict(part.data)))
            elif kind == "url":
                out.append(part.url)
        return out

    found = texts(task.status.message.parts) if task.status.HasField("message") else []
    for artifact in task.artifacts:
        found.extend(texts(artifact.parts))
    # Once each: an agent may say its answer both as its message and as an artifact.
    return list(dict.fromkeys(found))


class RemoteAgent:
    """One ``<a2a>``: its card, the SDK's client (made when first used, in the running
    trio), and the input-required tasks its callers may continue."""

    def __init__(self, spec: A2aRemoteSpec, tasks: RemoteTasks | None = None) -> None:
        self.spec = spec
        #: The record of which remote task each call started (a remote without ListTasks).
        self.tasks = tasks
        self.card: Any = _parse_card(dict(spec.card)) if spec.card else None
        self._http: Any = None
        self._client: Any = None
        #: (caller chain, skill) -> (context id, task id) of a task waiting for input.
        self.pending: dict[tuple[str, str], tuple[str, str]] = {}
        #: The remote serves ListTasks (until it refuses once): a call's lookup of the
        #: task it started.
        self.lists = True

    async def client(self) -> Any:
        if self._client is None:
            import httpx
            from a2a.client import ClientConfig, ClientFactory

            if self.card is None:
                await self.refetch_card()
            self._http = httpx.AsyncClient(**_http_options(self.spec, self.spec.timeout))
            streaming = bool(self.card.capabilities.streaming)
            factory = ClientFactory(ClientConfig(httpx_client=self._http, streaming=streaming))
            self._client = factory.create(self.card)
            if speaks_v03(self.card):
                self.lists = False  # 0.3 has no ListTasks: the record finds a call's task
        return self._client

    async def refetch_card(self) -> None:
        """Fetch the card again (a version failure), and make the client anew."""
        data = await trio.to_thread.run_sync(fetch_card_blocking, self.spec)
        self.card = _parse_card(data)
        await self.aclose()

    async def aclose(self) -> None:
        http, self._http, self._client = self._http, None, None
        if http is not None:
            await http.aclose()

    async def call(
        self,
        skill: str,
        text: str,
        data: Mapping[str, Any],
        key: str,
        chain: str,
        *,
        listener: str = "",
        caller: str = "",
    ) -> A2aAnswer:
        """One call of ``skill`` (see the module doc). Never raises but Cancelled."""
        call = RemoteCall(
            self.spec.name,
            skill,
            text,
            data,
            key,
            self.pending.pop((chain, skill), None),
            listener=listener,
            caller=caller,
        )
        try:
            with trio.fail_after(self.spec.timeout):
                call.deadline = trio.current_effective_deadline()
                task = await self._attempts(call)
        except trio.TooSlowError:
            await self._cancel(call.task_id)
            return self._failed(
                skill,
                f"no answer in time (timeout {self.spec.timeout:g} s, step-timeout "
                f"{self.spec.step_timeout or self.spec.timeout:g} s): the remote task was "
                "cancelled",
                call.task_id,
            )
        except trio.Cancelled:
            await self._cancel(call.task_id)
            raise
        except CallFailed as exc:
            return self._failed(skill, str(exc), call.task_id, call.context)
        except DirectAnswer as exc:
            return A2aAnswer(skill=skill, text=exc.texts)
        return self._answer(skill, chain, task)

    async def _attempts(self, call: RemoteCall) -> Any:
        """The call's attempts: each bounded by ``step-timeout``, a timed-out one or one
        whose transport failed tried again (``retries`` times, ``backoff(n)`` apart),
        continuing the remote task. Returns the settled task. Raises CallFailed,
        DirectAnswer, and TooSlowError when the last attempt timed out."""
        from a2a.utils.errors import A2AError, VersionNotSupportedError

        step_timeout = self.spec.step_timeout or self.spec.timeout
        retries, refetched = 0, False
        while True:
            failure = ""
            with trio.move_on_after(step_timeout):
                try:
                    client = await self.client()
                    streaming = bool(self.card.capabilities.streaming)
                    attempt = Attempt(client, call, streaming, self.lists, self.tasks)
                    try:
                        return await attempt.run()
                    finally:
                        self.lists = attempt.lists
                except VersionNotSupportedError as exc:
                    if refetched:
                        raise CallFailed(f"version refused: {exc}") from None
                    refetched = True
                    try:
                        await self.refetch_card()
                    except CardError as card_exc:
                        raise CallFailed(f"version refused, card: {card_exc}") from None
                    continue
                except A2AError as exc:  # the remote's answer: final
                    raise CallFailed(f"{type(exc).__name__}: {exc}") from None
                except CardError as exc:
                    raise CallFailed(str(exc)) from None
                except DirectAnswer:
                    raise
                except Exception as exc:  # the transport: connection refused, reset, ...
                    failure = f"the remote agent failed: {type(exc).__name__}: {exc}"
            if retries >= self.spec.retries:
                if failure:
                    raise CallFailed(failure)
                raise trio.TooSlowError
            retries += 1
            delay = backoff(retries)
            log.warning(
                "a2a %s: call %s attempt %d %s; retrying in %gs (same remote task)",
                self.spec.name,
                call.key,
                retries,
                failure or f"timed out after {step_timeout:g} s",
                delay,
            )
            await trio.sleep(delay)

    def _failed(self, skill: str, text: str, task: str = "", context: str = "") -> A2aAnswer:
        return A2aAnswer(
            state="failed", status="failed", skill=skill, task=task, context=context, text=[text]
        )

    def _answer(self, skill: str, chain: str, task: Any) -> A2aAnswer:
        """The answer of a settled ``task``; one that asks is remembered for ``chain``."""
        state = state_name(task)
        texts = task_texts(task)
        answer = A2aAnswer(
            state=state, skill=skill, task=task.id, context=task.context_id, text=texts
        )
        if state in WAITING:
            self.pending[(chain, skill)] = (task.context_id, task.id)
            while len(self.pending) > MAX_PENDING:
                self.pending.pop(next(iter(self.pending)))
            answer.text = [
                f"The remote agent asks: {' '.join(texts) or '(no question given)'} "
                "(call the same skill again with the answer)"
            ]
        elif state != "completed":
            answer.status = "failed"
            answer.text = texts or [f"the remote task ended {state}"]
        return answer

    async def _cancel(self, task_id: str) -> None:
        """Ask the remote to cancel ``task_id`` (shielded, bounded; failures logged)."""
        if not task_id or self._client is None:
            return
        from a2a.types import CancelTaskRequest

        with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_TIMEOUT):
            try:
                await self._client.cancel_task(CancelTaskRequest(id=task_id))
                log.info("a2a %s: remote task %s cancelled", self.spec.name, task_id)
            except Exception as exc:
                log.warning("a2a %s: cancel of %s failed: %s", self.spec.name, task_id, exc)


class A2aRemotes:
    """Every ``<a2a>`` of a topology, and the handlers of their skill listeners."""

    def __init__(self, specs: Sequence[A2aRemoteSpec], *, durable: bool = False) -> None:
        #: Which remote task each call started, for remotes without ListTasks (0.3);
        #: ``durable``: the agents' store will keep it (:meth:`log_steps_to`).
        self.tasks = RemoteTasks(durable=durable)
        self.agents = {spec.name: RemoteAgent(spec, self.tasks) for spec in specs}
        #: The calls in flight by caller (the listener or agent that called).
        self.calls: dict[str, set[trio.CancelScope]] = {}

    def log_steps_to(self, log: StepLog) -> None:
        """Keep the calls' remote tasks in ``log`` from now on: the step log made durable
        in the agents' store, which exists only once they run (as the runner hub's)."""
        self.tasks.log_to(log)

    def cancel_caller(self, caller: str) -> int:
        """Cancel every call ``caller`` has in flight (our stop of an agent): each sends
        CancelTask to its remote. Returns how many."""
        scopes = self.calls.get(caller, set())
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    async def aclose(self) -> None:
        for agent in self.agents.values():
            await agent.aclose()

    def handler_for(self, remote: str, skill: str, listener: str, shape: ToolShape) -> Any:
        """The pump handler of skill listener ``listener`` (raw: the validated element)."""
        agent = self.agents[remote]
        slots = trio.CapacityLimiter(agent.spec.concurrency)

        async def a2a_skill(payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
            try:
                arguments = shape.to_json(payload)
                data = json.loads(arguments.get("data") or "{}")
                if not isinstance(data, dict):
                    raise ValueError("data must be a JSON object")
            except (ArgumentError, ValueError) as exc:
                answer = A2aAnswer(state="rejected", status="failed", skill=skill, text=[str(exc)])
                return HandlerResponse.respond(answer)
            # The caller's chain names its context: its next call continues a waiting task.
            chain = meta.chain[0] if meta.chain else meta.thread_id
            caller = meta.chain[-2] if len(meta.chain) >= 2 else meta.from_id
            answer = A2aAnswer(
                state="canceled",
                status="failed",
                skill=skill,
                text=["the call was stopped: the remote task was cancelled"],
            )
            with trio.CancelScope() as scope:
                calls = self.calls.setdefault(caller, set())
                calls.add(scope)
                try:
                    answer = await self._call(
                        agent, slots, skill, arguments, data, meta, chain, listener, caller
                    )
                finally:
                    calls.discard(scope)
                    if not calls:
                        self.calls.pop(caller, None)
            return HandlerResponse.respond(answer)

        a2a_skill.__qualname__ = f"a2a:{listener}"
        return a2a_skill

    @staticmethod
    async def _call(
        agent: RemoteAgent,
        slots: trio.CapacityLimiter,
        skill: str,
        arguments: Mapping[str, Any],
        data: Mapping[str, Any],
        meta: HandlerMetadata,
        chain: str,
        listener: str,
        caller: str,
    ) -> A2aAnswer:
        async with slots:
            return await agent.call(
                skill,
                str(arguments.get("text", "")),
                data,
                meta.idempotency_key or meta.thread_id,
                chain,
                listener=listener,
                caller=caller,
            )
