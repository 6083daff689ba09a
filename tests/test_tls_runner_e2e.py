"""Mutual TLS for everything a client connects to, end to end: ``agentserver runner``
authenticated by its certificate alone serves a remote listener, and the HTTP API on the
same ``<tls>`` (client certificate required, bearer token still naming the caller)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
import trio
from httputil import http_url
from runner_handlers import NS, Query
from serverproc import ServerProcess, scratch_dir, subprocess_env
from tlsutil import make_pki

from agentserver.net.client import TlsSessions, open_client

CAROL = "carol-http-token-0123456789"
PING = b'<ping xmlns="urn:agentserver:echo"><text>over https</text></ping>'

BOOT = """<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="mutual-runner">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1"/>
  <tls cert="server.pem" key="server.key" client-ca="ca.pem" min-version="1.3"/>
  <clients>
    <client name="alice" cert-subject="CN=alice"/>
    <client name="search-runner" cert-subject="CN=search-runner" serves="search"/>
    <client name="carol" token-env="TLS_RUNNER_CAROL"/>
  </clients>
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="search" remote="true" timeout="5" idempotent="true">
      <accepts type="runner_handlers:Query"/>
      <responds type="runner_handlers:Result"/>
    </listener>
  </listeners>
</organism>
"""


@pytest.fixture(scope="module")
def mutual(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("mutual-runner"))
    files = {name: pki.client_files(name) for name in ("alice", "search-runner")}
    boot = pki.dir / "boot.xml"
    boot.write_text(BOOT)
    env = subprocess_env(TLS_RUNNER_CAROL=CAROL)
    proc = ServerProcess.start(boot, "--http-port", "0", env=env)
    proc.pki = pki
    proc.files = files
    yield proc
    assert proc.stop() == 0, proc.stderr


async def test_a_runner_authenticated_by_its_certificate_serves_its_listener(mutual):
    cert, key = mutual.files["search-runner"]
    env = subprocess_env()
    env.pop("AGENTSERVER_TOKEN", None)  # no token anywhere: the certificate is the proof
    cmd = [sys.executable, "-m", "agentserver", "runner", "--connect"]
    cmd += [f"{mutual.host}:{mutual.port}", "--tls", "--ca", str(mutual.pki.ca_file)]
    cmd += ["--cert", str(cert), "--key", str(key), "--listener", "search"]
    cmd += ["--handler", "runner_handlers:handle"]
    # Started and stopped around the awaits below (a process, not a trio task).
    runner = subprocess.Popen(  # noqa: ASYNC220
        cmd, env=env, cwd=scratch_dir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        alice_cert, alice_key = mutual.files["alice"]
        options = {"ca": mutual.pki.ca_file, "cert": alice_cert, "key": alice_key}
        sessions = TlsSessions()
        answer = None
        with trio.fail_after(20):
            while answer is None:
                # Reconnecting until the runner has announced itself: each reconnection
                # resumes alice's TLS session.
                async with open_client(
                    mutual.host, mutual.port, client="alice", sessions=sessions, **options
                ) as client:
                    reply = await client.request(Query(text="found"), to="search", timeout=10)
                if not reply.is_error:
                    answer = reply
                else:
                    assert runner.poll() is None, runner.stderr.read().decode()
                    await trio.sleep(0.2)
        assert answer.payload.findtext(f"{{{NS}}}text") == "found"
        assert answer.payload.findtext(f"{{{NS}}}runner") == str(runner.pid)
        # One more connection, as alice again: resumed, still named by her certificate.
        async with open_client(
            mutual.host, mutual.port, client="alice", sessions=sessions, **options
        ) as client:
            again = await client.request(Query(text="again"), to="search", timeout=10)
        assert again.to == "alice" and not again.is_error, again.raw
        assert sessions.full == 1 and sessions.resumed >= 1
    finally:
        runner.terminate()
        runner.wait(10)
    assert runner.returncode == 0, runner.stderr.read().decode()


def test_a_runner_with_neither_token_nor_certificate_is_a_usage_error(mutual):
    env = subprocess_env()
    env.pop("AGENTSERVER_TOKEN", None)
    cmd = [sys.executable, "-m", "agentserver", "runner", "--connect"]
    cmd += [f"{mutual.host}:{mutual.port}", "--tls", "--ca", str(mutual.pki.ca_file)]
    cmd += ["--listener", "search", "--handler", "runner_handlers:handle"]
    done = subprocess.run(
        cmd,
        env=env,
        cwd=scratch_dir(),
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert b"--cert" in done.stderr


def test_the_http_api_over_the_same_mutual_tls(mutual):
    url = http_url(mutual)
    assert url.startswith("https://")
    cert, key = mutual.files["alice"]
    bearer = {"Authorization": f"Bearer {CAROL}"}
    verify = mutual.pki.client_context()
    verify.load_cert_chain(cert, key)
    with httpx.Client(verify=verify, timeout=10) as client:
        response = client.post(
            f"{url}/v1/messages", params={"to": "echo"}, content=PING, headers=bearer
        )
        assert response.status_code == 200, response.text
        assert b"over https" in response.content
        # A certificate, but no token: HTTP still needs the bearer token to name the caller.
        assert client.get(f"{url}/v1/listeners").status_code == 401
    # No client certificate: the handshake is refused, nothing is served.
    with (
        httpx.Client(verify=mutual.pki.client_context(), timeout=10) as client,
        pytest.raises(httpx.HTTPError),
    ):
        client.post(f"{url}/v1/messages", params={"to": "echo"}, content=PING, headers=bearer)
    # Plaintext HTTP to the TLS port gets no answer.
    with httpx.Client(timeout=5) as client, pytest.raises(httpx.HTTPError):
        client.get(url.replace("https://", "http://") + "/healthz")


async def test_a_reconnecting_runner_outlives_a_server_restart(tmp_path):
    """``agentserver runner --reconnect`` keeps serving across a SIGKILL and restart of the
    server on the same port (a full handshake then: a new server has new ticket keys)."""
    pki = make_pki(tmp_path)
    boot = pki.dir / "boot.xml"
    boot.write_text(BOOT)
    env = subprocess_env(TLS_RUNNER_CAROL=CAROL)
    server = ServerProcess.start(boot, env=env)
    cert, key = pki.client_files("search-runner")
    alice_cert, alice_key = pki.client_files("alice")
    options = {"ca": pki.ca_file, "cert": alice_cert, "key": alice_key}
    runner_env = subprocess_env()
    runner_env.pop("AGENTSERVER_TOKEN", None)
    cmd = [sys.executable, "-m", "agentserver", "runner", "--connect"]
    cmd += [f"{server.host}:{server.port}", "--tls", "--ca", str(pki.ca_file)]
    cmd += ["--cert", str(cert), "--key", str(key), "--listener", "search"]
    cmd += ["--handler", "runner_handlers:handle", "--reconnect"]
    runner = subprocess.Popen(  # noqa: ASYNC220
        cmd, env=runner_env, cwd=scratch_dir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )

    async def served(text: str) -> None:
        with trio.fail_after(30):
            while True:
                try:
                    async with open_client(
                        server.host, server.port, client="alice", **options
                    ) as client:
                        reply = await client.request(Query(text=text), to="search", timeout=10)
                except OSError:
                    reply = None
                if reply is not None and not reply.is_error:
                    assert reply.payload.findtext(f"{{{NS}}}text") == text
                    assert reply.payload.findtext(f"{{{NS}}}runner") == str(runner.pid)
                    return
                assert runner.poll() is None, runner.stderr.read().decode()
                await trio.sleep(0.2)

    try:
        await served("before")
        port = server.port
        server.stop(signal.SIGKILL)
        server = ServerProcess.start(boot, "--port", str(port), env=env)
        await served("after")
    finally:
        runner.terminate()
        runner.wait(10)
        server.stop()
    err = runner.stderr.read().decode()
    assert runner.returncode == 0, err
    assert "reconnecting in" in err and "TLS sessions: 1 full" in err, err
