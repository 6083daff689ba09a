"""How the web console words a task (agentserver/http/ui/wording.py): the one mapping of
the store's states (every inbox status, every Turn end, a pending approval) to the six a
person reads, a task's text from its payload, and costs, durations, counts and errors."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserver.agents.store.rows import TaskStatus
from agentserver.agents.store.states import InboxStatus
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.ui import wording
from agentserver.http.ui.wording import (
    ASKING,
    CANCELLED,
    FAILED,
    FINISHED,
    QUEUED,
    RUNNING,
    STATES,
    SUCCEEDED,
)

#: Every inbox status of a task whose Turn has no end yet, and what a person reads.
BEFORE_THE_END = {
    InboxStatus.QUEUED: QUEUED,
    InboxStatus.PENDING: QUEUED,
    InboxStatus.DEFERRED: QUEUED,
    InboxStatus.PROCESSING: RUNNING,
    InboxStatus.CONSUMED: RUNNING,
    InboxStatus.ERROR: FAILED,
    InboxStatus.SKIPPED: CANCELLED,
}
#: Every Turn end (the deliverable's status) and what a person reads.
ENDS = {
    TaskStatus.SUCCEEDED: SUCCEEDED,
    TaskStatus.FAILED: FAILED,
    TaskStatus.TIMED_OUT: FAILED,
    TaskStatus.STOPPED: CANCELLED,
}


def test_the_six_states_are_the_issues():
    assert STATES == (
        "queued",
        "running",
        "waiting for approval",
        "succeeded",
        "failed",
        "cancelled",
    )
    assert FINISHED == {"succeeded", "failed", "cancelled"}


def test_every_inbox_status_reads_as_one_of_the_six():
    # The table above names every status the store has: a new one must be mapped too.
    assert set(BEFORE_THE_END) == set(InboxStatus)
    for status, shown in BEFORE_THE_END.items():
        assert wording.task_state(status, None, asking=False) == shown, status
        # A pending approval is read only while the task runs.
        with_approval = ASKING if shown == RUNNING else shown
        assert wording.task_state(status, None, asking=True) == with_approval, status
    # "consumed" is the row's status for the whole of a started task: never its outcome.
    assert wording.task_state("consumed", None, False) == RUNNING


def test_every_turn_end_reads_as_one_of_the_six_whatever_the_row_says():
    declared = {v for k, v in vars(TaskStatus).items() if not k.startswith("_")}
    assert set(ENDS) == declared  # a new end must be mapped too
    for outcome, shown in ENDS.items():
        for status in InboxStatus:
            for asking in (False, True):
                assert wording.task_state(status, outcome, asking) == shown, (outcome, status)
    # An end this version does not know is no success.
    assert wording.task_state("consumed", "exploded", False) == FAILED
    # A row status newer than this version: the task is not over.
    assert wording.task_state("teleporting", None, False) == RUNNING


def test_the_detail_says_what_the_state_leaves_out():
    assert wording.state_detail("consumed", "succeeded", None) == ""
    assert wording.state_detail("consumed", "failed", None) == ""
    assert wording.state_detail("consumed", "timed_out", None) == "timed out"
    assert wording.state_detail("consumed", "stopped", None) == "stopped"
    assert wording.state_detail("skipped", None, "conversation busy") == "conversation busy"
    assert wording.state_detail("skipped", None, None) == ""
    assert wording.state_detail("queued", None, "whatever") == ""


def test_a_payload_reads_as_its_text():
    parser = SafeParser(1 << 20)
    xml = '<task xmlns="urn:x"><text>Say\n   hello.</text></task>'
    assert wording.payload_text(xml, parser) == "Say hello."
    assert wording.payload_text("<a><b>one</b> <c>two</c></a>", parser) == "one two"
    assert wording.payload_text("not  xml <", parser) == "not xml <"
    assert wording.payload_text("", parser) == ""


def test_costs():
    assert wording.cost(0.0023799999999999993) == "$0.0024"
    assert wording.cost(0.5) == "$0.50"
    assert wording.cost(0.05) == "$0.05"
    assert wording.cost(0.000012) == "$0.000012"
    assert wording.cost(1234.5) == "$1,234.50"
    assert wording.cost(0) == "$0"
    assert wording.cost(None) == wording.NONE


@given(st.floats(min_value=1e-9, max_value=0.99))
def test_a_cost_under_a_dollar_keeps_two_significant_digits(value):
    text = wording.cost(value)
    assert re.fullmatch(r"\$0\.\d+", text), text
    assert abs(float(text[1:]) - value) <= 0.05 * value + 0.005 * (value >= 0.1)


def test_durations():
    assert wording.duration(0.04) == "40 ms"
    assert wording.duration(1.23) == "1.2 s"
    assert wording.duration(9.99) == "10 s"
    assert wording.duration(42.4) == "42 s"
    assert wording.duration(185) == "3 min 5 s"
    assert wording.duration(180) == "3 min"
    assert wording.duration(600) == "10 min"
    assert wording.duration(7500) == "2 h 5 min"
    assert wording.duration(90000) == "1 d 1 h"
    assert wording.duration(None) == wording.NONE
    assert wording.duration(-1) == wording.NONE


@given(st.floats(min_value=0, max_value=1e8))
def test_every_duration_is_a_short_phrase(seconds):
    assert re.fullmatch(
        r"\d+ ms|\d+\.\d s|\d+ s|\d+ min( \d+ s)?|\d+ h( \d+ min)?|\d+ d( \d+ h)?",
        wording.duration(seconds),
    )


def test_counts_errors_and_a_backends_calls():
    assert wording.count(1, "token") == "1 token"
    assert wording.count(1200, "token") == "1,200 tokens"
    assert wording.errors({}) == "no errors"
    assert wording.errors(None) == "no errors"
    assert wording.errors({"rate_limit": 1, "timeout": 2}) == "2 timeout, 1 rate limit"
    counters = {
        "requests": 3,
        "successes": 3,
        "failures": 0,
        "prompt_tokens": 1200,
        "completion_tokens": 300,
        "cost": 0.0023799999999999993,
        "errors": {},
    }
    line = wording.backend_calls(counters)
    assert (
        line == "3 requests, 3 succeeded, 0 failed · 1,200 tokens in, 300 out · $0.0024 · no errors"
    )
    assert "{" not in line and "0.00237" not in line


@pytest.mark.parametrize("chars", [5, 20, 100])
def test_shorten_cuts_at_a_word(chars):
    text = "the quick brown fox jumps over the lazy dog " * 5
    short = wording.shorten(text, chars)
    assert len(short) <= chars and short.endswith("…")
    assert text.startswith(short[:-1])
    assert wording.shorten("short", chars) == "short"
