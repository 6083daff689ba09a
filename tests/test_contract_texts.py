"""The canned refusal texts and codes are a public contract: clients match on them.

:mod:`agentserver.core.errors` is their one source and ``schemas/core.xsd`` is generated from
it; these tests read the checked-in XSD and the documentation as a client would, so a text
changed in one place only fails here (comparing the product with its own enum would not).
"""

from __future__ import annotations

import re

from lxml import etree

from agentserver.core.envelope import MULTITASK_MODES
from agentserver.core.errors import HuhReason, SystemErrorCode
from agentserver.core.schemas_export import schema_path

DOCS = schema_path("core.xsd").parents[1] / "docs"
XS = "{http://www.w3.org/2001/XMLSchema}"

HUH_TEXTS = [r.value for r in HuhReason]
SYSTEM_ERRORS = [(c.value, c.message) for c in SystemErrorCode]


def _between(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    return text[text.index(begin) + len(begin) : text.index(end)]


def _table_rows(block: str) -> list[list[str]]:
    """The cells of a markdown table, header and separator dropped, backticks stripped."""
    rows = [line for line in block.splitlines() if line.startswith("|")][2:]
    return [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]


def _xsd_enumeration(element: str, child: str) -> list[str]:
    doc = etree.parse(str(schema_path("core.xsd")))
    [restriction] = doc.xpath(
        "/xs:schema/xs:element[@name=$e]//xs:element[@name=$c]//xs:restriction",
        namespaces={"xs": XS[1:-1]},
        e=element,
        c=child,
    )
    return [e.get("value") for e in restriction.iter(f"{XS}enumeration")]


def test_core_xsd_enumerates_exactly_the_huh_texts_and_error_codes():
    assert _xsd_enumeration("huh", "error") == HUH_TEXTS
    assert _xsd_enumeration("SystemError", "code") == [code for code, _ in SYSTEM_ERRORS]


def test_protocol_doc_lists_every_huh_text_and_no_other():
    rows = _table_rows(_between((DOCS / "protocol.md").read_text(), "huh-texts"))
    assert [row[0] for row in rows] == HUH_TEXTS


def test_protocol_doc_lists_every_system_error_code_with_its_message():
    text = (DOCS / "protocol.md").read_text()
    rows = _table_rows(_between(text, "system-error-codes"))
    assert [(row[0], row[1]) for row in rows] == SYSTEM_ERRORS
    # The example shows a real code with its real message.
    example = re.search(r"<code>(\w+)</code>\s*<message>([^<]*)</message>", text)
    assert example is not None and example.groups() in SYSTEM_ERRORS


def test_protocol_doc_example_huh_uses_a_real_text():
    text = (DOCS / "protocol.md").read_text()
    assert set(re.findall(r"<error>([^<]*)</error>", text)) <= set(HUH_TEXTS)


def test_wire_doc_quotes_only_real_huh_texts_and_codes():
    text = (DOCS / "wire.md").read_text()
    # The refusals table: its last column is the <huh> text.
    start = text.index("| Input | `<huh>` error |")
    table = text[start : text.index("\n\n", start)]
    quoted = [row[-1] for row in _table_rows(table)]
    # Elsewhere: `<huh>` "Text." in prose and in the limits table.
    quoted += re.findall(r'`<huh>` "([^"]+)"', text)
    assert len(quoted) >= 7, quoted  # the tables are still there and still parsed
    assert [q for q in quoted if q not in HUH_TEXTS] == []
    codes = re.findall(r"`<SystemError>` \(`(\w+)`", text)
    assert codes and set(codes) <= {code for code, _ in SYSTEM_ERRORS}


def test_readme_quotes_only_real_huh_texts():
    readme = (DOCS.parent / "README.md").read_text()
    quoted = re.findall(r'`<huh>` \("([^"]+)"', readme.replace("\n", " "))
    assert quoted and [q for q in quoted if q not in HUH_TEXTS] == []


def test_envelope_xsd_enumerates_exactly_the_multitask_modes():
    """The envelope's ``multitask`` (docs/runs.md): the XSD a client validates against, the
    code's one list and the ``<huh>`` naming them agree."""
    doc = etree.parse(str(schema_path("envelope.xsd")))
    modes = doc.xpath(
        "//xs:attribute[@name='multitask']//xs:enumeration/@value", namespaces={"xs": XS[1:-1]}
    )
    assert tuple(modes) == MULTITASK_MODES
    huh = HuhReason.INVALID_MULTITASK.value
    assert re.findall(r"\w+", huh.split("be ", 1)[1]) == [*MULTITASK_MODES[:3], "or", "rollback"]
