"""The classifier (one test per rule row), the decision table, Retry-After and backoff."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserver.llm.classify import (
    DECISIONS,
    RULES,
    Action,
    ErrorKind,
    backoff_delay,
    classify,
    decision_table_markdown,
    parse_retry_after,
    rules_table_markdown,
)

# (rule expected to fire, status, message, code, transport, kind). One row per
# classifier rule, written from real provider error bodies where there is one.
# ``transport``: False (an answer), True (a failure after connecting), "connect".
ROWS = [
    (
        "connect",
        None,
        "ConnectError: [Errno 111] Connection refused",
        "",
        "connect",
        "UNREACHABLE",
    ),
    ("transport", None, "ReadTimeout: timed out", "", True, "TIMEOUT"),
    (
        "billing-message",
        429,
        "You exceeded your current quota, please check your plan and billing details.",
        "insufficient_quota insufficient_quota",
        False,
        "BILLING",
    ),
    (
        "context-message",
        400,
        "This model's maximum context length is 8192 tokens. However, your messages "
        "resulted in 9000 tokens.",
        "invalid_request_error context_length_exceeded",
        False,
        "CONTEXT_OVERFLOW",
    ),
    (
        "content-message",
        400,
        "The response was filtered due to the prompt triggering content management policy.",
        "content_filter",
        False,
        "CONTENT_BLOCKED",
    ),
    (
        "account-message",
        401,
        "Your account has been deactivated.",
        "account_deactivated",
        False,
        "AUTH_PERMANENT",
    ),
    (
        "model-message",
        400,
        "The model `gpt-9` does not exist or you do not have access to it.",
        "model_not_found",
        False,
        "MODEL_NOT_FOUND",
    ),
    (
        "rate-limit-message",
        400,
        "Rate limit reached for requests",
        "",
        False,
        "RATE_LIMIT",
    ),
    ("overloaded-message", None, "Overloaded", "overloaded_error", False, "OVERLOADED"),
    ("status-429", 429, "Too fast", "", False, "RATE_LIMIT"),
    ("status-503-529", 529, "", "", False, "OVERLOADED"),
    ("status-5xx", 502, "Bad gateway", "", False, "SERVER_ERROR"),
    ("status-408-504", 504, "Gateway Timeout", "", False, "TIMEOUT"),
    ("status-413", 413, "Request entity too large", "", False, "CONTEXT_OVERFLOW"),
    ("status-401-403", 401, "Incorrect API key provided", "invalid_api_key", False, "AUTH"),
    ("status-402", 402, "Payment needed", "", False, "BILLING"),
    (
        "status-404",
        404,
        "model 'llama9' not found, try pulling it first",
        "",
        False,
        "MODEL_NOT_FOUND",
    ),
    ("status-400-422", 422, "messages: field required", "", False, "FORMAT_ERROR"),
    ("otherwise", 409, "conflict", "", False, "UNKNOWN"),
]


@pytest.mark.parametrize(
    ("rule", "status", "message", "code", "transport", "kind"), ROWS, ids=[r[0] for r in ROWS]
)
def test_classifier_row(rule, status, message, code, transport, kind):
    got = classify(
        status, message, code=code, transport=bool(transport), connect=transport == "connect"
    )
    assert (got.rule, got.kind) == (rule, ErrorKind(kind))


def test_every_rule_has_a_row():
    assert [r[0] for r in ROWS] == [r.name for r in RULES] + ["otherwise"]


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        # The traps from the issue.
        (429, "Your credit balance is too low to access the API.", "BILLING"),
        (400, "Your credit balance is too low to access the Anthropic API.", "BILLING"),
        (400, "prompt is too long: 210000 tokens > 200000 maximum", "CONTEXT_OVERFLOW"),
        (429, "Rate limit reached for gpt-4 on requests per min (RPM)", "RATE_LIMIT"),
        (403, "Your API key does not have permission to use the specified resource.", "AUTH"),
        (500, "insufficient credits service hiccup", "SERVER_ERROR"),  # billing only on 4xx
        (
            429,
            "Rate limit reached for gpt-4 in organization org-x on requests per min (RPM): "
            "Limit 3, Used 3, Requested 1. You can increase your rate limit by adding a payment "
            "method to your account at https://platform.openai.com/account/billing.",
            "RATE_LIMIT",
        ),
    ],
)
def test_traps(status, message, kind):
    assert classify(status, message).kind is ErrorKind(kind)


def test_transport_wins_over_any_message():
    assert classify(429, "insufficient_quota", transport=True).kind is ErrorKind.TIMEOUT
    got = classify(429, "insufficient_quota", transport=True, connect=True)
    assert got.kind is ErrorKind.UNREACHABLE


def test_connect_without_transport_is_an_answer():
    # ``connect`` qualifies a transport failure; on its own the status decides.
    assert classify(503, "", connect=True).kind is ErrorKind.OVERLOADED


def test_decision_table_covers_every_kind_and_stops_where_the_issue_says():
    assert set(DECISIONS) == set(ErrorKind)
    stops = {k for k, d in DECISIONS.items() if d.action is Action.STOP}
    assert stops == {ErrorKind.CONTENT_BLOCKED, ErrorKind.FORMAT_ERROR, ErrorKind.AUTH_PERMANENT}
    assert DECISIONS[ErrorKind.BILLING].action is Action.FAILOVER
    assert DECISIONS[ErrorKind.TIMEOUT].action is Action.FAILOVER
    assert DECISIONS[ErrorKind.UNREACHABLE].action is Action.FAILOVER
    assert DECISIONS[ErrorKind.UNREACHABLE].breaker
    assert DECISIONS[ErrorKind.RATE_LIMIT].action is Action.RETRY


def test_docs_show_the_code_tables():
    doc = (Path(__file__).parents[2] / "docs" / "llm-router.md").read_text()

    def between(tag: str) -> str:
        start = doc.index(f"<!-- {tag}:start -->") + len(f"<!-- {tag}:start -->")
        return doc[start : doc.index(f"<!-- {tag}:end -->")].strip() + "\n"

    assert between("decision-table") == decision_table_markdown()
    assert between("classifier-rules") == rules_table_markdown()


@given(
    st.one_of(st.none(), st.integers(min_value=-1000, max_value=100_000)),
    st.text(),
    st.text(),
    st.booleans(),
    st.booleans(),
)
def test_classifier_is_total(status, message, code, transport, connect):
    got = classify(status, message, code=code, transport=transport, connect=connect)
    assert got.kind in DECISIONS


@pytest.mark.parametrize(
    ("retry_after", "ms", "expected"),
    [
        ("7", None, 7.0),
        ("1.5", None, 1.5),
        ("7", "250", 0.25),
        (None, "1200", 1.2),
        ("-3", None, 0.0),
        ("soon", None, None),
        (None, None, None),
        ("nan", None, None),
    ],
)
def test_parse_retry_after(retry_after, ms, expected):
    assert parse_retry_after(retry_after, ms) == expected


def test_parse_retry_after_http_date():
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2025, 1, 1, 12, 0, 30, tzinfo=UTC), usegmt=True)
    assert parse_retry_after(later, now_wall=now.timestamp()) == 30.0
    assert parse_retry_after(later) is None  # a date needs the wall clock


@given(st.text(), st.one_of(st.none(), st.text()), st.floats(allow_nan=True))
def test_parse_retry_after_never_raises(value, ms, now):
    got = parse_retry_after(value, ms, now_wall=now)
    assert got is None or got >= 0.0


@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=2**32))
def test_backoff_grows_and_stays_within_bounds(index, seed):
    rng = random.Random(seed)
    d = backoff_delay(index, 0.5, 8.0, rng)
    step = min(8.0, 0.5 * 2**index)
    assert step / 2 <= d <= step
