"""Docs that run (issue 45): every boot.xml snippet in docs/*.md and README.md goes through
``agentserver check``. A whole ``<organism>`` is checked as written; a fragment (a few
sections, a ``<listener>``, a ``<store>`` ...) is completed to a minimal topology first
(:func:`complete`). A snippet that is wrong on purpose is marked by the comment
``<!-- check: invalid -->`` on the line before its fence and must then FAIL the check; one
that cannot be checked here (it reaches the network, or needs files only the reader has)
is marked ``<!-- check: skip: REASON -->``. The guide's files (``<!-- guide: file NAME -->``)
are checked beside the modules the guide writes with them.

The check is :func:`agentserver.config.loader.load`, the very function ``agentserver
check`` runs (one subprocess smoke below proves it on the command).
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from lxml import etree
from serverproc import REPO, scratch_dir, subprocess_env
from tlsutil import make_pki

from agentserver.config import loader as boot
from agentserver.core.namespaces import BOOT_NS
from agentserver.core.schemas_export import schema_path

DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)
MARK = re.compile(r"<!-- check: (?P<what>invalid|skip: .+?) -->")
GUIDE_FILE = re.compile(r"<!-- guide: file (?P<name>\S+) -->")
XS = "{http://www.w3.org/2001/XMLSchema}"

#: Sections of ``<organism>`` (a fragment's element of these names goes in as it is).
SECTIONS = {
    "description",
    "listen",
    "limits",
    "tls",
    "http",
    "clients",
    "listeners",
    "llm",
    "store",
    "expose-mcp",
    "webhooks",
    "expose-a2a",
    "schedules",
    "budget",
}
#: A fragment's element that lives inside a section: the section it goes in.
INSIDE = {
    "agent": "listeners",  # an agent's settings: inside an agent listener of its own
    "listener": "listeners",
    "mcp": "listeners",
    "a2a": "listeners",
    "client": "clients",
    "webhook": "webhooks",
    "schedule": "schedules",
}
#: What a fragment that declares no such listener gets, so that what it names exists.
DEFAULT_LISTENERS = (
    '<listener name="echo" handler="echo"/>',
    '<listener name="calculator" handler="calculator"/>',
    '<listener name="assistant" handler="assistant" agent="true" peers="calculator">'
    '<agent model="m"/></listener>',
)


def boot_element_names() -> set[str]:
    names = set()
    for name in ("boot.xsd", "boot-llm.xsd", "boot-agents.xsd"):
        doc = etree.parse(str(schema_path(name)))
        names |= {e.get("name") for e in doc.getroot().iter(XS + "element") if e.get("name")}
    return names


@dataclass(frozen=True)
class Snippet:
    doc: Path
    line: int
    body: str
    mark: str | None  # "invalid", "skip: ...", or None
    guide_file: str | None

    @property
    def id(self) -> str:
        return f"{self.doc.name}:{self.line}"


def snippets() -> list[Snippet]:
    names = boot_element_names()
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            first = re.search(r"<([A-Za-z][\w.-]*)([^>]*)>", m["body"])
            if m["lang"] not in ("xml", "") or first is None or first[1] not in names:
                continue
            xmlns = re.search(r'\bxmlns="([^"]*)"', first[2])
            if xmlns is not None and xmlns[1] != BOOT_NS:
                continue  # a wire payload that shares a name with a section
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.fullmatch(before.strip())
            guide = GUIDE_FILE.fullmatch(before.strip())
            found.append(
                Snippet(
                    doc,
                    text[: m.start()].count("\n") + 1,
                    m["body"],
                    mark["what"] if mark else None,
                    guide["name"] if guide else None,
                )
            )
    return found


def complete(body: str) -> list[bytes]:
    """The documents to check for one snippet: a whole ``<organism>`` as written; a
    fragment inside ``<organism xmlns=BOOT>``, each element in its section, with the
    default listeners it does not declare (an agent's handler once). A line holding only
    ``...`` stands for what the docs leave out and is dropped. A fragment giving one
    section several times (alternatives: a SQLite ``<store>``, or a PostgreSQL one) makes
    one document per alternative."""
    body = "\n".join(line for line in body.splitlines() if line.strip() != "...")
    if re.match(r"\s*(<!--.*?-->\s*)*<organism[\s>]", body, re.S):
        return [body.encode()]
    fragment = etree.fromstring(f'<organism xmlns="{BOOT_NS}" name="docs">{body}</organism>')
    groups: dict[str, list[etree._Element]] = {}
    order: list[str] = []
    for el in fragment:
        if not isinstance(el.tag, str):
            continue
        local = etree.QName(el).localname
        section = local if local in SECTIONS else INSIDE.get(local)
        if section is None:
            raise AssertionError(f"<{local}>: no rule completes this fragment")
        if section not in groups:
            order.append(section)
        groups.setdefault(section, []).append(el)
    variants: list[dict[str, list[etree._Element]]] = [{}]
    for section in order:
        els = groups[section]
        if section in SECTIONS and len(els) > 1 and section != "budget":
            variants = [{**v, section: [el]} for v in variants for el in els]
        else:
            variants = [{**v, section: els} for v in variants]
    return [_document(v) for v in variants]


def _document(parts: dict[str, list[etree._Element]]) -> bytes:
    root = etree.Element(f"{{{BOOT_NS}}}organism", nsmap={None: BOOT_NS}, name="docs")
    listeners = None
    for section, els in parts.items():
        holder = None
        for el in els:
            copy = etree.fromstring(etree.tostring(el))
            if etree.QName(el).localname == section:  # the section itself
                root.append(copy)
                if section == "listeners":
                    listeners = copy
                continue
            if holder is None:
                holder = etree.SubElement(root, f"{{{BOOT_NS}}}{section}")
                if section == "listeners":
                    listeners = holder
            if etree.QName(el).localname == "agent":
                agent = etree.SubElement(
                    holder, f"{{{BOOT_NS}}}listener", name="docs-agent", handler="assistant"
                )
                agent.set("agent", "true")
                agent.append(copy)
            else:
                holder.append(copy)
    if listeners is None:
        listeners = etree.SubElement(root, f"{{{BOOT_NS}}}listeners")
    declared = {el.get("name") for el in listeners}
    handlers = {el.get("handler") for el in listeners}
    for text in DEFAULT_LISTENERS:
        default = etree.fromstring(f'<x xmlns="{BOOT_NS}">{text}</x>')[0]
        if default.get("name") not in declared and default.get("handler") not in handlers:
            listeners.append(default)
    # Sections in the schema's order: the document's own order is the docs' choice.
    rank = {n: i for i, n in enumerate(_SECTION_ORDER)}
    root[:] = sorted(root, key=lambda el: rank.get(etree.QName(el).localname, len(rank)))
    return etree.tostring(root)


_SECTION_ORDER = (
    "description",
    "listen",
    "limits",
    "tls",
    "http",
    "clients",
    "listeners",
    "llm",
    "store",
    "expose-mcp",
    "webhooks",
    "expose-a2a",
    "schedules",
    "budget",
)

SNIPPETS = snippets()


def test_the_docs_have_boot_snippets_and_few_are_skipped():
    assert len(SNIPPETS) >= 20
    skipped = [s for s in SNIPPETS if s.mark and s.mark.startswith("skip")]
    assert len(skipped) <= 5, [s.id for s in skipped]
    assert any(s.doc.name == "budgets.md" for s in SNIPPETS)


def _guide_folder(snippet: Snippet, folder: Path) -> Path:
    """The guide's files of the snippet's doc written into ``folder`` (its modules)."""
    text = snippet.doc.read_text()
    for m in re.finditer(
        r"^<!-- guide: (?P<how>file|append) (?P<name>\S+) -->\n```[a-z]*\n(?P<body>.*?)^```$",
        text,
        re.M | re.S,
    ):
        path = folder / m["name"]
        if m["how"] == "file":
            path.write_text(m["body"])
        else:  # as the guide's runner appends: after two blank lines
            path.write_text(path.read_text() + "\n\n" + m["body"])
        if path.name == snippet.guide_file:
            break  # the guide's files as they are when it uses this one
    return folder / snippet.guide_file


def environment(text: str) -> dict[str, str]:
    """The variables the snippet names, set as its reader would: each ``secret-env`` a
    webhook secret, each token, API key and header value ``-env`` a token (the overrides,
    ``url-env``, ``model-env`` ..., stay unset: the file's values stand)."""
    names = r'(?:token|api-key|value)-env="([A-Z_][A-Z0-9_]*)"'
    env = {var: "t" for var in re.findall(names, text)}
    for var in re.findall(r'secret-env="([A-Z_][A-Z0-9_]*)"', text):
        env[var] = "whsec_" + base64.b64encode(b"k" * 32).decode()
    return env


def reader_files(path: Path) -> None:
    """The files a completed document names that its reader would have: ``<tls>``'s
    certificate, key and client CA (made by trustme, written where it says)."""
    root = etree.parse(str(path)).getroot()
    tls = root.find(f"{{{BOOT_NS}}}tls")
    if tls is None:
        return
    pki = make_pki(path.parent / "pki")
    for attr, source in (
        ("cert", pki.cert_file),
        ("key", pki.key_file),
        ("client-ca", pki.ca_file),
    ):
        if (name := tls.get(attr)) is not None:
            target = path.parent / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@pytest.mark.parametrize(
    "snippet", [s for s in SNIPPETS if not (s.mark or "").startswith("skip")], ids=lambda s: s.id
)
def test_every_boot_snippet_passes_check(snippet, tmp_path):
    if snippet.guide_file is not None:
        documents = [_guide_folder(snippet, tmp_path).read_bytes()]
        paths = [tmp_path / snippet.guide_file]
    else:
        documents = complete(snippet.body)
        paths = []
        for i, data in enumerate(documents):
            path = tmp_path / f"boot-{i}.xml"
            path.write_bytes(data)
            paths.append(path)
    for path in paths:
        reader_files(path)
        result = boot.load(path, environ=environment(snippet.body))
        errors = [str(p) for p in result.errors]
        if snippet.mark == "invalid":
            assert errors, f"{snippet.id} is marked invalid but passes check"
        else:
            assert errors == [], f"{snippet.id}:\n{path.read_text()}\n" + "\n".join(errors)


def test_the_completion_is_what_check_passes_on_the_command(tmp_path):
    """One snippet through the real ``agentserver check`` process: the test's in-process
    load is the command's code path."""
    snippet = next(s for s in SNIPPETS if s.doc.name == "budgets.md")
    (data,) = complete(snippet.body)
    path = tmp_path / "boot.xml"
    path.write_bytes(data)
    done = subprocess.run(
        [sys.executable, "-m", "agentserver", "check", str(path)],
        capture_output=True,
        env=subprocess_env(ALICE_TOKEN="t"),
        cwd=scratch_dir(),
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.decode().splitlines()[-1].startswith(f"{path}: OK: organism 'shop'")


def test_a_snippet_marked_invalid_must_fail(tmp_path):
    # The rule's own check: a fragment with no namespace on <organism> fails.
    (data,) = complete('<organism name="x"><listeners/></organism>')
    path = tmp_path / "bad.xml"
    path.write_bytes(data)
    assert boot.load(path, environ={}).errors
