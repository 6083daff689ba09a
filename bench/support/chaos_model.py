"""The chaos bench's scripted OpenAI-compatible model: a real HTTP/1.1 server on loopback.

Stateless about Turns: each request is answered from the messages it carries. The task's
text names a nonce (``NONCE[...]``); the task's plan (which tools it needs) is drawn from
the seed and the nonce. While a needed tool's proof is not among the messages, the model
calls the tools still missing (several at once); once all are there it answers
``RESULT nonce=N stamp=P relay=P pay=P|refused|-`` with the proofs copied from the tool
results, so the checker can tell that the answer saw its own results. A ``pay`` call that
came back without a proof (denied, timed out) is answered ``pay=refused``. When the
system prompt names the agent's tools (a versioned agent, bench/support/chaos_deploy.py),
the model calls only those, and answers ``relay=removed`` (say) for a needed tool the
prompt does not name.

Faults, drawn from the seed per request while ``faults_on``: 429 with ``Retry-After``,
500/503, a hang past the agents' ``llm-timeout``, a malformed tool call. The tool calls
themselves ask for delays and (first attempt only) a ``stamp`` exception.

Bounded: one task per connection (the server's own pool), no per-request memory except
counters. Cancel: the server's nursery is the bench's.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio
from chaos_deploy import offered_tools
from chaos_tools import NONCE, PROOF, TOOLS_NS


@dataclass
class FaultMix:
    """Per model request, the chance of each fault (drawn in this order)."""

    rate_limit: float = 0.04
    server_error: float = 0.04
    hang: float = 0.015
    malformed: float = 0.05
    #: Per stamp call on its first attempt: the tool raises.
    tool_exception: float = 0.2


@dataclass(frozen=True)
class Plan:
    relay: bool
    pay: bool


def plan_for(seed: int, nonce: str) -> Plan:
    """Which tools the task with ``nonce`` needs (stamp always)."""
    rng = random.Random(f"{seed}:plan:{nonce}")
    return Plan(relay=rng.random() < 0.5, pay=rng.random() < 0.2)


@dataclass
class ModelStats:
    requests: int = 0
    faults: Counter = field(default_factory=Counter)
    answers: int = 0
    #: compactions' summary requests answered (the agent with memory, bench/chaos.py)
    summaries: int = 0
    #: requests by the version their system prompt names (``--deploy``)
    prompts: Counter = field(default_factory=Counter)


def _texts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append((str(m.get("role", "")), str(content or "")))
    return out


def _call(kind: str, nonce: str, **fields: object) -> str:
    inner = "".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
    return f'<{kind} xmlns="{TOOLS_NS}"><nonce>{nonce}</nonce>{inner}</{kind}>'


#: How a compaction's summary request starts (agents/turn/compaction.py's SUMMARY_SYSTEM):
#: the bench's agent with memory has a small context window (bench/chaos.py), so its
#: conversations are folded while the faults run.
SUMMARY_START = "You keep the running summary of a conversation"


def summary_of(texts: list[tuple[str, str]], nonce: str) -> str:
    """A compaction's summary: bounded (a rolling summary must not grow with the
    conversation), and keeping what a real model would: the tool results of the latest
    task, so a task folded mid-way still sees its proofs (none of its tools run twice)."""
    proofs = sorted(
        {
            f"PROOF[{kind}:{n}:{digest}]"
            for _, text in texts
            for kind, n, digest in PROOF.findall(text)
            if n == nonce
        }
    )
    return "Summary of the earlier tasks. Latest tool results: " + (" ".join(proofs) or "none")


_CALLED = re.compile(
    r"<(stamp|relay|pay) xmlns=\"" + re.escape(TOOLS_NS) + r"\"><nonce>([0-9a-f]{16})<"
)


class ChaosModel:
    """The scripted model. ``on_final(nonce)`` is called just before a final answer goes
    out (the bench may disconnect the task's client then)."""

    def __init__(
        self,
        seed: int,
        llm_timeout: float,
        mix: FaultMix | None = None,
        on_final: Callable[[str], None] | None = None,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(f"{seed}:model")
        self.llm_timeout = llm_timeout
        self.mix = mix or FaultMix()
        self.faults_on = True
        self.on_final = on_final
        self.stats = ModelStats()
        #: Every nonce a request was about (its task's Turn ran): a task the server
        #: rejected or superseded must never be here (bench/support/chaos_check.py).
        self.nonces_seen: set[str] = set()
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, nursery: trio.Nursery) -> ChaosModel:
        listeners = await nursery.start(partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]
        return self

    # -- deciding ----------------------------------------------------------------------

    def decide(self, body: dict[str, Any]) -> tuple[int, list[tuple[str, str]], str | float]:
        """(status, headers, text) for one request; text is a float for a hang (seconds)."""
        self.stats.requests += 1
        texts = _texts(body.get("messages", []))
        summary = bool(texts) and texts[0][1].startswith(SUMMARY_START)
        nonces = [n for _, t in texts for n in NONCE.findall(t)]
        if not nonces and not summary:
            return 200, [], "Nothing to do."
        nonce = nonces[-1] if nonces else ""
        if not summary:
            self.nonces_seen.add(nonce)
        if self.faults_on:
            r = self.rng.random()
            mix = self.mix
            if r < mix.rate_limit:
                self.stats.faults["rate_limit"] += 1
                return 429, [("retry-after", "1")], "rate limited"
            r -= mix.rate_limit
            if r < mix.server_error:
                self.stats.faults["server_error"] += 1
                return self.rng.choice((500, 503)), [], "server error"
            r -= mix.server_error
            if r < mix.hang:
                self.stats.faults["hang"] += 1
                return 200, [], self.llm_timeout + 3.0
        if summary:
            self.stats.summaries += 1
            return 200, [], summary_of(texts, nonce)
        plan = plan_for(self.seed, nonce)
        version, offered = offered_tools(t for role, t in texts if role == "system")
        if version is not None:
            self.stats.prompts[version] += 1
        proofs: dict[str, str] = {}
        calls: Counter = Counter()
        pay_after_call = False
        for role, text in texts:
            for kind, n, digest in PROOF.findall(text):
                if n == nonce:
                    proofs[kind] = f"PROOF[{kind}:{n}:{digest}]"
            for kind, n in _CALLED.findall(text):
                if n == nonce:
                    calls[kind] += 1
            if calls["pay"] and role != "assistant" and "pay" not in proofs:
                # Something came back after a pay call (a denial, a timeout, an interrupt).
                pay_after_call = pay_after_call or "interrupted" not in text
        needed = ["stamp"] + (["relay"] if plan.relay else []) + (["pay"] if plan.pay else [])
        # A tool this version's prompt does not name is not called (its proof, if a call
        # of an earlier version brought one, still counts).
        removed = {k for k in needed if offered is not None and k not in offered}
        removed -= set(proofs)
        missing = [
            k
            for k in needed
            if k not in proofs and k not in removed and not (k == "pay" and pay_after_call)
        ]
        if missing:
            parts = []
            for kind in missing:
                if kind == "stamp":
                    fail = calls["stamp"] == 0 and self.rng.random() < self.mix.tool_exception
                    delay = round(self.rng.uniform(0, 1.5), 2)
                    parts.append(_call("stamp", nonce, delay=delay, fail=str(fail).lower()))
                elif kind == "relay":
                    parts.append(_call("relay", nonce, delay=round(self.rng.uniform(0, 2.0), 2)))
                else:
                    parts.append(_call("pay", nonce))
            text = "Calling tools.\n" + "\n".join(parts)
            if self.faults_on and self.rng.random() < self.mix.malformed:
                self.stats.faults["malformed"] += 1
                text = text[: len(text) - 9]  # the last call's closing tag cut off
            return 200, [], text

        def shown(kind: str, otherwise: str) -> str:
            return proofs.get(kind, "removed" if kind in removed else otherwise)

        pay = shown("pay", "refused" if plan.pay else "-")
        answer = (
            f"RESULT nonce={nonce} stamp={shown('stamp', '-')} "
            f"relay={shown('relay', '-')} pay={pay}"
        )
        self.stats.answers += 1
        if self.on_final is not None:
            self.on_final(nonce)
        return 200, [], answer

    # -- HTTP --------------------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                got = await self._read(stream, conn)
                if got is None:
                    return
                try:
                    body = json.loads(got) if got else {}
                except ValueError:
                    body = {}
                status, headers, text = self.decide(body)
                if isinstance(text, float):
                    await trio.sleep(text)
                    return  # the caller gave up long ago
                await self._respond(stream, conn, status, headers, text, bool(body.get("stream")))
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    @staticmethod
    async def _read(stream: trio.SocketStream, conn: h11.Connection) -> bytes | None:
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)

    @staticmethod
    async def _respond(
        stream: trio.SocketStream,
        conn: h11.Connection,
        status: int,
        headers: list[tuple[str, str]],
        text: str,
        streamed: bool,
    ) -> None:
        if status != 200:
            body = json.dumps(
                {"error": {"message": text, "type": "server_error", "param": None, "code": None}}
            ).encode()
            ctype = "application/json"
        elif not streamed:
            body = json.dumps(
                {
                    "id": "chatcmpl-chaos",
                    "object": "chat.completion",
                    "created": 1700000000,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }
            ).encode()
            ctype = "application/json"
        else:

            def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
                return {
                    "id": "chatcmpl-chaos",
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": "m",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }

            events: list[Any] = [
                chunk({"role": "assistant", "content": ""}, None),
                chunk({"content": text}, None),
                chunk({}, "stop"),
                {
                    "id": "chatcmpl-chaos",
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": "m",
                    "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                },
                "[DONE]",
            ]
            body = b"".join(
                b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
                for e in events
            )
            ctype = "text/event-stream"
        head = [("content-type", ctype), ("content-length", str(len(body))), *headers]
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=head)))
        await stream.send_all(conn.send(h11.Data(data=body)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
