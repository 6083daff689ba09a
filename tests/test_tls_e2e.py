"""TLS end to end: boot.xml ``<tls>`` with mutual TLS, the real server as a subprocess,
the CLI's --tls/--ca/--cert/--key, and start-up refusal of plaintext on a public address."""

from __future__ import annotations

import ssl

import pytest
import trio
from cliutil import cli_in_process
from e2e_handlers import Record
from serverproc import DATA, REPO, ServerProcess, cli, subprocess_env
from tlsutil import make_pki

from agentserver.core.errors import HuhReason
from agentserver.core.framing import FrameDecoder
from agentserver.listeners.echo import Ping
from agentserver.net.client import ClientError, open_client
from agentserver.net.tls import fingerprint_of

CAROL = "carol-token-0123456789"
PING = b'<ping xmlns="urn:agentserver:echo"><text>over tls</text></ping>'

MUTUAL_BOOT = """<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="mutual">
  <limits hello-timeout="1" read-timeout="1" drain-timeout="1"/>
  <tls cert="server.pem" key="server.key" client-ca="ca.pem" min-version="1.2"/>
  <clients>
    <client name="alice" cert-subject="CN=alice"/>
    <client name="bob" cert-fingerprint="{bob}" may-address="echo"/>
    <client name="carol" token-env="E2E_CAROL_TOKEN"/>
  </clients>
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="record" handler="e2e_handlers:record">
      <accepts type="e2e_handlers:Record"/>
      <responds type="e2e_handlers:Note"/>
    </listener>
  </listeners>
</organism>
"""


@pytest.fixture(scope="module")
def mutual(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("mutual"))
    alice = pki.client_files("alice")
    bob = pki.client_files("bob")
    mallory = pki.client_files("mallory")
    stranger = make_pki(tmp_path_factory.mktemp("stranger")).client_files("alice")
    der = ssl.PEM_cert_to_DER_cert(bob[0].read_text())
    boot = pki.dir / "boot.xml"
    boot.write_text(MUTUAL_BOOT.format(bob=fingerprint_of(der)))
    record = pki.dir / "seen.txt"
    record.write_text("")
    env = subprocess_env(E2E_CAROL_TOKEN=CAROL, E2E_RECORD_FILE=str(record))
    proc = ServerProcess.start(boot, env=env)
    proc.pki = pki
    proc.files = {"alice": alice, "bob": bob, "mallory": mallory, "stranger": stranger}
    proc.record = record
    yield proc
    assert proc.stop() == 0


def tls_options(server, who: str) -> dict:
    cert, key = server.files[who]
    return {"ca": server.pki.ca_file, "cert": cert, "key": key}


async def test_alice_is_authenticated_by_her_certificate_alone(mutual):
    async with open_client(
        mutual.host, mutual.port, client="alice", **tls_options(mutual, "alice")
    ) as client:
        reply = await client.request(Record(text="by certificate"), to="record", timeout=5)
    # The listener sees the name the certificate proves as the sender; no token was sent.
    assert reply.payload[0].text == "alice" and reply.to == "alice"
    # Without a client name the library sends no hello either.
    async with open_client(mutual.host, mutual.port, **tls_options(mutual, "alice")) as client:
        reply = await client.request(Record(text="anonymous library"), to="record", timeout=5)
    assert reply.payload[0].text == "alice"


async def test_a_fingerprint_authenticates_and_may_address_still_applies(mutual):
    async with open_client(mutual.host, mutual.port, **tls_options(mutual, "bob")) as client:
        assert (await client.request(Ping(text="b"), to="echo", timeout=5)).payload[0].text == "b"
        refused = await client.request(Record(text="bob was here"), to="record", timeout=5)
        assert refused.is_huh and refused.error_text == HuhReason.INVALID_PAYLOAD.value
    assert "bob was here" not in mutual.record.read_text()


async def test_a_certificate_from_another_ca_is_refused(mutual):
    with pytest.raises(ClientError):
        async with open_client(
            mutual.host,
            mutual.port,
            ca=mutual.pki.ca_file,
            cert=mutual.files["stranger"][0],
            key=mutual.files["stranger"][1],
        ) as client:
            await client.request(Record(text="stranger"), to="record", timeout=5)
    assert "stranger" not in mutual.record.read_text()


async def test_no_client_certificate_is_refused_even_with_a_token(mutual):
    with pytest.raises(ClientError):
        async with open_client(
            mutual.host, mutual.port, client="carol", token=CAROL, ca=mutual.pki.ca_file
        ) as client:
            await client.request(Record(text="carol"), to="record", timeout=5)
    assert "carol" not in mutual.record.read_text()


async def test_a_valid_certificate_naming_no_declared_client_is_refused(mutual):
    ctx = ssl.create_default_context(cafile=str(mutual.pki.ca_file))
    ctx.load_cert_chain(*mutual.files["mallory"])
    tcp = await trio.open_tcp_stream(mutual.host, mutual.port)
    stream = trio.SSLStream(tcp, ctx, server_hostname=mutual.host)
    decoder = FrameDecoder(65536)
    frames = []
    with trio.fail_after(5):
        await stream.do_handshake()  # the CA signed it: TLS itself succeeds
        try:
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                frames.extend(decoder.frames())
        except trio.BrokenResourceError:
            pass
    await trio.aclose_forcefully(stream)
    # One canned refusal (the same as for a bad token), then the connection is closed.
    assert len(frames) == 1 and HuhReason.UNAUTHENTICATED.value.encode() in frames[0]


def test_cli_send_with_a_client_certificate_from_the_environment(mutual):
    cert, key = mutual.files["alice"]
    env = subprocess_env(
        AGENTSERVER_CA=str(mutual.pki.ca_file), AGENTSERVER_CERT=str(cert), AGENTSERVER_KEY=str(key)
    )
    address = f"{mutual.host}:{mutual.port}"
    result = cli("send", "--to", "echo", "--connect", address, input=PING, env=env)
    assert result.returncode == 0, result.stderr
    assert b"<text>over tls</text>" in result.stdout
    flags = cli(
        "send",
        "--to",
        "echo",
        "--connect",
        address,
        "--tls",
        "--ca",
        str(mutual.pki.ca_file),
        "--cert",
        str(cert),
        "--key",
        str(key),
        "--client",
        "alice",
        input=PING,
    )
    assert flags.returncode == 0, flags.stderr
    # Without the CA the server's certificate is not trusted: a clear error, exit 4.
    untrusted = cli("send", "--to", "echo", "--connect", address, "--tls", input=PING)
    assert untrusted.returncode == 4
    assert b"certificate" in untrusted.stderr and b"--ca" in untrusted.stderr
    # A plaintext client is disconnected (exit 4), it does not hang.
    plain = cli("send", "--to", "echo", "--connect", address, "--timeout", "20", input=PING)
    assert plain.returncode == 4, plain.stderr
    missing = cli(
        "send", "--to", "echo", "--connect", address, "--ca", "/nonexistent.pem", input=PING
    )
    assert missing.returncode == 2 and b"/nonexistent.pem" in missing.stderr


# -- start-up ---------------------------------------------------------------------------------


def clients_boot(tmp_path, listen: str) -> str:
    path = tmp_path / "boot.xml"
    text = (DATA / "clients-boot.xml").read_text()
    path.write_text(text.replace("<limits", f"{listen}\n  <limits", 1))
    return str(path)


def test_declared_clients_on_a_public_address_without_tls_are_refused(tmp_path):
    public = clients_boot(tmp_path, '<listen host="0.0.0.0" port="0"/>')
    check = cli_in_process("check", public)
    assert check.returncode == 1
    assert f"{public}:4:".encode() in check.stdout and b"<tls>" in check.stdout
    run = cli("run", public, timeout=30)
    assert run.returncode == 1 and b"not started" in run.stderr
    # The same on --host: the file says loopback, the command line does not.
    loopback = clients_boot(tmp_path, '<listen host="127.0.0.1" port="0"/>')
    override = cli("run", loopback, "--host", "0.0.0.0", "--port", "0", timeout=30)
    assert override.returncode == 1 and b"insecure-plaintext" in override.stderr


def test_insecure_plaintext_starts_with_a_warning(tmp_path):
    path = clients_boot(tmp_path, '<listen host="0.0.0.0" port="0" insecure-plaintext="true"/>')
    check = cli_in_process("check", path)
    assert check.returncode == 0 and b"insecure-plaintext" in check.stdout
    proc = ServerProcess.start(path)
    try:
        assert "in clear" in proc.stderr
    finally:
        assert proc.stop() == 0


def test_tls_on_a_public_address_needs_no_insecure_flag(tmp_path):
    pki = make_pki(tmp_path)
    path = pki.dir / "boot.xml"
    text = (DATA / "clients-boot.xml").read_text()
    path.write_text(
        text.replace(
            "<limits",
            '<listen host="0.0.0.0" port="0"/>\n  <tls cert="server.pem" key="server.key"/>\n'
            "  <limits",
            1,
        )
    )
    check = cli_in_process("check", str(path))
    assert check.returncode == 0, check.stdout
    assert b"in clear" not in check.stderr


def test_bundled_boot_is_unaffected():
    assert (
        cli_in_process(
            "check", str(REPO / "boot.xml"), env=subprocess_env(OPENAI_API_KEY="k")
        ).returncode
        == 0
    )
