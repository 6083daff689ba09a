"""Relative paths in boot.xml are relative to boot.xml's folder, resolved once by the
loader: the working directory changes nothing (docs/boot.md, "Paths")."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

from serverproc import ServerProcess, subprocess_env
from tlsutil import make_pki

from agentserver.agents.profile.settings import AgentSettings, StoreSettings
from agentserver.config import loader as boot
from agentserver.core.xsdgen import model_root_tag
from agentserver.llm.config import RouterConfig

NS = "https://xml-pipeline.org/ns/boot/v1"

AGENT = """\
<listeners>
  <listener name="helper" handler="assistant" agent="true"><agent model="m" max-steps="4"/></listener>
</listeners>
"""


def write(directory: pathlib.Path, body: str, name: str = "boot.xml") -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f'<organism xmlns="{NS}" name="t">\n' + textwrap.dedent(body) + "</organism>\n")
    return path


def test_a_relative_store_path_is_resolved_against_boot_xmls_folder(tmp_path, monkeypatch):
    write(tmp_path / "conf", '<store path="data/agents.sqlite3"/>\n' + AGENT)
    monkeypatch.chdir(tmp_path / "conf")
    here = boot.load_or_raise("boot.xml", environ={})
    monkeypatch.chdir(tmp_path)
    elsewhere = boot.load_or_raise("conf/boot.xml", environ={})
    expected = tmp_path / "conf" / "data" / "agents.sqlite3"
    assert here.store.path == elsewhere.store.path == expected
    assert expected.is_absolute()


def test_the_default_store_is_next_to_boot_xml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    topology = boot.load_or_raise(write(tmp_path / "conf", AGENT), environ={})
    # Fair share is on by default (issue 43): no <client weight> means equal weights.
    assert topology.store == StoreSettings(
        path=tmp_path / "conf" / "state" / "agents.sqlite3", fair_weights=()
    )
    # A document in memory has no folder: the working directory stands in for it.
    data = (tmp_path / "conf" / "boot.xml").read_bytes()
    assert boot.load_bytes(data, environ={}).topology.store.path == (
        tmp_path / "state" / "agents.sqlite3"
    )


def test_an_absolute_store_path_stays_as_written(tmp_path):
    where = tmp_path / "somewhere" / "agents.sqlite3"
    topology = boot.load_or_raise(
        write(tmp_path / "conf", f'<store path="{where}"/>\n' + AGENT), environ={}
    )
    assert topology.store.path == where


def test_sections_arrive_as_typed_settings_with_the_loaders_environment(tmp_path):
    path = write(
        tmp_path,
        """\
        <llm>
          <backend name="local" provider="ollama" base-url="http://127.0.0.1:1"
                   base-url-env="LOCAL_URL">
            <model name="llama3.1:8b"/>
          </backend>
        </llm>
        <store url-env="STORE_URL" worker-concurrency="3"/>
        """
        + AGENT,
    )
    url = "postgresql://u@db.example/agents"
    env = {"LOCAL_URL": "http://127.0.0.1:2", "STORE_URL": url}
    topology = boot.load_or_raise(path, environ=env)
    assert isinstance(topology.llm, RouterConfig)
    assert topology.llm.backends[0].base_url == "http://127.0.0.1:2"
    assert topology.store.url == url and topology.store.worker_concurrency == 3
    profile = topology.listener("helper").agent_profile
    assert profile == AgentSettings(model="m", max_steps=4)
    assert topology.listener("helper").agent_policy is None
    assert topology.listener("helper").agent_guardrails == ()


def test_tls_files_are_resolved_against_boot_xmls_folder(tmp_path, monkeypatch):
    pki = make_pki(tmp_path / "conf")
    write(
        tmp_path / "conf",
        '<tls cert="server.pem" key="server.key" client-ca="ca.pem"/>\n'
        '<listeners><listener name="echo" handler="echo"/></listeners>\n',
    )
    monkeypatch.chdir(tmp_path)
    topology = boot.load_or_raise(pathlib.Path("conf/boot.xml"), environ={})
    assert topology.tls is not None
    assert (topology.tls.cert, topology.tls.key, topology.tls.client_ca) == (
        pki.cert_file,
        pki.key_file,
        pki.ca_file,
    )


def test_schema_files_and_handler_modules_are_found_next_to_boot_xml(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "schemas").mkdir(parents=True)
    (conf / "schemas" / "note.xsd").write_text(
        '<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema" targetNamespace="urn:t:note"'
        ' elementFormDefault="qualified"><xs:element name="note" type="xs:string"/></xs:schema>'
    )
    (conf / "paths_next_to_boot.py").write_text(
        "async def handle(payload, meta):\n    return None\n"
    )
    write(
        conf,
        '<listeners><listener name="notes" handler="paths_next_to_boot:handle"'
        ' ends-chains="true"><accepts schema="schemas/note.xsd" root="{urn:t:note}note"/>'
        "</listener></listeners>\n",
    )
    monkeypatch.chdir(tmp_path)  # neither the schema nor the module is here
    topology = boot.load_or_raise("conf/boot.xml", environ={})
    notes = topology.listener("notes")
    assert notes.handler is not None and notes.handler.__module__ == "paths_next_to_boot"
    assert [model_root_tag(m) for m in notes.accepts] == ["{urn:t:note}note"]


def test_check_and_run_from_another_folder_name_and_open_the_store_next_to_boot_xml(tmp_path):
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(conf, '<store path="data/agents.sqlite3"/>\n' + AGENT)
    expected = conf / "data" / "agents.sqlite3"
    relative = os.path.join("..", "conf", "boot.xml")  # BOOT given relative to elsewhere
    check = subprocess.run(
        [sys.executable, "-m", "agentserver", "check", "--connect", relative],
        cwd=elsewhere,
        env=subprocess_env(),
        capture_output=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr.decode()
    assert f"store: SQLite file {expected} " in check.stdout.decode()
    server = ServerProcess.start(relative, cwd=elsewhere)
    try:
        assert expected.is_file()  # created and migrated at start, before listening
    finally:
        assert server.stop() == 0
    assert not (elsewhere / "data").exists() and not (elsewhere / "state").exists()
