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
  counted apart, by reason.

Pure: no I/O, no clock; memory is bounded by the attempts and answers recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: Words of a failed answer's text, in the order tried, and the reason counted.
FAILURE_REASONS = (
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

    def sent(self, client: str, thread: str, nonce: str, agent: str) -> Attempt:
        attempt = Attempt(client, thread, nonce, agent)
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
) -> Verdict:
    """The verdict over ``ledger``. ``taken``: the threads the store has a task for.
    ``expected(nonce, text)``: the alternatives of proofs a successful answer for
    ``nonce`` must carry (one list must be wholly in it)."""
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
    nonces = {a.nonce for a in ledger.attempts.values()}
    counts: dict[str, object] = {
        "tasks": len(nonces),
        "attempts": len(ledger.attempts),
        "taken": sum(1 for t in ledger.attempts if t in taken),
        "not_taken": sum(1 for t in ledger.attempts if t not in taken),
        "resent": len(ledger.resent),
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
        "violations": len(violations),
    }
    return Verdict(counts, violations[:max_listed])
