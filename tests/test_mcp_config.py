"""boot.xml's ``<mcp>`` read into McpServerSpec (agentserver.config.mcp), without reaching
any server: environment values, headers and tokens, and the problems reported."""

from __future__ import annotations

import pathlib

from lxml import etree

from agentserver.config.loader import boot_schema
from agentserver.config.mcp import McpReader, call_budget
from agentserver.config.problems import Report

BOOT = "https://xml-pipeline.org/ns/boot/v1"


def read(mcp: str, environ: dict[str, str] | None = None):
    doc = etree.fromstring(
        f'<organism xmlns="{BOOT}" name="t"><listeners>{mcp}</listeners></organism>'
    )
    assert boot_schema().validate(doc), boot_schema().error_log
    report = Report("boot.xml")
    reader = McpReader(report, pathlib.Path("/srv/agents"), environ or {})
    spec = reader.server(doc[0][0])
    return spec, report.result(None)


def test_a_url_server_with_a_token_and_headers():
    spec, result = read(
        '<mcp name="tracker" url="https://tracker.example/mcp" token-env="TRACKER_TOKEN" '
        'timeout="12" connect-timeout="5" concurrency="2">'
        '<header name="X-Team" value="core"/><header name="X-Key" value-env="KEY"/>'
        '<tool name="search"/><tool name="get_issue"/></mcp>',
        {"TRACKER_TOKEN": "t0k", "KEY": "k3y"},
    )
    assert not result.problems
    assert spec.url == "https://tracker.example/mcp" and spec.command is None
    assert dict(spec.headers) == {
        "X-Team": "core",
        "X-Key": "k3y",
        "Authorization": "Bearer t0k",
    }
    assert spec.allow == ("search", "get_issue")
    assert (spec.timeout, spec.connect_timeout, spec.concurrency) == (12.0, 5.0, 2)
    assert call_budget(spec) == 12.0


def test_a_command_server_runs_in_boot_xmls_folder_with_its_environment():
    spec, result = read(
        '<mcp name="fs" command="npx" args="-y \'@scope/server fs\' /srv/docs" '
        'idempotent="true" retries="2" timeout="10">'
        '<env name="LOG" value="warn"/><env name="API_KEY" value-env="FS_KEY"/></mcp>',
        {"FS_KEY": "secret"},
    )
    assert not result.problems
    assert spec.command == "npx"
    assert spec.args == ("-y", "@scope/server fs", "/srv/docs")
    assert spec.cwd == "/srv/agents"
    assert dict(spec.env) == {"LOG": "warn", "API_KEY": "secret"}
    assert spec.allow is None
    # every attempt and backoff (1 s, 2 s), plus a second
    assert call_budget(spec) == 3 * 10 + 1 + 2 + 1


def test_problems():
    for mcp, expected in (
        ('<mcp name="x"/>', "needs command"),
        ('<mcp name="x" command="a" url="http://h/mcp"/>', "needs command"),
        ('<mcp name="x" url="http://h/mcp" args="-v"/>', "are for a command"),
        ('<mcp name="x" command="a" token-env="T"/>', "are for a url"),
        ('<mcp name="x" command="a"><env name="A"/></mcp>', "value or value-env"),
    ):
        spec, result = read(mcp)
        assert spec is None or result.errors, mcp
        assert any(expected in str(p) for p in result.errors), (mcp, result.problems)
    spec, result = read('<mcp name="x" command="a"><env name="A" value-env="UNSET"/></mcp>')
    assert spec is not None and not result.errors
    assert "$UNSET is not set" in str(result.warnings[0])
    spec, result = read('<mcp name="x" url="http://h/mcp" token-env="UNSET"/>')
    assert "Authorization" not in spec.headers
    assert "$UNSET (token-env) is not set" in str(result.warnings[0])
