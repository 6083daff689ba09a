"""Loading and checking boot.xml without sockets (agentserver.config.loader is sans-IO)."""

from __future__ import annotations

import dataclasses
import textwrap

import trio
import trio.testing
from conftest import parse_reply
from lxml import etree
from serverproc import DATA, REPO

from agentserver.agents.profile.settings import AgentSettings
from agentserver.app.builtins import RunContext, build_listeners
from agentserver.config import loader as boot
from agentserver.config.bundled import BOOT_XML
from agentserver.config.topology import Limits
from agentserver.core.envelope import build_envelope
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping
from agentserver.llm.config import RouterConfig
from agentserver.pump.pump import open_pump

NS = "https://xml-pipeline.org/ns/boot/v1"


def write(tmp_path, body: str, name: str = "boot.xml"):
    path = tmp_path / name
    path.write_text(f'<organism xmlns="{NS}" name="t">\n' + textwrap.dedent(body) + "</organism>\n")
    return path


def messages(result: boot.LoadResult) -> list[str]:
    return [str(p) for p in result.problems]


def test_bundled_boot_xml_loads():
    result = boot.load(REPO / "boot.xml", environ={"OPENAI_API_KEY": "k"})
    assert result.ok and result.problems == []
    topo = result.topology
    assert topo.organism == "hello" and (topo.host, topo.port) == ("127.0.0.1", 7340)
    assert [s.name for s in topo.listeners] == [
        "boot",
        "echo",
        "calculator",
        "assistant",
        "console",
        "console-router",
    ]
    assert topo.boot_listener.name == "boot" and topo.clients == ()
    assistant = topo.listener("assistant")
    assert assistant.agent and assistant.peers == ("calculator",) and assistant.timeout == 300
    assert topo.listener("calculator").concurrency == 8 and topo.listener("calculator").timeout == 5
    router = topo.listener("console-router")
    assert router.raw and router.peers == ("echo", "calculator", "assistant")


def test_bundled_boot_warns_clearly_without_an_api_key():
    result = boot.load(REPO / "boot.xml", environ={})
    assert result.ok  # a warning, not an error: tasks then fail with a clear answer
    assert any("OPENAI_API_KEY" in m and "skipped" in m for m in messages(result))


def test_bundled_copy_matches_the_repository_file():
    # agentserver/config/bundled_boot.xml links to boot.xml; a wheel carries its content.
    assert BOOT_XML == (REPO / "boot.xml").read_text()
    assert boot.load_bytes(BOOT_XML.encode(), name="<bundled>", environ={}).ok


def test_minimal_file_gets_an_implicit_boot_listener_and_defaults(tmp_path):
    path = write(tmp_path, '<listeners><listener name="echo" handler="echo"/></listeners>\n')
    result = boot.load(path, environ={})
    assert result.ok, messages(result)
    topo = result.topology
    assert topo.boot_listener.name == boot.IMPLICIT_BOOT_NAME
    assert topo.limits == Limits()
    assert (topo.host, topo.port) == ("127.0.0.1", 7340)


def test_limits_listen_and_clients_are_read(tmp_path):
    path = write(
        tmp_path,
        """\
        <listen host="::1" port="9000"/>
        <limits max-connections="3" max-inflight="2" read-timeout="0.5" idle-timeout="0"
                max-inflight-bytes="5000" outgoing-buffer-bytes="7000"/>
        <clients><client name="ann" token-env="ANN_TOKEN" may-address="echo"/></clients>
        <listeners><listener name="echo" handler="echo"/></listeners>
        """,
    )
    result = boot.load(path, environ={"ANN_TOKEN": "x"})
    assert result.ok and result.problems == []
    topo = result.topology
    assert (topo.host, topo.port) == ("::1", 9000)
    assert topo.limits.max_connections == 3 and topo.limits.max_inflight == 2
    assert topo.limits.max_inflight_bytes == 5000
    assert topo.pump_config().endpoint_buffer_bytes == 7000
    assert topo.limits.read_timeout == 0.5
    (client,) = topo.clients
    assert (client.name, client.token_env, client.may_address) == ("ann", "ANN_TOKEN", ("echo",))


def test_every_limit_is_read_from_its_attribute(tmp_path):
    # Each Limits field has its own line in the reader: one left out would keep its
    # default whatever boot.xml says.
    defaults = Limits()
    wanted = {}
    for field in dataclasses.fields(Limits):
        value = getattr(defaults, field.name)
        wanted[field.name] = value + 3 if isinstance(value, int) else value + 1.5
    wanted["max_message_bytes"] = defaults.max_message_bytes - 3  # at most 2**32 - 1
    attributes = " ".join(f'{name.replace("_", "-")}="{value}"' for name, value in wanted.items())
    path = write(
        tmp_path,
        f"""\
        <limits {attributes}/>
        <listeners><listener name="echo" handler="echo"/></listeners>
        """,
    )
    result = boot.load(path)
    assert result.ok, result.problems
    assert dataclasses.asdict(result.topology.limits) == wanted


def test_frame_limit_beyond_a_4_byte_length_is_refused_by_check(tmp_path):
    body = """\
        <limits max-message-bytes="{}" max-threads="12345678901234567891"/>
        <listeners><listener name="echo" handler="echo"/></listeners>
        """
    too_big = boot.load(write(tmp_path, body.format(2**32)))
    assert not too_big.ok
    assert any(p.line == 2 and "max-message-bytes" in p.message for p in too_big.problems)
    largest = boot.load(write(tmp_path, body.format(2**32 - 1)))
    assert largest.ok, largest.problems
    assert largest.topology.limits.max_message_bytes == 2**32 - 1
    assert largest.topology.limits.max_threads == 12345678901234567891  # every digit kept


def test_threads_per_connection_is_read_defaults_sanely_and_warns_when_it_is_no_bound(tmp_path):
    listeners = '<listeners><listener name="echo" handler="echo"/></listeners>'
    default = boot.load(write(tmp_path, listeners))
    limits = default.topology.limits
    # A sane default: one connection holds at most ~1% of the registry.
    assert 0 < limits.max_threads_per_connection * 50 < limits.max_threads
    assert default.problems == []
    path = write(tmp_path, f'<limits max-threads-per-connection="7"/>\n{listeners}')
    topo = boot.load(path).topology
    assert topo.limits.max_threads_per_connection == 7
    assert topo.pump_config().max_threads_per_endpoint == 7
    path = write(
        tmp_path, f'<limits max-threads="10" max-threads-per-connection="10"/>\n{listeners}'
    )
    result = boot.load(path)
    assert result.ok
    assert messages(result) == [
        f"{path}:2: warning: max-threads-per-connection (10) is not below max-threads (10): "
        "one client can fill the thread registry and have every other refused"
    ]
    refused = boot.load(write(tmp_path, f'<limits max-threads-per-connection="0"/>\n{listeners}'))
    assert not refused.ok
    assert any("max-threads-per-connection" in p.message for p in refused.problems)


def test_unset_or_empty_token_variable_is_a_warning_not_an_error(tmp_path):
    path = write(
        tmp_path,
        """\
        <clients>
          <client name="ann" token-env="ANN_TOKEN"/>
          <client name="ben" token-env="BEN_TOKEN"/>
        </clients>
        <listeners><listener name="echo" handler="echo"/></listeners>
        """,
    )
    result = boot.load(path, environ={"BEN_TOKEN": " "})
    assert result.ok
    assert messages(result) == [
        f"{path}:3: warning: client 'ann': token variable ANN_TOKEN is not set (it cannot connect)",
        f"{path}:4: warning: client 'ben': token variable BEN_TOKEN is empty (it cannot connect)",
    ]


def test_client_names_must_be_unique_and_not_a_listener(tmp_path):
    path = write(
        tmp_path,
        """\
        <clients>
          <client name="ann" token-env="A"/>
          <client name="ann" token-env="A"/>
          <client name="echo" token-env="A"/>
          <client name="cy" token-env="A" may-address="ghost"/>
        </clients>
        <listeners><listener name="echo" handler="echo"/></listeners>
        """,
    )
    result = boot.load(path, environ={"A": "t"})
    assert not result.ok
    assert [str(p) for p in result.errors] == [
        f"{path}:4: client name 'ann' is already used on line 3",
        f"{path}:5: client name 'echo' is a listener's name",
        f"{path}:6: client 'cy': may-address names unknown listener 'ghost'",
    ]


def test_broadcast_listeners_may_share_a_root_tag(tmp_path):
    body = """\
        <listeners>
          <listener name="a" handler="echo" broadcast="{b}"/>
          <listener name="b" handler="echo" broadcast="true"/>
        </listeners>
        """
    assert boot.load(write(tmp_path, body.format(b="true")), environ={}).ok
    refused = boot.load(write(tmp_path, body.format(b="false"), "2.xml"), environ={})
    assert not refused.ok
    assert "share a root tag only if all of them are broadcast" in str(refused.errors[0])


def test_agent_settings_need_the_agent_flag_and_are_handed_over(tmp_path):
    refused = boot.load(
        write(
            tmp_path,
            '<listeners><listener name="a" handler="echo">\n<agent max-steps="3"/></listener></listeners>\n',
        ),
        environ={},
    )
    assert [str(p) for p in refused.errors] == [
        f"{tmp_path / 'boot.xml'}:3: listener 'a': <agent> settings need agent=\"true\""
    ]
    ok = boot.load(
        write(
            tmp_path,
            '<listeners><listener name="a" handler="assistant" agent="true">'
            '<agent max-steps="3"/></listener></listeners>\n',
            "ok.xml",
        ),
        environ={},
    )
    assert ok.ok
    profile = ok.topology.listener("a").agent_profile
    assert isinstance(profile, AgentSettings) and profile.max_steps == 3


def test_llm_and_store_sections_are_validated_and_handed_over(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners><listener name="echo" handler="echo"/></listeners>
        <llm>
          <backend name="local" provider="ollama" base-url="http://127.0.0.1:11434">
            <model name="llama3.1:8b"/>
          </backend>
        </llm>
        <store path="state/agents.sqlite3" worker-concurrency="2"/>
        """,
    )
    result = boot.load(path, environ={})
    assert result.ok, messages(result)
    # Parsed once, by the loader: the router's and the store's typed settings.
    assert isinstance(result.topology.llm, RouterConfig)
    assert [b.name for b in result.topology.llm.backends] == ["local"]
    assert result.topology.store.worker_concurrency == 2
    assert result.topology.store.path == tmp_path / "state" / "agents.sqlite3"


def test_llm_section_problems_are_reported_with_lines(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners><listener name="echo" handler="echo"/></listeners>
        <llm>
          <backend name="x" provider="ollama" base-url="http://127.0.0.1:1"><model name="m"/></backend>
          <backend name="x" provider="ollama" base-url="http://127.0.0.1:2"><model name="m"/></backend>
        </llm>
        """,
    )
    result = boot.load(path, environ={})
    assert not result.ok
    assert any(p.line == 5 and "'x'" in p.message for p in result.errors), messages(result)


def test_unknown_sections_and_schema_violations_are_errors(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners><listener name="Echo" handler="echo"/></listeners>
        <plugins/>
        """,
    )
    result = boot.load(path, environ={})
    assert not result.ok
    assert {p.line for p in result.errors} == {2, 3}
    assert "Element 'plugins': This element is not expected" in messages(result)[-1]


def test_doctype_and_malformed_xml_are_refused(tmp_path):
    evil = tmp_path / "evil.xml"
    evil.write_text('<!DOCTYPE o [<!ENTITY x SYSTEM "file:///etc/passwd">]>\n<organism/>')
    assert [p.message for p in boot.load(evil).errors] == ["a DOCTYPE is not allowed in boot.xml"]
    broken = tmp_path / "broken.xml"
    broken.write_text("<organism>\n<oops>\n</organism>")
    (problem,) = boot.load(broken).errors
    assert problem.line == 3 and problem.message.startswith("not well-formed XML")


def test_core_primitives_cannot_be_accepted_except_boot(tmp_path):
    path = write(
        tmp_path,
        '<listeners><listener name="a" handler="echo">\n'
        '<accepts type="agentserver.primitives.core:Huh"/></listener></listeners>\n',
    )
    result = boot.load(path, environ={})
    assert any("core primitives cannot be accepted" in p.message for p in result.errors)


def test_console_needs_a_router_peer(tmp_path):
    path = write(tmp_path, '<listeners><listener name="console" handler="console"/></listeners>\n')
    result = boot.load(path, environ={})
    assert any("needs a peer that takes console input" in p.message for p in result.errors)


def test_check_and_run_share_one_loader(tmp_path):
    assert boot.load_or_raise(DATA / "e2e-boot.xml").organism == "e2e"
    path = write(tmp_path, '<listeners><listener name="a" handler="nope"/></listeners>\n')
    try:
        boot.load_or_raise(path)
    except boot.BootError as exc:
        assert exc.problems and "unknown built-in handler 'nope'" in str(exc)
    else:
        raise AssertionError("expected BootError")


async def test_topology_builds_a_pump_that_serves_and_boots():
    topo = boot.load_or_raise(REPO / "boot.xml", environ={})
    listeners = build_listeners(topo, RunContext(topo))
    async with open_pump(listeners, config=topo.pump_config()) as pump:
        await pump.inject_system(topo.boot_primitive(), to=topo.boot_listener.name)
        endpoint = pump.open_endpoint()
        await endpoint.send(
            etree.tostring(
                build_envelope("x", "echo", new_thread_id(), Ping(text="in-process").to_xml_tree())
            )
        )
        with trio.fail_after(5):
            meta, payload = parse_reply(await endpoint.receive())
        assert meta["from"] == "echo" and payload[0].text == "in-process"
        assert pump.root_thread.dotted == "system.hello"
        # The echo answers in the sending task (a sync listener): the boot listener's
        # worker may not have run yet.
        await trio.testing.wait_all_tasks_blocked()
        assert pump.stats()["handled"]["boot"] == 1


def test_every_built_in_name_is_declared_once_and_made_by_the_app():
    from agentserver.app.builtins import BUILTIN_HANDLERS as MADE
    from agentserver.config.builtins import BUILTIN_HANDLERS, BUILTIN_PAYLOADS
    from agentserver.config.imports import resolve_import

    assert set(MADE) == set(BUILTIN_HANDLERS)
    refs = {ref for b in BUILTIN_HANDLERS.values() for ref in (*b.accepts, *b.responds)}
    for ref in refs | set(BUILTIN_PAYLOADS.values()):
        assert isinstance(resolve_import(ref), type), ref
