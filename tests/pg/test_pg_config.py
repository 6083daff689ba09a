"""``<store url url-env lease heartbeat pool-size>``: parsing, the variable winning,
``check``'s errors and warnings, and ``check --connect``."""

from __future__ import annotations

import socket

import pytest
from cliutil import cli_in_process
from lxml import etree
from serverproc import subprocess_env

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.config import store_settings_from_element
from agentserver.agents.profile.store_url import StoreUrlError, check_url, redact
from agentserver.config import loader as boot
from agentserver.core.namespaces import BOOT_NS

URL = "postgresql://agents@db.example:5432/organism"


def store(**attrs: str) -> etree._Element:
    el = etree.Element(etree.QName(BOOT_NS, "store").text)
    for k, v in attrs.items():
        el.set(k.replace("_", "-"), v)
    return el


def test_no_url_is_the_sqlite_file(tmp_path) -> None:
    s = store_settings_from_element(store(path="a.sqlite3"), base_dir=tmp_path, environ={})
    assert (s.url, s.backend, s.where) == (None, "sqlite", str(tmp_path / "a.sqlite3"))
    assert store_settings_from_element(None).backend == "sqlite"


def test_url_and_the_variable_that_wins_when_set() -> None:
    el = store(url=URL, url_env="STORE_URL")
    assert store_settings_from_element(el, environ={}).url == URL
    assert store_settings_from_element(el, environ={"STORE_URL": ""}).url == URL
    other = "postgres://x@elsewhere/db2"
    s = store_settings_from_element(el, environ={"STORE_URL": other})
    assert (s.url, s.backend) == (other, "postgresql")
    only_env = store(url_env="STORE_URL")
    assert store_settings_from_element(only_env, environ={"STORE_URL": other}).url == other
    assert store_settings_from_element(only_env, environ={}).url is None


def test_lease_heartbeat_pool_settings() -> None:
    s = store_settings_from_element(store(url=URL), environ={})
    assert (s.lease_s, s.heartbeat_s, s.pool_size) == (10.0, 3.0, 8)
    s = store_settings_from_element(
        store(url=URL, lease="4", heartbeat="1.5", pool_size="3"), environ={}
    )
    assert (s.lease_s, s.heartbeat_s, s.pool_size) == (4.0, 1.5, 3)
    with pytest.raises(AgentConfigError, match="lease"):
        store_settings_from_element(store(url=URL, lease="2", heartbeat="3"), environ={})


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("mysql://u@h/db", "must start with postgresql://"),
        ("db.example:5432", "must start with postgresql://"),
        ("postgresql://u:secret@h/db?nosuchparam=1", "invalid"),
    ],
)
def test_bad_urls_are_refused_without_showing_the_password(url: str, why: str) -> None:
    with pytest.raises(StoreUrlError, match=why) as info:
        check_url(url)
    assert "secret" not in str(info.value)
    with pytest.raises(AgentConfigError, match="STORE_URL"):
        store_settings_from_element(store(url=URL, url_env="STORE_URL"), environ={"STORE_URL": url})


def test_redact() -> None:
    assert redact("postgresql://u:pw@h:5/db?x=1") == "postgresql://u:***@h:5/db?x=1"
    assert redact(URL) == URL


def _boot(tmp_path, store_xml: str):
    path = tmp_path / "boot.xml"
    path.write_text(
        f'<organism xmlns="{BOOT_NS}" name="t"><listeners>'
        '<listener name="echo" handler="echo"/></listeners>'
        f"{store_xml}</organism>\n"
    )
    return path


def test_check_reports_a_bad_url_and_an_unset_variable(tmp_path) -> None:
    result = boot.load(_boot(tmp_path, '<store url="mysql://h/db"/>'), environ={})
    assert not result.ok
    assert any("postgresql://" in p.message for p in result.errors)
    result = boot.load(_boot(tmp_path, '<store url-env="NOPE_URL"/>'), environ={})
    assert result.ok
    assert any("$NOPE_URL is not set" in p.message for p in result.warnings)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_connect_says_unreachable(tmp_path) -> None:
    url = f"postgresql://u:hunter2@127.0.0.1:{_closed_port()}/db"
    path = _boot(tmp_path, '<store url-env="T_STORE_URL"/>')
    result = cli_in_process("check", "--connect", str(path), env=subprocess_env(T_STORE_URL=url))
    assert result.returncode == 1
    out = result.stdout.decode()  # check's one stream
    assert "NOT reachable" in out and "hunter2" not in out and "u:***@" in out
    assert "hunter2" not in result.stderr.decode()


def test_check_connect_on_sqlite_says_so(tmp_path) -> None:
    result = cli_in_process("check", "--connect", str(_boot(tmp_path, "")))
    assert result.returncode == 0
    assert "SQLite file" in result.stdout.decode()


def test_check_connect_says_reachable(tmp_path, pg_url: str) -> None:
    path = _boot(tmp_path, '<store url-env="T_STORE_URL"/>')
    result = cli_in_process("check", "--connect", str(path), env=subprocess_env(T_STORE_URL=pg_url))
    assert result.returncode == 0, result.stderr.decode()
    assert "reachable (PostgreSQL 1" in result.stdout.decode()
