"""Chaos bench: the real server under faults, and a checker of what every client got.

    python bench/chaos.py --minutes M --seed S --store sqlite|postgresql --processes 1|2
                          [--store-url URL] [--out DIR] [--drain S]
                          [--retention] [--budget-tokens N] [--deploy]

Starts ``agentserver run`` (one process, or two on one PostgreSQL store) on a generated
boot.xml: three agents (``alpha``, ``beta``, ``gamma``) whose tools are ``stamp`` (local,
random delays and exceptions), ``relay`` (remote: ``agentserver runner``, killed at random
and restarted) and ``pay`` (``require-approval``, decided by the named client
``approver``, who comes and goes); the model is bench/support/chaos_model.py on loopback (429 with
Retry-After, 5xx, hangs past ``llm-timeout``, malformed tool calls). Four named clients
(two with acknowledgements, two without) send tasks, disconnect at random (also just as
their answer is about to be ready) and reconnect to any live server; a server process is
SIGKILLed every 20-60 s and restarted; the operator stops and cancels tasks with the CLI.
``alpha`` keeps a conversation per client, and the clients double-text it with a
``multitask`` override (bench/support/chaos_multitask.py), over the socket and over the
HTTP API (``POST /v1/messages?multitask=``). An A2A client sends tasks to ``beta`` and
``gamma`` (``<expose-a2a>``) and follows them through the kills: streams, resubscribes,
cancels, a share of them on A2A 0.3's wire (bench/support/chaos_a2a.py). Issue 47's
doors: the client ``mcp`` calls ``beta`` and ``gamma`` as MCP tools at ``/mcp``
(``<expose-mcp>``), at 2026-07-28 as tasks followed with ``tasks/get`` on any live
server and sometimes cancelled (``tasks/cancel``), at 2025-11-25 as plain calls
(bench/support/chaos_mcp.py); the client ``agui`` runs them at ``POST /agui/agents/NAME``,
reading the SSE stream, dropping it now and then and posting the same run again on any
live server (bench/support/chaos_agui.py). ``--retention`` prunes with short windows
(bench/support/chaos_retention.py); ``--budget-tokens N`` gives clients ``c1``, ``c2``,
``a2a``, ``mcp`` and ``agui`` a budget of N tokens that runs out
(bench/support/chaos_budget.py). ``--deploy`` (issue 49, bench/support/chaos_deploy.py):
two boot files, ``v1`` (the agents ``version="v1"``, ``gamma`` pinned) and ``v2`` (every
prompt changed, ``alpha`` without ``relay``); every 25-50 s the server processes are
replaced one by one (two on PostgreSQL: a rolling deploy, both versions live for a
while), alternately onto v2 and back onto v1, each drained (``agentserver drain --wait``)
or sent SIGTERM; the checker adds that no pinned Turn ran on two versions. Every random
choice comes from ``--seed``.

After ``--minutes`` the faults stop (and no new task is sent); every task the server took
must then be answered within ``--drain`` s (120). bench/support/chaos_check.py checks the ledger
against the store (which tasks were taken). Progress lines go to standard error; the last
line on standard output is one JSON object with the counts. Exit status 1 on any
violation, printing the command line that reproduces the run. docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shlex
import shutil
import sys
import tempfile
import time
import uuid

import trio

# The chaos bench's modules (bench/support/: library modules, not benches).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from chaos_a2a import CLIENT as A2A_CLIENT
from chaos_a2a import A2aClient, check_a2a, expose_a2a_xml
from chaos_agui import CLIENT as AGUI_CLIENT
from chaos_agui import AguiClient, check_agui
from chaos_budget import (
    DEFAULT_TOKENS,
    WorstCase,
    budget_element,
    check_budgets,
    client_budget,
    refusal_violations,
)
from chaos_check import Ledger, check, failure_reason
from chaos_clients import (
    TOKEN,
    Approver,
    Operator,
    Servers,
    Switches,
    TaskClient,
    token_env,
    token_of,
)
from chaos_deploy import (
    REMOVED_TOOL,
    V1,
    V2,
    Deployer,
    agent_attrs,
    agent_end,
    check_versions,
    read_versions,
    tools_of,
)
from chaos_hooks import SECRET_ENV as HOOK_SECRET_ENV
from chaos_hooks import HookReceiver, await_hooks, check_hooks, ended_turns, webhooks_xml
from chaos_hooks import new_secret as hook_secret
from chaos_mcp import CLIENT as MCP_CLIENT
from chaos_mcp import McpClient, check_mcp, expose_mcp_xml, nonce_threads
from chaos_model import ChaosModel, plan_for
from chaos_multitask import MEMORY_AGENT
from chaos_oracle import Oracle
from chaos_procs import RunnerSlot, ServerSlot, child_env
from chaos_retention import SizeWatch, with_retention
from chaos_schedules import SCHEDULES_XML, check_schedules
from chaos_tools import AGENTS, EFFECTS_ENV, proof_text, read_effects

LLM_TIMEOUT = 4.0
CLIENTS = (("c0", True), ("c1", False), ("c2", True), ("c3", False))
#: The clients of the HTTP doors, each with a token of its own.
DOOR_CLIENTS = (A2A_CLIENT, MCP_CLIENT, AGUI_CLIENT)
#: ``--deploy``'s operator, whose token is its own (over HTTP the token names the client:
#: ``ops`` shares the approver's), for ``agentserver drain``.
DEPLOYER = "deployer"


#: The agent with memory folds its conversations early: a small window (the model answers
#: the summary requests, chaos_model.py), so its memory stays bounded through a long soak
#: and compaction runs among the faults. A task (its calls and results) fits ``keep-recent``.
MEMORY_WINDOW = ' context-window="3000" context-reserve="500" max-tokens="500" keep-recent="1000"'


def memory(agent: str) -> str:
    """The double texts' agent keeps a conversation per client (chaos_multitask.py)."""
    return ' memory="client"' + MEMORY_WINDOW if agent == MEMORY_AGENT else ""


def peers(agent: str, version: str | None) -> str:
    return " ".join(tools_of(agent, version))


def boot_xml(
    model_url: str,
    postgres: bool,
    retention: bool = False,
    budget_tokens: int | None = None,
    hooks: str = "",
    version: str | None = None,
) -> str:
    """The boot.xml; ``version`` (``--deploy``): v1 or v2 of the agents
    (bench/support/chaos_deploy.py), with the deployer's operator client."""
    store = (
        '<store url-env="CHAOS_STORE_URL" worker-concurrency="4" watchdog-interval="0.5" '
        'lease="2" heartbeat="0.5"/>'
        if postgres
        else '<store path="state/agents.sqlite3" worker-concurrency="4" watchdog-interval="0.5"/>'
    )
    if retention:
        store = with_retention(store)
    # Each task client (and the A2A client) has a token of its own: over HTTP the bearer
    # token alone names the client. Small budgets on some (``--budget-tokens``).
    clients = "\n".join(
        f'    <client name="{name}" token-env="{token_env(name)}">'
        f"{client_budget(name, budget_tokens)}</client>"
        for name in [*(n for n, _ in CLIENTS), *DOOR_CLIENTS]
    )
    if version is not None:
        clients += (
            f'\n    <client name="{DEPLOYER}" token-env="{token_env(DEPLOYER)}" operator="true"/>'
        )
    agents = "\n".join(
        f"""    <listener name="{agent}" handler="chaos_tools:agent_placeholder" agent="true"
              peers="{peers(agent, version)}">
      <accepts type="chaos_tools:{agent.title()}Task"/>
      <responds type="chaos_tools:{agent.title()}Answer"/>
      <agent model="m" max-steps="12" resume-deadline="60" llm-timeout="{LLM_TIMEOUT}"
             step-retries="3" step-retry-base="1" max-retry-after="5"{memory(agent)}{
            agent_attrs(agent, version)
        }{agent_end(agent, version)}
      <policy default="allow">
        <rule priority="1" id="payments" decision="require-approval" target="pay"
              approver="approver" timeout="45s"/>
      </policy>
    </listener>"""
        for agent in AGENTS
    )
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="chaos">
  <limits hello-timeout="2" read-timeout="5" drain-timeout="1" write-timeout="5"/>
  {budget_element(DEFAULT_TOKENS)}
  <clients>
{clients}
    <client name="approver" token-env="CHAOS_TOKEN"/>
    <client name="ops" token-env="CHAOS_TOKEN" operator="true"/>
    <client name="relay-runner" token-env="CHAOS_TOKEN" serves="relay"/>
  </clients>
  <llm max-attempts="3" timeout="30">
    <backend name="chaos" provider="openai" base-url="{model_url}" api-key-env="CHAOS_LLM_KEY"
             timeout="30">
      <model name="m"/>
    </backend>
  </llm>
  {store}
  <listeners>
    <listener name="stamp" handler="chaos_tools:stamp">
      <accepts type="chaos_tools:Stamp"/>
      <responds type="chaos_tools:Stamped"/>
    </listener>
    <listener name="relay" remote="true" step-timeout="6" idempotent="true" retries="3">
      <accepts type="chaos_tools:Relay"/>
      <responds type="chaos_tools:Stamped"/>
    </listener>
    <!-- agentserver console's router: the approver's /approve and /deny go through it -->
    <listener name="console-router" handler="console-router" peers="alpha beta gamma"/>
    <listener name="pay" handler="chaos_tools:pay">
      <accepts type="chaos_tools:Pay"/>
      <responds type="chaos_tools:Stamped"/>
    </listener>
{agents}
  </listeners>
  {SCHEDULES_XML}
  {expose_a2a_xml()}
  {expose_mcp_xml()}
{hooks}</organism>
"""


def expected_proofs(seed: int, deploy: bool = False):
    """The proofs a successful answer carries. ``deploy``: a task of an agent whose
    version lacks ``relay`` may answer ``relay=removed`` instead of its proof."""

    def expected(nonce: str, text: str) -> list[list[str]]:
        plan = plan_for(seed, nonce)
        bases = [[proof_text("stamp", nonce)]]
        if plan.relay:
            bases = [[*bases[0], proof_text("relay", nonce)]]
            if deploy:
                bases.append([*bases[0][:1], f"{REMOVED_TOOL}=removed"])
        if not plan.pay:
            return bases
        return [alt for b in bases for alt in ([*b, proof_text("pay", nonce)], [*b, "pay=refused"])]

    return expected


def say(start: float, text: str) -> None:
    print(f"[chaos {time.monotonic() - start:7.1f}s] {text}", file=sys.stderr, flush=True)


async def chaos(args: argparse.Namespace) -> int:
    start = time.monotonic()
    seed = args.seed
    out = pathlib.Path(args.out)
    postgres = args.store == "postgresql"
    pg_url = args.store_url if postgres else None
    dropdb = None
    if postgres and pg_url is None:
        pg_url, dropdb = make_database()
    ledger = Ledger()
    switches = Switches()
    clients: dict[str, TaskClient] = {}
    nonce_owner: dict[str, TaskClient] = {}
    rng = random.Random(f"{seed}:bench")

    def on_final(nonce: str) -> None:
        owner = nonce_owner.get(nonce)
        if owner is not None and switches.faults and rng.random() < 0.25:
            owner.leave_now.set()

    verdict = None
    drained = 0.0
    try:
        async with trio.open_nursery() as nursery:
            model = await ChaosModel(seed, LLM_TIMEOUT, on_final=on_final).start(nursery)
            worst = WorstCase()
            model.decide = worst.watch(model.decide)  # type: ignore[method-assign]
            boot_dir = out / "organism"
            hooks = await HookReceiver(seed, hook_secret(seed)).start(nursery)
            env = child_env(boot_dir, CHAOS_TOKEN=TOKEN, CHAOS_LLM_KEY="chaos-key")
            for name in [*(n for n, _ in CLIENTS), *DOOR_CLIENTS, DEPLOYER]:
                env[token_env(name)] = token_of(name)
            env[HOOK_SECRET_ENV] = hooks.secret
            env[EFFECTS_ENV] = str(out / "effects.log")
            if pg_url:
                env["CHAOS_STORE_URL"] = pg_url
            boot = boot_dir / "boot.xml"
            # --deploy: boot.xml is v1, boot-v2.xml v2 (one folder: one store path).
            boots = {V1: boot, V2: boot_dir / "boot-v2.xml"} if args.deploy else {None: boot}
            for version, path in boots.items():
                await trio.Path(path).write_text(
                    boot_xml(
                        model.base_url,
                        postgres,
                        args.retention,
                        args.budget_tokens,
                        webhooks_xml(hooks.url),
                        version,
                    )
                )
            sizes = SizeWatch(None if postgres else boot_dir / "state" / "agents.sqlite3", pg_url)
            oracle = Oracle(sizes.sqlite_path, pg_url, sizes.tombstones)
            if args.retention:
                nursery.start_soon(sizes.run)
            slots = [ServerSlot(i, boot, env, out) for i in range(args.processes)]
            for slot in slots:
                await slot.start()
            say(start, f"{len(slots)} server(s) up; logs in {out}")
            servers = Servers(slots)
            runners = [RunnerSlot(slot, {**env, "AGENTSERVER_TOKEN": TOKEN}, out) for slot in slots]
            for runner in runners:
                nursery.start_soon(keep_runner, runner, switches)
            for name, acks in CLIENTS:
                client = TaskClient(
                    name,
                    acks,
                    seed,
                    servers,
                    ledger,
                    switches,
                    oracle.taken,
                    stored_answers=oracle.stored_answers,
                )
                clients[name] = client
                nursery.start_soon(client.run)
            a2a = A2aClient(seed, servers, switches, token_of(A2A_CLIENT))
            nursery.start_soon(a2a.run)
            mcp = McpClient(seed, servers, switches, token_of(MCP_CLIENT))
            nursery.start_soon(mcp.run)
            agui = AguiClient(seed, servers, switches, token_of(AGUI_CLIENT))
            nursery.start_soon(agui.run)
            approver = Approver(seed, servers, switches, env)
            nursery.start_soon(approver.run)
            nursery.start_soon(Operator(seed, servers, switches, ledger, env).run)
            nursery.start_soon(kill_servers, slots, switches, rng, start)
            nursery.start_soon(kill_runners, runners, switches, rng)
            sqlite_path = None if postgres else boot_dir / "state" / "agents.sqlite3"
            deployer = Deployer(
                slots,
                {v: p for v, p in boots.items() if v is not None},
                {**env, "AGENTSERVER_TOKEN": token_of(DEPLOYER)},
                seed,
                lambda: switches.faults,
                lambda text: say(start, text),
                sqlite_path,
                pg_url,
            )
            if args.deploy:
                nursery.start_soon(deployer.run)

            async def track_owners() -> None:
                while True:
                    for attempt in ledger.attempts.values():
                        nonce_owner.setdefault(attempt.nonce, clients[attempt.client])
                    await trio.sleep(0.2)

            nursery.start_soon(track_owners)
            deadline = start + args.minutes * 60
            while time.monotonic() < deadline:
                await trio.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
                say(start, progress(ledger, switches, model))
            # The faults stop: no kills, no leaving, no model faults, no new tasks.
            switches.faults = False
            switches.sending = False
            model.faults_on = False
            hooks.faults = False
            if args.deploy:
                await deployer.stop()  # a deploy round under way ends first
            with trio.move_on_after(30):  # a killed server's restart under way
                for slot in slots:
                    while not slot.alive:
                        await slot.changed.wait()
            for slot in slots:
                async with slot.lock:
                    if not slot.alive:
                        await slot.start()
            say(start, "faults stopped; draining")
            drain_end = time.monotonic() + args.drain
            while time.monotonic() < drain_end:
                if args.deploy:  # a pinned Turn waiting for a version nobody serves
                    await deployer.settle(time.monotonic())
                refs = await oracle.refs()
                pending = [a for c in clients for a in ledger.open_attempts(c)]
                taken_open = [a for a in pending if a.thread in refs]
                if not pending and not a2a.open() and not mcp.open() and not agui.open():
                    break
                say(
                    start,
                    f"drain: {len(pending)} open ({len(taken_open)} taken), "
                    f"{a2a.open()} A2A tasks, {mcp.open()} MCP calls, "
                    f"{agui.open()} AG-UI runs open",
                )
                await trio.sleep(2.0)
            drained = time.monotonic() - (drain_end - args.drain)
            switches.stop = True
            await trio.sleep(1.0)
            refs = await oracle.refs()
            taken = {t for t in ledger.attempts if t in refs}
            verdict = check(
                ledger,
                taken,
                expected_proofs(seed, args.deploy),
                memory_agents={MEMORY_AGENT},
                rows=await oracle.rows(),
                model_nonces=model.nonces_seen,
                effects=read_effects(env[EFFECTS_ENV]),
            )
            await a2a.settle()
            a2a_counts, a2a_violations = check_a2a(
                a2a.tasks, expected_proofs(seed, args.deploy), internal_errors=a2a.internal_errors
            )
            a2a_counts.update(
                {k: v for k, v in sorted(a2a.counts.items()) if not k.startswith("seen:")}
            )
            verdict.counts.update(a2a_counts)
            await mcp.settle()
            payloads = await oracle.turn_payloads()
            replies = await oracle.reply_rows()
            gone = await oracle.pruned()
            mcp_counts, mcp_violations = check_mcp(
                mcp.calls,
                expected_proofs(seed, args.deploy),
                nonce_threads(payloads, [c.nonce for c in mcp.calls]),
                replies,
                lambda thread: thread in gone,
                internal_errors=mcp.internal_errors,
            )
            mcp_counts.update(
                {k: v for k, v in sorted(mcp.counts.items()) if not k.startswith("seen:")}
            )
            verdict.counts.update(mcp_counts)
            agui_counts, agui_violations = check_agui(
                agui.runs,
                expected_proofs(seed, args.deploy),
                nonce_threads(payloads, [r.nonce for r in agui.runs]),
                replies,
            )
            agui_counts.update(dict(sorted(agui.counts.items())))
            verdict.counts.update(agui_counts)
            spend, overspent = await check_budgets(oracle.sqlite_path, pg_url, worst)
            refused = [
                (a.client, a.thread, a.text)
                for a in ledger.answers
                if a.failed and failure_reason(a.text) == "budget"
            ] + [
                (A2A_CLIENT, t.message_id, text)
                for t in a2a.tasks
                for _, state, text in t.ends[:1]
                if state == "failed" and failure_reason(text) == "budget"
            ]
            refused += [
                (MCP_CLIENT, c.nonce, text)
                for c in mcp.calls
                for _, _, text, is_error in c.ends[:1]
                if is_error and failure_reason(text) == "budget"
            ]
            refused += [
                (AGUI_CLIENT, r.nonce, text)
                for r in agui.runs
                for kind, text in r.ends[:1]
                if kind.startswith(("error:", "refused:")) and failure_reason(text) == "budget"
            ]
            refusal_counts, misrefused = refusal_violations(refused, args.budget_tokens)
            spend.update(refusal_counts)
            verdict.counts.update(spend)
            more = [*a2a_violations, *mcp_violations, *agui_violations, *overspent, *misrefused]
            verdict.violations.extend(more)
            verdict.counts["violations"] = int(verdict.counts["violations"]) + len(more)
            sched_counts, sched_violations = await trio.to_thread.run_sync(
                check_schedules,
                oracle.sqlite_path,
                pg_url,
                time.time(),
                set(sizes.tombstones),
                dict(sizes.runs),
            )
            verdict.counts.update(sched_counts)
            verdict.violations.extend(sched_violations)
            verdict.counts["violations"] = int(verdict.counts["violations"]) + len(sched_violations)
            await await_hooks(hooks, lambda: ended_turns(sqlite_path, pg_url), 60.0)
            hook_counts, hook_violations = check_hooks(
                hooks, await ended_turns(sqlite_path, pg_url)
            )
            verdict.counts.update(hook_counts)
            verdict.counts["violations"] = int(str(verdict.counts["violations"])) + len(
                hook_violations
            )
            verdict.violations.extend(hook_violations)
            if args.deploy:
                deploy_counts, deploy_violations = check_versions(
                    *await trio.to_thread.run_sync(read_versions, sqlite_path, pg_url)
                )
                deploy_violations = [*deployer.violations, *deploy_violations]
                deploy_counts.update(deployer.figures())
                deploy_counts["model_requests_by_prompt"] = dict(
                    sorted(model.stats.prompts.items())
                )
                verdict.counts.update(deploy_counts)
                verdict.violations.extend(deploy_violations)
                verdict.counts["violations"] = int(str(verdict.counts["violations"])) + len(
                    deploy_violations
                )
            await trio.Path(out / "ledger.json").write_text(ledger_json(ledger, taken))
            for slot in slots:
                await slot.terminate()
            nursery.cancel_scope.cancel()
    finally:
        if dropdb is not None:
            dropdb()
    assert verdict is not None
    counts = dict(verdict.counts)
    counts.update(
        {
            "seed": seed,
            "minutes": args.minutes,
            "store": args.store,
            "processes": args.processes,
            "kills": switches.counts.get("kills", 0),
            "disconnects": switches.counts.get("disconnects", 0),
            "disconnects_before_answer": switches.counts.get("disconnects_before_answer", 0),
            "resends": switches.counts.get("resends", 0),
            "model_requests": model.stats.requests,
            "model_summaries": model.stats.summaries,
            "model_faults": sum(model.stats.faults.values()),
            "model_faults_by_kind": dict(sorted(model.stats.faults.items())),
            "runner_kills": sum(r.kills for r in runners),
            "approvals": switches.counts.get("approvals", 0),
            "console_decisions": switches.counts.get("console_decisions", 0),
            "console_decisions_applied": switches.counts.get("console_decisions_applied", 0),
            "denials": switches.counts.get("denials", 0),
            "stops": switches.counts.get("stops", 0),
            "cancels": switches.counts.get("cancels", 0),
            "stops_effective": switches.counts.get("stops_effective", 0),
            "ack_duplicates_dropped": switches.counts.get("ack_duplicates_dropped", 0),
            "drain_seconds": round(drained, 1),
            "retention": args.retention,
            "budget_tokens": args.budget_tokens,
            "deploy": args.deploy,
            **(sizes.figures() if args.retention else {}),
            "seconds": round(time.monotonic() - start, 1),
        }
    )
    for line in verdict.violations:
        print(f"VIOLATION: {line}", file=sys.stderr)
    if not verdict.ok:
        print(
            "reproduce with: " + shlex.join([sys.executable, *sys.argv]) + f"  (seed {seed})",
            file=sys.stderr,
        )
    print(json.dumps(counts))
    return 0 if verdict.ok else 1


def ledger_json(ledger: Ledger, taken: set[str]) -> str:
    """Every attempt with what its client was handed, for reading after a run."""
    answers: dict[str, list] = {}
    for answer in ledger.answers:
        answers.setdefault(answer.thread, []).append([answer.client, answer.failed, answer.text])
    refusals = {r.thread: r.text for r in ledger.refusals}
    return json.dumps(
        [
            {
                "thread": a.thread,
                "client": a.client,
                "agent": a.agent,
                "nonce": a.nonce,
                "multitask": a.multitask,
                "racing": a.racing,
                "via": a.via,
                "taken": a.thread in taken,
                "resent": a.thread in ledger.resent,
                "answers": answers.get(a.thread, []),
                "refusal": refusals.get(a.thread),
            }
            for a in ledger.attempts.values()
        ],
        indent=1,
    )


def progress(ledger: Ledger, switches: Switches, model: ChaosModel) -> str:
    return (
        f"attempts={len(ledger.attempts)} answers={len(ledger.answers)} "
        f"refusals={len(ledger.refusals)} model={model.stats.requests} "
        f"faults={sum(model.stats.faults.values())} "
        + " ".join(f"{k}={v}" for k, v in sorted(switches.counts.items()))
    )


async def keep_runner(runner: RunnerSlot, switches: Switches) -> None:
    """Run the slot's runner, restarting it whenever it exits (killed, or its server was)."""
    while not switches.stop:
        if not runner.server.alive:
            await trio.sleep(0.2)
            continue
        await runner.run_once()
        await trio.sleep(0.5)


async def kill_servers(
    slots: list[ServerSlot], switches: Switches, rng: random.Random, start: float
) -> None:
    """SIGKILL a server every 20-60 s; restart it (one process: soon; two: the survivor
    carries on meanwhile). Not while a deploy replaces it (``slot.lock``)."""
    while True:
        await trio.sleep(rng.uniform(20, 60))
        if not switches.faults:
            return
        slot = rng.choice([s for s in slots if s.alive] or slots)
        async with slot.lock:  # (a deploy may have held it past the faults' end)
            if not switches.faults:
                return
            await slot.kill()
            switches.count("kills")
            say(start, f"SIGKILL server {slot.index}")
            await trio.sleep(rng.uniform(0.5, 3.0) if len(slots) == 1 else rng.uniform(2.0, 10.0))
            await slot.start()


async def kill_runners(runners: list[RunnerSlot], switches: Switches, rng: random.Random) -> None:
    while True:
        await trio.sleep(rng.uniform(10, 40))
        if not switches.faults:
            return
        rng.choice(runners).kill()


def make_database() -> tuple[str, object]:
    """A new database on the server the PG* variables name, and a function dropping it."""
    from urllib.parse import quote, urlencode

    import psycopg
    from psycopg import sql

    name = f"agentserver_chaos_{uuid.uuid4().hex[:12]}"
    with psycopg.connect("", autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        info = conn.info
        host, port, user, password = info.host, info.port, info.user, info.password
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    if host.startswith("/"):
        url = f"postgresql://{auth}@/{name}?" + urlencode({"host": host, "port": port})
    else:
        url = f"postgresql://{auth}@{host}:{port}/{name}"

    def drop() -> None:
        with psycopg.connect("", autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    return url, drop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--store-url", help="postgresql://... (default: a new database on PG*)")
    parser.add_argument("--out", help="directory for boot.xml, the store and the logs")
    parser.add_argument("--drain", type=float, default=120.0, help="seconds to answer all")
    parser.add_argument(
        "--retention",
        action="store_true",
        help="the store prunes with short windows during the run (bench/support/chaos_retention.py)",
    )
    parser.add_argument(
        "--budget-tokens",
        type=int,
        default=None,
        help="a total budget of N tokens on clients c1, c2, a2a, mcp and agui, which runs out "
        "(bench/support/chaos_budget.py; default: none)",
    )
    parser.add_argument(
        "--deploy",
        action="store_true",
        help="two versions of the agents; the server processes replaced one by one under "
        "load, onto v2 and back (bench/support/chaos_deploy.py)",
    )
    args = parser.parse_args(argv)
    if args.processes == 2 and args.store != "postgresql":
        parser.error("--processes 2 needs --store postgresql")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
    args.out = str(out)
    # The servers and runners import chaos_tools from boot.xml's folder (not bench/, whose
    # socket.py and http.py would come before the standard library's there).
    (out / "organism").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(
        pathlib.Path(__file__).parent / "support" / "chaos_tools.py",
        out / "organism" / "chaos_tools.py",
    )
    return trio.run(chaos, args)


if __name__ == "__main__":
    sys.exit(main())
