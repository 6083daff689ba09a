"""The chaos bench's actors: task clients (with and without acknowledgements), the
approver and the operator (bench/chaos.py; docs/reliability.md).

A task client sends tasks (a fresh uuid4 thread each, a nonce in the text; now and then
a double text with a ``multitask`` override, bench/support/chaos_multitask.py), hands every
answer it receives to its "application" (the :class:`~chaos_check.Ledger`), and
disconnects and reconnects at random, to any live server. One with acks uses
``agentserver.net.client`` (acks, copies dropped by ``reply-id`` across its connections);
one without speaks the wire itself and leaves as docs/wire.md says a client without acks
must not lose answers: end of input (``send_eof``), then reading until the server closes.

Bounded: each client has at most ``max_open`` tasks in flight. Cancel: every actor runs
until the bench's nursery is cancelled or its ``stop`` is set.
"""

from __future__ import annotations

import random
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from chaos_check import Attempt, Ledger, StoredAnswers
from chaos_multitask import hurry, next_task
from chaos_procs import ServerSlot
from chaos_tools import AGENTS, TASK_TYPES
from lxml import etree

from agentserver.core.envelope import MULTITASK, build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import hello_frame_body
from agentserver.core.xmlsafe import SafeParser
from agentserver.net.client import Client, ClientError, approval_request, open_client
from agentserver.net.reply import DeliveredIds, Reply, parse_reply

TOKEN = "chaos-token"
#: Of the double texts to the memory agent, this share goes over the HTTP API
#: (``POST /v1/messages?multitask=``, docs/runs.md) rather than the socket.
HTTP_DOUBLE_TEXT_CHANCE = 0.35
#: A blocking HTTP task waits this long for its answer (the API's wait-timeout is 60 s).
HTTP_WAIT_S = 70.0


def token_of(name: str) -> str:
    """A task client's own token: over HTTP the bearer token alone names the client."""
    return f"{TOKEN}-{name}"


def token_env(name: str) -> str:
    """The variable boot.xml reads ``name``'s token from."""
    return f"CHAOS_TOKEN_{name.upper()}"


#: A request as ``agentserver console`` shows it (docs/agents.md, "Human approval").
_SHOWN = re.compile(r"approval request (\w+): (\w+) wants to call")


@dataclass
class Switches:
    """What the bench lets the actors do; flipped when the faults stop."""

    faults: bool = True
    sending: bool = True
    stop: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


class Servers:
    """The server slots, for actors picking one to connect to."""

    def __init__(self, slots: list[ServerSlot]) -> None:
        self.slots = slots

    async def pick(self, rng: random.Random) -> ServerSlot:
        """A live slot (waits for one)."""
        while True:
            live = [s for s in self.slots if s.alive]
            if live:
                return rng.choice(live)
            await trio.sleep(0.2)


def _is_failed(reply: Reply) -> bool:
    return reply.payload.get("status") == "failed"


def _text(reply: Reply) -> str:
    return "".join(reply.payload.itertext()) or reply.raw.decode("utf-8", "replace")


class TaskClient:
    """One named client sending tasks. ``taken(thread)`` asks the oracle whether the server
    took a task; ``slot_of[thread]`` is the (slot, generation) it was sent to."""

    def __init__(
        self,
        name: str,
        acks: bool,
        seed: int,
        servers: Servers,
        ledger: Ledger,
        switches: Switches,
        taken: Callable[[str], Awaitable[bool]],
        max_open: int = 3,
        stored_answers: Callable[[str], Awaitable[StoredAnswers]] | None = None,
    ) -> None:
        self.name = name
        self.acks = acks
        self.rng = random.Random(f"{seed}:client:{name}")
        self.servers = servers
        self.ledger = ledger
        self.switches = switches
        self.taken = taken
        self.max_open = max_open
        self.delivered = DeliveredIds()
        self.leave_now = trio.Event()
        #: thread -> (slot, generation, monotonic time its connection closed or None)
        self.sent_on: dict[str, list] = {}
        #: Attempts the store showed taken (that never changes).
        self.known_taken: set[str] = set()
        #: The open connection of a client with acks (tasks go through its ``send``).
        self._client: Client | None = None
        #: The store's answers to a thread (the HTTP tasks whose exchange a kill lost).
        self.stored_answers = stored_answers
        self._http: trio.Nursery | None = None
        #: HTTP tasks whose POST has not returned yet.
        self._http_pending: set[str] = set()

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._http = nursery
            await self._run()
            nursery.cancel_scope.cancel()

    async def _run(self) -> None:
        while not self.switches.stop:
            slot = await self.servers.pick(self.rng)
            gen = slot.generation
            self.leave_now = trio.Event()
            try:
                if self.acks:
                    await self._session_acks(slot)
                else:
                    await self._session_raw(slot)
            except* (ClientError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                # The connection broke (its server killed, or it closed us): also from
                # inside a session's nursery, where trio raises it in an ExceptionGroup.
                pass
            for thread, entry in self.sent_on.items():
                if thread in self._http_pending:
                    continue  # its POST, not this connection, says when it closed
                if entry[0] is slot and entry[1] == gen and entry[2] is None:
                    entry[2] = trio.current_time()
            if self.switches.faults:
                await trio.sleep(self.rng.uniform(0.1, 3.0))

    def _hand(self, reply: Reply) -> None:
        """``reply`` reaches the application."""
        if reply.is_error:
            self.ledger.refused(self.name, reply.thread, reply.error_text or "")
        else:
            self.ledger.answered(self.name, reply.thread, _text(reply), _is_failed(reply))

    async def _life(self, slot: ServerSlot, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Resend what must be, send new tasks, until it is time to leave."""
        gen = slot.generation
        with trio.move_on_after(self.rng.uniform(4, 25) if self.switches.faults else 1e9):
            while True:
                if self.leave_now.is_set() and self.switches.faults:
                    self.switches.count("disconnects_before_answer")
                    return
                if slot.generation != gen or not slot.alive:
                    return
                await self._resend(send, slot)
                open_agents = [a.agent for a in self.ledger.open_attempts(self.name)]
                task = next_task(self.rng, open_agents, self.max_open, AGENTS)
                if self.switches.sending and task is not None:
                    nonce = f"{self.rng.getrandbits(64):016x}"
                    if task.multitask is not None:
                        self.switches.count("multitask_sent")
                    like = Attempt(self.name, "", nonce, task.agent, task.multitask, task.racing)
                    if (
                        task.racing
                        and task.multitask is not None
                        and slot.http_url
                        and self.stored_answers is not None
                        and self.rng.random() < HTTP_DOUBLE_TEXT_CHANCE
                    ):
                        self._send_http(slot, like)
                    else:
                        await self._send_task(send, slot, like)
                    if hurry(self.rng, task):
                        continue
                with trio.move_on_after(self.rng.uniform(0.2, 1.5)):
                    await self.leave_now.wait()
        if self.switches.faults:
            self.switches.count("disconnects")

    async def _send_task(self, send, slot: ServerSlot, like: Attempt) -> None:
        """Send a new attempt of ``like``'s task (its nonce, agent and mode; a new thread)."""
        nonce, agent = like.nonce, like.agent
        thread = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        task = TASK_TYPES[agent](text=f"Please handle NONCE[{nonce}] with your tools.")
        self.ledger.sent(self.name, thread, nonce, agent, like.multitask, like.racing)
        self.sent_on[thread] = [slot, slot.generation, None]
        if self._client is not None:
            # With acks: agentserver.client's own way to ask for a mode.
            await self._client.send(task, to=agent, thread=thread, multitask=like.multitask)
            return
        envelope = build_envelope(self.name, agent, thread, task.to_xml_tree())
        if like.multitask is not None:
            envelope.set(MULTITASK, like.multitask)  # by hand: the envelope's attribute
        await send(etree.tostring(envelope))

    def _send_http(self, slot: ServerSlot, like: Attempt) -> None:
        """A double text over the HTTP API: ``POST /v1/messages?to=AGENT&multitask=MODE``
        with her own bearer token (her conversation, as her socket tasks), waiting for
        the answer in a task of its own (:meth:`_follow_http`)."""
        assert self._http is not None
        thread = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        self.ledger.sent(
            self.name, thread, like.nonce, like.agent, like.multitask, like.racing, via="http"
        )
        self.switches.count("http_double_texts")
        # Never a connection to close: the resend rule starts from the POST's return.
        self.sent_on[thread] = [slot, slot.generation, None]
        self._http_pending.add(thread)
        self._http.start_soon(self._follow_http, slot, thread, like)

    async def _follow_http(self, slot: ServerSlot, thread: str, like: Attempt) -> None:
        """The HTTP task's one answer: the POST's response body (200, the reply
        envelope), or, when the server that held the exchange was killed (or the wait
        timed out), what the store wrote for it: the reply row(s) of its task (an
        application without a socket of its own reads them as
        ``GET /v1/agents/NAME/tasks/THREAD`` would, from the store)."""
        import httpx

        task = TASK_TYPES[like.agent](text=f"Please handle NONCE[{like.nonce}] with your tools.")
        params = {"to": like.agent, "thread": thread, "multitask": like.multitask or "enqueue"}
        headers = {"Authorization": f"Bearer {token_of(self.name)}"}
        entry = self.sent_on[thread]
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=HTTP_WAIT_S) as http:
                got = await http.post(
                    "/v1/messages", params=params, headers=headers, content=task.to_xml()
                )
        except httpx.HTTPError:
            got = None
        entry[2] = trio.current_time()
        self._http_pending.discard(thread)
        if got is not None and got.status_code == 200:
            self._hand(parse_reply(got.content, SafeParser()))
            self.switches.count("http_answers_on_the_wire")
            return
        if got is not None and got.status_code not in (504,) and got.status_code >= 400:
            # Refused before it was a task (a problem document): her application sees it.
            self.ledger.refused(self.name, thread, got.text[:300])
            self.switches.count("http_refusals")
            return
        # The exchange is gone (its server killed) or timed out: the store has the answer
        # once the task ends, if the server took it (else the resend rule sends it again).
        while not self.switches.stop:
            if thread in self.ledger.resent:
                return
            if thread in self.known_taken or await self.taken(thread):
                self.known_taken.add(thread)
                assert self.stored_answers is not None
                found = await self.stored_answers(thread)
                if found.answers:
                    for text, failed in found.answers:
                        self.ledger.answered(self.name, thread, text, failed)
                    self.switches.count("http_answers_from_the_store")
                    return
                if found.pruned:
                    # Retention removed the task with its reply before we read it: what
                    # the answer was is unknowable here (counted, never a violation).
                    self.ledger.answered(self.name, thread, "pruned before read", True)
                    self.switches.count("http_answers_pruned")
                    return
            await trio.sleep(1.0)

    async def _resend(self, send, slot: ServerSlot) -> None:
        """docs/deploy.md: a task still in a killed server's socket was never accepted and
        must be sent again. Asked of the store once the connection it went on is closed
        and its server gone or 5 s have passed (the pump may still be taking it)."""
        now = trio.current_time()
        for attempt in self.ledger.open_attempts(self.name):
            slot0, gen0, closed = self.sent_on[attempt.thread]
            if closed is None:
                continue
            dead = slot0.generation != gen0 or not slot0.alive
            if not dead and now - closed < 5.0:
                continue
            if attempt.thread in self.known_taken:
                continue
            if await self.taken(attempt.thread):
                self.known_taken.add(attempt.thread)  # for good: no need to ask again
                continue
            self.ledger.resend(attempt.thread)
            self.switches.count("resends")
            await self._send_task(send, slot, attempt)

    async def _session_acks(self, slot: ServerSlot) -> None:
        async with open_client(
            slot.host,
            slot.port,
            client=self.name,
            token=token_of(self.name),
            delivered=self.delivered,
        ) as client:
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    while True:
                        self._hand(await client.receive())

                nursery.start_soon(receive)
                self._client = client
                try:
                    await self._life(slot, client.send_raw)
                finally:
                    self._client = None
                nursery.cancel_scope.cancel()
            self.switches.count("ack_duplicates_dropped", client.duplicates)

    async def _session_raw(self, slot: ServerSlot) -> None:
        stream = await trio.open_tcp_stream(slot.host, slot.port)
        parser = SafeParser()
        decoder = FrameDecoder(4 * 1024 * 1024)
        lock = trio.Lock()

        async def send(body: bytes) -> None:
            async with lock:
                await stream.send_all(encode_frame(body))

        async def read_all() -> None:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                decoder.feed(data)
                while (frame := decoder.next_frame()) is not None:
                    self._hand(parse_reply(frame, parser))

        async with stream:
            await send(hello_frame_body(self.name, token_of(self.name), ack=False))
            async with trio.open_nursery() as nursery:
                reader_done = trio.Event()

                async def reader() -> None:
                    try:
                        await read_all()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    finally:
                        reader_done.set()

                nursery.start_soon(reader)
                await self._life(slot, send)
                # Leave as docs/wire.md asks: end of input, then read what is owed.
                try:
                    async with lock:
                        await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                with trio.move_on_after(15):
                    await reader_done.wait()
                if not reader_done.is_set():
                    self.switches.count("raw_close_timeouts")
                nursery.cancel_scope.cancel()


class Approver:
    """The named client ``approver``: comes and goes, grants (70 %) and denies."""

    def __init__(
        self, seed: int, servers: Servers, switches: Switches, env: dict[str, str]
    ) -> None:
        self.rng = random.Random(f"{seed}:approver")
        self.servers = servers
        self.switches = switches
        self.delivered = DeliveredIds()
        self.env = {**env, "AGENTSERVER_TOKEN": TOKEN}

    async def _at_console(self, slot: ServerSlot, request_id: str, grant: bool) -> list:
        """``agentserver console --client approver``: ``/approve ID`` or ``/deny ID``.
        Returns the other requests the console showed (it received them: they will not
        come to the approver's own connection), as (agent, request id)."""
        line = f"/approve {request_id}" if grant else f"/deny {request_id} not today"
        _, out = await run_cli(
            ["console", "--connect", f"{slot.host}:{slot.port}", "--client", "approver"],
            self.env,
            stdin=f"{line}\n/quit\n".encode(),
        )
        self.switches.count("console_decisions")
        if "decision applied" in out:
            self.switches.count("console_decisions_applied")
        return [(a, r) for r, a in _SHOWN.findall(out) if r != request_id]

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._http = nursery
            await self._run()
            nursery.cancel_scope.cancel()

    async def _run(self) -> None:
        while not self.switches.stop:
            slot = await self.servers.pick(self.rng)
            gen = slot.generation
            try:
                async with open_client(
                    slot.host, slot.port, client="approver", token=TOKEN, delivered=self.delivered
                ) as client:
                    stay = self.rng.uniform(5, 20)
                    left = trio.current_time() + stay
                    while slot.generation == gen and (
                        not self.switches.faults or trio.current_time() < left
                    ):
                        reply = None
                        with trio.move_on_after(1):
                            reply = await client.receive()
                        request = approval_request(reply) if reply is not None else None
                        if request is None:
                            continue
                        if self.switches.faults:
                            await trio.sleep(self.rng.uniform(0, 2))
                        grant = self.rng.random() < 0.7
                        if self.rng.random() < 0.3:
                            # At the console instead: /approve or /deny, then /quit; and
                            # then the requests the console showed meanwhile.
                            for agent, other in await self._at_console(
                                slot, request["request"], grant
                            ):
                                await client.decide_approval(agent, other, True)
                                self.switches.count("approvals")
                        else:
                            await client.decide_approval(
                                request["agent"], request["request"], grant
                            )
                        self.switches.count("approvals" if grant else "denials")
            except (ClientError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if self.switches.faults:
                await trio.sleep(self.rng.uniform(2, 15))


async def run_cli(args: list[str], env: dict[str, str], stdin: bytes = b"") -> tuple[int, str]:
    """``agentserver ARGS``: its status and output. Bounded: 60 s."""
    with trio.move_on_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "agentserver", *args],
            env=env,
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return done.returncode, (done.stdout + done.stderr).decode("utf-8", "replace")
    return -1, "timed out"


class Operator:
    """Stops an agent's active task or cancels a sent task, every 8-30 s, with the CLI
    (``agentserver stop`` / ``cancel``, client ``ops``)."""

    def __init__(
        self,
        seed: int,
        servers: Servers,
        switches: Switches,
        ledger: Ledger,
        env: dict[str, str],
    ) -> None:
        self.rng = random.Random(f"{seed}:operator")
        self.servers = servers
        self.switches = switches
        self.ledger = ledger
        self.env = {**env, "AGENTSERVER_TOKEN": TOKEN}

    async def run(self) -> None:
        while self.switches.faults:
            await trio.sleep(self.rng.uniform(8, 30))
            if not self.switches.faults:
                return
            slot = await self.servers.pick(self.rng)
            connect = ["--connect", f"{slot.host}:{slot.port}", "--client", "ops"]
            if self.rng.random() < 0.5:
                agent = self.rng.choice(AGENTS)
                _, out = await run_cli(["stop", agent, *connect, "--timeout", "10"], self.env)
                self.switches.count("stops")
            else:
                open_ = [
                    a
                    for c in {a.client for a in self.ledger.attempts.values()}
                    for a in self.ledger.open_attempts(c)
                ]
                if not open_:
                    continue
                target = self.rng.choice(open_)
                _code, out = await run_cli(
                    [
                        "cancel",
                        target.agent,
                        "--thread",
                        target.thread,
                        *connect,
                        "--timeout",
                        "10",
                    ],
                    self.env,
                )
                self.switches.count("cancels")
            if 'count="' in out and 'count="0"' not in out:
                self.switches.count("stops_effective")
