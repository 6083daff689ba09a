"""The chaos bench's checker, sans-IO (bench/chaos.py; docs/reliability.md).

A :class:`Ledger` records what the clients did and what their applications were handed:
each *attempt* (one task sent on one thread by one client; a resend is a new attempt of the
same logical task, the same nonce), each answer handed to a client's application, each
refusal. :func:`check` then compares it with what the server *took* (the attempts whose
task has an inbox row in the store, the oracle read after the run) and returns the counts
and the violations:

- every taken attempt has exactly one answer handed to the application of the client that
  sent it (none: ``lost``; more: ``duplicates``);
- no answer reaches another client (``wrong_client``) or names a thread nobody sent
  (``unknown``); an attempt not taken gets no answer (``answered_untaken``);
- a successful answer proves it saw its own tool results (``wrong_content``: the proofs
  ``expected(nonce)`` lists are not all in it); a failed answer (``status="failed"``) is
  counted apart, by reason;
- double texting (docs/runs.md; :func:`double_text_violations`): the answers only a
  double text can cause (busy, interrupted, rolled back, superseded) go only to the tasks
  whose mode and conversation allow them, a rejected or superseded task never ran a Turn,
  an interrupt or a rollback ends every earlier task of its conversation still open when
  it arrived (the store's rows: :class:`TaskRow`), and no call of a non-idempotent tool
  had its effect twice (the tools' effect log, keyed by the call's idempotency key).

Pure: no I/O, no clock; memory is bounded by the attempts and answers recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

#: Words of a failed answer's text, in the order tried, and the reason counted.
FAILURE_REASONS = (
    # The double-texting answers (agents/store/sql/multitask.py), before "stopped" etc.
    ("conversation is busy", "busy"),
    ("interrupted: a newer task", "interrupted"),
    ("rolled back: a newer task", "rolled_back"),
    ("superseded: a newer task", "superseded"),
    ("budget exhausted", "budget"),  # issue 37 (bench/support/chaos_budget.py)
    ("cancel", "cancelled"),
    ("stopped", "stopped"),
    ("step retries", "model_gave_up"),
    ("did not answer within", "model_timeout"),
    ("timed out", "timed_out"),
    ("timeout", "timed_out"),
    ("max-steps", "max_steps"),
    ("steps", "max_steps"),
    ("model", "model_error"),
)


#: The failed answers only a double text causes (docs/runs.md), by reason.
DOUBLE_TEXT_REASONS = ("busy", "interrupted", "rolled_back", "superseded")
#: The tools whose effect must happen at most once per call. ``relay`` is declared
#: ``idempotent``: its retries repeat a call's key by design (the tool must dedupe).
ONCE_ONLY_TOOLS = ("stamp", "pay")
#: One tool effect, as the tools log it: (tool, nonce, the call's idempotency key).
Effect = tuple[str, str, str]
#: Seconds an earlier task may seem to end after a double text arrived and still have
#: ended before it: both times are the wall clock of one host, each taken inside its
#: transaction (an end's before its commit, an arrival's after its reads).
CLOCK_SLACK_S = 0.25


@dataclass(frozen=True, slots=True)
class TaskRow:
    """What the store shows of one task (its inbox row), read after the run."""

    #: The row's place in the inbox (the order the server took the tasks in).
    seq: int
    #: When the task's row was written (its transaction, after it read the head).
    created_at: float
    #: The head ever leased it a Turn.
    ran: bool
    #: When its answer was written (its first reply row; None: none).
    ended_at: float | None


def failure_reason(text: str) -> str:
    lowered = text.lower()
    for word, reason in FAILURE_REASONS:
        if word in lowered:
            return reason
    return "other"


@dataclass(frozen=True, slots=True)
class Attempt:
    client: str
    thread: str
    nonce: str
    agent: str
    #: The task's ``multitask`` override on its envelope (None: the agent's own mode).
    multitask: str | None = None
    #: Sent while an earlier task of this client to this agent had no answer yet: a
    #: double text if the agent keeps a conversation per client.
    racing: bool = False
    #: How it was sent: ``socket`` (her connection) or ``http`` (``POST /v1/messages``).
    via: str = "socket"


@dataclass(frozen=True, slots=True)
class Answer:
    client: str
    thread: str
    text: str
    failed: bool


@dataclass
class Ledger:
    """What happened, as the clients saw it."""

    attempts: dict[str, Attempt] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    refusals: list[Answer] = field(default_factory=list)
    resent: set[str] = field(default_factory=set)

    def sent(
        self,
        client: str,
        thread: str,
        nonce: str,
        agent: str,
        multitask: str | None = None,
        racing: bool = False,
        via: str = "socket",
    ) -> Attempt:
        attempt = Attempt(client, thread, nonce, agent, multitask, racing, via)
        self.attempts[thread] = attempt
        return attempt

    def answered(self, client: str, thread: str, text: str, failed: bool) -> None:
        self.answers.append(Answer(client, thread, text, failed))

    def refused(self, client: str, thread: str, text: str) -> None:
        self.refusals.append(Answer(client, thread, text, True))

    def resend(self, thread: str) -> None:
        self.resent.add(thread)

    def answer_count(self, thread: str) -> int:
        return sum(1 for a in self.answers if a.thread == thread)

    def open_attempts(self, client: str) -> list[Attempt]:
        """The attempts of ``client`` with no answer and no refusal, not resent."""
        done = {a.thread for a in self.answers} | {a.thread for a in self.refusals}
        return [
            a
            for a in self.attempts.values()
            if a.client == client and a.thread not in done and a.thread not in self.resent
        ]


@dataclass(frozen=True, slots=True)
class StoredAnswers:
    """What the store wrote as a task's answer (its reply rows: text, failed), for an
    HTTP task whose exchange a kill lost; ``pruned``: retention removed it first."""

    answers: list[tuple[str, bool]]
    pruned: bool = False


@dataclass
class Verdict:
    counts: dict[str, object]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations


def content_proves(text: str, nonce: str, expected: Iterable[str]) -> bool:
    return f"nonce={nonce}" in text and all(p in text for p in expected)


def check(
    ledger: Ledger,
    taken: set[str],
    expected: Callable[[str, str], list[list[str]]],
    max_listed: int = 20,
    *,
    memory_agents: Collection[str] = (),
    rows: Mapping[str, TaskRow] | None = None,
    model_nonces: Collection[str] | None = None,
    effects: Iterable[Effect] = (),
) -> Verdict:
    """The verdict over ``ledger``. ``taken``: the threads the store has a task for.
    ``expected(nonce, text)``: the alternatives of proofs a successful answer for
    ``nonce`` must carry (one list must be wholly in it). For double texting
    (:func:`double_text_violations`): ``memory_agents``, the agents keeping a
    conversation per client; ``rows``, per thread whose inbox row the store still has,
    what it shows (None: unknown); ``model_nonces``, the nonces
    the model was asked about (None: unknown); ``effects``, the tools' effect log."""
    by_thread: dict[str, list[Answer]] = {}
    violations: list[str] = []
    wrong_client = unknown = wrong_content = 0
    failed = Counter()
    for answer in ledger.answers:
        attempt = ledger.attempts.get(answer.thread)
        if attempt is None:
            unknown += 1
            violations.append(f"unknown thread answered to {answer.client}: {answer.thread}")
            continue
        if attempt.client != answer.client:
            wrong_client += 1
            violations.append(
                f"answer for {attempt.client}'s {answer.thread} handed to {answer.client}"
            )
            continue
        by_thread.setdefault(answer.thread, []).append(answer)
    answered_once = duplicates = lost = untaken_answered = 0
    for thread, attempt in ledger.attempts.items():
        got = by_thread.get(thread, [])
        if thread not in taken:
            if got:
                untaken_answered += 1
                violations.append(f"answer for {thread} ({attempt.nonce}), not a task in the store")
            continue
        if not got:
            lost += 1
            violations.append(f"lost: {attempt.client} {attempt.agent} {thread} ({attempt.nonce})")
            continue
        if len(got) > 1:
            duplicates += len(got) - 1
            violations.append(f"{len(got)} answers to {attempt.client} on {thread}")
        else:
            answered_once += 1
        first = got[0]
        if first.failed:
            failed[failure_reason(first.text)] += 1
        elif not any(
            content_proves(first.text, attempt.nonce, alt)
            for alt in expected(attempt.nonce, first.text)
        ):
            wrong_content += 1
            violations.append(f"wrong content on {thread} ({attempt.nonce}): {first.text[:300]}")
    dt_counts, dt_violations = double_text_violations(
        ledger, by_thread, taken, memory_agents, rows, model_nonces
    )
    violations.extend(dt_violations)
    fx_counts, fx_violations = repeated_effects(effects, ledger, by_thread)
    violations.extend(fx_violations)
    nonces = {a.nonce for a in ledger.attempts.values()}
    counts: dict[str, object] = {
        "tasks": len(nonces),
        "attempts": len(ledger.attempts),
        "taken": sum(1 for t in ledger.attempts if t in taken),
        "not_taken": sum(1 for t in ledger.attempts if t not in taken),
        "resent": len(ledger.resent),
        "http_tasks": sum(1 for a in ledger.attempts.values() if a.via == "http"),
        "http_tasks_answered_once": sum(
            1
            for t, a in ledger.attempts.items()
            if a.via == "http" and t in taken and len(by_thread.get(t, [])) == 1
        ),
        "refusals": len(ledger.refusals),
        "answered_once": answered_once,
        "duplicates": duplicates,
        "lost": lost,
        "wrong_client": wrong_client,
        "unknown_answers": unknown,
        "answered_untaken": untaken_answered,
        "wrong_content": wrong_content,
        "failed_answers": sum(failed.values()),
        "failed_by_reason": dict(sorted(failed.items())),
        **dt_counts,
        **fx_counts,
        "violations": len(violations),
    }
    return Verdict(counts, violations[:max_listed])


def _taken_after(
    sent: list[Attempt], i: int, taken: set[str], rows: dict[str, TaskRow] | None
) -> list[Attempt]:
    """The tasks of ``sent`` (one client's to one agent) the server took after ``sent[i]``:
    by the store's order (the inbox's ``seq``) where the store shows both rows, else by
    the order she sent them. A double text sent over HTTP goes on a connection of its own
    and may reach the server after a task she sent later over her socket, so the send
    order alone would call a legitimate rollback or interrupt a violation. So where the
    store was read but no longer shows both rows (retention pruned one) and one of the
    two went over HTTP, their order is unknown and the other counts as possibly later."""
    mine = None if rows is None else rows.get(sent[i].thread)
    out = []
    for j, other in enumerate(sent):
        if j == i or other.thread not in taken:
            continue
        theirs = None if rows is None else rows.get(other.thread)
        if mine is not None and theirs is not None:
            if theirs.seq > mine.seq:
                out.append(other)
        elif j > i or (rows is not None and "http" in (other.via, sent[i].via)):
            out.append(other)
    return out


def _first_reason(answers: Mapping[str, list[Answer]], thread: str) -> str | None:
    """The failure reason of the first answer on ``thread`` (None: none, or a success)."""
    got = answers.get(thread)
    if not got or not got[0].failed:
        return None
    return failure_reason(got[0].text)


def double_text_violations(
    ledger: Ledger,
    answers: Mapping[str, list[Answer]],
    taken: Collection[str],
    memory_agents: Collection[str],
    rows: Mapping[str, TaskRow] | None,
    model_nonces: Collection[str] | None,
) -> tuple[dict[str, object], list[str]]:
    """The promises of double texting (docs/runs.md) over the answers the clients were
    handed (``answers``: per thread, those handed to the client that sent it).

    A task with a busy, interrupted, rolled-back or superseded answer must be one that
    only a double text could answer so: sent to an agent that keeps a conversation per
    client (memory-less agents ignore ``multitask``); busy only when the task itself
    asked for ``reject``; interrupted (rolled back) only when a later task of the same
    client to the same agent asked for ``interrupt`` (``rollback``), and it ran a Turn;
    superseded only when a later one asked for either. A rejected or superseded task never
    ran a Turn: the store gave it none (``ran``) and the model was never asked about its
    nonce (``model_nonces``; unless another attempt of the nonce got an answer of its own,
    a resend the oracle raced). That each of these tasks, and the task that interrupted,
    got exactly one answer is :func:`check`'s rule for every task.

    And what an interrupt or a rollback must do: every earlier task of its conversation
    (the store's order) still open when it arrived is ended by it (interrupted, rolled
    back or superseded), not left to end later on its own (:func:`_left_running`)."""
    violations: list[str] = []
    by_mode: Counter = Counter()
    outcomes: Counter = Counter()
    sent_with_mode = 0
    # Each client's tasks to each agent, in the order she sent them (the ledger keeps it).
    order: dict[tuple[str, str], list[Attempt]] = {}
    for attempt in ledger.attempts.values():
        order.setdefault((attempt.client, attempt.agent), []).append(attempt)
    # Nonces some attempt ran for: a reason neither busy nor superseded (so a Turn).
    ran_nonces = {
        a.nonce
        for a in ledger.attempts.values()
        if a.thread in answers and _first_reason(answers, a.thread) not in ("busy", "superseded")
    }
    for (client, agent), sent in order.items():
        for i, attempt in enumerate(sent):
            if attempt.multitask is not None:
                sent_with_mode += 1
                if attempt.racing and agent in memory_agents:
                    by_mode[attempt.multitask] += 1
            reason = _first_reason(answers, attempt.thread)
            if attempt.thread not in taken or reason not in DOUBLE_TEXT_REASONS:
                continue
            outcomes[reason] += 1
            where = f"{client} {agent} {attempt.thread} ({attempt.nonce})"
            if agent not in memory_agents:
                violations.append(f"{reason} answer from an agent without memory: {where}")
                continue
            later = {a.multitask for a in _taken_after(sent, i, taken, rows)}
            if reason == "busy" and attempt.multitask != "reject":
                violations.append(f"busy answer to a task sent with {attempt.multitask}: {where}")
            elif reason == "interrupted" and "interrupt" not in later:
                violations.append(f"interrupted, no later task asked to interrupt: {where}")
            elif reason == "rolled_back" and "rollback" not in later:
                violations.append(f"rolled back, no later task asked to roll back: {where}")
            elif reason == "superseded" and not later & {"interrupt", "rollback"}:
                violations.append(f"superseded, no later interrupt or rollback: {where}")
            row = None if rows is None else rows.get(attempt.thread)
            turn = None if row is None else row.ran
            if reason in ("busy", "superseded"):
                if turn:
                    violations.append(f"{reason}, yet the store gave it a Turn: {where}")
                if model_nonces is not None and attempt.nonce in model_nonces:
                    if attempt.nonce not in ran_nonces:
                        violations.append(f"{reason}, yet the model was asked: {where}")
            elif turn is False:
                violations.append(f"{reason}, yet it never had a Turn: {where}")
    if rows is not None:
        for (_, agent), sent in order.items():
            if agent in memory_agents:
                violations.extend(_left_running(sent, answers, taken, rows))
    counts: dict[str, object] = {
        "multitask_sent": sent_with_mode,
        "double_texts": sum(by_mode.values()),
        "double_texts_by_mode": dict(sorted(by_mode.items())),
        "rejected_busy": outcomes["busy"],
        "interrupted": outcomes["interrupted"],
        "rolled_back": outcomes["rolled_back"],
        "superseded": outcomes["superseded"],
    }
    return counts, violations


def _left_running(
    sent: list[Attempt],
    answers: Mapping[str, list[Answer]],
    taken: Collection[str],
    rows: Mapping[str, TaskRow],
) -> list[str]:
    """One conversation's tasks (``sent``): an interrupt or a rollback that left an
    earlier task of it open. The earlier task's answer was written after the double text
    arrived (by more than :data:`CLOCK_SLACK_S`), so it was open then, yet no double text
    ended it (its answer is its own)."""
    found: list[str] = []
    known = [a for a in sent if a.thread in taken and a.thread in rows]
    for newer in known:
        if newer.multitask not in ("interrupt", "rollback"):
            continue
        if _first_reason(answers, newer.thread) == "busy":
            continue
        arrived = rows[newer.thread]
        for older in known:
            row = rows[older.thread]
            if row.seq >= arrived.seq or row.ended_at is None:
                continue
            if _first_reason(answers, older.thread) in DOUBLE_TEXT_REASONS:
                continue
            late = row.ended_at - arrived.created_at
            if late > CLOCK_SLACK_S:
                found.append(
                    f"{newer.multitask} {newer.thread} left {older.thread} ({older.nonce}) "
                    f"of {older.client} {older.agent} open: it ended {late:.2f} s later"
                )
    return found


def repeated_effects(
    effects: Iterable[Effect], ledger: Ledger, answers: Mapping[str, list[Answer]]
) -> tuple[dict[str, object], list[str]]:
    """No call of a tool in :data:`ONCE_ONLY_TOOLS` had its effect twice (the same
    idempotency key logged twice): neither a Turn a double text ended, nor the task that
    ran next, nor a restart sent a call again that had already run. Also counts the
    effects of the tasks a double text ended (calls already out when their Turn ended)."""
    per_key: Counter = Counter()
    by_kind: Counter = Counter()
    per_nonce: Counter = Counter()
    for kind, nonce, key in effects:
        by_kind[kind] += 1
        per_nonce[nonce] += 1
        if key:
            per_key[kind, key] += 1
    violations = [
        f"tool effect repeated: {kind} call {key} ran {n} times"
        for (kind, key), n in sorted(per_key.items())
        if n > 1 and kind in ONCE_ONLY_TOOLS
    ]
    ended = {
        a.nonce
        for a in ledger.attempts.values()
        if _first_reason(answers, a.thread) in ("interrupted", "rolled_back")
    }
    counts: dict[str, object] = {
        "tool_effects": sum(by_kind.values()),
        "tool_effects_by_kind": dict(sorted(by_kind.items())),
        "tool_effects_repeated": len(violations),
        "idempotent_repeats": sum(
            n - 1 for (kind, _), n in per_key.items() if n > 1 and kind not in ONCE_ONLY_TOOLS
        ),
        "effects_of_ended_turns": sum(per_nonce[n] for n in ended),
    }
    return counts, violations
