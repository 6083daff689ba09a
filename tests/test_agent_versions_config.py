"""An agent's version from boot.xml (issue 49, config/versions.py): ``<agent version
versioning>``, the digest and what moves it, and ``agentserver check``'s lines and its
warning for a named version whose definition changed."""

from __future__ import annotations

import pathlib

from serverproc import DATA, cli, subprocess_env

from agentserver.agents.clock import ManualClock
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sqlite_store import SqliteAgentStore
from agentserver.config import loader
from agentserver.config.versions import agent_versions

ENV = {"VERSIONS_ALICE_TOKEN": "a", "VERSIONS_OPS_TOKEN": "o", "VERSIONS_LLM_KEY": "k"}
V1, V2 = DATA / "versions-v1.xml", DATA / "versions-v2.xml"


def versions_of(path: pathlib.Path) -> dict:
    result = loader.load(path, environ=ENV)
    assert result.topology is not None, [str(p) for p in result.problems]
    return agent_versions(result.topology)


def written(tmp_path: pathlib.Path, text: str, name: str = "boot.xml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_named_versions_their_policy_and_digests():
    one, two = versions_of(V1), versions_of(V2)
    assert {a: (v.version, v.versioning, v.named) for a, v in one.items()} == {
        "keeper": ("k1", "upgrade", True),
        "pinner": ("p1", "pinned", True),
        "pinner2": ("q1", "pinned", True),
        "typer": ("t1", "upgrade", True),
        "payer": ("y1", "upgrade", True),
    }
    # Every agent's definition differs between the files (a prompt, a tool, a type).
    assert all(one[a].digest != two[a].digest for a in one)


def test_an_unnamed_version_is_its_digest_and_layout_and_comments_move_nothing(tmp_path):
    text = V1.read_text().replace(' version="k1"', "")
    plain = versions_of(written(tmp_path, text))["keeper"]
    assert not plain.named and plain.version == plain.digest[:12]
    relaid = text.replace("<system-prompt>Keeper", "<!-- why -->\n        <system-prompt>Keeper")
    relaid = relaid.replace(
        '<accepts type="versions_support:KeeperTask"/>\n      <responds',
        '<accepts type="versions_support:KeeperTask"/>\n\n          <responds',
    )
    relaid = relaid.replace(
        'max-steps="6" resume-deadline="600"', 'resume-deadline="600"  max-steps="6"'
    )
    assert versions_of(written(tmp_path, relaid, "relaid.xml"))["keeper"].digest == plain.digest
    reworded = text.replace("Keeper, version one.", "Keeper, version one!")
    assert versions_of(written(tmp_path, reworded, "reworded.xml"))["keeper"].digest != plain.digest
    # A peer's payload schema is part of it: typer's type changes between the files, and
    # so does the version of every agent that calls typer (none here) and typer's own.
    assert versions_of(V1)["typer"].digest != versions_of(V2)["typer"].digest


def test_a_bad_version_name_or_policy_is_a_boot_error(tmp_path):
    for attr in ('version="no spaces"', 'versioning="sometimes"'):
        text = V1.read_text().replace('version="k1"', attr)
        result = loader.load(written(tmp_path, text), environ=ENV)
        assert result.topology is None
        assert any("version" in str(p) for p in result.errors), [str(p) for p in result.errors]


def test_check_shows_each_version_and_warns_of_a_name_redefined(tmp_path):
    boot = written(tmp_path, V1.read_text())
    env = subprocess_env(**ENV)
    checked = cli("check", str(boot), env=env)
    assert checked.returncode == 0, checked.stdout
    assert f"{boot}: agent 'pinner': version p1 (pinned)\n" in checked.stdout.decode()
    assert "was defined differently" not in checked.stdout.decode()
    # The store saw version k1 of keeper served with another definition.
    served = ServedVersions(versions={"keeper": "k1"}, digests={"keeper": "0" * 64})
    settings = StoreSettings(path=tmp_path / "state" / "agents.sqlite3")
    store = SqliteAgentStore.open(
        settings.path, clock=ManualClock(), settings=settings, served=served
    )
    store.close()
    checked = cli("check", str(boot), env=env)
    out = checked.stdout.decode()
    assert checked.returncode == 0, out
    assert "warning: agent 'keeper': version 'k1' was defined differently before" in out, out
