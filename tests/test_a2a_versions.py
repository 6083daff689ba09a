"""Which A2A version a request and a card speak (issue 47, docs/a2a.md "Versions"):
the refusal of a method whose ``A2A-Version`` does not fit it, and the remote cards our
client calls at 0.3. Sans I/O; the end-to-end proofs are tests/test_a2a_v03.py and
tests/test_a2a_remote.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserver.http.a2a.versions import V03_METHODS, protocol_of, refusal
from agentserver.remote.a2a_client import _parse_card, speaks_v03

V10_METHODS = [*V03_METHODS.values(), "ListTasks"]


@pytest.mark.parametrize(
    ("method", "header", "refused"),
    [
        ("message/send", None, None),
        ("message/send", "0.3", None),
        ("message/send", "0.3.26", None),
        ("message/send", "1.0", "call SendMessage"),
        ("tasks/resubscribe", "1.2", "call SubscribeToTask"),
        ("tasks/get", "2.0", "call GetTask"),
        ("tasks/get", "banana", "call GetTask"),
        ("SendMessage", None, "A2A-Version: 1.0"),
        ("SendMessage", "0.3", "0.3 calls it message/send"),
        ("ListTasks", None, "0.3 has no such method"),
        ("SendMessage", "1.0", None),
        ("SendMessage", "2.0", None),  # the SDK's own VersionNotSupported
        ("tasks/list", None, None),  # the SDK's Method not found
        (None, None, None),
        (7, "1.0", None),
    ],
)
def test_refusal(method, header, refused) -> None:
    why = refusal(method, header)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


@given(st.sampled_from([*V03_METHODS, *V10_METHODS]), st.none() | st.text(max_size=8))
def test_a_method_is_served_under_its_own_version_only(method: str, header: str | None) -> None:
    given_ = (header or "").strip()
    head = given_.split(".", 1)[0]
    major = int(head) if head.isdigit() else None
    served_as_03 = not given_ or major == 0
    if protocol_of(method) == "0.3":
        assert (refusal(method, header) is None) == served_as_03
    elif served_as_03:
        assert refusal(method, header) is not None
    else:
        assert refusal(method, header) is None  # 1.x served, others the SDK's refusal


def card(**fields) -> dict:
    return {
        "name": "r",
        "description": "d",
        "version": "1",
        "capabilities": {},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{"id": "s", "name": "s", "description": "d", "tags": ["s"]}],
        **fields,
    }


def interfaces(*versions: str) -> list[dict]:
    return [
        {"url": "http://r/", "protocolBinding": "JSONRPC", "protocolVersion": v} for v in versions
    ]


@pytest.mark.parametrize(
    ("data", "v03"),
    [
        # A 0.3 card as a 0.3 server serves it.
        (card(url="http://r/", preferredTransport="JSONRPC", protocolVersion="0.3.0"), True),
        (card(supportedInterfaces=interfaces("0.3")), True),
        (card(supportedInterfaces=interfaces("1.0")), False),
        (card(supportedInterfaces=interfaces("1.0", "0.3")), False),  # ours
        (card(supportedInterfaces=interfaces("0.3", "1.1")), False),
        (card(supportedInterfaces=interfaces("")), False),  # the SDK's default: 1.0
    ],
)
def test_a_remote_card_called_at_0_3(data: dict, v03: bool) -> None:
    kept = dict(data)
    assert speaks_v03(_parse_card(data)) is v03
    assert data == kept  # the parse leaves the card as fetched (it is kept, parsed again)
