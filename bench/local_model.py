"""Benchmark: the local backend beside llama-cpp-python's own OpenAI-compatible server, on the
same GGUF model, in the same run; and, with ``--turns N``, the bundled assistant's Turns
with the calculator on the local model, with and without the reply grammar.

Part 1, speed (always). The same chat requests (one user message, temperature 0,
``--max-tokens``), one at a time:

- ``ours``: the router's ``llama-cpp`` backend in this process (a worker thread generates,
  pieces stream to trio);
- ``llama_cpp_server``: ``python -m llama_cpp.server`` on loopback (a subprocess with the
  same ``n_ctx`` and threads), called with httpx, streamed (``stream: true``).

Time to first token (``ttft_ms``: request sent → first text piece) and decode speed
(``tokens_per_s``: completion tokens / (end - first piece)), medians over ``--requests``.
The server's completion tokens are its ``usage`` when it reports it, else its content
pieces (one per token). The server needs the ``[server]`` extra of llama-cpp-python
(``pip install 'llama-cpp-python[server]==0.3.36'``); without it that side is reported as
unavailable (and the run exits 1).

Part 2, ``--turns N``: N Turns of an assistant whose peer is the calculator ("What is A+B?"
with random A, B) on the packaged model in-process, once with the grammar (the default of
the local backend) and once with ``constrain="false"``; the agent has ``max-steps="3"`` and
``max-tokens`` ``--turn-max-tokens`` (256). Per case: the model's tool calls, the share the
pump accepted (``tool.call`` cards over those plus refused payloads, ``sys.huh``), correct
answers, and seconds per Turn. A refusal of a reply the token limit cut (its step produced
``max-tokens`` tokens: the call in it is unfinished, which no grammar can prevent) is
counted apart (``refusals_of_replies_cut_at_max_tokens``), not in the share.
``--only-turns`` skips Part 1 and the grammar's cost (the shares do not depend on timing).

Ends with one JSON line. Usage::

    python bench/local_model.py [--requests 5] [--max-tokens 64] [--turns 50]
        [--model-path packaged:smollm2-135m] [--threads 2] [--n-ctx 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from lxml import etree

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentserver.llm import Message, Request, Router  # noqa: E402
from agentserver.llm.config import parse_llm_section  # noqa: E402
from agentserver.llm.local_models import resolve_model_path  # noqa: E402

BOOT_NS = "https://xml-pipeline.org/ns/boot/v1"
PROMPT = "Explain in a few sentences why the sky is blue."


def llm_element(model_path: str, n_ctx: int, threads: int, constrain: bool = True):
    llm = etree.Element(f"{{{BOOT_NS}}}llm")
    backend = etree.SubElement(
        llm,
        f"{{{BOOT_NS}}}backend",
        {
            "name": "local",
            "provider": "llama-cpp",
            "model-path": model_path,
            "context-window": str(n_ctx),
            "threads": str(threads),
            "timeout": "600",
            "constrain": "true" if constrain else "false",
        },
    )
    etree.SubElement(backend, f"{{{BOOT_NS}}}model", {"name": "local"})
    return llm


# -- part 1: ours ------------------------------------------------------------------------


async def bench_ours(args: argparse.Namespace) -> dict[str, Any]:
    config = parse_llm_section(llm_element(args.model_path, args.n_ctx, args.threads))
    ttfts, speeds, tokens = [], [], []
    async with Router(config, environ={}) as router:
        for _ in range(args.requests):
            request = Request(
                [Message.user(PROMPT)], model="local", max_tokens=args.max_tokens, temperature=0
            )
            sent = time.perf_counter()
            first = None
            async with router.stream(request) as stream:
                async for item in stream:
                    if isinstance(item, str):
                        if first is None:
                            first = time.perf_counter()
                    else:
                        done = item
            end = time.perf_counter()
            assert first is not None
            n = done.usage.completion_tokens
            ttfts.append((first - sent) * 1000)
            if n > 1 and end > first:
                speeds.append((n - 1) / (end - first))
            tokens.append(n)
    return summary(ttfts, speeds, tokens)


def summary(ttfts: list[float], speeds: list[float], tokens: list[int]) -> dict[str, Any]:
    return {
        "ttft_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else None,
        "completion_tokens": tokens,
    }


# -- part 1: llama-cpp-python's server ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, path: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(path),
            "--n_ctx",
            str(args.n_ctx),
            "--n_threads",
            str(args.threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}/v1", log


def bench_server(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return {
            "unavailable": f"llama_cpp.server needs its [server] extra ({exc}); "
            "pip install 'llama-cpp-python[server]==0.3.36'"
        }
    proc, base, log = start_server(args, path)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=600) as http:
            while True:
                if proc.poll() is not None:
                    return {"unavailable": "the server exited: " + log.read_text()[-2000:]}
                try:
                    if http.get(base + "/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    return {"unavailable": "the server did not answer within 120 s"}
                time.sleep(0.2)
            ttfts, speeds, tokens = [], [], []
            for _ in range(args.requests):
                body = {
                    "model": "local",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                }
                sent = time.perf_counter()
                first = None
                pieces = 0
                usage = None
                with http.stream("POST", base + "/chat/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or ():
                            if (choice.get("delta") or {}).get("content"):
                                pieces += 1
                                if first is None:
                                    first = time.perf_counter()
                end = time.perf_counter()
                assert first is not None, "the server streamed no text"
                n = int(usage["completion_tokens"]) if usage else pieces
                ttfts.append((first - sent) * 1000)
                if n > 1 and end > first:
                    speeds.append((n - 1) / (end - first))
                tokens.append(n)
        return summary(ttfts, speeds, tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


# -- part 2: Turns with the calculator ----------------------------------------------------

TURNS_BOOT = """<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="local-turns">
  <listen host="127.0.0.1" port="0"/>
  <store path="state/agents.sqlite3"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator"
              timeout="600">
      <agent model="local" max-steps="3" max-tokens="{max_tokens}"/>
    </listener>
  </listeners>
</organism>"""


async def bench_turns(args: argparse.Namespace, constrain: bool) -> dict[str, Any]:
    """N Turns in process (the pump, the agent runtime, SQLite), one at a time."""
    from agentserver.app.agents import start_agents
    from agentserver.app.builtins import RunContext, build_listener_set
    from agentserver.config import loader
    from agentserver.listeners.assistant import Task
    from agentserver.pump.pump import open_pump

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        boot_text = TURNS_BOOT.replace("{max_tokens}", str(args.turn_max_tokens))
        root = etree.fromstring(boot_text.encode())
        root.insert(1, llm_element(args.model_path, args.n_ctx, args.threads, constrain))
        boot = Path(tmp, "boot.xml")
        await trio.Path(boot).write_bytes(etree.tostring(root))
        topology = loader.load_or_raise(boot, environ={})
        built = build_listener_set(topology, RunContext(topology))
        answers = correct = 0
        started = time.perf_counter()
        import contextlib

        # As the composition root nests them: the pump, the agents' resources (router,
        # store), then the nursery of their tasks, which ends first.
        async with contextlib.AsyncExitStack() as resources:
            pump = await resources.enter_async_context(
                open_pump(built.listeners, config=topology.pump_config())
            )
            async with contextlib.AsyncExitStack() as agent_resources:
                async with trio.open_nursery() as nursery:
                    service = await start_agents(
                        topology, pump, built.agent_handlers, nursery, agent_resources, environ={}
                    )
                    from agentserver.testing import InProcess

                    client = InProcess(pump, "bench")
                    for _ in range(args.turns):
                        a, b = rng.randint(1, 99), rng.randint(1, 99)
                        reply = await client.request(
                            Task(text=f"What is {a}+{b}? Use the calculator."),
                            to="assistant",
                            timeout=900,
                        )
                        answers += 1
                        if str(a + b) in "".join(reply.payload.itertext()):
                            correct += 1
                    elapsed = time.perf_counter() - started
                    if service is not None:
                        service.stop()
                    nursery.cancel_scope.cancel()
        import sqlite3

        db = sqlite3.connect(Path(tmp, "state", "agents.sqlite3"))
        try:
            counts = dict(
                db.execute(
                    "SELECT card_type, count(*) FROM cards WHERE card_type IN "
                    "('tool.call', 'sys.huh', 'llm.message') GROUP BY card_type"
                ).fetchall()
            )
            # Each refusal with the model message it answers (the last one before it in
            # its box) and that message's completion tokens: a message the token limit
            # cut holds an unfinished call, which no grammar can make whole.
            refusals = db.execute(
                "SELECT h.seq, (SELECT s.completion_tokens FROM cards m JOIN agent_steps s "
                "ON s.step_id = json_extract(m.metadata, '$.step_id') WHERE m.box_id = "
                "h.box_id AND m.card_type = 'llm.message' AND m.seq < h.seq ORDER BY m.seq "
                "DESC LIMIT 1) FROM cards h WHERE h.card_type = 'sys.huh'"
            ).fetchall()
        finally:
            db.close()
    cut = sum(1 for _, tokens in refusals if tokens is not None and tokens >= args.turn_max_tokens)
    calls, refused = counts.get("tool.call", 0), counts.get("sys.huh", 0) - cut
    return {
        "constrain": constrain,
        "turns": answers,
        "correct_answers": correct,
        "tool_calls": calls,
        "refused_payloads": refused,
        "accepted_share": round(calls / (calls + refused), 3) if calls + refused else None,
        "refusals_of_replies_cut_at_max_tokens": cut,
        "model_messages": counts.get("llm.message", 0),
        "seconds_per_turn": round(elapsed / answers, 2) if answers else None,
    }


async def bench_grammar_cost(args: argparse.Namespace) -> dict[str, Any]:
    """ms per generated token on the same prompts with the calculator's reply grammar and
    without it (the outputs differ, the per-token cost is what compares)."""
    from agentserver.core.payloads import PayloadType
    from agentserver.core.xsd_gbnf import reply_grammar
    from agentserver.listeners import calculator

    types = [
        PayloadType.from_model(m)
        for m in (calculator.Add, calculator.Subtract, calculator.Multiply, calculator.Divide)
    ]
    grammar = reply_grammar(types, agent="assistant")
    system = (
        "You can call a calculator by writing XML such as "
        '<add xmlns="urn:agentserver:calculator"><a>1</a><b>2</b></add>.'
    )
    config = parse_llm_section(llm_element(args.model_path, args.n_ctx, args.threads))
    out: dict[str, Any] = {}
    rng = random.Random(args.seed)
    async with Router(config, environ={}) as router:
        for label, g in (("without", None), ("with", grammar)):
            per_token = []
            for _ in range(args.requests):
                a, b = rng.randint(1, 99), rng.randint(1, 99)
                request = Request(
                    [Message.system(system), Message.user(f"What is {a}+{b}?")],
                    model="local",
                    max_tokens=args.max_tokens,
                    temperature=0,
                    grammar=g,
                )
                first = None
                async with router.stream(request) as stream:
                    async for item in stream:
                        if isinstance(item, str):
                            first = first or time.perf_counter()
                        else:
                            done = item
                end = time.perf_counter()
                n = done.usage.completion_tokens
                if first is not None and n > 1:
                    per_token.append((end - first) * 1000 / (n - 1))
            out[f"ms_per_token_{label}_grammar"] = (
                round(statistics.median(per_token), 2) if per_token else None
            )
    w, wo = out.get("ms_per_token_with_grammar"), out.get("ms_per_token_without_grammar")
    out["grammar_ms_per_token"] = round(w - wo, 2) if w is not None and wo is not None else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=0)
    parser.add_argument(
        "--turn-max-tokens",
        type=int,
        default=256,
        help="the Turns' agent max-tokens (a reply cut there holds an unfinished call)",
    )
    parser.add_argument(
        "--only-turns",
        action="store_true",
        help="skip the speed parts (the shares do not depend on timing)",
    )
    parser.add_argument("--model-path", default="packaged:smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=46)
    args = parser.parse_args()
    path = resolve_model_path(args.model_path)
    result: dict[str, Any] = {
        "bench": "local_model",
        "model": path.name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "cpus": os.cpu_count(),
    }
    if not args.only_turns:
        result["ours"] = trio.run(bench_ours, args)
        print("ours (llama-cpp backend, in process):", result["ours"], flush=True)
        result["llama_cpp_server"] = bench_server(args, path)
        print("llama_cpp.server (OpenAI-compatible, loopback):", result["llama_cpp_server"])
        result["grammar_cost"] = trio.run(bench_grammar_cost, args)
        print("grammar cost:", result["grammar_cost"], flush=True)
    if args.turns:
        result["turns_with_grammar"] = trio.run(bench_turns, args, True)
        print("Turns, grammar on:", result["turns_with_grammar"], flush=True)
        result["turns_without_grammar"] = trio.run(bench_turns, args, False)
        print("Turns, grammar off:", result["turns_without_grammar"], flush=True)
    print(json.dumps(result))
    return 1 if "unavailable" in result.get("llama_cpp_server", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
