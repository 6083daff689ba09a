"""The chaos bench's deploy fault (bench/support/chaos_deploy.py, ``--deploy``): its check
finds a pinned Turn that ran on two versions in a store (a tiny SQLite file with the
columns it reads) and passes one where every pinned Turn kept its version; the scripted
model answers without the tool its version's prompt does not name, and the bench's
expected proofs accept that answer only with ``--deploy``."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import sys
from pathlib import Path

from serverproc import REPO

sys.path.append(str(REPO / "bench" / "support"))

from chaos_deploy import (
    PINNED_AGENT,
    SHRUNK_AGENT,
    V1,
    V2,
    check_versions,
    prompt_text,
    read_versions,
)
from chaos_model import ChaosModel, plan_for
from chaos_tools import proof_text


def store(path: Path, steps: list[tuple], edges: list[tuple] = ()) -> Path:
    """A store with just what the check reads: (agent, turn, step_no, version) steps and
    (agent, turn, primitive, from, to) edges."""
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE agent_steps (agent_id TEXT, agent_turn_id TEXT, step_no INTEGER, "
        "version TEXT)"
    )
    conn.execute(
        "CREATE TABLE execution_edges (agent_id TEXT, agent_turn_id TEXT, primitive TEXT, "
        "metadata TEXT)"
    )
    conn.executemany("INSERT INTO agent_steps VALUES (?,?,?,?)", steps)
    conn.executemany(
        "INSERT INTO execution_edges VALUES (?,?,?,?)",
        [(a, t, p, json.dumps({"from": f, "to": to})) for a, t, p, f, to in edges],
    )
    conn.commit()
    conn.close()
    return path


#: Turns that keep the promise: pinned ones on one version each (v1, and v2), an upgrade
#: Turn of alpha that moved v1 -> v2 -> v1 (a deploy, then a rollback).
GOOD_STEPS = [
    (PINNED_AGENT, "g1", 1, V1),
    (PINNED_AGENT, "g1", 2, V1),
    (PINNED_AGENT, "g2", 1, V2),
    (PINNED_AGENT, "g2", 2, V2),
    ("alpha", "a1", 1, V1),
    ("alpha", "a1", 2, V2),
    ("alpha", "a1", 3, V1),
    ("beta", "b1", 1, None),  # a step written before versions: not counted
]
GOOD_EDGES = [("alpha", "a1", "upgrade", V1, V2), ("alpha", "a1", "upgrade", V2, V1)]


def test_a_store_where_pinned_turns_kept_their_version_passes(tmp_path):
    steps, edges = read_versions(store(tmp_path / "s.sqlite3", GOOD_STEPS, GOOD_EDGES), None)
    counts, violations = check_versions(steps, edges)
    assert violations == []
    assert counts["turns_by_version"] == {V1: 2, V2: 1}
    assert counts["pinned_turns_by_version"] == {V1: 1, V2: 1}
    assert counts["turns_on_two_versions"] == 1
    assert counts["upgrades"] == 2 and counts["upgrades_by_way"] == {"v1->v2": 1, "v2->v1": 1}
    assert counts["pinned_violations"] == 0


def test_a_pinned_turn_with_steps_on_two_versions_is_a_violation(tmp_path):
    bad = [*GOOD_STEPS, (PINNED_AGENT, "g3", 1, V1), (PINNED_AGENT, "g3", 2, V2)]
    steps, edges = read_versions(store(tmp_path / "s.sqlite3", bad, GOOD_EDGES), None)
    counts, violations = check_versions(steps, edges)
    assert violations == [f"pinned Turn g3 of {PINNED_AGENT} ran on versions 1:v1 2:v2"]
    assert counts["pinned_violations"] == 1


def test_only_a_migration_lets_a_pinned_turn_change_version(tmp_path):
    moved = [*GOOD_STEPS, (PINNED_AGENT, "g3", 1, V1), (PINNED_AGENT, "g3", 2, V2)]
    migrated = [*GOOD_EDGES, (PINNED_AGENT, "g3", "migrate", V1, V2)]
    steps, edges = read_versions(store(tmp_path / "m.sqlite3", moved, migrated), None)
    assert check_versions(steps, edges)[1] == []
    # ... and once: a second change needs a second migration.
    again = [*moved, (PINNED_AGENT, "g3", 3, V1)]
    steps, edges = read_versions(store(tmp_path / "a.sqlite3", again, migrated), None)
    assert len(check_versions(steps, edges)[1]) == 1


def test_an_upgrade_edge_on_a_pinned_turn_is_a_violation(tmp_path):
    edges_in = [*GOOD_EDGES, (PINNED_AGENT, "g1", "upgrade", V1, V2)]
    steps, edges = read_versions(store(tmp_path / "s.sqlite3", GOOD_STEPS, edges_in), None)
    assert check_versions(steps, edges)[1] == [f"pinned Turn g1 of {PINNED_AGENT} upgraded v1->v2"]


def test_no_store_yet_is_no_violation(tmp_path):
    assert check_versions(*read_versions(tmp_path / "absent.sqlite3", None))[1] == []


def _bench():
    """bench/chaos.py, loaded by path (bench/ itself is not put on sys.path: its socket.py
    and http.py would shadow the standard library's)."""
    spec = importlib.util.spec_from_file_location("chaos_bench", REPO / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_answers_without_the_tool_its_version_removed():
    seed = 3
    nonce = next(f"{i:016x}" for i in range(1000) if plan_for(seed, f"{i:016x}").relay)
    stamp = proof_text("stamp", nonce)
    pay = [proof_text("pay", nonce)] if plan_for(seed, nonce).pay else []

    def ask(version: str, *results: str) -> str:
        model = ChaosModel(seed, 4.0)
        model.faults_on = False
        messages = [
            {"role": "system", "content": prompt_text(SHRUNK_AGENT, version)},
            {"role": "user", "content": f"Handle NONCE[{nonce}] with your tools."},
            *({"role": "user", "content": f"Result from tool:\n{r}"} for r in results),
        ]
        status, _, text = model.decide({"messages": messages})
        assert status == 200 and isinstance(text, str)
        assert model.stats.prompts == {version: 1}
        return text

    assert "<relay" in ask(V1, stamp, *pay)  # v1 offers relay: the model calls it
    answer = ask(V2, stamp, *pay)  # v2 does not: the answer says so
    assert answer.startswith(f"RESULT nonce={nonce}") and "relay=removed" in answer, answer
    assert "<relay" not in ask(V2)
    # A proof an earlier version's call brought still counts.
    assert proof_text("relay", nonce) in ask(V2, stamp, proof_text("relay", nonce), *pay)
    from chaos_check import content_proves

    bench = _bench()
    accepted = bench.expected_proofs(seed, deploy=True)(nonce, answer)
    assert any(content_proves(answer, nonce, alt) for alt in accepted)
    plain = bench.expected_proofs(seed)(nonce, answer)
    assert not any(content_proves(answer, nonce, alt) for alt in plain)


def test_the_boot_files_differ_as_the_deploy_says():
    bench = _bench()
    v1, v2 = (bench.boot_xml("http://127.0.0.1:9/v1", False, version=v) for v in (V1, V2))
    assert 'version="v1" versioning="pinned"' in v1 and 'version="v2" versioning="pinned"' in v2
    assert v1.count('versioning="pinned"') == v2.count('versioning="pinned"') == 1
    assert v1.count('peers="stamp relay pay"') == 3 and v2.count('peers="stamp relay pay"') == 2
    assert 'peers="stamp pay"' in v2 and prompt_text(SHRUNK_AGENT, V2) in v2
    assert prompt_text(SHRUNK_AGENT, V1) in v1 and 'operator="true"' in v1
    plain = bench.boot_xml("http://127.0.0.1:9/v1", False)
    assert "version=" not in plain.split("<listeners>")[1] and "system-prompt" not in plain
