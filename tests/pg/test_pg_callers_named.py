"""A named client's reply is never pinned to a process (agents/store/pg/callers.py).

Found by the two-process SIGKILL test (one task in about six runs went unanswered): a
named client's reply reference also named the process she was connected to, so when a
process died between ending a Turn and keeping its reply for her, the takeover gave the
pending reply up as if its caller had died with the process. She reconnects elsewhere; her
reply must stay deliverable.
"""

from __future__ import annotations

import json

from agentserver.agents.store.pg.callers import PROCESS_KEY, process_of


def test_an_anonymous_callers_reply_names_its_process():
    assert process_of(json.dumps({"caller": "client-1", PROCESS_KEY: "p1"})) == "p1"


def test_a_named_clients_reply_names_no_process_even_if_stored_with_one():
    ref = {"caller": "alice", "client": "alice", PROCESS_KEY: "p1"}
    assert process_of(json.dumps(ref)) is None


def test_unreadable_or_absent_references_name_no_process():
    assert process_of(None) is None
    assert process_of("not json") is None
    assert process_of(json.dumps(["p1"])) is None
