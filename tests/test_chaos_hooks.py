"""The chaos bench's webhook check (bench/support/chaos_hooks.py ``check_hooks``), sans
I/O: a lost event, an unstable id, an id shared by two Turns, a request without its id or
with a bad signature are violations; retries under one id are not."""

from __future__ import annotations

import sys

from serverproc import REPO

sys.path.append(str(REPO / "bench" / "support"))

from chaos_hooks import HookReceiver, Seen, check_hooks, new_secret


def receiver(*seen: Seen) -> HookReceiver:
    r = HookReceiver(1, new_secret(1))
    r.seen.extend(seen)
    return r


def test_retries_under_one_id_are_fine() -> None:
    r = receiver(
        Seen("msg_a", "t1", "task.succeeded", True, 500),
        Seen("msg_a", "t1", "task.succeeded", True, 0),
        Seen("msg_a", "t1", "task.succeeded", True, 204),
        Seen("msg_b", "t2", "task.failed", True, 204),
        Seen("msg_b", "t2", "task.failed", True, 204),  # at least once: twice is fine
    )
    counts, violations = check_hooks(r, {"t1": "succeeded", "t2": "failed"})
    assert violations == []
    assert counts["hook_delivered_turns"] == 2 and counts["hook_failed_attempts"] == 2


def test_each_broken_promise_is_a_violation() -> None:
    r = receiver(
        Seen("msg_a", "t1", "task.succeeded", True, 500),  # t1 never delivered
        Seen("msg_b", "t2", "task.succeeded", True, 204),
        Seen("msg_c", "t2", "task.succeeded", True, 204),  # t2 under two ids
        Seen("msg_d", "t3", "task.succeeded", True, 204),  # t3 ended stopped
        Seen("msg_d", "t4", "task.failed", False, 204),  # one id, two Turns; bad signature
        Seen("", "t5", "task.succeeded", False, 204),  # no id
    )
    ended = {"t1": "succeeded", "t2": "succeeded", "t3": "stopped", "t4": "failed"}
    counts, violations = check_hooks(r, ended)
    assert counts["hook_missing"] == 1 and counts["hook_wrong_type"] == 1
    assert counts["hook_unstable_ids"] == 1 and counts["hook_shared_ids"] == 1
    assert counts["hook_without_id"] == 1 and counts["hook_bad_signature"] == 1
    assert len(violations) == 6


def test_the_receiver_verifies_signatures_with_the_maintained_package() -> None:
    from agentserver.agents.edge.hooksign import secret_bytes, signed_headers

    r = receiver()
    body = b'{"type":"task.succeeded","data":{"turn":"t9"}}'
    import time

    headers = signed_headers(secret_bytes(r.secret), "msg_x", int(time.time()), body)
    r._record(headers, body, 204)
    r._record({**headers, "webhook-signature": "v1,AAAA"}, body, 204)
    assert [(s.turn, s.signed) for s in r.seen] == [("t9", True), ("t9", False)]
