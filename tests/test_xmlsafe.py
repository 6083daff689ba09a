"""The hardened parser refuses every entity and DTD trick, and never crashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.errors import HuhReason, InputRefused
from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES, SafeParser, canonicalize

BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<lolz>&lol3;</lolz>"""

EXTERNAL_ENTITY = b"""<?xml version="1.0"?>
<!DOCTYPE foo [<!ENTITY xxe SYSTEM "file:///etc/passwd">]><foo>&xxe;</foo>"""

EXTERNAL_DTD = b"""<?xml version="1.0"?>
<!DOCTYPE foo SYSTEM "http://example.invalid/evil.dtd"><foo/>"""

QUADRATIC = b'<!DOCTYPE q [<!ENTITY a "' + b"x" * 10000 + b'">]><q>' + b"&a;" * 1000 + b"</q>"


@pytest.mark.parametrize(
    "data",
    [BILLION_LAUGHS, EXTERNAL_ENTITY, EXTERNAL_DTD, QUADRATIC],
    ids=["billion-laughs", "external-entity", "external-dtd", "quadratic-blowup"],
)
def test_any_dtd_is_refused(data):
    with pytest.raises(InputRefused) as info:
        SafeParser().parse(data)
    assert info.value.reason is HuhReason.MALFORMED


def test_dtd_in_utf16_is_refused_after_parse():
    data = '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE a [<!ENTITY x "y">]><a>&x;</a>'
    with pytest.raises(InputRefused):
        SafeParser().parse(data.encode("utf-16"))


def test_deep_nesting_is_refused_not_recursed():
    data = b"<a>" * 100_000 + b"</a>" * 100_000
    with pytest.raises(InputRefused) as info:
        SafeParser(max_bytes=10_000_000).parse(data)
    assert info.value.reason is HuhReason.MALFORMED


def test_oversize_is_refused_before_parsing():
    with pytest.raises(InputRefused) as info:
        SafeParser(max_bytes=100).parse(b"<a>" + b"x" * 200 + b"</a>")
    assert info.value.reason is HuhReason.TOO_LARGE


def _many_attributes(n: int) -> bytes:
    return b"<a " + b" ".join(b'a%d="1"' % i for i in range(n)) + b"/>"


def test_many_attributes_within_size_limit_are_parsed():
    data = _many_attributes(90_000)
    assert len(data) <= DEFAULT_MAX_MESSAGE_BYTES  # just under 1 MiB
    root = SafeParser().parse(data)
    assert len(root.attrib) == 90_000 and root.get("a89999") == "1"


def test_many_attributes_over_size_limit_are_refused_by_size():
    data = _many_attributes(100_000)
    assert len(data) > DEFAULT_MAX_MESSAGE_BYTES
    with pytest.raises(InputRefused) as info:
        SafeParser().parse(data)
    assert info.value.reason is HuhReason.TOO_LARGE


def test_comments_and_processing_instructions_are_dropped():
    root = SafeParser().parse(b"<a><!-- hi --><?pi x?><b/></a>")
    assert canonicalize(root) == b"<a><b></b></a>"


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xfe\xfd", b"<a>\xff</a>", b"<a></b>", b"<a>", b"text"]
)
def test_malformed_is_refused(data):
    with pytest.raises(InputRefused) as info:
        SafeParser().parse(data)
    assert info.value.reason is HuhReason.MALFORMED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_parse_or_refuse(data):
    try:
        root = SafeParser().parse(data)
    except InputRefused:
        return
    assert isinstance(root, etree._Element)


def test_exclusive_c14n_drops_unused_namespaces():
    root = SafeParser().parse(b'<a xmlns:u="urn:unused"><b xmlns="urn:x">t</b></a>')
    assert canonicalize(root[0]) == b'<b xmlns="urn:x">t</b>'
