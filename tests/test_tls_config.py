"""boot.xml ``<tls>`` and client certificate attributes, checked by the loader (FILE:LINE
problems), and the pure parts: certificate matching and the hello throttle."""

from __future__ import annotations

import ssl
import textwrap

import pytest
import trio
import trustme
from hypothesis import given
from hypothesis import strategies as st
from tlsutil import make_pki

from agentserver.app.root import certificate_rules
from agentserver.config import loader as boot
from agentserver.core.throttle import HelloThrottle
from agentserver.net.tls import (
    CertificateRule,
    TlsError,
    client_context,
    match_certificate,
    normalize_fingerprint,
    parse_subject,
    subject_of,
)

NS = "https://xml-pipeline.org/ns/boot/v1"
LISTENERS = '  <listeners><listener name="echo" handler="echo"/></listeners>\n'


def write(directory, body: str):
    path = directory / "boot.xml"
    path.write_text(
        f'<organism xmlns="{NS}" name="t">\n' + textwrap.dedent(body) + LISTENERS + "</organism>\n"
    )
    return path


def messages(result: boot.LoadResult) -> list[str]:
    return [str(p) for p in result.problems]


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path)


def test_tls_paths_are_relative_to_boot_xml_and_load(pki, tmp_path):
    path = write(tmp_path, '  <tls cert="server.pem" key="server.key" min-version="1.3"/>\n')
    result = boot.load(path, environ={})
    assert result.ok, messages(result)
    tls = result.topology.tls
    assert (tls.cert, tls.key, tls.client_ca, tls.min_version) == (
        pki.cert_file,
        pki.key_file,
        None,
        "1.3",
    )


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ('cert="missing.pem" key="server.key"', "certificate file {d}/missing.pem does not exist"),
        ('cert="server.key" key="server.key"', "holds no PEM certificate"),
        ('cert="server.pem" key="server.pem"', "holds no PEM private key"),
        ('cert="server.pem" key="other.key"', "does not match the certificate"),
        ('cert="server.pem" key="server.key" client-ca="nope.pem"', "nope.pem does not exist"),
        ('key="server.key"', "<tls> needs cert= or cert-env="),
        ('cert-env="NO_SUCH_VAR" key="server.key"', "variable NO_SUCH_VAR is not set"),
    ],
)
def test_tls_problems_are_reported_with_file_and_line(pki, tmp_path, attributes, expected):
    other = trustme.CA().issue_cert("127.0.0.1")
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    path = write(tmp_path, f"\n  <tls {attributes}/>\n")
    result = boot.load(path, environ={})
    assert not result.ok
    assert any(
        m.startswith(f"{path}:3: <tls") and expected.format(d=tmp_path) in m
        for m in messages(result)
    ), messages(result)


def test_cert_env_and_key_env_keep_paths_out_of_the_file(pki, tmp_path):
    path = write(tmp_path, '  <tls cert-env="SRV_CERT" key-env="SRV_KEY"/>\n')
    env = {"SRV_CERT": str(pki.cert_file), "SRV_KEY": str(pki.key_file)}
    result = boot.load(path, environ=env)
    assert result.ok, messages(result)
    assert result.topology.tls.paths(env) == (pki.cert_file, pki.key_file)


def test_client_certificate_attributes(pki, tmp_path):
    fingerprint = "sha256:" + ":".join(["AB"] * 32)
    path = write(
        tmp_path,
        f"""\
          <tls cert="server.pem" key="server.key" client-ca="ca.pem"/>
          <clients>
            <client name="alice" cert-subject="CN=alice, O=acme"/>
            <client name="bob" cert-fingerprint="{fingerprint}"/>
            <client name="carol" token-env="CAROL_TOKEN"/>
          </clients>
        """,
    )
    result = boot.load(path, environ={"CAROL_TOKEN": "t"})
    assert result.ok, messages(result)
    alice, bob, _ = result.topology.clients
    assert alice.cert_subject == "CN=alice, O=acme" and alice.token_env is None
    assert bob.cert_fingerprint == "sha256:" + "ab" * 32
    rules = certificate_rules(result.topology)
    assert [r.client for r in rules] == ["alice", "bob"]
    assert rules[0].subject == {("CN", "alice"), ("O", "acme")}
    # carol has only a token: with mutual TLS she cannot connect, and check says so.
    assert any(":6: warning: client 'carol'" in m for m in messages(result)), messages(result)


def test_client_certificates_need_mutual_tls_and_some_credential(pki, tmp_path):
    path = write(
        tmp_path,
        """\
          <tls cert="server.pem" key="server.key"/>
          <clients>
            <client name="alice" cert-subject="CN=alice"/>
            <client name="bob"/>
            <client name="dave" cert-subject="alice"/>
          </clients>
        """,
    )
    found = messages(boot.load(path, environ={}))
    assert any(
        ":4: client 'alice': cert-subject/cert-fingerprint need mutual TLS" in m for m in found
    )
    assert any(
        ":5: client 'bob' needs token-env, cert-subject or cert-fingerprint" in m for m in found
    )
    assert any(":6: client 'dave': cert-subject: 'alice' is not NAME=VALUE" in m for m in found)


def test_a_bad_fingerprint_is_a_schema_error(pki, tmp_path):
    path = write(
        tmp_path,
        """\
          <tls cert="server.pem" key="server.key" client-ca="ca.pem"/>
          <clients><client name="bob" cert-fingerprint="md5:1234"/></clients>
        """,
    )
    result = boot.load(path, environ={})
    assert not result.ok and any(":3:" in m and "cert-fingerprint" in m for m in messages(result))


async def test_min_version_13_refuses_a_tls_12_client(pki, tmp_path):
    from agentserver.net.tls import TlsSpec, server_context

    ctx = server_context(TlsSpec(pki.cert_file, pki.key_file, min_version="1.3"), {})
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    old = client_context(ca=pki.ca_file)
    old.maximum_version = ssl.TLSVersion.TLSv1_2

    async def serve_one(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        stream = await listeners[0].accept()
        tls = trio.SSLStream(stream, ctx, server_side=True)
        with pytest.raises(trio.BrokenResourceError):
            await tls.do_handshake()
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_one)
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        client = trio.SSLStream(tcp, old, server_hostname="127.0.0.1")
        with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
            await client.do_handshake()
        await tcp.aclose()
    await listeners[0].aclose()


def test_client_context_reports_unusable_files(pki, tmp_path):
    with pytest.raises(TlsError, match="does not exist"):
        client_context(ca=tmp_path / "none.pem")
    with pytest.raises(TlsError, match="needs its certificate"):
        client_context(key=pki.key_file)
    assert client_context(ca=pki.ca_file).verify_mode == ssl.CERT_REQUIRED
    assert client_context(ca=pki.ca_file).check_hostname


# -- certificate matching (pure) ----------------------------------------------------------


PEER = {"subject": ((("organizationName", "acme"),), (("commonName", "alice"),))}


def test_subject_rules_match_every_declared_attribute():
    assert subject_of(PEER) == {("O", "acme"), ("CN", "alice")}
    alice = CertificateRule("alice", parse_subject("CN=alice"))
    exact = CertificateRule("alice2", parse_subject("O=acme,CN=alice"))
    other = CertificateRule("bob", parse_subject("CN=bob, O=acme"))
    assert alice.matches(subject_of(PEER), "x") and exact.matches(subject_of(PEER), "x")
    assert not other.matches(subject_of(PEER), "x")
    assert match_certificate([alice, other], PEER, b"der") == "alice"
    # Two clients matching one certificate prove nobody.
    assert match_certificate([alice, exact], PEER, b"der") is None
    assert match_certificate([alice], PEER, None) is None


def test_fingerprints_are_normalised():
    digest = "AB" * 32
    assert normalize_fingerprint(f"SHA256:{digest}") == "sha256:" + "ab" * 32
    with pytest.raises(ValueError):
        normalize_fingerprint("sha1:" + digest)
    with pytest.raises(ValueError):
        normalize_fingerprint("sha256:abc")


# -- the hello throttle (pure) ------------------------------------------------------------


def test_five_failures_are_free_then_the_delay_doubles_up_to_the_cap():
    throttle = HelloThrottle(free_failures=5, base_delay=1.0, max_delay=8.0)
    now = 100.0
    starts = []
    for _ in range(5):
        assert throttle.delay("a", now) == 0
        starts.append(throttle.failed("a", now))
    assert starts == [False, False, False, False, True]  # the burst starts: log once
    waits = []
    for _ in range(6):
        waits.append(throttle.delay("a", now))
        now += waits[-1]
        assert not throttle.failed("a", now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert throttle.delay("b", now) == 0  # another address is unaffected
    throttle.succeeded("a")
    assert throttle.delay("a", now) == 0


def test_waiting_counts_and_a_quiet_address_is_forgotten():
    throttle = HelloThrottle(free_failures=1, base_delay=10.0, forget_after=60.0)
    throttle.failed("a", 0.0)
    assert throttle.delay("a", 4.0) == 6.0 and throttle.delay("a", 12.0) == 0
    assert throttle.failures("a", 59.0) == 1 and throttle.failures("a", 60.0) == 0
    assert len(throttle) == 0
    assert throttle.failed("a", 61.0)  # a new burst: logged again


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 5)), max_size=300))
def test_the_table_stays_bounded_and_delays_stay_capped(events):
    throttle = HelloThrottle(free_failures=2, base_delay=0.5, max_delay=3.0, max_addresses=8)
    now = 0.0
    for address, step in events:
        now += step
        assert 0 <= throttle.delay(str(address), now) <= 3.0
        throttle.failed(str(address), now)
        assert len(throttle) <= 8
