"""Webhooks' pure parts: boot.xml's ``<webhooks>`` and agents' ``<webhook>`` read and
checked, bus events mapped to webhook event types, Standard Webhooks signatures checked
against the maintained ``standardwebhooks`` package (ours signs, theirs verifies)."""

from __future__ import annotations

import datetime
import json
import time

from hypothesis import given
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from agentserver.agents.edge.hooksign import new_secret, secret_bytes, signed_headers
from agentserver.agents.edge.webhook_events import event_type, render_signed
from agentserver.agents.events import (
    BudgetEvent,
    ChunkEvent,
    NoticeEvent,
    StateEvent,
    StepEvent,
    TaskEvent,
)
from agentserver.agents.profile.webhooks import WebhookSpec, event_matches
from agentserver.agents.store.outbox import OutboxRow
from agentserver.config.loader import load_bytes

SECRET = new_secret()


def boot(webhooks: str, agent_hooks: str = "", agent: str = "true") -> bytes:
    return f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="t">
  <listeners>
    <listener name="assistant" handler="assistant" agent="{agent}">{agent_hooks}</listener>
  </listeners>
  {webhooks}
</organism>""".encode()


def test_declared_webhooks_are_read_globally_and_per_agent() -> None:
    result = load_bytes(
        boot(
            '<webhooks><webhook name="all" url="https://x.example/h" events="task.* '
            'approval.requested" secret-env="S" first-delay="2" max-delay="20" '
            'retry-for="3600" timeout="3" concurrency="2" disable-after="600"/></webhooks>',
            '<webhook name="mine" url="http://127.0.0.1:9/h" events="task.failed" secret-env="S"/>',
        ),
        environ={"S": SECRET},
    )
    assert not result.errors, result.errors
    hooks = {h.name: h for h in result.topology.webhooks}
    assert hooks["all"].agent is None and hooks["mine"].agent == "assistant"
    a = hooks["all"]
    assert (a.first_delay_s, a.max_delay_s, a.retry_for_s, a.timeout_s) == (2, 20, 3600, 3)
    assert (a.concurrency, a.disable_after_s, a.secret) == (2, 600, SECRET)
    assert a.events == ("task.*", "approval.requested")
    m = hooks["mine"]
    assert (m.first_delay_s, m.retry_for_s, m.disable_after_s) == (5.0, 86400.0, 432000.0)


def test_webhook_durations_take_units_as_the_rest_of_boot_xml() -> None:
    result = load_bytes(
        boot(
            '<webhooks><webhook name="u" url="https://x.example/h" events="task.*" '
            'secret-env="S" first-delay="250ms" max-delay="10m" retry-for="36h" '
            'timeout="30s" disable-after="7d"/></webhooks>'
        ),
        environ={"S": SECRET},
    )
    assert not result.errors, result.errors
    [u] = result.topology.webhooks
    assert (u.first_delay_s, u.max_delay_s, u.retry_for_s) == (0.25, 600.0, 36 * 3600.0)
    assert (u.timeout_s, u.disable_after_s) == (30.0, 7 * 86400.0)
    for bad, says in (("5w", "retry-for"), ("0s", "longer than 0"), ("none", "retry-for")):
        result = load_bytes(
            boot(
                '<webhooks><webhook name="b" url="https://x.example/h" events="task.*" '
                f'secret-env="S" retry-for="{bad}"/></webhooks>'
            ),
            environ={"S": SECRET},
        )
        assert says in " ".join(p.message for p in result.errors), (bad, result.errors)


_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@given(
    number=st.integers(min_value=1, max_value=10**6),
    unit=st.sampled_from(sorted(_UNITS)),
    spaces=st.sampled_from(["", " "]),
)
def test_a_webhook_duration_is_its_number_times_its_unit(number: int, unit: str, spaces: str):
    from agentserver.agents.profile.webhooks import webhook_duration

    text = f"{spaces}{number}{spaces}{unit}{spaces}"
    assert webhook_duration(text, "retry-for") == number * _UNITS[unit]
    assert webhook_duration(number, "retry-for") == float(number)  # JSON: seconds


@given(st.one_of(st.text(max_size=12), st.floats(), st.integers(), st.none(), st.booleans()))
def test_any_webhook_duration_is_seconds_or_a_refusal_naming_it(value: object) -> None:
    from agentserver.agents.profile.webhooks import WebhookConfigError, webhook_duration

    try:
        seconds = webhook_duration(value, "max-delay")
    except WebhookConfigError as exc:
        assert "max-delay" in str(exc)
        return
    assert 0 < seconds < float("inf")


def test_bad_webhooks_are_clear_errors() -> None:
    def errors(xml: str, environ: dict[str, str], **kw: str) -> str:
        result = load_bytes(boot(xml, **kw), environ=environ)
        return " ".join(p.message for p in result.errors)

    hook = '<webhooks><webhook name="w" url="{url}" events="{ev}" secret-env="S"/></webhooks>'
    ok = {"url": "https://a.example/", "ev": "task.succeeded"}
    assert "S (secret-env) is not set" in errors(hook.format(**ok), {})
    assert "whsec_" in errors(hook.format(**ok), {"S": "plain"})
    assert "http:// or https://" in errors(hook.format(url="ftp://a", ev="x"), {"S": SECRET})
    assert "bad event name" in errors(hook.format(url=ok["url"], ev="Task!"), {"S": SECRET})
    two = (
        '<webhooks><webhook name="w" url="https://a/" events="x" secret-env="S"/>'
        '<webhook name="w" url="https://b/" events="x" secret-env="S"/></webhooks>'
    )
    assert "declared twice" in errors(two, {"S": SECRET})
    agent_hook = '<webhook name="w" url="https://a/" events="x" secret-env="S"/>'
    assert 'needs agent="true"' in errors("", {"S": SECRET}, agent_hooks=agent_hook, agent="false")


def test_events_map_to_webhook_types() -> None:
    assert event_type(TaskEvent("a", "t", "succeeded", "b", "c")) == "task.succeeded"
    assert event_type(TaskEvent("a", "t", "timed_out", "b", "c")) == "task.timed_out"
    assert event_type(StepEvent("a", "t", "s", "retrying")) == "step.retrying"
    assert event_type(StateEvent("a", "t", "running")) == "state.running"
    assert event_type(ChunkEvent("a", "t", "s", "x")) is None
    assert event_type(NoticeEvent("budget.soft", "a")) == "budget.soft"
    # the spend budgets' own event (docs/budgets.md) is delivered by its kind, once a period
    soft = BudgetEvent("a", "t", "organism", "day", 86400.0, 900, 0.0, 1000, None)
    assert event_type(soft) == "budget.soft"
    assert soft.dedupe_key == "budget.soft:organism:86400.0"

    class Other:  # any typed event of another feature, by its event_type
        event_type = "schedule.failed"
        agent_id = "a"

    assert event_type(Other()) == "schedule.failed"
    assert event_matches("task.*", "task.failed") and not event_matches("task.*", "tasks.x")
    assert event_matches("*", "anything") and not event_matches("task.failed", "task.stopped")
    spec = WebhookSpec("w", "https://a/", ("task.*",), SECRET, agent="x")
    assert spec.wants("task.failed", "x") and not spec.wants("task.failed", "y")


@given(
    text=st.text(max_size=300),
    msg=st.from_regex(r"msg_[a-z0-9]{1,26}", fullmatch=True),
    ts=st.integers(min_value=1_600_000_000, max_value=2_000_000_000),
)
def test_our_signatures_equal_the_maintained_packages(text: str, msg: str, ts: int) -> None:
    headers = signed_headers(secret_bytes(SECRET), msg, ts, text.encode())
    when = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    assert headers["webhook-signature"] == Webhook(SECRET).sign(msg, when, text)
    assert headers["webhook-id"] == msg and headers["webhook-timestamp"] == str(ts)


def test_a_rendered_attempt_verifies_and_a_tampered_one_does_not() -> None:
    row = OutboxRow(
        1, "msg_abc", "k", "webhook:w", "https://a/", {}, b'{"type":"task.failed","data":{}}',
        "w|c", 7, "pending", 0, 0.0, 1e12, 1.0, 2.0, 0.0,
    )  # fmt: skip
    headers, body = render_signed(secret_bytes(SECRET))(row, time.time())
    payload = Webhook(SECRET).verify(body, headers)
    assert payload == {"type": "task.failed", "data": {}, "sequence": 7}
    assert headers["webhook-id"] == "msg_abc"
    # The same bytes on every attempt (only the timestamp and signature change).
    assert render_signed(secret_bytes(SECRET))(row, time.time() + 5)[1] == body
    tampered = json.dumps({**payload, "sequence": 8}).encode()
    try:
        Webhook(SECRET).verify(tampered, headers)
    except WebhookVerificationError:
        pass
    else:
        raise AssertionError("a tampered body verified")
    try:
        Webhook(new_secret()).verify(body, headers)
    except WebhookVerificationError:
        pass
    else:
        raise AssertionError("another secret verified")


@given(
    attempt=st.integers(min_value=1, max_value=10_000),
    first=st.floats(min_value=0.001, max_value=1e4),
    factor=st.floats(min_value=1.0, max_value=1e3),
    r=st.floats(min_value=0.0, max_value=1.0),
)
def test_backoff_stays_between_half_and_all_of_the_capped_exponential(
    attempt: int, first: float, factor: float, r: float
) -> None:
    from agentserver.agents.edge.outbox import backoff

    cap = first * factor
    full = min(cap, first * 2.0 ** min(attempt - 1, 62))
    delay = backoff(attempt, first, cap, lambda: r)
    assert full / 2 <= delay <= full * (1 + 1e-12) and delay <= cap * (1 + 1e-12)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


@given(
    st.one_of(
        _json,
        st.fixed_dictionaries(
            {"name": st.text(max_size=70), "url": st.text(max_size=40)},
            optional={
                "events": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=15))),
                "first_delay": _json,
                "retry_for": st.one_of(
                    _json,
                    st.from_regex(r"\s?[0-9]{1,6}(\.[0-9]{1,3})?\s?(ms|s|m|h|d)?", fullmatch=True),
                ),
                "concurrency": _json,
                "agent": _json,
                "secret": _json,
            },
        ),
    )
)
def test_any_json_body_is_a_webhook_or_a_clear_refusal(doc: object) -> None:
    """``POST /v1/webhooks``'s parser and checks: a valid spec or one of the errors the
    route turns into a 400, never anything else."""
    import dataclasses

    from agentserver.agents.profile.webhooks import check_spec
    from agentserver.http.routes.webhooks import REFUSED, spec_from_json

    try:
        spec = spec_from_json(doc)
        spec = check_spec(dataclasses.replace(spec, secret=spec.secret or SECRET))
        secret_bytes(spec.secret)
    except REFUSED:  # a 400 naming it; anything else would be a 500
        return
    assert spec.url.startswith(("http://", "https://")) and spec.events
    assert 0 < spec.retry_for_s < float("inf") and 0 < spec.first_delay_s < float("inf")
