"""HTTP API authentication against real servers: the socket's rules with a bearer token.
Declared clients need their token (a bad one is refused, may-address applies, one
client cannot read another's threads); anonymous callers only from loopback; HTTPS with
boot.xml's <tls> certificate."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import parse_reply
from httputil import http_url
from serverproc import DATA, ServerProcess, subprocess_env
from tlsutil import make_pki, with_tls

from agentserver.core.errors import HuhReason

ECHO = "urn:agentserver:echo"
E2E = "urn:test:e2e"
PING = f'<ping xmlns="{ECHO}"><text>hi</text></ping>'.encode()
RECORD = f'<record xmlns="{E2E}"><text>x</text></record>'.encode()
ALICE, BOB = "alice-http-secret", "bob-http-secret"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def guarded():
    env = subprocess_env(E2E_ALICE_TOKEN=ALICE, E2E_BOB_TOKEN=BOB)
    proc = ServerProcess.start(DATA / "clients-boot.xml", "--http-port", "0", env=env)
    yield proc
    assert proc.stop() == 0, proc.stderr


def test_declared_clients_need_their_bearer_token(guarded):
    url = http_url(guarded)
    with httpx.Client(base_url=url, timeout=10) as client:
        good = {"headers": bearer(ALICE)}
        for headers in (
            {},
            bearer("wrong"),
            {"Authorization": ALICE},
            {"Authorization": "Basic x"},
        ):
            response = client.post(
                "/v1/messages", params={"to": "echo"}, content=PING, headers=headers
            )
            assert response.status_code == 401, (headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["title"] == HuhReason.UNAUTHENTICATED.value
            # a success forgets this address's failures (else it would be slowed down)
            assert client.get("/v1/listeners", **good).status_code == 200
        for path in ("/v1/listeners", "/metrics", "/v1/status", "/v1/agents", "/v1/events"):
            assert client.get(path, headers=bearer("wrong")).status_code == 401, path
            assert client.get("/healthz").status_code == 200  # probes stay open
            assert client.get("/v1/listeners", **good).status_code == 200
        ok = client.post("/v1/messages", params={"to": "echo"}, content=PING, **good)
        assert ok.status_code == 200, ok.text
        assert parse_reply(ok.content)[0]["from"] == "echo"


def test_repeated_failures_are_throttled_like_failed_hellos(guarded):
    url = http_url(guarded)
    with httpx.Client(base_url=url, timeout=30) as client:
        before = client.get("/v1/status", headers=bearer(ALICE)).json()["http"]["throttled"]
        for _ in range(6):  # five free failures, then the address is slowed down
            assert client.get("/v1/listeners", headers=bearer("guess")).status_code == 401
        after = client.get("/v1/status", headers=bearer(ALICE)).json()["http"]["throttled"]
    # slowed: the sixth failure, and the good request after it (a request is checked only
    # once its delay is over, like a throttled hello), which then forgets the failures
    assert after == before + 2
    with httpx.Client(base_url=url, timeout=30) as client:
        again = client.get("/v1/status", headers=bearer(ALICE)).json()["http"]["throttled"]
    assert again == after


def test_a_clients_name_is_its_endpoints_and_may_address_applies(guarded):
    url = http_url(guarded)
    with httpx.Client(base_url=url, timeout=10) as client:
        # the record listener answers with the sender's name: alice's, suffixed
        response = client.post(
            "/v1/messages", params={"to": "record"}, content=RECORD, headers=bearer(ALICE)
        )
        assert response.status_code == 200, response.text
        sender = parse_reply(response.content)[1].findtext(f"{{{E2E}}}text")
        assert sender.startswith("alice-")
        # bob may address echo only: record is refused exactly like an unknown listener
        refused = client.post(
            "/v1/messages", params={"to": "record"}, content=RECORD, headers=bearer(BOB)
        )
        unknown = client.post(
            "/v1/messages", params={"to": "nobody"}, content=RECORD, headers=bearer(BOB)
        )
        assert refused.status_code == unknown.status_code == 422
        assert refused.json()["title"] == unknown.json()["title"] == HuhReason.INVALID_PAYLOAD.value
        # and he sees only the listeners he may address
        names = [
            entry["name"]
            for entry in client.get("/v1/listeners", headers=bearer(BOB)).json()["listeners"]
        ]
        assert names == ["echo"]
        # a kept thread is its sender's only
        accepted = client.post(
            "/v1/messages",
            params={"to": "echo", "wait": "false"},
            content=PING,
            headers=bearer(BOB),
        )
        assert accepted.status_code == 202
        thread = accepted.json()["thread"]
        assert client.get(f"/v1/threads/{thread}", headers=bearer(BOB)).status_code == 200
        assert client.get(f"/v1/threads/{thread}", headers=bearer(ALICE)).status_code == 404


def _non_loopback_address() -> str | None:
    """This machine's own non-loopback IPv4 address (no packet is sent), if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_anonymous_callers_are_served_from_loopback_only(tmp_path):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback address on this machine")
    boot = tmp_path / "boot.xml"
    boot.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="open">'
        '<http host="0.0.0.0" port="0"/>'
        '<listeners><listener name="echo" handler="echo"/></listeners></organism>'
    )
    proc = ServerProcess.start(boot, "--insecure")
    try:
        port = http_url(proc).rsplit(":", 1)[1]
        # a client bound to the machine's own public address, talking to itself
        outside = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=outside, timeout=10) as client:
            response = client.post(
                f"http://{address}:{port}/v1/messages", params={"to": "echo"}, content=PING
            )
            assert response.status_code == 403
            assert response.json()["title"] == HuhReason.UNAUTHENTICATED.value
            assert client.get(f"http://{address}:{port}/v1/listeners").status_code == 403
            assert client.get(f"http://{address}:{port}/healthz").status_code == 200
        with httpx.Client(timeout=10) as client:
            response = client.post(
                f"http://127.0.0.1:{port}/v1/messages", params={"to": "echo"}, content=PING
            )
            assert response.status_code == 200
    finally:
        assert proc.stop() == 0, proc.stderr


def test_anonymous_http_on_a_public_address_needs_insecure(tmp_path):
    boot = tmp_path / "boot.xml"
    boot.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="open">'
        '<http host="0.0.0.0" port="0"/>'
        '<listeners><listener name="echo" handler="echo"/></listeners></organism>'
    )
    with pytest.raises(RuntimeError, match="HTTP callers are anonymous"):
        ServerProcess.start(boot, timeout=10)


def test_https_with_the_sockets_certificate(tmp_path):
    pki = make_pki(tmp_path / "pki")
    boot = with_tls(
        DATA / "clients-boot.xml",
        tmp_path / "boot.xml",
        cert=str(pki.cert_file),
        key=str(pki.key_file),
    )
    env = subprocess_env(E2E_ALICE_TOKEN=ALICE, E2E_BOB_TOKEN=BOB)
    proc = ServerProcess.start(boot, "--http-port", "0", env=env)
    try:
        url = http_url(proc)
        assert url.startswith("https://")
        with httpx.Client(verify=pki.client_context(), timeout=10) as client:
            response = client.post(
                f"{url}/v1/messages", params={"to": "echo"}, content=PING, headers=bearer(ALICE)
            )
            assert response.status_code == 200, response.text
        # plaintext HTTP to the TLS port gets no answer
        plain = url.replace("https://", "http://")
        with httpx.Client(timeout=5) as client, pytest.raises(httpx.HTTPError):
            client.get(f"{plain}/healthz")
    finally:
        assert proc.stop() == 0, proc.stderr
