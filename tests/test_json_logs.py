"""``agentserver run`` with JSON logs (issue #25, part 4): every line it writes on
standard error, from the start-up lines to the last one at shutdown, is one JSON object,
so that a log shipper can parse standard error line by line. JSON is ``--log-format
json`` and the default when standard error is not a terminal (here: a pipe). In text
mode the start-up lines stay the plain ones tools read.

Real ``agentserver run`` processes: the lines at stake are written by the CLI itself.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading

import pytest
from httputil import http_url
from serverproc import DATA, ServerProcess, cli, outside_checkout, scratch_dir, subprocess_env


def json_records(stderr: str) -> list[dict]:
    """Every line of ``stderr`` as the JSON object it must be."""
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not one JSON object: {line!r} in\n{stderr}")
        assert isinstance(record, dict), line
        records.append(record)
    assert records, "nothing on standard error"
    return records


def with_event(records: list[dict], prefix: str) -> dict:
    (record,) = [r for r in records if r["event"].startswith(prefix)]
    return record


@pytest.mark.parametrize(
    ("boot", "options"),
    [
        pytest.param(
            DATA / "e2e-boot.xml", ["--log-format", "json", "--log-level", "info"], id="json"
        ),
        # No --log-format: standard error is a pipe, so JSON. ServerProcess runs with
        # --log-level warning: the start-up lines are written whatever the level.
        pytest.param(None, [], id="default-off-terminal-bundled-boot"),
    ],
)
def test_every_line_run_writes_on_standard_error_is_one_json_object(boot, options):
    server = ServerProcess.start(boot, "--http-port", "0", *options)
    assert server.stop() == 0
    records = json_records(server.all_stderr())
    address = f"{server.host}:{server.port}"
    listening = with_event(records, "agentserver listening on ")
    assert listening["event"] == f"agentserver listening on {address}"
    assert listening["addresses"] == [address]
    assert listening["level"] == "info"
    assert listening["logger"] == "agentserver.cli"
    url = http_url(server)  # the tests' helper still finds it in the JSON line
    http = with_event(records, "agentserver http listening on ")
    assert http["event"] == f"agentserver http listening on {url}"
    assert http["urls"] == [url]
    if "info" in options:
        assert with_event(records, "agentserver stopped")["level"] == "info"


def test_text_logs_keep_the_plain_start_up_lines():
    server = ServerProcess.start(DATA / "e2e-boot.xml", "--http-port", "0", "--log-format", "text")
    assert server.stop() == 0
    lines = server.all_stderr().splitlines()
    assert f"agentserver listening on {server.host}:{server.port}" in lines
    assert f"agentserver http listening on {http_url(server)}" in lines
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", http_url(server))


def test_a_boot_xml_that_does_not_load_is_refused_in_json():
    result = cli("--log-format", "json", "run", "missing-boot.xml")
    assert result.returncode == 1
    records = json_records(result.stderr.decode())
    refused = with_event(records, "missing-boot.xml: not started")
    assert refused["level"] == "error"


def test_a_port_in_use_is_refused_in_json():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        boot = outside_checkout(DATA / "e2e-boot.xml", scratch_dir())
        result = cli("run", str(boot), "--port", str(port))  # default: JSON (a pipe)
    assert result.returncode == 1
    refused = with_event(json_records(result.stderr.decode()), f"{boot}: cannot listen")
    assert refused["level"] == "error"


# The CLI in a subprocess of its own, with a thread that raises a Python warning once the
# server listens (gc.freeze() is called when it does), or with a server that crashes.
WARNS = """
import gc, runpy, sys, threading, time, warnings

def warn():
    while gc.get_freeze_count() == 0:
        time.sleep(0.005)
    warnings.warn("a warning while serving", UserWarning)

threading.Thread(target=warn, daemon=True).start()
sys.argv = ["agentserver", "run", sys.argv[1], "--port", "0"]
runpy.run_module("agentserver", run_name="__main__", alter_sys=True)
"""

CRASHES = """
import runpy, sys
import agentserver.app.root as root

async def crash(*args, **kwargs):
    raise RuntimeError("a bug at start-up")

root.run_server = crash
sys.argv = ["agentserver", "run", sys.argv[1], "--port", "0"]
runpy.run_module("agentserver", run_name="__main__", alter_sys=True)
"""


def run_script(script: str, until: str | None) -> tuple[int, str]:
    """Run ``script`` on the e2e topology, with JSON logs (stderr is a pipe); stop it once
    a line of standard error contains ``until`` (None: let it end). Its exit status and
    all of its standard error."""
    work = scratch_dir()
    boot = outside_checkout(DATA / "e2e-boot.xml", work)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(boot)],
        cwd=work,
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if until is not None and until in line:
                seen.set()
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        seen.wait(60)
        proc.terminate()
        status = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(15)
    return status, "".join(lines)


def test_a_python_warning_while_serving_is_one_json_object():
    status, stderr = run_script(WARNS, until="a warning while serving")
    assert status == 0, stderr
    (warned,) = [r for r in json_records(stderr) if r["logger"] == "py.warnings"]
    assert "UserWarning: a warning while serving" in warned["event"]
    assert warned["level"] == "warning"


def test_an_unexpected_error_is_one_json_object_with_its_traceback():
    status, stderr = run_script(CRASHES, until=None)
    assert status == 1, stderr
    (crashed,) = [r for r in json_records(stderr) if r["level"] == "critical"]
    assert crashed["event"].endswith(": stopped by an unexpected error")
    assert "RuntimeError: a bug at start-up" in crashed["exception"]


@pytest.mark.parametrize("element", ["listen", "http"])
def test_a_port_in_use_names_its_element_and_nothing_announced_a_start(tmp_path, element):
    """Issue 45: which of the two ports, and no "booted" (nor "listening") logged before it:
    both addresses are bound before the boot message."""
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))  # a port nobody listens on, for the other element
        used, other = taken.getsockname()[1], free.getsockname()[1]
        ports = (
            {"listen": used, "http": other}
            if element == "listen"
            else {"listen": other, "http": used}
        )
        free.close()
        boot = tmp_path / "boot.xml"
        boot.write_text(
            '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="ports">\n'
            f'  <listen host="127.0.0.1" port="{ports["listen"]}"/>\n'
            f'  <http host="127.0.0.1" port="{ports["http"]}"/>\n'
            '  <listeners><listener name="echo" handler="echo"/></listeners>\n'
            "</organism>\n"
        )
        result = cli("run", str(boot))
    assert result.returncode == 1
    records = json_records(result.stderr.decode())
    refused = with_event(records, f"{boot}: cannot listen on <{element}> 127.0.0.1:{used}: ")
    assert refused["level"] == "error"
    assert "in use" in refused["event"]
    for record in records:
        assert "booted" not in record["event"] and "listening on" not in record["event"], record
