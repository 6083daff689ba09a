"""The HTTP API against a real server (a subprocess) with httpx: every endpoint, the
socket's refusals and limits, ?wait=false threads, and `agentserver status`."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from conftest import envelope_bytes, huh_text, is_huh, parse_reply
from httputil import http_url
from lxml import etree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import DATA, RawConnection, ServerProcess, cli, subprocess_env

from agentserver.core.errors import HuhReason
from agentserver.core.framing import encode_frame
from agentserver.core.threads import new_thread_id

ECHO = "urn:agentserver:echo"
E2E = "urn:test:e2e"
PING = f'<ping xmlns="{ECHO}"><text>hi</text></ping>'.encode()
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess.start(DATA / "e2e-boot.xml", "--http-port", "0")
    yield proc
    assert proc.stop() == 0, proc.stderr


@pytest.fixture
async def api(server):
    async with httpx.AsyncClient(base_url=http_url(server), timeout=10) as client:
        yield client


def problem(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/problem+json", response.text
    body = response.json()
    assert body["status"] == response.status_code
    assert body["type"].startswith("https://xml-pipeline.org/problems/")
    return body


async def socket_refusal(server: ServerProcess, payload: bytes, to: str) -> str:
    """The <huh> text the socket answers for ``payload`` sent to ``to``."""
    conn = await RawConnection.open(server)
    try:
        element = etree.fromstring(payload)
        await conn.send_frame(envelope_bytes(element, to=to, thread=new_thread_id()))
        with trio.fail_after(5):
            frame = await conn.receive_frame()
        _, reply = parse_reply(frame)
        assert is_huh(reply), frame
        return huh_text(reply)
    finally:
        await conn.aclose()


async def test_health_and_readiness(api):
    response = await api.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    response = await api.get("/readyz")
    assert response.status_code == 200
    # no agents in this topology: only the pump is checked
    assert response.json() == {"ready": True, "checks": {"pump": True, "store": None, "llm": None}}


async def test_post_message_waits_for_the_reply_envelope(api):
    thread = new_thread_id()
    response = await api.post("/v1/messages", params={"to": "echo", "thread": thread}, content=PING)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/xml"
    assert response.headers["agentserver-thread"] == thread
    meta, payload = parse_reply(response.content)
    assert meta["from"] == "echo" and meta["thread"] == thread
    assert payload.tag == f"{{{ECHO}}}pong" and payload.findtext(f"{{{ECHO}}}text") == "hi"


async def test_keep_alive_connection_carries_many_messages(api):
    for i in range(20):
        body = f'<ping xmlns="{ECHO}"><text>{i}</text></ping>'.encode()
        response = await api.post("/v1/messages", params={"to": "echo"}, content=body)
        assert response.status_code == 200
        assert parse_reply(response.content)[1].findtext(f"{{{ECHO}}}text") == str(i)


async def test_wait_false_answers_202_and_the_thread_collects_replies(api):
    job = f'<job xmlns="{E2E}"><text>later</text><seconds>0.3</seconds></job>'.encode()
    response = await api.post("/v1/messages", params={"to": "slow", "wait": "false"}, content=job)
    assert response.status_code == 202, response.text
    thread = response.json()["thread"]
    assert response.headers["location"] == f"/v1/threads/{thread}"
    # at first nothing has come back yet
    first = (await api.get(f"/v1/threads/{thread}")).json()
    assert first["thread"] == thread and first["replies"] == []
    with trio.fail_after(10):
        while True:
            body = (await api.get(f"/v1/threads/{thread}")).json()
            if body["replies"]:
                break
            await trio.sleep(0.05)
    meta, payload = parse_reply(body["replies"][0].encode())
    assert meta["from"] == "slow" and meta["thread"] == thread
    assert payload.findtext(f"{{{E2E}}}text") == "later"
    assert body["dropped"] == 0 and body["expires_in"] > 0
    # an unknown thread reads as not found
    missing = await api.get(f"/v1/threads/{new_thread_id()}")
    assert missing.status_code == 404 and problem(missing)["title"] == "Not found."


async def test_a_chain_ending_without_an_answer_is_204(api):
    body = f'<silent xmlns="{E2E}"><text>x</text></silent>'.encode()
    response = await api.post("/v1/messages", params={"to": "silent"}, content=body)
    assert response.status_code == 204
    assert response.headers["agentserver-thread"]


async def test_refusals_are_problems_with_the_sockets_canned_texts(server, api):
    cases = [
        # unknown listener, payload failing its XSD, unknown root tag: one text, no probing
        (PING, "nobody", 422),
        (f'<ping xmlns="{ECHO}"><wrong/></ping>'.encode(), "echo", 422),
        (f'<nothing xmlns="{ECHO}"/>'.encode(), "echo", 422),
    ]
    titles = set()
    for payload, to, status in cases:
        response = await api.post("/v1/messages", params={"to": to}, content=payload)
        assert response.status_code == status, response.text
        body = problem(response)
        assert body["title"] == await socket_refusal(server, payload, to)
        titles.add(body["title"])
    assert titles == {HuhReason.INVALID_PAYLOAD.value}
    # a handler's failure: the canned text, never its exception
    crash = f'<crash xmlns="{E2E}"><text>x</text></crash>'.encode()
    response = await api.post("/v1/messages", params={"to": "crash"}, content=crash)
    assert response.status_code == 502
    assert problem(response)["title"] == HuhReason.HANDLER_FAILED.value
    assert "secret" not in response.text
    # not XML at all
    response = await api.post("/v1/messages", params={"to": "echo"}, content=b"<unclosed")
    assert response.status_code == 400
    assert problem(response)["title"] == HuhReason.MALFORMED.value
    # a thread that is not a uuid4
    response = await api.post("/v1/messages", params={"to": "echo", "thread": "x"}, content=PING)
    assert response.status_code == 400 and problem(response)["type"].endswith("/bad-thread")
    # unknown route and wrong method are problems too
    assert problem(await api.get("/nope"))["status"] == 404
    assert problem(await api.get("/v1/messages"))["status"] == 405


async def test_a_body_over_max_message_bytes_is_refused_like_an_oversize_frame(server, api):
    limit = MiB  # e2e-boot.xml keeps the default max-message-bytes
    big = f'<ping xmlns="{ECHO}"><text>{"x" * limit}</text></ping>'.encode()
    assert len(big) > limit
    response = await api.post("/v1/messages", params={"to": "echo"}, content=big)
    assert response.status_code == 413
    assert problem(response)["title"] == HuhReason.TOO_LARGE.value

    # without a Content-Length (chunked), the body is cut off at the same limit
    async def chunks():
        for start in range(0, len(big), 64 * 1024):
            yield big[start : start + 64 * 1024]

    response = await api.post("/v1/messages", params={"to": "echo"}, content=chunks())
    assert response.status_code == 413
    assert problem(response)["title"] == HuhReason.TOO_LARGE.value
    # the socket refuses the same payload with the same text (from its length prefix: the
    # body is not read, so only its start is sent)
    conn = await RawConnection.open(server)
    try:
        frame = encode_frame(envelope_bytes(etree.fromstring(big), to="echo"))
        await conn.send_bytes(frame[:4096])
        with trio.fail_after(5):
            _, reply = parse_reply(await conn.receive_frame())
        assert huh_text(reply) == HuhReason.TOO_LARGE.value
    finally:
        await conn.aclose()
    # a payload just under the limit still goes through
    fits = f'<ping xmlns="{ECHO}"><text>{"x" * (limit - 4096)}</text></ping>'.encode()
    response = await api.post("/v1/messages", params={"to": "echo"}, content=fits)
    assert response.status_code == 200


async def test_listeners_list_names_root_tags_and_xsds(api):
    response = await api.get("/v1/listeners")
    assert response.status_code == 200
    listeners = {entry["name"]: entry for entry in response.json()["listeners"]}
    assert "boot" not in listeners  # takes only the core boot primitive
    echo = listeners["echo"]
    assert [p["root"] for p in echo["payloads"]] == [f"{{{ECHO}}}ping"]
    xsd = etree.fromstring(echo["payloads"][0]["xsd"].encode())
    assert xsd.get("targetNamespace") == ECHO
    assert {"calculator", "slow", "silent", "crash"} <= set(listeners)


async def test_agents_without_agents_is_an_empty_list_and_tasks_404(api):
    assert (await api.get("/v1/agents")).json() == {"agents": []}
    response = await api.get(f"/v1/agents/echo/tasks/{new_thread_id()}")
    assert response.status_code == 404 and problem(response)


async def test_metrics_are_prometheus_text_and_move_with_messages(api):
    def received(text: str) -> float:
        for family in text_string_to_metric_families(text):
            if family.name == "agentserver_http_messages":
                for sample in family.samples:
                    if sample.labels == {"outcome": "received"}:
                        return sample.value
        raise AssertionError(text)

    before = await api.get("/metrics")
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain")
    for _ in range(3):
        await api.post("/v1/messages", params={"to": "echo"}, content=PING)
    after = await api.get("/metrics")
    assert received(after.text) == received(before.text) + 3


async def test_events_stream_opens_without_agents_and_ends_with_its_client(api):
    async with api.stream("GET", "/v1/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        # Held (not a broken-off loop): a dropped line iterator is closed whenever it is
        # collected, which would end the stream early.
        lines = response.aiter_lines()
        assert (await lines.__anext__()).startswith(":")  # the opening comment
        assert (await api.get("/v1/status")).json()["connections"]["sse_streams"] == 1
    # the client went away: its stream (and subscription) ends
    for _ in range(100):
        if (await api.get("/v1/status")).json()["connections"]["sse_streams"] == 0:
            break
        await trio.sleep(0.05)
    else:
        raise AssertionError("the event stream outlived its client")


async def test_status_document_and_cli(server, api):
    doc = (await api.get("/v1/status")).json()
    assert doc["organism"] == "e2e" and doc["ready"]["ready"] is True
    assert {entry["name"] for entry in doc["listeners"]} >= {"echo", "slow"}
    assert doc["pump"]["state"] == "running"
    assert "socket" in doc["connections"]
    url = http_url(server)
    result = await trio.to_thread.run_sync(lambda: cli("status", "--url", url, "--json"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["organism"] == "e2e"
    result = await trio.to_thread.run_sync(lambda: cli("status", "--url", url))
    assert result.returncode == 0, result.stderr
    text = result.stdout.decode()
    assert "organism 'e2e'" in text and "listeners:" in text and "echo" in text


def test_status_without_the_http_api_says_so_and_exits_4():
    # a port nothing listens on (the socket's default port is not HTTP either way)
    result = cli("status", "--url", "http://127.0.0.1:9", "--timeout", "2")
    assert result.returncode == 4
    assert b"HTTP API" in result.stderr


def test_version():
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.decode().startswith("agentserver ")


def test_run_http_port_option_and_boot_element(tmp_path):
    boot = tmp_path / "boot.xml"
    boot.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="h">'
        '<http host="127.0.0.1" port="0" max-pending="8"/>'
        '<listeners><listener name="echo" handler="echo"/></listeners></organism>'
    )
    proc = ServerProcess.start(boot, env=subprocess_env())
    try:
        url = http_url(proc)
        response = httpx.post(f"{url}/v1/messages", params={"to": "echo"}, content=PING)
        assert response.status_code == 200
    finally:
        assert proc.stop() == 0, proc.stderr


async def test_shutdown_ends_open_event_streams_instead_of_waiting_for_them(tmp_path):
    # A drain timeout far longer than the stop below waits: an event stream left open
    # would hold the server for all of it.
    boot = tmp_path / "boot.xml"
    boot.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="h">'
        '<limits drain-timeout="120"/><http port="0"/>'
        '<listeners><listener name="echo" handler="echo"/></listeners></organism>'
    )
    proc = await trio.to_thread.run_sync(lambda: ServerProcess.start(boot))
    try:
        async with httpx.AsyncClient(base_url=http_url(proc), timeout=30) as client:
            async with client.stream("GET", "/v1/events") as response:
                lines = response.aiter_lines()
                assert (await lines.__anext__()).startswith(":")
                code = await trio.to_thread.run_sync(lambda: proc.stop(timeout=60))
                rest = [line async for line in lines]  # the server ended the stream
        assert code == 0, proc.stderr
        assert all(not line or line.startswith(":") for line in rest)
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
